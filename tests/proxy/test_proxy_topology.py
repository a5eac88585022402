"""The proxy learns each backend's topology from its engine's control sockets instead of taking its word.

``aiolayer proxy`` runs as a real process in front of fake vLLM servers (``helpers_proxy``) whose
control sockets are real aiolayer runtimes (memory backend), one per rank at the connector's port
rule, each with the identity the vLLM bridge sets. Given only ``URL,CONTROL``, the proxy must plan
for a P of two tensor-parallel ranks; a CONTROL that does not answer, answers in the wrong role,
disagrees with a declared ``,tp=N``, runs another model or an aiolayer without the query is refused
at start, naming it; a backend whose control socket stops answering leaves rotation, saying why on
``/health``, and comes back once its engine answers again.
"""

from __future__ import annotations

import asyncio
import collections
import socket
import subprocess
import sys
from dataclasses import replace

import pytest

pytest.importorskip("fastapi")

import httpx

from aiolayer import ControlPeers, Timeouts
from aiolayer.protocol import messages as m
from aiolayer.runtime.control.plane import ControlServer
from aiolayer_vllm.proxy.flow import binds_late
from aiolayer_vllm.proxy.pool import Backend, Pool
from aiolayer_vllm.proxy.topology import learn_pool, recheck
from aiolayer.harness.pd import ProxyProcess
from aiolayer.harness.procs import free_port, free_ports
from helpers_proxy import FakeEngine, Hub, StandInRanks, wait_for

pytestmark = pytest.mark.timeout(120)
NOWHERE = "http://127.0.0.1:9"   # refusals at start come before any HTTP call
NOWHERE_D = "http://127.0.0.1:10"   # D's: one URL per server


def _health(proxy: ProxyProcess) -> dict:
    return httpx.get(proxy.url + "/health", timeout=5, trust_env=False).json()


def _backend(health: dict, role: str) -> dict:
    return next(b for b in health["backends"] if b["role"] == role)


def _refused(prefill: str, decode: str, *, wait_s: float = 0) -> str:
    """Run the proxy, which must exit non-zero at start; its stderr. ``wait_s``: ``--control-wait-s``
    (a wrong answer must be refused at once, without it)."""
    cmd = [sys.executable, "-m", "aiolayer", "proxy", "--port", str(free_port()), "--prefill", prefill,
           "--decode", decode, "--log-level", "error", *(("--control-wait-s", str(wait_s)) if wait_s else ())]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=45)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"the proxy started: {exc.stderr}") from None
    assert done.returncode != 0, done.stderr
    return done.stderr


@pytest.fixture
def engines():
    """Stand-in ranks and fake servers, all stopped at the end."""
    made: list = []

    def make(kind, *args, **kwargs):
        thing = kind(*args, **kwargs).start()
        made.append(thing)
        return thing

    yield make
    for thing in reversed(made):
        thing.stop()


def test_the_proxy_given_only_url_and_control_plans_for_a_p_of_two_tp_ranks(engines):
    hub = Hub()
    p_ranks = engines(StandInRanks, "p", "producer", tp=2)
    p = engines(FakeEngine, "prefill", "p", hub, control=p_ranks.control)
    d = engines(FakeEngine, "decode", "d", hub)
    with ProxyProcess([f"{p.url},{p.control}"], [f"{d.url},{d.control}"], startup_timeout_s=60) as proxy:
        reply = httpx.post(proxy.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30,
                           trust_env=False)
        assert reply.status_code == 200, reply.text
        to_d = d.requests[-1]["kv_transfer_params"]["aiolayer"]
        to_p = p.requests[-1]["kv_transfer_params"]["aiolayer"]
        health = _health(proxy)
    rank1 = f"tcp://127.0.0.1:{p_ranks.base + 1}"
    assert to_d.get("prefill_controls") == [p_ranks.control, rank1], to_d   # D waits for both P ranks
    assert to_p.get("prefill_tp") == 2, to_p                                # P checks the plan's size
    learned = _backend(health, "prefill")["topology"]
    assert (learned["tp"], learned["dp"], learned["role"]) == (2, 1, "producer"), learned


def test_a_control_that_does_not_answer_is_refused_at_start_naming_it(engines):
    d_ranks = engines(StandInRanks, "d", "consumer")
    silent = f"tcp://127.0.0.1:{free_port()}"
    err = _refused(f"{NOWHERE},{silent}", f"{NOWHERE_D},{d_ranks.control}", wait_s=1)
    assert f"--prefill {NOWHERE} (control {silent})" in err and "did not answer" in err, err
    assert "--control-wait-s" in err, err


