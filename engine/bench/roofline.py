"""The engine bench's roofline: the bytes a decode step must read and the FLOPs of a prefill, set against the
copy bandwidth and the matmul rate measured on the device (engine.bench.serving)."""

from __future__ import annotations

import time

import torch

from engine.bench.build import sync
from engine.model import LlamaForCausalLM, ModelConfig


def prefill_flops(cfg: ModelConfig, batch: int, prompt: int) -> float:
    """Matmul FLOPs of a prefill of batch x prompt tokens (logits for the last token of each), plus causal attention."""
    per_token = 2 * sum(i * o for i, o in cfg.projection_shapes().values()) * cfg.num_layers
    attention = 2 * cfg.num_layers * batch * cfg.num_heads * cfg.head_dim * prompt * prompt  # QK^T and AV, causal halves
    return per_token * batch * prompt + 2 * cfg.hidden_size * cfg.vocab_size * batch + attention


def weight_bytes(model: LlamaForCausalLM) -> int:
    """Bytes a decode step reads of the base: every weight but the embedding table (B rows of it only); an FP8
    projection's (engine.quant) are its FP8 bytes and scales."""
    skip = model.model.embed_tokens.weight.data_ptr()
    seen, total = set(), 0
    fp8 = [(n, b) for n, b in model.named_buffers() if n.endswith((".qweight", ".weight_scale"))]
    for name, p in [*model.named_parameters(), *fp8]:
        if p.data_ptr() in seen or ("a_stack" in name or "b_stack" in name):
            continue
        seen.add(p.data_ptr())
        if p.data_ptr() != skip or model.config.tie_word_embeddings:
            total += p.numel() * p.element_size()
    return total


def kv_bytes(cfg: ModelConfig, batch: int, context: float, elem: int) -> float:
    return batch * context * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * elem


def adapter_bytes(cfg: ModelConfig, rank: int, elem: int) -> int:
    return cfg.num_layers * rank * sum(i + o for i, o in cfg.projection_shapes().values()) * elem


def measure_bandwidth(device: torch.device) -> float:
    """Bytes per second of a large copy (read + write counted) on the device."""
    n = (1 << 28) if device.type == "cuda" else (1 << 25)  # 1 GiB / 128 MiB of fp32
    src = torch.rand(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    reps = 10 if device.type == "cuda" else 3
    dst.copy_(src)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    sync(device)
    return 2 * n * 4 * reps / (time.perf_counter() - t0)


def measure_matmul(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of a large square matmul in the model's dtype on random data (8192^3 on CUDA, 1024^3 on CPU)."""
    n, reps = (8192, 10) if device.type == "cuda" else (1024, 3)
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    a @ b
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - t0)
