"""Regression tests of the connector through the real vLLM Scheduler: a request whose KV already arrived,
preemption at P and at D, bad parameters, several samples (n > 1) on one transfer, ``kv_both`` engines.

Each test drives real vLLM ``Scheduler``s with the connector and real aiolayer runtimes (memory
backend) as tests/vllm_sched.py describes, and asserts how each request really ended (vLLM's own
finish reason) within a bound far below the receive deadline: a request left waiting fails the test.
"""

from __future__ import annotations

import msgspec
import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is installed by `make test`")

from vllm_sched import (LAYERS, Engine, engines_fixture, layer_pattern, lookup, recv_params,
                        send_params, steps_until, tok)

pytestmark = pytest.mark.timeout(120)
LIMIT = 8.0          # every case ends well within this; the receive deadline is 20 s


engines = pytest.fixture(engines_fixture, name="engines")


def _waiting_remote():
    from vllm.v1.request import RequestStatus

    return RequestStatus.WAITING_FOR_REMOTE_KVS


def _ended(engine: Engine, req_id: str) -> str:
    """How vLLM finished the request: "length" (served), "error" (failed), or "" (not yet)."""
    done = engine.finished(req_id)
    return str(done[-1].finish_reason) if done else ""


def _prefill_at_p(p: Engine, d: Engine, tid: str, prompt: list[int], req_id: str | None = None, **add):
    reg = lookup(p, d, tid)
    req_id = req_id or "p-" + tid
    p.add(req_id, prompt, add.pop("max_tokens", 1), send_params(d, tid, reg))
    p.step(before_save=layer_pattern(p, req_id))
    return reg


def _pool_full(engine: Engine) -> bool:
    pool = engine.scheduler.kv_cache_manager.block_pool
    return pool.get_num_free_blocks() == pool.num_gpu_blocks - 1


# --- D re-parks a request whose KV already arrived -----------------------------------------------------

def test_one_token_prompt_is_computed_locally_after_its_kv_arrived(engines):
    """vLLM recomputes the last token of a full-prompt load: with a 1-token prompt it resets the
    count to 0 and asks the connector again. The parameters are spent: no second receive."""
    d = engines("kv_consumer", "d-one-token")
    p = engines("kv_producer", "p-one-token")
    d.add("d-1", [42], 3, recv_params(p, "one-token"))
    d.step()
    assert d.status("d-1") is _waiting_remote()
    _prefill_at_p(p, d, "one-token", [42])
    steps_until(lambda: _ended(d, "d-1"), d, p, limit=LIMIT)
    assert _ended(d, "d-1") == "length"
    assert d.runtime.receiver.outcome_counts == {"finished": 1}


def test_request_preempted_at_d_is_prefilled_locally_not_parked_again(engines):
    """A tiny KV cache at D: two received requests outgrow it while decoding, vLLM preempts one
    (freeing its blocks, so the received KV is gone) and asks the connector again; the request is
    then prefilled locally and completes, instead of waiting for a transfer that already happened."""
    d = engines("kv_consumer", "d-preempted", num_blocks=6)      # 5 usable blocks of 32 tokens
    p = engines("kv_producer", "p-preempted")
    prompt = list(range(3, 67))                               # 64 tokens: 2 blocks, a 3rd at decode
    reqs = {}
    for name in ("a", "b"):
        reqs[name] = d.add(f"d-{name}", prompt, 6, recv_params(p, f"preempted-{name}"))
        d.step()
        assert d.status(f"d-{name}") is _waiting_remote()
    for name in ("a", "b"):
        _prefill_at_p(p, d, f"preempted-{name}", prompt)
    parked_again = []

    def watch() -> bool:
        parked_again.extend(n for n, r in reqs.items() if r.num_preemptions and r.status is _waiting_remote())
        return bool(_ended(d, "d-a") and _ended(d, "d-b"))

    steps_until(watch, d, p, limit=LIMIT)
    assert sum(r.num_preemptions for r in reqs.values()) >= 1, "the test must force a preemption at D"
    assert not parked_again
    assert (_ended(d, "d-a"), _ended(d, "d-b")) == ("length", "length")
    assert d.runtime.receiver.outcome_counts == {"finished": 2}
    assert _pool_full(d)


