"""What the sender takes and gives: a transfer's spec, its outcome, P's local KV layout, D's as P sees it,
and how one maps onto the other (checks, per-layer byte runs).

Split off ``sender`` (which re-exports the types) so that the sender holds only the transfer logic.
"""

from __future__ import annotations

import math
from typing import Protocol

import msgspec
import numpy as np

from ..errors import ConfigError, LayoutMismatch, MetadataError
from ..protocol import messages as m
from ..protocol.plan import (BlockRuns, HeadGeometry, RankRoute, Spans, check_block_bounds, run_addresses,
                             slice_addresses, token_spans)


class Registered(Protocol):
    """What P's spec takes from D's registration: a ``Registration`` (``Runtime.receive``) or a
    ``DecodeNode``'s ``AllocReply``."""

    @property
    def transfer_id(self) -> str: ...

    @property
    def block_ids(self) -> list[int]: ...

    @property
    def incarnation(self) -> str: ...

    @property
    def token(self) -> str: ...


class TransferSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One request's transfer: our source blocks -> D's destination blocks."""

    transfer_id: str
    peer: str                     # D's control endpoint
    src_blocks: list[int]
    dst_blocks: list[int]
    dst_incarnation: str          # D's incarnation the blocks were allocated on: never write to another
    token: str                    # the transfer's secret: D accepts our layout request and DONE only with it
    layerwise: bool = True        # False: hold every layer and write them all after the last one
    # Head slice: copy the route's heads of every block (P and D ranks of other TP sizes, see
    # protocol.plan.map_ranks); both sides must have published their head geometry. None: whole blocks.
    route: RankRoute | None = None
    # How many P ranks write into this D transfer by our plan (head slices from several TP ranks): D
    # refuses the layout when it registered another number. 0 = not said (D trusts its registration).
    writers: int = 0
    # D's first destination block is the request's block ``src_from`` (D holds the earlier ones), and
    # src_blocks are the request's blocks from its first: with blocks of one size src_blocks[src_from:]
    # pair with dst_blocks; where D's blocks hold another number of tokens than ours, the tokens from
    # src_from x D's block size on are copied into D's blocks token by token (``check_layout``).
    src_from: int = 0
    # Late binding: D's blocks are not known yet (``dst_blocks`` empty, ``dst_incarnation`` ""). The
    # sender asks D for them (a waiting ``LookupRequest`` to ``peer``, bounded by ``lookup_call``) while
    # the forward runs and binds the spec to D's answer (``bind``); docs/fencing.md "late binding".
    late: bool = False

    @classmethod
    def from_registration(cls, reg: Registered, *, src_blocks: list[int], peer: str = "", layerwise: bool = True,
                          route: RankRoute | None = None) -> "TransferSpec":
        """P's spec for the blocks D registered: ``reg`` is D's ``Registration`` (``Runtime.receive``)
        or a ``DecodeNode``'s ``AllocReply``; ``peer`` is D's control endpoint where ``reg`` has none."""
        return cls(transfer_id=reg.transfer_id, peer=peer or getattr(reg, "decode_control", ""),
                   src_blocks=list(src_blocks), dst_blocks=list(reg.block_ids), dst_incarnation=reg.incarnation,
                   token=reg.token, layerwise=layerwise, route=route)

    @classmethod
    def late_bound(cls, *, transfer_id: str, peer: str, src_blocks: list[int], token: str, layerwise: bool = True,
                   route: RankRoute | None = None, writers: int = 0) -> "TransferSpec":
        """P's spec before D registered: D's blocks, incarnation and first block come from D (``bind``)."""
        return cls(transfer_id=transfer_id, peer=peer, src_blocks=list(src_blocks), dst_blocks=[],
                   dst_incarnation="", token=token, layerwise=layerwise, route=route, writers=writers, late=True)

    def bind(self, reg: Registered, first_block: int) -> "TransferSpec":
        """The late spec bound to D's registration: D's blocks, from the request's block ``first_block``."""
        return msgspec.structs.replace(self, dst_blocks=list(reg.block_ids), dst_incarnation=reg.incarnation,
                                       src_from=first_block, late=False)

    def __post_init__(self) -> None:
        if self.late:
            if self.dst_blocks or self.dst_incarnation or self.src_from:
                raise ConfigError(f"transfer {self.transfer_id}: a late-bound spec names no destination yet")
        elif not self.dst_incarnation:
            raise ConfigError(f"transfer {self.transfer_id}: dst_incarnation is required (D's AllocReply)")
        if not self.token:
            raise ConfigError(f"transfer {self.transfer_id}: token is required (minted with the transfer)")


