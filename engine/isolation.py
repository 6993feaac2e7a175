"""Failing one request alone: running a step's forward and sampling so that one request's fault spares the others.

The forward (`forward_isolated`): when a step's forward raises, the same items run again in halves, and failing
halves in halves again, down to single items: at most 2n - 1 forwards for n items, log2(n) deep. Running them
again in place is safe: an item's forward reads only its own KV and writes only its new tokens' slots (the same
values again), and the engine books nothing of a step before its forward returns. An item that fails alone fails
(`forward_failed`); the others take their step with the logits of the subset they ran in. If every item fails
alone too (a broken device, or a step of one request, where a culprit cannot be told from the engine), they all
fail with `engine_failed`, retriable.

Sampling (`sample_isolated`): the rows are drawn at once, and each row alone only after the batch raised (the rows
drawn before the fault then draw twice from their generator: reproducibility gives way to the request's survival).
A row whose logits are unusable (engine.sampling `usable_rows`) fails with `sampling_failed`, as does one whose
draw or logprobs raise.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from engine.api import EngineError, SamplingParams
from engine.runner import BatchItem
from engine.sampling import openai_logprob_entry, sample_on_device, token_logprobs, usable_rows

log = logging.getLogger("lorabatch.engine")


def forward_isolated(forward: Callable[[list[BatchItem]], torch.Tensor], items: list[BatchItem]) -> tuple[torch.Tensor, dict[int, EngineError]]:
    """`forward(items)`: logits [M', V] of the sampling items (`logits` set) that ran, in order, and the error of each
    item that did not, by index (module docstring)."""
    try:
        return forward(items), {}
    except Exception as e:
        log.warning("a forward of %d items raised %s: %s; running them in halves to find the culprit",
                    len(items), type(e).__name__, e, exc_info=True)  # fmt: skip
    rows: dict[int, torch.Tensor] = {}  # item index -> its logits [V]
    culprits: dict[int, Exception] = {}

    def probe(idx: list[int]) -> None:
        try:
            out = forward([items[i] for i in idx])  # [m, V]
        except Exception as e:
            if len(idx) == 1:
                culprits[idx[0]] = e
                return
            probe(idx[: len(idx) // 2])
            probe(idx[len(idx) // 2 :])
            return
        # A copy: a graphed forward returns a view of its static logits buffer (engine.cuda_graphs, engine.mixed_graphs),
        # which the next probe's forward overwrites.
        rows.update(zip([i for i in idx if items[i].logits], out.clone()))

    if len(items) > 1:
        probe(list(range(len(items) // 2)))
        probe(list(range(len(items) // 2, len(items))))
    if len(items) == 1 or len(culprits) == len(items):
        log.error("the forward raised for each of the %d items alone: failing them all with engine_failed", len(items))
        error = EngineError("the engine failed while running this request (the forward raised for every request of the step "
                            "alone); it was logged: retry", code="engine_failed", retriable=True)  # fmt: skip
        return torch.empty(0), dict.fromkeys(range(len(items)), error)
    failed = {i: EngineError(f"the forward raised {type(e).__name__} with this request alone in the batch ({e}); it was logged",
                             code="forward_failed") for i, e in culprits.items()}  # fmt: skip
    kept = [rows[i] for i, it in enumerate(items) if it.logits and i not in failed]
    return (torch.stack(kept) if kept else torch.empty(0)), failed


def sample_isolated(
    logits: torch.Tensor,  # [M, V] fp32, one row per request
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    token_bytes: Callable[[int], bytes],
) -> tuple[list[int], list[dict | None], dict[int, EngineError]]:
    """Each row's token (-1 where it failed), its OpenAI logprobs entry (None where not wanted or failed) and the
    error of each row that failed, by index (module docstring)."""
    m = len(params)
    errors: dict[int, EngineError] = {}
    try:
        chosen = draw(logits, params, generators)
    except Exception:
        log.exception("sampling %d rows raised; sampling each row alone", m)
        chosen = []
        for i in range(m):
            try:
                chosen += draw(logits[i : i + 1], params[i : i + 1], generators[i : i + 1])
            except Exception as e:
                chosen.append(-1)
                errors[i] = EngineError(f"sampling raised {type(e).__name__}: {e}; it was logged", code="sampling_failed")
    for i, token in enumerate(chosen):
        if token < 0 and i not in errors:
            errors[i] = unusable_logits()
    entries: list[dict | None] = [None] * m
    want = [i for i in range(m) if params[i].logprobs is not None and i not in errors]
    if want:
        try:
            entries_of(want, logits, chosen, params, token_bytes, entries)
        except Exception:
            log.exception("logprobs of %d rows raised; taking each row alone", len(want))
            for i in want:
                try:
                    entries_of([i], logits, chosen, params, token_bytes, entries)
                except Exception as e:
                    errors[i] = EngineError(f"logprobs raised {type(e).__name__}: {e}; it was logged", code="sampling_failed")
    for i in errors:
        chosen[i], entries[i] = -1, None
    return chosen, entries, errors


def entries_of(rows: list[int], logits: torch.Tensor, chosen: list[int], params: Sequence[SamplingParams],
               token_bytes: Callable[[int], bytes], out: list[dict | None]) -> None:  # fmt: skip
    """OpenAI logprobs entries of `rows`, into `out` (all of them or, if this raises, none)."""
    lps = token_logprobs(logits[rows], [chosen[i] for i in rows], [params[i].logprobs for i in rows])
    made = [openai_logprob_entry(lp, token_bytes) for lp in lps]
    for i, entry in zip(rows, made):
        out[i] = entry


def draw(logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]) -> list[int]:
    """Each row's token, or -1 for a row whose logits are unusable: one host sync."""
    chosen = sample_on_device(logits, params, generators)  # [M]
    return torch.where(usable_rows(logits), chosen, -1).tolist()


def unusable_logits() -> EngineError:
    return EngineError("the model's logits for this request hold NaN or +inf, or nothing finite: the request cannot be "
                       "sampled (a fault of the model or adapter weights, or of the kernels)", code="sampling_failed")  # fmt: skip
