"""P's outcome carries D's verdict on its DONE: ok only when D took the transfer as written.

- D answers ``failed`` (it had given the transfer up), ``already failed`` (it failed and was
  forgotten) or ``kept until registration`` (D has no such transfer): P's outcome fails, and its
  reason names D's answer.
- A DONE whose reply was lost is sent again; D, which finished (and, as under vLLM, forgot) the
  transfer, answers ``already finished``: P's outcome is ok. The same for a lost ``DoneBatch`` reply:
  every item ends ok.
- With several senders, a DONE counted while D still takes the transfer is ok; counted while D gives
  the transfer up (``aborting``), it is not.

Real runtimes on the memory backend over real control sockets. A layer whose device event completes
late (``TimedEvent``) holds P's DONE back while D changes its mind, or D drops the DONE (a frame lost
on the way) until it has given the transfer up; a D whose server drops the first reply of a kind (after
handling the message) stands for a reply lost on the way.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from aiolayer import ReceiveSpec, Runtime, Timeouts, TransferSpec
from aiolayer.errors import ControlRejected, FrameDropped
from aiolayer.kvcache import PagedKVCache
from aiolayer.protocol import messages as m
from aiolayer.protocol.codes import NackCode
from aiolayer.runtime.send import sender as sender_module
from aiolayer.runtime.receive.receiver import Receiver

from helpers_node import SMALL_SHAPE
from helpers_step import CACHES, TimedEvent, d_state, memory_p

pytestmark = pytest.mark.timeout(60)
LAYERS = SMALL_SHAPE.num_layers
TOKEN = "v" * 32
LOSSY = Timeouts(control_call=0.5, done_delivery=4.0)   # P: a lost reply is asked again after 0.5 s
PERSISTENT = Timeouts(control_call=0.5, control_retries=8, done_delivery=4.0)   # P: a lost DONE, for up to 4 s


def _late_done(p, d, tid: str, monkeypatch, last_layer_s: float):
    """One transfer to the decode node ``d`` whose last layer completes ``last_layer_s`` after the
    step began (its DONE goes no earlier); (registration, the moment the step began)."""
    rep = p.request(d.control_endpoint, m.AllocRequest(transfer_id=tid, num_blocks=1), timeout=5)
    spec = TransferSpec.from_registration(rep, src_blocks=[0], peer=d.control_endpoint)
    delays = iter([0.0] * (LAYERS - 1) + [last_layer_s])
    monkeypatch.setattr(sender_module, "record_event", lambda: TimedEvent(next(delays)))
    began = time.monotonic()
    p.sender.begin_step(1, [spec])
    for layer in range(LAYERS):
        p.sender.layer_ready(1, layer)
    p.sender.end_step(1)
    return rep, began


def _state_within(p, d, tid: str, want: str, limit: float = 5.0) -> str:
    end = time.monotonic() + limit
    while (state := d_state(p, d.control_endpoint, tid)) != want and time.monotonic() < end:
        time.sleep(0.02)
    return state


def _never_confirms(p) -> None:
    """P answers D's Abort ``settling`` forever (as a P whose write may still land would), so D's fence
    waits its grace and P's transfer runs on to its DONE, which D then judges."""
    async def settling(transfer_id: str, reason: str, token: str):
        raise ControlRejected(NackCode.SETTLING, f"writes of {transfer_id} may still land")

    p.sender.abort = settling


def _give_up_at_d(p, d, rep, after: float, began: float) -> None:
    """D gives the transfer up (an abort, as a proxy's client leaving), ``after`` s into the step:
    P's layout was fetched by then (it is the transfer's writer)."""
    time.sleep(max(0.0, began + after - time.monotonic()))
    ack = p.request(d.control_endpoint, m.AbortRequest(transfer_id=rep.transfer_id, token=rep.token), timeout=5)
    assert ack.detail == "aborting", ack


def test_a_done_that_d_answers_failed_fails_the_transfer_at_p(memory_runtime, memory_decode_node, monkeypatch):
    d = memory_decode_node(SMALL_SHAPE, "d-vfail", Timeouts(fence_grace=20))   # still aborting at the DONE
    p = memory_p(memory_runtime, "p-vfail", Timeouts(), 31)
    _never_confirms(p)
    rep, began = _late_done(p, d, "vfail", monkeypatch, last_layer_s=0.6)
    _give_up_at_d(p, d, rep, 0.2, began)
    outcome = p.sender.wait("vfail", 10)
    assert not outcome.ok and "'failed'" in outcome.reason, outcome.reason
    assert d_state(p, d.control_endpoint, "vfail") == "failed"


def _deaf_to_done(d: Runtime) -> threading.Event:
    """D drops every DONE unanswered (lost on the way) until the returned event is set: P asks again."""
    real, hearing = d.server.handler, threading.Event()

    async def handler(msg: m.Message) -> m.Message:
        if isinstance(msg, (m.Done, m.DoneBatch)) and not hearing.is_set():
            raise FrameDropped("the DONE is lost on the way")
        return await real(msg)
    d.server.handler = handler
    return hearing


