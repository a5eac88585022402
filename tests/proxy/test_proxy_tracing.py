"""``aiolayer proxy --otlp-traces-endpoint``: one OpenTelemetry span per request, child of the client's
``traceparent``, a span per stage under it, and P and D given the proxy's span as their parent.

The proxy is a real process exporting OTLP over HTTP to a collector in this test (a plain HTTP server
decoding OpenTelemetry's own protobuf messages); the engines are ``helpers_proxy.FakeEngine``.
"""

from __future__ import annotations

import contextlib
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

pytest.importorskip("fastapi")
trace_pb = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")

import httpx

from helpers_proxy import proxied_pair, wait_for

pytestmark = pytest.mark.timeout(90)
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


class Collector:
    """An OTLP/HTTP trace receiver on 127.0.0.1: every span it was sent, decoded."""

    def __init__(self) -> None:
        self.spans: list = []
        lock, spans = threading.Lock(), self.spans

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = trace_pb.ExportTraceServiceRequest.FromString(body)
                with lock:
                    spans.extend(s for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans)
                reply = trace_pb.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def of_trace(self, trace_id: str) -> list:
        return [s for s in list(self.spans) if s.trace_id.hex() == trace_id]


@contextlib.contextmanager
def _env(**values: str):
    """Environment for the proxy process started inside (it inherits this process's)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def stack():
    collector = Collector()
    collector.thread.start()
    try:
        with _env(OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="http/protobuf", OTEL_BSP_SCHEDULE_DELAY="100"), \
                proxied_pair("--otlp-traces-endpoint", collector.url) as stack:
            yield {**stack, "collector": collector}
    finally:
        collector.server.shutdown()
        collector.server.server_close()


def _request(stack, trace_id: str, stream: bool, **fake) -> httpx.Response:
    headers = {"traceparent": f"00-{trace_id}-{CLIENT_SPAN}-01", "x-request-id": f"req-{trace_id[:8]}"}
    with httpx.Client(timeout=30, trust_env=False) as client:
        return client.post(stack["proxy"].url + "/v1/completions", headers=headers,
                           json={"prompt": "x", "stream": stream, **({"fake": fake} if fake else {})})


def _spans(stack, trace_id: str, names: set[str]) -> dict:
    spans = wait_for(lambda: (s := stack["collector"].of_trace(trace_id)) and names <= {x.name for x in s} and s,
                     20, f"spans {sorted(names)} of trace {trace_id}")
    return {s.name: s for s in spans}


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_is_one_span_under_the_clients_with_a_span_per_stage(stack, stream):
    trace_id = TRACE_ID[:-1] + ("1" if stream else "0")
    r = _request(stack, trace_id, stream)
    assert r.status_code == 200, r.text
    stages = {"registration", "prefill", "first_token"} | ({"relay"} if stream else set())
    spans = _spans(stack, trace_id, {"POST /v1/completions"} | stages)
    root = spans["POST /v1/completions"]
    assert root.parent_span_id.hex() == CLIENT_SPAN
    attributes = {a.key: a.value for a in root.attributes}
    assert attributes["aiolayer.request_id"].string_value == f"req-{trace_id[:8]}"
    assert attributes["aiolayer.outcome"].string_value == "ok"
    transfer_id = attributes["aiolayer.transfer_id"].string_value
    for name in stages:
        span = spans[name]
        assert span.parent_span_id == root.span_id, name
        assert root.start_time_unix_nano <= span.start_time_unix_nano <= span.end_time_unix_nano \
            <= root.end_time_unix_nano, name
    assert spans["registration"].end_time_unix_nano <= spans["prefill"].start_time_unix_nano
    # P and D were told the proxy's span is their parent, in the same trace
    for engine in (stack["p"], stack["d"]):
        assert engine.headers[transfer_id]["traceparent"] == f"00-{trace_id}-{root.span_id.hex()}-01"


def test_a_failed_request_ends_its_span_in_error(stack):
    trace_id = TRACE_ID[:-2] + "ee"
    r = _request(stack, trace_id, False, p_status=503)
    assert r.status_code == 502, r.text
    root = _spans(stack, trace_id, {"POST /v1/completions"})["POST /v1/completions"]
    assert root.status.code == 2 and root.status.message == "HTTP 502", root.status   # STATUS_CODE_ERROR


def test_without_tracing_the_clients_trace_context_reaches_the_engines():
    """A proxy not tracing passes the client's ``traceparent`` on, so the engines' spans join its trace."""
    with proxied_pair() as untraced:
        r = _request(untraced, TRACE_ID, False)
        assert r.status_code == 200, r.text
        p, d = untraced["p"], untraced["d"]
        transfer_id = p.requests[-1]["kv_transfer_params"]["aiolayer"]["transfer_id"]
        for engine in (p, d):
            assert engine.headers[transfer_id]["traceparent"] == f"00-{TRACE_ID}-{CLIENT_SPAN}-01"
