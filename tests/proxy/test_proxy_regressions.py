"""Regressions of the proxy (request bodies, streams that end early, load balancing, headers), against
``aiolayer proxy`` as a real process.

The engines are small fake vLLM servers (``helpers_proxy.FakeEngine``: uvicorn in threads of this
process, real sockets). Each has a real aiolayer control socket, so the proxy's ``AbortRequest`` to D
is observed, not assumed. The proxy's state is read only from its ``/metrics`` and ``/health``.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import time

import pytest

pytest.importorskip("fastapi")

import httpx

from aiolayer.harness.pd import ProxyProcess
from aiolayer.harness.servers import metric_value, parse_metrics
from helpers_node import freeze
from helpers_proxy import FakeEngine, Hub, proxied_pair, wait_for as _wait_for

pytestmark = pytest.mark.timeout(90)


class FakeStackProxy(ProxyProcess):
    """``aiolayer proxy`` in front of fake engines, with short deadlines and a look at its tables."""

    def __init__(self, prefill: list[FakeEngine], decode: list[FakeEngine]) -> None:
        super().__init__([f"{e.url},{e.control}" for e in prefill], [f"{e.url},{e.control}" for e in decode],
                         startup_timeout_s=60, extra_args=(
                             "--health-interval", "0.2", "--registration-timeout", "5", "--prefill-timeout", "10",
                             "--request-timeout", "30"))

    def outstanding(self) -> dict[str, int]:
        backends = httpx.get(self.url + "/health", timeout=5, trust_env=False).json()["backends"]
        return {b["url"]: b["outstanding"] for b in backends}

    def pending(self) -> int:
        text = httpx.get(self.url + "/metrics", timeout=5, trust_env=False).text
        value = metric_value(parse_metrics(text), "aiolayer_proxy_pending_transfers")
        if value is None:
            raise AssertionError("no aiolayer_proxy_pending_transfers in /metrics")
        return int(value)

    def idle(self) -> bool:
        return self.pending() == 0 and not any(self.outstanding().values())


@pytest.fixture(scope="module")
def stack():
    """One P, two Ds and the proxy, shared: each test starts and ends with the proxy idle."""
    hub = Hub()
    engines = [FakeEngine("prefill", "p", hub), FakeEngine("decode", "d1", hub), FakeEngine("decode", "d2", hub)]
    try:
        for e in engines:
            e.start()
        proxy = FakeStackProxy(engines[:1], engines[1:]).start()
        try:
            yield {"hub": hub, "p": engines[0], "d1": engines[1], "d2": engines[2], "proxy": proxy}
        finally:
            proxy.stop()
    finally:
        for e in engines:
            e.stop()


def _client() -> httpx.Client:
    return httpx.Client(timeout=30, trust_env=False)


def _last_transfer(engine: FakeEngine) -> str:
    return engine.requests[-1]["kv_transfer_params"]["aiolayer"]["transfer_id"]


def test_least_outstanding_picks_the_idle_d_while_another_streams(stack):
    """The lease on D lasts the whole stream: short requests go to the idle D, not the streaming one."""
    proxy, p, d1, d2, hub = stack["proxy"], stack["p"], stack["d1"], stack["d2"], stack["hub"]
    _wait_for(proxy.idle, 10, "the proxy is idle")
    seen = {e.name: len(e.requests) for e in (d1, d2)}
    long_body = {"prompt": "long", "stream": True, "fake": {"chunks": 2000, "interval_s": 0.02, "until": "long"}}
    with _client() as client, client.stream("POST", proxy.url + "/v1/completions", json=long_body) as long:
        assert long.status_code == 200
        lines = long.iter_lines()
        assert next(line for line in lines if line.startswith("data: ")).startswith("data: {")   # decoding
        streaming = d1 if len(d1.requests) > seen["d1"] else d2
        idle = d2 if streaming is d1 else d1
        # P's part ended with its answer (which may come after D's first token); D's lasts while it streams
        _wait_for(lambda: proxy.outstanding()[p.url] == 0, 10, "P's lease released with its answer")
        assert proxy.outstanding() == {p.url: 0, streaming.url: 1, idle.url: 0}
        for i in range(4):
            r = client.post(proxy.url + "/v1/completions", json={"prompt": f"short {i}", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["engine"] == idle.name, (i, r.text)
        assert len(streaming.requests) == seen[streaming.name] + 1
        hub.event("long").set()
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]", rest[-3:]
    assert streaming.streams[_last_transfer(streaming)] == "completed"
    _wait_for(proxy.idle, 10, "every lease released after the stream ended")


def _raw_stream_request(proxy: ProxyProcess, body: dict) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return sock


def _decode_of(stack, transfer_id: str) -> FakeEngine:
    return next(d for d in (stack["d1"], stack["d2"]) if d.saw(transfer_id))


def test_client_gone_before_the_first_chunk_releases_table_leases_and_ds_stream(stack):
    proxy, p = stack["proxy"], stack["p"]
    body = {"prompt": "slow first token", "stream": True, "fake": {"hold_s": 60, "chunks": 2}}
    # (a) D holds its first token: D stays leased until the client leaves
    _wait_for(proxy.idle, 10, "the proxy is idle")
    asked = len(p.requests)
    sock = _raw_stream_request(proxy, body)
    _wait_for(lambda: len(p.requests) > asked, 10, "P got the prefill")
    # no status line before D's first token (a failure until then is still an HTTP error)
    sock.settimeout(0.5)
    with pytest.raises(TimeoutError):
        sock.recv(4096)
    tid = _last_transfer(p)
    d = _decode_of(stack, tid)
    assert proxy.outstanding()[d.url] == 1 and proxy.pending() == 1
    sock.close()
    _wait_for(lambda: proxy.idle() and d.streams.get(tid) == "closed", 10, "released after the client left")
    assert tid in d.aborts

    # (b) the client leaves while P's answer arrives: the proxy (frozen meanwhile, as under load) sees both
    # at once, and the exchange completes before its disconnect watcher runs
    p.gate.clear()
    try:
        sock = _raw_stream_request(proxy, body)
        _wait_for(lambda: len(p.requests) and _last_transfer(p) != tid, 10, "P got the prefill")
        tid = _last_transfer(p)
        d = _decode_of(stack, tid)
        freeze(proxy.proc.pid)   # every thread stopped before P answers and the client leaves
        try:
            p.gate.set()
            sock.close()
            _wait_for(lambda: stack["hub"].event("prefilled " + tid).is_set(), 10, "P answered")
            time.sleep(0.3)
        finally:
            os.kill(proxy.proc.pid, signal.SIGCONT)
    finally:
        p.gate.set()
    _wait_for(lambda: proxy.idle() and d.streams.get(tid) == "closed", 10,
              f"released after the client left (pending {proxy.pending()}, {proxy.outstanding()}, {d.streams})")


def test_d_failing_mid_stream_ends_in_an_error_event_and_an_abort(stack):
    proxy = stack["proxy"]
    _wait_for(proxy.idle, 10, "the proxy is idle")
    body = {"prompt": "doomed", "stream": True, "fake": {"chunks": 5, "fail_at": 2}}
    with _client() as client, client.stream("POST", proxy.url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert len(events) == 3 and "[DONE]" not in events[-1], events
    error = json.loads(events[-1][len("data: "):])["error"]
    assert error["type"] == "decode_error" and error["code"] == 502, error
    tid = _last_transfer(stack["p"])
    _wait_for(proxy.idle, 10, "every lease released")
    assert tid in _decode_of(stack, tid).aborts


def test_a_stream_ends_at_the_request_timeout_with_an_error_event_and_an_abort():
    """--request-timeout bounds D's whole answer, not only its first byte or each read."""
    with proxied_pair("--request-timeout", "2", "--health-interval", "0.5") as pair:
        body = {"prompt": "endless", "stream": True, "fake": {"chunks": 40, "interval_s": 0.25}}
        started = time.monotonic()
        with _client() as client, client.stream("POST", pair["proxy"].url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        took = time.monotonic() - started
        error = json.loads(events[-1][len("data: "):])["error"]
        assert error["type"] == "decode_timeout" and error["code"] == 504, events[-3:]
        assert 2.0 <= took < 3.5 and 3 <= len(events) < 12, (took, len(events))
        tid = _last_transfer(pair["p"])
        _wait_for(lambda: tid in pair["d"].aborts and pair["d"].streams.get(tid) == "closed", 10,
                  f"D told to abort and its stream closed: {pair['d'].streams}")


def test_a_client_that_stops_reading_is_let_go_at_the_request_timeout():
    """The client reads the status line, then nothing: the proxy's writes block once the socket's buffers
    are full. At --request-timeout the proxy gives the stream up (its last event within a few seconds
    more), tells D to abort, closes D's stream and releases its leases, with the client still connected."""
    with proxied_pair("--request-timeout", "2", "--health-interval", "0.5") as pair:
        proxy, d = pair["proxy"], pair["d"]
        body = {"prompt": "unread", "stream": True, "fake": {"chunks": 100_000, "pad": 4096}}
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)   # before connect: a small window
        try:
            sock.settimeout(10)
            sock.connect(("127.0.0.1", proxy.port))
            data = json.dumps(body).encode()
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
            assert sock.recv(12) == b"HTTP/1.1 200"
            started = time.monotonic()
            _wait_for(lambda: d.streams and all(v == "closed" for v in d.streams.values()), 15,
                      f"D's stream closed while the client reads nothing: {d.streams}")
            took = time.monotonic() - started
            tid = _last_transfer(pair["p"])
            assert tid in d.aborts and took < 2 + 5 + 3, (took, d.aborts)   # request timeout + TAIL_S + slack
            _wait_for(lambda: metric_value(parse_metrics(httpx.get(proxy.url + "/metrics", timeout=5,
                                                                   trust_env=False).text),
                                           "aiolayer_proxy_pending_transfers") == 0, 10, "the request table empty")
        finally:
            sock.close()


