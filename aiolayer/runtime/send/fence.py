"""The sender's per-transfer state and fencing helpers: the early-abort table, the coroutine guard.

Early aborts: D may ask P to stop a transfer before P's step for it came (``Abort`` for an id P
does not know). P answers ``stopped`` and remembers (transfer id, token) so that the step, when it
comes, is refused. The Abort is not authenticated (P cannot know the token of a transfer it never
saw), so the table is bounded; when full, the oldest entry makes room. Refusing instead (Nack
``busy``) would let a stranger's flood keep every genuine early abort out; evicting,
a genuine entry lives until ``Timeouts.receive`` or until that many later entries came.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
from typing import Any, Awaitable, Callable, Concatenate, Coroutine, ParamSpec, Protocol, TypeVar

from ...bounded import drop_expired, put_newest, refuse_long_keys
from ...protocol.plan import BlockRuns, Spans
from ...protocol.state import sender_transfer
from .checking import SourceCheck
from .events import READY, DeviceEvent
from ..spec import LayerTiming, TransferSpec

log = logging.getLogger(__name__)

MAX_EARLY_ABORTS = 4096
LayerItem = tuple[int, DeviceEvent, float]   # (layer, its device event, perf_counter when handed over)
# What the forward appends to its step's inbox: a layer number (host memory: the append is the whole hand-off,
# and the loop stamps the time it took it, within a poll tick) or a whole ``LayerItem`` (a device event)
InboxEntry = int | LayerItem


class StepLayers:
    """One step's "layer L is written" items, shared by every transfer of the step: each reads them
    with its own cursor, so a layer costs one append however many transfers there are, and only the
    transfers already waiting for it are woken."""

    __slots__ = ("items", "waiting", "inbox", "looked", "readers", "step")

    def __init__(self, inbox: collections.deque[InboxEntry] | None = None, begun: float = 0.0,
                 step: int | None = None) -> None:
        self.items: list[LayerItem] = []      # in hand-over order
        self.waiting: list[Request] = []      # transfers that read every item and wait for the next
        self.inbox = inbox                    # the forward's own deque for this step (``Sender.begin_step``)
        self.looked = begun                   # the loop's last look into the inbox (first: the step's begin)
        self.readers = 0                      # transfers started on it whose stream has not ended
        self.step = step                      # its id in the sender's table of open steps

    def add(self, item: LayerItem) -> None:
        self.items.append(item)
        self._wake()

    def take_inbox(self, now: float, observe: Callable[[float], None]) -> int:
        """Move what the forward appended to the inbox into ``items`` (the loop; popleft is atomic),
        observing each layer's wait in the inbox: a layer number came after the loop's previous look,
        so its wait is at most ``now - looked``. How many layers there were."""
        inbox, since, self.looked = self.inbox, self.looked, now
        if inbox is None or not len(inbox):   # len: a ``Step`` is always true
            return 0
        taken = 0
        while len(inbox):
            entry = inbox.popleft()
            taken += 1
            if not isinstance(entry, tuple):   # a layer number (an int, a numpy integer; checked by the stream)
                observe(now - since)
                self.items.append((entry, READY, now))
            else:
                observe(now - entry[2])
                self.items.append(entry)
        self._wake()
        return taken

    def _wake(self) -> None:
        waiting, self.waiting = self.waiting, []
        for req in waiting:
            req.wake()


class Request:
    """One transfer on the loop: its step's layers, its state, and what its fence waits for."""

    __slots__ = ("spec", "runs", "spans", "feed", "cursor", "_waiter", "state", "timings", "bytes", "pending",
                 "quiet", "digest", "checking", "check", "announced")

    def __init__(self, spec: TransferSpec, runs: BlockRuns | None, feed: StepLayers | None = None) -> None:
        self.spec = spec
        self.runs = runs                               # None: blocks of other sizes (spans say it all)
        self.spans: Spans | None = None                # head slice, relative to the layer bases
        self.feed = feed if feed is not None else StepLayers()
        self.cursor = 0                                # feed.items[:cursor] taken
        self._waiter: asyncio.Future[None] | None = None   # while waiting for the next layer (or a stop)
        self.state = sender_transfer()                 # with whether, and why, it was told to stop
        self.timings: list[LayerTiming] = []
        self.bytes = 0
        self.pending: list[asyncio.Future[Any]] = []   # timed-out writes that may still land
        self.quiet = asyncio.Event()                   # set once no write of ours can be in flight
        self.digest = "crc32"                          # the integrity digest D's layout offered (integrity.py)
        self.checking: SourceCheck | bool | None = None   # its integrity check (False: not sampled; None: not yet)
        self.check: asyncio.Future[Any] | None = None  # the whole check, once every layer was submitted
        self.announced = False   # its outcome went out as the sender stopped: its own end adds none

    @property
    def aborted(self) -> str:
        """Why we stopped, once D or P's engine said so ("" until then)."""
        return self.state.stopped

    @property
    def by_p(self) -> bool:
        """Our engine cancelled it: D still needs FAILED."""
        return self.state.by_p

    def abort(self, reason: str, by_p: bool = False) -> None:
        if self.state.stop(reason, by_p):
            self.wake()   # the streaming coroutine: no layer after this

    @property
    def layer_ready(self) -> bool:
        """A layer is handed over and not taken yet."""
        return self.cursor < len(self.feed.items)

    def take_layer(self) -> LayerItem | None:
        """The next handed-over layer, or None when there is none yet."""
        items = self.feed.items
        if self.cursor == len(items):
            return None
        self.cursor += 1
        return items[self.cursor - 1]

    def take_layers(self, limit: int) -> list[LayerItem]:
        """Every layer handed over and not taken yet (at most ``limit``); none once stopped."""
        if self.state.stopped:
            return []
        start = self.cursor
        self.cursor = min(len(self.feed.items), start + limit)
        return self.feed.items[start:self.cursor]

    def next_arrival(self) -> asyncio.Future[None]:
        """A future set when a layer is handed over or the transfer is stopped (call with none ready)."""
        self._waiter = asyncio.get_running_loop().create_future()
        self.feed.waiting.append(self)
        return self._waiter

    def stop_waiter(self) -> asyncio.Future[None]:
        """A future set once the transfer is stopped (D's abort, our engine's cancel): what a wait
        before the first layer (a late transfer's lookup) races against."""
        self._waiter = asyncio.get_running_loop().create_future()
        if self.state.stopped:
            self._waiter.set_result(None)
        return self._waiter

    def wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():   # done: woken already, or its wait timed out
            waiter.set_result(None)


