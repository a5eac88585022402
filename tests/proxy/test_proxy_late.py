"""The proxy's late-bound flow: P and D are sent the request at once, no registration is waited for.

The engines are an ``httpx.MockTransport`` that records what each was sent; D is a real control server
that records the ``AbortRequest`` the exchange sends when P fails.
"""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("fastapi")

import httpx

from aiolayer.config import Timeouts
from aiolayer.errors import ControlRejected
from aiolayer.protocol.codes import NackCode
from aiolayer.protocol import messages as m
from aiolayer.runtime.control.plane import ControlPeers, ControlServer
from aiolayer_vllm.params import KEY, RecvParams, SendParams, read
from aiolayer_vllm.proxy.app import ProxyState
from aiolayer_vllm.proxy.flow import Exchange, ExchangeError, ProxyTimeouts
from aiolayer_vllm.proxy.pool import Backend, Pool
from aiolayer_vllm.ranks import rank_transfer_id

P_URL, D_URL = "http://127.0.0.1:9", "http://127.0.0.1:8"


async def _exchange(p_status: int, aborts: list[m.Message], sent: dict[str, dict], d_status: int = 200):
    """A late-binding exchange whose D answers only once P was sent the request (a D-first flow would
    wait for a registration that never comes); P answers ``p_status``, D ``d_status``. D and P are one
    control server here (it records the aborts both get)."""
    p_seen = asyncio.Event()

    async def engines(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if request.url.host == "127.0.0.1" and request.url.port == 9:
            sent["P"] = body
            p_seen.set()
            return httpx.Response(p_status, json={"choices": [{"text": "x"}]})
        sent["D"] = body
        await asyncio.wait_for(p_seen.wait(), 5)
        if p_status != 200:
            await asyncio.sleep(5)   # D would wait for P's KV: the exchange must end on P's failure first
        return httpx.Response(d_status, json={"choices": [{"text": "decoded"}]})

    async def d_handler(msg: m.Message) -> m.Message:
        aborts.append(msg)
        if isinstance(msg, m.Abort):   # P: its transfer stops (or never starts)
            return m.Ack(detail="stopped")
        raise ControlRejected(NackCode.UNKNOWN_TRANSFER, "not registered yet")

    loop = asyncio.get_running_loop()
    d = ControlServer("127.0.0.1", 0, d_handler)
    endpoint = await d.start(loop.create_task)
    state = ProxyState(Pool([], []), "http://127.0.0.1:1", ProxyTimeouts(prefill_s=5, request_s=10), binding="late")
    state.spawn = lambda coro, name: loop.create_task(coro, name=name)   # type: ignore[method-assign]
    state.client = httpx.AsyncClient(transport=httpx.MockTransport(engines))
    state.peers = ControlPeers(Timeouts(), loop.create_task)
    exchange = Exchange(state, "/v1/completions", {"prompt": "x"}, Backend("prefill", P_URL, endpoint),
                        Backend("decode", D_URL, endpoint))
    return exchange, state, d, endpoint


async def _close(exchange, state, d) -> None:
    """What ``_exchange`` opened: the exchange, the proxy state's client and peers, D's control server."""
    await exchange.close()
    await state.client.aclose()
    await state.peers.close()
    await d.close()


@pytest.mark.timeout(20)
async def test_late_binding_sends_p_and_d_at_once_without_a_registration():
    aborts: list[m.Message] = []
    sent: dict[str, dict] = {}
    exchange, state, d, endpoint = await _exchange(200, aborts, sent)
    try:
        resp = await exchange.run_until_decode()
        assert resp.status_code == 200 and "registered" not in exchange.stamps
        recv, send = read(sent["D"]["kv_transfer_params"]), read(sent["P"]["kv_transfer_params"])
        assert isinstance(recv, RecvParams) and recv.notify_url == ""          # D need not POST to the proxy
        assert isinstance(send, SendParams) and send.late and not send.dst_blocks
        assert [r.decode_control for r in send.decode_ranks] == [endpoint]
        assert (send.transfer_id, send.token) == (recv.transfer_id, recv.token) == (exchange.transfer_id,
                                                                                       exchange.token)
        assert sent["P"]["kv_transfer_params"][KEY]["late"] is True and aborts == []
    finally:
        await _close(exchange, state, d)


@pytest.mark.timeout(20)
async def test_late_binding_p_failing_tells_d_and_ends_the_exchange():
    aborts: list[m.Message] = []
    sent: dict[str, dict] = {}
    exchange, state, d, endpoint = await _exchange(500, aborts, sent)
    try:
        with pytest.raises(ExchangeError) as err:
            await exchange.run_until_decode()
        assert err.value.kind == "prefill_error"
        tid = rank_transfer_id(exchange.transfer_id, 0, 1)
        d_told = [(a.transfer_id, a.token) for a in aborts if isinstance(a, m.AbortRequest)]
        assert d_told == [(tid, exchange.token)]
    finally:
        await _close(exchange, state, d)


@pytest.mark.timeout(20)
async def test_late_binding_d_failing_stops_p_s_transfers():
    """D answers 500 before registering: P's transfer would wait for D's registration until its
    deadline, holding its blocks; the proxy tells P to stop it (P's ``Abort``, with the token)."""
    aborts: list[m.Message] = []
    sent: dict[str, dict] = {}
    exchange, state, d, endpoint = await _exchange(200, aborts, sent, d_status=500)
    try:
        resp = await exchange.run_until_decode()
        assert resp.status_code == 500                     # the app turns it into the client's 502
        await exchange.abort_decode("decode answered HTTP 500")
        tid = rank_transfer_id(exchange.transfer_id, 0, 1)
        end = asyncio.get_running_loop().time() + 5
        while not any(isinstance(a, m.Abort) for a in aborts):
            assert asyncio.get_running_loop().time() < end, "P was never told to stop"
            await asyncio.sleep(0.01)
        assert [(a.transfer_id, a.token) for a in aborts if isinstance(a, m.Abort)] == [(tid, exchange.token)]
    finally:
        await _close(exchange, state, d)


def _learned(dp: int = 1, late_binding: bool = True, one_dp_rank: bool | None = None):
    from aiolayer_vllm.proxy.topology import Learned
    alone = dp == 1 if one_dp_rank is None else one_dp_rank
    return Learned(tp=1, dp=dp, role="x", model="m", engine_id="e", incarnations=("i",) * dp, num_layers=2,
                   block_size=16, late_binding=late_binding, one_dp_rank=alone)


@pytest.mark.parametrize("binding, prefill, decode, late", [
    ("auto", _learned(), _learned(), True),                       # both said they can: no D-first wait
    ("auto", _learned(late_binding=False), _learned(), False),    # P pairs its blocks with D's (hybrid)
    ("auto", _learned(), _learned(dp=2), False),                  # vLLM picks D's rank: its endpoint unknown
    ("auto", _learned(), _learned(one_dp_rank=False), False),     # rank 0 says dp 1, a rank listens beside it
    ("auto", None, _learned(), False),                            # not learned: nothing said, D first
    ("auto", _learned(), None, False),
    ("late", _learned(late_binding=False), _learned(), True),     # asked for: a hybrid P then refuses it
    ("late", None, None, True),
    ("late", _learned(), _learned(dp=2), False),
    ("late", _learned(), _learned(one_dp_rank=False), False),     # a dense D's DP ranks: D-first, as said
    ("d-first", _learned(), _learned(), False),
])
def test_the_binding_of_an_exchange(binding, prefill, decode, late):
    from aiolayer_vllm.proxy.flow import binds_late
    assert binds_late(binding, prefill, decode) is late


@pytest.mark.timeout(30)
@pytest.mark.parametrize("beside", [None, "listener"])
def test_what_the_proxy_learns_of_late_binding_from_an_engines_ranks(beside):
    """What the embedder said reaches the proxy; and a rank 0 that says dp 1 of 1 (each DP rank of a dense
    model in vLLM says so) counts as alone only if nothing listens where its second DP rank would."""
    import socket

    from aiolayer import Identity, NodeConfig, Runtime
    from aiolayer.harness.procs import free_ports
    from aiolayer_vllm.proxy.topology import Learned, learn

    async def learned(endpoint: str) -> Learned:
        peers = ControlPeers(Timeouts(), asyncio.get_running_loop().create_task)
        try:
            return await learn("prefill", endpoint, 0, peers, 5)
        finally:
            await peers.close()

    base = free_ports(2)
    with socket.socket() as other:
        if beside:   # e.g. the next DP rank's runtime: anything listening there
            other.bind(("127.0.0.1", base + 1))
            other.listen()
        for said in (None, False, True):
            rt = Runtime(NodeConfig(engine_id="p", backend="memory", control_port=base)).start()
            try:
                rt.set_identity(Identity(role="producer") if said is None else
                                Identity(role="producer", late_binding=said))
                got = asyncio.run(learned(rt.control_endpoint))
                assert got.late_binding is bool(said)   # not said: D first
                assert got.one_dp_rank is (beside is None)
            finally:
                rt.stop()
