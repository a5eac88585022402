"""Cheap in-process statistics the runtime keeps for its metrics: a fixed-bucket latency histogram.

Observed on the loop thread only, so it needs no lock; ``observe`` is one bisect and two adds,
cheap enough for every layer hand-off. Bucket bounds follow Prometheus' cumulative ``le`` buckets.
"""

from __future__ import annotations

import bisect

# 1 us .. 1 s: the hand-off is microseconds when healthy and milliseconds when the loop is starved
HANDOFF_BOUNDS_S = (1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2,
                    2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0)


class LatencyHistogram:
    def __init__(self, bounds: tuple[float, ...] = HANDOFF_BOUNDS_S) -> None:
        if list(bounds) != sorted(bounds) or not bounds:
            raise ValueError("histogram bounds must be a non-empty ascending sequence")
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(bounds) + 1)   # the last bucket is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.sum += seconds
        self.count += 1

    def cumulative(self) -> list[tuple[float, int]]:
        """[(upper bound, observations <= it)], ending with (inf, count)."""
        out, running = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts):
            running += n
            out.append((bound, running))
        return out

    def quantile(self, q: float) -> float:
        """Upper bound of the bucket holding quantile ``q`` (0 when empty)."""
        if not self.count:
            return 0.0
        rank = q * self.count
        for bound, seen in self.cumulative():
            if seen >= rank:
                return bound
        return float("inf")
