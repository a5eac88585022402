"""The P/D proxy in front of real vLLM CPU engines, end to end.

One P, one D (vLLM with AiolayerConnector) and ``aiolayer proxy`` as a real process (the folder's shared
pair, conftest.py). Requests through the proxy must give the same tokens as the aggregated engine (P
answering on its own); killing P fails the affected requests with a clear error in bounded time and D's
KV usage goes back to idle; a client that disconnects mid-stream makes D and P drop the request.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import httpx
import pytest

pytest.importorskip("vllm", reason="vLLM is installed by `make test`")

from aiolayer.harness.client import StreamError
from aiolayer.harness.servers import (acompletion, completion, kv_cache_usage, metric_value, parse_metrics,
                                     scrape_metrics)
from aiolayer.harness.tiny_model import SAMPLE_PROMPTS, long_prompt
from helpers_proxy import registration

pytestmark = [pytest.mark.timeout(600), pytest.mark.vllm]
MAX_TOKENS = 10


def test_concurrent_requests_through_the_proxy_equal_the_aggregated_engine(stack):
    p, proxy = stack["p"], stack["proxy"]
    prompts = [*SAMPLE_PROMPTS, *(long_prompt(20 + 13 * i, seed=i) for i in range(4))]
    baseline = {prompt: completion(p, prompt, max_tokens=MAX_TOKENS).token_ids for prompt in prompts}
    ok_before = _proxy_ok(proxy)

    async def burst():
        async with httpx.AsyncClient(timeout=120, trust_env=False) as client:
            jobs = [acompletion(proxy.url, prompts[i % len(prompts)], max_tokens=MAX_TOKENS, stream=bool(i % 2),
                                model=p.served_model, client=client, timeout_s=150) for i in range(20)]
            return await asyncio.gather(*jobs)

    outs = asyncio.run(burst())
    for i, out in enumerate(outs):
        assert out.token_ids == baseline[prompts[i % len(prompts)]], (i, out)
    metrics = httpx.get(proxy.url + "/metrics", timeout=5).text
    assert _proxy_ok(proxy) - ok_before == 20, metrics
    assert "aiolayer_proxy_pending_transfers 0" in metrics
    # at the proxy's default binding a plain model's requests go to P and D at once: no D-first wait
    prefill = next(b for b in httpx.get(proxy.url + "/health", timeout=5).json()["backends"] if b["role"] == "prefill")
    assert prefill["topology"]["late_binding"] is True, prefill
    bindings = parse_metrics(metrics)
    assert (metric_value(bindings, "aiolayer_proxy_bindings_total", binding="late") or 0) >= 20, metrics
    assert metric_value(bindings, "aiolayer_proxy_bindings_total", binding="d_first") is None, metrics


def _proxy_ok(proxy) -> float:
    """The proxy's count of requests that ended ok (the pair's proxy is shared: compare before and after)."""
    text = httpx.get(proxy.url + "/metrics", timeout=5).text
    found = re.search(r'^aiolayer_proxy_requests_total\{outcome="ok"\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def test_unknown_transfer_registration_is_a_404_with_a_json_error(stack):
    proxy = stack["proxy"]
    r = httpx.post(proxy.url + "/internal/aiolayer/registered", timeout=5,
                   json=registration("nope", "t" * 32, "x", "tcp://127.0.0.1:1"))
    assert r.status_code == 404 and r.json()["error"]["type"] == "unknown_transfer"
    assert httpx.post(proxy.url + "/internal/aiolayer/registered", timeout=5, content=b"{").status_code == 400
    models = httpx.get(proxy.url + "/v1/models", timeout=5)
    assert models.status_code == 200 and models.json()["data"]


def test_vllms_4xx_reach_the_client_through_the_proxy_unchanged(stack):
    """An unknown model (404) and a prompt past max_model_len (400): vLLM's own answers, byte for byte."""
    d, proxy = stack["d"], stack["proxy"]
    too_long = long_prompt(600, seed=3)   # past the 512 tokens of max_model_len
    cases = [({"model": "no-such-model", "prompt": "hello", "max_tokens": 2}, 404),
             ({"model": d.served_model, "prompt": too_long, "max_tokens": 2}, 400)]
    with httpx.Client(timeout=30, trust_env=False) as client:
        for body, status in cases:
            direct = client.post(d.base_url + "/v1/completions", json=body)
            assert direct.status_code == status, direct.text
            for stream in (False, True):
                through = client.post(proxy.url + "/v1/completions", json={**body, "stream": stream})
                assert (through.status_code, through.content) == (status, direct.content), (stream, through.text)
    assert "aiolayer_proxy_pending_transfers 0" in httpx.get(proxy.url + "/metrics", timeout=5).text


