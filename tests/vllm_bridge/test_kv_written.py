"""P hands a layer over as vLLM's KV update op wrote it (``aiolayer_vllm.kv_written``), once per step.

The layers here stand in for vLLM's attention modules (their ``attn_backend``, ``impl`` and shared-KV
attribute); the wrapper's rules are what is tested. P and D are real ``WorkerSide`` objects with their
own runtimes (the in-process memory backend). vLLM's own layers are hooked in its engines (the matrix,
tests/vllm_bridge/test_vllm_matrix.py, compiled and eager), whose answers equal the aggregated engine's.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is installed by `make test`")

from aiolayer_vllm.config import from_extra_config
from aiolayer_vllm.kv_written import hook_kv_writes
from aiolayer_vllm.metadata import AiolayerMetadata, RecvReq, SendReq
from aiolayer_vllm.params import DecodeRank, RecvParams, SendParams
from aiolayer_vllm.ranks import Topology
from aiolayer_vllm.worker import WorkerSide

pytestmark = pytest.mark.timeout(60)
HEADS, BLOCK, HEAD_SIZE, BLOCKS = 2, 16, 8, 8
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
TOKEN = "k" * 32


class Impl:
    def __init__(self, log: list) -> None:
        self.log = log

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        self.log.append(("update", layer))


def _layer(log: list, name: str, *, apart: bool = True, shares: str | None = None, impl: Impl | None = None):
    backend = SimpleNamespace(forward_includes_kv_cache_update=not apart)
    return SimpleNamespace(attn_backend=backend, impl=impl or Impl(log), kv_sharing_target_layer_name=shares,
                           name=name)


def test_the_update_is_wrapped_where_vllm_runs_it_apart_and_reports_after_it():
    log: list = []
    shared_impl = Impl(log)
    context = {"a": _layer(log, "a"), "b": _layer(log, "b", apart=False), "c": _layer(log, "c", shares="a"),
               "d": _layer(log, "d", impl=shared_impl), "e": _layer(log, "e", impl=shared_impl),
               "f": SimpleNamespace(), "g": _layer(log, "g")}
    written = lambda name: log.append(("written", name))  # noqa: E731
    assert hook_kv_writes(context, ["a", "b", "c", "d", "e", "f", "g", "missing"], written) == ["a", "g"]
    context["a"].impl.do_kv_cache_update("a", None, None, None, None)
    assert log == [("update", "a"), ("written", "a")]          # after vLLM's write, never before
    assert hook_kv_writes(context, ["a"], written) == []         # never wrapped twice
    log.clear()
    context["a"].impl.do_kv_cache_update("a", None, None, None, None)
    assert log == [("update", "a"), ("written", "a")]


def _worker(role: str) -> WorkerSide:
    config = from_extra_config({"backend": "memory", "timeouts": {"receive": 20.0, "fence_grace": 2.0}}, role)
    w = WorkerSide(config, role == "p", role == "d", BLOCKS, Topology(total_kv_heads=HEADS), block_size=BLOCK,
                   head_size=HEAD_SIZE)
    w.caches = {name: (torch.rand(BLOCKS, HEADS, BLOCK, 2 * HEAD_SIZE) if role == "p" else
                       torch.zeros(BLOCKS, HEADS, BLOCK, 2 * HEAD_SIZE)) for name in LAYERS}
    w.register_kv_caches(w.caches)
    return w


def test_a_layer_handed_at_its_kv_write_is_not_handed_again_after_its_attention():
    """Each layer once per step, whichever signal comes first; the bytes D gets are P's."""
    p, d = _worker("p"), _worker("d")
    try:
        handed: list[int] = []
        src, dst = [1, 2], [3, 4]
        d.bind(AiolayerMetadata(recvs=[RecvReq("rq-d", RecvParams(transfer_id="tx", token=TOKEN), dst, 0)]))
        d.bind(AiolayerMetadata())
        rank = DecodeRank(decode_control=d.runtime.control_endpoint, dst_incarnation=d.runtime.incarnation)
        params = SendParams(transfer_id="tx", token=TOKEN, dst_blocks=dst, decode_ranks=[rank])
        p.bind(AiolayerMetadata(sends=[SendReq("rq-p", params, src, dst)]))
        step = p._active_step
        assert step is not None
        ready = step.layer_ready
        step.layer_ready = lambda layer: (handed.append(layer), ready(layer))   # what the worker hands over
        for name in LAYERS:
            p.save_kv_layer(name)   # as the wrapped KV update calls it
            p.save_kv_layer(name)   # as vLLM's save_kv_layer calls it after the attention
        p.wait_for_save()
        assert handed == [0, 1, 2]
        deadline = time.monotonic() + 30
        got = False
        while not got:
            assert time.monotonic() < deadline
            _, recv, failed = d.transfer_results(set())
            assert not failed
            got = bool(recv)
            time.sleep(0.01)
        for name in LAYERS:
            assert torch.equal(d.caches[name][dst], p.caches[name][src]), name
    finally:
        p.shutdown()
        d.shutdown()