def test_ds_stream_is_closed_when_the_exchange_fails_after_its_status_line(stack):
    """D answered its status line but never registered: the 504 closes D's call (vLLM then aborts it)."""
    proxy = stack["proxy"]
    _wait_for(proxy.idle, 10, "the proxy is idle")
    body = {"prompt": "lost", "stream": True, "fake": {"register": False}}
    with _client() as client:
        r = client.post(proxy.url + "/v1/completions", json=body)
    assert r.status_code == 504 and r.json()["error"]["type"] == "registration_timeout", r.text
    d = next(d for d in (stack["d1"], stack["d2"]) if d.requests and d.requests[-1]["prompt"] == "lost")
    tid = _last_transfer(d)
    _wait_for(lambda: proxy.idle() and d.streams.get(tid) == "closed", 10, f"D's stream closed: {d.streams}")


BAD_REQUESTS = [
    ("/v1/completions", {"prompt": "x", "n": 2}, "n > 1"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, "best_of > 1"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 2}, "n > 1"),
    ("/v1/completions", {"prompt": "x", "n": "2"}, "n must be an integer"),
    ("/v1/completions", {"prompt": "x", "use_beam_search": True, "n": 1}, "beam search"),
    # vLLM makes one engine request per prompt of a batch, each with the request's one kv_transfer_params
    ("/v1/completions", {"prompt": ["a", "b"]}, "a batch of 2 prompts"),
    ("/v1/completions", {"prompt": [[1, 2], [3, 4], [5]]}, "a batch of 3 prompts"),
]


