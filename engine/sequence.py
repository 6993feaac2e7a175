"""One request inside the engine: its tokens, its text so far, when it stops, and what it cost."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.api import EngineError, FinishReason, GenerationRequest, GenerationResult, RequestTimings
from engine.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(eq=False)  # identity: two sequences are never the same request
class Sequence:
    request: GenerationRequest
    order: int  # admission order among equal priorities
    prompt_ids: list[int]
    arrival_us: int  # monotonic
    adapter_sha: str | None
    detok: IncrementalDetokenizer
    generator: torch.Generator | None  # None for greedy requests
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens in the KV cache
    lora_slot: int = -1
    text: str = ""
    finish_reason: FinishReason | None = None
    logprobs: list[dict] | None = None
    timings: RequestTimings = field(default_factory=RequestTimings)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def max_kv_tokens(self) -> int:
        """Tokens this sequence may write to the KV cache: the prompt and every output token but the last,
        which is never fed back."""
        return len(self.prompt_ids) + self.request.sampling.max_new_tokens - 1

    def next_tokens(self) -> tuple[int, ...]:
        """Tokens to feed in this step: the whole prompt at first, then the last sampled token."""
        if self.num_computed == 0:
            return tuple(self.prompt_ids)
        return (self.output_ids[-1],)

    def append_token(self, token_id: int, eos_ids: tuple[int, ...]) -> None:
        """Take one sampled token and decide whether the sequence is finished (sets finish_reason, text)."""
        sp = self.request.sampling
        self.output_ids.append(token_id)
        if token_id in eos_ids and not sp.ignore_eos:
            self._finish("eos")
            return
        new = self.detok.push(token_id)
        if sp.stop and new:
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
            adapter=self.request.adapter,
            output_ids=list(self.output_ids),
            text=self.text,
            finish_reason=self.finish_reason,
            prompt_tokens=len(self.prompt_ids),
            logprobs={"content": self.logprobs} if self.logprobs is not None else None,
            timings=self.timings,
            error=error,
        )
