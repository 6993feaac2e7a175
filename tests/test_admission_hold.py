"""Admission hold-back (engine.admission): while adapters' store reads land, a batch is admitted in few prompt steps, never
while nothing else runs, never for longer than the bound, and a failed read still fails its request: the decision
alone, and the planner over a fake pool, scheduling or stepping as the engine does with decode rounds in flight. The
engine with real store reads: tests/test_admission_hold_engine.py."""

from __future__ import annotations

import contextlib
import random

import pytest
from pydantic import ValidationError

from engine.adapter_pool import WAIT_READ
from engine.admission import AdmissionHold
from engine.api import AdapterError, GenerationRequest, SamplingParams
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.planner import Plan, StepPlanner
from engine.sequence import Sequence

BOUND_MS = 40.0


class FakeClock:
    def __init__(self) -> None:
        self.ms = 0  # integer milliseconds: no float drift at the bound

    def __call__(self) -> float:
        return self.ms / 1000


# ---- the decision alone


@pytest.mark.parametrize(
    ("name", "bound_ms", "calls", "held"),
    [
        # calls: (ms, the batch has work in the step, ready, places the waiting could fill)
        ("nothing waits", BOUND_MS, [(0, True, 0, 0)], [False]),
        ("nothing runs: never held", BOUND_MS, [(0, False, 1, 8), (10, False, 1, 8)], [False, False]),
        ("none ready: nothing to hold back", BOUND_MS, [(0, True, 0, 8)], [False]),
        ("3/4 of the places ready", BOUND_MS, [(0, True, 6, 8)], [False]),
        ("one short of 3/4", BOUND_MS, [(0, True, 5, 8)], [True]),
        ("one place, one ready", BOUND_MS, [(0, True, 1, 1)], [False]),
        ("two places, one ready", BOUND_MS, [(0, True, 1, 2)], [True]),
        ("the bound ends the hold", BOUND_MS, [(0, True, 1, 8), (39, True, 1, 8), (40, True, 1, 8)], [True, True, False]),
        ("a new hold after the bound", BOUND_MS, [(0, True, 1, 8), (40, True, 1, 8), (50, True, 1, 8), (80, True, 1, 8), (91, True, 1, 8)],
         [True, False, True, True, False]),
        ("an admission ends the hold", BOUND_MS, [(0, True, 1, 8), (30, True, 6, 8), (50, True, 1, 8), (80, True, 1, 8)],
         [True, False, True, True]),
        ("the batch idles mid-hold: the next hold starts afresh", BOUND_MS,
         [(0, True, 1, 8), (10, False, 1, 8), (20, True, 1, 8), (50, True, 1, 8), (61, True, 1, 8)], [True, False, True, True, False]),
        ("bound 0: never held", 0.0, [(0, True, 1, 8)], [False]),
    ],
)  # fmt: skip
def test_hold_decision(name, bound_ms, calls, held):
    """`AdmissionHold.hold` holds only while the batch runs, some are ready but fewer than 3/4 of the places, and the hold
    is younger than its bound; the bound runs from the hold's first step and restarts after any step that does not hold."""
    clock = FakeClock()
    hold = AdmissionHold(bound_ms, clock)
    got = []
    for ms, running, ready, want in calls:
        clock.ms = ms
        got.append(hold.hold(running, ready, want))
    assert got == held, name
    assert hold.holds == sum(held), name


# ---- the planner, over a fake pool


class FakePool:
    """The adapter pool as the planner sees it: an adapter in `reading` still comes from the store (WAIT_READ); one in
    `failing` has had its read fail; any other is read and gets a slot."""

    def __init__(self) -> None:
        self.reading: set[str] = set()
        self.failing: set[str] = set()
        self.slots: dict[str, int] = {}

    def awaits_read(self, key: str) -> bool:
        return key in self.reading

    def waits_for_read(self, key: str) -> bool:
        return key in self.reading

    def sha_of(self, key: str) -> str:
        return f"{hash(key) & 0xFFFF:064x}"

    def acquire(self, key: str):
        if key in self.failing:
            raise AdapterError(f"adapter {key!r} is corrupt", code="adapter_corrupt")
        if key in self.reading:
            return WAIT_READ
        return self.slots.setdefault(key, len(self.slots)), []

    def release(self, sha: str) -> None:
        pass

    def placing(self):
        return contextlib.nullcontext()


