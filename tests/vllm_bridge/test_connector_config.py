"""The vLLM connector's configuration is strict and checked early: a misspelt key anywhere in
``kv_connector_extra_config`` is refused with the key named, while vLLM builds its engine config
(before any engine process or model load), and a KV cache the bridge cannot move (a group of SSM
state beside attention groups) is refused when the connector starts."""

from __future__ import annotations

import time

import msgspec
import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is installed by `make test`")

import torch

from aiolayer import ConfigError, Timeouts
from aiolayer_vllm.config import from_extra_config
from aiolayer_vllm.identity import fingerprint
from vllm_sched import BLOCK_SIZE, LAYERS, vllm_config

pytestmark = pytest.mark.timeout(120)

MISSPELT = {"backend": "memory", "timeouts": {"recieve": 60}}


def test_a_misspelt_timeout_name_is_refused_naming_it():
    with pytest.raises(msgspec.ValidationError, match="unknown field `recieve`"):
        msgspec.convert({"recieve": 60}, Timeouts)
    with pytest.raises(ConfigError, match=r"unknown field `recieve` - at `\$.timeouts`"):
        from_extra_config(MISSPELT, "eng")
    assert from_extra_config({"timeouts": {"receive": 60}}, "eng").timeouts.receive == 60


@pytest.mark.parametrize("extra, key", [
    (MISSPELT, "recieve"),
    ({"transport": {"bind_hots": "0.0.0.0"}}, "bind_hots"),
    ({"layerwise_min_token": 5}, "layerwise_min_token"),
    ({"backend": "memory", "timeouts": {"receive": 0}}, "receive"),
])
def test_a_bad_setting_stops_vllm_while_it_builds_the_engine_config(extra, key):
    """vLLM resolves the connector while it builds its config, in the API server before any engine
    process starts: the registered plugin checks the settings there."""
    from aiolayer_vllm.config import check_extra_config
    from aiolayer_vllm.plugin import register

    register()
    with pytest.raises(ConfigError, match=key):
        check_extra_config(extra)
    with pytest.raises(ValueError, match=f"invalid aiolayer kv_connector_extra_config: .*{key}"):
        vllm_config("kv_consumer", extra)
    vllm_config("kv_consumer", {"backend": "memory", "timeouts": {"receive": 60}})   # a good one builds


def test_the_cuda_graph_question_checks_the_settings_too():
    """Where CUDA graphs exist vLLM asks the connector class, with the extra config, at config time."""
    from aiolayer_vllm.connector import AiolayerConnector

    with pytest.raises(ConfigError, match="recieve"):
        AiolayerConnector.requires_piecewise_for_cudagraph(MISSPELT)
    assert AiolayerConnector.requires_piecewise_for_cudagraph({"backend": "memory"}) is True


def _groups(second: str = "window"):
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec,
                                            SlidingWindowSpec)

    full = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=64, dtype=torch.float32)
    other = SlidingWindowSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=64, dtype=torch.float32,
                              sliding_window=128) if second == "window" else \
        MambaSpec(block_size=BLOCK_SIZE, shapes=((4, 64),), dtypes=(torch.float32,))
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(LAYERS[:1], full), KVCacheGroupSpec(LAYERS[1:], other)])


def _start(role: str, kv_cache_config, cache_dtype: str = "auto", dbo: bool = False):
    from aiolayer_vllm.connector import AiolayerConnector
    from aiolayer_vllm.plugin import register
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    register()   # vLLM's plugin loader does it in an engine
    config = vllm_config("kv_both", {"backend": "memory"})
    config.cache_config.num_gpu_blocks = 64
    config.cache_config.cache_dtype = cache_dtype   # as vLLM validated it (the connector sees the string)
    config.parallel_config.enable_dbo = dbo
    return AiolayerConnector(config, KVConnectorRole[role], kv_cache_config)


def test_the_connector_supports_the_hybrid_kv_cache_manager():
    """vLLM keeps its hybrid KV cache manager on only for a connector class that subclasses SupportsHMA."""
    from aiolayer_vllm.connector import AiolayerConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma

    assert supports_hma(AiolayerConnector)


@pytest.mark.parametrize("role", ["SCHEDULER", "WORKER"])
def test_full_attention_and_sliding_window_groups_start_and_enter_the_fingerprint(role):
    """Several groups of attention KV start; the worker's fingerprint names them, so that a P and a D
    whose groups differ (one with the hybrid manager off) are refused at the proxy's handshake."""
    connector = _start(role, _groups())
    try:
        if role == "WORKER":
            facts = connector._worker.model_facts
            assert facts["kv_cache_groups"] == f"FullAttentionSpecx1;SlidingWindowSpec(128)x{len(LAYERS) - 1}"
            assert facts["block_size"] == BLOCK_SIZE          # groups pair block for block: one size
            hybrid, plain = fingerprint(facts), fingerprint({k: v for k, v in facts.items() if k != "kv_cache_groups"})
            assert hybrid.split("/")[0] == f"{facts['model']} (hybrid KV cache: 2 groups)", hybrid
            assert hybrid.split("/")[1] != plain.split("/")[1]
    finally:
        connector.shutdown()


