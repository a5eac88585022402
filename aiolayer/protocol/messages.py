"""Versioned msgspec wire messages of the control plane, as one tagged union.

A control frame is ``[request_id (8 bytes), payload]`` where the payload is one of ``Message``
encoded with msgpack. Every request gets exactly one reply; ``Nack`` carries a code and a reason.

Every message about a transfer carries its ``token``: a secret minted by whoever created the
transfer (the proxy, or the benchmark driving a node) and handed only to D and to P. D serves its
layout and accepts DONE/FAILED only with the token of a transfer it registered; P stops a transfer
only on an Abort with that transfer's token. A stranger on the control port learns nothing and
ends nothing (``Nack`` code ``auth``, counted).

Codes and details a peer acts on are the enums of ``codes`` (str enums: the same strings on the wire).
The catalogue, the request/reply pairs and the versioning policy: docs/protocol.md.
"""

from __future__ import annotations

import hmac
import struct
from typing import Annotated, Union

import msgspec

from .codes import AckDetail, NackCode, is_tally

PROTOCOL_VERSION = 1
REQUEST_ID = struct.Struct("!Q")
# The longest transfer id, token, engine id or endpoint a message may carry (real ones: tens of
# characters). Refused when decoded (``decode``), before any table or reply holds it: a frame may be
# 1 MiB, and a stranger's ids kept for a deadline, or quoted back in each refusal, would be gigabytes.
MAX_KEY_CHARS = 1024
Key = Annotated[str, msgspec.Meta(max_length=MAX_KEY_CHARS)]


class _Msg(msgspec.Struct, tag_field="type", kw_only=True, frozen=True):
    # Each message repeats ``frozen=True``: msgspec inherits it, type checkers read a class's own keywords.
    v: int = PROTOCOL_VERSION


# --- layout (P asks D where its KV lives) -------------------------------------------------------

class LayerRegion(msgspec.Struct, frozen=True, array_like=True):
    k_base: int
    v_base: int


class LayoutRequest(_Msg, tag="layout_req", frozen=True):
    """P asks for D's layout before a transfer's first write: D records the asking P rank as one of the
    transfer's writers (``requester`` with its ``control`` endpoint and runtime ``incarnation``), and
    its fence later asks exactly those writers to stop (docs/fencing.md)."""

    requester: Key = ""        # the P rank's engine id: its DONE/FAILED carry the same ``sender``
    transfer_id: Key = ""      # a transfer D registered, and its token: D shows its layout only then
    token: Key = ""
    control: Key = ""          # the P rank's own control endpoint: where D's fence asks it to stop
    incarnation: Key = ""      # the P rank's runtime incarnation
    writers: int = 0           # how many P ranks write into this D's transfer, as P's plan says (0: not said)


MAX_LAYOUT_BATCH = 256


class LayoutBatch(_Msg, tag="layout_batch", frozen=True):
    """Several transfers' ``LayoutRequest``s to one D in one frame (P's prefetches of one pass of its
    loop, e.g. a step's transfers). D authorizes each as if it came alone; answers ``LayoutReplies``."""

    items: list[LayoutRequest]


class LayoutReply(_Msg, tag="layout", frozen=True):
    engine_id: Key
    incarnation: Key           # new on every process start: stale cached layouts are refused
    session: Key               # transfer-engine target name, e.g. "127.0.0.1:15123"
    block_bytes: int
    num_blocks: int
    layers: list[LayerRegion]
    # Head geometry of each block, so that P can write head slices (TP ranks of different sizes):
    # 0 / "" = not published, and then P writes whole blocks only.
    kv_heads: int = 0          # local KV heads per block
    block_size: int = 0        # tokens per block
    head_bytes: int = 0        # head_dim * dtype bytes
    kv_layout: str = ""        # "NHD" or "HND" (protocol.plan.HeadGeometry)
    kv_interior: str = ""      # what a head's bytes hold token by token (HeadGeometry.interior)
    # Integrity digests D can verify besides "crc32" (LayerCheck.digest); [] from an older D: crc32 only.
    digests: list[str] = []
    # Seconds from when D got the request to the end of the answered transfer's writes (docs/fencing.md,
    # rule 8): P, counting from its send, submits none after. None: not said (an older D, or a batch's layout).
    window: Union[float, None] = None


