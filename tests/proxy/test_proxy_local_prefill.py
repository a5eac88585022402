"""D prefilling a short prompt itself (``--local-prefill-max-tokens``): the choice per request from the first
tokens the proxy measured each way, its limits (the cap, a named transfer mode), and the chooser's rules."""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("fastapi")

from aiolayer.harness.servers import metric_value, parse_metrics
from aiolayer_vllm.proxy.route import REMEASURE_EVERY, REMEASURE_FAR_EVERY, RouteChooser, prompt_text_bytes, size_class
from helpers_proxy import proxied_pair, wait_for

pytestmark = pytest.mark.timeout(90)


def _ask(proxy_url: str, prompt: str, fake: dict, *, stream: bool = True, headers: dict | None = None) -> str:
    """One request through the proxy; its answer's text (a stream's lines, or the JSON)."""
    body = {"prompt": prompt, "max_tokens": 2, "stream": stream, "fake": fake}
    with httpx.Client(timeout=30, trust_env=False) as client:
        if not stream:
            reply = client.post(proxy_url + "/v1/completions", json=body, headers=headers or {})
            assert reply.status_code == 200, reply.text
            return reply.text
        with client.stream("POST", proxy_url + "/v1/completions", json=body, headers=headers or {}) as reply:
            assert reply.status_code == 200, reply.read()
            lines = [line for line in reply.iter_lines() if line]
    assert lines[-1] == "data: [DONE]", lines
    return "\n".join(lines)


def _routes(d, p, asks) -> list[str]:
    """Where each of ``asks`` (callables sending one request) was prefilled: D itself, or P."""
    routes = []
    for ask in asks:
        local, remote = len(d.local), len(p.requests)
        ask()
        routes.append("local" if len(d.local) == local + 1 and len(p.requests) == remote else
                      "remote" if len(p.requests) == remote + 1 and len(d.local) == local else "both?")
    return routes


def test_a_short_prompt_is_prefilled_where_its_first_token_came_sooner():
    with proxied_pair("--local-prefill-max-tokens", "64", "--health-interval", "0.2") as s:
        p, d, url = s["p"], s["d"], s["proxy"].url
        wait_for(lambda: httpx.get(url + "/health", timeout=5, trust_env=False).status_code == 200, 20,
                 "the proxy sees both engines")
        slow_p = {"prefill_s": 0.3}   # ~10 tokens: P's prefill and transfer slower than D doing it
        short = [lambda i=i: _ask(url, f"{i:02d}" + "x" * 38, slow_p) for i in range(5)]
        assert _routes(d, p, short) == ["remote", "local", "local", "local", "local"]
        assert "d-local-0" in _ask(url, "xx" + "x" * 38, slow_p)   # D's own tokens relayed

        # a request that names its transfer mode goes to P; so does a prompt over the cap (64 tokens)
        named = lambda: _ask(url, "n" * 40, slow_p, headers={"X-Aiolayer-Transfer-Mode": "bulk"})  # noqa: E731
        long = lambda: _ask(url, "l" * 400, slow_p)  # noqa: E731
        # not streamed: no first token to time, so the route predicted faster
        whole = lambda: _ask(url, "w" * 40, slow_p, stream=False)  # noqa: E731
        assert _routes(d, p, [named, long, whole]) == ["remote", "remote", "local"]

        # ~40 tokens, another size: there D is the slower one, and after one try each it goes to P
        slow_d = {"local_prefill_s": 0.3}
        other = [lambda i=i: _ask(url, f"{i:02d}" + "y" * 158, slow_d) for i in range(4)]
        assert _routes(d, p, other) == ["remote", "local", "remote", "remote"]

        metrics = parse_metrics(httpx.get(url + "/metrics", timeout=5, trust_env=False).text)
        assert metric_value(metrics, "aiolayer_proxy_routes_total", route="local") == len(d.local) == 7
        assert metric_value(metrics, "aiolayer_proxy_routes_total", route="remote") == len(p.requests) == 6
        assert all(body.get("kv_transfer_params") is None for body in d.local)   # no transfer D would wait for


def test_without_the_option_every_request_goes_to_p():
    with proxied_pair("--health-interval", "0.2") as s:
        p, d, url = s["p"], s["d"], s["proxy"].url
        wait_for(lambda: httpx.get(url + "/health", timeout=5, trust_env=False).status_code == 200, 20,
                 "the proxy sees both engines")
        asks = [lambda i=i: _ask(url, f"{i}", {"prefill_s": 0.2}) for i in range(3)]
        assert _routes(d, p, asks) == ["remote"] * 3


def _choose(chooser: RouteChooser, body: dict, named_mode: bool = False, stream: bool = True):
    return chooser.choose(chooser.prompt_size("/v1/completions", body)[0], named_mode, stream)