def test_a_control_of_the_wrong_role_is_refused_at_start_naming_it(engines):
    d_ranks = engines(StandInRanks, "d", "consumer")
    other_d = engines(StandInRanks, "d2", "consumer")
    err = _refused(f"{NOWHERE},{other_d.control}", f"{NOWHERE_D},{d_ranks.control}")
    assert f"--prefill {NOWHERE} (control {other_d.control})" in err, err
    assert "role 'consumer'" in err and "producer or both" in err, err


@pytest.mark.parametrize("declared,actual", [(1, 2), (2, 1)])
def test_a_declared_tp_that_disagrees_with_the_engine_is_refused_at_start(engines, declared, actual):
    p_ranks = engines(StandInRanks, "p", "producer", tp=actual)
    d_ranks = engines(StandInRanks, "d", "consumer")
    err = _refused(f"{NOWHERE},{p_ranks.control},tp={declared}", f"{NOWHERE_D},{d_ranks.control}")
    assert f"--prefill {NOWHERE} (control {p_ranks.control})" in err, err
    assert f"declared tp={declared}, learned tp={actual}" in err, err


def test_p_and_d_running_different_models_are_refused_at_start(engines):
    p_ranks = engines(StandInRanks, "p", "producer", model="tiny/aaaaaaaaaaaa")
    d_ranks = engines(StandInRanks, "d", "consumer", model="tiny/bbbbbbbbbbbb")
    err = _refused(f"{NOWHERE},{p_ranks.control}", f"{NOWHERE_D},{d_ranks.control}")
    assert "model fingerprints differ" in err and "'tiny/aaaaaaaaaaaa'" in err and "'tiny/bbbbbbbbbbbb'" in err, err


def test_a_rank_missing_by_the_port_rule_is_refused_at_start(engines):
    p_ranks = engines(StandInRanks, "p", "producer", tp=2)
    d_ranks = engines(StandInRanks, "d", "consumer")
    p_ranks.stop(1)
    err = _refused(f"{NOWHERE},{p_ranks.control}", f"{NOWHERE_D},{d_ranks.control}", wait_s=1)
    assert f"tcp://127.0.0.1:{p_ranks.base + 1} did not answer" in err, err


def test_an_engine_without_the_topology_query_is_refused_at_start_saying_so(engines):
    """An aiolayer older than the query answers Nack(decode): the proxy must say that, not time out."""
    import threading

    d_ranks = engines(StandInRanks, "d", "consumer")
    ready, stop = threading.Event(), threading.Event()
    endpoint: list[str] = []

    def old_node() -> None:
        async def main() -> None:
            async def handler(msg: m.Message) -> m.Message:
                return m.Nack(code="decode", reason="Invalid value 'topology_req' - at `$.type`")
            server = ControlServer("127.0.0.1", 0, handler)
            endpoint.append(await server.start(asyncio.get_running_loop().create_task))
            ready.set()
            while not stop.is_set():
                await asyncio.sleep(0.05)
            await server.close()
        asyncio.run(main())

    thread = threading.Thread(target=old_node, daemon=True)
    thread.start()
    try:
        assert ready.wait(10)
        err = _refused(f"{NOWHERE},{endpoint[0]}", f"{NOWHERE_D},{d_ranks.control}")
    finally:
        stop.set()
        thread.join(10)
    assert f"(control {endpoint[0]})" in err and "does not serve the topology query" in err, err
    assert "older" in err, err


def test_a_backend_whose_control_stops_answering_leaves_rotation_and_says_why(engines):
    hub = Hub()
    d_ranks = engines(StandInRanks, "d", "consumer", tp=2)
    p = engines(FakeEngine, "prefill", "p", hub)
    d = engines(FakeEngine, "decode", "d", hub, control=d_ranks.control)
    with ProxyProcess([f"{p.url},{p.control}"], [f"{d.url},{d.control}"], startup_timeout_s=60,
                      healthy=(200, 503), extra_args=("--health-interval", "0.2", "--control-timeout", "1")) as proxy:
        assert _backend(_health(proxy), "decode")["healthy"]
        d_ranks.stop(1)
        down = wait_for(lambda: (lambda b: b if not b["healthy"] else None)(_backend(_health(proxy), "decode")),
                        15, "D out of rotation")
        assert f"tcp://127.0.0.1:{d_ranks.base + 1} did not answer" in down["problem"], down
        reply = httpx.post(proxy.url + "/v1/completions", json={"prompt": "x"}, timeout=10, trust_env=False)
        assert reply.status_code == 503 and reply.json()["error"]["type"] == "no_backend", reply.text
        d_ranks.start(1)   # rank 1 back, rank 0 unchanged: one engine's ranks of two lives
        mixed = wait_for(lambda: "restarted" in _backend(_health(proxy), "decode")["problem"] and
                         _backend(_health(proxy), "decode"), 15, "mixed incarnations reported")
        assert not mixed["healthy"] and "kept their incarnation" in mixed["problem"], mixed
        d_ranks.stop(0)
        d_ranks.start(0)   # now every rank is new: the engine restarted whole
        wait_for(lambda: _backend(_health(proxy), "decode")["healthy"], 15, "D back in rotation")
        assert _backend(_health(proxy), "decode")["problem"] == ""
        reply = httpx.post(proxy.url + "/v1/completions", json={"prompt": "x"}, timeout=30, trust_env=False)
        assert reply.status_code == 200, reply.text


