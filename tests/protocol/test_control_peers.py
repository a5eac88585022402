"""Control plane over real zmq sockets on 127.0.0.1: peers reused and evicted, binding conflicts, no socket left."""

from __future__ import annotations

import asyncio

import pytest

from aiolayer.config import Timeouts
from aiolayer.errors import ControlError, ControlTimeout
from aiolayer.protocol import messages as m
from aiolayer.runtime.control.plane import ControlClient, ControlPeers, ControlServer, open_sockets

pytestmark = pytest.mark.timeout(30)

from helpers_control import EchoHandler, free_port


# --- peers, binding, leaks ---------------------------------------------------------------------------------

async def test_bind_conflict_is_a_control_error(server, spawn):
    other = ControlServer("127.0.0.1", server.port, EchoHandler())
    with pytest.raises(ControlError, match="cannot bind"):
        await other.start(spawn)
    await other.close()


async def test_peers_reuse_clients_and_close_all(server, spawn, closer):
    peers = ControlPeers(Timeouts(), spawn)
    closer(peers)
    a = await peers.get(server.endpoint)
    assert await peers.get(server.endpoint) is a
    assert (await a.call(m.StatusRequest(transfer_id="p"))).transfer_id == "p"
    before = open_sockets()
    await peers.close()
    assert open_sockets() == before - 1


async def test_peers_close_idle_clients_of_departed_peers_and_keep_their_counts(server, spawn, closer):
    """A long-lived P whose D peers restart on new ports must not keep a socket per departed peer."""
    peers = ControlPeers(Timeouts(peer_idle=0.5, control_call=0.1), spawn)
    closer(peers)
    gone = await peers.get(f"tcp://127.0.0.1:{free_port()}")     # nobody there: its call times out
    with pytest.raises(ControlTimeout):
        await gone.call(m.StatusRequest(transfer_id="x"))
    live = await peers.get(server.endpoint)
    await live.call(m.StatusRequest(transfer_id="y"))
    sockets = open_sockets()
    await asyncio.sleep(0.6)
    await peers.get(server.endpoint)                            # a known peer: nothing is evicted
    assert len(peers) == 2
    await peers.get(f"tcp://127.0.0.1:{free_port()}")           # a new peer: both idle clients go
    assert len(peers) == 1 and peers.evicted == 2
    assert open_sockets() == sockets - 1
    assert peers.totals()["timeout"] == 1 and peers.totals()["ok"] == 1
    fresh = await peers.get(server.endpoint)                    # a departed peer that comes back: new client
    assert fresh is not live and (await fresh.call(m.StatusRequest(transfer_id="z"))).transfer_id == "z"


async def test_concurrent_new_peers_while_evicting_neither_fail_nor_duplicate(server, spawn, closer):
    peers = ControlPeers(Timeouts(peer_idle=0.05), spawn)
    closer(peers)
    for _ in range(5):
        await peers.get(f"tcp://127.0.0.1:{free_port()}")
    await asyncio.sleep(0.1)                                    # all five are stale now
    endpoints = [f"tcp://127.0.0.1:{free_port()}" for _ in range(4)] * 2
    clients = await asyncio.gather(*(peers.get(ep) for ep in endpoints))
    assert peers.evicted == 5 and len(peers) == 4
    assert all(clients[i] is clients[i + 4] for i in range(4))  # one client per endpoint


async def test_a_caller_cancelled_while_idle_clients_close_leaks_no_socket_or_reader(spawn, closer):
    """The caller that evicts may be cancelled at its first await (a fence's deadline, a lookup given up):
    the stale clients are out of the table by then, so each must be shut before that await or never."""
    peers = ControlPeers(Timeouts(peer_idle=0.01), spawn)
    closer(peers)
    before = open_sockets()
    for _ in range(3):
        await peers.get(f"tcp://127.0.0.1:{free_port()}")
    await asyncio.sleep(0.05)                                   # all three idle past peer_idle
    evicting = asyncio.ensure_future(peers.get(f"tcp://127.0.0.1:{free_port()}"))
    await asyncio.sleep(0)                                      # now at the eviction's first await
    evicting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await evicting
    await asyncio.sleep(0.05)
    assert peers.evicted == 3 and open_sockets() == before
    assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("control-client") and not t.done()]


async def test_everything_closed_leaves_no_socket(spawn):
    handler = EchoHandler()
    srv = ControlServer("127.0.0.1", 0, handler)
    await srv.start(spawn)
    clients = [ControlClient(srv.endpoint, Timeouts()) for _ in range(3)]
    for c in clients:
        await c.start(spawn)
    await asyncio.gather(*(c.call(m.StatusRequest(transfer_id=str(i))) for i, c in enumerate(clients)))
    assert open_sockets() == 4
    for c in clients:
        await c.close()
        await c.close()                                 # idempotent
    await srv.close()
    await srv.close()
    assert open_sockets() == 0


@pytest.mark.parametrize("endpoint, needle", [
    ("tcp://127.0.0.1:99999", "port must be in 1..65535"),   # ZMQ took it, and the call timed out
    ("tcp://127.0.0.1:0", "port must be in 1..65535"),
    ("tcp://127.0.0.1", "port must be in 1..65535"),
    ("127.0.0.1:5600", "not transport://address"),
    ("tcp://127.0.0.1:56 00", "printable ASCII without spaces"),
])
async def test_an_endpoint_no_peer_can_have_is_refused_saying_why(spawn, closer, endpoint, needle):
    peers = ControlPeers(Timeouts(), spawn)
    closer(peers)
    before = open_sockets()
    with pytest.raises(ControlError, match=needle):
        await peers.get(endpoint)
    assert len(peers) == 0 and open_sockets() == before
