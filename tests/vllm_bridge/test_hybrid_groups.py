"""Several KV cache groups (vLLM's hybrid KV cache manager), without an engine: how P pairs its groups'
blocks with D's, and how the groups' shared tensors become the runtime's layers."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is installed by `make test`")

import torch

from aiolayer_vllm.layout import describe
from aiolayer_vllm.scheduler import pair_groups

NULL = 0


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
