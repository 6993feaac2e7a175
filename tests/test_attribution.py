"""The per-step split that bills (engine/timing.py): a step's shares sum to its measured time, to the microsecond.

The engine splits each step's measured time over its requests as it runs, and the ledger receives the
sums as plain records; this is the only copy of the split (billing holds none). Also here: the
marginal prefill cost the KV credit is measured with (PrefillCost).
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.timing import PrefillCost, RequestShare, StepRecord, apportion, attribute_step

Row = tuple[tuple[str, str], int, bool]  # ((tenant, request_id), tokens, has_lora)


def row(rid: str, tokens: int, lora: bool = False, tenant_id: str = "t") -> Row:
    return ((tenant_id, rid), tokens, lora)


@pytest.mark.parametrize(
    ("total_us", "lora_us", "rows", "expected"),
    [
        # 3 one-token requests share 100 us: 34 + 33 + 33, never 33 * 3 = 99; the tied remainder goes to the earlier row.
        (100, 0, [row("a", 1), row("b", 1), row("c", 1)], [(34, 0), (33, 0), (33, 0)]),
        # Ties by position, not by name: the same three rows in reverse order give the extra unit to "c".
        (100, 0, [row("c", 1), row("b", 1), row("a", 1)], [(34, 0), (33, 0), (33, 0)]),
        # base 900 us by tokens 1 : 2 : 1 over everyone; LoRA 300 us only over the adapter rows, 2 : 1.
        (1_200, 300, [row("base", 1), row("x", 2, True), row("y", 1, True)], [(225, 0), (450, 200), (225, 100)]),
        # A row with no token in the forward (a finished sequence's slot) takes nothing while others take it all.
        (10, 0, [row("a", 0), row("b", 3)], [(0, 0), (10, 0)]),
        (0, 0, [row("a", 0)], [(0, 0)]),  # a zero-token step with nothing measured attributes nothing
        (0, 0, [], []),  # the empty step
        # The same request id under two tenants is two requests.
        (9, 0, [row("r", 1, tenant_id="t0"), row("r", 2, tenant_id="t1")], [(3, 0), (6, 0)]),
    ],
)
def test_attribute_step_cases(total_us: int, lora_us: int, rows: list[Row], expected: list[tuple[int, int]]) -> None:
    """Base time by tokens over all rows, LoRA time by tokens over adapter rows, largest remainder with ties to the earlier row."""
    record = attribute_step(7, total_us, lora_us, rows)
    assert [(s.base_us, s.lora_us) for s in record.shares] == expected
    assert [((s.tenant_id, s.request_id), s.tokens, s.has_lora) for s in record.shares] == rows
    assert (record.step_id, record.total_us, record.base_us + record.lora_us) == (7, total_us, total_us)


@pytest.mark.parametrize(
    ("total_us", "lora_us", "rows", "message"),
    [
        (5, 0, [], "cannot split 5 over zero weights"),  # time measured for a step without requests
        (5, 0, [row("a", 0)], "cannot split 5 over zero weights"),  # time measured for a step without tokens
        (100, 10, [row("a", 1)], "LoRA time in a step without adapter tokens"),
        (10, 11, [row("a", 1, True)], r"\(11, 10\)"),  # more LoRA time than the step took
    ],
)
def test_impossible_steps_are_refused(total_us: int, lora_us: int, rows: list[Row], message: str) -> None:
    """Time nobody in the step can carry is a programming error: an assertion names the amounts."""
    with pytest.raises(AssertionError, match=message):
        attribute_step(0, total_us, lora_us, rows)


@pytest.mark.parametrize(
    ("total", "weights", "parts"),
    [
        (100_000, [1, 2], [33_333, 66_667]),
        (10, [1, 1, 1], [4, 3, 3]),  # remainder tie: the earlier entry
        (2, [1, 1, 1], [1, 1, 0]),
        (7, [5], [7]),
        (0, [1, 2], [0, 0]),
        (5, [0, 3], [0, 5]),
        (0, [0, 0], [0, 0]),
        (0, [], []),
    ],
)
def test_apportion_cases(total: int, weights: list[int], parts: list[int]) -> None:
    """Largest-remainder parts: proportional, whole units, ties to the earlier entry, and the empty and all-zero cases."""
    assert apportion(total, weights) == parts


_rows = st.lists(
    st.tuples(st.tuples(st.sampled_from(["t0", "t1"]), st.sampled_from("abcdefgh")), st.integers(0, 4_096), st.booleans()),
    min_size=1, max_size=8, unique_by=lambda r: r[0],
)


@st.composite
def steps(draw: st.DrawFn) -> tuple[int, int, list[Row]]:
    rows = draw(_rows)
    tokens = sum(t for _, t, _ in rows)
    total = draw(st.integers(0, 10**9)) if tokens else 0
    lora = draw(st.integers(0, total)) if any(t and lora for _, t, lora in rows) else 0
    return total, lora, rows


def _check(record: StepRecord, rows: list[Row]) -> None:
    shares: tuple[RequestShare, ...] = record.shares
    assert sum(s.base_us + s.lora_us for s in shares) == record.total_us == record.base_us + record.lora_us
    assert sum(s.lora_us for s in shares) == record.lora_us
    assert all(s.lora_us == 0 for s in shares if not s.has_lora)
    assert all(s.base_us == s.lora_us == 0 for s in shares if s.tokens == 0)
    for s in shares if record.tokens else ():  # each base share within one microsecond of its exact proportion
        assert abs(s.base_us * record.tokens - record.base_us * s.tokens) < record.tokens
    assert (record.tokens, record.lora_tokens) == (sum(t for _, t, _ in rows), sum(t for _, t, lora in rows if lora))


@given(st.lists(steps(), max_size=12))
def test_per_step_conservation(run: list[tuple[int, int, list[Row]]]) -> None:
    """Per-step conservation: each step's shares sum to its total_us exactly (LoRA shares to its lora_us, none to rows without an adapter or without tokens), and over many steps the per-request sums add up to the steps' sum."""
    totals: dict[tuple[str, str], int] = {}
    for i, (total, lora, rows) in enumerate(run):
        record = attribute_step(i, total, lora, rows)
        _check(record, rows)
        for s in record.shares:
            totals[(s.tenant_id, s.request_id)] = totals.get((s.tenant_id, s.request_id), 0) + s.base_us + s.lora_us
    assert sum(totals.values()) == sum(total for total, _, _ in run)


# ---- the marginal prefill cost -------------------------------------------------------------------------


def test_prefill_cost_is_the_slope_not_the_average() -> None:
    """Steps of 1 token at 900 us and 33 tokens at 1500 us: 600 / 32 = 18.75 us per token (the average would be 45)."""
    cost = PrefillCost(alpha=1e-12)  # (almost) no decay: the two steps weigh the same
    cost.update(1, 900)
    cost.update(33, 1_500)
    assert cost.value == pytest.approx(18.75, rel=1e-6)


def test_prefill_cost_has_no_value_until_a_slope_can_be_fitted() -> None:
    """One token count fits no slope, and its average carries the step's fixed cost: no value (no credit) until two have been seen."""
    cost = PrefillCost()
    assert cost.value is None
    for _ in range(50):
        cost.update(1, 46_000)  # a 46 ms one-token step
    assert cost.value is None
    cost.update(2, 46_010)
    assert cost.value is not None and 0 <= cost.value < 46_000 / 1.5


@pytest.mark.parametrize(
    ("steps", "expected"),
    [
        ([(1, 1_000), (10, 100)], 0.0),  # time falls with tokens: the slope is floored at 0
        ([(1, 0), (2, 1_000)], 1_000 / 3),  # the fit's fixed part is negative: the slope is capped at the average
    ],
)
def test_prefill_cost_is_bounded(steps: list[tuple[int, int]], expected: float) -> None:
    """The slope stays within 0 and the average time per token, whatever the fit."""
    cost = PrefillCost(alpha=1e-12)
    for tokens, us in steps:
        cost.update(tokens, us)
    assert cost.value == pytest.approx(expected, rel=1e-6, abs=1e-9)
