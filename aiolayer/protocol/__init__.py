"""The I/O-free core: wire messages, block planning and transfer state machines.

Nothing in this package may import asyncio, zmq, torch or a backend; a test checks it.
"""
