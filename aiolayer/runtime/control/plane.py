"""Control plane over zmq.asyncio: a ROUTER server that answers every frame, DEALER clients with deadlines.

A frame is ``[request_id, payload]`` (the ROUTER adds the peer identity; a REQ peer's empty
delimiter is accepted and echoed, so plain REQ clients work too). The server replies to
every frame, valid or not: a handler's reply, or a ``Nack`` with a code and a reason. A client
matches replies by request id, so a late reply to an abandoned call is dropped, never mistaken for
the next one. One ZMQ context per process; every socket is closed with linger 0.

A peer endpoint comes from the network or a request: it is checked (``check_endpoint``) before a
socket exists, and any failure to connect closes the socket and raises ``ControlError``.

At most ``max_concurrent`` frames are worked on at once (past that the server reads no more). A
handler about to wait long (a lookup held for its registration) gives its slot back first
(``release_slot``): held, a thousand lookups of made-up ids would stop every other frame, DONEs and
Aborts included, for the whole wait. Such waits are bounded by their own table instead.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import itertools
import logging
import random
import time
from typing import Awaitable, Callable

import zmq
import zmq.asyncio

from ... import compat
from ...config import Timeouts
from ...errors import ControlError, ControlRejected, ControlTimeout, FrameDropped, ProtocolError, RuntimeStateError
from ...protocol import messages as m
from ...protocol.codes import NackCode
from ...transport import MAX_ENDPOINT_CHARS, check_endpoint, url_host  # noqa: F401 - re-exported
from ..loop import Spawn

log = logging.getLogger(__name__)

Handler = Callable[[m.Message], Awaitable[m.Message]]

_context: zmq.asyncio.Context | None = None
_SLOT: contextvars.ContextVar[Callable[[], None] | None] = contextvars.ContextVar("control_slot", default=None)
_BAD_RID = m.pack_request_id(0)
_JITTER = random.Random()   # retry jitter: its own generator, never the process's shared one


def release_slot() -> None:
    """From a handler the control server runs: give its slot to the next frame before a long wait."""
    release = _SLOT.get()
    if release is not None:
        release()


def shared_context() -> zmq.asyncio.Context:
    """The process's one ZMQ context (created on first use)."""
    global _context
    if _context is None or _context.closed:
        _context = zmq.asyncio.Context()
    return _context


def open_sockets() -> int:
    """Sockets of this process's context still open (for leak checks)."""
    if _context is None or _context.closed:
        return 0
    return sum(1 for s in list(_context._sockets) if not s.closed)  # noqa: SLF001 - read-only


class ControlServer:
    def __init__(self, host: str, port: int, handler: Handler, *, max_frame_bytes: int = 1 << 20,
                 max_concurrent: int = 1024) -> None:
        self.host = host
        self.port = port
        self.handler = handler
        self.max_frame_bytes = max_frame_bytes
        self.endpoint = ""
        self.frames_received = 0
        self.nacks_sent = 0
        self.nacks: collections.Counter[str] = collections.Counter()   # refused frames, by Nack code
        self.dropped = 0                                               # fault injection: unanswered
        self.send_errors = 0
        self._sock: zmq.asyncio.Socket | None = None
        self._slots = asyncio.Semaphore(max_concurrent)
        self._task: asyncio.Task[None] | None = None

    async def start(self, spawn: Spawn) -> str:
        sock = shared_context().socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, 4 * self.max_frame_bytes)  # beyond: drop the peer, not our memory
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        host = url_host(self.host)
        if host != self.host:
            sock.setsockopt(zmq.IPV6, 1)   # ZMQ resolves IPv4 only unless told (and wants brackets)
        try:
            if self.port:
                sock.bind(f"tcp://{host}:{self.port}")
            else:
                self.port = sock.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as exc:
            sock.close(0)
            raise ControlError(f"cannot bind control socket on {host}:{self.port}: {exc}") from exc
        self._sock = sock
        self.endpoint = f"tcp://{host}:{self.port}"
        self._task = spawn(self._serve(), name=f"control-server {self.endpoint}")
        return self.endpoint

    @property
    def bound(self) -> bool:
        """Whether the socket is bound and its serving task still runs (one that ended answers nothing)."""
        return self._sock is not None and self._task is not None and not self._task.done()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None

    async def _serve(self) -> None:
        sock = self._sock
        if sock is None:
            raise RuntimeStateError("control server is not started")
        loop_spawn = asyncio.get_running_loop().create_task
        pending: set[asyncio.Task[None]] = set()
        try:
            while True:
                frames = await sock.recv_multipart(copy=True)
                self.frames_received += 1
                await self._slots.acquire()
                task = loop_spawn(self._answer(sock, frames))
                pending.add(task)
                task.add_done_callback(pending.discard)
        finally:
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=1.0)

    async def _answer(self, sock: zmq.asyncio.Socket, frames: list[bytes]) -> None:
        """Reply to one frame on ``sock``, the socket it came in on; its slot is released once."""
        held = [True]

        def release() -> None:
            if held[0]:
                held[0] = False
                self._slots.release()
        _SLOT.set(release)   # this task's own context: seen by its handler only
        try:
            # A REQ peer's frames carry an empty delimiter after the identity; its reply must too.
            envelope = frames[:2] if len(frames) >= 2 and frames[1] == b"" else frames[:1]
            frames = [frames[0], *frames[len(envelope):]]
            rid = _BAD_RID
            reply: m.Message | None = None
            if len(frames) >= 2 and m.unpack_request_id(frames[1]) is not None:
                rid = frames[1]  # echo a valid id even on a malformed frame, so the caller can match it
            if len(frames) != 3:
                reply = m.Nack(code=NackCode.FRAME,
                               reason=f"expected [request_id, payload], got {len(frames) - 1} frames")
            elif m.unpack_request_id(frames[1]) is None:
                reply = m.Nack(code=NackCode.FRAME, reason="request id must be 8 bytes")
            else:
                reply = await self._dispatch(frames[2])
            if reply is None:
                self.dropped += 1
                return
            if isinstance(reply, m.Nack):
                self.nacks_sent += 1
                self.nacks[str(reply.code)] += 1   # plain str keys: the snapshot is plain data
            try:
                await sock.send_multipart([*envelope, rid, m.encode(reply)])
            except zmq.ZMQError as exc:  # peer gone (ROUTER_MANDATORY): nobody to tell
                self.send_errors += 1
                log.debug("control reply to a departed peer dropped: %s", exc)
        finally:
            release()

    async def _dispatch(self, payload: bytes) -> m.Message | None:
        if len(payload) > self.max_frame_bytes:
            return m.Nack(code=NackCode.SIZE, reason=f"payload of {len(payload)} bytes exceeds {self.max_frame_bytes}")
        try:
            msg = m.decode(payload)
        except m.DecodeFailure as exc:
            return m.Nack(code=exc.code, reason=exc.reason)
        log.debug("%s: %s", self.endpoint, type(msg).__name__)
        try:
            return await self.handler(msg)
        except asyncio.CancelledError:
            raise
        except ControlRejected as exc:
            return m.Nack(code=exc.code, reason=exc.reason)
        except FrameDropped:
            return None
        except Exception as exc:  # the peer is told, and so is the log
            log.exception("control handler failed on %s", type(msg).__name__)
            return m.Nack(code=NackCode.INTERNAL, reason=f"{type(exc).__name__}: {exc}"[:300])


