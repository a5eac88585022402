"""``aiolayer proxy``'s ``/metrics`` (Prometheus text, each metric with its HELP) and its start-up log line.

The proxy runs as a real process in front of ``helpers_proxy.FakeEngine``s (real sockets); the
registry's isolation is checked in-process, where two proxies share one Python process.
"""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

import httpx
from prometheus_client.parser import text_string_to_metric_families

from aiolayer_vllm.proxy.app import ProxyState
from aiolayer_vllm.proxy.flow import ProxyTimeouts
from aiolayer_vllm.proxy.pool import Backend, Pool
from aiolayer.harness.pd import ProxyProcess
from helpers_proxy import proxied_pair, wait_for

pytestmark = pytest.mark.timeout(90)
HISTOGRAMS = ("aiolayer_proxy_time_to_first_token_seconds", "aiolayer_proxy_registration_seconds",
              "aiolayer_proxy_prefill_seconds", "aiolayer_proxy_relay_seconds", "aiolayer_proxy_request_seconds")


@pytest.fixture(scope="module")
def proxy():
    with proxied_pair("--health-interval", "0.2") as stack:   # the default log level and format
        yield stack["proxy"]


def _families(proxy: ProxyProcess) -> dict:
    r = httpx.get(proxy.url + "/metrics", timeout=5, trust_env=False)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4"), r.headers
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def _sample(families: dict, family: str, sample: str, **labels: str) -> float:
    values = [s.value for s in families[family].samples
              if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())]
    return sum(values)


def test_every_metric_has_help_and_a_stream_fills_the_stage_histograms(proxy):
    before = _families(proxy)
    for name in HISTOGRAMS:
        assert before[name].type == "histogram" and before[name].documentation, name
    for name in ("aiolayer_proxy_requests", "aiolayer_proxy_pending_transfers", "aiolayer_proxy_backend_healthy"):
        assert before[name].documentation, name
    with httpx.Client(timeout=30, trust_env=False) as client, \
            client.stream("POST", proxy.url + "/v1/completions", json={"prompt": "x", "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]", lines

    def counted() -> dict:
        after = _families(proxy)
        return {name: _sample(after, name, name + "_count") - _sample(before, name, name + "_count")
                for name in HISTOGRAMS}

    # P's answer may come after the stream's end: its histogram is filled when it does
    wait_for(lambda: all(v == 1 for v in counted().values()), 10, f"one of each stage: {counted()}")
    after = _families(proxy)
    ttft = HISTOGRAMS[0]
    assert _sample(after, ttft, ttft + "_sum") > _sample(before, ttft, ttft + "_sum")
    ok = "aiolayer_proxy_requests_total"
    assert _sample(after, "aiolayer_proxy_requests", ok, outcome="ok") == \
        _sample(before, "aiolayer_proxy_requests", ok, outcome="ok") + 1


def test_failed_requests_are_counted_by_outcome(proxy):
    before = _families(proxy)
    with httpx.Client(timeout=30, trust_env=False) as client:
        r = client.post(proxy.url + "/v1/completions", json={"prompt": "x", "fake": {"p_status": 500}})
    assert r.status_code == 502
    after = _families(proxy)
    name = "aiolayer_proxy_requests_total"
    assert _sample(after, "aiolayer_proxy_requests", name, outcome="prefill_error") == \
        _sample(before, "aiolayer_proxy_requests", name, outcome="prefill_error") + 1


def test_the_start_up_line_names_the_address_and_backends_at_the_default_level(proxy):
    assert proxy.log is not None
    proxy.log.seek(0)
    lines = proxy.log.read().decode(errors="replace").splitlines()
    start = [line for line in lines if "listening on " + proxy.url in line]
    assert len(start) == 1, lines[:5]
    assert "prefill http://" in start[0] and "decode http://" in start[0], start[0]


def test_two_proxies_in_one_process_keep_their_own_metrics():
    pools = [Pool([Backend("prefill", f"http://127.0.0.1:{9000 + i}", "tcp://127.0.0.1:1")], []) for i in range(2)]
    first, second = (ProxyState(pool, "http://127.0.0.1:1", ProxyTimeouts()) for pool in pools)
    first.metrics.requests.labels("ok").inc()
    first.metrics.ttft.observe(0.2)
    texts = [state.metrics.text().decode() for state in (first, second)]
    assert 'aiolayer_proxy_requests_total{outcome="ok"} 1.0' in texts[0]
    assert "aiolayer_proxy_requests_total{" not in texts[1]
    assert "aiolayer_proxy_time_to_first_token_seconds_count 1.0" in texts[0]
    assert "aiolayer_proxy_time_to_first_token_seconds_count 0.0" in texts[1]
    assert 'url="http://127.0.0.1:9000"' in texts[0] and 'url="http://127.0.0.1:9000"' not in texts[1]
