"""``aiolayer bench vllm --together``: every row's engines up at once, their concurrency-1 requests taken
in rounds, so that each row sees the same moments of the host.

A host's compute speed can drift by up to 2x over seconds (docs/results.md), and the rows of a plain run
are measured minutes apart: two P/D systems can then differ by more than either's transfer costs. Here
the aggregated engine and every P shares the first of ``--cores``, every D the second; round ``i`` sends
prompt ``i`` to each row in turn (the order rotated by one each round), and each P/D row's P answers
another prompt by itself right after. Every request comes ``--together-pause`` seconds after the one
before: vLLM's message-queue readers spin for 1 s after each message, and a spinning idle engine would
slow the one working beside it on the same core. The bursts then run one row at a time, the others idle.
Rows come back in ``run.run_row``'s form, so the summary, table and plot are the plain run's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from pathlib import Path

from .run import SYSTEMS, _measure, _progress, take_hooks


def run_rows(names: list[str], model: Path, args: argparse.Namespace, texts: dict[str, list[str]]) -> list[dict]:
    """Each row's dict as ``run_row`` gives it; a row whose engines do not start is reported as such."""
    rows: dict[str, dict] = {}
    stop_failed: dict[str, str] = {}
    t_all = time.monotonic()
    with contextlib.ExitStack() as stack:
        up: dict[str, tuple] = {}
        for i, name in enumerate(names):
            print(f"[{i + 1}/{len(names)}] {name}: starting beside the rows before it", file=sys.stderr, flush=True)
            t0 = time.monotonic()
            try:
                complete, how = stack.enter_context(_StopRecorded(SYSTEMS[name](model, args), name, stop_failed))
            except Exception as exc:   # noqa: BLE001 - a row that cannot run is reported as such, the others still run
                rows[name] = {"row": name, "ran": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
                continue
            up[name] = (complete, take_hooks(how).get("_p_alone"), how)
            print(f"  {name}: engines up in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
        measured = asyncio.run(_rounds(up, args, texts))
        for name, (complete, _, how) in up.items():
            serial, solo = measured[name]
            _progress(name, "concurrency 1", serial)
            burst = asyncio.run(_burst(complete, texts["burst"], args))
            _progress(name, f"burst of {len(burst)}", burst)
            rows[name] = {"row": name, "ran": True, "how": how, "serial": serial, "burst": burst, "p_alone": solo,
                          "together": True}   # its serial results in round order (summary._against_rows)
    # ``how`` gets its byte counts as each row's engines stop (the ExitStack above), before the summary reads it;
    # the rows shared their time, so each one's wall is the whole run's (as the link sweep's grouped rows)
    wall = round(time.monotonic() - t_all, 1)
    for name, error in stop_failed.items():   # as ``run_row`` reports a row whose engines raise as they stop
        rows[name] = {"row": name, "ran": False, "error": error}
    return [rows[name] if not rows[name]["ran"] else {**rows[name], "wall_s": wall} for name in names]


class _StopRecorded(contextlib.AbstractContextManager):
    """A row's engines whose stop raises (its byte counts are read as they stop) fail that row alone, as in
    a plain run, and the other rows' engines still stop and their figures still come out."""

    def __init__(self, system, name: str, failed: dict[str, str]) -> None:
        self.system, self.name, self.failed = system, name, failed

    def __enter__(self):
        return self.system.__enter__()

    def __exit__(self, *exc_info) -> bool:
        try:
            return bool(self.system.__exit__(*exc_info))
        except Exception as exc:   # noqa: BLE001 - recorded as the row's failure
            self.failed[self.name] = f"stopping its engines: {type(exc).__name__}: {exc}"[:2000]
            return False


async def _rounds(up: dict[str, tuple], args: argparse.Namespace, texts: dict[str, list[str]]) -> dict:
    """The warm-ups, then ``--prompts`` rounds; per row (its results, its P alone's)."""
    pause = args.together_pause
    for complete, alone, _ in up.values():
        await _measure(complete, texts["warmup"], False, args.max_tokens)
        if alone is not None:
            await asyncio.sleep(pause)
            await _measure(alone, texts["alone_warmup"], False, 1)
        await asyncio.sleep(pause)
    out: dict[str, tuple[list, list]] = {name: ([], []) for name in up}
    names = list(up)
    for i, text in enumerate(texts["serial"]):
        for name in names[i % len(names):] + names[:i % len(names)]:
            complete, alone, _ = up[name]
            out[name][0].extend(await _measure(complete, [text], False, args.max_tokens))
            await asyncio.sleep(pause)
            if alone is not None:
                out[name][1].extend(await _measure(alone, [texts["alone"][i]], False, 1))
                await asyncio.sleep(pause)
        firsts = ", ".join(f"{n} {out[n][0][-1].get('ttft_ms') or 0:.0f}" for n in names)
        print(f"  round {i + 1}/{len(texts['serial'])}: TTFT ms {firsts}", file=sys.stderr, flush=True)
    return out


async def _burst(complete, texts: list[str], args: argparse.Namespace) -> list[dict]:
    await asyncio.sleep(args.together_pause)
    return await _measure(complete, texts, True, args.max_tokens)
