"""FP8 (e4m3) base weights with one scale per output channel (`engine.weight_dtype = "fp8"`).

The four projections of each layer (qkv, o, gate_up, down) hold their weights as float8_e4m3fn with an fp32 scale per
output row: W ≈ q * scale[:, None]. The embeddings, norms and the LM head stay in the engine's dtype, and so do the
adapters: a LoRA delta adds to the projection's output as it does over a bf16 base.

Two ways in:
- a bf16/fp32 checkpoint quantized at load (`quantize_fp8`): scale = max |row| / 448 (e4m3's largest finite value), a row
  of zeros scale 1, q = W / scale rounded to e4m3 (round to nearest even, as torch's cast does);
- an HF folder already in FP8 (`config.json` `quantization_config.quant_method = "fbgemm_fp8"`): per projection
  `weight` in F8_E4M3 and `weight_scale` [out, 1] fp32, the layout transformers' FBGEMM FP8 integration writes (its
  `modules_to_not_convert` keep the LM head in the model's dtype). `is_fp8_folder` tells; engine.checkpoint reads it.

Compute, on the triton backend (engine.runner sets `Fp8Linear.decode` and `.prefill`):
- a call of up to 64 rows (a decode step, in or out of a CUDA graph) runs kernels/fp8_linear.py, which streams the FP8
  bytes and applies the scales after its K loop: the weights only are FP8, the activations stay as they are;
- a longer bf16 call (prefill) runs on FP8 tensor cores (`scaled_linear`): its activations quantized per row (token) as
  the weights are per output row, `torch._scaled_mm` with both scales, output bf16. This rounds the activations to
  e4m3 too, as FP8 serving engines do for prefill: `scaled_linear_ref` is its reference.
Everything else (the torch backend, fp32 and fp16 engines) reads `Fp8Linear.weight`, the dequantized weight in the
compute dtype made when it is read, to the rounding of one product per weight: the CPU's fallback, through which CI
tests the logic.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn import functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
QUANT_METHOD = "fbgemm_fp8"  # the quantization_config.quant_method of an FP8 folder this engine reads and writes
_PROJECTION_WEIGHT = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj\.weight$")


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [out, in] float8_e4m3fn, scale [out] fp32) of a weight [out, in]: W ≈ q * scale[:, None] (module docstring)."""
    assert w.dim() == 2, w.shape
    w32 = w.float()
    amax = w32.abs().amax(dim=1)
    if not torch.isfinite(amax).all():
        raise ValueError("the weight holds a NaN or an infinity; an FP8 scale cannot be taken of it")
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w32 / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q * scale[:, None] in `dtype` ([out, in]); the product is taken in fp32 and rounded once."""
    return (q.float() * scale.float()[:, None]).to(dtype)


def fp8_compute(device: torch.device) -> bool:
    """Whether FP8 operands can be computed on `device`: CUDA from sm_89 (Ada, Hopper), or the CPU (Triton's interpreter,
    torch's CPU `_scaled_mm`, for the tests). Elsewhere (an A100) FP8 weights are dequantized where they are read."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(xq [M, K] float8_e4m3fn, scale [M, 1] fp32) of activations x [M, K], one scale per row (token), as
    `quantize_fp8` takes one per weight row; a row of zeros gets scale 1. kernels/fp8_quant.py does this in one launch
    on the triton backend, to the bit: the scale divides tensor by tensor (torch's CUDA division by a Python scalar
    multiplies by its reciprocal, a last-bit difference)."""
    amax = x.abs().amax(dim=1, keepdim=True).float()
    scale = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def scaled_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                  quantize: Callable | None = None) -> torch.Tensor:  # fmt: skip
    """x (q * scale)^T + bias on FP8 tensor cores (torch._scaled_mm): x quantized per row (`quantize`, by default
    `quantize_rows_fp8`; the triton backend passes kernels.fp8_quant.quantize_rows, equal to the bit), the product of
    the two FP8 operands accumulated in fp32 and scaled by both scales, output in x's dtype (bf16: the dtype row-wise
    scaling takes). Prefill rows; numerics are `scaled_linear_ref`'s.

    The quantization's cost matters: at a llama-8b prefill of 16,384 tokens the torch ops took 741-2,645 µs a
    projection against 74-222 for the kernel, while the FP8 GEMM itself took 399-2,870 (H200, `python -m
    kernels.bench.fp8`)."""
    xq, xs = (quantize or quantize_rows_fp8)(x)
    y = torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=scale.float()[None, :], out_dtype=x.dtype)
    return y if bias is None else y.add_(bias)


def scaled_linear_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`scaled_linear` in fp32 torch: both operands dequantized, multiplied, rounded once."""
    xq, xs = quantize_rows_fp8(x)
    y = (xq.float() * xs) @ (q.float() * scale.float()[:, None]).t()
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)


