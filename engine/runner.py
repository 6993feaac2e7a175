"""The model runner: turns one step's per-sequence work into one flat forward and returns logits.

It owns the device state (model with LoRA slots, KV pools, block tables) and nothing of requests,
sampling or scheduling, so tests can drive the exact forward the engine runs.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch

from engine.attention import build_attention_metadata
from engine.block_manager import BlockManager
from engine.kv_cache import KVCache
from engine.lora import apply_lora
from engine.model import LlamaForCausalLM


@dataclass(frozen=True)
class BatchItem:
    """One sequence's part of a step."""

    seq_id: Hashable
    token_ids: tuple[int, ...]  # new tokens: a prompt chunk (prefill), or the last sampled token (decode)
    context_len: int  # tokens of this sequence already in the KV cache
    lora_slot: int = -1  # adapter slot, -1 for the base model
    logits: bool = True  # False for a prefill chunk that does not reach the end of the known tokens


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        *,
        max_loras: int,
        max_lora_rank: int,
        kv_num_blocks: int,
        kv_block_size: int,
        prefix_caching: bool = True,
        tenant_quota_blocks: int | None = None,
    ):
        param = model.lm_head.weight
        self.device, self.dtype = param.device, param.dtype
        self.model = model
        self.config = model.config
        self.lora = apply_lora(self.model, max_loras, max_lora_rank)
        self.kv = KVCache(
            num_layers=self.config.num_layers,
            num_blocks=kv_num_blocks,
            block_size=kv_block_size,
            num_kv_heads=self.config.num_kv_heads,
            head_dim=self.config.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        self.blocks = BlockManager(kv_num_blocks, kv_block_size, prefix_caching=prefix_caching, tenant_quota=tenant_quota_blocks)

    @torch.inference_mode()
    def forward(self, items: list[BatchItem], *, all_logits: bool = False) -> torch.Tensor:
        """Run one forward over every item's new tokens; logits [M, vocab] fp32 for the last token of each
        item with `logits` set (or [N, vocab] for every token with `all_logits`).

        Block tables must cover each item's context + new tokens; items of sequences the block manager
        does not know yet are opened uncached (tests drive the runner that way; the engine's scheduler
        grows every table before the step, with prefix hits and quotas).
        """
        assert items, "empty batch"
        for it in items:
            assert it.token_ids, f"{it.seq_id!r}: no new tokens"
            self.blocks.ensure(it.seq_id, it.context_len + len(it.token_ids))

        query_lens = [len(it.token_ids) for it in items]
        ids = [t for it in items for t in it.token_ids]
        positions = [p for it in items for p in range(it.context_len, it.context_len + len(it.token_ids))]
        slots = [it.lora_slot for it in items for _ in it.token_ids]
        attn = build_attention_metadata(
            self.kv, query_lens, [it.context_len for it in items], [self.blocks.block_table(it.seq_id) for it in items]
        )
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)  # [N]
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)  # [N]
        used_slots = {s for s in slots if s >= 0}
        slot_idx = torch.tensor(slots, dtype=torch.int64, device=self.device) if used_slots else None  # [N]
        self.lora.wait_ready(used_slots)
        logit_rows = None
        if not all_logits:
            ends, end = [], -1
            for it, q in zip(items, query_lens):
                end += q
                if it.logits:
                    ends.append(end)
            logit_rows = torch.tensor(ends, dtype=torch.int64, device=self.device)  # [M] last token of each item
        self.lora.set_batch(slot_idx)
        try:
            return self.model(input_ids, pos, attn, logit_rows)
        finally:
            self.lora.set_batch(None)

    def free(self, seq_id: Hashable) -> None:
        """Release a finished, aborted or preempted sequence's KV blocks."""
        self.blocks.free(seq_id)
