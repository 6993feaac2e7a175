"""One request inside the engine: its tokens, how many of them are in the KV cache, when it stops, what it cost.

A sequence's known tokens are its prompt followed by what it has generated. Each step computes the
next slice of them that is not in the KV cache yet (`num_computed` onwards): the prompt, possibly in
chunks over several steps; then, once all are computed, the latest generated token (decode). Whenever
a step computes up to the last known token, its logits give the next token. A preempted sequence loses
its KV (`num_computed` back to 0, or to what the prefix cache still holds) and recomputes its prompt and
generated tokens the same way, then goes on generating as if nothing had happened.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.api import (
    EngineError,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    RequestTimings,
)
from engine.tokenizer import IncrementalDetokenizer


@dataclass(eq=False)  # identity: two sequences are never the same request
class Sequence:
    request: GenerationRequest
    order: int  # arrival order, the tie-break among equal priorities; unique per engine, so also the sequence's
    # internal id (`seq_id`) for KV blocks and batch rows: a request_id is unique only within its tenant
    prompt_ids: list[int]
    arrival_us: int  # monotonic
    detok: IncrementalDetokenizer
    generator: torch.Generator | None  # None for greedy requests
    adapter_key: str | None  # None: the base model (also after a base fallback)
    tokens: list[int] = field(default_factory=list)  # prompt + generated
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # leading tokens whose KV is in the cache
    adapter_sha: str | None = None  # known once the adapter is acquired
    lora_slot: int = -1
    kv_namespace: bytes | None = None
    scheduled_once: bool = False
    base_fallback: bool = False
    load_charges: list = field(default_factory=list)  # adapter loads this request is charged for (resolved at the end)
    text: str = ""
    finish_reason: FinishReason | None = None
    logprobs: list[dict] | None = None
    error: EngineError | None = None  # set when the request failed alone (engine.engine, "Isolation")
    timings: RequestTimings = field(default_factory=RequestTimings)

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.prompt_ids)

    @property
    def seq_id(self) -> int:
        return self.order

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def key(self) -> tuple[str, str]:
        """The request's identity, (tenant_id, request_id)."""
        return (self.request.tenant_id, self.request.request_id)

    @property
    def tenant_id(self) -> str:
        return self.request.tenant_id

    @property
    def priority(self) -> int:
        return self.request.priority

    @property
    def max_kv_tokens(self) -> int:
        """Tokens this sequence may write to the KV cache: the prompt and every output token but the last,
        which is never fed back."""
        return len(self.prompt_ids) + self.request.sampling.max_new_tokens - 1

    @property
    def num_uncomputed(self) -> int:
        return len(self.tokens) - self.num_computed

    def chunk(self, budget: int) -> tuple[int, ...]:
        """The next at most `budget` tokens to compute."""
        return tuple(self.tokens[self.num_computed : self.num_computed + budget])

    def append_token(self, token_id: int, eos_ids: tuple[int, ...]) -> None:
        """Take one sampled token and decide whether the sequence is finished (sets finish_reason, text)."""
        sp = self.request.sampling
        self.output_ids.append(token_id)
        self.tokens.append(token_id)
        if token_id in eos_ids and not sp.ignore_eos:
            self._finish("eos")
            return
        # Incremental text only to match stop strings (two tokenizer calls per token: ~7 µs, a quarter of a batch-32
        # step's host time); the final text is one decode at the end (_finish) either way.
        if sp.stop and (new := self.detok.push(token_id)):
            # A new match must end in the new text, so it starts at most len(stop) - 1 characters before it.
            text = self.detok.text
            start = max(0, len(text) - len(new) - max(len(s) for s in sp.stop) + 1)
            hits = [i for s in sp.stop if (i := text.find(s, start)) >= 0]
            if hits:
                self.text = text[: min(hits)]
                self.finish_reason = "stop"
                return
        if len(self.output_ids) >= sp.max_new_tokens:
            self._finish("length")

    def _finish(self, reason: FinishReason) -> None:
        self.finish_reason = reason
        ids = self.output_ids[:-1] if reason == "eos" else self.output_ids
        self.text = self.detok.tokenizer.decode(ids)

    def result(self, error: EngineError | None = None) -> GenerationResult:
        return GenerationResult(
            request_id=self.request_id,
            adapter_key=self.adapter_key,
            tenant_id=self.tenant_id,
            output_ids=list(self.output_ids),
            text=self.text,
            finish_reason=self.finish_reason,
            prompt_tokens=len(self.prompt_ids),
            logprobs={"content": self.logprobs} if self.logprobs is not None else None,
            timings=self.timings,
            error=error,
            base_fallback=self.base_fallback,
        )
