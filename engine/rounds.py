"""Decode rounds: several decode steps replayed back to back as CUDA graphs, read back by a later step().

When every running request decodes and none wants logprobs, a step runs up to `decode_steps` graph replays back to
back (`launch_round`), each fed the tokens the one before sampled, without the host reading them; the next step()
launches the following round from the last one's tokens on the device (`plan_next_round`) and only then reads the last
one back and books it (`book_round`), so that host work overlaps the GPU instead of idling it (llama-1b, batch 32: 2.11
-> 1.34 ms per decode step, engine/PERF.md; a round of one step costs what a step of a longer one does, 1.00-1.01x on
the H100 in session 18). Results thus come back one step() call later. While a waiting request could be admitted, a
round is of one step (so is every round with `decode_steps` 1), and the next is launched only while the planner would
admit none of them (their adapters' store reads, the admission hold: engine.planner `admits_none`), of as many steps
as the host's last cycle took (engine.engine `_held_steps`); a waiting request that could be admitted, a request
reaching its max_new_tokens, or one found finished ends the run of rounds, and the next step() schedules afresh
(engine.engine).

A sequence that finishes at step j of a round (EOS, stop string) still has a row in the steps after j, and
in the round launched before it was read: those rows' time is charged to it, as the lookahead computed it on
its behalf, and their tokens are dropped. So has one that fails at step j (unusable logits, read back as -1).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.isolation import unusable_logits
from engine.planner import Plan
from engine.requests import monotonic_us
from engine.runner import BatchItem, ModelRunner
from engine.sampling import sample_on_device, usable_rows
from engine.sequence import Sequence
from engine.timing import DeviceTimer


@dataclass
class Round:
    """Decode steps launched back to back (`launch_round`), read back by a later step()."""

    seqs: list[Sequence]
    steps: int
    last_ids: torch.Tensor  # [M] the last step's sampled tokens, on the device: the next round's first input
    tokens: torch.Tensor  # [steps, M] int64, pinned host memory, filled by an async copy
    done: torch.cuda.Event | None  # recorded after that copy (None on CPU, where it is synchronous)
    timers: list[DeviceTimer]  # one per step
    lora_us: int  # the calibrated LoRA share of one step (engine.cuda_graphs "Timing")


def chain_length(plan: Plan, items: list[BatchItem], runner: ModelRunner, decode_steps: int, *, whole_batch: bool) -> int:
    """Decode steps the round of `plan` runs back to back (engine.config `decode_steps`, engine.cuda_graphs
    "Chains"), 0 when the step runs eagerly instead. A round (of one step or more) only when `whole_batch` (every
    running request is in the step; the engine passes `decode_steps` 1 while a waiting request could be admitted),
    nothing was preempted, every item decodes one token and samples, none wants logprobs, the graphs fit, and every sequence's
    blocks grow to cover the steps (taken here). Capped at the fewest tokens any request has left, so no request
    computes past its max_new_tokens. A round of one step still pays off: the next one is launched before it is read
    back, so its host work overlaps the GPU as a longer round's does."""
    if not whole_batch or plan.preempted:
        return 0  # (a running request left out of this step by the token budget must not wait for a whole run)
    if not all(it.samples and len(it.tokens) == 1 and it.seq.logprobs is None for it in plan.items):
        return 0
    steps = min(decode_steps, *(tokens_left(it.seq) for it in plan.items))
    return steps if steps >= 1 and reserve_round(runner, items, steps) else 0


def plan_next_round(rnd: Round, runner: ModelRunner, decode_steps: int) -> tuple[list[BatchItem], int] | None:
    """The items and steps of the round after `rnd`, to launch before `rnd` is read back, their blocks grown; None
    when a request of `rnd` had finished before it, reaches its max_new_tokens in it, or when blocks or graphs do
    not allow it. Sequences that stop in `rnd` by EOS or a stop string are found only when it is read: they keep
    their row in the next round, charged to them and dropped (module docstring)."""
    if any(s.finish_reason is not None or s.error is not None for s in rnd.seqs):
        return None  # (a sequence that finished in the round before this one: not carried any further)
    steps = min(decode_steps, *(tokens_left(s) - rnd.steps for s in rnd.seqs))
    items = [BatchItem(s.seq_id, (0,), s.num_computed + rnd.steps, s.lora_slot, True) for s in rnd.seqs]
    if steps < 1 or not reserve_round(runner, items, steps):
        return None
    return items, steps


def reserve_round(runner: ModelRunner, items: list[BatchItem], steps: int) -> bool:
    """Whether `steps` decode steps of `items` can run as one graph chain, growing each sequence's blocks to cover
    them (blocks grown before a later sequence fails to grow stay its own, for its next tokens)."""
    if not runner.can_chain(items, steps):
        return False
    blocks = runner.blocks
    for it in items:
        total = it.context_len + steps
        if blocks.can_grow(it.seq_id, total) is not None:
            return False
        blocks.grow(it.seq_id, total)
    return True


def launch_round(runner: ModelRunner, seqs: list[Sequence], items: list[BatchItem], steps: int,
                 first_ids: torch.Tensor | None = None) -> Round:  # fmt: skip
    """Launch `steps` decode steps of `seqs` back to back (engine.cuda_graphs "Chains") and the copy of their
    tokens to pinned host memory; nothing waits for them here. `first_ids`: the first step's input tokens on the
    device (the last tokens of the round before), instead of the items' own. A row whose logits are unusable is
    fed a valid token on the device and read back as -1 (its request fails when the round is read)."""
    device = runner.device
    runner.prepare(items)
    params, generators = [s.request.sampling for s in seqs], [s.generator for s in seqs]
    timers = [DeviceTimer(device) for _ in range(steps)]
    usable: list[torch.Tensor] = []  # [M] bool per step

    def sample(logits: torch.Tensor) -> torch.Tensor:
        usable.append(usable_rows(logits))
        return sample_on_device(logits, params, generators)

    chosen = runner.decode_chain(items, steps, sample, lambda j: timers[j].section(), first_ids=first_ids)
    stacked = torch.where(torch.stack(usable), torch.stack(chosen), -1)  # [steps, M] on the device
    host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=device.type == "cuda")
    host.copy_(stacked, non_blocking=True)
    done = None
    if device.type == "cuda":
        done = torch.cuda.Event()
        done.record()
    return Round(seqs, steps, chosen[-1], host, done, timers, runner.lora_us())


def tokens_left(seq: Sequence) -> int:
    return seq.request.sampling.max_new_tokens - len(seq.output_ids)


def book_round(rnd: Round, book: Callable[..., None]) -> int:
    """Read a round's tokens back (the one wait) and book each of its steps as a step of its own, one StepRecord each
    (`book`: the engine's, engine.booking `StepBook.book`). A row computed past its sequence's end is charged to it
    and its token dropped; a row read back as -1 (unusable logits) fails its request. Returns the ns the host waited
    for the round's end."""
    waited = time.perf_counter_ns()
    if rnd.done is not None:
        rnd.done.synchronize()
    waited = time.perf_counter_ns() - waited
    tokens = rnd.tokens.tolist()  # [steps, M]
    end_us = monotonic_us()
    rows = [(s, 1, s.lora_slot >= 0) for s in rnd.seqs]  # (taken once: a request failing mid-round releases its slot)
    for j in range(rnd.steps):
        total_us = rnd.timers[j].elapsed_us()
        outcomes = [unusable_logits() if token < 0 else token for token in tokens[j]]
        book(rows, total_us, min(rnd.lora_us, total_us), end_us, outcomes)
    return waited
