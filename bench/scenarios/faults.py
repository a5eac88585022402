"""``aiolayer bench faults``: peer faults against real processes, each ending in a visible state.

Every scenario runs one step on P that streams the same KV to two decode nodes (child processes,
Mooncake over TCP): a healthy one, and one that gets the fault mid-transfer. It records how each
transfer ended, how long after the fault P reached a terminal state, how many transfers never
reached one (``lost``, must be 0), and the forward thread's hand-off cost while it happened.
The same functions back ``tests/runtime/test_faults.py``.
"""

from __future__ import annotations

import os
import random
import secrets
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
import zmq

from aiolayer import Runtime, TransferSpec
from aiolayer.config import KVShape, NodeConfig, Timeouts
from aiolayer.errors import AiolayerError, DeadlineExceeded
from aiolayer.kvcache import PagedKVCache, checksums
from aiolayer.protocol import messages as m
from aiolayer.harness.node import NodeProcess
from aiolayer.harness.procs import freeze

from .fault_checks import broken
from ..provenance import write_result
from ..perf.forward import RequestKV, SimulatedForward, seeded_kv
from . import net_faults

# Short deadlines so a scenario ends in seconds; Mooncake gives up on a frozen peer after 5 s.
MC_TRANSFER_TIMEOUT_S = 5
FAULT_TIMEOUTS = Timeouts(control_call=0.5, layout_fetch=2.0, layer_write=2.0, done_delivery=1.5,
                          receive=8.0, fence_grace=MC_TRANSFER_TIMEOUT_S + 1.0, quarantine=15.0)
SHAPE = KVShape(num_layers=8, num_blocks=64, block_size=16, kv_heads=8, head_dim=128)
BLOCKS = 32
LAYER_MS = 25.0
FAULT_AT_LAYER = 3
NODE_ARGS = ["--receive-timeout", str(FAULT_TIMEOUTS.receive), "--fence-grace", str(FAULT_TIMEOUTS.fence_grace)]
NODE_ENV = {"MC_TRANSFER_TIMEOUT": str(MC_TRANSFER_TIMEOUT_S)}
# What P may take from the fault to a terminal state: a write deadline, then FAILED delivery.
P_DEADLINE_S = FAULT_TIMEOUTS.layer_write + FAULT_TIMEOUTS.done_delivery


class FaultHarness:
    """P runtime in this process, one healthy D kept for every scenario, a faulty D per scenario."""

    def __init__(self) -> None:
        self.good: NodeProcess | None = None
        self.rt: Runtime | None = None
        self.step = 0
        self.tokens: dict[str, str] = {}   # transfer id -> its token, as the driver (a proxy's role) holds it

    def __enter__(self) -> "FaultHarness":
        os.environ.update(NODE_ENV)
        self.good = NodeProcess(SHAPE, extra_args=NODE_ARGS, env=NODE_ENV).start()
        self.rt = Runtime(NodeConfig(engine_id="faults-p"), FAULT_TIMEOUTS).start()
        self.shape = KVShape(**{**_fields(SHAPE), "num_blocks": BLOCKS})
        self.cache = PagedKVCache(self.shape)
        self.rt.register_kv_memory(self.cache.k_base, self.cache.v_base, self.shape.block_bytes, BLOCKS)
        self.forward = SimulatedForward(self.cache, LAYER_MS)
        self.base_kv = seeded_kv(SHAPE.num_layers, BLOCKS, SHAPE.block_bytes, seed=99)
        return self

    def __exit__(self, *exc) -> None:
        if self.rt is not None:
            self.rt.stop()
        if self.good is not None:
            self.good.stop()

    def bad_node(self, *extra: str, port: int = 0) -> NodeProcess:
        args = [*NODE_ARGS, *extra] + (["--port", str(port), "--engine-id", f"d-{port}"] if port else [])
        return NodeProcess(SHAPE, extra_args=args, env=NODE_ENV).start()

    def alloc(self, node_control: str, tid: str, token: str = "") -> m.AllocReply:
        reply = self.rt.request(node_control, m.AllocRequest(transfer_id=tid, num_blocks=BLOCKS, token=token,
                                                             sender_control=self.rt.control_endpoint))
        self.tokens[tid] = reply.token
        return reply

    def stream(self, targets: list[tuple[str, str, m.AllocReply]], fault=None, fault_at=FAULT_AT_LAYER):
        """One step to every (tid, control, alloc) target; ``fault()`` runs when layer ``fault_at`` is due."""
        self.step += 1
        if any(tid != a.transfer_id for tid, _, a in targets):
            raise ValueError("each target's tid must be its AllocReply's transfer_id")
        specs = [TransferSpec.from_registration(a, src_blocks=list(range(BLOCKS)), peer=ctl) for _, ctl, a in targets]
        kv = RequestKV(self.base_kv, self.step)
        fired: dict = {}
        timer = None
        if fault is not None:
            def inject() -> None:
                fired["t"] = time.perf_counter()
                fault()
            timer = threading.Timer(fault_at * LAYER_MS / 1000.0, inject)
            timer.start()
        timing = self.forward.run(self.rt, specs, kv, list(range(BLOCKS)))
        if timer is not None:
            timer.join()
        return kv, timing, fired.get("t", timing["t0"])

    def outcome(self, tid: str, limit: float):
        try:
            return self.rt.wait_outcome(tid, limit)
        except DeadlineExceeded:
            return None

    def verified(self, control: str, tid: str, kv: RequestKV) -> bool:
        reply = self.rt.request(control, m.VerifyRequest(transfer_id=tid), timeout=10)
        return (reply.state == "finished" and
                (reply.crc_k, reply.crc_v) == checksums(kv.data, range(BLOCKS)))

    def d_state(self, control: str, tid: str) -> str:
        try:
            return self.rt.request(control, m.StatusRequest(transfer_id=tid), timeout=1.0).state
        except AiolayerError:
            return "unreachable"

    def release(self, control: str, tid: str) -> None:
        try:
            self.rt.request(control, m.ReleaseRequest(transfer_id=tid), timeout=1.0)
        except AiolayerError:
            pass


