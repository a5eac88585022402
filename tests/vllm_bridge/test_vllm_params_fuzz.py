"""Fuzz: malformed ``kv_transfer_params`` never raise out of a connector method: one request's
parameters must never kill the engine.

Hypothesis mutates the two parameter shapes (wrong types, huge and negative ints, lone surrogates,
empty strings, nested junk, missing and extra keys) and also sends junk as the aiolayer value and
any JSON object as the whole (vLLM's OpenAI API types ``kv_transfer_params`` as an object; JSON's
``\udc80`` escape is how a lone surrogate arrives).
Every example goes through real vLLM Schedulers (tests/vllm_sched.py) of a D (kv_consumer), a P
(kv_producer) and a kv_both engine: ``get_num_new_matched_tokens``, ``update_state_after_alloc``,
``build_connector_meta``, ``request_finished``, and on the worker side ``bind_connector_metadata``
with what the scheduler built, ``save_kv_layer``, ``wait_for_save``, ``get_transfer_results``. A
second property binds worker metadata built from junk directly (defence in depth). Afterwards
every engine still serves: each fuzzed request ended, every block is back, and a good transfer
completes with its KV intact.
"""

from __future__ import annotations

import itertools
import time

import httpx  # noqa: F401 - imported here, not first on a loop thread (see _with_surrogate)
import msgspec
import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is installed by `make test`")
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_sched import LAYERS, Engine, layer_pattern, lookup, recv_params, send_params, steps_until

pytestmark = pytest.mark.timeout(600)
FAST = {"control_call": 0.3, "control_retries": 2, "layer_write": 1.0, "done_delivery": 0.5, "receive": 5.0,
        "fence_grace": 0.5}
PROMPT = list(range(20, 28))           # 8 tokens: one block
_ids = itertools.count()

# Named functions, no lambdas: hypothesis describes lambdas by walking module tables, which the
# runtimes' loop threads may change meanwhile (a lazy import) -> a flaky RuntimeError in hypothesis.


def _with_surrogate(a: str, b: str) -> str:
    return a + "\udc80" + b


def _ours(value) -> dict:
    return {"aiolayer": value}


def _ours_and(value, other: dict) -> dict:
    return {"aiolayer": value, **other}


SURROGATE = st.builds(_with_surrogate, st.text(max_size=4), st.text(max_size=4))
SCALAR = (st.none() | st.booleans() | st.integers() | st.integers(min_value=2**63 - 2, max_value=2**80)
          | st.integers(max_value=-1) | st.floats() | st.text(max_size=20) | st.just("") | SURROGATE
          | st.text(min_size=600, max_size=700))


def _nest(inner):
    return st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8) | SURROGATE, inner, max_size=4)


JUNK = st.recursive(SCALAR, _nest, max_leaves=8)

RECV = {"transfer_id": "fz", "token": "fz-token-0123456789abcdef", "prefill_controls": ["tcp://127.0.0.1:1"],
        "notify_url": "http://127.0.0.1:1/registered"}
SEND = {"transfer_id": "fz", "token": "fz-token-0123456789abcdef", "dst_blocks": [1, 2], "first_block": 0,
        "decode_ranks": [{"decode_control": "tcp://127.0.0.1:1", "dst_incarnation": "inc"}]}


def _mutate(base: dict, drop: set, junk: dict, extra: dict) -> dict:
    out = {k: v for k, v in base.items() if k not in drop}
    out.update(junk)
    out.update(extra)
    return out


def _mutated(base: dict):
    keys = sorted(base)
    return st.builds(_mutate, st.just(base), st.sets(st.sampled_from(keys)),
                     st.dictionaries(st.sampled_from(keys), JUNK, max_size=3),
                     st.dictionaries(st.text(max_size=12) | SURROGATE, JUNK, max_size=2))


PARAMS = st.one_of(
    st.builds(_ours, _mutated(RECV) | _mutated(SEND)),
    st.builds(_ours_and, _mutated(RECV) | _mutated(SEND), st.dictionaries(st.text(max_size=8), JUNK, max_size=2)),
    st.builds(_ours, JUNK),
    st.dictionaries(st.text(max_size=8) | SURROGATE, JUNK, max_size=3),   # vLLM's API admits any JSON object
)


@pytest.fixture(scope="module")
def trio():
    made = {}
    try:
        for role, name in (("kv_consumer", "d"), ("kv_producer", "p"), ("kv_both", "both")):
            made[name] = Engine(role, {"backend": "memory", "engine_id": f"fuzz-{name}", "timeouts": FAST})
        yield made
    finally:
        for eng in made.values():
            eng.close()


@pytest.fixture(scope="module")
def lone():
    """An engine whose worker gets junk metadata for requests its scheduler never saw (so it is
    never stepped through that scheduler, which would assert on the unknown ids)."""
    eng = Engine("kv_both", {"backend": "memory", "engine_id": "fuzz-lone", "timeouts": FAST})
    yield eng
    eng.close()


