"""What each fault scenario guarantees, checked on its result row: ``broken`` names the first guarantee a
row breaks ("" when all hold). ``aiolayer bench faults`` fails a run on any, and the fault tests check the
same rows, so the bench's exit code and the tests agree on what a pass is."""

from __future__ import annotations

from collections.abc import Callable

from aiolayer import Timeouts

HANDOFF_MAX_NS = 50_000_000   # the design aiolayer replaces stalled the forward ~3 s per layer; allow noise
Check = tuple[bool, str]


def _peer_unhurt(r: dict) -> list[Check]:
    return [(r["lost"] == 0, "a transfer was lost"),
            (r["good_ok"] and r["good_verified"], "the healthy peer's transfer failed or did not verify"),
            (r["handoff_ns"]["max"] < HANDOFF_MAX_NS, "the forward's hand-off stalled")]


def _failed_in_time(r: dict, cause: str = "") -> list[Check]:
    return [(not r["bad_ok"] and bool(r["bad_reason"]) and cause in r["bad_reason"],
             f"the faulty transfer did not fail visibly{' with ' + cause if cause else ''}"),
            (r["terminal_s"] <= r["deadline_s"] + 1.0, "it ended past its deadline")]


GUARANTEES: dict[str, Callable[[dict, Timeouts], list[Check]]] = {   # (row, the run's timeouts)
    "scenario_kill": lambda r, t: _peer_unhurt(r) + _failed_in_time(r),
    "scenario_freeze": lambda r, t: _peer_unhurt(r) + _failed_in_time(r, "TransferTimeout") + [
        (not r["source_released_at_outcome"] and not r["source_released_while_frozen"],
         "P released the source while a write might land"),
        (r["source_released_later"], "P never released the source"),
        (r["d_state_after_sigcont"] == "failed", "D did not fail the transfer once it ran again"),
        (r["d_terminal_after_sigcont_s"] <= t.receive + t.fence_grace + 1.0,
         "D ended it past receive + fence_grace")],
    "scenario_refuse": lambda r, t: _peer_unhurt(r) + [
        (not r["bad_ok"] and "BackendError" in r["bad_reason"], "the refused write did not fail the transfer"),
        (r["d_state"] == "failed", "D was not told")],
    "scenario_slow": lambda r, t: _peer_unhurt(r) + [(r["bad_ok"] and r["bad_verified"], "a slow peer failed")],
    "scenario_abort": lambda r, t: _peer_unhurt(r) + [
        (r["aborted_tid_seen"] and not r["bad_ok"] and "client disconnected" in r["bad_reason"],
         "the abort did not fail the transfer"),
        (r["d_state"] == "failed", "D did not fail the transfer"),
        (r["d_fenced_s"] < t.fence_grace, "the fence waited out its grace: P's ack did not end it")],
    "scenario_unreachable": lambda r, t: _peer_unhurt(r) + _failed_in_time(r, "layout_fetch") + [
        (r["layout_fetches"] == 1, "the layout was fetched more than once per transfer")],
    "scenario_done_first": lambda r, t: [
        (r["early_reply"] == "kept until registration", "an early DONE was not kept"),
        (r["state"] == "finished" and r["duplicate_reply"] == "already finished", "the DONE or its repeat misapplied")],
    "scenario_garbage": lambda r, t: _peer_unhurt(r) + [
        (r["answered"] == r["frames"], "a garbage frame went unanswered"),
        (r["bad_ok"] and r["bad_verified"], "D stopped serving")],
}


def broken(scenario: str, r: dict, timeouts: Timeouts) -> str:
    """The first guarantee of ``scenario`` its row ``r`` (run with ``timeouts``) breaks; "" when all hold."""
    try:
        return next((what for ok, what in GUARANTEES.get(scenario, lambda *_: [])(r, timeouts) if not ok), "")
    except (KeyError, TypeError) as exc:   # a field the scenario did not report: it did not get that far
        return f"the row lacks what its checks read: {type(exc).__name__}: {exc}"