# --- P preempted while its layer-wise send is in flight ------------------------------------------------

@pytest.mark.parametrize("asynchronous", [True, False], ids=["async-scheduling", "sync"])
def test_send_of_a_request_preempted_at_p_fails_and_never_says_done(engines, asynchronous):
    """vLLM frees a preempted request's blocks at once (``_preempt_request``), even while the step
    that carried its layer-wise send is still writing them to D; here the next step's forward
    reuses those blocks for other requests before the (slowed) writes read them. The send must
    end as a failure at D (FAILED after its writes are quiet), never DONE with another's KV.

    async-scheduling (vLLM's default where supported): P's request X (max_tokens=1, as the proxy
    asks) is done after its prefill step N, but step N+1 is scheduled before N's output is in:
    X is still running (skipped, at max_tokens) and is the last one, so vLLM preempts it when Y
    needs a block. sync: the same with max_tokens=2, X preempted in the next step."""
    d = engines("kv_consumer", "d-p-preempted")
    p = engines("kv_producer", "p-p-preempted", num_blocks=8, asynchronous=asynchronous)   # 7 usable blocks
    prompt = list(range(5, 69))                               # 64 tokens: 2 blocks
    d.add("d-x", prompt, 3, recv_params(p, "p-preempted"))
    d.step()
    reg = lookup(p, d, "p-preempted")
    p.add("p-y", list(range(100, 196)), 2, None)              # 3 blocks, needs a 4th at its 1st decode
    p.add("p-z", list(range(200, 264)), 2, None)              # 2 blocks, needs a 3rd
    x = p.add("p-x", prompt, 1 if asynchronous else 2, send_params(d, "p-preempted", reg))  # the pool is now full
    d.runtime.backend.faults.delay_s = 0.5                    # P's writes stay in flight a while

    def forward(name: str) -> None:                           # X's KV, and other requests' KV elsewhere
        for req_id in ("p-y", "p-z"):
            p.kv_blocks(name)[p.blocks_of(req_id)] = -1.0
        if p.blocks_of("p-x"):
            p.kv_blocks(name)[p.blocks_of("p-x")] = float(LAYERS.index(name) + 1)

    first = p.run(before_save=forward)
    assert [s.req_id for s in first[0].kv_connector_metadata.sends] == ["p-x"]
    if asynchronous:
        second = p.run(before_save=forward)                   # scheduled before step N's output is in
        p.land(*first)
        p.land(*second)
    else:
        p.land(*first)
        p.step(before_save=forward)                           # Y and Z grow into X's freed blocks
    assert x.num_preemptions == 1, "the test must preempt P's request while its send is in flight"
    steps_until(lambda: _ended(d, "d-x") and _ended(p, "p-x") and _pool_full(p), d, p, limit=LIMIT)
    assert d.runtime.receiver.outcome_counts["finished"] == 0, "D accepted KV read from freed blocks"
    assert _ended(d, "d-x") == "error"                        # kv_load_failure_policy "fail"
    assert p.runtime.sender.outcome_counts["finished"] == 0


# --- one request's parameters must never kill the engine ----------------------------------------------

BAD_RECV = {
    "empty token": {"token": ""},
    "short token": {"token": "short"},
    "surrogate endpoint": {"prefill_controls": ["tcp://127.0.0.1:\udc80"]},
    "endpoint without port": {"prefill_controls": ["tcp://127.0.0.1"]},
    "endpoints not a list": {"prefill_controls": "tcp://127.0.0.1:5555"},
    "unknown field": {"prefil_controls": ["tcp://127.0.0.1:5555"]},
    "one rank's spelling": {"prefill_control": "tcp://127.0.0.1:5555"},
    "ftp notify_url": {"notify_url": "ftp://proxy/registered"},
    "surrogate notify_url": {"notify_url": "http://proxy\udc80/registered"},
    "empty transfer id": {"transfer_id": ""},
}


