"""Benchmark reporting: per-mode summaries, the cross-mode figures, the terminal table, a progress bar."""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np

PREFILL_FIGURES = ("ttft_ms", "exposed_ms", "forward_ms", "forward_cpu_ms", "transfer_ms", "gbps")


def _pct(values, q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if len(values) else 0.0


def _med(values) -> float:
    values = list(values)
    return round(statistics.median(values), 3) if values else 0.0


def _spread(ns: list[int]) -> dict:
    return {"p50": round(_pct(ns, 50)), "p99": round(_pct(ns, 99)), "max": int(max(ns)) if ns else 0, "count": len(ns)}


def summarize(samples: list[dict], warmups: list[dict]) -> dict:
    """Medians over the measured requests of one mode."""
    base = {"requests": len(samples), "ok": bool(samples) and all(s["ok"] for s in samples),
            "verified": bool(samples) and all(s["verified"] for s in samples) and all(w["verified"] for w in warmups),
            "failures": [s["reason"] for s in samples + warmups if not s["ok"]],
            "bytes_per_request": samples[0]["bytes"] if samples else 0}
    if samples and "variants" in samples[0]:
        return {**base, **_limit_summary(samples)}
    handoff = [ns for s in samples for ns in s["handoff_ns"]]
    out = {**base, **{key: _med(s[key] for s in samples) for key in PREFILL_FIGURES}}
    out["cpu_s_per_gb"] = _med(s["cpu_s"] / (s["bytes"] / 1e9) for s in samples if s["bytes"])
    out["save_kv_layer_ns"] = _spread(handoff)
    floor = [ns for s in samples for ns in s.get("floor_ns", ())]
    if floor:   # an empty statement timed where save_kv is: this host's floor for any hand-off
        out["save_kv_floor_ns"] = _spread(floor)
    out["ttft_ms_all"] = [round(s["ttft_ms"], 3) for s in samples]
    out["warmup_ttft_ms"] = [round(w["ttft_ms"], 3) for w in warmups]
    if samples and "choice" in samples[0]:
        out["choice"] = samples[0]["choice"]
    if samples:
        median = sorted(samples, key=lambda s: s["ttft_ms"])[len(samples) // 2]
        out["timeline"] = {"layers": median["layers"], "phases": median["phases"], "done_s": median["done_s"],
                           "forward_s": median["forward_ms"] / 1e3}
    return out


def _limit_summary(samples: list[dict]) -> dict:
    nbytes = samples[0]["bytes"]
    variants = {}
    for name, first in samples[0]["variants"].items():
        secs = statistics.median(s["variants"][name]["s"] for s in samples)
        cpu = statistics.median(s["variants"][name]["cpu_s"] for s in samples)
        variants[name] = {"ms": round(secs * 1e3, 4), "gbps": round(nbytes / secs / 1e9, 3) if secs else 0.0,
                          "cpu_s_per_gb": round(cpu / (nbytes / 1e9), 4), "ceiling": first["ceiling"]}
    best = max((n for n, v in variants.items() if v["ceiling"]), key=lambda n: variants[n]["gbps"])
    return {"ttft_ms": None, "exposed_ms": None, "forward_ms": None, "transfer_ms": variants[best]["ms"],
            "gbps": variants[best]["gbps"], "cpu_s_per_gb": variants[best]["cpu_s_per_gb"],
            "save_kv_layer_ns": None, "ceiling_variant": best, "variants": variants}


def derive(modes: dict) -> dict:
    """Cross-mode figures; returns what they were measured against."""
    raw = modes.get("raw_mooncake")
    threaded = modes.get("threaded")
    for name, r in modes.items():
        r["efficiency"] = round(r["gbps"] / raw["gbps"], 3) if raw and raw["gbps"] else None
        if r["ttft_ms"] is None:
            r["hidden_fraction"] = None
            r["ttft_vs_threaded"] = None
            continue
        alone = raw["transfer_ms"] if raw else r["transfer_ms"]
        r["hidden_fraction"] = round(1 - r["exposed_ms"] / alone, 3) if alone else None
        r["ttft_vs_threaded"] = (round(r["ttft_ms"] / threaded["ttft_ms"], 3) if threaded and threaded["ttft_ms"]
                                 else None)
        if raw:
            for variant, key in (("batch_sync", "efficiency_vs_batch_sync"),
                                 ("submit_poll+compute", "efficiency_vs_raw_under_compute"),
                                 ("per_layer_paced", "efficiency_vs_raw_per_layer"),
                                 ("per_layer_1ms", "efficiency_vs_raw_per_layer_1ms")):
                v = raw["variants"].get(variant)
                r[key] = round(r["gbps"] / v["gbps"], 3) if v and v["gbps"] else None
    return {"transfer_alone": "raw_mooncake transfer_ms" if raw else "each mode's own transfer_ms",
            "efficiency": "gbps / raw_mooncake gbps" if raw else None}


def _fmt(value, spec: str, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{spec}}"


def print_table(report: dict) -> None:
    cfg = report["config"]
    print(f"\naiolayer bench: {cfg['num_layers']} layers x {cfg['kv_heads']} KV heads x head_dim {cfg['head_dim']} "
          f"({cfg['dtype']}), {cfg['prompt_tokens']} tokens in {cfg['block_size']}-token blocks, "
          f"{cfg['bytes_per_request'] / 2**20:.0f} MiB per request, {cfg['layer_ms']:g} ms compute per layer, "
          f"backend {cfg['backend']}, {cfg['requests']} requests per mode (medians)")
    header = (f"{'mode':<13}{'TTFT ms':>9}{'x thr':>7}{'fwd ms':>8}{'exposed':>9}{'hidden':>8}{'xfer ms':>9}{'GB/s':>7}"
              f"{'eff':>6}  {'save_kv p50/p99/max ns':<23}{'CPU s/GB':>9}{'verified':>9}")
    print(header)
    print("-" * len(header))
    for name, r in report["modes"].items():
        h = r["save_kv_layer_ns"]
        handoff = f"{h['p50']}/{h['p99']}/{h['max']}" if h else "-"
        label = f"{name}({r['choice'][0]})" if "choice" in r else name
        print(f"{label:<13}{_fmt(r['ttft_ms'], '.1f', 9)}{_fmt(r['ttft_vs_threaded'], '.2f', 7)}"
              f"{_fmt(r['forward_ms'], '.1f', 8)}{_fmt(r['exposed_ms'], '.1f', 9)}"
              f"{_fmt(r['hidden_fraction'], '.2f', 8)}"
              f"{_fmt(r['transfer_ms'], '.1f', 9)}{_fmt(r['gbps'], '.2f', 7)}{_fmt(r['efficiency'], '.2f', 6)}"
              f"  {handoff:<23}{_fmt(r['cpu_s_per_gb'], '.3f', 9)}{str(r['verified']).lower():>9}")
    alone = "raw_mooncake transfer time" if "raw_mooncake" in report["modes"] else "the mode's own transfer time"
    print(f"x thr = TTFT / threaded TTFT; hidden = 1 - exposed / {alone}; "
          "eff = GB/s / raw_mooncake GB/s;\nCPU s/GB = loop thread (aiolayer), sender thread (threaded), "
          "pushing thread (raw_mooncake, memcpy), P process (raw_tcp)")
    for name in ("raw_mooncake", "raw_tcp"):
        r = report["modes"].get(name)
        if r:
            parts = [f"{v} {d['gbps']:.2f} GB/s{' (ceiling)' if v == r['ceiling_variant'] else ''}"
                     for v, d in r["variants"].items()]
            print(f"{name} variants: " + ", ".join(parts))
    lw = report["modes"].get("layerwise", {})
    if lw.get("save_kv_floor_ns"):
        f, h = lw["save_kv_floor_ns"], lw["save_kv_layer_ns"]
        print(f"layerwise save_kv p50/p99 {h['p50']}/{h['p99']} ns (even layers) against this host's floor "
              f"{f['p50']}/{f['p99']} ns (an empty statement timed at the same point, odd layers)")
    _print_integrity_cost(lw, report["modes"].get("checked"))
    if lw.get("efficiency_vs_raw_per_layer") is not None:
        same_tick = lw.get("efficiency_vs_raw_per_layer_1ms")
        print(f"layerwise GB/s vs raw Mooncake paced one layer at a time like the forward: "
              f"{lw['efficiency_vs_raw_per_layer']:.2f}"
              + (f" (polled every 0.1 ms); vs the same forward's layers polled every 1 ms (the runtime's tick): "
                 f"{same_tick:.2f}" if same_tick is not None else "")
              + f"; vs Mooncake's batch write: {lw['efficiency_vs_batch_sync']:.2f}")


def _print_integrity_cost(lw: dict, checked: dict | None) -> None:
    """What the end-to-end check costs: every transfer checked vs none, and at the default share."""
    from aiolayer.config import DEFAULT_INTEGRITY_SAMPLE

    if not checked or not lw.get("ttft_ms") or checked.get("ttft_ms") is None:
        return
    extra_ms = checked["ttft_ms"] - lw["ttft_ms"]
    extra_cpu = (checked.get("cpu_s_per_gb") or 0.0) - (lw.get("cpu_s_per_gb") or 0.0)
    share = DEFAULT_INTEGRITY_SAMPLE
    print(f"integrity check on every transfer (checked vs layerwise): TTFT {extra_ms:+.1f} ms "
          f"({100 * extra_ms / lw['ttft_ms']:+.1f} %), loop CPU {extra_cpu:+.3f} s/GB; at the default share "
          f"{share:g}: {100 * share * extra_ms / lw['ttft_ms']:+.2f} % of TTFT on average")


class Progress:
    """A progress bar on stderr with elapsed and remaining time: redrawn in place on a terminal.

    ``weight`` is what a step is expected to cost (the sweep's steps differ 100-fold), for the estimate.
    """

    def __init__(self, total: int, stream=sys.stderr, total_weight: float | None = None) -> None:
        self.total = total
        self.total_weight = float(total if total_weight is None else total_weight)
        self.done = 0
        self.weight_done = 0.0
        self.stream = stream
        self.tty = stream.isatty()
        self.started = time.monotonic()

    def advance(self, text: str, units: int = 1, weight: float | None = None) -> None:
        self.done += units
        self.weight_done += units if weight is None else weight
        width = 24
        filled = int(width * self.weight_done / max(1e-9, self.total_weight))
        spent = time.monotonic() - self.started
        left = spent / self.weight_done * max(0.0, self.total_weight - self.weight_done) if self.weight_done else 0.0
        line = (f"[{'#' * min(width, filled)}{'.' * max(0, width - filled)}] {self.done}/{self.total} "
                f"{spent:.0f}s, ~{left:.0f}s left  {text}")
        if self.tty:
            self.stream.write("\r\033[K" + line[:160])
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