def test_the_block_size_enters_the_fingerprint_only_where_blocks_pair_block_for_block():
    """One full-attention group may meet blocks of another size (tokens are copied); a sliding window's
    blocks outside the window are null and pair block for block, like several groups'."""
    from aiolayer_vllm.connector import group_facts

    assert group_facts(["FullAttentionSpecx4"], 32) == {}
    assert group_facts(["SlidingWindowSpec(128)x4"], 32) == {"block_size": 32}
    assert group_facts(["FullAttentionSpecx1", "SlidingWindowSpec(128)x3"], 32) == {
        "kv_cache_groups": "FullAttentionSpecx1;SlidingWindowSpec(128)x3", "block_size": 32}


@pytest.mark.parametrize("groups, late", [(["FullAttentionSpecx4"], True), (["SlidingWindowSpec(128)x4"], False),
                                          (["FullAttentionSpecx1", "SlidingWindowSpec(128)x3"], False)])
def test_the_identity_says_late_binding_only_where_blocks_do_not_pair_with_ds(groups, late):
    """What the proxy's ``auto`` binding goes by: a P whose scheduler pairs its blocks with D's (several
    groups, a sliding window) refuses a late request (``scheduler._pair``), so it must not say it can."""
    from aiolayer_vllm.connector import group_facts
    from aiolayer_vllm.identity import identity
    from aiolayer_vllm.ranks import Topology

    facts = {"model": "m", **group_facts(groups, 16)}
    said = identity(Topology(), True, False, facts)
    said.check()
    assert said.late_binding is late


@pytest.mark.parametrize("role", ["SCHEDULER", "WORKER"])
def test_an_ssm_state_group_is_refused_at_start(role):
    with pytest.raises(ConfigError, match="2 groups, one of them MambaSpec"):
        _start(role, _groups("mamba")).shutdown()


@pytest.mark.parametrize("role", ["SCHEDULER", "WORKER"])
@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e5m2"])
def test_an_fp8_kv_cache_with_per_tensor_scales_starts(role, cache_dtype):
    """Its scales are the model's (static in vLLM 0.32), the same at P and D: only its bytes move."""
    _start(role, _groups(), cache_dtype=cache_dtype).shutdown()


@pytest.mark.parametrize("role", ["SCHEDULER", "WORKER"])
@pytest.mark.parametrize("cache_dtype", ["fp8_per_token_head", "int8_per_token_head", "fp8_ds_mla"])
def test_a_kv_cache_with_scales_beside_its_values_is_refused_at_start(role, cache_dtype):
    with pytest.raises(ConfigError, match=f"this engine runs '{cache_dtype}'"):
        _start(role, _groups(), cache_dtype=cache_dtype).shutdown()


@pytest.mark.parametrize("role", ["SCHEDULER", "WORKER"])
def test_micro_batched_steps_are_refused_at_start(role):
    """Dual batch overlap writes each layer's KV in two parts per step; P would send the first part only."""
    with pytest.raises(ConfigError, match="micro-batches"):
        _start(role, _groups(), dbo=True).shutdown()


@pytest.mark.vllm
@pytest.mark.timeout(300)
def test_vllm_serve_with_a_misspelt_setting_exits_before_loading_the_model(tmp_path):
    """A real ``vllm serve`` (CPU, the tiny model): it must stop while it builds its config, naming the
    key, not ~40 s later inside a worker's traceback once the model has loaded."""
    from aiolayer.harness.procs import ServerError
    from aiolayer.harness.servers import VllmServer
    from aiolayer.harness.tiny_model import tiny_model_dir

    server = VllmServer(tiny_model_dir(), name="misspelt", log_dir=tmp_path, enforce_eager=True, omp_bind="nobind",
                        max_model_len=512, startup_timeout_s=150,
                        kv_transfer_config={"kv_connector": "AiolayerConnector", "kv_role": "kv_consumer",
                                            "kv_connector_extra_config": MISSPELT})
    t0 = time.monotonic()
    try:
        with pytest.raises(ServerError, match="exited with code"):
            server.start()
    finally:
        server.stop()   # a server that did start is not left running
    elapsed = time.monotonic() - t0
    log = server.log_text()
    assert any("unknown field `recieve` - at `$.timeouts`" in line for line in log.splitlines()), log[-3000:]
    assert "Initializing a V1 LLM engine" not in log and "Loading weights" not in log, log[-3000:]
    assert elapsed < 60, f"{elapsed:.0f} s: the API server alone starts in ~10-25 s on a loaded 2-core box"


