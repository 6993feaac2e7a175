"""The engine: continuous batching of many tenants' and adapters' requests over one base model.

Requests join and leave the running batch between steps. Each `step()` lets the planner
(engine.planner.StepPlanner) pick the step's work under a token budget (decodes, prefill chunks, new admissions,
preemptions when KV blocks run out), runs ONE forward over all of it with rows of different adapters
or none side by side, samples a token for every request whose known tokens are all computed, and
returns the requests that finished. Adapters are loaded lazily by the pool (engine.adapter_pool) when
a request needs one, or eagerly with `load_adapter`.

Device, dtype and compute backend (engine.device), chosen once at start and logged: Triton kernels on CUDA, with
decode steps replayed as CUDA graphs (engine.cuda_graphs); the torch reference ops on the CPU.

Decode rounds (CUDA graphs only, engine.rounds): when every running request decodes and none wants logprobs, a step
launches graph replays back to back (several when nothing waits, one while a waiting request could be admitted, or
as many as the host's last cycle took while the planner holds admissions back: `_held_steps`), and
the next step() launches the following round before it reads the last one back, so that host work overlaps the GPU;
results thus come back one step() call later.

Timings and the KV credit (engine.booking): each step's measured device time is split exactly among its requests by
tokens, one StepRecord per step (`pop_step_records`); cached prompt tokens are credited at the measured marginal
cost of a prefill token (a fit of prefill step time against tokens). Adapter loads are measured apart, each one
reported with its tier (`pop_load_events`) and charged as adapter_load_us to the first request that uses the
adapter after it.

Identity and a request's life from admission to result: engine.requests.

Isolation: one request's failure fails that request alone, with a code; its batchmates go on. A request whose
validation or admission fails comes back failed from the next step(); a step's forward that raises is run again in
halves down to the culprits, and a row whose logits are unusable or whose sampling raises fails alone
(engine.isolation); so does one whose detokenizing or stop-string matching raises. A decode round that fails to
launch falls back to one isolated eager step.

Error codes of failed results (EngineError.code; retriable only where said): those of engine.validation;
duplicate_request_id (the same (tenant_id, request_id) is unfinished); unknown_adapter; the adapter's load errors
(engine.api.ADAPTER_ERROR_CODES; adapter_load_failed when loading raised unexpectedly); admission_failed (building
the request raised unexpectedly); sampling_failed (unusable logits, or sampling or logprobs raised); decode_failed
(detokenizing or stop-string matching raised); forward_failed (the forward raised with this request alone);
engine_failed (retriable: the forward raised for every request alone, or, from engine.async_engine, a step raised
outside all of this); aborted (`abort`).

Single-threaded: call every method from one thread (`engine.async_engine.AsyncEngine` runs the step
loop in its own thread for asyncio callers).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from engine.adapter_pool import AdapterPool
from engine.api import AdapterError, AdapterInfo, EngineError, GenerationRequest, GenerationResult
from engine.booking import Outcome, StepBook
from engine.checkpoint import base_fingerprint, load_model, read_eos_ids
from engine.collector import CollectorWindow
from engine.config import EngineConfig
from engine.device import build_runner, pick_device, pick_dtype
from engine.isolation import forward_isolated, sample_isolated
from engine.model import LlamaForCausalLM
from engine.requests import Requests, duplicate, failed_result, monotonic_us
from engine.rounds import Round, book_round, chain_length, launch_round, plan_next_round, tokens_left
from engine.runner import BatchItem
from engine.planner import Plan, StepPlanner
from engine.sequence import Sequence
from engine.sizing import derive, device_memory, sized_by
from engine.timing import DeviceTimer, StepRecord
from engine.tokenizer import Tokenizer

log = logging.getLogger("lorabatch.engine")

# Adapter placement looks this many decode rounds past the work in flight for requests about to finish (`_load_ahead`):
# their successors' adapters are copied in while the GPU runs those rounds.
LOOKAHEAD_ROUNDS = 2


class Engine:
    def __init__(self, config: EngineConfig, *, clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time):
        """Load the model of `config.model_dir`. `clock` (monotonic seconds) paces the adapter admission
        bucket, heat, the warm pool's interval and the admission hold's bound; `wall_clock` gives the warm pool its hour
        of day."""
        device = pick_device(config.device)
        dtype = pick_dtype(config.dtype, device)
        model_dir = Path(config.model_dir)
        tokenizer = Tokenizer(model_dir)
        model = load_model(model_dir, device, dtype, config.weight_dtype)
        self._setup(config, model, tokenizer, read_eos_ids(model_dir), base_fingerprint(model_dir), clock, wall_clock)

    @classmethod
    def from_model(
        cls,
        config: EngineConfig,
        model: LlamaForCausalLM,
        tokenizer: Tokenizer,
        *,
        eos_ids: tuple[int, ...] = (),
        fingerprint: str,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> Engine:
        """An engine over a model built in memory (the bench builds random weights on the device)."""
        engine = cls.__new__(cls)
        engine._setup(config, model, tokenizer, eos_ids, fingerprint, clock, wall_clock)
        return engine

    def _setup(self, config, model, tokenizer, eos_ids, fingerprint, clock, wall_clock) -> None:
        weight = model.lm_head.weight
        # On CUDA, the sizes the configuration leaves unset come from the device (engine.sizing), the weights loaded
        config, self.sizing = derive(config, model.config, weight.device, weight.dtype, device_memory(weight.device, weights_loaded=True))
        if weight.device.type == "cuda":
            log.info("engine sizes: %s", "; ".join(f"{d.field}={d.value} ({d.source})" for d in self.sizing))
        self.config = config
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.base_fingerprint = fingerprint
        model.config.check_sliding_window(config.max_prompt_tokens + config.max_new_tokens)
        num_blocks = config.kv_pool_blocks
        quota = int(config.kv_tenant_quota * num_blocks)
        if quota < config.blocks_per_sequence:
            raise EngineError(
                f"engine.kv_tenant_quota={config.kv_tenant_quota} gives a tenant {quota} of {num_blocks} KV blocks, under the "
                f"{config.blocks_per_sequence} one sequence of max_prompt_tokens + max_new_tokens may need; raise the quota "
                "or kv_num_blocks",
                code="config_invalid",
            )
        with sized_by(config, "kv_num_blocks", "max_batch_size", "adapter_gpu_bytes", "max_loras"):
            self.runner = build_runner(model, config, quota)
        self.device, self.dtype = self.runner.device, self.runner.dtype
        with sized_by(config, "host_cache_bytes"):
            self.adapters = AdapterPool(self.runner.lora, model.config, config, base_fingerprint=fingerprint, clock=clock,
                                        wall_clock=wall_clock)
        self.planner = StepPlanner(config, self.runner.blocks, self.adapters, fingerprint, clock=clock)
        self.requests = Requests(config, model.config, tokenizer, self.device, self.planner, self.adapters)
        self.book = StepBook(self.runner.blocks, self.requests)
        self._ran = False  # whether the last step ran a forward
        self._step_timer = DeviceTimer(self.device)
        self._inflight: Round | None = None  # a decode round launched and not yet read back (engine.rounds)
        # the garbage collector's passes, run while a round is in flight (engine.collector)
        self.collector = CollectorWindow() if config.gc_in_rounds else None
        self._decode_us = 0.0  # the last decode round's last step's measured µs (0 until one ran): what a round covers
        self._eager_us = 0  # the last eager step's measured µs: what the next one's load-ahead covers, lacking a better guess
        # A chained round's host cycle (`_held_steps`): when the last round was launched (None: not by a chain of rounds),
        # and the ns the host has waited for rounds' ends since
        self._launched_ns: int | None = None
        self._waited_ns = 0
        self._cycle_ns: int | None = None  # the host's last chained cycle, in ns
        # The host's time in a chained cycle besides its placements and its waits for rounds' ends (the round's launch,
        # the read-ahead walk, booking, the caller's loop): the shorter of the last two, None until one was measured;
        # placements ahead of admission stop where this rest would start past the round's end (`_load_ahead`)
        self._rest_ns: int | None = None
        self._rest_last: int | None = None
        self._placed_ns = 0  # the pool's placement ns when the last round was launched

    @property
    def step_records(self) -> list[StepRecord]:
        """Each step's measured and attributed time since the last `pop_step_records` (engine.booking)."""
        return self.book.records

    @property
    def _unfinished(self) -> dict[tuple[str, str], Sequence]:
        """(tenant_id, request_id) -> sequence, waiting or running (engine.requests); the tests look inside."""
        return self.requests.unfinished

    # ---- adapters

    def register_adapter(self, adapter_key: str, path: Path, sha256: str | None = None, *, tenant_id: str = "", slo_tier: str = "standard") -> None:
        """Make `adapter_key` usable by requests; nothing is read until a request (or the warm pool) needs it.
        With `sha256`, the files must hash to it when read (else the requests fail with adapter_changed)."""
        self.adapters.register(adapter_key, Path(path), sha256=sha256, tenant=tenant_id, slo_tier=slo_tier)

    def load_adapter(self, adapter_key: str, path: Path, *, tenant_id: str = "", slo_tier: str = "standard") -> AdapterInfo:
        """Register, validate and load a PEFT adapter folder under `adapter_key` now; the same content under another
        key is shared. Raises AdapterError (and leaves the adapter_key unregistered) if it cannot be loaded."""
        return self.adapters.load(adapter_key, Path(path), tenant=tenant_id, slo_tier=slo_tier)

    def unload_adapter(self, adapter_key: str) -> None:
        users = [k for k, s in self.requests.unfinished.items() if s.adapter_key == adapter_key]
        if users:
            raise AdapterError(
                f"adapter {adapter_key!r} is in use by {len(users)} unfinished requests (e.g. {users[0]!r}); "
                "unload it once they finish or abort them",
                code="adapter_in_use",
                retriable=True,
            )
        self.adapters.unload(adapter_key)

    def capture_decode_graphs(self) -> int:
        """Capture every decode bucket's CUDA graphs now, between steps, rather than at each bucket's first step: the
        base graphs on padding rows, and, when adapters are in device slots, the with-LoRA graphs calibrated on rows of
        those adapters (engine.cuda_graphs `prepare_all`). Call it after a warm-up that loaded adapters. Returns how many
        graphs it made (0 without graphs: the torch backend, or no CUDA)."""
        return self.runner.capture_graphs(self.adapters.resident_slots())

    def has_adapter(self, adapter_key: str) -> bool:
        return self.adapters.has(adapter_key)

    def resident_adapters(self) -> list[str]:
        """Keys of the adapters in device slots now: batching requests of these avoids loads."""
        return self.adapters.resident_keys()

    def pop_load_events(self) -> list[AdapterInfo]:
        """Every adapter load since the last call (eager ones too), with its tier and measured duration."""
        return self.adapters.pop_events()

    # ---- requests

    def add_request(self, req: GenerationRequest) -> None:
        """Queue a request; a request that fails validation (or whose admission raises) comes back from the next step()
        with its error. Never raises for the request's content."""
        self.requests.add(req)

    def abort(self, request_id: str, tenant_id: str = "") -> GenerationResult | None:
        """Stop the unfinished request (tenant_id, request_id) now; returns its partial result (error code `aborted`), or
        None if unknown."""
        self._drain()  # its blocks and slot may not be released under a round still running on the device
        return self.requests.abort((tenant_id, request_id))

    def abort_all(self, error: EngineError) -> list[GenerationResult]:
        """Fail every unfinished request with `error` and hand out every result not yet returned: the last resort of a
        caller whose step() raised (engine.async_engine), so that no request is left unsettled."""
        try:
            self._drain()
        except Exception:
            log.exception("reading back the decode round in flight raised; its tokens are lost")
        return self.requests.abort_all(error)

    def has_unfinished(self) -> bool:
        return bool(self.requests.unfinished or self.requests.done)

    def step(self) -> list[GenerationResult]:
        """Run one engine step; return the requests that finished in it (and failed validations).

        With a decode round in flight (engine.rounds), the step launches the next round first (when nothing waits
        and every request has tokens left), then reads the one in flight back and returns what finished in it."""
        self._step_timer.reset()
        self.runner.begin_step()
        if self._inflight is not None:
            rnd, self._inflight = self._inflight, None
            try:
                self._inflight = self._next_round(rnd)
            except Exception:  # the next step schedules afresh, eagerly
                log.exception("launching the next decode round raised; stepping afresh")
            try:
                if self._inflight is not None:  # the GPU has `rnd` and the round just launched queued
                    self._under_round(self._inflight.steps, rnd.steps)
            finally:
                self._waited_ns += book_round(rnd, self._book)  # (booked whatever the load-ahead did)
                self._decode_us = rnd.timers[-1].elapsed_us()  # a whole-batch decode step's: what the next round covers
            self._ran = True
            return self._pop_done()
        self._launched_ns = self._cycle_ns = None  # rounds, if any, ended: the next one's host cycle is not a chained one's
        plan = self.planner.schedule()
        now = monotonic_us()
        for seq, error in plan.failed:
            self.requests.end(seq, error, now, release=False)
        self._ran = bool(plan.items)
        if plan.items:
            self._run(plan, now)
        else:
            self._load_ahead()
        return self._pop_done()

    def _pop_done(self) -> list[GenerationResult]:
        """The finished requests' results, but for those with a row in the decode round in flight: a request that
        stopped (EOS, a stop string, a failed row) in the round just read back has a row in the next, launched before
        the stop was known, and that row is charged to it when its round is booked. Its result waits for that (one
        round), so that every result carries its whole charge when it is handed out, and every step of it has been
        booked (pop_step_records(drain=False) relies on that)."""
        if self._inflight is None or not self.requests.done:
            return self.requests.pop_done()
        in_round = {s.key for s in self._inflight.seqs if s.finish_reason is not None or s.error is not None}
        done, self.requests.done = self.requests.done, []
        for res in done:
            if (res.tenant_id, res.request_id) in in_round:
                self.requests.done.append(res)
        return [res for res in done if (res.tenant_id, res.request_id) not in in_round]

    def generate(self, reqs: list[GenerationRequest]) -> list[GenerationResult]:
        """Run `reqs` to completion; results in input order. Other requests' results stay for step()."""
        results: list[GenerationResult | None] = [None] * len(reqs)
        slot_of: dict[tuple[str, str], int] = {}  # (tenant_id, request_id) -> index
        for i, req in enumerate(reqs):
            key = (req.tenant_id, req.request_id)
            if key in slot_of or key in self.requests.unfinished:
                # Caught here rather than by add_request: two results of one identity could not be told apart.
                results[i] = failed_result(req, duplicate(req))
                continue
            slot_of[key] = i
            self.add_request(req)
        others: list[GenerationResult] = []
        try:
            while slot_of:
                finished = self.step()
                for res in finished:
                    i = slot_of.pop((res.tenant_id, res.request_id), None)
                    if i is None:
                        others.append(res)
                    else:
                        results[i] = res
                if not finished and (wait := self.idle_wait_s()) > 0:
                    time.sleep(min(0.05, wait))
        finally:
            for tenant_id, rid in slot_of:  # only after an exception: leave no half-run request behind
                self.abort(rid, tenant_id)
            self.requests.done = others + self.requests.done
        return results  # type: ignore[return-value]

    def idle_wait_s(self) -> float:
        """How long a caller stepping in a loop may sleep before the next step: 0 when the last step ran or
        has results to hand out; else until the adapter admission bucket refills (1 ms at least)."""
        if self._ran or self.requests.done or not self.planner.waiting:
            return 0.0
        return max(0.001, self.adapters.wait_s())

    def pop_step_records(self, *, drain: bool = True) -> list[StepRecord]:
        """The records of every step launched so far: a decode round still in flight is read back first (its results
        come from the next step()), so that no step popped later began before this call. The worker's busy-time
        records rely on that: each covers the wall span between two pops, and the ledger refuses one whose GPU time
        exceeds its span.

        `drain=False` leaves a round in flight running and returns the steps booked so far, those of every result
        handed out (`_pop_done` holds back a result with a row in the round in flight): a step loop that pops after each step (engine.engine_process) would otherwise wait for each round
        and leave the GPU idle while it sends results and reads commands. The round left in flight began on the device
        as the one before it ended, so it may have begun up to the read-back's host time before this call; the busy
        records' keeper ends a record that much later (consumer.feeder)."""
        if drain:
            self._drain()
        records, self.book.records = self.book.records, []
        return records

    def stats(self) -> dict:
        """Gauges and counters for metrics (the consumer exports them to Prometheus)."""
        blocks, planner = self.runner.blocks, self.planner
        looked = planner.prompt_tokens_looked_up
        return {
            "running": len(planner.running),
            "waiting": len(planner.waiting),
            "steps": self.book.steps,
            "prompt_steps": self.book.prompt_steps,  # steps with prompt tokens, their device µs and prompt tokens
            "prompt_step_us": self.book.prompt_step_us,
            "prompt_tokens": self.book.prompt_tokens,
            "preemptions": planner.preemptions,
            "admission_holds": planner.hold.holds,  # steps that held back admissions for store reads (engine.admission)
            "load_ahead_cuts": planner.load_ahead_cuts,  # load-aheads that left placements to later steps (engine.load_ahead_share)
            "kv_pool_total_blocks": blocks.num_blocks,
            "kv_pool_used_blocks": blocks.num_used,
            "kv_pool_cached_blocks": blocks.num_cached,
            "kv_pool_hit_rate": planner.prompt_tokens_hit / looked if looked else 0.0,
            "kv_prefix_hit_tokens": planner.prompt_tokens_hit,
            "kv_prefix_lookup_tokens": looked,
            "kv_tenant_quota_blocks": blocks.tenant_quota,
            "kv_tenant_used_blocks": blocks.tenants(),
            "prefill_us_per_token": self.book.prefill_cost.value,
            **self.adapters.stats(),
        }

    # ---- internals

    def _run(self, plan: Plan, now_us: int) -> None:
        for it in plan.items:
            seq = it.seq
            if not seq.scheduled_once:
                seq.scheduled_once = True
                seq.timings.queue_us = max(0, now_us - seq.arrival_us)
                seq.timings.kv_saved_us = round(seq.timings.cached_tokens * (self.book.prefill_cost.value or 0.0))
        items = [BatchItem(it.seq.seq_id, it.tokens, it.seq.num_computed, it.seq.lora_slot, it.samples) for it in plan.items]
        # While a waiting request could be admitted, a round is of one step: the next step() schedules it afresh unless
        # the planner finds that nobody would be admitted then either (`_next_round`)
        limit = 1 if self._admissible() else self.config.decode_steps
        steps = chain_length(plan, items, self.runner, limit, whole_batch=len(plan.items) == len(self.planner.running))
        if steps:
            try:
                self._inflight = self._launch_round([it.seq for it in plan.items], items, steps)  # read by the next step()
            except Exception:  # (blocks grown for the round stay the sequences', for their next tokens)
                log.exception("launching a decode round of %d requests raised; running one isolated step instead", len(items))
                self._step_timer.reset()
                self.runner.begin_step()
            else:
                self._under_round(steps)  # (the round is in flight whatever this does)
                return
        logits, failed = forward_isolated(self._forward, items)  # [M', V] for the sampling items that ran
        # between launching the forward and reading its results: on CUDA, overlapped with it; it covers its prompt tokens
        # at the fitted cost of one, or what the last eager step took
        prompt = sum(len(it.tokens) for it in plan.items if len(it.tokens) > 1)  # (a decode item computes one token)
        per_token = self.book.prefill_cost.value
        self._load_ahead(1, covers_us=prompt * per_token if prompt and per_token else self._eager_us)
        samplers = [i for i, it in enumerate(plan.items) if it.samples and i not in failed]
        with self._step_timer.section():
            chosen, sample_errors = self._sample(logits, [plan.items[i].seq for i in samplers])
        end_us = monotonic_us()
        total_us = self._eager_us = self._step_timer.elapsed_us()
        # Event rounding may overshoot by 1 us; a graph's calibrated share may exceed a faster step's total.
        lora_us = min(self.runner.lora_us(), total_us)
        outcomes: list[Outcome] = [None] * len(plan.items)
        for j, i in enumerate(samplers):
            outcomes[i] = sample_errors.get(j, chosen[j])
        rows = [(it.seq, len(it.tokens), it.seq.lora_slot >= 0) for it in plan.items]
        self._book(rows, total_us, lora_us, end_us, outcomes, failed)

    def _book(self, rows: list[tuple[Sequence, int, bool]], total_us: int, lora_us: int, end_us: int, outcomes: list[Outcome],
              failed: dict[int, EngineError] | None = None) -> None:  # fmt: skip
        """Book a measured step, eager or of a decode round (engine.booking `StepBook.book`)."""
        self.book.book(rows, total_us, lora_us, end_us, outcomes, self.eos_ids, failed)

    def _forward(self, items: list[BatchItem]) -> torch.Tensor:
        self.runner.prepare(items)  # the wait for its adapters' copies and one-time work stay out of the step's time
        with self._step_timer.section():
            return self.runner.forward(items)  # [M, V] fp32, one row per sampling item

    def _launch_round(self, seqs: list[Sequence], items: list[BatchItem], steps: int, first_ids: torch.Tensor | None = None) -> Round:
        """Launch a decode round (engine.rounds `launch_round`); the caller then starts the adapter loads no request of it
        waits for (`_load_ahead`), once the round is kept, so that a load-ahead that raises loses no launched step."""
        launched = launch_round(self.runner, seqs, items, steps, first_ids)
        now, placed_ns = time.perf_counter_ns(), self.adapters.placement_ns
        if self._launched_ns is not None:  # a chained cycle ended: its host time besides placements and waits
            rest = now - self._launched_ns - self._waited_ns - (placed_ns - self._placed_ns)
            self._rest_ns, self._rest_last = min(rest, self._rest_last or rest), rest
        self._launched_ns, self._waited_ns, self._placed_ns = now, 0, placed_ns
        return launched

    def _next_round(self, rnd: Round) -> Round | None:
        """The round after `rnd`, launched before `rnd` is read back, so that the host's reading and bookkeeping of
        `rnd` overlap the GPU's next steps; None (and the next step() schedules afresh) when a waiting request could
        be admitted, or engine.rounds `plan_next_round` finds none. While requests wait with room for them but the
        planner would admit none (each awaits a store read, or the admission hold holds them back: engine.planner
        `admits_none`), the round is of `_held_steps` (one, or as many as the host's last cycle took), so that the next
        step() asks again about as soon as it could anyway."""
        held = self._admissible()
        if held and not self.planner.admits_none():
            return None
        if (planned := plan_next_round(rnd, self.runner, self._held_steps() if held else self.config.decode_steps)) is None:
            return None
        items, steps = planned
        launched = self._launch_round(rnd.seqs, items, steps, first_ids=rnd.last_ids)
        if held:
            self.planner.note_held(steps)  # the round the planner held back admissions for runs: its hold counted once
        return launched

    def _held_steps(self) -> int:
        """The steps of a round launched while admissions are held (`_next_round`): one, or as many as the host's last
        cycle of a chained round took at the last decode step's measured time, rounded (at most `decode_steps`). The
        host asks the planner once a cycle, so where its work (reads landing beside it, placements, booking) outlasts one step, a round
        of one step leaves the GPU idle for the rest and asks no sooner than a longer round would (issue 19's cold
        pass on an H100: one-step calls of 4.5 ms wall against 2.25 ms on the device, engine/PERF.md, session 22)."""
        if self._launched_ns is None or self._decode_us <= 0:
            return 1
        now = time.perf_counter_ns()
        cycle_ns = now - self._launched_ns - self._waited_ns
        # the shorter of the last two cycles: one long cycle (a burst of arrivals, a traceback logged) is not a trend
        host_ns, self._cycle_ns = min(cycle_ns, self._cycle_ns or cycle_ns), cycle_ns
        steps = round(host_ns / (self._decode_us * 1000))
        left_s = self.planner.hold.remaining_s(self.planner.hold.clock())
        if left_s is not None:  # a hold under way ends at its bound: no round runs on past it by a step
            steps = min(steps, int(left_s * 1e6 // self._decode_us) + 1)
        return max(1, min(self.config.decode_steps, steps))

    def _under_round(self, in_flight: int, finished_before: int = 0) -> None:
        """The host work overlapped with a round of `in_flight` steps just launched: the load-ahead, bounded by the
        round's steps at the last decode step's measured µs, then the collector's window, which runs also when the
        load-ahead raised; the automatic collector held off across both, so that the window collects what the
        load-ahead allocated (engine.collector `deferred`). Both stop short of where the rest of the host's cycle would
        start past the round's end (`_round_end_ns`): the placements, and a full collection put off to a later round."""
        covers_us = self._decode_us * in_flight
        until_ns = self._round_end_ns(covers_us)
        deferred = self.collector.deferred() if self.collector is not None else contextlib.nullcontext()
        with deferred:
            try:
                self._load_ahead(in_flight, finished_before, covers_us, until_ns=until_ns)
            finally:
                self._collect(until_ns)

    def _round_end_ns(self, covers_us: float) -> int | None:
        """The latest (time.perf_counter_ns) the host's work ahead under the round just launched, of `covers_us` of
        device time, may run: where the rest of the host's cycle, as the last chained cycles measured it (`_rest_ns`),
        would start past the round's end. None until a decode step and a chained cycle were measured.

        A round of one step covers 1.5-2.5 ms, about what the host's cycle takes without placements: placing there made
        the GPU wait (issue 19's cold pass on an H200: one-step calls of 3.2-4.6 ms wall placing 1-6 adapters, against
        1.5-3.0 ms on the device), as did a full collection of 6-9 ms in a round already filled with placements
        (engine/PERF.md, sessions 25 and 26)."""
        if self._launched_ns is None or covers_us <= 0 or self._rest_ns is None:
            return None
        return self._launched_ns + int(covers_us * 1000) - self._rest_ns

    def _collect(self, until_ns: int | None = None) -> None:
        """The collector's next pass, if the automatic one would fire before the next call, while the GPU has a round
        queued (engine.collector), a full one only if it would end by `until_ns`. A guard only: CPython reports
        finalizers' errors through sys.unraisablehook, and anything else the window raised is logged, never the step's."""
        if self.collector is None:
            return
        try:
            self.collector(until_ns)
        except Exception:
            log.exception("a garbage-collector pass between rounds raised")

    def _admissible(self) -> bool:
        """Whether a waiting request might be admitted by the next schedule: some wait and the batch has room. With the
        batch full (a loaded worker's usual state) nobody can join until a request finishes, and rounds end at the
        first finish by length anyway; a finish by EOS or a stop string frees its place one round later."""
        return bool(self.planner.waiting) and len(self.planner.running) < self.config.max_batch_size

    def _drain(self) -> None:
        """Read back and book the round in flight, if any, launching nothing after it."""
        rnd, self._inflight = self._inflight, None
        self._launched_ns = self._cycle_ns = None
        if rnd is not None:
            book_round(rnd, self._book)

    def _load_ahead(self, in_flight: int = 0, finished_before: int = 0, covers_us: float = 0.0, until_ns: int | None = None) -> None:
        """Adapter loads no request of this step waits for: those of the waiting requests next in line, then the
        warm pool's (after admission, so that what requests need now is loaded for them, and charged to them).

        Placed in L1 now are the adapters of as many waiting requests as the next schedules can admit: the batch's free
        places, and the running requests that reach their max_new_tokens within the `in_flight` steps launched (of which
        `finished_before` were launched before) and the LOOKAHEAD_ROUNDS rounds after; the others are only read ahead
        from the store (engine.planner `prefetch`). A request that ends early (EOS, a stop string) was not counted: its
        successor's adapter is placed at its admission.

        `covers_us`: the device time of the work just launched, which this host work overlaps. Placements stop once they
        took `engine.load_ahead_share` of it (a placement is host work: its eviction choice, page tables and the copies'
        launches, 100-600 µs each on an H100's host), so that the GPU does not wait for them; the requests left are
        placed by the next step's walk, or at their admission. 0 (nothing measured yet, or nothing launched): no bound.
        `until_ns` (time.perf_counter_ns; a decode round's `_round_end_ns`): no placement starts past it either, where a
        share bounds them; the requests left are placed in longer rounds, or at their admission."""
        running = self.planner.running
        horizon = finished_before + in_flight + LOOKAHEAD_ROUNDS * self.config.decode_steps
        ending = sum(tokens_left(s) <= horizon for s in running)
        places = self.config.max_batch_size - len(running) + ending
        share = self.config.load_ahead_share
        deadline = time.perf_counter_ns() + int(share * covers_us * 1000) if share is not None and covers_us > 0 else None
        if deadline is not None and until_ns is not None:
            deadline = min(deadline, until_ns)
        self.planner.prefetch((s.lora_slot for s in running if s.lora_slot >= 0), places, deadline)
        self.adapters.warm()

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], dict[int, EngineError]]:
        """The next token of each of `seqs` (rows of `logits`), their logprobs appended, and the error of each row that
        failed, by index (engine.isolation)."""
        if not seqs:
            return [], {}
        params, generators = [s.request.sampling for s in seqs], [s.generator for s in seqs]
        chosen, entries, errors = sample_isolated(logits, params, generators, self.tokenizer.token_bytes)
        for seq, entry in zip(seqs, entries):
            if entry is not None:
                seq.logprobs.append(entry)
        return chosen, errors
