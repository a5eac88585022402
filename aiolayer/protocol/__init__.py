"""The I/O-free core: wire messages and their vocabulary (codes), block planning, transfer state machines.

Nothing in this package may import asyncio, zmq, torch or a backend; a test checks it.
"""
