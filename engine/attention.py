"""Attention over the paged KV cache for a flat batch of sequences, and the metadata it reads.

Two backends, picked once per engine (engine.backend) and carried by the step's metadata:

- triton (CUDA; the CPU too under TRITON_INTERPRET=1, for tests): one launch of
  kernels/paged_attention.py per layer for the whole batch, decode rows, prefill chunks over a cached
  prefix and mixes of both. Its metadata is a handful of device tensors (padded block tables, sequence
  lengths, query offsets), so a decode step's metadata can live in static buffers and the step can be a
  CUDA-graph replay (engine.cuda_graphs).
- torch (the CPU default): for each sequence, gather its blocks into contiguous K/V and call torch SDPA,
  one call per sequence; exact fp32, the reference the tests compare the kernels with.

Either way the new tokens' K/V are written into the layer's pool first (`write_kv`, an `index_copy_`
through the flat slot of each token, or kernels/rope_cache.py fused with RoPE), and the metadata is
built once per step and shared by every layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.kv_cache import KVCache

# Backends chosen once, cuDNN left out: its SDPA builds an execution graph for every new shape (~0.55 ms
# of CPU per call on an H200), and with one call per sequence every KV length is new at every step. On
# the demo model, 32 sequences with mixed adapters in bf16, that made a decode step ~65 ms; without it
# the median step is ~20 ms. Flash serves bf16/fp16, memory-efficient fp32 and masked calls, math the rest.
_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass
class AttentionMetadata:
    kv_cache: KVCache
    slot_mapping: torch.Tensor  # [N] int64: flat pool slot of each new token
    # ---- torch backend: per-sequence host lists
    query_lens: list[int] = field(default_factory=list)  # [B] new tokens of each sequence in this step, in flat-batch order
    context_lens: list[int] = field(default_factory=list)  # [B] tokens of each sequence already in the cache before this step
    block_tables: list[torch.Tensor] = field(default_factory=list)  # B x [blocks of that sequence] int64
    masks: list[torch.Tensor | None] = field(default_factory=list)  # B x [q_len, context + q_len] bool, None where SDPA's modes suffice
    # ---- triton backend: the kernel and its device tensors
    kernel: Callable[..., torch.Tensor] | None = None  # kernels.paged_attention.paged_attention; None: the torch loop
    block_table: torch.Tensor | None = None  # [B, max_blocks] int32/int64, padded; entries past a sequence's length never read
    seq_lens: torch.Tensor | None = None  # [B] int32/int64: context + query tokens
    cu_seqlens_q: torch.Tensor | None = None  # [B + 1] int32 query offsets; None: decode, sequence b is row b
    max_query_len: int = 1


def build_attention_metadata(
    kv_cache: KVCache,
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
) -> AttentionMetadata:
    """Torch-backend metadata for one step; each block table must already cover context + query tokens."""
    assert len(query_lens) == len(context_lens) == len(block_tables), (len(query_lens), len(context_lens), len(block_tables))
    bs = kv_cache.block_size
    device = kv_cache.k[0].device
    slots: list[int] = []
    masks: list[torch.Tensor | None] = []
    for q_len, ctx, table in zip(query_lens, context_lens, block_tables):
        assert q_len > 0 and len(table) * bs >= ctx + q_len, (q_len, ctx, len(table), bs)
        slots.extend(table[p // bs] * bs + p % bs for p in range(ctx, ctx + q_len))
        if q_len == 1 or ctx == 0:
            masks.append(None)  # decode sees every cached key; a fresh prefill is plain causal
        else:
            # Query i sits at position ctx + i and sees keys 0 .. ctx + i: a causal mask shifted by ctx
            # (SDPA's is_causal aligns the top-left corner, which is only right when ctx == 0).
            q_pos = torch.arange(ctx, ctx + q_len, device=device)[:, None]  # [q, 1]
            k_pos = torch.arange(ctx + q_len, device=device)[None, :]  # [1, ctx + q]
            masks.append(k_pos <= q_pos)  # [q, ctx + q]
    return AttentionMetadata(
        kv_cache=kv_cache,
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_lens=list(query_lens),
        context_lens=list(context_lens),
        block_tables=[torch.tensor(t, dtype=torch.int64, device=device) for t in block_tables],
        masks=masks,
    )


def write_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write the new tokens' rotated keys and values [N, KV, D] into a layer's pools [blocks, bs, KV, D] at their
    flat slots (the composite path; kernels/rope_cache.py does this fused with RoPE)."""
    kv_heads, head_dim = k.shape[1], k.shape[2]
    k_pool.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_pool.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def attend(
    q: torch.Tensor,  # [N, H, D] rotated queries of the step's new tokens
    layer: int,
    attn: AttentionMetadata,
) -> torch.Tensor:
    """Attend each sequence's queries over its whole cache, the new tokens' K/V already written (write_kv)."""
    n, heads, head_dim = q.shape
    assert n == attn.slot_mapping.numel(), (n, attn.slot_mapping.numel())
    k_pool, v_pool = attn.kv_cache.k[layer], attn.kv_cache.v[layer]  # [blocks, bs, KV, D]
    kv_heads = k_pool.shape[2]
    if attn.kernel is not None:
        return attn.kernel(q, k_pool, v_pool, attn.block_table, attn.seq_lens, cu_seqlens_q=attn.cu_seqlens_q,
                           max_query_len=attn.max_query_len)  # fmt: skip

    out = torch.empty_like(q)  # [N, H, D]
    start = 0
    with sdpa_kernel(_SDPA_BACKENDS):
        for q_len, ctx, table, mask in zip(attn.query_lens, attn.context_lens, attn.block_tables, attn.masks):
            total = ctx + q_len
            k_seq = k_pool[table].flatten(0, 1)[:total]  # [T, KV, D]
            v_seq = v_pool[table].flatten(0, 1)[:total]  # [T, KV, D]
            o = F.scaled_dot_product_attention(
                q[start : start + q_len].transpose(0, 1)[None],  # [1, H, q, D]
                k_seq.transpose(0, 1)[None],  # [1, KV, T, D]
                v_seq.transpose(0, 1)[None],
                attn_mask=mask,
                is_causal=mask is None and q_len > 1,
                enable_gqa=kv_heads != heads,  # query heads h*G .. h*G+G-1 share KV head h, as HF's repeat_kv
            )  # [1, H, q, D]
            out[start : start + q_len] = o[0].transpose(0, 1)
            start += q_len
    return out
