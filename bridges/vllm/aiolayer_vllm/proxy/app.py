"""The proxy's FastAPI app: OpenAI routes through the D-first flow, registration, health, metrics.

The app owns its tasks (health watcher, each decode call) and closes them at shutdown; request
tables are freed in ``finally`` blocks, cancellation included.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from aiolayer.config import Timeouts
from aiolayer.protocol import messages as m
from aiolayer.runtime.control import ControlPeers

from .flow import Exchange, ExchangeError, ProxyTimeouts
from .pool import NoBackend, Pool

log = logging.getLogger(__name__)
REGISTER_PATH = "/internal/aiolayer/registered"


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

    async def start(self) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)  # no pool caps concurrency
        self.client = httpx.AsyncClient(limits=limits)
        self.peers = ControlPeers(Timeouts(control_call=self.timeouts.abort_s), self.spawn)
        self.spawn(self.pool.watch_health(self.client), "health")

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5)
        await self.peers.close()
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
        if not exchange.registered.done():
            exchange.registered.set_result(body)
        return JSONResponse({"accepted": tid}, 202)   # answered at once; P is dispatched by the exchange

    # --- the OpenAI routes ------------------------------------------------------------------------

    async def serve(self, request: Request, path: str) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return self._error(ExchangeError(400, "invalid_request", "body is not JSON"))
        if not isinstance(body, dict):
            return self._error(ExchangeError(400, "invalid_request", "body must be a JSON object"))
        try:
            prefill, decode = self.pool.pick("prefill"), self.pool.pick("decode")
        except NoBackend as exc:
            return self._error(ExchangeError(503, "no_backend", str(exc)))
        exchange = Exchange(self, path, body, prefill, decode)
        self.pending[exchange.transfer_id] = exchange
        streaming = False
        try:
            with self.pool.lease(prefill), self.pool.lease(decode):
                d_resp = await self._unless_disconnected(request, exchange.run_until_decode())
                if exchange.stream and d_resp.status_code == 200:
                    streaming = True
                    return StreamingResponse(self._relay(exchange, d_resp), status_code=200,
                                             media_type=d_resp.headers.get("content-type", "text/event-stream"))
                self.outcomes["ok" if d_resp.status_code == 200 else "decode_http_error"] += 1
                content = await d_resp.aread()
                return Response(content, status_code=d_resp.status_code,
                                media_type=d_resp.headers.get("content-type", "application/json"))
        except ExchangeError as exc:
            await exchange.abort_decode(exc.kind)
            return self._error(exc)
        except asyncio.CancelledError:
            self.outcomes["client_disconnect"] += 1
            await asyncio.shield(exchange.abort_decode("client disconnected"))
            raise
        except Exception as exc:  # noqa: BLE001 - a bug still ends in a JSON error and frees D's blocks
            log.exception("transfer %s: proxy failure", exchange.transfer_id)
            await exchange.abort_decode("proxy failure")
            return self._error(ExchangeError(500, "internal_error", f"proxy failure: {type(exc).__name__}: {exc}"))
        finally:
            if not streaming:
                await exchange.close()

    async def _relay(self, exchange: Exchange, d_resp: httpx.Response):
        """Stream D's bytes; a client that goes away cancels this, which closes D's call."""
        outcome = "client_disconnect"
        try:
            async for chunk in d_resp.aiter_raw():
                if b"data: [DONE]" in chunk:
                    outcome = "ok"   # the client may close as soon as it has the end marker
                yield chunk
            outcome = "ok"
        finally:
            self.outcomes[outcome] += 1
            await exchange.close()

    async def _unless_disconnected(self, request: Request, work):
        """Run ``work``; if the client disconnects first, cancel it (and so the engines' requests)."""
        task = asyncio.ensure_future(work)

        async def watch() -> None:
            # After the body was read, the server's next ASGI message is the client's disconnect.
            while (await request.receive())["type"] != "http.disconnect":
                pass

        watcher = asyncio.ensure_future(watch())
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise asyncio.CancelledError("client disconnected")
            return task.result()
        finally:
            watcher.cancel()
            task.cancel()

    def _error(self, exc: ExchangeError) -> JSONResponse:
        self.outcomes[exc.kind] += 1
        return JSONResponse(exc.body(), status_code=exc.status)

    def metrics(self) -> str:
        lines = ["# TYPE aiolayer_proxy_requests_total counter"]
        lines += [f'aiolayer_proxy_requests_total{{outcome="{k}"}} {v}' for k, v in sorted(self.outcomes.items())]
        lines += ["# TYPE aiolayer_proxy_rejected_registrations_total counter",
                  f"aiolayer_proxy_rejected_registrations_total {self.rejected_registrations}"]
        lines += ["# TYPE aiolayer_proxy_pending_transfers gauge", f"aiolayer_proxy_pending_transfers {len(self.pending)}",
                  "# TYPE aiolayer_proxy_backend_outstanding gauge", "# TYPE aiolayer_proxy_backend_healthy gauge"]
        for b in self.pool.all:
            labels = f'role="{b.role}",url="{b.url}"'
            lines.append(f"aiolayer_proxy_backend_outstanding{{{labels}}} {b.outstanding}")
            lines.append(f"aiolayer_proxy_backend_healthy{{{labels}}} {int(b.healthy)}")
        return "\n".join(lines) + "\n"


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

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await state.serve(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await state.serve(request, "/v1/chat/completions")

    @app.post(REGISTER_PATH)
    async def registered(request: Request) -> JSONResponse:
        try:
            body = await request.json()
        except ValueError:
            return JSONResponse({"error": {"message": "body is not JSON"}}, 400)
        return state.registered(body)

    @app.get("/v1/models")
    async def models() -> Response:
        try:
            backend = state.pool.pick("decode")
            reply = await state.client.get(backend.url + "/v1/models", timeout=5.0)
        except (NoBackend, httpx.HTTPError) as exc:
            return JSONResponse({"error": {"message": f"no decode backend answered: {exc}"}}, 503)
        return Response(reply.content, status_code=reply.status_code, media_type="application/json")

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = any(b.healthy for b in state.pool.prefill) and any(b.healthy for b in state.pool.decode)
        return JSONResponse({"healthy": ok, "backends": [
            {"role": b.role, "url": b.url, "healthy": b.healthy, "outstanding": b.outstanding}
            for b in state.pool.all]}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(state.metrics())

    return app
