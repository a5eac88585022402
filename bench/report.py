"""Benchmark reporting: per-mode summaries, the terminal table and a progress line on stderr."""

from __future__ import annotations

import statistics
import sys

import numpy as np


def _pct(values, q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if len(values) else 0.0


def mode_summary(samples: list[dict]) -> dict:
    """Medians over the measured requests; hand-off cost percentiles over every hand-off."""
    handoff = [ns for s in samples for ns in s["handoff_ns"]]
    med = lambda key: round(statistics.median(s[key] for s in samples), 3) if samples else 0.0  # noqa: E731
    return {
        "requests": len(samples),
        "ok": all(s["ok"] for s in samples),
        "verified": bool(samples) and all(s["verified"] for s in samples),
        "failures": [s["reason"] for s in samples if not s["ok"]],
        "ttft_ms": med("ttft_ms"),
        "exposed_ms": med("exposed_ms"),
        "forward_ms": med("forward_ms"),
        "transfer_busy_ms": med("transfer_busy_ms"),
        "gbps": med("gbps"),
        "bytes_per_request": samples[0]["bytes"] if samples else 0,
        "save_kv_layer_ns": {"p50": round(_pct(handoff, 50)), "p99": round(_pct(handoff, 99)),
                             "max": int(max(handoff)) if handoff else 0, "count": len(handoff)},
        "ttft_ms_all": [round(s["ttft_ms"], 3) for s in samples],
        "timeline": samples[len(samples) // 2]["layers"] if samples else [],
    }


def print_table(report: dict) -> None:
    cfg = report["config"]
    print(f"\naiolayer bench: {cfg['num_layers']} layers x {cfg['kv_heads']} KV heads x head_dim {cfg['head_dim']} "
          f"({cfg['dtype']}), {cfg['prompt_tokens']} tokens in {cfg['block_size']}-token blocks, "
          f"{cfg['bytes_per_request'] / 2**20:.0f} MiB per request, {cfg['layer_ms']:g} ms compute per layer, "
          f"backend {cfg['backend']}")
    header = (f"{'mode':<11} {'ttft ms':>9} {'exposed ms':>11} {'forward ms':>11} {'GB/s':>7} "
              f"{'hand-off p50/p99/max ns':>25} {'verified':>9}")
    print(header)
    print("-" * len(header))
    for name, r in report["modes"].items():
        h = r["save_kv_layer_ns"]
        print(f"{name:<11} {r['ttft_ms']:>9.1f} {r['exposed_ms']:>11.1f} {r['forward_ms']:>11.1f} {r['gbps']:>7.2f} "
              f"{h['p50']:>8}/{h['p99']}/{h['max']:<8} {str(r['verified']).lower():>9}")


class Progress:
    """One status line on stderr: redrawn in place on a terminal, a line per step otherwise."""

    def __init__(self, total: int, stream=sys.stderr) -> None:
        self.total = total
        self.done = 0
        self.stream = stream
        self.tty = stream.isatty()

    def advance(self, text: str) -> None:
        self.done += 1
        width = 24
        filled = int(width * self.done / max(1, self.total))
        line = f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {text}"
        if self.tty:
            self.stream.write("\r\033[K" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
