"""Rotary position embeddings: the inverse frequencies of each RoPE flavour, and cos/sin per token.

Flavours, as HF transformers computes them (`modeling_rope_utils`), so logits match to fp32 error:

- default: inv_freq[i] = 1 / theta^(2i / D), i = 0 .. D/2 - 1.
- linear: default / factor (position interpolation, kaiokendev 2023).
- llama3 (Llama 3.1+): per frequency, by its wavelength 2 pi / inv_freq against the original context L:
  wavelengths under L / high_freq_factor keep their frequency, those over L / low_freq_factor are
  divided by `factor`, and the band between is interpolated. Running example, Llama-3.1-8B (theta 5e5,
  D 128, factor 8, low 1, high 4, L 8192): the 64 frequencies have wavelengths 6.3 .. 2.6e6; the 29
  under 2048 stay, the 29 over 8192 are divided by 8, the 6 between are blended.

Anything else (yarn, dynamic, longrope) is refused when the config is read (engine.model), not here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


def inv_frequencies(head_dim: int, rope: RopeConfig, device: torch.device | None = None) -> torch.Tensor:
    """inv_freq [head_dim / 2] fp32 for the configured flavour."""
    assert rope.rope_type in ROPE_TYPES, rope
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)  # [D / 2]
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, blended, scaled)
    return inv_freq


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, head_dim] for each token's position (HF's non-interleaved half-split layout)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [N, D / 2], fp32: positions up to 1e5 stay exact
    emb = torch.cat((freqs, freqs), dim=-1)  # [N, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin (HF's half-split rotation), as a new tensor [N, heads, head_dim].

    Three launches (a product, then each half's cross term added in place) instead of five (negate, concat,
    two products, a sum): the model rotates q and k of all heads in one call, so a decode layer spends 3
    small kernels here rather than 10."""
    # x [N, heads, head_dim]; cos, sin [N, head_dim]
    half = x.shape[-1] // 2
    out = x * cos[:, None, :]  # [N, heads, D]
    out[..., :half].addcmul_(x[..., half:], sin[:, None, :half], value=-1)  # first half: - x2 * sin
    out[..., half:].addcmul_(x[..., :half], sin[:, None, half:])  # second half: + x1 * sin
    return out
