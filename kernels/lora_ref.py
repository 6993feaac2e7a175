"""Heterogeneous multi-LoRA, pure torch: every row of a batch with its own adapter, or none.

Semantics: y[i] += scale[idx[i]] * (x[i] @ A[idx[i]]^T) @ B[idx[i]]^T for every row i with idx[i] >= 0;
rows with idx[i] == -1 are left untouched, bit for bit.

This is Punica's BGMV ("Punica: Multi-Tenant LoRA Serving", Chen et al., 2023, arXiv:2310.18547) split,
as vLLM splits it, into a shrink (x -> h, down to the rank) and an expand (h -> y, back up and added).
Adapters live in preallocated slots: `a_stack [slots, max_rank, in]` and `b_stack [slots, out, max_rank]`,
zero-padded beyond each adapter's own rank, so a rank-4 adapter in a max-rank-64 slot yields h with 60
zero columns and adds exactly the rank-4 product. Mixed ranks therefore need no special case, at the
cost of computing max_rank columns for every row.

The reference gathers each row's slot weights and runs one batched matmul per chunk of rows: no Python
loop over adapters, so its cost does not grow with how many distinct adapters the batch holds. Rows
without an adapter are computed with slot 0 and masked out rather than filtered out, so the op never
waits on the device to learn which rows those are (no `nonzero()` sync, and it can be captured in a
CUDA graph with the indices as an input); a kernel can skip them instead. Gathered weights cost
rows x max_rank x features elements: a 8192-token prefill of a 4096 -> 14336 projection at rank 64 in
bf16 would gather 8192 * 64 * 14336 * 2 B = 15 GB, so rows go in chunks of at most `_GATHER_BYTES`
(256 MiB: 146 rows in that example, all of a typical decode batch in one chunk).

This is the engine's v0 path. The Triton kernels (kernels/lora_shrink.py, kernels/lora_expand.py, with
row groups from kernels/lora_segments.py) compute the same op at each slot's true rank, fused slices in one
launch, and take B rank-major, `[slots, max_rank, out]` (this file's `b_stack` transposed; their modules'
docstrings say why); each has its own pure-torch `_ref` beside it.
"""

from __future__ import annotations

import torch

_GATHER_BYTES = 256 * 1024 * 1024


def lora_shrink_ref(
    x: torch.Tensor,  # [N, in]
    a_stack: torch.Tensor,  # [slots, max_rank, in]
    idx: torch.Tensor,  # [N] int slot of each row, -1 for none
) -> torch.Tensor:
    """h [N, max_rank] = x[i] @ A[idx[i]]^T per row; zero for rows with idx -1."""
    n, in_features = x.shape
    slots, max_rank, a_in = a_stack.shape
    assert a_in == in_features, f"a_stack {tuple(a_stack.shape)} does not match x {tuple(x.shape)}"
    _check_idx(idx, n)
    h = x.new_empty(n, max_rank)  # [N, R]
    for rows in _row_chunks(n, max_rank * in_features * a_stack.element_size()):
        slot = idx[rows]  # [m]
        a = a_stack[slot.clamp(min=0)]  # [m, R, in]; rows without an adapter read slot 0, zeroed below
        h_rows = torch.bmm(a, x[rows].unsqueeze(-1)).squeeze(-1)  # [m, R]
        h[rows] = h_rows.masked_fill((slot < 0)[:, None], 0)
    return h


def lora_expand_ref(
    y: torch.Tensor,  # [N, out], updated in place
    h: torch.Tensor,  # [N, max_rank] from lora_shrink_ref
    b_stack: torch.Tensor,  # [slots, out, max_rank]
    idx: torch.Tensor,  # [N] int slot of each row, -1 for none
    scale: torch.Tensor,  # [slots] scaling of each slot's adapter (alpha / r, or alpha / sqrt(r))
) -> None:
    """y[i] += scale[idx[i]] * h[i] @ B[idx[i]]^T for rows with idx >= 0."""
    n, out_features = y.shape
    slots, b_out, max_rank = b_stack.shape
    assert b_out == out_features, f"b_stack {tuple(b_stack.shape)} does not match y {tuple(y.shape)}"
    assert h.shape == (n, max_rank), f"h {tuple(h.shape)}, expected {(n, max_rank)}"
    assert scale.shape == (slots,), f"scale {tuple(scale.shape)}, expected ({slots},)"
    _check_idx(idx, n)
    for rows in _row_chunks(n, max_rank * out_features * b_stack.element_size()):
        slot = idx[rows]  # [m]
        safe = slot.clamp(min=0)
        delta = torch.bmm(b_stack[safe], h[rows].unsqueeze(-1)).squeeze(-1)  # [m, out]
        delta = delta * scale[safe].to(delta.dtype)[:, None]
        y_rows = y[rows]  # [m, out]
        # where(), not y + 0: rows without an adapter keep their exact bits (-0.0 + 0 would turn into +0.0).
        y[rows] = torch.where((slot >= 0)[:, None], y_rows + delta.to(y.dtype), y_rows)


def lora_ref(
    y: torch.Tensor,  # [N, out], updated in place
    x: torch.Tensor,  # [N, in]
    a_stack: torch.Tensor,  # [slots, max_rank, in]
    b_stack: torch.Tensor,  # [slots, out, max_rank]
    idx: torch.Tensor,  # [N] int slot of each row, -1 for none
    scale: torch.Tensor,  # [slots]
) -> None:
    """The whole op (see Semantics): shrink then expand."""
    lora_expand_ref(y, lora_shrink_ref(x, a_stack, idx), b_stack, idx, scale)


def _check_idx(idx: torch.Tensor, n: int) -> None:
    assert idx.shape == (n,), f"idx {tuple(idx.shape)}, expected ({n},)"
    assert not idx.is_floating_point() and not idx.is_complex(), idx.dtype


def _row_chunks(n: int, bytes_per_row: int) -> list[slice]:
    """Row ranges whose gathered weights fit in _GATHER_BYTES."""
    per_chunk = max(1, _GATHER_BYTES // max(1, bytes_per_row))
    return [slice(start, min(start + per_chunk, n)) for start in range(0, n, per_chunk)]
