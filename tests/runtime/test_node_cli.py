"""``aiolayer node``: one JSON line on stdout, a control socket that answers, a clean exit on signals.

Every test here runs the real command in a subprocess (``helpers_node.spawn_node``) with the
Mooncake backend, as an operator or the benchmark would start it.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from aiolayer import NodeConfig, Runtime
from aiolayer.backends.memory import MemoryBackend
from aiolayer.errors import ControlRejected
from aiolayer.protocol import messages as m

from aiolayer.harness.procs import free_port
from helpers_node import SMALL_SHAPE, apply_mc_env, run_node_cli, spawn_node

apply_mc_env()

ENDPOINT_RE = re.compile(r"^tcp://127\.0\.0\.1:(\d+)$")
STOP_LIMIT_S = 5.0


@pytest.fixture
def p_runtime():
    """A P-side runtime (memory backend: only its control client is used here)."""
    rt = Runtime(NodeConfig(engine_id="p", backend="memory")).start()
    try:
        yield rt
    finally:
        rt.stop()


def _check_layout(reply: m.Message, info: dict) -> None:
    shape = SMALL_SHAPE
    assert isinstance(reply, m.LayoutReply), reply
    assert reply.engine_id == info["engine_id"]
    assert reply.incarnation == info["incarnation"]
    assert reply.session == info["session"]
    assert reply.block_bytes == shape.block_bytes
    assert reply.num_blocks == shape.num_blocks
    assert len(reply.layers) == shape.num_layers
    # one buffer laid out K0, V0, K1, V1, ...: each region is one layer's K or V tensor
    bases = [b for region in reply.layers for b in (region.k_base, region.v_base)]
    assert all(b > 0 for b in bases)
    assert [b - bases[0] for b in bases] == [i * shape.layer_bytes for i in range(len(bases))]


def _layout_of(p_runtime, control: str, tid: str) -> m.LayoutReply:
    """D shows its layout only for a transfer it registered: allocate one, then ask with its token."""
    alloc = p_runtime.request(control, m.AllocRequest(transfer_id=tid, num_blocks=1), timeout=5)
    reply = p_runtime.request(control, m.LayoutRequest(requester="p", transfer_id=tid, token=alloc.token), timeout=5)
    assert isinstance(reply, m.LayoutReply), reply
    return reply


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_node_prints_one_json_line_answers_layout_and_exits_cleanly(sig, p_runtime):
    with spawn_node() as node:
        info = node.info
        assert ENDPOINT_RE.match(info["control"]), info
        assert info["backend"] == "mooncake"
        assert info["num_blocks"] == SMALL_SHAPE.num_blocks
        assert re.match(r"^127\.0\.0\.1:\d+$", info["session"]), info  # Mooncake's P2PHANDSHAKE name
        assert len(info["incarnation"]) == 32

        _check_layout(_layout_of(p_runtime, info["control"], "cli-layout"), info)
        # the socket keeps answering, and tells a D-only message apart from a bad one
        status = p_runtime.request(info["control"], m.StatusRequest(transfer_id="nope"), timeout=5)
        assert isinstance(status, m.StatusReply) and status.state == "unknown"
        with pytest.raises(ControlRejected) as exc:
            p_runtime.request(info["control"], m.LayoutReply(
                engine_id="x", incarnation="y", session="z", block_bytes=1, num_blocks=1, layers=[]),
                timeout=5)
        assert exc.value.code == "unknown"

        rc = node.stop(sig, timeout=STOP_LIMIT_S + 5)
        assert not node.killed, f"node ignored {sig.name}\n{node.stderr_text()}"
        assert rc == 0, f"exit status {rc} after {sig.name}\n{node.stderr_text()}"
        assert node.stop_s < STOP_LIMIT_S, f"stop took {node.stop_s:.2f}s"
        # exactly one line on stdout: nothing before the JSON, nothing after it
        assert node.rest_stdout == b"", node.rest_stdout


@pytest.mark.timeout(60)
def test_control_socket_binds_loopback_by_default():
    with spawn_node() as node:
        match = ENDPOINT_RE.match(node.control)
        assert match, node.info
        port = int(match.group(1))
        listeners = _listening_addresses(port)
        if listeners is not None:
            assert listeners, f"nothing listens on port {port}"
            assert listeners == {"127.0.0.1"}, f"port {port} listens on {listeners}"
        # and it really is reachable there
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
        assert node.stop() == 0, node.stderr_text()


@pytest.mark.timeout(60)
def test_explicit_port_and_engine_id(p_runtime):
    port = free_port()
    with spawn_node("--host", "127.0.0.1", "--port", str(port), "--engine-id", "d-cli") as node:
        assert node.control == f"tcp://127.0.0.1:{port}"
        assert node.info["engine_id"] == "d-cli"
        assert _layout_of(p_runtime, node.control, "cli-port").engine_id == "d-cli"
        assert node.stop() == 0, node.stderr_text()


@pytest.mark.timeout(90)
def test_port_in_use_exits_nonzero_with_message():
    with spawn_node() as first:
        port = ENDPOINT_RE.match(first.control).group(1)
        with spawn_node("--port", port, wait=False) as second:
            try:
                rc = second.proc.wait(30)
            except Exception:  # noqa: BLE001 - report below with the node's stderr
                pytest.fail(f"second node on a busy port did not exit\n{second.stderr_text()}")
            assert rc not in (0, None)
            assert "cannot bind control socket" in second.stderr_text(), second.stderr_text()
            second.stop()
            assert second.rest_stdout == b"", "a node that failed to start must print no JSON line"
        assert first.proc.poll() is None, "the first node must be unaffected"
        assert first.stop() == 0, first.stderr_text()


@pytest.mark.timeout(60)
def test_health_answers_ok_with_the_nodes_identity(p_runtime):
    with spawn_node("--metrics-port", "0", "--engine-id", "d-health") as node:
        url = node.info["metrics"].replace("/metrics", "/health")
        reply = httpx.get(url, timeout=5)
        assert reply.status_code == 200, reply.text
        assert reply.headers["content-type"] == "application/json"
        body = reply.json()
        assert body["status"] == "ok" and "reason" not in body, body
        assert body["engine_id"] == "d-health"
        assert (body["incarnation"], body["control"]) == (node.info["incarnation"], node.control)
        assert httpx.get(node.info["metrics"], timeout=5).status_code == 200   # /metrics still there
        assert node.stop() == 0, node.stderr_text()


class _SlowClose(MemoryBackend):
    """Closes only once the test let it: the runtime stays in its stopping phase meanwhile."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    async def close(self) -> None:
        deadline = time.monotonic() + 10
        while not self.release.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await super().close()


