"""The kernel benches (kernels/bench/) call the kernels and references as they are: every LoRA case the bench, the sweeps
and the probes time is built and run once at a tiny model, on the CPU in Triton's interpreter (CUDA where there is one).

The benches time on CUDA only; here the timers, the device's ceilings and the config picker are replaced by one plain
call of what they would time, so a kernel's signature change breaks this test rather than the next GPU session. What is
checked is that every call runs (and the bench's rows come out), not the figures.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("the kernel benches need triton (a dev extra)", allow_module_level=True)

from tests.triton_interp import DEVICE, import_kernels, interpreter_env  # noqa: E402, F401  (autouse fixture)

cases, roofline, probes = import_kernels("kernels.bench.cases", "kernels.bench.roofline", "kernels.bench.probes")

# q 32, k and v 16 wide (2 heads over 1 KV head of 16), MLP 48: every slice a multiple of decode_linear's 16-column panels
TINY = {"tiny": cases.Model(hidden=32, heads=2, kv_heads=1, head_dim=16, intermediate=48)}
TOKENS = 2  # prefill tokens per sequence
SEQUENCES = 4  # the batch (decode rows, prefill sequences) and its distinct adapters: 4, each of the mixed ranks once


def _once(fn, rep: int = 0) -> float:
    fn()
    return 1.0


@pytest.fixture(autouse=True)
def tiny_bench(monkeypatch):
    """The benches' modules at the tiny model and batch on DEVICE, each timer one call."""
    for module in (cases, roofline, probes):
        for name, value in (("DEVICE", str(DEVICE)), ("MODELS", TINY), ("graph_us", _once), ("plain_us", _once),
                            ("measure_ceilings", lambda: (1e12, 1e15, 1.0)), ("PREFILL_TOKENS", TOKENS),
                            ("BATCH", SEQUENCES), ("ADAPTERS", SEQUENCES),
                            ("best", lambda label, module, candidates, run, floor_us=None: run())):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, value)
    # _sweep's attention part: paged attention is not what these cases test (tests/test_kernel_attention.py is)
    monkeypatch.setattr(roofline, "attention_case", lambda model, phase: ({}, 0, 0.0))
    monkeypatch.setattr(roofline, "paged_attention", lambda **kwargs: None)


def _mixed() -> list[int]:
    return [cases.MIXED_RANKS[s % len(cases.MIXED_RANKS)] for s in range(cases.ADAPTERS)]


@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_lora_case_pages_hold_the_dense_stacks(phase):
    """A case's pages are its dense stacks (pack_pages): the shrink's t at build equals the reference's through them."""
    in_f, widths = TINY["tiny"].projections()["qkv"]
    case = cases.lora_case(in_f, widths, phase, _mixed(), prefill_tokens=TOKENS)
    lora_segments = import_kernels("kernels.lora_segments")[0]
    a, b = lora_segments.unpack_stacks(case.w)
    torch.testing.assert_close(a, case.a.float())
    torch.testing.assert_close(b, case.b.float())
    rank = case.rank.cpu()[lora_segments.rows_of(case.segments).cpu()]  # [N]: every row has an adapter
    within = (torch.arange(cases.MAX_RANK)[None, :] < rank[:, None]).expand(len(widths), -1, -1)  # [S, N, R] what t holds
    want = lora_segments.lora_shrink_ref(case.x, case.w, case.segments)
    torch.testing.assert_close(case.t.cpu()[within], want.cpu()[within], rtol=1e-3, atol=1e-3)
    assert case.w.slices == widths and case.w.pool.device.type == DEVICE.type


@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_bench_projection_rows_for_every_projection(phase):
    """`lorabatch bench kernels`'s LoRA part: shrink, expand, their references, decode_linear with the delta, and the
    mixed and uniform rank sums, for every projection."""
    for proj, (in_f, widths) in TINY["tiny"].projections().items():
        rows, lora_us, base_us = roofline._bench_projection("tiny", phase, proj, in_f, widths, 1e12)
        assert [r["op"].split()[0] for r in rows] == ["shrink", "expand"] + (["linear+delta"] if phase == "decode" else [])
        assert lora_us == 2.0 and base_us == 1.0
        assert roofline._bench_ranks(in_f, widths, phase, _mixed()) == 2.0
        assert roofline._bench_ranks(in_f, widths, phase, [cases.MEAN_RANK] * cases.ADAPTERS) == 2.0


def test_sweeps_run_every_call():
    """The launchers' config sweeps, each timed call once at the launcher's own config."""
    roofline._sweep(rep=1)
    roofline._sweep_prefill(tokens=TOKENS, rep=1)
    roofline._sweep_prefill_delta(tokens=TOKENS, rep=1, models=("tiny",))
    roofline._sweep_decode_linear(rep=1, models=("tiny",))
    roofline._sweep_prefill_shrink(rep=1, models=(("tiny", TOKENS),), cands=[(2, 16, 16, 4, 3, False), (1, 16, 16, 4, 3, True)])
    roofline._sweep_prefill_fused_delta(rep=1, models=(("tiny", TOKENS),), cands=[(16, 16, 16, 16, 4, False), (32, 32, 32, 4096, 4, True)])


def test_probes_run_every_call():
    """The probes that time the LoRA kernels: the prefill delta (with every rank 0 too) and the consumer op."""
    probes.probe_delta(tokens=TOKENS, rep=1, models=("tiny",))
    probes.probe_consumers(tokens=TOKENS, rep=1, models=("tiny",), sweep=True)
