"""The engine: continuous batching of many tenants' and adapters' requests over one base model.

Requests join and leave the running batch between steps. Each `step()` lets the scheduler
(engine.planner) pick the step's work under a token budget (decodes, prefill chunks, new admissions,
preemptions when KV blocks run out), runs ONE forward over all of it with rows of different adapters
or none side by side, samples a token for every request whose known tokens are all computed, and
returns the requests that finished. Adapters are loaded lazily by the pool (engine.adapter_pool) when
a request needs one, or eagerly with `load_adapter`.

Compute backend (engine.backend), chosen once at start and logged: Triton kernels on CUDA, with decode
steps replayed as CUDA graphs (engine.cuda_graphs); the torch reference ops on the CPU.

Decode rounds (CUDA graphs only): when every running request decodes, none wants logprobs and nothing
waits, a step runs up to `decode_steps` graph replays back to back (`_launch_round`), each fed the
tokens the one before sampled, without the host reading them; the next step() launches the following
round from the last one's tokens on the device (`_next_round`) and only then reads the last one back
and does its bookkeeping, so that host work overlaps the GPU instead of idling it (llama-1b, batch 32:
2.11 -> 1.34 ms per decode step, engine/PERF.md). Results thus come back one step() call later. A
waiting request that the batch has room for, a request reaching its max_new_tokens, or one found
finished ends the run of rounds, and the next step() schedules afresh.

Timings (for billing, DESIGN.md "Cost attribution"): each step's time is measured with CUDA events around
the forward and the sampling (the adapter loads started between them, which overlap the forward on CUDA,
and a decode bucket's one-time graph capture, are not part of it), its LoRA part around the LoRA ops in
eager steps and by the bucket's one-time calibration in graphed ones (engine.cuda_graphs, "Timing"), and
both are split exactly among the step's requests by tokens (engine.timing); `step_records`
keeps each step's split for billing's conservation checks (drain with `pop_step_records`). Tokens a
request finds in the prefix cache are credited as kv_saved_us = cached tokens x the measured marginal
cost of a prefill token (engine.timing.PrefillCost, a fit of step time over step tokens). Adapter loads are measured apart, each
one reported with its tier (`pop_load_events`) and charged as adapter_load_us to the first request
that uses the adapter after it. Tokens recomputed after a preemption are computed, and so charged,
like any others.

Identity: a request is (tenant, request_id); two tenants may use one request_id at once. Inside, each sequence
has its own id (`Sequence.seq_id`) for KV blocks and batch rows.

Isolation: one request's failure fails that request alone, with a code; its batchmates go on. A request whose
validation or admission fails comes back failed from the next step(); a step's forward that raises is run again in
halves down to the culprits, and a row whose logits are unusable or whose sampling raises fails alone
(engine.isolation); so does one whose detokenizing or stop-string matching raises. A decode round that fails to
launch falls back to one isolated eager step.

Error codes of failed results (EngineError.code; retriable only where said): those of engine.validation;
duplicate_request_id (the same (tenant, request_id) is unfinished); unknown_adapter; the adapter's load errors
(engine.api.ADAPTER_ERROR_CODES; adapter_load_failed when loading raised unexpectedly); admission_failed (building
the request raised unexpectedly); sampling_failed (unusable logits, or sampling or logprobs raised); decode_failed
(detokenizing or stop-string matching raised); forward_failed (the forward raised with this request alone);
engine_failed (retriable: the forward raised for every request alone, or, from engine.async_engine, a step raised
outside all of this); aborted (`abort`).

Single-threaded: call every method from one thread (`engine.async_engine.AsyncEngine` runs the step
loop in its own thread for asyncio callers).
"""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.adapter_pool import AdapterPool
from engine.api import (
    AdapterError,
    AdapterInfo,
    EngineError,
    GenerationRequest,
    GenerationResult,
    RequestError,
    RequestTimings,
)
from engine.backend import graph_batch_sizes, pick_backend
from engine.config import EngineConfig
from engine.model import LlamaForCausalLM, base_fingerprint, load_model, read_eos_ids
from engine.runner import BatchItem, ModelRunner
from engine.isolation import forward_isolated, sample_isolated, unusable_logits
from engine.sampling import generator_seed, is_greedy, sample_on_device, usable_rows
from engine.planner import Plan, StepPlanner
from engine.sequence import Sequence
from engine.timing import DeviceTimer, PrefillCost, StepRecord, attribute_step
from engine.tokenizer import IncrementalDetokenizer, Tokenizer
from engine.validation import check_context, check_sampling, prompt_ids

