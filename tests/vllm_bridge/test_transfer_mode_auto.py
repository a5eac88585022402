"""``transfer_mode: auto`` through vLLM's own plumbing: P's workers' measurements reach P's scheduler
(``build_connector_worker_meta``, vLLM's ``KVOutputAggregator`` across workers, ``update_connector_output``)
and choose the next sends' mode. The real vLLM ``Scheduler`` and worker-side connector with a real
aiolayer Runtime (memory backend) in one process, as in test_vllm_connector.py (tests/vllm_sched.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is installed by `make test`")

from vllm_sched import LAYERS, engines_fixture, layer_pattern, lookup, send_params, steps_until, tok

pytestmark = pytest.mark.timeout(120)
engines = pytest.fixture(engines_fixture, name="engines")


def _transfer(p, d, tid: str, prompt: list[int], requested: str = "") -> bool:
    """One request P -> D (``requested``: the mode the request itself asks for); returns whether P sent
    it layer-wise. Ends when P freed its blocks (its send's figures then went back to its scheduler)
    and D's KV landed."""
    d.add("d-" + tid, prompt, 2, {"aiolayer": {"transfer_id": tid, "token": tok(tid),
                                              "prefill_controls": [p.runtime.control_endpoint]}})
    d.step()
    params = send_params(d, tid, lookup(p, d, tid))
    if requested:
        params["aiolayer"]["transfer_mode"] = requested
    p.add("p-" + tid, prompt, 1, params)
    out = p.step(before_save=layer_pattern(p, "p-" + tid))
    (send,) = out.kv_connector_metadata.sends
    steps_until(lambda: "p-" + tid not in p.scheduler.requests, p)
    steps_until(lambda: "d-" + tid not in d.scheduler.requests, d)
    return send.layerwise


def _policy(p):
    return p.scheduler.connector._scheduler._modes


def test_auto_tries_both_modes_then_chooses_from_what_the_sends_measured(engines):
    d = engines("kv_consumer", "d-auto")
    p = engines("kv_producer", "p-auto", extra={"transfer_mode": "auto"})
    prompt = list(range(3, 103))                    # 100 tokens: 4 blocks of 32, one step size throughout
    modes = [_transfer(p, d, f"t{i}", prompt) for i in range(4)]
    assert modes[:2] == [True, False], modes        # layer-wise measured first, then bulk
    estimates = _policy(p).chooser.snapshot()
    assert estimates["rate_bytes_s"][d.runtime.control_endpoint] > 0, estimates
    assert {k.split("@")[0] for k in estimates["s_per_step_token"]} == {"layerwise", "bulk"}, estimates
    assert estimates["layers"] == len(LAYERS) and estimates["bytes_per_token"] > 0, estimates
    counted = {k: sum(stats.data.get(k, 0) for _, stats in p.reports if stats)   # vLLM's stats, per mode
               for k in ("sends_layerwise", "sends_bulk")}
    assert counted == {"sends_layerwise": modes.count(True), "sends_bulk": modes.count(False)}, counted


def test_a_request_that_names_its_mode_is_sent_so_and_does_not_teach_auto(engines):
    d = engines("kv_consumer", "d-asked")
    p = engines("kv_producer", "p-asked", extra={"transfer_mode": "auto"})
    prompt = list(range(3, 103))
    # auto's first send would be layer-wise (nothing measured yet): the request's own mode wins
    assert [_transfer(p, d, f"a{i}", prompt, mode) for i, mode in enumerate(("bulk", "layerwise", "bulk"))] \
        == [False, True, False]
    assert _policy(p).chooser.snapshot()["s_per_step_token"] == {}, "a requested mode's figures reached auto"
    assert _transfer(p, d, "a3", prompt) is True   # auto's own first choice, as on a fresh engine
    learned = _policy(p).chooser.snapshot()["s_per_step_token"]
    assert learned and all(key.startswith("layerwise@") for key in learned), learned


def test_fixed_modes_report_nothing_back():
    from aiolayer_vllm.modes import AiolayerWorkerMeta, ModePolicy, SendFigures

    policy = ModePolicy("bulk", 0)
    assert not policy.layerwise("r", step_tokens=8, prompt_tokens=8, dest="x") and policy.chooser is None
    policy.observe(AiolayerWorkerMeta([SendFigures("r", 0.1, 0.1, 0.1, 100, 2)]))   # ignored, no error
    assert ModePolicy("layerwise", 512).layerwise("r", step_tokens=8, prompt_tokens=8, dest="x") is False
    assert ModePolicy("layerwise", 0).layerwise("r", step_tokens=8, prompt_tokens=8, dest="x") is True


def test_vllms_aggregator_joins_every_workers_figures():
    from aiolayer_vllm.modes import AiolayerWorkerMeta, SendFigures
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    def output(rank: int) -> ModelRunnerOutput:
        meta = AiolayerWorkerMeta([SendFigures("r", 0.1 * rank, 0.01, 0.02, 1000, 2)])
        return ModelRunnerOutput(req_ids=[], req_id_to_index={},
                                 kv_connector_output=KVConnectorOutput(kv_connector_worker_meta=meta))

    joined = KVOutputAggregator(expected_finished_count=2).aggregate([output(1), output(2)])
    sends = joined.kv_connector_output.kv_connector_worker_meta.sends
    assert [s.window_s for s in sends] == [0.1, 0.2]
