"""Prometheus metrics scraped over HTTP from a running ``aiolayer node`` and from P's runtime.

One transfer completes and one is left to expire, so every family has something to count: bytes
moved, transfers by outcome, the bridge hand-off histogram, queue depths, per-peer health and
deadline expiries. The text is parsed with prometheus_client's own parser, so it is valid
exposition, not just strings that look right.
"""

from __future__ import annotations

import socket
import time

import httpx
import numpy as np
import pytest

from helpers_node import SMALL_SHAPE, apply_mc_env, spawn_node

apply_mc_env()

from prometheus_client.parser import text_string_to_metric_families

from aiolayer import NodeConfig, Runtime, TransferSpec
from aiolayer.config import Timeouts
from aiolayer.kvcache import PagedKVCache
from aiolayer.protocol import messages as m
from aiolayer.stats import LatencyHistogram

RECEIVE_S = 1.0


def samples(text: str) -> dict[tuple, float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(snap: dict, name: str, **labels) -> float | None:
    return snap.get((name, tuple(sorted(labels.items()))))


def _transfer(rt: Runtime, d: str, cache: PagedKVCache) -> None:
    alloc = rt.request(d, m.AllocRequest(transfer_id="ok-1", num_blocks=4, sender_control=rt.control_endpoint))
    rt.sender.begin_step(1, [TransferSpec.from_registration(alloc, src_blocks=[0, 1, 2, 3], peer=d)])
    for layer in range(SMALL_SHAPE.num_layers):
        rt.sender.layer_ready(1, layer)
    rt.sender.end_step(1)
    assert rt.sender.wait("ok-1", 15).ok


@pytest.mark.timeout(90)
def test_node_and_p_metrics_scraped_over_http():
    args = ("--metrics-port", "0", "--receive-timeout", str(RECEIVE_S), "--fence-grace", "2")
    with spawn_node(*args) as node:
        url = node.info["metrics"]
        assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics"), node.info
        rt = Runtime(NodeConfig(engine_id="metrics-p", metrics_port=0), Timeouts(control_call=5.0)).start()
        try:
            cache = PagedKVCache(SMALL_SHAPE)
            cache.buffer[:] = np.random.default_rng(1).integers(0, 256, cache.buffer.size, dtype=np.uint8)
            rt.register_kv_memory(cache.k_base, cache.v_base, SMALL_SHAPE.block_bytes, SMALL_SHAPE.num_blocks)
            d = node.info["control"]
            _transfer(rt, d, cache)
            # a transfer whose P fetched the layout and never wrote: D's receive deadline expires and it
            # fences through that P (which answers 'stopped': it runs nothing of it)
            never = rt.request(d, m.AllocRequest(transfer_id="never", num_blocks=1))
            rt.request(d, m.LayoutRequest(requester="metrics-p", transfer_id="never", token=never.token,
                                          control=rt.control_endpoint, incarnation=rt.incarnation))
            deadline = time.monotonic() + RECEIVE_S + 10
            while rt.request(d, m.StatusRequest(transfer_id="never")).state != "failed":
                assert time.monotonic() < deadline, "the receive deadline never ended the transfer"
                time.sleep(0.05)
            d_snap = samples(httpx.get(url, timeout=5).text)
            p_snap = samples(httpx.get(rt.metrics_url, timeout=5).text)
        finally:
            rt.stop()

    layer_bytes = 4 * SMALL_SHAPE.block_bytes * 2 * SMALL_SHAPE.num_layers
    assert value(d_snap, "aiolayer_bytes_received_total") == layer_bytes
    assert value(d_snap, "aiolayer_transfers_total", role="receive", outcome="finished") == 1
    assert value(d_snap, "aiolayer_transfers_total", role="receive", outcome="failed") == 1
    assert value(d_snap, "aiolayer_deadline_expiries_total", phase="receive") == 1
    assert value(d_snap, "aiolayer_receive_failures_total", cause="deadline") == 1   # failed before any KV landed
    assert value(d_snap, "aiolayer_receive_failures_total", cause="aborted") is None
    assert value(d_snap, "aiolayer_queue_depth", queue="receiving") == 0
    assert value(d_snap, "aiolayer_peer_up", peer=rt.control_endpoint) == 1      # D asked P to stop: P answered
    assert value(d_snap, "aiolayer_control_frames_total") >= 5

    assert value(p_snap, "aiolayer_bytes_sent_total") == layer_bytes
    assert value(p_snap, "aiolayer_transfers_total", role="send", outcome="finished") == 1
    assert value(p_snap, "aiolayer_bridge_handoff_seconds_count") == SMALL_SHAPE.num_layers
    assert value(p_snap, "aiolayer_bridge_handoff_seconds_bucket", le="+Inf") == SMALL_SHAPE.num_layers
    assert value(p_snap, "aiolayer_queue_depth", queue="bridge") == 0
    assert value(p_snap, "aiolayer_queue_depth", queue="writes_in_flight") == 0
    assert value(p_snap, "aiolayer_writes_peak_per_peer") >= 1      # the transfer's runs were in flight
    assert value(d_snap, "aiolayer_writes_peak_per_peer") == 0      # D wrote nothing
    assert value(p_snap, "aiolayer_peer_up", peer=d) == 1


@pytest.mark.timeout(30)
def test_metrics_endpoint_answers_only_get_metrics_and_survives_garbage():
    rt = Runtime(NodeConfig(engine_id="metrics-http", backend="memory", metrics_port=0)).start()
    try:
        host, port = rt.metrics_url.split("//")[1].split("/")[0].split(":")
        assert host == "127.0.0.1"                      # the control interface, never all interfaces
        assert httpx.get(rt.metrics_url.replace("/metrics", "/other"), timeout=5).status_code == 404
        assert httpx.post(rt.metrics_url, timeout=5).status_code == 405
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(b"\x00garbage without an end of head")
            s.shutdown(socket.SHUT_WR)
            assert s.recv(100).startswith(b"HTTP/1.0 400")
        assert httpx.get(rt.metrics_url, timeout=5).status_code == 200   # still serving
        assert "aiolayer_transfers_total" in rt.metrics_text()
    finally:
        rt.stop()


def test_latency_histogram_buckets_are_cumulative():
    h = LatencyHistogram((0.001, 0.01))
    for x in (0.0005, 0.001, 0.005, 0.5):
        h.observe(x)
    assert h.cumulative() == [(0.001, 2), (0.01, 3), (float("inf"), 4)]
    assert h.quantile(0.5) == 0.001 and h.quantile(0.75) == 0.01 and h.quantile(1.0) == float("inf")
    assert h.count == 4 and abs(h.sum - 0.5065) < 1e-12
    with pytest.raises(ValueError):
        LatencyHistogram((0.1, 0.01))