def test_parallel_samples_are_refused_with_a_400_before_any_engine_sees_them(stack):
    proxy, engines = stack["proxy"], [stack["p"], stack["d1"], stack["d2"]]
    _wait_for(proxy.idle, 10, "the proxy is idle")
    seen = [len(e.requests) for e in engines]
    with _client() as client:
        for path, body, message in BAD_REQUESTS:
            r = client.post(proxy.url + path, json=body)
            assert r.status_code == 400, (body, r.text)
            error = r.json()["error"]
            assert error["type"] == "invalid_request" and error["code"] == 400 and message in error["message"]
        assert [len(e.requests) for e in engines] == seen, "a refused request reached an engine"
        assert proxy.idle()
        ok = client.post(proxy.url + "/v1/completions", json={"prompt": "x", "n": 1, "best_of": 1})
        assert ok.status_code == 200, ok.text


def test_bad_bodies_are_a_400_and_affect_nothing_else(stack):
    proxy, hub = stack["proxy"], stack["hub"]
    _wait_for(proxy.idle, 10, "the proxy is idle")
    bad = [(json.dumps({"prompt": "x", "kv_transfer_params": {"aiolayer": {"transfer_id": "mine"}}}),
            "kv_transfer_params"),
           (json.dumps({"prompt": "x", "stream": "false"}), "stream must be true or false"),
           (json.dumps({"prompt": "x", "stream": 1}), "stream must be true or false"),
           (json.dumps(["prompt", "x"]), "JSON object"), ("{", "not JSON"), (b"\xff\xfe", "not JSON"),
           # json.loads takes these, but no engine request can carry them (they went out as a 502 "D failed")
           ('{"prompt": "x", "temperature": NaN}', "NaN"), ('{"prompt": "x", "top_p": -Infinity}', "-Infinity"),
           ('{"prompt": "x\\ud800"}', "unpaired UTF-16 surrogate")]
    body = {"prompt": "bystander", "stream": True, "fake": {"chunks": 2000, "interval_s": 0.02, "until": "bystander"}}
    with _client() as client, client.stream("POST", proxy.url + "/v1/completions", json=body) as bystander:
        lines = bystander.iter_lines()
        assert next(line for line in lines if line.startswith("data: ")).startswith("data: {")
        seen = [len(e.requests) for e in (stack["p"], stack["d1"], stack["d2"])]
        for content, message in bad:
            r = client.post(proxy.url + "/v1/completions", content=content,
                            headers={"content-type": "application/json"})
            assert r.status_code == 400 and message in r.json()["error"]["message"], (content, r.text)
            assert r.json()["error"]["type"] == "invalid_request"
        assert [len(e.requests) for e in (stack["p"], stack["d1"], stack["d2"])] == seen
        hub.event("bystander").set()
        assert [line for line in lines if line][-1] == "data: [DONE]"   # the stream in flight went on untouched
    ok = httpx.post(proxy.url + "/v1/completions", json={"prompt": "x", "stream": False}, timeout=30, trust_env=False)
    assert ok.status_code == 200, ok.text
    _wait_for(proxy.idle, 10, "every lease released")


