"""Remote layout cache with prefetch, keyed by peer endpoint and checked by (engine_id, incarnation).

A fetch runs on the loop as soon as a step names a new peer; every request to that peer awaits
the same future. A failed fetch fails the requests that awaited it once; the next new request
fetches again. A layout from another incarnation than the one a transfer was allocated on is
refused (``StaleLayout``): a restarted D never receives writes at its old addresses.

A fetch presents the token of the transfer that started it. If D refuses that one (its transfer is
unknown there, e.g. D restarted on the same port), a waiting transfer with other credentials
fetches once more with its own rather than failing on another's token.
"""

from __future__ import annotations

import asyncio
import collections
import weakref

import msgspec
import numpy as np

from .. import compat
from ..config import Timeouts
from ..errors import ControlError, ControlRejected, DeadlineExceeded, MetadataError, StaleLayout
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
        # what each fetch presented; weak, so a fetch forgotten by the cache takes its entry along
        self._credentials: weakref.WeakKeyDictionary[asyncio.Future, tuple[str, str]] = weakref.WeakKeyDictionary()
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
        self._credentials[fut] = credentials
        return fut

    async def get(self, endpoint: str, credentials: tuple[str, str], incarnation: str = "") -> RemoteLayout:
        """The layout of ``endpoint``; refetched once if it is not of ``incarnation``."""
        layout = await self._shared(endpoint, credentials)
        if incarnation and layout.incarnation != incarnation:
            self.invalidate(endpoint)
            layout = await asyncio.shield(self.prefetch(endpoint, credentials))
            if layout.incarnation != incarnation:
                raise StaleLayout(f"{endpoint} is incarnation {layout.incarnation}, transfer was "
                                  f"allocated on {incarnation}")
        return layout

    async def _shared(self, endpoint: str, credentials: tuple[str, str]) -> RemoteLayout:
        """The shared fetch; if D refused the token it presented and that was not ours, our own."""
        fut = self.prefetch(endpoint, credentials)
        try:
            return await asyncio.shield(fut)
        except MetadataError as exc:
            if not _refused(exc) or self._credentials.get(fut, credentials) == credentials:
                raise
        if self._entries.get(endpoint) is fut:
            self.invalidate(endpoint)
        again = self.prefetch(endpoint, credentials)
        if not again.done() and self._credentials.get(again) != credentials:
            # another waiter's retry with its own token, which may be as stale: fetch with ours
            again = spawn_future(self._spawn, self._fetch(endpoint, credentials), name=f"layout-fetch {endpoint}")
            again.add_done_callback(_consume_exception)
        return await asyncio.shield(again)

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


def _refused(exc: BaseException | None) -> bool:
    """A fetch D refused for its credentials (the transfer is not, or no longer, registered there)."""
    return isinstance(exc, MetadataError) and isinstance(exc.__cause__, ControlRejected) and exc.__cause__.code == "auth"


def _consume_exception(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()  # mark retrieved: the awaiting requests report it
