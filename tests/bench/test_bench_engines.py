"""``aiolayer bench vllm`` (bench/engines/run.py): its rows are verified against the aggregated
engine, failures and differing answers are counted, and a real small run writes its JSON and PNG."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from aiolayer.bench.engines.summary import bad_rows, print_table, summarize


def _row(name: str, tokens: list[list[int]], errors: tuple[int, ...] = ()) -> dict:
    results = [{"error": "TimeoutError: x"} if i in errors else {"ttft_ms": 10.0 + i, "total_ms": 50.0, "tokens": t}
               for i, t in enumerate(tokens)]
    return {"row": name, "ran": True, "how": {}, "serial": results, "burst": results, "wall_s": 1.0}


def test_rows_are_checked_against_the_aggregated_engine_and_every_bad_answer_counts():
    ref = _row("aggregated", [[1, 2], [3, 4], [5, 6]])
    good = _row("aiolayer", [[1, 2], [3, 4], [5, 6]])
    bad = _row("mooncake", [[1, 2], [3, 9], [5, 6]], errors=(2,))
    missing = {"row": "nixl", "ran": False, "error": "ServerError: no start"}
    by_row = {s["row"]: s for s in summarize([ref, good, bad, missing])}
    assert by_row["aggregated"]["c1"]["verified"] is None   # the reference checks nothing
    assert by_row["aiolayer"]["c1"] == {**by_row["aiolayer"]["c1"], "verified": 3, "failed": 0, "differ": 0}
    assert (by_row["mooncake"]["c1"]["failed"], by_row["mooncake"]["c1"]["differ"]) == (1, 1)
    assert by_row["mooncake"]["c1"]["verified"] == 1
    assert by_row["nixl"] == missing
    ref_failed = _row("aggregated", [[1, 2], [3, 4]], errors=(1,))
    unchecked = {s["row"]: s for s in summarize([ref_failed, _row("aiolayer", [[1, 2], [3, 4]])])}["aiolayer"]["c1"]
    assert (unchecked["verified"], unchecked["differ"], unchecked["unchecked"]) == (1, 0, 1)   # not "differ"


def test_a_drift_with_every_byte_verified_is_numerics_and_a_byte_mismatch_fails():
    """aiolayer's rows check every layer's bytes: a drift then is numerics (counted, not a failure); a
    mismatch fails the row even with equal tokens, and a row without byte checks cannot excuse a drift."""
    ref = _row("aggregated", [[1, 2], [3, 4]])
    drift = [[1, 2], [3, 9]]
    checked = {"verified": 40.0, "mismatch": 0.0, "receives_finished": 40.0, "receives_failed": 0.0}
    numerics = {**_row("aiolayer", drift), "how": {"bytes": checked}}
    corrupt = {**_row("aiolayer-bulk", [[1, 2], [3, 4]]), "how": {"bytes": {**checked, "mismatch": 1.0}}}
    peer = _row("mooncake", drift)
    summary = summarize([ref, numerics, corrupt, peer])
    by_row = {s["row"]: s for s in summary}
    assert (by_row["aiolayer"]["c1"]["differ"], by_row["aiolayer"]["c1"]["numerics"]) == (1, 1)
    assert by_row["mooncake"]["c1"]["numerics"] == 0
    assert bad_rows(summary) == ["aiolayer-bulk", "mooncake"]
    unsettled = {**numerics, "how": {"bytes": {**checked, "receives_failed": 1.0}}}
    assert bad_rows(summarize([ref, unsettled])) == ["aiolayer"]   # a failed receive: not all verified
    unchecked = {**numerics, "how": {"bytes": {**checked, "verified": 39.0}}}
    assert bad_rows(summarize([ref, unchecked])) == ["aiolayer"]   # one transfer not checked: drift unexplained


def test_a_row_that_did_not_run_or_a_run_without_its_reference_fails(capsys):
    """A row asked for and not measured (its engines failed to start) is no pass; nor is a run whose
    reference did not run or was left out: no answer of the others was compared."""
    ref, good = _row("aggregated", [[1, 2], [3, 4]]), _row("aiolayer", [[1, 2], [3, 4]])
    down = {"row": "aiolayer-bulk", "ran": False, "error": "ServerError: P did not start"}
    assert bad_rows(summarize([ref, good, down])) == ["aiolayer-bulk"]
    wrong = _row("aiolayer", [[9, 9], [9, 9]])
    no_ref = {"row": "aggregated", "ran": False, "error": "ServerError: no start"}
    assert bad_rows(summarize([no_ref, wrong])) == ["aggregated"]
    (left_out,) = bad_rows(summarize([wrong]))
    assert left_out.startswith("aggregated (the reference")
    print_table(summarize([wrong]))
    assert "not compared" in capsys.readouterr().out   # not "reference"


def test_a_row_is_compared_with_its_own_p_alone_request_by_request():
    """The host's speed drifts over seconds: the row's TTFT over its P's, paired, is the median of the
    per-request differences, not the difference of medians; a failed request on either side drops its pair."""
    ref = _row("aggregated", [[1], [2], [3], [4]])
    row = _row("aiolayer", [[1], [2], [3], [4]])
    row["serial"] = [{**r, "ttft_ms": t} for r, t in zip(row["serial"], (100.0, 300.0, 110.0, 290.0))]
    row["p_alone"] = [{"ttft_ms": t} for t in (80.0, 270.0, 95.0)] + [{"error": "TimeoutError: x"}]
    by_row = {s["row"]: s for s in summarize([ref, row])}
    c1 = by_row["aiolayer"]["c1"]
    assert (c1["p_alone_ms_median"], c1["over_p_alone_ms_median"], c1["p_alone_failed"]) == (95.0, 20.0, 1)
    assert by_row["aggregated"]["c1"]["p_alone_ms_median"] is None   # no P of its own


def test_rows_run_together_are_compared_round_by_round(capsys):
    """--together: each row against each other one in the same round, the median of the rounds'
    differences (not the difference of medians) and the rounds it was lower in; a failed request drops
    its round; a plain run's rows, measured minutes apart, get no such comparison."""
    rows = [_row(name, [[1], [2], [3], [4]]) for name in ("aggregated", "aiolayer", "mooncake")]
    for row, ttfts in zip(rows, ((150.0, 250.0, 160.0, 240.0), (180.0, 290.0, 170.0, 999.0),
                                  (200.0, 280.0, 175.0, 260.0))):
        row["serial"] = [{**r, "ttft_ms": t} for r, t in zip(row["serial"], ttfts)]
        row["together"] = True
    rows[1]["serial"][3] = {"error": "TimeoutError: x"}
    for row, alone in zip(rows[1:], ((150.0, 250.0, 150.0, 200.0), (190.0, 250.0, 170.0, 230.0))):
        row["p_alone"] = [{"ttft_ms": t} for t in alone]   # each P's own speed, the same rounds
    summary = summarize(rows)
    by_row = {s["row"]: s["c1"]["same_round_vs"] for s in summary}
    assert by_row["aiolayer"] == {
        "aggregated": {"median_ms": 30.0, "lower_in": 0, "rounds": 3, "ci95_ms": None},   # no P of its own
        "mooncake": {"median_ms": -5.0, "lower_in": 2, "rounds": 3, "ci95_ms": None,
                     # over each one's P: (30, 40, 20) against (10, 30, 5), the errored round left out
                     "over_p_median_ms": 15.0, "over_p_lower_in": 0, "over_p_rounds": 3, "over_p_ci95_ms": None}}
    assert by_row["mooncake"]["aiolayer"]["median_ms"] == 5.0 and by_row["mooncake"]["aiolayer"]["lower_in"] == 1
    from aiolayer.bench.engines.summary import print_table
    print_table(summary)
    out = capsys.readouterr().out
    few = " (too few rounds for a 95% interval)"
    assert (f"aiolayer against mooncake, round by round: -5.0 ms (median of the rounds' differences){few}, "
            f"lower in 2 of 3 rounds; over each one's own P: +15.0 ms{few}, lower in 0 of 3") in out
    assert f"aiolayer against aggregated, round by round: +30.0 ms (median of the rounds' differences){few}" in out
    assert "mooncake against aiolayer" not in out and "aggregated against" not in out   # each pair once
    plain = summarize([{k: v for k, v in row.items() if k != "together"} for row in rows])
    assert all("same_round_vs" not in s["c1"] for s in plain)


