"""`lorabatch bench kernels`: each Triton kernel against its torch reference and its memory roofline (CUDA only).

Shapes are issue 4's: llama-1b (hidden 2048, 32 heads over 8 KV heads of 64, MLP 8192) and llama-8b (4096,
32 over 8 of 128, MLP 14336), bf16, a batch of 32 sequences over 32 distinct adapters of rank 16 in slots of
max rank 64. Decode is 32 rows (per-row groups, as a CUDA-graph decode step runs) with 1024 cached tokens
each; prefill is 32 sequences of 128 tokens (4096 rows, 32 segments) over a 512-token cached prefix.

Roofline: the fewest bytes an op must move (each input read once, each output written once: x, the batch's
distinct adapters' A and B at their true ranks, t written and read back in fp32, y read and written; for
attention q, o and each sequence's K and V), over the device-to-device copy bandwidth measured here (bytes
read plus written by a 1 GiB copy). Prefill attention also has a compute floor (causal flops over the bf16
matmul rate measured here). Kernels are timed as CUDA-graph replays (what a graph-captured step pays, no
Python launch cost); references, which sync, as plain calls; both with triton.testing.do_bench's median,
which flushes L2 before every run, so no weight is served from the cache a real step would have evicted.

Decode also times kernels/decode_linear.py, the base projection and the rows' deltas in one launch ("linear+delta"),
whose floor is W, the distinct adapters' B, t, x and y each moved once.

Mixed ranks: adapters of rank 8/16/32/64 (cycled over the 32) against all 32 at rank 30, their mean: the
bytes are equal, so the time ratio shows what heterogeneity itself costs (issue 4's target: at most 1.1x).

Beside the bench, the `_sweep*` functions time the launchers' candidate configs; one-off probes of where a kernel's time
goes are kernels/bench/probes.py.
"""

from __future__ import annotations

import json
import sys

import torch
import triton

from kernels.bench.cases import (
    ADAPTERS, BATCH, DEVICE, DTYPE, MEAN_RANK, MIXED_RANKS, MODELS, PREFILL_TOKENS, RANK, Model, attention_case, best, graph_us,
    lora_case, lora_kernels_us, measure_ceilings, plain_us,
)
from kernels.decode_linear import decode_linear, decode_linear_ref
from kernels.lora_segments import DecodeLora, lora_expand_ref, lora_shrink_ref
from kernels.lora_expand import lora_expand
from kernels.lora_shrink import lora_shrink
from kernels.paged_attention import paged_attention, paged_attention_ref


def _row(model: str, phase: str, op: str, kernel_us: float, ref_us: float, nbytes: int, bandwidth: float,
         flop_us: float | None = None) -> dict:
    roof_us = nbytes / bandwidth * 1e6
    return {"model": model, "phase": phase, "op": op, "kernel_us": round(kernel_us, 2), "ref_us": round(ref_us, 2),
            "roof_us": round(roof_us, 2), "x_roof": round(kernel_us / roof_us, 2), "ref_x": round(ref_us / kernel_us, 1),
            "bytes": nbytes, "flop_floor_us": None if flop_us is None else round(flop_us, 2)}


