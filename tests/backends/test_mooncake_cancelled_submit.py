"""A write cancelled just as its threaded submit returns (the opening of a new segment, or the submit
thread while another segment opens): the run Mooncake took is still watched to its end. It was dropped:
never polled, so its batch never freed and the caller's fence saw nothing pending while it could land.

The real engine writes into a real ``aiolayer node``; a thin wrapper only times the cancel (as the
submit returns), which nothing else can, and records which batch ids the backend polls."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from helpers_node import SMALL_SHAPE, apply_mc_env, mooncake_p, stoppable_node

apply_mc_env()  # before any Mooncake engine exists in this process

from aiolayer.protocol import messages as m

pytestmark = pytest.mark.timeout(90)
SHAPE = SMALL_SHAPE


class _CancelAsSubmitReturns:
    def __init__(self, engine, loop) -> None:
        self._engine, self._loop = engine, loop
        self.task: asyncio.Task | None = None
        self.submitted: list[int] = []
        self.polled: set[int] = set()

    def transfer_submit_write(self, *args):
        bid = self._engine.transfer_submit_write(*args)
        self.submitted.append(bid)
        if self.task is not None:
            self._loop.call_soon_threadsafe(self.task.cancel)
        return bid

    def transfer_check_status(self, bid):
        self.polled.add(bid)
        return self._engine.transfer_check_status(bid)

    def __getattr__(self, name):
        return getattr(self._engine, name)


@pytest.mark.parametrize("path", ["opening", "submit thread"])
def test_a_run_submitted_as_its_write_is_cancelled_is_still_watched(path):
    with stoppable_node(SHAPE) as node, mooncake_p(f"p-cancel-{path}", 3, SHAPE) as (rt, cache):
        rep = rt.request(node.control, m.AllocRequest(transfer_id="c", num_blocks=1), timeout=5)
        layout = rt.request(node.control, m.LayoutRequest(transfer_id="c", token=rep.token), timeout=5)
        one = [np.array([v], dtype=np.int64) for v in (cache.k_base[0], layout.layers[0].k_base
                                                        + rep.block_ids[0] * SHAPE.block_bytes, SHAPE.block_bytes)]
        backend = rt.backend

        async def cancelled_write() -> tuple[str, list[int], set[int], int]:
            loop = asyncio.get_running_loop()
            real, wrapper = backend._engine, _CancelAsSubmitReturns(backend._engine, loop)
            if path == "submit thread":   # the segment is open; another one's opening sends submits to the thread
                await backend.write(layout.session, *one, 10.0)
                backend._openers["another"] = loop.create_future()
            backend._engine = wrapper
            backend._poll.check = wrapper.transfer_check_status
            wrapper.task = loop.create_task(backend.write(layout.session, *one, 10.0))
            try:
                await wrapper.task
                outcome = "returned"
            except asyncio.CancelledError:
                outcome = "cancelled"
            deadline = time.monotonic() + 5
            while (backend.quarantined or backend.inflight) and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            backend._openers.pop("another", None)
            backend._engine = real
            backend._poll.check = real.transfer_check_status
            return outcome, wrapper.submitted, wrapper.polled, backend.quarantined + backend.inflight

        outcome, submitted, polled, quarantined = rt.loop_thread.call(cancelled_write(), timeout=30)
        assert outcome == "cancelled"
        assert len(submitted) == 1 and set(submitted) <= polled, (submitted, polled)   # the run was watched ...
        assert quarantined == 0                                                          # ... to its end
