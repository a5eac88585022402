"""Fixtures of the control plane's tests: an owner for spawned tasks, a closer for sockets, an echo server."""

from __future__ import annotations

import asyncio

import pytest
import zmq

from aiolayer.runtime.control.plane import ControlServer, open_sockets
from helpers_control import MAX_FRAME, EchoHandler


@pytest.fixture
async def spawn():
    tasks: list[asyncio.Task] = []

    def spawn(coro, name=None):
        task = asyncio.get_running_loop().create_task(coro, name=name)
        tasks.append(task)
        return task

    yield spawn
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


@pytest.fixture
async def closer():
    """Collects servers, clients and raw sockets; closes all of them at teardown."""
    things: list = []
    yield things.append
    for thing in reversed(things):
        if isinstance(thing, zmq.Socket):
            thing.close(0)
        else:
            await thing.close()
    assert open_sockets() == 0


@pytest.fixture
async def server(spawn, closer):
    handler = EchoHandler()
    srv = ControlServer("127.0.0.1", 0, handler, max_frame_bytes=MAX_FRAME)
    closer(srv)
    await srv.start(spawn)
    srv.test_handler = handler
    return srv