# --- transfer outcome (P tells D) ----------------------------------------------------------------

MAX_CHECK_RUNS = 4096   # runs per layer a sampled integrity check may name (larger transfers are not sampled)
# The digests a LayerCheck may name, slowest first: CRC32 (zlib, ~4 GB/s on one core) is what every
# version verifies; XXH3-64 (~50 GB/s) only where D's layout lists it.
CHECK_DIGESTS = ("crc32", "xxh3_64")


class LayerCheck(msgspec.Struct, frozen=True, kw_only=True):
    """A transfer's sampled end-to-end check: for each sampled layer (``layers``, ascending), the digest
    (``digest``, one of ``CHECK_DIGESTS``) of the bytes P wrote, taken in run order over P's source;
    ``offsets``/``lengths`` are the runs at D, relative to a layer's base (the same for every layer, and
    for K and V). ``crc_k``/``crc_v`` hold the digests (their names predate the choice); ``crc_v`` is
    empty where K and V share one plane."""

    layers: list[int]
    offsets: list[int]
    lengths: list[int]
    crc_k: list[int]
    crc_v: list[int] = []
    digest: str = "crc32"


class Done(_Msg, tag="done", frozen=True):
    transfer_id: Key
    sender: Key
    incarnation: Key = ""      # D's incarnation the data was written to
    layers: int = 0
    bytes: int = 0
    token: Key = ""
    check: Union[LayerCheck, None] = None   # sampled transfers: D verifies what landed before it accepts
    sender_incarnation: Key = ""   # the P process that wrote (its runtime incarnation): D takes the word only
                                   # from the process it showed the layout to ("" from an older P)


class EarlyCheck(_Msg, tag="early_check", frozen=True):
    """Part of a sampled transfer's check sent before its DONE: sampled layers whose writes P saw complete
    while later ones were still being computed or written. D verifies them at once and remembers the layers
    that matched; the DONE still carries every sampled layer, and D verifies at DONE only those it did
    not match early. Changes no transfer state; only a known writer with the token is answered."""

    transfer_id: Key
    sender: Key
    token: Key
    check: LayerCheck


# Items per DoneBatch: ~40 KB of DONEs, far below a node's max_frame_bytes (1 MiB by default).
MAX_DONE_BATCH = 256


class DoneBatch(_Msg, tag="done_batch", frozen=True):
    """Several DONEs to one D in one frame (P's decided in one pass of its loop). D applies each as if
    it came alone and answers ``Replies``, item by item, in order."""

    items: list[Done]


class Failed(_Msg, tag="failed", frozen=True):
    """Sent by P only once none of its writes for the transfer can still be in flight."""

    transfer_id: Key
    sender: Key
    reason: str
    token: Key = ""
    sender_incarnation: Key = ""   # as Done's


class Abort(_Msg, tag="abort", frozen=True):
    """D (or a proxy through D) asks P to stop; P acks once none of its writes is in flight."""

    transfer_id: Key
    reason: str = ""
    token: Key = ""


# --- node management (used by a proxy or the benchmark to drive a standalone D node) -----------

class AllocRequest(_Msg, tag="alloc", frozen=True):
    transfer_id: Key
    num_blocks: int
    contiguous: bool = True
    sender_control: Key = ""   # not used: D's fence asks the P ranks that fetched the layout (docs/fencing.md)
    token: Key = ""            # the transfer's secret; "" = the node mints one and returns it
    drop_done: bool = False    # fault injection (bench/tests): D never answers this transfer's DONE
    senders: int = 1           # P ranks writing disjoint head slices: D ends it once each said DONE/FAILED


class AbortRequest(_Msg, tag="abort_req", frozen=True):
    """To D: give up a transfer (client gone); D fences its blocks until P is quiet."""

    transfer_id: Key
    reason: str = "aborted"
    token: Key = ""


