"""Peer faults against real processes and the real Mooncake engine, one test per seed fragility.

Each test runs one scenario of ``aiolayer bench faults`` (bench/scenarios/faults.py) on a shared
harness: P in this process, a healthy decode node kept for the module, a faulty node per test.
Each test's docstring names the items of docs/seed-fragilities.md it shows impossible.
"""

from __future__ import annotations

import pytest

from aiolayer.harness.procs import free_port
from helpers_node import apply_mc_env

apply_mc_env()

from aiolayer.bench.scenarios import faults
from aiolayer.bench.scenarios.fault_checks import broken
from aiolayer.bench.scenarios.faults import FAULT_TIMEOUTS, P_DEADLINE_S

pytestmark = pytest.mark.timeout(120)
HANDOFF_MAX_NS = 50_000_000   # the design aiolayer replaces stalled the forward ~3 s per layer; allow scheduler noise


@pytest.fixture(scope="module")
def harness():
    with faults.FaultHarness() as h:
        yield h


def _guaranteed(scenario: str, r: dict) -> None:
    """Its guarantees as ``aiolayer bench faults`` checks them (a broken one fails the bench run)."""
    why = broken(scenario, r, FAULT_TIMEOUTS)
    assert not why, (why, r)


def _healthy_peer_unhurt(r: dict) -> None:
    assert r["lost"] == 0, r
    assert r["good_ok"] and r["good_verified"], r
    assert r["handoff_ns"]["max"] < HANDOFF_MAX_NS, r


def test_killed_d_fails_within_its_deadline_and_others_complete(harness):
    """Seed fragilities 4 and 20."""
    r = faults.scenario_kill(harness)
    _guaranteed("scenario_kill", r)
    _healthy_peer_unhurt(r)
    assert not r["bad_ok"] and r["bad_reason"]
    assert r["terminal_s"] <= P_DEADLINE_S + 1.0, r


def test_frozen_d_fails_at_p_then_at_d_and_source_is_fenced(harness):
    """Seed fragilities 4 and 9."""
    r = faults.scenario_freeze(harness)
    _guaranteed("scenario_freeze", r)
    _healthy_peer_unhurt(r)
    assert not r["bad_ok"] and "TransferTimeout" in r["bad_reason"], r
    assert r["terminal_s"] <= P_DEADLINE_S + 1.0, r
    # the timed-out write may still land: P must not hand its source blocks back while D is frozen
    assert not r["source_released_at_outcome"] and not r["source_released_while_frozen"], r
    assert r["source_released_later"], r
    assert r["d_state_after_sigcont"] == "failed", r
    assert r["d_terminal_after_sigcont_s"] <= FAULT_TIMEOUTS.receive + FAULT_TIMEOUTS.fence_grace + 1.0, r


def test_refused_write_fails_and_d_is_told(harness):
    """Seed fragility 5."""
    r = faults.scenario_refuse(harness)
    _guaranteed("scenario_refuse", r)
    _healthy_peer_unhurt(r)
    assert not r["bad_ok"] and "BackendError" in r["bad_reason"], r
    assert r["d_state"] == "failed", r          # FAILED reached D: it does not wait forever


def test_slow_peer_is_delayed_not_failed(harness):
    r = faults.scenario_slow(harness)
    _guaranteed("scenario_slow", r)
    _healthy_peer_unhurt(r)
    assert r["bad_ok"] and r["bad_verified"], r


def test_client_abort_stops_p_and_fences_d(harness):
    """Seed fragility 11."""
    r = faults.scenario_abort(harness)
    _guaranteed("scenario_abort", r)
    _healthy_peer_unhurt(r)
    assert r["aborted_tid_seen"] and not r["bad_ok"], r
    assert "client disconnected" in r["bad_reason"], r
    assert r["d_state"] == "failed", r
    assert r["d_fenced_s"] < FAULT_TIMEOUTS.fence_grace, r   # P's ack ended the fence, not the grace timer


def test_unreachable_d_fails_once_off_the_forward(harness):
    """Seed fragilities 1 and 2."""
    r = faults.scenario_unreachable(harness)
    _guaranteed("scenario_unreachable", r)
    _healthy_peer_unhurt(r)
    assert not r["bad_ok"] and "layout_fetch" in r["bad_reason"], r
    assert r["layout_fetches"] == 1, r          # once per transfer, never once per layer
    assert r["terminal_s"] <= r["deadline_s"] + 1.0, r


