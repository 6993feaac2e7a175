"""One-off probes of where a kernel's time goes on the GPU, each a command of its own and named, with its figures, in
engine/PERF.md; `lorabatch bench kernels` and the launchers' config sweeps are kernels/bench/roofline.py.

- probe_delta: the prefill delta (kernels/lora_expand.py, accumulate=False) against its stores alone, torch's fill and copy.
- probe_beta: the prefill GEMM adding into the delta (beta = 1) against beta = 0, through cuBLAS and cuBLASLt.
- probe_lora_gemm: a Triton GEMM with the prefill delta in its epilogue against cuBLAS.
- probe_consumers: gate_up -> SiLU x up at prefill, the delta first against the delta added by the op.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from kernels.bench.cases import ADAPTERS, BATCH, DEVICE, DTYPE, MODELS, RANK, best, graph_us, lora_case
from kernels.lora_expand import lora_expand
from kernels.lora_shrink import lora_shrink


def probe_delta(tokens: int = 512, rep: int = 30, models: tuple[str, ...] = ("llama-8b",)) -> None:
    """Where the prefill delta's time goes (kernels/lora_expand.py, accumulate=False), per projection at 32 sequences of
    `tokens` over 32 adapters of rank 16: the delta, the same launch with every rank 0 (its stores alone), torch's fill
    of z (a write of the same bytes) and copy into z (read + write); µs and z's write rate
    (python -c "from kernels.bench.probes import probe_delta; probe_delta()")."""
    torch.manual_seed(0)
    print(f"{'projection':20} {'delta':>8} {'stores':>8} {'fill':>8} {'copy':>8}  (µs; GB/s of z written)")
    for name in models:
        for proj, (in_f, widths) in MODELS[name].projections().items():
            case = lora_case(in_f, widths, "prefill", [RANK] * ADAPTERS, prefill_tokens=tokens)
            z = torch.empty_like(case.y)
            zero_rank = dataclasses.replace(case.w, rank=torch.zeros_like(case.w.rank))  # the same pages, every rank 0
            gb = z.numel() * z.element_size() / 1e3
            us = [graph_us(lambda: lora_expand(z, case.t, case.w, case.segments, accumulate=False), rep),
                  graph_us(lambda: lora_expand(z, case.t, zero_rank, case.segments, accumulate=False), rep),
                  graph_us(lambda: z.zero_(), rep),
                  graph_us(lambda: z.copy_(case.y), rep)]
            print(f"{name + ' ' + proj:20} " + " ".join(f"{v:8.1f}" for v in us) + "   " +
                  " ".join(f"{gb / v:6.0f}" for v in us), flush=True)


def probe_beta(tokens: int = 512, rep: int = 30, models: tuple[str, ...] = ("llama-8b",)) -> None:
    """The prefill GEMM adding into the delta (`z.addmm_(x, W^T)`, beta = 1) against the plain GEMM (beta = 0), per
    projection at 32 sequences of `tokens`, through torch's default BLAS path and through cuBLASLt
    (`torch.backends.cuda.preferred_blas_library`); µs (python -c "from kernels.bench.probes import probe_beta; probe_beta()")."""
    torch.manual_seed(0)
    default = torch.backends.cuda.preferred_blas_library()
    print(f"{'projection':20} {'beta=0':>8} {'beta=1':>8} {'Lt beta=0':>10} {'Lt beta=1':>10}  (µs)")
    for name in models:
        for proj, (in_f, widths) in MODELS[name].projections().items():
            x = torch.randn(BATCH * tokens, in_f, device=DEVICE, dtype=DTYPE)
            w = torch.randn(sum(widths), in_f, device=DEVICE, dtype=DTYPE) * in_f**-0.5
            y = torch.empty(x.shape[0], w.shape[0], device=DEVICE, dtype=DTYPE)
            z = torch.zeros_like(y)
            us = []
            for lib in (default, "cublaslt"):
                torch.backends.cuda.preferred_blas_library(lib)
                us += [graph_us(lambda: torch.mm(x, w.t(), out=y), rep), graph_us(lambda: z.addmm_(x, w.t()), rep)]
            torch.backends.cuda.preferred_blas_library(default)
            print(f"{name + ' ' + proj:20} {us[0]:8.1f} {us[1]:8.1f} {us[2]:10.1f} {us[3]:10.1f}", flush=True)


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, y_ptr, t_ptr, b_ptr, scale_ptr, tile_slot_ptr, M, N, K,
                       stride_xm, stride_wn, stride_ym, stride_tm, stride_bs, stride_br,
                       LORA: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, R: tl.constexpr,
                       GROUP: tl.constexpr):
    """y = x W^T, plus (LORA) scale * t[rows, :R] @ B[slot, :R, cols] in the epilogue, one slot per BM-row tile."""
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    per_group = GROUP * tiles_n
    first_m = (pid // per_group) * GROUP
    group_m = tl.minimum(tiles_m - first_m, GROUP)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, K, BK):
        a = tl.load(x_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] + k < K), other=0.0)
        b = tl.load(w_ptrs, mask=(offs_n[None, :] < N) & (offs_k[:, None] + k < K), other=0.0)
        acc = tl.dot(a, b, acc)
        x_ptrs += BK
        w_ptrs += BK
    if LORA:
        slot = tl.load(tile_slot_ptr + pid_m)
        offs_r = tl.arange(0, R)
        tt = tl.load(t_ptr + offs_m.to(tl.int64)[:, None] * stride_tm + offs_r[None, :], mask=offs_m[:, None] < M, other=0.0)
        bt = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + offs_r[:, None] * stride_br + offs_n[None, :], mask=offs_n[None, :] < N,
                     other=0.0)  # fmt: skip
        acc += tl.load(scale_ptr + slot) * tl.dot(tt.to(bt.dtype), bt)
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def probe_lora_gemm(tokens: int = 512, rep: int = 20) -> None:
    """Whether a Triton GEMM with the prefill LoRA delta in its epilogue could replace cuBLAS + the delta at llama-8b's
    prefill (32 x `tokens` rows, 32 adapters of rank 16, one adapter per 512-row segment): per projection, cuBLAS
    alone, cuBLAS adding into the delta (the engine's path, the delta kernel excluded), and the Triton GEMM without and
    with the epilogue, over a few tile configs; µs and TFLOP/s
    (python -c "from kernels.bench.probes import probe_lora_gemm; probe_lora_gemm()").

    On an H200 (triton 3.6; engine/PERF.md, "Tried and set aside") this pointer-based GEMM (wgmma, no TMA, no warp
    specialization) took 1.30-1.41x cuBLAS's time at its best config, and the epilogue's extra [BM, 16] x [16, BN] dot
    made it 3-5x slower again: epilogue fusion needs a GEMM at cuBLAS's rate first."""
    torch.manual_seed(0)
    m = BATCH * tokens
    for proj, (in_f, widths) in MODELS["llama-8b"].projections().items():
        n = sum(widths)
        x = torch.randn(m, in_f, device=DEVICE, dtype=DTYPE)
        w = torch.randn(n, in_f, device=DEVICE, dtype=DTYPE) * in_f**-0.5
        y = torch.empty(m, n, device=DEVICE, dtype=DTYPE)
        z = torch.zeros_like(y)
        t = torch.randn(m, RANK, device=DEVICE, dtype=torch.float32)
        b = torch.randn(ADAPTERS, RANK, n, device=DEVICE, dtype=DTYPE)
        scale = torch.rand(ADAPTERS, device=DEVICE)
        flops = 2 * m * n * in_f
        cublas = graph_us(lambda: torch.mm(x, w.t(), out=y), rep)
        beta = graph_us(lambda: z.addmm_(x, w.t()), rep)
        line = f"{proj:8} cuBLAS {cublas:8.1f} µs ({flops / cublas / 1e6:5.0f} TFLOP/s), beta=1 {beta:8.1f} |"
        for bm, bn, bk, warps, stages in ((128, 256, 64, 8, 3), (128, 128, 64, 4, 4), (128, 256, 64, 8, 4), (256, 128, 64, 8, 3)):
            tile_slot = (torch.arange(triton.cdiv(m, bm), device=DEVICE) * bm // tokens % ADAPTERS).to(torch.int32)
            grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)

            def run(lora: bool) -> None:
                _gemm_kernel[grid](x, w, y, t, b, scale, tile_slot, m, n, in_f, x.stride(0), w.stride(0), y.stride(0),
                                         t.stride(0), b.stride(0), b.stride(1), LORA=lora, BM=bm, BN=bn, BK=bk, R=RANK, GROUP=8,
                                         num_warps=warps, num_stages=stages)  # fmt: skip

            try:
                plain, fused = graph_us(lambda: run(False), rep), graph_us(lambda: run(True), rep)
                line += f" {bm}x{bn}x{bk}/{warps}/{stages}: {plain:8.1f} / {fused:8.1f}"
            except (triton.CompilationError, triton.runtime.OutOfResources) as exc:
                line += f" {bm}x{bn}x{bk}/{warps}/{stages}: {type(exc).__name__}"
        print(line, flush=True)
    run(True)
    want = (x.float() @ w.float().t())[:bm]
    print("epilogue check (last config, first tile): max abs err of the GEMM part",
          float(((y.float()[:bm] - want) - (scale[tile_slot[0]] * (t[:bm].to(DTYPE).float() @ b[tile_slot[0]].float()))).abs().max()))


def probe_consumers(tokens: int = 512, rep: int = 30, models: tuple[str, ...] = ("llama-8b",), sweep: bool = True) -> None:
    """gate_up -> SiLU x up at prefill (32 sequences of `tokens`, 32 adapters of rank 16), three ways: base only (GEMM,
    plain op); the delta first (shrink, delta z, GEMM adding into z, plain op); the delta left to the op (GEMM, shrink,
    the op adding t B^T itself: engine.lora "Prefill"). µs and LoRA's share; with `sweep`, the fused op's tile configs
    first (python -c "from kernels.bench.probes import probe_consumers; probe_consumers()")."""
    import itertools

    import kernels.silu_mul as silu_module
    from kernels.lora_segments import LoraDelta
    from kernels.silu_mul import silu_mul

    torch.manual_seed(0)
    for name in models:
        in_f, widths = MODELS[name].projections()["gate_up"]
        case = lora_case(in_f, widths, "prefill", [RANK] * ADAPTERS, prefill_tokens=tokens)
        w = torch.randn(sum(widths), in_f, device=DEVICE, dtype=DTYPE) * in_f**-0.5
        z = torch.empty_like(case.y)
        lora = LoraDelta(t=case.t, weights=case.w, segments=case.segments)
        if sweep:
            cands = list(itertools.product((32, 64, 128), (64, 128, 256), (4, 8)))
            best(f"{name} gate_up fused op", silu_module, cands, lambda: graph_us(lambda: silu_mul(case.y, lora), rep))

        def base() -> None:
            torch.mm(case.x, w.t(), out=case.y)
            silu_mul(case.y)

        def delta_first() -> None:
            lora_shrink(case.x, case.w, case.segments, out=case.t)
            lora_expand(z, case.t, case.w, case.segments, accumulate=False)
            z.addmm_(case.x, w.t())
            silu_mul(z)

        def to_op() -> None:
            torch.mm(case.x, w.t(), out=case.y)
            lora_shrink(case.x, case.w, case.segments, out=case.t)
            silu_mul(case.y, lora)

        plain_op, fused_op = graph_us(lambda: silu_mul(case.y), rep), graph_us(lambda: silu_mul(case.y, lora), rep)
        b, d, c = graph_us(base, rep), graph_us(delta_first, rep), graph_us(to_op, rep)
        print(f"{name} gate_up base {b:8.1f} µs | delta first {d:8.1f} (+{100 * (d / b - 1):.1f}%) | delta in the op {c:8.1f} "
              f"(+{100 * (c / b - 1):.1f}%) | op plain {plain_op:.1f}, fused {fused_op:.1f}", flush=True)