log = logging.getLogger("lorabatch.engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Engine:
    def __init__(self, config: EngineConfig, *, clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time):
        """Load the model of `config.model_dir`. `clock` (monotonic seconds) paces the adapter admission
        bucket, heat and the warm pool's interval; `wall_clock` gives the warm pool its hour of day."""
        device = pick_device(config.device)
        dtype = pick_dtype(config.dtype, device)
        model_dir = Path(config.model_dir)
        tokenizer = Tokenizer(model_dir)
        model = load_model(model_dir, device, dtype)
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
        device = model.lm_head.weight.device
        backend = pick_backend(config.kernel_backend, device)
        graph_cap = min(config.cuda_graph_max_batch, config.max_batch_size)
        graphs = graph_batch_sizes(graph_cap) if backend.triton and device.type == "cuda" else ()
        self.runner = ModelRunner(
            model,
            max_loras=config.max_loras,
            max_lora_rank=config.max_lora_rank,
            kv_num_blocks=num_blocks,
            kv_block_size=config.kv_block_size,
            prefix_caching=config.enable_prefix_caching,
            tenant_quota_blocks=quota,
            backend=backend,
            graph_sizes=graphs,
            max_blocks_per_seq=config.blocks_per_sequence,
            max_chain=config.decode_steps,
        )
        self.device, self.dtype = self.runner.device, self.runner.dtype
        if backend.triton:
            what = "Triton kernels (multi-LoRA shrink/expand, paged attention)" + (" in the interpreter" if backend.interpreted else "")
        else:
            what = "torch reference ops (gathered multi-LoRA, per-sequence SDPA)"
        if graphs:
            how = f"decode steps of up to {graphs[-1]} requests replay CUDA graphs (buckets {', '.join(map(str, graphs))})"
        elif backend.triton and device.type == "cuda":
            how = "CUDA graphs off (engine.cuda_graph_max_batch=0): every step eager"
        else:
            how = "no CUDA graphs (they need the triton backend on cuda): every step eager"
        log.info("engine backend: %s on %s, %s (engine.kernel_backend=%r); %s", backend.name, device, what, config.kernel_backend, how)
        self.adapters = AdapterPool(self.runner.lora, model.config, config, base_fingerprint=fingerprint, clock=clock, wall_clock=wall_clock)
        self.scheduler = StepPlanner(config, self.runner.blocks, self.adapters, fingerprint)
        self.step_records: list[StepRecord] = []
        self.prefill_cost = PrefillCost()  # measured us per prefill token (engine.timing)
        self._unfinished: dict[tuple[str, str], Sequence] = {}  # (tenant, request_id) -> sequence, waiting or running
        self._done: list[GenerationResult] = []  # finished, not yet returned by step()
        self._order = itertools.count()
        self._step_ids = itertools.count()
        self._steps = 0
        self._ran = False  # whether the last step ran a forward
        self._step_timer = DeviceTimer(self.device)
        self._inflight: _Round | None = None  # a decode round launched and not yet read back (_launch_round)

    # ---- adapters

    def register_adapter(self, key: str, path: Path, sha256: str | None = None, *, tenant: str = "", slo_tier: str = "standard") -> None:
        """Make `key` usable by requests; nothing is read until a request (or the warm pool) needs it.
        With `sha256`, the files must hash to it when read (else the requests fail with adapter_changed)."""
        self.adapters.register(key, Path(path), sha256=sha256, tenant=tenant, slo_tier=slo_tier)

    def load_adapter(self, key: str, path: Path, *, tenant: str = "", slo_tier: str = "standard") -> AdapterInfo:
        """Register, validate and load a PEFT adapter folder under `key` now; the same content under a new key
        is shared. Raises AdapterError (and leaves the key unregistered) if it cannot be loaded."""
        return self.adapters.load(key, Path(path), tenant=tenant, slo_tier=slo_tier)

    def unload_adapter(self, key: str) -> None:
        users = [k for k, s in self._unfinished.items() if s.adapter_key == key]
        if users:
            raise AdapterError(
                f"adapter {key!r} is in use by {len(users)} unfinished requests (e.g. {users[0]!r}); "
                "unload it once they finish or abort them",
                code="adapter_in_use",
                retriable=True,
            )
        self.adapters.unload(key)

    def has_adapter(self, key: str) -> bool:
        return self.adapters.has(key)

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
        now = _now_us()
        arrival = req.arrival_us if isinstance(req.arrival_us, int) else now
        try:
            seq = self._new_sequence(req, arrival)
            if req.adapter is not None:
                self.adapters.note_request(req.adapter)
        except RequestError as e:
            self._done.append(_failed(req, e, max(0, now - arrival)))
            return
        except Exception as e:  # a bug met by this request's content: it fails alone
            log.exception("admitting request %r of tenant %r raised", req.request_id, req.tenant)
            error = RequestError(f"admitting the request raised {type(e).__name__}: {e}; it was logged", code="admission_failed")
            self._done.append(_failed(req, error, max(0, now - arrival)))
            return
        self.scheduler.add(seq)
        self._unfinished[seq.key] = seq

    def abort(self, request_id: str, tenant: str = "") -> GenerationResult | None:
        """Stop the unfinished request (tenant, request_id) now; returns its partial result (error code `aborted`), or
        None if unknown."""
        self._drain()  # its blocks and slot may not be released under a round still running on the device
        seq = self._unfinished.pop((tenant, request_id), None)
        if seq is None:
            return None
        self.scheduler.remove(seq)
        try:
            seq.text = seq.text or self.tokenizer.decode(seq.output_ids)
        except Exception:
            log.exception("decoding the partial text of aborted request %r raised", seq.key)
        return self._result(seq, RequestError(f"request {request_id!r} was aborted", code="aborted"))

    def abort_all(self, error: EngineError) -> list[GenerationResult]:
        """Fail every unfinished request with `error` and hand out every result not yet returned: the last resort of a
        caller whose step() raised (engine.async_engine), so that no request is left unsettled."""
        try:
            self._drain()
        except Exception:
            log.exception("reading back the decode round in flight raised; its tokens are lost")
        out, self._done = self._done, []
        for key in list(self._unfinished):
            seq = self._unfinished.pop(key)
            try:
                self.scheduler.remove(seq)
            except Exception:
                log.exception("releasing request %r raised", key)
            out.append(self._result(seq, error))
        return out

    def has_unfinished(self) -> bool:
        return bool(self._unfinished or self._done)

    def step(self) -> list[GenerationResult]:
        """Run one engine step; return the requests that finished in it (and failed validations).

        With a decode round in flight (`_launch_round`), the step launches the next round first (when nothing waits
        and every request has tokens left), then reads the one in flight back and returns what finished in it."""
        self._step_timer.reset()
        self.runner.begin_step()
        if self._inflight is not None:
            rnd, self._inflight = self._inflight, None
            try:
                self._inflight = self._next_round(rnd)
            except Exception:  # the next step schedules afresh, eagerly
                log.exception("launching the next decode round raised; stepping afresh")
            self._process_round(rnd)
            self._ran = True
            done, self._done = self._done, []
            return done
        plan = self.scheduler.schedule()
        now = _now_us()
        for seq, error in plan.failed:
            del self._unfinished[seq.key]
            self._done.append(self._result(seq, error, now))
        self._ran = bool(plan.items)
        if plan.items:
            self._run(plan, now)
        else:
            self._load_ahead()
        done, self._done = self._done, []
        return done

    def generate(self, reqs: list[GenerationRequest]) -> list[GenerationResult]:
        """Run `reqs` to completion; results in input order. Other requests' results stay for step()."""
        results: list[GenerationResult | None] = [None] * len(reqs)
        slot_of: dict[tuple[str, str], int] = {}  # (tenant, request_id) -> index
        for i, req in enumerate(reqs):
            key = (req.tenant, req.request_id)
            if key in slot_of or key in self._unfinished:
                # Caught here rather than by add_request: two results of one identity could not be told apart.
                results[i] = _failed(req, _duplicate(req))
                continue
            slot_of[key] = i
            self.add_request(req)
        others: list[GenerationResult] = []
        try:
            while slot_of:
                finished = self.step()
                for res in finished:
                    i = slot_of.pop((res.tenant, res.request_id), None)
                    if i is None:
                        others.append(res)
                    else:
                        results[i] = res
                if not finished and (wait := self.idle_wait_s()) > 0:
                    time.sleep(min(0.05, wait))
        finally:
            for tenant, rid in slot_of:  # only after an exception: leave no half-run request behind
                self.abort(rid, tenant)
            self._done = others + self._done
        return results  # type: ignore[return-value]

    def idle_wait_s(self) -> float:
        """How long a caller stepping in a loop may sleep before the next step: 0 when the last step ran or
        has results to hand out; else until the adapter admission bucket refills (1 ms at least)."""
        if self._ran or self._done or not self.scheduler.waiting:
            return 0.0
        return max(0.001, self.adapters.wait_s())

    def pop_step_records(self) -> list[StepRecord]:
        """The records of every step launched so far: a decode round still in flight is read back first (its results
        come from the next step()), so that no step popped later began before this call. The worker's busy-time
        records rely on that: each covers the wall span between two pops, and the ledger refuses one whose GPU time
        exceeds its span."""
        self._drain()
        records, self.step_records = self.step_records, []
        return records

    def stats(self) -> dict:
        """Gauges and counters for metrics (the consumer exports them to Prometheus)."""
        blocks, sched = self.runner.blocks, self.scheduler
        looked = sched.prompt_tokens_looked_up
        return {
            "running": len(sched.running),
            "waiting": len(sched.waiting),
            "steps": self._steps,
            "preemptions": sched.preemptions,
            "kv_pool_total_blocks": blocks.num_blocks,
            "kv_pool_used_blocks": blocks.num_used,
            "kv_pool_cached_blocks": blocks.num_cached,
            "kv_pool_hit_rate": sched.prompt_tokens_hit / looked if looked else 0.0,
            "kv_prefix_hit_tokens": sched.prompt_tokens_hit,
            "kv_prefix_lookup_tokens": looked,
            "kv_tenant_quota_blocks": blocks.tenant_quota,
            "kv_tenant_used_blocks": blocks.tenants(),
            "prefill_us_per_token": self.prefill_cost.value,
            **self.adapters.stats(),
        }

    # ---- internals

    def _new_sequence(self, req: GenerationRequest, arrival: int) -> Sequence:
        if (req.tenant, req.request_id) in self._unfinished:
            raise _duplicate(req)
        if req.adapter is not None and not self.adapters.has(req.adapter):
            raise RequestError(
                f"adapter {req.adapter!r} is not registered; register it with register_adapter or load_adapter first",
                code="unknown_adapter",
            )
        ids = prompt_ids(req, self.tokenizer, self.config, vocab_size=self.runner.config.vocab_size)
        check_sampling(req.sampling, self.config)
        check_context(len(ids), req.sampling, self.runner.config.max_position_embeddings)
        generator = None
        if not is_greedy(req.sampling):
            seed = req.sampling.seed if req.sampling.seed is not None else secrets.randbits(63)
            generator = torch.Generator(device=self.device).manual_seed(generator_seed(seed))
        return Sequence(
            request=req,
            order=next(self._order),
            prompt_ids=ids,
            arrival_us=arrival,
            detok=IncrementalDetokenizer(self.tokenizer),
            generator=generator,
            adapter_key=req.adapter,
            logprobs=[] if req.sampling.logprobs is not None else None,
        )

    def _run(self, plan: Plan, now_us: int) -> None:
        for it in plan.items:
            seq = it.seq
            if not seq.scheduled_once:
                seq.scheduled_once = True
                seq.timings.queue_us = max(0, now_us - seq.arrival_us)
                seq.timings.kv_saved_us = round(seq.timings.cached_tokens * (self.prefill_cost.value or 0.0))
        items = [BatchItem(it.seq.seq_id, it.tokens, it.seq.num_computed, it.seq.lora_slot, it.samples) for it in plan.items]
        steps = self._chain_length(plan, items)
        if steps > 1:
            try:
                self._inflight = self._launch_round([it.seq for it in plan.items], items, steps)  # read by the next step()
                return
            except Exception:  # (blocks grown for the round stay the sequences', for their next tokens)
                log.exception("launching a decode round of %d requests raised; running one isolated step instead", len(items))
                self._step_timer.reset()
                self.runner.begin_step()
        logits, failed = forward_isolated(self._forward, items)  # [M', V] for the sampling items that ran
        self._load_ahead()  # between launching the forward and reading its results: on CUDA, overlapped with it
        samplers = [it.seq for i, it in enumerate(plan.items) if it.samples and i not in failed]
        with self._step_timer.section():
            chosen, sample_errors = self._sample(logits, samplers)
        end_us = _now_us()

        total_us = self._step_timer.elapsed_us()
        # Event rounding may overshoot by 1 us; a graph's calibrated share may exceed a faster step's total.
        lora_us = min(self.runner.lora_us(), total_us)
        rows = [(it.seq.key, len(it.tokens), it.seq.lora_slot >= 0) for it in plan.items]
        record = attribute_step(next(self._step_ids), total_us, lora_us, rows)
        self.step_records.append(record)
        self._steps += 1
        for i, (it, share) in enumerate(zip(plan.items, record.shares)):
            seq, t = it.seq, it.seq.timings
            t.base_us += share.base_us
            t.lora_us += share.lora_us
            t.steps += 1
            if i in failed:
                continue
            start = seq.num_computed
            in_prompt = max(0, min(start + len(it.tokens), len(seq.prompt_ids)) - start)
            t.prefill_tokens += in_prompt
            t.decode_tokens += len(it.tokens) - in_prompt
            seq.num_computed += len(it.tokens)
            self.runner.blocks.commit(seq.seq_id, seq.tokens, seq.num_computed)
        if not failed:  # (retried forwards would skew the fit)
            self.prefill_cost.update(record.tokens, total_us)
        for i, error in failed.items():
            self._fail(plan.items[i].seq, error, end_us)
        for j, (seq, token) in enumerate(zip(samplers, chosen)):
            if j in sample_errors:
                self._fail(seq, sample_errors[j], end_us)
                continue
            if not self._take_token(seq, token, end_us):
                continue
            if seq.timings.ttft_us == 0:
                seq.timings.ttft_us = end_us - seq.arrival_us

    def _take_token(self, seq: Sequence, token: int, end_us: int) -> bool:
        """Append a sampled token to `seq`, finishing it if it is done; False if that raised (and failed the request)."""
        try:
            seq.append_token(token, self.eos_ids)
        except Exception as e:
            log.exception("detokenizing token %d of request %r raised", token, seq.key)
            self._fail(seq, EngineError(f"detokenizing the output raised {type(e).__name__}: {e}; it was logged", code="decode_failed"), end_us)
            return False
        if seq.finish_reason is not None:
            self.scheduler.remove(seq)
            del self._unfinished[seq.key]
            self._done.append(self._result(seq, None, end_us))
        return True

    def _fail(self, seq: Sequence, error: EngineError, now_us: int) -> None:
        """End an unfinished request with `error`, releasing its blocks and adapter pin."""
        log.warning("request %r failed alone with %s: %s", seq.key, error.code, error)
        seq.error = error
        self.scheduler.remove(seq)
        del self._unfinished[seq.key]
        self._done.append(self._result(seq, error, now_us))

    def _forward(self, items: list[BatchItem]) -> torch.Tensor:
        self.runner.prepare(items)  # one-time work (a decode bucket's graph capture) stays out of the step's time
        with self._step_timer.section():
            return self.runner.forward(items)  # [M, V] fp32, one row per sampling item

    def _chain_length(self, plan: Plan, items: list[BatchItem]) -> int:
        """Decode steps this round runs back to back (engine.config `decode_steps`, engine.cuda_graphs "Chains"): more
        than 1 only when every running request is in the step, decodes one token and samples, none wants logprobs,
        no waiting request could be admitted now (`_admissible`), the graphs fit, and every sequence's blocks grow
        to cover the extra steps (taken here). Capped at the fewest tokens any request has left, so no request
        computes past its max_new_tokens."""
        steps = self.config.decode_steps
        if steps <= 1 or self._admissible() or plan.preempted or len(plan.items) != len(self.scheduler.running):
            return 1  # (a running request left out of this step by the token budget must not wait for a whole run)
        if not all(it.samples and len(it.tokens) == 1 and it.seq.logprobs is None for it in plan.items):
            return 1
        steps = min(steps, *(_tokens_left(it.seq) for it in plan.items))
        return steps if steps > 1 and self._reserve_round(items, steps) else 1

    def _launch_round(self, seqs: list[Sequence], items: list[BatchItem], steps: int, first_ids: torch.Tensor | None = None) -> _Round:
        """Launch `steps` decode steps of `seqs` back to back (engine.cuda_graphs "Chains") and the copy of their
        tokens to pinned host memory; nothing waits for them here. `first_ids`: the first step's input tokens on the
        device (the last tokens of the round before), instead of the items' own. A row whose logits are unusable is
        fed a valid token on the device and read back as -1 (its request fails when the round is read)."""
        self.runner.prepare(items)
        params, generators = [s.request.sampling for s in seqs], [s.generator for s in seqs]
        timers = [DeviceTimer(self.device) for _ in range(steps)]
        usable: list[torch.Tensor] = []  # [M] bool per step

        def sample(logits: torch.Tensor) -> torch.Tensor:
            usable.append(usable_rows(logits))
            return sample_on_device(logits, params, generators)

        chosen = self.runner.decode_chain(items, steps, sample, lambda j: timers[j].section(), first_ids=first_ids)
        stacked = torch.where(torch.stack(usable), torch.stack(chosen), -1)  # [steps, M] on the device
        host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=self.device.type == "cuda")
        host.copy_(stacked, non_blocking=True)
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        rnd = _Round(seqs, steps, chosen[-1], host, done, timers, self.runner.lora_us())
        self._load_ahead()
        return rnd

    def _next_round(self, rnd: _Round) -> _Round | None:
        """The round after `rnd`, launched before `rnd` is read back, so that the host's reading and bookkeeping of
        `rnd` overlap the GPU's next steps; None (and the next step() schedules afresh) when a waiting request could
        be admitted (`_admissible`), when a request of `rnd` reaches its max_new_tokens in it, or when blocks or
        graphs do not allow it. Sequences that stop in `rnd` by EOS or a stop string are found only when it is read:
        they keep their row in this round, charged to them and dropped (as in a round, `_chain_length`)."""
        if self._admissible() or any(s.finish_reason is not None or s.error is not None for s in rnd.seqs):
            return None  # (a sequence that finished in the round before this one: not carried any further)
        steps = min(self.config.decode_steps, *(_tokens_left(s) - rnd.steps for s in rnd.seqs))
        items = [BatchItem(s.seq_id, (0,), s.num_computed + rnd.steps, s.lora_slot, True) for s in rnd.seqs]
        if steps < 1 or not self._reserve_round(items, steps):
            return None
        return self._launch_round(rnd.seqs, items, steps, first_ids=rnd.last_ids)

    def _reserve_round(self, items: list[BatchItem], steps: int) -> bool:
        """Whether `steps` decode steps of `items` can run as one graph chain, growing each sequence's blocks to cover
        them (blocks grown before a later sequence fails to grow stay its own, for its next tokens)."""
        if not self.runner.can_chain(items, steps):
            return False
        blocks = self.runner.blocks
        for it in items:
            total = it.context_len + steps
            if blocks.can_grow(it.seq_id, total) is not None:
                return False
            blocks.grow(it.seq_id, total)
        return True

    def _admissible(self) -> bool:
        """Whether a waiting request might be admitted by the next schedule: some wait and the batch has room. With the
        batch full (a loaded worker's usual state) nobody can join until a request finishes, and rounds end at the
        first finish by length anyway; a finish by EOS or a stop string frees its place one round later."""
        return bool(self.scheduler.waiting) and len(self.scheduler.running) < self.config.max_batch_size

    def _process_round(self, rnd: _Round) -> None:
        """Read a round's tokens back (the one wait) and book its steps: each step is measured and attributed as a step
        of its own (one StepRecord each). A sequence that finishes at step j (EOS, stop string) still has a row in
        the steps after j: that row's time is charged to it, as the lookahead computed it on its behalf, and its
        tokens are dropped. So has one that fails at step j (unusable logits: token -1; detokenizing raised)."""
        if rnd.done is not None:
            rnd.done.synchronize()
        tokens = rnd.tokens.tolist()  # [steps, M]
        end_us = _now_us()
        rows = [(s.key, 1, s.lora_slot >= 0) for s in rnd.seqs]
        blocks = self.runner.blocks
        for j in range(rnd.steps):
            total_us = rnd.timers[j].elapsed_us()
            record = attribute_step(next(self._step_ids), total_us, min(rnd.lora_us, total_us), rows)
            self.step_records.append(record)
            self._steps += 1
            self.prefill_cost.update(record.tokens, total_us)
            for seq, share, token in zip(rnd.seqs, record.shares, tokens[j]):
                t = seq.timings
                t.base_us += share.base_us
                t.lora_us += share.lora_us
                if seq.finish_reason is not None or seq.error is not None:
                    continue  # computed past its end: charged, not kept
                t.steps += 1
                t.decode_tokens += 1
                seq.num_computed += 1
                blocks.commit(seq.seq_id, seq.tokens, seq.num_computed)
                if token < 0:
                    self._fail(seq, unusable_logits(), end_us)
                    continue
                self._take_token(seq, token, end_us)

    def _drain(self) -> None:
        """Read back and book the round in flight, if any, launching nothing after it."""
        rnd, self._inflight = self._inflight, None
        if rnd is not None:
            self._process_round(rnd)

    def _load_ahead(self) -> None:
        """Adapter loads no request of this step waits for: those of the waiting requests next in line, then the
        warm pool's (after admission, so that what requests need now is loaded for them, and charged to them)."""
        self.scheduler.prefetch(s.lora_slot for s in self.scheduler.running if s.lora_slot >= 0)
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

    def _result(self, seq: Sequence, error: EngineError | None, now_us: int | None = None) -> GenerationResult:
        t = seq.timings
        t.total_us = max(0, (now_us if now_us is not None else _now_us()) - seq.arrival_us)
        t.adapter_load_us = sum(event.load_us() for event in seq.load_charges)
        return seq.result(error)


