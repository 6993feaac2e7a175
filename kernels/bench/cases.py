"""What the kernel benches share (kernels.bench.roofline, kernels.bench.probes): the bench shapes, the cases
they time (one projection's LoRA, one batch's paged attention), the timers and the device's ceilings.

Shapes are issue 4's (kernels.bench.roofline's docstring). Kernels are timed as CUDA-graph replays (`graph_us`:
what a graph-captured step pays, no Python launch cost); references, which sync, as plain calls (`plain_us`);
both with triton.testing.do_bench's median, which flushes L2 before every run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
from triton.testing import do_bench

from kernels.lora_expand import lora_expand
from kernels.lora_segments import LoraPages, LoraSegments, pack_pages, segments_from_indices, segments_per_row
from kernels.lora_shrink import lora_shrink

BATCH, ADAPTERS, RANK, MAX_RANK = 32, 32, 16, 64
MIXED_RANKS, MEAN_RANK = (8, 16, 32, 64), 30
PREFILL_TOKENS, PREFIX, DECODE_CONTEXT, BLOCK_SIZE = 128, 512, 1024, 16
DTYPE = torch.bfloat16
DEVICE = "cuda"


@dataclass(frozen=True)
class Model:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int

    def projections(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        """LoRA targets as the kernels see them: name -> (in_features, output width of each fused slice)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {
            "qkv": (self.hidden, (q, kv, kv)),
            "o": (q, (self.hidden,)),
            "gate_up": (self.hidden, (self.intermediate, self.intermediate)),
            "down": (self.intermediate, (self.hidden,)),
        }

MODELS = {"llama-1b": Model(2048, 32, 8, 64, 8192), "llama-8b": Model(4096, 32, 8, 128, 14336)}


def graph_us(fn: Callable[[], object], rep: int = 100) -> float:
    """Median µs of a CUDA-graph replay of fn (compiled and warmed first)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return do_bench(graph.replay, warmup=25, rep=rep, return_mode="median") * 1e3


def plain_us(fn: Callable[[], object]) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


@dataclass
class LoraCase:
    """One projection's LoRA at one phase and rank mix, with the bytes its shrink and expand must move."""

    x: torch.Tensor  # [N, in]
    y: torch.Tensor  # [N, out]
    a: torch.Tensor  # [slots, S, R, in]
    b: torch.Tensor  # [slots, R, out]
    rank: torch.Tensor  # [slots]
    scale: torch.Tensor  # [slots]
    w: LoraPages  # a, b, rank and scale as the kernels read them: pages of the rows below each rank (pack_pages)
    segments: LoraSegments
    widths: tuple[int, ...]
    t: torch.Tensor  # [S, N, R] fp32
    shrink_bytes: int
    expand_bytes: int


def lora_case(in_f: int, widths: tuple[int, ...], phase: str, ranks: list[int], prefill_tokens: int = PREFILL_TOKENS) -> LoraCase:
    device, e = torch.device(DEVICE), DTYPE.itemsize
    num_slices, out_f = len(widths), sum(widths)
    rank = torch.tensor(ranks, dtype=torch.int32, device=device)  # [slots]
    a = torch.randn(ADAPTERS, num_slices, MAX_RANK, in_f, device=device, dtype=DTYPE) * in_f**-0.5
    b = torch.randn(ADAPTERS, MAX_RANK, out_f, device=device, dtype=DTYPE)
    for s, r in enumerate(ranks):  # zero-filled beyond the rank, as the engine's slots are
        a[s, :, r:] = 0
        b[s, r:] = 0
    if phase == "decode":
        slots = list(range(BATCH))
        segments = segments_per_row(torch.tensor(slots, device=device))
    else:
        slots = [s for s in range(BATCH) for _ in range(prefill_tokens)]
        segments = segments_from_indices(slots, device=device)
    n = len(slots)
    x = torch.randn(n, in_f, device=device, dtype=DTYPE)
    y = torch.randn(n, out_f, device=device, dtype=DTYPE)
    scale = torch.full((ADAPTERS,), 2.0, device=device)
    w = pack_pages(a, b, rank, scale, widths)
    t = lora_shrink(x, w, segments)
    rank_sum = sum(ranks[s] for s in set(slots))  # distinct adapters, each once
    t_bytes = num_slices * sum(ranks[s] for s in slots) * 4
    shrink_bytes = n * in_f * e + num_slices * rank_sum * in_f * e + t_bytes
    expand_bytes = t_bytes + rank_sum * out_f * e + 2 * n * out_f * e
    return LoraCase(x, y, a, b, rank, scale, w, segments, widths, t, shrink_bytes, expand_bytes)


