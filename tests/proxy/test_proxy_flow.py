"""The proxy's exchange when the HTTP client itself breaks: P's failure is still a 502 and D is told.

httpcore/anyio have been seen raising ``AttributeError`` (not an ``httpx.HTTPError``) when P dies
mid-connect; the transport here raises exactly that. D is a real control server that records the
``AbortRequest`` the exchange must send.
"""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("fastapi")

import httpx

from aiolayer.config import Timeouts
from aiolayer.protocol import messages as m
from aiolayer.runtime.control.plane import ControlPeers, ControlServer
from helpers_proxy import registration
from aiolayer_vllm.params import read_registration
from aiolayer_vllm.proxy.app import ProxyState
from aiolayer_vllm.proxy.flow import Exchange, ExchangeError, ProxyTimeouts
from aiolayer_vllm.proxy.pool import Backend, Pool


def _broken_client(request: httpx.Request) -> httpx.Response:
    raise AttributeError("'NoneType' object has no attribute 'getpeername'")


@pytest.mark.timeout(20)
async def test_an_unexpected_client_error_calling_p_is_a_502_and_d_is_told_to_abort():
    aborts: list[m.AbortRequest] = []

    async def d_handler(msg: m.Message) -> m.Message:
        aborts.append(msg)
        return m.Ack(detail="aborting")

    loop = asyncio.get_running_loop()
    d = ControlServer("127.0.0.1", 0, d_handler)
    endpoint = await d.start(loop.create_task)
    state = ProxyState(Pool([], []), "http://127.0.0.1:1", ProxyTimeouts(prefill_s=5))
    state.client = httpx.AsyncClient(transport=httpx.MockTransport(_broken_client))
    state.peers = ControlPeers(Timeouts(), loop.create_task)
    try:
        prefill = Backend("prefill", "http://127.0.0.1:9", "tcp://127.0.0.1:9")
        decode = Backend("decode", "http://127.0.0.1:8", endpoint)
        exchange = Exchange(state, "/v1/completions", {"prompt": "x"}, prefill, decode)
        reg = read_registration(registration(exchange.transfer_id, exchange.token, "i", endpoint, blocks=[1]))
        assert exchange.add_registration(reg) == ""
        with pytest.raises(ExchangeError) as err:
            await exchange._prefill(exchange.registered.result())
        assert err.value.status == 502 and err.value.kind == "prefill_error"
        assert "AttributeError" in err.value.message
        assert [(a.transfer_id, a.token) for a in aborts] == [(exchange.transfer_id, exchange.token)]
    finally:
        await state.client.aclose()
        await state.peers.close()
        await d.close()
