"""The compute backend of the engine's LoRA and attention ops, chosen once at start (STYLE item 10).

- triton: the kernels of `kernels/` (multi-LoRA shrink/expand at each adapter's true rank with fused
  slices, paged attention, the fused residual-add + RMSNorm, RoPE + KV write and SiLU x up that
  replace the model's composite ops, the decode projection with its LoRA delta in one launch, and a prefill
  projection's LoRA delta in one launch), and
  CUDA graphs for decode steps. The default on CUDA.
- torch: pure-torch references (the multi-LoRA shrink and expand's own, from kernels/lora_segments.py, in the
  kernels' layout and signatures; per-sequence SDPA), no graphs, no triton needed. The default on the CPU, where it
  is exact fp32.

`engine.kernel_backend` forces either. Triton on the CPU runs only in Triton's interpreter (the tests
use it to check the engine's kernel path against the torch path): the process must have set
TRITON_INTERPRET=1 before it first imported triton, and the engine refuses to start otherwise rather
than run something else. Nothing falls back: a backend that cannot run is an error naming the fix,
and the engine logs the one it runs.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from engine.api import EngineError
from kernels.lora_segments import lora_expand_ref, lora_shrink_ref


@dataclass(frozen=True)
class KernelBackend:
    name: Literal["torch", "triton"]
    lora_shrink: Callable = lora_shrink_ref  # triton: kernels.lora_shrink.lora_shrink; torch: its reference
    lora_expand: Callable = lora_expand_ref  # triton: kernels.lora_expand.lora_expand; torch: its reference
    paged_attention: Callable | None = None  # kernels.paged_attention.paged_attention
    add_rms_norm: Callable | None = None  # kernels.rms_norm.add_rms_norm
    rope_and_cache: Callable | None = None  # kernels.rope_cache.rope_and_cache
    silu_mul: Callable | None = None  # kernels.silu_mul.silu_mul
    decode_linear: Callable | None = None  # kernels.decode_linear.decode_linear
    decode_linear_fits: Callable | None = None  # kernels.decode_linear.fits: (rows, slices, in_features) -> bool
    interpreted: bool = False  # Triton's CPU interpreter (tests)
    fp8_linear: Callable | None = None  # kernels.fp8_linear.fp8_linear: an FP8 projection's decode rows (engine.quant)
    fp8_quantize_rows: Callable | None = None  # kernels.fp8_quant.quantize_rows: activations to FP8 for prefill (engine.quant)
    lora_delta: Callable | None = None  # kernels.lora_delta.lora_delta: a delta-first projection's shrink + expand in one launch
    lora_delta_fits: Callable | None = None  # kernels.lora_delta.fits: (weights, segments) -> bool
    decode_rope_attention: Callable | None = None  # kernels.paged_attention.decode_rope_attention

    @property
    def triton(self) -> bool:
        return self.name == "triton"


def pick_backend(choice: str, device: torch.device) -> KernelBackend:
    """The backend for `choice` ("auto", "triton" or "torch") on `device`; raises EngineError if it cannot run."""
    assert choice in ("auto", "triton", "torch"), choice
    name = choice if choice != "auto" else ("triton" if device.type == "cuda" else "torch")
    if name == "torch":
        return KernelBackend("torch")
    try:
        # Imported here, not at module import: tests import the kernels under the interpreter first.
        shrink = importlib.import_module("kernels.lora_shrink")
        expand = importlib.import_module("kernels.lora_expand")
        attention = importlib.import_module("kernels.paged_attention")
        norm, rope, act, linear, fp8, quant, delta = (importlib.import_module(f"kernels.{m}") for m in
                                                      ("rms_norm", "rope_cache", "silu_mul", "decode_linear", "fp8_linear",
                                                       "fp8_quant", "lora_delta"))  # fmt: skip
    except ImportError as e:
        raise EngineError(
            f"engine.kernel_backend={choice!r} needs triton, which failed to import ({e}); install triton or set "
            "engine.kernel_backend='torch'",
            code="config_invalid",
        ) from e
    interpreted = type(shrink._shrink_kernel).__name__ == "InterpretedFunction"
    if device.type != "cuda" and not interpreted:
        raise EngineError(
            f"engine.kernel_backend={choice!r} on {device.type}: Triton kernels run on the CPU only in Triton's "
            "interpreter; start the process with TRITON_INTERPRET=1 (tests), or set engine.kernel_backend='torch'",
            code="config_invalid",
        )
    return KernelBackend("triton", shrink.lora_shrink, expand.lora_expand, attention.paged_attention, norm.add_rms_norm,
                         rope.rope_and_cache, act.silu_mul, linear.decode_linear, linear.fits, interpreted, fp8.fp8_linear,
                         quant.quantize_rows, delta.lora_delta, delta.fits, attention.decode_rope_attention)  # fmt: skip


def graph_batch_sizes(max_batch: int) -> tuple[int, ...]:
    """Decode batch sizes captured as CUDA graphs: powers of two below `max_batch`, then `max_batch` itself.

    A batch runs in the smallest bucket that holds it, padded: 1, 2, 4, ..., so padding wastes under half
    of a bucket's rows, and a padded row costs little in a decode step bound by reading the weights."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return (*sizes, max_batch) if max_batch > 0 else ()
