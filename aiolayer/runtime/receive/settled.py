"""D's memory of settled transfers: id -> (token, how it ended), for ``Timeouts.receive`` seconds.

A late or retried DONE/FAILED for a settled transfer is answered from here ("already finished" /
"already failed", never kept as an early word a later registration would take for its own), and the
id cannot be registered again meanwhile. Bounded: beyond ``MAX_SETTLED`` ids the oldest go first.
"""

from __future__ import annotations

import collections
import operator
import time

from ...bounded import drop_expired, put_newest

MAX_SETTLED = 16384       # settled ids remembered: the oldest go first beyond this


class SettledTable:
    def __init__(self, lifetime_s: float, capacity: int = MAX_SETTLED) -> None:
        self.lifetime_s = lifetime_s
        self.capacity = capacity
        # transfer id -> (token, expiry, finished), oldest first (the same lifetime for each)
        self._ids: collections.OrderedDict[str, tuple[str, float, bool]] = collections.OrderedDict()

    def remember(self, transfer_id: str, token: str, finished: bool) -> None:
        self._prune(now := time.monotonic())
        put_newest(self._ids, transfer_id, (token, now + self.lifetime_s, finished), self.capacity)

    def word(self, transfer_id: str) -> tuple[str, bool] | None:
        """(token, finished) of a transfer settled within the lifetime, or None."""
        self._prune(time.monotonic())
        settled = self._ids.get(transfer_id)
        return None if settled is None else (settled[0], settled[2])

    def clear(self) -> None:
        self._ids.clear()

    def _prune(self, now: float) -> None:
        drop_expired(self._ids, now, operator.itemgetter(1))
