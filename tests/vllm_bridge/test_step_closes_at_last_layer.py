"""P's step closes the moment its last layer is handed over (vLLM's KV update for the last layer), not
at ``wait_for_save`` after the forward: the loop is woken for that layer instead of finding it at its
next look. Real ``WorkerSide`` objects with their own runtimes on the in-process memory backend."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm", reason="vLLM is installed by `make test`")

from helpers_worker import assert_landed, bind_transfer, worker_pair

pytestmark = pytest.mark.timeout(60)
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(3)]


def _open_steps(w) -> int:
    return w.runtime.debug_tables()["sender_steps"]


def _until_closed(w, within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while _open_steps(w):
        assert time.monotonic() < deadline, "the step is still open"
        time.sleep(0.01)


def test_the_step_closes_with_its_last_layer_before_wait_for_save():
    with worker_pair(LAYERS) as (p, d):
        src, dst = [1, 2], [3, 4]
        bind_transfer(p, d, src, dst)
        for name in LAYERS:
            p.save_kv_layer(name)
        _until_closed(p)   # no wait_for_save yet
        assert_landed(p, d, src, dst)
        p.wait_for_save()   # vLLM's call after the forward: nothing left to do, nothing fails
        p.save_kv_layer(LAYERS[-1])   # the layer's own signal after its attention: already handed
        assert _open_steps(p) == 0


def test_a_step_stays_open_while_a_layer_is_missing_and_closes_when_it_comes():
    with worker_pair(LAYERS) as (p, d):
        src, dst = [5], [6]
        bind_transfer(p, d, src, dst)
        for name in LAYERS[1:]:   # the last layer first: layer 0 (not hooked, say) signals later
            p.save_kv_layer(name)
        time.sleep(0.3)
        assert _open_steps(p) == 1
        p.save_kv_layer(LAYERS[0])
        _until_closed(p)
        assert_landed(p, d, src, dst)
