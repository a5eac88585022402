"""Stand-ins for vLLM engines in front of which ``aiolayer proxy`` runs as a real process.

``FakeEngine``: a small vLLM-like OpenAI server (uvicorn in a thread of the test process, real
sockets). D takes ``kv_transfer_params``, POSTs its registration to the proxy's ``notify_url`` as the
connector does, sends its status line at once and streams SSE chunks once P prefilled; P answers the
prefill. Each has a real aiolayer control socket of its own (recording the proxy's ``AbortRequest``
and answering its ``TopologyRequest`` as a one-rank engine), or uses the control sockets of
``StandInRanks``: real memory-backend runtimes, one per rank at the connector's port rule, each with
the identity the vLLM bridge sets, for engines of several ranks or whose control socket must stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import socket
import threading
import time
from typing import Callable

import httpx
import msgspec
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from aiolayer import Identity, NodeConfig, Registration, Runtime
from aiolayer.errors import ControlError
from aiolayer.protocol import messages as m
from aiolayer.runtime.control.plane import ControlServer
from aiolayer.harness.pd import ProxyProcess
from aiolayer.harness.procs import free_ports

MODEL = "tiny/0123456789ab"            # the fingerprint every stand-in says unless told otherwise
ROLES = {"prefill": "producer", "decode": "consumer"}


def registration(transfer_id: str, token: str, incarnation: str, control: str, *, rank: int = 0, ranks: int = 1,
                 blocks=(3, 4), first_block: int = 0) -> dict:
    """D's rank's registration as the connector POSTs it to the proxy (``aiolayer_vllm.params``)."""
    from aiolayer_vllm.params import DecodeRegistration
    from aiolayer_vllm.ranks import rank_transfer_id

    reg = Registration(transfer_id=rank_transfer_id(transfer_id, rank, ranks), block_ids=list(blocks),
                       first_block=first_block, token=token, incarnation=incarnation, decode_control=control)
    return msgspec.to_builtins(DecodeRegistration(transfer_id=transfer_id, registration=reg, rank=rank, ranks=ranks))


@contextlib.contextmanager
def proxied_pair(*proxy_args: str):
    """A fake P and D sharing one ``Hub``, ``aiolayer proxy`` (a real process) in front of them with
    ``proxy_args``; yields ``{"hub", "p", "d", "proxy"}`` and stops all of them on the way out."""
    hub = Hub()
    with contextlib.ExitStack() as stack:
        p = FakeEngine("prefill", "p", hub).start()
        stack.callback(p.stop)
        d = FakeEngine("decode", "d", hub).start()
        stack.callback(d.stop)
        proxy = ProxyProcess([f"{p.url},{p.control}"], [f"{d.url},{d.control}"], startup_timeout_s=60,
                             extra_args=proxy_args).start()
        stack.callback(proxy.stop)
        yield {"hub": hub, "p": p, "d": d, "proxy": proxy}


def wait_for(check, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"not within {timeout_s}s: {what}"
        time.sleep(0.02)


class Hub:
    """What the fake engines share across their threads: which transfers P prefilled, test switches."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: dict[str, threading.Event] = {}

    def event(self, name: str) -> threading.Event:
        with self._lock:
            return self._events.setdefault(name, threading.Event())


