"""Every Triton kernel, at the variants its launcher picks on CUDA, compiles for the H200 (sm_90) on this machine.

The other kernel tests run in Triton's interpreter here, which never runs the compiler; kernels.compile_check
does, in a process of its own without TRITON_INTERPRET (the interpreter replaces functions the compiler needs).
It caught, for one, a loop-carried tile that changed dtype between iterations, which the interpreter runs
without complaint.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _has_ptxas() -> bool:
    """Whether this triton carries the NVIDIA backend's ptxas (its wheels do) or is pointed at one."""
    import importlib.util

    spec = importlib.util.find_spec("triton")
    shipped = spec is not None and spec.origin is not None and (Path(spec.origin).parent / "backends/nvidia/bin/ptxas").exists()
    return shipped or bool(os.environ.get("TRITON_PTXAS_PATH"))


@pytest.mark.skipif(not _has_ptxas(), reason="this triton build has no NVIDIA backend with ptxas to compile for sm_90")
@pytest.mark.timeout(1200)  # as long as the compile check itself may run: ptxas over every variant, on two cores
def test_every_kernel_variant_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # One compiling process: the suite's other worker holds the second core (two here made three busy processes on two
    # cores, and the interpreter tests beside them ran past their time limit). The dtype the engine runs on a GPU, bf16
    # (71 s here with a cold Triton cache). fp32 (the GPU tests' dtype) and fp16 (a config choice) double and triple
    # that and run the same launchers' code paths; `python -m kernels.compile_check` compiles every dtype.
    out = subprocess.run([sys.executable, "-m", "kernels.compile_check", "--jobs", "1", "--dtypes", "bf16"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=1200)  # fmt: skip
    failures = [line for line in out.stdout.splitlines() if "FAIL" in line or line.startswith("    ")]
    assert out.returncode == 0, "\n".join(failures) or out.stderr[-3000:]
    last = out.stdout.strip().splitlines()[-1]
    assert last.endswith(" 0 failed") and int(last.split()[0]) >= 40, last  # every launcher at issue 4's shapes


OVER_BUDGET = """
import torch
import kernels.decode_linear as dl
from kernels.compile_check import _meta, compile_variant, record_launches
dl._config = lambda m, n, k, elem=2: (32, 256, 4, 5)  # the config swept at 32 rows, as it was before the budget
x, w = _meta(64, 4096, dtype=torch.bfloat16), _meta(4096, 4096, dtype=torch.bfloat16)
(variant,) = record_launches(lambda: dl.decode_linear(x, w))
print(compile_variant(variant)[1])
"""


@pytest.mark.skipif(not _has_ptxas(), reason="this triton build has no NVIDIA backend with ptxas to compile for sm_90")
def test_compile_check_refuses_a_variant_over_the_shared_memory_of_sm90():
    """decode_linear's 5 stages at 64 rows of llama-8b asked 245,760 bytes of shared memory on the H200 and its launch
    failed there, though it compiled: the check, specializing arguments as the JIT does, sees that figure and fails it."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", OVER_BUDGET], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "asks 245760 bytes of shared memory, over sm_90's 232448" in out.stdout, out.stdout


def test_compile_check_refuses_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-m", "kernels.compile_check"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "unset TRITON_INTERPRET" in out.stderr, (out.returncode, out.stderr)
