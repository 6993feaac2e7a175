"""The engine's requests from admission to result: who is unfinished, and the results not yet handed out.

Identity: a request is (tenant_id, request_id); two tenants may use one request_id at once, but one tenant's id
is unique among its unfinished requests (a second one fails with duplicate_request_id). Inside, each sequence
has its own id (`Sequence.seq_id`, its admission order) for KV blocks and batch rows.

Admission (`add`) validates the request (engine.validation) and builds its `Sequence`; a request that fails
that, or whose admission raises, becomes a failed result at once and never reaches the planner. A request
ends finished (`take_token` sees its stop), failed alone (`fail`) or aborted; each end releases its blocks and
adapter pin (through the planner) and leaves its result for the next step() to hand out (`pop_done`).
"""

from __future__ import annotations

import itertools
import logging
import secrets
import time

import torch

from engine.adapter_pool import AdapterPool
from engine.api import EngineError, GenerationRequest, GenerationResult, RequestError, RequestTimings
from engine.config import EngineConfig
from engine.model import ModelConfig
from engine.sampling import is_greedy, seeded_generator
from engine.planner import StepPlanner
from engine.sequence import Sequence
from engine.tokenizer import IncrementalDetokenizer, Tokenizer
from engine.validation import check_context, check_sampling, prompt_ids

log = logging.getLogger("lorabatch.engine")


class Requests:
    def __init__(self, config: EngineConfig, model: ModelConfig, tokenizer: Tokenizer, device: torch.device,
                 planner: StepPlanner, adapters: AdapterPool):  # fmt: skip
        self._config, self._model, self._tokenizer, self._device = config, model, tokenizer, device
        self._planner, self._adapters = planner, adapters
        self.unfinished: dict[tuple[str, str], Sequence] = {}  # (tenant_id, request_id) -> sequence, waiting or running
        self.done: list[GenerationResult] = []  # finished, not yet returned by step()
        self._order = itertools.count()

    def add(self, req: GenerationRequest) -> None:
        """Admit a request to the planner, or fail it into `done` (module docstring). Never raises for its content."""
        now = monotonic_us()
        arrival = req.arrival_us if isinstance(req.arrival_us, int) else now
        try:
            seq = self._new_sequence(req, arrival)
            if req.adapter_key is not None:
                self._adapters.note_request(req.adapter_key)
        except RequestError as e:
            self.done.append(failed_result(req, e, max(0, now - arrival)))
            return
        except Exception as e:  # a bug met by this request's content: it fails alone
            log.exception("admitting request %r of tenant %r raised", req.request_id, req.tenant_id)
            error = RequestError(f"admitting the request raised {type(e).__name__}: {e}; it was logged", code="admission_failed")
            self.done.append(failed_result(req, error, max(0, now - arrival)))
            return
        self._planner.add(seq)
        self.unfinished[seq.key] = seq

    def take_token(self, seq: Sequence, token: int, eos_ids: tuple[int, ...], end_us: int) -> bool:
        """Append a sampled token to `seq`, finishing it if it is done; False if that raised (and failed the request)."""
        try:
            seq.append_token(token, eos_ids)
        except Exception as e:
            log.exception("detokenizing token %d of request %r raised", token, seq.key)
            self.fail(seq, EngineError(f"detokenizing the output raised {type(e).__name__}: {e}; it was logged", code="decode_failed"), end_us)
            return False
        if seq.finish_reason is not None:
            self.end(seq, None, end_us)
        return True

    def fail(self, seq: Sequence, error: EngineError, now_us: int) -> None:
        """End an unfinished request with `error`, releasing its blocks and adapter pin."""
        log.warning("request %r failed alone with %s: %s", seq.key, error.code, error)
        seq.error = error
        self.end(seq, error, now_us)

    def end(self, seq: Sequence, error: EngineError | None, now_us: int, *, release: bool = True) -> None:
        """Release an unfinished request (`release` False: the planner has) and leave its result for the next step()."""
        if release:
            self._planner.remove(seq)
        del self.unfinished[seq.key]
        self.done.append(result(seq, error, now_us))

    def abort(self, key: tuple[str, str]) -> GenerationResult | None:
        """Stop the unfinished request `key` now; its partial result (error code `aborted`), or None if unknown."""
        seq = self.unfinished.pop(key, None)
        if seq is None:
            return None
        self._planner.remove(seq)
        try:
            seq.text = seq.text or self._tokenizer.decode(seq.output_ids)
        except Exception:
            log.exception("decoding the partial text of aborted request %r raised", seq.key)
        return result(seq, RequestError(f"request {key[1]!r} was aborted", code="aborted"))

    def abort_all(self, error: EngineError) -> list[GenerationResult]:
        """Fail every unfinished request with `error`; with the results not yet handed out, all of them."""
        out, self.done = self.done, []
        for key in list(self.unfinished):
            seq = self.unfinished.pop(key)
            try:
                self._planner.remove(seq)
            except Exception:
                log.exception("releasing request %r raised", key)
            out.append(result(seq, error))
        return out

    def pop_done(self) -> list[GenerationResult]:
        done, self.done = self.done, []
        return done

    def _new_sequence(self, req: GenerationRequest, arrival: int) -> Sequence:
        if (req.tenant_id, req.request_id) in self.unfinished:
            raise duplicate(req)
        if req.adapter_key is not None and not self._adapters.has(req.adapter_key):
            raise RequestError(
                f"adapter {req.adapter_key!r} is not registered; register it with register_adapter or load_adapter first",
                code="unknown_adapter",
            )
        ids = prompt_ids(req, self._tokenizer, self._config, vocab_size=self._model.vocab_size)
        check_sampling(req.sampling, self._config)
        check_context(len(ids), req.sampling, self._model.max_position_embeddings)
        generator = None
        if not is_greedy(req.sampling):
            seed = req.sampling.seed if req.sampling.seed is not None else secrets.randbits(63)
            generator = seeded_generator(seed, self._device)
        return Sequence(
            request=req,
            order=next(self._order),
            prompt_ids=ids,
            arrival_us=arrival,
            detok=IncrementalDetokenizer(self._tokenizer),
            generator=generator,
            adapter_key=req.adapter_key,
            logprobs=[] if req.sampling.logprobs is not None else None,
        )


def result(seq: Sequence, error: EngineError | None, now_us: int | None = None) -> GenerationResult:
    t = seq.timings
    t.total_us = max(0, (now_us if now_us is not None else monotonic_us()) - seq.arrival_us)
    t.adapter_load_us = sum(event.load_us() for event in seq.load_charges)
    return seq.result(error)


def failed_result(req: GenerationRequest, error: EngineError, total_us: int = 0) -> GenerationResult:
    """The result of a request that failed before it became a sequence."""
    return GenerationResult(request_id=req.request_id, adapter_key=req.adapter_key, tenant_id=req.tenant_id, error=error,
                            timings=RequestTimings(total_us=total_us))  # fmt: skip


def duplicate(req: GenerationRequest) -> RequestError:
    return RequestError(f"request_id {req.request_id!r} of tenant {req.tenant_id!r} is already in flight; use unique ids per tenant",
                        code="duplicate_request_id")  # fmt: skip


def monotonic_us() -> int:
    return time.monotonic_ns() // 1000

