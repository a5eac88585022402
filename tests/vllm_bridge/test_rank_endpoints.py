"""Per-rank endpoints and the multi-rank request contract: which rank binds what, which P rank writes
which D rank, the parameters that name several ranks, and the proxy gathering every D rank's
registration before it calls P."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("vllm", reason="vLLM is installed by `make test`")

from aiolayer.errors import ConfigError
from helpers_proxy import registration
from aiolayer_vllm.params import DecodeRegistration, InvalidParams, RecvParams, SendParams, read, read_registration
from aiolayer_vllm.proxy.flow import Exchange, ProxyTimeouts
from aiolayer_vllm.proxy.pool import Backend
from aiolayer_vllm.ranks import Topology, rank_transfer_id, routes_for_p, whole_blocks, writers_of_d

TOKEN = "t" * 32


def test_each_rank_binds_base_plus_its_rank_and_names_itself():
    ports = {(dp, tp): Topology(tp_rank=tp, tp_size=2, dp_rank=dp, dp_size=2, total_kv_heads=2).control_port(5600)
             for dp in range(2) for tp in range(2)}
    assert ports == {(0, 0): 5600, (0, 1): 5601, (1, 0): 5602, (1, 1): 5603}
    assert Topology(tp_rank=1, tp_size=2, total_kv_heads=2).control_port(0) == 0     # any free port
    assert Topology().engine_id("p") == "p"
    assert Topology(tp_rank=1, tp_size=2, total_kv_heads=2).engine_id("p") == "p-dp0-tp1"
    with pytest.raises(ConfigError, match="3 KV heads"):
        Topology(tp_rank=0, tp_size=2, total_kv_heads=3)


@pytest.mark.parametrize("p_tp,d_tp", [(1, 1), (1, 2), (2, 1), (2, 2), (1, 4), (4, 1), (2, 4), (4, 2), (4, 4)])
def test_every_d_head_is_written_once_by_a_p_rank_holding_it(p_tp, d_tp):
    """2 KV heads: TP 4 replicates them. Every D rank gets each of its heads from exactly one P rank,
    and waits for exactly the P ranks that write into it."""
    heads = 2
    written: dict[int, list[int]] = {d: [] for d in range(d_tp)}
    writers: dict[int, set[int]] = {d: set() for d in range(d_tp)}
    for p in range(p_tp):
        me = Topology(tp_rank=p, tp_size=p_tp, total_kv_heads=heads)
        for route in routes_for_p(me, d_tp):
            p_first = p * me.local_heads() if p_tp <= heads else p // (p_tp // heads)
            written[route.d_rank] += [p_first + route.src_head + i for i in range(route.num_heads)]
            writers[route.d_rank].add(p)
            assert whole_blocks(route, me, d_tp) == (p_tp == d_tp or (p_tp >= heads and d_tp >= heads))
    for d in range(d_tp):
        d_me = Topology(tp_rank=d, tp_size=d_tp, total_kv_heads=heads)
        first = d * d_me.local_heads() if d_tp <= heads else d // (d_tp // heads)
        assert sorted(written[d]) == list(range(first, first + d_me.local_heads())), (d, written)
        assert writers_of_d(d_me, p_tp) == sorted(writers[d])


def test_mla_sends_each_d_rank_once_spread_over_p_ranks():
    for p_tp, d_tp in [(2, 1), (1, 2), (2, 4), (4, 2)]:
        routes = [r for p in range(p_tp) for r in routes_for_p(Topology(tp_rank=p, tp_size=p_tp, mla=True), d_tp)]
        assert sorted(r.d_rank for r in routes) == list(range(d_tp))          # each D rank exactly once
        assert len({r.p_rank for r in routes}) == min(p_tp, d_tp)           # spread over the P ranks
        assert all(whole_blocks(r, Topology(tp_rank=r.p_rank, tp_size=p_tp, mla=True), d_tp) for r in routes)


def test_transfer_ids_are_rank_qualified_only_with_several_d_ranks():
    assert rank_transfer_id("x", 0, 1) == "x"
    assert [rank_transfer_id("x", d, 2) for d in range(2)] == ["x.d0", "x.d1"]


def test_parameters_name_ranks_as_lists_only():
    send = read({"aiolayer": {"transfer_id": "x", "token": TOKEN, "dst_blocks": [3, 4], "decode_ranks": [
        {"decode_control": "tcp://10.0.0.2:5600", "dst_incarnation": "a"},
        {"decode_control": "tcp://10.0.0.2:5601", "dst_incarnation": "b"}]}})
    assert isinstance(send, SendParams) and [r.dst_incarnation for r in send.decode_ranks] == ["a", "b"]
    recv = read({"aiolayer": {"transfer_id": "x", "token": TOKEN,
                              "prefill_controls": ["tcp://10.0.0.1:5600", "tcp://10.0.0.1:5601"]}})
    assert isinstance(recv, RecvParams) and recv.prefill_tp == 2
    unnamed = read({"aiolayer": {"transfer_id": "x", "token": TOKEN}})
    assert isinstance(unnamed, RecvParams) and unnamed.prefill_tp == 1   # one P rank nobody named
    for bad, why in [
        ({"dst_blocks": [1], "decode_control": "tcp://h:1", "dst_incarnation": "i"}, "unknown field `decode_control`"),
        ({"dst_blocks": [1]}, "missing required field `decode_ranks`"),
        ({"dst_blocks": [1], "decode_ranks": []}, "length >= 1"),
        ({"dst_blocks": [1], "decode_ranks": [{"decode_control": "http://h:2", "dst_incarnation": "j"}]}, "tcp://"),
        ({"dst_blocks": [1], "decode_ranks": [{"decode_control": "tcp://h:2"}]}, "dst_incarnation"),
        ({"prefill_control": "tcp://h:1"}, "unknown field `prefill_control`"),
        ({"prefill_controls": "tcp://h:1"}, "Expected `array`"),
        ({"prefill_controls": ["tcp://h:1", "nonsense"]}, r"prefill_controls\[1\]"),
    ]:
        with pytest.raises(InvalidParams, match=why):
            read({"aiolayer": {"transfer_id": "x", "token": TOKEN, **bad}})


def test_the_proxy_backend_names_every_p_rank():
    b = Backend.parse("prefill", "http://h:8100,tcp://h:5600,tp=2")
    assert b.controls == ["tcp://h:5600", "tcp://h:5601"]
    assert Backend.parse("prefill", "http://h:8100,tcp://h:5600").controls == ["tcp://h:5600"]
    for bad in ["http://h:8100,tcp://h:5600,tp=0", "http://h:8100,tcp://h:5600,tp=x", "http://h:8100,tcp://h:65535,tp=2"]:
        with pytest.raises(ValueError, match="tp=N"):
            Backend.parse("prefill", bad)


class _State:
    notify_url = "http://proxy/internal/aiolayer/registered"
    timeouts = ProxyTimeouts()
    binding = "d-first"


def _reg(ex: Exchange, rank: int, ranks: int, blocks=(7, 8), port: int = 5600) -> DecodeRegistration:
    return read_registration(registration(ex.transfer_id, ex.token, f"inc{rank}", f"tcp://d:{port + rank}",
                                          rank=rank, ranks=ranks, blocks=blocks))


async def test_the_proxy_calls_p_only_once_every_d_rank_registered():
    p = Backend.parse("prefill", "http://p:8100,tcp://p:5600,tp=2")
    d = Backend.parse("decode", "http://d:8200,tcp://d:5600")
    ex = Exchange(_State(), "/v1/completions", {"prompt": "x"}, p, d)
    assert ex.d_body()["kv_transfer_params"]["aiolayer"]["prefill_controls"] == ["tcp://p:5600", "tcp://p:5601"]
    assert ex.add_registration(_reg(ex, 1, 2)) == "" and not ex.registered.done()
    assert "rank 0 registered other" in ex.add_registration(_reg(ex, 0, 2, blocks=(9,)))   # refused, not stored
    assert "registered twice, differently" in ex.add_registration(_reg(ex, 1, 2, port=5700))
    assert ex.add_registration(_reg(ex, 0, 2)) == "" and ex.registered.done()
    params = ex.p_body(ex.registered.result())["kv_transfer_params"]["aiolayer"]
    assert params["decode_ranks"] == [{"decode_control": "tcp://d:5600", "dst_incarnation": "inc0"},
                                      {"decode_control": "tcp://d:5601", "dst_incarnation": "inc1"}]
    assert (params["dst_blocks"], params["prefill_tp"]) == ([7, 8], 2)
    assert isinstance(read({"aiolayer": params}), SendParams)     # P accepts what the proxy sends
    one = Exchange(_State(), "/v1/completions", {"prompt": "x"}, Backend.parse("prefill", "http://p:1,tcp://p:2"), d)
    assert one.d_body()["kv_transfer_params"]["aiolayer"]["prefill_controls"] == ["tcp://p:2"]
    assert one.add_registration(_reg(one, 0, 1)) == "" and one.registered.done()
    to_p = one.p_body(one.registered.result())["kv_transfer_params"]["aiolayer"]
    assert to_p["decode_ranks"] == [{"decode_control": "tcp://d:5600", "dst_incarnation": "inc0"}]   # a list of one


def test_a_registration_that_does_not_fit_the_contract_is_refused_whole():
    good = registration("x", TOKEN, "inc", "tcp://d:1", rank=1, ranks=2)
    assert read_registration(good).registration.transfer_id == "x.d1"
    for bad, why in [
        ({**good, "rank": 2}, "rank 2 of 2"),
        ({**good, "ranks": 0}, r"\$.ranks"),
        ({**good, "registration": {**good["registration"], "transfer_id": "x"}}, "not rank 1 of 2"),
        ({**good, "registration": {**good["registration"], "decode_control": "http://d:1"}}, "tcp://host:port"),
        ({**good, "registration": {**good["registration"], "block_ids": []}}, "block_ids"),
        ({**good, "registration": {**good["registration"], "token": "short"}}, "token"),
        ({**good, "registration": {**good["registration"], "incarnation": "a b"}}, "incarnation"),
    ]:
        with pytest.raises(InvalidParams, match=why):
            read_registration(bad)


def test_pipeline_parallel_is_refused_at_start():
    from types import SimpleNamespace

    from aiolayer_vllm.ranks import from_vllm

    cfg = SimpleNamespace(parallel_config=SimpleNamespace(pipeline_parallel_size=2, tensor_parallel_size=1,
                                                          data_parallel_rank=0, data_parallel_size=1),
                          model_config=None)
    with pytest.raises(ConfigError, match="pipeline"):
        from_vllm(cfg)


def test_a_dense_models_dp_rank_is_read_where_vllm_keeps_it():
    """vLLM runs the DP ranks of a dense model as independent engines: it resets data_parallel_rank/size
    to 0/1 and keeps the rank in data_parallel_index (two DP ranks once bound the same port)."""
    from types import SimpleNamespace

    from aiolayer_vllm.ranks import from_vllm

    model = SimpleNamespace(get_total_num_kv_heads=lambda: 2, use_mla=False)
    ranks = [from_vllm(SimpleNamespace(model_config=model, parallel_config=SimpleNamespace(
        pipeline_parallel_size=1, tensor_parallel_size=1, data_parallel_rank=0, data_parallel_size=1,
        data_parallel_index=index))) for index in (0, 1)]
    assert [r.control_port(5600) for r in ranks] == [5600, 5601]
    assert ranks[0].engine_id("d") != ranks[1].engine_id("d")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_aiolayers_threads_leave_the_forwards_pinned_core():
    """vLLM pins a CPU worker's main thread (OpenMP binding); a thread it starts inherits that core.
    Threads started under ``unpinned`` get the engine's CPUs (the parent's), and the caller keeps its own."""
    code = textwrap.dedent("""
        import os, threading
        from aiolayer_vllm.threads import unpinned
        os.sched_setaffinity(0, {0})                    # what OMP binding does to the worker's main thread
        seen = {}
        def probe():
            seen["thread"] = os.sched_getaffinity(0)
        with unpinned():
            t = threading.Thread(target=probe)
            t.start()
        t.join()
        print(sorted(seen["thread"]), sorted(os.sched_getaffinity(0)))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    thread, main = out.stdout.split("] [")
    assert thread.strip("[") == ", ".join(str(c) for c in sorted(os.sched_getaffinity(0))) and main.strip("]\n") == "0"


