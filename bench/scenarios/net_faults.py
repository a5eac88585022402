"""The network fault rows of ``aiolayer bench faults``: faults of the link, not of a process.

P (``net_p.py``) and D (``aiolayer node``) run on two "hosts", network namespaces joined by one veth
pair (``aiolayer.harness.netns``), so the only path between them is the link the row breaks: a partition
mid-transfer (the link down for longer than ``layer_write``, then up), a link slowed to a crawl (tbf),
and D at a new address after a restart. Each row has the fields of the process rows (outcome,
terminal_s after the fault, deadline_s, lost) plus its transfers. Without namespaces (not root, no
iproute2) each row says so, with the reason, and counts as skipped.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

from aiolayer.harness.child import ChildProcess
from aiolayer.harness.netns import Host, Hosts, available, two_hosts
from aiolayer.harness.node import MOONCAKE_ENV

# The deadlines of P in these rows (net_p's defaults) and of D (the node's flags).
CONTROL_S, LAYER_WRITE_S, DONE_DELIVERY_S = 5.0, 5.0, 5.0
TIMEOUTS = {"control_call": CONTROL_S, "layer_write": LAYER_WRITE_S, "done_delivery": DONE_DELIVERY_S,
            "d_receive": 15.0, "d_fence_grace": 10.0}
NODE_ARGS = ["--num-layers", "4", "--num-blocks", "256", "--block-size", "16", "--kv-heads", "2",
             "--head-dim", "64", "--fence-grace", "10", "--receive-timeout", "15"]
PARTITION_S = 8.0            # longer than layer_write: the write in flight must fail, not wait
START_S = 60.0


def _child(hosts: Hosts, host: Host, argv: list[str], name: str) -> ChildProcess:
    env = {**os.environ, **MOONCAKE_ENV}
    return ChildProcess(["ip", "netns", "exec", host.ns, sys.executable, *argv], env=env, name=name).start()


def start_d(hosts: Hosts) -> ChildProcess:
    """An ``aiolayer node`` bound to host B's own address; ``.info`` is its JSON line."""
    d = _child(hosts, hosts.b, ["-m", "aiolayer", "node", "--bind-host", hosts.b.address, *NODE_ARGS], "D node")
    try:
        d.info = d.read_json(START_S, require="control")
    except BaseException:
        d.stop()
        raise
    return d


def run_p(hosts: Hosts, d_control: str, *flags: str, during=None, limit: float = 200.0) -> dict:
    """net_p in host A; ``during(p)`` runs once its runtime is up. Its final JSON line."""
    p = _child(hosts, hosts.a, ["-m", "aiolayer.bench.scenarios.net_p", d_control, hosts.a.address, *flags], "P")
    try:
        p.read_json(START_S, require="ready")
        if during is not None:
            during(p)
        p.proc.wait(limit)
    finally:
        p.stop()
    lines = [x for x in p.rest_stdout.decode(errors="replace").splitlines() if x.strip()]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"P exited {p.returncode}: {p.stderr_text(2000)}")
    return json.loads(lines[-1])


def _summary(name: str, result: dict, t_fault: float, deadline_s: float) -> dict:
    """The row: how every transfer ended, the slowest one after the fault, lost ones at P and at D."""
    recs = result["transfers"]
    after = [r["end"] - max(r["start"], t_fault) for r in recs if r["end"] >= t_fault]
    failed = [r["reason"] for r in recs if not r["ok"]]
    lost = sum(r["lost"] for r in recs) + result["d_states"].get("unsettled", 0)
    ok = [r for r in recs if r["ok"]]
    return {"name": name, "transfers": len(recs), "ok": len(ok), "verified": sum(r["verified"] for r in ok),
            "failed": len(failed), "bad_reason": failed[0] if failed else "", "d_states": result["d_states"],
            "terminal_s": round(max(after), 3) if after else None, "deadline_s": deadline_s, "lost": lost,
            "ms": [round((r["end"] - r["start"]) * 1e3, 1) for r in recs]}


def _verdict(row: dict, must_fail: bool, recovered: bool) -> str:
    if row["lost"]:
        return "LOST"
    if row["verified"] != row["ok"]:
        return "NOT VERIFIED"
    if row["terminal_s"] is not None and row["terminal_s"] > row["deadline_s"] + 1.0:
        return "PAST DEADLINE"
    if not recovered:
        return "NOT RECOVERED"
    if must_fail and not row["failed"]:
        return "NO FAILURE SEEN"
    return "failed (visible)" if row["failed"] else "completed"


