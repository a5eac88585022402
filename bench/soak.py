"""``aiolayer bench --scenario soak``: many transfers with faults; nothing lost, nothing hung, memory flat.

One P ``Runtime`` in this process streams ``--requests`` transfers, a window of them in flight and
several per step, to ``--decode-ranks`` decode node processes (Mooncake over TCP on 127.0.0.1) and
one more node started with ``--refuse-writes``. Each transfer gets a fault with probability
``--fault-rate`` (seeded by ``--seed``), the kinds taken in turn, so evenly:

  kill       SIGKILL its D node at layer 1 of its step, with that node's other transfers in flight too,
             then start a replacement (a new process and incarnation, same engine id; every other one
             binds the dead node's control port again, so P must see the new incarnation behind an
             old endpoint, the others a fresh port). Every transfer to the dead node must fail at P.
  freeze     SIGSTOP its D node at layer 1 for 0.5-3 s (uniform; the write deadline is 2 s), then SIGCONT.
  refuse     send it to the ``--refuse-writes`` node (layout published, no memory registered):
             Mooncake refuses every write.
  drop_done  allocate it with ``drop_done``: D never answers its DONE, so P fails it when DONE
             delivery runs out; D's receive deadline fences it (D asks P to stop, P answers) and fails it.

The driver plays the proxy's role on an event loop of its own in the main thread: it allocates on
D ahead of the forward (``AllocRequest``, the reply's token goes into the ``TransferSpec``), runs the
simulated forward (per layer: copy the transfer's seeded bytes into P's paged cache, ``layer_ready``,
1 ms of "compute"), collects P's outcomes with ``pop_outcomes`` and frees P's source blocks with
``pop_released``. Each ended transfer is checked at D off the critical path (``VerifyRequest``:
state and per-layer CRC32s; ``StatusRequest`` while a failed one is still fencing) and released
(``ReleaseRequest``), so D's memory does not fill up. An allocation whose reply timed out (its node
froze) may still register at D later: it is released once D has failed it ("orphans").

Each transfer ends in exactly one class; they add up to ``requests``:

  finished        P's outcome ok, and D verified: state finished, CRCs equal to what P sent.
  failed          P's outcome failed, and D failed it too (or D was killed, or D never registered it).
  disagree        P's outcome failed but D finished with the right bytes: DONE reached D, its
                  acknowledgement did not reach P in time (D froze in between). Not data loss - D
                  has the right bytes - but the two sides disagree, so it is counted apart.
  lost            silent loss: P ok while D is not finished or has other bytes; or D finished with
                  bytes other than P's, whatever P said. Must be 0.
  ok_unverified   P ok, but D was killed by the soak before the check could run (nothing to verify).
  hung            no terminal outcome at P within ``p_bound_s`` of its step, or D still
                  ``registered``/``aborting`` (or not answering while alive) ``d_bound_s`` after P's
                  outcome. Must be 0.

Defaults chosen here (the bench's shape flags default to a big model; a shape flag left at that
default takes the soak's value): 4 layers, 16 tokens x 2 KV heads x 64 dims, float16, so 4 KiB
blocks; 4 blocks (64 tokens) per transfer, i.e. 4 layers x (K, V) = 8 writes of 16 KiB; 64
transfers in flight at most, 8 per step; D nodes of 1024 blocks, P's cache of 1024 blocks.
Deadlines: ``bench.faults.FAULT_TIMEOUTS`` on P and the nodes, ``MC_TRANSFER_TIMEOUT=5``.

Memory: RSS of this process (``/proc/self/statm``) is taken once ``rss_start_after`` transfers (10 %)
have ended, so connections, caches and allocator pools are warm, and again at the end, after every
transfer was checked and released. The run passes (exit 0) only with lost == 0, hung == 0 and an
RSS growth under 5 %. Writes ``<out>/soak.json``.

A fault hurts more than its own transfer: a kill fails every transfer in flight to that node (and
the ones allocated there, not begun yet), a freeze longer than the write deadline likewise;
``collateral`` counts the outcomes of transfers without a fault of their own, and
``collateral_failures_by_node`` says whether their node had been killed or frozen (or neither).
Before a kill the forward waits (at most ``KILL_VERIFY_S``) until D verified what P already
acknowledged on that node, so few P-ok transfers end up ``ok_unverified``. A kill or freeze drawn
for a transfer whose node an earlier kill took already is carried over to the next one without a
fault (``*_carried_over``), so the kinds stay even. ``p_internals_*`` are the sizes of the
runtime's per-transfer and per-peer tables at ``rss_start`` and at the end (growth = a leak).
Mooncake's own log lines (one per refused or failed write) go to a temporary file while it runs,
summarised under ``native_log``.

Diagnostics (environment): ``AIOLAYER_SOAK_KINDS=kill,freeze`` injects only those kinds;
``AIOLAYER_SOAK_RESTART_PORT=same|new`` restarts killed nodes on the same or a fresh port (default:
alternate); ``AIOLAYER_SOAK_TRACEMALLOC=N`` traces Python allocations after the warm-up (N frames)
and lists the biggest survivors under ``examples.tracemalloc_top``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import random
import secrets
import signal
import sys
import tempfile
import threading
import time
import zlib
from array import array
from pathlib import Path

import numpy as np

from aiolayer import Runtime, TransferSpec
from aiolayer.config import KVShape, NodeConfig, Timeouts
from aiolayer.errors import AiolayerError, ControlRejected, RuntimeStateError
from aiolayer.kvcache import BlockAllocator, PagedKVCache
from aiolayer.protocol import messages as m
from aiolayer.runtime.control import ControlClient, open_sockets

from .faults import FAULT_TIMEOUTS, MC_TRANSFER_TIMEOUT_S, NODE_ARGS, NODE_ENV
from .node_proc import NodeProcess

SOAK_SHAPE = dict(num_layers=4, block_size=16, kv_heads=2, head_dim=64, dtype="float16")
BLOCKS = 4                 # per transfer
D_BLOCKS = 1024            # per decode node
P_BLOCKS = 1024            # P's paged cache: source blocks of transfers in flight or fenced
WINDOW = 64                # transfers in flight at P at most
STEP = 8                   # transfers begun per step
LAYER_S = 0.001            # simulated compute per layer
ALLOC_WORKERS = 8          # allocations in flight ahead of the forward
READY_AHEAD = 2 * STEP     # allocated, not yet begun: short, D's receive deadline runs from allocation
D_CHECKS = 32              # D verifications/releases in flight
FAULT_AT_LAYER = 1
KILL_VERIFY_S = 0.25       # before a SIGKILL: at most this long for D to verify what P acknowledged there
FREEZE_S = (0.5, 3.0)
KINDS = ("kill", "freeze", "refuse", "drop_done")
RSS_LIMIT = 0.05
PROGRESS_S = 5.0
STALL_S = 90.0             # no P outcome at all for this long, with transfers in flight: give up

T = FAULT_TIMEOUTS
# P: layout fetch, then each layer's write, then DONE/FAILED delivery; doubled and padded for a busy box
P_BOUND_S = 2 * (T.layout_fetch + T.layer_write + T.done_delivery) + 5.0
# D, from P's outcome: receive deadline, then the fence without P's answer, a freeze, padding
D_BOUND_S = T.receive + T.fence_grace + FREEZE_S[1] + 5.0
DRIVER_TIMEOUTS = Timeouts(control_call=1.0)
CALL_S = 1.0

def _rss_mb(pid: int | str = "self") -> float:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, IndexError, ValueError):
        return 0.0


def _pct(values, q: float) -> float | None:
    return round(float(np.percentile(np.frombuffer(values, dtype=np.float64), q)) * 1000, 2) if len(values) else None


def _soak_shape(args) -> KVShape:
    """The command line's shape, with every flag left at the bench's (big) default set to the soak's."""
    big = KVShape()
    fields = {}
    for name, small in SOAK_SHAPE.items():
        given = getattr(args, name, getattr(big, name))
        fields[name] = small if given == getattr(big, name) else given
    return KVShape(num_blocks=BLOCKS, **fields)