def _tokens_left(seq: Sequence) -> int:
    return seq.request.sampling.max_new_tokens - len(seq.output_ids)


@dataclass
class _Round:
    """Decode steps launched back to back (Engine._launch_round), read back by a later step()."""

    seqs: list[Sequence]
    steps: int
    last_ids: torch.Tensor  # [M] the last step's sampled tokens, on the device: the next round's first input
    tokens: torch.Tensor  # [steps, M] int64, pinned host memory, filled by an async copy
    done: torch.cuda.Event | None  # recorded after that copy (None on CPU, where it is synchronous)
    timers: list[DeviceTimer]  # one per step
    lora_us: int  # the calibrated LoRA share of one step (engine.cuda_graphs "Timing")


def pick_device(choice: str) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise EngineError("engine.device='cuda' but no CUDA GPU is visible; set engine.device to 'cpu' or 'auto'", code="no_gpu")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def pick_dtype(choice: str, device: torch.device) -> torch.dtype:
    if choice == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[choice]


def _failed(req: GenerationRequest, error: EngineError, total_us: int = 0) -> GenerationResult:
    """The result of a request that failed before it became a sequence."""
    return GenerationResult(request_id=req.request_id, adapter=req.adapter, tenant=req.tenant, error=error,
                            timings=RequestTimings(total_us=total_us))  # fmt: skip


def _duplicate(req: GenerationRequest) -> RequestError:
    return RequestError(f"request_id {req.request_id!r} of tenant {req.tenant!r} is already in flight; use unique ids per tenant",
                        code="duplicate_request_id")  # fmt: skip


def _now_us() -> int:
    return time.monotonic_ns() // 1000
