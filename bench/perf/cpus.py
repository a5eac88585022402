"""CPU placement: one core plays the accelerator, the others are the host that moves the KV.

On a GPU host the forward pass computes on the device, and the transfer (Mooncake's threads, the
event loop, D) runs on host cores: neither slows the other down except through the GIL. Simulated
on CPUs sharing one scheduler, a transfer in flight would steal the compute's core and stretch the
forward by a random 0-50% (measured here, run to run). So by default the forward thread (and the
compute load of raw_mooncake's under-compute variant) owns the first allowed CPU, and every other
thread and child process of the benchmark, the ceilings included, runs on the rest: every mode and
every limit gets the same host CPUs. ``--no-pin`` shares all CPUs instead.
"""

from __future__ import annotations

import os


def plan(pin: bool) -> tuple[set[int] | None, set[int] | None]:
    """(device CPUs, host CPUs), or (None, None) when not pinning or with fewer than two CPUs."""
    if not pin or not hasattr(os, "sched_getaffinity"):
        return None, None
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        return None, None
    return {allowed[0]}, set(allowed[1:])


def pin_this_thread(cpus: set[int] | None) -> None:
    """Linux applies ``sched_setaffinity(0, ...)`` to the calling thread; new threads and children inherit it."""
    if cpus:
        os.sched_setaffinity(0, cpus)
