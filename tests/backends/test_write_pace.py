"""The Mooncake poller's pace (``mooncake_pace.WritePace``, ``mooncake_poll.GroupPoller._tick``): across a slow link a
layer's write takes tens of ms, and the poller sleeps through most of what is left of it rather than
waking every 1 ms on the core the forward runs on; it still ticks where it cannot tell (no rate yet,
runs waiting for room, a deadline near). Near the due time of a write that takes 2 ms or more it looks
every quarter millisecond (``fine_sleep``), so such a layer is seen landed within a fraction of a tick.
The effect on real engines and on ``make bench``: docs/results.md, docs/mooncake.md."""

from __future__ import annotations

import asyncio
import heapq

import pytest

from aiolayer.backends.fine_sleep import FineSleep
from aiolayer.backends.mooncake_pace import WritePace
from aiolayer.backends.mooncake_poll import _FINE_TICK_S, _MAX_NAP_S, POLL_TICK_S, Group, GroupPoller

MB = 1_000_000


def _group(target: str, nbytes: int, watched: float, deadline: float = 100.0) -> Group:
    group = Group(None, deadline, 30.0, target, nbytes)   # type: ignore[arg-type]  # the future is not used here
    group.watched = watched
    return group


def test_a_write_is_due_after_its_bytes_at_the_rate_its_target_settled_at():
    pace = WritePace()
    first = _group("d", 4 * MB, watched=0.0)
    assert pace.due(first) is None                 # no rate measured yet
    pace.settled(first, 0.040)                     # 4 MB in 40 ms: 100 MB/s
    alone = _group("d", 2 * MB, watched=1.0)       # sent after an idle second: timed from its own start
    assert pace.due(alone) == pytest.approx(1.020)
    queued = _group("d", 4 * MB, watched=0.010)    # behind the first: timed from the first's settling
    assert pace.due(queued) == pytest.approx(0.080)
    assert pace.due(_group("other", MB, watched=0.0)) is None   # rates are per target
    pace.settled(_group("d", 4 * MB, watched=0.040), 0.060)     # 200 MB/s now: the estimate moves halfway
    assert pace.due(_group("d", 3 * MB, watched=0.060)) == pytest.approx(0.080)


def _poller_with(*groups: Group) -> GroupPoller:
    poller = GroupPoller()
    for group in groups:
        poller._inflight.setdefault(group.target, []).append(group)
        heapq.heappush(poller._deadlines, (group.deadline, id(group), group))
    return poller


def test_the_poller_naps_through_most_of_a_long_write_and_ticks_near_its_end():
    measured = _group("d", 4 * MB, watched=0.0)
    head = _group("d", 4 * MB, watched=0.040)      # due at 0.080 once the rate is 100 MB/s
    poller = _poller_with(head)
    assert poller._tick(0.040) == POLL_TICK_S      # no rate for its target yet
    poller.pace.settled(measured, 0.040)
    assert poller._tick(0.041) == _MAX_NAP_S       # 39 ms left: the longest nap
    assert poller._tick(0.068) == pytest.approx(0.8 * 0.012)
    assert poller._tick(0.076) == POLL_TICK_S      # nearly due: tick, so it is seen as soon as it lands
    assert poller._tick(0.200) == POLL_TICK_S      # overdue: tick
    assert poller.naps == 2
    short = _poller_with(_group("d", 800_000, watched=0.040))   # 8 ms of write: only ticked (loopback)
    short.pace.settled(measured, 0.040)
    assert short._tick(0.040) == POLL_TICK_S and short.naps == 0


def test_the_poller_ticks_where_a_nap_could_miss_something():
    poller = _poller_with(_group("d", 4 * MB, watched=0.040, deadline=0.053))
    poller.pace.settled(_group("d", 4 * MB, watched=0.0), 0.040)
    assert poller._tick(0.041) == pytest.approx(0.8 * 0.012)   # never past a deadline (12 ms away)
    waiting = _poller_with(_group("d", 4 * MB, watched=0.040))
    waiting.pace.settled(_group("d", 4 * MB, watched=0.0), 0.040)
    waiting._waiting["d"] = None                   # type: ignore[assignment]  # runs waiting for room: top-ups need ticks
    assert waiting._tick(0.041) == POLL_TICK_S
    two = _poller_with(_group("d", 4 * MB, watched=0.040), _group("new", MB, watched=0.040))
    two.pace.settled(_group("d", 4 * MB, watched=0.0), 0.040)
    assert two._tick(0.041) == POLL_TICK_S         # one target without a rate: tick for it


def test_writes_that_overlap_and_settle_in_one_look_do_not_make_the_rate_look_faster():
    pace = WritePace()
    pace.settled(_group("d", 4 * MB, watched=0.0), 0.020)          # 200 MB/s
    # two writes share the link from 0.100 on and land together, 8 MB in 40 ms
    first, behind = _group("d", 4 * MB, watched=0.100), _group("d", 4 * MB, watched=0.101)
    pace.settled(first, 0.1400)                                      # 4 MB in 40 ms: 100 MB/s
    pace.settled(behind, 0.1401)                                     # seen a look later
    # the second's sample is the 8 MB since the two began to overlap (~200 MB/s), not its 4 MB over the
    # 0.1 ms between the two looks (40 GB/s), which made the next write look due almost at once
    due = pace.due(_group("d", 4 * MB, watched=0.200))
    assert due is not None and 0.215 < due < 0.230


@pytest.mark.asyncio
async def test_near_the_due_time_of_a_write_of_2_ms_or_more_the_poller_looks_every_quarter_millisecond():
    poller = _poller_with(_group("d", 4 * MB, watched=0.040))      # due at 0.080 (100 MB/s)
    poller.pace.settled(_group("d", 4 * MB, watched=0.0), 0.040)
    assert poller._tick(0.0785) == POLL_TICK_S                      # no fine timer: whole ticks
    poller.fine = FineSleep.open(asyncio.get_running_loop())
    assert poller.fine is not None
    try:
        assert poller._tick(0.060) == _MAX_NAP_S                    # 20 ms left: still a nap
        assert poller._tick(0.076) == POLL_TICK_S                   # 4 ms left: ticks
        assert poller._tick(0.0785) == pytest.approx(0.0005)        # to 1 ms before it is due
        assert poller._tick(0.0795) == _FINE_TICK_S                 # then looks every 0.25 ms
        assert poller._tick(0.0805) == _FINE_TICK_S                 # through 1 ms past it
        assert poller._tick(0.0815) == POLL_TICK_S                  # then the estimate was wrong: ticks
        short = _poller_with(_group("d", 100_000, watched=0.040))  # 1 ms of write: looks would cover it all
        short.pace.settled(_group("d", 4 * MB, watched=0.0), 0.040)
        short.fine = poller.fine
        assert short._tick(0.0405) == POLL_TICK_S
    finally:
        poller.fine.close()
