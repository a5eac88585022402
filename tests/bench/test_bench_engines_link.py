"""``aiolayer bench vllm --link-gbit`` (bench/engines/link.py): the engine rows with P and D on two network
namespaces over a tbf-shaped veth; every answer verified, the JSON and heatmap written, nothing left behind."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from aiolayer.harness import netns
from aiolayer.bench.engines.link import cell_texts, p99
from aiolayer.bench.engines.link_rows import auto_choices, cell_key, lanes, measure_cell, prompt_sets, row_groups


def _bench(*argv: str, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aiolayer", "bench", "vllm", *argv], capture_output=True,
                          text=True, timeout=timeout, env=env)


def test_every_prompt_of_a_sweep_is_new_and_p99_is_the_slowest_of_few():
    texts = cell_texts([1.0, 0.0], [256, 2000], prompts=3, sets=2)
    every = [t for cell in texts.values() for one_set in cell for phase in one_set.values() for t in phase]
    assert len(every) == len(set(every)) == 2 * 2 * (13 + 4)   # a repeat would hit the prefix cache, skip the transfer
    assert [len(texts[0, li][1]["serial"]) for li in (0, 1)] == [12, 3]   # short prompts: more of them
    assert p99([3.0, 1.0, 2.0]) == 3.0 and p99([]) is None


def test_the_mode_rows_share_engines_and_their_requests_alternate():
    names = ["aggregated", "aiolayer", "mooncake", "aiolayer-bulk", "aiolayer-auto"]
    groups = row_groups(names)
    assert groups == [["aggregated"], ["aiolayer", "aiolayer-bulk", "aiolayer-auto"], ["mooncake"]]
    assert row_groups(names, separate=True) == [[n] for n in names]
    assert row_groups(["aggregated", "aiolayer", "mooncake"]) == [["aggregated"], ["aiolayer"], ["mooncake"]]
    assert lanes(["aggregated"], prompt_sets(groups)) == [("aggregated", 0), ("aggregated", 1), ("aggregated", 2)]
    assert lanes(groups[1], 3) == [("aiolayer", 0), ("aiolayer-bulk", 1), ("aiolayer-auto", 2)]
    assert [cell_key("1,2", k) for k in (0, 2)] == ["1,2", "1,2/2"]

    calls: list[str] = []

    def complete_as(name: str):
        async def complete(text: str, max_tokens: int):
            calls.append(f"{name}:{text}")
            raise RuntimeError("no engine")   # counted as the request's error; the order is what is tested
        return complete

    texts = [{"warmup": [f"w{k}"], "serial": [f"s{k}.{i}" for i in range(3)]} for k in range(2)]
    two = [("aiolayer", 0), ("aiolayer-bulk", 1)]
    results = measure_cell({n: complete_as(n) for n, _ in two}, two, texts, argparse.Namespace(max_tokens=2))
    assert calls == ["aiolayer:w0", "aiolayer-bulk:w1", "aiolayer:s0.0", "aiolayer-bulk:s1.0",
                     "aiolayer-bulk:s1.1", "aiolayer:s0.1", "aiolayer:s0.2", "aiolayer-bulk:s1.2"]
    assert [len(results[lane]) for lane in two] == [3, 3] and "error" in results[two[0]][0]


def test_auto_choices_are_what_p_sent_less_what_the_other_rows_asked_for():
    ok, failed = {"ttft_ms": 1.0}, {"error": "x"}
    results = {("aiolayer", 0): [ok, ok], ("aiolayer-bulk", 1): [ok, failed], ("aiolayer-auto", 2): [ok, ok]}
    # P sent 3 + 3 layer-wise (the layer-wise row's warm-up and two; auto's warm-up and two) and the bulk row's 2
    assert auto_choices({"layerwise": 6, "bulk": 2}, results) == {"layerwise": 3, "bulk": 0}


def test_auto_is_compared_with_the_better_fixed_mode_in_each_cell(tmp_path):
    from aiolayer.bench.engines.link import auto_cells
    from aiolayer.bench.engines.link_plot import plot_link

    def row(name: str, *p50s, modes=None) -> dict:
        cells = [{"link_gbit": g, "prompt_tokens": 100, "ttft_ms_median": v, **({"modes": modes} if modes else {})}
                 for g, v in zip((1.0, 0.0), p50s)]
        return {"row": name, "ran": True, "cells": cells}

    summary = [row("aiolayer", 800.0, 700.0), row("aiolayer-bulk", 1000.0, 600.0),
               row("aiolayer-auto", 820.0, 660.0, modes={"layerwise": 5, "bulk": 1})]
    cells = auto_cells(summary)
    assert [c["ratio"] for c in cells] == [1.025, 1.1] and cells[0]["modes"] == {"layerwise": 5, "bulk": 1}
    assert auto_cells(summary[:2]) == []        # without the auto row (or a fixed one): nothing to compare
    plot_link([], "", [1.0, 0.0], [100], tmp_path / "link.png", cells)
    assert (tmp_path / "link.png").stat().st_size > 1000


def test_bad_rates_or_lengths_are_refused_before_anything_starts():
    r = _bench("--link-gbit", "1,x", "--rows", "aggregated", timeout=60)
    assert r.returncode == 2 and "--link-gbit wants comma-separated numbers" in r.stderr
    r = _bench("--link-gbit", "1", "--prompt-lengths", "0", "--rows", "aggregated", timeout=60)
    assert r.returncode == 2 and "--prompt-lengths wants" in r.stderr
    r = _bench("--prompt-lengths", "256", "--rows", "aggregated", timeout=60)
    assert r.returncode == 2 and "--prompt-lengths goes with --link-gbit" in r.stderr


def test_without_iproute2_the_sweep_exits_saying_why(tmp_path):
    env = {**os.environ, "PATH": str(tmp_path)}   # no ip, no tc
    r = _bench("--link-gbit", "1", "--rows", "aggregated", "--out", str(tmp_path), timeout=60, env=env)
    assert r.returncode == 2, r.stderr
    assert "--link-gbit: cannot make the two hosts:" in r.stderr
    assert "network namespaces need root" in r.stderr or "iproute2 (ip, tc) is not installed" in r.stderr


@pytest.mark.vllm
@pytest.mark.timeout(600)
@pytest.mark.skipif(bool(netns.available()), reason=netns.available() or "available")
def test_a_small_sweep_over_a_shaped_link_verifies_every_answer_and_leaves_no_namespace(tmp_path):
    # small on purpose (2 layers, ~150-token prompts, eager, one rate); the sweep itself: docs/results.md.
    # It is also the two-host set-up docs/operations.md describes: each engine in its namespace bound to its
    # address there, the proxy beside P; a 127.0.0.1 leaked into an advertised address dials the wrong
    # namespace and fails the row. ~150 tokens: a prompt over two of vLLM's 128-token blocks.
    # aiolayer's three mode rows share one pair of engines, the fixed rows' requests naming their mode (the
    # proxy's header); auto's may also be prefilled by D itself (the proxy's --local-prefill-max-tokens).
    # float32: token equality with the aggregated engine (vLLM CPU's bf16 is not batch-invariant).
    names = "aggregated,aiolayer,aiolayer-bulk,aiolayer-auto"
    r = _bench("--link-gbit", "1", "--prompt-lengths", "150", "--rows", names, "--layers", "2", "--prompts", "2",
               "--max-tokens", "4", "--eager", "--dtype", "float32", "--out", str(tmp_path), timeout=560)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "aiolayer | 1 Gbit/s | 150 tokens: TTFT p50" in r.stderr   # a progress line per cell
    report = json.loads((tmp_path / "engines_link.json").read_text())
    assert report["config"]["engines"] == [["aggregated"], ["aiolayer", "aiolayer-bulk", "aiolayer-auto"]]
    rows = {s["row"]: s for s in report["summary"]}
    for name in ("aiolayer", "aiolayer-bulk", "aiolayer-auto"):
        assert rows[name]["ran"], rows[name]
        (cell,) = rows[name]["cells"]
        assert (cell["link_gbit"], cell["prompt_tokens"]) == (1.0, 150)
        assert (cell["verified"], cell["failed"], cell["differ"]) == (8, 0, 0), (name, cell)   # 4x 2 below 1,024
    # P sent each fixed row's warm-up and eight requests the way the request asked; auto's went either way,
    # or (short prompts, a real D answering them alone) were prefilled by D: each answer equal all the same
    chose = rows["aiolayer-auto"]["cells"][0]["modes"]
    assert sum(chose.values()) == 9 and chose["local"] >= 1, chose
    assert rows["aiolayer-bulk"]["how"]["sends_by_mode"] == {"layerwise": 9 + chose["layerwise"],
                                                             "bulk": 9 + chose["bulk"]}, rows["aiolayer-bulk"]["how"]
    (cell,) = rows["aiolayer"]["cells"]
    assert cell["ttft_ms_median"] > 0 and cell["ttft_ms_p99"] >= cell["ttft_ms_median"]
    assert "veth 10." in rows["aiolayer"]["how"]["transport"]
    kv_bytes = 150 * report["config"]["kv_bytes_per_token"]             # the KV crossed the namespaces' link
    assert cell["link_mb_per_request"] * 1e6 >= 0.9 * kv_bytes, (cell, kv_bytes)
    checks = rows["aiolayer"]["how"]["bytes"]                            # every layer of every transfer checked
    assert checks["verified"] == checks["receives_finished"] > 0 and checks["mismatch"] == 0, checks
    assert report["ratios"][0]["ratio"] > 0
    assert (tmp_path / "engines_link.png").stat().st_size > 1000
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    assert not [ns for ns in report["config"]["namespaces"] if ns in left], left
