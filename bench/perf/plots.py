"""The benchmark's PNGs: a Gantt chart of one request per mode (``--timeline``) and the sweep's TTFT plot.

matplotlib (the ``bench`` extra) with the Agg back-end: no display is needed.
"""

from __future__ import annotations

from pathlib import Path

COLORS = {"layerwise": "tab:blue", "bulk": "tab:orange", "auto": "tab:green", "threaded": "tab:red",
          "raw_mooncake": "tab:gray", "raw_tcp": "tab:brown", "memcpy": "tab:pink"}
STYLES = {"auto": "--", "raw_mooncake": ":"}
TIMELINE_MODES = ("layerwise", "bulk", "threaded", "auto")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# --- timeline ------------------------------------------------------------------------------------

def plot_timeline(report: dict, path: Path) -> Path:
    """One panel per prefill mode: per layer, compute and KV write on P, the transfer, arrival at D."""
    plt = _pyplot()
    from matplotlib.patches import Patch
    from matplotlib.lines import Line2D

    modes = [m for m in TIMELINE_MODES if m in report["modes"] and report["modes"][m].get("timeline")]
    if "auto" in modes and "layerwise" in modes and report["modes"]["auto"].get("choice") == "layerwise":
        modes.remove("auto")   # the same plan as layerwise: one panel less to read
    if not modes:
        raise ValueError("no prefill mode with a timeline in this report")
    layers = report["config"]["num_layers"]
    height = 1.2 + 0.12 * layers * len(modes) + 0.6 * len(modes)
    fig, axes = plt.subplots(len(modes), 1, figsize=(11, height), sharex=True, squeeze=False)
    end = max(report["modes"][m]["timeline"]["done_s"] for m in modes) * 1e3
    for ax, mode in zip(axes[:, 0], modes):
        _timeline_panel(ax, mode, report["modes"][mode], layers)
    axes[-1, 0].set_xlabel("time since the forward pass started (ms)")
    axes[-1, 0].set_xlim(0, end * 1.04)
    cfg = report["config"]
    fig.suptitle(f"One request, layer by layer: {cfg['prompt_tokens']} tokens, {layers} layers, "
                 f"{cfg['bytes_per_request'] / 2**20:.0f} MiB of KV, {cfg['layer_ms']:g} ms compute per layer",
                 fontsize=11)
    handles = [Patch(color="#9ecae1", label="compute on P"), Patch(color="#3182bd", label="KV write on P"),
               Patch(color="#fd8d3c", label="transfer in flight (submitted -> landed)"),
               Line2D([], [], color="0.6", lw=1, label="waiting to be submitted"),
               Line2D([], [], marker="|", color="k", ls="", ms=7, label="arrived at D"),
               Line2D([], [], color="k", ls="--", lw=1, label="forward done"),
               Line2D([], [], color="red", lw=1.5, label="D acknowledged DONE (TTFT)")]
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.75 / height, 1, 1 - 0.45 / height))   # room for the legend and the title
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _timeline_panel(ax, mode: str, r: dict, layers: int) -> None:
    t = r["timeline"]
    for layer, (start, computed, written) in enumerate(t["phases"]):
        ax.barh(layer, (computed - start) * 1e3, left=start * 1e3, height=0.8, color="#9ecae1", lw=0)
        ax.barh(layer, (written - computed) * 1e3, left=computed * 1e3, height=0.8, color="#3182bd", lw=0)
    for layer, handed, submitted, landed in t["layers"]:
        ax.plot([handed * 1e3, submitted * 1e3], [layer, layer], color="0.6", lw=1)
        ax.barh(layer, (landed - submitted) * 1e3, left=submitted * 1e3, height=0.45, color="#fd8d3c", lw=0)
        ax.plot(landed * 1e3, layer, marker="|", color="k", ms=5)
    ax.axvline(t["forward_s"] * 1e3, color="k", ls="--", lw=1)
    ax.axvline(t["done_s"] * 1e3, color="red", lw=1.5)
    label = f"{mode} ({r['choice']})" if "choice" in r else mode
    ax.set_title(f"{label}: TTFT {r['ttft_ms']:.0f} ms, exposed {r['exposed_ms']:.1f} ms, "
                 f"{r['gbps']:.2f} GB/s while in flight", fontsize=9, loc="left")
    ax.set_ylabel("layer")
    ax.set_ylim(layers - 0.5, -0.5)
    ax.grid(axis="x", alpha=0.3)


# --- sweep ---------------------------------------------------------------------------------------

