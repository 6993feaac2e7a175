"""Measuring a step's device time and splitting it among the step's requests, to the microsecond.

Clock, chosen once per device: on CPU the kernels run synchronously, so `time.perf_counter_ns` around
a section is its compute time; on CUDA launches are asynchronous, so a section records a pair of CUDA
events and the elapsed time is read once, after the step's results have synchronised the stream.

Split: DESIGN.md's cost model gives request r the share base_us(s) * tokens_r(s) / tokens(s) of step s,
and lora_us(s) * tokens_r(s) / lora_tokens(s) if it used an adapter. Rounding each share on its own
would lose or invent microseconds (3 requests of 1 token sharing 100 us: 33 + 33 + 33 = 99), so shares
are apportioned by largest remainder (Hamilton's method): they sum to the measured total exactly,
which is the ledger's conservation invariant.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


class DeviceTimer:
    """Accumulates the device time of any number of sections; `reset` between steps."""

    def __init__(self, device: torch.device):
        device = torch.device(device)
        self._cuda = device.type == "cuda"
        self._ns = 0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event, float]] = []  # (start, end, credit µs)
        # A 1b prefill with adapters records 100-130 events and waits for the host's launches: each torch.cuda.Event made
        # and each `record()` finding the current stream (torch.cuda.current_stream resolves the device in Python) cost
        # host time the GPU waits for. So events are kept and recorded again from step to step (`reset` hands them back:
        # by then the step's `elapsed_us` has waited for them), and the current stream object is reused while the
        # stream id the driver reports for the device stays the same.
        self._pool: list[torch.cuda.Event] = []
        self._used = 0
        self._index = (device.index if device.index is not None else torch.cuda.current_device()) if self._cuda else -1
        self._stream_key: tuple | None = None
        self._stream: torch.cuda.Stream | None = None

    def reset(self) -> None:
        self._ns = 0
        self._events.clear()
        self._used = 0

    def _record(self) -> torch.cuda.Event:
        """The next pooled event, recorded on the current stream."""
        if self._used == len(self._pool):
            self._pool.append(torch.cuda.Event(enable_timing=True))
        event = self._pool[self._used]
        self._used += 1
        key = torch._C._cuda_getCurrentStream(self._index)  # (stream id, device index, device type)
        if key != self._stream_key:
            self._stream_key, self._stream = key, torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
        event.record(self._stream)
        return event

    @contextmanager
    def section(self, credit_us: float = 0.0) -> Iterator[None]:
        """Time what runs inside. `credit_us`: time inside that is not this timer's to count (a fused launch doing
        other work too: engine.lora, "Attribution"); the section counts its measured time less that, and never
        less than zero."""
        start = self.begin()
        try:
            yield
        finally:
            self.end(start, credit_us)

    def begin(self) -> object:
        """Open a section that `end` closes: for one that spans calls no single `with` can wrap."""
        if self._cuda:
            return self._record()
        return time.perf_counter_ns()

    def end(self, start: object, credit_us: float = 0.0) -> None:
        """Close the section `begin` opened (see `section` for the credit)."""
        if self._cuda:
            self._events.append((start, self._record(), credit_us))
        else:
            self._ns += max(0, time.perf_counter_ns() - start - round(credit_us * 1000))

    def elapsed_us(self) -> int:
        """Total of the sections so far, in whole microseconds (waits for the last CUDA event)."""
        if not self._events:
            return self._ns // 1000
        self._events[-1][1].synchronize()
        return round(sum(max(0.0, s.elapsed_time(e) * 1000 - credit) for s, e, credit in self._events))


class Stopwatch:
    """The duration of one piece of work, possibly asynchronous on a CUDA stream, read later.

    On CPU it is the host time between start and stop. On CUDA it is the time between two events
    recorded on `stream` (the side stream of adapter copies), so the host need not wait for the copy
    to learn how long it took; `elapsed_us` waits for the end event only when asked before it is done.
    """

    def __init__(self, device: torch.device, stream: torch.cuda.Stream | None = None):
        self._stream = stream if torch.device(device).type == "cuda" else None
        self._t0 = time.perf_counter_ns()
        self._ns: int | None = None
        self._events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        if self._stream is not None:
            start = torch.cuda.Event(enable_timing=True)
            start.record(self._stream)
            self._events = (start, torch.cuda.Event(enable_timing=True))

    def stop(self) -> Stopwatch:
        if self._events is not None:
            self._events[1].record(self._stream)
        else:
            self._ns = time.perf_counter_ns() - self._t0
        return self

    @property
    def end_event(self) -> torch.cuda.Event | None:
        """The CUDA event recorded by `stop` (None on CPU): what a stream waits on to follow the timed work."""
        return None if self._events is None else self._events[1]

    def done(self) -> bool:
        return self._events is None or self._events[1].query()

    def elapsed_us(self) -> int:
        if self._events is None:
            assert self._ns is not None, "stop() first"
            return self._ns // 1000
        self._events[1].synchronize()
        return round(self._events[0].elapsed_time(self._events[1]) * 1000)


class PrefillCost:
    """The marginal device time of one more prefill token, in microseconds, fitted over recent prefill steps.

    A step costs a fixed part (launches, weights read once, sampling) plus a part per token; only the
    latter is what a cached token saves. So the cost per token is the slope of prefill step time against
    tokens: fed only by steps that hold prompt tokens (engine.booking; a decode step's time says nothing of
    what a prefill token costs, and decode rounds would outnumber and skew the prefill steps), fitted by
    least squares with weights decaying by (1 - alpha) per step (about the last 1 / alpha steps count).
    Example: prefill steps of 1 token at 900 us and of 33 tokens at 1500 us give 600 / 32 = 18.75 us per
    token, where the 33-token step's average, 45 us per token, would count the fixed part as saved too. The slope is capped at the weighted average cost per token (which it
    exceeds only if the fitted fixed part is negative) and floored at 0. There is no value (so no
    credit) until steps of two different token counts have been seen: one token count fits no slope,
    and its average carries the fixed part (a 46 ms one-token first step credited 846 ms on a request
    with cached tokens that way; billing caps the credit as well, billing/credit.py).
    """

    def __init__(self, alpha: float = 0.05):
        assert 0 < alpha <= 1, alpha
        self.alpha = alpha
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def update(self, tokens: int, us: int) -> None:
        assert tokens > 0, tokens
        keep = 1 - self.alpha
        self._w = keep * self._w + 1
        self._x = keep * self._x + tokens
        self._y = keep * self._y + us
        self._xx = keep * self._xx + tokens * tokens
        self._xy = keep * self._xy + tokens * us

    @property
    def value(self) -> float | None:
        """us per token, or None before steps of two different token counts (no slope to fit yet)."""
        if self._x == 0:
            return None
        var = self._w * self._xx - self._x * self._x
        if var <= 1e-9 * self._w * self._xx:
            return None
        slope = (self._w * self._xy - self._x * self._y) / var
        return min(max(slope, 0.0), self._y / self._x)


def apportion(total: int, weights: list[int]) -> list[int]:
    """Split integer `total` in proportion to non-negative integer `weights`; the parts sum to `total`.

    Largest remainder: each part gets floor(total * w / W), then the leftover units go one each to
    the largest remainders, ties to the earlier entry (deterministic).
    """
    assert total >= 0 and all(w >= 0 for w in weights), (total, weights)
    w_sum = sum(weights)
    if w_sum == 0:
        assert total == 0, f"cannot split {total} over zero weights"
        return [0] * len(weights)
    parts = [total * w // w_sum for w in weights]
    remainders = [total * w % w_sum for w in weights]
    leftover = total - sum(parts)
    for i in sorted(range(len(weights)), key=lambda i: (-remainders[i], i))[:leftover]:
        parts[i] += 1
    return parts


@dataclass(frozen=True)
class RequestShare:
    request_id: str
    tokens: int  # tokens of this request in the step's forward
    has_lora: bool
    base_us: int
    lora_us: int
    tenant_id: str = ""  # with request_id, the request's identity


@dataclass(frozen=True)
class StepRecord:
    """One engine step as measured and attributed; base_us + lora_us == total_us and the shares sum to each."""

    step_id: int
    total_us: int
    base_us: int
    lora_us: int
    tokens: int
    lora_tokens: int
    shares: tuple[RequestShare, ...]


def attribute_step(step_id: int, total_us: int, lora_us: int, rows: list[tuple[tuple[str, str], int, bool]]) -> StepRecord:
    """Split a step's measured time among its ((tenant_id, request_id), tokens, has_lora) rows."""
    assert 0 <= lora_us <= total_us, (lora_us, total_us)
    tokens = [t for _, t, _ in rows]
    lora_tokens = [t if has_lora else 0 for _, t, has_lora in rows]
    assert lora_us == 0 or sum(lora_tokens) > 0, f"{lora_us} us of LoRA time in a step without adapter tokens"
    base_us = total_us - lora_us
    base = apportion(base_us, tokens)
    lora = apportion(lora_us, lora_tokens)
    return StepRecord(
        step_id=step_id,
        total_us=total_us,
        base_us=base_us,
        lora_us=lora_us,
        tokens=sum(tokens),
        lora_tokens=sum(lora_tokens),
        shares=tuple(RequestShare(rid, t, h, b, lo, tenant_id) for ((tenant_id, rid), t, h), b, lo in zip(rows, base, lora)),
    )