def _fields(shape: KVShape) -> dict:
    return {f: getattr(shape, f) for f in shape.__struct_fields__}


def _wait_d_state(h: FaultHarness, control: str, tid: str, want: set[str], limit: float) -> tuple[str, float]:
    start = time.perf_counter()
    state = h.d_state(control, tid)
    while state not in want and time.perf_counter() - start < limit:
        time.sleep(0.05)
        state = h.d_state(control, tid)
    return state, time.perf_counter() - start


def _with_good_peer(h: FaultHarness, name: str, bad_ctl: str, fault, fault_at=FAULT_AT_LAYER,
                    after=None, bad_alloc: m.AllocReply | None = None, deadline_s: float = P_DEADLINE_S) -> dict:
    """Stream to the faulty D and the healthy one together; the healthy one must verify."""
    bad_tid, good_tid = f"{name}-bad-{h.step + 1}", f"{name}-good-{h.step + 1}"
    bad_alloc = bad_alloc or h.alloc(bad_ctl, bad_tid)
    good_alloc = h.alloc(h.good.control, good_tid)
    kv, timing, t_fault = h.stream([(bad_tid, bad_ctl, bad_alloc), (good_tid, h.good.control, good_alloc)],
                                   fault, fault_at)
    limit = P_DEADLINE_S + FAULT_TIMEOUTS.quarantine + 5
    bad, good = h.outcome(bad_tid, limit), h.outcome(good_tid, limit)
    result = {"name": name, "lost": int(bad is None) + int(good is None),
              "bad_ok": bool(bad and bad.ok), "bad_reason": bad.reason if bad else "no outcome",
              "terminal_s": round(bad.finished_s - t_fault, 3) if bad else None,
              "deadline_s": deadline_s,
              "good_ok": bool(good and good.ok), "good_verified": bool(good and good.ok) and
              h.verified(h.good.control, good_tid, kv),
              "handoff_ns": {"p50": int(np.percentile(timing["handoff_ns"], 50)),
                             "p99": int(np.percentile(timing["handoff_ns"], 99)),
                             "max": int(max(timing["handoff_ns"]))}}
    if after is not None:
        result.update(after(bad_tid, kv, bad))
    h.release(h.good.control, good_tid)
    result["outcome"] = _verdict(result)
    return result


def _released_within(h: FaultHarness, limit: float) -> set[str]:
    """Transfer ids P handed back as safe to reuse within ``limit`` seconds."""
    end = time.monotonic() + limit
    seen = set(h.rt.pop_released())
    while time.monotonic() < end:
        time.sleep(0.05)
        seen.update(h.rt.pop_released())
    return seen