# --- vLLM's own engine_id / kv_port / kv_ip ----------------------------------------------------------

def _ktc(**fields):
    from vllm.config import KVTransferConfig

    own = {k: v for k, v in fields.items() if k != "kv_ip"}
    ktc = KVTransferConfig(kv_connector="AiolayerConnector", kv_role="kv_producer", **own)
    if "kv_ip" in fields:   # a vLLM with the field (this one has none)
        object.__setattr__(ktc, "kv_ip", fields["kv_ip"])
    return ktc


def test_vllms_engine_id_and_kv_port_stand_in_for_absent_aiolayer_keys():
    config = from_extra_config({"backend": "memory"}, "fallback", _ktc(engine_id="prefill-a", kv_port=17000))
    assert (config.node.engine_id, config.node.control_port) == ("prefill-a", 17000)
    data_parallel = _ktc(engine_id="prefill-a_dp1")   # vLLM appends the DP rank; aiolayer adds its own suffix
    assert from_extra_config({}, "fallback", data_parallel).node.engine_id == "prefill-a"
    # an empty engine_id is no engine id (as aiolayer reads it alone), not a conflict with vLLM's
    assert from_extra_config({"engine_id": ""}, "fallback", _ktc(engine_id="prefill-a")).node.engine_id == "prefill-a"


def test_vllms_kv_ip_stands_in_for_the_bind_host():
    ktc = _ktc(kv_ip="10.1.2.3")
    assert from_extra_config({}, "e", ktc).node.transport.bind_host == "10.1.2.3"
    extra = {"transport": {"protocol": "tcp"}}
    assert from_extra_config(extra, "e", ktc).node.transport.bind_host == "10.1.2.3"
    assert extra == {"transport": {"protocol": "tcp"}}   # the user's dict is left as written


def test_vllms_defaults_count_as_not_given():
    """vLLM makes up a UUID engine id per engine (with "_dp<rank>" under data parallel) and always has a
    kv_port: taken as given, every engine on a host would want one port."""
    ktc = _ktc()
    config = from_extra_config({}, "fallback", ktc)
    assert (config.node.engine_id, config.node.control_port) == ("fallback", 0)
    config = from_extra_config({"engine_id": "p", "control_port": 5600}, "x", _ktc(engine_id=ktc.engine_id + "_dp0"))
    assert (config.node.engine_id, config.node.control_port) == ("p", 5600)


def test_aiolayers_keys_win_when_they_agree_and_a_conflict_is_refused_naming_both():
    same = from_extra_config({"engine_id": "p", "control_port": 17000}, "x", _ktc(engine_id="p", kv_port=17000))
    assert (same.node.engine_id, same.node.control_port) == ("p", 17000)
    with pytest.raises(ConfigError, match=r"engine_id='p' conflicts with kv_transfer_config engine_id='q'"):
        from_extra_config({"engine_id": "p"}, "x", _ktc(engine_id="q"))
    with pytest.raises(ConfigError, match=r"control_port=5600 conflicts with kv_transfer_config kv_port=17000"):
        from_extra_config({"control_port": 5600}, "x", _ktc(kv_port=17000))
    with pytest.raises(ConfigError, match=r"transport.bind_host='0.0.0.0' conflicts with kv_transfer_config kv_ip="):
        from_extra_config({"transport": {"bind_host": "0.0.0.0"}}, "x", _ktc(kv_ip="10.1.2.3"))


def test_a_conflict_stops_vllm_while_it_builds_the_engine_config():
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    import aiolayer_vllm.plugin as plugin

    plugin.register()
    ktc = _ktc(engine_id="q")
    ktc.kv_connector_extra_config = {"engine_id": "p"}
    with pytest.raises(ConfigError, match="conflicts with kv_transfer_config engine_id"):
        KVConnectorFactory.get_connector_class(ktc)


@pytest.mark.parametrize("raw", ["nan", "inf", "-inf", "abc"])
def test_a_park_wait_that_is_not_a_finite_number_falls_back_to_the_default(monkeypatch, raw):
    """NaN passed the clamp and reached zmq's poll as int(nan), raising in vLLM's schedule() at D's first
    parked step: the engine core died."""
    from aiolayer_vllm.wake import PARK_WAIT_S, open_waiter, park_wait_s

    monkeypatch.setenv("AIOLAYER_PARK_WAIT_MS", raw)
    assert park_wait_s() == PARK_WAIT_S
    waiter = open_waiter(park_wait_s(), f"park-{raw}")
    try:
        assert waiter is not None and waiter.wait() is False   # the cap passes, nothing raised
    finally:
        waiter.close()
