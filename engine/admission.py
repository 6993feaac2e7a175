"""Admission hold-back: while adapters are being read from the store, a batch is admitted in few prompt steps.

With read-ahead threads (engine.adapter_records), admission skips a waiting request whose adapter is still being read
(WAIT_READ) and takes it at the first step after its read lands. Taken as they land, a batch's requests come in many
small prompt steps, and a prompt step costs about as much with a quarter of a batch as with all of it: on the H200
(engine/PERF.md, session 10: llama-1b, batch 64, prompts of 128, 2,000 adapters, the cold pass) the pass took 64 steps
with prompt tokens, at a median of 41 ms, against 32 of them (32 ms) at 5 adapters; a decode step took 2.6 ms.

The planner (engine.planner) holds back a step's admissions when all of these hold (`AdmissionHold.hold`):
- the running batch has work in the step: otherwise the GPU would idle, and nothing is held back;
- some waiting requests are ready (their adapters need no store read): with none, there is nothing to hold back;
- fewer are ready than ADMIT_FRACTION of the places the waiting requests could fill, min(free places, waiting): the
  reads of the others are still landing;
- the hold began less than `engine.admission_hold_ms` ago.

A batch whose requests were admitted together also finish together, and one admitted in parts finishes in parts: the
same requests take the same number of steps, so the parts free their places some steps apart, and each part's
successors would come in a prompt step of their own, pass after pass. A prompt step of few rows costs nearly what a
batch's does: it runs eagerly, and its few hundred launches, not its kernels, set its time (H100, session 16: 1 prompt
row beside 63 decode rows 21 ms, 9 rows 22 ms, 54 rows 31 ms, 64 rows 36 ms; a decode step 2.8 ms; llama-1b, 64 adapters
of ranks 8-64: a small prompt step costs 6-7 decode steps more than a decode step). So a step also holds back its
admissions while running requests that reach their max_new_tokens within COALESCE_STEPS steps would free more places
for the waiting requests, when waiting for them is cheaper than a prompt step. What a hold costs, counted over the
whole hold (the steps already held and those until the last of those requests finishes), in whole-batch decode steps:
the free places idle meanwhile (place-steps over the batch), and UNCHAINED_STEP a held step, since a step that leaves
places free for waiting requests runs in a short round, not chained with the next (engine.rounds; PERF.md,
issue 21's suite: 2.92 against 2.16 ms a step at llama-1b, when such a step ran eagerly; since session 18 a held step
is a round launched before the last is read back, of one step (1.00-1.01x a chained step on the H100 with
decode_steps 1) or, since session 22, of as many as the host's last cycle took; the figure, kept until the hold is
measured again, overstates it, and a held round of several steps counts once). It must stay within PROMPT_STEP_DECODES: 4 free places of
64 for 7 steps are held (0.4 + 1.75); 60 for 7 steps are not, they are admitted and the other 4 come later; nor are
places freeing 16 steps on. A hold lasts at most that reckoning allows and, as any hold, at most the bound. A request
counts by its max_new_tokens: one that stops earlier (EOS, a stop string) only frees its place sooner.

Refills. A batch admitted in parts is refilled in parts for as long as requests wait, so a hold that joins the parts
saves a prompt step at every refill after it, not one: the reckoning weighs PROMPT_STEP_DECODES by the refills the
waiting requests make (waiting / batch, at least 1). With 1,024 requests waiting behind a batch of 64, places freeing
16 steps off are waited for (cost at most 16 decode steps, and the bound's 40 ms, against 16 prompt steps saved); with
one batch's worth waiting, as above. The bound still ends any hold: parts more than `engine.admission_hold_ms` apart
stay apart. The 2,000-adapter cold pass (engine/PERF.md, session 20) ran either 18-19 prompt steps or 33, the latter
with every batch of 64 admitted in two prompt steps; how far apart its parts were was not measured, and this weighting
has not yet run on the device.

The bound runs from the first held step of a hold, not from a request's arrival: a batch job's requests arrive
together, and timed from their arrival every hold after the first bound would end at once. A step that admits, or has
nothing to hold back, ends the hold; so a ready request waits at most the bound (and the step under way when it runs
out), however many requests keep arriving behind it. A request whose read failed counts as ready (it takes no place):
it fails with its adapter's error at the step that admits, at most the bound later than it would have.

Why 3/4 and 40 ms: a hold keeps the ready requests' places idle (fewer than 3/4 of the batch's; the others wait for
their reads either way) for at most 40 ms, at worst 3/4 x 40 = 30 ms of the whole batch's time: about one prompt step
(32 ms, less the 2.6 ms decode step that runs in its place). A hold that runs out thus costs at most about the prompt
step it was after, and one whose reads land in time saves that step, or several. Eight reader processes land about
23 reads in 40 ms (12-16 ms each, PERF.md session 10), a third of a batch of 64: a hold short of fewer reads than that
ends by them, not by the bound. At llama-8b a prompt step costs more and the bound is on the safe side.
"""

