"""Strangers on the control plane: without a transfer's token nothing is read, ended or stopped.

A real ``aiolayer node`` (Mooncake over TCP) and a legitimate P runtime, plus a stranger who can
reach both control ports (a raw DEALER socket, as any process on the host could open). The
stranger's layout requests, lookups, DONE/FAILED, abort requests and Aborts are refused with
``Nack(auth)`` and counted in the metrics, while the legitimate transfer completes byte for byte.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import zmq

from helpers_node import SMALL_SHAPE, apply_mc_env, spawn_node

apply_mc_env()

from prometheus_client.parser import text_string_to_metric_families

from aiolayer import NodeConfig, Runtime, TransferSpec
from aiolayer.config import Timeouts
from aiolayer.errors import ConfigError, ControlRejected
from aiolayer.kvcache import PagedKVCache, checksums
from aiolayer.protocol import messages as m
from aiolayer.bounded import MAX_KEY_CHARS
from aiolayer.runtime.receive.early import MAX_EARLY, MAX_ID_CHARS, MAX_REASON_CHARS
from aiolayer.runtime.receive.receiver import Receiver

BLOCKS = 4
WRONG = "f" * 32


class Stranger:
    """A DEALER that speaks the wire protocol but holds no token."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.socks: dict[str, zmq.Socket] = {}
        self.rid = 0

    def call(self, endpoint: str, msg: m.Message) -> m.Message:
        sock = self.socks.get(endpoint)
        if sock is None:
            sock = self.socks[endpoint] = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVTIMEO, 5000)
            sock.connect(endpoint)
        self.rid += 1
        sock.send_multipart([m.pack_request_id(self.rid), m.encode(msg)])
        rid, payload = sock.recv_multipart()
        assert m.unpack_request_id(rid) == self.rid
        return m.decode(payload)

    def close(self) -> None:
        for sock in self.socks.values():
            sock.close(0)
        self.ctx.term()


def _refused(reply: m.Message) -> bool:
    return isinstance(reply, m.Nack) and reply.code == "auth"


def _metric(text: str, name: str, **labels) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


@pytest.mark.timeout(90)
def test_stranger_is_refused_and_counted_while_the_real_transfer_completes():
    with spawn_node("--metrics-port", "0") as node:
        rt = Runtime(NodeConfig(engine_id="legit-p", metrics_port=0), Timeouts(control_call=5.0)).start()
        stranger = Stranger()
        try:
            _run_attack(node, rt, stranger)
        finally:
            stranger.close()
            rt.stop()


