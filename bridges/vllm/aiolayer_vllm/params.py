"""The request-level contract: what the proxy puts in ``kv_transfer_params["aiolayer"]``.

To D (remote prefill): ``{"transfer_id": str, "token": str, "prefill_control": "tcp://...",
"notify_url": "http://..."}`` (P's control endpoint, so D can tell P to stop on abort or deadline;
where to POST the registration); a P with several tensor-parallel ranks is named by
``"prefill_controls": [rank 0's, rank 1's, ...]`` instead (D's ranks work out which P ranks write
into them). To P (remote decode): ``{"transfer_id": str, "token": str, "decode_control": "tcp://...",
"dst_blocks": [int], "dst_incarnation": str, "first_block": int, "prefill_tp": int}``, the registration
D published and the P tensor-parallel size the plan assumed (optional; P refuses to send when its own
differs, telling D at once); a D with several tensor-parallel ranks is named by ``"decode_ranks":
[{"decode_control": ..., "dst_incarnation": ...}, ...]`` in rank order instead of the two single fields
(the blocks are the same on every rank: one scheduler allocates them). Transfer ids are the proxy's
own, never derived from vLLM's request ids. The token is a secret the proxy mints per transfer
(``secrets.token_hex(16)``) and gives only to this transfer's D and P: D refuses layout requests and
DONE/FAILED without it.

A request's parameters come from a client: ``read`` validates them whole (types, ranges, ASCII ids
and endpoints, no unknown field) and tells the two shapes apart by their fields, so one engine can
play both roles (``kv_both``). Anything else is ``InvalidParams`` with a message safe to log.
"""

from __future__ import annotations

import re
from typing import Annotated, Any
from urllib.parse import urlsplit

import msgspec
from msgspec import Meta

from aiolayer import MIN_TOKEN_CHARS   # the runtime's own minimum: refused here, before any I/O

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


class RecvParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    transfer_id: Id
    token: Token
    prefill_control: Url = ""   # "" = no P to tell on abort (D then waits fence_grace)
    notify_url: Url = ""        # where D POSTs its registration (the proxy); "" = LookupRequest only
    prefill_controls: Annotated[list[Url], Meta(max_length=MAX_RANKS)] = []   # P's TP ranks, in rank order

    def __post_init__(self) -> None:
        if self.prefill_control and self.prefill_controls:
            raise ValueError("give prefill_control (one P rank) or prefill_controls (several), not both")
        if self.prefill_control:
            check_endpoint(self.prefill_control, "prefill_control")
        for i, control in enumerate(self.prefill_controls):
            check_endpoint(control, f"prefill_controls[{i}]")
        if self.notify_url:
            check_url(self.notify_url, "notify_url")

    @property
    def prefill_ranks(self) -> list[str]:
        """P's control endpoint per TP rank ("" = unknown: D cannot tell that P to stop)."""
        return list(self.prefill_controls) or [self.prefill_control]


class DecodeRank(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    decode_control: Url
    dst_incarnation: Id

    def __post_init__(self) -> None:
        check_endpoint(self.decode_control, "decode_control")


class SendParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    transfer_id: Id
    token: Token
    dst_blocks: Annotated[list[BlockId], Meta(min_length=1, max_length=MAX_BLOCKS)]
    decode_control: Url = ""
    dst_incarnation: Annotated[str, Meta(max_length=MAX_ID_CHARS, pattern=r"^[\x21-\x7e]*$")] = ""
    first_block: Annotated[int, Meta(ge=0, lt=MAX_FIRST_BLOCK)] = 0
    decode_ranks: Annotated[list[DecodeRank], Meta(max_length=MAX_RANKS)] = []
    # P's tensor-parallel size the proxy planned the request for (the P ranks it told D to wait for):
    # P refuses to send when its own differs. 0 = not said (an older proxy): not checked.
    prefill_tp: Annotated[int, Meta(ge=0, le=MAX_RANKS)] = 0

    def __post_init__(self) -> None:
        if self.decode_ranks:
            if self.decode_control or self.dst_incarnation:
                raise ValueError("give decode_control and dst_incarnation (one D rank) or decode_ranks, not both")
            return
        check_endpoint(self.decode_control, "decode_control")
        if not self.dst_incarnation:
            raise ValueError("dst_incarnation is required with decode_control")

    @property
    def ranks(self) -> list[DecodeRank]:
        """D's ranks in TP order (one for a D without tensor parallelism)."""
        return list(self.decode_ranks) or [DecodeRank(decode_control=self.decode_control,
                                                      dst_incarnation=self.dst_incarnation)]


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
        return msgspec.convert(value, kind)
    except InvalidParams:
        raise
    except Exception as exc:  # noqa: BLE001 - msgspec raises more than ValidationError on odd input
        raise InvalidParams(_safe(f"kv_transfer_params[{KEY!r}] invalid for {kind.__name__}: {exc}")) from None