@pytest.mark.parametrize("case", sorted(BAD_RECV))
def test_bad_params_at_d_prefill_locally(engines, case):
    d = engines("kv_consumer", "d-bad-d-params")
    params = {"transfer_id": "bad-d-params", "token": tok("bad-d-params"), "prefill_controls": ["tcp://127.0.0.1:5555"],
              **BAD_RECV[case]}
    d.add("d-bad", list(range(40)), 2, {"aiolayer": params})
    d.step()
    assert d.status("d-bad") is not _waiting_remote()
    steps_until(lambda: _ended(d, "d-bad"), d, limit=LIMIT)
    assert _ended(d, "d-bad") == "length"
    assert not d.runtime.receiver.outcome_counts


BAD_SEND = {
    "empty token": {"token": ""},
    "empty dst_incarnation": {"decode_ranks": [{"decode_control": "tcp://127.0.0.1:5555", "dst_incarnation": ""}]},
    "no decode rank": {"decode_ranks": []},
    "one rank's spelling": {"decode_control": "tcp://127.0.0.1:5555", "dst_incarnation": "inc"},
    "dst block 2**63": {"dst_blocks": [2**63, 1]},
    "negative dst block": {"dst_blocks": [-1, 1]},
    "surrogate decode_control": {"decode_ranks": [{"decode_control": "tcp://127.0.0.1:\udc80",
                                                   "dst_incarnation": "inc"}]},
    "decode_control not tcp": {"decode_ranks": [{"decode_control": "http://127.0.0.1:5555", "dst_incarnation": "inc"}]},
    "negative first_block": {"first_block": -1},
    "huge first_block": {"first_block": 2**40},
}


@pytest.mark.parametrize("case", sorted(BAD_SEND))
def test_bad_params_at_p_are_not_sent_and_the_engine_keeps_serving(engines, case):
    d = engines("kv_consumer", "d-bad-p-params")
    p = engines("kv_producer", "p-bad-p-params")
    prompt = list(range(7, 71))
    d.add("d-good", prompt, 2, recv_params(p, "good"))
    d.step()
    reg = lookup(p, d, "good")
    bad = send_params(d, "bad", reg)
    bad["aiolayer"].update(BAD_SEND[case])
    p.add("p-bad", prompt, 1, bad)
    p.step(before_save=layer_pattern(p, "p-bad"))              # nothing raises on the model-runner thread
    steps_until(lambda: _ended(p, "p-bad") and _pool_full(p), p, limit=LIMIT)
    # the engine keeps serving: a good transfer through the same P and D still completes
    p.add("p-good", prompt, 1, send_params(d, "good", reg))
    p.step(before_save=layer_pattern(p, "p-good"))
    steps_until(lambda: _ended(d, "d-good"), d, p, limit=LIMIT)
    assert _ended(d, "d-good") == "length"
    for i, name in enumerate(LAYERS):
        assert (d.kv_blocks(name)[reg.block_ids] == float(i + 1)).all()
    assert p.runtime.sender.outcome_counts == {"finished": 1}


def test_worker_never_raises_for_one_bad_request(engines):
    """Defence in depth: metadata the scheduler would never build still fails alone at the worker."""
    from aiolayer_vllm.metadata import AiolayerMetadata, SendReq

    d = engines("kv_consumer", "d-one-bad")
    p = engines("kv_producer", "p-one-bad")
    prompt = list(range(9, 73))
    d.add("d-w", prompt, 2, recv_params(p, "one-bad"))
    d.step()
    reg = lookup(p, d, "one-bad")
    p.add("p-w", prompt, 1, send_params(d, "one-bad", reg))
    out = p.scheduler.schedule()
    meta = out.kv_connector_metadata
    good = meta.sends[0]
    ghost = msgspec.structs.replace(good.params, transfer_id="ghost", token="", decode_ranks=[
        msgspec.structs.replace(r, dst_incarnation="") for r in good.params.decode_ranks])
    meta.sends.insert(0, SendReq("p-ghost", ghost, good.src_blocks, good.dst_blocks))   # TransferSpec refuses it
    assert isinstance(meta, AiolayerMetadata)
    p.worker.bind_connector_metadata(meta)
    for name in LAYERS:
        layer_pattern(p, "p-w")(name)
        p.worker.save_kv_layer(name, p.kv[name], None)
        p.worker.save_kv_layer("model.no_such_layer.attn", p.kv[name], None)
    p.worker.wait_for_save()
    p.worker.clear_connector_metadata()
    steps_until(lambda: d.runtime.receiver.outcome_counts["finished"] == 1, d, limit=LIMIT)


