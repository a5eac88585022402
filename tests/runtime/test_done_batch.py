"""P's DONEs batched per D (``runtime.done_batch``): one frame for the DONEs of a loop pass,
and each still means what it meant alone.

- Transfers of one step that end together reach D as ``DoneBatch`` frames; every one is verified
  at D, and one whose DONE D drops (fault injection) fails alone ("DONE not delivered"), while the
  others of its batch finish.
- A D that does not know ``DoneBatch`` (an older node answers ``Nack(decode)``) gets them one by one:
  every transfer still finishes.
- D answers a batch item by item: a wrong token or a sender D does not expect is that item's Nack.
- The first DONE of a pass, cancelled while the others join, does not strand them.
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from aiolayer import DecodeNode, NodeConfig, Timeouts
from aiolayer.errors import ControlRejected
from aiolayer.protocol import messages as m
from aiolayer.protocol.codes import NackCode
from aiolayer.runtime.control.plane import ControlPeers
from aiolayer.runtime.send.done_batch import DoneBatcher

from helpers_node import SMALL_SHAPE
from helpers_step import d_state, memory_p, one_step

pytestmark = pytest.mark.timeout(60)
SHAPE = SMALL_SHAPE
FAST = Timeouts(control_call=0.5, done_delivery=1.5)
COUNT = 24


def _p(memory_runtime, name: str):
    return memory_p(memory_runtime, name, FAST, 5)


def _stream(p, d_control: str, drop: frozenset[str] = frozenset()) -> dict:
    return one_step(p, d_control, COUNT, drop)


_state = d_state


def test_dones_of_one_pass_go_as_batches_and_a_dropped_one_fails_alone(memory_runtime, memory_decode_node):
    d = memory_decode_node(SHAPE, "d-batch", FAST)
    p = _p(memory_runtime, "p-batch")
    outcomes = _stream(p, d.control_endpoint, drop={"t7"})
    assert p.sender.dones.batches >= 1
    failed = {tid: o.reason for tid, o in outcomes.items() if not o.ok}
    assert list(failed) == ["t7"] and failed["t7"].startswith("DONE not delivered"), failed
    for tid in outcomes:
        assert _state(p, d.control_endpoint, tid) == ("registered" if tid == "t7" else "finished")


def test_a_d_without_batches_gets_the_dones_one_by_one(memory_runtime):
    def old_node(msg: m.Message) -> None:   # what an older node answers to a type it does not know
        if isinstance(msg, m.DoneBatch):
            raise ControlRejected(NackCode.DECODE, "Invalid value 'done_batch' - at `$.type`")

    d = DecodeNode(SHAPE, NodeConfig(engine_id="d-old", backend="memory"), FAST)
    d.runtime._hooks = msgspec.structs.replace(d.runtime._hooks, inbound_filter=old_node)   # before start
    d.start()
    try:
        p = _p(memory_runtime, "p-old")
        outcomes = _stream(p, d.control_endpoint)
        assert all(o.ok for o in outcomes.values()), {t: o.reason for t, o in outcomes.items() if not o.ok}
        assert p.sender.dones.batches == 0
        assert all(_state(p, d.control_endpoint, tid) == "finished" for tid in outcomes)
    finally:
        d.stop()


def test_d_answers_each_batched_done_alone(memory_runtime, memory_decode_node):
    d = memory_decode_node(SHAPE, "d-items", FAST)
    p = _p(memory_runtime, "p-items")
    good = p.request(d.control_endpoint, m.AllocRequest(transfer_id="good", num_blocks=1), timeout=5)
    other = p.request(d.control_endpoint, m.AllocRequest(transfer_id="other", num_blocks=1), timeout=5)
    reply = p.request(d.control_endpoint, m.DoneBatch(items=[
        m.Done(transfer_id="good", sender="p", token=good.token),
        m.Done(transfer_id="other", sender="p", token="wrong-token-for-this-one"),
        m.Done(transfer_id="good", sender="p", token=good.token),   # a repeat: idempotent
        m.Done(transfer_id="other", sender="p", token=other.token, v=m.PROTOCOL_VERSION + 1),
    ]), timeout=5)
    assert isinstance(reply, m.Replies) and len(reply.items) == 4
    first, wrong, repeat, newer = reply.items
    assert isinstance(newer, m.Nack) and newer.code == NackCode.VERSION
    assert isinstance(first, m.Ack) and first.detail == "finished"
    assert isinstance(wrong, m.Nack) and wrong.code == NackCode.AUTH
    assert isinstance(repeat, m.Ack) and repeat.detail.startswith("already")
    assert _state(p, d.control_endpoint, "other") == "registered" and other.token
    too_many = m.DoneBatch(items=[m.Done(transfer_id="x", sender="p")] * (m.MAX_DONE_BATCH + 1))
    with pytest.raises(ControlRejected) as refused:
        p.request(d.control_endpoint, too_many, timeout=5)
    assert refused.value.code == NackCode.SIZE


def test_a_cancelled_first_done_does_not_strand_the_others(memory_runtime, memory_decode_node):
    """The first DONE of a pass sends the pass's batch; cancelled while it waits for the others to
    join (the runtime stopping under it), those others are still sent and answered."""
    d = memory_decode_node(SHAPE, "d-cancel", FAST)
    p = _p(memory_runtime, "p-cancel")
    regs = [p.request(d.control_endpoint, m.AllocRequest(transfer_id=f"c{i}", num_blocks=1), timeout=5)
            for i in range(3)]
    dones = [m.Done(transfer_id=r.transfer_id, sender="p-cancel", token=r.token) for r in regs]

    async def main() -> list:
        async with asyncio.TaskGroup() as group:
            peers = ControlPeers(FAST, group.create_task)
            batcher = DoneBatcher(peers, FAST)
            batcher.spawn = group.create_task
            first = group.create_task(batcher.deliver(d.control_endpoint, dones[0]))
            others = [group.create_task(batcher.deliver(d.control_endpoint, x)) for x in dones[1:]]
            await asyncio.sleep(0)   # all three queued; the first waits one pass for the others
            first.cancel()
            answers = await asyncio.wait_for(asyncio.gather(*others), 5)
            await peers.close()
        assert first.cancelled()
        return answers

    answers = asyncio.run(main())
    assert [a.detail for a in answers] == ["finished", "finished"]
    assert [_state(p, d.control_endpoint, f"c{i}") for i in range(3)] == ["registered", "finished", "finished"]