def _bench_projection(model: str, phase: str, proj: str, in_f: int, widths: tuple[int, ...], bandwidth: float):
    """(table rows of its shrink and expand at rank 16, their µs, the base GEMM's µs) for one projection."""
    case = lora_case(in_f, widths, phase, [RANK] * ADAPTERS)
    shrink_us, expand_us = lora_kernels_us(case)
    shrink_ref_us = plain_us(lambda: lora_shrink_ref(case.x, case.w, case.segments))
    y_ref = case.y.clone()
    expand_ref_us = plain_us(lambda: lora_expand_ref(y_ref, case.t, case.w, case.segments))
    w = torch.randn(sum(widths), in_f, device=DEVICE, dtype=DTYPE)  # the base projection, fused as the slices are
    base_us = graph_us(lambda: torch.mm(case.x, w.t(), out=case.y))
    rows = [_row(model, phase, f"shrink {proj}", shrink_us, shrink_ref_us, case.shrink_bytes, bandwidth),
            _row(model, phase, f"expand {proj}", expand_us, expand_ref_us, case.expand_bytes, bandwidth)]
    if phase == "decode":  # the base GEMM + delta in one launch (kernels/decode_linear.py), whichever shapes the engine gives it
        lora = DecodeLora(t=case.t, weights=case.w, slot=case.segments.slot)
        linear_us = graph_us(lambda: decode_linear(case.x, w, None, lora))
        linear_ref_us = plain_us(lambda: decode_linear_ref(case.x, w, None, lora))
        y_bytes = case.y.numel() * case.y.element_size()  # written once; the expand's read of y is gone
        nbytes = w.numel() * w.element_size() + case.expand_bytes - 2 * y_bytes + y_bytes + case.x.numel() * case.x.element_size()
        rows.append(_row(model, phase, f"linear+delta {proj}", linear_us, linear_ref_us, nbytes, bandwidth))
    return rows, shrink_us + expand_us, base_us


def _bench_ranks(in_f: int, widths: tuple[int, ...], phase: str, ranks: list[int]) -> float:
    """µs of shrink + expand for one projection with the given per-slot ranks."""
    return sum(lora_kernels_us(lora_case(in_f, widths, phase, ranks)))


def _bench_attention(name: str, model: Model, phase: str, bandwidth: float, matmul_rate: float) -> dict:
    args, nbytes, flops = attention_case(model, phase)
    max_q = 1 if phase == "decode" else PREFILL_TOKENS
    kernel_us = graph_us(lambda: paged_attention(**args, max_query_len=max_q))
    ref_us = plain_us(lambda: paged_attention_ref(**args))
    return _row(name, phase, "attention", kernel_us, ref_us, nbytes, bandwidth, flops / matmul_rate * 1e6)


def bench_kernels(json_only: bool = False) -> dict:
    """Time every kernel at issue 4's shapes; print a table (unless json_only), then one JSON line; return the figures."""
    if not torch.cuda.is_available():
        print("bench kernels needs a CUDA GPU: the Triton kernels only run compiled there (the CPU interpreter is for tests)",
              file=sys.stderr)
        raise SystemExit(2)
    torch.manual_seed(0)
    bandwidth, matmul_rate, launch_us = measure_ceilings()
    mixed_ranks = [MIXED_RANKS[s % len(MIXED_RANKS)] for s in range(ADAPTERS)]
    rows: list[dict] = []
    mixed: list[dict] = []
    overhead: list[dict] = []
    for name, model in MODELS.items():
        for phase in ("decode", "prefill"):
            lora_us = base_us = mixed_us = uniform_us = 0.0
            for proj, (in_f, widths) in model.projections().items():
                proj_rows, proj_lora_us, proj_base_us = _bench_projection(name, phase, proj, in_f, widths, bandwidth)
                rows += proj_rows
                lora_us += proj_lora_us
                base_us += proj_base_us
                mixed_us += _bench_ranks(in_f, widths, phase, mixed_ranks)
                uniform_us += _bench_ranks(in_f, widths, phase, [MEAN_RANK] * ADAPTERS)
            overhead.append({"model": name, "phase": phase, "base_us": round(base_us, 1), "lora_us": round(lora_us, 1),
                             "lora_pct": round(100 * lora_us / base_us, 1)})
            mixed.append({"model": name, "phase": phase, "mixed_us": round(mixed_us, 1), "uniform_us": round(uniform_us, 1),
                          "ratio": round(mixed_us / uniform_us, 3)})
            rows.append(_bench_attention(name, model, phase, bandwidth, matmul_rate))
    result = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "torch": torch.__version__,
              "copy_gb_s": round(bandwidth / 1e9, 1), "matmul_tflop_s": round(matmul_rate / 1e12, 1),
              "launch_floor_us": round(launch_us, 2), "kernels": rows, "mixed_vs_uniform": mixed, "lora_vs_base": overhead}
    if not json_only:
        _print_tables(result)
    print(json.dumps(result))
    return result


