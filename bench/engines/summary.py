"""``aiolayer bench vllm``'s figures from its rows: per row and phase the TTFT, the answers checked
against the aggregated engine's (a drift with every byte verified is numerics, not a failure), the row
against its own P alone, and under ``--together`` against every other row round by round; the table,
and which rows fail the run."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

REFERENCE = "aggregated"   # the row every other row's answers are compared with


def bytes_verified(how: dict) -> bool:
    """Every transfer of the row byte-checked (one check per transfer D finished: a transfer too
    scattered to check, integrity.MAX_CHECK_RUNS, leaves it unverified) and none mismatched or failed."""
    checks = how.get("bytes")
    return bool(checks) and checks["verified"] == checks.get("receives_finished") > 0 \
        and checks["mismatch"] == 0 and checks["receives_failed"] == 0


def phase_summary(results: list[dict], reference: list[dict] | None, verified_bytes: bool = False) -> dict:
    ttft = [r["ttft_ms"] for r in results if r.get("ttft_ms") is not None]
    failed = sum(1 for r in results if "error" in r)
    checked = [] if reference is None else [
        (r, ref) for r, ref in zip(results, reference) if "error" not in r and "tokens" in ref]
    differ = sum(1 for r, ref in checked if r["tokens"] != ref["tokens"])
    return {"requests": len(results), "failed": failed, "differ": differ,
            # answers that differ while every byte moved verified: numerics, not a transfer error
            "numerics": differ if verified_bytes else 0,
            # the reference failed too: that answer is neither verified nor wrong
            "unchecked": len(results) - failed - len(checked) if reference is not None else None,
            "verified": len(checked) - differ if reference is not None else None,
            "ttft_ms_median": round(statistics.median(ttft), 1) if ttft else None,
            "ttft_ms_max": round(max(ttft), 1) if ttft else None,
            "errors": sorted({r["error"] for r in results if "error" in r})[:3]}


def _against_p_alone(serial: list[dict], solo: list[dict]) -> dict:
    """The row's P answering by itself right after each concurrency-1 request: its TTFT, and the row's
    over it, paired request by request (None where the row has no P alone)."""
    over = [d for d in _over_own_p(serial, solo) if d is not None]
    known = [a for a in _ttfts(solo) if a is not None]
    return {"p_alone_ms_median": round(statistics.median(known), 1) if known else None,
            "over_p_alone_ms_median": round(statistics.median(over), 1) if over else None,
            "p_alone_failed": sum(1 for r in solo if "error" in r)}


def _against_rows(row: dict, rows: list[dict]) -> dict:
    """``--together``: the row against each other row in the same round (round ``i`` sent prompt ``i`` to
    every row within seconds): the median of the rounds' TTFT differences and in how many rounds it was the
    lower; where both rows have a P of their own, the same for their TTFT over that P (each P's speed taken
    out: engines of one host answer the same prompt tens of ms apart); {} in a plain run."""
    if not row.get("together"):
        return {}
    against = {}
    for other in rows:
        if other is row or not other["ran"] or not other.get("together"):
            continue
        figures = _paired(_ttfts(row["serial"]), _ttfts(other["serial"]))
        if figures:
            over = _paired(_over_own_p(row["serial"], row.get("p_alone") or []),
                           _over_own_p(other["serial"], other.get("p_alone") or []))
            against[other["row"]] = {**figures, **({f"over_p_{k}": v for k, v in over.items()} if over else {})}
    return {"same_round_vs": against} if against else {}


def _ttfts(results: list[dict]) -> list[float | None]:
    return [r.get("ttft_ms") for r in results]


def _over_own_p(serial: list[dict], solo: list[dict]) -> list[float | None]:
    """Per request, the row's TTFT minus its P alone's right after (None: either failed, or no P alone)."""
    return [None if t is None or a is None else t - a for t, a in zip(_ttfts(serial), _ttfts(solo))]


def _paired(mine: list[float | None], theirs: list[float | None]) -> dict:
    diffs = [a - b for a, b in zip(mine, theirs) if a is not None and b is not None]
    ci = median_ci95(diffs)
    return {"median_ms": round(statistics.median(diffs), 1), "lower_in": sum(d < 0 for d in diffs),
            "rounds": len(diffs), "ci95_ms": None if ci is None else [round(c, 1) for c in ci]} if diffs else {}


def median_ci95(values: list[float]) -> tuple[float, float] | None:
    """An interval that holds the median of what ``values`` sample with at least 95% confidence, from
    the sign test's order statistics: nothing assumed about how rounds spread (they swing by hundreds of
    ms on some hosts). None below 6 values, where even the whole range holds it with less."""
    n, tail, k = len(values), 0, -1
    while k + 1 < n and 2 * (tail + math.comb(n, k + 1)) <= 0.05 * 2 ** n:
        k += 1
        tail += math.comb(n, k)   # 2**n * P(Binomial(n, 1/2) <= k): the interval misses that often at each end
    if k < 0:
        return None
    ordered = sorted(values)
    return ordered[k], ordered[n - 1 - k]


def each_row(rows: list[dict], summary_of: Callable[[dict, dict | None], dict]) -> list[dict]:
    """``summary_of(row, reference)`` for each row that ran, the reference being the aggregated engine's
    row (every other row's answers are checked against it) if it ran; a row that did not run as such."""
    ref = next((r for r in rows if r["row"] == REFERENCE and r["ran"]), None)
    return [summary_of(row, ref) if row["ran"] else {"row": row["row"], "ran": False, "error": row["error"]}
            for row in rows]


def summarize(rows: list[dict]) -> list[dict]:
    def summary_of(row: dict, ref: dict | None) -> dict:
        same, checked = ref is not None and row is not ref, bytes_verified(row["how"])
        return {"row": row["row"], "ran": True, "how": row["how"], "wall_s": row["wall_s"],
                "c1": {**phase_summary(row["serial"], ref["serial"] if same else None, checked),
                       **_against_p_alone(row["serial"], row.get("p_alone") or []),
                       **_against_rows(row, rows)},
                "c8": phase_summary(row["burst"], ref["burst"] if same else None, checked)}
    return each_row(rows, summary_of)


def bad_rows(summary: list[dict]) -> list[str]:
    """The rows that fail the run: a failed request, a byte mismatch, or a drift not explained by
    verified bytes (a row without byte checks cannot tell numerics from corruption); and those that did
    not run (``unmeasured``)."""
    bad = unmeasured(summary)
    for s in summary:
        if not s["ran"]:
            continue
        checks = s["how"].get("bytes") or {}
        unexplained = sum(s[k]["differ"] - s[k]["numerics"] for k in ("c1", "c8"))
        if s["c1"]["failed"] or s["c8"]["failed"] or unexplained or checks.get("mismatch"):
            bad.append(s["row"])
    return bad


def unmeasured(summary: list[dict]) -> list[str]:
    """Rows asked for that did not run (drop one from --rows to run without it), and the reference when
    others ran without it: no answer of theirs was compared, and nothing unchecked passes."""
    missing = [s["row"] for s in summary if not s["ran"]]
    if any(s["ran"] for s in summary) and not any(s["row"] == REFERENCE and s["ran"] for s in summary) \
            and REFERENCE not in missing:
        missing.append(f"{REFERENCE} (the reference: not in --rows, so no answer was compared)")
    return missing


def print_table(summary: list[dict]) -> None:
    print(f"{'row':<16} {'c1 TTFT p50':>12} {'c1 max':>9} {'P alone':>8} {'over P':>7} {'burst p50':>10} "
          f"{'burst max':>10}  verified / failed")
    for s in summary:
        if not s["ran"]:
            print(f"{s['row']:<16} not run: {s['error'][:200]}")
            continue
        c1, c8 = s["c1"], s["c8"]
        numerics = c1["numerics"] + c8["numerics"]
        ok = ("reference" if s["row"] == REFERENCE else "not compared") if c1["verified"] is None else (
            f"{c1['verified'] + c8['verified']}/{c1['requests'] + c8['requests']} / {c1['failed'] + c8['failed']}"
            + (f" ({numerics} numerics: bytes verified)" if numerics else ""))
        alone, over = c1.get("p_alone_ms_median"), c1.get("over_p_alone_ms_median")
        print(f"{s['row']:<16} {c1['ttft_ms_median'] or '-':>12} {c1['ttft_ms_max'] or '-':>9} "
              f"{'-' if alone is None else alone:>8} {'-' if over is None else f'{over:+.1f}':>7} "
              f"{c8['ttft_ms_median'] or '-':>10} {c8['ttft_ms_max'] or '-':>10}  {ok}")
    print("P alone: c1 TTFT p50 of the row's P answering by itself (no D, no transfer), one request right after each "
          "of the row's; over P: the row's TTFT minus that, paired, median")
    _print_rounds(summary)


def _print_rounds(summary: list[dict]) -> None:
    """``--together``: each pair of rows once (a P/D row against the aggregated engine, not the reverse),
    compared round by round, with whether the rounds resolve the difference."""
    seen = set()
    for s in summary:
        for other, d in (s.get("c1", {}).get("same_round_vs") or {}).items():
            if s["row"] == "aggregated" or (other, s["row"]) in seen:
                continue
            seen.add((s["row"], other))
            over = (f"; over each one's own P: {d['over_p_median_ms']:+.1f} ms{_interval(d.get('over_p_ci95_ms'))}, "
                    f"lower in {d['over_p_lower_in']} of {d['over_p_rounds']}") if "over_p_median_ms" in d else ""
            print(f"{s['row']} against {other}, round by round: {d['median_ms']:+.1f} ms (median of the rounds' "
                  f"differences){_interval(d.get('ci95_ms'))}, lower in {d['lower_in']} of {d['rounds']} rounds{over}")


def _interval(ci: list[float] | None) -> str:
    if ci is None:
        return " (too few rounds for a 95% interval)"
    verdict = "resolved" if ci[0] > 0 or ci[1] < 0 else "not resolved"
    return f" [95% {ci[0]:+.1f} to {ci[1]:+.1f}: {verdict}]"