def _verdict(r: dict) -> str:
    if r["lost"] or not r["good_verified"]:
        return "LOST" if r["lost"] else "HEALTHY PEER HURT"
    return "completed" if r["bad_ok"] else "failed (visible)"


# --- the scenarios ------------------------------------------------------------------------------

def scenario_kill(h: FaultHarness) -> dict:
    """A dead D fails its transfer at P within the write deadline; the other D is unaffected."""
    node = h.bad_node()
    try:
        return _with_good_peer(h, "kill -9 D", node.control, lambda: os.kill(node.pid, signal.SIGKILL))
    finally:
        node.stop()


def scenario_freeze(h: FaultHarness) -> dict:
    """A frozen D fails at P within its deadline, at D once it runs again; P's source stays held until then."""
    node = h.bad_node()

    def after(tid: str, kv, outcome) -> dict:
        released_while_frozen = tid in _released_within(h, 0.3)
        os.kill(node.pid, signal.SIGCONT)
        state, took = _wait_d_state(h, node.control, tid, {"failed", "finished"},
                                    FAULT_TIMEOUTS.receive + FAULT_TIMEOUTS.fence_grace + 2)
        released = released_while_frozen or tid in _released_within(h, FAULT_TIMEOUTS.quarantine)
        return {"d_state_after_sigcont": state, "d_terminal_after_sigcont_s": round(took, 3),
                "source_released_at_outcome": bool(outcome and outcome.source_released),
                "source_released_while_frozen": released_while_frozen, "source_released_later": released}

    try:
        return _with_good_peer(h, "SIGSTOP D", node.control, lambda: freeze(node.pid),
                               after=after)
    finally:
        node.stop()


def scenario_refuse(h: FaultHarness) -> dict:
    """A write that D refuses fails the transfer at once, and D is told (FAILED)."""
    node = h.bad_node("--refuse-writes")

    def after(tid: str, kv, outcome) -> dict:
        state, _ = _wait_d_state(h, node.control, tid, {"failed"}, 3)
        return {"d_state": state}

    try:
        return _with_good_peer(h, "refused write", node.control, None, after=after)
    finally:
        node.stop()


def scenario_slow(h: FaultHarness) -> dict:
    """A peer that stalls for less than the write deadline is slow, not failed."""
    node = h.bad_node()

    def stall() -> None:
        freeze(node.pid)
        time.sleep(0.5)
        os.kill(node.pid, signal.SIGCONT)

    def after(tid: str, kv, outcome) -> dict:
        return {"bad_verified": h.verified(node.control, tid, kv)}

    try:
        return _with_good_peer(h, "slow D (0.5 s stall)", node.control, stall, after=after)
    finally:
        node.stop()


def scenario_abort(h: FaultHarness) -> dict:
    """A client abort at D mid-transfer: P stops, and D keeps the blocks until P says it is quiet."""
    node = h.bad_node()
    tids: list[str] = []

    def abort() -> None:
        tid = f"client abort-bad-{h.step}"
        tids.append(tid)
        h.rt.request(node.control, m.AbortRequest(transfer_id=tid, reason="client disconnected",
                                                  token=h.tokens[tid]))

    def after(tid: str, kv, outcome) -> dict:
        state, took = _wait_d_state(h, node.control, tid, {"failed"}, FAULT_TIMEOUTS.fence_grace + 2)
        return {"d_state": state, "d_fenced_s": round(took, 3), "aborted_tid_seen": tid in tids}

    try:
        return _with_good_peer(h, "client abort", node.control, abort, after=after)
    finally:
        node.stop()