def _print_tables(result: dict) -> None:
    print(f"{result['device']}: copy {result['copy_gb_s']} GB/s (read + write), bf16 matmul {result['matmul_tflop_s']} TFLOP/s; "
          f"triton {result['triton']}, torch {result['torch']}")
    print(f"a one-element kernel, timed the same way (graph replay after an L2 flush): {result['launch_floor_us']} µs")
    print(f"{'model':9} {'phase':8} {'op':15} {'kernel µs':>10} {'ref µs':>10} {'roof µs':>9} {'x roof':>7} {'ref/kern':>9} {'flop floor µs':>14}")
    for r in result["kernels"]:
        floor = "" if r["flop_floor_us"] is None else f"{r['flop_floor_us']:14.1f}"
        print(f"{r['model']:9} {r['phase']:8} {r['op']:15} {r['kernel_us']:10.1f} {r['ref_us']:10.1f} {r['roof_us']:9.1f} "
              f"{r['x_roof']:7.2f} {r['ref_x']:9.1f} {floor}")
    print(f"\n{'model':9} {'phase':8} {'mixed 8/16/32/64 µs':>20} {'uniform 30 µs':>14} {'ratio':>6}   (all 4 projections, shrink + expand)")
    for r in result["mixed_vs_uniform"]:
        print(f"{r['model']:9} {r['phase']:8} {r['mixed_us']:20.1f} {r['uniform_us']:14.1f} {r['ratio']:6.3f}")
    print(f"\n{'model':9} {'phase':8} {'base GEMMs µs':>14} {'LoRA µs':>9} {'LoRA / base':>12}   (one layer's 4 projections, rank 16)")
    for r in result["lora_vs_base"]:
        print(f"{r['model']:9} {r['phase']:8} {r['base_us']:14.1f} {r['lora_us']:9.1f} {r['lora_pct']:11.1f}%")