class FakeEngine:
    """A vLLM-like OpenAI server (role "prefill" or "decode") with an aiolayer control socket: its own
    (a one-rank engine running ``model``), or ``control`` (a ``StandInRanks``')."""

    def __init__(self, role: str, name: str, hub: Hub, *, control: str = "", model: str = MODEL) -> None:
        self.role, self.name, self.hub = role, name, hub
        self.model, self.given_control = model, control
        self.requests: list[dict] = []        # bodies received on the OpenAI routes
        self.headers: dict[str, dict] = {}    # transfer id -> the headers its OpenAI request came with
        self.streams: dict[str, str] = {}     # D: transfer id -> open | completed | closed
        self.aborts: list[str] = []           # D: transfer ids the proxy told to abort
        self.local: list[dict] = []           # D: bodies it prefilled itself (no kv_transfer_params)
        self.gate = threading.Event()         # P: answers prefills only while set
        self.gate.set()
        self.healthy = True                   # what its /health says
        self.control = control
        self._tasks: set[asyncio.Task] = set()
        routes = [Route("/health", self._health), Route("/v1/completions", self._serve, methods=["POST"]),
                  Route("/v1/chat/completions", self._serve, methods=["POST"])]
        app = Starlette(routes=routes, lifespan=self._lifespan)
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="critical", timeout_graceful_shutdown=1))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    def start(self) -> "FakeEngine":
        self._thread.start()
        wait_for(lambda: self._server.started and self.control, 30, f"{self.name} started")
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        self._sock.close()

    def saw(self, transfer_id: str) -> bool:
        return any((b.get("kv_transfer_params") or {}).get("aiolayer", {}).get("transfer_id") == transfer_id
                   for b in self.requests)   # a request D prefilled alone has none

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        if self.given_control:
            yield
            return

        async def on_control(msg: m.Message) -> m.Message:
            if isinstance(msg, m.TopologyRequest):
                return m.TopologyReply(engine_id=self.name, incarnation=f"{self.name}-1", control=self.control,
                                       role=ROLES[self.role], model=self.model)
            if isinstance(msg, m.AbortRequest):
                self.aborts.append(msg.transfer_id)
            return m.Ack(detail="aborting")

        server = ControlServer("127.0.0.1", 0, on_control)
        self.control = await server.start(asyncio.get_running_loop().create_task)
        try:
            yield
        finally:
            await server.close()

    async def _health(self, request):
        return JSONResponse({}, status_code=200 if self.healthy else 503)

    async def _serve(self, request):
        body = await request.json()
        self.requests.append(body)
        if body.get("max_tokens") is not None and body.get("min_tokens", 0) > body["max_tokens"]:   # vLLM's check
            return JSONResponse({"error": {"message": "min_tokens must be less than or equal to max_tokens"}}, 400)
        fake = body.get("fake", {})
        if self.role == "decode" and body.get("kv_transfer_params") is None:   # no P: D prefills it itself
            await asyncio.sleep(fake.get("local_prefill_s", 0))
            self.local.append(body)
            if not body.get("stream"):
                return JSONResponse({"choices": [{"text": f"{self.name}: local"}], "engine": self.name})
            return StreamingResponse(self._stream_local(fake), media_type="text/event-stream")
        params = body["kv_transfer_params"]["aiolayer"]
        self.headers[params["transfer_id"]] = dict(request.headers)
        if self.role == "prefill":
            while not self.gate.is_set():
                await asyncio.sleep(0.01)
            await asyncio.sleep(fake.get("prefill_s", 0))
            self.hub.event("prefilled " + params["transfer_id"]).set()   # the KV is at D
            await asyncio.sleep(fake.get("p_reply_after_s", 0))   # P's own first token comes later
            self.hub.event("p replied " + params["transfer_id"]).set()
            if fake.get("p_status"):
                return Response(fake.get("p_body", '{"error": {"message": "P failed"}}'), fake["p_status"],
                                media_type="application/json")
            return JSONResponse({"choices": [{"text": "p"}], "usage": {"completion_tokens": 1}})
        if fake.get("d_status"):   # vLLM's OpenAI server refuses the request before its engine sees it
            return Response(fake["d_body"], fake["d_status"], media_type="application/json")
        if fake.get("register", True):   # the connector's worker POSTs it while the request is parked
            task = asyncio.get_running_loop().create_task(self._register(params))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        if body.get("stream"):   # vLLM sends its status line at once and the tokens as they come
            return StreamingResponse(self._stream(params["transfer_id"], fake), media_type="text/event-stream")
        await self._prefilled(params["transfer_id"])
        return JSONResponse({"choices": [{"text": f"{self.name}: done"}], "engine": self.name})

    async def _stream_local(self, fake: dict):
        for i in range(fake.get("chunks", 3)):
            yield f"data: {json.dumps({'choices': [{'text': f'{self.name}-local-{i}'}]})}\n\n"
        yield "data: [DONE]\n\n"

    async def _register(self, params: dict) -> None:
        body = registration(params["transfer_id"], params["token"], f"{self.name}-1", self.control)
        async with httpx.AsyncClient(timeout=5, trust_env=False) as client:
            await client.post(params["notify_url"], json=body)

    async def _prefilled(self, transfer_id: str) -> None:
        flag = self.hub.event("prefilled " + transfer_id)
        deadline = time.monotonic() + 30
        while not flag.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    async def _stream(self, transfer_id: str, fake: dict):
        self.streams[transfer_id] = "open"
        try:
            await self._prefilled(transfer_id)
            await asyncio.sleep(fake.get("hold_s", 0))   # D's first token comes late
            until = self.hub.event(fake["until"]) if "until" in fake else None
            for i in range(fake.get("chunks", 3)):
                if until is not None and until.is_set():
                    break
                if i == fake.get("fail_at"):
                    raise RuntimeError("D died mid-stream")   # uvicorn drops the connection mid-body
                if i == fake.get("error_at"):   # vLLM's end of a request that failed (e.g. its KV never came)
                    yield f"data: {json.dumps({'error': VLLM_STREAM_ERROR})}\n\n"
                    break
                text = f"{self.name}-{i}" + "x" * fake.get("pad", 0)   # pad: a token's text as long as asked
                yield f"data: {json.dumps({'choices': [{'text': text}]})}\n\n"
                await asyncio.sleep(fake.get("interval_s", 0))
            yield "data: [DONE]\n\n"
            self.streams[transfer_id] = "completed"
        finally:
            if self.streams[transfer_id] == "open":
                self.streams[transfer_id] = "closed"