# --- n > 1 shares one kv_transfer_params --------------------------------------------------------------

def test_d_children_sharing_a_transfer_id_are_served_once_each(engines):
    """vLLM's n > 1 children share one kv_transfer_params: the first receives, the others are
    prefilled locally; none waits forever."""
    d = engines("kv_consumer", "d-d-children")
    p = engines("kv_producer", "p-d-children")
    prompt = list(range(11, 75))
    shared = recv_params(p, "d-children")
    d.add("d-c0", prompt, 2, shared)
    d.add("d-c1", prompt, 2, shared)
    d.step()
    assert d.status("d-c0") is _waiting_remote() and d.status("d-c1") is not _waiting_remote()
    _prefill_at_p(p, d, "d-children", prompt)
    steps_until(lambda: _ended(d, "d-c0") and _ended(d, "d-c1"), d, p, limit=LIMIT)
    assert (_ended(d, "d-c0"), _ended(d, "d-c1")) == ("length", "length")
    assert d.runtime.receiver.outcome_counts == {"finished": 1}
    assert _pool_full(d)


def test_p_children_sharing_a_transfer_id_send_once_and_free_every_block(engines):
    d = engines("kv_consumer", "d-p-children")
    p = engines("kv_producer", "p-p-children")
    prompt = list(range(13, 77))
    d.add("d-1", prompt, 2, recv_params(p, "p-children"))
    d.step()
    shared = send_params(d, "p-children", lookup(p, d, "p-children"))
    p.add("p-c0", prompt, 1, shared)
    p.add("p-c1", prompt, 1, shared)
    first = p.step(before_save=layer_pattern(p, "p-c0"))
    assert [s.req_id for s in first.kv_connector_metadata.sends] == ["p-c0"]
    steps_until(lambda: _ended(d, "d-1") and _pool_full(p) and not p.scheduler.requests, d, p, limit=LIMIT)
    assert _ended(d, "d-1") == "length"
    assert p.runtime.sender.outcome_counts == {"finished": 1}


# --- kv_role "kv_both" --------------------------------------------------------------------------------

def test_kv_both_engines_tell_p_parameters_from_d_parameters(engines):
    """vLLM's NIXL recipes start both engines with kv_both: P's own request (P's parameters) must be
    prefilled and sent, not parked as a receive; D's must be parked and received."""
    d = engines("kv_both", "d-kv-both")
    p = engines("kv_both", "p-kv-both")
    prompt = list(range(17, 81))
    d.add("d-1", prompt, 2, recv_params(p, "kv-both"))
    d.step()
    assert d.status("d-1") is _waiting_remote()
    reg = lookup(p, d, "kv-both")
    p.add("p-1", prompt, 1, send_params(d, "kv-both", reg))
    first = p.step(before_save=layer_pattern(p, "p-1"))
    assert p.status("p-1") is not _waiting_remote()
    assert [s.req_id for s in first.kv_connector_metadata.sends] == ["p-1"]
    steps_until(lambda: _ended(d, "d-1") and _pool_full(p), d, p, limit=LIMIT)
    assert _ended(d, "d-1") == "length"
    for i, name in enumerate(LAYERS):
        assert (d.kv_blocks(name)[reg.block_ids] == float(i + 1)).all()