def _run_attack(node, rt: Runtime, stranger: Stranger) -> None:
    d, p = node.info["control"], rt.control_endpoint
    cache = PagedKVCache(SMALL_SHAPE)
    cache.buffer[:] = np.random.default_rng(3).integers(0, 256, cache.buffer.size, dtype=np.uint8)
    rt.register_kv_memory(cache.k_base, cache.v_base, SMALL_SHAPE.block_bytes, SMALL_SHAPE.num_blocks)

    # a DONE with a wrong token before the registration is kept, then dropped when the real one comes
    assert stranger.call(d, m.Done(transfer_id="legit", sender="x", token=WRONG)).detail == "kept until registration"
    alloc = rt.request(d, m.AllocRequest(transfer_id="legit", num_blocks=BLOCKS, sender_control=p), timeout=5)
    assert len(alloc.token) >= 16
    refused = [
        stranger.call(d, m.LayoutRequest(requester="stranger")),
        stranger.call(d, m.LayoutRequest(requester="stranger", transfer_id="legit", token=WRONG)),
        stranger.call(d, m.LookupRequest(transfer_id="legit", token=WRONG)),
        stranger.call(d, m.Done(transfer_id="legit", sender="legit-p", token=WRONG, layers=4, bytes=1)),
        stranger.call(d, m.Failed(transfer_id="legit", sender="legit-p", reason="forged", token=WRONG)),
        stranger.call(d, m.AbortRequest(transfer_id="legit", reason="forged", token=WRONG)),
    ]
    assert all(_refused(r) for r in refused), refused
    assert rt.request(d, m.StatusRequest(transfer_id="legit"), timeout=5).state == "registered"

    spec = TransferSpec.from_registration(alloc, src_blocks=list(range(BLOCKS)), peer=d)
    # before P knows the transfer, an Abort cannot be checked: it is kept under its own token, harmless
    early = stranger.call(p, m.Abort(transfer_id="legit", reason="forged", token=WRONG))
    assert isinstance(early, m.Ack), early
    rt.sender.begin_step(1, [spec])
    rt.sender.layer_ready(1, 0)
    deadline = time.monotonic() + 5
    while rt.sender.active == 0:      # P is mid-transfer now: a stranger's Abort is refused
        assert time.monotonic() < deadline, "P never started the transfer"
        time.sleep(0.001)
    abort = stranger.call(p, m.Abort(transfer_id="legit", reason="forged", token=WRONG))
    for layer in range(1, SMALL_SHAPE.num_layers):
        rt.sender.layer_ready(1, layer)
    rt.sender.end_step(1)
    outcome = rt.sender.wait("legit", 15)
    assert _refused(abort), abort
    assert outcome.ok, outcome

    verify = rt.request(d, m.VerifyRequest(transfer_id="legit"), timeout=10)
    assert verify.state == "finished"
    assert (verify.crc_k, verify.crc_v) == checksums(cache.blocks, range(BLOCKS))

    import httpx
    d_metrics = httpx.get(node.info["metrics"], timeout=5).text
    assert _metric(d_metrics, "aiolayer_control_rejected_total", code="auth") == len(refused)
    assert _metric(d_metrics, "aiolayer_control_rejected_total", code="early_auth") == 1
    p_metrics = httpx.get(rt.metrics_url, timeout=5).text
    assert _metric(p_metrics, "aiolayer_control_rejected_total", code="auth") == 1
    assert isinstance(rt.request(d, m.ReleaseRequest(transfer_id="legit"), timeout=5), m.Ack)


def test_a_registration_needs_a_real_token():
    async def register(token: str) -> None:
        Receiver(Timeouts()).register("t", [0], token=token)

    with pytest.raises(ConfigError):
        asyncio.run(register(""))
    with pytest.raises(ConfigError):
        asyncio.run(register("short"))
    with pytest.raises(ConfigError):
        TransferSpec(transfer_id="t", peer="tcp://127.0.0.1:1", src_blocks=[0], dst_blocks=[0],
                     dst_incarnation="i", token="")


def test_early_messages_from_strangers_cannot_grow_without_bound():
    receiver = Receiver(Timeouts())
    for i in range(MAX_EARLY):
        receiver.handle(m.Done(transfer_id=f"t{i}", sender="s", token=WRONG))
    with pytest.raises(ControlRejected) as exc:
        receiver.handle(m.Done(transfer_id="one-more", sender="s", token=WRONG))
    assert exc.value.code == "busy"


def test_early_messages_from_strangers_are_kept_small():
    """Each kept word was a whole frame (up to 1 MiB): 4,096 of them, kept for ``receive``, gigabytes."""
    receiver = Receiver(Timeouts())
    check = m.LayerCheck(layers=[0], offsets=[0], lengths=[1], crc_k=list(range(100_000)))
    with pytest.raises(ControlRejected) as exc:   # no P writes, so none has a check, before D registered
        receiver.handle(m.Done(transfer_id="checked", sender="s", token=WRONG, check=check))
    assert exc.value.code == "not_registered"
    with pytest.raises(ControlRejected) as exc:
        receiver.handle(m.Done(transfer_id="t" * (MAX_ID_CHARS + 1), sender="s", token=WRONG))
    assert exc.value.code == "decode"
    receiver.handle(m.Failed(transfer_id="long-reason", sender="s", reason="x" * 500_000, token=WRONG))
    ((_, kept),) = receiver._early.take("long-reason")   # what the table holds
    assert len(kept.reason) == MAX_REASON_CHARS