# what vLLM's OpenAI server streams when a request fails in its engine (create_streaming_error_response)
VLLM_STREAM_ERROR = {"message": "Internal server error", "type": "InternalServerError", "param": None, "code": 500}


def _start_on_its_port(make: Callable[[], Runtime], within: float = 10.0) -> Runtime:
    """A restarted rank wants its old port back; a connection of the proxy's health checks may hold that
    port as its own ephemeral one for a moment ("Address already in use", seen in CI): retry, bounded."""
    deadline = time.monotonic() + within
    while True:
        try:
            return make().start()
        except ControlError as exc:
            if "Address already in use" not in str(exc) or time.monotonic() > deadline:
                raise
        time.sleep(0.2)


class StandInRanks:
    """An engine's ranks' control sockets: a memory-backend ``Runtime`` per rank at the connector's port
    rule (base + dp x TP + tp), each with the identity the vLLM bridge sets. ``stop`` and ``start``
    again: the same ports, new incarnations (an engine restarted)."""

    def __init__(self, name: str, role: str, tp: int = 1, dp: int = 1, model: str = MODEL) -> None:
        self.name, self.role, self.tp, self.dp, self.model = name, role, tp, dp, model
        self.base = free_ports(tp * dp)
        self.control = f"tcp://127.0.0.1:{self.base}"
        self.ranks: list[Runtime | None] = [None] * (tp * dp)

    def start(self, *only: int) -> "StandInRanks":
        """Start every rank (or those given) that is not running."""
        for index in only or range(len(self.ranks)):
            if self.ranks[index] is None:
                dp, tp = divmod(index, self.tp)
                self.ranks[index] = _start_on_its_port(functools.partial(self._rank, index, dp, tp))
        return self

    def _rank(self, index: int, dp: int, tp: int) -> Runtime:
        rt = Runtime(NodeConfig(engine_id=f"{self.name}-dp{dp}-tp{tp}", backend="memory",
                                control_port=self.base + index))
        rt.set_identity(Identity(role=self.role, tp_rank=tp, tp_size=self.tp, dp_rank=dp, dp_size=self.dp,
                                 model=self.model))
        return rt

    def stop(self, *only: int) -> None:
        for index in only or range(len(self.ranks)):
            rt, self.ranks[index] = self.ranks[index], None
            if rt is not None:
                rt.stop()
