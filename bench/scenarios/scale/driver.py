"""``aiolayer bench scale``: many concurrent transfers between P and D tensor-parallel ranks.

M decode ranks are ``aiolayer node`` processes, each holding ``local_heads(kv_heads, M)`` heads of
every block. N prefill ranks are child processes (bench/scenarios/scale/rank.py), each with its own Runtime
(Mooncake over TCP) and a paged KV cache of its local heads, filled from one global seeded KV
(``model.kv_layer``: any process can compute any rank's expected bytes).

This process plays the proxy: it mints a token per (request, D rank), allocates every request on
every D rank first, then hands each P rank its plan (``protocol.plan.map_ranks``: which heads go to
which D rank and where). Each P rank begins ONE step with all its transfers, marks every layer
ready at once and waits for every outcome. Where several P ranks write disjoint head slices of one
D transfer (P_tp > D_tp), D registers it with ``senders=k`` and ends it once all k said DONE; its
fence asks each of the k ranks that fetched the layout (docs/fencing.md). Every transfer is verified at
its D rank (per-layer CRC32 of K and V against the global KV). Then every P rank pushes the same
spans again with Mooncake alone (``raw.py``: the baseline, timed the same way, reported as
``raw_gbps`` and ``raw_ratio``), and the transfers are released.

Shape: ``--num-layers/--kv-heads/--head-dim/--block-size/--dtype`` are honoured as given; each
request gets ``blocks_per_request`` blocks chosen so that the global KV stays near ``BUDGET_BYTES``
(at least one block): with the transfer defaults (32 layers, 8 x 128 heads, fp16) and 1000
requests that is one 16-token block per request, 2 GiB in all. ``--kv-layout NHD`` writes one span
per token of a head slice (HND: one per block), so it submits block_size times more writes.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import selectors
import subprocess
import sys
import tempfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import numpy as np

from aiolayer import Runtime
from aiolayer.backends.mooncake_poll import MAX_RUNS_PER_TARGET
from aiolayer.config import DTYPE_BYTES, NodeConfig, Timeouts
from aiolayer.errors import AiolayerError
from aiolayer.protocol import messages as m
from aiolayer.protocol.plan import local_heads, map_ranks, routes_from
from aiolayer.harness.child import ChildProcess
from aiolayer.harness.node import MOONCAKE_ENV, NodeProcess

from ...provenance import write_result
from .model import PlanItem, ScaleConfig, kv_layer, rank_heads
from .raw import METHODS, RawLayout
from .report import build_report, print_scale, writes_per_peer

BUDGET_BYTES = 1 << 30          # global KV of one run (both planes, all layers), at least one block a request
MAX_BLOCKS_PER_REQUEST = 4
CALL_S = 10.0                   # one control call of the proxy (alloc, verify, release)
START_S = 120.0                 # a rank process fills its cache first: slow on a busy 2-core host


# --- the driver (this process): ranks as child processes -----------------------------------------

class RankProcess(ChildProcess):
    """A P rank child: JSON lines prefixed "SCALE " on stdout, its plan path on stdin."""

    def __init__(self, rank: int, cfg_path: Path) -> None:
        super().__init__([sys.executable, "-m", "aiolayer.bench.scenarios.scale.rank", str(rank), str(cfg_path)],
                         env={**os.environ, **MOONCAKE_ENV}, name=f"P rank {rank}", stdin=subprocess.PIPE,
                         new_session=False)
        self.rank = rank
        self.messages: list[dict] = []
        self.start()

    def feed(self) -> bool:
        """Read what is there; False at EOF."""
        chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
        self._buf += chunk
        *lines, self._buf = self._buf.split(b"\n")
        self.messages += [json.loads(x[6:]) for x in lines if x.startswith(b"SCALE ")]
        return bool(chunk)

    def send(self, line: str) -> None:
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def stderr_tail(self, limit: int = 2000) -> str:
        return self.stderr_text(limit)

    def end(self, timeout: float = 15.0) -> None:
        """EOF on stdin (a rank still waiting for its plan exits), a bounded wait, then SIGKILL."""
        self.end_input(timeout)
        self.close()


def collect(ranks: list[RankProcess], kind: str, limit: float, note=None) -> dict[int, dict]:
    """The first ``kind`` message of every rank within ``limit`` seconds; progress goes to ``note``."""
    got: dict[int, dict] = {}
    ended: set[int] = set()
    deadline = time.monotonic() + limit
    with selectors.DefaultSelector() as sel:
        for r in ranks:
            sel.register(r.proc.stdout, selectors.EVENT_READ, r)
        while len(got) < len(ranks) and time.monotonic() < deadline:
            for key, _ in sel.select(0.5):
                if not key.data.feed():
                    sel.unregister(key.fileobj)
                    ended.add(key.data.rank)
            for r in ranks:
                for msg in r.messages:
                    if msg["kind"] == kind:
                        got.setdefault(r.rank, msg)
                    elif msg["kind"] == "progress" and note is not None:
                        note(r.rank, msg)
                r.messages.clear()
            if ended - set(got):
                break   # a rank exited without it
    missing = [r for r in ranks if r.rank not in got]
    if missing:
        r = missing[0]
        raise RuntimeError(f"P rank {r.rank} sent no {kind!r} within {limit:g}s (exit {r.proc.poll()}); "
                           f"stderr:\n{r.stderr_tail()}")
    return got


def call_all(rt: Runtime, calls: list[tuple[str, m.Message]], what: str, width: int = 32) -> list:
    """Control calls from the proxy, ``width`` at a time on its loop; an error is returned, not raised."""
    done = [0]

    async def run() -> list:
        for endpoint in dict.fromkeys(ep for ep, _ in calls):
            await rt.peers.get(endpoint)   # one client per peer before the calls race to create it
        gate = asyncio.Semaphore(width)

        async def one(endpoint: str, msg: m.Message):
            async with gate:
                try:
                    return await (await rt.peers.get(endpoint)).call(msg, timeout=CALL_S)
                except AiolayerError as exc:
                    return exc
                finally:
                    done[0] += 1
                    _progress(f"{what} {done[0]}/{len(calls)}")
        return await asyncio.gather(*(one(ep, msg) for ep, msg in calls))

    out = rt.loop_thread.call(run(), timeout=CALL_S * (len(calls) // width + 2) + 30)
    _progress(f"{what} {len(calls)}/{len(calls)}", final=True)
    return out


_last_progress = [0.0]


def _progress(text: str, final: bool = False) -> None:
    now = time.monotonic()
    if final or now - _last_progress[0] > 1.0:
        _last_progress[0] = now
        end = "\n" if final or not sys.stderr.isatty() else ""
        sys.stderr.write(("\r\033[K" if sys.stderr.isatty() else "") + f"scale: {text}" + end)
        sys.stderr.flush()


def plan(cfg: ScaleConfig, d_controls: list[str], p_controls: list[str]):
    """Routes, senders per D rank, and every (transfer id, D rank, AllocRequest) to make."""
    routes = map_ranks(cfg.kv_heads, cfg.p_tp, cfg.d_tp)
    pairs = [(r.p_rank, r.d_rank) for r in routes]
    if len(set(pairs)) != len(pairs):
        raise ValueError("a P rank with two routes into one D rank is not supported (one spec per transfer id)")
    for r in routes:   # the data model agrees with the mapping: same global heads on both ends
        assert (rank_heads(cfg.kv_heads, cfg.p_tp, r.p_rank)[r.src_head:r.src_head + r.num_heads]
                == rank_heads(cfg.kv_heads, cfg.d_tp, r.d_rank)[r.dst_head:r.dst_head + r.num_heads]), r
    writers = {d: [r.p_rank for r in routes if r.d_rank == d] for d in range(cfg.d_tp)}
    allocs = []
    for req in range(cfg.requests):
        for d in range(cfg.d_tp):
            tid = f"s{req}-d{d}"
            allocs.append((req, d, m.AllocRequest(transfer_id=tid, num_blocks=cfg.blocks_per_request,
                                                  contiguous=cfg.contiguous, token=secrets.token_hex(16),
                                                  senders=len(writers[d]))))
    return routes, writers, allocs


def rank_items(cfg, routes, allocs, replies, d_controls) -> dict[int, list[PlanItem]]:
    by_key = {(req, d): (msg, rep) for (req, d, msg), rep in zip(allocs, replies)}
    items: dict[int, list[PlanItem]] = {p: [] for p in range(cfg.p_tp)}
    for req in range(cfg.requests):   # request-major: each rank's step spreads over its D ranks
        for p in range(cfg.p_tp):
            for route in routes_from(routes, p):
                msg, rep = by_key[(req, route.d_rank)]
                items[p].append(PlanItem(msg.transfer_id, req, d_controls[route.d_rank], rep.block_ids,
                                         rep.incarnation, msg.token, route))
    return items


def expected_crcs(cfg: ScaleConfig, d_rank: int) -> tuple[np.ndarray, np.ndarray]:
    """[requests, layers] CRC32 of K and of V that D rank ``d_rank`` must hold for each request."""
    heads, nb = rank_heads(cfg.kv_heads, cfg.d_tp, d_rank), cfg.blocks_per_request
    crc = np.zeros((2, cfg.requests, cfg.num_layers), dtype=np.int64)
    for layer in range(cfg.num_layers):
        data = kv_layer(cfg, heads, range(cfg.total_blocks), layer)
        for plane in (0, 1):
            for req in range(cfg.requests):
                crc[plane, req, layer] = zlib.crc32(data[plane, req * nb:(req + 1) * nb])
    return crc[0], crc[1]


def check_all(cfg: ScaleConfig, allocs, replies) -> dict[str, str]:
    """transfer id -> "" when D holds exactly the expected bytes and finished it, else why not."""
    expected = {d: expected_crcs(cfg, d) for d in range(cfg.d_tp)}
    verdict = {}
    for (req, d, msg), rep in zip(allocs, replies):
        if not isinstance(rep, m.VerifyReply):
            verdict[msg.transfer_id] = f"verify failed: {rep!r}"
        elif rep.state != "finished":
            verdict[msg.transfer_id] = f"D state {rep.state}: {rep.reason}"
        else:
            k, v = expected[d]
            same = rep.crc_k == k[req].tolist() and rep.crc_v == v[req].tolist()
            verdict[msg.transfer_id] = "" if same else "bytes at D differ from the global KV"
    return verdict


def config_from_args(args) -> ScaleConfig:
    per_block = 2 * args.num_layers * args.block_size * args.kv_heads * args.head_dim * DTYPE_BYTES[args.dtype]
    nb = max(1, min(MAX_BLOCKS_PER_REQUEST, BUDGET_BYTES // max(1, args.requests * per_block)))
    return ScaleConfig(p_tp=args.prefill_ranks, d_tp=args.decode_ranks, requests=args.requests,
                       blocks_per_request=nb, num_layers=args.num_layers, block_size=args.block_size,
                       kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=args.dtype, layout=args.kv_layout,
                       seed=args.seed, contiguous=not getattr(args, "scatter", False),
                       gc_freeze=getattr(args, "gc_freeze", True))


def run_scale(args) -> int:
    cfg = config_from_args(args)
    load_before = [round(x, 2) for x in os.getloadavg()]
    report = run_scenario(cfg)
    if getattr(args, "against_whole_blocks", False) and cfg.d_tp != cfg.p_tp:
        _progress(f"whole blocks: the same {cfg.requests} requests, {cfg.p_tp} P -> {cfg.p_tp} D", final=True)
        report["whole_blocks"] = compare_whole_blocks(report, run_scenario(msgspec.structs.replace(cfg, d_tp=cfg.p_tp)))
        report["all_verified"] = report["all_verified"] and report["whole_blocks"]["all_verified"]
    report["machine"] = {"cpus": os.cpu_count(), "loadavg_before": load_before,   # other work skews the figures
                         "loadavg_after": [round(x, 2) for x in os.getloadavg()]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_result(out / "scale.json", report)
    print_scale(report)
    print(f"\nwrote {out / 'scale.json'}  (verified: {report['verified']}/{report['transfers']})")
    return 0 if report["all_verified"] else 1


def compare_whole_blocks(sliced: dict, whole: dict) -> dict:
    """The head-slice run's loop CPU per GB against whole blocks' (P TP == D TP), same requests, same run."""
    loop_sliced, loop_whole = sliced["cpu_s_per_gb"]["loop"], whole["cpu_s_per_gb"]["loop"]
    return {"decode_ranks": whole["decode_ranks"], "gbps": whole["gbps"], "raw_ratio": whole["raw_ratio"],
            "cpu_s_per_gb": whole["cpu_s_per_gb"], "gc_s_per_gb": whole.get("gc_s_per_gb"),
            "verified": whole["verified"], "transfers": whole["transfers"], "all_verified": whole["all_verified"],
            "loop_cpu_head_slices_over_whole_blocks": round(loop_sliced / max(1e-9, loop_whole), 2),
            "loop_us_per_run": whole["loop_us_per_run"],
            "loop_cpu_per_run_head_slices_over_whole_blocks": round(sliced["loop_us_per_run"]
                                                                    / max(1e-9, whole["loop_us_per_run"]), 2),
            "raw_cpu_head_slices_over_whole_blocks": round(sliced["cpu_s_per_gb"]["raw_process"]
                                                           / max(1e-9, whole["cpu_s_per_gb"]["raw_process"]), 2)}


def run_scenario(cfg: ScaleConfig) -> dict:
    """Start M D nodes and N P ranks, run every request at once, verify, release, stop everything."""
    d_heads = local_heads(cfg.kv_heads, cfg.d_tp)
    local_heads(cfg.kv_heads, cfg.p_tp)   # validates the P topology before anything starts
    node_args = ["--receive-timeout", str(cfg.wait_s + 120)]
    with tempfile.TemporaryDirectory(prefix="aiolayer-scale-") as tmp:
        cfg_path = Path(tmp) / "config.json"
        cfg_path.write_bytes(msgspec.json.encode(cfg))
        nodes = [NodeProcess(cfg.shape(d_heads, cfg.total_blocks),
                             extra_args=[*node_args, "--engine-id", f"scale-d{d}"], start_timeout=START_S)
                 for d in range(cfg.d_tp)]
        ranks: list[RankProcess] = []
        proxy = None
        try:
            ranks = [RankProcess(p, cfg_path) for p in range(cfg.p_tp)]
            with ThreadPoolExecutor(len(nodes)) as pool:
                list(pool.map(NodeProcess.start, nodes))
            ready = collect(ranks, "ready", START_S)
            proxy = Runtime(NodeConfig(engine_id="scale-proxy", backend="memory"),
                            Timeouts(control_call=CALL_S)).start()
            return _drive(cfg, Path(tmp), nodes, ranks, ready, proxy)
        finally:
            if proxy is not None:
                proxy.stop()
            for rank in ranks:
                rank.end()
            for node in nodes:
                node.stop()


def _drive(cfg: ScaleConfig, tmp: Path, nodes, ranks, ready, proxy) -> dict:
    d_controls = [n.control for n in nodes]
    routes, writers, allocs = plan(cfg, d_controls, [ready[p]["control"] for p in range(cfg.p_tp)])
    if writes_per_peer(cfg, routes) > MAX_RUNS_PER_TARGET:
        _progress(f"note: up to {writes_per_peer(cfg, routes)} writes per P->D pair; aiolayer keeps at most "
                  f"{MAX_RUNS_PER_TARGET} in flight per target (Mooncake's queue holds "
                  f"{MOONCAKE_ENV['MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER']}), the rest wait", final=True)
    layouts = raw_layouts(proxy, d_controls)   # before the allocations fill D's blocks
    replies = call_all(proxy, [(d_controls[d], msg) for _, d, msg in allocs], "allocating")
    refused = [r for r in replies if not isinstance(r, m.AllocReply)]
    if refused:
        raise RuntimeError(f"{len(refused)} of {len(allocs)} allocations failed, first: {refused[0]!r}")
    items = rank_items(cfg, routes, allocs, replies, d_controls)
    for p in items:
        (tmp / f"plan-{p}.json").write_bytes(msgspec.json.encode(items[p]))
    (tmp / "raw-layouts.json").write_bytes(msgspec.json.encode(layouts))
    total, counts = sum(len(v) for v in items.values()), {}

    def note(rank: int, msg: dict) -> None:
        counts[rank] = (msg["done"], msg.get("writes", 0))
        done, writes = (sum(c[i] for c in counts.values()) for i in (0, 1))
        _progress(f"streaming: {done}/{total} outcomes, {writes} writes in flight")

    t_go = time.perf_counter()
    for rank in ranks:
        rank.send(str(tmp / f"plan-{rank.rank}.json"))
    summaries = collect(ranks, "summary", cfg.wait_s + 60.0, note)
    wall = time.perf_counter() - t_go
    _progress(f"streaming: {sum(s['specs'] - s['lost'] for s in summaries.values())}/{total} outcomes", final=True)
    verify = call_all(proxy, [(d_controls[d], m.VerifyRequest(transfer_id=msg.transfer_id)) for _, d, msg in allocs],
                      "verifying")
    verdict = check_all(cfg, allocs, verify)
    raws = {}
    for method in METHODS:   # after D verified aiolayer's bytes, before it frees the blocks; every rank at once
        for rank in ranks:
            rank.send(f"{method} {tmp / 'raw-layouts.json'}")
        raws[method] = collect(ranks, "raw", cfg.wait_s + 60.0)
    call_all(proxy, [(d_controls[d], m.ReleaseRequest(transfer_id=msg.transfer_id)) for _, d, msg in allocs],
             "releasing")
    return build_report(cfg, routes, writers, allocs, summaries, verdict, wall, raws)


def raw_layouts(proxy: Runtime, d_controls: list[str]) -> list[RawLayout]:
    """Each D rank's layout for the raw baseline, fetched under a probe transfer of its own (D shows
    its layout only to a transfer's writer, and admits no writer beyond the transfer's P ranks), which
    the probe then ends with FAILED and releases."""
    ranks = list(range(len(d_controls)))
    probes = {d: m.AllocRequest(transfer_id=f"raw-layout-d{d}", num_blocks=1, token=secrets.token_hex(16))
              for d in ranks}
    made = call_all(proxy, [(d_controls[d], probes[d]) for d in ranks], "layout probes")
    if any(not isinstance(r, m.AllocReply) for r in made):
        raise RuntimeError(f"D refused a layout probe: {next(r for r in made if not isinstance(r, m.AllocReply))!r}")
    replies = call_all(proxy, [(d_controls[d], m.LayoutRequest(requester="scale-raw", transfer_id=probes[d].transfer_id,
                                                               token=probes[d].token)) for d in ranks], "layouts")
    call_all(proxy, [(d_controls[d], m.Failed(transfer_id=probes[d].transfer_id, sender="scale-raw",
                                              reason="layout probe", token=probes[d].token)) for d in ranks],
             "ending layout probes")
    call_all(proxy, [(d_controls[d], m.ReleaseRequest(transfer_id=probes[d].transfer_id)) for d in ranks],
             "releasing layout probes")
    bad = [r for r in replies if not isinstance(r, m.LayoutReply)]
    if bad:
        raise RuntimeError(f"D refused a layout request: {bad[0]!r}")
    return [RawLayout(d, r.session, [x.k_base for x in r.layers], [x.v_base for x in r.layers], r.kv_heads)
            for d, r in zip(ranks, replies)]
