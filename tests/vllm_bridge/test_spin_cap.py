"""The connector caps how long vLLM's shm message-queue readers spin after a message.

vLLM's ``SpinCondition`` reader ``sched_yield``-spins for 1 s after every message (hard-coded); on cores
shared by two engines those spinners stalled the other engine's forward (45 s for a request that takes
0.19 s on one engine, docs/results.md). ``aiolayer_vllm.spin.cap_spin`` caps it in the connector's processes.
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

# A reader whose last message is 10 ms old waits up to 100 ms for the next: with vLLM's 1 s spin it
# returns at once (one sched_yield, the caller loops); capped at 2 ms it sleeps on the notification.
_CHILD = textwrap.dedent("""
    import json, os, tempfile, time
    import zmq
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    from aiolayer_vllm.spin import cap_spin

    ctx = zmq.Context()
    address = "ipc://" + os.path.join(tempfile.mkdtemp(), "notify")
    writer = SpinCondition(False, ctx, address)
    reader = SpinCondition(True, ctx, address)

    def waited():
        reader.record_read()
        time.sleep(0.01)
        t0 = time.perf_counter()
        reader.wait(timeout_ms=100)
        return time.perf_counter() - t0

    before = waited()
    capped = cap_spin(0.002)
    after = waited()
    again = cap_spin(0.5)      # a second call sets a new cap, it does not wrap twice
    print(json.dumps({"before": before, "capped": capped, "after": after, "again": again,
                      "spin": reader.busy_loop_s, "wraps": SpinCondition.wait.__qualname__}))
""")


def test_a_capped_reader_sleeps_past_the_cap_where_vllms_spins():
    r = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=90)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["capped"] and got["again"], got
    assert got["before"] < 0.02, f"vLLM's reader did not spin 10 ms after a message: {got}"
    assert got["after"] >= 0.08, f"the capped reader returned before its 100 ms timeout: it still spins ({got})"
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