from __future__ import annotations

import math
from collections.abc import Callable

ADMIT_FRACTION = 0.75  # a step admits once this share of the places the waiting requests could fill is ready
COALESCE_STEPS = 16  # running requests that reach their max_new_tokens within this many steps count as places freeing
PROMPT_STEP_DECODES = 4  # a small prompt step's cost beyond a decode step, in whole-batch decode steps (measured: 6-7)
UNCHAINED_STEP = 0.25  # what a held step costs more than a chained one, in whole-batch decode steps (measured eager: 0.26-0.35)


class AdmissionHold:
    """Whether a step holds back its admissions (module docstring), and since when the hold under way began."""

    def __init__(self, bound_ms: float, clock: Callable[[], float]):
        self.bound_s = bound_ms / 1000
        self._clock = clock
        self._since: float | None = None  # clock() at the first held step of the hold under way
        self._idle = 0  # place-steps left idle by the hold under way's steps held for places freeing
        self._held = 0  # those steps
        self.holds = 0  # steps whose admissions were held back

    def clock(self) -> float:
        return self._clock()

    def worth_waiting(self, want: int, steps: int, batch: int, refills: int = 1) -> bool:
        """Whether holding `want` free places of `batch` idle for `steps` more steps, until places freeing then are
        free, keeps the hold under way's cost within what it saves: a prompt step at each of the `refills` times the
        waiting requests refill the batch (module docstring, "Refills")."""
        idle = (self._idle + want * steps) / batch
        return idle + (self._held + steps) * UNCHAINED_STEP <= PROMPT_STEP_DECODES * max(1, refills)

    @staticmethod
    def enough(want: int, soon: int = 0) -> int:
        """Ready requests that let a step admit when the waiting requests could fill `want` places now and `soon` more
        once the running requests that reach their max_new_tokens within COALESCE_STEPS steps have finished: 3/4 of
        `want` while none are freeing; else every place, those freeing included (which no step can admit before then)."""
        return want + soon if soon > 0 else math.ceil(ADMIT_FRACTION * want)

    def remaining_s(self, now: float) -> float | None:
        """The time left to the hold under way before its bound ends it, None when none is under way."""
        return None if self._since is None else max(0.0, self.bound_s - (now - self._since))

    def would_hold(self, running: bool, ready: int, want: int, soon: int = 0, *, now: float | None = None) -> bool:
        """What `hold` would answer at `now` (the clock's time by default), changing nothing."""
        if running and self.bound_s > 0 and 0 < min(ready, want) < self.enough(want, soon):
            return self._since is None or (self._clock() if now is None else now) - self._since < self.bound_s
        return False

    def hold(self, running: bool, ready: int, want: int, soon: int = 0, *, now: float | None = None, steps: int = 1) -> bool:
        """Whether this step holds back its admissions: `running`, the batch has work in it; `ready`, waiting requests
        whose adapters need no store read (counted up to `enough(want, soon)`); `want`, the places the waiting could
        fill now; `soon`, the places more they could fill within COALESCE_STEPS steps, when `worth_waiting` says so
        (the caller's reckoning; module docstring); `now`, the step's time (the clock's by default); `steps`, the decode
        steps it holds them back for (a held round's)."""
        if running and self.bound_s > 0 and 0 < min(ready, want) < self.enough(want, soon):
            now = self._clock() if now is None else now
            if self._since is None:
                self._since = now
            if now - self._since < self.bound_s:
                self.holds += steps
                if soon > 0:
                    self._idle += want * steps
                    self._held += 1
                return True
        self._since = None
        self._idle = self._held = 0
        return False
