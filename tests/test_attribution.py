"""Per-step attribution over plain step records: the shares of a step sum to its measured time, to the microsecond."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from billing.attribution import RequestTime, Step, StepRequest, attribute_step, attribute_steps


@pytest.mark.parametrize(
    ("step", "expected"),
    [
        # 3 one-token requests share 100 us: 34 + 33 + 33, never 33 * 3 = 99.
        (Step(100, 0, (StepRequest("a", 1), StepRequest("b", 1), StepRequest("c", 1))), {"a": (34, 0), "b": (33, 0), "c": (33, 0)}),
        # base 900 us by tokens 1 : 2 : 1 over everyone; LoRA 300 us only over the adapter rows, 2 : 1.
        (Step(1_200, 300, (StepRequest("base", 1), StepRequest("x", 2, "x@1"), StepRequest("y", 1, "y@1"))),
         {"base": (225, 0), "x": (450, 200), "y": (225, 100)}),
        (Step(0, 0, (StepRequest("a", 0),)), {"a": (0, 0)}),  # nothing measured: nothing attributed
        (Step(5, 0, ()), None),  # time measured for a step without requests is a programming error
    ],
)
def test_attribute_step_cases(step: Step, expected: dict[str, tuple[int, int]] | None) -> None:
    """Base time by tokens over all requests, LoRA time by tokens over adapter requests, largest remainder; the empty step is refused."""
    if expected is None:
        with pytest.raises(AssertionError):
            attribute_step(step)
        return
    assert attribute_step(step) == {rid: RequestTime(*us) for rid, us in expected.items()}


def test_lora_time_without_adapter_tokens_is_refused() -> None:
    """LoRA time in a step with no adapter request cannot be attributed to anyone: an assertion says so."""
    with pytest.raises(AssertionError, match="LoRA time in a step without adapter tokens"):
        attribute_step(Step(100, 10, (StepRequest("a", 1),)))


_requests = st.lists(
    st.builds(StepRequest, request_id=st.sampled_from("abcdefgh"), tokens=st.integers(1, 4_096), adapter=st.sampled_from([None, "x@1", "y@2"])),
    min_size=1, max_size=8, unique_by=lambda r: r.request_id,
)


@st.composite
def steps(draw: st.DrawFn) -> Step:
    requests = tuple(draw(_requests))
    total = draw(st.integers(0, 10**9))
    lora = draw(st.integers(0, total)) if any(r.adapter for r in requests) else 0
    return Step(total, lora, requests)


@given(st.lists(steps(), min_size=0, max_size=12))
def test_per_step_conservation(run: list[Step]) -> None:
    """Per-step conservation: each step's base + LoRA shares sum to its total_us exactly, LoRA shares to its lora_us, and over many steps the per-request sums add up to the sum of the steps."""
    for step in run:
        shares = attribute_step(step)
        assert sum(s.base_us + s.lora_us for s in shares.values()) == step.total_us
        assert sum(s.lora_us for s in shares.values()) == step.lora_us
        assert all(s.lora_us == 0 for rid, s in shares.items() if next(r for r in step.requests if r.request_id == rid).adapter is None)
    totals = attribute_steps(run)
    assert sum(t.base_us + t.lora_us for t in totals.values()) == sum(s.total_us for s in run)
