"""The model runner: turns one step's per-sequence work into one flat forward and returns logits.

It owns the device state (model with LoRA slots, KV pools, block tables) and nothing of requests,
sampling or scheduling, so tests can drive the exact forward the engine runs.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.attention import build_attention_metadata
from engine.kv_cache import BlockAllocator, KVCache
from engine.lora import apply_lora
from engine.model import load_model


@dataclass(frozen=True)
class BatchItem:
    """One sequence's part of a step."""

    seq_id: Hashable
    token_ids: tuple[int, ...]  # new tokens: the prompt (prefill) or the last sampled token (decode)
    context_len: int  # tokens of this sequence already in the KV cache
    lora_slot: int = -1  # adapter slot, -1 for the base model


class ModelRunner:
    def __init__(
        self,
        model_dir: Path,
        *,
        device: torch.device,
        dtype: torch.dtype,
        max_loras: int,
        max_lora_rank: int,
        kv_num_blocks: int,
        kv_block_size: int,
    ):
        self.device, self.dtype = device, dtype
        self.model = load_model(model_dir, device, dtype)
        self.config = self.model.config
        self.lora = apply_lora(self.model, max_loras, max_lora_rank)
        self.kv = KVCache(
            num_layers=self.config.num_layers,
            num_blocks=kv_num_blocks,
            block_size=kv_block_size,
            num_kv_heads=self.config.num_kv_heads,
            head_dim=self.config.head_dim,
            dtype=dtype,
            device=device,
        )
        self.blocks = BlockAllocator(kv_num_blocks, kv_block_size)

    @torch.inference_mode()
    def forward(self, items: list[BatchItem], *, all_logits: bool = False) -> torch.Tensor:
        """Run one forward over every item's new tokens; logits [B, vocab] for each item's last token
        (or [N, vocab] for every token with `all_logits`), fp32.

        Grows each sequence's block table for its new tokens (KVCacheFullError if the pool is short:
        the engine reserves blocks at admission so that this does not happen mid-request).
        """
        assert items, "empty batch"
        for it in items:
            assert it.token_ids, f"{it.seq_id!r}: no new tokens"
            if it.context_len == 0:
                self.blocks.allocate(it.seq_id, len(it.token_ids))
            else:
                assert self.blocks.num_tokens(it.seq_id) == it.context_len, (it.seq_id, self.blocks.num_tokens(it.seq_id), it.context_len)
                self.blocks.append(it.seq_id, len(it.token_ids))

        query_lens = [len(it.token_ids) for it in items]
        ids = [t for it in items for t in it.token_ids]
        positions = [p for it in items for p in range(it.context_len, it.context_len + len(it.token_ids))]
        slots = [it.lora_slot for it in items for _ in it.token_ids]
        attn = build_attention_metadata(
            self.kv, query_lens, [it.context_len for it in items], [self.blocks.block_table(it.seq_id) for it in items]
        )
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)  # [N]
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)  # [N]
        any_lora = any(s >= 0 for s in slots)
        slot_idx = torch.tensor(slots, dtype=torch.int64, device=self.device) if any_lora else None  # [N]
        last_rows = None
        if not all_logits:
            ends = torch.tensor(query_lens, dtype=torch.int64).cumsum(0) - 1  # [B] last token of each item
            last_rows = ends.to(self.device)
        self.lora.set_batch(slot_idx)
        try:
            return self.model(input_ids, pos, attn, last_rows)
        finally:
            self.lora.set_batch(None)

    def free(self, seq_id: Hashable) -> None:
        """Release a finished or aborted sequence's KV blocks."""
        self.blocks.free(seq_id)
