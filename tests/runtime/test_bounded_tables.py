"""The runtime's per-peer and per-transfer tables stay bounded: past their capacity the entry used longest
ago goes, and a key used again counts as new (``aiolayer.bounded.put_newest`` and its users)."""

from __future__ import annotations

import time

from aiolayer.backends.mooncake_pace import _PACED_TARGETS, WritePace
from aiolayer.backends.mooncake_poll import Group
from aiolayer.bounded import put_newest
from aiolayer.runtime.receive.settled import SettledTable
from aiolayer.runtime.send.fence import EarlyAborts


def test_put_newest_drops_the_entry_used_longest_ago():
    table: dict[str, int] = {}
    assert [put_newest(table, k, i, 3) for i, k in enumerate("abc")] == [0, 0, 0]
    assert put_newest(table, "a", 10, 3) == 0          # used again: now the newest, nothing goes
    assert put_newest(table, "d", 11, 3) == 1          # b was used longest ago
    assert list(table.items()) == [("c", 2), ("a", 10), ("d", 11)]


def test_settled_transfers_past_capacity_forget_the_oldest():
    table = SettledTable(lifetime_s=60.0, capacity=2)
    table.remember("x", "tx", True)
    table.remember("y", "ty", False)
    table.remember("x", "tx2", True)                   # settled again: newest
    table.remember("z", "tz", True)
    assert table.word("y") is None
    assert table.word("x") == ("tx2", True) and table.word("z") == ("tz", True)


def test_early_aborts_count_what_made_room_but_not_what_expired():
    aborts = EarlyAborts(capacity=2)
    now = time.monotonic()
    aborts.add(("t1", "k"), now + 0.001, now)
    aborts.add(("t2", "k"), now + 60, now)
    aborts.add(("t3", "k"), now + 60, now + 1)         # t1 expired: it goes, no eviction
    assert aborts.evicted == 0 and len(aborts) == 2
    aborts.add(("t4", "k"), now + 60, now + 1)         # full: t2 makes room
    assert aborts.evicted == 1
    assert not aborts.take(("t2", "k"), now + 1)
    assert aborts.take(("t3", "k"), now + 1) and aborts.take(("t4", "k"), now + 1)


def _settle(pace: WritePace, target: str, at: float) -> None:
    group = Group(None, 100.0, 30.0, target, 1_000_000)   # type: ignore[arg-type]  # the future is not used
    group.watched = at
    pace.settled(group, at + 0.01)


def test_write_pace_remembers_the_targets_written_to_last():
    pace = WritePace()
    _settle(pace, "first", 0.0)
    for i in range(_PACED_TARGETS - 1):
        _settle(pace, f"d{i}", 1.0)
    _settle(pace, "first", 2.0)                        # written to again: kept
    _settle(pace, "one-more", 3.0)                     # d0 was written to longest ago
    probe = Group(None, 100.0, 30.0, "first", 1_000_000)   # type: ignore[arg-type]
    assert pace.takes(probe) > 0
    probe.target = "d0"
    assert pace.takes(probe) == 0.0 and pace.due(probe) is None
    probe.target = "d1"
    assert pace.takes(probe) > 0


def test_outcomes_nobody_pops_keep_the_newest_and_every_wait_is_still_answered(caplog):
    """An embedder that only waits never pops: each outcome (with its per-layer timings) stayed forever."""
    from types import SimpleNamespace

    from aiolayer.runtime.send.results import Results
    from aiolayer.runtime.spec import Outcome

    results = Results(max_outcomes=3)
    ids = [f"t{i}" for i in range(5)]
    results.expect([SimpleNamespace(transfer_id=tid) for tid in ids])
    for tid in ids:
        results.publish(Outcome(transfer_id=tid, ok=True))   # no loop running here: visible at once
    assert [o.transfer_id for o in results.outcomes] == ids[2:] and results.outcomes_dropped == 2
    assert "never popped" in caplog.text
    assert [results.wait(tid, 1).transfer_id for tid in ids] == ids
    assert not results.waiters
