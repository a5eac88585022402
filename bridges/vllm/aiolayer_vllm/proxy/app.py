"""The proxy's FastAPI app: OpenAI routes through the P/D flow (late-bound or D-first), registration, health, metrics.

The app owns its tasks (health watcher, each decode call) and closes them at shutdown. Each OpenAI
request is one ASGI call that owns its exchange from the pick to the last byte relayed, so its
``finally`` frees the request table, the backend leases and D's call whichever way it ends. A
stream's status line waits for D's first token, so a request failing before it gets an HTTP error;
after it, only an SSE error event can end the stream. Each failed request is one log line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from aiolayer.config import Timeouts
from aiolayer.protocol import messages as m
from aiolayer import ControlPeers, RuntimeStateError, compat

from ..params import InvalidParams, read_registration
from .failures import ExchangeError, answered_error, call_failed, error_event, failed_stage
from .admit import check_body, forwarded_headers, prefilled_at_d, read_json_body, requested_mode
from .flow import BINDINGS, Exchange, ProxyTimeouts
from .metrics import CONTENT_TYPE, ProxyMetrics
from .pool import Backend, NoBackend, Pool
from .route import RouteChooser
from .tracing import Tracing

log = logging.getLogger(__name__)
REGISTER_PATH = "/internal/aiolayer/registered"
TAIL_S = 5.0   # a stream's last event to the client, after which it is taken for gone
REGISTRATION_MAX_BYTES = 16 << 20   # D's POST: a 128k-token prompt's block ids in 16-token blocks is ~50 kB


class ClientGone(Exception):
    """The client closed its connection before the answer was complete."""


def error_response(status: int, kind: str, message: str) -> JSONResponse:
    """An error the proxy itself answers, in OpenAI's shape."""
    return JSONResponse(ExchangeError(status, kind, message).body(), status)


