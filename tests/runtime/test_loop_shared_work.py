"""The loop's cost per transfer: work shared by the transfers of a step or of a loop pass.

- A layer handed over is appended once to its step's ``StepLayers``, whatever the number of
  transfers: each reads it through its own cursor, and only a transfer already waiting is woken (with
  ``asyncio.Queue`` per transfer, each layer was a put and a get per transfer). A stop wakes a
  waiting transfer too.
- ``Results`` makes what one pass of the loop published visible together, after ONE ``on_change``
  (the runtime's metrics snapshot, taken per outcome and per release before), in the order it was
  published: a ``resolve`` after a ``publish`` of the same id does not replace the published answer.
"""

from __future__ import annotations

import asyncio

import pytest

from aiolayer.protocol.plan import merge_runs
from aiolayer.runtime.send.fence import Request, StepLayers
from aiolayer.runtime.send.results import Results
from aiolayer.runtime.spec import Outcome, TransferSpec

pytestmark = pytest.mark.timeout(30)


def _spec(tid: str) -> TransferSpec:
    return TransferSpec(transfer_id=tid, peer="tcp://127.0.0.1:9", src_blocks=[0], dst_blocks=[0],
                        dst_incarnation="i", token="t")


def test_a_layer_is_one_append_per_step_and_wakes_only_waiting_transfers():
    async def main() -> None:
        feed = StepLayers()
        idle = [Request(_spec(f"idle-{i}"), merge_runs([0], [0]), feed) for i in range(1000)]
        waiting = Request(_spec("waiting"), merge_runs([0], [0]), feed)
        arrival = waiting.next_arrival()
        assert feed.waiting == [waiting]
        feed.add((0, None, 1.0))
        assert arrival.done() and feed.waiting == []   # woken, and no longer listed
        feed.add((1, None, 2.0))
        assert len(feed.items) == 2
        for req in (*idle, waiting):   # every transfer reads every layer, in order, once
            assert req.layer_ready
            assert [req.take_layer()[0], req.take_layer()[0], req.take_layer()] == [0, 1, None]
            assert not req.layer_ready
        stopped = waiting.next_arrival()
        waiting.abort("D asked")
        assert stopped.done() and waiting.aborted == "D asked"

    asyncio.run(main())


def test_a_loop_pass_publishes_together_after_one_metrics_snapshot():
    async def main() -> None:
        snapshots = []
        results = Results(on_change=lambda: snapshots.append(len(results.outcomes)))
        ids = [f"t{i}" for i in range(200)]
        results.expect([_spec(tid) for tid in ids])
        waiters = dict(results.waiters)
        for tid in ids:
            results.publish(Outcome(transfer_id=tid, ok=True, finished_s=1.0))
            results.release(tid)
        results.resolve(Outcome(transfer_id="t0", ok=False, reason="late answer", finished_s=2.0))
        assert not results.outcomes and not results.released and snapshots == []
        await asyncio.sleep(0)   # the pass ends
        assert snapshots == [0]   # once, before any of them was visible
        assert all(w.done() for w in waiters.values()) and waiters["t0"].result(0).ok   # published first
        assert [o.transfer_id for o in results.pop_outcomes()] == ids
        assert results.pop_released() == ids
        assert not results.waiters   # forgotten as their outcomes were popped

    asyncio.run(main())


def test_the_first_answer_to_a_wait_stays_the_published_one():
    async def main() -> None:
        results = Results()
        results.expect([_spec("x")])
        waiter = results.waiters["x"]
        results.publish(Outcome(transfer_id="x", ok=False, reason="first", finished_s=1.0))
        results.resolve(Outcome(transfer_id="x", ok=False, reason="second", finished_s=2.0))
        await asyncio.sleep(0)
        assert waiter.result(0).reason == "first"

    asyncio.run(main())


def test_results_off_the_loop_are_visible_at_once():
    results = Results()
    results.publish(Outcome(transfer_id="y", ok=True, finished_s=1.0))
    assert [o.transfer_id for o in results.pop_outcomes()] == ["y"]
