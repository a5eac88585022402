"""LoopThread: one uvloop event loop in a dedicated thread that owns a TaskGroup.

Other threads hand coroutines to it with ``submit`` (a concurrent Future comes back) or ``call``
(wait for the result with a deadline). Tasks started on the loop with ``spawn`` belong to the
TaskGroup; ``stop`` cancels them and returns within its deadline, whatever they do.

Every spawned task is guarded: an error in one (a bug, a bad request's data) is logged with the
task's name and counted in ``task_errors``, never raised into the TaskGroup, where it would cancel
every other task of the runtime (one request must not take the engine down).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Iterable
from typing import Any, Awaitable, Callable, Coroutine, Protocol

import uvloop

from ..compat import TaskGroup
from ..errors import DeadlineExceeded, RuntimeStateError

log = logging.getLogger(__name__)


class Spawn(Protocol):
    """How the runtime's parts start a task on its loop (``LoopThread.spawn``: guarded, owned by its
    TaskGroup, from the loop thread only; a driver's own loop may pass ``loop.create_task``)."""

    def __call__(self, coro: Coroutine[Any, Any, Any], *, name: str) -> asyncio.Task[Any]: ...


def not_running(coro: Awaitable[Any], name: str) -> asyncio.Task[Any]:
    """The ``Spawn`` of a part the runtime has not started yet: it starts nothing."""
    if asyncio.iscoroutine(coro):
        coro.close()
    raise RuntimeStateError(f"cannot start {name!r}: not running on a loop yet")


