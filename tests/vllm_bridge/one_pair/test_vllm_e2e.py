"""The real-engine test: two vLLM CPU engines with AiolayerConnector, P pushes KV to D.

P prefills and streams every layer through aiolayer (Mooncake over TCP) into D's paged cache (P and D
are the folder's shared pair, conftest.py); D decodes from it. The generated tokens must equal P's own
no-transfer generation (the aggregated baseline), and a negative control, a D that zeroes whatever KV
arrived, must change them: the tokens depend on the transferred KV, not on anything D computed itself.
The test plays the proxy: D first, D's registration from its control socket, then P with D's block ids.
"""

from __future__ import annotations

import concurrent.futures
import secrets
import time
import uuid

import pytest

pytest.importorskip("vllm", reason="vLLM is installed by `make test`")

from aiolayer.harness.servers import VllmServer, completion, free_port, running, scrape_metrics
from aiolayer.harness.tiny_model import SAMPLE_PROMPTS, long_prompt, tiny_model_dir
from helpers_pair import pair_connector, pair_settings

from aiolayer import NodeConfig, Runtime
from aiolayer.protocol import messages as m
from aiolayer_vllm.config import DEBUG_CORRUPT_RECEIVED_ENV, DEBUG_ZERO_RECEIVED_ENV

pytestmark = [pytest.mark.timeout(600), pytest.mark.vllm]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def cluster(stack):
    """The folder's shared P and D, and two more Ds of the same settings: one zeroes whatever KV arrived
    (the negative control), one changes bytes after they landed (the integrity check must catch every
    one, and vLLM's "recompute" policy then prefills the request at D)."""
    model = tiny_model_dir()
    z_ctl, c_ctl = free_port(), free_port()
    dz = VllmServer(model, name="decode-zeroing", **pair_settings(**{DEBUG_ZERO_RECEIVED_ENV: "1"}),
                    kv_transfer_config=pair_connector("kv_consumer", "dz", z_ctl))
    dc = VllmServer(model, name="decode-corrupting", **pair_settings(**{DEBUG_CORRUPT_RECEIVED_ENV: "1"}),
                    kv_transfer_config=pair_connector("kv_consumer", "dc", c_ctl, policy="recompute"))
    client = Runtime(NodeConfig(engine_id="e2e-proxy", backend="memory")).start()
    try:
        with running(dz, dc):
            yield {"p": stack["p"], "d": stack["d"], "dz": dz, "dc": dc, "p_ctl": stack["p_ctl"],
                   "d_ctl": stack["d_ctl"], "dz_ctl": f"tcp://127.0.0.1:{z_ctl}",
                   "dc_ctl": f"tcp://127.0.0.1:{c_ctl}", "client": client}
    finally:
        client.stop()


def _lookup(client: Runtime, control: str, tid: str, token: str, limit: float = 30.0) -> m.AllocReply:
    deadline = time.monotonic() + limit
    while True:
        try:
            return client.request(control, m.LookupRequest(transfer_id=tid, token=token), timeout=2.0)
        except Exception:  # noqa: BLE001 - D registers once its scheduler parked the request
            assert time.monotonic() < deadline, f"D never registered {tid}"
            time.sleep(0.02)


def disaggregated(c: dict, decode: str, prompt: str, max_tokens: int = MAX_TOKENS, stream: bool = False):
    """D first (parks and registers), then P with D's blocks; returns (D's completion, P's)."""
    tid, token = uuid.uuid4().hex, secrets.token_hex(16)
    d_server, d_ctl = c[decode], c[decode + "_ctl"]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        d_future = pool.submit(completion, d_server, prompt, max_tokens=max_tokens, stream=stream, timeout_s=120,
                               kv_transfer_params={"aiolayer": {"transfer_id": tid, "token": token,
                                                                "prefill_controls": [c["p_ctl"]]}})
        reg = _lookup(c["client"], d_ctl, tid, token)
        p_out = completion(c["p"], prompt, max_tokens=1, timeout_s=120, kv_transfer_params={"aiolayer": {
            "transfer_id": tid, "token": token, "dst_blocks": reg.block_ids, "first_block": reg.first_block,
            "decode_ranks": [{"decode_control": d_ctl, "dst_incarnation": reg.incarnation}]}})
        return d_future.result(timeout=150), p_out


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streaming"])
def test_decode_from_transferred_kv_equals_the_aggregated_baseline(cluster, stream):
    prompts = [*SAMPLE_PROMPTS[:3], long_prompt(150, seed=3)]     # up to ~5 blocks of 32 tokens
    for prompt in prompts:
        baseline = completion(cluster["p"], prompt, max_tokens=MAX_TOKENS)
        d_out, p_out = disaggregated(cluster, "d", prompt, stream=stream)
        assert d_out.token_ids == baseline.token_ids, (prompt, d_out, baseline)
        assert p_out.token_ids == baseline.token_ids[:1]