def scenario_partition() -> dict:
    """A partition mid-transfer fails the transfers it cuts within their deadlines; after it, transfers verify."""
    with two_hosts() as hosts, tempfile.TemporaryDirectory() as tmp:
        hosts.shape(gbit=0.02)                   # 20 Mbit/s: each 512 KiB transfer streams ~0.2 s
        d = start_d(hosts)
        resume = os.path.join(tmp, "resume")
        fault = {}

        def partition(p: ChildProcess) -> None:
            p.read_json(START_S, require="held")  # transfer 3 is mid-stream: layer 0 written, 1-3 to go
            fault["t"] = time.time()
            hosts.link(up=False)
            open(resume, "w").close()
            time.sleep(PARTITION_S)
            hosts.link(up=True)
            fault["up"] = time.time()

        try:
            result = run_p(hosts, d.info["control"], "--transfers", "20", "--blocks", "16", "--pause-s", "0.1",
                           "--settle-s", "40", "--hold-at", "3", "--resume-file", resume, during=partition)
        finally:
            d.stop()
    deadline = max(CONTROL_S, LAYER_WRITE_S + DONE_DELIVERY_S)   # a cut alloc, or a cut write then FAILED
    row = _summary(f"partition ({PARTITION_S:g} s)", result, fault["t"], deadline)
    late = [r for r in result["transfers"] if r["start"] > fault["up"]]
    row.update(link_down_s=PARTITION_S, transfers_after_link_up=len(late),
               good_verified=bool(late) and all(r["ok"] and r["verified"] for r in late))
    row["outcome"] = _verdict(row, must_fail=True, recovered=row["good_verified"])
    return row


def scenario_slow_link() -> dict:
    """A link slowed to a crawl fails each transfer at its write deadline, not a hang; D ends them too."""
    gbit = 0.0005                                # 500 kbit/s: one 384 KiB layer needs ~6 s > layer_write
    with two_hosts() as hosts:
        d = start_d(hosts)
        hosts.shape(gbit=gbit)
        t_fault = time.time()
        try:
            result = run_p(hosts, d.info["control"], "--transfers", "2", "--blocks", "48", "--per-transfer-s", "40",
                           "--settle-s", "40")
        finally:
            d.stop()
    row = _summary(f"slow link ({gbit * 1e3:g} Mbit/s)", result, t_fault,
                   CONTROL_S + LAYER_WRITE_S + DONE_DELIVERY_S)
    row["link_mbit"] = gbit * 1e3
    row["outcome"] = _verdict(row, must_fail=True, recovered=True)
    return row


def scenario_readdress() -> dict:
    """D restarted at a new address: P's call to the old one fails within its deadline; the new one verifies."""
    with two_hosts() as hosts:
        old = start_d(hosts)
        try:
            before = run_p(hosts, old.info["control"], "--transfers", "1")
        finally:
            old.stop()                           # D's machine restarts ...
        hosts.readdress(hosts.b, hosts.b.address.rsplit(".", 1)[0] + ".7")   # ... with another address
        new = start_d(hosts)
        try:
            t_fault = time.time()
            stale = run_p(hosts, old.info["control"], "--transfers", "1", "--status-at", new.info["control"])
            fresh = run_p(hosts, new.info["control"], "--transfers", "2")
        finally:
            new.stop()
    row = _summary("D at a new address", stale, t_fault, CONTROL_S)
    good = before["transfers"] + fresh["transfers"]
    row.update(old_control=old.info["control"], new_control=new.info["control"],
               stale_known_at_new_d=stale["d_states"].get("unknown", 0) != 1,
               good_verified=all(r["ok"] and r["verified"] for r in good), good_transfers=len(good))
    row["outcome"] = _verdict(row, must_fail=True, recovered=row["good_verified"] and not row["stale_known_at_new_d"])
    return row


NET_SCENARIOS = [scenario_partition, scenario_slow_link, scenario_readdress]


def run_rows(progress=sys.stderr) -> list[dict]:
    """Every network row; each one ``skipped: <reason>`` where namespaces cannot be made."""
    why = available()
    rows = []
    for i, scenario in enumerate(NET_SCENARIOS, 1):
        guarantee = scenario.__doc__.splitlines()[0]
        if why:
            rows.append({"name": scenario.__name__[9:], "outcome": f"skipped: {why}", "terminal_s": None,
                         "lost": 0, "skipped": why, "guarantee": guarantee})
            continue
        print(f"[net {i}/{len(NET_SCENARIOS)}] {scenario.__name__[9:]}: {guarantee}", file=progress, flush=True)
        try:
            rows.append({**scenario(), "guarantee": guarantee, "timeouts": TIMEOUTS})
        except Exception as exc:  # noqa: BLE001 - a row that could not run says why; the others still run
            rows.append({"name": scenario.__name__[9:], "outcome": "ERROR", "error": f"{type(exc).__name__}: {exc}",
                         "terminal_s": None, "lost": "?", "guarantee": guarantee})
    return rows
