"""D's half of the embedding API (any thread; every call returns at once): ``receive``,
``abort_receive``, ``pop_received``, ``wait_received``.

``ReceiveApi`` is a base of ``Runtime``: it reads the runtime's state, declared here. A registration is
handed to the loop in call order (``call_soon_threadsafe``) before anything that arrives later is
served, so the caller may publish the ``Registration`` at once; the receiver's results reach other
threads through its deque, and ``wait_received`` keeps the ones it took for others in an inbox.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from typing import Any, Callable

import msgspec

from ...config import Timeouts, wait_limit
from ...errors import AiolayerError, DeadlineExceeded, RuntimeStateError
from ..api import Announce, ReceiveSpec, Registration
from .entry import Received
from ..loop import LoopThread
from .receiver import Receiver

log = logging.getLogger("aiolayer.runtime.runtime")   # the runtime's own log, as before the split
WAIT_POLL_S = 0.005   # wait_received: how often a blocked caller looks (results come from the loop's deque)


class ReceiveApi:
    # the runtime's state this half reads (``Runtime.__init__`` and ``start`` set every one)
    timeouts: Timeouts
    incarnation: str
    control_endpoint: str
    loop_thread: LoopThread
    receiver: Receiver
    _closed: bool
    _inbox: list[Received]          # results wait_received took from the receiver for other callers
    _inbox_lock: threading.Lock

    def receive(self, spec: ReceiveSpec, announce: Announce | None = None) -> Registration:
        """Register a transfer into ``spec.block_ids``; returns the ``Registration`` to hand to P.

        The registration is made on the loop before any message a peer sends after this call can be
        served, so publishing the returned value right away is safe. A bad spec raises
        ``ConfigError`` here; a refusal on the loop (an id already live or recently settled) comes back
        as a failed ``Received`` with ``refused`` set. ``announce(registration)``, if given, runs on the
        loop once registered (e.g. tell a proxy); if it raises, the transfer is aborted."""
        if not spec.token:   # the caller hands the Registration (which carries it) to P
            spec = msgspec.structs.replace(spec, token=secrets.token_hex(16))
        spec.check()
        if self._closed or not self.loop_thread.alive:
            raise RuntimeStateError("runtime not running")
        reg = Registration(transfer_id=spec.transfer_id, block_ids=list(spec.block_ids),
                           first_block=spec.first_block, token=spec.token, incarnation=self.incarnation,
                           decode_control=self.control_endpoint)
        self._on_loop(self._register_receive, spec, announce, reg)
        return reg

    def _register_receive(self, spec: ReceiveSpec, announce: Announce | None, reg: Registration) -> None:
        try:
            self.receiver.register(spec.transfer_id, spec.block_ids, token=spec.token, forget=True,
                                   first_block=spec.first_block,
                                   senders=spec.senders)
        except Exception as exc:  # noqa: BLE001 - the caller learns it from the transfer's result
            self.receiver.refuse(spec.transfer_id, f"registration refused: {type(exc).__name__}: {exc}")
            return
        if announce is not None:
            self.loop_thread.spawn(self._announce(announce, reg), name=f"announce {reg.transfer_id}")

    async def _announce(self, announce: Announce, reg: Registration) -> None:
        try:
            await asyncio.wait_for(announce(reg), self.timeouts.receive)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - nobody will dispatch P: give the transfer up now
            reason = f"registration not announced: {type(exc).__name__}: {exc}"
            log.warning("transfer %s: %s", reg.transfer_id, reason)
            self._abort_receive(reg.transfer_id, reason)

    def abort_receive(self, transfer_id: str, reason: str) -> None:
        """Give a receive up: P is told to stop; its failure comes through ``pop_received`` once P is
        quiet. An id that already ended (its result is on its way) is ignored."""
        self._on_loop(self._abort_receive, transfer_id, str(reason))

    def _abort_receive(self, transfer_id: str, reason: str) -> None:
        try:
            self.receiver.abort(transfer_id, reason)
        except AiolayerError as exc:
            log.debug("transfer %s: abort not needed: %s", transfer_id, exc)

    def _on_loop(self, callback: Callable[..., None], *args: Any) -> None:
        """Run ``callback`` on the loop, in call order, before the loop serves anything that arrives later."""
        try:
            self.loop_thread.loop.call_soon_threadsafe(callback, *args)
        except RuntimeError as exc:   # the loop closed meanwhile
            raise RuntimeStateError(f"runtime not running: {exc}") from None

    def pop_received(self) -> list[Received]:
        """Receives ended since the last call. A result is the release: no write lands after it."""
        with self._inbox_lock:
            out, self._inbox = self._inbox + self.receiver.pop_results(), []
        return out

    def wait_received(self, transfer_id: str, timeout: float) -> Received:
        """Block until ``transfer_id``'s receive ended (never from the forward thread or the loop);
        the other transfers' results stay for ``pop_received``."""
        self.loop_thread.not_on_loop("wait_received")
        end = time.monotonic() + wait_limit(timeout, "wait_received")
        while True:
            with self._inbox_lock:
                self._inbox += self.receiver.pop_results()
                for index, result in enumerate(self._inbox):
                    if result.transfer_id == transfer_id:
                        return self._inbox.pop(index)
            if time.monotonic() >= end:
                raise DeadlineExceeded("wait_received", timeout, f"transfer {transfer_id}")
            time.sleep(WAIT_POLL_S)
