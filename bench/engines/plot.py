"""``engines.png``: median time to first token per system, at concurrency 1 and in the burst, each P/D
row's own P answering alone at the same moments as a mark on its concurrency-1 bar (the host's speed
drifts: that mark is what the row stands on), with each row's failed and differing requests written under
its bars."""

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
    alone = [(i - width / 2, s["c1"].get("p_alone_ms_median")) for i, s in enumerate(rows)]
    alone = [(x, y) for x, y in alone if y is not None]
    if alone:
        ax.scatter([x for x, _ in alone], [y for _, y in alone], marker="_", s=400, color="black", zorder=3,
                   label="its P alone, p50 (no D, no transfer)")
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
