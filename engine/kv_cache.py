"""A paged KV cache: fixed-size blocks in one preallocated pool per layer, and the allocator of blocks.

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

from collections.abc import Hashable

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


class BlockAllocator:
    """Hands out KV blocks to sequences from a free list and keeps each sequence's block table."""

    def __init__(self, num_blocks: int, block_size: int):
        assert num_blocks > 0 and block_size > 0, (num_blocks, block_size)
        self.num_blocks, self.block_size = num_blocks, block_size
        # Popped from the end; reversed so that a fresh cache hands out blocks 0, 1, 2, ... (easy to read in tests).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[Hashable, list[int]] = {}
        self._lengths: dict[Hashable, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def allocate(self, seq_id: Hashable, num_tokens: int) -> None:
        """Start a sequence with room for its first `num_tokens` tokens."""
        assert seq_id not in self._tables, f"sequence {seq_id!r} already holds blocks"
        self._tables[seq_id] = []
        self._lengths[seq_id] = 0
        try:
            self.append(seq_id, num_tokens)
        except KVCacheFullError:
            del self._tables[seq_id], self._lengths[seq_id]
            raise

    def append(self, seq_id: Hashable, num_tokens: int) -> None:
        """Grow a sequence by `num_tokens` tokens, taking new blocks only when its last one is full."""
        assert num_tokens >= 0, num_tokens
        table = self._tables[seq_id]
        new_len = self._lengths[seq_id] + num_tokens
        need = self.blocks_for(new_len) - len(table)
        if need > len(self._free):
            raise KVCacheFullError(
                f"KV cache full: sequence {seq_id!r} needs {need} more blocks, {len(self._free)} of "
                f"{self.num_blocks} are free; raise engine.kv_num_blocks or lower engine.max_batch_size"
            )
        for _ in range(need):
            table.append(self._free.pop())
        self._lengths[seq_id] = new_len

    def free(self, seq_id: Hashable) -> None:
        """Return all of a sequence's blocks; freeing an unknown sequence is a no-op (abort after finish)."""
        table = self._tables.pop(seq_id, None)
        self._lengths.pop(seq_id, None)
        if table:
            self._free.extend(reversed(table))

    def block_table(self, seq_id: Hashable) -> list[int]:
        return self._tables[seq_id]

    def num_tokens(self, seq_id: Hashable) -> int:
        return self._lengths[seq_id]

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._tables