class AllocReply(_Msg, tag="alloc_ok", frozen=True):
    """D's registration of a transfer, as published to whoever dispatches P."""

    transfer_id: Key
    block_ids: list[int]
    incarnation: Key
    first_block: int = 0       # blocks before this index of the request were already at D (prefix hit)
    token: Key = ""            # the transfer's secret, for whoever dispatches P
    layout: Union[LayoutReply, None] = None   # to a writer's lookup (late binding): D's layout, as a LayoutRequest's


class LookupRequest(_Msg, tag="lookup", frozen=True):
    """To D: the registration of ``transfer_id`` (an AllocReply), once D registered it.

    ``wait``: D holds the answer until it registered the transfer (at most ``Timeouts.lookup_wait``)
    instead of answering ``not_registered`` at once. A P rank binding a late transfer (its
    destination left open, docs/fencing.md "late binding") names itself as a ``LayoutRequest`` does
    (``requester``, its ``control`` endpoint, ``incarnation``, ``writers``): D then records it as a
    writer before it answers, only while the transfer takes writes, and the reply carries D's layout."""

    transfer_id: Key
    token: Key = ""
    wait: bool = False
    requester: Key = ""        # "" = not a writer (whoever dispatches P): no layout, no writer recorded
    control: Key = ""
    incarnation: Key = ""
    writers: int = 0


class VerifyRequest(_Msg, tag="verify", frozen=True):
    transfer_id: Key


class VerifyReply(_Msg, tag="verify_ok", frozen=True):
    transfer_id: Key
    state: str
    reason: str
    crc_k: list[int]           # per layer, over the transfer's blocks in order
    crc_v: list[int]


class ReleaseRequest(_Msg, tag="release", frozen=True):
    transfer_id: Key


class StatusRequest(_Msg, tag="status", frozen=True):
    transfer_id: Key


class StatusReply(_Msg, tag="status_ok", frozen=True):
    transfer_id: Key
    state: str
    reason: str = ""


# --- generic replies ----------------------------------------------------------------------------

class Ack(_Msg, tag="ack", frozen=True):
    # ``AckDetail`` where it is a signal (``stopped``: P is quiet); else informative text. A str on
    # the wire, so that every peer's detail decodes.
    detail: str = ""


class Nack(_Msg, tag="nack", frozen=True):
    """A refusal: ``code`` is machine-readable (a ``NackCode`` value), ``reason`` is for people."""

    code: str                  # a NackCode; a str on the wire, so that a newer peer's code still decodes
    reason: str


class Replies(_Msg, tag="replies", frozen=True):
    """The answer to a ``DoneBatch``: one per item, in order; None for an item left unanswered (a
    fault-injection hook dropped it), which its sender sends again alone."""

    items: list[Union[Ack, Nack, None]]


class LayoutReplies(_Msg, tag="layouts", frozen=True):
    """The answer to a ``LayoutBatch``: per item, in order, ``Ack`` (authorized: ``layout`` is its
    answer), its ``Nack``, or None (left unanswered: a fault-injection hook dropped it; asked again
    alone). ``layout`` is None when no item was authorized. ``windows``: per item, its transfer's
    ``LayoutReply.window`` (0 where the item was not authorized); [] from an older D."""

    layout: Union[LayoutReply, None]
    items: list[Union[Ack, Nack, None]]
    windows: list[float] = []


# --- topology (whoever routes requests asks a rank who it is) ------------------------------------

class TopologyRequest(_Msg, tag="topology_req", frozen=True):
    """To any runtime: who it is and where it sits in its engine. No token: the answer names no
    memory (the layout's summary only, never its addresses) and changes nothing."""

    requester: Key = ""


