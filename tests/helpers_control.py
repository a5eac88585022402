"""The control plane's tests' stand-ins: a free port, a handler that sleeps, echoes, raises or refuses."""

from __future__ import annotations

import asyncio
import socket

from aiolayer.errors import ControlRejected
from aiolayer.protocol import messages as m

MAX_FRAME = 1024   # the echo server's frame limit (the conftest's ``server`` fixture)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EchoHandler:
    """StatusRequest("sleep:0.1[#tag]") sleeps then echoes, ("boom") raises a bug; others are rejected."""

    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, msg: m.Message) -> m.Message:
        self.calls += 1
        if isinstance(msg, m.StatusRequest):
            tid = msg.transfer_id
            if tid.startswith("sleep:"):
                await asyncio.sleep(float(tid.split(":")[1].split("#")[0]))
            if tid == "boom":
                raise RuntimeError("handler bug")
            return m.StatusReply(transfer_id=tid, state="echo")
        if isinstance(msg, m.ReleaseRequest):
            raise ControlRejected("busy", f"transfer {msg.transfer_id} is busy")
        raise ControlRejected("unknown", f"{type(msg).__name__} is not served here")
