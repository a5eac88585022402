"""The report of ``aiolayer bench scale``: aiolayer's figures per rank, the raw-Mooncake baseline
over the same spans next to them (every method in ``raw.METHODS``, the fastest is the baseline), CPU
seconds per GB, and the printed table.
"""

from __future__ import annotations

import msgspec
import numpy as np

from aiolayer.protocol import messages as m
from aiolayer.protocol.plan import HeadGeometry, local_heads, merge_runs, routes_from, slice_addresses

from .model import ScaleConfig, rank_heads


def build_report(cfg: ScaleConfig, routes, writers, allocs, summaries: dict[int, dict], verdict: dict, wall: float,
                 raws: dict[str, dict[int, dict]]) -> dict:
    finished = {tid: t for s in summaries.values() for tid, t in s["finished"].items()}
    begin = {p: s["t_begin"] for p, s in summaries.items()}
    spans: dict[int, list[float]] = {}   # request -> [first begin, last outcome] over the ranks writing it
    for req, d, msg in allocs:
        for p in writers[d]:
            lo, hi = spans.get(req, [np.inf, -np.inf])
            spans[req] = [min(lo, begin[p]), max(hi, finished.get(msg.transfer_id, np.inf))]
    t0, t1 = min(begin.values()), max(s["t_end"] for s in summaries.values())
    nbytes, secs = sum(s["bytes"] for s in summaries.values()), max(1e-9, t1 - t0)
    verified = sum(1 for v in verdict.values() if not v)
    baseline = raw_report(summaries, raws, nbytes, secs)
    best = baseline["raw_best"]
    raw = baseline["raw_methods"][best]
    d_block = cfg.shape(local_heads(cfg.kv_heads, cfg.d_tp), 1).block_bytes
    per_d = [{"rank": d, "heads": rank_heads(cfg.kv_heads, cfg.d_tp, d), "senders": len(writers[d]),
              "transfers": cfg.requests,
              "verified": sum(1 for _, dd, msg in allocs if dd == d and not verdict[msg.transfer_id]),
              "bytes": cfg.requests * cfg.blocks_per_request * d_block * 2 * cfg.num_layers} for d in range(cfg.d_tp)]
    per_p = [{"rank": p, "heads": rank_heads(cfg.kv_heads, cfg.p_tp, p),
              "d_ranks": [r.d_rank for r in routes_from(routes, p)],
              **{k: s[k] for k in ("specs", "ok", "failed", "lost", "bytes", "peak_active", "peak_backend_writes",
                                   "writes_submitted")}, "backend_writes": s.get("backend_writes"),
              "done_batches": s.get("done_batches"), "dones_batched": s.get("dones_batched"),
              "layout_batches": s.get("layout_batches"), "layouts_batched": s.get("layouts_batched"),
              "peak_runs_per_target": s.get("peak_runs_per_target"),
              "seconds": round(s["t_end"] - s["t_begin"], 3),
              "gbps": round(s["bytes"] / max(1e-9, s["t_end"] - s["t_begin"]) / 1e9, 3),
              "cpu_s": s["cpu_s"], "loop_cpu_s": s["loop_cpu_s"], "gc_s": s.get("gc_s"),
              "gc_collections": s.get("gc_collections"),
              "raw_gbps": raw["per_rank_gbps"][p], "raw_cpu_s": raws[best][p]["cpu_s"]}
             for p, s in sorted(summaries.items())]
    failures = [f"{tid}: {why}" for tid, why in verdict.items() if why][:10]
    failures += [f"{tid}: {why}" for s in summaries.values() for tid, why in s["reasons"].items()][:10]
    return {"scenario": "scale", "config": msgspec.to_builtins(cfg), "routes": msgspec.to_builtins(routes),
            "prefill_ranks": cfg.p_tp, "decode_ranks": cfg.d_tp, "requests": cfg.requests,
            "transfers": len(allocs), "p_transfers": sum(s["specs"] for s in summaries.values()),
            "concurrent": max_in_flight([a for a, _ in spans.values()], [b for _, b in spans.values()]),
            "bytes": nbytes, "seconds": round(secs, 3), "wall_s": round(wall, 3), "gbps": round(nbytes / secs / 1e9, 3),
            **baseline,
            "verified": verified, "failed": len(verdict) - verified,
            "lost": sum(s["lost"] for s in summaries.values()),
            "all_verified": verified == len(allocs) and not any(s["lost"] for s in summaries.values()),
            "writes_per_peer": writes_per_peer(cfg, routes),
            "per_p_rank": per_p, "per_d_rank": per_d, "failures": failures}