def test_a_round_by_round_difference_is_resolved_only_where_its_95_percent_interval_excludes_zero(capsys):
    """The interval is the sign test's (order statistics 4 and 13 of 16 rounds): rounds that swing by
    hundreds of ms either way leave a 30 ms median unresolved; the same median with a tight spread does not."""
    from aiolayer.bench.engines.summary import median_ci95, print_table

    assert median_ci95([5.0] * 5) is None and median_ci95(list(range(6))) == (0, 5)
    assert median_ci95([float(x) for x in range(16, 0, -1)]) == (4.0, 13.0)
    swinging = [-300.0, 400.0, -250.0, 350.0, 30.0, 30.0, -200.0, 300.0, 30.0, 30.0, -150.0, 250.0, 30.0, 30.0,
                -100.0, 200.0]
    tight = [20.0 + i for i in range(16)]
    rows = [_row(name, [[1]] * 16) for name in ("aggregated", "aiolayer", "mooncake")]
    for row, diffs in zip(rows, ([0.0] * 16, swinging, tight)):
        row["serial"] = [{**r, "ttft_ms": 1000.0 + d} for r, d in zip(row["serial"], diffs)]
        row["together"] = True
    print_table(summarize(rows))
    out = capsys.readouterr().out
    assert "aiolayer against aggregated, round by round: +30.0 ms (median of the rounds' differences) " \
           "[95% -150.0 to +250.0: not resolved]" in out
    assert "mooncake against aggregated, round by round: +27.5 ms (median of the rounds' differences) " \
           "[95% +23.0 to +32.0: resolved]" in out