class ControlClient:
    """One DEALER to one peer; concurrent calls are matched to replies by request id."""

    _ids = itertools.count(1)

    def __init__(self, endpoint: str, timeouts: Timeouts) -> None:
        self.endpoint = endpoint
        self.timeouts = timeouts
        self._sock: zmq.asyncio.Socket | None = None
        self._pending: dict[int, asyncio.Future[m.Message]] = {}
        self._reader: asyncio.Task[None] | None = None
        self.late_replies = 0
        self.results: collections.Counter[str] = collections.Counter()   # ok / timeout / rejected / error
        self.last_ok: bool | None = None                                  # the peer's health, as last seen
        self.last_used = time.monotonic()

    @property
    def idle(self) -> bool:
        return not self._pending

    async def start(self, spawn: Spawn) -> None:
        check_endpoint(self.endpoint)
        sock = shared_context().socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IMMEDIATE, 1)      # queue nothing for a peer that is not connected
            sock.setsockopt(zmq.SNDHWM, 10000)
            if "://[" in self.endpoint:
                # an IPv6 peer (url_host's brackets); only then, so that a name such as localhost
                # keeps resolving to IPv4, where an IPv4 server listens
                sock.setsockopt(zmq.IPV6, 1)
            sock.connect(self.endpoint)
        except (zmq.ZMQError, UnicodeError, TypeError, ValueError) as exc:
            sock.close(0)
            raise ControlError(f"cannot connect to {self.endpoint!r}: {exc}") from exc
        self._sock = sock
        self._reader = spawn(self._read(), name=f"control-client {self.endpoint}")

    async def close(self) -> None:
        reader = self.shut()
        if reader is not None:
            await asyncio.gather(reader, return_exceptions=True)

    def shut(self) -> asyncio.Task[None] | None:
        """Close without a suspension (a caller cancelled meanwhile leaks nothing): the reader cancelled,
        the socket closed, waiting calls failed. Returns the reader, to await its end."""
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.cancel()
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(ControlError(f"client to {self.endpoint} closed"))
                fut.exception()  # a waiting call still gets it; an abandoned one is not logged as lost
        self._pending.clear()
        return reader

    async def call(self, msg: m.Message, timeout: float | None = None) -> m.Message:
        """Send ``msg`` and return the reply; a Nack raises ControlRejected."""
        if self._sock is None:
            raise RuntimeStateError(f"control client to {self.endpoint} is not started")
        timeout = self.timeouts.control_call if timeout is None else timeout
        rid = next(self._ids)
        self.last_used = time.monotonic()
        fut: asyncio.Future[m.Message] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        try:
            async with compat.timeout(timeout):
                await self._sock.send_multipart([m.pack_request_id(rid), m.encode(msg)])
                reply = await fut
        except TimeoutError:
            self._note("timeout", False)
            raise ControlTimeout("control_call", timeout, f"{type(msg).__name__} to {self.endpoint}") from None
        except (ControlError, zmq.ZMQError):
            self._note("error", False)
            raise
        finally:
            self._pending.pop(rid, None)
        if isinstance(reply, m.Nack):
            self._note("rejected", True)   # it answered: the peer is up, it said no
            raise ControlRejected(reply.code, reply.reason)
        self._note("ok", True)
        return reply

    def _note(self, result: str, up: bool) -> None:
        self.results[result] += 1
        self.last_ok = up

    async def call_with_retries(self, msg: m.Message, deadline_s: float) -> m.Message:
        """For idempotent requests: retry on timeout with jittered back-off, all within ``deadline_s``.
        The last attempt waits for whatever is left of it: a peer that is slow, not gone (D checking a
        DONE takes up to ``done_delivery``), still answers within the deadline the caller gave."""
        loop = asyncio.get_running_loop()
        end = loop.time() + deadline_s
        attempts = self.timeouts.control_retries
        for attempt in range(1, attempts + 1):
            left = end - loop.time()
            if left <= 0:
                break
            last = attempt == attempts
            try:
                return await self.call(msg, timeout=left if last else min(self.timeouts.control_call, left))
            except ControlTimeout:
                if last:
                    raise
            await asyncio.sleep(min(max(0.0, end - loop.time()), _JITTER.uniform(0.01, 0.05) * attempt))
        raise ControlTimeout("control_call", deadline_s,
                             f"{type(msg).__name__} to {self.endpoint}, {attempts} attempts")

    async def _read(self) -> None:
        sock = self._sock
        if sock is None:
            raise RuntimeStateError(f"control client to {self.endpoint} is not started")
        while True:
            frames = await sock.recv_multipart(copy=True)
            rid = m.unpack_request_id(frames[0]) if len(frames) == 2 else None
            fut = self._pending.get(rid) if rid is not None else None
            if fut is None or fut.done():
                self.late_replies += 1  # a reply to a call that already timed out
                continue
            try:
                fut.set_result(m.decode(frames[1]))
            except m.DecodeFailure as exc:
                fut.set_exception(ProtocolError(f"undecodable reply from {self.endpoint}: {exc}"))


