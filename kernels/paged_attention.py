"""Paged attention over a block-table KV cache, for decode and for prefill over a cached prefix, one launch.

Semantics: o[q_b + i, h] = softmax(q[q_b + i, h] . K_b[:p + 1, h // G]^T * scale) V_b[:p + 1, h // G] for
sequence b's query token i at position p = seq_lens[b] - query_len_b + i, where K_b / V_b are the
sequence's keys and values gathered through its block table and G = heads / kv_heads.

Decode is the case query_len_b = 1 for all b (cu_seqlens_q None); a prefill chunk attends causally to its
cached prefix and to itself. The maths are the same, so one kernel and one launcher serve both, and a
batch that mixes prefill chunks and decode tokens (chunked prefill) is one launch. The new tokens' K/V
must already be in the cache (kernels/rope_cache.py writes them first), except in a decode step's fused form below.

RoPE and the KV write (`decode_rope_attention`): a decode step can start from the fused projection's rows
qkv [B, (H + 2 KV) * D] instead, as kernels/rope_cache.py and then this kernel would (that kernel's Semantics: the
rotation in fp32, q and k rounded once to their dtypes). Each program rotates its G query heads and its KV
head's new key in registers, attends over the cached keys before the new token's position, then adds the new key's
term to the online softmax from registers; the program whose key range holds that position (the only one, or the
last non-empty split) also writes the new k and v into the cache for later steps. No program of the launch reads
that slot, so nothing orders the write against the reads. One launch a layer instead of two (16 a step at llama-1b,
32 at -8b), and q never goes through memory. Prefill chunks keep the two kernels: their new keys are many.

LoRA (`decode_rope_attention(..., lora=LoraDelta)`): with adapters, qkv arrives without its delta, and each program
adds the delta of the columns it reads first: for its G query heads (and the rotate-half partners of their columns),
its KV head's k (and partners) and v, scale * t[s, b, :r_s] @ B_s[slot_b, :r_s, cols] through the slot's page tables
(kernels.lora_segments.LoraPages), in fp32, each sum rounded once to the dtype as kernels.lora_expand rounds qkv; then
RoPE and the rest as above. A decode step then has no expand launch for qkv (engine.lora, "Decode"): a program reads
(G + 2) x D of B's columns per rank, e.g. 12 KB at llama-1b rank 16, where the expand was one more launch a layer.

Cache layout: the engine's `[num_blocks, block_size, kv_heads, head_dim]` per layer, kept as it is: one
token of one KV head is head_dim contiguous elements (128 B for bf16 at head_dim 64, 256 B at 128),
whole cache lines, so reading one head's keys token by token coalesces as well as a head-major
`[num_blocks, kv_heads, block_size, head_dim]` block would, and the engine's `index_copy_` of new K/V
stays one flat write. The key tile (BLOCK_N keys) is independent of block_size: each key finds its
block through the table (block_tables[b, n // block_size]), so 16-token blocks still give 64- or
128-key tiles.

Algorithm: FlashAttention-2's online softmax (Dao, 2023, arXiv:2307.08691) over key tiles, in fp32
(running max m, running sum l, rescaled accumulator), base 2 with log2(e) folded into the scale. GQA:
one program takes one KV head and all G query heads that share it, stacked with BLOCK_T query tokens into
the rows of one tile (row = token * G_PAD + head), so each K/V tile is read once for the G heads (4 at
llama-1b and -8b) instead of G times. Decode fills a 16-row tile (tensor-core minimum) with 16 / G_PAD
token slots of which one is live: the padding costs arithmetic, not bytes, and decode is bound by bytes.

Interpreter: on CPU (the Triton interpreter) the dot operands are widened to fp32, since the
interpreter multiplies the raw bit patterns of bf16 in `tl.dot` (triton-lang/triton#11584); on CUDA
fp16/bf16 tiles go to the tensor cores as they are, and P is rounded to V's dtype (as FlashAttention-2).
fp32 inputs are multiplied in IEEE fp32, not TF32.

Decode splits a sequence's keys over several programs when the batch alone would not fill the GPU
(Flash-Decoding, Dao et al., 2023): batch x kv_heads programs is 256 for 32 sequences at 8 KV heads, two
per SM, each walking its keys tile after dependent tile, and llama-8b decode at 544 cached tokens ran
at ~1/3 of the copy bandwidth that way (48.8 µs a layer against a 16.6 µs floor, engine/PERF.md). With
S splits, program (s, kv head, sequence) takes whole key tiles s * chunk .. (s + 1) * chunk - 1, chunk
= cdiv(cdiv(keys, S), BLOCK_N) * BLOCK_N, and stores its unnormalised accumulator and its running max and
sum in fp32; `_combine_splits_kernel` rescales the S partials to their common max and divides once. An
empty split (a short sequence) stores max -1e30 and sum 0 and weighs nothing. S is a launch constant
(`decode_splits`, from the batch and the block table's width), so one CUDA graph serves every context.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.lora_segments import LoraDelta
from kernels.utils import TL_DTYPE, cdiv, next_power_of_2

_LOG2E = 1.4426950408889634
_NEG_BIG = tl.constexpr(-1.0e30)  # start of the running max: finite, so a fully masked padding row gives 0, not NaN


@triton.jit
def _paged_attention_kernel(
    q_ptr,  # [N, H, D]
    k_ptr,  # [num_blocks, block_size, KV, D]
    v_ptr,  # [num_blocks, block_size, KV, D]
    o_ptr,  # [N, H, D]
    table_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32: tokens in the cache for each sequence, this step's included
    cu_q_ptr,  # [B + 1] int32: first query row of each sequence, then N; unused when HAS_CU_Q is False
    part_o_ptr,  # [NUM_SPLITS, N, H, D] fp32 unnormalised partial outputs (decode with NUM_SPLITS > 1)
    part_ml_ptr,  # [NUM_SPLITS, N, H, 2] fp32 running max and sum of each partial
    pos_ptr,  # [N] int: each new token's position (ROPE only)
    inv_freq_ptr,  # [D / 2] fp32 (ROPE only)
    new_slot_ptr,  # [N] int: each new token's flat cache slot (ROPE only)
    lora_t_ptr,  # [3, N, R] fp32: the qkv shrink's t (LORA only; kernels.lora_segments.LoraDelta)
    lora_pool_ptr,  # [E] the adapters' pages (LORA only; kernels.lora_segments.LoraPages)
    lora_page_ptr,  # [slots, 3, R] int64: q's, k's and v's page tables
    lora_rank_ptr,  # [slots, 3]
    lora_scale_ptr,  # [slots] fp32
    lora_slot_ptr,  # [N] int: each row's slot, -1 for none
    qk_scale,  # softmax scale * log2(e)
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_table,
    stride_lti, stride_ltm,
    stride_lps, stride_lpi, stride_lpr,
    stride_lrs, stride_lri,
    b_off_q, b_off_k, b_off_v,  # each slice's B row of this layer inside a page
    HAS_CU_Q: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # GROUP rounded up to a power of two
    BLOCK_T: tl.constexpr,  # query tokens per program
    ROWS: tl.constexpr,  # BLOCK_T * GROUP_PAD: rows of the query tile
    BLOCK_N: tl.constexpr,  # keys per step
    BLOCK_D: tl.constexpr,  # head_dim rounded up to a power of two
    HEAD_DIM: tl.constexpr,
    KV_BLOCK: tl.constexpr,  # the cache's block_size
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    NUM_SPLITS: tl.constexpr,  # decode only: key ranges per sequence, each its own program (Flash-Decoding)
    EARLY_V: tl.constexpr,  # issue a tile's V load beside its K load, before the softmax (see Decode latency)
    ROPE: tl.constexpr,  # decode from the fused projection: q_ptr is qkv [N, (H + 2 KV) D] (see RoPE and the KV write)
    NUM_HEADS: tl.constexpr,  # H: where k and v start in a qkv row (ROPE only)
    NUM_KV: tl.constexpr,  # KV (ROPE only)
    LORA: tl.constexpr,  # ROPE only: add the rows' qkv LoRA delta first (see LoRA)
    LORA_R: tl.constexpr,  # ranks gathered per step of the delta's loop
):
    pid_t = tl.program_id(0)  # query-token tile of the sequence; with NUM_SPLITS > 1 (decode), the key split
    kv_head = tl.program_id(1)
    seq = tl.program_id(2)
    if HAS_CU_Q:
        q_begin = tl.load(cu_q_ptr + seq)
        q_len = tl.load(cu_q_ptr + seq + 1) - q_begin
    else:
        q_begin = seq
        q_len = 1
    t0 = 0
    if NUM_SPLITS == 1:
        t0 = pid_t * BLOCK_T
    if t0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len  # cached tokens before the first query token

    offs_row = tl.arange(0, ROWS)  # [M] row = token slot * GROUP_PAD + head in group
    tok = t0 + offs_row // GROUP_PAD  # [M] query index within the sequence
    head = kv_head * GROUP + offs_row % GROUP_PAD  # [M]
    row_ok = (tok < q_len) & (offs_row % GROUP_PAD < GROUP)
    q_pos = context + tok  # [M] position of each row's query token
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    q_rows = (q_begin + tok).to(tl.int64) * stride_qt + head * stride_qh  # [M]
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :] * stride_qd, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if ROPE:  # q rotated here, rounded to its dtype as the separate kernel stores it; the new k and v kept in registers
        half = HEAD_DIM // 2
        angle = tl.load(pos_ptr + seq).to(tl.float32) * tl.load(inv_freq_ptr + offs_d % half)  # [D]: j = d mod D/2
        cos, sin = tl.cos(angle), tl.sin(angle)
        partner = tl.where(offs_d < half, offs_d + half, offs_d - half)  # rotate_half: x2 for the first half, x1 for the second
        sign = tl.where(offs_d < half, -1.0, 1.0)
        q_par = tl.load(q_ptr + q_rows[:, None] + partner[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
        kv_row = q_ptr + seq.to(tl.int64) * stride_qt + (NUM_HEADS + kv_head) * HEAD_DIM  # this KV head's k in the qkv row
        k_raw = tl.load(kv_row + offs_d)
        k_par = tl.load(kv_row + partner)
        v_new = tl.load(kv_row + NUM_KV * HEAD_DIM + offs_d)  # [D]
        if LORA:  # q, k and v (and the halves they rotate with) plus the row's delta, each rounded once (see LoRA)
            dq, dq_par, dk, dk_par, dv = _qkv_delta(
                lora_t_ptr + seq.to(tl.int64) * stride_ltm, lora_pool_ptr, lora_page_ptr, lora_rank_ptr, lora_scale_ptr,
                tl.load(lora_slot_ptr + seq), kv_head, stride_lti, stride_lps, stride_lpi, stride_lpr, stride_lrs,
                stride_lri, b_off_q, b_off_k, b_off_v, GROUP, GROUP_PAD, HEAD_DIM, LORA_R)  # fmt: skip
            q = _with_rows(q, dq, BLOCK_T, GROUP_PAD, HEAD_DIM)
            q_par = _with_rows(q_par, dq_par, BLOCK_T, GROUP_PAD, HEAD_DIM)
            q = q.to(q_ptr.dtype.element_ty)
            q_par = q_par.to(q_ptr.dtype.element_ty).to(tl.float32)
            k_raw = (k_raw.to(tl.float32) + dk).to(q_ptr.dtype.element_ty)
            k_par = (k_par.to(tl.float32) + dk_par).to(q_ptr.dtype.element_ty)
            v_new = (v_new.to(tl.float32) + dv).to(q_ptr.dtype.element_ty)
        q = (q.to(tl.float32) * cos[None, :] + sign[None, :] * q_par * sin[None, :]).to(q_ptr.dtype.element_ty)
        k_new = k_raw.to(tl.float32) * cos + sign * k_par.to(tl.float32) * sin
        k_new = k_new.to(k_ptr.dtype.element_ty)  # [D], as the cache holds it
    q = q.to(DOT_DTYPE)  # [M, D]

    m_i = tl.full((ROWS,), _NEG_BIG, dtype=tl.float32)  # running max, base-2 units
    l_i = tl.zeros((ROWS,), dtype=tl.float32)  # running sum of exp2
    acc = tl.zeros((ROWS, BLOCK_D), dtype=tl.float32)  # [M, D]

    # Keys 0 .. kv_end - 1: up to the position of this tile's last query token.
    kv_end = context + tl.minimum(t0 + BLOCK_T, q_len)
    kv_begin = 0
    if NUM_SPLITS > 1:  # this program's share: whole key tiles, the last split shorter or empty
        chunk = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
        kv_begin = pid_t * chunk
        kv_end = tl.minimum(kv_end, kv_begin + chunk)
    table_row = table_ptr + seq.to(tl.int64) * stride_table
    loop_end = kv_end
    if ROPE:  # the new token's key (at position `context`) comes from registers, after the cached ones
        loop_end = tl.minimum(kv_end, context)
    for n0 in range(kv_begin, loop_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)  # [BN] key positions
        n_ok = offs_n < loop_end
        block = tl.load(table_row + offs_n // KV_BLOCK, mask=n_ok, other=0).to(tl.int64)  # [BN]
        k_rows = block * stride_kb + (offs_n % KV_BLOCK) * stride_ks + kv_head * stride_kh  # [BN]
        kt = tl.load(k_ptr + k_rows[None, :] + offs_d[:, None] * stride_kd, mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        v_rows = block * stride_vb + (offs_n % KV_BLOCK) * stride_vs + kv_head * stride_vh  # [BN]
        if EARLY_V:
            vt = tl.load(v_ptr + v_rows[:, None] + offs_d[None, :] * stride_vd, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        s = tl.dot(q, kt.to(DOT_DTYPE), input_precision=DOT_PRECISION) * qk_scale  # [M, BN] fp32, base-2 logits
        visible = n_ok[None, :] & (offs_n[None, :] <= q_pos[:, None])  # causal, shifted by the context
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # [M]
        alpha = tl.exp2(m_i - m_new)  # rescales what was summed under the old max
        p = tl.exp2(s - m_new[:, None])  # [M, BN]; 0 where masked
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if not EARLY_V:
            vt = tl.load(v_ptr + v_rows[:, None] + offs_d[None, :] * stride_vd, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), vt.to(DOT_DTYPE), input_precision=DOT_PRECISION)  # [M, D]
        m_i = m_new

    if ROPE:
        if (kv_begin <= context) & (context < kv_end):  # the one program (of the splits) whose keys hold the new token
            # Into the cache for the steps after this one; nothing in this launch reads that slot (every program's
            # loop stops before `context`), so no ordering between programs is needed.
            slot = tl.load(new_slot_ptr + seq).to(tl.int64)
            cache_at = (slot // KV_BLOCK) * stride_kb + (slot % KV_BLOCK) * stride_ks + kv_head * stride_kh
            tl.store(k_ptr + cache_at + offs_d * stride_kd, k_new)
            tl.store(v_ptr + (slot // KV_BLOCK) * stride_vb + (slot % KV_BLOCK) * stride_vs + kv_head * stride_vh + offs_d * stride_vd, v_new)
            s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * qk_scale  # [M] exact products, fp32 sum
            m_new = tl.maximum(m_i, s_new)
            alpha = tl.exp2(m_i - m_new)
            p_new = tl.exp2(s_new - m_new).to(DOT_DTYPE).to(tl.float32)  # rounded as the tiles' P is for their dot
            l_i = l_i * alpha + tl.exp2(s_new - m_new)
            acc = acc * alpha[:, None] + p_new[:, None] * v_new.to(tl.float32)[None, :]
            m_i = m_new

    if NUM_SPLITS > 1:  # the partial as it is; _combine_splits_kernel merges the splits
        part_rows = ((pid_t * tl.num_programs(2) + q_begin + tok).to(tl.int64) * GROUP * tl.num_programs(1) + head)  # [M]
        mask = row_ok[:, None] & d_ok[None, :]
        tl.store(part_o_ptr + part_rows[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=mask)
        tl.store(part_ml_ptr + part_rows * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part_rows * 2 + 1, l_i, mask=row_ok)
        return
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # padding rows have l = 0 and are not stored
    o_rows = (q_begin + tok).to(tl.int64) * stride_ot + head * stride_oh  # [M]
    tl.store(
        o_ptr + o_rows[:, None] + offs_d[None, :] * stride_od,
        out.to(o_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )



@triton.jit
def _qkv_delta(t_row, pool_ptr, page_ptr, rank_ptr, scale_ptr, slot, kv_head, stride_ti, stride_ps, stride_pi, stride_pr,
               stride_rs, stride_ri, b_off_q, b_off_k, b_off_v, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
               HEAD_DIM: tl.constexpr, LORA_R: tl.constexpr):
    """scale * t[s, row, :r_s] @ B_s[slot, :r_s, cols] in fp32 for one program's columns: its G query heads (flat
    [GROUP_PAD * D], head-major, padding heads 0) and their rotate-half partners, its KV head's k and partner, and v.
    Zeros for slot -1 and for slices the adapter does not target (rank 0). t_row: t[0, row] (ranks contiguous)."""
    safe = tl.maximum(slot, 0).to(tl.int64)
    rank_q = tl.where(slot >= 0, tl.load(rank_ptr + safe * stride_rs), 0)
    rank_k = tl.where(slot >= 0, tl.load(rank_ptr + safe * stride_rs + stride_ri), 0)
    rank_v = tl.where(slot >= 0, tl.load(rank_ptr + safe * stride_rs + 2 * stride_ri), 0)
    scale = tl.load(scale_ptr + safe).to(tl.float32)
    half = HEAD_DIM // 2
    offs_d = tl.arange(0, HEAD_DIM)
    offs_c = tl.arange(0, GROUP_PAD * HEAD_DIM)  # (head in group, d), head-major
    c_d = offs_c % HEAD_DIM
    c_ok = offs_c // HEAD_DIM < GROUP
    q_col = kv_head * GROUP * HEAD_DIM + offs_c  # column in the q slice
    q_par_col = q_col - c_d + tl.where(c_d < half, c_d + half, c_d - half)
    k_col = kv_head * HEAD_DIM + offs_d  # column in the k and v slices
    k_par_col = kv_head * HEAD_DIM + tl.where(offs_d < half, offs_d + half, offs_d - half)
    pages = page_ptr + safe * stride_ps
    dq = tl.zeros((GROUP_PAD * HEAD_DIM,), dtype=tl.float32)
    dq_par = tl.zeros((GROUP_PAD * HEAD_DIM,), dtype=tl.float32)
    dk = tl.zeros((HEAD_DIM,), dtype=tl.float32)
    dk_par = tl.zeros((HEAD_DIM,), dtype=tl.float32)
    dv = tl.zeros((HEAD_DIM,), dtype=tl.float32)
    for r0 in range(0, tl.maximum(rank_q, tl.maximum(rank_k, rank_v)), LORA_R):
        offs_r = r0 + tl.arange(0, LORA_R)  # [LR]
        in_q, in_k, in_v = offs_r < rank_q, offs_r < rank_k, offs_r < rank_v
        t_q = tl.load(t_row + offs_r, mask=in_q, other=0.0)
        t_k = tl.load(t_row + stride_ti + offs_r, mask=in_k, other=0.0)
        t_v = tl.load(t_row + 2 * stride_ti + offs_r, mask=in_v, other=0.0)
        p_q = tl.load(pages + offs_r * stride_pr, mask=in_q, other=0) + b_off_q  # [LR] each rank row's B of this layer
        p_k = tl.load(pages + stride_pi + offs_r * stride_pr, mask=in_k, other=0) + b_off_k
        p_v = tl.load(pages + 2 * stride_pi + offs_r * stride_pr, mask=in_v, other=0) + b_off_v
        m_q = in_q[:, None] & c_ok[None, :]
        b_q = tl.load(pool_ptr + p_q[:, None] + q_col[None, :], mask=m_q, other=0.0).to(tl.float32)  # [LR, G_PAD * D]
        b_q_par = tl.load(pool_ptr + p_q[:, None] + q_par_col[None, :], mask=m_q, other=0.0).to(tl.float32)
        b_k = tl.load(pool_ptr + p_k[:, None] + k_col[None, :], mask=in_k[:, None], other=0.0).to(tl.float32)  # [LR, D]
        b_k_par = tl.load(pool_ptr + p_k[:, None] + k_par_col[None, :], mask=in_k[:, None], other=0.0).to(tl.float32)
        b_v = tl.load(pool_ptr + p_v[:, None] + k_col[None, :], mask=in_v[:, None], other=0.0).to(tl.float32)
        dq += tl.sum(t_q[:, None] * b_q, axis=0)
        dq_par += tl.sum(t_q[:, None] * b_q_par, axis=0)
        dk += tl.sum(t_k[:, None] * b_k, axis=0)
        dk_par += tl.sum(t_k[:, None] * b_k_par, axis=0)
        dv += tl.sum(t_v[:, None] * b_v, axis=0)
    return dq * scale, dq_par * scale, dk * scale, dk_par * scale, dv * scale


@triton.jit
def _with_rows(q, delta, BLOCK_T: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr):
    """q [BLOCK_T * GROUP_PAD, D] (row = token slot * GROUP_PAD + head) in fp32 plus the heads' delta [GROUP_PAD * D] on
    every token slot's rows (decode has one live slot; the others are masked where they are stored)."""
    d3 = tl.broadcast_to(tl.reshape(delta, (1, GROUP_PAD, HEAD_DIM)), (BLOCK_T, GROUP_PAD, HEAD_DIM))
    return q.to(tl.float32) + tl.reshape(d3, (BLOCK_T * GROUP_PAD, HEAD_DIM))


