"""Prometheus metrics of one Runtime: a snapshot taken on the loop, rendered in the text format, served over HTTP.

``snapshot`` runs on the loop thread only (where every counter is written: it walks dicts the loop
changes), so a scrape sees one consistent state without locks. Other threads read the copy the
runtime publishes (``Runtime.published_metrics``), as the vLLM connector's ``KVConnectorStats`` do.
``MetricsServer`` is a minimal HTTP/1.0 endpoint on the same loop, owned by the runtime's
TaskGroup: ``GET /metrics`` and ``GET /health`` only, bounded reads, every connection closed.
``/health`` is answered on the loop too, so a 200 also says the loop turns; once the runtime stops
(its loop closing what it holds) or its control socket is gone, it answers 503 with the reason.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from .. import compat
from ..backends.mooncake_poll import MAX_RUNS_PER_TARGET
from ..errors import ControlError
from ..transport import url_host

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from ..backends.base import TransferBackend
    from ..config import NodeConfig
    from .send.bridge import LayerBridge
    from .control.plane import ControlPeers, ControlServer
    from .loop import LoopThread
    from .send.metadata import LayoutCache
    from .receive.receiver import Receiver
    from .send.sender import Sender

log = logging.getLogger(__name__)
MAX_REQUEST_HEAD = 8192


class Source(Protocol):
    """What a snapshot reads (``Runtime``; not imported: it imports this module); the optional parts
    exist once it started."""

    node: NodeConfig
    backend: TransferBackend
    bridge: LayerBridge
    loop_thread: LoopThread
    receiver: Receiver
    sender: Sender | None
    server: ControlServer | None
    peers: ControlPeers | None
    layouts: LayoutCache | None


def snapshot(rt: Source) -> dict[str, Any]:
    """Every figure the metrics expose, as new plain data; on the loop thread only.

    From another thread it may raise (a dict changed during iteration): read the runtime's
    ``published_metrics`` there.
    """
    sender, receiver, server = rt.sender, rt.receiver, rt.server
    backend = rt.backend
    deadlines = dict(sender.deadlines) if sender else {}
    deadlines["receive"] = receiver.deadlines_expired
    deadlines["layout_fetch"] = rt.layouts.deadlines_expired if rt.layouts else 0
    peers = rt.peers.health() if rt.peers else {}
    deadlines["control_call"] = rt.peers.totals()["timeout"] if rt.peers else 0
    rejected = dict(server.nacks) if server else {}
    for reason, n in receiver.rejected.items():
        rejected[reason] = rejected.get(reason, 0) + n
    return {
        "engine_id": rt.node.engine_id,
        "bytes_sent": sender.bytes_sent if sender else 0,
        "bytes_received": receiver.bytes_received,
        "transfers": {("send", k): v for k, v in (sender.outcome_counts if sender else {}).items()}
        | {("receive", k): v for k, v in receiver.outcome_counts.items()},
        "handoff": (sender.handoff.cumulative(), sender.handoff.sum) if sender else ([], 0.0),
        "handoff_p99_s": sender.handoff.quantile(0.99) if sender else 0.0,   # a bucket's upper bound
        "queues": {"bridge": len(rt.bridge), "sending": sender.active if sender else 0,
                   "peers": len(rt.peers) if rt.peers else 0,
                   "receiving": receiver.pending, "writes_in_flight": getattr(backend, "inflight", 0),
                   "writes_quarantined": backend.quarantined},
        # the most runs in flight to one peer at once: Mooncake's queue per peer breaks past 65,535
        "writes_peak_per_peer": getattr(backend, "peak_runs_per_target", 0),
        "peers": peers,
        "deadlines": deadlines,
        "rejected": rejected,
        "frames": server.frames_received if server else 0,
        "fence_timeouts": sender.fence_timeouts if sender else 0,
        "fences_unconfirmed": receiver.fences_unconfirmed,
        "receive_failures": dict(receiver.failures),
        "task_errors": rt.loop_thread.task_errors,
        # sampled end-to-end checks: P's sent ("sampled"; "sent_early": a part before the DONE, taken by D),
        # D's "verified" / "mismatch" / "unfinished" (at DONE) and "verified_early" (early parts it verified)
        "integrity": {"sampled": sender.integrity_checks if sender else 0,
                      "sent_early": sender.early_checks if sender else 0, **receiver.integrity},
    }


class _SnapshotCollector:
    def __init__(self, snap: dict[str, Any]) -> None:
        self.snap = snap

    def collect(self) -> Iterator[Metric]:
        s = self.snap
        yield _counter("aiolayer_bytes_sent", "bytes P wrote into D's KV cache", s["bytes_sent"])
        yield _counter("aiolayer_bytes_received", "bytes D received, as reported by P's DONE", s["bytes_received"])
        yield _counter("aiolayer_transfers", "transfers that reached a terminal state", None,
                       ["role", "outcome"], [([r, o], v) for (r, o), v in sorted(s["transfers"].items())])
        buckets, total = s["handoff"]
        hist = HistogramMetricFamily("aiolayer_bridge_handoff_seconds",
                                     "forward thread hand-off to the loop picking the layer up")
        if buckets:
            hist.add_metric([], [(_le(b), n) for b, n in buckets], sum_value=total)
        yield hist
        queues = GaugeMetricFamily("aiolayer_queue_depth", "items waiting or in progress", labels=["queue"])
        for name, depth in s["queues"].items():
            queues.add_metric([name], depth)
        yield queues
        yield GaugeMetricFamily("aiolayer_writes_peak_per_peer", "the most write runs in flight to one peer at "
                                f"once since start (Mooncake: {MAX_RUNS_PER_TARGET:,} at most by default; its "
                                "own queue per peer breaks past 65,535)", value=s.get("writes_peak_per_peer", 0))
        up = GaugeMetricFamily("aiolayer_peer_up", "1 if the peer answered our last control call",
                               labels=["peer"])
        calls = CounterMetricFamily("aiolayer_peer_calls", "control calls to a peer, by result",
                                    labels=["peer", "result"])
        for peer, (last_ok, results) in sorted(s["peers"].items()):
            if last_ok is not None:
                up.add_metric([peer], int(last_ok))
            for result, n in sorted(results.items()):
                calls.add_metric([peer, result], n)
        yield up
        yield calls
        yield _counter("aiolayer_deadline_expiries", "waits that ran past their Timeouts deadline", None,
                       ["phase"], [([k], v) for k, v in sorted(s["deadlines"].items())])
        yield _counter("aiolayer_control_rejected", "control frames refused (Nack code, or dropped unanswered)",
                       None, ["code"], [([k], v) for k, v in sorted(s["rejected"].items())])
        yield _counter("aiolayer_control_frames", "control frames received", s["frames"])
        yield _counter("aiolayer_fence_timeouts", "timed-out writes still unresolved after the quarantine",
                       s["fence_timeouts"])
        yield _counter("aiolayer_fences_unconfirmed", "D's fences that ended on fence_grace alone, a writer never "
                       "confirmed it stopped (its blocks were freed on time, not on its word)",
                       s.get("fences_unconfirmed", 0))
        yield _counter("aiolayer_receive_failures", "D's receives that failed before their KV was accepted, by "
                       "cause: deadline (P died, hung, never came), aborted (given up at D), prefill_failed "
                       "(P's FAILED, or D's integrity check refused its DONE), refused (the registration)",
                       None, ["cause"], [([k], v) for k, v in sorted(s.get("receive_failures", {}).items())])
        yield _counter("aiolayer_integrity_checks", "sampled end-to-end KV checks: sent by P (sampled; "
                       "sent_early: the part landed before the DONE, taken by D), verified, mismatched or "
                       "unfinished (not read within done_delivery) at D (verified_early: early parts verified)",
                       None, ["result"],
                       [([k], v) for k, v in sorted(s["integrity"].items())])
        yield _counter("aiolayer_task_errors", "loop tasks that ended with an error (logged, the runtime went on)",
                       s.get("task_errors", 0))


def _counter(name: str, doc: str, value: float | None, labels: Sequence[str] | None = None,
             samples: Iterable[tuple[Sequence[str], float]] = ()) -> CounterMetricFamily:
    fam = CounterMetricFamily(name, doc, labels=labels)
    if labels is None:
        if value is None:
            raise ValueError(f"{name}: a counter without labels needs its value")
        fam.add_metric([], value)
    for label_values, v in samples:
        fam.add_metric(label_values, v)
    return fam


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)


def render(snap: dict[str, Any]) -> bytes:
    """The Prometheus text exposition of a snapshot."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_SnapshotCollector(snap))
    return generate_latest(registry)