class Node:
    """One decode node process of the pool (a replacement is a new ``Node``)."""

    def __init__(self, slot: int, proc: NodeProcess, refuse: bool) -> None:
        self.slot = slot
        self.proc = proc
        self.refuse = refuse
        self.control = proc.control
        self.port = int(self.control.rsplit(":", 1)[1])
        self.incarnation = proc.info.get("incarnation", "")
        self.pid = proc.pid
        self.client: ControlClient | None = None
        self.dead = False
        self.killed = False            # by the soak (an unexpected death is reported apart)
        self.frozen_until = 0.0
        self.acked: set[str] = set()   # P acknowledged, D not verified yet
        self.cont: asyncio.TimerHandle | None = None
        self.held = 0                  # transfers allocated here, not yet released
        self.active = 0                # transfers allocated here, no outcome at P yet
        self.rss_first = 0.0
        self.last_freeze = 0.0         # loop time of the last SIGSTOP
        self.killed_at = 0.0           # perf_counter of the SIGKILL
        self.successor: "Node | None" = None

    def up(self, now: float) -> bool:
        return not self.dead and self.client is not None and now >= self.frozen_until


class Transfer:
    __slots__ = ("index", "tid", "kind", "node", "alloc", "src", "crc", "t_begin", "outcome", "p_hung", "faulted")

    def __init__(self, index: int, kind: str) -> None:
        self.index = index
        self.tid = f"soak-{index}-{secrets.token_hex(4)}"
        self.kind = kind               # "" or one of KINDS
        self.node: Node | None = None
        self.alloc: m.AllocReply | None = None
        self.src: list[int] | None = None
        self.crc: tuple[list[int], list[int]] | None = None
        self.t_begin = 0.0
        self.outcome = None
        self.p_hung = False
        self.faulted = False           # the fault was actually applied (a kill/freeze of a live node)


class _CountingHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.counts: collections.Counter[str] = collections.Counter()

    def emit(self, record: logging.LogRecord) -> None:
        self.counts[f"{record.levelname} {record.name}: {str(record.msg)[:70]}"] += 1