class ControlPeers:
    """Started clients keyed by endpoint, created on first use, all closed together.

    Peers come and go (a restarted D listens on a new port): a client idle for ``peer_idle`` is closed
    when a new peer is added, so a long-lived P does not keep a reconnecting socket and a reader
    task per departed peer. Its call counts stay in ``totals``.
    """

    def __init__(self, timeouts: Timeouts, spawn: Spawn) -> None:
        self.timeouts = timeouts
        self._spawn = spawn
        self._clients: dict[str, ControlClient] = {}
        self._retired: collections.Counter[str] = collections.Counter()   # results of closed clients
        self.evicted = 0
        self._closed = False   # a DONE or FAILED made after ``close`` opens no socket that outlives it

    def table_sizes(self) -> dict[str, int]:
        return {"clients": len(self._clients)}

    async def get(self, endpoint: str) -> ControlClient:
        if self._closed:
            raise ControlError(f"control peers closed (the runtime stops): no call to {endpoint}")
        client = self._clients.get(check_endpoint(endpoint))
        if client is None:
            await self._evict_idle()
            client = self._clients.get(endpoint)   # another caller may have added it meanwhile
        if client is None:
            if self._closed:   # closed while the eviction awaited
                raise ControlError(f"control peers closed (the runtime stops): no call to {endpoint}")
            client = ControlClient(endpoint, self.timeouts)
            await client.start(self._spawn)        # no suspension inside: no second client can race in
            self._clients[endpoint] = client
        return client

    async def _evict_idle(self) -> None:
        cutoff = time.monotonic() - self.timeouts.peer_idle
        # all out of the table before the first await: nobody picks one up, no other eviction sees it
        stale = [self._clients.pop(ep) for ep, c in list(self._clients.items()) if c.idle and c.last_used < cutoff]
        for client in stale:
            self._retired.update(client.results)
            self.evicted += 1
        readers = [client.shut() for client in stale]   # every one shut before the first await
        await asyncio.gather(*(r for r in readers if r is not None), return_exceptions=True)

    def health(self) -> dict[str, tuple[bool | None, dict[str, int]]]:
        """Per current peer endpoint: (answered the last call, call results by kind)."""
        return {ep: (c.last_ok, dict(c.results)) for ep, c in list(self._clients.items())}

    def totals(self) -> collections.Counter[str]:
        """Call results by kind over every client this process had, closed ones included."""
        out = collections.Counter(self._retired)
        for client in list(self._clients.values()):
            out.update(client.results)
        return out

    def __len__(self) -> int:
        return len(self._clients)

    async def close(self) -> None:
        self._closed = True
        readers = [client.shut() for client in self._clients.values()]
        self._clients = {}
        await asyncio.gather(*(r for r in readers if r is not None), return_exceptions=True)