def test_a_done_that_d_answers_already_failed_fails_the_transfer_at_p(memory_runtime, memory_decode_node,
                                                                      monkeypatch):
    """Every write landed within D's window, but the DONE is lost until D's deadline ended the
    transfer and D freed it: the retried DONE is answered ``already failed``."""
    # receive 1 s: D remembers how the transfer ended for as long, so the retry P sends once D hears again
    # (every ~0.5 s) still finds that record; at 0.5 s it could come after it and be kept as an early word
    d = memory_decode_node(SMALL_SHAPE, "d-vgone", Timeouts(receive=1.0, fence_grace=0.1))
    hearing = _deaf_to_done(d.runtime)
    p = memory_p(memory_runtime, "p-vgone", PERSISTENT, 32)
    _never_confirms(p)
    _late_done(p, d, "vgone", monkeypatch, last_layer_s=0.0)
    assert _state_within(p, d, "vgone", "failed") == "failed"   # deadline, then the grace after the window
    p.request(d.control_endpoint, m.ReleaseRequest(transfer_id="vgone"), timeout=5)   # forgotten: settled only
    hearing.set()
    outcome = p.sender.wait("vgone", 10)
    assert not outcome.ok and "'already failed'" in outcome.reason, outcome.reason


def test_a_done_that_d_keeps_as_early_word_fails_the_transfer_at_p(memory_runtime, memory_decode_node,
                                                                   monkeypatch):
    """D's deadline ended the transfer, D freed it, and forgot even that it settled, before the DONE
    (lost until then) came: it is for a transfer D does not have (``kept until registration``), never
    a success."""
    limits = Timeouts(receive=0.5, fence_grace=0.1)
    d = memory_decode_node(SMALL_SHAPE, "d-vkept", limits)
    hearing = _deaf_to_done(d.runtime)
    p = memory_p(memory_runtime, "p-vkept", PERSISTENT, 33)
    _never_confirms(p)
    _late_done(p, d, "vkept", monkeypatch, last_layer_s=0.0)
    assert _state_within(p, d, "vkept", "failed") == "failed"   # deadline, then the grace after the window
    p.request(d.control_endpoint, m.ReleaseRequest(transfer_id="vkept"), timeout=5)
    time.sleep(limits.receive + 0.2)                             # its settled id is forgotten too
    hearing.set()
    outcome = p.sender.wait("vkept", 10)
    assert not outcome.ok and "'kept until registration'" in outcome.reason, outcome.reason


# --- lost replies -------------------------------------------------------------------------------

def _receiving_d(memory_runtime, name: str) -> Runtime:
    """A D as the vLLM bridge runs it: ``Runtime.receive`` (the entry is forgotten once settled)."""
    d = memory_runtime(name, Timeouts(receive=30))
    cache = PagedKVCache(SMALL_SHAPE)
    CACHES.append(cache)
    d.register_kv_memory(cache.k_base, cache.v_base, SMALL_SHAPE.block_bytes, SMALL_SHAPE.num_blocks)
    return d


def _lose_first_reply(d: Runtime, kind: type) -> list:
    """D handles every message, but the reply to its first ``kind`` message never leaves."""
    real, lost = d.server.handler, []

    async def handler(msg: m.Message) -> m.Message:
        reply = await real(msg)
        if isinstance(msg, kind) and not lost:
            lost.append(msg)
            raise FrameDropped(f"the reply to {type(msg).__name__} is lost")
        return reply
    d.server.handler = handler
    return lost


def _step(p, d: Runtime, ids: list[str]) -> dict:
    regs = [d.receive(ReceiveSpec(transfer_id=tid, block_ids=[i + 1], token=TOKEN)) for i, tid in enumerate(ids)]
    p.sender.begin_step(1, [TransferSpec.from_registration(r, src_blocks=[i]) for i, r in enumerate(regs)])
    for layer in range(LAYERS):
        p.sender.layer_ready(1, layer)
    p.sender.end_step(1)
    return {tid: p.sender.wait(tid, 10) for tid in ids}


def test_a_retried_done_whose_reply_was_lost_ends_ok(memory_runtime):
    d = _receiving_d(memory_runtime, "d-vlost")
    lost = _lose_first_reply(d, m.Done)
    p = memory_p(memory_runtime, "p-vlost", LOSSY, 34)
    outcome = _step(p, d, ["vlost"])["vlost"]
    assert len(lost) == 1
    assert outcome.ok, outcome.reason
    assert d.wait_received("vlost", 5).ok


def test_a_lost_done_batch_reply_fails_none_of_the_transfers_d_finished(memory_runtime):
    d = _receiving_d(memory_runtime, "d-vbatch")
    lost = _lose_first_reply(d, m.DoneBatch)
    p = memory_p(memory_runtime, "p-vbatch", LOSSY, 35)
    ids = [f"vb{i}" for i in range(8)]
    outcomes = _step(p, d, ids)
    assert len(lost) == 1 and len(lost[0].items) > 1   # a batch's reply was lost, after D applied it
    assert all(o.ok for o in outcomes.values()), {t: o.reason for t, o in outcomes.items() if not o.ok}
    assert all(d.wait_received(tid, 5).ok for tid in ids)


# --- several senders (head slices): D's tally ----------------------------------------------------

async def test_with_several_senders_a_counted_done_is_ok_until_d_gives_the_transfer_up():
    loop = asyncio.get_running_loop()
    rx = Receiver(Timeouts(fence_grace=30))   # no sender named: the fence asks nobody, waits its grace
    rx.bind(lambda coro, name: loop.create_task(coro, name=name), stop_sender=None)
    try:
        rx.register("k", [1, 2], token=TOKEN, senders=3)
        first = rx.handle(m.Done(transfer_id="k", sender="p0", token=TOKEN))
        assert first.detail == "1 of 3 senders reported" and m.done_verdict(first) == ""
        assert rx.abort("k", "the client left") == "aborting"
        second = rx.handle(m.Done(transfer_id="k", sender="p1", token=TOKEN))
        assert "'aborting'" in m.done_verdict(second), second   # counted, but D will fail the transfer
        assert "'already settled'" in m.done_verdict(m.Ack(detail="already settled"))   # an older D
    finally:
        rx.close()