def test_a_row_whose_engines_fail_to_stop_fails_alone_when_rows_run_together(monkeypatch):
    """--together holds every row's engines at once: one row's stop raising (its byte counts are read
    then) is that row's failure, as in a plain run; the other rows keep their figures."""
    import argparse
    import contextlib
    from types import SimpleNamespace

    from aiolayer.bench.engines import together
    from aiolayer.bench.engines.run import SYSTEMS

    stopped = []

    def system(name: str, stop_error: Exception | None):
        @contextlib.contextmanager
        def start(_model, _args):
            async def complete(text: str, max_tokens: int):
                return SimpleNamespace(ttft_s=0.01, elapsed_s=0.02, token_ids=[len(text), max_tokens])
            yield complete, {"engine": name}
            stopped.append(name)
            if stop_error is not None:
                raise stop_error
        return start

    monkeypatch.setitem(SYSTEMS, "fake-good", system("fake-good", None))
    monkeypatch.setitem(SYSTEMS, "fake-bad", system("fake-bad", RuntimeError("metrics gone")))
    args = argparse.Namespace(together_pause=0.0, max_tokens=2)
    texts = {"warmup": ["w"], "serial": ["a", "bb"], "burst": ["c", "d"], "alone": ["e", "f"], "alone_warmup": ["g"]}
    rows = {r["row"]: r for r in together.run_rows(["fake-good", "fake-bad"], None, args, texts)}
    assert sorted(stopped) == ["fake-bad", "fake-good"]
    assert rows["fake-bad"] == {"row": "fake-bad", "ran": False,
                                "error": "stopping its engines: RuntimeError: metrics gone"}
    assert rows["fake-good"]["ran"] and len(rows["fake-good"]["serial"]) == 2 == len(rows["fake-good"]["burst"])


def test_the_plot_marks_each_rows_p_alone_where_it_has_one(tmp_path):
    from aiolayer.bench.engines.plot import plot_engines

    ref, row = _row("aggregated", [[1], [2]]), _row("aiolayer", [[1], [2]])
    row["p_alone"] = [{"ttft_ms": 9.0}, {"ttft_ms": 11.0}]
    summary = summarize([ref, row])
    assert [s["c1"]["p_alone_ms_median"] for s in summary] == [None, 10.0]
    path = plot_engines(summary, tmp_path / "engines.png")
    assert path.stat().st_size > 1000
    plot_engines(summarize([ref]), tmp_path / "none.png")   # no row with a P of its own: no mark, no error


