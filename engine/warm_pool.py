"""Predicting each adapter's next-hour traffic, for the warm pool that loads adapters ahead of requests.

Seed 003's predictor: an EWMA of recent traffic plus an hour-of-day profile, blended. Here both are in
requests per hour, so the blend is itself a forecast of requests in the coming hour:

    recent   = EWMA over whole hours of the hourly request count (weight `alpha` on the newest hour),
               with the hour in progress counted as if it were complete (a lower bound)
    profile  = mean count of the coming hour's hour-of-day over the past days since the adapter was
               first seen (hours of no traffic count as 0)
    forecast = w * recent + (1 - w) * profile        (just `recent` before a whole day has passed)

Seed 000's warm pool prefetches, ahead of time, the adapters of tenants that had traffic at the same
time of day on past days; the profile term is what catches those after a night of silence, when the
EWMA has decayed to nothing. Running example, alpha 0.3, w 0.6: an adapter with 20 requests every day
between 09:00 and 10:00 and none otherwise. The EWMA is 0.3 * 20 = 6 when a 09:00 hour ends; at 08:30
on day 8 it has decayed over 22 idle hours and the idle hour in progress to 6 * 0.7^23 = 0.002; the
profile of hour 9 is 20; the forecast is 0.6 * 0.002 + 0.4 * 20 = 8.0 requests: above a threshold of 1,
so the adapter is loaded before 09:00. At 12:30 the forecast is ~0 and it is not.

The clock is wall time in seconds (hour of day = floor(t / 3600) mod 24, UTC); the engine injects it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Traffic:
    first_hour: int
    hour: int  # the hour in progress
    count: int = 0  # requests in the hour in progress
    ewma: float | None = None  # over completed hours
    profile_sum: list[int] = field(default_factory=lambda: [0] * 24)  # requests per hour of day, completed hours


class TrafficPredictor:
    def __init__(self, *, alpha: float, recent_weight: float):
        assert 0 < alpha <= 1 and 0 <= recent_weight <= 1, (alpha, recent_weight)
        self.alpha, self.recent_weight = alpha, recent_weight
        self._by_key: dict[str, _Traffic] = {}

    def observe(self, key: str, t: float) -> None:
        """One request for `key` at wall time t."""
        hour = int(t // 3600)
        tr = self._by_key.get(key)
        if tr is None:
            tr = self._by_key[key] = _Traffic(first_hour=hour, hour=hour)
        self._advance(tr, hour)
        tr.count += 1

    def forget(self, key: str) -> None:
        self._by_key.pop(key, None)

    def forecast(self, key: str, t: float) -> float:
        """Expected requests for `key` in the hour after the one holding t."""
        tr = self._by_key.get(key)
        if tr is None:
            return 0.0
        hour = int(t // 3600)
        self._advance(tr, hour)
        recent = tr.count if tr.ewma is None else self.alpha * tr.count + (1 - self.alpha) * tr.ewma
        coming = (hour + 1) % 24
        days = _count_in(tr.first_hour, hour, coming)
        if days == 0:
            return recent
        return self.recent_weight * recent + (1 - self.recent_weight) * tr.profile_sum[coming] / days

    def ranked(self, t: float, min_per_hour: float) -> list[tuple[str, float]]:
        """(key, forecast) of every key forecast at min_per_hour or more, most expected first."""
        out = [(k, f) for k in self._by_key if (f := self.forecast(k, t)) >= min_per_hour]
        return sorted(out, key=lambda kf: (-kf[1], kf[0]))

    def _advance(self, tr: _Traffic, hour: int) -> None:
        if hour <= tr.hour:
            return
        tr.ewma = tr.count if tr.ewma is None else self.alpha * tr.count + (1 - self.alpha) * tr.ewma
        tr.profile_sum[tr.hour % 24] += tr.count
        tr.ewma *= (1 - self.alpha) ** (hour - tr.hour - 1)  # the idle hours between
        tr.hour, tr.count = hour, 0


def _count_in(start: int, stop: int, hour_of_day: int) -> int:
    """Hours h in [start, stop) with h mod 24 == hour_of_day."""
    return (stop - 1 - hour_of_day) // 24 - (start - 1 - hour_of_day) // 24