class ProxyState:
    def __init__(self, pool: Pool, public_url: str, timeouts: ProxyTimeouts, tracing: Tracing | None = None,
                 binding: str = "auto", local_prefill_max_tokens: int = 0) -> None:
        if binding not in BINDINGS:
            raise ValueError(f"binding must be one of {BINDINGS}, got {binding!r}")
        if local_prefill_max_tokens < 0:
            raise ValueError(f"local_prefill_max_tokens must be >= 0, got {local_prefill_max_tokens}")
        self.pool = pool
        self.timeouts = timeouts
        self.binding = binding   # "late": P and D at once; "auto": late where the engines can (flow.Exchange)
        self.tracing = tracing or Tracing()
        self.router = RouteChooser(local_prefill_max_tokens)   # whether D prefills a short prompt itself
        self.notify_url = public_url.rstrip("/") + REGISTER_PATH
        self.pending: dict[str, Exchange] = {}
        self.metrics = ProxyMetrics(self)
        self.client: httpx.AsyncClient | None = None
        self.peers: ControlPeers | None = None
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro, name: str) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    @property
    def http(self) -> httpx.AsyncClient:
        """The client to the engines, from ``start`` on."""
        if self.client is None:
            raise RuntimeStateError("the proxy is not started")
        return self.client

    async def start(self) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)  # no pool caps concurrency
        self.client = httpx.AsyncClient(limits=limits)
        self.peers = ControlPeers(Timeouts(control_call=self.timeouts.abort_s), self.spawn)
        self.spawn(self.pool.watch_health(self.client, self.peers), "health")

    async def stop(self) -> None:
        for exchange in list(self.pending.values()):   # normally none: each request's frame closed its own
            await exchange.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5)
        if self.peers is not None:
            await self.peers.close()
        if self.client is not None:
            await self.client.aclose()
        await asyncio.to_thread(self.tracing.close)   # the spans still buffered, bounded

    # --- registration (D -> proxy) -------------------------------------------------------------

    def registered(self, body) -> JSONResponse:
        """One of D's ranks POSTed its registration (``params.DecodeRegistration``): 400 unless it fits the
        contract, 404 for a transfer we are not running, 403 without its token, 409 against D's other ranks."""
        try:
            reg = read_registration(body)
        except InvalidParams as exc:
            return error_response(400, "invalid_registration", str(exc))
        tid = reg.transfer_id
        exchange = self.pending.get(tid)
        if exchange is None:
            return error_response(404, "unknown_transfer", f"unknown transfer {tid}")
        if not m.same_token(reg.registration.token, exchange.token):
            self.metrics.rejected_registrations.inc()   # only the D we sent the token to may redirect P's writes
            return error_response(403, "auth", f"wrong token for transfer {tid}")
        problem = exchange.add_registration(reg)
        if problem:
            return error_response(409, "invalid_registration", problem)
        return JSONResponse({"accepted": tid}, 202)   # answered at once; P is dispatched by the exchange

    # --- the OpenAI routes ------------------------------------------------------------------------

    async def serve(self, scope, receive, send, path: str) -> None:
        """One OpenAI request, served as a plain ASGI app so that one frame owns the whole exchange:
        its ``finally`` closes it (table entry, leases, D's call) however the request ends."""
        started = time.perf_counter()
        try:
            await self._serve(scope, receive, send, path)
        finally:
            self.metrics.request.observe(time.perf_counter() - started)

    async def _serve(self, scope, receive, send, path: str) -> None:
        headers = forwarded_headers(scope["headers"])
        try:
            body = await read_json_body(scope, receive)
        except ClientDisconnect:
            self.metrics.requests.labels("client_disconnect").inc()
            return
        except ExchangeError as exc:   # not JSON, too large
            return await self._answer(self._error(exc, headers.get("x-request-id")), scope, receive, send)
        try:
            check_body(body)
            mode = requested_mode(scope["headers"])
            decode = self.pool.pick("decode")
            tokens, text_bytes = self.router.prompt_size(path, body)
            route, size = self.router.choose(tokens, bool(mode), body.get("stream") is True)
            remote = route == "remote" and not prefilled_at_d(body, path)
            prefill = self._pick_prefill(tokens, bool(mode)) if remote else None
            route = "remote" if prefill is not None else "local"
        except (ExchangeError, NoBackend) as exc:
            failed = exc if isinstance(exc, ExchangeError) else ExchangeError(503, "no_backend", str(exc))
            return await self._answer(self._error(failed, headers.get("x-request-id")), scope, receive, send)
        exchange = Exchange(self, path, body, prefill, decode, headers, mode, text_bytes)   # leases both
        self.metrics.routes.labels(route).inc()
        span = self.tracing.start(headers, path, exchange.started)
        if span is not None:   # P and D see the proxy's span as their parent
            exchange.headers.update(span.trace_headers())
        response = None
        try:
            self.pending[exchange.transfer_id] = exchange
            response = await self._exchange(exchange, receive, send)
            first = exchange.stamps.get("first_chunk")
            if size is not None and exchange.outcome == "ok" and first is not None:
                self.router.learn_ttft(route, size, first / 1e3)
        finally:
            await exchange.close()
            if span is not None:
                status = response.status_code if response is not None else None
                span.finish(exchange.stamps, {"aiolayer.request_id": exchange.request_id,
                                              "aiolayer.transfer_id": exchange.transfer_id,
                                              "aiolayer.route": route,
                                              "aiolayer.prefill": exchange.prefill.url if exchange.prefill else None,
                                              "aiolayer.decode": exchange.decode.url,
                                              "aiolayer.outcome": exchange.outcome or None,
                                              "http.response.status_code": status},
                            error="" if exchange.outcome == "ok" else f"HTTP {status}" if status else "failed")
        if response is not None:
            await self._answer(response, scope, receive, send)

    def _pick_prefill(self, tokens: int | None, named_mode: bool) -> Backend | None:
        """A P for the request, or None where no P is healthy and D may prefill it alone (under the cap)."""
        try:
            return self.pool.pick("prefill")
        except NoBackend:
            if self.router.may_go_local(tokens, named_mode):
                return None
            raise

    async def _exchange(self, exchange: Exchange, receive, send) -> Response | None:
        """Run the exchange; the answer still to send, or None once streamed (or nobody is listening)."""
        try:
            d_resp = await self._unless_disconnected(receive, exchange.run_until_decode())
            if exchange.stream and d_resp.status_code == 200:
                outcome = await self._unless_disconnected(receive, self._relay(exchange, d_resp, send))
                self.metrics.requests.labels(outcome).inc()
                if outcome != "ok":
                    await exchange.abort_decode(outcome)
                return None
            content = await self._read_whole(exchange, d_resp)
            if d_resp.status_code != 200:   # e.g. its KV never arrived (5xx), or the request's fault (4xx)
                raise answered_error("D", exchange.decode.url, d_resp.status_code, content,
                                     d_resp.headers.get("content-type", "application/json"))
            exchange.outcome = "ok"
            self.metrics.requests.labels("ok").inc()
            return Response(content, status_code=d_resp.status_code,
                            media_type=d_resp.headers.get("content-type", "application/json"))
        except ExchangeError as exc:
            await exchange.abort_decode(exc.kind)
            return self._error(exc, exchange.request_id)
        except ClientGone:
            self.metrics.requests.labels(exchange.outcome or "client_disconnect").inc()
            if exchange.outcome != "ok":
                log.info("request %s: the client left before its answer was complete", exchange.request_id,
                         extra={"request_id": exchange.request_id, "stage": "relay" if exchange.relaying else "wait",
                                "error_type": "client_disconnect"})
                await exchange.abort_decode("client disconnected")
            return None
        except asyncio.CancelledError:   # the server is stopping
            self.metrics.requests.labels("cancelled").inc()
            await asyncio.shield(self.spawn(exchange.abort_decode("proxy stopping"), f"abort {exchange.transfer_id}"))
            raise
        except Exception as exc:  # a bug still ends in a JSON error and frees D's blocks
            log.exception("request %s: proxy failure", exchange.request_id,
                          extra={"request_id": exchange.request_id, "stage": "proxy", "error_type": "internal_error"})
            await exchange.abort_decode("proxy failure")
            self.metrics.requests.labels("internal_error").inc()
            if exchange.relaying:   # the status line is out: the client sees the stream end early
                return None
            return error_response(500, "internal_error", f"proxy failure: {type(exc).__name__}: {exc}")

    async def _relay(self, exchange: Exchange, d_resp: httpx.Response, send) -> str:
        """Stream D's answer from its first token on (a failure before it raises ``ExchangeError``: an
        HTTP error for the client); a failure after it is an SSE error event. Returns the outcome."""
        ctype = d_resp.headers.get("content-type", "text/event-stream").encode("latin-1")
        chunks = exchange.decoded_chunks(d_resp)
        try:
            first = await anext(chunks, None)
        except httpx.HTTPError as exc:
            raise call_failed(exc, "D", exchange.decode.url, self.timeouts.request_s) from None
        failed = error_event(first)   # D failed the request before its first token: not a 200
        if failed is not None:
            raise answered_error("D", exchange.decode.url, failed[0], failed[1], "application/json",
                                 " in its stream, before any token")
        try:
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", ctype)]})
            exchange.relaying = True
            relayed = time.perf_counter()
            tail, outcome = b"", "ok"
            try:   # the whole answer within --request-timeout, a client that stops reading too
                async with compat.timeout(self._left(exchange)):
                    chunk = first
                    while chunk is not None:
                        if b"data: [DONE]" in chunk:
                            exchange.outcome = "ok"   # the client may close as soon as it has the end marker
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                        chunk = await anext(chunks, None)
            except Exception as exc:   # P failed while D streamed (D was told to abort), D, our deadline or a bug
                if isinstance(exc, OSError) and not isinstance(exc, TimeoutError):
                    raise   # the client's socket (TimeoutError is an OSError too: the request's deadline)
                error = self._stream_error(exchange, exc)
                outcome, tail = error.kind, b"data: " + error.payload() + b"\n\n"   # what vLLM sends mid-stream
            async with compat.timeout(TAIL_S):   # a client that reads nothing more: gone
                await send({"type": "http.response.body", "body": tail, "more_body": False})
            self.metrics.relay.observe(time.perf_counter() - relayed)
            return outcome
        except OSError:   # the server could not write to the client (or the tail within TAIL_S): it is gone
            raise ClientGone() from None

    def _left(self, exchange: Exchange) -> float:
        """What is left of the exchange's ``request_s`` (from its start)."""
        return max(0.0, self.timeouts.request_s - (time.perf_counter() - exchange.started))

    async def _read_whole(self, exchange: Exchange, d_resp: httpx.Response) -> bytes:
        """D's whole body (a non-200 stream's error) within what is left of ``request_s``."""
        try:
            async with compat.timeout(self._left(exchange)):
                return await d_resp.aread()
        except (httpx.HTTPError, TimeoutError) as exc:
            raise call_failed(exc, "D", exchange.decode.url, self.timeouts.request_s) from None

    def _stream_error(self, exchange: Exchange, exc: Exception) -> ExchangeError:
        """A failure after the first token: the error the stream's last event carries, logged."""
        if isinstance(exc, ExchangeError):
            error = exc
        elif isinstance(exc, (httpx.HTTPError, TimeoutError)):   # TimeoutError: the request's own deadline
            error = call_failed(exc, "D", exchange.decode.url, self.timeouts.request_s)
            error.message = f"D's stream failed: {error.message}"
        else:
            log.exception("request %s: proxy failure mid-stream", exchange.request_id)
            error = ExchangeError(502, "internal_error", f"the proxy failed mid-stream: {type(exc).__name__}: {exc}")
        self._log_failure(error, exchange.request_id, "relay")
        return error

    async def _unless_disconnected(self, receive, work):
        """Run ``work``; if the client disconnects first, cancel it (and so the engines' requests)."""
        task = self.spawn(work, "exchange step")

        async def watch() -> None:
            # After the body was read, the server's next ASGI message is the client's disconnect.
            while (await receive())["type"] != "http.disconnect":
                pass

        watcher = self.spawn(watch(), "disconnect watch")
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise ClientGone()
            return task.result()
        finally:
            watcher.cancel()
            task.cancel()

    async def _answer(self, response: Response, scope, receive, send) -> None:
        try:
            await response(scope, receive, send)
        except OSError:   # the client is gone; the outcome is already counted
            pass

    def _error(self, exc: ExchangeError, request_id: str | None) -> Response:
        """The client's answer to a failed request (counted and logged): a backend's 4xx as it was, or the
        proxy's OpenAI-shaped error."""
        self.metrics.requests.labels(exc.kind).inc()
        self._log_failure(exc, request_id or "-", failed_stage(exc.kind))
        return Response(exc.payload(), status_code=exc.status, media_type=exc.media_type)

    @staticmethod
    def _log_failure(exc: ExchangeError, request_id: str, stage: str) -> None:
        # a backend's 4xx is the request's own fault: info; the rest is a failure of the deployment
        level = logging.INFO if exc.raw is not None or exc.status < 500 else logging.WARNING
        log.log(level, "request %s failed at %s: HTTP %d %s: %s", request_id, stage, exc.status, exc.kind,
                exc.message, extra={"request_id": request_id, "stage": stage, "status": exc.status,
                                    "error_type": exc.kind})


