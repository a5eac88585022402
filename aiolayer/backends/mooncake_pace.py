"""When the Mooncake poller should expect each target's next write to settle (``WritePace``).

Split off ``mooncake_poll``: the poller naps through most of a write that will take long (a slow link)
and looks often near the time it should land; this module only keeps the rates that tell when.
"""

from __future__ import annotations

from typing import Protocol

from ..bounded import put_newest

_PACED_TARGETS = 1024   # targets whose rate is remembered


class Group(Protocol):
    """What the pace reads of a write (``mooncake_poll.Group``; not imported: it imports this module)."""

    target: str
    nbytes: int      # its bytes
    watched: float   # when the poller began to watch it (time.monotonic)


class WritePace:
    """When each target's next write should settle, from the rate its writes settled at: a write's time
    runs from when it was watched or, behind another write to that target, from when that one settled
    (writes to one peer complete nearly in order). A rate sample is every byte settled since that
    target's writes began to overlap over the time since (writes behind another share its bytes' time:
    two settling in one look once made the rate hundreds of times too high). The estimate moves by
    half of each new sample."""

    def __init__(self) -> None:
        self._rate: dict[str, float] = {}       # target -> bytes per second
        # target -> (when its last write settled, when its current run of overlapping writes began,
        # the bytes settled in that run)
        self._last: dict[str, tuple[float, float, int]] = {}

    def settled(self, group: Group, now: float) -> None:
        target = group.target
        last, since, run_bytes = self._last.get(target, (0.0, 0.0, 0))
        if group.watched >= last:   # nothing to this target was in flight when it was watched
            since, run_bytes = group.watched, 0
        run_bytes += group.nbytes
        put_newest(self._last, target, (now, since, run_bytes), _PACED_TARGETS)
        if group.nbytes > 0 and now > since:
            sample = run_bytes / (now - since)
            old = self._rate.get(target)
            put_newest(self._rate, target, sample if old is None else (old + sample) / 2, _PACED_TARGETS)

    def takes(self, group: Group) -> float:
        """How long ``group``'s bytes take at its target's rate (0.0: no estimate)."""
        rate = self._rate.get(group.target)
        return group.nbytes / rate if rate else 0.0

    def due(self, group: Group) -> float | None:
        """When ``group`` (the first unsettled write to its target) should settle; None: no estimate."""
        takes = self.takes(group)
        if takes <= 0.0:   # no rate yet, or no bytes
            return None
        last = self._last.get(group.target, (0.0, 0.0, 0))[0]
        return max(group.watched, last) + takes