def _sweep(rep: int = 30) -> None:
    """Tuning aid behind each launcher's `_config`: time candidate block sizes at the bench shapes, print the best.

    Run once per GPU kind (python -c "from kernels.bench.roofline import _sweep; _sweep()"); the defaults in the launchers
    are what it printed on an H200. Swaps each module's `_config` for the duration of a timing only.
    """
    import itertools

    import kernels.lora_expand as expand_module
    import kernels.lora_shrink as shrink_module
    import kernels.paged_attention as attention_module

    def projection(label: str, in_f: int, widths: tuple[int, ...], phase: str) -> None:
        case = lora_case(in_f, widths, phase, [RANK] * ADAPTERS)
        if phase == "decode":
            s_cands = list(itertools.product((1, 4, 8, 16), (1,), (128, 256, 512), (4,), (3,), (False,)))
            e_cands = list(itertools.product((1,), (256, 512, 1024, 2048), (4, 8), (1,)))
        else:
            s_cands = list(itertools.product((1, 2, 4), (32, 64), (128,), (4,), (3,), (False,)))
            e_cands = [(128, 128, 8, 1), (128, 256, 8, 1), (64, 256, 8, 1), (256, 128, 8, 1), (32, 128, 4, 4)]
        best(f"{label} shrink", shrink_module, s_cands,
              lambda: graph_us(lambda: lora_shrink(case.x, case.w, case.segments, out=case.t), rep))
        best(f"{label} expand", expand_module, e_cands, lambda: graph_us(
            lambda: lora_expand(case.y, case.t, case.w, case.segments), rep))

    def attention(label: str, model: Model, phase: str) -> None:
        args, _, _ = attention_case(model, phase)
        if phase == "decode":
            max_q, cands = 1, [(4, n, w, 3, False) for n in (64, 128, 256) for w in (4, 8)]
        else:
            max_q, cands = PREFILL_TOKENS, [(r // 4, n, w, 3, False) for r in (64, 128) for n in (32, 64) for w in (4, 8)]
        best(label, attention_module, cands, lambda: graph_us(lambda: paged_attention(**args, max_query_len=max_q), rep))

    torch.manual_seed(0)
    for name, model in MODELS.items():
        for phase in ("decode", "prefill"):
            for proj in ("qkv", "gate_up", "down"):
                in_f, widths = model.projections()[proj]
                projection(f"{name} {phase} {proj}", in_f, widths, phase)
            attention(f"{name} {phase} attention", model, phase)


def _sweep_prefill(tokens: int = 512, rep: int = 30, kernels: tuple[str, ...] = ("shrink", "expand")) -> None:
    """The prefill LoRA kernels alone at issue 4's prefill (32 sequences of `tokens` over 32 adapters of rank 16):
    for each projection of llama-1b and -8b, the fastest shrink and expand configs of a wide grid, with the achieved
    bandwidth against the bytes each must move (python -c "from kernels.bench.roofline import _sweep_prefill; _sweep_prefill()")."""
    import itertools

    import kernels.lora_expand as expand_module
    import kernels.lora_shrink as shrink_module

    bandwidth = measure_ceilings()[0]
    torch.manual_seed(0)

    for name, model in reversed(MODELS.items()):  # llama-8b first: issue 4's prefill target is at 8b
        for proj, (in_f, widths) in model.projections().items():
            case = lora_case(in_f, widths, "prefill", [RANK] * ADAPTERS, prefill_tokens=tokens)
            s_cands = list(itertools.product((1, 2), (32, 64), (128, 256), (4,), (3,), (False, True) if len(widths) > 1 else (False,)))
            e_cands = list(itertools.product((16, 32, 64), (64, 128, 256), (4, 8), (1, 2, 4, 8)))
            if "shrink" in kernels:
                best(f"{name} {proj} shrink", shrink_module, s_cands,
                      lambda: graph_us(lambda: lora_shrink(case.x, case.w, case.segments, out=case.t), rep),
                      case.shrink_bytes / bandwidth * 1e6)
            if "expand" in kernels:
                best(f"{name} {proj} expand", expand_module, e_cands, lambda: graph_us(
                    lambda: lora_expand(case.y, case.t, case.w, case.segments), rep),
                    case.expand_bytes / bandwidth * 1e6)  # fmt: skip


def _sweep_prefill_shrink(rep: int = 30, models: tuple[tuple[str, int], ...] = (("llama-1b", 128), ("llama-8b", 512)),
                          cands: list[tuple] | None = None) -> None:  # fmt: skip
    """The prefill shrink alone at issue 4's prefills (llama-1b: 32 sequences of 128 tokens; llama-8b: of 512; 32 adapters
    of rank 16): per projection, the launcher's config and its time, then the six fastest of a grid (split 1/2/4, 32/64/128
    rows, 128-column K steps, 4/8 warps, a slice a program or all slices in one; or `cands`) (python -c "from kernels.bench.roofline
    import _sweep_prefill_shrink; _sweep_prefill_shrink()")."""
    import itertools

    import kernels.lora_shrink as shrink_module

    torch.manual_seed(0)
    for name, tokens in models:
        for proj, (in_f, widths) in MODELS[name].projections().items():
            case = lora_case(in_f, widths, "prefill", [RANK] * ADAPTERS, prefill_tokens=tokens)
            now_cfg = shrink_module._config(case.segments, len(widths), in_f)
            fused = (False, True) if len(widths) > 1 else (False,)
            grid = cands if cands is not None else list(itertools.product((1, 2, 4), (32, 64, 128), (128,), (4, 8), (3,), fused))
            times = []
            default = shrink_module._config
            for cfg in grid:
                shrink_module._config = lambda *_, cfg=cfg: cfg
                try:
                    times.append((graph_us(lambda: lora_shrink(case.x, case.w, case.segments, out=case.t), rep), cfg))
                except (triton.CompilationError, triton.runtime.OutOfResources) as exc:
                    print(f"  {name} {proj} {cfg}: {type(exc).__name__}")
                finally:
                    shrink_module._config = default
            times.sort()
            now_us = graph_us(lambda: lora_shrink(case.x, case.w, case.segments, out=case.t), rep)
            print(f"{name} {proj:8} now {now_cfg} {now_us:.1f} µs | top: " + " ".join(f"{c}:{t:.1f}" for t, c in times[:6]),
                  flush=True)


def _sweep_prefill_fused_delta(rep: int = 30, models: tuple[tuple[str, int], ...] = (("llama-1b", 128), ("llama-8b", 512)),
                               cands: list[tuple] | None = None, module: str = "kernels.lora_delta") -> None:  # fmt: skip
    """The delta-first projections' LoRA (qkv, o, down; gate_up's goes to SiLU x up) at issue 4's prefills, 32 adapters of
    rank 16: the shrink then the expand writing the delta (two launches, their launchers' configs), against the one-launch
    delta (kernels/lora_delta.py) over a grid of (BLOCK_M, BLOCK_N, BLOCK_K, chunk, warps, round t) or `cands` (python -c "from
    kernels.bench.roofline import _sweep_prefill_fused_delta; _sweep_prefill_fused_delta()"); `module` names another
    module with the same launcher (`lora_delta` and `_config`) to sweep in its place, with its own `cands` (session 21's
    split-K delta, kernels/lora_delta_split.py, is in commit 1a00c65)."""
    import importlib
    import itertools

    delta_module = importlib.import_module(module)

    torch.manual_seed(0)
    grid = cands if cands is not None else list(itertools.product((16, 32, 64), (64, 128, 256), (64, 128), (256, 512, 1024, 4096), (4, 8),
                                                                  (False, True)))
    for name, tokens in models:
        for proj, (in_f, widths) in MODELS[name].projections().items():
            if proj == "gate_up":
                continue
            case = lora_case(in_f, widths, "prefill", [RANK] * ADAPTERS, prefill_tokens=tokens)
            z = torch.empty_like(case.y)

            def two() -> None:
                t = lora_shrink(case.x, case.w, case.segments)
                lora_expand(z, t, case.w, case.segments, accumulate=False)

            two_us = graph_us(two, rep)
            print(f"{name} {proj:5} shrink + expand {two_us:.1f} µs", flush=True)
            best(f"{name} {proj} {module}", delta_module, grid,
                 lambda: graph_us(lambda: delta_module.lora_delta(case.x, case.w, case.segments, sum(widths)), rep))  # fmt: skip


def _sweep_prefill_delta(tokens: int = 512, rep: int = 30, models: tuple[str, ...] = ("llama-8b",)) -> None:
    """Prefill LoRA as the engine runs it, the delta first (engine.lora "Prefill"): per projection of llama-8b and
    -1b at 32 sequences of `tokens` over 32 adapters of rank 16, the base GEMM alone, the GEMM then the expand adding
    into y (expand after the GEMM), and shrink + delta + the GEMM adding into it (addmm, beta = 1), after a sweep of the delta
    expand's configs; LoRA's share of each (python -c "from kernels.bench.roofline import _sweep_prefill_delta; _sweep_prefill_delta()")."""
    import itertools

    import kernels.lora_expand as expand_module

    bandwidth = measure_ceilings()[0]
    torch.manual_seed(0)
    totals: dict[str, list[float]] = {}
    for name in models:
        for proj, (in_f, widths) in MODELS[name].projections().items():
            case = lora_case(in_f, widths, "prefill", [RANK] * ADAPTERS, prefill_tokens=tokens)
            w = torch.randn(sum(widths), in_f, device=DEVICE, dtype=DTYPE)
            z = torch.empty_like(case.y)
            delta_bytes = case.expand_bytes - case.y.numel() * case.y.element_size()  # y written, not read
            cands = list(itertools.product((64, 128), (256, 512), (4, 8), (1, 2)))
            best(f"{name} {proj} delta", expand_module, cands, lambda: graph_us(
                lambda: lora_expand(z, case.t, case.w, case.segments, accumulate=False),
                rep), delta_bytes / bandwidth * 1e6)  # fmt: skip

            def old() -> None:
                torch.mm(case.x, w.t(), out=case.y)
                lora_shrink(case.x, case.w, case.segments, out=case.t)
                lora_expand(case.y, case.t, case.w, case.segments)

            def new() -> None:
                lora_shrink(case.x, case.w, case.segments, out=case.t)
                lora_expand(z, case.t, case.w, case.segments, accumulate=False)
                z.addmm_(case.x, w.t())

            base_us = graph_us(lambda: torch.mm(case.x, w.t(), out=case.y), rep)
            beta_us = graph_us(lambda: z.addmm_(case.x, w.t()), rep)
            old_us, new_us = graph_us(old, rep), graph_us(new, rep)
            for key, v in zip(("base", "old", "new"), (base_us, old_us, new_us)):
                totals.setdefault(name, [0.0, 0.0, 0.0])[("base", "old", "new").index(key)] += v
            print(f"{name} {proj:8} GEMM {base_us:8.1f} µs (beta=1: {beta_us:8.1f}) | GEMM then expand {old_us:8.1f} "
                  f"(+{100 * (old_us / base_us - 1):.1f}%) | delta then GEMM {new_us:8.1f} (+{100 * (new_us / base_us - 1):.1f}%)",
                  flush=True)
    for name, (base_us, old_us, new_us) in totals.items():
        print(f"{name} one layer: GEMMs {base_us:.1f} µs, LoRA after +{100 * (old_us / base_us - 1):.1f}%, "
              f"delta first +{100 * (new_us / base_us - 1):.1f}%")


def _sweep_decode_linear(rows: int = BATCH, rep: int = 50, models: tuple[str, ...] = tuple(MODELS), cands=None) -> None:
    """The decode projection kernel (kernels/decode_linear.py) against cuBLAS at issue 4's decode (32 rows, 32 adapters
    of rank 16): per projection of llama-1b and -8b, the base GEMM (cuBLAS; ours over a grid of configs, with W's bytes
    as the floor), then with adapters: cuBLAS + the per-row expand (the graphs' old path) against ours with the delta
    fused; the shrink, the same in both, is left out (python -c "from kernels.bench.roofline import _sweep_decode_linear;
    _sweep_decode_linear()")."""
    import itertools

    import kernels.decode_linear as linear_module

    bandwidth = measure_ceilings()[0]
    torch.manual_seed(0)
    cands = cands or list(itertools.product((16, 32, 64), (128, 256, 512), (4,), (3, 5)))
    summary = []
    for name in models:
        for proj, (in_f, widths) in MODELS[name].projections().items():
            case = lora_case(in_f, widths, "decode", [RANK] * ADAPTERS)
            w = torch.randn(sum(widths), in_f, device=DEVICE, dtype=DTYPE) * in_f**-0.5
            lora = DecodeLora(t=case.t, weights=case.w, slot=case.segments.slot)
            floor_us = w.numel() * w.element_size() / bandwidth * 1e6
            label = f"{name} {proj} ({sum(widths)} x {in_f})"
            best(label, linear_module, cands, lambda: graph_us(lambda: linear_module.decode_linear(case.x, w), rep), floor_us)
            cublas_us = graph_us(lambda: torch.mm(case.x, w.t(), out=case.y), rep)
            ours_us = graph_us(lambda: linear_module.decode_linear(case.x, w), rep)

            def old() -> None:
                torch.mm(case.x, w.t(), out=case.y)
                lora_expand(case.y, case.t, case.w, case.segments)

            old_us = graph_us(old, rep)
            fused_us = graph_us(lambda: linear_module.decode_linear(case.x, w, None, lora), rep)
            summary.append((label, floor_us, cublas_us, ours_us, old_us, fused_us))
    print(f"\n{'projection':34} {'W floor':>8} {'cuBLAS':>8} {'ours':>8} {'cuBLAS+expand':>14} {'ours+delta':>11}  (µs)")
    for label, *us in summary:
        print(f"{label:34} " + " ".join(f"{v:8.1f}" if i < 3 else f"{v:14.1f}" if i == 3 else f"{v:11.1f}" for i, v in enumerate(us)))
