"""P and D on two "hosts" (network namespaces joined by a veth pair, no loopback path between them),
over the real Mooncake TCP transport: the transfer verifies byte for byte, also under a rate limit. The
faults across the link (a partition mid-transfer, a link slowed to a crawl, D at a new address) are the
benchmark's network fault rows, tested in tests/runtime/test_faults.py."""

from __future__ import annotations

import json
import select
import subprocess
import sys

import pytest

from aiolayer.harness import netns

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
