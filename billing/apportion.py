"""Split an integer amount over parties in proportion to integer weights, losing nothing to rounding."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

K = TypeVar("K", bound=str)


def apportion(total: int, weights: Mapping[K, int]) -> dict[K, int]:
    """Integer shares of `total` in proportion to `weights`, summing to `total` exactly.

    Largest-remainder (Hamilton) method: each key gets floor(total * w / sum(w)); the units left over
    go one each to the largest remainders, ties to the smaller key, so every caller that apportions the
    same amount gets the same split. Example: 100_000 us over weights {a: 1, b: 2} is 33_333.3 / 66_666.7,
    floors 33_333 + 66_666 leave 1, which goes to b's larger remainder: {a: 33_333, b: 66_667}.
    """
    assert total >= 0, total
    assert all(w >= 0 for w in weights.values()), weights
    weight_sum = sum(weights.values())
    if not weights or total == 0:
        return dict.fromkeys(weights, 0)
    assert weight_sum > 0, f"cannot apportion {total} over all-zero weights {dict(weights)}"
    shares = {key: total * w // weight_sum for key, w in weights.items()}
    left = total - sum(shares.values())  # < len(weights): each floor lost less than one unit
    by_remainder = sorted(weights, key=lambda key: (-(total * weights[key] % weight_sum), key))
    for key in by_remainder[:left]:
        shares[key] += 1
    return shares
