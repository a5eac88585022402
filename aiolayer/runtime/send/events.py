"""Device events: "layer L is written" as something the loop can poll without a device sync.

With an accelerator (CUDA, NPU, XPU through ``torch.accelerator``) an event is recorded on the
current stream; on CPU the write is complete when the call returns, so the event is ready at once.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable, Protocol

from ...errors import DeadlineExceeded
from ..api import Step, StepSink


class DeviceEvent(Protocol):
    """A recorded point on a device stream (``torch.Event``), or ``READY`` on the CPU."""

    def query(self) -> bool: ...


class ReadyEvent:
    """The CPU case: nothing to wait for."""

    __slots__ = ()

    def query(self) -> bool:
        return True


READY = ReadyEvent()


def _make_recorder() -> Callable[[], DeviceEvent] | None:
    """The recorder of this process's accelerator; None where KV is host memory (nothing to record)."""
    try:
        import torch
    except ImportError:  # torch is optional for the core; without it everything is host memory
        return None
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is None or not accelerator.is_available():
        return None
    device = accelerator.current_accelerator()

    def record() -> DeviceEvent:
        event = torch.Event(device=device)
        event.record()
        recorded: DeviceEvent = event
        return recorded

    return record


device_recorder = _make_recorder()


def record_event() -> DeviceEvent:
    return READY if device_recorder is None else device_recorder()


async def wait_event(event: DeviceEvent, timeout: float) -> None:
    """Poll ``event.query()`` with back-off until it is ready; never a device-wide synchronize."""
    if event.query():
        return
    deadline = time.monotonic() + timeout
    delay = 0.0
    while not event.query():
        if time.monotonic() >= deadline:
            raise DeadlineExceeded("layer_event", timeout, "device event not completed")
        await asyncio.sleep(delay)
        delay = min(0.001, delay * 2 + 0.00005)


class DeviceStep(Step):
    """A step whose KV a device writes: each hand-off records an event on the current stream, which the
    loop polls before that layer's writes, with the time it was handed over."""

    __slots__ = ("_record",)

    def __init__(self, sender: StepSink, step_id: int, record: Callable[[], DeviceEvent]) -> None:
        super().__init__(sender, step_id)
        self._record = record

    def layer_ready(self, layer: int) -> None:
        self.append((layer, self._record(), time.perf_counter()))
