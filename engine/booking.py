"""Booking a measured engine step: what it cost each request, what it computed, and who it finished.

Timings (for billing, DESIGN.md "Cost attribution"): each step's time is measured with CUDA events around the
forward and the sampling (the adapter loads started between them, which overlap the forward on CUDA, and a
decode bucket's one-time graph capture, are not part of it), its LoRA part around the LoRA ops in eager steps
and by the bucket's one-time calibration in graphed ones (engine.cuda_graphs, "Timing"), and both are split
exactly among the step's requests by tokens (engine.timing `attribute_step`). `records` keeps each step's
split for billing's conservation checks (the engine drains it with `pop_step_records`). Tokens a request
finds in the prefix cache are credited as kv_saved_us = cached tokens x the measured marginal cost of a
prefill token (`prefill_cost`, engine.timing.PrefillCost: a fit of prefill step time against tokens, fed by
the steps that hold prompt tokens alone). Tokens recomputed after a preemption are computed, and so
charged, like any others.

An eager step and each step of a decode round (engine.rounds) are booked alike, by `StepBook.book`.
"""

from __future__ import annotations

import itertools

from engine.api import EngineError
from engine.block_manager import BlockManager
from engine.requests import Requests
from engine.sequence import Sequence
from engine.timing import PrefillCost, StepRecord, attribute_step

# What became of a row's sampling: its token, the error that fails its request, or None (nothing sampled).
Outcome = int | EngineError | None


class StepBook:
    def __init__(self, blocks: BlockManager, requests: Requests):
        self._blocks, self._requests = blocks, requests
        self.records: list[StepRecord] = []
        self.prefill_cost = PrefillCost()  # measured us per prefill token (engine.timing)
        self.steps = 0
        # Steps that held prompt tokens, their device µs and those tokens (`Engine.stats`): how a load's prompts were
        # batched (many small prompt steps cost more than a few full ones).
        self.prompt_steps = self.prompt_step_us = self.prompt_tokens = 0
        self._ids = itertools.count()

    def book(self, rows: list[tuple[Sequence, int, bool]], total_us: int, lora_us: int, end_us: int, outcomes: list[Outcome],
             eos_ids: tuple[int, ...], failed: dict[int, EngineError] | None = None) -> None:  # fmt: skip
        """Book one measured step of `rows` ((sequence, tokens computed for it, whether with an adapter)): attribute
        its time among them (one StepRecord), add each share to its request's timings, count its prefill and decode
        tokens, commit its KV blocks; then end the rows: fail those of `failed` (their forward raised: charged and
        counted as a step, nothing computed), then take each row's outcome. A row of a sequence already finished or
        failed (a decode round's lookahead past its end, engine.rounds) is charged and nothing more. Only a step
        holding prompt tokens, every row of which ran, feeds the prefill cost fit (decode steps fit no prefill
        cost, and retried forwards would skew it)."""
        failed = failed or {}
        record = attribute_step(next(self._ids), total_us, lora_us, [(seq.key, n, lora) for seq, n, lora in rows])
        self.records.append(record)
        self.steps += 1
        prompt_tokens = 0
        for i, ((seq, n, _), share) in enumerate(zip(rows, record.shares)):
            t = seq.timings
            t.base_us += share.base_us
            t.lora_us += share.lora_us
            if seq.finish_reason is not None or seq.error is not None:
                continue  # computed past its end: charged, not kept
            t.steps += 1
            if i in failed:
                continue
            start = seq.num_computed
            in_prompt = max(0, min(start + n, len(seq.prompt_ids)) - start)
            t.prefill_tokens += in_prompt
            t.decode_tokens += n - in_prompt
            prompt_tokens += in_prompt
            seq.num_computed += n
            self._blocks.commit(seq.seq_id, seq.tokens, seq.num_computed)
        if prompt_tokens:
            self.prompt_steps += 1
            self.prompt_step_us += total_us
            self.prompt_tokens += prompt_tokens
        if prompt_tokens and not failed:
            self.prefill_cost.update(record.tokens, total_us)
        for i, error in failed.items():
            self._requests.fail(rows[i][0], error, end_us)
        for (seq, _, _), outcome in zip(rows, outcomes):
            if outcome is None or seq.finish_reason is not None or seq.error is not None:
                continue
            if isinstance(outcome, EngineError):
                self._requests.fail(seq, outcome, end_us)
            elif self._requests.take_token(seq, outcome, eos_ids, end_us) and seq.timings.ttft_us == 0:
                seq.timings.ttft_us = end_us - seq.arrival_us