def _wait_health(url: str, status: int, limit: float = 5.0) -> dict:
    end = time.monotonic() + limit
    while True:
        try:
            reply = httpx.get(url, timeout=2)
            if reply.status_code == status:
                return reply.json()
        except httpx.HTTPError:
            pass
        assert time.monotonic() < end, f"/health never answered {status}"
        time.sleep(0.02)


@pytest.mark.timeout(30)
def test_health_answers_503_once_the_runtime_is_stopping():
    backend = _SlowClose()
    rt = Runtime(NodeConfig(engine_id="h-stop", backend="memory", metrics_port=0), backend=backend).start()
    url = rt.metrics_url.replace("/metrics", "/health")
    stopper = threading.Thread(target=rt.stop)
    try:
        assert httpx.get(url, timeout=5).json()["status"] == "ok"
        stopper.start()
        body = _wait_health(url, 503)
        assert body["status"] == "unavailable" and body["reason"] == "stopping", body
        assert body["engine_id"] == "h-stop"
    finally:
        backend.release.set()
        if stopper.ident is not None:
            stopper.join(15)
        else:
            rt.stop()
    with pytest.raises(httpx.HTTPError):   # once stopped, nothing listens
        httpx.get(url, timeout=2)


@pytest.mark.timeout(30)
def test_health_answers_503_when_the_control_socket_is_gone():
    rt = Runtime(NodeConfig(engine_id="h-sock", backend="memory", metrics_port=0)).start()
    try:
        url = rt.metrics_url.replace("/metrics", "/health")
        assert httpx.get(url, timeout=5).status_code == 200
        rt.loop_thread.call(rt.server.close(), timeout=5)
        reply = httpx.get(url, timeout=5)
        assert reply.status_code == 503, reply.text
        assert reply.json()["reason"] == "control socket not bound"
    finally:
        rt.stop()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args, rc, needle", [
    (["--dtype", "nonsense"], 2, "invalid choice: 'nonsense'"),
    (["--num-layers", "four"], 2, "invalid int value"),
    (["--backend", "rdma"], 2, "invalid choice: 'rdma'"),
    (["--role", "prefill"], 2, "only --role decode"),
    (["--num-layers", "0"], 1, "num_layers must be 1 to 16,777,216, got 0"),
    (["--num-blocks", "1000000000"], 1, "num_blocks must be 1 to 16,777,216"),   # numpy's traceback before
    (["--engine-id", "x" * 1025], 1, "engine_id must be 1 to 1024 printable characters"),
    (["--host", "localhost"], 1, "bind_host must be an IP address"),
    (["--port", "70000"], 1, "control_port out of range"),
    (["--advertise-host", "0.0.0.0"], 1, "is not an address a peer can dial"),
    (["--metadata-server", "redis://x"], 1, "metadata server must be P2PHANDSHAKE"),
    # RDMA asked for on a host without a device fails at start, naming what is missing
    (["--protocol", "rdma"], 1, "transport protocol 'rdma' needs an RDMA device"),
], ids=["dtype", "int", "backend", "prefill", "zero-layers", "huge-cache", "long-engine-id", "hostname",
        "port-range", "advertise-wildcard",
        "metadata-scheme", "rdma-without-device"])
