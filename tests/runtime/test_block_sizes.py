"""P's side of a transfer between blocks of other sizes: ``check_spec`` and ``check_layout`` with D's
published layout, and the bridge's pairing of one KV cache group when D already holds a prefix."""

from __future__ import annotations

import numpy as np
import pytest

from aiolayer.errors import LayoutMismatch
from aiolayer.protocol.plan import HeadGeometry, RankRoute, merge_runs
from aiolayer.runtime.spec import RemoteLayout
from aiolayer.runtime.spec import LocalLayout, TransferSpec, check_layout, check_spec

HEAD = 256      # bytes of one head's K and V per token (bf16, head size 64)
CPU = "kv-slabs-kt2"


def _local(size: int, interior: str = CPU) -> LocalLayout:
    return LocalLayout(k_base=np.array([1 << 20]), v_base=np.array([0]), block_bytes=2 * size * HEAD,
                       num_blocks=8, heads=2, geometry=HeadGeometry(size, HEAD, "HND", interior), host=True)


def _remote(size: int, interior: str = CPU) -> RemoteLayout:
    return RemoteLayout("tcp://127.0.0.1:1", "d", "inc", "d:1", block_bytes=2 * size * HEAD, num_blocks=40,
                        k_base=np.array([1 << 30]), v_base=np.array([0]), kv_heads=2, block_size=size,
                        head_bytes=HEAD, kv_layout="HND", kv_interior=interior)


def _spec(src: list[int], dst: list[int], src_from: int = 0) -> TransferSpec:
    return TransferSpec(transfer_id="t", peer="tcp://127.0.0.1:1", src_blocks=src, dst_blocks=dst,
                        dst_incarnation="inc", token="tok-0123456789abcdef", src_from=src_from)


def test_d_holding_more_of_its_small_blocks_than_p_has_blocks_is_a_valid_start():
    """D (blocks of 32) holds 12 blocks = 384 tokens of a 397-token prompt; P (128) has 4 blocks: P copies
    tokens 384..415 from its fourth block into D's one block."""
    spec = _spec([0, 1, 2, 3], [5], src_from=12)
    check_spec(spec)
    src, dst, lengths = check_layout(_local(128), spec, None, _remote(32))
    assert int(lengths.sum()) == 32 * 2 * HEAD                       # 32 tokens, 2 heads, K and V
    assert src.min() >= 3 * 2 * 128 * HEAD and dst.min() >= 5 * 2 * 32 * HEAD   # P's block 3, D's block 5


def test_blocks_of_one_size_that_do_not_pair_are_refused():
    with pytest.raises(LayoutMismatch, match="do not pair"):
        check_layout(_local(32), _spec([0, 1, 2], [5]), None, _remote(32))


def test_other_sizes_with_another_or_an_unknown_interior_are_refused():
    with pytest.raises(LayoutMismatch, match="interior"):
        check_layout(_local(128), _spec([0], [5, 6, 7, 8]), None, _remote(32, "kv-slabs"))
    with pytest.raises(LayoutMismatch, match="not known token by token"):
        check_layout(_local(128, "opaque"), _spec([0], [5, 6, 7, 8]), None, _remote(32, "opaque"))


def test_bridge_sends_one_group_whole_from_its_first_block():
    pytest.importorskip("vllm", reason="vLLM is installed by `make test`")
    from aiolayer_vllm.config import from_extra_config
    from aiolayer_vllm.params import DecodeRank, SendParams
    from aiolayer_vllm.scheduler import SchedulerSide

    side = SchedulerSide(from_extra_config({"backend": "memory"}, "p"), 128, True, False)
    send = SendParams(transfer_id="t", token="tok-0123456789abcdef", dst_blocks=[9], first_block=12,
                      decode_ranks=[DecodeRank(decode_control="tcp://h:1", dst_incarnation="inc")])
    assert side._pair(([4, 5, 6, 7, 8],), 4, send) == ([4, 5, 6, 7], [9], "", 12)


@pytest.mark.parametrize("p, d", [(("NHD", ""), ("HND", "")),                        # flash -> FlashInfer
                                  (("HND", "opaque-amx"), ("HND", "kv-slabs-kt2")),   # vLLM CPU on AMX -> vec16
                                  (("HND", "opaque-amx"), ("HND", "opaque-neon")),    # two unknown kernels
                                  # D's string, from the network, is compared whole, not as it is shown
                                  (("HND", "opaque-" + "k" * 33), ("HND", "opaque-" + "k" * 33 + "-other"))])
@pytest.mark.parametrize("route", [None, RankRoute(0, 0, 0, 0, 1)])
def test_blocks_of_one_size_whose_interiors_differ_are_never_copied_byte_for_byte(p, d, route):
    """Same-size blocks copied whole: D's attention would read P's heads and tokens in its own arrangement
    and decode from scrambled KV, which no checksum sees (the bytes are P's, faithfully)."""
    heads = 2 if route is None else 1
    local = LocalLayout(k_base=np.array([1 << 20]), v_base=np.array([0]), block_bytes=32 * 2 * HEAD, num_blocks=8,
                        heads=2, geometry=HeadGeometry(32, HEAD, *p), host=True)
    remote = RemoteLayout("tcp://127.0.0.1:1", "d", "inc", "d:1", block_bytes=32 * heads * HEAD, num_blocks=40,
                          k_base=np.array([1 << 30]), v_base=np.array([0]), kv_heads=heads, block_size=32,
                          head_bytes=HEAD, kv_layout=d[0], kv_interior=d[1])
    spec = _spec([0, 1], [3, 4])
    spec = TransferSpec(**{**{f: getattr(spec, f) for f in spec.__struct_fields__}, "route": route})
    with pytest.raises(LayoutMismatch):
        check_layout(local, spec, merge_runs(spec.src_blocks, spec.dst_blocks), remote)
    same = RemoteLayout(**{**{f: getattr(remote, f) for f in remote.__struct_fields__}, "kv_layout": p[0],
                           "kv_interior": p[1]})
    check_layout(local, spec, merge_runs(spec.src_blocks, spec.dst_blocks), same)   # one interior: copied