def test_a_negative_pause_between_rounds_is_refused_before_any_engine_starts():
    r = subprocess.run([sys.executable, "-m", "aiolayer", "bench", "vllm", "--rows", "aggregated,aiolayer",
                        "--together", "--together-pause", "-1"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--together-pause must be 0 or more seconds, not -1.0" in r.stderr


def test_an_unknown_row_is_refused_before_any_engine_starts():
    r = subprocess.run([sys.executable, "-m", "aiolayer", "bench", "vllm", "--rows", "aggregated,nope"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "unknown --rows ['nope']" in r.stderr


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_a_small_real_run_verifies_aiolayer_against_the_aggregated_engine(tmp_path):
    # small on purpose (2 layers, ~100-token prompts, eager): the full run is make bench-vllm; float32, as
    # token equality with the aggregated engine asks (vLLM CPU's bf16 is not batch-invariant)
    r = subprocess.run([sys.executable, "-m", "aiolayer", "bench", "vllm", "--rows", "aggregated,aiolayer",
                        "--layers", "2", "--prompt-tokens", "100", "--prompts", "2", "--concurrency", "2",
                        "--max-tokens", "8", "--eager", "--dtype", "float32", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=840)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads((tmp_path / "engines.json").read_text())
    rows = {s["row"]: s for s in report["summary"]}
    assert rows["aiolayer"]["ran"], rows["aiolayer"]
    for key in ("c1", "c8"):
        stats = rows["aiolayer"][key]
        assert (stats["verified"], stats["failed"], stats["differ"]) == (2, 0, 0), stats
        assert stats["ttft_ms_median"] > 0
    c1 = rows["aiolayer"]["c1"]   # its P answered by itself beside each concurrency-1 request
    assert c1["p_alone_ms_median"] > 0 and c1["p_alone_failed"] == 0 and c1["over_p_alone_ms_median"] is not None
    checks = rows["aiolayer"]["how"]["bytes"]         # every layer of every transfer byte-checked at D
    assert checks["verified"] == checks["receives_finished"] > 0, checks
    assert checks["mismatch"] == 0 == checks["receives_failed"], checks
    assert (tmp_path / "engines.png").stat().st_size > 1000


def test_together_is_refused_with_the_link_sweep_before_any_engine_starts():
    r = subprocess.run([sys.executable, "-m", "aiolayer", "bench", "vllm", "--rows", "aggregated,aiolayer",
                        "--together", "--link-gbit", "1"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--together is for a loopback run" in r.stderr


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_rows_run_together_in_rounds_and_are_verified_as_in_a_plain_run(tmp_path):
    """--together: the aggregated engine and aiolayer's pair up at once, requests in rounds; the answers
    are still checked against the aggregated engine's and every transfer's bytes at D."""
    r = subprocess.run([sys.executable, "-m", "aiolayer", "bench", "vllm", "--rows", "aggregated,aiolayer",
                        "--together", "--layers", "2", "--prompt-tokens", "100", "--prompts", "2",
                        "--concurrency", "2", "--max-tokens", "8", "--eager", "--dtype", "float32",
                        "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=840)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "round 2/2: TTFT ms aggregated" in r.stderr, r.stderr[-3000:]   # the progress line of each round
    rows = {s["row"]: s for s in json.loads((tmp_path / "engines.json").read_text())["summary"]}
    stats = rows["aiolayer"]["c1"]
    assert (stats["verified"], stats["failed"], stats["differ"], stats["p_alone_failed"]) == (2, 0, 0, 0), stats
    assert stats["p_alone_ms_median"] > 0 and rows["aiolayer"]["c8"]["verified"] == 2
    assert stats["same_round_vs"]["aggregated"]["rounds"] == 2, stats   # compared round by round
    checks = rows["aiolayer"]["how"]["bytes"]
    assert checks["verified"] == checks["receives_finished"] > 0 and checks["mismatch"] == 0, checks