class Soak:
    def __init__(self, args, shape: KVShape) -> None:
        self.args = args
        self.n = args.requests
        self.rate = args.fault_rate
        self.ranks = max(1, args.decode_ranks)
        self.shape = shape
        self.d_shape = KVShape(**{**{f: getattr(shape, f) for f in shape.__struct_fields__}, "num_blocks": D_BLOCKS})
        self.p_shape = KVShape(**{**{f: getattr(shape, f) for f in shape.__struct_fields__}, "num_blocks": P_BLOCKS})
        # diagnostics: AIOLAYER_SOAK_KINDS=kill,freeze injects only those kinds
        self.kinds = tuple(k for k in os.environ.get("AIOLAYER_SOAK_KINDS", ",".join(KINDS)).split(",") if k in KINDS)
        self.rng = random.Random(args.seed)            # which transfers get a fault: one draw per transfer, in order
        self.pick_rng = random.Random(args.seed + 1)   # node choice among the least loaded
        self.freeze_rng = random.Random(args.seed + 2)
        self.rt: Runtime | None = None
        self.pool: list[Node | None] = []
        self.refuse_node: Node | None = None
        self.all_nodes: list[Node] = []
        self.node_pids: list[int] = []
        # pipeline
        self.next_index = 0
        self.fault_turn = 0
        self.ready: asyncio.Queue | None = None
        self.pending_p: dict[str, Transfer] = {}   # begun, no outcome yet
        self.hung_p: dict[str, Transfer] = {}      # past the P bound without an outcome
        self.src_of: dict[str, list[int]] = {}     # tid -> P source blocks not yet released by P
        self.begun = 0
        self.ended = 0                             # classified
        self.step = 0
        self.checks: set[asyncio.Task] = set()
        self.sem: asyncio.Semaphore | None = None
        self.orphans: list[tuple[Node, str, float]] = []
        self.tasks: set[asyncio.Task] = set()
        # results
        self.classes: collections.Counter[str] = collections.Counter()
        self.by_kind: dict[str, collections.Counter[str]] = {k: collections.Counter() for k in ("none", *KINDS)}
        self.injected: collections.Counter[str] = collections.Counter()
        self.skipped: collections.Counter[str] = collections.Counter()
        self.carry: collections.Counter[str] = collections.Counter()
        self.collateral_where: collections.Counter[str] = collections.Counter()
        self.unverified_why: collections.Counter[str] = collections.Counter()
        self.kill_waits = array("d")
        self.reasons: collections.Counter[str] = collections.Counter()
        self.counters: collections.Counter[str] = collections.Counter()
        self.lat_all, self.lat_ok, self.lat_fail = array("d"), array("d"), array("d")
        self.lat_kind: dict[str, array] = {k: array("d") for k in KINDS}
        self.examples: dict[str, list[str]] = collections.defaultdict(list)
        self.unexpected_deaths: list[dict] = []
        self.rss_start = self.rss_start_at = None
        self.rss_samples: list[list] = []
        self.rss_peak = 0.0
        self.internals_start: dict = {}
        self.last_outcome = time.monotonic()
        self.p_src = BlockAllocator(P_BLOCKS)
        self.src_waits = 0
        self.restarts = 0
        self.t0 = 0.0
        self.duration = 0.0
        self.rss_after = max(1, self.n // 10)
        self.rss_last_begin = None
        self.rss_end = 0.0
        self.internals_end: dict = {}
        self.node_rss: dict = {}
        self.error = ""
        self.stopping = False
        self.err = sys.stderr
        base_rng = np.random.default_rng(args.seed)
        self.base = base_rng.integers(0, 1 << 63, size=shape.num_layers * 2 * BLOCKS * shape.block_bytes // 8,
                                      dtype=np.uint64)

    # --- nodes ---------------------------------------------------------------------------------

    def _start_node(self, slot: int, refuse: bool = False, port: int = 0) -> Node:
        extra = [*NODE_ARGS, "--engine-id", "soak-refuse" if refuse else f"soak-d{slot}"]
        if refuse:
            extra.append("--refuse-writes")
        if port:
            extra += ["--port", str(port)]
        proc = NodeProcess(self.d_shape, extra_args=extra, env=NODE_ENV).start()
        self.node_pids.append(proc.pid)
        node = Node(slot, proc, refuse)
        self.all_nodes.append(node)
        return node

    async def _attach(self, node: Node) -> None:
        client = ControlClient(node.control, DRIVER_TIMEOUTS)
        await client.start(self._spawn)
        node.client = client
        node.rss_first = _rss_mb(node.pid)

    def _spawn(self, coro, name: str = "") -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def _kill(self, node: Node) -> None:
        if node.dead:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(node.pid, signal.SIGKILL)
        node.killed = True
        node.killed_at = time.perf_counter()
        self._node_gone(node)

    def _node_gone(self, node: Node) -> None:
        node.dead = True
        if node.cont is not None:
            node.cont.cancel()
            node.cont = None
        client, node.client = node.client, None
        if client is not None:
            self._spawn(client.close(), name="close client")
        if node is self.refuse_node or (not node.refuse and self.pool[node.slot] is node):
            self._spawn(self._replace(node), name=f"replace d{node.slot}")

    async def _replace(self, old: Node) -> None:
        await asyncio.to_thread(self._reap, old)
        # diagnostics: AIOLAYER_SOAK_RESTART_PORT=same|new (default: alternate)
        policy = os.environ.get("AIOLAYER_SOAK_RESTART_PORT", "alternate")
        port = old.port if policy == "same" or (policy == "alternate" and self.restarts % 2 == 0) else 0
        self.restarts += 1
        for attempt in range(4):
            try:
                new = await asyncio.to_thread(self._start_node, old.slot, old.refuse, port)
                await self._attach(new)
            except Exception as exc:  # noqa: BLE001 - the port may be taken: a fresh one next time
                self.counters["restart_errors"] += 1
                self.examples["restart_errors"].append(f"{type(exc).__name__}: {str(exc)[:200]}")
                port = 0
                await asyncio.sleep(0.5)
                continue
            self.counters["restarts_same_port" if port else "restarts_new_port"] += 1
            old.successor = new
            new.started_at = time.perf_counter()
            if old.refuse:
                self.refuse_node = new
            else:
                self.pool[old.slot] = new
            return
        self.counters["slots_lost"] += 1

    @staticmethod
    def _reap(node: Node) -> None:
        node.proc.stop(5.0)
        with contextlib.suppress(Exception):
            node.proc._stderr.close()   # noqa: SLF001 - one temporary file per node, no fd kept for the dead

    def _freeze(self, node: Node, seconds: float) -> None:
        if node.dead:
            return
        loop = asyncio.get_running_loop()
        with contextlib.suppress(ProcessLookupError):
            os.kill(node.pid, signal.SIGSTOP)
        until = loop.time() + seconds
        node.last_freeze = loop.time()
        if until > node.frozen_until:
            node.frozen_until = until
            if node.cont is not None:
                node.cont.cancel()
            node.cont = loop.call_at(until, self._thaw, node)

    def _thaw(self, node: Node) -> None:
        node.cont = None
        if not node.dead:
            with contextlib.suppress(ProcessLookupError):
                os.kill(node.pid, signal.SIGCONT)

    def _pick(self) -> Node | None:
        now = asyncio.get_running_loop().time()
        up = [n for n in self.pool if n is not None and n.up(now)]
        if not up:
            return None
        # by transfers in flight, not blocks held: a fresh replacement must not draw the whole window
        least = min(n.active for n in up)
        return self.pick_rng.choice([n for n in up if n.active == least])

    # --- pipeline ------------------------------------------------------------------------------

    def _next_transfer(self) -> Transfer | None:
        if self.next_index >= self.n:
            return None
        kind = ""
        if self.rng.random() < self.rate:
            kind = self.kinds[self.fault_turn % len(self.kinds)]
            self.fault_turn += 1
        t = Transfer(self.next_index, kind)
        self.next_index += 1
        return t

    async def _allocator(self) -> None:
        while (t := self._next_transfer()) is not None:
            while True:
                node = self.refuse_node if t.kind == "refuse" else self._pick()
                if node is None or node.client is None or node.dead:
                    await asyncio.sleep(0.05)
                    continue
                req = m.AllocRequest(transfer_id=t.tid, num_blocks=BLOCKS, sender_control=self.rt.control_endpoint,
                                     drop_done=t.kind == "drop_done")
                node.held += 1
                try:
                    reply = await node.client.call(req, timeout=CALL_S)
                except ControlRejected as exc:
                    node.held -= 1
                    self.counters[f"alloc_rejected_{exc.code}"] += 1
                    await asyncio.sleep(0.05)
                    continue
                except (AiolayerError, asyncio.TimeoutError):
                    self.counters["alloc_timeouts"] += 1
                    if not node.dead:   # it may register once it runs again: release it then
                        self.orphans.append((node, t.tid, asyncio.get_running_loop().time()))
                    else:
                        node.held -= 1
                    t.tid = f"soak-{t.index}-{secrets.token_hex(4)}"   # the old id may be registered there
                    await asyncio.sleep(0.01)
                    continue
                t.node, t.alloc = node, reply
                node.active += 1
                break
            await self.ready.put(t)

    def _kv_of(self, t: Transfer) -> np.ndarray:
        salt = np.uint64((t.index + 1) * 0x9E3779B97F4A7C15 % (1 << 64))
        data = np.bitwise_xor(self.base, salt).view(np.uint8)
        return data.reshape(self.shape.num_layers, 2, BLOCKS, self.shape.block_bytes)

    async def _forward(self) -> None:
        blocks = self.cache.blocks
        sender = self.rt.sender
        while self.begun < self.n:
            while len(self.pending_p) >= WINDOW:
                await asyncio.sleep(0.002)
            batch = [await self.ready.get()]
            while len(batch) < STEP and len(self.pending_p) + len(batch) < WINDOW and not self.ready.empty():
                batch.append(self.ready.get_nowait())
            kvs = []
            for t in batch:
                while (src := self.p_src.allocate(BLOCKS)) is None:
                    self.src_waits += 1
                    await asyncio.sleep(0.005)
                t.src = src
                self.src_of[t.tid] = src
                kv = self._kv_of(t)
                t.crc = ([zlib.crc32(kv[layer, 0]) for layer in range(kv.shape[0])],
                         [zlib.crc32(kv[layer, 1]) for layer in range(kv.shape[0])])
                kvs.append(kv)
            specs = [TransferSpec(transfer_id=t.tid, peer=t.node.control, src_blocks=t.src,
                                  dst_blocks=t.alloc.block_ids, dst_incarnation=t.alloc.incarnation,
                                  token=t.alloc.token) for t in batch]
            self.step += 1
            step = self.step
            now = time.perf_counter()
            for t in batch:
                t.t_begin = now
                self.pending_p[t.tid] = t
            self.begun += len(batch)
            sender.begin_step(step, specs)
            for layer in range(self.shape.num_layers):
                for t, kv in zip(batch, kvs):
                    blocks[layer][:, t.src] = kv[layer]
                sender.layer_ready(step, layer)
                if layer == FAULT_AT_LAYER:
                    for t in batch:
                        self._carry_over(t)
                    doomed = {t.node for t in batch if t.kind == "kill" and not t.node.dead}
                    if doomed:
                        await self._verify_before_kill(doomed)
                    for t in batch:
                        self._inject(t)
                await asyncio.sleep(LAYER_S)
            sender.end_step(step)
            if self.begun >= self.n:
                self.rss_last_begin = _rss_mb()

    async def _verify_before_kill(self, doomed: set) -> None:
        """Let D verify the transfers P already acknowledged on a node about to be killed (bounded).

        Killed right away, those could never be checked (``ok_unverified``). The faulted transfer
        stays mid-stream meanwhile: its later layers are not handed over until the kill.
        """
        loop = asyncio.get_running_loop()
        start = loop.time()
        while any(n.acked for n in doomed) and loop.time() - start < KILL_VERIFY_S:
            await asyncio.sleep(0.002)
        waited = loop.time() - start
        self.kill_waits.append(waited)
        self.counters["kill_acked_left_unverified"] += sum(len(n.acked) for n in doomed)

    def _carry_over(self, t: Transfer) -> None:
        node = t.node
        if not t.kind and not node.dead and not node.refuse:
            for kind in ("kill", "freeze"):
                if self.carry[kind]:      # one drawn earlier found its node dead: this transfer takes it
                    self.carry[kind] -= 1
                    self.counters[f"{kind}_carried_over"] += 1
                    t.kind = kind
                    break

    def _inject(self, t: Transfer) -> None:
        node = t.node
        if t.kind in ("refuse", "drop_done"):
            self.injected[t.kind] += 1
            t.faulted = True
        elif t.kind in ("kill", "freeze"):
            if node.dead:
                self.skipped[t.kind] += 1     # an earlier kill got its node already: it fails all the same,
                self.carry[t.kind] += 1       # and the fault goes to the next transfer without one
                return
            self.injected[t.kind] += 1
            t.faulted = True
            if t.kind == "kill":
                self._kill(node)
            else:
                self._freeze(node, self.freeze_rng.uniform(*FREEZE_S))

    async def _collector(self) -> None:
        sender = self.rt.sender
        loop = asyncio.get_running_loop()
        next_scan = loop.time() + 0.5
        while self.ended < self.n:
            for o in sender.pop_outcomes():
                t = self.pending_p.pop(o.transfer_id, None)
                if t is None:
                    t = self.hung_p.pop(o.transfer_id, None)
                    if t is None:
                        self.counters["unknown_outcomes"] += 1
                        continue
                    self.counters["late_outcomes"] += 1
                t.outcome = o
                if not t.p_hung:
                    t.node.active -= 1
                self.last_outcome = time.monotonic()
                took = o.finished_s - t.t_begin
                if not t.p_hung:
                    self.lat_all.append(took)
                    (self.lat_ok if o.ok else self.lat_fail).append(took)
                    if t.kind:
                        self.lat_kind[t.kind].append(took)
                if o.ok:
                    t.node.acked.add(t.tid)
                else:
                    self.reasons[_reason_key(o.reason)] += 1
                    if not t.kind:
                        self._collateral(t, o)
                self._check(t)
            for tid in sender.pop_released():
                src = self.src_of.pop(tid, None)
                if src is not None:
                    self.p_src.release(src)
            if loop.time() >= next_scan:
                next_scan = loop.time() + 0.5
                now = time.perf_counter()
                for tid, t in list(self.pending_p.items()):
                    if now - t.t_begin > P_BOUND_S:
                        del self.pending_p[tid]
                        t.p_hung = True
                        t.node.active -= 1
                        self.hung_p[tid] = t
                        self.examples["hung_p"].append(f"{tid} kind={t.kind or 'none'} node=d{t.node.slot}")
                        self._classify(t, "hung")   # counted now; a late outcome still gets D checked
                self._watch_nodes()
            await asyncio.sleep(0.002)

    def _collateral(self, t: Transfer, o) -> None:
        """Why a transfer without a fault of its own failed: its node's condition during its life."""
        node = t.node
        now = asyncio.get_running_loop().time()
        if node.killed or node.dead:
            where = "node killed"
        elif node.last_freeze and node.last_freeze >= now - (o.finished_s - t.t_begin) - 6.0:
            where = "node frozen"
        else:
            where = "healthy node"
            if len(self.examples["collateral_healthy"]) < 20:
                self.examples["collateral_healthy"].append(
                    f"{t.tid} d{node.slot}{' refuse' if node.refuse else ''} took {o.finished_s - t.t_begin:.3f}s: "
                    f"{o.reason[:200]}")
        self.collateral_where[where] += 1

    def _watch_nodes(self) -> None:
        for node in list(self.pool) + [self.refuse_node]:
            if node is not None and not node.dead and node.proc.proc.poll() is not None:
                self.unexpected_deaths.append({"slot": node.slot, "refuse": node.refuse,
                                               "rc": node.proc.proc.returncode,
                                               "stderr": node.proc.stderr_text()[-1500:]})
                self._node_gone(node)

    def _check(self, t: Transfer) -> None:
        if self.stopping:
            return
        task = asyncio.get_running_loop().create_task(self._d_check(t))
        self.checks.add(task)
        task.add_done_callback(self.checks.discard)

    async def _d_check(self, t: Transfer) -> None:
        state, crc_ok = "driver_error", False
        try:
            state, crc_ok = await self._d_state(t)
            t.node.acked.discard(t.tid)
            if state in ("finished", "failed"):
                await self._release(t.node, t.tid)
            elif state in ("dead", "unknown"):
                t.node.held -= 1
        except Exception as exc:  # noqa: BLE001 - a driver bug must not hide a transfer: it counts as hung
            self.examples["driver_errors"].append(f"{t.tid}: {type(exc).__name__}: {exc}")
            if state not in ("finished", "failed"):
                state = "driver_error"
        finally:
            t.node.acked.discard(t.tid)
        if t.p_hung:
            return
        ok = t.outcome.ok
        if state == "finished" and not crc_ok:
            cls = "lost"
        elif ok:
            cls = ("finished" if state == "finished" else "ok_unverified" if state == "dead" else
                   "hung" if state in ("registered", "aborting", "unreachable", "driver_error") else "lost")
        else:
            cls = ("disagree" if state == "finished" else
                   "hung" if state in ("registered", "aborting", "unreachable", "driver_error") else "failed")
            if state == "unknown":
                self.counters["failed_d_unknown"] += 1
        if cls == "ok_unverified":
            # P ok although its D was killed: acknowledged before the kill, or after it by whom?
            node = t.node
            succ = node.successor
            after_kill = t.outcome.finished_s - node.killed_at
            heir = ("successor on the same port" if succ is not None and succ.port == node.port else
                    "successor on another port" if succ is not None else "no successor yet")
            up_before = succ is not None and getattr(succ, "started_at", 1e18) <= t.outcome.finished_s
            key = (f"ok {'after' if after_kill > 0 else 'before'} the kill; {heir}"
                   + (", up before the ack" if up_before else ""))
            self.unverified_why[key] += 1
            if after_kill > 0 and len(self.examples["ok_after_kill"]) < 20:
                self.examples["ok_after_kill"].append(f"{t.tid} ack {after_kill:.3f}s after SIGKILL; {heir}"
                                                      f"{', successor up before the ack' if up_before else ''}")
        if cls in ("lost", "hung", "disagree") and len(self.examples[cls]) < 20:
            self.examples[cls].append(f"{t.tid} kind={t.kind or 'none'} p_ok={ok} d={state} crc_ok={crc_ok} "
                                      f"reason={t.outcome.reason[:160]!r}")
        self._classify(t, cls)

    def _classify(self, t: Transfer, cls: str) -> None:
        self.classes[cls] += 1
        self.by_kind[t.kind or "none"][cls] += 1
        self.ended += 1
        if self.rss_start is None and self.ended >= self.rss_after:
            self.rss_start = _rss_mb()
            self.rss_start_at = self.ended
            self.internals_start = self._internals()
            if os.environ.get("AIOLAYER_SOAK_TRACEMALLOC"):   # diagnostics: where does memory grow after warm-up?
                import tracemalloc
                tracemalloc.start(int(os.environ["AIOLAYER_SOAK_TRACEMALLOC"]))
            for node in self.all_nodes:
                if not node.dead:
                    node.rss_first = _rss_mb(node.pid)

    async def _d_state(self, t: Transfer) -> tuple[str, bool]:
        """D's final word on ``t``: (state, CRCs equal P's), waiting out fences, freezes and deadlines."""
        loop = asyncio.get_running_loop()
        node = t.node
        deadline = loop.time() + D_BOUND_S
        pause = 0.2
        verify = t.outcome.ok
        state = "unreachable"
        while True:
            if node.dead:
                return "dead", False
            client = node.client
            try:
                if client is None:
                    raise RuntimeStateError("no client")
                wait = node.frozen_until - loop.time()
                if wait > 0:               # we froze it: ask once it runs again
                    await asyncio.sleep(wait + 0.05)
                    continue
                if verify:
                    async with self.sem_verify:
                        reply = await client.call(m.VerifyRequest(transfer_id=t.tid), timeout=CALL_S)
                    return reply.state, (reply.crc_k, reply.crc_v) == t.crc
                async with self.sem:
                    reply = await client.call(m.StatusRequest(transfer_id=t.tid), timeout=CALL_S)
                state = reply.state
                if state == "finished":
                    verify = True
                    continue
                if state in ("failed", "unknown"):
                    return state, False
            except ControlRejected as exc:
                if exc.code == "unknown_transfer":
                    return "unknown", False
                state = f"rejected_{exc.code}"
            except (AiolayerError, asyncio.TimeoutError):
                if node.dead:
                    return "dead", False
                state = "unreachable"
            if loop.time() >= deadline:
                return ("unreachable" if state.startswith("rejected") else state), False
            await asyncio.sleep(pause)
            pause = min(1.0, pause * 1.5)

    async def _release(self, node: Node, tid: str) -> bool:
        for _ in range(5):
            client = node.client
            if node.dead or client is None:
                node.held -= 1
                return False
            try:
                async with self.sem:
                    await client.call(m.ReleaseRequest(transfer_id=tid), timeout=CALL_S)
                self.counters["d_released"] += 1
                node.held -= 1
                return True
            except ControlRejected as exc:
                self.counters[f"d_release_rejected_{exc.code}"] += 1
                if exc.code == "unknown_transfer":
                    node.held -= 1
                    return False
            except (AiolayerError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(0.5)
        self.counters["d_release_failed"] += 1
        return False

    async def _orphan_cleaner(self, final: bool = False) -> None:
        """Release allocations whose reply was lost (the node froze): once D failed them, or never had them."""
        loop = asyncio.get_running_loop()
        while True:
            keep = []
            for node, tid, since in self.orphans:
                if node.dead:
                    node.held -= 1
                    continue
                if node.client is None or loop.time() < node.frozen_until:
                    keep.append((node, tid, since))
                    continue
                client = node.client
                try:
                    await client.call(m.ReleaseRequest(transfer_id=tid), timeout=CALL_S)
                    self.counters["orphans_released"] += 1
                    node.held -= 1
                    continue
                except ControlRejected as exc:
                    if exc.code == "unknown_transfer" and loop.time() - since > 2 * CALL_S:
                        self.counters["orphans_never_registered"] += 1
                        node.held -= 1
                        continue
                except (AiolayerError, asyncio.TimeoutError):
                    pass
                if loop.time() - since > D_BOUND_S + T.receive:
                    self.counters["orphans_stuck"] += 1
                    self.examples["orphans_stuck"].append(tid)
                    node.held -= 1
                    continue
                keep.append((node, tid, since))
            self.orphans = keep
            if final and not keep:
                return
            await asyncio.sleep(1.0)

    async def _progress(self) -> None:
        last_t, last_n = time.perf_counter(), 0
        while True:
            await asyncio.sleep(PROGRESS_S)
            now = time.perf_counter()
            rss = _rss_mb()
            self.rss_peak = max(self.rss_peak, rss) if self.rss_start is not None else self.rss_peak
            if len(self.rss_samples) < 400:   # [ended, RSS MB, D restarts so far, P's control clients]
                clients = getattr(self.rt.peers, "_clients", None)
                self.rss_samples.append([self.ended, round(rss, 1), self.restarts,
                                         len(clients) if clients is not None else None])
            c = self.classes
            rate = (self.ended - last_n) / (now - last_t)
            print(f"soak {self.ended}/{self.n} begun={self.begun} finished={c['finished']} failed={c['failed']} "
                  f"disagree={c['disagree']} lost={c['lost']} hung={c['hung']} in-flight={len(self.pending_p)} "
                  f"faults={dict(self.injected)} rate={rate:.0f}/s rss={rss:.1f}MB "
                  f"t={now - self.t0:.0f}s", file=self.err, flush=True)
            last_t, last_n = now, self.ended
            if time.monotonic() - self.last_outcome > STALL_S:
                now_l = asyncio.get_running_loop().time()
                pool = "; ".join(f"d{n.slot}{'(refuse)' if n.refuse else ''} dead={n.dead} "
                                 f"client={n.client is not None} "
                                 f"frozen_for={max(0.0, n.frozen_until - now_l):.1f}s active={n.active} held={n.held}"
                                 for n in [*self.pool, self.refuse_node] if n is not None)
                self.error = (f"stalled: no outcome at P for {STALL_S:g}s ({len(self.pending_p)} in flight, "
                              f"{self.ready.qsize()} allocated and waiting, {self.begun} begun, "
                              f"{self.next_index} drawn; nodes: {pool}; "
                              f"tasks: {sorted(t.get_name() for t in self.tasks if not t.done())})")
                print(f"soak: {self.error}; stopping", file=self.err, flush=True)
                return

    def _internals(self) -> dict:
        """Sizes of the runtime's per-transfer and per-peer tables (growth = a leak)."""
        rt = self.rt
        s, b = rt.sender, rt.backend

        def size(obj, name):
            value = getattr(obj, name, None)
            return len(value) if value is not None else None

        out = {"control_clients": size(rt.peers, "_clients"), "layout_entries": size(rt.layouts, "_entries"),
               "layout_fetch_counters": size(rt.layouts, "fetches"),
               "sender_waiters": size(s, "_waiters"), "sender_live": size(s, "_live"),
               "sender_aborted_early": size(s, "_aborted_early"), "sender_steps": size(s, "_steps"),
               "sender_outcomes_queued": size(s, "_outcomes"), "sender_released_queued": size(s, "_released"),
               "sender_fence_timeouts": getattr(s, "fence_timeouts", None),
               "backend_opened_targets": size(b, "_opened_targets"), "backend_inflight": size(b, "_inflight"),
               "backend_quarantine": size(b, "_quarantine"),
               "receiver_entries": size(rt.receiver, "_entries"), "receiver_early": size(rt.receiver, "_early"),
               "zmq_sockets": open_sockets(), "threads": threading.active_count()}
        with contextlib.suppress(OSError):
            out["fds"] = len(os.listdir("/proc/self/fd"))
        return out

    async def _p_loop_tasks(self) -> dict | None:
        """Tasks alive on P's loop, by the first word of their name (e.g. one ``control-client`` per peer)."""
        async def count() -> dict:
            names = collections.Counter(t.get_name().split(" ")[0] for t in asyncio.all_tasks())
            return dict(names.most_common())
        try:
            return await asyncio.wrap_future(self.rt.loop_thread.submit(count()))
        except Exception:  # noqa: BLE001
            return None

    # --- the run -------------------------------------------------------------------------------

    async def run(self) -> None:
        self.t0 = time.perf_counter()
        self.ready = asyncio.Queue(READY_AHEAD)
        self.sem = asyncio.Semaphore(D_CHECKS)          # status polls and releases
        self.sem_verify = asyncio.Semaphore(D_CHECKS)   # verifications: never behind the polls
        for node in self.all_nodes:
            await self._attach(node)
        progress = self._spawn(self._progress(), name="progress")
        orphans = self._spawn(self._orphan_cleaner(), name="orphans")
        workers = [self._spawn(self._allocator(), name=f"alloc {i}") for i in range(ALLOC_WORKERS)]
        forward = self._spawn(self._forward(), name="forward")
        collector = self._spawn(self._collector(), name="collector")
        watch = {forward, collector, progress, *workers}
        stop = False
        while not stop and not collector.done():
            done, _ = await asyncio.wait(watch, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                watch.discard(task)
                if task.cancelled():
                    continue
                if task.exception() is not None:      # a driver bug (or the runtime refused a step)
                    self.examples["driver_errors"].append(repr(task.exception()))
                    self.error = self.error or repr(task.exception())
                    stop = True
                elif task is progress:                 # it returns only on a stall
                    stop = True
        self.duration = time.perf_counter() - self.t0
        self.stopping = stop
        for task in (forward, collector, progress, *workers):
            task.cancel()
        # whatever never ended is hung
        for t in list(self.pending_p.values()):
            t.p_hung = True
            self._classify(t, "hung")
            self.hung_p[t.tid] = t
        self.pending_p.clear()
        now = asyncio.get_running_loop().time()
        for t in self.hung_p.values():   # best effort: give D its blocks back
            if t.node is not None:
                self.orphans.append((t.node, t.tid, now))
        if self.checks:
            await asyncio.wait(set(self.checks), timeout=D_BOUND_S + 10)
        for task in list(self.checks):
            task.cancel()
            self.classes["hung"] += 1
            self.counters["d_checks_unfinished"] += 1
        orphans.cancel()
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(self._orphan_cleaner(final=True), D_BOUND_S + T.receive + 5)
        # P hands back the last sources once their writes are quiet
        end = time.monotonic() + T.quarantine + 2
        while self.src_of and time.monotonic() < end:
            for tid in self.rt.sender.pop_released():
                src = self.src_of.pop(tid, None)
                if src is not None:
                    self.p_src.release(src)
            await asyncio.sleep(0.05)
        self.rss_end = _rss_mb()
        self.internals_end = self._internals()
        import tracemalloc
        if tracemalloc.is_tracing():
            import gc
            self.counters["gc_collected_at_end"] = gc.collect()   # cyclic garbage is not a leak: leave it out
            self.counters["rss_after_gc_kb"] = int(_rss_mb() * 1024)
            snap = tracemalloc.take_snapshot()
            tracemalloc.stop()
            key = "traceback" if int(os.environ["AIOLAYER_SOAK_TRACEMALLOC"]) > 1 else "lineno"
            self.examples["tracemalloc_top"] = [f"{st.size / 1024:.1f} KiB in {st.count}: "
                                                f"{' <- '.join(str(f) for f in st.traceback[:6])}"
                                                for st in snap.statistics(key)[:20]]
        self.internals_end["p_loop_tasks"] = await self._p_loop_tasks()
        self.node_rss = {}
        for node in self.all_nodes:
            if not node.dead:
                self.node_rss["refuse" if node.refuse else f"d{node.slot}"] = {
                    "start_mb": round(node.rss_first, 1), "end_mb": round(_rss_mb(node.pid), 1)}
        for node in self.all_nodes:
            if node.client is not None:
                await node.client.close()
                node.client = None
        pending = [t for t in self.tasks if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=5)

    # --- set-up / tear-down (blocking, main thread) --------------------------------------------

    def open(self) -> None:
        os.environ.update(NODE_ENV)    # this process's Mooncake gives up on a frozen peer after 5 s too
        starts = [threading.Thread(target=self._start_slot, args=(i,)) for i in range(self.ranks)]
        self.pool = [None] * self.ranks
        self._start_errors: list[BaseException] = []
        for th in starts:
            th.start()
        self.refuse_node = self._start_node(-1, refuse=True)
        for th in starts:
            th.join()
        if self._start_errors:
            raise self._start_errors[0]
        self.rt = Runtime(NodeConfig(engine_id="soak-p"), FAULT_TIMEOUTS).start()
        self.cache = PagedKVCache(self.p_shape)
        self.rt.publish_layout(self.cache.k_base, self.cache.v_base, self.p_shape.block_bytes, P_BLOCKS)

    def _start_slot(self, slot: int) -> None:
        try:
            self.pool[slot] = self._start_node(slot)
        except BaseException as exc:  # noqa: BLE001 - re-raised by open()
            self._start_errors.append(exc)

    def close(self) -> None:
        if self.rt is not None:
            self.rt.stop()
        stoppers = [threading.Thread(target=self._reap, args=(n,)) for n in self.all_nodes]
        for th in stoppers:
            th.start()
        for th in stoppers:
            th.join(20)
        for node in self.all_nodes:   # a stop that timed out: make sure
            if node.proc.proc is not None and node.proc.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    node.proc.proc.kill()
                with contextlib.suppress(Exception):
                    node.proc.proc.wait(5)

    def result(self) -> dict:
        c = self.classes
        growth = (self.rss_end - self.rss_start) / self.rss_start if self.rss_start else None
        faults = {}
        for kind in KINDS:
            faults[kind] = {"injected": self.injected[kind], "skipped_node_already_dead": self.skipped[kind],
                            "outcomes": dict(self.by_kind[kind]),
                            "p_terminal_p50_ms": _pct(self.lat_kind[kind], 50),
                            "p_terminal_max_ms": _pct(self.lat_kind[kind], 100)}
        out = {
            "requests": self.n, "finished": c["finished"], "failed": c["failed"], "disagree": c["disagree"],
            "lost": c["lost"], "hung": c["hung"], "ok_unverified": c["ok_unverified"],
            "accounted": sum(c.values()),
            "p50_ms": _pct(self.lat_all, 50), "p99_ms": _pct(self.lat_all, 99),
            "finished_p50_ms": _pct(self.lat_ok, 50), "finished_p99_ms": _pct(self.lat_ok, 99),
            "failed_p50_ms": _pct(self.lat_fail, 50), "failed_p99_ms": _pct(self.lat_fail, 99),
            "latency_is": "P's step begin -> P's terminal outcome (DONE acknowledged, or failure decided); "
                          "p50/p99 over every transfer, finished_/failed_ split by P's outcome",
            "rss_start_mb": round(self.rss_start or 0.0, 1), "rss_end_mb": round(self.rss_end, 1),
            "rss_peak_mb": round(max(self.rss_peak, self.rss_end), 1),
            "rss_at_last_begin_mb": round(self.rss_last_begin, 1) if self.rss_last_begin else None,
            "rss_start_after": self.rss_start_at, "rss_growth": round(growth, 4) if growth is not None else None,
            "rss_limit": RSS_LIMIT, "rss_ok": growth is not None and growth < RSS_LIMIT,
            "kill_verify_wait_ms": {"p50": _pct(self.kill_waits, 50), "max": _pct(self.kill_waits, 100)},
            "rss_samples": self.rss_samples,
            "rss_samples_are": "[transfers ended, RSS MB of P, D restarts so far, P's ControlPeers clients]",
            "rss_nodes_mb": self.node_rss,
            "duration_s": round(self.duration, 1), "transfers_per_s": round(self.n / self.duration, 1),
            "fault_rate": self.rate, "faults": faults, "collateral": dict(self.by_kind["none"]),
            "collateral_failures_by_node": dict(self.collateral_where),
            "ok_unverified_why": dict(self.unverified_why),
            "failure_reasons": dict(self.reasons.most_common(25)),
            "counters": {**dict(self.counters), "p_src_waits": self.src_waits,
                         "p_src_blocks_held_at_end": P_BLOCKS - self.p_src.free},
            "p_internals_start": self.internals_start, "p_internals_end": self.internals_end,
            "p_log_counts": dict(self.log_counts.most_common(30)) if hasattr(self, "log_counts") else {},
            "unexpected_node_deaths": self.unexpected_deaths,
            "examples": {k: v[:20] for k, v in self.examples.items()},
            "node_pids": self.node_pids,
            "config": {"decode_ranks": self.ranks, "refuse_nodes": 1, "shape": {f: getattr(self.shape, f) for f in
                       ("num_layers", "block_size", "kv_heads", "head_dim", "dtype")},
                       "block_bytes": self.shape.block_bytes, "blocks_per_transfer": BLOCKS,
                       "d_blocks_per_node": D_BLOCKS, "p_blocks": P_BLOCKS, "window": WINDOW, "per_step": STEP,
                       "layer_ms": LAYER_S * 1000, "fault_at_layer": FAULT_AT_LAYER, "freeze_s": list(FREEZE_S),
                       "seed": self.args.seed, "mc_transfer_timeout_s": MC_TRANSFER_TIMEOUT_S},
            "timeouts": {f: getattr(T, f) for f in T.__struct_fields__},
            "p_bound_s": P_BOUND_S, "d_bound_s": D_BOUND_S,
        }
        out["error"] = self.error
        out["ok"] = (out["lost"] == 0 and out["hung"] == 0 and out["rss_ok"] and out["accounted"] == self.n
                     and not self.error)
        return out


def _reason_key(reason: str) -> str:
    """A failure reason without its ids, addresses and numbers, to count kinds of failure."""
    import re
    text = re.sub(r"tcp://[\d.:]+|\d+\.\d+\.\d+\.\d+:\d+|soak-\d+-[0-9a-f]+|0x[0-9a-f]+|\d+(\.\d+)?", "#", reason)
    return text[:110]


@contextlib.contextmanager
def _native_stderr_captured():
    """Send fd 2 (Mooncake's C++ log: a line per refused or failed write) to a file; yield the real stderr."""
    sys.stderr.flush()
    saved = os.dup(2)
    real = os.fdopen(os.dup(saved), "w", buffering=1)
    log_file = tempfile.TemporaryFile()
    os.dup2(log_file.fileno(), 2)
    try:
        yield real, log_file
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        real.flush()


def _native_summary(log_file) -> dict:
    """Line count and the most frequent kinds of line (timestamps, ids and numbers taken out)."""
    import re
    log_file.seek(0)
    kinds: collections.Counter[str] = collections.Counter()
    tail: collections.deque[str] = collections.deque(maxlen=20)
    lines = 0
    for raw in log_file:
        line = raw.decode(errors="replace").rstrip()
        lines += 1
        tail.append(line)
        body = re.sub(r"^[EWIF]\d{4} [\d:.]+\s+\d+ ", lambda m0: m0.group(0)[0] + " ", line)
        kinds[re.sub(r"\d+", "#", body)[:140]] += 1
    return {"lines": lines, "top": dict(kinds.most_common(12)), "tail": list(tail)}


def run_soak(args) -> int:
    if args.requests < 1:
        print("soak: --requests must be >= 1", file=sys.stderr)
        return 2
    with _native_stderr_captured() as (err, native):
        try:
            return _run_soak(args, err, native)
        finally:
            native.close()


def _run_soak(args, err, native) -> int:
    shape = _soak_shape(args)
    soak = Soak(args, shape)
    soak.err = err
    logger = logging.getLogger("aiolayer")
    counting = _CountingHandler()
    quiet = logging.StreamHandler(err)
    quiet.setLevel(logging.ERROR)
    saved = (logger.level, logger.propagate)
    logger.setLevel(logging.WARNING)
    logger.addHandler(counting)
    logger.addHandler(quiet)
    logger.propagate = False   # expected warnings (every injected fault makes some) are counted, not printed
    print(f"soak: {args.requests} transfers, fault rate {args.fault_rate:g}, {soak.ranks} decode nodes "
          f"+ 1 refusing; {shape.num_layers} layers x {BLOCKS} blocks of {shape.block_bytes} B "
          f"(this process's native log goes to a temporary file, summarised in soak.json)", file=err, flush=True)
    try:
        soak.open()
        import uvloop
        try:
            uvloop.run(soak.run())
        except Exception as exc:  # noqa: BLE001 - still write what was measured
            soak.error = f"{type(exc).__name__}: {exc}"
            print(f"soak: driver error: {soak.error}", file=err)
    finally:
        soak.close()
        logger.removeHandler(counting)
        logger.removeHandler(quiet)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]
    soak.log_counts = counting.counts
    result = soak.result()
    result["native_log"] = _native_summary(native)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(result, indent=2) + "\n")
    f = result["faults"]
    print(f"\nsoak: {result['requests']} transfers in {result['duration_s']} s ({result['transfers_per_s']}/s)\n"
          f"  finished {result['finished']}  failed {result['failed']}  disagree {result['disagree']}  "
          f"ok_unverified {result['ok_unverified']}  lost {result['lost']}  hung {result['hung']}\n"
          f"  faults injected: " + ", ".join(f"{k} {v['injected']}" for k, v in f.items()) + "\n"
          f"  latency p50 {result['p50_ms']} ms, p99 {result['p99_ms']} ms "
          f"(finished p50 {result['finished_p50_ms']}, p99 {result['finished_p99_ms']})\n"
          f"  RSS {result['rss_start_mb']} MB (after {result['rss_start_after']}) -> {result['rss_end_mb']} MB: "
          f"{(result['rss_growth'] or 0) * 100:+.2f}% (limit {RSS_LIMIT * 100:g}%)\n"
          f"  {'PASS' if result['ok'] else 'FAIL'}; wrote {out / 'soak.json'}", file=err)
    if not result["ok"]:
        print("last lines of the native log:\n  " + "\n  ".join(result["native_log"]["tail"]), file=err)
    return 0 if result["ok"] else 1
