"""``engines_link.png``: aiolayer's layer-wise TTFT p50 over the best peer's, per link rate (rows) and
prompt length (columns), each cell annotated with the ratio and the two medians; below 1 aiolayer is faster."""

from __future__ import annotations

from pathlib import Path

from ..perf.plots import _pyplot


def plot_link(cells: list[dict], basis: str, rates: list[float], lengths: list[int], path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(5.5, 1.8 + 1.9 * len(lengths)), 1.8 + 1.1 * len(rates)))
    grid = [[float("nan")] * len(lengths) for _ in rates]
    for i, c in enumerate(cells):
        if c["ratio"] is not None:
            grid[i // len(lengths)][i % len(lengths)] = c["ratio"]
    image = ax.imshow(grid, cmap="RdYlGn_r", vmin=0.4, vmax=1.6, aspect="auto")
    for i, c in enumerate(cells):
        text = "-" if c["ratio"] is None else \
            f"{c['ratio']:.2f}\n{c['aiolayer_ms']:.0f} / {c['best_ms']:.0f} ms\n({c['best']})"
        ax.text(i % len(lengths), i // len(lengths), text, ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_yticks(range(len(rates)), ["unshaped" if r == 0 else f"{r:g} Gbit/s" for r in rates])
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("link (tbf, both ends)")
    ax.set_title(f"TTFT p50: aiolayer layer-wise / {basis or 'no baseline'}\n(vLLM CPU engines, P and D on two "
                 "network namespaces)", fontsize=9)
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