Health = tuple[bool, dict[str, Any]]   # (serving, what /health says: "status", "reason" when not serving)


def health_body(health: Health) -> tuple[str, bytes]:
    ok, body = health
    return ("200 OK" if ok else "503 Service Unavailable"), (json.dumps(body) + "\n").encode()


class MetricsServer:
    """``GET /metrics`` and ``GET /health`` on ``host:port`` (0 = a free port), served on the runtime's loop."""

    def __init__(self, host: str, port: int, scrape: Callable[[], Awaitable[bytes]], read_timeout: float,
                 health: Callable[[], Health] | None = None) -> None:
        self.host, self.port = host, port
        self.scrape = scrape              # coroutine function -> bytes, run on the loop
        self.health = health              # on the loop: (serving, body)
        self.read_timeout = read_timeout
        self.scrapes = 0
        self._server: asyncio.base_events.Server | None = None

    @property
    def url(self) -> str:
        return f"http://{url_host(self.host)}:{self.port}/metrics"

    async def start(self) -> str:
        try:
            self._server = await asyncio.start_server(self._serve, self.host, self.port)
        except OSError as exc:
            raise ControlError(f"cannot bind the metrics endpoint on {self.host}:{self.port}: {exc}") from exc
        self.port = self._server.sockets[0].getsockname()[1]
        return self.url

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with compat.timeout(self.read_timeout):
                head = await reader.readuntil(b"\r\n\r\n")
            status, body = await self._answer(head)
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            status, body = "400 Bad Request", b"bad request\n"
        kind = "application/json" if body.startswith(b"{") else "text/plain; version=0.0.4"
        try:
            writer.write(f"HTTP/1.0 {status}\r\nContent-Type: {kind}\r\n"
                         f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
            async with compat.timeout(self.read_timeout):
                await writer.drain()
        except (TimeoutError, ConnectionError):
            pass   # the scraper went away: nothing to tell it
        finally:
            writer.close()

    async def _answer(self, head: bytes) -> tuple[str, bytes]:
        if len(head) > MAX_REQUEST_HEAD:
            return "431 Request Header Fields Too Large", b"request head too large\n"
        parts = head.split(b"\r\n", 1)[0].split()
        if len(parts) < 2 or parts[0] != b"GET":
            return "405 Method Not Allowed", b"only GET /metrics or /health\n"
        path = parts[1].split(b"?", 1)[0]
        if path == b"/health" and self.health is not None:
            return health_body(self.health())
        if path != b"/metrics":
            return "404 Not Found", b"only GET /metrics or /health\n"
        self.scrapes += 1
        return "200 OK", await self.scrape()