def test_with_no_healthy_p_a_short_prompt_is_prefilled_by_d_and_a_long_one_refused():
    with proxied_pair("--local-prefill-max-tokens", "64", "--health-interval", "0.2") as s:
        p, d, url = s["p"], s["d"], s["proxy"].url
        wait_for(lambda: httpx.get(url + "/health", timeout=5, trust_env=False).status_code == 200, 20,
                 "the proxy sees both engines")
        p.healthy = False
        wait_for(lambda: httpx.get(url + "/health", timeout=5, trust_env=False).status_code == 503, 20,
                 "the proxy sees P down")
        answers = [_ask(url, f"{i:02d}" + "x" * 38, {}, stream=i == 0) for i in range(2)]   # not measured yet
        assert "d-local-0" in answers[0] and len(d.local) == 2 and p.requests == []
        with httpx.Client(timeout=30, trust_env=False) as client:
            for body, headers in (({"prompt": "l" * 400}, {}),                                  # over the cap
                                  ({"prompt": "n" * 40}, {"X-Aiolayer-Transfer-Mode": "bulk"})):   # names P's mode
                reply = client.post(url + "/v1/completions", json={**body, "max_tokens": 2}, headers=headers)
                assert reply.status_code == 503 and reply.json()["error"]["type"] == "no_backend", reply.text
        assert len(d.local) == 2 and p.requests == []


def test_the_chooser_tries_each_route_then_re_measures_the_loser_now_and_then():
    chooser = RouteChooser(local_max_tokens=256)
    body = {"prompt": "x" * 400}   # 100 tokens at the starting 4 bytes per token
    assert _choose(chooser, body) == ("remote", 7)
    chooser.learn_ttft("remote", 7, 0.100)
    assert _choose(chooser, body) == ("local", 7)
    chooser.learn_ttft("local", 7, 0.095)   # within 20%: the loser is re-measured every 16th request
    routes = [_choose(chooser, body)[0] for _ in range(3, 3 + 2 * REMEASURE_EVERY)]
    assert routes.count("remote") == 2 and routes.count("local") == 2 * REMEASURE_EVERY - 2
    chooser.learn_ttft("local", 7, 0.035)   # moving estimate: 0.065, more than 20% ahead: every 128th
    assert chooser.ttft_s["local", 7] == pytest.approx(0.065)
    routes = [_choose(chooser, body)[0] for _ in range(REMEASURE_FAR_EVERY)]
    assert routes.count("remote") == 1
    assert _choose(chooser, body, named_mode=True) == ("remote", None)
    assert _choose(chooser, body, stream=False) == ("local", None)
    assert _choose(chooser, {"prompt": "x" * 1100}) == ("remote", None)  # > 256
    assert _choose(chooser, {"prompt": [1, 2, 3]}) == ("remote", 2)  # token ids
    off = RouteChooser()   # off by default: nothing is even measured
    assert off.prompt_size("/v1/completions", body) == (None, None) and _choose(off, body) == ("remote", None)
    assert chooser.may_go_local(64, False) and not chooser.may_go_local(64, True)
    assert not chooser.may_go_local(None, False) and not chooser.may_go_local(257, False)


def test_the_bytes_per_token_come_from_ps_answers_and_only_text_is_sized():
    chooser = RouteChooser(local_max_tokens=64)
    body = {"prompt": "x" * 400}
    assert chooser.prompt_size("/v1/completions", body) == (100, 400)
    chooser.learn_usage("/v1/completions", 400, b'{"usage": {"prompt_tokens": 50}}')
    assert chooser.prompt_size("/v1/completions", body) == (50, 400)          # 8 bytes per token now
    assert chooser.prompt_size("/v1/chat/completions", {"messages": [{"content": "x" * 40}]}) == (10, 40)   # per path
    assert chooser.prompt_size("/v1/completions", {"prompt": [1, 2]}) == (2, None)
    for bad in (b"not json", b"[]", b'{"usage": {"prompt_tokens": 0}}', b'{"usage": {"prompt_tokens": true}}'):
        chooser.learn_usage("/v1/completions", 400, bad)
    chooser.learn_usage("/v1/completions", None, b'{"usage": {"prompt_tokens": 1}}')   # not a text prompt
    assert chooser.bytes_per_token == {"/v1/completions": 8.0}
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "héllo"}]}, {"content": "ab"}]}
    assert prompt_text_bytes(chat) == 8
    assert prompt_text_bytes({"messages": [{"content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}) is None
    assert prompt_text_bytes({"prompt": ["a", "b"]}) is None
    assert [size_class(n) for n in (1, 2, 3, 256, 257)] == [0, 1, 2, 8, 9]
