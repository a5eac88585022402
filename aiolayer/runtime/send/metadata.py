"""D's layout for each transfer, prefetched with that transfer's own credentials, checked by incarnation.

A fetch runs on the loop as soon as a step names a transfer; its request awaits the same future
and consumes it. D shows its layout only to a transfer it registered and that still takes writes
(its token, ``LayoutRequest``), so every transfer is authorized by D before its first write: a
transfer D would refuse (a stale dispatch after D ended it and reused its blocks, a wrong token)
fails here, having written nothing, instead of writing and being refused only at DONE. Sharing one
fetch per D would skip that check for all but the first transfer.

A layout from another incarnation than the one a transfer was allocated on is refused
(``StaleLayout``): a restarted D never receives writes at its old addresses.

D's answer also says how long the transfer's writes may go on (its window: docs/fencing.md, rule 8);
the layout a transfer gets carries the end, counted from when we asked (``RemoteLayout.write_by``).

The fetches one pass of the loop starts for one D (a step's transfers) go as ONE ``LayoutBatch``
frame (up to ``MAX_LAYOUT_BATCH`` each): D still authorizes every transfer, answers each item as
if it came alone and sends the layout once. A fetch alone in its pass goes as a plain
``LayoutRequest``; an item D left unanswered (a fault-injection hook), and every item when D does
not know the batch (an older node: from then on it gets them one by one) or finds it too big, is
asked again alone, within the same ``layout_fetch`` deadline.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Any, Coroutine, Union

from ... import compat
from ...bounded import put_newest
from ...config import Timeouts
from ...errors import ControlError, ControlRejected, DeadlineExceeded, MetadataError, StaleLayout
from ...protocol import messages as m
from ...protocol.codes import NackCode
from ..control.plane import ControlPeers
from ..loop import Spawn, fail_futures, settle_future, spawn_or_fail
from ..spec import RemoteLayout

log = logging.getLogger(__name__)
# (transfer id, token[, writers]); writers: how many P ranks write into the transfer by this P's plan
# (D checks it against its registration), 0 or absent = not said
Credentials = Union[tuple[str, str], tuple[str, str, int]]
_Key = tuple[Union[str, int], ...]   # (endpoint, *credentials)
# A batch Nacked with these was not understood (an older D) or too big: its items go alone.
_NOT_BATCHED = (NackCode.DECODE, NackCode.UNKNOWN, NackCode.SIZE)

MAX_PREFETCHED = 4096   # fetches waiting for their transfer; a transfer that never came cannot pin more


_Item = tuple[Credentials, asyncio.Future[RemoteLayout]]   # one fetch: its credentials, its future


class LayoutCache:
    def __init__(self, peers: ControlPeers, timeouts: Timeouts, requester: str, spawn: Spawn) -> None:
        self.peers = peers
        self._spawn = spawn
        self.timeouts = timeouts
        self.requester = requester
        # who asks, as D records its writers (its fence asks exactly these to stop): set by the runtime
        # once its control server is bound
        self.control = ""
        self.incarnation = ""
        # (endpoint, *credentials) -> the fetch, until its transfer consumes it (``get``)
        self._entries: dict[_Key, asyncio.Future[RemoteLayout]] = {}
        self._queued: dict[str, list[_Item]] = {}      # endpoint -> fetches of this pass, not sent yet
        self._singles: set[str] = set()                # Ds that did not know a batch: one by one
        self.fetches: collections.Counter[str] = collections.Counter()   # per endpoint: transfers asked for
        self.lookups: collections.Counter[str] = collections.Counter()   # per endpoint: late transfers bound
        self.batches = 0                               # LayoutBatch frames answered
        self.batched = 0                               # the fetches they carried
        self.deadlines_expired = 0

    def prefetch(self, endpoint: str, credentials: Credentials) -> asyncio.Future[RemoteLayout]:
        """Start fetching ``endpoint``'s layout for a transfer unless its fetch is running already.

        ``credentials`` is (transfer id, token) of a transfer D registered: D shows its layout
        only to a peer that holds one, and records the asking P rank as one of its writers; a third
        item, the number of P ranks writing the transfer by our plan, lets D refuse a plan that
        disagrees with its registration. Sent once this pass of the loop ends, with the pass's others.
        """
        key: _Key = (endpoint, *credentials)
        fut = self._entries.get(key)
        if fut is not None and not (fut.done() and (fut.cancelled() or fut.exception() is not None)):
            return fut
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        fut.add_done_callback(_consume_exception)
        put_newest(self._entries, key, fut, MAX_PREFETCHED)   # never consumed (its transfer failed first): oldest go
        queue = self._queued.setdefault(endpoint, [])
        queue.append((credentials, fut))
        if len(queue) == 1:
            loop.call_soon(self._flush, endpoint)
        return fut

    def table_sizes(self) -> dict[str, int]:
        return {"entries": len(self._entries), "fetch_counters": len(self.fetches)}

    async def get(self, endpoint: str, credentials: Credentials, incarnation: str = "") -> RemoteLayout:
        """The layout of ``endpoint`` as D showed it to this transfer; it must be of ``incarnation``."""
        key: _Key = (endpoint, *credentials)
        fut = self.prefetch(endpoint, credentials)
        try:
            layout: RemoteLayout = await asyncio.shield(fut)
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

    def _flush(self, endpoint: str) -> None:
        """This pass's fetches for ``endpoint``, one task per ``MAX_LAYOUT_BATCH`` of them."""
        items = [item for item in self._queued.pop(endpoint, []) if not item[1].done()]   # done: closed
        for i in range(0, len(items), m.MAX_LAYOUT_BATCH):
            chunk = items[i:i + m.MAX_LAYOUT_BATCH]
            spawn_or_fail(self._spawn, self._fetch_all(endpoint, chunk), f"layout-fetch {endpoint}", chunk,
                          lambda exc: MetadataError(f"layout of {endpoint} not fetched: {type(exc).__name__}: {exc}"))

    async def _fetch_all(self, endpoint: str, items: list[_Item]) -> None:
        """Never raises (but cancellation): every item's future gets its layout or its error."""
        deadline = asyncio.get_running_loop().time() + self.timeouts.layout_fetch
        try:
            if len(items) == 1 or endpoint in self._singles:
                await asyncio.gather(*(self._alone(endpoint, item, deadline) for item in items))
            else:
                await self._batch(endpoint, items, deadline)
        except asyncio.CancelledError:
            for _, fut in items:
                fut.cancel()
            raise
        except Exception as exc:  # noqa: BLE001 - each item's failure, reported by its transfer
            fail_futures(items, exc)

    async def _batch(self, endpoint: str, items: list[_Item], deadline: float) -> None:
        batch = m.LayoutBatch(items=[self._request(credentials) for credentials, _ in items])
        asked = time.monotonic()
        try:
            reply = await self._call(endpoint, batch, deadline, len(items))
        except MetadataError as exc:
            code = getattr(exc.__cause__, "code", None)
            if code not in _NOT_BATCHED:
                raise
            if code != NackCode.SIZE:   # too big for D's max_frame_bytes: this batch only
                log.warning("D at %s does not take batched layout requests (%s): one by one to it", endpoint, code)
                self._singles.add(endpoint)
            self.fetches[endpoint] -= len(items)   # each is counted again when it goes alone
            reply = m.LayoutReplies(layout=None, items=[None] * len(items))
        else:
            granted = isinstance(reply, m.LayoutReplies) and any(isinstance(a, m.Ack) for a in reply.items)
            if (not isinstance(reply, m.LayoutReplies) or len(reply.items) != len(items)
                    or granted != isinstance(reply.layout, m.LayoutReply)
                    or len(reply.windows) not in (0, len(items))):
                raise MetadataError(f"{endpoint} answered {len(items)} batched layout requests with "
                                    f"{type(reply).__name__}")
            self.batches += 1
            self.batched += len(items)
        layout = RemoteLayout.from_reply(endpoint, reply.layout) if reply.layout is not None else None
        windows: list[float | None] = list(reply.windows) or [None] * len(items)   # []: an older D
        again: list[Coroutine[Any, Any, None]] = []
        for item, answer, window in zip(items, reply.items, windows):
            if answer is None:
                again.append(self._alone(endpoint, item, deadline))
            elif isinstance(answer, m.Nack):   # as a Nack to a LayoutRequest alone reads
                cause = ControlRejected(answer.code, answer.reason)
                settle_future(item[1], exc=MetadataError(f"layout of {endpoint} unavailable: {cause}"))
            elif layout is not None:
                try:
                    settle_future(item[1], result=layout.granted(window, asked))
                except MetadataError as exc:
                    settle_future(item[1], exc=exc)
        if again:
            await asyncio.gather(*again)

    async def _alone(self, endpoint: str, item: _Item, deadline: float) -> None:
        credentials, fut = item
        try:
            request = self._request(credentials)
            asked = time.monotonic()
            reply = await self._call(endpoint, request, deadline, 1)
            if not isinstance(reply, m.LayoutReply):
                raise MetadataError(f"{endpoint} answered a layout request with {type(reply).__name__}")
            settle_future(fut, result=RemoteLayout.from_reply(endpoint, reply).granted(reply.window, asked))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the item's own error, as its transfer reports it
            settle_future(fut, exc=exc)

    async def bind(self, endpoint: str, credentials: Credentials) -> tuple[m.AllocReply, RemoteLayout]:
        """A late transfer's registration and D's layout, in one waiting lookup: D answers once it
        registered the transfer, having recorded this P rank as a writer (as for a layout request),
        within ``lookup_call``; ``DeadlineExceeded`` or ``MetadataError`` (cause: the control error) else."""
        tid, token, *writers = credentials
        request = m.LookupRequest(transfer_id=tid, token=token, wait=True, requester=self.requester,
                                  control=self.control, incarnation=self.incarnation,
                                  writers=writers[0] if writers else 0)
        limit = self.timeouts.lookup_call
        self.lookups[endpoint] += 1
        asked = time.monotonic()
        try:
            async with compat.timeout(limit):
                client = await self.peers.get(endpoint)
                reply = await client.call(request, timeout=limit)
        except TimeoutError:   # a ControlTimeout too: one deadline, the lookup's
            self.deadlines_expired += 1
            raise DeadlineExceeded("lookup_call", limit, f"registration of {tid} at {endpoint}") from None
        except ControlError as exc:
            raise MetadataError(f"registration of {tid} at {endpoint} unavailable: {exc}") from exc
        if (not isinstance(reply, m.AllocReply) or reply.transfer_id != tid or not reply.block_ids
                or not isinstance(reply.layout, m.LayoutReply) or reply.layout.incarnation != reply.incarnation):
            raise MetadataError(f"{endpoint} answered the lookup of {tid} with {type(reply).__name__} "
                                "without its blocks and layout")
        return reply, RemoteLayout.from_reply(endpoint, reply.layout).granted(reply.layout.window, asked)

    def _request(self, credentials: Credentials) -> m.LayoutRequest:
        tid, token, *writers = credentials
        return m.LayoutRequest(requester=self.requester, transfer_id=tid, token=token, control=self.control,
                               incarnation=self.incarnation, writers=writers[0] if writers else 0)

    async def _call(self, endpoint: str, request: m.Message, deadline: float, count: int) -> m.Message:
        """``request``'s reply by ``deadline``; ``DeadlineExceeded`` or ``MetadataError`` (cause: the
        control error) else."""
        self.fetches[endpoint] += count
        limit = self.timeouts.layout_fetch
        try:
            async with compat.timeout(max(0.0, deadline - asyncio.get_running_loop().time())):
                client = await self.peers.get(endpoint)
                return await client.call_with_retries(request, limit)
        except TimeoutError:
            self.deadlines_expired += count
            raise DeadlineExceeded("layout_fetch", limit, endpoint) from None
        except ControlError as exc:
            raise MetadataError(f"layout of {endpoint} unavailable: {exc}") from exc

    def close(self) -> None:
        for fut in self._entries.values():
            fut.cancel()
        self._entries.clear()
        self._queued.clear()


def _consume_exception(fut: asyncio.Future[RemoteLayout]) -> None:
    if not fut.cancelled():
        fut.exception()  # mark retrieved: the awaiting requests report it
