"""Paged attention (Triton) against float64 attention over the same paged cache: decode, prefill, and both at once.

Grid (STYLE item 7, for attention): dtype x heads per KV head (GQA 4:1; 3:1, not a power of two; MHA) x batch
(decode; fresh prefill; prefill over a cached prefix; chunked: prefill chunks and decode tokens in one launch)
x block size (4, 16), at head_dim 24 and 32 in the Triton interpreter; llama-1b and llama-8b head shapes only
where CUDA is. Every cache slot no sequence owns (the tail of each last block too) is NaN, block tables are
shuffled and padded with -1, and outputs start as NaN, so reading a wrong key or skipping a row fails.
"""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch

from tests.triton_interp import DEVICE, import_kernels, interpreter_env  # noqa: F401  (autouse fixture)


(paged_attention_module,) = import_kernels("kernels.paged_attention")
paged_attention, paged_attention_ref = paged_attention_module.paged_attention, paged_attention_module.paged_attention_ref

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # max |err| / max |want|
HEADS = {"gqa4": (8, 2, 32), "gqa3": (6, 2, 24), "mha": (4, 4, 32)}  # (heads, kv heads, head_dim)
# (query_len, cached context) of each sequence
BATCHES = {
    "decode": [(1, 0), (1, 3), (1, 15), (1, 16), (1, 17), (1, 90)],
    "prefill": [(1, 0), (7, 0), (16, 0), (33, 0)],
    "prefix": [(5, 11), (1, 40), (20, 70), (3, 0)],
    "chunked": [(1, 20), (9, 4), (1, 0), (17, 50), (1, 99)],
}



