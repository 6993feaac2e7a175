"""Checking one request against the engine's limits and turning its input into prompt token ids.

Every failure is a RequestError with a stable code, so that one bad request becomes one failed result
and never fails its batch. The engine checks the adapter, then the prompt, then the sampling limits,
then that both fit the model's positions: a request with several faults reports the first of these. Sampling
parameters are checked for type and finiteness only (a seed may be any int, a top_k any size): engine.sampling is
numerically safe for every value let through. Codes: invalid_request, empty_prompt, invalid_input_ids, prompt_too_long,
max_new_tokens_too_large, invalid_sampling_params, invalid_messages, no_chat_template.
"""

from __future__ import annotations

import math

from engine.api import GenerationRequest, RequestError, SamplingParams
from engine.config import EngineConfig
from engine.tokenizer import Tokenizer

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs


def check_sampling(sp: SamplingParams, config: EngineConfig) -> None:
    def bad(what: str) -> RequestError:
        return RequestError(f"sampling: {what}", code="invalid_sampling_params")

    if not _is_int(sp.max_new_tokens) or sp.max_new_tokens < 1:
        raise bad(f"max_new_tokens={sp.max_new_tokens!r}; ask for at least 1 token")
    if sp.max_new_tokens > config.max_new_tokens:
        raise RequestError(
            f"max_new_tokens={sp.max_new_tokens} is over this engine's limit of {config.max_new_tokens} "
            f"(engine.max_new_tokens); send 1..{config.max_new_tokens}",
            code="max_new_tokens_too_large",
        )
    if not (_is_finite_real(sp.temperature) and sp.temperature >= 0):
        raise bad(f"temperature={sp.temperature!r}; use 0 (greedy) or a finite positive number")
    if not (_is_finite_real(sp.top_p) and 0 < sp.top_p <= 1):
        raise bad(f"top_p={sp.top_p!r}; use a finite number in (0, 1]")
    if not _is_int(sp.top_k) or sp.top_k < 0:
        raise bad(f"top_k={sp.top_k!r}; use 0 (no cut) or a positive integer")
    if sp.logprobs is not None and not (_is_int(sp.logprobs) and 0 <= sp.logprobs <= MAX_TOP_LOGPROBS):
        raise bad(f"logprobs={sp.logprobs!r}; use None or 0..{MAX_TOP_LOGPROBS} top log-probabilities")
    if sp.seed is not None and not _is_int(sp.seed):
        raise bad(f"seed={sp.seed!r}; use an integer")
    if not isinstance(sp.stop, tuple) or any(not isinstance(s, str) or not s for s in sp.stop):
        raise bad(f"stop={sp.stop!r}; use a tuple of non-empty strings")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_finite_real(x: object) -> bool:
    """An int or float that is finite as a float (10**400 is not: it overflows float())."""
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return False
    try:
        return math.isfinite(float(x))
    except OverflowError:
        return False


def prompt_ids(req: GenerationRequest, tokenizer: Tokenizer, config: EngineConfig, *, vocab_size: int) -> list[int]:
    """The request's prompt as token ids, checked for emptiness, vocabulary and length."""
    given = [name for name in ("prompt", "messages", "input_ids") if getattr(req, name) is not None]
    if len(given) != 1:
        raise RequestError(f"give exactly one of prompt, messages, input_ids; got {given or 'none'}", code="invalid_request")
    if req.prompt is not None:
        if not isinstance(req.prompt, str):
            raise RequestError(f"prompt must be a string, got {type(req.prompt).__name__}", code="invalid_request")
        if not req.prompt:
            raise RequestError("prompt is empty; send some text", code="empty_prompt")
        check_whole_text(req.prompt, "prompt")
        check_text_bound(req.prompt, "prompt is", tokenizer, config)
        ids = tokenizer.encode(req.prompt)
    elif req.messages is not None:
        if not req.messages:
            raise RequestError("messages is empty; send at least one message", code="empty_prompt")
        for i, m in enumerate(req.messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise RequestError(f"messages[{i}] must be {{'role': str, 'content': str}}, got {m!r}", code="invalid_messages")
            check_whole_text(m["content"], f"messages[{i}].content")
        text = tokenizer.apply_chat_template(req.messages)  # what encode_chat encodes: the template's text, not guessed
        check_text_bound(text, "messages render to", tokenizer, config)
        ids = tokenizer.encode(text, add_special_tokens=False)
    else:
        ids = list(req.input_ids)
        if not ids:
            raise RequestError("input_ids is empty; send at least one token", code="empty_prompt")
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
        if bad:
            raise RequestError(
                f"input_ids holds {len(bad)} ids outside the vocabulary [0, {vocab_size}), e.g. {bad[0]!r}; "
                "tokenize with this model's tokenizer",
                code="invalid_input_ids",
            )
    if not ids:  # a sequence of no tokens has nothing for its first step to compute (nor to split that step's time over)
        raise RequestError("prompt encodes to no tokens with this model's tokenizer; send text that does" if req.prompt is not None
                           else "messages render to no tokens with this model's chat template (it writes out none of them); "
                           "send messages of the roles it renders, with content", code="empty_prompt")  # fmt: skip
    if len(ids) > config.max_prompt_tokens:
        raise RequestError(
            f"prompt is {len(ids)} tokens, over engine.max_prompt_tokens={config.max_prompt_tokens}; shorten it",
            code="prompt_too_long",
        )
    return ids


def check_whole_text(text: str, what: str) -> None:
    """Refuse text that UTF-8 cannot carry (a lone UTF-16 surrogate, '\\ud800'): the tokenizer raised TypeError on it,
    and the request failed as admission_failed with a traceback logged instead of naming what to fix."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(f"{what} holds a lone UTF-16 surrogate (\\u{ord(text[e.start]):04x}) at character {e.start}, "
                           "which is not text; send the whole character or leave it out", code="invalid_request") from None


def check_text_bound(text: str, what: str, tokenizer: Tokenizer, config: EngineConfig) -> None:
    """Refuse a text that certainly encodes to more than engine.max_prompt_tokens tokens, without encoding it.

    Encoding runs on the engine's thread (in its process), about 1 s a megabyte: a tenant's prompts of a few MB each,
    encoded only to be refused, stalled every other tenant's requests. No token covers more than
    `tokenizer.max_token_bytes` = L bytes of text, so B bytes are at least ceil(B / L) tokens (the post-processor's
    BOS only adds): over the limit is refused here exactly as after encoding; a text that may fit is encoded and judged
    by its real count. No bound (None): every text is encoded."""
    per_token, limit = tokenizer.max_token_bytes, config.max_prompt_tokens
    if per_token is None or len(text) * 4 <= limit * per_token:  # a character is 1..4 bytes: it fits the bound
        return
    size = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
    at_least = -(-size // per_token)
    if at_least > limit:
        raise RequestError(
            f"{what} at least {at_least} tokens ({size} bytes of text, at most {per_token} bytes a token with this model's "
            f"tokenizer), over engine.max_prompt_tokens={limit}; shorten it",
            code="prompt_too_long",
        )


def check_context(prompt_len: int, sp: SamplingParams, max_positions: int) -> None:
    """The prompt and every token asked for must fit the model's positions (after check_sampling)."""
    if prompt_len + sp.max_new_tokens > max_positions:
        raise RequestError(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({sp.max_new_tokens}) is over the model's "
            f"{max_positions} positions; shorten the prompt or ask for fewer tokens",
            code="prompt_too_long",
        )
