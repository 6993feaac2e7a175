"""A decode step's projections as weight streams on the GPU: `python -m kernels.bench.stream [rows]`, CUDA only.

Per projection of llama-8b and llama-1b (bf16 activations, `rows` of them, 32 by default): cuBLAS over the bf16 weight,
kernels/decode_linear.py where the engine takes it (its `_TUNED` shapes), kernels/stream_linear.py over a grid of configs
(its launcher's choice and the best three), then the same over the FP8 weight (engine.quant's per-row quantization) beside
kernels/fp8_linear.py; each against the byte floor of its weight at the measured copy bandwidth. The best configs' outputs
are checked against stream_linear_ref. Times are CUDA-graph replays (kernels.bench.cases.graph_us, L2 flushed before each);
the table comes last, then `_TUNED` as the sweep found it.
"""

from __future__ import annotations

import itertools
import sys

import torch

import kernels.stream_linear as stream_module
from engine.quant import quantize_fp8
from kernels.bench.cases import MODELS, graph_us, measure_ceilings
from kernels.decode_linear import _TUNED as DECODE_TUNED, decode_linear
from kernels.fp8_linear import fp8_linear
from kernels.stream_linear import stream_linear, stream_linear_ref
from kernels.utils import cdiv

TILES = ((64, 128, 4, 4), (64, 256, 4, 3), (128, 128, 4, 3), (128, 128, 8, 4), (64, 128, 4, 6), (128, 256, 8, 3))
SPLITS = (1, 2, 4, 8, 16)


def candidates(n: int, k: int) -> list[tuple[int, int, int, int, int]]:
    """(BN, BK, warps, stages, split K) of TILES x SPLITS whose grid stays under ~8 programs an SM and whose splits
    each hold at least two K tiles."""
    return [(bn, bk, w, s, split) for (bn, bk, w, s), split in itertools.product(TILES, SPLITS)
            if cdiv(n, bn) * split <= 1056 and k // (bk * split) >= 2]  # fmt: skip


def sweep(label: str, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, rep: int) -> tuple[float, tuple, float]:
    """(best µs, its config, the launcher's current µs); prints the best three."""
    n, k = w.shape
    default, times = stream_module._config, []
    for cfg in candidates(n, k):
        stream_module._config = lambda *_, cfg=cfg: cfg
        try:
            times.append((graph_us(lambda: stream_linear(x, w, scale), rep), cfg))
        except Exception as exc:  # noqa: BLE001 - a config too big for the chip is not a candidate
            print(f"  {label} {cfg}: {type(exc).__name__}", flush=True)
        finally:
            stream_module._config = default
    times.sort()
    stream_module._config = lambda *_, cfg=times[0][1]: cfg
    try:
        got = stream_linear(x, w, scale)
    finally:
        stream_module._config = default
    want = stream_linear_ref(x, w, scale)
    err = ((got.float() - want.float()).abs() / want.float().abs().clamp_min(1e-2)).max().item()
    print(f"  {label}: best {times[0][1]} {times[0][0]:.1f} µs, next " + " ".join(f"{c}:{t:.1f}" for t, c in times[1:3]) +
          f"; max relative error against the reference {err:.2e}", flush=True)  # fmt: skip
    return times[0][0], times[0][1], graph_us(lambda: stream_linear(x, w, scale), rep)


def main(rows: int = 32, rep: int = 50) -> None:
    bandwidth, _, harness = measure_ceilings()
    torch.manual_seed(0)
    table, tuned = [], {}
    for name in ("llama-8b", "llama-1b"):
        for proj, (in_f, widths) in MODELS[name].projections().items():
            n = sum(widths)
            w = torch.randn(n, in_f, device="cuda", dtype=torch.bfloat16) * in_f**-0.5
            q, s = quantize_fp8(w)
            x = torch.randn(rows, in_f, device="cuda", dtype=torch.bfloat16)
            label = f"{name} {proj} ({n} x {in_f})"
            bf16_floor = w.numel() * 2 / bandwidth * 1e6
            fp8_floor = (q.numel() + 4 * n) / bandwidth * 1e6
            cublas = graph_us(lambda: x @ w.t(), rep)
            dl = graph_us(lambda: decode_linear(x, w), rep) if (n, in_f) in DECODE_TUNED else None
            b_us, b_cfg, b_now = sweep(label + " bf16", x, w, None, rep)
            f8_old = graph_us(lambda: fp8_linear(x, q, s), rep)
            f_us, f_cfg, f_now = sweep(label + " fp8", x, q, s, rep)
            tuned[(n, in_f, 2)], tuned[(n, in_f, 1)] = b_cfg, f_cfg
            table.append((label, bf16_floor, cublas, dl, b_now, b_us, fp8_floor, f8_old, f_now, f_us))
    print(f"\ndecode, {rows} rows, µs (floors at {bandwidth / 1e9:.0f} GB/s; the harness's own floor {harness:.1f} µs)")
    head = ("projection", "bf16 floor", "cuBLAS", "decode_lin", "stream now", "stream best", "fp8 floor", "fp8_linear",
            "stream now", "stream best")  # fmt: skip
    print(" | ".join(head))
    for label, *us in table:
        print(f"{label} | " + " | ".join("-" if v is None else f"{v:.1f}" for v in us))
    for name in ("llama-8b", "llama-1b"):
        rows_ = [r for r in table if r[0].startswith(name)]
        sums = [sum(r[i] if r[i] is not None else r[2] for r in rows_) for i in range(1, 10)]
        print(f"{name} layer | " + " | ".join(f"{v:.1f}" for v in sums))
    print("\n_TUNED = {")
    for key, cfg in tuned.items():
        print(f"    {key}: {cfg},")
    print("}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 32)