def test_client_disconnect_mid_stream_drops_the_request_on_d(stack):
    d, proxy, p = stack["d"], stack["proxy"], stack["p"]
    body = {"model": p.served_model, "prompt": long_prompt(60, seed=9), "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60, trust_env=False) as client:
        with client.stream("POST", proxy.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for i, _line in enumerate(r.iter_lines()):
                if i >= 3:
                    break   # leave mid-stream: the context manager closes the connection
    deadline = time.monotonic() + 20
    while (kv_cache_usage(d) or 0) > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert (kv_cache_usage(d) or 0) == 0, "D kept the disconnected request's KV"
    assert _running(d) == 0 and _running(p) == 0, "an engine still runs the disconnected request"
    assert "aiolayer_proxy_pending_transfers 0" in httpx.get(proxy.url + "/metrics", timeout=5).text


def _running(server) -> float:
    return metric_value(scrape_metrics(server), "vllm:num_requests_running") or 0.0


@pytest.mark.ends_pair
def test_killed_prefill_fails_in_flight_requests_visibly_and_d_frees_its_kv(stack):
    """Kills the shared P (marked ``ends_pair``: it runs after every other test of the pair)."""
    p, d, proxy = stack["p"], stack["d"], stack["proxy"]
    prompts = [long_prompt(30 + 7 * i, seed=20 + i) for i in range(10)]
    baseline = {x: completion(p, x, max_tokens=40).token_ids for x in prompts}
    pids = p.pids()

    async def burst():
        async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
            async def one(i: int):
                await asyncio.sleep(0.05 * i)          # requests keep arriving while P dies
                t0 = time.monotonic()
                try:
                    out = await acompletion(proxy.url, prompts[i], max_tokens=40, model=p.served_model,
                                            client=client, timeout_s=60, stream=bool(i % 2))
                    return "ok", out.token_ids == baseline[prompts[i]], time.monotonic() - t0
                except httpx.HTTPStatusError as exc:
                    r = exc.response
                    return r.status_code, "error" in r.json(), time.monotonic() - t0
                except StreamError as exc:   # D's stream was already relayed: P's error ends it
                    return exc.status, "message" in exc.error, time.monotonic() - t0

            async def kill():
                await asyncio.sleep(0.2)
                for pid in pids:
                    os.kill(pid, signal.SIGKILL)

            results = await asyncio.gather(*(one(i) for i in range(len(prompts))), kill())
            return results[:-1]

    results = asyncio.run(burst())
    failed = [r for r in results if r[0] != "ok"]
    assert failed, f"killing P failed no request: {results}"
    for status, body_ok, took in failed:   # a clear error, within the prefill/registration deadline
        assert status in (502, 503, 504) and body_ok and took < 45, results
    for status, same, _ in results:
        if status == "ok":
            assert same, results               # those P had served still decode correctly
    deadline = time.monotonic() + 40
    while ((kv_cache_usage(d) or 0) > 0 or _running(d) > 0) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert (kv_cache_usage(d) or 0) == 0 and _running(d) == 0, "D kept KV of requests whose P died"
    # the health check (every 2 s, 1 s probe) takes the dead P out: the proxy then refuses at once
    deadline = time.monotonic() + 10
    while True:
        r = httpx.post(proxy.url + "/v1/completions", timeout=10,
                       json={"model": p.served_model, "prompt": "x", "max_tokens": 2})
        if r.status_code == 503 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert r.status_code == 503 and r.json()["error"]["type"] == "no_backend", r.text
