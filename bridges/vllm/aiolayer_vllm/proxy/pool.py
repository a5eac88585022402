"""Backends (vLLM servers with their aiolayer control endpoints), least-outstanding choice, health.

A backend that fails its health check is taken out of rotation and put back when it answers
again. ``outstanding`` counts the requests a backend is working on: a ``Lease`` holds it from the
pick until that engine's part ends (P: its prefill answered; D: its answer relayed or closed), and
is released exactly once, from ``finally`` blocks, so no way a request ends can leak a count.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import httpx

log = logging.getLogger(__name__)


@dataclass
class Backend:
    role: str                 # "prefill" | "decode"
    url: str                  # http://host:port of the vLLM OpenAI server
    control: str              # tcp://host:port of its aiolayer connector
    tp: int = 1               # tensor-parallel ranks: rank r listens on CONTROL's port + r
    healthy: bool = True
    outstanding: int = 0
    served: int = 0

    @property
    def controls(self) -> list[str]:
        """Every rank's control endpoint, by the connector's per-rank rule (aiolayer_vllm.ranks)."""
        host, _, port = self.control.rpartition(":")
        return [f"{host}:{int(port) + r}" for r in range(self.tp)]

    @classmethod
    def parse(cls, role: str, spec: str) -> "Backend":
        """``URL,CONTROL[,tp=N]``, e.g. ``http://127.0.0.1:8100,tcp://127.0.0.1:5600,tp=2``."""
        url, sep, rest = spec.partition(",")
        control, _, extra = rest.partition(",")
        tp = extra.removeprefix("tp=")
        port = control.rpartition(":")[2]
        if not sep or not url.startswith(("http://", "https://")) or not control.startswith("tcp://") \
                or not port.isdigit() or (extra and not (extra.startswith("tp=") and tp.isdigit() and 1 <= int(tp) <= 1024)) \
                or int(port) + int(tp or 1) - 1 > 65535:
            raise ValueError(f"--{role} expects URL,CONTROL[,tp=N] (http://host:port,tcp://host:port,tp=2), got {spec!r}")
        return cls(role, url.rstrip("/"), control, tp=int(tp or 1))


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
    health_timeout_s: float = 1.0

    def pick(self, role: str) -> Backend:
        candidates = [b for b in (self.prefill if role == "prefill" else self.decode) if b.healthy]
        if not candidates:
            raise NoBackend(f"no healthy {role} backend")
        return min(candidates, key=lambda b: (b.outstanding, b.served))

    @property
    def all(self) -> list[Backend]:
        return [*self.prefill, *self.decode]

    async def watch_health(self, client: httpx.AsyncClient) -> None:
        """Forever (until cancelled): probe every backend's /health, flip ``healthy`` on change."""
        while True:
            await asyncio.gather(*(self._probe(client, b) for b in self.all))
            await asyncio.sleep(self.health_interval_s)

    async def _probe(self, client: httpx.AsyncClient, backend: Backend) -> None:
        try:
            ok = (await client.get(f"{backend.url}/health", timeout=self.health_timeout_s)).status_code == 200
        except httpx.HTTPError:
            ok = False
        if ok != backend.healthy:
            log.warning("%s backend %s is now %s", backend.role, backend.url, "healthy" if ok else "DOWN")
        backend.healthy = ok
