"""P's layer streaming (``runtime.stream``) around layers that are not ready: a layer whose device event
is still pending is waited for (the layers ready before it already submitted), a layer that never
completes ends the transfer by ``layer_event``, and a layer that never comes by ``layer_gap``; every
layer the step hands over at once is taken in one go. On CPU every event is ready at once, so these
tests hand the sender events that complete at set times (what a GPU's do)."""

from __future__ import annotations


import pytest

from aiolayer import Timeouts, TransferSpec
from aiolayer.protocol import messages as m
from aiolayer.runtime.send import sender as sender_module

from helpers_node import SMALL_SHAPE
from helpers_step import TimedEvent, d_state, memory_p

pytestmark = pytest.mark.timeout(60)
LAYERS = SMALL_SHAPE.num_layers


def _one_transfer(p, d, tid: str, delays: list[float | None], monkeypatch, handed: int = LAYERS):
    """One transfer whose first ``handed`` layers are handed over at once, layer i's event completing
    ``delays[i]`` seconds after its hand-over; its outcome."""
    rep = p.request(d.control_endpoint, m.AllocRequest(transfer_id=tid, num_blocks=1), timeout=5)
    spec = TransferSpec.from_registration(rep, src_blocks=[0], peer=d.control_endpoint)
    queue = iter(delays)
    monkeypatch.setattr(sender_module, "record_event", lambda: TimedEvent(next(queue)))
    p.sender.begin_step(1, [spec])
    for layer in range(handed):
        p.sender.layer_ready(1, layer)
    return p.sender.wait(tid, 10)


def test_a_pending_layer_is_waited_for_and_the_ready_ones_go_first(memory_runtime, memory_decode_node, monkeypatch):
    d = memory_decode_node(SMALL_SHAPE, "d-pending", Timeouts())
    p = memory_p(memory_runtime, "p-pending", Timeouts(), 11)
    outcome = _one_transfer(p, d, "pending", [0.0, 0.3] + [0.0] * (LAYERS - 2), monkeypatch)
    assert outcome.ok, outcome.reason
    submitted = {t.layer: t.submitted_s for t in outcome.layers}
    assert sorted(submitted) == list(range(LAYERS))
    # layer 0 went before the wait (layer-wise); layer 1 and those after it only once its event completed
    assert submitted[0] < submitted[1] and submitted[1] - submitted[0] > 0.2
    assert d_state(p, d.control_endpoint, "pending") == "finished"


def test_a_layer_that_never_completes_fails_the_transfer_by_layer_event(memory_runtime, memory_decode_node,
                                                                          monkeypatch):
    d = memory_decode_node(SMALL_SHAPE, "d-event", Timeouts())
    p = memory_p(memory_runtime, "p-event", Timeouts(layer_event=0.3), 12)
    outcome = _one_transfer(p, d, "event", [0.0, 0.0, None] + [0.0] * (LAYERS - 3), monkeypatch)
    assert not outcome.ok and "layer_event" in outcome.reason, outcome.reason
    assert {t.layer for t in outcome.layers} <= {0, 1}   # nothing from the stuck layer on
    assert p.sender.deadlines["layer_event"] == 1
    assert d_state(p, d.control_endpoint, "event") == "failed"   # P said FAILED once its writes were quiet


def test_a_layer_that_never_comes_fails_the_transfer_by_layer_gap(memory_runtime, memory_decode_node, monkeypatch):
    d = memory_decode_node(SMALL_SHAPE, "d-gap", Timeouts())
    p = memory_p(memory_runtime, "p-gap", Timeouts(layer_gap=0.3), 13)
    outcome = _one_transfer(p, d, "gap", [0.0] * LAYERS, monkeypatch, handed=LAYERS - 1)
    assert not outcome.ok and "layer_gap" in outcome.reason, outcome.reason
    assert p.sender.deadlines["layer_gap"] == 1
    assert d_state(p, d.control_endpoint, "gap") == "failed"