class LayerTiming(msgspec.Struct, array_like=True):
    layer: int
    handed_s: float               # perf_counter when the forward thread handed it over
    submitted_s: float
    landed_s: float


class Outcome(msgspec.Struct, kw_only=True):
    transfer_id: str
    ok: bool
    reason: str = ""
    bytes: int = 0
    finished_s: float = 0.0       # perf_counter when DONE was acknowledged (or the failure decided)
    writes_settled_s: float = 0.0
    source_released: bool = True  # False: a timed-out write may still read the source (see pop_released)
    layers: list[LayerTiming] = []
    layerwise: bool = True        # how it was sent (TransferSpec.layerwise)


class LocalLayout(msgspec.Struct, frozen=True):
    k_base: np.ndarray
    v_base: np.ndarray
    block_bytes: int
    num_blocks: int
    heads: int = 0                          # local KV heads per block (0: geometry not published)
    geometry: HeadGeometry | None = None    # what a head slice needs: tokens per block, head bytes, layout
    host: bool = False                      # host memory: readable here, so integrity can be checked

    @property
    def num_layers(self) -> int:
        return int(self.k_base.shape[0])


class RemoteLayout(msgspec.Struct, frozen=True):
    """D's KV layout as P writes into it (``LayoutReply``), cached per transfer by ``send.metadata``."""

    endpoint: str
    engine_id: str
    incarnation: str
    session: str
    block_bytes: int
    num_blocks: int
    k_base: np.ndarray     # int64 per layer
    v_base: np.ndarray
    kv_heads: int = 0      # head geometry (LayoutReply): 0 / "" = not published, whole blocks only
    block_size: int = 0
    head_bytes: int = 0
    kv_layout: str = ""
    kv_interior: str = ""
    digests: tuple[str, ...] = ()   # integrity digests D verifies besides crc32
    # The transfer's writes end at ``write_by`` (time.monotonic): D granted ``window`` seconds when it
    # answered; counted from when P asked, so P's end comes no later than D's (docs/fencing.md, rule 8).
    window: float = math.inf
    write_by: float = math.inf

    @property
    def num_layers(self) -> int:
        return int(self.k_base.shape[0])

    @classmethod
    def from_reply(cls, endpoint: str, reply: m.LayoutReply) -> "RemoteLayout":
        return cls(endpoint, reply.engine_id, reply.incarnation, reply.session, reply.block_bytes,
                   reply.num_blocks, np.array([r.k_base for r in reply.layers], dtype=np.int64),
                   np.array([r.v_base for r in reply.layers], dtype=np.int64),
                   reply.kv_heads, reply.block_size, reply.head_bytes, reply.kv_layout, reply.kv_interior,
                   tuple(reply.digests))

    def granted(self, window: float | None, asked_s: float) -> "RemoteLayout":
        """This layout as one transfer's: its writes end ``window`` s after ``asked_s`` (time.monotonic
        when P sent the request D answered). None: D did not say (an older D), no end."""
        if window is None:
            return self
        if not window >= 0:   # NaN too: from the network, refused
            raise MetadataError(f"{self.endpoint} granted a write window of {window!r}")
        return msgspec.structs.replace(self, window=window, write_by=asked_s + window)


