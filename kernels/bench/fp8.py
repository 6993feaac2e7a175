"""FP8 projections on the GPU (issue 22): `python -m kernels.bench.fp8 [rows]`, CUDA only.

Per projection of llama-8b and llama-1b (bf16 activations, weights quantized per output channel, engine.quant):
- decode (32 rows): cuBLAS over the bf16 weight, kernels/fp8_linear.py over a grid of configs with and without a split
  K loop (the launcher's choice and the best three), and the FP8 tensor-core path (kernels/fp8_quant.py's row quantization + torch._scaled_mm), each
  against the byte floor of its weight;
- prefill (llama-8b: 16,384 rows; llama-1b: 4,096): cuBLAS bf16, the row quantization (torch ops and the kernel), the
  FP8 GEMM alone, and engine.quant.scaled_linear whole.
Times are CUDA-graph replays (kernels.bench.cases.graph_us, L2 flushed before each); the tables come last, with a JSON line
between them of the best decode config per (N, K), in `_TUNED`'s form.
"""

from __future__ import annotations

import itertools
import json
import sys

import torch

import kernels.fp8_linear as fp8_module
from kernels.bench.cases import MODELS, best, graph_us, measure_ceilings
from engine.quant import quantize_fp8, quantize_rows_fp8 as quantize_rows_ref, scaled_linear
from kernels.fp8_quant import quantize_rows

PREFILL_ROWS = {"llama-8b": 16384, "llama-1b": 4096}


def main(rows: int = 32, rep: int = 50) -> None:
    bandwidth, matmul, _ = measure_ceilings()
    torch.manual_seed(0)
    cands = list(itertools.product((16, 32, 64), (128, 256), (4,), (3, 4), (1, 2, 4, 8)))  # (BN, BK, warps, stages, split K)
    decode, prefill, tuned = [], [], {}
    for name in ("llama-8b", "llama-1b"):
        for proj, (in_f, widths) in MODELS[name].projections().items():
            n = sum(widths)
            w = torch.randn(n, in_f, device="cuda", dtype=torch.bfloat16) * in_f**-0.5
            q, s = quantize_fp8(w)
            x = torch.randn(rows, in_f, device="cuda", dtype=torch.bfloat16)
            fp8_floor = (q.numel() + 4 * n) / bandwidth * 1e6
            label = f"{name} {proj} ({n} x {in_f})"
            swept = best(label, fp8_module, cands, lambda: graph_us(lambda: fp8_module.fp8_linear(x, q, s), rep), fp8_floor)
            tuned[f"{n},{in_f}"] = list(swept[0][1])
            bf16_us = graph_us(lambda: x @ w.t(), rep)
            ours_us = graph_us(lambda: fp8_module.fp8_linear(x, q, s), rep)
            mm_us = graph_us(lambda: scaled_linear(x, q, s, None), rep)

            def kernel_mm(x=x, q=q, sb=s[None, :]):
                xq, xs = quantize_rows(x)
                return torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=sb, out_dtype=torch.bfloat16)

            decode.append((label, w.numel() * 2 / bandwidth * 1e6, bf16_us, fp8_floor, ours_us, mm_us, graph_us(kernel_mm, rep)))
            xp = torch.randn(PREFILL_ROWS[name], in_f, device="cuda", dtype=torch.bfloat16)
            xq, xs = quantize_rows(xp)
            ref_q, ref_s = quantize_rows_ref(xp)
            same = (xq.view(torch.uint8) == ref_q.view(torch.uint8)).float().mean().item(), torch.equal(xs, ref_s)
            sb = s[None, :]
            prefill.append((label, 2 * xp.shape[0] * n * in_f / matmul * 1e6, graph_us(lambda: xp @ w.t(), 10),
                            graph_us(lambda: quantize_rows_ref(xp), 10), graph_us(lambda: quantize_rows(xp), 10),
                            graph_us(lambda: torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=sb, out_dtype=torch.bfloat16), 10),
                            graph_us(lambda: scaled_linear(xp, q, s, None), 10), same))  # fmt: skip
            print(f"  {label}: quantize_rows equals the reference on {same[0]:.6f} of the bytes, scales equal {same[1]}", flush=True)
    print(f"\ndecode, {rows} rows (µs; floors at {bandwidth / 1e9:.0f} GB/s)")
    print(f"{'projection':34} {'bf16 floor':>10} {'cuBLAS':>8} {'fp8 floor':>9} {'fp8_linear':>10} {'torch quant+mm':>14} {'kernel quant+mm':>15}")
    for label, *us in decode:
        print(f"{label:34} " + " ".join(f"{v:{wd}.1f}" for v, wd in zip(us, (10, 8, 9, 10, 14, 15))))
    print(json.dumps({"fp8_tuned": tuned}))
    print(f"\nprefill (µs; bf16 matmul floor at {matmul / 1e12:.0f} TFLOP/s)")
    print(f"{'projection':34} {'bf16 floor':>10} {'cuBLAS':>8} {'quant torch':>11} {'quant kernel':>12} {'_scaled_mm':>10} {'scaled_linear':>13}")
    for label, *us, _ in prefill:
        print(f"{label:34} " + " ".join(f"{v:{wd}.1f}" for v, wd in zip(us, (10, 8, 11, 12, 10, 13))))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 32)