def test_done_before_registration_completes_and_duplicate_is_a_no_op(harness):
    """Seed fragility 13."""
    r = faults.scenario_done_first(harness)
    _guaranteed("scenario_done_first", r)
    assert r["early_reply"] == "kept until registration"
    assert r["state"] == "finished" and r["duplicate_reply"] == "already finished", r


def test_garbage_frames_are_all_answered_and_d_keeps_serving(harness):
    """Seed fragility 6."""
    r = faults.scenario_garbage(harness, frames=1000)
    _guaranteed("scenario_garbage", r)
    assert r["answered"] == r["frames"] == 1000, r
    _healthy_peer_unhurt(r)
    assert r["bad_ok"] and r["bad_verified"], r


def test_restarted_d_on_the_same_port_is_never_written_at_stale_addresses(harness):
    """Seed fragility 16."""
    from aiolayer.protocol import messages as m

    h = harness
    port = free_port()
    first = h.bad_node(port=port)
    try:
        old = h.alloc(first.control, "before-restart")
        h.release(first.control, "before-restart")
    finally:
        first.stop()
    second = h.bad_node(port=port)
    try:
        assert second.control == first.control and second.info["incarnation"] != old.incarnation
        fresh = h.alloc(second.control, "after-restart")
        stale = h.alloc(second.control, "stale-spec")
        before = h.rt.request(second.control, m.VerifyRequest(transfer_id="stale-spec"))
        # a transfer still carrying the first incarnation's allocation must be refused, unwritten
        kv, _, _ = h.stream([("stale-spec", second.control, m.AllocReply(
            transfer_id="stale-spec", block_ids=stale.block_ids, incarnation=old.incarnation, token=stale.token)),
            ("after-restart", second.control, fresh)])
        bad, good = h.outcome("stale-spec", 10), h.outcome("after-restart", 10)
        assert bad is not None and not bad.ok and "StaleLayout" in bad.reason, bad
        assert good is not None and good.ok, good
        assert h.verified(second.control, "after-restart", kv)
        after = h.rt.request(second.control, m.VerifyRequest(transfer_id="stale-spec"))
        assert (after.crc_k, after.crc_v) == (before.crc_k, before.crc_v)   # not one byte written
    finally:
        second.stop()


# --- faults of the network (bench/scenarios/net_faults.py): P and D on two network namespaces -----------

from aiolayer.harness import netns
from aiolayer.bench.scenarios import net_faults

needs_netns = pytest.mark.skipif(bool(netns.available()), reason=netns.available() or "available")


def _ended_visibly_none_lost(r: dict) -> None:
    assert r["lost"] == 0 and r["d_states"].get("unsettled", 0) == 0, r       # every transfer ended, at P and D
    assert r["outcome"] == "failed (visible)" and r["failed"] >= 1, r
    assert r["verified"] == r["ok"], r
    assert r["terminal_s"] is not None and r["terminal_s"] <= r["deadline_s"] + 1.0, r


@needs_netns
@pytest.mark.timeout(240)
def test_partition_row_fails_cut_transfers_in_deadline_and_recovers():
    r = net_faults.scenario_partition()
    _ended_visibly_none_lost(r)
    assert not r["bad_reason"].startswith("alloc"), r          # the held transfer failed mid-stream
    assert r["ok"] > 0 and r["transfers_after_link_up"] > 0 and r["good_verified"], r


@needs_netns
@pytest.mark.timeout(240)
def test_slow_link_row_fails_at_the_write_deadline_not_a_hang():
    r = net_faults.scenario_slow_link()
    _ended_visibly_none_lost(r)
    assert r["failed"] == r["transfers"] == 2 and "layer_write" in r["bad_reason"], r
    assert r["d_states"].get("failed") == 2, r                                   # D ended both too


@needs_netns
@pytest.mark.timeout(240)
def test_readdress_row_fails_the_old_address_fast_and_the_new_one_verifies():
    r = net_faults.scenario_readdress()
    _ended_visibly_none_lost(r)
    assert r["old_control"] != r["new_control"] and r["bad_reason"].startswith("alloc:"), r
    assert r["good_verified"] and r["good_transfers"] == 3 and not r["stale_known_at_new_d"], r


def test_network_rows_say_why_when_namespaces_are_unavailable(monkeypatch):
    monkeypatch.setattr(net_faults, "available", lambda: "network namespaces need root")
    rows = net_faults.run_rows()
    assert [r["outcome"] for r in rows] == ["skipped: network namespaces need root"] * 3
    assert all(r["lost"] == 0 and r["skipped"] for r in rows)
