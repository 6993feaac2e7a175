"""Choosing the next token of each row, and the log-probabilities reported for it.

Order of the filters, as in HF's generate and vLLM: temperature, then top-k, then top-p (nucleus),
then one draw. A temperature at or below TEMPERATURE_FLOOR is greedy (argmax, first index on ties, as
torch and HF break them): dividing logits by so small a temperature puts all the mass on the argmax
anyway, and below it the division overflows (1e-300 in fp32 is 0).

Numerical safety, for every value engine.validation accepts: the row is shifted by its maximum before
the division, so the scaled logits are <= 0 with at least one 0 and the softmax is never 0/0 whatever
the temperature; top_p is compared in the probabilities' dtype (fp32, where 1e-300 is 0), so the most
likely token is always kept explicitly; a top_k at or past the vocabulary is no cut. A row whose logits
are unusable (any NaN or +inf, or nothing finite: a model that produced garbage) is found by
`usable_rows`; it is sanitised before any draw so that no NaN or inf ever reaches torch.multinomial, and
the engine fails that row's request alone (code `sampling_failed`). Seeds are folded into the range
torch.Generator.manual_seed takes (`generator_seed`), and on the CPU into the 32 bits its generator keeps
(`seeded_generator`).

Reproducibility: every sampled request draws from its own torch.Generator, seeded by the request's
seed, and takes exactly one draw per token. A request's tokens thus depend on its seed and its own
logits only, not on which other requests share the batch or in what order.

Logprobs are taken from the raw logits (before temperature and filters), as OpenAI reports them: the
chosen token's log-probability plus the `n` most likely tokens, in the chat-completions shape
`{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}]}`.
A token of probability 0 (logit -inf) is reported as MIN_LOGPROB, OpenAI's value for it, since JSON
has no -Infinity.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.api import SamplingParams

TEMPERATURE_FLOOR = 1e-5  # temperature <= this is greedy; 1 / 1e-5 scales a logit gap of 1e-3 to 100 nats already
MIN_LOGPROB = -9999.0  # what OpenAI reports for a token of (numerically) zero probability
_SEED_RANGE = 2**64  # torch.Generator.manual_seed takes [-2**63, 2**64); seeds are folded into [0, 2**64)


def is_greedy(p: SamplingParams) -> bool:
    return p.temperature <= TEMPERATURE_FLOOR


def generator_seed(seed: int) -> int:
    """`seed` folded into manual_seed's range: the identity on the job contract's [0, 2**63 - 1]."""
    return seed % _SEED_RANGE


def seeded_generator(seed: int, device: torch.device) -> torch.Generator:
    """A generator of its own for one request. The CPU's (mt19937) is seeded with 32 bits: given a 64-bit seed, torch
    keeps its low half, so seeds 5 and 5 + 2**32 drew the same tokens. There the high half is mixed in (`_fold32`): a
    seed below 2**32 seeds it as itself, as before. A GPU's Philox generator takes all 64 bits as they are."""
    folded = generator_seed(seed)
    if torch.device(device).type == "cpu":
        folded = _fold32(folded)
    return torch.Generator(device=device).manual_seed(folded)


def _fold32(seed: int) -> int:
    """A 64-bit seed in 32 bits: the low half plus a bijective mix (murmur3's fmix32, which maps 0 to 0) of the high.
    Seeds of one high half never collide; seeds of different ones only as random 32-bit values do."""
    h = seed >> 32
    h = ((h ^ (h >> 16)) * 0x85EBCA6B) & 0xFFFFFFFF
    h = ((h ^ (h >> 13)) * 0xC2B2AE35) & 0xFFFFFFFF
    return ((seed & 0xFFFFFFFF) + (h ^ (h >> 16))) & 0xFFFFFFFF


def usable_rows(logits: torch.Tensor) -> torch.Tensor:  # [M] bool on the logits' device
    """Whether each row [M, V] can be sampled from: no NaN, no +inf, at least one finite logit. That is a finite row
    maximum (amax propagates NaN; +inf is the maximum if present; a row of -inf has -inf): two kernels a decode step
    rather than eight."""
    return torch.isfinite(logits.amax(dim=-1))


