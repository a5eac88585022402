"""Remote layout cache with prefetch, keyed by peer endpoint and checked by (engine_id, incarnation).

A fetch runs on the loop as soon as a step names a new peer; every request to that peer awaits
the same future. A failed fetch fails the requests that awaited it once; the next new request
fetches again. A layout from another incarnation than the one a transfer was allocated on is
refused (``StaleLayout``): a restarted D never receives writes at its old addresses.
"""

from __future__ import annotations

import asyncio
import collections

import msgspec
import numpy as np

from .. import compat
from ..config import Timeouts
from ..errors import ControlError, DeadlineExceeded, MetadataError, StaleLayout
from ..protocol import messages as m
from .control import ControlPeers
from .loop import spawn_future


class RemoteLayout(msgspec.Struct, frozen=True):
    endpoint: str
    engine_id: str
    incarnation: str
    session: str
    block_bytes: int
    num_blocks: int
    k_base: np.ndarray     # int64 per layer
    v_base: np.ndarray
    kv_heads: int = 0      # head geometry (LayoutReply): 0 / "" = not published, whole blocks only
    block_size: int = 0
    head_bytes: int = 0
    kv_layout: str = ""

    @property
    def num_layers(self) -> int:
        return int(self.k_base.shape[0])

    @classmethod
    def from_reply(cls, endpoint: str, reply: m.LayoutReply) -> "RemoteLayout":
        return cls(endpoint, reply.engine_id, reply.incarnation, reply.session, reply.block_bytes,
                   reply.num_blocks, np.array([r.k_base for r in reply.layers], dtype=np.int64),
                   np.array([r.v_base for r in reply.layers], dtype=np.int64),
                   reply.kv_heads, reply.block_size, reply.head_bytes, reply.kv_layout)


class LayoutCache:
    def __init__(self, peers: ControlPeers, timeouts: Timeouts, requester: str, spawn) -> None:
        self.peers = peers
        self._spawn = spawn
        self.timeouts = timeouts
        self.requester = requester
        self._entries: dict[str, asyncio.Future] = {}
        self.fetches: collections.Counter[str] = collections.Counter()   # per endpoint
        self.deadlines_expired = 0

    def prefetch(self, endpoint: str, credentials: tuple[str, str]) -> asyncio.Future:
        """Start fetching ``endpoint``'s layout unless a fetch is cached or running.

        ``credentials`` is (transfer id, token) of a transfer D registered: D shows its layout
        only to a peer that holds one.
        """
        fut = self._entries.get(endpoint)
        if fut is not None and not (fut.done() and (fut.cancelled() or fut.exception() is not None)):
            return fut
        fut = spawn_future(self._spawn, self._fetch(endpoint, credentials), name=f"layout-fetch {endpoint}")
        fut.add_done_callback(_consume_exception)
        self._entries[endpoint] = fut
        return fut

    async def get(self, endpoint: str, credentials: tuple[str, str], incarnation: str = "") -> RemoteLayout:
        """The layout of ``endpoint``; refetched once if it is not of ``incarnation``."""
        layout = await asyncio.shield(self.prefetch(endpoint, credentials))
        if incarnation and layout.incarnation != incarnation:
            self.invalidate(endpoint)
            layout = await asyncio.shield(self.prefetch(endpoint, credentials))
            if layout.incarnation != incarnation:
                raise StaleLayout(f"{endpoint} is incarnation {layout.incarnation}, transfer was "
                                  f"allocated on {incarnation}")
        return layout

    def invalidate(self, endpoint: str) -> None:
        self._entries.pop(endpoint, None)

    async def _fetch(self, endpoint: str, credentials: tuple[str, str]) -> RemoteLayout:
        self.fetches[endpoint] += 1
        limit = self.timeouts.layout_fetch
        request = m.LayoutRequest(requester=self.requester, transfer_id=credentials[0], token=credentials[1])
        try:
            async with compat.timeout(limit):
                client = await self.peers.get(endpoint)
                reply = await client.call_with_retries(request, limit)
        except TimeoutError:
            self.deadlines_expired += 1
            raise DeadlineExceeded("layout_fetch", limit, endpoint) from None
        except ControlError as exc:
            raise MetadataError(f"layout of {endpoint} unavailable: {exc}") from exc
        if not isinstance(reply, m.LayoutReply):
            raise MetadataError(f"{endpoint} answered a layout request with {type(reply).__name__}")
        return RemoteLayout.from_reply(endpoint, reply)

    def close(self) -> None:
        for fut in self._entries.values():
            fut.cancel()
        self._entries.clear()


def _consume_exception(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()  # mark retrieved: the awaiting requests report it