class EarlyAborts:
    """(transfer id, token) -> expiry (monotonic seconds), oldest first; bounded by ``capacity``."""

    def __init__(self, capacity: int = MAX_EARLY_ABORTS) -> None:
        self.capacity = capacity
        self._entries: dict[tuple[str, str], float] = {}
        self.evicted = 0       # entries dropped to make room before they expired

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, key: tuple[str, str], expiry: float, now: float) -> None:
        """Remember ``key`` (a stranger's may be 1 MiB: ids or tokens past ``MAX_KEY_CHARS`` are refused)."""
        refuse_long_keys("abort", *key)
        entries = self._entries
        entries.pop(key, None)   # a repeat moves to the end: insertion order stays expiry order
        drop_expired(entries, now, float)
        self.evicted += put_newest(entries, key, expiry, self.capacity)

    def take(self, key: tuple[str, str], now: float) -> bool:
        """Whether ``key`` was aborted early (and not expired); forgets it either way."""
        expiry = self._entries.pop(key, None)
        return expiry is not None and expiry > now


async def until_writes_end(pending: list[asyncio.Future[Any]], limit: float, late: Callable[[int], None]) -> bool:
    """Until every write in ``pending`` ended (P's source fence); ``late(count)`` once, if some outlive
    ``limit``: the wait goes on regardless, since memory a write may still read is never handed back
    (Mooncake drains refused writes to one peer at ~5 per second). ``pending`` is the transfer's own
    list, read again after each wait: a write that ends late may name runs that may still land.
    False when a write was cancelled (the backend closed: nobody knows whether it landed)."""
    warned = False
    while still := [f for f in pending if not f.done()]:
        _, left = await asyncio.wait(still, timeout=None if warned else limit)
        if left and not warned:
            warned = True
            late(len(left))
    return not any(f.cancelled() for f in pending)


class _Guarded(Protocol):
    """What ``guarded`` needs of the object whose method it wraps (the sender)."""

    def _fail_after_bug(self, req: Request, reason: str) -> None: ...


_Owner = TypeVar("_Owner", bound=_Guarded)
_Args = ParamSpec("_Args")


def guarded(method: Callable[Concatenate[_Owner, Request, _Args], Awaitable[None]]
            ) -> Callable[Concatenate[_Owner, Request, _Args], Coroutine[Any, Any, None]]:
    """For a per-transfer coroutine ``method(self, req, ...)``: any error ends that transfer as a
    failure (``self._fail_after_bug``) instead of reaching the runtime's TaskGroup, where it would
    cancel every other transfer. Cancellation still propagates."""

    @functools.wraps(method)
    async def run(self: _Owner, req: Request, /, *args: _Args.args, **kwargs: _Args.kwargs) -> None:
        try:
            await method(self, req, *args, **kwargs)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug must end this transfer visibly, and only it
            log.exception("sender bug in %s of transfer %r", method.__name__, getattr(req.spec, "transfer_id", "?"))
            self._fail_after_bug(req, f"internal error {type(exc).__name__}: {exc}")

    return run
