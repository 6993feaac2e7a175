"""The engine: continuous batching of many adapters' requests over one base model.

Each `step()` admits waiting requests (highest priority first, then arrival order) while there is room
in the batch, in the KV cache and in the adapter slots, then runs ONE forward over all running
requests: the whole prompt of each newly admitted one (prefill) and one token of each of the others
(decode), rows of different adapters or none side by side. It samples one token per request, finishes
those that hit EOS, a stop string or max_new_tokens, and returns them.

KV admission reserves a request's worst case (prompt + max_new_tokens - 1 tokens) up front, so a running request
never runs out of blocks and v0 needs no preemption; chunked prefill and preemption are later issues.

Timings: each step's time is measured around the whole step after admission (forward, sampling,
stop checks), its LoRA part around the LoRA ops (engine.timing), and both are split exactly among the
step's requests; `step_records` keeps each step's split for billing's conservation checks (drain it
with `pop_step_records`). Adapter loads and page-ins are measured apart and charged as adapter_load_us.
"""

from __future__ import annotations

import itertools
import secrets
import time
from pathlib import Path

import torch

from engine.adapter_pool import AdapterPool
from engine.api import AdapterError, AdapterInfo, EngineError, GenerationRequest, GenerationResult, RequestError, RequestTimings
from engine.config import EngineConfig
from engine.model import read_eos_ids
from engine.runner import BatchItem, ModelRunner
from engine.sampling import openai_logprob_entry, sample_tokens, token_logprobs
from engine.sequence import Sequence
from engine.timing import DeviceTimer, StepRecord, attribute_step
from engine.tokenizer import IncrementalDetokenizer, Tokenizer
from engine.validation import check_context, check_sampling, prompt_ids

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = _pick_device(config.device)
        auto_dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.dtype = auto_dtype if config.dtype == "auto" else _DTYPES[config.dtype]
        model_dir = Path(config.model_dir)
        self.tokenizer = Tokenizer(model_dir)
        self.eos_ids = read_eos_ids(model_dir)
        blocks_per_seq = -(-(config.max_prompt_tokens + config.max_new_tokens) // config.kv_block_size)
        self.runner = ModelRunner(
            model_dir,
            device=self.device,
            dtype=self.dtype,
            max_loras=config.max_loras,
            max_lora_rank=config.max_lora_rank,
            kv_num_blocks=config.kv_num_blocks or config.max_batch_size * blocks_per_seq,
            kv_block_size=config.kv_block_size,
        )
        self.adapters = AdapterPool(
            self.runner.lora, self.runner.config, max_lora_rank=config.max_lora_rank, max_adapter_bytes=config.max_adapter_bytes
        )
        self.step_records: list[StepRecord] = []
        self._waiting: list[Sequence] = []
        self._running: list[Sequence] = []
        self._unfinished: dict[str, Sequence] = {}  # request_id -> sequence, waiting or running
        self._done: list[GenerationResult] = []  # finished, not yet returned by step()
        self._order = itertools.count()
        self._step_ids = itertools.count()
        self._step_timer = DeviceTimer(self.device)

    # ---- adapters

    def load_adapter(self, key: str, path: Path) -> AdapterInfo:
        """Validate and load a PEFT adapter folder under `key`; the same content under a new key is shared."""
        return self.adapters.load(key, Path(path))

    def unload_adapter(self, key: str) -> None:
        users = [rid for rid, s in self._unfinished.items() if s.request.adapter == key]
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

    # ---- requests

    def add_request(self, req: GenerationRequest) -> None:
        """Queue a request; a request that fails validation comes back from the next step() with its error."""
        now = _now_us()
        arrival = req.arrival_us if req.arrival_us is not None else now
        try:
            seq = self._new_sequence(req, arrival)
        except RequestError as e:
            timings = RequestTimings(total_us=max(0, now - arrival))
            self._done.append(GenerationResult(request_id=req.request_id, adapter=req.adapter, error=e, timings=timings))
            return
        self._waiting.append(seq)
        self._unfinished[seq.request_id] = seq

    def abort(self, request_id: str) -> GenerationResult | None:
        """Stop an unfinished request now; returns its partial result (error code `aborted`), or None if unknown."""
        seq = self._unfinished.get(request_id)
        if seq is None:
            return None
        (self._waiting if seq in self._waiting else self._running).remove(seq)
        self._release(seq)
        seq.timings.total_us = _now_us() - seq.arrival_us
        seq.text = seq.text or self.tokenizer.decode(seq.output_ids)
        return seq.result(RequestError(f"request {request_id!r} was aborted", code="aborted"))

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running or self._done)

    def step(self) -> list[GenerationResult]:
        """Run one engine step; return the requests that finished in it (and failed validations)."""
        self._step_timer.reset()
        self.runner.lora.timer.reset()
        # Admission runs outside the measured step: the adapter copies it may do are charged to the
        # requests that needed them (adapter_load_us), so counting them in the step too would bill them twice.
        self._admit(_now_us())
        batch = list(self._running)
        items = [BatchItem(s.request_id, s.next_tokens(), s.num_computed, s.lora_slot) for s in batch]
        if batch:
            with self._step_timer.section():
                self._run(batch, items)
        end_us = _now_us()
        if batch:
            total_us = self._step_timer.elapsed_us()
            lora_us = min(self.runner.lora.timer.elapsed_us(), total_us)  # CUDA event rounding may overshoot by 1 us
            rows = [(s.request_id, len(it.token_ids), it.lora_slot >= 0) for s, it in zip(batch, items)]
            record = attribute_step(next(self._step_ids), total_us, lora_us, rows)
            self.step_records.append(record)
            for seq, share in zip(batch, record.shares):
                t = seq.timings
                t.base_us += share.base_us
                t.lora_us += share.lora_us
                t.steps += 1
                if len(seq.output_ids) == 1:
                    t.ttft_us = end_us - seq.arrival_us
            for seq in batch:
                if seq.finish_reason is not None:
                    seq.timings.total_us = end_us - seq.arrival_us
                    self._done.append(seq.result())
        done, self._done = self._done, []
        return done

    def generate(self, reqs: list[GenerationRequest]) -> list[GenerationResult]:
        """Run `reqs` to completion; results in input order. Other requests' results stay for step()."""
        results: list[GenerationResult | None] = [None] * len(reqs)
        slot_of: dict[str, int] = {}
        for i, req in enumerate(reqs):
            if req.request_id in slot_of or req.request_id in self._unfinished:
                # Caught here rather than by add_request: two results of one id could not be told apart.
                results[i] = GenerationResult(request_id=req.request_id, adapter=req.adapter, error=_duplicate(req.request_id))
                continue
            slot_of[req.request_id] = i
            self.add_request(req)
        others: list[GenerationResult] = []
        try:
            while slot_of:
                for res in self.step():
                    i = slot_of.pop(res.request_id, None)
                    if i is None:
                        others.append(res)
                    else:
                        results[i] = res
        finally:
            for rid in slot_of:  # only after an exception: leave no half-run request behind
                self.abort(rid)
            self._done = others + self._done
        return results  # type: ignore[return-value]

    def pop_step_records(self) -> list[StepRecord]:
        records, self.step_records = self.step_records, []
        return records

    # ---- internals

    def _new_sequence(self, req: GenerationRequest, arrival: int) -> Sequence:
        if req.request_id in self._unfinished:
            raise _duplicate(req.request_id)
        sha = None
        if req.adapter is not None:
            if not self.adapters.has(req.adapter):
                raise RequestError(f"adapter {req.adapter!r} is not loaded; load it with load_adapter first", code="unknown_adapter")
            sha = self.adapters.sha_of(req.adapter)
        ids = prompt_ids(req, self.tokenizer, self.config, vocab_size=self.runner.config.vocab_size)
        check_sampling(req.sampling, self.config)
        check_context(len(ids), req.sampling, self.runner.config.max_position_embeddings)
        generator = None
        if req.sampling.temperature > 0:
            seed = req.sampling.seed if req.sampling.seed is not None else secrets.randbits(63)
            generator = torch.Generator(device=self.device).manual_seed(seed)
        return Sequence(
            request=req,
            order=next(self._order),
            prompt_ids=ids,
            arrival_us=arrival,
            adapter_sha=sha,
            detok=IncrementalDetokenizer(self.tokenizer),
            generator=generator,
            logprobs=[] if req.sampling.logprobs is not None else None,
        )

    def _admit(self, now_us: int) -> None:
        blocks = self.runner.blocks
        # Blocks the running requests may still take, at worst: reserved so they never run short.
        reserved = sum(
            blocks.blocks_for(s.max_kv_tokens) - (len(blocks.block_table(s.request_id)) if s.request_id in blocks else 0)
            for s in self._running
        )
        for seq in sorted(self._waiting, key=lambda s: (-s.request.priority, s.order)):
            if len(self._running) >= self.config.max_batch_size:
                break
            need = blocks.blocks_for(seq.max_kv_tokens)
            if need > blocks.num_free - reserved:
                break  # wait for blocks in order, so a long request is not passed over for ever
            if seq.adapter_sha is not None:
                got = self.adapters.acquire(seq.adapter_sha)
                if got is None:
                    continue  # every slot is pinned by running requests; others may still fit
                seq.lora_slot, seq.timings.adapter_load_us = got
            reserved += need
            seq.timings.queue_us = max(0, now_us - seq.arrival_us)
            self._waiting.remove(seq)
            self._running.append(seq)

    def _run(self, batch: list[Sequence], items: list[BatchItem]) -> None:
        logits = self.runner.forward(items)  # [B, V] fp32
        params = [s.request.sampling for s in batch]
        chosen = sample_tokens(logits, params, [s.generator for s in batch])
        want = [i for i, s in enumerate(batch) if s.logprobs is not None]
        if want:
            lps = token_logprobs(logits[want], [chosen[i] for i in want], [params[i].logprobs for i in want])
            for i, lp in zip(want, lps):
                batch[i].logprobs.append(openai_logprob_entry(lp, self.tokenizer.token_bytes))
        for seq, it, token in zip(batch, items, chosen):
            if seq.num_computed == 0:
                seq.timings.prefill_tokens += len(it.token_ids)
            else:
                seq.timings.decode_tokens += len(it.token_ids)  # tokens fed back, one per decode step
            seq.num_computed += len(it.token_ids)
            seq.append_token(token, self.eos_ids)
            if seq.finish_reason is not None:
                self._running.remove(seq)
                self._release(seq)

    def _release(self, seq: Sequence) -> None:
        del self._unfinished[seq.request_id]
        self.runner.free(seq.request_id)
        if seq.lora_slot >= 0:
            self.adapters.release(seq.adapter_sha)
            seq.lora_slot = -1


def _pick_device(choice: str) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise EngineError("engine.device='cuda' but no CUDA GPU is visible; set engine.device to 'cpu' or 'auto'", code="no_gpu")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _duplicate(request_id: str) -> RequestError:
    return RequestError(f"request_id {request_id!r} is already in flight; use unique ids", code="duplicate_request_id")


def _now_us() -> int:
    return time.monotonic_ns() // 1000
