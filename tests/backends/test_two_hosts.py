"""P and D on two "hosts" (network namespaces joined by a veth pair, no loopback path between them),
over the real Mooncake TCP transport: the transfer verifies byte for byte, also under a rate limit."""

from __future__ import annotations

import json
import select
import subprocess
import sys
import time

import pytest

from aiolayer.bench import netns

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(bool(netns.available()), reason=netns.available() or "available")]
# P's side: the network fault rows' driver (transfers one at a time, verifies, reports D's final states)
P_DRIVER = "aiolayer.bench.scenarios.net_p"


def summary(out: dict) -> dict:
    """net_p's per-transfer records as counts: ok, verified, failure reasons, wall ms, D's states."""
    recs = out["transfers"]
    return {"ok": sum(r["ok"] for r in recs), "verified": sum(r["verified"] for r in recs),
            "lost": sum(r["lost"] for r in recs),          # no outcome within --per-transfer-s
            "failed": [r["reason"] for r in recs if not r["ok"]],
            "ms": [round((r["end"] - r["start"]) * 1e3, 1) for r in recs],
            "d_states": out.get("d_states", {}), "p_endpoint": out["p_endpoint"]}


def start_node(hosts: netns.Hosts, host: netns.Host, receive_s: float = 120) -> dict:
    """An ``aiolayer node`` bound to the host's own address; its JSON line, within 60 s."""
    proc = hosts.popen(host, [sys.executable, "-m", "aiolayer", "node", "--bind-host", host.address,
                              "--num-layers", "4", "--num-blocks", "256", "--block-size", "16",
                              "--kv-heads", "2", "--head-dim", "64", "--fence-grace", "10",
                              "--receive-timeout", str(receive_s)],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    assert ready, f"D node printed nothing: {proc.poll()}"
    line = proc.stdout.readline()
    assert line, proc.stderr.read()[-2000:]
    return json.loads(line)


def run_p(hosts: netns.Hosts, d_control: str, transfers: int, blocks: int, timeout: float = 120, *extra) -> dict:
    done = hosts.run(hosts.a, [sys.executable, "-m", P_DRIVER, d_control, hosts.a.address,
                               "--transfers", str(transfers), "--blocks", str(blocks), *extra],
                     timeout=timeout, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return summary(json.loads(done.stdout.strip().splitlines()[-1]))


def start_p(hosts: netns.Hosts, d_control: str, *extra: str) -> subprocess.Popen:
    """The P driver in the background; returns once its runtime is up (its first JSON line)."""
    proc = hosts.popen(hosts.a, [sys.executable, "-m", P_DRIVER, d_control, hosts.a.address,
                                 *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    assert ready and "ready" in json.loads(proc.stdout.readline()), proc.stderr.read()[-2000:]
    return proc


def finish_p(proc: subprocess.Popen, timeout: float) -> dict:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return summary(json.loads(out.strip().splitlines()[-1]))


def test_node_pair_across_two_hosts_verifies():
    with netns.two_hosts() as hosts:
        d = start_node(hosts, hosts.b)
        assert d["control"] == f"tcp://{hosts.b.address}:{d['control'].rsplit(':', 1)[1]}"
        assert d["session"].startswith(f"{hosts.b.address}:")      # Mooncake told the routable address
        result = run_p(hosts, d["control"], 6, 8)
        assert result["p_endpoint"].startswith(f"tcp://{hosts.a.address}:")
        assert result["failed"] == [] and result["ok"] == 6 and result["verified"] == 6, result


def test_node_pair_under_a_rate_limit_verifies():
    with netns.two_hosts() as hosts:
        hosts.shape(gbit=1)
        d = start_node(hosts, hosts.b)
        result = run_p(hosts, d["control"], 3, 32)
        assert result["failed"] == [] and result["verified"] == 3, result


def test_a_leaked_loopback_address_cannot_work_here():
    """The negative control: D advertising 127.0.0.1 (the old default) is unreachable from P's host."""
    with netns.two_hosts() as hosts:
        proc = hosts.popen(hosts.b, [sys.executable, "-m", "aiolayer", "node", "--num-layers", "4",
                                     "--num-blocks", "64", "--block-size", "16", "--kv-heads", "2",
                                     "--head-dim", "64"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready
        d = json.loads(proc.stdout.readline())
        assert d["control"].startswith("tcp://127.0.0.1:")
        result = run_p(hosts, d["control"], 1, 4)
        assert result["ok"] == 0 and result["failed"], result


def test_a_partition_mid_transfer_ends_every_transfer_visibly(tmp_path):
    """The link goes down while a transfer streams and comes back: each transfer ends (ok, or failed with
    its deadline), D ends every one it registered (fenced, then failed), none is lost, later ones verify."""
    resume = tmp_path / "resume"
    with netns.two_hosts() as hosts:
        hosts.shape(gbit=0.02)                       # 20 Mbit/s: each 256 KiB transfer streams ~0.1 s
        d = start_node(hosts, hosts.b, receive_s=15)
        proc = start_p(hosts, d["control"], "--transfers", "20", "--blocks", "16", "--pause-s", "0.1",
                       "--per-transfer-s", "30", "--settle-s", "40", "--hold-at", "3", "--resume-file", str(resume))
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready and "held" in json.loads(proc.stdout.readline())   # transfer 3: layer 0 out, 1-3 to go
        hosts.link(up=False)                         # partition: longer than layer_write (5 s)
        resume.touch()
        time.sleep(8)
        hosts.link(up=True)
        result = finish_p(proc, timeout=200)
        assert result["ok"] + len(result["failed"]) == 20 and result["lost"] == 0, result   # all ended at P
        assert result["failed"] and result["verified"] == result["ok"] > 0, result
        assert not result["failed"][0].startswith("alloc"), result           # the held one failed mid-stream
        assert result["d_states"].get("unsettled", 0) == 0, result         # and at D: none lost
        late = result["ms"][-3:]
        assert late and max(late) < 5000, result                            # the link serves again


def test_a_link_slowed_to_a_crawl_ends_in_deadlines_not_hangs():
    with netns.two_hosts() as hosts:
        d = start_node(hosts, hosts.b, receive_s=15)
        hosts.shape(gbit=0.0005)                     # 500 kbit/s: a 384 KiB layer needs ~6 s, over layer_write (5 s)
        started = time.monotonic()
        result = run_p(hosts, d["control"], 2, 48, 120, "--per-transfer-s", "40", "--settle-s", "40")
        assert time.monotonic() - started < 110
        assert len(result["failed"]) == 2 and result["ok"] == 0 and result["lost"] == 0, result
        assert all("layer_write" in r or "deadline" in r or "timed out" in r for r in result["failed"]), result
        assert result["d_states"].get("unsettled", 0) == 0, result


def test_d_at_a_new_address_after_a_restart_is_reached_and_the_old_one_fails_fast():
    with netns.two_hosts() as hosts:
        old = start_node(hosts, hosts.b)
        assert run_p(hosts, old["control"], 1, 8)["verified"] == 1
        hosts.stop_all()                               # D's machine restarts ...
        hosts.readdress(hosts.b, hosts.b.address.rsplit(".", 1)[0] + ".7")   # ... with another address
        new = start_node(hosts, hosts.b)
        assert new["control"] != old["control"] and new["incarnation"] != old["incarnation"]
        stale = run_p(hosts, old["control"], 1, 8, 60)
        assert stale["ok"] == 0 and stale["failed"] and stale["failed"][0].startswith("alloc:"), stale
        fresh = run_p(hosts, new["control"], 2, 8)
        assert fresh["verified"] == 2, fresh
