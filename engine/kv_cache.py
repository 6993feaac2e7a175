"""A paged KV cache: fixed-size blocks in one preallocated pool per layer (which block holds what is
`engine.block_manager`'s business).

Layout. For each layer, K and V are each one tensor `[num_blocks, block_size, kv_heads, head_dim]`,
allocated once at start so that no allocator call runs on the hot path. A sequence owns a list of
block ids (its block table); its token at position p lives in block `table[p // block_size]`, row
`p % block_size`. Flattened, the pool is `[num_blocks * block_size, kv_heads, head_dim]` and that token's
slot is `table[p // block_size] * block_size + p % block_size`.

Running example, block_size 16: a 40-token prompt takes 3 blocks (16 + 16 + 8 used); its decode tokens
fill the third block up to position 47, and position 48 takes a fourth block. Waste is under one block
per sequence, which is why paging beats reserving max length per sequence.
"""

from __future__ import annotations

import torch

from engine.api import EngineError


class KVCacheFullError(EngineError):
    """No free KV blocks are left for the tokens asked for."""

    code = "kv_cache_full"
    retriable = True


class KVCache:
    """The per-layer K and V pools (see the module docstring for the layout)."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        assert num_layers > 0 and num_blocks > 0 and block_size > 0, (num_layers, num_blocks, block_size)
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]  # L x [blocks, bs, KV, D]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]  # L x [blocks, bs, KV, D]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
