"""The connector caps how long vLLM's shm message-queue readers spin after a message.

vLLM's ``SpinCondition`` reader ``sched_yield``-spins for 1 s after every message (hard-coded); on cores
shared by two engines those spinners stalled the other engine's forward (45 s for a request that takes
0.19 s on one engine, docs/results.md). ``aiolayer_vllm.spin.cap_spin`` caps it in the connector's processes.
A capped reader sleeps on the writer's notification, which can be lost (vLLM's PUB socket drops one
while the previous is in flight): then it slept until vLLM's recheck, 5 s later. Within a second of its
last message it now sleeps at most ``LOST_WAKEUP_CAP_MS`` per look; idle longer, as vLLM has it.
These tests drive vLLM's real ``SpinCondition`` in a child process (the cap is process-wide) and check
the setting at the connector's boundary; the parked-D test (test_parked_decode_cpu.py) measures the
worker's CPU with the cap in a real engine.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("vllm", reason="vLLM is installed by `make test`")

pytestmark = pytest.mark.timeout(120)

# A reader whose last message is 10 ms old waits for the next, whose notification never comes (as when
# it is lost): with vLLM's 1 s spin it returns at once (one sched_yield, the caller loops); capped at
# 2 ms it sleeps on the notification, at most LOST_WAKEUP_CAP_MS of its 5 s. A reader idle for 1.5 s
# sleeps its whole timeout (300 ms here), as vLLM's does.
_CHILD = textwrap.dedent("""
    import atexit, json, os, shutil, tempfile, time
    import zmq
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    from aiolayer_vllm.spin import cap_spin

    ctx = zmq.Context()
    where = tempfile.mkdtemp()
    atexit.register(shutil.rmtree, where, ignore_errors=True)
    address = "ipc://" + os.path.join(where, "notify")
    writer = SpinCondition(False, ctx, address)
    reader = SpinCondition(True, ctx, address)

    def waited(idle_s, timeout_ms):
        reader.record_read()
        time.sleep(idle_s)
        t0, cpu0 = time.perf_counter(), time.thread_time()
        reader.wait(timeout_ms=timeout_ms)
        return time.perf_counter() - t0, time.thread_time() - cpu0

    before = waited(0.01, 5000)
    capped = cap_spin(0.002)
    busy = waited(0.01, 5000)
    idle = waited(1.5, 300)
    again = cap_spin(0.5)      # a second call sets a new cap, it does not wrap twice
    print(json.dumps({"before": before, "capped": capped, "busy": busy, "idle": idle, "again": again,
                      "spin": reader.busy_loop_s, "wraps": SpinCondition.wait.__qualname__}))
""")


def test_a_capped_reader_sleeps_past_the_cap_and_a_lost_wakeup_costs_it_milliseconds_not_seconds():
    from aiolayer_vllm.spin import LOST_WAKEUP_CAP_MS

    r = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=90)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["capped"] and got["again"], got
    assert got["before"][0] < 0.005, f"vLLM's reader did not spin 10 ms after a message: {got}"
    busy_s, busy_cpu_s = got["busy"]
    # it slept (no spin: little CPU) and woke by itself well before vLLM's 5 s recheck
    assert LOST_WAKEUP_CAP_MS / 1e3 * 0.8 <= busy_s <= 0.5, got
    assert busy_cpu_s < busy_s / 2, f"the capped reader spun instead of sleeping: {got}"
    assert got["idle"][0] >= 0.25, f"a reader idle past the busy window should sleep its whole timeout: {got}"
    assert got["wraps"] == "cap_spin.<locals>.wait", got


@pytest.mark.parametrize("value, ok", [(2.0, True), (0, True), (None, True), (-1, False), (1001, False),
                                       ("2", False)])
def test_queue_spin_ms_is_checked_at_the_boundary(value, ok):
    from aiolayer.errors import ConfigError
    from aiolayer_vllm.config import from_extra_config

    if ok:
        cfg = from_extra_config({"queue_spin_ms": value}, "e")
        assert cfg.queue_spin_s == (None if value is None else value / 1e3)
    else:
        with pytest.raises(ConfigError, match="queue_spin_ms"):
            from_extra_config({"queue_spin_ms": value}, "e")


def test_the_default_caps_at_2_ms():
    from aiolayer_vllm.config import from_extra_config

    assert from_extra_config({}, "e").queue_spin_s == 0.002
