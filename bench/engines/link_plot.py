"""``engines_link.png``: per link rate (rows) and prompt length (columns), aiolayer's layer-wise TTFT p50
over the best peer's, and (when ``aiolayer-auto`` ran beside layer-wise and bulk) the mode chosen per
request over the better fixed mode; each cell annotated with the ratio and its medians, below 1 faster."""

from __future__ import annotations

from pathlib import Path

from ..perf.plots import _pyplot


def _panel(ax, fig, cells: list[dict], rates: list[float], lengths: list[int], title: str, label, span) -> None:
    grid = [[float("nan")] * len(lengths) for _ in rates]
    for i, c in enumerate(cells):
        if c["ratio"] is not None:
            grid[i // len(lengths)][i % len(lengths)] = c["ratio"]
    image = ax.imshow(grid, cmap="RdYlGn_r", vmin=span[0], vmax=span[1], aspect="auto")
    for i, c in enumerate(cells):
        ax.text(i % len(lengths), i // len(lengths), "-" if c["ratio"] is None else label(c),
                ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_yticks(range(len(rates)), ["unshaped" if r == 0 else f"{r:g} Gbit/s" for r in rates])
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("link (tbf, both ends)")
    ax.set_title(title, fontsize=9)
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)


def plot_link(cells: list[dict], basis: str, rates: list[float], lengths: list[int], path: Path,
              auto: list[dict] | None = None) -> Path:
    plt = _pyplot()
    panels = 2 if auto else 1
    width = max(5.5, 1.8 + 1.9 * len(lengths))
    fig, axes = plt.subplots(1, panels, figsize=(width * panels, 1.8 + 1.1 * len(rates)), squeeze=False)
    _panel(axes[0][0], fig, cells, rates, lengths,
           f"TTFT p50: aiolayer layer-wise / {basis or 'no baseline'}\n(vLLM CPU engines, P and D on two "
           "network namespaces)",
           lambda c: f"{c['ratio']:.2f}\n{c['aiolayer_ms']:.0f} / {c['best_ms']:.0f} ms\n({c['best']})", (0.4, 1.6))
    if auto:
        _panel(axes[0][1], fig, auto, rates, lengths,
               "TTFT p50: aiolayer auto / min(layer-wise, bulk)\n(<= 1.05: as good as the better fixed mode)",
               lambda c: f"{c['ratio']:.2f}\n{c['auto_ms']:.0f} ms\nlw {c['layerwise_ms'] or 0:.0f} / "
                         f"bulk {c['bulk_ms'] or 0:.0f}", (0.8, 1.2))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
