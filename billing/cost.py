"""GPU time to money: the one place the price formula and the rounding live.

Times arrive as integer microseconds, so milliseconds with three places are exact and the only rounding
is the final one to nine places of currency (ROUND_HALF_EVEN, so that rounding over many rows has no
bias). Floats never take part.
"""

from __future__ import annotations

from decimal import ROUND_HALF_EVEN, Context, Decimal

US_PER_HOUR = 3_600_000_000
MONEY_PLACES = 9  # the ledger's money columns: Numeric(18, 9) prices, Numeric(38, 9) amounts
_MONEY_QUANTUM = Decimal(1).scaleb(-MONEY_PLACES)  # 0.000000001
_MS_QUANTUM = Decimal("0.001")
ZERO_COST = Decimal(0).quantize(_MONEY_QUANTUM)  # 0.000000000: a sum of costs starts here, keeping nine places
# 60 digits make the single division exact to far beyond the ninth place (a year of GPU time is ~3.2e13
# us); a context object of our own, not the thread's, so no caller's settings leak in or out.
_EXACT = Context(prec=60, rounding=ROUND_HALF_EVEN)


def gpu_cost(gpu_us: int, price_per_hour: Decimal) -> Decimal:
    """Cost of `gpu_us` microseconds of GPU time at `price_per_hour`, rounded to nine places.

    Multiplying before dividing keeps the product exact; the division then rounds only far beyond the
    ninth place, and the quantize is the one rounding that counts.
    """
    assert isinstance(gpu_us, int), gpu_us
    assert isinstance(price_per_hour, Decimal), f"price_per_hour must be a Decimal, got {price_per_hour!r}"
    return _EXACT.divide(_EXACT.multiply(Decimal(gpu_us), price_per_hour), US_PER_HOUR).quantize(_MONEY_QUANTUM, context=_EXACT)


def us_to_ms(us: int) -> Decimal:
    """Integer microseconds as milliseconds with exactly three places (exact, no rounding)."""
    assert isinstance(us, int), us
    return (Decimal(us) / 1000).quantize(_MS_QUANTUM)
