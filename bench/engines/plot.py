"""``engines.png``: median time to first token per system, at concurrency 1 and in the burst, with
each row's failed and differing requests written under its bars."""

from __future__ import annotations

from pathlib import Path

from ..perf.plots import _pyplot


def plot_engines(summary: list[dict], path: Path) -> Path:
    plt = _pyplot()
    rows = [s for s in summary if s["ran"]]
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * max(1, len(rows)), 4.2))
    width = 0.38
    for offset, key, label in ((-width / 2, "c1", "concurrency 1"), (width / 2, "c8", "burst")):
        values = [s[key]["ttft_ms_median"] or 0 for s in rows]
        bars = ax.bar([i + offset for i in range(len(rows))], values, width, label=f"TTFT p50, {label}")
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    names = []
    for s in rows:
        bad = sum(s[k]["failed"] + s[k]["differ"] - s[k].get("numerics", 0) for k in ("c1", "c8"))
        numerics = sum(s[k].get("numerics", 0) for k in ("c1", "c8"))
        names.append(s["row"] + (f"\n{bad} failed/differ" if bad else "")
                     + (f"\n{numerics} numerics" if numerics else ""))
    ax.set_xticks(range(len(rows)), names, fontsize=8)
    ax.set_ylabel("ms")
    ax.set_title("vLLM CPU engines: time to first token (P and D on disjoint cores)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
