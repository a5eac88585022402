"""How a proxied request failed, as its client gets it: a backend's 4xx unchanged, else an OpenAI-shaped
error naming the backend (P or D) and what happened (refused the connection, timed out, answered 5xx)."""

from __future__ import annotations

import json

import httpx


class ExchangeError(Exception):
    """How a request failed, as the client gets it: the proxy's OpenAI-shaped JSON error, or (``raw``)
    a backend's own 4xx answer, passed on with its status and body unchanged."""

    def __init__(self, status: int, kind: str, message: str, raw: bytes | None = None,
                 media_type: str = "application/json") -> None:
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message
        self.raw, self.media_type = raw, media_type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "code": self.status}}

    def payload(self) -> bytes:
        """What the client gets: the backend's body as it sent it, else the proxy's JSON error."""
        return self.raw if self.raw is not None else json.dumps(self.body()).encode()


def call_failed(exc: BaseException, who: str, url: str, limit_s: float) -> ExchangeError:
    """A call to P or D that got no answer, said as what happened: refused, timed out, or broken."""
    role = "prefill" if who == "P" else "decode"
    if isinstance(exc, httpx.ConnectTimeout):
        return ExchangeError(504, f"{role}_timeout", f"{who} ({url}) did not accept the connection in time")
    if isinstance(exc, httpx.ConnectError):
        why = "connection refused" if _refused(exc) else str(exc)
        return ExchangeError(502, f"{role}_unreachable", f"could not connect to {who} ({url}): {why}")
    if isinstance(exc, (httpx.TimeoutException, TimeoutError)):
        return ExchangeError(504, f"{role}_timeout", f"{who} ({url}) did not answer within {limit_s:g}s")
    return ExchangeError(502, f"{role}_error", f"{who} ({url}) failed: {type(exc).__name__}: {exc}")


def _refused(exc: BaseException | None, depth: int = 0) -> bool:
    """Whether a connect failure was a refusal (anyio hides it in a group under "All connection attempts failed")."""
    if exc is None or depth > 8:
        return False
    if isinstance(exc, ConnectionRefusedError):
        return True
    inner = list(getattr(exc, "exceptions", ()))   # an ExceptionGroup's
    return any(_refused(e, depth + 1) for e in [exc.__cause__, exc.__context__, *inner])


def answered_error(who: str, url: str, status: int, content: bytes, media_type: str,
                   what: str = "") -> ExchangeError:
    """P or D answered with an error: a 4xx (the request's own fault, e.g. an unknown model) goes to the
    client unchanged; anything else is that backend's failure, a 502 that quotes it."""
    role = "prefill" if who == "P" else "decode"
    if 400 <= status < 500:
        return ExchangeError(status, f"{role}_rejected", f"{who} answered HTTP {status}", raw=content,
                             media_type=media_type)
    text = content[:300].decode(errors="replace")
    return ExchangeError(502, f"{role}_error", f"{who} ({url}) answered HTTP {status}{what}: {text}")


def error_event(chunk: bytes | None) -> tuple[int, bytes] | None:
    """(status, error JSON) when a stream's first event is an error (vLLM ends a request that failed
    before any token so: ``data: {"error": {..., "code": 500}}`` under a 200), else None."""
    if not chunk or not chunk.startswith(b"data: {"):
        return None
    data = chunk[6:].split(b"\n", 1)[0]
    try:
        event = json.loads(data)
    except ValueError:   # an event split across chunks: not one to judge here
        return None
    error = event.get("error") if isinstance(event, dict) else None
    if not isinstance(error, dict):
        return None
    code = error.get("code")
    return (code if isinstance(code, int) and 400 <= code < 600 else 500), data


def failed_stage(kind: str) -> str:
    """Where a request that failed before its relay failed, by its error type: the proxy's checks, the
    pick, or a backend's part."""
    for prefix in ("registration", "prefill", "decode"):
        if kind.startswith(prefix):
            return prefix
    return {"no_backend": "pick", "invalid_request": "request"}.get(kind, "proxy")