class Harness:
    """A StepPlanner over a FakePool and a fake clock; `step` schedules, computes what it planned, and advances the
    clock by `dt_ms` (a step's time)."""

    def __init__(self, hold_ms: float = BOUND_MS, batch: int = 8, dt_ms: int = 1):
        cfg = EngineConfig(max_batch_size=batch, max_prompt_tokens=16, max_new_tokens=512, max_num_batched_tokens=batch * 16,
                           kv_block_size=16, kv_num_blocks=batch * 40, admission_hold_ms=hold_ms)  # fmt: skip
        self.pool = FakePool()
        self.clock = FakeClock()
        self.dt_ms = dt_ms
        self.planner = StepPlanner(cfg, BlockManager(cfg.kv_num_blocks, cfg.kv_block_size), self.pool, "fp", clock=self.clock)
        self.n = 0
        self.admitted_at: dict[str, int] = {}  # request id -> the step that admitted it
        self.failed_at: dict[str, int] = {}
        self.finished_at: dict[str, int] = {}
        self.prompt_steps = 0
        self.steps = 0
        self.inflight: list[Sequence] | None = None  # engine_step's round in flight: its sequences
        self.holds_per_step: list[int] = []  # engine_step: the holds counted for each launched step
        self._holds_seen = 0

    def add(self, adapter: str | None, *, priority: int = 0, reading: bool = True, new: int = 512) -> str:
        rid = f"r{self.n}"
        request = GenerationRequest(request_id=rid, input_ids=tuple(range(1, 9)), adapter_key=adapter, priority=priority,
                                    sampling=SamplingParams(max_new_tokens=new, ignore_eos=True))  # fmt: skip
        self.planner.add(Sequence(request, self.n, list(request.input_ids), 0, None, None, adapter))
        self.n += 1
        if adapter is not None and reading:
            self.pool.reading.add(adapter)
        return rid

    def step(self, *, apply: bool = True) -> Plan:
        plan = self.planner.schedule()
        if apply:
            self._apply(plan)
            self.steps += 1
            self.clock.ms += self.dt_ms
        return plan

    def _apply(self, plan: Plan) -> None:
        """The step's work computed: prompt chunks and decodes, sampled tokens, finished requests out."""
        prompt = False
        for it in plan.items:
            if len(it.tokens) > 1:
                prompt = True
                self.admitted_at.setdefault(it.seq.request_id, self.steps)
            it.seq.num_computed += len(it.tokens)
            if it.samples:
                it.seq.tokens.append(1)
                it.seq.output_ids.append(1)
                if len(it.seq.output_ids) >= it.seq.request.sampling.max_new_tokens:
                    self.planner.remove(it.seq)
                    self.finished_at[it.seq.request_id] = self.steps
        for seq, _error in plan.failed:
            self.failed_at[seq.request_id] = self.steps
        self.prompt_steps += prompt

    def engine_step(self) -> None:
        """As engine.Engine.step, a decode step a call: with a round of one step in flight (its tokens not booked yet),
        while requests wait with room for them the planner is asked (`admits_none`) instead of scheduling; the next
        round is launched when it says nobody would be admitted and every request has a token left past the one in
        flight, its hold then counted (`note_held`); then the round in flight is booked. Without one, a schedule, whose
        whole-batch decode step becomes the round in flight. Each launched step's holds go to `holds_per_step`."""
        planner = self.planner
        if self.inflight is not None:
            rnd, self.inflight = self.inflight, None
            held = bool(planner.waiting) and len(planner.running) < planner.config.max_batch_size
            if (not held or planner.admits_none()) and all(_left(s) > 1 for s in rnd):
                self.inflight = rnd
                if held:
                    planner.note_held()
                self._launched()
            self._book(rnd)
        else:
            plan = self.step(apply=False)
            decode = [it.seq for it in plan.items if len(it.tokens) == 1 and it.samples]
            if plan.items and len(decode) == len(plan.items) == len(planner.running):
                self.inflight = decode
            else:
                self._apply(plan)
            self._launched()
        self.steps += 1
        self.clock.ms += self.dt_ms

    def _launched(self) -> None:
        self.holds_per_step.append(self.planner.hold.holds - self._holds_seen)
        self._holds_seen = self.planner.hold.holds

    def _book(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            seq.num_computed += 1
            seq.tokens.append(1)
            seq.output_ids.append(1)
            if len(seq.output_ids) >= seq.request.sampling.max_new_tokens:
                self.planner.remove(seq)
                self.finished_at[seq.request_id] = self.steps


def _left(seq: Sequence) -> int:
    return seq.request.sampling.max_new_tokens - len(seq.output_ids)


@pytest.mark.parametrize(("hold_ms", "prompt_steps", "pipelined"), [(0.0, (7,), False), (BOUND_MS, (2,), False), (BOUND_MS, (1, 2), True)])
def test_reads_landing_one_by_one_admit_in_few_prompt_steps(hold_ms, prompt_steps, pipelined):
    """A running request and 7 waiting ones whose reads land one a step (well within the bound): with the hold, the batch
    is admitted in 2 prompt steps (6 = 3/4 of 7 places at once, then the last), not one per read; the running request
    decodes in every step meanwhile. Stepping as the engine does with decode rounds in flight (`engine_step`), the first
    admission may come a step later (in 1 or 2 prompt steps), each held step's hold counted once."""
    h = Harness(hold_ms)
    h.add(None)
    h.step()  # the running request's prompt
    keys = [f"a{i}" for i in range(7)]
    for k in keys:
        h.add(k)
    h.prompt_steps = 0
    for k in keys:
        h.pool.reading.discard(k)
        if pipelined:
            h.engine_step()
        else:
            assert any(it.seq.request_id == "r0" for it in h.step().items)
    for _ in range(3 if pipelined else 1):
        h.engine_step() if pipelined else h.step()
    assert h.prompt_steps in prompt_steps
    assert sorted(h.admitted_at) == [f"r{i}" for i in range(8)]
    if pipelined:
        assert max(h.holds_per_step) <= 1 and h.planner.hold.holds >= 4, (h.holds_per_step, h.planner.hold.holds)
    else:
        assert h.planner.hold.holds == (5 if hold_ms else 0)


def test_the_bound_ends_the_wait():
    """One read of seven lands and the others never do: its request is held while the hold is younger than the bound
    (steps of 11 ms: held at 0, 11, 22, 33 ms) and admitted at the first step past it (44 ms), alone."""
    h = Harness(dt_ms=11)
    h.add(None)
    h.step()
    for i in range(7):
        h.add(f"a{i}")
    h.pool.reading.discard("a3")
    first = h.steps
    for _ in range(8):
        h.step()
    assert h.admitted_at.get("r4") == first + 4, (h.admitted_at, first)
    assert h.planner.hold.holds == 4
    assert set(h.admitted_at) == {"r0", "r4"}


@pytest.mark.parametrize("ready", [1, 3])
def test_no_hold_when_nothing_else_runs(ready):
    """With nothing running the GPU would idle: the ready requests are admitted at once, however few they are of what
    waits."""
    h = Harness()
    for i in range(8):
        h.add(f"a{i}")
    for i in range(ready):
        h.pool.reading.discard(f"a{i}")
    h.step()
    assert sorted(h.admitted_at) == [f"r{i}" for i in range(ready)]
    assert h.planner.hold.holds == 0


def test_a_failed_read_still_fails_its_request():
    """A request whose read failed counts as ready (it takes no place): it fails with its adapter's error, at the latest
    when the bound ends the hold, and is never admitted; the others are admitted when their reads land."""
    h = Harness(dt_ms=11)
    h.add(None)
    h.step()
    for i in range(7):
        h.add(f"a{i}")
    h.pool.reading.discard("a2")
    h.pool.failing.add("a2")
    start = h.steps
    for _ in range(6):
        h.step()
    assert h.failed_at.get("r3") is not None and h.failed_at["r3"] - start <= 4, (h.failed_at, start)
    assert "r3" not in h.admitted_at and all(s.request_id != "r3" for s in h.planner.waiting + h.planner.running)
    h.pool.reading.clear()
    h.step()
    assert sorted(h.admitted_at) == sorted(["r0", "r1", "r2", "r4", "r5", "r6", "r7"])


def test_no_starvation_under_a_stream_of_arrivals():
    """A stream of higher-priority arrivals whose reads never land keeps fewer than 3/4 of the places ready: each ready
    request is still admitted within the bound (4 steps of 11 ms) of its read landing, every hold ending at the bound."""
    h = Harness(batch=64, dt_ms=11)
    h.add(None)
    h.step()
    landed: dict[str, int] = {}
    for step in range(64):
        h.add(f"hi{step}", priority=5)  # never lands
        if step % 7 == 0 and step < 56:
            rid = h.add(f"lo{step}")
            h.pool.reading.discard(f"lo{step}")
            landed[rid] = h.steps
        h.step()
    assert landed and all(rid in h.admitted_at for rid in landed), (landed, h.admitted_at)
    assert max(h.admitted_at[rid] - landed[rid] for rid in landed) <= 4
    assert h.planner.hold.holds > 0


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("pipelined", [False, True])
def test_random_arrivals_and_landings_keep_the_bound(seed, pipelined):
    """Random arrivals, priorities and read times, one long request always running, places to spare: no request waits
    past its read's landing for longer than the bound (4 steps of 11 ms), and every one is admitted in the end; stepping
    as the engine does with decode rounds in flight (`engine_step`), at most one step more, each step's hold counted once."""
    rng = random.Random(seed)
    h = Harness(batch=128, dt_ms=11)
    h.add(None)
    h.step()
    lands: dict[str, int] = {}  # request id -> the step before which its read lands
    for _ in range(40):
        for _ in range(rng.randrange(4)):
            rid = f"r{h.n}"
            h.add(f"k{rid}", priority=rng.randrange(3))
            lands[rid] = h.steps + rng.randrange(12)
        for rid, at in lands.items():
            if at <= h.steps:
                h.pool.reading.discard(f"k{rid}")
        h.engine_step() if pipelined else h.step()
    end = h.steps
    h.pool.reading.clear()
    for _ in range(6):
        h.engine_step() if pipelined else h.step()
    assert set(lands) <= set(h.admitted_at)
    late = {rid: h.admitted_at[rid] - at for rid, at in lands.items() if at < end}
    assert late and max(late.values()) <= 4 + pipelined, late
    assert max(h.holds_per_step, default=0) <= 1 and h.planner.hold.holds > 0


@pytest.mark.parametrize(
    ("name", "calls", "held"),
    [
        # calls: (ms, the batch has work in the step, ready, places the waiting could fill now, places more within
        # COALESCE_STEPS steps)
        ("places freeing: the ready wait for them", [(0, True, 8, 1, 7)], [True]),
        ("most places free, two more freeing: still held", [(0, True, 8, 6, 2)], [True]),
        ("none freeing, 3/4 ready: admitted", [(0, True, 6, 8, 0)], [False]),
        ("no free place: nothing to hold back", [(0, True, 8, 0, 8)], [False]),
        ("none ready: nothing to hold back", [(0, True, 0, 2, 6)], [False]),
        ("nothing runs: never held", [(0, False, 8, 1, 7)], [False]),
        ("the bound ends it, as any hold", [(0, True, 8, 1, 7), (39, True, 8, 1, 7), (40, True, 8, 1, 7)],
         [True, True, False]),
        ("a read hold after it counts from its start", [(0, True, 8, 1, 7), (30, True, 1, 8, 0), (40, True, 1, 8, 0)],
         [True, True, False]),
    ],
)  # fmt: skip
def test_hold_decision_with_places_freeing(name, calls, held):
    """Places that running requests free within COALESCE_STEPS steps: a step admits only once every place it could fill
    then is free (or the bound ends the hold), so that a batch is admitted in one prompt step."""
    clock = FakeClock()
    hold = AdmissionHold(BOUND_MS, clock)
    got = []
    for ms, running, ready, want, soon in calls:
        clock.ms = ms
        got.append(hold.hold(running, ready, want, soon))
    assert got == held, name


def _parts(h: Harness, sizes: list[int], new: int) -> None:
    """A batch admitted in parts of `sizes`, one prompt step each (their adapters ready), every request of `new` tokens."""
    for size in sizes:
        for _ in range(size):
            h.add(f"a{h.n}", reading=False, new=new)
        h.step()


@pytest.mark.parametrize(("coalesce", "prompt_steps"), [(True, 1), (False, 3)])
def test_a_batch_admitted_in_parts_is_replaced_in_one_prompt_step(monkeypatch, coalesce, prompt_steps):
    """Requests of the same length admitted in parts of 1, 5 and 2, a step apart, finish a step apart: the 8 waiting
    behind them come in one prompt step once all three parts are done (two steps held), not one per part, which would
    go on pass after pass."""
    import engine.planner as planner

    if not coalesce:
        monkeypatch.setattr(planner, "COALESCE_STEPS", 0)
    h = Harness(batch=8)
    _parts(h, [1, 5, 2], new=6)
    assert len(h.planner.running) == 8
    h.prompt_steps = 0
    later = [h.add(f"b{i}", reading=False, new=6) for i in range(8)]
    while h.planner.waiting:
        h.step()
    assert h.prompt_steps == prompt_steps
    assert len({h.admitted_at[rid] for rid in later}) == prompt_steps
    last = max(h.finished_at[f"r{i}"] for i in range(8))
    assert min(h.admitted_at[rid] for rid in later) == (last + 1 if coalesce else h.finished_at["r0"] + 1)
    assert h.planner.hold.holds == (2 if coalesce else 0)


def _two_running(new: int) -> Harness:
    """A batch of 8 running 2 requests of `new` tokens, 6 steps in: they have new - 7 tokens left, 6 places are free."""
    h = Harness(batch=8)
    _parts(h, [2], new=new)
    for _ in range(6):
        h.step()
    return h


def test_many_free_places_are_not_held_for_a_few_far_off():
    """8 waiting, 6 places free and 2 more freeing, batch 8: a hold costs 6/8 of a decode step a step for the idle places
    and UNCHAINED_STEP for the unchained round, so places 4 steps off (4 decode steps' worth, PROMPT_STEP_DECODES) are
    waited for and places 5 steps off are not: the 6 are admitted at once and the other 2 come later."""
    h = _two_running(new=11)  # the 2 have 4 tokens left
    for _ in range(8):
        h.add(f"w{h.n}", reading=False, new=11)
    h.step()
    assert h.planner.hold.holds == 1
    h2 = _two_running(new=12)  # the 2 have 5 tokens left
    waiting = [h2.add(f"w{h2.n}", reading=False, new=12) for _ in range(8)]
    h2.step()
    assert h2.planner.hold.holds == 0 and [rid for rid in waiting if rid in h2.admitted_at] == waiting[:6]


def test_a_hold_for_places_freeing_counts_what_it_has_spent():
    """Places freeing 4 steps on, step after step (requests finishing in a stream keep entering the window): the hold's
    cost adds up over its steps, 1 idle place of 8 and an unchained round each, so it ends after 7 held steps, not at
    the clock's bound; a step that does not hold starts the reckoning afresh."""
    clock = FakeClock()
    hold = AdmissionHold(BOUND_MS, clock)
    held = []
    for step in range(12):
        clock.ms = step
        soon = 3 if hold.worth_waiting(1, 4, 8) else 0
        held.append(hold.hold(True, 1, 1, soon))
    assert held == [True] * 7 + [False] + [True] * 4
    assert hold.worth_waiting(1, 4, 8) is True  # 4 held since the reset: (4 + 4) / 8 + 8 x 0.25 = 3 decode steps


def test_requests_far_from_their_end_free_no_places():
    """Running requests with more than COALESCE_STEPS tokens left free no place soon: a ready request is admitted at
    once into the free places, as before."""
    h = Harness(batch=8)
    _parts(h, [4], new=40)
    rid = h.add("late", reading=False, new=40)
    h.step()
    assert rid in h.admitted_at and h.planner.hold.holds == 0


def test_a_budget_full_of_prompts_is_not_held_for_places_freeing():
    """A token budget that takes the running rows and 2 prompts a step: the 2 free places' requests fill it, so a step
    admits them at once although 2 running requests free more places within a few steps (holding could only admit the
    same 2 prompts later)."""
    cfg = EngineConfig(max_batch_size=8, max_prompt_tokens=16, max_new_tokens=512, max_num_batched_tokens=6 + 2 * 8,
                       kv_block_size=16, kv_num_blocks=8 * 40, admission_hold_ms=BOUND_MS)  # fmt: skip
    h = Harness(batch=8)
    h.planner = StepPlanner(cfg, BlockManager(cfg.kv_num_blocks, cfg.kv_block_size), h.pool, "fp", clock=h.clock)
    _parts(h, [2], new=5)  # 2 tokens left after the next two steps
    _parts(h, [2, 2], new=40)
    assert len(h.planner.running) == 6 and h.planner.hold.holds == 0
    waiting = [h.add(f"w{h.n}", reading=False, new=40) for _ in range(4)]
    h.step()
    assert h.planner.hold.holds == 0
    assert [rid for rid in waiting if rid in h.admitted_at] == waiting[:2]


def test_config_bound_is_validated():
    """`admission_hold_ms` is milliseconds from 0 (never hold) up; a negative one is refused naming the field."""
    assert EngineConfig(admission_hold_ms=0).admission_hold_ms == 0
    with pytest.raises(ValidationError, match="admission_hold_ms"):
        EngineConfig(admission_hold_ms=-1)


@pytest.mark.parametrize("seed", range(8))
def test_rounds_asking_admits_none_admit_and_finish_every_request(seed):
    """The engine's decode rounds ask the planner whether the next schedule would admit nobody (engine.planner
    `admits_none`) before the round in flight is booked, instead of scheduling. Over random arrivals, read landings and
    lengths through a batch of 8 (requests finishing and freeing places, base requests, reads landing late), in the
    engine's order: every request is admitted and finishes, rounds are launched while requests wait, and each launched
    step counts at most one hold (a step asked for and then not launched counts none)."""
    rng = random.Random(seed)
    h = Harness(batch=8, dt_ms=rng.choice((3, 11)))
    h.add(None, new=60)
    h.step()
    lands: dict[str, int] = {}
    added = []
    for step in range(160):
        if step < 50 and rng.random() < 0.4:
            adapter = None if rng.random() < 0.15 else f"a{h.n}"
            added.append(h.add(adapter, new=rng.randint(2, 12)))
            lands[adapter or added[-1]] = step + rng.randint(0, 12)
        for key, at in lands.items():
            if at == step:
                h.pool.reading.discard(key)
        h.engine_step()
    assert h.inflight is None and not h.planner.waiting and not h.planner.running
    assert set(added) <= set(h.admitted_at) and set(added) <= set(h.finished_at) and len(added) > 8
    assert max(h.holds_per_step) <= 1, h.holds_per_step
    assert h.planner.hold.holds > 0


def test_places_too_far_off_for_one_refill_are_waited_for_when_the_queue_makes_several():
    """A split batch is refilled split for as long as requests wait: 6 places free and 2 freeing 5 steps off are not
    waited for with one batch's worth waiting (8, batch 8: a hold would cost 5 decode steps against one prompt step's 4),
    and are with three (24 waiting: 3 refills, 12 decode steps saved); the 8 are then admitted in one prompt step."""
    h = _two_running(new=12)  # the 2 have 5 tokens left
    waiting = [h.add(f"w{h.n}", reading=False, new=12) for _ in range(24)]
    h.step()
    assert h.planner.hold.holds == 1 and not any(rid in h.admitted_at for rid in waiting)
    while not any(rid in h.admitted_at for rid in waiting):
        h.step()
    first = min(h.admitted_at[rid] for rid in waiting if rid in h.admitted_at)
    assert [rid for rid in waiting if h.admitted_at.get(rid) == first] == waiting[:8]


def test_the_reckoning_weighs_a_prompt_step_by_the_refills():
    """worth_waiting: 6 of 8 places idle for 5 steps and 5 unchained rounds cost 3.75 + 1.25 = 5 decode steps: more than
    one prompt step (4), within two."""
    hold = AdmissionHold(BOUND_MS, FakeClock())
    assert not hold.worth_waiting(6, 5, 8) and not hold.worth_waiting(6, 5, 8, refills=1)
    assert hold.worth_waiting(6, 5, 8, refills=2) and hold.worth_waiting(6, 5, 8, refills=0) is False
