"""D's layout for each transfer, prefetched with that transfer's own credentials, checked by incarnation.

A fetch runs on the loop as soon as a step names a transfer; its request awaits the same future
and consumes it. D shows its layout only to a transfer it registered and that still takes writes
(its token, ``LayoutRequest``), so every transfer is authorized by D before its first write: a
transfer D would refuse (a stale dispatch after D ended it and reused its blocks, a wrong token)
fails here, having written nothing, instead of writing and being refused only at DONE. Sharing one
fetch per D would skip that check for all but the first transfer.

A layout from another incarnation than the one a transfer was allocated on is refused
(``StaleLayout``): a restarted D never receives writes at its old addresses.
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

MAX_PREFETCHED = 4096   # fetches waiting for their transfer; a transfer that never came cannot pin more


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
        # (endpoint, transfer id, token) -> the fetch, until its transfer consumes it (``get``)
        self._entries: dict[tuple[str, str, str], asyncio.Future] = {}
        self.fetches: collections.Counter[str] = collections.Counter()   # per endpoint
        self.deadlines_expired = 0

    def prefetch(self, endpoint: str, credentials: tuple[str, str]) -> asyncio.Future:
        """Start fetching ``endpoint``'s layout for a transfer unless its fetch is running already.

        ``credentials`` is (transfer id, token) of a transfer D registered: D shows its layout
        only to a peer that holds one.
        """
        key = (endpoint, *credentials)
        fut = self._entries.get(key)
        if fut is not None and not (fut.done() and (fut.cancelled() or fut.exception() is not None)):
            return fut
        while len(self._entries) >= MAX_PREFETCHED:   # never consumed (its transfer failed first): oldest go
            self._entries.pop(next(iter(self._entries)))
        fut = spawn_future(self._spawn, self._fetch(endpoint, credentials), name=f"layout-fetch {endpoint}")
        fut.add_done_callback(_consume_exception)
        self._entries[key] = fut
        return fut

    async def get(self, endpoint: str, credentials: tuple[str, str], incarnation: str = "") -> RemoteLayout:
        """The layout of ``endpoint`` as D showed it to this transfer; it must be of ``incarnation``."""
        key = (endpoint, *credentials)
        fut = self.prefetch(endpoint, credentials)
        try:
            layout = await asyncio.shield(fut)
        finally:
            if self._entries.get(key) is fut:
                del self._entries[key]
        if incarnation and layout.incarnation != incarnation:
            raise StaleLayout(f"{endpoint} is incarnation {layout.incarnation}, transfer was "
                              f"allocated on {incarnation}")
        return layout

    def invalidate(self, endpoint: str) -> None:
        """Forget finished fetches of ``endpoint`` (running ones stay: their transfers await them)."""
        for key in [k for k, fut in self._entries.items() if k[0] == endpoint and fut.done()]:
            del self._entries[key]

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
