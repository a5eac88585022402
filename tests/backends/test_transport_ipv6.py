"""IPv6 addresses: the control plane binds and dials them (bracketed endpoints, ZMQ's IPv6 switch) and
a transfer completes between two runtimes on ::1; the mooncake backend, which cannot handshake over
IPv6, refuses one when the configuration is parsed."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import numpy as np
import pytest

from aiolayer import ConfigError, DecodeNode, NodeConfig, Runtime, TransferSpec
from aiolayer.errors import ControlRejected
from aiolayer.kvcache import PagedKVCache, checksums
from aiolayer.protocol import messages as m
from aiolayer.transport import Transport

pytestmark = pytest.mark.timeout(60)


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


needs_ipv6 = pytest.mark.skipif(not _has_ipv6_loopback(), reason="this host has no IPv6 loopback (::1)")
V6 = Transport(bind_host="::1")


@needs_ipv6
def test_a_transfer_between_two_runtimes_bound_on_ipv6_loopback_lands_intact(small_shape):
    d = DecodeNode(small_shape, NodeConfig(engine_id="d6", backend="memory", transport=V6))
    p = Runtime(NodeConfig(engine_id="p6", backend="memory", transport=V6, metrics_port=0))
    cache = PagedKVCache(small_shape)
    cache.buffer[:] = np.random.default_rng(6).integers(0, 256, cache.buffer.size, dtype=np.uint8)
    with p:
        d.start()
        try:
            assert d.control_endpoint.startswith("tcp://[::1]:") and p.control_endpoint.startswith("tcp://[::1]:")
            assert p.metrics_url.startswith("http://[::1]:")
            p.register_kv_memory(cache.k_base, cache.v_base, small_shape.block_bytes, small_shape.num_blocks)
            src = [3, 9, 4, 17]
            reg = p.request(d.control_endpoint, m.AllocRequest(transfer_id="v6", num_blocks=len(src)))
            assert isinstance(reg, m.AllocReply)
            p.sender.begin_step(0, [TransferSpec.from_registration(reg, src_blocks=src, peer=d.control_endpoint)])
            for layer in range(small_shape.num_layers):
                p.sender.layer_ready(0, layer)
            p.sender.end_step(0)
            out = p.sender.wait("v6", 10)
            assert out.ok, out.reason
            verified = p.request(d.control_endpoint, m.VerifyRequest(transfer_id="v6"), timeout=10)
            assert (verified.crc_k, verified.crc_v) == checksums(cache.blocks, src)
            with pytest.raises(ControlRejected):   # D dials P's IPv6 endpoint back: answered, nothing there
                d.runtime.request(p.control_endpoint, m.LookupRequest(transfer_id="none", token="t" * 32))
        finally:
            d.stop()


@needs_ipv6
def test_a_wildcard_ipv6_bind_serves_ipv4_peers_too():
    server = Runtime(NodeConfig(engine_id="dual", backend="memory", transport=Transport(bind_host="::")))
    client = Runtime(NodeConfig(engine_id="v4-client", backend="memory"))
    with server, client:
        port = server.control_endpoint.rsplit(":", 1)[1]
        for endpoint in (f"tcp://127.0.0.1:{port}", f"tcp://[::1]:{port}"):
            with pytest.raises(ControlRejected) as refused:
                client.request(endpoint, m.LookupRequest(transfer_id="x", token="t" * 32))
            assert refused.value.code == "not_registered"


@pytest.mark.parametrize("transport", [Transport(bind_host="::1"),
                                       Transport(bind_host="0.0.0.0", advertise_host="fd00::2")],
                         ids=["bind", "advertise"])
def test_mooncake_refuses_an_ipv6_host_when_the_config_is_parsed(transport):
    with pytest.raises(ConfigError, match="IPv6 is not supported with the mooncake backend"):
        NodeConfig(transport=transport)
    assert NodeConfig(transport=transport, backend="memory").transport == transport


@needs_ipv6
def test_node_cli_binds_an_ipv6_host_and_prints_a_bracketed_endpoint():
    cmd = [sys.executable, "-m", "aiolayer", "node", "--backend", "memory", "--bind-host", "::1", "--num-layers", "2",
           "--num-blocks", "8"]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            info = json.loads(proc.stdout.readline())
        finally:
            proc.terminate()
            proc.wait(10)
    assert info["control"].startswith("tcp://[::1]:"), info
    refused = subprocess.run(cmd[:-4] + ["--backend", "mooncake"], capture_output=True, text=True, timeout=30)
    assert refused.returncode == 1 and "IPv6 is not supported with the mooncake backend" in refused.stderr


def test_the_proxy_takes_bracketed_ipv6_control_endpoints():
    """What the runtime advertises for an IPv6 bind, the proxy's checks accept (and split per rank)."""
    pytest.importorskip("vllm", reason="the bridge's package imports vLLM")
    from aiolayer_vllm.params import check_endpoint
    from aiolayer_vllm.proxy.pool import Backend

    check_endpoint("tcp://[::1]:5600", "prefill_controls[0]")
    backend = Backend.parse("prefill", "http://[::1]:8100,tcp://[::1]:5600,tp=2")
    assert backend.controls == ["tcp://[::1]:5600", "tcp://[::1]:5601"]
    with pytest.raises(ValueError):
        check_endpoint("tcp://::1:5600", "prefill_controls[0]")   # unbracketed: host and port are ambiguous
