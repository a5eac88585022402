"""D's parked wait: the scheduler side sleeps on a wake-up from the receiver, not on vLLM's 1 ms poll.

While D only holds requests in WAITING_FOR_REMOTE_KVS, vLLM's EngineCore steps every ~1.7 ms (each
empty step is an ``execute_model`` round trip to the worker, whose results are the only way the
scheduler learns that KV arrived). When a step schedules nothing and only our parked receives are
pending, the scheduler side (``SchedulerSide.build_connector_meta``) waits here for at most
``PARK_WAIT_S``; the worker's runtime wakes it the moment a receive ends (``Runtime.on_outcome``), so
a request whose KV arrived loses nothing, and the step rate while parked falls ~4x.

The wake-up crosses processes (the receiver lives in the worker, the scheduler in the EngineCore):
a ZMQ PUSH -> PULL pair on a local ipc path named after the EngineCore's pid, which the worker knows
as its parent (vLLM's ``mp`` executor) or itself (``uni``), and the engine id (several engines in one
process: tests). Anything else that sends there only costs an early step (vLLM's own cadence). Without a
wake-up (another executor), the scheduler never waits. ``AIOLAYER_PARK_WAIT_MS`` sets the cap
(0: no waiting, vLLM's own cadence).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import sys
import tempfile

import zmq

log = logging.getLogger(__name__)
PARK_WAIT_S = 0.005          # at most this long per empty step: also what a new request can wait for its step
LOCAL_EXECUTORS = ("mp", "uni")   # the executors whose workers run on this host, as EngineCore's children or in it


def park_wait_s() -> float:
    raw = os.environ.get("AIOLAYER_PARK_WAIT_MS", "")
    try:
        ms = float(raw) if raw else PARK_WAIT_S * 1e3
    except ValueError:
        ms = math.nan
    if not math.isfinite(ms):   # NaN would reach zmq's poll as int(nan) and raise in vLLM's schedule()
        log.error("AIOLAYER_PARK_WAIT_MS=%r is not a finite number: %g ms is used", raw, PARK_WAIT_S * 1e3)
        return PARK_WAIT_S
    return min(max(ms, 0.0), 50.0) / 1e3   # a few ms at most: a new request waits that long for its step


def address(engine_core_pid: int, engine_id: str) -> str:
    """Linux: an abstract socket (no file: nothing is left behind by an engine that was killed)."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", engine_id)[:40]    # a socket path holds at most 107 bytes
    where = "@" if sys.platform == "linux" else f"{tempfile.gettempdir()}/"
    return f"ipc://{where}aiolayer-wake-{engine_core_pid}-{name}.sock"


def engine_core_pid(executor_backend) -> int | None:
    """From a worker: the pid of its EngineCore, or None where its workers are not local children."""
    if executor_backend == "uni":
        return os.getpid()
    if executor_backend == "mp":
        return os.getppid()
    return None


class Waiter:
    """The scheduler side's end (EngineCore's busy-loop thread only)."""

    def __init__(self, cap_s: float, engine_id: str) -> None:
        self.cap_ms = cap_s * 1e3
        self.path = address(os.getpid(), engine_id)[len("ipc://"):]
        self._sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        if not self.path.startswith("@"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)       # a stale socket file of a dead process that had this pid
        self._sock.bind("ipc://" + self.path)

    def wait(self) -> bool:
        """Block until a wake-up or the cap; True if woken. Every queued wake-up is drained."""
        woken = bool(self._sock.poll(int(self.cap_ms)))   # whole ms, as pyzmq makes of a float
        while woken:
            try:
                self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
        return woken

    def close(self) -> None:
        self._sock.close(0)
        if not self.path.startswith("@"):
            with contextlib.suppress(OSError):
                os.unlink(self.path)


def open_waiter(cap_s: float, engine_id: str) -> Waiter | None:
    """The scheduler side's end, or None (no waiting: vLLM's own cadence) if off or it cannot bind."""
    if cap_s <= 0:
        return None
    try:
        return Waiter(cap_s, engine_id)
    except (zmq.ZMQError, OSError) as exc:
        log.warning("aiolayer: parked wait off (%s): a parked D steps at vLLM's own rate", exc)
        return None


class Waker:
    """The worker's end: ``wake`` runs on the runtime's loop thread (its only user, as ZMQ requires)."""

    def __init__(self, engine_core_pid: int, engine_id: str) -> None:
        self._address = address(engine_core_pid, engine_id)
        self._sock = None

    def wake(self) -> None:
        try:
            if self._sock is None:
                self._sock = zmq.Context.instance().socket(zmq.PUSH)
                self._sock.setsockopt(zmq.LINGER, 0)
                self._sock.setsockopt(zmq.SNDHWM, 4)    # one pending wake-up is as good as many
                self._sock.connect(self._address)
            self._sock.send(b"", zmq.NOBLOCK)
        except zmq.Again:
            pass   # wake-ups already queued: the scheduler drains them all at once
        except zmq.ZMQError as exc:   # the scheduler then waits out its cap: slower, never wrong
            log.warning("aiolayer: scheduler wake-up not sent: %s", exc)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
