"""Continuous batching: which requests run in the next step, and how many of their tokens.

Each step (`schedule`) spends a budget of `max_num_batched_tokens` tokens:

1. Running requests first, highest priority first (then earliest arrival): each gets its next tokens,
   one for a decode, up to the rest of the budget for a prompt still being prefilled (chunked
   prefill). If its KV blocks cannot grow (the pool is out of blocks, or its tenant is at quota), the
   lowest-ranked running request not yet scheduled in this step (of the same tenant, for a quota) is
   preempted: its blocks are freed and it goes back to waiting, to be recomputed later (vLLM's
   recompute preemption). When none is left below it, the request preempts itself.
2. Then waiting requests, in the same order, while the budget, the batch size and the blocks allow:
   each first looks its known tokens up in the prefix cache, then needs its adapter pinned in a slot
   (which may mean waiting for the admission token bucket or for a slot to free up; others go ahead
   meanwhile) and blocks for its first chunk. A request of a tenant at quota is skipped; one that does
   not fit the free blocks stops admission, so a long request is not passed over for ever. Admission
   keeps a watermark of free blocks (1% of the pool, at least one) while anything runs, so that a newly
   admitted request does not preempt a running one at its next token. While the running batch has work
   and most of the requests that could be admitted still wait for their adapters' store reads, a step
   admits none of them, for at most `admission_hold_ms` (engine.admission), so that a batch is admitted in
   few prompt steps rather than one per read landing; likewise while running requests that reach their
   max_new_tokens within a few steps would free more places, so that a batch admitted in parts is not
   replaced in parts for ever.

Blocks are taken as needed rather than reserved for a request's worst case: more requests run at once,
at the price of a preemption when they all grow at the same time.

After the forward, `prefetch` loads ahead for the waiting requests at the head of the queue: the
adapters of those the next schedules can admit are copied into L1 (on CUDA a side-stream copy that
overlaps the step's compute instead of delaying the next step), the others only read from the store
on read-ahead threads.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from engine.adapter_pool import WAIT_SLOT, AdapterPool
from engine.admission import COALESCE_STEPS, AdmissionHold
from engine.api import AdapterError, EngineError
from engine.block_manager import BlockManager, namespace_hash
from engine.config import EngineConfig
from engine.sequence import Sequence

log = logging.getLogger("lorabatch.engine")


@dataclass(frozen=True)
class Scheduled:
    seq: Sequence
    tokens: tuple[int, ...]  # the tokens computed in this step
    samples: bool  # the chunk reaches the last known token, so the step samples the next one


@dataclass
class Plan:
    items: list[Scheduled] = field(default_factory=list)
    failed: list[tuple[Sequence, EngineError]] = field(default_factory=list)  # adapter failures, no fallback
    preempted: list[Sequence] = field(default_factory=list)


READ_AHEAD_BATCHES = 2  # prefetch reads ahead for this many batches' worth of waiting requests past the next admissions


def _rank(seq: Sequence) -> tuple[int, int]:
    return (-seq.priority, seq.order)


def _tokens_left(seq: Sequence) -> int:
    return seq.request.sampling.max_new_tokens - len(seq.output_ids)


class StepPlanner:
    """Which requests run in each engine step, and how many of their tokens (module docstring). Not the worker's
    consumer.scheduler.Scheduler, which batches Kafka jobs by adapter and tenant before they reach the engine."""

    def __init__(self, config: EngineConfig, blocks: BlockManager, pool: AdapterPool, base_fingerprint: str, *,
                 clock: Callable[[], float] = time.monotonic):  # fmt: skip
        self.config = config
        self.blocks = blocks
        self.pool = pool
        self.base_fingerprint = base_fingerprint
        self.waiting: list[Sequence] = []  # in admission order (`_rank`), kept so: each step walks it, 1,000 long in a cold start
        self.running: list[Sequence] = []
        self.watermark = max(1, blocks.num_blocks // 100)
        self.preemptions = 0
        self.load_ahead_cuts = 0  # `prefetch` walks that stopped placing at their deadline (engine.load_ahead_share)
        self.prompt_tokens_looked_up = 0  # prompt tokens of first admissions
        self.prompt_tokens_hit = 0  # of those, found in the prefix cache
        self.hold = AdmissionHold(config.admission_hold_ms, clock)
        self._asked: tuple | None = None  # what the last `admits_none` that said yes saw, for `note_held`
        self._keys: dict[int, tuple[bytes | None, int, list[bytes]]] = {}  # id(seq) -> (namespace, len(tokens), keys)

    def add(self, seq: Sequence) -> None:
        bisect.insort(self.waiting, seq, key=_rank)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted request out, releasing its blocks and adapter pin."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        self._keys.pop(id(seq), None)

    def schedule(self) -> Plan:
        plan = Plan()
        budget = self.config.max_num_batched_tokens
        queue = sorted(self.running, key=_rank)
        i = 0
        while i < len(queue) and budget > 0:
            seq = queue[i]
            n = min(seq.num_uncomputed, budget)
            assert n > 0, seq.key
            total = seq.num_computed + n
            while (why := self.blocks.can_grow(seq.seq_id, total)) is not None:
                lower = [s for s in queue[i + 1 :] if why == "pool" or s.tenant_id == seq.tenant_id]
                victim = lower[-1] if lower else seq
                self._preempt(victim, plan)
                queue.remove(victim)
                if victim is seq:
                    break
            else:
                self.blocks.grow(seq.seq_id, total)
                plan.items.append(Scheduled(seq, seq.chunk(n), total == len(seq.tokens)))
                budget -= n
                i += 1
        queue = [s for s in self.waiting if s not in plan.preempted]  # not back in the step that preempted it
        if self._held(plan, queue, budget):
            return plan
        with self.pool.placing():  # the eviction candidates ranked once for the step's admissions
            for seq in queue:
                if budget == 0 or len(self.running) >= self.config.max_batch_size:
                    break
                verdict = self._admit(seq, budget, plan)
                if verdict == "stop":
                    break
                if isinstance(verdict, Scheduled):
                    plan.items.append(verdict)
                    budget -= len(verdict.tokens)
        return plan

    def prefetch(self, busy_slots: Iterable[int], places: int, deadline_ns: int | None = None) -> None:
        """Load ahead for the waiting requests next in line, in admission order: the adapters of the first `places` of
        them (those the next schedule can admit, as the engine counts them) go into L1 now, until L1 has no room left
        that is not held for a request before them (each one placed is kept from eviction for the rest of the walk, so
        a later request never takes an earlier one's slot); the adapters of the rest, and of those after a refusal, are
        only read from the store on read-ahead threads.

        Placing more than the next admissions need cost the GPU its work: at 2,000 adapters on an H200 (issue 19),
        the step that admitted a batch of 64 also placed the next 64 adapters, about 30 ms of host time against a
        20 ms prefill, so the GPU waited; the decode rounds that follow have the time. Walking on placing past the
        first refusal only repeats it (each request scanned every slot for victims: about 0.7 s of a 4.6 s pass).

        `deadline_ns` (time.perf_counter_ns): no placement starts past it; the walk goes on reading ahead, and the
        requests left unplaced are placed by a later walk or at their admission (`load_ahead_cuts` counts the walks it
        ended)."""
        exclude = set(busy_slots)
        placing = True
        # The walk covers the next admissions and READ_AHEAD_BATCHES batches after them: it runs once a round, and over
        # thousands of waiting requests it would cost more host time than a round of GPU work (L1's rows, max_loras, are
        # no bound once the byte budget, not the rows, limits residency).
        walk = min(len(self.waiting), max(places, 0) + READ_AHEAD_BATCHES * self.config.max_batch_size)
        with self.pool.placing():  # the eviction candidates ranked once for the walk
            for i, seq in enumerate(self.waiting[:walk]):
                if seq.adapter_key is None or seq.lora_slot >= 0 or self.pool.failed(seq.adapter_key) is not None:
                    continue
                if placing and i < places and deadline_ns is not None and time.perf_counter_ns() >= deadline_ns:
                    placing = False
                    self.load_ahead_cuts += 1
                if not placing or i >= places:
                    if self.pool.read_ahead(seq.adapter_key) is None:
                        break  # no room for another read (or no token): none after it would start either
                    continue
                slot = self.pool.prefetch(seq.adapter_key, exclude)
                if slot == WAIT_SLOT:
                    placing = False
                elif slot is not None:
                    exclude.add(slot)

    def admits_none(self) -> bool:
        """Whether the next schedule, every running request decoding, would admit none of the waiting ones, by what it
        can tell before trying: none could take a place (the batch is full, or the token budget is spent), none is ready
        (each awaits a store read), or the admission hold holds them back (engine.admission). Changes nothing: the
        engine runs a short decode round instead of that schedule (engine.engine `_held_steps`), and `note_held` then
        counts its hold."""
        self._asked = None
        budget = self.config.max_num_batched_tokens - len(self.running)
        free = self.config.max_batch_size - len(self.running)
        if not self.waiting or free <= 0 or budget <= 0:
            return True
        ready, want, soon = self._hold_counts(self.running, self.waiting, budget)
        now = self.hold.clock()
        if ready and not self.hold.would_hold(bool(self.running), ready, want, soon, now=now):
            return False
        self._asked = (bool(self.running), ready, want, soon, now)
        return True

    def note_held(self, steps: int = 1) -> None:
        """The round of `steps` that `admits_none` answered for runs (the engine launched it): its hold counted, or a
        hold ended when none was ready, as the schedule that round replaces would (at the time `admits_none` asked)."""
        if self._asked is not None:
            running, ready, want, soon, now = self._asked
            self._asked = None
            self.hold.hold(running, ready, want, soon, now=now, steps=steps)

    # ---- internals

    def _held(self, plan: Plan, queue: list[Sequence], budget: int) -> bool:
        """Whether this step holds back its admissions (engine.admission): `queue`, the waiting requests in admission
        order."""
        ready, want, soon = self._hold_counts([it.seq for it in plan.items if it.samples], queue, budget) if plan.items else (0, 0, 0)
        return self.hold.hold(bool(plan.items), ready, want, soon)

    def _hold_counts(self, samplers: list[Sequence], queue: list[Sequence], budget: int) -> tuple[int, int, int]:
        """(ready, want, soon) for AdmissionHold.hold, with the batch at work (`samplers`: its requests that sample a
        token in the step). The ready ones are counted only up to what lets the step admit: over thousands of waiting
        requests the walk costs host time."""
        free = self.config.max_batch_size - len(self.running)
        want = max(0, min(free, len(queue))) if budget > 0 else 0
        ready = soon = 0
        if want:
            # places that requests reaching their max_new_tokens within COALESCE_STEPS steps free (a sampling row's
            # next steps are decodes; one that may stop earlier, by EOS or a stop string, frees its place sooner)
            left_of = [t for seq in samplers if (t := _tokens_left(seq)) <= COALESCE_STEPS]
            ending = len(left_of)
            # worth waiting for only while the hold costs less than the prompt steps it saves (engine.admission)
            refills = -(-len(queue) // self.config.max_batch_size)  # the refills the waiting make, each split too (engine.admission)
            if ending and self.hold.worth_waiting(want, max(left_of), self.config.max_batch_size, refills):
                # as many as one step's token budget takes then (theirs back in it): a step admits no more
                fits, left = 0, budget + ending
                for seq in queue[: free + ending]:
                    left -= seq.num_uncomputed
                    if left < 0:
                        break
                    fits += 1
                soon = max(0, fits - want)
            enough = 1 if soon else self.hold.enough(want)  # with places freeing, any ready request is held back
            for seq in queue:
                if ready >= enough:
                    break
                ready += seq.adapter_key is None or seq.lora_slot >= 0 or not self.pool.awaits_read(seq.adapter_key)
        return ready, want, soon

    def _admit(self, seq: Sequence, budget: int, plan: Plan) -> Scheduled | str | None:
        """Admit `seq` if it can run now: its Scheduled item, None to skip it, or "stop" to end admission."""
        if seq.adapter_key is not None and seq.lora_slot < 0 and self.pool.waits_for_read(seq.adapter_key):
            return None  # its adapter is being read on a read-ahead thread (or waits for one): skipped before any lookup
        hits, keys = self._lookup(seq)
        total = len(hits) * self.blocks.block_size + min(len(seq.tokens) - len(hits) * self.blocks.block_size, budget)
        if not self._fits(seq, hits, total):
            return "stop" if self._why_not(seq, hits, total) == "pool" else None
        if seq.adapter_key is not None and seq.lora_slot < 0:
            known = self.pool.sha_of(seq.adapter_key)
            try:
                got = self._acquire(seq.adapter_key)
            except EngineError as e:
                if not seq.request.allow_base_fallback:
                    self.waiting.remove(seq)
                    self._keys.pop(id(seq), None)
                    plan.failed.append((seq, e))
                    return None
                seq.adapter_key, seq.base_fallback = None, True  # admitted on the base from the next step on
                self._keys.pop(id(seq), None)
                return None
            if isinstance(got, str):
                return None  # waiting for the bucket or a slot
            seq.lora_slot, charges = got
            seq.load_charges.extend(charges)
            seq.adapter_sha = self.pool.sha_of(seq.adapter_key)
            if known != seq.adapter_sha:  # first read of a key registered without its sha256: a new namespace
                hits, keys = self._lookup(seq)
                total = len(hits) * self.blocks.block_size + min(len(seq.tokens) - len(hits) * self.blocks.block_size, budget)
                if not self._fits(seq, hits, total):
                    self.pool.release(seq.adapter_sha)
                    seq.lora_slot = -1
                    return None
        cached = self.blocks.open(seq.seq_id, seq.tenant_id, self._namespace(seq), hits, keys)
        self.blocks.grow(seq.seq_id, total)
        seq.num_computed = cached
        if not seq.scheduled_once:
            self.prompt_tokens_looked_up += len(seq.prompt_ids)
            self.prompt_tokens_hit += cached
            seq.timings.cached_tokens = cached
        self.waiting.remove(seq)
        self.running.append(seq)
        return Scheduled(seq, seq.chunk(total - cached), total == len(seq.tokens))

    def _acquire(self, key: str) -> tuple[int, list] | str:
        """pool.acquire, with an unexpected exception (a bug met by this adapter's content) as the AdapterError
        `adapter_load_failed`, so that it fails the adapter's requests alone instead of the step."""
        try:
            return self.pool.acquire(key)
        except EngineError:
            raise
        except Exception as e:
            log.exception("acquiring adapter %r raised", key)
            raise AdapterError(f"loading adapter {key!r} raised {type(e).__name__}: {e}; it was logged", code="adapter_load_failed") from e

    def _fits(self, seq: Sequence, hits: list[int], total: int) -> bool:
        return self._why_not(seq, hits, total) is None

    def _why_not(self, seq: Sequence, hits: list[int], total: int) -> str | None:
        cost = self.blocks.admission_cost(hits, total)
        if self.blocks.tenant_blocks(seq.tenant_id) + cost > self.blocks.tenant_quota:
            return "quota"
        headroom = self.watermark if self.running else 0
        if cost > self.blocks.num_free - headroom:
            return "pool"
        return None

    def _namespace(self, seq: Sequence) -> bytes | None:
        if seq.adapter_key is not None and seq.adapter_sha is None and self.pool.sha_of(seq.adapter_key) is None:
            return None  # content not known yet: nothing can be cached under it
        sha = seq.adapter_sha or (self.pool.sha_of(seq.adapter_key) if seq.adapter_key else None)
        return namespace_hash(seq.tenant_id, seq.adapter_key, sha, self.base_fingerprint)

    def _lookup(self, seq: Sequence) -> tuple[list[int], list[bytes]]:
        ns = self._namespace(seq)
        cached = self._keys.get(id(seq))
        if cached is None or cached[0] != ns or cached[1] != len(seq.tokens):
            cached = (ns, len(seq.tokens), self.blocks.prefix_keys(ns, seq.tokens))
            self._keys[id(seq)] = cached
        keys = cached[2]
        return self.blocks.lookup(keys), keys

    def _preempt(self, seq: Sequence, plan: Plan) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed = 0
        seq.timings.preemptions += 1
        self.preemptions += 1
        bisect.insort(self.waiting, seq, key=_rank)
        plan.preempted.append(seq)

    def _release(self, seq: Sequence) -> None:
        self.blocks.free(seq.seq_id)
        if seq.lora_slot >= 0:
            assert seq.adapter_sha is not None
            self.pool.release(seq.adapter_sha)
            seq.lora_slot = -1