def test_p_keeps_no_strangers_abort_with_an_overlong_id():
    """P remembers an Abort for a transfer it does not know (id, token) for ``receive``: kept whole, a
    stranger's 1 MiB ids would be gigabytes in its 4,096 entries."""
    p = Runtime(NodeConfig(engine_id="p-abort-size", backend="memory")).start()
    stranger = Stranger()
    try:
        reply = stranger.call(p.control_endpoint, m.Abort(transfer_id="t" * (MAX_KEY_CHARS + 1), token=WRONG))
        assert isinstance(reply, m.Nack) and reply.code == "decode", reply
        reply = stranger.call(p.control_endpoint, m.Abort(transfer_id="t", token=WRONG))
        assert isinstance(reply, m.Ack) and reply.detail == "stopped", reply
    finally:
        stranger.close()
        p.stop()


def test_overlong_ids_are_refused_as_they_are_decoded_and_never_quoted_back():
    """A stranger's ids of most of a frame: a waiting lookup held one for ``lookup_wait`` (4,096 at once:
    gigabytes), and each refusal quoted it back into D's queue of replies nobody reads. Refused when the
    frame is decoded: at once, in a short reply, nothing waiting."""
    d = Runtime(NodeConfig(engine_id="d-long-ids", backend="memory"), Timeouts(lookup_wait=30)).start()
    stranger = Stranger()
    long = "t" * 1_000_000
    try:
        for msg in (m.LookupRequest(transfer_id=long, token=WRONG, wait=True),
                    m.LookupRequest(transfer_id="t", token=WRONG, requester=long, wait=True),
                    m.LayoutRequest(requester="s", transfer_id=long, token=WRONG),
                    m.AbortRequest(transfer_id="t", token=long),
                    m.Done(transfer_id="t", sender=long, token=WRONG)):
            started = time.monotonic()
            reply = stranger.call(d.control_endpoint, msg)
            assert isinstance(reply, m.Nack) and reply.code == "decode", reply
            assert time.monotonic() - started < 2 and len(m.encode(reply)) < 1000, (type(msg).__name__, reply)
        assert d.receiver.lookups.count == 0
        at_limit = stranger.call(d.control_endpoint, m.LookupRequest(transfer_id="t" * MAX_KEY_CHARS, token=WRONG))
        assert isinstance(at_limit, m.Nack) and at_limit.code != "decode", at_limit   # decoded, then judged
    finally:
        stranger.close()
        d.stop()


async def test_proxy_takes_a_registration_only_with_the_transfers_token():
    """Only the D the proxy gave the token to can tell it where P must write."""
    pytest.importorskip("fastapi")
    import json

    from aiolayer_vllm.proxy.app import ProxyState
    from aiolayer_vllm.proxy.flow import Exchange, ProxyTimeouts
    from aiolayer_vllm.proxy.pool import Backend, Pool

    state = ProxyState(Pool([], []), "http://127.0.0.1:1", ProxyTimeouts())
    exchange = Exchange(state, "/v1/completions", {"prompt": "x"}, Backend.parse("prefill", "http://p:1,tcp://p:2"),
                        Backend.parse("decode", "http://d:1,tcp://d:2"))
    exchange.token = "a" * 32
    state.pending["t"] = exchange
    from helpers_proxy import registration

    def body(token: str) -> dict:
        return registration("t", token, "i", "tcp://127.0.0.1:9", blocks=(1,))

    forged = state.registered(body(WRONG))
    assert forged.status_code == 403 and json.loads(forged.body)["error"]["type"] == "auth"
    tokenless = body("a" * 32)
    del tokenless["registration"]["token"]
    assert state.registered(tokenless).status_code == 400           # no token at all: not a registration
    assert not exchange.registered.done()
    assert state.registered(body("a" * 32)).status_code == 202
    assert exchange.registered.result()[0].registration.block_ids == [1]   # one registration per D rank
    assert "aiolayer_proxy_rejected_registrations_total 1.0" in state.metrics.text().decode()