def lora_kernels_us(case: LoraCase, rep: int = 100) -> tuple[float, float]:
    shrink = graph_us(lambda: lora_shrink(case.x, case.w, case.segments, out=case.t), rep)
    expand = graph_us(lambda: lora_expand(case.y, case.t, case.w, case.segments), rep)
    return shrink, expand


def attention_case(model: Model, phase: str) -> tuple[dict, int, float]:
    """Keyword arguments of paged_attention, its fewest bytes, and its causal flops."""
    device, e = torch.device(DEVICE), DTYPE.itemsize
    q_len, context = (1, DECODE_CONTEXT - 1) if phase == "decode" else (PREFILL_TOKENS, PREFIX)
    total = q_len + context
    per_seq = triton.cdiv(total, BLOCK_SIZE)
    shape = (BATCH * per_seq, BLOCK_SIZE, model.kv_heads, model.head_dim)
    k_cache, v_cache = (torch.randn(shape, device=device, dtype=DTYPE) for _ in range(2))
    tables = torch.randperm(BATCH * per_seq, device=device, dtype=torch.int32).view(BATCH, per_seq)
    args = {
        "q": torch.randn(BATCH * q_len, model.heads, model.head_dim, device=device, dtype=DTYPE),
        "k_cache": k_cache,
        "v_cache": v_cache,
        "block_tables": tables,
        "seq_lens": torch.full((BATCH,), total, dtype=torch.int32, device=device),
    }
    if phase == "prefill":
        args["cu_seqlens_q"] = torch.arange(0, BATCH * q_len + 1, q_len, dtype=torch.int32, device=device)
    nbytes = 2 * BATCH * q_len * model.heads * model.head_dim * e + 2 * BATCH * total * model.kv_heads * model.head_dim * e
    keys_seen = sum(context + i + 1 for i in range(q_len))  # per sequence, causal
    flops = 4.0 * BATCH * keys_seen * model.heads * model.head_dim
    return args, nbytes, flops


def measure_ceilings() -> tuple[float, float, float]:
    """(copy bandwidth in bytes/s, counting read + write; bf16 matmul rate in flop/s, on random data; the harness's
    floor in µs: a one-element kernel timed as the kernels are)."""
    src = torch.randn(256 * 1024 * 1024, device=DEVICE, dtype=torch.float32)  # 1 GiB
    dst = torch.empty_like(src)
    copy_ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    m = torch.randn(8192, 8192, device=DEVICE, dtype=DTYPE)
    mm_ms = do_bench(lambda: m @ m, warmup=25, rep=200, return_mode="median")
    one = torch.ones(1, device=DEVICE)
    return 2 * src.numel() * src.element_size() / (copy_ms * 1e-3), 2 * 8192**3 / (mm_ms * 1e-3), graph_us(lambda: one.add_(1))


def best(label: str, module, candidates, run: Callable[[], float], floor_us: float | None = None) -> list[tuple[float, tuple]]:
    """Time `run` with each candidate as `module._config` (restored after each), print the fastest three, the launcher's
    current choice and, given the op's byte floor, the best one's share of it. Swaps `_config` for a timing only.
    Returns (µs, candidate) of every candidate that ran, fastest first."""
    default, times = module._config, []
    for cfg in candidates:
        module._config = lambda *_, cfg=cfg: cfg
        try:
            times.append((run(), cfg))
        except (triton.CompilationError, triton.runtime.OutOfResources) as exc:  # too big for the chip: not a candidate
            print(f"  {label} {cfg}: {type(exc).__name__}")
        finally:
            module._config = default
    times.sort()
    floor = f" = {floor_us / times[0][0]:4.0%} of the {floor_us:.1f} µs floor" if floor_us else ""
    print(f"{label:34} now {run():8.1f} µs | best {times[0][1]} {times[0][0]:8.1f} µs{floor} | next " +
          " ".join(f"{c}:{t:.1f}" for t, c in times[1:3]), flush=True)
    return times