def scenario_unreachable(h: FaultHarness) -> dict:
    """Nobody listens at D's address: the layout fetch fails once, never per layer, never on the forward."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    sock.close(0)  # the port is now free: nobody will answer there
    fake = m.AllocReply(transfer_id=f"unreachable D-bad-{h.step + 1}", block_ids=list(range(BLOCKS)),
                        incarnation="gone", token="never-checked-" * 2)
    dead = f"tcp://127.0.0.1:{port}"
    return _with_good_peer(h, "unreachable D", dead, None, bad_alloc=fake,
                           deadline_s=FAULT_TIMEOUTS.layout_fetch + FAULT_TIMEOUTS.done_delivery,
                           after=lambda tid, kv, _: {"layout_fetches": h.rt.layouts.fetches[dead]})


def scenario_done_first(h: FaultHarness) -> dict:
    """A DONE that arrives before D registered the transfer completes it; a duplicate changes nothing."""
    tid = f"early-{h.step + 1}"
    ctl = h.good.control
    t0 = time.perf_counter()
    token = secrets.token_hex(16)   # minted by the driver, as a proxy does, so P has it before D registers
    done = m.Done(transfer_id=tid, sender="faults-p", incarnation="", layers=0, bytes=0, token=token)
    early = h.rt.request(ctl, done)
    h.alloc(ctl, tid, token=token)
    state = h.d_state(ctl, tid)
    dup = h.rt.request(ctl, done)
    after_dup = h.d_state(ctl, tid)
    h.release(ctl, tid)
    ok = state == "finished" and after_dup == "finished" and dup.detail.startswith("already")
    return {"name": "DONE before registration", "outcome": "completed" if ok else "WRONG STATE",
            "terminal_s": round(time.perf_counter() - t0, 3), "lost": 0 if ok else 1,
            "early_reply": early.detail, "state": state, "duplicate_reply": dup.detail}


def scenario_garbage(h: FaultHarness, frames: int = 2000) -> dict:
    """Random and truncated frames: every one answered, and D still serves a transfer afterwards."""
    node = h.bad_node()
    rng = random.Random(7)
    valid = m.encode(m.StatusRequest(transfer_id="x"))
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(node.control)
    answered = 0
    t0 = time.perf_counter()
    try:
        for i in range(frames):
            kind = i % 3
            payload = (rng.randbytes(rng.randint(0, 64)) if kind == 0 else valid[: rng.randint(0, len(valid) - 1)]
                       if kind == 1 else bytes([rng.randint(0x80, 0x9f)]) + rng.randbytes(8))
            sock.send_multipart([m.pack_request_id(i + 1), payload])
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        deadline = time.monotonic() + 20
        while answered < frames and time.monotonic() < deadline:
            if poller.poll(500):
                sock.recv_multipart()
                answered += 1
        result = _with_good_peer(h, "garbage frames", node.control, None,
                                 after=lambda tid, kv, _: {"bad_verified": h.verified(node.control, tid, kv)})
    finally:
        sock.close(0)
        node.stop()
    result.update({"name": f"{frames} garbage frames", "frames": frames, "answered": answered,
                   "terminal_s": round(time.perf_counter() - t0, 3)})
    if answered != frames:
        result["outcome"] = "FRAMES UNANSWERED"
    return result


SCENARIOS = [scenario_kill, scenario_freeze, scenario_refuse, scenario_slow, scenario_abort, scenario_unreachable,
             scenario_done_first, scenario_garbage]


def run_faults(args) -> int:
    rows = []
    with FaultHarness() as h:
        for i, scenario in enumerate(SCENARIOS, 1):
            guarantee = scenario.__doc__.splitlines()[0]
            print(f"[{i}/{len(SCENARIOS)}] {scenario.__name__[9:]}: {guarantee}", file=sys.stderr, flush=True)
            row = {**scenario(h), "guarantee": guarantee}
            row["broken"] = broken(scenario.__name__, row, FAULT_TIMEOUTS)   # as the fault tests check them
            if row["broken"]:
                row["outcome"] = "BROKEN"
                print(f"  broken: {row['broken']}", file=sys.stderr, flush=True)
            rows.append(row)
    rows += net_faults.run_rows()   # faults of the link: P and D on two network namespaces
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_result(out / "faults.json", {"timeouts": _fields(FAULT_TIMEOUTS), "scenarios": rows})
    print(f"\n{'scenario':<26} {'outcome':<18} {'terminal s':>10} {'deadline s':>10} {'lost':>5} "
          f"{'hand-off p99 ns':>15}  other peer")
    for r in rows:
        handoff = r.get("handoff_ns", {}).get("p99", "")
        other = "verified" if r.get("good_verified") else ("-" if "good_verified" not in r else "HURT")
        print(f"{r['name']:<26} {r['outcome']:<18} {r['terminal_s'] or 0:>10.3f} {r.get('deadline_s', ''):>10} "
              f"{r['lost']:>5} {handoff:>15}  {other}")
    print(f"\nwrote {out / 'faults.json'}")
    bad = [r for r in rows if r["lost"] or r["outcome"].isupper()]
    return 1 if bad else 0