class LoopThread:
    def __init__(self, name: str = "aiolayer-loop") -> None:
        self.name = name
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._group: TaskGroup | None = None
        self._stop_event: asyncio.Event | None = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._on_exit: list[Callable[[BaseException | None], None]] = []
        self._on_stop: list[Callable[[], Awaitable[None]]] = []
        self.task_errors = 0          # spawned tasks that ended with an error (logged, not propagated)

    # --- lifecycle (called from any thread but the loop's) -----------------------------------

    def start(self, timeout: float = 5.0) -> None:
        if self._thread is not None:
            raise RuntimeStateError("LoopThread already started")
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise DeadlineExceeded("loop start", timeout)
        if self._failure is not None:
            raise RuntimeStateError(f"loop thread failed to start: {self._failure!r}")

    def stop(self, timeout: float = 5.0) -> None:
        """Cancel every task and join the thread; raises DeadlineExceeded if it would not end."""
        if self._thread is None:
            return
        self.not_on_loop("stop")
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._request_stop)
            except RuntimeError:  # loop already closed between the check and the call
                pass
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise DeadlineExceeded("loop stop", timeout, "tasks did not finish after cancellation")

    def on_exit(self, callback: Callable[[BaseException | None], None]) -> None:
        """Run ``callback(error)`` on the loop thread as it exits (normally or not)."""
        self._on_exit.append(callback)

    def on_stop(self, closer: Callable[[], Awaitable[None]]) -> None:
        """Await ``closer()`` on the loop after its tasks ended, however the loop ends (stop or crash)."""
        self._on_stop.append(closer)

    def not_on_loop(self, what: str) -> None:
        """A blocking wait on the loop's own thread waits for the loop it blocks: its deadline, then an
        error (or, joining itself, Python's). Refused at once instead (an announce or outcome callback)."""
        if self._thread is not None and threading.current_thread() is self._thread:
            raise RuntimeStateError(f"{what} from the runtime's own loop thread (a callback): it would wait "
                                    "for the loop it blocks; call it from another thread")

    @property
    def ident(self) -> int | None:
        """The loop thread's id once started (a report reads its CPU clock), else None."""
        return self._thread.ident if self._thread is not None else None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._ready.is_set()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise RuntimeStateError("LoopThread not started")
        return self._loop

    # --- handing work to the loop ------------------------------------------------------------

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        """Run ``coro`` as a task of the loop's TaskGroup; returns a concurrent Future."""
        if not self.alive:
            coro.close()
            raise RuntimeStateError("loop thread is not running")
        result: concurrent.futures.Future[Any] = concurrent.futures.Future()

        async def runner() -> None:
            try:
                value = await coro
            except asyncio.CancelledError:
                result.cancel()
                raise
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's future
                _settle(result.set_exception, exc)
            else:
                _settle(result.set_result, value)

        def start_task() -> None:
            if result.cancelled():  # the caller gave up before the task started
                coro.close()
                return
            if self._group is None or self._stop_event is None or self._stop_event.is_set():
                coro.close()
                _settle(result.set_exception, RuntimeStateError("loop is stopping"))
                return
            task = self._group.create_task(runner(), name=getattr(coro, "__name__", "submitted"))
            loop = self.loop

            def cancel_task(fut: concurrent.futures.Future[Any]) -> None:
                # the caller cancelled its future (e.g. ``call`` timed out): stop the work too
                if fut.cancelled() and not loop.is_closed():
                    try:
                        loop.call_soon_threadsafe(task.cancel)
                    except RuntimeError:
                        pass

            result.add_done_callback(cancel_task)

        self.loop.call_soon_threadsafe(start_task)
        return result

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float) -> Any:
        """Run ``coro`` on the loop and wait for its result, at most ``timeout`` seconds."""
        try:
            self.not_on_loop("a blocking call")
        except RuntimeStateError:
            coro.close()
            raise
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise DeadlineExceeded("loop call", timeout) from None

    def spawn(self, coro: Awaitable[Any], name: str) -> asyncio.Task[Any]:
        """Start a guarded task owned by the TaskGroup; only from the loop thread.

        The task's result is None if ``coro`` raised: the error is logged and counted, not kept.
        """
        if self._group is None:
            if asyncio.iscoroutine(coro):
                coro.close()
            raise RuntimeStateError("loop has no task group (not running)")
        task: asyncio.Task[Any] = self._group.create_task(self._guard(coro, name), name=name)
        return task

    async def _guard(self, coro: Awaitable[Any], name: str) -> Any:
        try:
            return await coro
        except asyncio.CancelledError:
            raise
        except Exception:  # one task's failure must not cancel its TaskGroup siblings
            self.task_errors += 1
            log.exception("aiolayer task %r failed (the runtime goes on)", name)
            return None

    # --- the thread ---------------------------------------------------------------------------

    def _request_stop(self) -> None:
        if self._stop_event is not None:
            self._stop_event.set()

    def _run(self) -> None:
        error: BaseException | None = None
        try:
            uvloop.run(self._main())
        except BaseException as exc:  # noqa: BLE001 - recorded and handed to on_exit callbacks
            error = exc
            self._failure = exc
            log.error("aiolayer loop thread ended with an error: %r", exc)
        finally:
            self._ready.set()
            for callback in self._on_exit:
                try:
                    callback(error)
                except Exception:  # one bad callback must not hide the others
                    log.exception("on_exit callback failed")

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop_event = asyncio.Event()
        try:
            async with TaskGroup() as group:
                self._group = group
                self._ready.set()
                await self._stop_event.wait()
                for task in asyncio.all_tasks():
                    if task is not asyncio.current_task():
                        task.cancel()
        finally:
            self._group = None
            for closer in self._on_stop:  # also after a crash: close what the tasks owned
                try:
                    await closer()
                except Exception:  # one bad closer must not skip the others
                    log.exception("on_stop closer failed")


def _settle(setter: Callable[[Any], None], value: Any) -> None:
    """Set a concurrent future unless the caller already cancelled it (a late result is dropped)."""
    try:
        setter(value)
    except concurrent.futures.InvalidStateError:
        pass


def settle_future(fut: asyncio.Future[Any], *, result: Any = None, exc: BaseException | None = None) -> None:
    """Set ``fut``'s result (or ``exc``) unless it is done already (e.g. its waiter was cancelled)."""
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


def fail_futures(items: Iterable[tuple[object, asyncio.Future[Any]]], exc: BaseException) -> None:
    """``exc`` into the future of every (anything, future) pair not done yet."""
    for _, fut in items:
        settle_future(fut, exc=exc)


def spawn_or_fail(spawn: Spawn, coro: Coroutine[Any, Any, Any], name: str,
                  items: Iterable[tuple[object, asyncio.Future[Any]]],
                  failure: Callable[[Exception], BaseException]) -> None:
    """Start ``coro`` as an owned task that answers ``items`` (pairs of anything and a future); when
    no task can start (the runtime is stopping), close it and fail each future with ``failure(exc)``."""
    try:
        spawn(coro, name=name)
    except Exception as exc:  # noqa: BLE001 - handed to every item's waiter
        coro.close()
        fail_futures(items, failure(exc))