def plot_sweep(rows: list[dict], path: Path, threshold: int | None, auto_min_tokens: int) -> Path:
    """Four panels: TTFT by prompt length, TTFT relative to bulk, by layer count, by block size."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    (a, b), (c, d) = axes
    _lines(a, rows, "prompt_tokens", "ttft_ms")
    layers = next((r["num_layers"] for r in rows if r["axis"] == "prompt_tokens"), "?")
    a.set(xscale="log", yscale="log", xlabel="prompt length (tokens)", ylabel="TTFT (ms)",
          title=f"TTFT by prompt length ({layers} layers; compute per layer grows with the prompt)")
    _ratio(b, rows, threshold, auto_min_tokens)
    _lines(c, rows, "num_layers", "ttft_ms")
    c.set(xscale="log", xlabel="layers", ylabel="TTFT (ms)", title="TTFT by layer count (default prompt)")
    _lines(d, rows, "block_size", "ttft_ms")
    d.set(xscale="log", xlabel="block size (tokens), D's blocks scattered", ylabel="TTFT (ms)",
          title="TTFT by block size (one run per block)")
    for ax in axes.flat:
        ax.grid(alpha=0.3, which="both")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "not measured", transform=ax.transAxes, ha="center", va="center", color="0.5")
    for ax, key in ((a, "prompt_tokens"), (b, "prompt_tokens"), (c, "num_layers"), (d, "block_size")):
        xs = sorted({r[key] for r in rows if r["axis"] == key})
        if xs:
            ax.set_xticks(xs, [str(x) for x in xs])
            ax.minorticks_off()
    fig.suptitle("aiolayer bench transfer --sweep: medians per point; raw_mooncake's line is its transfer time alone",
                 fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _series(rows, axis: str, mode: str, key: str):
    pts = sorted((r[axis], r[key]) for r in rows if r["axis"] == axis and r["mode"] == mode and r[key] is not None)
    return [p[0] for p in pts], [p[1] for p in pts]


def _lines(ax, rows, axis: str, key: str) -> None:
    for mode in dict.fromkeys(r["mode"] for r in rows):
        field = "transfer_ms" if mode in ("raw_mooncake", "raw_tcp", "memcpy") else key
        xs, ys = _series(rows, axis, mode, field)
        if xs:
            label = f"{mode} (transfer alone)" if field != key else mode
            ax.plot(xs, ys, marker="o", ms=4, ls=STYLES.get(mode, "-"), color=COLORS.get(mode), label=label)


def _ratio(ax, rows, threshold: int | None, auto_min_tokens: int) -> None:
    bulk = dict(zip(*_series(rows, "prompt_tokens", "bulk", "ttft_ms")))
    for mode in ("layerwise", "auto", "threaded"):
        xs, ys = _series(rows, "prompt_tokens", mode, "ttft_ms")
        pts = [(x, y / bulk[x]) for x, y in zip(xs, ys) if bulk.get(x)]
        if pts:
            ax.plot(*zip(*pts), marker="o", ms=4, ls=STYLES.get(mode, "-"), color=COLORS.get(mode), label=mode)
    ax.axhline(1.0, color=COLORS["bulk"], lw=1.5, label="bulk (= 1)")
    ax.axvline(auto_min_tokens, color=COLORS["auto"], ls=":", lw=1.5, label=f"--auto-min-tokens {auto_min_tokens}")
    if threshold:
        ax.axvline(threshold, color="k", ls="--", lw=1, label=f"measured: layer-wise wins from {threshold}")
    ax.set(xscale="log", xlabel="prompt length (tokens)", ylabel="TTFT / bulk TTFT (lower is better)",
           title="Where layer-wise pays: TTFT relative to bulk")


# --- two hosts -------------------------------------------------------------------------------------

def plot_two_hosts(rows: list[dict], path: Path) -> Path:
    """Per link rate (one tick each, unlimited last): TTFT per mode, and the hidden fraction."""
    plt = _pyplot()
    fig, (ax_t, ax_h) = plt.subplots(1, 2, figsize=(12, 4.5))
    xs = list(range(len(rows)))
    labels = [f"{r['label']}\nlayer {r['layer_transfer_ms_measured']:.1f} ms" if r.get("layer_transfer_ms_measured")
              else r["label"] for r in rows]
    modes = [m for m in ("layerwise", "bulk", "threaded", "raw_mooncake") if m in rows[0]["modes"]]
    for mode in modes:
        key = "transfer_ms" if mode == "raw_mooncake" else "ttft_ms"
        what = "transfer alone" if key == "transfer_ms" else "TTFT"
        ax_t.plot(xs, [r["modes"][mode][key] for r in rows], marker="o", color=COLORS[mode],
                  linestyle=STYLES.get(mode, "-"), label=f"{mode} ({what})")
        if mode in ("layerwise", "bulk", "threaded"):
            ax_h.plot(xs, [r["modes"][mode]["hidden_fraction"] for r in rows], marker="o", color=COLORS[mode],
                      label=mode)
    compute = rows[0]["layer_compute_ms"]
    ax_t.set(title=f"TTFT by link rate (compute {compute:g} ms per layer)", ylabel="ms", yscale="log")
    ax_h.set(title="hidden fraction (1 = transfer fully behind compute)", ylabel="hidden fraction")
    ax_h.axhline(0, color="black", linewidth=0.5)
    for ax in (ax_t, ax_h):
        ax.set_xticks(xs, labels)
        ax.set_xlabel("link (tbf) and one layer's transfer time measured there (raw Mooncake)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
