"""The host time of the LoRA launchers' own Python, the kernel launches themselves stubbed out: `python -m
kernels.bench.launch_overhead [--reps 2000]`, on the CPU, no GPU needed.

A prefill with adapters is eager: each projection's shrink and delta are launched from Python, 112 launches at llama-1b,
and a step whose kernels are short waits for that host work (engine/PERF.md, session 19: a 1b prefill's kernels sum to
18.0 ms of a 24.5 ms step). This times what each launcher does before Triton's own launch path (asserts, the config,
grid and stride arithmetic) at issue 4's 1b prefill (32 sequences of 128 tokens, 32 adapters, max rank 64), on "meta"
tensors (shapes, no storage: the fused SiLU's output costs no allocation, as a cached CUDA block costs next to none),
µs a call (median of 5 runs of `--reps` calls); Triton's launch path is not in it. Beside the shrink and the delta, the
one-launch delta (kernels/lora_delta.py) with the engine's `fits` check before it, for the projections that take it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

import kernels.lora_delta as delta_module
import kernels.lora_expand as expand_module
import kernels.lora_shrink as shrink_module
import kernels.silu_mul as silu_module
from kernels.lora_segments import LoraDelta, LoraPages, segments_from_indices


class _NoLaunch:
    """Stands for a JIT kernel: `kernel[grid](...)` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _per_call_us(fn: Callable[[], object], reps: int) -> float:
    for _ in range(min(reps, 100)):
        fn()
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        runs.append((time.perf_counter() - t0) / reps * 1e6)
    return round(statistics.median(runs), 2)


def run(reps: int = 2000) -> dict:
    hidden, inter, max_rank, adapters, seqs, tokens = 2048, 8192, 64, 32, 32, 128
    widths = {"qkv": (2048, 512, 512), "gate_up": (inter, inter), "down": (hidden,)}
    ins = {"qkv": hidden, "gate_up": hidden, "down": inter}
    n = seqs * tokens
    seg = segments_from_indices([s for s in range(seqs) for _ in range(tokens)], device="meta")
    saved = shrink_module._shrink_kernel, expand_module._expand_kernel, silu_module._silu_mul_lora_kernel, delta_module._delta_kernel
    shrink_module._shrink_kernel = expand_module._expand_kernel = silu_module._silu_mul_lora_kernel = _NoLaunch()
    delta_module._delta_kernel = _NoLaunch()
    out = {}

    def meta(*shape, dtype=torch.bfloat16):
        return torch.empty(*shape, dtype=dtype, device="meta")

    try:
        for proj, w_s in widths.items():
            s, in_f = len(w_s), ins[proj]
            w = LoraPages(pool=meta(1 << 24), pages=meta(adapters, 7, max_rank, dtype=torch.int64)[:, :s],
                          rank=meta(adapters, 7, dtype=torch.int32)[:, :s], scale=meta(adapters, dtype=torch.float32),
                          num_layers=16, layer=3, in_features=in_f, slices=w_s)  # fmt: skip
            x, t, y = meta(n, in_f), meta(s, n, max_rank, dtype=torch.float32), meta(n, sum(w_s))
            out[f"{proj}_shrink_us"] = _per_call_us(lambda: shrink_module.lora_shrink(x, w, seg, out=t, out_zeroed=True), reps)
            if proj == "gate_up":
                lora = LoraDelta(t=t, weights=w, segments=seg)
                out["gate_up_silu_delta_us"] = _per_call_us(lambda: silu_module.silu_mul(y, lora), reps)
            else:
                out[f"{proj}_delta_us"] = _per_call_us(lambda: expand_module.lora_expand(y, t, w, seg, accumulate=False), reps)
                # the engine's path at this batch: the fits check, then the one launch (kernels/lora_delta.py)
                out[f"{proj}_one_launch_delta_us"] = _per_call_us(
                    lambda: delta_module.fits(w, seg) and delta_module.lora_delta(x, w, seg, sum(w_s)), reps)
    finally:
        (shrink_module._shrink_kernel, expand_module._expand_kernel, silu_module._silu_mul_lora_kernel,
         delta_module._delta_kernel) = saved
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m kernels.bench.launch_overhead", description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=2000)
    a = p.parse_args(argv)
    if a.reps < 1:
        p.error("--reps must be at least 1")
    out = run(a.reps)
    print("launcher | host µs a call (launch stubbed)")
    for k, v in out.items():
        print(f"{k.removesuffix('_us')} | {v}")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
