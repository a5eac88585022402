"""The link sweep's rows as they run: which share a pair of engines, and one cell of them.

aiolayer's rows that differ only by P's transfer mode (``MODE_ROWS``) run on ONE pair of engines whose P
is configured ``auto``: the layer-wise and bulk rows' requests name their mode (the proxy's
``x-aiolayer-transfer-mode`` header, which P obeys and does not learn from), the auto row's name none. In
each cell their measured requests alternate (the order rotating), so the three modes differ by nothing
but the mode: not by engine start, memory placement or the minutes between two rows. Each row has a
prompt set of its own (a prompt repeated on one engine would hit its prefix cache), and the aggregated
engine answers every set, so every answer is still checked against it. ``--separate-engines`` gives
each row its engines, as every other row has.
"""

from __future__ import annotations

import argparse
import asyncio

from .run import _measure

# aiolayer's mode rows, and the mode each one's requests ask P for ("": auto's own choice)
MODE_ROWS = {"aiolayer": "layerwise", "aiolayer-bulk": "bulk", "aiolayer-auto": ""}


def row_groups(names: list[str], separate: bool = False) -> list[list[str]]:
    """``names`` in running order, grouped by the engines they share: two or more of ``MODE_ROWS`` on one
    pair (placed where the first of them was), every other row alone."""
    shared = [] if separate else [n for n in names if n in MODE_ROWS]
    if len(shared) < 2:
        return [[n] for n in names]
    groups: list[list[str]] = []
    for name in names:
        if name not in shared:
            groups.append([name])
        elif name == shared[0]:
            groups.append(shared)
    return groups


def prompt_sets(groups: list[list[str]]) -> int:
    """How many prompt sets a cell needs: one per row of the largest group."""
    return max(len(g) for g in groups)


def lanes(group: list[str], sets: int) -> list[tuple[str, int]]:
    """(row, prompt set) pairs one cell of ``group`` measures: the aggregated engine answers every set
    (each row's answers are checked against it), a shared group's k-th row its set k, any other row set 0."""
    if group == ["aggregated"]:
        return [("aggregated", k) for k in range(sets)]
    return [(name, k) for k, name in enumerate(group)]


def cell_key(key: str, k: int) -> str:
    """Where a row keeps a cell's answers to prompt set ``k`` (set 0 under the cell's own key)."""
    return key if k == 0 else f"{key}/{k}"


def measure_cell(completes: dict[str, object], cell_lanes: list[tuple[str, int]], texts: list[dict],
                 args: argparse.Namespace) -> dict[tuple[str, int], list[dict]]:
    """One warm-up per row, then the lanes' measured requests one at a time, alternating lane by lane
    (the order rotating by one each round, so no lane always follows the same one)."""
    warmed: set[str] = set()
    for name, k in cell_lanes:
        if name not in warmed:
            warmed.add(name)
            asyncio.run(_measure(completes[name], texts[k]["warmup"], False, args.max_tokens))
    results: dict[tuple[str, int], list[dict]] = {lane: [] for lane in cell_lanes}
    for i in range(len(texts[0]["serial"])):
        turn = i % len(cell_lanes)
        for name, k in cell_lanes[turn:] + cell_lanes[:turn]:
            results[name, k] += asyncio.run(_measure(completes[name], [texts[k]["serial"][i]], False, args.max_tokens))
    return results


def auto_choices(delta: dict[str, float], results: dict[tuple[str, int], list[dict]], warmups: int = 1) -> dict:
    """What the auto row chose in a cell of a shared group: P's send counters moved by every row's
    requests, so the ones the other rows asked for (their warm-up and answered requests) are taken off;
    the requests D prefilled itself (``local``) are all the auto row's, since a request naming its mode
    always goes to P."""
    asked = {mode: 0 for mode in delta}
    for (name, _), answers in results.items():
        mode = MODE_ROWS.get(name)
        if mode:
            asked[mode] = asked.get(mode, 0) + warmups + sum(1 for r in answers if "error" not in r)
    return {mode: max(0, int(delta[mode] - asked[mode])) for mode in delta}
