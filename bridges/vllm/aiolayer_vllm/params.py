"""The request-level contract: what the proxy puts in ``kv_transfer_params["aiolayer"]``.

To D (remote prefill): ``{"transfer_id": str, "token": str, "prefill_control": "tcp://...",
"notify_url": "http://..."}`` (P's control endpoint, so D can tell P to stop on abort or deadline;
where to POST the registration). To P (remote decode): ``{"transfer_id": str, "token": str,
"decode_control": "tcp://...", "dst_blocks": [int], "dst_incarnation": str, "first_block": int}``,
the registration D published. Transfer ids are the proxy's own, never derived from vLLM's request
ids. The token is a secret the proxy mints per transfer (``secrets.token_hex(16)``) and gives only
to this transfer's D and P: D refuses layout requests and DONE/FAILED without it.
"""

from __future__ import annotations

from typing import Any

import msgspec

KEY = "aiolayer"


class RecvParams(msgspec.Struct, frozen=True, kw_only=True):
    transfer_id: str
    token: str
    prefill_control: str = ""
    notify_url: str = ""      # where D POSTs its registration (the proxy); "" = LookupRequest only


class SendParams(msgspec.Struct, frozen=True, kw_only=True):
    transfer_id: str
    token: str
    decode_control: str
    dst_blocks: list[int]
    dst_incarnation: str
    first_block: int = 0


class InvalidParams(ValueError):
    """The request names aiolayer but its parameters do not fit the contract."""


def parse(params: dict[str, Any] | None, kind: type) -> Any:
    """The aiolayer part of a request's kv_transfer_params as ``kind``; None if it has none."""
    if not params or KEY not in params:
        return None
    try:
        return msgspec.convert(params[KEY], kind)
    except (msgspec.ValidationError, TypeError) as exc:
        raise InvalidParams(f"kv_transfer_params[{KEY!r}] invalid for {kind.__name__}: {exc}") from None
