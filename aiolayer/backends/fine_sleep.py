"""Sleeps shorter than a millisecond on the event loop: a Linux timerfd the loop watches.

uvloop's timers (libuv's) count whole milliseconds, and its ``loop.time()`` too: a 0.2 ms
``asyncio.sleep`` returns at once, a 1 ms one after 1-2 ms. The Mooncake poller wants to look at a
write within a fraction of a millisecond of when it should land (a layer's write on loopback takes
~4 ms, so a 1 ms tick adds an eighth to its observed time), without a thread and without spinning.
A timerfd fires on the kernel's high-resolution clock and wakes the loop's poll like any socket.
Where there is none (not Linux), ``FineSleep.open`` returns None and callers keep the loop's timers.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import os
import sys

_CLOCK_MONOTONIC = 1
_TFD_NONBLOCK = os.O_NONBLOCK
_TFD_CLOEXEC = os.O_CLOEXEC


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.timerfd_create.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.timerfd_settime.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(_Itimerspec),
                                         ctypes.c_void_p]
    except (OSError, AttributeError):
        return None
    return libc


class FineSleep:
    """One one-shot timer for ONE sleeper at a time (the poller task), on the loop that opened it."""

    def __init__(self, libc: ctypes.CDLL, fd: int, loop: asyncio.AbstractEventLoop) -> None:
        self._libc, self._fd, self._loop = libc, fd, loop
        self._waiter: asyncio.Future[None] | None = None
        loop.add_reader(fd, self._fired)

    @classmethod
    def open(cls, loop: asyncio.AbstractEventLoop) -> "FineSleep | None":
        """A timer on ``loop``, or None where this system has no timerfd (the caller keeps ms timers)."""
        libc = _libc()
        if libc is None:
            return None
        fd = libc.timerfd_create(_CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC)
        if fd < 0:
            return None
        try:
            return cls(libc, fd, loop)
        except (OSError, RuntimeError, NotImplementedError):   # a loop that cannot watch this fd
            os.close(fd)
            return None

    async def sleep(self, seconds: float) -> None:
        """Return after ``seconds`` (at least one microsecond), to a few microseconds."""
        if self._fd < 0:
            raise RuntimeError("fine sleep is closed")
        waiter = self._loop.create_future()
        self._waiter = waiter
        self._arm(max(seconds, 1e-6))
        try:
            await waiter
        finally:
            self._waiter = None
            if not waiter.done() and self._fd >= 0:   # cancelled: it must not fire into the next sleep
                self._arm(0.0)
                self._drain()

    def _arm(self, seconds: float) -> None:
        whole = int(seconds)
        spec = _Itimerspec(_Timespec(0, 0), _Timespec(whole, int((seconds - whole) * 1e9)))
        if self._libc.timerfd_settime(self._fd, 0, ctypes.byref(spec), None) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"timerfd_settime: {os.strerror(err)}")

    def _drain(self) -> bool:
        """Read the expiry count (which makes the fd quiet again); False if there was none."""
        try:
            os.read(self._fd, 8)
        except BlockingIOError:
            return False
        return True

    def _fired(self) -> None:
        if not self._drain():   # disarmed between the poll and this call
            return
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def close(self) -> None:
        """Stop watching the fd and close it (on the loop; idempotent)."""
        if self._fd < 0:
            return
        if not self._loop.is_closed():
            self._loop.remove_reader(self._fd)
        os.close(self._fd)
        self._fd = -1
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.cancel()
