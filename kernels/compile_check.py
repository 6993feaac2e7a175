"""Compile every Triton kernel for the H200 without a GPU: `python -m kernels.compile_check [--jobs N]`.

Why: the CPU tests run the kernels in Triton's interpreter, which executes their Python but not the compiler,
so an error only the compiler sees (a loop-carried value that changes dtype between iterations, an op the
backend cannot lower, a block too big for shared memory) would otherwise first show on the device. On
2026-11-29 one did, and it cost a device call.

How: each launcher is called at issue 4's shapes (llama-1b and -8b: decode, grouped and prefill batches; bf16,
fp16 and fp32) on "meta" tensors, which have shapes, dtypes and strides but no storage, so the launchers pick
the same block sizes and constexprs they pick on CUDA. The launch itself is intercepted (JITFunction.run), and
every distinct variant (kernel, argument types, constexprs, warps, stages) is then compiled to a cubin for
sm_90 with the ptxas that Triton ships, and its shared memory checked against what one sm_90 program may take (a
variant over it compiles, but its launch fails on the device). One line per variant; exit status 1 if any fails. TRITON_INTERPRET must
be unset: the interpreter replaces the very functions the compiler needs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import torch

from kernels.utils import SHARED_BYTES

TARGET_ARCH = 90  # the H200 (Hopper); issue 4's device
_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int32: "i32", torch.int64: "i64",
           torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv"}  # fmt: skip
_MODELS = {  # hidden, heads, kv_heads, head_dim, intermediate (kernels.bench.cases.MODELS, without importing triton.testing)
    "llama-1b": (2048, 32, 8, 64, 8192),
    "llama-8b": (4096, 32, 8, 128, 14336),
}


@dataclass(frozen=True)
class Variant:
    module: str  # the kernel's module, imported again in the compiling process
    kernel: str  # its name there
    signature: tuple[tuple[str, str], ...]  # (parameter, Triton type or "constexpr") in order
    constexprs: tuple[tuple[str, object], ...]
    aligned: tuple[str, ...]  # parameters specialized as divisible by 16 (tensors, and ints that are), as the JIT does
    num_warps: int
    num_stages: int

    @property
    def label(self) -> str:
        consts = ", ".join(f"{k}={v}" for k, v in self.constexprs)
        return f"{self.module}.{self.kernel}[{consts}; warps {self.num_warps}, stages {self.num_stages}]"


def _type_of(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _DTYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for a {type(value).__name__} argument")


def record_launches(calls: Callable[[], None]) -> list[Variant]:
    """Run `calls` with every JITFunction launch intercepted; the distinct variants launched, in first-seen order."""
    from triton.runtime.jit import JITFunction

    seen: dict[Variant, None] = {}
    original = JITFunction.run

    def intercept(self, *args, grid, warmup, **kwargs):
        params = self.params
        num_warps = kwargs.pop("num_warps", 4)
        num_stages = kwargs.pop("num_stages", 3)
        bound = dict(zip((p.name for p in params), args))
        bound.update(kwargs)
        missing = [p.name for p in params if p.name not in bound]
        assert not missing, f"{self.fn.__name__}: no value for {missing}"
        # The JIT specializes as it launches on the device: an int argument equal to 1 becomes a constant, and tensors
        # (16-byte aligned, as torch allocates them) and ints divisible by 16 are marked so, which lets the compiler
        # vectorize and pipeline their loads; without these the compiled kernel is not the device's (a pipeline's
        # shared memory among what differs).
        def const(p) -> bool:
            v = bound[p.name]
            return p.is_constexpr or (not p.do_not_specialize and type(v) is int and v == 1)

        signature = tuple((p.name, "constexpr" if const(p) else _type_of(bound[p.name])) for p in params)
        constexprs = tuple((p.name, bound[p.name]) for p in params if const(p))
        aligned = tuple(p.name for p in params if not const(p) and not p.do_not_specialize and (
            isinstance(bound[p.name], torch.Tensor) or (type(bound[p.name]) is int and bound[p.name] % 16 == 0)))  # fmt: skip
        seen[Variant(self.fn.__module__, self.fn.__name__, signature, constexprs, aligned, num_warps, num_stages)] = None

    JITFunction.run = intercept
    try:
        calls()
    finally:
        JITFunction.run = original
    return list(seen)


def compile_variant(variant: Variant) -> tuple[str, str | None, float]:
    """(label, error or None, seconds): the variant compiled to a cubin for sm_90."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    start = time.perf_counter()
    try:
        fn = getattr(importlib.import_module(variant.module), variant.kernel)
        names = [name for name, _ in variant.signature]
        constexprs = {(names.index(name),): value for name, value in variant.constexprs}
        attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in variant.aligned}
        src = ASTSource(fn=fn, signature=dict(variant.signature), constexprs=constexprs, attrs=attrs)
        kernel = triton.compile(src, target=GPUTarget("cuda", TARGET_ARCH, 32),
                                options={"num_warps": variant.num_warps, "num_stages": variant.num_stages})
        assert kernel.asm.get("cubin"), "no cubin"
        shared = kernel.metadata.shared
        if shared > SHARED_BYTES:  # compiles, but its launch fails on the device
            return variant.label, (f"asks {shared} bytes of shared memory, over sm_{TARGET_ARCH}'s {SHARED_BYTES}: "
                                   "fewer stages or smaller tiles for this shape"), time.perf_counter() - start  # fmt: skip
        return variant.label, None, time.perf_counter() - start
    except Exception as exc:  # noqa: BLE001  (every failure is reported, none stops the others)
        return variant.label, _explain(exc), time.perf_counter() - start


