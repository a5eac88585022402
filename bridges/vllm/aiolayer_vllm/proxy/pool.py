"""Backends (vLLM servers with their aiolayer control endpoints), least-outstanding choice, health.

A backend's parallel layout is what its engine's ranks said (``topology``), not what it was declared
with. A backend that fails its health check (its HTTP ``/health``, or the topology of its control
sockets) is taken out of rotation, with the reason in ``problem``, and put back when it passes
again. ``outstanding`` counts the requests a backend is working on: a ``Lease`` holds it from the
pick until that engine's part ends (P: its prefill answered; D: its answer relayed or closed), and
is released exactly once, from ``finally`` blocks, so no way a request ends can leak a count.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import httpx

from aiolayer import ControlPeers

from .topology import Learned, rank_endpoint, recheck

log = logging.getLogger(__name__)


@dataclass
class Backend:
    role: str                 # "prefill" | "decode"
    url: str                  # http://host:port of the vLLM OpenAI server
    control: str              # tcp://host:port of its aiolayer connector's first rank
    declared_tp: int = 0      # ,tp=N as given: only checked against what the engine says (0: not given)
    healthy: bool = True
    outstanding: int = 0
    served: int = 0
    topology: Learned | None = None   # what its ranks said (``topology.learn``)
    problem: str = ""         # why it is out of rotation ("" while it passes)

    @property
    def tp(self) -> int:
        """Its tensor-parallel size: as learned (before that, as declared)."""
        return self.topology.tp if self.topology is not None else self.declared_tp or 1

    @property
    def controls(self) -> list[str]:
        """Its first data-parallel rank's TP ranks' endpoints, by the connector's rule (aiolayer_vllm.ranks)."""
        return [rank_endpoint(self.control, r) for r in range(self.tp)]

    @property
    def name(self) -> str:
        return f"--{self.role} {self.url} (control {self.control})"

    def adopt(self, learned: Learned) -> None:
        self.topology = learned

    @classmethod
    def parse(cls, role: str, spec: str) -> "Backend":
        """``URL,CONTROL[,tp=N]``, e.g. ``http://127.0.0.1:8100,tcp://127.0.0.1:5600,tp=2``."""
        url, sep, rest = spec.partition(",")
        control, _, extra = rest.partition(",")
        tp = extra.removeprefix("tp=")
        port = control.rpartition(":")[2]
        bad_tp = bool(extra) and not (extra.startswith("tp=") and tp.isdigit() and 1 <= int(tp) <= 1024)
        if not sep or not url.startswith(("http://", "https://")) or not control.startswith("tcp://") \
                or not port.isdigit() or bad_tp or int(port) + int(tp or 1) - 1 > 65535:
            raise ValueError(f"--{role} expects URL,CONTROL[,tp=N] (http://host:port,tcp://host:port,tp=2), "
                             f"got {spec!r}")
        return cls(role, url.rstrip("/"), control, declared_tp=int(tp or 0))


class NoBackend(Exception):
    pass


class Lease:
    """One request's hold on a backend, counted in its ``outstanding`` until ``release`` (idempotent)."""

    __slots__ = ("backend", "_held")

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self._held = True
        backend.outstanding += 1
        backend.served += 1

    @property
    def held(self) -> bool:
        return self._held

    def release(self) -> None:
        if self._held:
            self._held = False
            self.backend.outstanding -= 1


@dataclass
class Pool:
    prefill: list[Backend]
    decode: list[Backend]
    health_interval_s: float = 2.0
    health_timeout_s: float = 1.0   # each probe of HTTP /health
    # each rank's topology query: an engine's aiolayer loop shares its cores with the engine (a parked D's
    # engine core spins), and has answered control calls only after seconds there
    # (tests/vllm_bridge/test_vllm_parallel.py)
    control_timeout_s: float = 5.0
    model: str = ""                 # the model fingerprint every backend's ranks said at start

    def pick(self, role: str) -> Backend:
        candidates = [b for b in (self.prefill if role == "prefill" else self.decode) if b.healthy]
        if not candidates:
            raise NoBackend(f"no healthy {role} backend")
        return min(candidates, key=lambda b: (b.outstanding, b.served))

    @property
    def all(self) -> list[Backend]:
        return [*self.prefill, *self.decode]

    async def watch_health(self, client: httpx.AsyncClient, peers: ControlPeers | None = None) -> None:
        """Forever (until cancelled): probe every backend's /health and, with ``peers``, its ranks'
        topology; flip ``healthy`` (and ``problem``, why) on change."""
        while True:
            await asyncio.gather(*(self._probe(client, peers, b) for b in self.all))
            await asyncio.sleep(self.health_interval_s)

    async def _probe(self, client: httpx.AsyncClient, peers: ControlPeers | None, backend: Backend) -> None:
        """One backend's check. An error it did not expect (httpcore has raised AttributeError for an
        engine dying mid-connect) takes that backend out of rotation: raised, it would end the watcher,
        and every backend would keep its last verdict for good."""
        try:
            problem = await self._problem(client, peers, backend)
        except Exception as exc:  # noqa: BLE001 - the backend's failure, and logged below with the reason
            problem = f"health check failed unexpectedly: {type(exc).__name__}: {exc}"
        if problem != backend.problem:
            if problem:
                log.warning("%s is out of rotation: %s", backend.name, problem)
            else:
                log.warning("%s is back in rotation", backend.name)
        backend.problem, backend.healthy = problem, not problem

    async def _problem(self, client: httpx.AsyncClient, peers: ControlPeers | None, backend: Backend) -> str:
        async def http() -> str:
            try:
                reply = await client.get(f"{backend.url}/health", timeout=self.health_timeout_s)
            except httpx.HTTPError as exc:
                return f"HTTP /health failed: {type(exc).__name__}: {exc}"
            return "" if reply.status_code == 200 else f"HTTP /health answered {reply.status_code}"

        # HTTP first: a dead engine refuses its connection at once and leaves rotation within the probe's
        # timeout, while its control socket (ZMQ retries quietly) would hold the verdict for the whole
        # control timeout
        problem = await http()
        if not problem and peers is not None:
            problem = await recheck(backend, peers, self.control_timeout_s, self.model)
        return problem
