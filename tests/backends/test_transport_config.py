"""Transport configuration: one struct, bind vs advertised host, RDMA refused clearly where
there is no device, and the vLLM connector's extra config decoded strictly into it."""

from __future__ import annotations

import ipaddress

import pytest

from aiolayer import ConfigError, ControlRejected, NodeConfig, Runtime
from aiolayer.errors import BackendError
from aiolayer.protocol import messages as m
from aiolayer.transport import Transport, check_rdma_devices, routed_host

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("fields, needle", [
    (dict(protocol="infiniband"), "transport protocol must be one of"),
    (dict(bind_host="localhost"), "bind_host must be an IP address"),
    (dict(advertise_host="0.0.0.0"), "not an address a peer can dial"),
    (dict(metadata_server="redis://meta:6379"), "metadata server must be"),
])
def test_a_bad_transport_is_refused_with_the_field_named(fields, needle):
    with pytest.raises(ConfigError, match=needle):
        Transport(**fields)


def test_the_advertised_host_is_never_a_wildcard():
    assert Transport().advertised() == "127.0.0.1"                                  # the safe default
    assert Transport(bind_host="10.1.2.3").advertised() == "10.1.2.3"
    assert Transport(bind_host="0.0.0.0", advertise_host="10.9.9.9").advertised() == "10.9.9.9"
    routed = Transport(bind_host="0.0.0.0").advertised()
    assert routed == routed_host() and routed not in ("0.0.0.0", "::")
    ipaddress.ip_address(routed)


def test_rdma_without_a_device_is_refused_naming_what_is_missing(tmp_path):
    with pytest.raises(BackendError, match="needs an RDMA device, and this host has none"):
        check_rdma_devices("", root=str(tmp_path / "absent"))
    (tmp_path / "mlx5_0").mkdir()
    with pytest.raises(BackendError, match="RDMA device mlx5_1 not found; this host has mlx5_0"):
        check_rdma_devices("mlx5_0,mlx5_1", root=str(tmp_path))
    assert check_rdma_devices("mlx5_0", root=str(tmp_path)) == ["mlx5_0"]


def test_rdma_requested_here_fails_at_start_not_later():
    rt = Runtime(NodeConfig(engine_id="rdma", transport=Transport(protocol="rdma")))
    with pytest.raises(BackendError, match="rdma"):
        rt.start()
    assert not rt.loop_thread.alive


def test_a_wildcard_bind_advertises_a_dialable_address():
    server = Runtime(NodeConfig(engine_id="wild", backend="memory", transport=Transport(bind_host="0.0.0.0")))
    client = Runtime(NodeConfig(engine_id="client", backend="memory"))
    with server, client:
        host = server.control_endpoint.removeprefix("tcp://").rsplit(":", 1)[0]
        assert host == routed_host() and host != "0.0.0.0"
        with pytest.raises(ControlRejected) as refused:   # reached, and answered: nothing registered
            client.request(server.control_endpoint, m.LookupRequest(transfer_id="x", token="t" * 32))
        assert refused.value.code == "not_registered"


def test_connector_config_is_decoded_strictly():
    pytest.importorskip("vllm", reason="the connector's package imports vLLM")
    from aiolayer_vllm.config import from_extra_config

    config = from_extra_config({"control_port": 5600, "transport": {"bind_host": "0.0.0.0", "protocol": "tcp"},
                                "timeouts": {"receive": 30}}, "eng")
    assert config.node.transport.bind_host == "0.0.0.0" and config.node.control_port == 5600
    assert config.node.engine_id == "eng" and config.timeouts.receive == 30 and not config.debug_zero_received
    assert config.transfer_mode == "layerwise"
    assert from_extra_config({"transfer_mode": "auto"}, "e").transfer_mode == "auto"
    for bad, needle in ((dict(debug_zero_received="false"), "unknown field"),      # test switches are not config
                        (dict(control_port="5600"), "Expected `int`"),
                        (dict(transport={"host": "1.2.3.4"}), "unknown field"),
                        (dict(transport={"protocol": "rdma2"}), "transport protocol must be one of"),
                        (dict(layerwise_min_tokens=-1), "layerwise_min_tokens must be >= 0"),
                        (dict(transfer_mode="layer-wise"), "transfer_mode must be one of layerwise, bulk, auto"),
                        (dict(transfer_mode="auto", layerwise_min_tokens=512), "applies to transfer_mode layerwise")):
        with pytest.raises(ConfigError, match=needle):
            from_extra_config(bad, "eng")


def test_a_wildcard_proxy_host_needs_a_public_url():
    pytest.importorskip("vllm", reason="the proxy's package imports the connector's")
    from aiolayer_vllm.proxy.server import public_url

    with pytest.raises(ValueError, match="--public-url"):
        public_url("0.0.0.0", 8000, "")
    assert public_url("0.0.0.0", 8000, "http://10.0.0.5:8000/") == "http://10.0.0.5:8000"
    assert public_url("10.0.0.5", 8000, "") == "http://10.0.0.5:8000"
    assert public_url("::1", 8000, "") == "http://[::1]:8000"
    for wrong in ("10.0.0.5:8000", "http://0.0.0.0:8000", "ftp://10.0.0.5"):   # D could not dial these
        with pytest.raises(ValueError, match="--public-url"):
            public_url("10.0.0.5", 8000, wrong)


PAIR = ["--prefill", "http://127.0.0.1:8100,tcp://127.0.0.1:5600", "--decode", "http://127.0.0.1:8200,tcp://127.0.0.1:5700"]


@pytest.mark.parametrize("extra, needle", [
    (["--port", "70000"], "--port must be in 1..65535"),
    (["--port", "0"], "--port must be in 1..65535"),
    (["--health-interval", "0"], "--health-interval must be > 0"),
    (["--request-timeout", "-1"], "--request-timeout must be > 0"),
    (["--registration-timeout", "inf"], "--registration-timeout must be > 0 and at most"),
    (["--prefill-timeout", "nan"], "--prefill-timeout must be > 0"),
    (["--control-wait-s", "0"], "--control-wait-s must be > 0"),
    (["--public-url", "http://0.0.0.0:8000"], "names every interface"),
    (["--decode", "http://127.0.0.1:8200,tcp://127.0.0.1:5700", "http://127.0.0.1:8200,tcp://127.0.0.1:5700"],
     "--decode lists a server twice"),
    (["--decode", "http://127.0.0.1:8100,tcp://127.0.0.1:5700"], "is given with both"),   # P's URL, D's control
    (["--decode", "http://127.0.0.1:8200,tcp://127.0.0.1:5600"], "is given with both"),   # D's URL, P's control
])
def test_the_proxy_refuses_arguments_that_would_only_fail_later(extra, needle, capsys):
    """Exit 2 with the reason before any backend is asked: a port the OS would take modulo 65536, a
    deadline of 0 or less (every request a 504) or a health interval of 0 (the loop spins), a public URL
    D cannot dial, a server listed twice or a URL and control socket that do not pair up."""
    pytest.importorskip("vllm", reason="the proxy's package imports the connector's")
    import argparse

    from aiolayer_vllm.proxy.server import add_proxy_args, run_proxy

    parser = argparse.ArgumentParser()
    add_proxy_args(parser)
    args = parser.parse_args(PAIR + extra)
    assert run_proxy(args) == 2
    assert needle in capsys.readouterr().err