def _explain(exc: BaseException) -> str:
    """The innermost cause of a compile failure: Triton nests one CompilationError per inlined function, each ending
    on a caret under the call, and the reason is in the last one."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: " + "\n    ".join(lines[-4:])


def _meta(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def issue_calls(dtypes: tuple[torch.dtype, ...] = tuple(DTYPES.values())) -> Iterator[Callable[[], None]]:
    """One call per launcher and shape of issue 4 (decode, grouped and prefill) and dtype."""
    from kernels.decode_linear import MAX_ROWS as DECODE_MAX_ROWS
    from kernels.decode_linear import DecodeLora, decode_linear
    from kernels.fp8_linear import FP8, fp8_linear
    from kernels.fp8_quant import quantize_rows
    from kernels.lora_delta import MAX_RANK_TILE
    from kernels.lora_delta import fits as delta_fits
    from kernels.lora_delta import lora_delta
    from kernels.lora_expand import lora_expand
    from kernels.lora_segments import LoraDelta, LoraPages, segments_from_indices, segments_per_row
    from kernels.lora_shrink import lora_shrink
    from kernels.paged_attention import decode_rope_attention, paged_attention
    from kernels.rms_norm import add_rms_norm
    from kernels.rope_cache import rope_and_cache
    from kernels.silu_mul import silu_mul

    rows, adapters, max_rank, block = 32, 32, 64, 16
    forms = {
        "decode": segments_per_row(_meta(rows, dtype=torch.int64)),
        "grouped": segments_from_indices([i // 4 for i in range(rows)], device="meta", pad_to=rows),
        "prefill": segments_from_indices([i // 512 for i in range(rows * 512)], device="meta"),
    }
    short_prefill = segments_from_indices([i // 128 for i in range(rows * 128)], device="meta")  # llama-1b's issue-4 prefill
    short_groups = segments_from_indices([i // 8 for i in range(rows * 8)], device="meta")  # groups of 8 rows: the delta's small tiles
    for dtype in dtypes:
        for hidden, heads, kv_heads, head_dim, inter in _MODELS.values():
            q_out, kv_out = heads * head_dim, kv_heads * head_dim
            projections = {"qkv": (hidden, (q_out, kv_out, kv_out)), "o": (q_out, (hidden,)),
                           "gate_up": (hidden, (inter, inter)), "down": (inter, (hidden,))}  # fmt: skip
            scale = _meta(adapters, dtype=torch.float32)
            pool = _meta(1 << 24, dtype=dtype)
            pages, ranks = _meta(adapters, 7, max_rank, dtype=torch.int64), _meta(adapters, 7, dtype=torch.int32)

            def paged(in_f, widths, pool=pool, pages=pages, ranks=ranks, scale=scale):  # as engine.lora's views: table columns
                s = len(widths)
                return LoraPages(pool=pool, pages=pages[:, :s], rank=ranks[:, :s], scale=scale, num_layers=32, layer=3,
                                 in_features=in_f, slices=widths)  # fmt: skip

            for in_f, widths in projections.values():
                out_f = sum(widths)
                a = b = paged(in_f, widths)
                for segments in forms.values():
                    n = segments.num_rows
                    x, y = _meta(n, in_f, dtype=dtype), _meta(n, out_f, dtype=dtype)
                    t = _meta(len(widths), n, max_rank, dtype=torch.float32)
                    yield lambda x=x, a=a, segments=segments, t=t: lora_shrink(x, a, segments, out=t)
                    for accumulate in (True, False):
                        yield lambda y=y, t=t, b=b, segments=segments, accumulate=accumulate: lora_expand(
                            y, t, b, segments, accumulate=accumulate)
                # What the one-launch delta takes (its byte limit), at max rank 64 and at the largest it takes (its rank tile)
                wide = LoraPages(pool=pool, pages=_meta(adapters, len(widths), MAX_RANK_TILE, dtype=torch.int64),
                                 rank=_meta(adapters, len(widths), dtype=torch.int32), scale=scale, num_layers=32, layer=3,
                                 in_features=in_f, slices=widths)  # fmt: skip
                for segments in (forms["grouped"], short_prefill, short_groups):
                    for pages_view in (a, wide):
                        if delta_fits(pages_view, segments):
                            x = _meta(segments.num_rows, in_f, dtype=dtype)
                            yield lambda x=x, w=pages_view, segments=segments, out_f=out_f: lora_delta(x, w, segments, out_f)
                for m in (rows, DECODE_MAX_ROWS):  # its tiles grow with the rows: the most it takes, too
                    x, w = _meta(m, in_f, dtype=dtype), _meta(out_f, in_f, dtype=dtype)
                    lora = DecodeLora(t=_meta(len(widths), m, max_rank, dtype=torch.float32), weights=paged(in_f, widths),
                                      slot=_meta(m, dtype=torch.int64))  # fmt: skip
                    bias = _meta(out_f, dtype=dtype)
                    yield lambda x=x, w=w, lora=lora, bias=bias: (decode_linear(x, w), decode_linear(x, w, bias, lora))
                    q, wscale = _meta(out_f, in_f, dtype=FP8), _meta(out_f, dtype=torch.float32)
                    yield lambda x=x, q=q, wscale=wscale, bias=bias: (fp8_linear(x, q, wscale), fp8_linear(x, q, wscale, bias))
                yield lambda x=_meta(rows * 512, in_f, dtype=dtype): quantize_rows(x)  # FP8 prefill's activations
            blocks = 64
            k_cache = _meta(blocks * rows, block, kv_heads, head_dim, dtype=dtype)
            tables = _meta(rows, blocks, dtype=torch.int32)
            seq_lens = _meta(rows, dtype=torch.int32)
            q_decode = _meta(rows, heads, head_dim, dtype=dtype)
            qkv = _meta(rows, q_out + 2 * kv_out, dtype=dtype)
            pos = _meta(rows, dtype=torch.int64)
            for splits in (1, 4):
                yield lambda q=q_decode, kc=k_cache, s=splits: paged_attention(q, kc, kc, tables, seq_lens, num_splits=s)
                qkv_lora = LoraDelta(t=_meta(3, rows, max_rank, dtype=torch.float32), weights=paged(hidden, projections["qkv"][1]),
                                     segments=forms["decode"])  # fmt: skip
                for lora in (None, qkv_lora):  # decode steps with adapters add qkv's delta here (engine.lora, "Decode")
                    yield lambda qkv=qkv, kc=k_cache, s=splits, heads=heads, hd=head_dim, lora=lora: decode_rope_attention(
                        qkv, pos, _meta(hd // 2, dtype=torch.float32), kc, kc, pos, tables.long(), seq_lens.long(), heads,
                        num_splits=s, lora=lora)  # the engine's int64 metadata  # fmt: skip
            q_prefill = _meta(rows * 128, heads, head_dim, dtype=dtype)
            cu = _meta(rows + 1, dtype=torch.int32)
            yield lambda q=q_prefill, kc=k_cache: paged_attention(q, kc, kc, tables, seq_lens, cu_seqlens_q=cu, max_query_len=128)
            h = _meta(rows, hidden, dtype=dtype)
            yield lambda h=h: (add_rms_norm(h, _meta(hidden, dtype=dtype), 1e-5), add_rms_norm(h, _meta(hidden, dtype=dtype), 1e-5, h))
            yield lambda qkv=qkv, kc=k_cache, heads=heads, hd=head_dim: rope_and_cache(
                qkv, pos, _meta(hd // 2, dtype=torch.float32), kc, kc, pos, heads)
            yield lambda g=_meta(rows, 2 * inter, dtype=dtype): silu_mul(g)
            for segments in (forms["decode"], forms["grouped"], forms["prefill"]):  # the forms whose steps add gate_up's LoraDelta in silu_mul
                n, widths = segments.num_rows, (inter, inter)
                lora = LoraDelta(t=_meta(2, n, max_rank, dtype=torch.float32), weights=paged(hidden, widths), segments=segments)
                yield lambda g=_meta(n, 2 * inter, dtype=dtype), lora=lora: silu_mul(g, lora)

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernels.compile_check", description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiling processes (default: one per core)")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help=f"comma-separated, of {', '.join(DTYPES)} (default: all)")
    args = parser.parse_args(argv)
    unknown = [d for d in args.dtypes.split(",") if d not in DTYPES]
    if unknown:
        parser.error(f"--dtypes: {unknown} not among {list(DTYPES)}")
    if os.environ.get("TRITON_INTERPRET") not in (None, "", "0"):
        print("kernels.compile_check: unset TRITON_INTERPRET (the interpreter replaces what the compiler needs)", file=sys.stderr)
        return 2
    dtypes = tuple(DTYPES[d] for d in args.dtypes.split(","))
    variants = record_launches(lambda: [call() for call in issue_calls(dtypes)])
    print(f"{len(variants)} kernel variants to compile for sm_{TARGET_ARCH}, {args.jobs} at a time", flush=True)
    failed = 0
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for i, (label, error, seconds) in enumerate(pool.map(compile_variant, variants), 1):
            failed += error is not None
            print(f"[{i}/{len(variants)}] {'FAIL' if error else 'ok  '} {seconds:5.1f} s  {label}" + (f"\n    {error}" if error else ""),
                  flush=True)
    print(f"{len(variants) - failed} compiled, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
