"""P hands a layer over as vLLM's KV update op wrote it (``aiolayer_vllm.kv_written``), once per step.

The layers here stand in for vLLM's attention modules (their ``attn_backend``, ``impl`` and shared-KV
attribute); the wrapper's rules are what is tested. P and D are real ``WorkerSide`` objects with their
own runtimes (the in-process memory backend). vLLM's own layers are hooked in its engines (the matrix,
tests/vllm_bridge/test_vllm_matrix.py, compiled and eager), whose answers equal the aggregated engine's.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM is installed by `make test`")

from aiolayer_vllm.kv_written import hook_kv_writes
from helpers_worker import assert_landed, bind_transfer, worker_pair

pytestmark = pytest.mark.timeout(60)
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(3)]


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


def test_a_layer_handed_at_its_kv_write_is_not_handed_again_after_its_attention():
    """Each layer once per step, whichever signal comes first; the bytes D gets are P's."""
    with worker_pair(LAYERS) as (p, d):
        handed: list[int] = []
        src, dst = [1, 2], [3, 4]
        bind_transfer(p, d, src, dst)
        step = p._active_step
        assert step is not None

        class Recorded:   # what the worker hands over, then the step's own hand-off
            def layer_ready(self, layer: int) -> None:
                handed.append(layer)
                step.layer_ready(layer)

            def __getattr__(self, name: str):
                return getattr(step, name)

        p._active_step = Recorded()
        for name in LAYERS:
            p.save_kv_layer(name)   # as the wrapped KV update calls it
            p.save_kv_layer(name)   # as vLLM's save_kv_layer calls it after the attention
        p.wait_for_save()
        assert handed == [0, 1, 2]
        assert_landed(p, d, src, dst)