async def test_d_does_not_post_a_registration_the_proxy_would_refuse():
    """Checked with the proxy's own struct before any HTTP: the transfer is given up at once, saying why."""
    from aiolayer import ControlError, Registration, Timeouts
    from aiolayer_vllm.publish import RegistrationPublisher

    reg = Registration(transfer_id="x.d1", block_ids=[1], first_block=0, token=TOKEN, incarnation="inc",
                       decode_control="http://d:1")
    publisher = RegistrationPublisher(Topology(tp_rank=1, tp_size=2, total_kv_heads=2))
    try:
        with pytest.raises(ControlError, match="tcp://host:port"):
            await publisher.publish(reg, "http://127.0.0.1:9/registered", "x", Timeouts(control_retries=1))
    finally:
        await publisher.close()


@pytest.mark.asyncio
async def test_a_registration_publish_ends_at_done_delivery_whatever_the_retries():
    """A proxy that is down: each attempt fails at once and waits a growing back-off; with many retries the
    publish went on long past the receive deadline that freed the blocks it announces."""
    import time

    from aiolayer import ControlError, Registration, Timeouts
    from aiolayer.harness.procs import free_port
    from aiolayer_vllm.publish import RegistrationPublisher

    reg = Registration(transfer_id="x", block_ids=[1], first_block=0, token=TOKEN, incarnation="inc",
                       decode_control="tcp://127.0.0.1:5")
    publisher = RegistrationPublisher(Topology())
    t0 = time.monotonic()
    try:
        with pytest.raises(ControlError, match="gave up after"):
            await publisher.publish(reg, f"http://127.0.0.1:{free_port()}/registered", "x",
                                    Timeouts(control_retries=100, done_delivery=1.0))
    finally:
        await publisher.close()
    assert time.monotonic() - t0 < 3.0   # 100 attempts' back-off alone is 250 s