class Fp8Linear(nn.Module):
    """A projection whose weight is stored as FP8 with a scale per output row (module docstring); the bias, if any, in
    the compute dtype. Duck-types nn.Linear for the engine: `weight` (dequantized when read), `bias`, `in_features`,
    `out_features`, and calling it on x [N, in]."""

    def __init__(self, qweight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        assert qweight.dtype == FP8 and qweight.dim() == 2, (qweight.dtype, qweight.shape)
        assert weight_scale.shape == (qweight.shape[0],), (weight_scale.shape, qweight.shape)
        self.out_features, self.in_features = qweight.shape
        self.dtype = dtype
        self.register_buffer("qweight", qweight)
        self.register_buffer("weight_scale", weight_scale.float())
        self.bias = nn.Parameter(bias.to(dtype), requires_grad=False) if bias is not None else None
        # kernels.fp8_linear.fp8_linear on the triton backend (engine.runner sets it): decode rows read the FP8 bytes
        self.decode: Callable | None = None
        self.decode_rows = 64  # the most rows it takes (kernels.fp8_linear.MAX_ROWS)
        # `scaled_linear` for longer bf16 steps (prefill) on the triton backend, set by engine.runner: FP8 tensor cores
        self.prefill: Callable | None = None

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> Fp8Linear:
        """Quantized from `weight` [out, in] as stored (per output row, `quantize_fp8`)."""
        q, scale = quantize_fp8(weight)
        return cls(q, scale, bias, dtype)

    @property
    def weight(self) -> torch.Tensor:
        return dequantize_fp8(self.qweight, self.weight_scale, self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.decode is not None and 0 < x.shape[0] <= self.decode_rows and x.is_contiguous():
            return self.decode(x, self.qweight, self.weight_scale, self.bias)
        if self.prefill is not None and x.dtype == torch.bfloat16 and x.shape[0] > 0 and self.in_features % 16 == 0 \
                and self.out_features % 16 == 0:  # what torch._scaled_mm takes
            return self.prefill(x, self.qweight, self.weight_scale, self.bias)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3, scale per output row"


def write_fp8_folder(src: Path, dst: Path) -> Path:
    """An FP8 copy of the HF model folder `src` at `dst`: every projection weight `...{q,k,v,o,gate,up,down}_proj.weight`
    quantized per output channel (`quantize_fp8`) and stored as F8_E4M3 beside its `weight_scale` [out, 1] fp32,
    everything else (embeddings, norms, LM head, biases) as it was; config.json gains the quantization_config of
    transformers' FBGEMM FP8 integration. The tokenizer and the other files are copied. Returns `dst`."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    if config.get("quantization_config") is not None:
        raise ValueError(f"{src / 'config.json'} is quantized already ({config['quantization_config'].get('quant_method')!r})")
    config["quantization_config"] = {"quant_method": QUANT_METHOD, "activation_scale_ub": 1200.0, "modules_to_not_convert": ["lm_head"]}
    for path in sorted(src.iterdir()):
        if path.name == "config.json" or not path.is_file():
            continue
        if path.suffix == ".safetensors":
            out: dict[str, torch.Tensor] = {}
            for key, tensor in load_file(str(path)).items():
                if _PROJECTION_WEIGHT.match(key):
                    q, scale = quantize_fp8(tensor)
                    out[key], out[key + "_scale"] = q, scale[:, None].contiguous()
                else:
                    out[key] = tensor
            save_file(out, str(dst / path.name), metadata={"format": "pt"})
        elif path.name == "model.safetensors.index.json":
            index = json.loads(path.read_text())
            index["weight_map"].update({k + "_scale": f for k, f in index["weight_map"].items() if _PROJECTION_WEIGHT.match(k)})
            (dst / path.name).write_text(json.dumps(index, indent=2))
        else:
            shutil.copyfile(path, dst / path.name)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst
