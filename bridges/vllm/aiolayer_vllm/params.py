"""The request-level contract of the bridge, one msgspec struct per message the engines and the proxy
exchange about a request: what the proxy puts in ``kv_transfer_params["aiolayer"]`` and what D POSTs back.

To D (remote prefill), ``RecvParams``: ``{"transfer_id": str, "token": str, "prefill_controls":
["tcp://...", ...], "notify_url": "http://..."}``: P's control endpoint per tensor-parallel rank in
rank order (D's ranks work out which P ranks write into them) and where to POST the registration.
D POSTs ``DecodeRegistration`` there, one per tensor-parallel rank: ``{"transfer_id": str,
"registration": {...}, "rank": int, "ranks": int, "dp_rank": int}``, ``registration`` being the
runtime's own ``aiolayer.Registration`` (its transfer id is this rank's, ``ranks.rank_transfer_id``).
To P (remote decode), once every D rank registered (D first), ``SendParams``: ``{"transfer_id": str, "token":
str, "dst_blocks": [int], "first_block": int, "decode_ranks": [{"decode_control": "tcp://...",
"dst_incarnation": str}, ...], "prefill_tp": int}``: D's ranks in rank order (the blocks are the same
on every rank: one scheduler allocates them) and the P tensor-parallel size the plan assumed (0 = not
said; P refuses to send when its own differs, telling D at once) and, where the client asked for one,
``"transfer_mode"`` ("layerwise" or "bulk", overriding P's configured mode for this request). With
late binding P gets, at the same time as D, ``SendParams`` with ``"late": true`` and no
``dst_blocks``/``first_block``/``dst_incarnation``: each P transfer asks its D rank for them (a waiting
``LookupRequest``). Ranks are always lists, one entry for an engine without tensor parallelism.
Transfer ids are the proxy's own, never derived from vLLM's request ids. The token is a secret the
proxy mints per transfer (``secrets.token_hex(16)``) and gives only to this transfer's D and P: D
refuses layout requests and DONE/FAILED without it.

A request's parameters come from a client: ``read`` validates them whole (types, ranges, ASCII ids
and endpoints, no unknown field) and tells the two shapes apart by their fields, so one engine can
play both roles (``kv_both``). Anything else is ``InvalidParams`` with a message safe to log.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import msgspec
from msgspec import Meta

from aiolayer import MIN_TOKEN_CHARS, Registration   # the runtime's own minimum: refused here, before any I/O

from .ranks import rank_transfer_id

KEY = "aiolayer"
MAX_ID_CHARS = 256
MAX_TOKEN_CHARS = 512
MAX_URL_CHARS = 2048
MAX_BLOCKS = 1 << 22          # more destination blocks than any engine has: refused before any I/O
MAX_FIRST_BLOCK = 1 << 31
_PRINTABLE = r"^[\x21-\x7e]+$"   # printable ASCII without spaces: every id goes on the wire
_HOST = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9]([A-Za-z0-9._-]{0,252}))$")

Id = Annotated[str, Meta(min_length=1, max_length=MAX_ID_CHARS, pattern=_PRINTABLE)]
Token = Annotated[str, Meta(min_length=MIN_TOKEN_CHARS, max_length=MAX_TOKEN_CHARS, pattern=_PRINTABLE)]
Url = Annotated[str, Meta(max_length=MAX_URL_CHARS, pattern=r"^[\x21-\x7e]*$")]
BlockId = Annotated[int, Meta(ge=0, le=2**63 - 1)]


class InvalidParams(ValueError):
    """The request names aiolayer but its parameters do not fit the contract."""


def check_endpoint(value: str, field: str) -> None:
    """``tcp://host:port`` with an ASCII host and a port in 1..65535 (ValueError otherwise)."""
    scheme, sep, rest = value.partition("://")
    host, colon, port = rest.rpartition(":")
    if scheme != "tcp" or not sep or not colon or not _HOST.match(host) or not port.isdigit() \
            or not 0 < int(port) < 65536:
        raise ValueError(f"{field} must be tcp://host:port, got {ascii(value[:100])}")


def check_url(value: str, field: str) -> None:
    """An http(s) URL with a host (ValueError otherwise)."""
    try:
        parts = urlsplit(value)
        ok = parts.scheme in ("http", "https") and bool(parts.hostname) and (parts.port is None or parts.port > 0)
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"{field} must be an http(s) URL with a host, got {ascii(value[:100])}")