def test_a_body_over_the_limit_is_a_413_before_it_is_read(stack):
    """Content-Length past the proxy's cap: answered at once, with only the headers and one byte sent
    (the proxy would otherwise wait for, and hold, all 300 MB); no engine sees it, the next request runs."""
    proxy = stack["proxy"]
    _wait_for(proxy.idle, 10, "the proxy is idle")
    seen = [len(e.requests) for e in (stack["p"], stack["d1"], stack["d2"])]
    host, port = proxy.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 300000000\r\n\r\n{")
        answer = b""
        while b"limit" not in answer and (chunk := sock.recv(65536)):   # head and body may come apart
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"over the proxy's limit" in answer, answer
    assert [len(e.requests) for e in (stack["p"], stack["d1"], stack["d2"])] == seen
    ok = httpx.post(proxy.url + "/v1/completions", json={"prompt": "x", "stream": False}, timeout=30, trust_env=False)
    assert ok.status_code == 200, ok.text
    _wait_for(proxy.idle, 10, "every lease released")


def test_a_chunked_body_is_refused_once_it_passes_the_limit(stack):
    """No Content-Length: the proxy counts what arrives and answers 413 as soon as it passes the cap,
    while the client is still sending (it would otherwise read, and hold, all of it)."""
    proxy = stack["proxy"]
    _wait_for(proxy.idle, 10, "the proxy is idle")
    host, port = proxy.url.removeprefix("http://").rsplit(":", 1)
    chunk = b"%x\r\n%s\r\n" % (1 << 20, b" " * (1 << 20))
    sent, answer = 0, b""
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        with contextlib.suppress(OSError):   # the proxy closes the connection after its answer
            while sent < 400 and not select.select([sock], [], [], 0)[0]:
                sock.sendall(chunk)
                sent += 1
        while b"limit" not in answer and (part := sock.recv(65536)):
            answer += part
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert 256 <= sent < 400, f"answered after {sent} MiB"


def test_authorization_and_request_id_reach_both_engines(stack):
    """vLLM servers started with --api-key answer 401 to a request without the client's key."""
    proxy, p = stack["proxy"], stack["p"]
    _wait_for(proxy.idle, 10, "the proxy is idle")
    sent = {"Authorization": "Bearer sk-test-key", "X-Request-Id": "client-req-7", "Cookie": "session=c"}
    with _client() as client:
        reply = client.post(proxy.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=sent)
    assert reply.status_code == 200, reply.text
    tid = _last_transfer(p)
    for engine in (p, _decode_of(stack, tid)):
        seen = engine.headers[tid]
        assert seen.get("authorization") == "Bearer sk-test-key", (engine.name, seen)
        assert seen.get("x-request-id") == "client-req-7", (engine.name, seen)
    assert "cookie" not in p.headers[tid]        # only the two named headers go on


def test_a_request_with_min_tokens_is_served_though_p_makes_one_token(stack):
    """vLLM refuses min_tokens above max_tokens; P's part of a request is one token."""
    proxy, p = stack["proxy"], stack["p"]
    _wait_for(proxy.idle, 10, "the proxy is idle")
    with _client() as client:
        reply = client.post(proxy.url + "/v1/completions", json={"prompt": "min", "max_tokens": 4, "min_tokens": 3})
    assert reply.status_code == 200, reply.text
    tid = _last_transfer(p)
    assert "min_tokens" not in p.requests[-1]
    assert _decode_of(stack, tid).requests[-1]["min_tokens"] == 3   # D makes the answer: the client's bound holds
    _wait_for(proxy.idle, 10, "every lease released")


def test_a_request_d_must_prefill_itself_goes_to_d_alone(stack):
    """vLLM reads no transferred KV for a request that asks its prompt's logprobs (or gives embeddings):
    sent to P too, P's transfer would wait for a registration D never makes (D-first: the client a 504)."""
    proxy, p = stack["proxy"], stack["p"]
    _wait_for(proxy.idle, 10, "the proxy is idle")
    seen = len(p.requests)
    with _client() as client:
        for extra in ({"prompt_logprobs": 1}, {"prompt_embeds": "AAAA"}, {"echo": True, "logprobs": 1}):
            body = {"prompt": f"whole prompt {extra}", "max_tokens": 2, **extra}
            reply = client.post(proxy.url + "/v1/completions", json=body)
            assert reply.status_code == 200 and reply.json()["choices"][0]["text"].endswith(": local"), reply.text
        # a chat's echo asks the prompt's logprobs by itself (vLLM's top_logprobs defaults to 0)
        chat = {"messages": [{"role": "user", "content": "whole prompt, echoed"}], "max_tokens": 2, "echo": True}
        reply = client.post(proxy.url + "/v1/chat/completions", json=chat)
        assert reply.status_code == 200, reply.text
    assert len(p.requests) == seen, "P was sent a request D prefills itself"
    with _client() as client:   # echo alone, on a completion, reads transferred KV as usual: P prefills it
        reply = client.post(proxy.url + "/v1/completions", json={"prompt": "echoed", "max_tokens": 2, "echo": True})
        assert reply.status_code == 200, reply.text
    assert len(p.requests) == seen + 1
    _wait_for(proxy.idle, 10, "every lease released")


def test_a_requested_transfer_mode_reaches_p_and_a_bad_one_is_a_400(stack):
    proxy, p = stack["proxy"], stack["p"]
    _wait_for(proxy.idle, 10, "the proxy is idle")
    with _client() as client:
        for sent, want in (("bulk", "bulk"), ("LayerWise", "layerwise"), (None, None)):
            reply = client.post(proxy.url + "/v1/completions", json={"prompt": "mode", "max_tokens": 2},
                                headers={"X-Aiolayer-Transfer-Mode": sent} if sent else {})
            assert reply.status_code == 200, reply.text
            assert p.requests[-1]["kv_transfer_params"]["aiolayer"].get("transfer_mode") == want, p.requests[-1]
        seen = len(p.requests)
        for bad in ("auto", "fast", ""):
            reply = client.post(proxy.url + "/v1/completions", json={"prompt": "mode"},
                                headers={"X-Aiolayer-Transfer-Mode": bad})
            assert reply.status_code == 400 and "x-aiolayer-transfer-mode" in reply.json()["error"]["message"], \
                reply.text
        assert len(p.requests) == seen, "a refused request reached P"
    _wait_for(proxy.idle, 10, "every lease released")


def test_ds_first_token_is_relayed_before_ps_reply_arrives(stack):
    """D decodes as soon as the KV is there; the client must not wait for P's own HTTP answer too."""
    proxy, p = stack["proxy"], stack["p"]
    _wait_for(proxy.idle, 10, "the proxy is idle")
    body = {"prompt": "early", "stream": True, "fake": {"p_reply_after_s": 3, "chunks": 2}}
    with _client() as client, client.stream("POST", proxy.url + "/v1/completions", json=body) as resp:
        lines = resp.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        tid = _last_transfer(p)
        assert not stack["hub"].event("p replied " + tid).is_set(), "D's token waited for P's reply"
        rest = [line for line in lines if line]
    assert first.startswith("data: {") and rest[-1] == "data: [DONE]", rest
    _wait_for(proxy.idle, 10, "every lease released")


def test_p_failing_while_d_streams_ends_the_stream_with_ps_error_and_aborts_d(stack):
    proxy, p = stack["proxy"], stack["p"]
    _wait_for(proxy.idle, 10, "the proxy is idle")
    body = {"prompt": "p fails late", "stream": True,
            "fake": {"p_reply_after_s": 1, "p_status": 500, "chunks": 400, "interval_s": 0.02}}
    with _client() as client, client.stream("POST", proxy.url + "/v1/completions", json=body) as resp:
        lines = [line for line in resp.iter_lines() if line]
    tid = _last_transfer(p)
    d = _decode_of(stack, tid)
    assert lines[0].startswith("data: {") and "data: [DONE]" not in lines, lines[-3:]
    error = json.loads(lines[-1][len("data: "):])["error"]
    assert error["type"] == "prefill_error" and "HTTP 500" in error["message"], error
    _wait_for(lambda: tid in d.aborts, 10, "D was told to abort")
    _wait_for(proxy.idle, 10, "every lease released")