def _abort_stragglers(engine: Engine) -> None:
    from vllm.v1.request import RequestStatus

    alive = [r for r, req in engine.scheduler.requests.items() if r.startswith("fz") and not req.is_finished()]
    if alive:
        engine.scheduler.finish_requests(alive, RequestStatus.FINISHED_ABORTED)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(params=PARAMS)
def test_malformed_kv_transfer_params_never_raise_out_of_the_connector(trio, params):
    engines = list(trio.values())
    n = next(_ids)
    ours = params.get("aiolayer")
    if isinstance(ours, dict) and ours.get("transfer_id") == "fz":   # valid by chance: a fresh transfer
        params = {**params, "aiolayer": {**ours, "transfer_id": f"fz{n}"}}
    for eng in engines:
        eng.add(f"fz-{n}-{eng.config.kv_transfer_config.kv_role}", PROMPT, 1, params)
    for _ in range(2):
        for eng in engines:
            eng.step()
    for eng in engines:       # valid by chance: parked at D or sent at P; give it up, it must still end
        _abort_stragglers(eng)
        eng.step()


def _unchecked(struct, **fields):
    """``struct`` holding what its checks refuse: what a worker must survive all the same."""
    for name, value in fields.items():
        msgspec.structs.force_setattr(struct, name, value)
    return struct


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(tid=st.text(max_size=6) | SURROGATE, token=st.text(max_size=20) | SURROGATE,
       endpoint=st.sampled_from(["", "tcp://127.0.0.1:1", "tcp://127.0.0.1:\udc80", "nonsense"]),
       blocks=st.lists(st.integers(min_value=-2**64, max_value=2**64), max_size=4),
       first=st.integers(min_value=-2**64, max_value=2**64))
def test_junk_worker_metadata_fails_alone(lone, tid, token, endpoint, blocks, first):
    """What the scheduler never builds, bound anyway: the worker refuses it without raising."""
    from aiolayer_vllm.metadata import AiolayerMetadata, RecvReq, SendReq
    from aiolayer_vllm.params import DecodeRank, RecvParams, SendParams

    valid = {"transfer_id": "x", "token": "fz-token-0123456789abcdef"}
    recv = _unchecked(RecvParams(**valid), transfer_id="fzw" + tid, token=token, prefill_controls=[endpoint])
    rank = _unchecked(DecodeRank(decode_control="tcp://h:1", dst_incarnation="i"), decode_control=endpoint,
                      dst_incarnation=tid)
    send = _unchecked(SendParams(**valid, dst_blocks=[1], decode_ranks=[rank]), transfer_id="fzw" + tid,
                      token=token, dst_blocks=blocks)
    meta = AiolayerMetadata(recvs=[RecvReq(f"fz-w{next(_ids)}", recv, blocks, first)],
                            sends=[SendReq(f"fz-w{next(_ids)}", send, blocks, blocks)],
                            aborts=[(f"fz-w{next(_ids)}", "fzw" + tid)],
                            cancels=[(f"fz-w{next(_ids)}", "fzw" + tid)])
    worker = lone.worker
    worker.bind_connector_metadata(meta)
    for name in LAYERS:
        worker.save_kv_layer(name, lone.kv[name], None)
    worker.wait_for_save()
    worker.get_transfer_results(set())
    worker.get_block_ids_with_load_errors()
    worker.clear_connector_metadata()
    assert lone.runtime.loop_thread.alive


def test_after_the_fuzz_every_engine_still_serves(trio):
    """Runs after the properties (file order): nothing is left behind, and a good transfer works."""
    d, p, both = trio["d"], trio["p"], trio["both"]

    def settled() -> bool:
        return all(not any(r.startswith("fz-") and not r.startswith("fz-w") for r in eng.scheduler.requests)
                   and _pool_full(eng) for eng in (d, p, both))

    steps_until(settled, d, p, both, limit=FAST["receive"] + 10)
    for dst, src, tid in ((d, p, "good-dp"), (both, both, "good-bb")):
        dst.add(f"d-{tid}", PROMPT, 2, recv_params(src, tid))
        dst.step()
        reg = lookup(src, dst, tid)
        src.add(f"p-{tid}", PROMPT, 1, send_params(dst, tid, reg))
        src.step(before_save=layer_pattern(src, f"p-{tid}"))
        t0 = time.monotonic()
        steps_until(lambda: dst.finished(f"d-{tid}"), dst, src, limit=8)
        assert str(dst.finished(f"d-{tid}")[-1].finish_reason) == "length", time.monotonic() - t0
        for i, name in enumerate(LAYERS):
            assert (dst.kv_blocks(name)[reg.block_ids] == float(i + 1)).all()


def _pool_full(engine: Engine) -> bool:
    pool = engine.scheduler.kv_cache_manager.block_pool
    return pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
