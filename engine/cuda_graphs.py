"""CUDA graphs for decode steps: one graph per batch-size bucket serves every mix of adapters.

A decode step launches ~16 kernels per layer (~30 with LoRA): at llama-1b that is 260-500 launches of
2-10 µs each, against ~0.6 ms of weights to read, so launching them from Python one by one (5-10 µs of
CPU each) would cost more than the work. A graph replays them all with one call.

Inputs. Everything that changes from step to step is a graph INPUT: a static device buffer the graph
reads, which the step overwrites before `replay()`: token ids, positions, KV slot of each new token,
sequence lengths, block tables and the adapter slot of each row. The adapter slot rows feed the
multi-LoRA kernels' per-row groups (kernels/lora_segments.py `segments_per_row`, no host work), and
each slot's rank and scale are read from the slot tensors at run time, so one graph runs any mix of
adapters and ranks, and an adapter loaded after capture needs no new graph. All inputs are int64
views of ONE buffer, filled on the host (pinned) and copied with one H2D copy per step.

Buckets (engine.backend.graph_batch_sizes): a batch of B rows runs in the smallest bucket b >= B, its
rows B .. b - 1 padding: token 0 at position 0, no adapter, a sequence of length 1 whose block table
points at a scratch block (the KV pool has one more block than the block manager hands out), so the
padding writes and reads only that block. Each bucket has two graphs: with the LoRA ops, for batches with
any adapter row, and without, for base-only batches (which therefore carry no LoRA time, as in eager mode).
They are captured at the first step that needs them, or all at once between steps (`prepare_all`, through
Engine.capture_decode_graphs after a warm-up), which keeps a capture and its calibration out of serving. The graphs share one memory pool; only
one runs at a time and each one's output is consumed before the next replay.

Chains (`run_chain`): when every request of a batch is decoding and nothing else waits, the engine runs
several decode steps per scheduling round (engine.config `decode_steps`), replayed back to back with no
host sync between them: each step's sampled tokens are copied on the device into the next replay's ids
input, and the other inputs of step j (positions + j, their KV slots, lengths + j) are staged in the
pinned buffer's row j and copied before its replay. The host then reads all the steps' tokens at once.
At llama-1b, batch 32, a step is ~1.3 ms of GPU work and ~0.4 ms of host work (scheduling, staging,
reading the tokens, bookkeeping) that the GPU otherwise waits for each step.

Falls back to the eager forward (engine.runner) for prefill or mixed steps (any row with more than one
new token), for batches larger than the largest bucket, and for sequences longer than the static block
table. Not on the CPU: there `capture=False` runs the same static-buffer forward eagerly, so tests
check the padding and the buffers with the Triton interpreter.

Timing. The engine measures a step with CUDA events around it, replay included. Events inside a graph
would be graph nodes, so the LoRA share of a graphed step is calibrated once per bucket instead: at
capture, the two graphs of the bucket are replayed alternately (11 times each, after 3 warm-ups) and the
LoRA share is the difference of their median times (at least 0), capped at the step's measured total by
the engine, so base + LoRA still sums to the measured step exactly. Each bucket is calibrated at both ends
of the mixes it meets, on synthetic rows in the scratch block: every row with an adapter (cycling over the
adapters of the capturing step, or with `prepare_all` over those in device slots then), and one adapter
row beside b - 1 base rows. A step with k adapter rows is charged between the two in proportion to k
(`lora_share`): the decode LoRA kernels run a program per adapter row and slice, so their time is a floor
(a launch's latency per kernel, which a lone adapter row pays in full) plus a part that grows with the rows.
Charged the all-adapter figure whatever its mix (as before this version), a step's one adapter row paid for
the 63 others of a bucket of 64; charged by rows alone, it would pay less than its kernels' floor. Ranks are
those of the calibration's adapters, so it is still an estimate (eager steps measure theirs); it moves time
between a step's base and LoRA shares, never the step's total.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Hashable, Sequence
from contextlib import AbstractContextManager

import numpy as np
import torch

from engine.attention import AttentionMetadata
from engine.kv_cache import KVCache
from engine.lora import LoraState
from engine.model import LlamaForCausalLM
from kernels.lora_segments import segments_per_row

_CALIBRATION_WARMUP, _CALIBRATION_REPS = 3, 11


class CopyFence:
    """A pinned staging row's guard: its next fill waits on the host until the device copy out of it has been made. A
    step's copy queues behind the replays before it, and a failing step's halves (engine.isolation) are staged one after
    another with no sync between them: refilled meanwhile, the row would give the queued copy the next step's inputs."""

    def __init__(self, on: bool):
        self.on = on
        self._event: torch.cuda.Event | None = None

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()
            self._event = None

    def copied(self) -> None:
        if self.on:
            self._event = torch.cuda.Event()
            self._event.record()


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaForCausalLM,
        lora: LoraState,
        kv: KVCache,
        *,
        sizes: tuple[int, ...],
        max_blocks: int,
        scratch_block: int,
        block_table: Callable[[Hashable], list[int]],
        capture: bool,
        max_chain: int = 1,
    ):
        assert sizes and list(sizes) == sorted(set(sizes)) and sizes[0] >= 1, sizes
        assert lora.backend.triton, "graphs need the triton backend: the torch one loops over sequences on the host"
        self.model, self.lora, self.kv = model, lora, kv
        self.sizes, self.max_blocks, self.scratch_block = sizes, max_blocks, scratch_block
        self.block_table = block_table
        self.capture = capture
        device = lora.device
        mb = sizes[-1]
        n = 5 * mb + mb * max_blocks
        # [ids | positions | KV slots | seq lens | adapter slots | block tables], each section mb rows. One staging
        # row per step of a chain (run_chain), as step j's copy may still be queued when step j + 1's row is filled,
        # and two sets of them used in turn by consecutive chains: the engine stages the next round while the last
        # one still runs (engine.engine, _next_round), and that one's copies read their rows until it ends.
        self.max_chain = max(1, max_chain)
        # The last row stages single steps (run, and prepare's capture), which may come while a chain still runs.
        self._host = torch.zeros(2 * self.max_chain + 1, n, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._host_np = self._host.numpy()
        self._single = CopyFence(device.type == "cuda")  # of the last row
        self._chain_set = 0  # which set of staging rows the next chain fills
        self._dev = torch.zeros(n, dtype=torch.int64, device=device)
        self.ids, self.pos, self.slot_mapping, self.seq_lens, self.adapter_slot = self._dev[: 5 * mb].view(5, mb)
        self.tables = self._dev[5 * mb :].view(mb, max_blocks)  # [mb, max_blocks]
        self._graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None]] = {}
        self.lora_us: dict[int, int] = {}  # bucket -> calibrated LoRA share of a step with every row an adapter's, µs
        self.lora_floor_us: dict[int, int] = {}  # bucket -> ... of a step with one adapter row, µs
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self.last_lora_us: int | None = None  # of the last run: calibrated share (None when not captured: timer)

    def fits(self, items: list, steps: int = 1) -> bool:
        """Whether `steps` decode steps of these runner items can replay a graph: all decode-shaped, few enough, and
        short enough for the static block tables after the last step."""
        if len(items) > self.sizes[-1] or steps > self.max_chain:
            return False
        limit = self.max_blocks * self.kv.block_size - steps + 1
        return all(len(it.token_ids) == 1 and it.context_len < limit for it in items)

    def bucket(self, batch: int) -> int:
        return next(b for b in self.sizes if b >= batch)

    def __len__(self) -> int:
        """How many graphs are captured (or prepared, without capture) so far."""
        return len(self._graphs)

    def captured(self, items: list) -> bool:
        """Whether the graph a decode step of `items` replays exists already."""
        return (self.bucket(len(items)), any(it.lora_slot >= 0 for it in items)) in self._graphs

    def prepare(self, items: list) -> None:
        """Capture (and calibrate) the graph a decode step of `items` needs, if this is its bucket's first such step.
        The engine calls it before it starts timing the step: capture is a one-time cost, not the step's."""
        b, lora = self.bucket(len(items)), any(it.lora_slot >= 0 for it in items)
        if (b, lora) in self._graphs:
            return
        self._stage_single(items, b)
        self._graphs[(b, lora)] = self._capture(b, lora)
        if lora and self.capture:
            if (b, False) not in self._graphs:
                self._graphs[(b, False)] = self._capture(b, False)
            self._calibrate(b, sorted({it.lora_slot for it in items if it.lora_slot >= 0}))

    def prepare_all(self, slots: Sequence[int] = ()) -> int:
        """Capture every bucket's graphs not captured yet, on padding rows; with `slots` (adapters in device slots now),
        the with-LoRA graphs too, their rows cycling over those slots, and calibrate them on those rows. So no step pays
        a bucket's first capture (and its 28-replay calibration: a decode step of 127-159 ms against 2.6 on the H200,
        issue 19) in the middle of serving. Returns how many graphs it made."""
        made, mb = 0, self.sizes[-1]
        for b in self.sizes:
            for lora in (False, True) if slots else (False,):
                if (b, lora) in self._graphs:
                    continue
                self._stage_single([], b, slots if lora else ())
                self._graphs[(b, lora)] = self._capture(b, lora)
                made += 1
            if slots and self.capture and b not in self.lora_us:
                self._calibrate(b, slots)
        return made

    def run(self, items: list, logit_rows: list[int] | None) -> torch.Tensor:
        """Logits [M, V] fp32 of a decode step of `items` (runner BatchItems, one token each); M = len(logit_rows)
        rows in that order, or every item's when None."""
        self.prepare(items)
        batch = len(items)
        b = self.bucket(batch)
        lora = any(it.lora_slot >= 0 for it in items)
        self._stage_single(items, b)
        graph, out = self._graphs[(b, lora)]
        if graph is None:
            out = self._forward(b, lora)  # CPU: the static-buffer forward, eagerly
        else:
            graph.replay()
        self.last_lora_us = self.lora_share(b, items) if graph is not None else None
        assert out is not None
        if logit_rows is None:
            return out[:batch]
        return out[:batch] if logit_rows == list(range(batch)) else out[torch.tensor(logit_rows, device=out.device)]

    def run_chain(self, items: list, steps: int, sample: Callable[[torch.Tensor], torch.Tensor],
                  section: Callable[[int], AbstractContextManager], first_ids: torch.Tensor | None = None) -> list[torch.Tensor]:  # fmt: skip
        """`steps` decode steps of `items` back to back, with no host sync between them: step j feeds the tokens
        `sample` drew from step j - 1's logits (a device-to-device copy into the ids input) at positions + j.
        Returns each step's sampled tokens [batch] (device tensors); `section(j)` wraps step j's replay and
        sampling (the engine's timer). The block tables must already cover context + steps tokens. `first_ids` [batch]
        on the device replaces the items' own tokens as the first step's input (the engine's next round)."""
        assert 1 <= steps <= self.max_chain, (steps, self.max_chain)
        self.prepare(items)
        batch = len(items)
        b = self.bucket(batch)
        lora = any(it.lora_slot >= 0 for it in items)
        base_row = self._chain_set * self.max_chain
        self._chain_set ^= 1
        self._fill(items, b, row=base_row)
        for j in range(1, steps):
            self._advance(base_row, base_row + j, batch, j)
        graph, out = self._graphs[(b, lora)]
        chosen: list[torch.Tensor] = []
        for j in range(steps):
            with section(j):
                self._dev.copy_(self._host[base_row + j], non_blocking=True)
                if j or first_ids is not None:
                    self.ids[:batch].copy_(chosen[-1] if j else first_ids)
                if graph is None:
                    out = self._forward(b, lora)
                else:
                    graph.replay()
                assert out is not None
                chosen.append(sample(out[:batch]))
        self.last_lora_us = self.lora_share(b, items) if graph is not None else None
        return chosen

    def lora_share(self, b: int, items: list) -> int:
        """The calibrated LoRA µs of a replay of bucket b with these items (module docstring, "Timing"): 0 without
        adapter rows, the one-row floor with one, the all-row figure with b, in proportion to the rows between."""
        k = sum(1 for it in items if it.lora_slot >= 0)
        if k == 0:
            return 0
        full, floor = self.lora_us[b], self.lora_floor_us[b]
        return full if k >= b else floor + (full - floor) * (k - 1) // (b - 1)

    # ---- internals

    def _fill(self, items: list, b: int, row: int = 0) -> None:
        """Stage the inputs of a decode step of `items` in staging row `row`."""
        h, mb, bs, maxb = self._host_np[row], self.sizes[-1], self.kv.block_size, self.max_blocks
        batch = len(items)
        ids, pos, slots, lens, adapters = (h[i * mb : i * mb + b] for i in range(5))
        tables = h[5 * mb :].reshape(mb, maxb)
        for i, it in enumerate(items):
            p = it.context_len
            table = self.block_table(it.seq_id)
            tables[i, : len(table)] = table
            ids[i], pos[i], slots[i], lens[i], adapters[i] = it.token_ids[0], p, table[p // bs] * bs + p % bs, p + 1, it.lora_slot
        # padding rows: token 0 at position 0 of a 1-token sequence in the scratch block, no adapter
        ids[batch:], pos[batch:], slots[batch:], lens[batch:], adapters[batch:] = 0, 0, self.scratch_block * bs, 1, -1
        tables[batch:b, 0] = self.scratch_block

    def _stage_single(self, items: list, b: int, slots: Sequence[int] = (), adapter_rows: int | None = None) -> None:
        """Stage a single step (with `slots`, padding rows cycling over them, the first `adapter_rows` of them, all by
        default: the synthetic steps of prepare_all and of the calibration) in the last row and copy it to the device,
        once the last such copy is made (CopyFence)."""
        self._single.wait()
        self._fill(items, b, row=-1)
        if slots:
            mb, k = self.sizes[-1], b if adapter_rows is None else adapter_rows
            self._host_np[-1][4 * mb : 4 * mb + b] = [slots[i % len(slots)] if i < k else -1 for i in range(b)]
        self._dev.copy_(self._host[-1], non_blocking=True)
        self._single.copied()

    def _advance(self, src: int, dst: int, batch: int, ahead: int) -> None:
        """Stage in row `dst` the step `ahead` steps after row `src`'s: the same rows and block tables, positions and
        lengths + ahead and their KV slots, in a few vectorised ops (the ids are fed on the device, run_chain)."""
        mb, bs = self.sizes[-1], self.kv.block_size
        h = self._host_np[dst]
        h[:] = self._host_np[src]
        pos = h[mb : mb + batch]
        pos += ahead
        h[3 * mb : 3 * mb + batch] = pos + 1
        tables = h[5 * mb :].reshape(mb, self.max_blocks)
        h[2 * mb : 2 * mb + batch] = tables[np.arange(batch), pos // bs] * bs + pos % bs

    def _forward(self, b: int, lora: bool) -> torch.Tensor:
        attn = AttentionMetadata(
            kv_cache=self.kv,
            slot_mapping=self.slot_mapping[:b],
            kernel=self.lora.backend.paged_attention,
            block_table=self.tables[:b],
            seq_lens=self.seq_lens[:b],
            max_query_len=1,
        )
        self.lora.set_batch(segments=segments_per_row(self.adapter_slot[:b]) if lora else None)
        try:
            return self.model(self.ids[:b], self.pos[:b], attn, None)  # [b, V] fp32
        finally:
            self.lora.set_batch()

    def _capture(self, b: int, lora: bool) -> tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None]:
        if not self.capture:
            return None, None
        return capture(lambda: self._forward(b, lora), self.lora, self._pool)

    def _calibrate(self, b: int, slots: Sequence[int]) -> None:
        """The µs the LoRA ops add to a replay of bucket b with every row an adapter's (cycling over `slots`) and with
        one adapter row (module docstring, "Timing"), on synthetic rows: they write K/V only into the scratch block.
        The caller stages its own step again after this."""
        with_lora, without = self._graphs[(b, True)][0], self._graphs[(b, False)][0]
        assert with_lora is not None and without is not None and slots
        self._stage_single([], b, slots)
        self.lora_us[b] = lora_share_us(with_lora, without)
        self._stage_single([], b, slots, adapter_rows=1)
        self.lora_floor_us[b] = min(self.lora_us[b], lora_share_us(with_lora, without))


def capture(forward: Callable[[], torch.Tensor], lora: LoraState, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """A CUDA graph of `forward` on the static buffers it reads, and its output tensor (in the graph's pool)."""
    # Warm up on a side stream first, as torch.cuda.graphs asks: Triton compiles each kernel at its first
    # call, the expand builds its slice table, cuBLAS picks its kernels; none of that may happen in capture.
    # The warm-up writes this step's K/V at this step's slots, which the real replay writes again.
    device = lora.device
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        forward()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    lora.timed = False
    try:
        # Thread-local capture: the adapter pool's read-ahead threads pin host memory (cudaHostAlloc) at any time,
        # and in the default global mode such a call from another thread during a capture invalidates it
        # ("operation not permitted when stream is capturing"; seen on the H200 in issue 19's bench). The
        # capturing thread's own unsafe calls are still refused.
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            out = forward()
    finally:
        lora.timed = True
    return graph, out


def lora_share_us(with_lora: torch.cuda.CUDAGraph, without: torch.cuda.CUDAGraph) -> int:
    """µs the LoRA ops add to a replay: median with-LoRA minus median without, at least 0. Both graphs run the inputs
    staged now; the step's real replay comes after, so its K/V are the ones that stay."""
    times: dict[bool, list[float]] = {True: [], False: []}
    for rep in range(_CALIBRATION_WARMUP + _CALIBRATION_REPS):
        for flag, graph in ((True, with_lora), (False, without)):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            if rep >= _CALIBRATION_WARMUP:
                times[flag].append(start.elapsed_time(end))
    return max(0, round((statistics.median(times[True]) - statistics.median(times[False])) * 1000))
