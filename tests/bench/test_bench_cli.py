"""The benchmark end to end with a tiny shape: every mode verified, the sweep's CSV/PNG, the timeline PNG.

Real processes and the real Mooncake engine (as ``make bench`` runs them), sized to take seconds.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

pytest.importorskip("mooncake.engine")
pytest.importorskip("matplotlib")

from aiolayer.bench.perf.harness import MODES

TINY = ["--backend", "mooncake", "--prompt-tokens", "64", "--num-layers", "3", "--kv-heads", "2",
        "--head-dim", "64", "--layer-ms", "1"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _bench(*args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aiolayer", "bench", "transfer", *TINY, *args],
                          capture_output=True, text=True, timeout=timeout)


def _is_png(path) -> bool:
    return path.is_file() and path.stat().st_size > 1000 and path.read_bytes()[:8] == PNG_MAGIC


def test_every_mode_verified_with_figures_and_timeline(tmp_path):
    proc = _bench("--requests", "2", "--warmup", "1", "--timeline", "--auto-min-tokens", "128", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "latest.json").read_text())
    assert report["verified"] is True
    assert set(report["modes"]) == set(MODES)
    made = report["provenance"]   # a figure quoted from it names its date, commit, host and command
    assert made["commit"] and not made["commit"].startswith("unknown") and made["host"] and made["cpu"], made
    assert made["utc"].startswith("20") and "bench transfer" in made["command"], made
    assert "hidden = 1 - exposed / raw_mooncake transfer time" in proc.stdout
    for name, r in report["modes"].items():
        assert r["verified"] is True, name
        assert r["requests"] == 2
        assert r["gbps"] > 0 and r["efficiency"] is not None and r["cpu_s_per_gb"] is not None
        if name in ("raw_mooncake", "raw_tcp", "memcpy"):
            assert r["ttft_ms"] is None and r["ceiling_variant"] in r["variants"]
        else:
            assert r["ttft_ms"] > 0 and r["hidden_fraction"] is not None and r["ttft_vs_threaded"] is not None
            if name == "bulk":   # every layer handed over after the forward, each timed
                assert r["save_kv_layer_ns"]["count"] == 2 * 3 and "save_kv_floor_ns" not in r
            else:                # layers 0 and 2 time the hand-off, layer 1 the floor beside it
                assert r["save_kv_layer_ns"]["count"] == 2 * 2 and r["save_kv_floor_ns"]["count"] == 2 * 1
            assert len(r["timeline"]["layers"]) == 3 and len(r["timeline"]["phases"]) == 3
    assert report["modes"]["raw_mooncake"]["efficiency"] == 1.0
    # the layer-at-a-time ceilings: timer-paced, and driven by the forward at the runtime's poll tick
    assert {"per_layer_paced", "per_layer_1ms"} <= set(report["modes"]["raw_mooncake"]["variants"])
    assert report["modes"]["layerwise"]["efficiency_vs_raw_per_layer_1ms"] > 0
    assert report["modes"]["auto"]["choice"] == "bulk"       # 64 tokens < --auto-min-tokens
    for header in ("TTFT ms", "x thr", "hidden", "eff", "verified", "against this host's floor"):
        assert header in proc.stdout
    assert _is_png(tmp_path / "timeline.png")


def test_sweep_writes_csv_json_and_png(tmp_path):
    proc = _bench("--sweep", "--sweep-tokens", "32,64", "--sweep-layers", "2", "--sweep-block-sizes", "32",
                  "--sweep-modes", "layerwise,bulk,raw_mooncake", "--sweep-requests", "1", "--out", str(tmp_path),
                  timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    with open(tmp_path / "sweep.csv") as f:
        rows = list(csv.DictReader(f))
    points = {(r["axis"], r["prompt_tokens"], r["num_layers"], r["block_size"]) for r in rows}
    assert points == {("prompt_tokens", "32", "3", "16"), ("prompt_tokens", "64", "3", "16"),
                      ("num_layers", "64", "2", "16"), ("block_size", "64", "3", "32")}
    assert {r["mode"] for r in rows} == {"layerwise", "bulk", "raw_mooncake"}
    assert all(r["verified"] == "True" for r in rows)
    summary = json.loads((tmp_path / "sweep.json").read_text())
    assert summary["skipped"] == [] and len(summary["rows"]) == len(rows)
    assert _is_png(tmp_path / "sweep.png")


def test_bench_without_a_subcommand_is_the_transfer_benchmark(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "aiolayer", "bench", "--modes", "layerwise,nope", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "unknown mode" in proc.stderr, proc.stderr[-2000:]
    for modes in (",", "threaded,raw_mooncake"):   # nothing left to measure: no "verified" run of no rows
        proc = subprocess.run([sys.executable, "-m", "aiolayer", "bench", "--backend", "memory", "--modes", modes,
                               "--out", str(tmp_path)], capture_output=True, text=True, timeout=30)
        assert proc.returncode == 2 and "no mode to run" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "latest.json").exists()


@pytest.mark.parametrize("args, words", [
    (["soak", "--fault-rate", "1.5"], "--fault-rate"),
    (["soak", "--requests", "0"], "--requests"),
    (["scale", "--prefill-ranks", "0"], "--prefill-ranks"),
    (["scale", "--prefill-ranks", "3", "--decode-ranks", "4"], "do not split evenly"),
    # the transfer benchmark's own: an endless --layer-ms overflowed a deadline once the harness was up
    (["transfer", "--backend", "memory", "--layer-ms", "inf"], "--layer-ms must be 0 to 60000"),
    (["transfer", "--backend", "memory", "--layer-ms", "nan"], "--layer-ms must be 0 to 60000"),
    (["transfer", "--backend", "memory", "--requests", "0"], "--requests and --prompt-tokens must be >= 1"),
    (["transfer", "--backend", "memory", "--prompt-tokens", "0"], "--requests and --prompt-tokens must be >= 1"),
])
def test_scale_and_soak_refuse_bad_arguments_with_a_message(args, words):
    proc = subprocess.run([sys.executable, "-m", "aiolayer", "bench", *args], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and words in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("old, new, words", [
    (["--scenario", "soak", "--fault-rate", "1.5"], "aiolayer bench soak", "--fault-rate must be within"),
    (["--scenario=scale", "--prefill-ranks", "0"], "aiolayer bench scale", "--prefill-ranks"),
    (["--engine", "vllm", "--engine-rows", "aggregated,nope"], "aiolayer bench vllm", "unknown --rows ['nope']"),
])
def test_the_spellings_before_subcommands_still_run_and_name_the_new_command(old, new, words):
    """``--scenario NAME`` and ``--engine vllm`` (its ``--engine-*`` options renamed) work for one release,
    with one line on stderr saying what to write instead."""
    proc = subprocess.run([sys.executable, "-m", "aiolayer", "bench", *old], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and words in proc.stderr, proc.stderr[-2000:]
    notes = [line for line in proc.stderr.splitlines() if "deprecated" in line]
    assert len(notes) == 1 and f"use `{new}`" in notes[0], proc.stderr[-2000:]


def test_bench_two_hosts_writes_json_and_png_and_every_rate_verifies(tmp_path):
    from aiolayer.harness import netns

    why = netns.available()
    if why:
        pytest.skip(why)
    # 4 MiB per request: well past tbf's burst (10 ms of traffic), so the 1 Gbit/s rate shows
    proc = _bench("--two-hosts", "--link-gbit", "1,0", "--prompt-tokens", "256", "--num-layers", "4",
                  "--kv-heads", "8", "--head-dim", "128", "--layer-ms", "2", "--requests", "1", "--warmup", "1",
                  "--out", str(tmp_path), timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "two_hosts.json").read_text())
    assert report["verified"] is True and [r["label"] for r in report["rates"]] == ["1gbit", "unlimited"]
    for row in report["rates"]:
        assert row["verified"] is True, row
        assert set(row["modes"]) == {"layerwise", "bulk", "threaded", "raw_mooncake"}, row
        assert all(m["verified"] for m in row["modes"].values()), row
        assert row["ttft_ms_layerwise"] > 0 and row["ttft_ms_bulk"] > 0 and row["hidden_fraction_layerwise"] is not None
    # the link was really shaped: 1 Gbit/s moves the same bytes slower than the unlimited veth
    assert report["rates"][0]["link_gbps_raw"] < report["rates"][1]["link_gbps_raw"], report["rates"]
    assert report["rates"][0]["link_gbps_raw"] < 0.25, report["rates"]     # 1 Gbit/s = 0.125 GB/s (+ tbf burst)
    assert _is_png(tmp_path / "two_hosts.png")


def test_bench_two_hosts_refuses_bad_rates(tmp_path):
    proc = _bench("--two-hosts", "--link-gbit", "-1", "--out", str(tmp_path), timeout=60)
    assert proc.returncode == 2 and "--link-gbit" in proc.stderr, proc.stderr[-2000:]