class _OpenAIRoute:
    """A raw ASGI endpoint (not request -> response): the exchange must outlive a returned response."""

    def __init__(self, state: ProxyState, path: str) -> None:
        self.state, self.path = state, path

    async def __call__(self, scope, receive, send) -> None:
        await self.state.serve(scope, receive, send, self.path)


def create_app(pool: Pool, public_url: str, timeouts: ProxyTimeouts | None = None,
               tracing: Tracing | None = None, binding: str = "auto", local_prefill_max_tokens: int = 0) -> FastAPI:
    state = ProxyState(pool, public_url, timeouts or ProxyTimeouts(), tracing, binding, local_prefill_max_tokens)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    app = FastAPI(title="aiolayer P/D proxy", lifespan=lifespan)
    app.state.proxy = state

    for path in ("/v1/completions", "/v1/chat/completions"):
        # an ASGI app: Starlette's Route serves a non-function endpoint as one (its hint names handlers only)
        app.router.add_route(path, _OpenAIRoute(state, path), methods=["POST"])  # type: ignore[arg-type]

    @app.post(REGISTER_PATH)
    async def registered(request: Request) -> JSONResponse:
        try:   # D's registration: its block ids, a few kB
            body = await read_json_body(request.scope, request.receive, REGISTRATION_MAX_BYTES)
        except ExchangeError as exc:
            return JSONResponse(exc.body(), exc.status)
        return state.registered(body)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            backend = state.pool.pick("decode")
            reply = await state.http.get(backend.url + "/v1/models", timeout=5.0,
                                           headers=forwarded_headers(request.scope["headers"]))
        except NoBackend as exc:
            return error_response(503, "no_backend", str(exc))
        except httpx.HTTPError as exc:
            error = call_failed(exc, "D", backend.url, 5.0)
            return error_response(error.status, error.kind, error.message)
        return Response(reply.content, status_code=reply.status_code, media_type="application/json")

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = any(b.healthy for b in state.pool.prefill) and any(b.healthy for b in state.pool.decode)
        return JSONResponse({"healthy": ok, "binding": state.binding, "backends": [
            {"role": b.role, "url": b.url, "control": b.control, "healthy": b.healthy, "problem": b.problem,
             "outstanding": b.outstanding, "topology": b.topology.summary() if b.topology else None}
            for b in state.pool.all]}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.text(), media_type=CONTENT_TYPE)

    return app
