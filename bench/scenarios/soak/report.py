"""The soak's measurements and report: counts, RSS and P's internals, progress lines, soak.json, the summary."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import logging
import os
import re
import sys
import tempfile
import threading
import time
import tracemalloc
from array import array
from pathlib import Path

import numpy as np

from aiolayer.runtime.control.plane import open_sockets

from ...provenance import write_result as write_json
from ..faults import MC_TRANSFER_TIMEOUT_S
from .common import (BLOCKS, D_BLOCKS, D_BOUND_S, FAULT_AT_LAYER, FREEZE_S, KINDS, LAYER_S, P_BLOCKS, P_BOUND_S,
                          PROGRESS_S, RSS_LIMIT, STALL_S, STEP, WINDOW, T, rss_mb)


def pct(values, q: float) -> float | None:
    return round(float(np.percentile(np.frombuffer(values, dtype=np.float64), q)) * 1000, 2) if len(values) else None


def reason_key(reason: str) -> str:
    """A failure reason without its ids, addresses and numbers, to count kinds of failure."""
    text = re.sub(r"tcp://[\d.:]+|\d+\.\d+\.\d+\.\d+:\d+|soak-\d+-[0-9a-f]+|0x[0-9a-f]+|\d+(\.\d+)?", "#", reason)
    return text[:110]


class CountingHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.counts: collections.Counter[str] = collections.Counter()

    def emit(self, record: logging.LogRecord) -> None:
        self.counts[f"{record.levelname} {record.name}: {str(record.msg)[:70]}"] += 1


@contextlib.contextmanager
def warnings_counted(err):
    """Count ``aiolayer``'s warnings (every injected fault makes some), print only its errors to ``err``.

    Yields the counts (``p_log_counts``).
    """
    logger = logging.getLogger("aiolayer")
    counting = CountingHandler()
    quiet = logging.StreamHandler(err)
    quiet.setLevel(logging.ERROR)
    saved = (logger.level, logger.propagate)
    logger.setLevel(logging.WARNING)
    logger.addHandler(counting)
    logger.addHandler(quiet)
    logger.propagate = False   # expected warnings are counted, not printed
    try:
        yield counting.counts
    finally:
        logger.removeHandler(counting)
        logger.removeHandler(quiet)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


@contextlib.contextmanager
def native_stderr_captured():
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


def native_summary(log_file) -> dict:
    """Line count and the most frequent kinds of line (timestamps, ids and numbers taken out)."""
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


def write_result(result: dict, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "soak.json"
    write_json(path, result)
    return path


def print_summary(result: dict, path: Path, err) -> None:
    f = result["faults"]
    print(f"\nsoak: {result['requests']} transfers in {result['duration_s']} s ({result['transfers_per_s']}/s)\n"
          f"  finished {result['finished']}  failed {result['failed']}  disagree {result['disagree']}  "
          f"ok_unverified {result['ok_unverified']}  lost {result['lost']}  hung {result['hung']}\n"
          f"  faults injected: " + ", ".join(f"{k} {v['injected']}" for k, v in f.items()) + "\n"
          f"  latency p50 {result['p50_ms']} ms, p99 {result['p99_ms']} ms "
          f"(finished p50 {result['finished_p50_ms']}, p99 {result['finished_p99_ms']})\n"
          f"  RSS {result['rss_start_mb']} MB (after {result['rss_start_after']}) -> {result['rss_end_mb']} MB: "
          f"{(result['rss_growth'] or 0) * 100:+.2f}% (limit {RSS_LIMIT * 100:g}%)\n"
          f"  {'PASS' if result['ok'] else 'FAIL'}; wrote {path}", file=err)
    if not result["ok"]:
        print("last lines of the native log:\n  " + "\n  ".join(result["native_log"]["tail"]), file=err)


class SoakReport:
    """``Soak``'s counts and measurements (a mixin), the progress lines and ``result()``, soak.json's content."""

    def _init_report(self) -> None:
        self.classes: collections.Counter[str] = collections.Counter()
        self.by_kind: dict[str, collections.Counter[str]] = {k: collections.Counter() for k in ("none", *KINDS)}
        self.injected: collections.Counter[str] = collections.Counter()
        self.skipped: collections.Counter[str] = collections.Counter()
        self.collateral_where: collections.Counter[str] = collections.Counter()
        self.unverified_why: collections.Counter[str] = collections.Counter()
        self.kill_waits = array("d")
        self.reasons: collections.Counter[str] = collections.Counter()
        self.counters: collections.Counter[str] = collections.Counter()
        self.lat_all, self.lat_ok, self.lat_fail = array("d"), array("d"), array("d")
        self.lat_kind: dict[str, array] = {k: array("d") for k in KINDS}
        self.examples: dict[str, list[str]] = collections.defaultdict(list)
        self.unexpected_deaths: list[dict] = []
        self.log_counts: collections.Counter[str] = collections.Counter()   # aiolayer's warnings
        # memory: RSS once the warm-up's transfers ended, and at the end
        self.rss_after = max(1, self.n // 10)
        self.rss_start = self.rss_start_at = None
        self.rss_samples: list[list] = []
        self.rss_peak = 0.0
        self.rss_last_begin = None
        self.rss_end = 0.0
        self.internals_start: dict = {}
        self.internals_end: dict = {}
        self.node_rss: dict = {}

    async def _progress(self) -> None:
        last_t, last_n = time.perf_counter(), 0
        while True:
            await asyncio.sleep(PROGRESS_S)
            now = time.perf_counter()
            rss = rss_mb()
            self.rss_peak = max(self.rss_peak, rss) if self.rss_start is not None else self.rss_peak
            if len(self.rss_samples) < 400:   # [ended, RSS MB, D restarts so far, P's control clients]
                self.rss_samples.append([self.ended, round(rss, 1), self.restarts,
                                         self.rt.debug_tables().get("control_clients")])
            c = self.classes
            rate = (self.ended - last_n) / (now - last_t)
            print(f"soak {self.ended}/{self.n} begun={self.begun} finished={c['finished']} failed={c['failed']} "
                  f"disagree={c['disagree']} lost={c['lost']} hung={c['hung']} in-flight={len(self.pending_p)} "
                  f"faults={dict(self.injected)} rate={rate:.0f}/s rss={rss:.1f}MB "
                  f"t={now - self.t0:.0f}s", file=self.err, flush=True)
            last_t, last_n = now, self.ended
            if time.monotonic() - self.last_outcome > STALL_S:
                self.error = self._stall_error()
                print(f"soak: {self.error}; stopping", file=self.err, flush=True)
                return

    def _stall_error(self) -> str:
        """What a stall looks like: the pipeline's queues, each node's condition, the tasks still alive."""
        now_l = asyncio.get_running_loop().time()
        pool = "; ".join(f"d{n.slot}{'(refuse)' if n.refuse else ''} dead={n.dead} "
                         f"client={n.client is not None} "
                         f"frozen_for={max(0.0, n.frozen_until - now_l):.1f}s active={n.active} held={n.held}"
                         for n in [*self.pool, self.refuse_node] if n is not None)
        return (f"stalled: no outcome at P for {STALL_S:g}s ({len(self.pending_p)} in flight, "
                f"{self.ready.qsize()} allocated and waiting, {self.begun} begun, "
                f"{self.next_index} drawn; nodes: {pool}; "
                f"tasks: {sorted(t.get_name() for t in self.tasks if not t.done())})")

    def _internals(self) -> dict:
        """Sizes of the runtime's per-transfer and per-peer tables (growth = a leak), and the process's."""
        out: dict = {**self.rt.debug_tables(), "zmq_sockets": open_sockets(), "threads": threading.active_count()}
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

    def _measure_start(self) -> None:
        """RSS (P's and the nodes') and P's internals once the warm-up's transfers ended."""
        self.rss_start = rss_mb()
        self.rss_start_at = self.ended
        self.internals_start = self._internals()
        if os.environ.get("AIOLAYER_SOAK_TRACEMALLOC"):   # diagnostics: where does memory grow after warm-up?
            tracemalloc.start(int(os.environ["AIOLAYER_SOAK_TRACEMALLOC"]))
        for node in self.all_nodes:
            if not node.dead:
                node.rss_first = rss_mb(node.pid)

    async def _measure_end(self) -> None:
        """RSS (P's and the live nodes') and P's internals once every transfer was checked and released."""
        self.rss_end = rss_mb()
        self.internals_end = self._internals()
        if tracemalloc.is_tracing():
            self._tracemalloc_top()
        self.internals_end["p_loop_tasks"] = await self._p_loop_tasks()
        self.node_rss = {}
        for node in self.all_nodes:
            if not node.dead:
                self.node_rss["refuse" if node.refuse else f"d{node.slot}"] = {
                    "start_mb": round(node.rss_first, 1), "end_mb": round(rss_mb(node.pid), 1)}

    def _tracemalloc_top(self) -> None:
        """The biggest Python allocations alive since the warm-up (``AIOLAYER_SOAK_TRACEMALLOC``)."""
        self.counters["gc_collected_at_end"] = gc.collect()   # cyclic garbage is not a leak: leave it out
        self.counters["rss_after_gc_kb"] = int(rss_mb() * 1024)
        snap = tracemalloc.take_snapshot()
        tracemalloc.stop()
        key = "traceback" if int(os.environ["AIOLAYER_SOAK_TRACEMALLOC"]) > 1 else "lineno"
        self.examples["tracemalloc_top"] = [f"{st.size / 1024:.1f} KiB in {st.count}: "
                                            f"{' <- '.join(str(f) for f in st.traceback[:6])}"
                                            for st in snap.statistics(key)[:20]]

    def result(self) -> dict:
        c = self.classes
        growth = (self.rss_end - self.rss_start) / self.rss_start if self.rss_start else None
        out = {
            "requests": self.n, "finished": c["finished"], "failed": c["failed"], "disagree": c["disagree"],
            "lost": c["lost"], "hung": c["hung"], "ok_unverified": c["ok_unverified"],
            "accounted": sum(c.values()),
            "p50_ms": pct(self.lat_all, 50), "p99_ms": pct(self.lat_all, 99),
            "finished_p50_ms": pct(self.lat_ok, 50), "finished_p99_ms": pct(self.lat_ok, 99),
            "failed_p50_ms": pct(self.lat_fail, 50), "failed_p99_ms": pct(self.lat_fail, 99),
            "latency_is": "P's step begin -> P's terminal outcome (DONE acknowledged, or failure decided); "
                          "p50/p99 over every transfer, finished_/failed_ split by P's outcome",
            "rss_start_mb": round(self.rss_start or 0.0, 1), "rss_end_mb": round(self.rss_end, 1),
            "rss_peak_mb": round(max(self.rss_peak, self.rss_end), 1),
            "rss_at_last_begin_mb": round(self.rss_last_begin, 1) if self.rss_last_begin else None,
            "rss_start_after": self.rss_start_at, "rss_growth": round(growth, 4) if growth is not None else None,
            "rss_limit": RSS_LIMIT, "rss_ok": growth is not None and growth < RSS_LIMIT,
            "kill_verify_wait_ms": {"p50": pct(self.kill_waits, 50), "max": pct(self.kill_waits, 100)},
            "rss_samples": self.rss_samples,
            "rss_samples_are": "[transfers ended, RSS MB of P, D restarts so far, P's ControlPeers clients]",
            "rss_nodes_mb": self.node_rss,
            "duration_s": round(self.duration, 1), "transfers_per_s": round(self.n / self.duration, 1),
            "fault_rate": self.rate, "faults": self._faults_result(), "collateral": dict(self.by_kind["none"]),
            "collateral_failures_by_node": dict(self.collateral_where),
            "ok_unverified_why": dict(self.unverified_why),
            "failure_reasons": dict(self.reasons.most_common(25)),
            "counters": {**dict(self.counters), "p_src_waits": self.src_waits,
                         "p_src_blocks_held_at_end": P_BLOCKS - self.p_src.free},
            "p_internals_start": self.internals_start, "p_internals_end": self.internals_end,
            "p_log_counts": dict(self.log_counts.most_common(30)),
            "unexpected_node_deaths": self.unexpected_deaths,
            "examples": {k: v[:20] for k, v in self.examples.items()},
            "node_pids": self.node_pids,
            "config": self._config_result(),
            "timeouts": {f: getattr(T, f) for f in T.__struct_fields__},
            "p_bound_s": P_BOUND_S, "d_bound_s": D_BOUND_S,
        }
        out["error"] = self.error
        out["ok"] = (out["lost"] == 0 and out["hung"] == 0 and out["rss_ok"] and out["accounted"] == self.n
                     and not self.error)
        return out

    def _faults_result(self) -> dict:
        return {kind: {"injected": self.injected[kind], "skipped_node_already_dead": self.skipped[kind],
                       "outcomes": dict(self.by_kind[kind]),
                       "p_terminal_p50_ms": pct(self.lat_kind[kind], 50),
                       "p_terminal_max_ms": pct(self.lat_kind[kind], 100)} for kind in KINDS}

    def _config_result(self) -> dict:
        return {"decode_ranks": self.ranks, "refuse_nodes": 1,
                "shape": {f: getattr(self.shape, f) for f in ("num_layers", "block_size", "kv_heads", "head_dim",
                                                              "dtype")},
                "block_bytes": self.shape.block_bytes, "blocks_per_transfer": BLOCKS,
                "d_blocks_per_node": D_BLOCKS, "p_blocks": P_BLOCKS, "window": WINDOW, "per_step": STEP,
                "layer_ms": LAYER_S * 1000, "fault_at_layer": FAULT_AT_LAYER, "freeze_s": list(FREEZE_S),
                "seed": self.args.seed, "mc_transfer_timeout_s": MC_TRANSFER_TIMEOUT_S}