@triton.jit
def _combine_splits_kernel(
    part_o_ptr,  # [S, N, H, D] fp32
    part_ml_ptr,  # [S, N, H, 2] fp32
    o_ptr,  # [N, H, D]
    rows,  # N * H
    stride_ot, stride_oh,
    H: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # token * H + head
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    m = tl.load(part_ml_ptr + (offs_s * rows + row) * 2)  # [S] base-2 running maxima; -1e30 for an empty split
    l = tl.load(part_ml_ptr + (offs_s * rows + row) * 2 + 1)  # [S]
    w = tl.exp2(m - tl.max(m, axis=0))  # [S] each split's rescale to the common max
    acc = tl.load(part_o_ptr + (offs_s[:, None] * rows + row) * HEAD_DIM + offs_d[None, :], mask=d_ok[None, :], other=0.0)
    total = tl.sum(l * w, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)  # [D]
    tok, head = row // H, row % H
    tl.store(o_ptr + tok * stride_ot + head * stride_oh + offs_d, out.to(o_ptr.dtype.element_ty), mask=d_ok)

def paged_attention(
    q: torch.Tensor,  # [N, H, D] the step's query tokens, sequence by sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, KV, D] one layer's keys, this step's included
    v_cache: torch.Tensor,  # [num_blocks, block_size, KV, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32: each sequence's blocks; entries past seq_len never read
    seq_lens: torch.Tensor,  # [B] int32: tokens of each sequence in the cache, this step's included
    *,
    cu_seqlens_q: torch.Tensor | None = None,  # [B + 1] int32 query offsets; None: decode, sequence b is row b
    max_query_len: int = 1,  # longest query_len in the batch (sizes the grid; an upper bound is fine)
    softmax_scale: float | None = None,  # default 1 / sqrt(D)
    out: torch.Tensor | None = None,  # [N, H, D] to write into (a CUDA-graph buffer)
    num_splits: int | None = None,  # decode: key splits per sequence; None picks (`decode_splits`), 1: none
) -> torch.Tensor:  # [N, H, D]
    """Causal attention of each sequence's query tokens over its paged cache (see Semantics)."""
    n, heads, head_dim = q.shape
    _, block_size, kv_heads, d_cache = k_cache.shape  # [num_blocks, block_size, KV, D]
    batch = seq_lens.shape[0]
    assert v_cache.shape == k_cache.shape and d_cache == head_dim, (tuple(q.shape), tuple(k_cache.shape), tuple(v_cache.shape))
    assert heads % kv_heads == 0, f"{heads} query heads do not share {kv_heads} KV heads evenly"
    assert q.dtype == k_cache.dtype == v_cache.dtype and q.dtype in (torch.float32, torch.float16, torch.bfloat16), (q.dtype, k_cache.dtype)
    assert block_tables.dim() == 2 and block_tables.shape[0] == batch, (tuple(block_tables.shape), batch)
    assert not block_tables.is_floating_point() and not seq_lens.is_floating_point(), (block_tables.dtype, seq_lens.dtype)
    if cu_seqlens_q is None:
        assert n == batch and max_query_len == 1, f"decode takes one query token per sequence: {n} rows, {batch} sequences"
    else:
        assert cu_seqlens_q.shape == (batch + 1,) and max_query_len >= 1, (tuple(cu_seqlens_q.shape), batch, max_query_len)
    assert q.device == k_cache.device == v_cache.device == block_tables.device == seq_lens.device
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype, (tuple(out.shape), out.dtype)
    if n == 0:
        return out
    _launch(q, None, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, max_query_len, softmax_scale, out, num_splits)
    return out


def decode_rope_attention(
    qkv: torch.Tensor,  # [B, (H + 2 KV) * D] the fused projection's rows [q | k | v], one new token per sequence
    positions: torch.Tensor,  # [B] int: each token's position
    inv_freq: torch.Tensor,  # [D / 2] fp32
    k_cache: torch.Tensor,  # [num_blocks, block_size, KV, D] one layer's keys, this step's not yet written
    v_cache: torch.Tensor,  # [num_blocks, block_size, KV, D]
    slot_mapping: torch.Tensor,  # [B] int: flat cache slot of each new token
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32: tokens of each sequence in the cache, this step's included
    num_heads: int,
    *,
    softmax_scale: float | None = None,
    out: torch.Tensor | None = None,  # [B, H, D]
    num_splits: int | None = None,
    lora: LoraDelta | None = None,  # the qkv projection's LoRA delta, not yet added to qkv (see LoRA)
) -> torch.Tensor:  # [B, H, D]
    """A decode step's RoPE, KV write and attention in one launch (see RoPE and the KV write): what
    kernels.rope_cache.rope_and_cache and then `paged_attention` compute, the caches written the same; with `lora`, what
    kernels.lora_expand adding the delta into qkv and then those two compute."""
    b = qkv.shape[0]
    _, _, kv_heads, head_dim = k_cache.shape
    assert qkv.shape[1] == (num_heads + 2 * kv_heads) * head_dim and qkv.stride(1) == 1, (tuple(qkv.shape), num_heads, kv_heads)
    assert head_dim % 2 == 0 and head_dim & (head_dim - 1) == 0, f"head_dim {head_dim}: RoPE here takes powers of two"
    assert positions.shape == slot_mapping.shape == (b,) and inv_freq.shape == (head_dim // 2,), (positions.shape, inv_freq.shape)
    assert inv_freq.dtype == torch.float32 and not positions.is_floating_point() and not slot_mapping.is_floating_point()
    assert v_cache.shape == k_cache.shape and num_heads % kv_heads == 0, (tuple(k_cache.shape), tuple(v_cache.shape), num_heads)
    assert qkv.dtype == k_cache.dtype == v_cache.dtype and qkv.dtype in (torch.float32, torch.float16, torch.bfloat16), (qkv.dtype, k_cache.dtype)
    assert block_tables.dim() == 2 and block_tables.shape[0] == b == seq_lens.shape[0], (tuple(block_tables.shape), tuple(seq_lens.shape), b)
    assert not block_tables.is_floating_point() and not seq_lens.is_floating_point(), (block_tables.dtype, seq_lens.dtype)
    assert qkv.device == k_cache.device == v_cache.device == block_tables.device == seq_lens.device == positions.device \
        == slot_mapping.device == inv_freq.device, "every tensor on one device"
    assert positions.is_contiguous() and slot_mapping.is_contiguous() and seq_lens.is_contiguous(), "read as flat arrays"
    if out is None:
        out = torch.empty(b, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    assert out.shape == (b, num_heads, head_dim) and out.dtype == qkv.dtype and out.device == qkv.device, (tuple(out.shape), out.dtype)
    if lora is not None:
        _check_lora(lora, b, num_heads, kv_heads, head_dim, qkv)
    _launch(qkv.view(b, num_heads + 2 * kv_heads, head_dim), (positions, inv_freq, slot_mapping), k_cache, v_cache,
            block_tables, seq_lens, None, 1, softmax_scale, out, num_splits, lora)  # fmt: skip
    return out


def _check_lora(lora: LoraDelta, b: int, num_heads: int, kv_heads: int, head_dim: int, qkv: torch.Tensor) -> None:
    w, t, seg = lora.weights, lora.t, lora.segments
    assert seg.start is None and seg.num_rows == b, f"the qkv delta's rows must be decode rows, one group each ({seg.num_rows} of {b})"
    assert tuple(w.slices) == (num_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), \
        f"qkv's LoRA slices {w.slices} are not q, k, v of {num_heads}, {kv_heads}, {kv_heads} heads of {head_dim}"  # fmt: skip
    assert t.shape == (3, b, w.max_rank) and t.dtype == torch.float32 and t.stride(2) == 1, (tuple(t.shape), t.dtype, t.stride())
    assert w.pool.dtype == qkv.dtype and seg.slot.shape == (b,) and t.device == seg.slot.device == qkv.device, \
        (w.pool.dtype, qkv.dtype, tuple(seg.slot.shape), t.device, seg.slot.device)  # fmt: skip
    w.check(qkv.device)


def _launch(q, rope, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, max_query_len, softmax_scale, out, num_splits,
            lora=None) -> None:  # fmt: skip
    """The attention launch (and the splits' combine) into `out`; with `rope` (positions, inv_freq, slot_mapping), q is
    the qkv rows [N, H + 2 KV, D] of a decode step (`decode_rope_attention`), and `lora` its delta (LoraDelta) or None."""
    n, _, head_dim = q.shape
    heads = out.shape[1]
    _, block_size, kv_heads, _ = k_cache.shape
    batch = seq_lens.shape[0]
    if n == 0:
        return
    group = heads // kv_heads
    group_pad = next_power_of_2(group)
    block_t, block_n, num_warps, num_stages, early_v = _config(group_pad, max_query_len, head_dim)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    splits = 1 if cu_seqlens_q is not None else (num_splits or decode_splits(batch, kv_heads, block_tables.shape[1] * block_size))
    assert splits == 1 or (cu_seqlens_q is None and splits & (splits - 1) == 0), f"num_splits {splits}: decode only, a power of two"
    part_o = part_ml = out  # placeholders, never read without splits
    if splits > 1:
        part_o = torch.empty(splits, n, heads, head_dim, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(splits, n, heads, 2, dtype=torch.float32, device=q.device)
    grid = (splits if splits > 1 else cdiv(max_query_len, block_t), kv_heads, batch)
    if lora is not None:
        w, t = lora.weights, lora.t
        lora_args = (t, w.pool, w.pages, w.rank, w.scale, lora.segments.slot)
        lora_strides = (t.stride(0), t.stride(1), *w.pages.stride(), *w.rank.stride(), w.b_offset(0), w.b_offset(1), w.b_offset(2))
    else:
        lora_args, lora_strides = (seq_lens,) * 6, (0,) * 10  # placeholders, never read
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, block_tables, seq_lens, cu_seqlens_q if cu_seqlens_q is not None else seq_lens,
        part_o, part_ml, *(rope or (seq_lens, seq_lens, seq_lens)), *lora_args, scale * _LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        out.stride(0), out.stride(1), out.stride(2),
        block_tables.stride(0),
        *lora_strides,
        HAS_CU_Q=cu_seqlens_q is not None,
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_T=block_t,
        ROWS=block_t * group_pad,
        BLOCK_N=block_n,
        BLOCK_D=next_power_of_2(head_dim),
        HEAD_DIM=head_dim,
        KV_BLOCK=block_size,
        # The interpreter (CPU) multiplies bf16 bit patterns in tl.dot: widen there (see the docstring).
        DOT_DTYPE=tl.float32 if q.device.type == "cpu" or q.dtype == torch.float32 else TL_DTYPE[q.dtype],
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # fp32 stays fp32; widened halves are exact in TF32
        NUM_SPLITS=splits,
        EARLY_V=early_v,
        ROPE=rope is not None,
        NUM_HEADS=heads,
        NUM_KV=kv_heads,
        LORA=lora is not None,
        LORA_R=max(1, min(16, 2048 // (group_pad * head_dim))),  # [LR, G_PAD * D] B tiles of at most 2k elements
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if splits > 1:
        _combine_splits_kernel[(n * heads,)](
            part_o, part_ml, out, n * heads, out.stride(0), out.stride(1),
            H=heads, NUM_SPLITS=splits, HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim), num_warps=1,
        )  # fmt: skip


def decode_splits(batch: int, kv_heads: int, max_context: int, min_keys: int = 128) -> int:
    """Key splits per sequence for a decode launch: splits only while the batch leaves SMs idle (batch x kv_heads x
    splits < 128, about one program per SM of an H200), none shorter than `min_keys` at the longest context the
    block tables allow, at most 16. Measured on an H200 (engine.bench.profile_steps --attention, PERF.md): at batch 32 x 8
    KV heads any split was slower (8b, 544 keys: 25.8 µs unsplit, 33.8 at 2 splits, 42.0 at 8), as the combine's
    launch and partials cost more than the extra programs gain once 256 programs run."""
    splits = 1
    while splits < 16 and batch * kv_heads * splits < 128 and max_context >= 2 * splits * min_keys:
        splits *= 2
    return splits



def _config(group_pad: int, max_query_len: int, head_dim: int) -> tuple[int, int, int, int, bool]:
    """(BLOCK_T, BLOCK_N, num_warps, num_stages, EARLY_V): the fastest of kernels.bench.roofline._sweep's candidates on an H200.

    Decode: 16 rows (one token's G heads, padded), 128 keys a step (8b: 48.8 µs; 64 keys: 52.4), a 2-stage pipeline
    with V's load issued beside K's (engine.bench.profile_steps --attention-configs, batch 32: 8b at 544 keys 24.3 µs against
    26.0 at Triton's default 3 stages, 1b 17.0 against 18.2; early V alone is worth ~0.1 µs). Prefill: 128 rows
    (32 tokens x 4 heads), 64 keys a step (8b: 181.9 µs; 64 rows: 194.4), Triton's default depth."""
    if max_query_len == 1:
        rows, block_n, stages, early_v = 16, 128, 2, True
    else:
        rows, block_n, stages, early_v = 128, 64, 3, False
    if head_dim > 128:
        block_n //= 2  # keep the K and V tiles' registers as at head_dim 128
    return max(1, rows // group_pad), block_n, 4, stages, early_v


def paged_attention_ref(
    q: torch.Tensor,  # [N, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KV, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, KV, D]
    block_tables: torch.Tensor,  # [B, max_blocks]
    seq_lens: torch.Tensor,  # [B]
    *,
    cu_seqlens_q: torch.Tensor | None = None,  # [B + 1]
    softmax_scale: float | None = None,
) -> torch.Tensor:  # [N, H, D] in q's dtype, computed in fp32
    """Pure torch, one sequence at a time: gather its blocks, mask causally from its context, softmax in fp32."""
    n, heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    cu = cu_seqlens_q.tolist() if cu_seqlens_q is not None else list(range(n + 1))
    out = torch.empty_like(q)
    for b, total in enumerate(seq_lens.tolist()):
        q_begin, q_end = cu[b], cu[b + 1]
        if q_end == q_begin:
            continue
        blocks = block_tables[b, : -(-total // block_size)].long()
        k = k_cache[blocks].flatten(0, 1)[:total].float().repeat_interleave(heads // kv_heads, dim=1)  # [T, H, D]
        v = v_cache[blocks].flatten(0, 1)[:total].float().repeat_interleave(heads // kv_heads, dim=1)  # [T, H, D]
        qs = q[q_begin:q_end].float()  # [q, H, D]
        scores = torch.einsum("qhd,thd->hqt", qs, k) * scale  # [H, q, T]
        q_pos = torch.arange(total - (q_end - q_begin), total, device=q.device)[:, None]  # [q, 1]
        scores = scores.masked_fill(torch.arange(total, device=q.device)[None, :] > q_pos, float("-inf"))
        out[q_begin:q_end] = torch.einsum("hqt,thd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out
