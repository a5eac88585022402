"""What a failed request looks like to the client of ``aiolayer proxy`` (a real process), and in its log.

A backend's 4xx (the request's own fault: vLLM refusing an unknown model or a prompt too long) reaches
the client as that backend sent it; a backend that refuses the connection, times out or answers 5xx
is a 502/504 naming the backend and what happened; a stream failing before its first token is an HTTP
error, not a 200; every error the proxy makes itself is OpenAI's ``{"error": {message, type, code}}``.
The engines are ``helpers_proxy.FakeEngine`` (uvicorn in threads of this process, real sockets).
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")

import httpx

from aiolayer.harness.pd import ProxyProcess
from helpers_proxy import proxied_pair, registration, wait_for

pytestmark = pytest.mark.timeout(90)
# vLLM's OpenAI server's answer to an unknown model, byte for byte (spacing included)
UNKNOWN_MODEL = (b'{"error":{"message":"The model `nope` does not exist.","type":"NotFoundError",'
                 b'"param":"model","code":404}}')
TOO_LONG = b'{"error": {"message": "This model\'s maximum context length is 512 tokens.", "type": "BadRequestError"}}'


def _stack(*args: str):
    return proxied_pair("--registration-timeout", "5", "--prefill-timeout", "2", "--request-timeout", "20", *args)


def _log_lines(proxy: ProxyProcess) -> list[str]:
    assert proxy.log is not None
    proxy.log.seek(0)
    return proxy.log.read().decode(errors="replace").splitlines()


@pytest.fixture(scope="module")
def stack():
    with _stack("--health-interval", "0.2", "--log-format", "json") as stack:
        yield stack


def _post(proxy: ProxyProcess, body: dict, **kw) -> httpx.Response:
    with httpx.Client(timeout=30, trust_env=False) as client:
        return client.post(proxy.url + "/v1/completions", json=body, **kw)


def _openai_error(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "code"}, r.text
    assert body["error"]["code"] == r.status_code and isinstance(body["error"]["message"], str), r.text
    return body["error"]


@pytest.mark.parametrize("stream", [False, True])
def test_ds_4xx_reaches_the_client_unchanged(stack, stream):
    for status, raw in ((404, UNKNOWN_MODEL), (400, TOO_LONG)):
        r = _post(stack["proxy"], {"prompt": "x", "stream": stream, "fake": {"d_status": status,
                                                                               "d_body": raw.decode()}})
        assert (r.status_code, r.content) == (status, raw), (r.status_code, r.text)
        assert r.headers["content-type"] == "application/json"


@pytest.mark.parametrize("stream", [False, True])
def test_ps_4xx_reaches_the_client_unchanged_and_d_is_told_to_abort(stack, stream):
    body = {"prompt": "x", "stream": stream, "fake": {"p_status": 400, "p_body": TOO_LONG.decode(), "hold_s": 2}}
    r = _post(stack["proxy"], body)
    assert (r.status_code, r.content) == (400, TOO_LONG), (r.status_code, r.text)
    tid = stack["p"].requests[-1]["kv_transfer_params"]["aiolayer"]["transfer_id"]
    wait_for(lambda: tid in stack["d"].aborts, 10, "D was told to abort")


def test_a_backends_5xx_is_a_502_that_names_it(stack):
    p, d, proxy = stack["p"], stack["d"], stack["proxy"]
    r = _post(proxy, {"prompt": "x", "fake": {"d_status": 500, "d_body": '{"error": "engine dead"}'}})
    error = _openai_error(r)
    assert r.status_code == 502 and error["type"] == "decode_error", error
    assert error["message"].startswith(f"D ({d.url}) answered HTTP 500 before registering") \
        and "engine dead" in error["message"], error
    r = _post(proxy, {"prompt": "x", "fake": {"p_status": 503}})
    error = _openai_error(r)
    assert r.status_code == 502 and error["type"] == "prefill_error", error
    assert error["message"].startswith(f"P ({p.url}) answered HTTP 503"), error


def test_a_prefill_past_its_deadline_is_a_504_that_says_so(stack):
    p, proxy = stack["p"], stack["proxy"]
    p.gate.clear()
    try:
        r = _post(proxy, {"prompt": "slow P"})
    finally:
        p.gate.set()
    error = _openai_error(r)
    assert r.status_code == 504 and error["type"] == "prefill_timeout", error
    assert error["message"] == f"P ({p.url}) did not answer within 2s", error


@pytest.mark.parametrize("fake", [{"p_status": 500, "hold_s": 2}, {"fail_at": 0}, {"error_at": 0}],
                         ids=["p_fails", "d_breaks", "d_ends_in_an_error_event"])
def test_a_stream_failing_before_its_first_token_is_an_http_error(stack, fake):
    """Also when D's first event is vLLM's error event (its request failed, e.g. the KV never came)."""
    with httpx.Client(timeout=30, trust_env=False) as client, \
            client.stream("POST", stack["proxy"].url + "/v1/completions",
                          json={"prompt": "x", "stream": True, "fake": fake}) as r:
        r.read()
    assert r.status_code == 502, (r.status_code, r.text)
    error = _openai_error(r)
    assert error["type"] == ("prefill_error" if "p_status" in fake else "decode_error"), error
    if "error_at" in fake:
        assert "answered HTTP 500 in its stream, before any token" in error["message"], error
        assert "Internal server error" in error["message"], error


def test_an_error_event_after_the_first_token_ends_the_stream_as_d_sent_it(stack):
    with httpx.Client(timeout=30, trust_env=False) as client, \
            client.stream("POST", stack["proxy"].url + "/v1/completions",
                          json={"prompt": "x", "stream": True, "fake": {"error_at": 1}}) as r:
        text = r.read().decode()
    assert r.status_code == 200 and "\"InternalServerError\"" in text and "\"d-0\"" in text, text


def test_the_proxys_own_errors_are_openai_shaped(stack):
    proxy = stack["proxy"]
    with httpx.Client(timeout=10, trust_env=False) as client:
        answers = [client.post(proxy.url + "/v1/completions", content=b"{not json"),
                   client.post(proxy.url + "/v1/completions", json={"prompt": "x", "n": 2}),
                   client.post(proxy.url + "/internal/aiolayer/registered", content=b"{"),
                   client.post(proxy.url + "/internal/aiolayer/registered", json={"transfer_id": "t"}),
                   client.post(proxy.url + "/internal/aiolayer/registered",
                               json=registration("nope", "t" * 32, "i", "tcp://h:1"))]
    assert [r.status_code for r in answers] == [400, 400, 400, 400, 404]
    for r in answers:
        _openai_error(r)


def test_each_failed_request_is_one_json_log_line_naming_its_stage(stack):
    proxy = stack["proxy"]
    r = _post(proxy, {"prompt": "x", "fake": {"p_status": 500}}, headers={"X-Request-Id": "req-failing-p"})
    assert r.status_code == 502
    wait_for(lambda: any("req-failing-p" in line for line in _log_lines(proxy)), 10, "the failure is logged")
    lines = _log_lines(proxy)
    records = [json.loads(line) for line in lines if line.strip()]   # every line is one JSON object
    mine = [x for x in records if x.get("request_id") == "req-failing-p"]
    assert len(mine) == 1, mine
    assert mine[0]["stage"] == "prefill" and mine[0]["status"] == 502 and mine[0]["error_type"] == "prefill_error"
    assert mine[0]["level"] == "WARNING" and "P (" in mine[0]["message"], mine[0]
    assert any("listening on " + proxy.url in x["message"] for x in records), records[:3]


@pytest.mark.parametrize("dead", ["prefill", "decode"])
def test_a_backend_refusing_the_connection_is_a_502_that_says_so(dead):
    """The backend's HTTP server stops between two health checks: the call to it is refused."""
    with _stack("--health-interval", "600") as stack:
        proxy = stack["proxy"]
        gone = stack["p"] if dead == "prefill" else stack["d"]
        gone.stop()
        r = _post(proxy, {"prompt": "x"})
        error = _openai_error(r)
        who = "P" if dead == "prefill" else "D"
        assert r.status_code == 502 and error["type"] == f"{dead}_unreachable", error
        assert error["message"].startswith(f"could not connect to {who} ({gone.url})") \
            and "refused" in error["message"], error
