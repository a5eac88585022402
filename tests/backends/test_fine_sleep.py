"""``backends/fine_sleep.FineSleep``: sleeps shorter than uvloop's whole-millisecond timers, on a
timerfd the loop watches (the Mooncake poller's looks near a write's due time)."""

from __future__ import annotations

import asyncio
import statistics
import sys
import time

import pytest
import uvloop

from aiolayer.backends.fine_sleep import FineSleep

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="timerfd is Linux's")


def _on_uvloop(main):
    return uvloop.run(asyncio.wait_for(main(), 30))


def test_a_quarter_millisecond_lasts_a_quarter_millisecond_not_zero_nor_a_tick():
    async def main():
        fine = FineSleep.open(asyncio.get_running_loop())
        assert fine is not None
        took = []
        try:
            for _ in range(40):
                t0 = time.perf_counter()
                await fine.sleep(0.00025)
                took.append(time.perf_counter() - t0)
        finally:
            fine.close()
        return took

    took = _on_uvloop(main)
    assert min(took) >= 0.00025                 # uvloop's own sleep(0.00025) returns at once
    assert statistics.median(took) < 0.001      # and its timers would round it up to a whole tick


def test_a_cancelled_sleep_leaves_nothing_to_fire_into_the_next_and_close_ends_it():
    async def main():
        fine = FineSleep.open(asyncio.get_running_loop())
        assert fine is not None
        first = asyncio.ensure_future(fine.sleep(0.002))
        await asyncio.sleep(0)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        await asyncio.sleep(0.004)              # when the cancelled one would have fired
        t0 = time.perf_counter()
        await fine.sleep(0.003)
        took = time.perf_counter() - t0
        pending = asyncio.ensure_future(fine.sleep(10))
        await asyncio.sleep(0)
        fine.close()
        fine.close()                            # idempotent
        with pytest.raises(asyncio.CancelledError):
            await pending
        with pytest.raises(RuntimeError, match="closed"):
            await fine.sleep(0.001)
        return took

    assert _on_uvloop(main) >= 0.003