MAX_RANKS = 1024
# a mode a request may ask P for, overriding P's ``transfer_mode`` ("": P's own)
RequestedMode = Literal["", "layerwise", "bulk"]
REQUESTED_MODES: dict[str, RequestedMode] = {"layerwise": "layerwise", "bulk": "bulk"}
Ranks = Annotated[int, Meta(ge=1, le=MAX_RANKS)]
Rank = Annotated[int, Meta(ge=0, lt=MAX_RANKS)]
BlockIds = Annotated[list[BlockId], Meta(min_length=1, max_length=MAX_BLOCKS)]
FirstBlock = Annotated[int, Meta(ge=0, lt=MAX_FIRST_BLOCK)]


class RecvParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """D's part of a request: the transfer, its secret, P's ranks and where to register."""

    transfer_id: Id
    token: Token
    # P's control endpoint per tensor-parallel rank, in rank order; [] = one P rank nobody named
    prefill_controls: Annotated[list[Url], Meta(max_length=MAX_RANKS)] = []
    notify_url: Url = ""        # where D POSTs its registration (the proxy); "" = LookupRequest only

    def __post_init__(self) -> None:
        for i, control in enumerate(self.prefill_controls):
            check_endpoint(control, f"prefill_controls[{i}]")
        if self.notify_url:
            check_url(self.notify_url, "notify_url")

    @property
    def prefill_tp(self) -> int:
        """How many P ranks write this transfer (one where none was named)."""
        return len(self.prefill_controls) or 1


class DecodeRank(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One of D's tensor-parallel ranks as P addresses it; ``dst_incarnation`` "" in a late form (D
    answers it with its registration)."""

    decode_control: Url
    dst_incarnation: Annotated[str, Meta(max_length=MAX_ID_CHARS, pattern=r"^[\x21-\x7e]*$")] = ""

    def __post_init__(self) -> None:
        check_endpoint(self.decode_control, "decode_control")


class SendParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """P's part of a request: D's blocks (the same on every D rank: one scheduler allocates them) and
    D's ranks in tensor-parallel order.

    ``late``: sent to P at the same time as D's part, before D registered: no ``dst_blocks``,
    ``first_block`` or incarnations; each of P's transfers asks its D rank for them (late binding,
    docs/fencing.md) while P's forward runs."""

    transfer_id: Id
    token: Token
    decode_ranks: Annotated[list[DecodeRank], Meta(min_length=1, max_length=MAX_RANKS)]
    dst_blocks: Annotated[list[BlockId], Meta(max_length=MAX_BLOCKS)] = []
    first_block: FirstBlock = 0
    # P's tensor-parallel size the proxy planned the request for (the P ranks it told D to wait for):
    # P refuses to send when its own differs. 0 = not said: not checked.
    prefill_tp: Annotated[int, Meta(ge=0, le=MAX_RANKS)] = 0
    late: bool = False
    # how P sends this request's KV, where its client asked (the proxy's ``x-aiolayer-transfer-mode``
    # header); "" = P's own ``transfer_mode``
    transfer_mode: RequestedMode = ""

    def check(self) -> None:
        """The two forms apart (``read`` calls it; ValueError): late names no destination, D-first all of it.
        Not ``__post_init__``: engines and tests build refused shapes on purpose, which the worker survives."""
        incarnations = [bool(r.dst_incarnation) for r in self.decode_ranks]
        if self.late and (self.dst_blocks or self.first_block or any(incarnations)):
            raise ValueError("a late SendParams names no dst_blocks, first_block or dst_incarnation: D answers them")
        if not self.late and (not self.dst_blocks or not all(incarnations)):
            raise ValueError("dst_blocks and every rank's dst_incarnation are required (or late: true)")

    @classmethod
    def late_for(cls, transfer_id: str, token: str, decode_controls: list[str], prefill_tp: int,
                 transfer_mode: RequestedMode = "") -> SendParams:
        """What P is told at the same time as D (late binding): D's ranks' control endpoints only."""
        return cls(transfer_id=transfer_id, token=token, late=True, prefill_tp=prefill_tp,
                   decode_ranks=[DecodeRank(decode_control=c) for c in decode_controls],
                   transfer_mode=transfer_mode)

    @classmethod
    def for_registrations(cls, regs: list[DecodeRegistration], prefill_tp: int,
                          transfer_mode: RequestedMode = "") -> SendParams:
        """What P is told once every one of D's ranks registered (``regs`` in rank order, agreeing)."""
        first = regs[0].registration
        return cls(transfer_id=regs[0].transfer_id, token=first.token, dst_blocks=list(first.block_ids),
                   first_block=first.first_block, prefill_tp=prefill_tp,
                   decode_ranks=[r.decode_rank for r in regs],
                   transfer_mode=transfer_mode)


class DecodeRegistration(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What one of D's ranks POSTs to ``notify_url``: the runtime's registration as it made it, which
    request transfer it belongs to, and which rank of how many (P goes once every rank registered)."""

    transfer_id: Id                 # the request's (the proxy's); ``registration`` has this rank's
    registration: Registration
    rank: Rank
    ranks: Ranks
    dp_rank: Annotated[int, Meta(ge=0, lt=1 << 16)] = 0

    def __post_init__(self) -> None:
        reg = self.registration
        if self.rank >= self.ranks:
            raise ValueError(f"rank {self.rank} of {self.ranks}: not a rank")
        if reg.transfer_id != rank_transfer_id(self.transfer_id, self.rank, self.ranks):
            raise ValueError(f"registration.transfer_id {ascii(reg.transfer_id[:100])} is not rank {self.rank} "
                             f"of {self.ranks}'s of transfer {self.transfer_id}")
        if not 0 < len(reg.block_ids) <= MAX_BLOCKS or not all(0 <= b < 2**63 for b in reg.block_ids):
            raise ValueError(f"registration.block_ids: 1 to {MAX_BLOCKS} block ids, each >= 0")
        if not 0 <= reg.first_block < MAX_FIRST_BLOCK:
            raise ValueError(f"registration.first_block must be in [0, {MAX_FIRST_BLOCK})")
        if not MIN_TOKEN_CHARS <= len(reg.token) <= MAX_TOKEN_CHARS:
            raise ValueError(f"registration.token must have {MIN_TOKEN_CHARS} to {MAX_TOKEN_CHARS} characters")
        if len(reg.incarnation) > MAX_ID_CHARS or not re.fullmatch(r"[\x21-\x7e]+", reg.incarnation):
            raise ValueError("registration.incarnation must be printable ASCII without spaces")
        check_endpoint(reg.decode_control, "registration.decode_control")   # the proxy dials it to abort

    @property
    def decode_rank(self) -> DecodeRank:
        return DecodeRank(decode_control=self.registration.decode_control,
                          dst_incarnation=self.registration.incarnation)


_SEND_ONLY = frozenset(SendParams.__struct_fields__) - frozenset(RecvParams.__struct_fields__)
_RECV_ONLY = frozenset(RecvParams.__struct_fields__) - frozenset(SendParams.__struct_fields__)


def _safe(text: str) -> str:
    """An error message that can be logged anywhere (no lone surrogates, bounded)."""
    return text.encode("ascii", "backslashreplace").decode("ascii")[:500]


def read(params: Any) -> RecvParams | SendParams | None:
    """The aiolayer part of a request's kv_transfer_params, in the shape its fields name.

    None if the request has none; ``InvalidParams`` if it has one that does not fit the contract.
    Never raises anything else, whatever ``params`` holds.
    """
    if not isinstance(params, dict) or KEY not in params:
        return None
    value = params[KEY]
    if not isinstance(value, dict):
        raise InvalidParams(f"kv_transfer_params[{KEY!r}] must be an object, got {type(value).__name__}")
    kind: type[RecvParams] | type[SendParams] = RecvParams
    try:
        keys = {k for k in value if isinstance(k, str)}
        if keys & _SEND_ONLY and keys & _RECV_ONLY:
            raise InvalidParams(f"kv_transfer_params[{KEY!r}] mixes the fields of D's ({sorted(_RECV_ONLY)}) "
                                f"and P's ({sorted(_SEND_ONLY)}) parameters")
        kind = SendParams if keys & _SEND_ONLY else RecvParams
        params = msgspec.convert(value, kind)
        if isinstance(params, SendParams):
            params.check()
        return params
    except InvalidParams:
        raise
    except Exception as exc:  # noqa: BLE001 - msgspec raises more than ValidationError on odd input
        raise InvalidParams(_safe(f"kv_transfer_params[{KEY!r}] invalid for {kind.__name__}: {exc}")) from None


def read_registration(body: Any) -> DecodeRegistration:
    """A registration POSTed to the proxy, validated whole; ``InvalidParams`` (safe to log) otherwise."""
    try:
        return msgspec.convert(body, DecodeRegistration)
    except Exception as exc:  # noqa: BLE001 - msgspec raises more than ValidationError on odd input
        raise InvalidParams(_safe(f"invalid registration: {exc}")) from None