def _paged_batch(shape, block_size, seqs, dtype, gen):
    """A cache holding each sequence's keys/values in shuffled blocks (NaN elsewhere), its queries and metadata,
    and the dense per-sequence keys/values the float64 reference reads."""
    heads, kv_heads, head_dim = shape
    totals = [q + c for q, c in seqs]
    blocks_of = [-(-t // block_size) for t in totals]
    num_blocks = sum(blocks_of) + 3  # three blocks nobody owns
    order = torch.randperm(num_blocks, generator=gen)
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    table = torch.full((len(seqs), max(blocks_of) + 2), -1, dtype=torch.int32)  # padding is never read
    dense, used = [], 0
    for b, total in enumerate(totals):
        ids = order[used : used + blocks_of[b]]
        used += blocks_of[b]
        table[b, : len(ids)] = ids.to(torch.int32)
        k = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)  # [T, KV, D]
        v = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
        for p in range(total):
            k_cache[ids[p // block_size], p % block_size] = k[p].float()
            v_cache[ids[p // block_size], p % block_size] = v[p].float()
        dense.append((k, v))
    q = torch.randn(sum(q for q, _ in seqs), heads, head_dim, generator=gen).to(dtype)  # [N, H, D]
    cu = torch.tensor([0] + list(itertools.accumulate(q for q, _ in seqs)), dtype=torch.int32)
    return q, k_cache.to(dtype), v_cache.to(dtype), table, torch.tensor(totals, dtype=torch.int32), cu, dense


def _want(q, seqs, dense, heads, kv_heads) -> torch.Tensor:
    """[N, H, D] float64: each query token attends to keys at its position and before (HF's repeat_kv for GQA)."""
    out = torch.empty(q.shape, dtype=torch.float64)
    start = 0
    for (q_len, ctx), (k, v) in zip(seqs, dense):
        total = q_len + ctx
        kk = k.double().repeat_interleave(heads // kv_heads, dim=1)  # [T, H, D]
        vv = v.double().repeat_interleave(heads // kv_heads, dim=1)
        qq = q[start : start + q_len].double()  # [q, H, D]
        scores = torch.einsum("qhd,thd->hqt", qq, kk) / q.shape[-1] ** 0.5
        visible = torch.arange(total)[None, :] <= torch.arange(ctx, total)[:, None]  # [q, T]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start : start + q_len] = torch.einsum("hqt,thd->qhd", scores.softmax(-1), vv)
        start += q_len
    return out


def _check(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    got = got.double().cpu()
    assert not torch.isnan(got).any(), f"{what}: {int(torch.isnan(got).sum())} NaN entries (unwritten rows or NaN keys read)"
    err = (got - want).abs()
    rel = err.max() / want.abs().max()
    assert rel < tol, f"{what}: max err {err.max():.3e} (rel {rel:.3e} > {tol}), mean err {err.mean():.3e}"


def _run(dtype, shape, seqs, block_size, gen):
    heads, kv_heads, _ = shape
    q, k_cache, v_cache, table, seq_lens, cu, dense = _paged_batch(shape, block_size, seqs, dtype, gen)
    want = _want(q, seqs, dense, heads, kv_heads)
    decode = all(q_len == 1 for q_len, _ in seqs)
    q, k_cache, v_cache, table, seq_lens, cu = (t.to(DEVICE) for t in (q, k_cache, v_cache, table, seq_lens, cu))
    out = torch.full_like(q, float("nan"))
    if decode:
        paged_attention(q, k_cache, v_cache, table, seq_lens, out=out)
    else:
        paged_attention(q, k_cache, v_cache, table, seq_lens, cu_seqlens_q=cu, max_query_len=max(s for s, _ in seqs), out=out)
    _check(out, want, TOL[dtype], f"paged_attention {dtype}")
    return q, k_cache, v_cache, table, seq_lens, cu, want


@pytest.mark.parametrize(
    ("dtype", "heads", "batch", "block_size"),
    list(itertools.product([torch.float32, torch.float16, torch.bfloat16], HEADS, BATCHES, [4, 16])),
    ids=lambda v: str(v).replace("torch.", ""),
)
def test_matches_float64_over_the_paged_cache(dtype, heads, batch, block_size):
    """Each query token's output equals float64 softmax attention over its sequence's keys up to its own position,
    within the dtype's tolerance; every output row is written; nothing outside the sequence's blocks is read."""
    gen = torch.Generator().manual_seed(zlib.crc32(repr((str(dtype), heads, batch, block_size)).encode()))
    _run(dtype, HEADS[heads], BATCHES[batch], block_size, gen)


@pytest.mark.parametrize("batch", ["decode", "prefix"])
def test_torch_reference_matches_float64(batch):
    """paged_attention_ref (what the bench times the kernel against) computes the same attention."""
    gen = torch.Generator().manual_seed(11)
    seqs = BATCHES[batch]
    q, k_cache, v_cache, table, seq_lens, cu, dense = _paged_batch(HEADS["gqa4"], 4, seqs, torch.float32, gen)
    got = paged_attention_ref(q, k_cache, v_cache, table, seq_lens, cu_seqlens_q=None if batch == "decode" else cu)
    _check(got, _want(q, seqs, dense, 8, 2), 1e-5, "paged_attention_ref")


@pytest.mark.parametrize("batch", ["decode", "prefix"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda v: str(v).replace("torch.", ""))
def test_v_loaded_early_gives_the_same_attention(monkeypatch, dtype, batch):
    """The EARLY_V launch option (V's load issued beside K's, a tuning choice) computes the same attention."""
    default = paged_attention_module._config
    monkeypatch.setattr(paged_attention_module, "_config", lambda *a: (*default(*a)[:3], 2, True))
    gen = torch.Generator().manual_seed(zlib.crc32(repr(("early", str(dtype), batch)).encode()))
    _run(dtype, HEADS["gqa4"], BATCHES[batch], 4, gen)


def test_decode_equals_one_token_prefill_chunks():
    """A decode batch gives the same rows whether it is passed as decode or as query_len-1 chunks with cu_seqlens."""
    gen = torch.Generator().manual_seed(12)
    q, k_cache, v_cache, table, seq_lens, cu, _ = _run(torch.float32, HEADS["gqa4"], BATCHES["decode"], 16, gen)
    as_decode = paged_attention(q, k_cache, v_cache, table, seq_lens)
    as_chunks = paged_attention(q, k_cache, v_cache, table, seq_lens, cu_seqlens_q=cu, max_query_len=1)
    torch.testing.assert_close(as_decode, as_chunks, rtol=0, atol=0)


@pytest.mark.parametrize("splits", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda v: str(v).replace("torch.", ""))
def test_decode_split_over_keys_matches_float64(dtype, splits):
    """Flash-Decoding: with a sequence's keys split over programs and the partials merged, each row equals float64
    attention; sequences shorter than the splits (empty partials) and longer ones (several live splits) alike."""
    gen = torch.Generator().manual_seed(13 + splits)
    seqs = [(1, 700), (1, 4), (1, 300), (1, 128), (1, 129), (1, 0)]
    q, k_cache, v_cache, table, seq_lens, _, dense = _paged_batch(HEADS["gqa4"], 16, seqs, dtype, gen)
    want = _want(q, seqs, dense, 8, 2)
    q, k_cache, v_cache, table, seq_lens = (t.to(DEVICE) for t in (q, k_cache, v_cache, table, seq_lens))
    out = torch.full_like(q, float("nan"))
    paged_attention(q, k_cache, v_cache, table, seq_lens, out=out, num_splits=splits)
    _check(out, want, TOL[dtype], f"paged_attention {dtype}, {splits} splits")


def test_decode_splits_fill_the_gpu_and_stay_long_enough():
    """The split count: more programs for small batches, none for short contexts, always a power of two up to 16."""
    pa = paged_attention_module
    assert pa.decode_splits(32, 8, 192) == 1  # llama-1b bench: 256 programs already
    assert pa.decode_splits(32, 8, 4096) == 1  # llama-8b bench shape at long contexts: still enough programs
    assert pa.decode_splits(1, 8, 8192) == 16
    assert pa.decode_splits(4, 8, 1024) == 4  # 128 programs
    assert pa.decode_splits(2, 8, 255) == 1  # too short for two splits of 128 keys, the least a split takes


# llama-1b and llama-8b attention: 32 heads over 8 KV heads, head_dim 64 and 128, block 16; CUDA only.
REAL_HEADS = {"1b": (32, 8, 64), "8b": (32, 8, 128)}
REAL_BATCHES = {
    "decode": [(1, c) for c in (0, 15, 16, 127, 500, 1023, 64, 300)] * 4,  # 32 sequences
    "prefix": [(100, 300), (1, 700), (257, 0), (64, 64)],
    "chunked": [(1, 900), (128, 256), (1, 31), (33, 0)],
}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real head shapes need CUDA (the interpreter would take hours)")
@pytest.mark.parametrize(
    ("dtype", "heads", "batch"),
    list(itertools.product([torch.float32, torch.float16, torch.bfloat16], REAL_HEADS, REAL_BATCHES)),
    ids=lambda v: str(v).replace("torch.", ""),
)
def test_real_head_shapes_on_cuda(dtype, heads, batch):
    """The same check at llama-1b/-8b head shapes, context up to 1024."""
    gen = torch.Generator().manual_seed(zlib.crc32(repr((str(dtype), heads, batch)).encode()))
    _run(dtype, REAL_HEADS[heads], REAL_BATCHES[batch], 16, gen)


# ---- a decode step's RoPE, KV write and attention in one launch (decode_rope_attention)

(rope_cache_module,) = import_kernels("kernels.rope_cache")
decode_rope_attention = paged_attention_module.decode_rope_attention
ROPE_HEADS = {"gqa4": (8, 2, 32), "gqa3": (6, 2, 32), "mha": (4, 4, 16)}  # head_dim a power of two: RoPE's halves
ROPE_CONTEXTS = [0, 3, 15, 16, 17, 90]  # cached tokens before each sequence's new one


def _rope64(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:  # [B, heads, D] float64
    angle = pos.double()[:, None] * inv_freq.double()[None, :]  # [B, D/2]
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    x1, x2 = x.double().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _rope_step(dtype, shape, contexts, block_size, gen):
    """A decode step as the engine runs it: each sequence's cached keys in shuffled blocks, its new token's slot and every
    slot nobody owns NaN, the fused projection's rows qkv, and the float64 attention of the rotated q over the cached keys
    and the rotated new key."""
    heads, kv_heads, head_dim = shape
    seqs = [(1, c) for c in contexts]
    _, k_cache, v_cache, table, seq_lens, _, dense = _paged_batch(shape, block_size, seqs, dtype, gen)
    slots = torch.tensor([int(table[b, c // block_size]) * block_size + c % block_size for b, c in enumerate(contexts)])
    k_cache.view(-1, kv_heads, head_dim)[slots] = float("nan")  # the new tokens' slots: written by the launch, never read
    v_cache.view(-1, kv_heads, head_dim)[slots] = float("nan")
    qkv = (torch.randn(len(contexts), (heads + 2 * kv_heads) * head_dim, generator=gen) * 2).to(dtype)
    pos = torch.tensor(contexts, dtype=torch.int64)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    parts = qkv.view(len(contexts), heads + 2 * kv_heads, head_dim)
    q64 = _rope64(parts[:, :heads], pos, inv_freq)
    k_new = _rope64(parts[:, heads : heads + kv_heads], pos, inv_freq).to(dtype)  # [B, KV, D] as the cache must hold it
    v_new = parts[:, heads + kv_heads :]
    for b, (k, v) in enumerate(dense):
        k[-1], v[-1] = k_new[b], v_new[b]
    want = _want(q64, seqs, dense, heads, kv_heads)
    return qkv, pos, inv_freq, k_cache, v_cache, slots, table, seq_lens, want, k_new, v_new


@pytest.mark.parametrize("splits", [1, 2, 4])
@pytest.mark.parametrize(
    ("dtype", "heads", "block_size"),
    list(itertools.product([torch.float32, torch.float16, torch.bfloat16], ROPE_HEADS, [4, 16])),
    ids=lambda v: str(v).replace("torch.", ""),
)
def test_decode_rope_attention_matches_float64(dtype, heads, block_size, splits):
    """Each row equals float64 attention of its rotated query over the cached keys and its own rotated key; the new
    k and v land in their slots (rotated, rounded to the dtype), the cache's other slots are untouched, and the slot
    being written is never read (it starts NaN), also with the keys split over programs."""
    shape = ROPE_HEADS[heads]
    gen = torch.Generator().manual_seed(zlib.crc32(repr(("rope", str(dtype), heads, block_size, splits)).encode()))
    qkv, pos, inv_freq, k_cache, v_cache, slots, table, seq_lens, want, k_new, v_new = _rope_step(
        dtype, shape, ROPE_CONTEXTS, block_size, gen)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    qkv, pos, inv_freq, k_cache, v_cache, slots, table, seq_lens = (
        t.to(DEVICE) for t in (qkv, pos, inv_freq, k_cache, v_cache, slots, table, seq_lens))
    out = torch.full((len(ROPE_CONTEXTS), shape[0], shape[2]), float("nan"), dtype=dtype, device=DEVICE)
    decode_rope_attention(qkv, pos, inv_freq, k_cache, v_cache, slots, table, seq_lens, shape[0], out=out, num_splits=splits)
    _check(out, want, TOL[dtype], f"decode_rope_attention {dtype}, {splits} splits")
    flat_k, flat_v = k_cache.cpu().view(-1, *k_cache.shape[2:]), v_cache.cpu().view(-1, *v_cache.shape[2:])
    torch.testing.assert_close(flat_k[slots.cpu()], k_new, rtol=TOL[dtype], atol=TOL[dtype], msg="the new keys' slots")
    torch.testing.assert_close(flat_v[slots.cpu()], v_new, rtol=0, atol=0, msg="the new values' slots: v as it came")
    others = torch.ones(flat_k.shape[0], dtype=torch.bool)
    others[slots.cpu()] = False
    for got, was in ((flat_k, before_k), (flat_v, before_v)):
        torch.testing.assert_close(got[others], was.view(-1, *was.shape[2:])[others], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("splits", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda v: str(v).replace("torch.", ""))
def test_decode_rope_attention_over_keys_split_past_one_tile(dtype, splits):
    """Contexts around a 128-key tile and past it, so that with key splits the new token's position falls in a later
    split than the first (alone in it at 256 with 2 splits), and the cached keys span several splits and tiles."""
    shape = ROPE_HEADS["gqa4"]
    contexts = [127, 128, 129, 255, 256, 300, 511, 0]
    gen = torch.Generator().manual_seed(zlib.crc32(repr(("rope-split", str(dtype), splits)).encode()))
    qkv, pos, inv_freq, k_cache, v_cache, slots, table, seq_lens, want, k_new, v_new = _rope_step(dtype, shape, contexts, 16, gen)
    qkv, pos, inv_freq, k_cache, v_cache, slots, table, seq_lens = (
        t.to(DEVICE) for t in (qkv, pos, inv_freq, k_cache, v_cache, slots, table, seq_lens))
    out = torch.full((len(contexts), shape[0], shape[2]), float("nan"), dtype=dtype, device=DEVICE)
    decode_rope_attention(qkv, pos, inv_freq, k_cache, v_cache, slots, table, seq_lens, shape[0], out=out, num_splits=splits)
    _check(out, want, TOL[dtype], f"decode_rope_attention {dtype}, {splits} splits, long contexts")
    torch.testing.assert_close(k_cache.cpu().view(-1, *k_cache.shape[2:])[slots.cpu()], k_new, rtol=TOL[dtype], atol=TOL[dtype])
    torch.testing.assert_close(v_cache.cpu().view(-1, *v_cache.shape[2:])[slots.cpu()], v_new, rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real head shapes need CUDA (the interpreter would take hours)")
@pytest.mark.parametrize(("dtype", "heads"), list(itertools.product([torch.float32, torch.bfloat16], REAL_HEADS)),
                         ids=lambda v: str(v).replace("torch.", ""))  # fmt: skip
def test_decode_rope_attention_at_real_head_shapes_on_cuda(dtype, heads):
    """llama-1b and -8b heads (32 over 8, head_dim 64 and 128), 32 sequences up to 1,023 cached keys, block 16."""
    gen = torch.Generator().manual_seed(zlib.crc32(repr(("rope-real", str(dtype), heads)).encode()))
    contexts = [c for c, _ in zip(itertools.cycle((0, 15, 16, 127, 500, 1023, 64, 300)), range(32))]
    qkv, pos, inv_freq, k_cache, v_cache, slots, table, seq_lens, want, _, _ = _rope_step(dtype, REAL_HEADS[heads], contexts, 16, gen)
    args = (t.to(DEVICE) for t in (qkv, pos, inv_freq, k_cache, v_cache, slots, table, seq_lens))
    _check(decode_rope_attention(*args, REAL_HEADS[heads][0]), want, TOL[dtype], f"decode_rope_attention {dtype} {heads}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda v: str(v).replace("torch.", ""))
def test_decode_rope_attention_equals_the_two_kernels(dtype):
    """One launch gives what kernels/rope_cache.py and then paged_attention give (the engine's prefill path and its
    decode path before): the same values bit for bit, the same keys to their last bit (each rotation's fp32 products
    may be contracted into an FMA differently by the compiler, then rounded to the dtype), and the same rows to the
    rounding of the softmax's sums, which take the new key last here and in its tile there."""
    shape = ROPE_HEADS["gqa4"]
    gen = torch.Generator().manual_seed(21)
    qkv, pos, inv_freq, k_cache, v_cache, slots, table, seq_lens, *_ = _rope_step(dtype, shape, ROPE_CONTEXTS, 4, gen)
    qkv, pos, inv_freq, k_cache, v_cache, slots, table, seq_lens = (
        t.to(DEVICE) for t in (qkv, pos, inv_freq, k_cache, v_cache, slots, table, seq_lens))
    k2, v2 = k_cache.clone(), v_cache.clone()
    q = rope_cache_module.rope_and_cache(qkv, pos, inv_freq, k_cache, v_cache, slots, shape[0])
    want = paged_attention(q, k_cache, v_cache, table, seq_lens)
    got = decode_rope_attention(qkv, pos, inv_freq, k2, v2, slots, table, seq_lens, shape[0])
    ulp = {torch.float32: 2**-23, torch.bfloat16: 2**-7}[dtype]
    # one ulp of the products' size: where x1 cos and x2 sin nearly cancel, that is more than one ulp of the key
    torch.testing.assert_close(k2, k_cache, rtol=ulp, atol=2 * ulp * float(qkv.abs().max()), equal_nan=True)
    torch.testing.assert_close(v2, v_cache, rtol=0, atol=0, equal_nan=True)
    _check(got, want.double().cpu(), {torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype], f"one launch against the two, {dtype}")


# (q, k, v) ranks of each adapter slot: q alone, all three at one rank, k and v alone at mixed ranks past one rank step
LORA_RANKS = [(5, 0, 0), (16, 16, 16), (0, 9, 20), (3, 1, 7)]


def _qkv_delta(shape, rows, dtype, gen):
    """A qkv projection's LoRA delta for `rows` decode rows: paged adapters of LORA_RANKS (the tables' unused entries on a
    NaN page), the shrink's t, and each row's slot cycling over the slots and -1 (no adapter)."""
    lora_segments = import_kernels("kernels.lora_segments")[0]
    heads, kv_heads, head_dim = shape
    widths = (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
    slots, max_rank, d_in = len(LORA_RANKS), 24, 16
    a = torch.randn(slots, 3, max_rank, d_in, generator=gen).to(dtype)
    b = (torch.randn(slots, max_rank, sum(widths), generator=gen) / 4).to(dtype)  # deltas about the size of qkv
    w = lora_segments.pack_pages(a, b, torch.tensor(LORA_RANKS), torch.tensor([2.0, 1.0, 4.0, 4.0]), widths, generator=gen,
                                 fill=float("nan"))  # fmt: skip
    slot = torch.tensor([(i % (slots + 1)) - 1 for i in range(rows)])  # -1, 0, 1, 2, 3, -1, ...
    t = torch.randn(3, rows, max_rank, generator=gen)
    moved = lambda x: x.to(DEVICE)  # noqa: E731
    w = lora_segments.LoraPages(pool=moved(w.pool), pages=moved(w.pages), rank=moved(w.rank), scale=moved(w.scale), num_layers=1,
                                layer=0, in_features=d_in, slices=widths)  # fmt: skip
    return lora_segments.LoraDelta(t=moved(t), weights=w, segments=lora_segments.segments_per_row(moved(slot))), lora_segments


@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize(("dtype", "heads"), list(itertools.product([torch.float32, torch.bfloat16], ["gqa4", "gqa3", "mha"])),
                         ids=lambda v: str(v).replace("torch.", ""))  # fmt: skip
def test_decode_rope_attention_adds_the_qkv_lora_delta_first(dtype, heads, splits):
    """With the qkv projection's LoRA delta, one launch gives what the expand adding it into qkv and then the launch
    without it give: every row's attention, and the new k and v in the cache, to the dtype's rounding (the delta's
    sums are taken in another order); rows without an adapter exactly as without the delta. The delta moves the rows
    by far more than the tolerance, and pages past each slice's rank are NaN, never read."""
    shape = ROPE_HEADS[heads]
    gen = torch.Generator().manual_seed(zlib.crc32(repr(("rope-lora", str(dtype), heads, splits)).encode()))
    contexts = [0, 3, 15, 16, 17, 90, 40, 1, 33, 64]
    qkv, pos, inv_freq, k_cache, v_cache, slots, table, seq_lens, *_ = _rope_step(dtype, shape, contexts, 4, gen)
    qkv = qkv / 2  # (exact) logits of a gentler softmax: the interpreter rounds bf16 toward zero, and a peaked one magnifies that
    delta, lora_segments = _qkv_delta(shape, len(contexts), dtype, gen)
    qkv, pos, inv_freq, k_cache, v_cache, slots, table, seq_lens = (
        t.to(DEVICE) for t in (qkv, pos, inv_freq, k_cache, v_cache, slots, table, seq_lens))
    added = lora_segments.with_delta_ref(qkv, delta)  # what the expand writes into qkv
    k_want, v_want = k_cache.clone(), v_cache.clone()
    want = decode_rope_attention(added, pos, inv_freq, k_want, v_want, slots, table, seq_lens, shape[0], num_splits=splits)
    got = decode_rope_attention(qkv, pos, inv_freq, k_cache, v_cache, slots, table, seq_lens, shape[0], num_splits=splits,
                                lora=delta)  # fmt: skip
    plain = decode_rope_attention(qkv, pos, inv_freq, k_cache.clone(), v_cache.clone(), slots, table, seq_lens, shape[0],
                                  num_splits=splits)  # fmt: skip
    tol = {torch.float32: 1e-5, torch.bfloat16: 3e-2}[dtype]  # bf16: a rounding of q, k and v more than the two kernels
    _check(got, want.double().cpu(), tol, f"qkv delta in the launch, {dtype}, {splits} splits")
    bare = delta.segments.slot.cpu() < 0
    # rows without an adapter as without the delta: bit for bit in the interpreter; compiled, the two variants may
    # contract the rotation's products into FMAs differently (as the two kernels do against the one launch)
    _check(got[bare.to(DEVICE)], plain[bare.to(DEVICE)].double().cpu(), {torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype],
           "rows without an adapter")  # fmt: skip
    if DEVICE.type == "cpu":
        assert torch.equal(got[bare], plain[bare]), "rows without an adapter changed"
    moved = ((plain - want).abs().amax(dim=(1, 2)) / want.abs().amax()).cpu()
    assert bool((moved[~bare] > tol).all()), f"the delta must move every adapter row past the tolerance: {moved}"
    new_k = k_cache.view(-1, *k_cache.shape[2:])[slots]
    torch.testing.assert_close(new_k, k_want.view(-1, *k_cache.shape[2:])[slots], rtol=tol, atol=tol * float(new_k.abs().max()))
    new_v = v_cache.view(-1, *v_cache.shape[2:])[slots]
    torch.testing.assert_close(new_v, v_want.view(-1, *v_cache.shape[2:])[slots], rtol=tol, atol=tol * float(new_v.abs().max()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real head shapes need CUDA (the interpreter would take hours)")
@pytest.mark.parametrize(("dtype", "heads"), list(itertools.product([torch.float32, torch.bfloat16], REAL_HEADS)),
                         ids=lambda v: str(v).replace("torch.", ""))  # fmt: skip
def test_decode_rope_attention_adds_the_qkv_lora_delta_at_real_head_shapes_on_cuda(dtype, heads):
    """llama-1b and -8b heads, 32 sequences up to 1,023 cached keys: the qkv delta in the launch against the expand
    (the torch reference) then the launch without it."""
    shape = REAL_HEADS[heads]
    gen = torch.Generator().manual_seed(zlib.crc32(repr(("rope-lora-real", str(dtype), heads)).encode()))
    contexts = [c for c, _ in zip(itertools.cycle((0, 15, 16, 127, 500, 1023, 64, 300)), range(32))]
    qkv, pos, inv_freq, k_cache, v_cache, slots, table, seq_lens, *_ = _rope_step(dtype, shape, contexts, 16, gen)
    delta, lora_segments = _qkv_delta(shape, len(contexts), dtype, gen)
    args = [t.to(DEVICE) for t in (qkv / 2, pos, inv_freq, k_cache, v_cache, slots, table, seq_lens)]
    added = lora_segments.with_delta_ref(args[0], delta)
    want = decode_rope_attention(added, *args[1:3], args[3].clone(), args[4].clone(), *args[5:], shape[0])
    got = decode_rope_attention(*args, shape[0], lora=delta)
    _check(got, want.double().cpu(), {torch.float32: 1e-5, torch.bfloat16: 3e-2}[dtype], f"qkv delta in the launch, {heads}")


def test_decode_rope_attention_refuses_a_delta_of_other_rows_or_slices():
    """A delta that is not per decode row, or whose slices are not q, k and v of these heads, is an assertion."""
    shape = ROPE_HEADS["gqa4"]
    gen = torch.Generator().manual_seed(23)
    qkv, pos, inv_freq, k_cache, v_cache, slots, table, seq_lens, *_ = _rope_step(torch.float32, shape, [3, 5], 4, gen)
    args = [t.to(DEVICE) for t in (qkv, pos, inv_freq, k_cache, v_cache, slots, table, seq_lens)]
    delta, lora_segments = _qkv_delta(shape, 2, torch.float32, gen)
    grouped = lora_segments.LoraSegments(slot=delta.segments.slot, start=torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE),
                                         max_len=1, num_rows=2)  # fmt: skip
    with pytest.raises(AssertionError, match="decode rows"):
        decode_rope_attention(*args, shape[0], lora=lora_segments.LoraDelta(t=delta.t, weights=delta.weights, segments=grouped))
    narrow = ROPE_HEADS["mha"]
    with pytest.raises(AssertionError, match="slices"):
        decode_rope_attention(*args, shape[0], lora=_qkv_delta(narrow, 2, torch.float32, gen)[0])


def test_decode_rope_attention_refuses_what_it_cannot_rotate():
    """A head size that is not a power of two, or qkv rows of the wrong width, is an assertion naming the shapes."""
    gen = torch.Generator().manual_seed(22)
    _, k_cache, v_cache, table, seq_lens, _, _ = _paged_batch((4, 2, 24), 4, [(1, 3)], torch.float32, gen)
    args = (torch.zeros(1), torch.zeros(1, dtype=torch.int64), torch.zeros(12), k_cache, v_cache, torch.zeros(1, dtype=torch.int64),
            table, seq_lens, 4)  # fmt: skip
    with pytest.raises(AssertionError):
        decode_rope_attention(torch.zeros(1, 8 * 24), *args[1:])
    with pytest.raises(AssertionError):
        decode_rope_attention(torch.zeros(1, 7 * 24), *args[1:])