class TopologyReply(_Msg, tag="topology", frozen=True):
    """A runtime's identity as its embedder set it (``Runtime.set_identity``), and its KV layout's
    summary as its ``LayoutReply`` publishes it (0 / "" before the KV memory is registered)."""

    engine_id: Key
    incarnation: Key           # new on every process start
    control: Key               # its own control endpoint, as it advertises it
    role: str = ""             # "producer", "consumer", "both", or "" (the embedder did not say)
    tp_rank: int = 0
    tp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    model: str = ""            # the embedder's fingerprint of what must match between P and D
    late_binding: bool = False  # Identity.late_binding (False from an older peer: the proxy binds it D-first)
    num_layers: int = 0
    block_bytes: int = 0
    block_size: int = 0
    kv_heads: int = 0
    head_bytes: int = 0
    kv_layout: str = ""
    kv_interior: str = ""      # HeadGeometry.interior: blocks of other sizes copy token by token only if known
    # How it was started, so that ``aiolayer doctor`` can compare two hosts ("" / False from an older peer):
    version: str = ""          # its aiolayer version
    session: Key = ""          # its Mooncake segment name (host:port), where P's writes go
    protocol: str = ""         # its Mooncake transport as configured (Transport.protocol)
    device_name: str = ""      # its RDMA NIC(s) as configured ("" = Mooncake picks)
    force_tcp: bool = False    # MC_FORCE_TCP is set in its environment (Mooncake then uses TCP whatever protocol says)


Message = Union[
    LayoutRequest, LayoutBatch, LayoutReply, LayoutReplies, Done, EarlyCheck, DoneBatch, Failed, Abort,
    AllocRequest, AbortRequest, AllocReply, LookupRequest, VerifyRequest, VerifyReply, ReleaseRequest,
    StatusRequest, StatusReply, Ack, Nack, Replies,
    TopologyRequest, TopologyReply,
]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


class DecodeFailure(Exception):
    """Raised by ``decode``; the control plane turns it into a ``Nack``."""

    def __init__(self, code: NackCode, reason: str) -> None:
        self.code = code
        self.reason = reason
        super().__init__(f"{code}: {reason}")


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(payload: bytes) -> Message:
    """Decode one payload, refusing other protocol versions."""
    try:
        msg = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise DecodeFailure(NackCode.DECODE, str(exc)[:200]) from None
    except (ValueError, TypeError, OverflowError) as exc:
        raise DecodeFailure(NackCode.DECODE, f"{type(exc).__name__}: {exc}"[:200]) from None
    check_version(msg)
    return msg


def check_version(msg: Message) -> None:
    """Refuse a message of another protocol version (a frame's, or an item inside one)."""
    if msg.v != PROTOCOL_VERSION:
        raise DecodeFailure(NackCode.VERSION,
                            f"protocol version {msg.v} unsupported; this side speaks {PROTOCOL_VERSION}")


def confirms_stop(reply: Message) -> bool:
    """Whether a reply to an ``Abort`` says P is quiet (no write of the transfer can still land)."""
    return isinstance(reply, Ack) and reply.detail == AckDetail.STOPPED


def done_verdict(reply: Message) -> str:
    """"" when D's reply to a DONE says it took the transfer as written (with several senders: this
    sender's word counted, the transfer still taking writes); else P's failure reason, naming D's
    answer. P's outcome must agree with D's: only these replies make it ok."""
    if isinstance(reply, Ack):
        detail = reply.detail
        if detail in (AckDetail.FINISHED, AckDetail.ALREADY_FINISHED) or is_tally(detail):
            return ""
        return f"D did not take the DONE: it answered {detail!r}"[:500]
    return f"D answered the DONE with {type(reply).__name__}"


def same_token(presented: str, expected: str) -> bool:
    """Whether a presented transfer token is the expected one, in constant time (no timing oracle)."""
    return hmac.compare_digest(presented.encode(), expected.encode())


def pack_request_id(rid: int) -> bytes:
    return REQUEST_ID.pack(rid)


def unpack_request_id(frame: bytes) -> int | None:
    """The request id of a frame, or None when the frame is not a valid id."""
    if len(frame) != REQUEST_ID.size:
        return None
    rid: int = REQUEST_ID.unpack(frame)[0]
    return rid