def check_spec(spec: object) -> None:
    """What the sender needs of a spec before it touches anything; ``ValueError`` otherwise.

    ``TransferSpec`` does not check field types (msgspec does not on construction), and the
    engine builds specs from request parameters: a wrong type must fail that transfer only.
    """
    if not isinstance(spec, TransferSpec):
        raise ValueError(f"not a TransferSpec: {type(spec).__name__}")
    if not isinstance(spec.late, bool):
        raise ValueError(f"late must be a bool, got {spec.late!r:.80}")
    for name in ("transfer_id", "peer", "token") if spec.late else ("transfer_id", "peer", "dst_incarnation", "token"):
        value = getattr(spec, name)
        if not isinstance(value, str) or not value:
            raise ValueError(f"{name} must be a non-empty string, got {value!r:.80}")
        if not (value.isascii() if name in ("peer", "token") else _encodable(value)):
            raise ValueError(f"{name} must be {'ASCII' if name in ('peer', 'token') else 'valid UTF-8'}, "
                             f"got {value!r:.80}")
    if isinstance(spec.writers, bool) or not isinstance(spec.writers, int) or not 0 <= spec.writers <= 1 << 16:
        raise ValueError(f"writers must be an integer in 0..65536, got {spec.writers!r:.80}")
    # in D's blocks, which may be of another size than ours: check_layout checks it against both sides
    if isinstance(spec.src_from, bool) or not isinstance(spec.src_from, int) or not 0 <= spec.src_from < 1 << 31:
        raise ValueError(f"src_from must be an integer in 0..2**31-1, got {spec.src_from!r:.80}")
    if spec.route is not None and not isinstance(spec.route, RankRoute):
        raise ValueError(f"route must be a RankRoute or None, got {type(spec.route).__name__}")


