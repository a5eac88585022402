"""The proxy's FastAPI app: OpenAI routes through the D-first flow, registration, health, metrics.

The app owns its tasks (health watcher, each decode call) and closes them at shutdown. Each OpenAI
request is one ASGI call that owns its exchange from the pick to the last byte relayed, so its
``finally`` frees the request table, the backend leases and D's call whichever way it ends.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.requests import ClientDisconnect

from aiolayer.config import Timeouts
from aiolayer.protocol import messages as m
from aiolayer import ControlPeers, RuntimeStateError

from .flow import Exchange, ExchangeError, ProxyTimeouts, check_body, forwarded_headers
from .pool import NoBackend, Pool

log = logging.getLogger(__name__)
REGISTER_PATH = "/internal/aiolayer/registered"


class ClientGone(Exception):
    """The client closed its connection before the answer was complete."""


class ProxyState:
    def __init__(self, pool: Pool, public_url: str, timeouts: ProxyTimeouts) -> None:
        self.pool = pool
        self.timeouts = timeouts
        self.notify_url = public_url.rstrip("/") + REGISTER_PATH
        self.pending: dict[str, Exchange] = {}
        self.outcomes: collections.Counter = collections.Counter()
        self.rejected_registrations = 0
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

    # --- registration (D -> proxy) -------------------------------------------------------------

    def registered(self, body: dict) -> JSONResponse:
        tid = body.get("transfer_id") if isinstance(body, dict) else None
        needed = ("block_ids", "incarnation", "decode_control")
        if not isinstance(tid, str) or not all(k in body for k in needed):
            return JSONResponse({"error": {"message": f"need transfer_id and {', '.join(needed)}"}}, 400)
        exchange = self.pending.get(tid)
        if exchange is None:
            return JSONResponse({"error": {"message": f"unknown transfer {tid}", "type": "unknown_transfer"}}, 404)
        token = body.get("token")
        if not isinstance(token, str) or not m.same_token(token, exchange.token):
            self.rejected_registrations += 1   # only the D we sent the token to may redirect P's writes
            return JSONResponse({"error": {"message": f"wrong token for transfer {tid}", "type": "auth"}}, 403)
        problem = exchange.add_registration(body)
        if problem:
            return JSONResponse({"error": {"message": problem, "type": "invalid_registration"}}, 409)
        return JSONResponse({"accepted": tid}, 202)   # answered at once; P is dispatched by the exchange

    # --- the OpenAI routes ------------------------------------------------------------------------

    async def serve(self, scope, receive, send, path: str) -> None:
        """One OpenAI request, served as a plain ASGI app so that one frame owns the whole exchange:
        its ``finally`` closes it (table entry, leases, D's call) however the request ends."""
        try:
            body = await Request(scope, receive).json()
        except ClientDisconnect:
            self.outcomes["client_disconnect"] += 1
            return
        except ValueError:   # not JSON, not UTF-8
            return await self._answer(self._error(ExchangeError(400, "invalid_request", "body is not JSON")),
                                      scope, receive, send)
        try:
            check_body(body)
            prefill, decode = self.pool.pick("prefill"), self.pool.pick("decode")
        except ExchangeError as exc:
            return await self._answer(self._error(exc), scope, receive, send)
        except NoBackend as exc:
            return await self._answer(self._error(ExchangeError(503, "no_backend", str(exc))), scope, receive, send)
        exchange = Exchange(self, path, body, prefill, decode, forwarded_headers(scope["headers"]))   # leases both
        try:
            self.pending[exchange.transfer_id] = exchange
            response = await self._exchange(exchange, receive, send)
        finally:
            await exchange.close()
        if response is not None:
            await self._answer(response, scope, receive, send)

    async def _exchange(self, exchange: Exchange, receive, send) -> Response | None:
        """Run the exchange; the answer still to send, or None once streamed (or nobody is listening)."""
        try:
            d_resp = await self._unless_disconnected(receive, exchange.run_until_decode())
            if exchange.stream and d_resp.status_code == 200:
                outcome = await self._unless_disconnected(receive, self._relay(exchange, d_resp, send))
                self.outcomes[outcome] += 1
                if outcome != "ok":
                    await exchange.abort_decode(outcome)
                return None
            content = await d_resp.aread()
            if d_resp.status_code >= 500:   # D failed (e.g. its KV never arrived): a backend's failure
                raise ExchangeError(502, "decode_error", f"D failed the request: HTTP {d_resp.status_code}: "
                                    f"{content[:300].decode(errors='replace')}")
            if d_resp.status_code == 200:
                exchange.outcome = "ok"
            self.outcomes["ok" if d_resp.status_code == 200 else "decode_http_error"] += 1
            return Response(content, status_code=d_resp.status_code,
                            media_type=d_resp.headers.get("content-type", "application/json"))
        except ExchangeError as exc:
            await exchange.abort_decode(exc.kind)
            return self._error(exc)
        except ClientGone:
            self.outcomes[exchange.outcome or "client_disconnect"] += 1
            if exchange.outcome != "ok":
                await exchange.abort_decode("client disconnected")
            return None
        except asyncio.CancelledError:   # the server is stopping
            self.outcomes["cancelled"] += 1
            await asyncio.shield(self.spawn(exchange.abort_decode("proxy stopping"), f"abort {exchange.transfer_id}"))
            raise
        except Exception as exc:  # a bug still ends in a JSON error and frees D's blocks
            log.exception("transfer %s: proxy failure", exchange.transfer_id)
            await exchange.abort_decode("proxy failure")
            if exchange.relaying:   # the status line is out: the client sees the stream end early
                self.outcomes["internal_error"] += 1
                return None
            return self._error(ExchangeError(500, "internal_error", f"proxy failure: {type(exc).__name__}: {exc}"))

    async def _relay(self, exchange: Exchange, d_resp: httpx.Response, send) -> str:
        """Stream D's answer; D failing after the status line is an SSE error event. Returns the outcome."""
        ctype = d_resp.headers.get("content-type", "text/event-stream").encode("latin-1")
        try:
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", ctype)]})
            exchange.relaying = True
            tail, outcome = b"", "ok"
            try:
                async for chunk in exchange.decoded_chunks(d_resp):
                    if b"data: [DONE]" in chunk:
                        exchange.outcome = "ok"   # the client may close as soon as it has the end marker
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except OSError:
                raise
            except ExchangeError as exc:   # P failed while D streamed (D was told to abort)
                outcome, tail = exc.kind, b"data: " + json.dumps(exc.body()).encode() + b"\n\n"
            except Exception as exc:  # D (or a proxy bug) failed after the status line
                outcome = "decode_error" if isinstance(exc, httpx.HTTPError) else "internal_error"
                if outcome == "internal_error":
                    log.exception("transfer %s: proxy failure mid-stream", exchange.transfer_id)
                error = ExchangeError(502, outcome, f"D's stream failed: {type(exc).__name__}: {exc}")
                tail = b"data: " + json.dumps(error.body()).encode() + b"\n\n"   # what vLLM sends mid-stream
            await send({"type": "http.response.body", "body": tail, "more_body": False})
            return outcome
        except OSError:   # the server could not write to the client: it is gone
            raise ClientGone() from None

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

    def _error(self, exc: ExchangeError) -> JSONResponse:
        self.outcomes[exc.kind] += 1
        return JSONResponse(exc.body(), status_code=exc.status)

    def metrics(self) -> str:
        lines = ["# TYPE aiolayer_proxy_requests_total counter"]
        lines += [f'aiolayer_proxy_requests_total{{outcome="{k}"}} {v}' for k, v in sorted(self.outcomes.items())]
        lines += ["# TYPE aiolayer_proxy_rejected_registrations_total counter",
                  f"aiolayer_proxy_rejected_registrations_total {self.rejected_registrations}"]
        lines += ["# TYPE aiolayer_proxy_pending_transfers gauge",
                  f"aiolayer_proxy_pending_transfers {len(self.pending)}",
                  "# TYPE aiolayer_proxy_backend_outstanding gauge", "# TYPE aiolayer_proxy_backend_healthy gauge"]
        for b in self.pool.all:
            labels = f'role="{b.role}",url="{b.url}"'
            lines.append(f"aiolayer_proxy_backend_outstanding{{{labels}}} {b.outstanding}")
            lines.append(f"aiolayer_proxy_backend_healthy{{{labels}}} {int(b.healthy)}")
        return "\n".join(lines) + "\n"


class _OpenAIRoute:
    """A raw ASGI endpoint (not request -> response): the exchange must outlive a returned response."""

    def __init__(self, state: ProxyState, path: str) -> None:
        self.state, self.path = state, path

    async def __call__(self, scope, receive, send) -> None:
        await self.state.serve(scope, receive, send, self.path)


def create_app(pool: Pool, public_url: str, timeouts: ProxyTimeouts | None = None) -> FastAPI:
    state = ProxyState(pool, public_url, timeouts or ProxyTimeouts())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    app = FastAPI(title="aiolayer D-first proxy", lifespan=lifespan)
    app.state.proxy = state

    for path in ("/v1/completions", "/v1/chat/completions"):
        # an ASGI app: Starlette's Route serves a non-function endpoint as one (its hint names handlers only)
        app.router.add_route(path, _OpenAIRoute(state, path), methods=["POST"])  # type: ignore[arg-type]

    @app.post(REGISTER_PATH)
    async def registered(request: Request) -> JSONResponse:
        try:
            body = await request.json()
        except ValueError:
            return JSONResponse({"error": {"message": "body is not JSON"}}, 400)
        return state.registered(body)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            backend = state.pool.pick("decode")
            reply = await state.http.get(backend.url + "/v1/models", timeout=5.0,
                                           headers=forwarded_headers(request.scope["headers"]))
        except (NoBackend, httpx.HTTPError) as exc:
            return JSONResponse({"error": {"message": f"no decode backend answered: {exc}"}}, 503)
        return Response(reply.content, status_code=reply.status_code, media_type="application/json")

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = any(b.healthy for b in state.pool.prefill) and any(b.healthy for b in state.pool.decode)
        return JSONResponse({"healthy": ok, "backends": [
            {"role": b.role, "url": b.url, "control": b.control, "healthy": b.healthy, "problem": b.problem,
             "outstanding": b.outstanding, "topology": b.topology.summary() if b.topology else None}
            for b in state.pool.all]}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(state.metrics())

    return app