def test_bad_arguments_exit_nonzero_with_message(args, rc, needle):
    result = run_node_cli("node", *args)
    assert result.returncode == rc, (result.returncode, result.stderr)
    assert needle in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert result.stdout == "", "no JSON line may be printed on a failed start"


@pytest.mark.timeout(60)
def test_no_subcommand_is_an_error():
    result = run_node_cli()
    assert result.returncode == 2
    assert "usage:" in result.stderr


def _listening_addresses(port: int) -> set[str] | None:
    """IPv4/IPv6 addresses in LISTEN on ``port`` from /proc/net (None where /proc is absent)."""
    found: set[str] = set()
    any_table = False
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        path = Path(table)
        if not path.exists():
            continue
        any_table = True
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            local, state = fields[1], fields[3]
            addr_hex, port_hex = local.split(":")
            if state != "0A" or int(port_hex, 16) != port:
                continue
            found.add(_decode_addr(addr_hex, v6))
    return found if any_table else None


def _decode_addr(addr_hex: str, v6: bool) -> str:
    raw = bytes.fromhex(addr_hex)
    if not v6:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    # /proc prints IPv6 as four little-endian 32-bit words
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    text = socket.inet_ntop(socket.AF_INET6, words)
    return text[7:] if text.startswith("::ffff:") else text


HARNESS_THEN_HANG = """
import sys, time
from aiolayer.config import KVShape
from aiolayer.harness.node import NodeProcess
node = NodeProcess(KVShape(num_layers=2, num_blocks=8, block_size=4, kv_heads=1, head_dim=8), backend="memory")
node.start()
print(node.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(60)
def test_a_node_the_harness_started_stops_when_the_harness_is_killed():
    """A bench killed with SIGKILL (OOM, a CI's hard stop) runs no clean-up: its node, 800 MB with
    Mooncake, stayed behind reparented to init. It now notices its parent is gone and stops."""
    import subprocess
    import sys

    from aiolayer.harness.procs import pid_alive

    harness = subprocess.Popen([sys.executable, "-c", HARNESS_THEN_HANG], stdout=subprocess.PIPE, text=True,
                               start_new_session=True)
    node_pid = 0
    try:
        node_pid = int(harness.stdout.readline())
        assert pid_alive(node_pid)
        harness.kill()
        harness.wait(10)
        deadline = time.monotonic() + 10
        while pid_alive(node_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not pid_alive(node_pid), "the node outlived the harness that started it"
    finally:
        harness.kill()
        harness.wait(10)
        if node_pid and pid_alive(node_pid):
            os.kill(node_pid, signal.SIGKILL)
