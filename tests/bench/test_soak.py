"""A short soak through the CLI: a few hundred transfers, every fault kind, nothing lost or hung.

``aiolayer bench soak`` (bench/scenarios/soak/) runs in a child process of its own session, so
that a run past its deadline can be killed together with its decode nodes; afterwards none of the
node processes it reports may still exist.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers_node import REPO_ROOT, node_env

pytestmark = pytest.mark.timeout(170)

REQUESTS = 400
FAULT_RATE = 0.12
RUN_TIMEOUT_S = 150
KEYS = {"requests", "finished", "failed", "lost", "hung", "p50_ms", "p99_ms", "rss_start_mb", "rss_end_mb",
        "rss_start_after", "disagree", "ok_unverified", "faults", "duration_s", "fault_rate", "timeouts",
        "p_bound_s", "d_bound_s", "p_internals_start", "p_internals_end", "node_pids"}


def _alive_node(pid: int) -> bool:
    """True if ``pid`` is still an ``aiolayer node`` process (not a zombie, not a recycled pid)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    state = next((line.split()[1] for line in status.splitlines() if line.startswith("State:")), "")
    return state != "Z" and b"aiolayer" in cmdline and b"node" in cmdline


@pytest.fixture(scope="module")
def soak(tmp_path_factory):
    out = tmp_path_factory.mktemp("soak")
    cmd = [sys.executable, "-m", "aiolayer", "bench", "soak", "--requests", str(REQUESTS),
           "--fault-rate", str(FAULT_RATE), "--decode-ranks", "3", "--seed", "11", "--out", str(out)]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=node_env(), cwd=str(REPO_ROOT), start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)   # the nodes are in its process group
        stdout, stderr = proc.communicate(timeout=10)
        pytest.fail(f"soak ran past {RUN_TIMEOUT_S}s\n{stderr.decode(errors='replace')[-4000:]}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)   # nothing of its group may outlive the test
    took = time.monotonic() - t0
    text = stderr.decode(errors="replace")
    path = out / "soak.json"
    assert path.exists(), f"no soak.json (exit {proc.returncode})\n{text[-4000:]}"
    return proc.returncode, json.loads(path.read_text()), text, took


def test_soak_loses_nothing_and_hangs_nothing(soak):
    rc, r, text, took = soak
    assert KEYS <= set(r), KEYS - set(r)
    assert r["requests"] == REQUESTS and r["accounted"] == REQUESTS, r
    assert r["lost"] == 0, r["examples"]
    assert r["hung"] == 0, r["examples"]
    assert r["finished"] > 0 and r["failed"] > 0, r
    assert not r["error"], r["error"]
    # the exit status is the verdict: 0 only with nothing lost or hung and RSS flat
    assert rc == (0 if r["ok"] else 1), (rc, r["ok"], text[-3000:])
    assert r["ok"] == (r["rss_growth"] < r["rss_limit"]), r
    assert took < RUN_TIMEOUT_S


def test_soak_injects_every_fault_kind(soak):
    _, r, _, _ = soak
    for kind in ("kill", "freeze", "refuse", "drop_done"):
        f = r["faults"][kind]
        assert f["injected"] >= 1, (kind, f)
        assert sum(f["outcomes"].values()) >= f["injected"], (kind, f)
    # a refused write, a dropped DONE and a killed D never complete; a freeze may (shorter than the deadline)
    for kind in ("kill", "refuse", "drop_done"):
        assert r["faults"][kind]["outcomes"].get("finished", 0) == 0, (kind, r["faults"][kind])
    assert r["counters"].get("restarts_same_port", 0) + r["counters"].get("restarts_new_port", 0) >= 1, r["counters"]


def test_soak_leaves_no_process_and_no_transfer_behind(soak):
    _, r, _, _ = soak
    alive = [pid for pid in r["node_pids"] if _alive_node(pid)]
    assert not alive, alive
    end = r["p_internals_end"]
    assert end["sender_live"] == 0 and end["sender_waiters"] == 0, end
    assert end["backend_inflight"] == 0, end
    assert r["counters"]["p_src_blocks_held_at_end"] == 0, r["counters"]