def test_negative_control_zeroed_kv_changes_the_tokens(cluster):
    changed = 0
    for prompt in [*SAMPLE_PROMPTS[:3], long_prompt(150, seed=5)]:
        baseline = completion(cluster["p"], prompt, max_tokens=MAX_TOKENS)
        zeroed, _ = disaggregated(cluster, "dz", prompt)
        changed += zeroed.token_ids != baseline.token_ids
    assert changed >= 3, "the tokens did not depend on the transferred KV"


def test_kv_corrupted_after_it_landed_is_caught_every_time_and_recomputed(cluster):
    """Every request's KV is changed at D after it landed (one value of the last layer); P checks every
    layer (integrity_sample 1.0), so D fails each transfer, and vLLM's recompute policy prefills the
    request at D: the answer still equals the aggregated engine's, never one decoded from corrupt KV."""
    before = _total(cluster["dc"], "vllm:aiolayer_integrity_mismatch_total")
    prompts = [*SAMPLE_PROMPTS[:3], long_prompt(150, seed=7)]
    for prompt in prompts:
        baseline = completion(cluster["p"], prompt, max_tokens=MAX_TOKENS)
        d_out, _ = disaggregated(cluster, "dc", prompt)
        assert d_out.token_ids == baseline.token_ids, (prompt, d_out, baseline)
    deadline = time.monotonic() + 20
    while (caught := _total(cluster["dc"], "vllm:aiolayer_integrity_mismatch_total") - before) < len(prompts):
        assert time.monotonic() < deadline, f"{caught} of {len(prompts)} corrupted transfers caught"
        time.sleep(0.2)
    assert caught == len(prompts)
    assert _total(cluster["dc"], "vllm:aiolayer_integrity_verified_total") == 0


def _total(server, name: str) -> float:
    return sum(value for _, value in scrape_metrics(server).get(name, []))


def test_connector_stats_reach_vllms_own_metrics(cluster):
    """The connector's figures travel vLLM's stats path into each server's /metrics (vllm:aiolayer_*)."""
    sent_before = _total(cluster["p"], "vllm:aiolayer_sends_finished_total")
    got_before = _total(cluster["d"], "vllm:aiolayer_receives_finished_total")
    disaggregated(cluster, "d", SAMPLE_PROMPTS[0])
    deadline = time.monotonic() + 20
    while True:
        sent = _total(cluster["p"], "vllm:aiolayer_sends_finished_total")
        got = _total(cluster["d"], "vllm:aiolayer_receives_finished_total")
        if sent > sent_before and got > got_before:
            break
        assert time.monotonic() < deadline, (sent_before, sent, got_before, got)
        time.sleep(0.2)
    assert _total(cluster["p"], "vllm:aiolayer_bytes_sent_total") > 0
    assert _total(cluster["d"], "vllm:aiolayer_bytes_received_total") > 0
    # every layer of vLLM's real cache layout was checked end to end, and matched
    assert _total(cluster["d"], "vllm:aiolayer_integrity_verified_total") > 0
    assert _total(cluster["d"], "vllm:aiolayer_integrity_mismatch_total") == 0
    # each finished transfer's timings, as histograms: P's send and its layers' landings, D's receive
    for server, name, least in (("p", "send_seconds", sent), ("p", "layer_landing_seconds", sent),
                                ("d", "receive_seconds", got)):
        while (count := _total(cluster[server], f"vllm:aiolayer_{name}_count")) < least:
            assert time.monotonic() < deadline, f"{server}'s vllm:aiolayer_{name} counts {count} of {least}"
            time.sleep(0.2)
        metrics = scrape_metrics(cluster[server])
        inf = sum(v for labels, v in metrics.get(f"vllm:aiolayer_{name}_bucket", []) if labels["le"] == "+Inf")
        assert inf == _total(cluster[server], f"vllm:aiolayer_{name}_count") and \
            _total(cluster[server], f"vllm:aiolayer_{name}_sum") > 0
