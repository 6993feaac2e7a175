"""CUDA graphs for steps with prompt tokens: a prefill, or a few prompts beside decode rows, replayed with one call.

Why. An eager step launches ~20 kernels a layer from Python, each 20-50 µs of host time. At llama-1b that is ~15 ms
of host work for a step whose kernels take 1-4 ms when it carries a few prompts: the GPU waits for the host. Issue 19's
cold pass at 2,000 adapters ran its batch in two parts, and each refill of the small part was such a step: 4 prompts
beside 60 decode rows, 11.5-14 ms on the device against 2.6 for a decode step (engine/PERF.md, session 31). Replayed
from a graph the same step costs its kernels.

Buckets. A step of n tokens whose longest item has q new tokens replays the graph of bucket (T, Q): T the smallest
token bucket >= n (powers of two from 64 below `max_tokens`, then `max_tokens`), Q the smallest query bucket >= q
(16, 64, 256, ... by fours below T, then T). The grids of the attention and LoRA kernels are sized by Q and by the
batch, and their programs past an item's own length return at once, so a bound is all a bucket needs; the coarse
steps of Q keep the graphs few (18 pairs for 2,048 tokens). Each pair has a graph with the LoRA ops and one without.

Inputs. Every graph reads the same static device buffers, which a step fills from one pinned staging row with one copy
(two: the LoRA groups are int32): token ids, positions and KV slots of its T token rows, then per item (the batch's
`batch` places) the sequence length, the first query row (cu_seqlens), the logits row, the block table, and the LoRA
group of the item (its adapter slot, its rows). Padding: token rows n .. T - 1 belong to no item: they write their K/V
into the scratch block (the KV pool's block past the block manager's, as decode graphs' padding rows do), no attention
program reads them as queries, and no LoRA group covers them; their rows of each activation are whatever the graph's
memory held, which no real row reads (every op of the forward is row-wise but attention, which reads only the items'
cached K/V). Padding items have no rows (cu_seqlens repeats n), a length of 1 in the scratch block, no adapter, and
read logits row 0; the step returns only its real items' rows.

Logits. Each graph copies its logits into one buffer [batch, vocab] outside the graphs' pool, so the graphs' own
memory is only what a forward holds at once, shared by all of them, not a logits tensor per graph.

Timing, as for decode graphs (engine.cuda_graphs, "Timing"): the step is timed with events around the replay, and its
LoRA share is the bucket's calibrated difference of the two graphs' medians, measured on the step that captured it (or
prepare_all's synthetic one), in proportion to the step's adapter tokens against that step's (`_lora_share`).

Falls back to the eager forward for steps of more than `max_tokens` tokens or `batch` items, for items past the static
block table, and for `all_logits`. Without CUDA, `capture=False` runs the same static-buffer forward eagerly.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import numpy as np
import torch

from engine.attention import AttentionMetadata
from engine.cuda_graphs import CopyFence, capture, lora_share_us
from engine.kv_cache import KVCache
from engine.lora import LoraState
from engine.model import LlamaForCausalLM
from kernels.lora_segments import LoraSegments

_MIN_TOKENS, _MIN_QUERY = 64, 16


def token_buckets(max_tokens: int) -> tuple[int, ...]:
    """Powers of two from 64 below `max_tokens`, then `max_tokens` itself. Midpoints (96, 192, 384, ...) were measured
    and left out: 4 prompts beside 60 decode rows (572 tokens) took 4,348 µs in bucket 768 against 4,393 in 1,024 (H100,
    llama-1b, engine/PERF.md session 33), for twice the graphs to capture."""
    sizes, t = [], _MIN_TOKENS
    while t < max_tokens:
        sizes.append(t)
        t *= 2
    return (*sizes, max_tokens)


def query_bucket(q: int, tokens: int) -> int:
    """The grid bound for items of up to q new tokens in a step of bucket `tokens`: 16, 64, 256, ... or `tokens`."""
    b = _MIN_QUERY
    while b < q:
        b *= 4
    return min(b, tokens)


class MixedGraphs:
    def __init__(
        self,
        model: LlamaForCausalLM,
        lora: LoraState,
        kv: KVCache,
        *,
        batch: int,
        max_tokens: int,
        max_blocks: int,
        scratch_block: int,
        block_table: Callable[[Hashable], list[int]],
        capture: bool,
        pool=None,
    ):
        assert batch >= 1 and max_tokens >= 1 and max_blocks >= 1, (batch, max_tokens, max_blocks)
        assert lora.backend.triton, "graphs need the triton backend: the torch one loops over sequences on the host"
        self.model, self.lora, self.kv = model, lora, kv
        self.batch, self.max_blocks, self.scratch_block = batch, max_blocks, scratch_block
        self.tokens = token_buckets(max_tokens)
        self.block_table = block_table
        self.capture = capture
        device = lora.device
        t, b = self.tokens[-1], batch
        self._n64 = 3 * t + 3 * b + 1 + b * max_blocks  # ids, positions, KV slots | lengths, cu (b + 1), logit rows | tables
        self._n32 = 2 * b + 1  # LoRA groups: slot of each item | first row of each (b + 1)
        pinned = device.type == "cuda"
        # Two staging rows used in turn: a step's copies may still be queued when the next step fills its row.
        self._host64 = torch.zeros(2, self._n64, dtype=torch.int64, pin_memory=pinned)
        self._host32 = torch.zeros(2, self._n32, dtype=torch.int32, pin_memory=pinned)
        self._row = 0
        self._fences = (CopyFence(pinned), CopyFence(pinned))
        self._dev64 = torch.zeros(self._n64, dtype=torch.int64, device=device)
        self._dev32 = torch.zeros(self._n32, dtype=torch.int32, device=device)
        self.ids, self.pos, self.slot_mapping = self._dev64[: 3 * t].view(3, t)
        rest = self._dev64[3 * t :]
        self.seq_lens, self.cu, self.logit_rows = rest[:b], rest[b : 2 * b + 1], rest[2 * b + 1 : 3 * b + 1]
        self.tables = rest[3 * b + 1 :].view(b, max_blocks)
        self.group_slot, self.group_start = self._dev32[:b], self._dev32[b:]
        self.logits = torch.zeros(b, model.config.vocab_size, dtype=torch.float32, device=device)  # outside the pool
        self._graphs: dict[tuple[int, int, bool], torch.cuda.CUDAGraph | None] = {}
        self.lora_us: dict[tuple[int, int], int] = {}  # (T, Q) -> calibrated LoRA share of a step, µs
        self._calibrated_tokens: dict[tuple[int, int], int] = {}  # (T, Q) -> adapter tokens of the step calibrated on
        self._staged_lora_tokens = 0  # adapter tokens of the step staged last
        self._pool = pool if pool is not None or not capture else torch.cuda.graph_pool_handle()
        self.last_lora_us: int | None = None  # of the last run: calibrated share (None when not captured: timer)

    def __len__(self) -> int:
        """How many graphs are captured (or prepared, without capture) so far."""
        return len(self._graphs)

    def fits(self, items: list) -> bool:
        """Whether a step of these runner items replays a graph: some item with more than one new token, few enough
        items and tokens, and every item within the static block table."""
        if len(items) > self.batch or max(len(it.token_ids) for it in items) == 1:
            return False
        if sum(len(it.token_ids) for it in items) > self.tokens[-1]:
            return False
        limit = self.max_blocks * self.kv.block_size
        return all(it.context_len + len(it.token_ids) <= limit for it in items)

    def key(self, items: list) -> tuple[int, int, bool]:
        """(T, Q, with LoRA) of the graph a step of `items` replays."""
        n = sum(len(it.token_ids) for it in items)
        t = next(b for b in self.tokens if b >= n)
        return t, query_bucket(max(len(it.token_ids) for it in items), t), any(it.lora_slot >= 0 for it in items)

    def captured(self, items: list) -> bool:
        return self.key(items) in self._graphs

    def prepare(self, items: list) -> None:
        """Capture (and calibrate) the graphs of this step's bucket if this is its first step; the engine calls it
        before it times the step. The capture's warm-up runs this step's inputs: its K/V are written again by the step."""
        t, q, lora = self.key(items)
        if (t, q, lora) in self._graphs:
            return
        self._stage(items, t)
        self._make(t, q, lora)

    def prepare_all(self, slots: Sequence[int] = ()) -> int:
        """Capture every bucket's graphs not captured yet, on synthetic rows in the scratch block: each bucket's items
        as long as its Q bound, the last shorter, and with `slots` (adapters in device slots now) the with-LoRA graphs too,
        items cycling over those slots, calibrated there. Returns how many graphs it made."""
        made = 0
        for t in self.tokens:
            for q in sorted({query_bucket(q, t) for q in range(1, t + 1)}):
                for lora in (False, True) if slots else (False,):
                    if (t, q, lora) in self._graphs:
                        continue
                    self._stage_synthetic(t, q, slots if lora else ())
                    made += self._make(t, q, lora)
        return made

    def run(self, items: list, logit_rows: list[int]) -> torch.Tensor:
        """Logits [M, V] fp32 of a step of `items` (runner BatchItems), rows `logit_rows` (the flat index of the last
        token of each item that wants logits, in item order, as the eager forward takes them)."""
        t, q, lora = self.key(items)
        if (t, q, lora) not in self._graphs:  # not prepared by the engine (tests drive the runner that way)
            self._stage(items, t)
            self._make(t, q, lora)
        self._stage(items, t, logit_rows)
        graph = self._graphs[(t, q, lora)]
        if graph is None:
            self._forward(t, q, lora)  # CPU: the static-buffer forward, eagerly
            self.last_lora_us = None  # the timer's sections measured it
        else:
            graph.replay()
            self.last_lora_us = self._lora_share(t, q) if lora else 0
        return self.logits[: len(logit_rows)]

    # ---- internals

    def _lora_share(self, t: int, q: int) -> int:
        """The staged step's LoRA µs: the bucket's calibrated share in proportion to its adapter tokens. The shrink and
        expand programs a step runs go by its adapter rows, and a bucket holds steps of 1 to T of them: charged whole, a
        step with one adapter row beside base prompts paid (to that one request) for a bucket calibrated on adapter rows
        only (prepare_all). Still an estimate; the engine caps it at the step's measured total."""
        return round(self.lora_us[(t, q)] * self._staged_lora_tokens / self._calibrated_tokens[(t, q)])

    def _stage(self, items: list, t: int, logit_rows: list[int] | None = None) -> None:
        """Fill the next staging row with a step of `items` in token bucket t and copy it to the device buffers."""
        b, bs, maxb = self.batch, self.kv.block_size, self.max_blocks
        self._fences[self._row].wait()
        h64, h32 = self._host64[self._row].numpy(), self._host32[self._row].numpy()
        n = sum(len(it.token_ids) for it in items)
        tmax = self.tokens[-1]
        ids, pos, slots = (h64[i * tmax : i * tmax + t] for i in range(3))
        rest = h64[3 * tmax :]
        lens, cu, logit = rest[:b], rest[b : 2 * b + 1], rest[2 * b + 1 : 3 * b + 1]
        tables = rest[3 * b + 1 :].reshape(b, maxb)
        q = np.fromiter((len(it.token_ids) for it in items), dtype=np.int64, count=len(items))
        ctx = np.fromiter((it.context_len for it in items), dtype=np.int64, count=len(items))
        k = len(items)
        tables[:] = self.scratch_block
        for i, it in enumerate(items):
            table = self.block_table(it.seq_id)
            tables[i, : len(table)] = table
        cu[0] = 0
        np.cumsum(q, out=cu[1 : k + 1])
        cu[k + 1 :] = n
        seq_of = np.repeat(np.arange(k), q)  # [n] item of each token
        p = np.arange(n) - cu[:k][seq_of] + ctx[seq_of]  # [n] position of each token in its sequence
        ids[:n] = [tok for it in items for tok in it.token_ids]
        pos[:n] = p
        slots[:n] = tables[seq_of, p // bs] * bs + p % bs
        ids[n:], pos[n:] = 0, 0
        slots[n:] = self.scratch_block * bs + np.arange(t - n) % bs  # padding rows: the scratch block
        lens[:k] = ctx + q
        lens[k:] = 1
        rows = logit_rows if logit_rows is not None else []
        logit[: len(rows)] = rows
        logit[len(rows) :] = 0
        h32[:k] = [it.lora_slot for it in items]
        h32[k:b] = -1
        h32[b:] = cu
        self._dev64.copy_(self._host64[self._row], non_blocking=True)
        self._dev32.copy_(self._host32[self._row], non_blocking=True)
        self._fences[self._row].copied()
        self._row ^= 1
        self._staged_lora_tokens = sum(len(it.token_ids) for it in items if it.lora_slot >= 0)

    def _stage_synthetic(self, t: int, q: int, slots: Sequence[int]) -> None:
        """A step of bucket (t, q) on the scratch block: items of q tokens (the last shorter) up to t tokens or the
        batch, adapters cycling over `slots` (none when empty)."""
        q = min(q, self.max_blocks * self.kv.block_size)  # no real item is longer (fits)
        k = min(self.batch, -(-t // q))
        lens = [q] * (k - 1) + [t - q * (k - 1)] if k * q >= t else [q] * k
        scratch = [self.scratch_block] * self.max_blocks

        class _Item:  # what _stage reads of a runner item
            def __init__(self, i: int, n: int):
                self.seq_id, self.token_ids, self.context_len = i, (0,) * n, 0
                self.lora_slot = slots[i % len(slots)] if slots else -1

        items = [_Item(i, n) for i, n in enumerate(lens)]
        table = self.block_table
        self.block_table = lambda _: scratch  # type: ignore[method-assign]
        try:
            self._stage(items, t)
        finally:
            self.block_table = table  # type: ignore[method-assign]

    def _make(self, t: int, q: int, lora: bool) -> int:
        """Capture the staged bucket's graph (and, with LoRA, the one without and the calibration); graphs made."""
        made = 0
        for flag in (lora, False) if lora else (False,):
            if (t, q, flag) not in self._graphs:
                self._graphs[(t, q, flag)] = capture(lambda: self._forward(t, q, flag), self.lora, self._pool)[0] if self.capture else None
                made += 1
        if lora and self.capture and (t, q) not in self.lora_us:
            with_lora, without = self._graphs[(t, q, True)], self._graphs[(t, q, False)]
            assert with_lora is not None and without is not None
            self.lora_us[(t, q)] = lora_share_us(with_lora, without)
            self._calibrated_tokens[(t, q)] = max(1, self._staged_lora_tokens)
        return made

    def _forward(self, t: int, q: int, lora: bool) -> torch.Tensor:
        attn = AttentionMetadata(
            kv_cache=self.kv,
            slot_mapping=self.slot_mapping[:t],
            kernel=self.lora.backend.paged_attention,
            block_table=self.tables,
            seq_lens=self.seq_lens,
            cu_seqlens_q=self.cu,
            max_query_len=q,
        )
        segments = LoraSegments(slot=self.group_slot, start=self.group_start, max_len=q, num_rows=t) if lora else None
        self.lora.set_batch(segments=segments)
        try:
            out = self.model(self.ids[:t], self.pos[:t], attn, self.logit_rows)  # [batch, V] fp32
            self.logits.copy_(out)
            return self.logits
        finally:
            self.lora.set_batch()