def sample_tokens(
    logits: torch.Tensor,  # [M, V] fp32, one row per request
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],  # one per row; None only for greedy rows
) -> list[int]:
    """The next token of every row (a valid token id even for an unusable row: check `usable_rows`)."""
    return sample_on_device(logits, params, generators).tolist()


def sample_on_device(
    logits: torch.Tensor,  # [M, V] fp32, one row per request
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:  # [M] int64 on the logits' device
    """The next token of every row, left on the device: nothing here waits for it (a decode chain feeds it to the
    next step, engine.cuda_graphs)."""
    m = logits.shape[0]
    assert len(params) == len(generators) == m, (len(params), len(generators), m)
    chosen = logits.argmax(dim=-1)  # [M]; stays for greedy rows (a NaN row gives some valid id, failed by the engine)
    for i, p in enumerate(params):
        if not is_greedy(p):
            g = generators[i]
            assert g is not None, f"row {i} samples with temperature {p.temperature} but has no generator"
            probs = filtered_probs(logits[i], p)  # [V]
            chosen[i] = torch.multinomial(probs, 1, generator=g)[0]
    return chosen


def filtered_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Probabilities [V] of one row after temperature, top-k and top-p; finite, summing to 1, at least one token kept.

    Computed on the device without a host sync. An unusable row (`usable_rows`) still gives a distribution: NaN
    counts as -inf, +inf as the largest float, and a row with nothing finite left as all zeros (uniform)."""
    assert not is_greedy(p), p
    clean = torch.nan_to_num(row.float(), nan=float("-inf"), posinf=torch.finfo(torch.float32).max)  # [V]
    top = clean.max()
    # Shifted by the max: every scaled logit is <= 0 and the max is exactly 0, so softmax's sum is >= 1.
    scaled = torch.where(top > float("-inf"), clean - top, torch.zeros_like(clean)) / p.temperature  # [V]
    if 0 < p.top_k < scaled.numel():
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)  # [V]
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)  # [V] each
        # Drop a token when the more likely tokens before it already reach top_p; the first always stays (explicitly:
        # a top_p under fp32's smallest subnormal, e.g. 1e-300, compares as 0 and would drop it too).
        drop_sorted = (sorted_probs.cumsum(0) - sorted_probs) >= p.top_p  # [V]
        drop_sorted[0] = False
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum()
    return probs


@dataclass(frozen=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


def token_logprobs(
    logits: torch.Tensor,  # [M, V] fp32, raw
    chosen: Sequence[int],  # [M]
    top_n: Sequence[int],  # [M] how many top entries each row wants (0: the chosen token's only)
) -> list[TokenLogprobs]:
    """Log-probabilities of the chosen tokens and each row's top_n, from log_softmax of the raw logits (usable rows)."""
    assert logits.shape[0] == len(chosen) == len(top_n), (logits.shape, len(chosen), len(top_n))
    logp = torch.log_softmax(logits, dim=-1).clamp(min=MIN_LOGPROB)  # [M, V]
    k = min(max(top_n, default=0), logp.shape[1])
    top_vals, top_ids = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())  # [M, k] each
    picked = logp.gather(1, torch.tensor(chosen, device=logp.device)[:, None])[:, 0].tolist()  # [M]
    top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    return [
        TokenLogprobs(t, lp, tuple(zip(ids[:n], vals[:n])))
        for t, lp, ids, vals, n in zip(chosen, picked, top_ids, top_vals, top_n)
    ]


def openai_logprob_entry(lp: TokenLogprobs, token_bytes: Callable[[int], bytes]) -> dict:
    """One element of OpenAI's `logprobs.content` list."""

    def item(token_id: int, logprob: float) -> dict:
        raw = token_bytes(token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

    return {**item(lp.token_id, lp.logprob), "top_logprobs": [item(t, v) for t, v in lp.top]}
