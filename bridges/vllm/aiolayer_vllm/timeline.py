"""The per-transfer debug timeline: one log line per stage a transfer passes, at DEBUG only.

Stamps are ``time.perf_counter`` seconds (CLOCK_MONOTONIC on Linux: comparable across P, D and the
proxy on one host), so that the time each stage aiolayer owns takes can be read off the engines' logs
(tests/vllm_bridge/one_pair/test_stage_timeline.py does; docs/results.md tabulates them).
"""

from __future__ import annotations

import logging
import time

from aiolayer import Outcome

log = logging.getLogger("aiolayer_vllm.worker")   # the name the timeline has always been logged under


def stage(transfer_id: str, name: str, at: float | None = None) -> None:
    """One stage of ``transfer_id``: now, or at ``at``."""
    if log.isEnabledFor(logging.DEBUG):
        log.debug("timeline %s %s %.6f", transfer_id, name, time.perf_counter() if at is None else at)


def p_stages(outcome: Outcome) -> None:
    """P's own stamps from a send's outcome: its last layer taken by the loop, landed, every write
    settled, DONE acknowledged. Computed only when logged."""
    if outcome.ok and outcome.layers and log.isEnabledFor(logging.DEBUG):
        stage(outcome.transfer_id, "p_last_taken", max(t.submitted_s for t in outcome.layers))
        stage(outcome.transfer_id, "p_landed", max(t.landed_s for t in outcome.layers))
        stage(outcome.transfer_id, "p_settled", outcome.writes_settled_s)
        stage(outcome.transfer_id, "p_done_acked", outcome.finished_s)
