"""How often the Mooncake poller looks at writes in flight (``backends.mooncake_poll``).

On a slow link one layer's write is in flight for tens of ms while P's forward runs on the same core:
the poller backs off (1, 2, 4 ms) while nothing settles, and is back at 1 ms once something does or a
new write comes. Its ``check`` here is a clock (a run "lands" at a set time), so that the cadence is
what is measured; the real engine's writes are in ``test_mooncake_grouped_writes``.
"""

from __future__ import annotations

import asyncio

import pytest

from aiolayer.backends.mooncake_poll import _MAX_POLL_TICK_S, Group, GroupPoller

pytestmark = pytest.mark.timeout(30)
# A loaded 2-core box wakes timers late; the bounds below are about the cadence, not the box.
SLACK_S = 0.05


def _landing_clock(loop: asyncio.AbstractEventLoop, lands_at: dict[int, float]):
    """Mooncake's status call as a clock: run ``bid`` is pending (0) until ``lands_at[bid]``, then done (1)."""
    def check(bid: int) -> int:
        return 1 if loop.time() >= lands_at[bid] else 0
    return check


def _watch(poller: GroupPoller, loop: asyncio.AbstractEventLoop, bid: int) -> asyncio.Future:
    group = Group(loop.create_future(), deadline=loop.time() + 10, timeout=10, target="d")
    group.ids = [bid]
    poller.watch("d", group)
    return group.future


async def test_a_write_long_in_flight_is_looked_at_sparsely_and_seen_soon_after_it_lands():
    loop = asyncio.get_running_loop()
    lands_at = {1: loop.time() + 0.12}
    poller = GroupPoller()
    poller.start(_landing_clock(loop, lands_at), lambda *_: None)
    task = asyncio.create_task(poller.run())
    try:
        written = _watch(poller, loop, 1)
        await asyncio.wait_for(written, 5)
        seen_after = loop.time() - lands_at[1]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    # ticking every ms would look ~120 times; backed off to 4 ms, ~33
    assert poller.ticks <= 45, poller.ticks
    assert seen_after <= _MAX_POLL_TICK_S + SLACK_S, seen_after


async def test_a_settled_write_brings_the_tick_back_so_the_next_landing_is_seen_within_a_tick():
    loop = asyncio.get_running_loop()
    now = loop.time()
    # three writes queued behind each other, as on a slow link: each lands 40 ms after the previous
    lands_at = {1: now + 0.04, 2: now + 0.08, 3: now + 0.12}
    poller = GroupPoller()
    poller.start(_landing_clock(loop, lands_at), lambda *_: None)
    task = asyncio.create_task(poller.run())
    try:
        written = [_watch(poller, loop, bid) for bid in lands_at]
        late = []
        for bid, fut in zip(lands_at, written):
            await asyncio.wait_for(fut, 5)
            late.append(loop.time() - lands_at[bid])
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert max(late) <= _MAX_POLL_TICK_S + SLACK_S, late
    assert poller.ticks <= 45, poller.ticks