async def test_a_health_check_takes_out_a_backend_whose_model_changed(engines):
    p_ranks = engines(StandInRanks, "p", "producer")
    d_ranks = engines(StandInRanks, "d", "consumer")
    pool = Pool([Backend.parse("prefill", f"{NOWHERE},{p_ranks.control}")],
                [Backend.parse("decode", f"{NOWHERE_D},{d_ranks.control}")])
    peers = ControlPeers(Timeouts(), asyncio.get_running_loop().create_task)
    try:
        assert await learn_pool(pool, peers, 5.0, 1.0) == []
        assert pool.model == p_ranks.model and pool.decode[0].topology.tp == 1
        await asyncio.to_thread(d_ranks.stop)
        d_ranks.model = "other/cccccccccccc"
        await asyncio.to_thread(d_ranks.start)
        problem = await recheck(pool.decode[0], peers, 1.0, pool.model)
        assert "model fingerprint 'other/cccccccccccc'" in problem and repr(p_ranks.model) in problem, problem
    finally:
        await peers.close()


async def test_one_refused_connection_where_ds_second_dp_engine_listened_keeps_it_d_first(engines):
    """A dense model's DP ranks are engines of their own, each saying dp 1 of 1: the port after D's tells
    whether D has a second one. That engine restarting refuses one health check's connection; bound
    late then, a request vLLM gives it would never be registered. A restart of all D's ranks looks anew."""
    d_ranks = StandInRanks("d", "consumer")
    d_ranks.base = free_ports(2)
    d_ranks.control = f"tcp://127.0.0.1:{d_ranks.base}"
    engines(lambda: d_ranks)
    second = socket.create_server(("127.0.0.1", d_ranks.base + 1))   # D's second DP engine
    pool = Pool([], [Backend.parse("decode", f"{NOWHERE_D},{d_ranks.control}")])
    peers = ControlPeers(Timeouts(), asyncio.get_running_loop().create_task)
    try:
        assert await learn_pool(pool, peers, 5.0, 1.0) == []
        assert not pool.decode[0].topology.one_dp_rank
        second.close()   # restarting
        assert await recheck(pool.decode[0], peers, 1.0, pool.model) == ""
        d = pool.decode[0].topology
        assert not d.one_dp_rank
        assert not binds_late("auto", replace(d, role="producer", late_binding=True), d)
        await asyncio.to_thread(d_ranks.stop)
        await asyncio.to_thread(d_ranks.start)   # every rank new, nothing on the next port
        assert await recheck(pool.decode[0], peers, 1.0, pool.model) == ""
        assert pool.decode[0].topology.one_dp_rank
    finally:
        second.close()
        await peers.close()


async def test_an_unexpected_error_in_a_health_check_takes_that_backend_out_and_the_checks_go_on(caplog):
    """httpcore has raised AttributeError for an engine dying mid-connect; injected here at the HTTP
    client's transport, where such a bug comes from. Raised into the watcher, it ended every check."""
    calls: collections.Counter[int] = collections.Counter()

    def answer(request: httpx.Request) -> httpx.Response:
        calls[request.url.port] += 1
        if request.url.port == 8101 and calls[8101] == 1:
            raise AttributeError("'NoneType' object has no attribute 'read'")
        return httpx.Response(503 if request.url.port == 8101 else 200)

    pool = Pool([Backend.parse("prefill", "http://127.0.0.1:8101,tcp://127.0.0.1:5601")],
                [Backend.parse("decode", "http://127.0.0.1:8201,tcp://127.0.0.1:5701")], health_interval_s=0.01)
    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
        watcher = asyncio.ensure_future(pool.watch_health(client))
        try:
            async with asyncio.timeout(5):
                while calls[8101] < 3:
                    assert not watcher.done(), f"the health checks ended: {watcher.exception()!r}"
                    await asyncio.sleep(0.01)
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
    p, d = pool.prefill[0], pool.decode[0]
    assert not p.healthy and p.problem == "HTTP /health answered 503", p.problem
    assert d.healthy and calls[8201] >= 3
    assert "health check failed unexpectedly: AttributeError" in caplog.text
