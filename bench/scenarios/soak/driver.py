"""``aiolayer bench soak``: many transfers with faults; nothing lost, nothing hung, memory flat.

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

Defaults chosen here (the shape flags of ``aiolayer bench soak`` default to them): 4 layers, 16
tokens x 2 KV heads x 64 dims, float16, so 4 KiB blocks; 4 blocks (64 tokens) per transfer, i.e.
4 layers x (K, V) = 8 writes of 16 KiB; 64 transfers in flight at most, 8 per step; D nodes of 1024
blocks, P's cache of 1024 blocks.
Deadlines: ``scenarios.faults.FAULT_TIMEOUTS`` on P and the nodes, ``MC_TRANSFER_TIMEOUT=5``.

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
runtime's per-transfer and per-peer tables (``Runtime.debug_tables``) at ``rss_start`` and at the end
(growth = a leak).
Mooncake's own log lines (one per refused or failed write) go to a temporary file while it runs,
summarised under ``native_log``.

Diagnostics (environment): ``AIOLAYER_SOAK_KINDS=kill,freeze`` injects only those kinds;
``AIOLAYER_SOAK_RESTART_PORT=same|new`` restarts killed nodes on the same or a fresh port (default:
alternate); ``AIOLAYER_SOAK_TRACEMALLOC=N`` traces Python allocations after the warm-up (N frames)
and lists the biggest survivors under ``examples.tracemalloc_top``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import sys
import time
from pathlib import Path

import numpy as np

from aiolayer import Runtime
from aiolayer.config import KVShape, NodeConfig
from aiolayer.kvcache import PagedKVCache

from ..faults import FAULT_TIMEOUTS, NODE_ENV
from .checks import SoakChecks
from .common import (ALLOC_WORKERS, BLOCKS, D_BLOCKS, D_BOUND_S, D_CHECKS, KINDS, P_BLOCKS, READY_AHEAD, T,
                          soak_shape, with_blocks)
from .nodes import SoakNodes
from .pipeline import SoakPipeline
from .report import (SoakReport, native_stderr_captured, native_summary, print_summary, warnings_counted,
                          write_result)


class Soak(SoakNodes, SoakPipeline, SoakChecks, SoakReport):
    """One soak run: set-up, ``run()`` on the driver's loop, tear-down; the parts are in the mixins' modules."""

    def __init__(self, args, shape: KVShape) -> None:
        self.args = args
        self.n = args.requests
        self.rate = args.fault_rate
        self.ranks = max(1, args.decode_ranks)
        self.shape = shape
        self.d_shape = with_blocks(shape, D_BLOCKS)
        self.p_shape = with_blocks(shape, P_BLOCKS)
        # diagnostics: AIOLAYER_SOAK_KINDS=kill,freeze injects only those kinds
        self.kinds = tuple(k for k in os.environ.get("AIOLAYER_SOAK_KINDS", ",".join(KINDS)).split(",") if k in KINDS)
        self.rng = random.Random(args.seed)            # which transfers get a fault: one draw per transfer, in order
        self.pick_rng = random.Random(args.seed + 1)   # node choice among the least loaded
        self.freeze_rng = random.Random(args.seed + 2)
        base_rng = np.random.default_rng(args.seed)
        self.base = base_rng.integers(0, 1 << 63, size=shape.num_layers * 2 * BLOCKS * shape.block_bytes // 8,
                                      dtype=np.uint64)
        self.rt: Runtime | None = None
        self.cache: PagedKVCache | None = None
        self.tasks: set[asyncio.Task] = set()
        self.t0 = 0.0
        self.duration = 0.0
        self.error = ""
        self.stopping = False
        self.err = sys.stderr
        self._init_nodes()
        self._init_pipeline()
        self._init_checks()
        self._init_report()

    # --- set-up / tear-down (blocking, main thread) --------------------------------------------

    def open(self) -> None:
        os.environ.update(NODE_ENV)    # this process's Mooncake gives up on a frozen peer after 5 s too
        self._start_pool()
        self.rt = Runtime(NodeConfig(engine_id="soak-p"), FAULT_TIMEOUTS).start()
        self.cache = PagedKVCache(self.p_shape)
        self.rt.register_kv_memory(self.cache.k_base, self.cache.v_base, self.p_shape.block_bytes, P_BLOCKS)

    def close(self) -> None:
        if self.rt is not None:
            self.rt.stop()
        self._stop_pool()

    # --- the run -------------------------------------------------------------------------------

    def _spawn(self, coro, name: str = "") -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

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
        self.stopping = await self._until_done(collector, progress, {forward, collector, progress, *workers})
        self.duration = time.perf_counter() - self.t0
        for task in (forward, collector, progress, *workers):
            task.cancel()
        self._count_unended_as_hung()
        await self._finish_checks(orphans)
        await self._take_back_sources()
        await self._measure_end()
        await self._close_clients_and_tasks()

    async def _until_done(self, collector: asyncio.Task, progress: asyncio.Task, watch: set) -> bool:
        """Until every transfer ended (False), or a driver task failed or progress saw a stall (True)."""
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
        return stop

    def _count_unended_as_hung(self) -> None:
        """Whatever never ended at P is hung; D gets its blocks back as an orphan's (best effort)."""
        for t in list(self.pending_p.values()):
            t.p_hung = True
            self._classify(t, "hung")
            self.hung_p[t.tid] = t
        self.pending_p.clear()
        now = asyncio.get_running_loop().time()
        for t in self.hung_p.values():
            if t.node is not None:
                self.orphans.append((t.node, t.tid, now))

    async def _finish_checks(self, orphans: asyncio.Task) -> None:
        """Let the D checks end (a check past its bound counts as hung), then release the last orphans."""
        if self.checks:
            await asyncio.wait(set(self.checks), timeout=D_BOUND_S + 10)
        for task in list(self.checks):
            task.cancel()
            self.classes["hung"] += 1
            self.counters["d_checks_unfinished"] += 1
        orphans.cancel()
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(self._orphan_cleaner(final=True), D_BOUND_S + T.receive + 5)

    async def _take_back_sources(self) -> None:
        """P hands back the last sources once their writes are quiet (at most its quarantine, and 2 s)."""
        end = time.monotonic() + T.quarantine + 2
        while self.src_of and time.monotonic() < end:
            self._free_released()
            await asyncio.sleep(0.05)

    async def _close_clients_and_tasks(self) -> None:
        for node in self.all_nodes:
            if node.client is not None:
                await node.client.close()
                node.client = None
        pending = [t for t in self.tasks if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=5)


def run_soak(args) -> int:
    if args.requests < 1:
        print("soak: --requests must be >= 1", file=sys.stderr)
        return 2
    with native_stderr_captured() as (err, native):
        try:
            return _run_soak(args, err, native)
        finally:
            native.close()


def _run_soak(args, err, native) -> int:
    shape = soak_shape(args)
    soak = Soak(args, shape)
    soak.err = err
    with warnings_counted(err) as log_counts:
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
    soak.log_counts = log_counts
    result = soak.result()
    result["native_log"] = native_summary(native)
    path = write_result(result, Path(args.out))
    print_summary(result, path, err)
    return 0 if result["ok"] else 1
