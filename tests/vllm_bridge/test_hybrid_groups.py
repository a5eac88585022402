"""Several KV cache groups (vLLM's hybrid KV cache manager): how P pairs its groups' blocks with D's, how
the groups' shared tensors become the runtime's layers, and a transfer through vLLM's real Scheduler
(in-process P and D, ``vllm_sched``) with a full-attention and a sliding-window group."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is installed by `make test`")

import torch

from aiolayer_vllm.layout import describe
from aiolayer_vllm.scheduler import pair_groups
from vllm_sched import FAST, LAYERS, engines_fixture, lookup, send_params, steps_until, tok

NULL = 0
WINDOW = 32     # one block
engines = pytest.fixture(engines_fixture, name="engines")
pytestmark = pytest.mark.timeout(120)


def test_blocks_pair_group_by_group_and_d_null_blocks_are_not_moved():
    # full attention: 3 blocks; sliding window: D holds only the last one, P still all three
    p_groups = [[11, 12, 13], [21, 22, 23]]
    d_flat = [31, 32, 33] + [NULL, NULL, 43]
    assert pair_groups(p_groups, d_flat, NULL) == ([11, 12, 13, 23], [31, 32, 33, 43], "")


def test_groups_of_other_sizes_are_refused_naming_them():
    src, dst, refused = pair_groups([[11, 12], [21, 22]], [31, 32, 33], NULL)
    assert (src, dst) == ([], []) and "D registered 3 blocks, P holds 4 in 2 KV cache group(s)" in refused


def test_a_block_d_needs_but_p_freed_is_refused():
    src, dst, refused = pair_groups([[11, 12], [NULL, 22]], [31, 32, 41, 42], NULL)
    assert (src, dst) == ([], []) and "group 1: D needs a block P already freed" in refused


def test_one_group_pairs_as_before():
    assert pair_groups([[5, 6, 7]], [8, 9, 10], NULL) == ([5, 6, 7], [8, 9, 10], "")


def test_layers_overlaid_on_one_tensor_are_one_runtime_layer_named_after_the_last():
    """vLLM's hybrid manager: layer i of each group uses the same tensor (a block id belongs to one
    group at a time), so the runtime moves each tensor once, after its last layer has run."""
    blocks, block_size, heads, head = 8, 32, 1, 64
    tensors = [torch.zeros(blocks, heads, block_size, 2 * head) for _ in range(2)]
    # 6 layers in 3 groups of 2: layers 0, 2, 3 on tensor 0 and 1, 4, 5 on tensor 1
    on = {0: 0, 1: 1, 2: 0, 3: 0, 4: 1, 5: 1}
    caches = {f"model.layers.{i}.self_attn.attn": tensors[t] for i, t in on.items()}
    layout = describe(caches, blocks, block_size, head, heads, use_mla=False)
    assert layout.names == ("model.layers.3.self_attn.attn", "model.layers.5.self_attn.attn")
    assert layout.k_base == (tensors[0].data_ptr(), tensors[1].data_ptr())
    assert layout.block_bytes == heads * block_size * 2 * head * 4


def test_separate_tensors_stay_separate_layers():
    blocks, block_size, head = 8, 32, 64
    caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(blocks, 1, block_size, 2 * head) for i in range(3)}
    layout = describe(caches, blocks, block_size, head, 1, use_mla=False)
    assert layout.names == tuple(f"model.layers.{i}.self_attn.attn" for i in range(3))


def _recv(p, tid: str) -> dict:
    return {"aiolayer": {"transfer_id": tid, "token": tok(tid), "prefill_controls": [p.runtime.control_endpoint]}}


def test_each_group_lands_in_its_own_blocks_and_blocks_outside_d_window_are_not_sent(engines):
    from vllm.v1.request import RequestStatus

    d = engines("kv_consumer", "d-hyb", window=WINDOW)
    p = engines("kv_producer", "p-hyb", window=WINDOW)
    prompt = list(range(3, 153))          # 150 tokens: 5 blocks
    d.add("d-h", prompt, 3, _recv(p, "th"))
    d.step()
    full, window = d.blocks_of("d-h", 0), d.blocks_of("d-h", 1)
    # D's window at its first decode step starts at token 150 - 32 + 1 = 119: blocks 3 and 4 only
    assert len(full) == len(window) == 5 and window[:3] == [NULL] * 3 and NULL not in window[3:] + full
    reg = lookup(p, d, "th")
    assert reg.block_ids == full + window
    p.add("p-th", prompt, 1, send_params(d, "th", reg))

    def forward(name: str) -> None:      # each layer writes its own group's blocks of the one tensor
        group = LAYERS.index(name)
        assert NULL not in p.blocks_of("p-th", group)
        p.kv_blocks(name)[p.blocks_of("p-th", group)] = float(group + 1)

    p.step(before_save=forward)
    steps_until(lambda: d.status("d-h") in (RequestStatus.RUNNING, None), d, p)
    kv = d.kv_blocks(LAYERS[0])           # both layers' view of the one tensor
    assert (kv[full] == 1.0).all() and (kv[window[3:]] == 2.0).all()
    assert (kv[NULL] == 0.0).all(), "a block outside D's window was written (into vLLM's null block)"


def test_a_d_with_other_kv_cache_groups_gets_failed_not_a_wrong_cache(engines, caplog):
    """P with a sliding-window group, D without (one group): P refuses to send and D's request fails
    at once, naming the groups, instead of waiting for its deadline or decoding over half a cache."""
    d = engines("kv_consumer", "d-one")
    p = engines("kv_producer", "p-two", window=WINDOW)
    prompt = list(range(3, 103))
    d.add("d-o", prompt, 3, _recv(p, "to"))
    d.step()
    p.add("p-to", prompt, 1, send_params(d, "to", lookup(p, d, "to")))
    p.step()
    seconds = steps_until(lambda: "d-o" not in d.scheduler.requests, d, p)
    assert seconds < 5.0, seconds
    finished = d.finished("d-o")
    assert finished and "error" in str(finished[-1].finish_reason).lower(), finished
    assert "P and D do not agree on the KV cache groups" in caplog.text


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_failed_receive_on_a_hybrid_d_fails_or_recomputes_the_request_not_the_engine(engines, policy):
    """With several KV cache groups vLLM refuses block-level load errors (block ids repeat across
    groups): reported, they raised in its scheduler and ended the engine core on the first receive that
    failed (here D's deadline: no P ever comes). A failed receive goes by request only (failed_recving)."""
    d = engines("kv_consumer", f"d-hybrid-{policy}", window=WINDOW, policy=policy,
                extra={"timeouts": {**FAST, "receive": 1.0}})
    d.add("d-h", list(range(3, 153)), 3, {"aiolayer": {"transfer_id": f"th-{policy}", "token": tok(f"th-{policy}"),
                                                       "prefill_controls": ["tcp://127.0.0.1:9"]}})
    d.step()
    steps_until(lambda: "d-h" not in d.scheduler.requests, d)
    reason = str(d.finished("d-h")[-1].finish_reason).lower()
    assert ("error" in reason) == (policy == "fail"), reason   # recompute: D prefilled it itself
    pool = d.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1   # every block back


def test_p_decoding_past_its_window_fails_the_send_that_reads_the_freed_block(engines):
    """P keeps decoding the request it sent (``max_tokens`` > 1 there): its sliding window moves past a
    block the send still reads, and vLLM frees that block for any request to take. The send fails as a
    preempted one does (FAILED to D, never DONE), instead of DONE over KV another request may overwrite."""
    d = engines("kv_consumer", "d-past", window=WINDOW)
    p = engines("kv_producer", "p-past", window=WINDOW)
    prompt = list(range(3, 161))          # 158 tokens: D needs window blocks 3 and 4 (from token 127 on)
    d.add("d-p", prompt, 3, _recv(p, "tp"))
    d.step()
    reg = lookup(p, d, "tp")
    d.runtime.backend.faults.delay_s = 0.3   # each layer's write lands 0.3 s after its submit: still sending
    p.add("p-tp", prompt, 20, send_params(d, "tp", reg))
    p.step()
    window = p.blocks_of("p-tp", 1)
    read = window[3]                      # P's block the send pairs with D's window block 3
    for _ in range(3):                    # decode steps: token 159 takes the window past block 3
        p.step()
    assert read not in p.blocks_of("p-tp", 1)   # vLLM freed it while the send was open
    d.runtime.backend.faults.delay_s = 0.0
    from vllm.v1.request import RequestStatus

    steps_until(lambda: d.status("d-p") in (RequestStatus.RUNNING, None), d, p)
    finished = d.finished("d-p")   # D's policy "fail": the request ends in an error, never decodes on
    assert d.status("d-p") is None and finished and "error" in str(finished[-1].finish_reason).lower(), finished


def test_more_destination_blocks_than_the_prompt_has_tokens_are_refused_before_any_io(engines):
    """A P request of a 3-block prompt whose ``dst_blocks`` name 100,000 blocks (each of D's blocks holds
    at least a token): refused at once, D told, and the step's metadata stays small (the whole list went
    to every worker, pickled twice, and stalled the scheduler)."""
    import pickle

    p = engines("kv_producer", "p-many")
    params = {"aiolayer": {"transfer_id": "many", "token": tok("many"), "dst_blocks": list(range(1, 100_001)),
                           "decode_ranks": [{"decode_control": "tcp://127.0.0.1:9", "dst_incarnation": "i"}]}}
    p.add("p-m", list(range(3, 99)), 1, params)
    out = p.step()
    send = out.kv_connector_metadata.sends[0]
    assert not send.src_blocks and "100000 blocks for a 96-token prompt" in send.refused, send.refused
    assert len(pickle.dumps(out.kv_connector_metadata)) < 1_000_000