def print_scale(r: dict) -> None:
    c = r["config"]
    print(f"scale: {r['prefill_ranks']} P ranks -> {r['decode_ranks']} D ranks, {r['requests']} requests "
          f"({r['transfers']} D transfers, {r['p_transfers']} P transfers), {c['layout']}, {c['num_layers']} layers, "
          f"{c['kv_heads']}x{c['head_dim']} {c['dtype']} heads, "
          f"{c['blocks_per_request']} x {c['block_size']}-token blocks")
    print(f"{'rank':<6}{'heads':<14}{'transfers':>10}{'ok':>7}{'failed':>7}{'MB':>9}{'s':>8}{'GB/s':>7}"
          f"{'raw GB/s':>9}{'loop CPU s':>11}{'peak active':>12}{'peak writes':>12}")
    for p in r["per_p_rank"]:
        print(f"{'P' + str(p['rank']):<6}{str(p['heads']):<14}{p['specs']:>10}{p['ok']:>7}{p['failed'] + p['lost']:>7}"
              f"{p['bytes'] / 1e6:>9.1f}{p['seconds']:>8.2f}{p['gbps']:>7.2f}{p['raw_gbps']:>9.2f}"
              f"{p['loop_cpu_s']:>11.2f}{p['peak_active']:>12}"
              f"{p['peak_backend_writes']:>12}")
    for d in r["per_d_rank"]:
        print(f"{'D' + str(d['rank']):<6}{str(d['heads']):<14}{d['transfers']:>10}{d['verified']:>7}"
              f"{d['transfers'] - d['verified']:>7}{d['bytes'] / 1e6:>9.1f}   (senders per transfer: {d['senders']})")
    print(f"total: {r['concurrent']} requests in flight at once, {r['bytes'] / 1e9:.3f} GB in {r['seconds']:.2f} s "
          f"= {r['gbps']:.2f} GB/s; verified {r['verified']}/{r['transfers']}, failed {r['failed']}, lost {r['lost']}")
    batched = [(p.get("done_batches"), p.get("dones_batched")) for p in r["per_p_rank"]]
    if all(b is not None for b, _ in batched):
        print(f"DONEs to D: {sum(n for _, n in batched)} of {sum(p['ok'] for p in r['per_p_rank'])} went in "
              f"{sum(b for b, _ in batched)} batch frames (those decided in one pass of P's loop), the rest alone")
    layouts = [(p.get("layout_batches"), p.get("layouts_batched")) for p in r["per_p_rank"]]
    if all(b is not None for b, _ in layouts):
        print(f"layout requests to D: {sum(n for _, n in layouts)} of {sum(p['specs'] for p in r['per_p_rank'])} "
              "went in "
              f"{sum(b for b, _ in layouts)} batch frames (a step's, up to {m.MAX_LAYOUT_BATCH} per frame)")
    print_raw(r)
    print_whole_blocks(r)
    for line in r["failures"]:
        print(f"  {line}")


def writes_per_peer(cfg: ScaleConfig, routes) -> int:
    """Most Mooncake writes one P rank has in flight to one D rank at once (every layer ready at once),
    for contiguous blocks; Mooncake's per-peer queues hold MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER."""
    geom = HeadGeometry(cfg.block_size, cfg.head_bytes, cfg.layout)
    p_heads, d_heads = local_heads(cfg.kv_heads, cfg.p_tp), local_heads(cfg.kv_heads, cfg.d_tp)
    runs = merge_runs(range(cfg.blocks_per_request), range(cfg.blocks_per_request))
    spans = max(slice_addresses(runs, 0, 0, p_heads, d_heads, r, geom)[0].size for r in routes)
    return cfg.requests * cfg.num_layers * 2 * spans


def max_in_flight(starts, ends) -> int:
    """Most intervals [start, end] open at once."""
    starts, ends = np.sort(np.asarray(starts, dtype=float)), np.sort(np.asarray(ends, dtype=float))
    if not starts.size:
        return 0
    return int((np.searchsorted(starts, starts, side="right") - np.searchsorted(ends, starts, side="left")).max())


