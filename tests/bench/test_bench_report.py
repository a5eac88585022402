"""The benchmark's arithmetic without processes: busy time, summaries, cross-mode figures, the threshold."""

from __future__ import annotations

import argparse

import pytest

from aiolayer.bench.perf.harness import busy_seconds, limit_sample
from aiolayer.bench.main import add_bench_args
from aiolayer.bench.perf.report import derive, print_table, summarize
from aiolayer.bench.perf.sweep import crossover, point_args, sweep_points


def _prefill(ttft, exposed, busy_ms, nbytes=10**9, cpu=0.1):
    return {"ok": True, "reason": "", "verified": True, "bytes": nbytes, "ttft_ms": ttft, "exposed_ms": exposed,
            "forward_ms": ttft - exposed, "forward_cpu_ms": ttft - exposed, "transfer_ms": busy_ms,
            "gbps": nbytes / (busy_ms / 1e3) / 1e9, "cpu_s": cpu, "handoff_ns": [100, 200, 5000],
            "layers": [[0, 0.0, 0.001, 0.002]], "phases": [(0.0, 0.001, 0.0012)], "done_s": ttft / 1e3}


def test_busy_seconds_is_the_union_of_intervals():
    assert busy_seconds([]) == 0
    assert busy_seconds([(0, 1), (0.5, 2), (3, 4)]) == pytest.approx(3.0)
    assert busy_seconds([(3, 4), (0, 1)]) == pytest.approx(2.0)


def test_derived_figures_against_threaded_and_raw():
    modes = {
        "layerwise": summarize([_prefill(110, 10, 400), _prefill(120, 12, 500)], []),
        "threaded": summarize([_prefill(200, 50, 800)], []),
        "raw_mooncake": summarize([limit_sample({"batch_sync": {"s": 0.5, "cpu_s": 0.5, "ceiling": True},
                                                 "submit_poll": {"s": 0.25, "cpu_s": 0.01, "ceiling": True},
                                                 "submit_poll+compute": {"s": 0.4, "cpu_s": 0.01, "ceiling": False},
                                                 "per_layer_1ms": {"s": 0.8, "cpu_s": 0.01, "ceiling": False}},
                                                True, 10**9)], []),
    }
    basis = derive(modes)
    raw, lw = modes["raw_mooncake"], modes["layerwise"]
    assert raw["ceiling_variant"] == "submit_poll" and raw["gbps"] == pytest.approx(4.0)
    assert raw["efficiency"] == 1.0 and raw["hidden_fraction"] is None
    assert lw["ttft_ms"] == pytest.approx(115) and lw["exposed_ms"] == pytest.approx(11)
    assert lw["hidden_fraction"] == pytest.approx(1 - 11 / 250, abs=1e-3)
    assert lw["efficiency"] == pytest.approx(lw["gbps"] / 4.0, abs=1e-3)
    assert lw["efficiency_vs_batch_sync"] == pytest.approx(lw["gbps"] / 2.0, abs=1e-3)
    assert lw["efficiency_vs_raw_per_layer_1ms"] == pytest.approx(lw["gbps"] / 1.25, abs=1e-3)
    assert lw["efficiency_vs_raw_per_layer"] is None   # no such variant measured
    assert lw["ttft_vs_threaded"] == pytest.approx(115 / 200, abs=1e-3)
    assert lw["save_kv_layer_ns"]["max"] == 5000 and lw["cpu_s_per_gb"] == pytest.approx(0.1)
    assert "raw_mooncake" in basis["transfer_alone"]


def test_table_prints_every_mode(capsys):
    modes = {"layerwise": summarize([_prefill(110, 10, 400)], []),
             "memcpy": summarize([limit_sample({"numpy_copyto": {"s": 0.1, "cpu_s": 0.1, "ceiling": True}},
                                               True, 10**9)], [])}
    derive(modes)
    cfg = {"num_layers": 32, "kv_heads": 8, "head_dim": 128, "dtype": "float16", "prompt_tokens": 2048,
           "block_size": 16, "bytes_per_request": 2**28, "layer_ms": 3.0, "backend": "mooncake", "requests": 1}
    print_table({"config": cfg, "modes": modes})
    out = capsys.readouterr().out
    assert "layerwise" in out and "memcpy" in out and "10.00" in out


def test_crossover_is_where_layerwise_wins_from_then_on():
    def rows(pairs):
        return [{"axis": "prompt_tokens", "prompt_tokens": t, "mode": mode, "ttft_ms": v}
                for t, (lw, bulk) in pairs.items() for mode, v in (("layerwise", lw), ("bulk", bulk))]

    assert crossover(rows({256: (10, 9), 512: (11, 12), 1024: (20, 30)})) == 512
    assert crossover(rows({256: (10, 9), 512: (13, 12), 1024: (20, 30)})) == 1024
    assert crossover(rows({256: (8, 9), 512: (11, 12)})) == 256
    assert crossover(rows({256: (10, 9), 512: (13, 12)})) is None


def test_sweep_points_scale_compute_with_the_prompt():
    p = argparse.ArgumentParser()
    add_bench_args(p)
    args = p.parse_args(["transfer", "--sweep-tokens", "1024,4096", "--sweep-layers", "16",
                         "--sweep-block-sizes", "64"])
    points = sweep_points(args)
    assert [axis for axis, _ in points] == ["prompt_tokens", "prompt_tokens", "num_layers", "block_size"]
    a = point_args(args, points[1][1], ["layerwise"])
    assert a.layer_ms == pytest.approx(args.layer_ms * 2) and a.requests == args.sweep_requests
    assert point_args(args, points[3][1], ["bulk"]).scatter is True


def test_a_fault_row_that_breaks_its_guarantee_is_named_so_the_run_fails():
    """``bench faults`` failed a run only on a lost transfer: a kill ending past its deadline, or a slow D
    whose transfer failed, printed "failed (visible)" and exited 0."""
    from aiolayer.bench.scenarios.fault_checks import broken
    from aiolayer.bench.scenarios.faults import FAULT_TIMEOUTS

    t = FAULT_TIMEOUTS

    healthy = {"lost": 0, "good_ok": True, "good_verified": True, "handoff_ns": {"max": 10_000}}
    late_kill = {**healthy, "bad_ok": False, "bad_reason": "TransferTimeout", "terminal_s": 14.9, "deadline_s": 3.5}
    assert broken("scenario_kill", late_kill, t) == "it ended past its deadline"
    assert broken("scenario_kill", {**late_kill, "terminal_s": 3.0}, t) == ""
    assert broken("scenario_slow", {**healthy, "bad_ok": False, "bad_verified": False}, t) == "a slow peer failed"
    assert broken("scenario_refuse", {**healthy, "bad_ok": False, "bad_reason": None}, t).startswith("the row lacks")
