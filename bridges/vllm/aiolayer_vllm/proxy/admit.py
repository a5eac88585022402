"""A client's request checked at the proxy's boundary, before any engine sees it: the body the flows can
serve, the headers that go on to the engines, the transfer mode the client may name. A request that
fails a check is a 400 (``ExchangeError``) and nothing is sent.
"""

from __future__ import annotations

import json

from starlette.requests import ClientDisconnect

from ..params import REQUESTED_MODES, RequestedMode
from .failures import ExchangeError

# Passed on to P and D as the client sent them: vLLM servers started with --api-key check the first,
# and the second ties the engines' logs to the client's request.
FORWARDED_HEADERS = ("authorization", "x-request-id", "traceparent", "tracestate")   # the last two: W3C trace context
# How P sends this request's KV, where the client wants a fixed mode rather than P's ``transfer_mode``
# (a benchmark comparing the modes on one pair of engines, a request known to be short or long)
MODE_HEADER = "x-aiolayer-transfer-mode"
# The largest body the proxy reads (413 past it, the rest never read): the whole body is held while the
# request runs, so without a cap one client's upload could take the proxy's memory from every other. The
# largest legitimate bodies are prompt embeddings (4 bytes x hidden size x tokens, base64: 8k tokens of
# 4,096 floats is ~180 MB); a 128k-token prompt as text or token ids is about 1 MB.
MAX_BODY_BYTES = 256 << 20


async def read_json_body(scope, receive, limit: int = MAX_BODY_BYTES):
    """The request's body parsed as JSON, reading at most ``limit`` bytes: a 413 once it is past that (by
    its Content-Length or as it arrives), a 400 when it is not JSON; ``ClientDisconnect`` when the
    client leaves first."""
    declared = next((value for name, value in scope["headers"] if name.lower() == b"content-length"), b"")
    if declared.strip().isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    raw = b"".join(chunks)
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except ValueError:   # not JSON, not UTF-8
        raise ExchangeError(400, "invalid_request", "body is not JSON") from None
    if b"\\u" in raw:   # an escaped lone surrogate parses, but no engine request can carry it
        try:
            json.dumps(body, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise ExchangeError(400, "invalid_request", "body holds an unpaired UTF-16 surrogate (\\ud800-"
                                "\\udfff): not text any engine takes") from None
    return body


def _no_constant(name: str):
    raise ExchangeError(400, "invalid_request", f"body holds {name}, which is not JSON (nor a value an engine takes)")


def _too_large(size: int, limit: int) -> ExchangeError:
    return ExchangeError(413, "invalid_request", f"body of {size:,}+ bytes is over the proxy's limit of {limit:,}")


def forwarded_headers(raw: list[tuple[bytes, bytes]]) -> dict[str, str]:
    """The client's headers that go on to the engines, from an ASGI scope's ``headers``."""
    wanted = {}
    for name, value in raw:
        key = name.decode("latin-1").lower()
        if key in FORWARDED_HEADERS:
            wanted[key] = value.decode("latin-1")
    return wanted


def requested_mode(raw: list[tuple[bytes, bytes]]) -> RequestedMode:
    """The client's ``MODE_HEADER`` from an ASGI scope's ``headers``: "" without one; a 400 for another
    value than "layerwise" or "bulk" (or two different ones)."""
    values = {value.decode("latin-1").strip().lower() for name, value in raw
              if name.decode("latin-1").lower() == MODE_HEADER}
    if not values:
        return ""
    mode = REQUESTED_MODES.get(values.pop()) if len(values) == 1 else None
    if mode is None:
        raise ExchangeError(400, "invalid_request", f"{MODE_HEADER} must be one of {', '.join(REQUESTED_MODES)}")
    return mode


def check_body(body) -> None:
    """Refuse, at the boundary, a request the D-first flow cannot serve correctly (400, nothing sent)."""
    if not isinstance(body, dict):
        raise ExchangeError(400, "invalid_request", "body must be a JSON object")
    if body.get("kv_transfer_params") is not None:
        # refused rather than dropped: a client that means to steer the transfer should learn it cannot
        raise ExchangeError(400, "invalid_request",
                            "kv_transfer_params is set by the proxy, which owns the KV transfer: leave it out")
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise ExchangeError(400, "invalid_request", "stream must be true or false")
    for key in ("n", "best_of"):
        value = body.get(key)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            raise ExchangeError(400, "invalid_request", f"{key} must be an integer")
        if value > 1:
            # vLLM's parallel samples share the request's kv_transfer_params, so they would share one transfer
            raise ExchangeError(400, "invalid_request",
                                f"{key} > 1 is not supported through the disaggregated proxy: send {value} requests")
    if body.get("use_beam_search"):
        raise ExchangeError(400, "invalid_request", "beam search is not supported through the disaggregated proxy")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(one, (str, list)) for one in prompt):
        # vLLM makes one engine request per prompt of a batch, all with this request's kv_transfer_params
        raise ExchangeError(400, "invalid_request", f"a batch of {len(prompt)} prompts is not supported through "
                            f"the disaggregated proxy (they would share one KV transfer): send {len(prompt)} requests")


def prefilled_at_d(body: dict, path: str = "") -> bool:
    """Whether D computes the whole prompt itself whatever KV it is sent: vLLM reads no transferred (or
    cached) KV for a request that asks the prompt's logprobs, and a prompt of embeddings has no token
    ids to match. Such a request goes to D alone; sent to P as well, P's transfer would wait for a
    registration D never makes. ``echo`` asks them too (vLLM's ``to_sampling_params``: the prompt's
    logprobs are ``logprobs`` for a completion, ``top_logprobs`` for a chat, whose default is 0)."""
    if any(body.get(key) is not None for key in ("prompt_logprobs", "prompt_logprob_token_ids", "prompt_embeds")):
        return True
    if body.get("echo"):
        wanted = body.get("top_logprobs", 0) if path.endswith("chat/completions") else body.get("logprobs")
        return wanted is not None
    return False