def _encodable(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:   # a lone surrogate: no message could carry it
        return False
    return True


def check_layout(local: LocalLayout, spec: TransferSpec, runs: BlockRuns | None, layout: RemoteLayout) -> Spans | None:
    """D's layout must fit ours and the spec's blocks (``LayoutMismatch``, ``ValueError``);
    returns the spans of a routed spec or of blocks of other sizes (None: whole blocks). ``runs``
    is None when the spec's blocks do not pair one to one (blocks of other sizes only)."""
    route = spec.route
    tokens = other_block_size(local, layout)
    sliced = route is not None or tokens   # then block sizes differ legitimately: the geometry must match
    if layout.num_layers != local.num_layers or (not sliced and layout.block_bytes != local.block_bytes):
        raise LayoutMismatch(
            f"D has {layout.num_layers} layers of {layout.block_bytes}-byte blocks, "
            f"P has {local.num_layers} of {local.block_bytes}")
    if bool((layout.v_base == 0).any()) != bool((local.v_base == 0).any()):
        raise LayoutMismatch("one side keeps K and V in separate tensors, the other in one")
    check_block_bounds(spec.dst_blocks, layout.num_blocks, "destination")
    if tokens:
        return _token_spans(local, spec, layout)
    if runs is None:
        raise LayoutMismatch(f"D's {len(spec.dst_blocks)} blocks do not pair with our "
                             f"{len(spec.src_blocks) - spec.src_from} and D's blocks are of our size")
    if route is not None:
        return _route_spans(local, route, runs, layout)
    _same_interior(local, layout)
    return None


def _same_interior(local: LocalLayout, layout: RemoteLayout) -> None:
    """Whole blocks are copied byte for byte: where both sides say how a block holds its heads and tokens,
    they must say the same (P on flash, D on FlashInfer; vLLM CPU's kernels, picked per host)."""
    geom = local.geometry
    if geom is None or not layout.kv_layout:
        return   # a side published no geometry (an embedder's raw blocks): as before, bytes are bytes
    theirs = (layout.head_bytes, layout.kv_layout, layout.kv_interior)
    if theirs != (geom.head_bytes, geom.layout, geom.interior):
        shown = (layout.head_bytes, layout.kv_layout[:40], layout.kv_interior[:40])   # D's strings: from the network
        raise LayoutMismatch(f"D's blocks hold their heads otherwise than P's (head bytes, layout, interior): "
                             f"{shown} at D, {(geom.head_bytes, geom.layout, geom.interior)} at P; a byte copy "
                             "would scramble them (run both on one attention backend / CPU kernel)")


def other_block_size(local: LocalLayout, layout: RemoteLayout) -> bool:
    """D published blocks of another number of tokens than ours (then both need the head geometry)."""
    geom = local.geometry
    return geom is not None and bool(layout.block_size) and layout.block_size != geom.block_size


def _token_spans(local: LocalLayout, spec: TransferSpec, layout: RemoteLayout) -> Spans:
    """Spans copying the request's tokens from ours into D's blocks of another size, per request."""
    geom = local.geometry
    assert geom is not None   # other_block_size
    theirs = (layout.head_bytes, layout.kv_layout, layout.kv_interior)
    if theirs != (geom.head_bytes, geom.layout, geom.interior):
        shown = (layout.head_bytes, layout.kv_layout[:40], layout.kv_interior[:40])   # D's strings: from the network
        raise LayoutMismatch(f"D has blocks of {layout.block_size} tokens, P of {geom.block_size}, and their heads "
                             f"differ: (head bytes, layout, interior) {shown} at D, "
                             f"{(geom.head_bytes, geom.layout, geom.interior)} at P")
    if layout.block_bytes != layout.kv_heads * layout.block_size * geom.head_bytes:
        raise LayoutMismatch(f"D's {layout.block_bytes}-byte blocks do not hold {layout.kv_heads} heads "
                             f"of {layout.block_size} x {geom.head_bytes} bytes")
    try:
        return token_spans(spec.src_blocks, spec.dst_blocks, spec.src_from * layout.block_size, geom,
                           layout.block_size, local.heads, layout.kv_heads, spec.route)
    except ValueError as exc:
        raise LayoutMismatch(f"blocks of {geom.block_size} tokens at P, {layout.block_size} at D: {exc}") from None


def _route_spans(local: LocalLayout, route: RankRoute, runs: BlockRuns, layout: RemoteLayout) -> Spans:
    """The route's byte spans relative to each layer's bases: computed once per request."""
    geom = local.geometry
    if geom is None or not layout.kv_heads:
        side = "P" if geom is None else "D"
        raise LayoutMismatch(f"a head-slice route needs both sides' head geometry; {side} published none")
    theirs = (layout.block_size, layout.head_bytes, layout.kv_layout, layout.kv_interior)
    if theirs != (geom.block_size, geom.head_bytes, geom.layout, geom.interior):
        shown = (*theirs[:2], layout.kv_layout[:40], layout.kv_interior[:40])   # D's strings: from the network
        raise LayoutMismatch(f"D's blocks are (tokens, head bytes, layout, interior) {shown}, P's "
                             f"{(geom.block_size, geom.head_bytes, geom.layout, geom.interior)}")
    if layout.block_bytes != layout.kv_heads * geom.block_size * geom.head_bytes:
        raise LayoutMismatch(f"D's {layout.block_bytes}-byte blocks do not hold {layout.kv_heads} heads "
                             f"of {geom.block_size} x {geom.head_bytes} bytes")
    try:
        return slice_addresses(runs, 0, 0, local.heads, layout.kv_heads, route, geom)
    except ValueError as exc:
        raise LayoutMismatch(f"route {route}: {exc}") from None


def layer_runs(local: LocalLayout, runs: BlockRuns | None, spans: Spans | None, layout: RemoteLayout,
               layer: int) -> Spans:
    """(src, dst, lengths) int64 arrays of one layer's K and V writes."""
    planes = [(local.k_base, layout.k_base)]
    if local.v_base[layer]:   # 0: K and V share each block (one plane), as on vLLM's CPU backend
        planes.append((local.v_base, layout.v_base))
    if spans is not None:   # a head slice: spans precomputed per request, offset by this layer's bases
        rel_src, rel_dst, rel_len = spans
        src, dst, lengths = zip(*((rel_src + int(mine[layer]), rel_dst + int(theirs[layer]), rel_len)
                                  for mine, theirs in planes))
    else:
        assert runs is not None   # check_layout gives spans wherever the blocks do not pair
        src, dst, lengths = zip(*(run_addresses(runs, int(mine[layer]), int(theirs[layer]), local.block_bytes)
                                  for mine, theirs in planes))
    return np.concatenate(src), np.concatenate(dst), np.concatenate(lengths)
