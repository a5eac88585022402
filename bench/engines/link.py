"""``aiolayer bench vllm --link-gbit R,.. --prompt-lengths N,..``: the rows of ``run.py`` across a
rate-limited link, where the KV's transfer can outlast the prefill it is meant to hide behind.

P's engine runs in host A, D's in host B (``netns.two_hosts(management=True)``: two network
namespaces joined by a veth pair, shaped with tbf on both ends); their KV and control traffic
crosses that link only (the connectors bound to the 10.S.0.x addresses), this process reaches their
HTTP ports over the management links, and aiolayer's proxy runs in host A, beside P. The aggregated
engine needs no link: it runs in this namespace. Each row's engines start once (aiolayer's mode rows
share one pair, their requests alternating: ``link_rows.py``); for every cell (a rate, then a prompt
length) the link is reshaped, one request per row warms the cell, and ``--prompts`` requests per row
(more for short prompts: ``prompts_for``) are measured one at a time (no burst). Every prompt is new
to every engine (a prefix-cache hit would skip the transfer), and every answer is checked against the
aggregated engine's for the same prompt, as in ``run.py``; aiolayer's rows byte-check every layer of
every transfer.
Writes ``engines_link.json`` and ``engines_link.png`` (``link_plot.py``) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from aiolayer.harness import netns
from ..provenance import write_result
from .link_rows import MODE_ROWS, auto_choices, cell_key, lanes, measure_cell, prompt_sets, row_groups
from .place import of_hosts
from .run import SYSTEMS, kv_bytes_per_token, model_spec, row_names, run_engines, take_hooks
from .summary import bytes_verified, each_row, phase_summary, unmeasured
from aiolayer.harness.tiny_model import long_prompt, tiny_model_dir

PEERS = ("mooncake", "nixl")     # vLLM's own connectors: the heatmap's baseline


def _numbers(text: str, what: str, *, positive: bool) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(v < 0 or (positive and v == 0) for v in values):
        raise ValueError(f"{what} wants comma-separated numbers {'> 0' if positive else '>= 0'}, got {text!r}")
    return values


def label(gbit: float) -> str:
    return "unshaped" if gbit == 0 else f"{gbit:g} Gbit/s"


def prompts_for(length: int, prompts: int) -> int:
    """Measured requests per row in a cell of ``length``-token prompts: ``--prompts``, and up to 4x that
    below 1,024 tokens, where a request takes ~0.1 s and its TTFT varies most (a few ms of ~90)."""
    return prompts * min(4, max(1, 1024 // length))


def cell_texts(rates: list[float], lengths: list[int], prompts: int,
               sets: int = 1) -> dict[tuple[int, int], list[dict[str, list[str]]]]:
    """(rate index, length index) -> per prompt set (``link_rows.lanes``), its warm-up and measured prompts
    (``prompts_for``), none repeated anywhere in the run."""
    out = {}
    for ri in range(len(rates)):
        for li, length in enumerate(lengths):
            out[ri, li] = []
            for k in range(sets):
                seed = 20_000 + 100_000 * k + 1_000 * ri + 100 * li
                out[ri, li].append({"warmup": [long_prompt(length, seed=seed + 99)],
                                    "serial": [long_prompt(length, seed=seed + i)
                                               for i in range(prompts_for(length, prompts))]})
    return out


def p99(values: list[float]) -> float | None:
    """Nearest rank: with fewer than 100 requests, the slowest."""
    ordered = sorted(values)
    return round(ordered[max(0, -(-99 * len(ordered) // 100) - 1)], 1) if ordered else None


def link_bytes(hosts) -> int:
    """Bytes host A has sent on the link so far (P's KV goes that way): what a cell moved over it."""
    done = hosts.run(hosts.a, ["cat", f"/sys/class/net/{hosts.a.dev}/statistics/tx_bytes"], timeout=10,
                     capture_output=True, text=True)
    return int(done.stdout.strip() or 0)


def tbf_drops(hosts) -> int:
    """Packets host A's tbf dropped since the link was last shaped (its queue full: TCP then retransmits)."""
    done = hosts.run(hosts.a, ["tc", "-s", "-j", "qdisc", "show", "dev", hosts.a.dev], timeout=10,
                     capture_output=True, text=True)
    try:
        return sum(int(q.get("drops", 0)) for q in json.loads(done.stdout or "[]"))
    except (ValueError, AttributeError):
        return -1


def _cell(completes: dict, cell_lanes: list[tuple[str, int]], texts: list[dict], args: argparse.Namespace,
          hosts, p_modes=None) -> tuple[dict, dict]:
    """One cell of a group of rows (``link_rows.measure_cell``); with it the load average, the bytes per
    request A sent on the link (the KV, which goes from P to D, and the control plane), tbf's drops and
    (aiolayer's rows: ``p_modes`` reads P's counters) how P sent them, warm-up included."""
    sent, dropped, before = link_bytes(hosts), tbf_drops(hosts), p_modes() if p_modes else {}
    results = measure_cell(completes, cell_lanes, texts, args)
    requests = len(completes) + sum(len(r) for r in results.values())
    meta = {"loadavg_1m": round(os.getloadavg()[0], 2),
            "link_mb_per_request": round((link_bytes(hosts) - sent) / requests / 1e6, 2),
            "tbf_drops": tbf_drops(hosts) - dropped}
    if p_modes:
        delta = {k: v - before.get(k, 0) for k, v in p_modes().items()}
        meta["modes"] = auto_choices(delta, results) if len(completes) > 1 else {k: int(v) for k, v in delta.items()}
    return results, meta


def _start(group: list[str], model: Path, args: argparse.Namespace):
    """The engines of a group of rows: a row's own system, or (aiolayer's mode rows together) one pair
    whose P chooses each send's mode unless the request names it."""
    return SYSTEMS[group[0] if len(group) == 1 else "aiolayer-auto"](model, args)


def _completes(group: list[str], complete, hooks: dict) -> dict:
    if len(group) == 1:
        return {group[0]: complete}
    return {name: hooks["_complete_as"](MODE_ROWS[name]) for name in group}


def _row_how(name: str, group: list[str], how: dict) -> dict:
    if len(group) == 1:
        return how
    asked = MODE_ROWS[name]
    return {**how, "transfer_mode": f"{asked}, asked by each request (x-aiolayer-transfer-mode)" if asked else "auto",
            "engines": f"shared by the rows {', '.join(group)}, their requests alternating"}


def run_group(group: list[str], index: str, model: Path, args: argparse.Namespace, hosts, rates: list[float],
              lengths: list[int], texts: dict) -> list[dict]:
    """One group's engines (``link_rows.row_groups``), started once, through every cell; one result per
    row. A group that cannot start is reported as such, each of its rows."""
    t0, sets = time.monotonic(), len(next(iter(texts.values())))
    cell_lanes = lanes(group, sets)
    cells: dict[str, dict] = {name: {} for name in group}
    meta: dict[str, dict] = {name: {} for name in group}
    title = "+".join(group)
    try:
        with _start(group, model, args) as (complete, how):
            hooks = take_hooks(how)
            p_modes, completes = hooks.get("_p_modes"), _completes(group, complete, hooks)
            print(f"{index} {title}: engines up in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
            for ri, gbit in enumerate(rates):
                hosts.shape(gbit or None)   # the aggregated engine uses no link: the rate changes nothing for it
                for li, length in enumerate(lengths):
                    t1, key = time.monotonic(), f"{ri},{li}"
                    results, cell_meta = _cell(completes, cell_lanes, texts[ri, li], args, hosts, p_modes)
                    for (name, k), answers in results.items():
                        cells[name][cell_key(key, k if name == "aggregated" else 0)] = answers
                    for name in group:   # what P chose is the auto row's (``auto_choices``)
                        meta[name][key] = cell_meta if name == "aiolayer-auto" or len(group) == 1 else \
                            {field: v for field, v in cell_meta.items() if field != "modes"}
                        more = sum(len(a) for (row, _), a in results.items() if row == name) - len(cells[name][key])
                        _print_cell(f"{index} {name}", gbit, length, cells[name][key], meta[name][key],
                                    time.monotonic() - t1, more)
    except Exception as exc:   # noqa: BLE001 - reported in the row, with its error; the others still run
        print(f"{index} {title}: not run: {type(exc).__name__}: {str(exc)[:300]}", file=sys.stderr, flush=True)
        return [{"row": name, "ran": False, "error": f"{type(exc).__name__}: {exc}"[:3000], "cells": cells[name],
                 "meta": meta[name]} for name in group]
    wall = round(time.monotonic() - t0, 1)
    return [{"row": name, "ran": True, "how": _row_how(name, group, how), "cells": cells[name], "meta": meta[name],
             "prompt_set": k if len(group) > 1 else 0, "wall_s": wall} for k, name in enumerate(group)]


def _print_cell(title: str, gbit: float, length: int, answers: list[dict], meta: dict, took_s: float,
                more: int = 0) -> None:
    """A cell's progress line; ``more``: answers to other rows' prompts (the aggregated engine), not in its figures."""
    ttft = [r["ttft_ms"] for r in answers if r.get("ttft_ms") is not None]
    p50 = f"TTFT p50 {statistics.median(ttft):.0f} p99 {p99(ttft):.0f} ms" if ttft else "no TTFT"
    ok = sum(1 for r in answers if "error" not in r)   # 2 shared cores: the load says what else ran
    print(f"{title} | {label(gbit)} | {length} tokens: {p50}, {ok}/{len(answers)} answered"
          + (f" (+{more} to the other rows' prompts)" if more else "") + ", "
          f"{meta['link_mb_per_request']:.1f} MB A->B each, {meta['tbf_drops']} tbf drops "
          f"({took_s:.0f} s, load {meta['loadavg_1m']})" + (f", modes {meta['modes']}" if "modes" in meta else ""),
          file=sys.stderr, flush=True)


def summarize(rows: list[dict], rates: list[float], lengths: list[int]) -> list[dict]:
    """Per row and cell: TTFT p50/p99, and every answer checked against the aggregated engine's."""
    def summary_of(row: dict, ref: dict | None) -> dict:
        checked = bytes_verified(row["how"])
        cells = []
        for ri, gbit in enumerate(rates):
            for li, length in enumerate(lengths):
                key = f"{ri},{li}"
                results = row["cells"].get(key, [])
                reference = ref["cells"].get(cell_key(key, row.get("prompt_set", 0))) \
                    if ref is not None and row is not ref else None
                s = phase_summary(results, reference, checked)
                s["ttft_ms_p99"] = p99([r["ttft_ms"] for r in results if r.get("ttft_ms") is not None])
                cells.append({"link_gbit": gbit, "prompt_tokens": length, **row["meta"].get(key, {}), **s})
        return {"row": row["row"], "ran": True, "how": row["how"], "wall_s": row["wall_s"], "cells": cells}
    return each_row(rows, summary_of)


def bad_rows(summary: list[dict]) -> list[str]:
    """As ``summary.bad_rows``: a failed request, a byte mismatch or a drift not explained by verified bytes,
    and rows that did not run."""
    bad = unmeasured(summary)
    for s in summary:
        if s["ran"] and (any(c["failed"] or c["differ"] - c["numerics"] for c in s["cells"])
                         or (s["how"].get("bytes") or {}).get("mismatch")):
            bad.append(s["row"])
    return bad


def ratios(summary: list[dict]) -> tuple[str, list[dict]]:
    """aiolayer's layer-wise TTFT p50 over the best peer's per cell (vLLM's own connectors; without one that
    ran, the best of the other rows), and what it was divided by."""
    by_row = {s["row"]: s for s in summary if s["ran"]}
    lw = by_row.get("aiolayer")
    base = [n for n in PEERS if n in by_row] or [n for n in ("aiolayer-bulk", "aggregated") if n in by_row][:1]
    if lw is None or not base:
        return "", []
    out = []
    for i, cell in enumerate(lw["cells"]):
        peer = {n: by_row[n]["cells"][i]["ttft_ms_median"] for n in base if by_row[n]["cells"][i]["ttft_ms_median"]}
        best = min(peer, key=lambda n: peer[n]) if peer else None
        mine = cell["ttft_ms_median"]
        out.append({"link_gbit": cell["link_gbit"], "prompt_tokens": cell["prompt_tokens"], "aiolayer_ms": mine,
                    "best": best, "best_ms": peer.get(best) if best else None,
                    "ratio": round(mine / peer[best], 3) if best and mine else None})
    return ("best of " + ", ".join(base)) if base[0] in PEERS else base[0], out


def auto_cells(summary: list[dict]) -> list[dict]:
    """Per cell, ``aiolayer-auto``'s TTFT p50 over the better of layer-wise's and bulk's (all three must have
    run): within 1.05 the mode chosen per request did as well as the better fixed mode."""
    by_row = {s["row"]: s for s in summary if s["ran"]}
    if not {"aiolayer", "aiolayer-bulk", "aiolayer-auto"} <= by_row.keys():
        return []
    out = []
    for auto, lw, bulk in zip(*(by_row[n]["cells"] for n in ("aiolayer-auto", "aiolayer", "aiolayer-bulk"))):
        fixed = [c["ttft_ms_median"] for c in (lw, bulk) if c["ttft_ms_median"]]
        mine = auto["ttft_ms_median"]
        out.append({"link_gbit": auto["link_gbit"], "prompt_tokens": auto["prompt_tokens"], "auto_ms": mine,
                    "layerwise_ms": lw["ttft_ms_median"], "bulk_ms": bulk["ttft_ms_median"],
                    "modes": auto.get("modes", {}),
                    "ratio": round(mine / min(fixed), 3) if mine and fixed else None})
    return out


def chosen(modes: dict) -> str:
    """What auto chose in a cell, short: lw5/b1, and /l20 where D prefilled some itself."""
    local = modes.get("local", 0)
    return f"lw{modes.get('layerwise', 0)}/b{modes.get('bulk', 0)}" + (f"/l{local}" if local else "")


def print_table(summary: list[dict], rates: list[float], lengths: list[int], basis: str, cells: list[dict]) -> None:
    print("\nTTFT p50 / p99 ms at concurrency 1, by link and prompt tokens (verified/requests per row at the end)")
    print(f"{'row':<14} {'link':<12}" + "".join(f"{n:>14}" for n in lengths) + "  verified / failed")
    for s in summary:
        if not s["ran"]:
            print(f"{s['row']:<14} not run: {s['error'][:300]}")
            continue
        for ri, gbit in enumerate(rates):
            row = s["cells"][ri * len(lengths):(ri + 1) * len(lengths)]
            figures = "".join(f"{c['ttft_ms_median'] or '-'!s:>8}/{c['ttft_ms_p99'] or '-'!s:<5}" for c in row)
            ok = "reference" if row[0]["verified"] is None else \
                f"{sum(c['verified'] for c in row)}/{sum(c['requests'] for c in row)} / {sum(c['failed'] for c in row)}"
            numerics = sum(c["numerics"] for c in row)
            print(f"{s['row']:<14} {label(gbit):<12}{figures}  {ok}" + (f" ({numerics} numerics)" if numerics else ""))
    if cells:
        print(f"\naiolayer layer-wise TTFT p50 / {basis} p50")
        print(f"{'link':<12}" + "".join(f"{n:>14}" for n in lengths))
        for ri, gbit in enumerate(rates):
            row = cells[ri * len(lengths):(ri + 1) * len(lengths)]
            print(f"{label(gbit):<12}" + "".join(f"{(c['ratio'] or '-')!s:>8} {(c['best'] or '')[:5]:<5}" for c in row))
    auto = auto_cells(summary)
    if auto:
        print("\naiolayer-auto TTFT p50 / min(layer-wise, bulk) p50 (<= 1.05: as good as the better fixed mode)")
        print(f"{'link':<12}" + "".join(f"{n:>17}" for n in lengths))
        for ri, gbit in enumerate(rates):
            row = auto[ri * len(lengths):(ri + 1) * len(lengths)]
            print(f"{label(gbit):<12}" + "".join(
                f"{(c['ratio'] or '-')!s:>6} {chosen(c['modes']):<10}" for c in row))
        print("(lwN/bN/lN: auto's requests sent layer-wise, in bulk, or prefilled by D itself, warm-up included)")


def run_link(args: argparse.Namespace, names: list[str]) -> int:
    try:
        rates = _numbers(args.link_gbit, "--link-gbit", positive=False)
        lengths = [int(n) for n in _numbers(args.prompt_lengths or str(args.prompt_tokens), "--prompt-lengths",
                                            positive=True)]
    except ValueError as exc:
        print(f"aiolayer bench vllm: {exc}", file=sys.stderr)
        return 2
    why = netns.available()
    if why:
        print(f"aiolayer bench vllm --link-gbit: cannot make the two hosts: {why}", file=sys.stderr)
        return 2
    spec = model_spec(args)
    model = tiny_model_dir(spec)
    per_token = kv_bytes_per_token(spec, args.dtype)
    dtype = "bf16" if args.dtype == "auto" else args.dtype
    print(f"model: {spec.num_layers} layers x {spec.num_kv_heads} KV heads of {spec.head_dim}, {dtype}: "
          f"{per_token} B of KV per token; at 1 Gbit/s a {max(lengths)}-token prompt's KV takes "
          f"{per_token * max(lengths) * 8 / 1e6:.0f} ms", file=sys.stderr, flush=True)
    groups = row_groups(names, args.separate_engines)
    texts, rows = cell_texts(rates, lengths, args.prompts, prompt_sets(groups)), []
    with netns.two_hosts(management=True) as hosts:
        args.place = of_hosts(hosts)
        namespaces = [hosts.a.ns, hosts.b.ns]
        for i, group in enumerate(groups):
            rows += run_group(group, f"[{i + 1}/{len(groups)}]", model, args, hosts, rates, lengths, texts)
    args.place = None
    summary = summarize(rows, rates, lengths)
    basis, cells = ratios(summary)
    print_table(summary, rates, lengths, basis, cells)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = {"link_gbit": rates, "prompt_lengths": lengths, "rows": names, "engines": [list(g) for g in groups],
              "prompts_per_cell": {length: prompts_for(length, args.prompts) for length in lengths},
              "warmup_per_cell": 1, "max_tokens": args.max_tokens, "layers": spec.num_layers,
              "kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim, "kv_bytes_per_token": per_token,
              "cores": args.cores, "pin": args.pin, "eager": args.eager, "dtype": args.dtype, "namespaces": namespaces,
              "link": "veth pair, tbf on both ends; aggregated engine in the root namespace"}
    auto = auto_cells(summary)
    report = {"config": config, "summary": summary, "ratio_basis": basis, "ratios": cells, "auto": auto,
              "rows": rows}
    write_result(out / "engines_link.json", report, indent=1)
    from .link_plot import plot_link
    plot_link(cells, basis, rates, lengths, out / "engines_link.png", auto)
    print(f"wrote {out / 'engines_link.json'} and {out / 'engines_link.png'}")
    bad = bad_rows(summary)
    if bad:
        print(f"aiolayer bench vllm: rows with failed requests, byte mismatches or unexplained drift: {bad}",
              file=sys.stderr)
    return 1 if bad else 0


def run_vllm(args: argparse.Namespace) -> int:
    """``aiolayer bench vllm``: the sweep across a shaped link with ``--link-gbit``, else one loopback run."""
    if args.together:
        if args.link_gbit:
            print("aiolayer bench vllm: --together is for a loopback run (the link sweep alternates its mode rows "
                  "on one pair already)", file=sys.stderr)
            return 2
        if not args.together_pause >= 0:
            print(f"aiolayer bench vllm: --together-pause must be 0 or more seconds, not {args.together_pause}",
                  file=sys.stderr)
            return 2
        from .together import run_rows   # imports run.py; handed in, so that run.py need not import it back
        return run_engines(args, run_rows)
    if not args.link_gbit:
        return run_engines(args)
    names = row_names(args)
    return 2 if names is None else run_link(args, names)
