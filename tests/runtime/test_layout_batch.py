"""P's layout requests batched per D (``runtime.metadata``): the fetches one pass of P's loop
starts for one D (a step's transfers) go as ONE ``LayoutBatch`` frame, and D still authorizes each.

- A step's transfers to one D cost one layout frame; every transfer finishes and is counted as asked.
- An item D leaves unanswered (a hook drops it) is asked again alone and fails alone, by its own
  ``layout_fetch`` deadline; the others of its batch finish.
- A D that does not know ``LayoutBatch`` (an older node answers ``Nack(decode)``) gets the requests one
  by one: every transfer still finishes.
- D answers a batch item by item: a wrong token or another protocol version is that item's Nack, and
  the layout is sent only when some item was authorized.
"""

from __future__ import annotations

import msgspec
import pytest

from aiolayer import DecodeNode, NodeConfig, Timeouts
from aiolayer.errors import ControlRejected, FrameDropped
from aiolayer.protocol import messages as m
from aiolayer.protocol.codes import NackCode

from helpers_node import SMALL_SHAPE
from helpers_step import d_state, memory_p, one_step

pytestmark = pytest.mark.timeout(60)
SHAPE = SMALL_SHAPE
FAST = Timeouts(control_call=0.5, done_delivery=1.5, layout_fetch=1.5)
COUNT = 24


def _node_with_filter(name: str, inbound_filter) -> DecodeNode:
    d = DecodeNode(SHAPE, NodeConfig(engine_id=name, backend="memory"), FAST)
    d.runtime._hooks = msgspec.structs.replace(d.runtime._hooks, inbound_filter=inbound_filter)   # before start
    return d.start()


def test_a_steps_layout_requests_go_as_one_frame(memory_runtime, memory_decode_node):
    d = memory_decode_node(SHAPE, "d-layouts", FAST)
    p = memory_p(memory_runtime, "p-layouts", FAST, 7)
    outcomes = one_step(p, d.control_endpoint, COUNT)
    assert all(o.ok for o in outcomes.values()), {t: o.reason for t, o in outcomes.items() if not o.ok}
    assert (p.layouts.batches, p.layouts.batched) == (1, COUNT)
    assert p.layouts.fetches[d.control_endpoint] == COUNT   # every transfer was authorized by D
    assert all(d_state(p, d.control_endpoint, tid) == "finished" for tid in outcomes)


def test_a_dropped_layout_item_is_asked_alone_and_fails_alone(memory_runtime):
    def drop_t5(msg: m.Message) -> None:   # every LayoutRequest of t5 is lost, batched or alone
        if isinstance(msg, m.LayoutRequest) and msg.transfer_id == "t5":
            raise FrameDropped("test: t5's layout request lost")

    d = _node_with_filter("d-drop", drop_t5)
    try:
        p = memory_p(memory_runtime, "p-drop", FAST, 7)
        outcomes = one_step(p, d.control_endpoint, COUNT)
        failed = {tid: o.reason for tid, o in outcomes.items() if not o.ok}
        assert list(failed) == ["t5"] and "layout_fetch" in failed["t5"], failed
        assert p.layouts.batches == 1 and p.layouts.deadlines_expired == 1
        assert all(d_state(p, d.control_endpoint, tid) == "finished" for tid in outcomes if tid != "t5")
    finally:
        d.stop()


def test_a_d_without_layout_batches_gets_them_one_by_one(memory_runtime):
    def old_node(msg: m.Message) -> None:   # what an older node answers to a type it does not know
        if isinstance(msg, m.LayoutBatch):
            raise ControlRejected(NackCode.DECODE, "Invalid value 'layout_batch' - at `$.type`")

    d = _node_with_filter("d-old-layouts", old_node)
    try:
        p = memory_p(memory_runtime, "p-old-layouts", FAST, 7)
        outcomes = one_step(p, d.control_endpoint, COUNT)
        assert all(o.ok for o in outcomes.values()), {t: o.reason for t, o in outcomes.items() if not o.ok}
        assert p.layouts.batches == 0 and p.layouts.fetches[d.control_endpoint] == COUNT
        assert all(d_state(p, d.control_endpoint, tid) == "finished" for tid in outcomes)
    finally:
        d.stop()


def test_d_authorizes_each_batched_layout_request(memory_runtime, memory_decode_node):
    d = memory_decode_node(SHAPE, "d-layout-items", FAST)
    p = memory_p(memory_runtime, "p-layout-items", FAST, 7)
    good = p.request(d.control_endpoint, m.AllocRequest(transfer_id="good", num_blocks=1), timeout=5)
    reply = p.request(d.control_endpoint, m.LayoutBatch(items=[
        m.LayoutRequest(requester="p", transfer_id="good", token=good.token),
        m.LayoutRequest(requester="p", transfer_id="good", token="wrong-token-for-this-one"),
        m.LayoutRequest(requester="p", transfer_id="good", token=good.token, v=m.PROTOCOL_VERSION + 1),
    ]), timeout=5)
    assert isinstance(reply, m.LayoutReplies) and len(reply.items) == 3
    granted, wrong, newer = reply.items
    assert isinstance(granted, m.Ack) and reply.layout is not None and reply.layout.engine_id == "d-layout-items"
    assert isinstance(wrong, m.Nack) and wrong.code == NackCode.AUTH
    assert isinstance(newer, m.Nack) and newer.code == NackCode.VERSION
    refused = p.request(d.control_endpoint, m.LayoutBatch(items=[m.LayoutRequest(transfer_id="nope", token="x" * 32)]),
                        timeout=5)
    assert refused.layout is None and isinstance(refused.items[0], m.Nack)   # no memory shown to a stranger
    too_many = m.LayoutBatch(items=[m.LayoutRequest(transfer_id="x")] * (m.MAX_LAYOUT_BATCH + 1))
    with pytest.raises(ControlRejected) as big:
        p.request(d.control_endpoint, too_many, timeout=5)
    assert big.value.code == NackCode.SIZE