def raw_report(summaries: dict[int, dict], raws: dict[str, dict[int, dict]], nbytes: int, secs: float) -> dict:
    """The raw baseline next to aiolayer's figures: GB/s, their ratio, CPU seconds per GB. Every raw
    method is reported (``raw_methods``); the fastest is ``raw``, the one the ratio divides by."""
    from .raw import METHODS
    gb = max(1e-9, nbytes / 1e9)
    gbps = nbytes / secs / 1e9
    methods = {name: _raw_method(runs, METHODS[name][1]) for name, runs in raws.items()}
    best = max(methods, key=lambda name: methods[name]["gbps"])
    raw, raw_gb = methods[best], max(1e-9, methods[best]["bytes"] / 1e9)
    return {"raw": {k: raw[k] for k in ("method", "bytes", "seconds", "writes", "batches", "failed_batches")},
            "raw_best": best, "raw_methods": methods,
            "raw_gbps": raw["gbps"], "raw_ratio": round(gbps / max(1e-9, raw["gbps"]), 3),
            # the exact spans: as many writes and bytes as aiolayer submitted
            "raw_same_spans": (raw["bytes"] == nbytes
                               and raw["writes"] == sum(s["writes_submitted"] for s in summaries.values())),
            "gc_s_per_gb": round(sum(s.get("gc_s", 0.0) for s in summaries.values()) / gb, 3),
            # per run submitted: head slices have twice the runs per GB of whole blocks (half-block runs)
            "loop_us_per_run": round(1e6 * sum(s["loop_cpu_s"] for s in summaries.values())
                                     / max(1, sum(s["writes_submitted"] for s in summaries.values())), 2),
            "cpu_s_per_gb": {"loop": round(sum(s["loop_cpu_s"] for s in summaries.values()) / gb, 3),
                             "process": round(sum(s["cpu_s"] for s in summaries.values()) / gb, 3),
                             "raw_process": round(raw["cpu_s"] / raw_gb, 3)}}


def _raw_method(raw: dict[int, dict], method: str) -> dict:
    t0, t1 = min(r["t_begin"] for r in raw.values()), max(r["t_end"] for r in raw.values())
    nbytes, secs = sum(r["bytes"] for r in raw.values()), max(1e-9, t1 - t0)
    return {"method": method, "bytes": nbytes, "seconds": round(secs, 3), "gbps": round(nbytes / secs / 1e9, 3),
            "writes": sum(r["writes"] for r in raw.values()), "batches": sum(r["batches"] for r in raw.values()),
            "failed_batches": sum(r["failed_batches"] for r in raw.values()),
            "cpu_s": round(sum(r["cpu_s"] for r in raw.values()), 3),
            "per_rank_gbps": {p: round(r["bytes"] / max(1e-9, r["t_end"] - r["t_begin"]) / 1e9, 3)
                              for p, r in raw.items()}}


def print_whole_blocks(r: dict) -> None:
    w = r.get("whole_blocks")
    if not w:
        return
    print(f"whole blocks, same requests ({r['prefill_ranks']} P -> {w['decode_ranks']} D, run after): "
          f"{w['gbps']:.3f} GB/s, aiolayer / raw = {w['raw_ratio']:.2f}, "
          f"loop CPU {w['cpu_s_per_gb']['loop']:.2f} s/GB, "
          f"verified {w['verified']}/{w['transfers']}")
    print(f"head slices' loop CPU per GB = {w['loop_cpu_head_slices_over_whole_blocks']:.2f}x whole blocks' "
          f"(raw Mooncake's process CPU per GB, the same spans: {w['raw_cpu_head_slices_over_whole_blocks']:.2f}x); "
          f"per run submitted: {r['loop_us_per_run']:.1f} us vs {w['loop_us_per_run']:.1f} us "
          f"({w['loop_cpu_per_run_head_slices_over_whole_blocks']:.2f}x)")


def print_raw(r: dict) -> None:
    cpu = r["cpu_s_per_gb"]
    for name, x in r["raw_methods"].items():
        print(f"raw Mooncake ({name}{', the baseline' if name == r['raw_best'] else ''}): {x['writes']} writes in "
              f"{x['seconds']:.2f} s = {x['gbps']:.3f} GB/s, {x['cpu_s'] / max(1e-9, x['bytes'] / 1e9):.2f} CPU s/GB, "
              f"{x['failed_batches']} failed  ({x['method']})")
    print(f"raw Mooncake, same spans{'' if r['raw_same_spans'] else ' (COUNTS DIFFER)'}: "
          f"aiolayer {r['gbps']:.3f} GB/s / "
          f"raw {r['raw_gbps']:.3f} GB/s: aiolayer / raw = {r['raw_ratio']:.2f}")
    print(f"CPU s per GB: aiolayer loop thread {cpu['loop']:.2f}, aiolayer process {cpu['process']:.2f}, "
          f"raw process {cpu['raw_process']:.2f}; aiolayer's garbage collector {r['gc_s_per_gb']:.2f} "
          f"(collections by generation: {[p.get('gc_collections') for p in r['per_p_rank']]}; start-up heap "
          f"{'frozen' if r['config'].get('gc_freeze', True) else 'not frozen (--no-gc-freeze)'})")
