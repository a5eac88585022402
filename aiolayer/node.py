"""DecodeNode: a standalone D process with a paged KV cache, driven over its control socket.

It serves what a proxy and a P engine need from D: ``AllocRequest`` (allocate blocks and register
the transfer before the ids are published), the layout, DONE/FAILED, ``StatusRequest``,
``VerifyRequest`` (per-layer checksums of what arrived) and ``ReleaseRequest``.

These management messages are the driver's surface (a proxy, the benchmark, tests): whoever can
reach the control port can allocate. Keep it on 127.0.0.1 or a private interface (the default).
A transfer's token comes with its ``AllocRequest`` or is minted here and returned in the reply.
"""

from __future__ import annotations

import asyncio
import secrets

from .config import KVShape, NodeConfig, Timeouts
from .backends.base import TransferBackend
from .errors import ConfigError, ControlRejected, FrameDropped, RuntimeStateError
from .kvcache import BlockAllocator, PagedKVCache
from .protocol import messages as m
from .protocol.codes import AckDetail, NackCode
from .protocol.plan import HeadGeometry
from .runtime.control.hooks import install_hooks
from .runtime.runtime import Runtime


class DecodeNode:
    def __init__(self, shape: KVShape, node: NodeConfig | None = None, timeouts: Timeouts | None = None,
                 backend: TransferBackend | None = None, refuse_writes: bool = False) -> None:
        self.shape = shape
        self.refuse_writes = refuse_writes   # fault injection: publish the layout, register no memory
        self.runtime = install_hooks(Runtime(node, timeouts, backend=backend), extra_handler=self._handle,
                                     inbound_filter=self._drop_faulty, refuse_writes=refuse_writes)
        self.cache: PagedKVCache | None = None
        self.allocator = BlockAllocator(shape.num_blocks)
        self._blocks: dict[str, list[int]] = {}
        self._drop_done: set[str] = set()    # fault injection: DONEs of these transfers go unanswered

    @property
    def control_endpoint(self) -> str:
        return self.runtime.control_endpoint

    def start(self) -> "DecodeNode":
        self.cache = PagedKVCache(self.shape)
        self.runtime.start()
        try:
            # with its head geometry, so P ranks of another TP size can write head slices
            shape = self.shape
            self.runtime.register_kv_memory(self.cache.k_base, self.cache.v_base, shape.block_bytes,
                                            shape.num_blocks, kv_heads=shape.kv_heads,
                                            geometry=HeadGeometry(shape.block_size, shape.head_bytes, shape.layout),
                                            host_memory=True)
        except BaseException:
            self.runtime.stop()
            raise
        return self

    def stop(self) -> None:
        self.runtime.stop()

    def info(self) -> dict:
        return {"control": self.control_endpoint, "session": self.runtime.backend.session,
                "engine_id": self.runtime.node.engine_id, "incarnation": self.runtime.incarnation,
                "backend": self.runtime.backend.name, "num_blocks": self.shape.num_blocks,
                "metrics": self.runtime.metrics_url}

    async def _handle(self, msg: m.Message) -> m.Message:
        receiver = self.runtime.receiver
        if isinstance(msg, m.AllocRequest):
            if msg.senders < 1 or msg.num_blocks < 1:   # -1 took all but one block, 0 an empty transfer
                raise ControlRejected(NackCode.BAD_REQUEST, f"num_blocks and senders must be >= 1, got "
                                      f"{msg.num_blocks} and {msg.senders}")
            ids = self.allocator.allocate(msg.num_blocks, msg.contiguous)
            if ids is None:
                raise ControlRejected(NackCode.NO_SPACE, f"{msg.num_blocks} blocks asked, {self.allocator.free} free")
            token = msg.token or secrets.token_hex(16)
            try:
                receiver.register(msg.transfer_id, ids, token=token, on_release=self.allocator.release,
                                  senders=msg.senders)
            except ConfigError as exc:
                self.allocator.release(ids)
                raise ControlRejected(NackCode.TOKEN, str(exc)) from None
            except ControlRejected:
                self.allocator.release(ids)
                raise
            self._blocks[msg.transfer_id] = ids
            if msg.drop_done:
                self._drop_done.add(msg.transfer_id)
            return m.AllocReply(transfer_id=msg.transfer_id, block_ids=ids, incarnation=self.runtime.incarnation,
                                token=token)
        if isinstance(msg, m.StatusRequest):
            state, reason = receiver.state_of(msg.transfer_id)
            return m.StatusReply(transfer_id=msg.transfer_id, state=state, reason=reason)
        if isinstance(msg, m.VerifyRequest):
            return await self._verify(msg.transfer_id)
        if isinstance(msg, m.ReleaseRequest):
            receiver.pop_results()  # a node reports through StatusRequest: do not let results pile up
            if not receiver.release(msg.transfer_id):
                raise ControlRejected(NackCode.UNKNOWN_TRANSFER, f"no transfer {msg.transfer_id}")
            self._blocks.pop(msg.transfer_id, None)
            self._drop_done.discard(msg.transfer_id)
            return m.Ack(detail=AckDetail.RELEASED)
        raise ControlRejected(NackCode.UNKNOWN, f"{type(msg).__name__} is not served by a decode node")

    def _drop_faulty(self, msg: m.Message) -> None:
        if isinstance(msg, m.Done) and msg.transfer_id in self._drop_done:
            raise FrameDropped(f"fault injection: DONE of {msg.transfer_id} dropped")

    async def _verify(self, transfer_id: str) -> m.Message:
        ids = self._blocks.get(transfer_id)
        if ids is None:
            raise ControlRejected(NackCode.UNKNOWN_TRANSFER, f"no transfer {transfer_id}")
        if self.cache is None:
            raise RuntimeStateError("decode node not started")
        state, reason = self.runtime.receiver.state_of(transfer_id)
        crc_k, crc_v = await asyncio.to_thread(self.cache.checksums, ids)
        return m.VerifyReply(transfer_id=transfer_id, state=state, reason=reason, crc_k=crc_k, crc_v=crc_v)
