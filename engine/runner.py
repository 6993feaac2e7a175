"""The model runner: turns one step's per-sequence work into one flat forward and returns logits.

It owns the device state (model with LoRA slots, KV pools, block tables, decode graphs) and nothing of
requests, sampling or scheduling, so tests can drive the exact forward the engine runs.

Two paths: a decode step (every item one new token) that fits a CUDA-graph bucket replays a graph
(engine.cuda_graphs), and so does a step with prompt tokens of up to `prompt_graph_tokens` tokens (engine.
mixed_graphs); anything else runs eagerly, its metadata built on the host in a few vectorised
ops and copied to the device in ONE transfer. Neither waits on the device: the one sync of a step is
the engine reading the sampled tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention import AttentionMetadata, build_attention_metadata
from engine.backend import KernelBackend
from engine.block_manager import BlockManager
from engine.cuda_graphs import DecodeGraphs
from engine.kv_cache import KVCache
from engine.mixed_graphs import MixedGraphs
from engine.lora import apply_lora
from engine.model import LlamaForCausalLM, ModelOps
from engine.quant import Fp8Linear, fp8_compute, scaled_linear
from kernels.lora_segments import segments_from_indices, segments_per_row


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
        adapter_gpu_bytes: int | None = None,
        kv_num_blocks: int,
        kv_block_size: int,
        prefix_caching: bool = True,
        tenant_quota_blocks: int | None = None,
        backend: KernelBackend | None = None,
        graph_sizes: tuple[int, ...] = (),
        prompt_graph_tokens: int = 0,
        max_blocks_per_seq: int = 0,
        capture_graphs: bool | None = None,
        max_chain: int = 1,
        decode_lora_in_ops: tuple[str, ...] = (),
        decode_lora_overlap: bool = True,
    ):
        """`graph_sizes`: decode buckets run through engine.cuda_graphs (triton backend only), with block tables of
        `max_blocks_per_seq`; steps with prompt tokens of up to `prompt_graph_tokens` tokens and up to the largest bucket's
        items replay graphs too (engine.mixed_graphs; only with `graph_sizes`); `capture_graphs` None captures on CUDA only (False: static buffers, eagerly; tests).
        `decode_lora_in_ops`: the projections whose decode delta their consumer op adds (engine.lora, "Decode");
        `decode_lora_overlap`: graphed decode steps run each shrink beside its projection's GEMM (engine.lora, "Decode")."""
        param = model.lm_head.weight
        self.device, self.dtype = param.device, param.dtype
        self.backend = backend or KernelBackend("torch")
        self.model = model
        self.config = model.config
        self.lora = apply_lora(self.model, max_loras, max_lora_rank, self.backend, adapter_gpu_bytes)
        self.lora.overlap_decode(decode_lora_overlap)
        if self.backend.triton:
            self.model.ops = self.lora.wrap_ops(model_ops(self.backend, self.config.head_dim), self.config, decode_lora_in_ops)
            if fp8_compute(self.device):
                for module in self.model.modules():  # FP8 projections (engine.quant): decode rows read their FP8 bytes
                    if isinstance(module, Fp8Linear):
                        module.decode = self.backend.fp8_linear
                        module.prefill = functools.partial(scaled_linear, quantize=self.backend.fp8_quantize_rows)
        # One block more than the block manager hands out: the padding rows of a graphed decode batch use it.
        self.kv = KVCache(
            num_layers=self.config.num_layers,
            num_blocks=kv_num_blocks + 1,
            block_size=kv_block_size,
            num_kv_heads=self.config.num_kv_heads,
            head_dim=self.config.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        self.blocks = BlockManager(kv_num_blocks, kv_block_size, prefix_caching=prefix_caching, tenant_quota=tenant_quota_blocks)
        self.graphs: DecodeGraphs | None = None
        if graph_sizes:
            assert max_blocks_per_seq > 0, max_blocks_per_seq
            self.graphs = DecodeGraphs(
                self.model, self.lora, self.kv, sizes=graph_sizes, max_blocks=max_blocks_per_seq, scratch_block=kv_num_blocks,
                block_table=self.blocks.block_table,
                capture=self.device.type == "cuda" if capture_graphs is None else capture_graphs, max_chain=max_chain,
            )  # fmt: skip
        self.mixed: MixedGraphs | None = None
        if graph_sizes and prompt_graph_tokens:
            self.mixed = MixedGraphs(
                self.model, self.lora, self.kv, batch=graph_sizes[-1], max_tokens=prompt_graph_tokens,
                max_blocks=max_blocks_per_seq, scratch_block=kv_num_blocks, block_table=self.blocks.block_table,
                capture=self.graphs.capture, pool=self.graphs._pool,
            )  # fmt: skip
        self._graph_lora_us: int | None = None  # the last step's calibrated LoRA share when it was a replay

    def begin_step(self) -> None:
        """Reset the LoRA time of the step about to run."""
        self.lora.timer.reset()
        self._graph_lora_us = None

    def lora_us(self) -> int:
        """LoRA device time of the steps since `begin_step`: measured with events in eager mode, the bucket's
        calibrated share after a graph replay (engine.cuda_graphs, "Timing")."""
        return self._graph_lora_us if self._graph_lora_us is not None else self.lora.timer.elapsed_us()

    @torch.inference_mode()
    def prepare(self, items: list[BatchItem]) -> None:
        """Work a step may need once, done before the engine times the step: the compute stream's wait for the copies of
        the step's adapters still on the side stream (their time is the loads', billed as cold starts; queued inside the
        step's timed section, the GPU's wait for a copy started at the request's admission was measured as the step's
        time as well, and split over every request of the step), capturing a graph bucket's graphs, or measuring the
        plain consumer ops at an eager LoRA step's row count (engine.lora, "Attribution")."""
        self.lora.wait_ready(it.lora_slot for it in items if it.lora_slot >= 0)
        if self.graphs is not None and self.graphs.fits(items):
            if not self.graphs.captured(items):
                self._ensure_blocks(items)
                self.graphs.prepare(items)
        elif self.mixed is not None and self.mixed.fits(items):
            if not self.mixed.captured(items):
                self._ensure_blocks(items)
                self.mixed.prepare(items)
        elif self.lora.calibration is not None and any(it.lora_slot >= 0 for it in items) and any(len(it.token_ids) > 1 for it in items):
            self.lora.calibration.prepare(sum(len(it.token_ids) for it in items))

    @torch.inference_mode()
    def capture_graphs(self, slots: list[int]) -> int:
        """Every bucket's graphs not captured yet (`prepare_all` of engine.cuda_graphs and engine.mixed_graphs); 0
        without graphs."""
        if self.graphs is None:
            return 0
        self.lora.wait_ready(slots)
        return self.graphs.prepare_all(slots) + (self.mixed.prepare_all(slots) if self.mixed is not None else 0)

    @torch.inference_mode()
    def forward(self, items: list[BatchItem], *, all_logits: bool = False) -> torch.Tensor:
        """Run one forward over every item's new tokens; logits [M, vocab] fp32 for the last token of each
        item with `logits` set (or [N, vocab] for every token with `all_logits`). A graph replay's is a view of the
        graphs' static logits buffer: read it (or copy it) before the next forward.

        Block tables must cover each item's context + new tokens; items of sequences the block manager
        does not know yet are opened uncached (tests drive the runner that way; the engine's scheduler
        grows every table before the step, with prefix hits and quotas).
        """
        self._ensure_blocks(items)
        self.lora.wait_ready(it.lora_slot for it in items if it.lora_slot >= 0)
        if self.graphs is not None and not all_logits and self.graphs.fits(items):
            out = self.graphs.run(items, _logit_rows(items, [1] * len(items)))
            self._graph_lora_us = self.graphs.last_lora_us
            return out
        if self.mixed is not None and not all_logits and self.mixed.fits(items):
            out = self.mixed.run(items, _logit_rows(items, [len(it.token_ids) for it in items]))
            self._graph_lora_us = self.mixed.last_lora_us
            return out
        return self._eager(items, all_logits)

    def can_chain(self, items: list[BatchItem], steps: int) -> bool:
        """Whether `steps` decode steps of `items` can run as one graph chain (DecodeGraphs.run_chain)."""
        return self.graphs is not None and self.graphs.fits(items, steps)

    @torch.inference_mode()
    def decode_chain(self, items: list[BatchItem], steps: int, sample: Callable[[torch.Tensor], torch.Tensor],
                     section: Callable[[int], AbstractContextManager], first_ids: torch.Tensor | None = None) -> list[torch.Tensor]:  # fmt: skip
        """`steps` decode steps of `items` back to back on the device (DecodeGraphs.run_chain): each step's sampled
        tokens [batch] as device tensors. Every item's blocks must cover context + steps tokens."""
        assert self.graphs is not None
        self._ensure_blocks(items)
        self.lora.wait_ready(it.lora_slot for it in items if it.lora_slot >= 0)
        chosen = self.graphs.run_chain(items, steps, sample, section, first_ids)
        self._graph_lora_us = self.graphs.last_lora_us
        return chosen

    def free(self, seq_id: Hashable) -> None:
        """Release a finished, aborted or preempted sequence's KV blocks."""
        self.blocks.free(seq_id)

    # ---- internals

    def _ensure_blocks(self, items: list[BatchItem]) -> None:
        assert items, "empty batch"
        blocks = self.blocks
        for it in items:
            assert it.token_ids, f"{it.seq_id!r}: no new tokens"
            total = it.context_len + len(it.token_ids)
            if it.seq_id not in blocks or blocks.num_tokens(it.seq_id) < total:
                blocks.ensure(it.seq_id, total)

    def _eager(self, items: list[BatchItem], all_logits: bool) -> torch.Tensor:
        query_lens = [len(it.token_ids) for it in items]
        context_lens = [it.context_len for it in items]
        tables = [self.blocks.block_table(it.seq_id) for it in items]
        ids = [t for it in items for t in it.token_ids]
        token_slots = [it.lora_slot for it, q in zip(items, query_lens) for _ in range(q)]  # [N] adapter slot per token
        lora = any(s >= 0 for s in token_slots)
        rows = None if all_logits else _logit_rows(items, query_lens)
        if self.backend.triton:
            attn, input_ids, pos, row_slots, logit_rows = self._triton_metadata(items, query_lens, context_lens, tables, ids, rows)
            if not lora:
                segments = None
            elif max(query_lens) == 1:
                segments = segments_per_row(row_slots)  # decode rows: one group each, no host work
            else:
                segments = segments_from_indices(token_slots, device=self.device)  # runs of one sequence's tokens
            self.lora.set_batch(segments=segments)
        else:
            attn = build_attention_metadata(self.kv, query_lens, context_lens, tables)
            positions = [p for it in items for p in range(it.context_len, it.context_len + len(it.token_ids))]
            input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)  # [N]
            pos = torch.tensor(positions, dtype=torch.int64, device=self.device)  # [N]
            logit_rows = None if rows is None else torch.tensor(rows, dtype=torch.int64, device=self.device)  # [M]
            self.lora.set_batch(slot_idx=torch.tensor(token_slots, dtype=torch.int64, device=self.device) if lora else None)
        try:
            logits = self.model(input_ids, pos, attn, logit_rows)
            assert self.lora.pending is None, "a LoRA delta was left pending: its consumer op did not run"
            return logits
        finally:
            self.lora.set_batch()

    def _triton_metadata(self, items, query_lens, context_lens, tables, ids, rows):
        """Kernel metadata for an eager step, all int64, built on the host in numpy and moved in one copy:
        (attention metadata, input ids [N], positions [N], adapter slot per item [B], logit rows [M] or None).

        numpy, not torch CPU ops: on the 16-core H200 host, torch's CPU indexing of a 4096-token prefill took
        ~3.5 ms a call (its thread pool), against ~0.1 ms here, and the GPU waits for all of it."""
        bs = self.kv.block_size
        batch, n = len(items), len(ids)
        q = np.asarray(query_lens, dtype=np.int64)  # [B]
        ctx = np.asarray(context_lens, dtype=np.int64)  # [B]
        width = max(len(t) for t in tables)
        table = np.zeros((batch, width), dtype=np.int64)  # [B, width]
        for i, t in enumerate(tables):
            table[i, : len(t)] = t
        cu = np.zeros(batch + 1, dtype=np.int64)
        np.cumsum(q, out=cu[1:])  # [B + 1] first token of each item
        seq_of = np.repeat(np.arange(batch), q)  # [N] item of each token
        pos = np.arange(n) - cu[:-1][seq_of] + ctx[seq_of]  # [N] position of each token in its sequence
        slot_mapping = table[seq_of, pos // bs] * bs + pos % bs  # [N]
        item_slots = np.asarray([it.lora_slot for it in items], dtype=np.int64)  # [B]
        logit = np.asarray(rows if rows is not None else [], dtype=np.int64)  # [M]
        parts = [np.asarray(ids, dtype=np.int64), pos, slot_mapping, ctx + q, cu, item_slots, logit, table.ravel()]
        flat = torch.from_numpy(np.concatenate(parts)).to(self.device, non_blocking=True)
        views = flat.split([p.size for p in parts])
        input_ids, pos_d, slot_d, seq_lens, cu_d, item_slots_d, logit_d, table_d = views
        decode = max(query_lens) == 1
        attn = AttentionMetadata(
            kv_cache=self.kv,
            slot_mapping=slot_d,
            kernel=self.backend.paged_attention,
            block_table=table_d.view(batch, width),
            seq_lens=seq_lens,
            cu_seqlens_q=None if decode else cu_d,
            max_query_len=max(query_lens),
        )
        return attn, input_ids, pos_d, item_slots_d, None if rows is None else logit_d


def _logit_rows(items: list[BatchItem], query_lens: list[int]) -> list[int]:
    """Flat index of the last token of each item that wants logits."""
    rows, end = [], -1
    for it, q in zip(items, query_lens):
        end += q
        if it.logits:
            rows.append(end)
    return rows


def model_ops(backend: KernelBackend, head_dim: int) -> ModelOps:
    """The fused kernels of the triton backend as the model's ops; RoPE + KV write stays composite for head sizes
    that are not a power of two (the kernels load whole halves of a head), and so does a decode step's attention."""
    pow2 = head_dim & (head_dim - 1) == 0
    return ModelOps(add_rms_norm=backend.add_rms_norm, rope_and_cache=backend.rope_and_cache if pow2 else None, silu_mul=backend.silu_mul,
                    decode_rope_attention=backend.decode_rope_attention if pow2 else None)  # fmt: skip
