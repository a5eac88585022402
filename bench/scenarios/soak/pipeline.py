"""The soak's proxy role: draw transfers and faults, allocate on D, run P's forward, collect P's outcomes."""

from __future__ import annotations

import asyncio
import collections
import secrets
import time
import zlib

import numpy as np

from aiolayer import TransferSpec
from aiolayer.errors import AiolayerError, ControlRejected
from aiolayer.kvcache import BlockAllocator
from aiolayer.protocol import messages as m

from .common import (BLOCKS, CALL_S, FAULT_AT_LAYER, FREEZE_S, KILL_VERIFY_S, LAYER_S, P_BLOCKS, P_BOUND_S,
                          STEP, WINDOW, rss_mb)
from .nodes import Node
from .report import reason_key


class Transfer:
    __slots__ = ("index", "tid", "kind", "node", "alloc", "src", "crc", "t_begin", "outcome", "p_hung", "faulted")

    def __init__(self, index: int, kind: str) -> None:
        self.index = index
        self.tid = f"soak-{index}-{secrets.token_hex(4)}"
        self.kind = kind               # "" or one of KINDS
        self.node: Node | None = None
        self.alloc: m.AllocReply | None = None
        self.src: list[int] | None = None
        self.crc: tuple[list[int], list[int]] | None = None
        self.t_begin = 0.0
        self.outcome = None
        self.p_hung = False
        self.faulted = False           # the fault was actually applied (a kill/freeze of a live node)


class SoakPipeline:
    """``Soak``'s allocators, forward and collector (a mixin), and the transfers on their way through them."""

    def _init_pipeline(self) -> None:
        self.next_index = 0
        self.fault_turn = 0
        self.carry: collections.Counter[str] = collections.Counter()   # kill/freeze faults drawn for a dead node
        self.ready: asyncio.Queue | None = None
        self.pending_p: dict[str, Transfer] = {}   # begun, no outcome yet
        self.hung_p: dict[str, Transfer] = {}      # past the P bound without an outcome
        self.src_of: dict[str, list[int]] = {}     # tid -> P source blocks not yet released by P
        self.p_src = BlockAllocator(P_BLOCKS)
        self.src_waits = 0
        self.begun = 0
        self.ended = 0                             # classified
        self.last_outcome = time.monotonic()

    def _next_transfer(self) -> Transfer | None:
        if self.next_index >= self.n:
            return None
        kind = ""
        if self.rng.random() < self.rate:
            kind = self.kinds[self.fault_turn % len(self.kinds)]
            self.fault_turn += 1
        t = Transfer(self.next_index, kind)
        self.next_index += 1
        return t

    async def _allocator(self) -> None:
        while (t := self._next_transfer()) is not None:
            while True:
                node = self.refuse_node if t.kind == "refuse" else self._pick()
                if node is None or node.client is None or node.dead:
                    await asyncio.sleep(0.05)
                    continue
                req = m.AllocRequest(transfer_id=t.tid, num_blocks=BLOCKS, sender_control=self.rt.control_endpoint,
                                     drop_done=t.kind == "drop_done")
                node.held += 1
                try:
                    reply = await node.client.call(req, timeout=CALL_S)
                except ControlRejected as exc:
                    node.held -= 1
                    self.counters[f"alloc_rejected_{exc.code}"] += 1
                    await asyncio.sleep(0.05)
                    continue
                except (AiolayerError, asyncio.TimeoutError):
                    self.counters["alloc_timeouts"] += 1
                    if not node.dead:   # it may register once it runs again: release it then
                        self.orphans.append((node, t.tid, asyncio.get_running_loop().time()))
                    else:
                        node.held -= 1
                    t.tid = f"soak-{t.index}-{secrets.token_hex(4)}"   # the old id may be registered there
                    await asyncio.sleep(0.01)
                    continue
                t.node, t.alloc = node, reply
                node.active += 1
                break
            await self.ready.put(t)

    def _kv_of(self, t: Transfer) -> np.ndarray:
        salt = np.uint64((t.index + 1) * 0x9E3779B97F4A7C15 % (1 << 64))
        data = np.bitwise_xor(self.base, salt).view(np.uint8)
        return data.reshape(self.shape.num_layers, 2, BLOCKS, self.shape.block_bytes)

    async def _forward(self) -> None:
        blocks = self.cache.blocks
        while self.begun < self.n:
            while len(self.pending_p) >= WINDOW:
                await asyncio.sleep(0.002)
            batch = [await self.ready.get()]
            while len(batch) < STEP and len(self.pending_p) + len(batch) < WINDOW and not self.ready.empty():
                batch.append(self.ready.get_nowait())
            kvs = []
            for t in batch:
                while (src := self.p_src.allocate(BLOCKS)) is None:
                    self.src_waits += 1
                    await asyncio.sleep(0.005)
                t.src = src
                self.src_of[t.tid] = src
                kv = self._kv_of(t)
                t.crc = ([zlib.crc32(kv[layer, 0]) for layer in range(kv.shape[0])],
                         [zlib.crc32(kv[layer, 1]) for layer in range(kv.shape[0])])
                kvs.append(kv)
            specs = [TransferSpec.from_registration(t.alloc, src_blocks=t.src, peer=t.node.control) for t in batch]
            now = time.perf_counter()
            for t in batch:
                t.t_begin = now
                self.pending_p[t.tid] = t
            self.begun += len(batch)
            step = self.rt.begin_step(specs)
            for layer in range(self.shape.num_layers):
                for t, kv in zip(batch, kvs):
                    blocks[layer][:, t.src] = kv[layer]
                step.layer_ready(layer)
                if layer == FAULT_AT_LAYER:
                    for t in batch:
                        self._carry_over(t)
                    doomed = {t.node for t in batch if t.kind == "kill" and not t.node.dead}
                    if doomed:
                        await self._verify_before_kill(doomed)
                    for t in batch:
                        self._inject(t)
                await asyncio.sleep(LAYER_S)
            step.end()
            if self.begun >= self.n:
                self.rss_last_begin = rss_mb()

    async def _verify_before_kill(self, doomed: set) -> None:
        """Let D verify the transfers P already acknowledged on a node about to be killed (bounded).

        Killed right away, those could never be checked (``ok_unverified``). The faulted transfer
        stays mid-stream meanwhile: its later layers are not handed over until the kill.
        """
        loop = asyncio.get_running_loop()
        start = loop.time()
        while any(n.acked for n in doomed) and loop.time() - start < KILL_VERIFY_S:
            await asyncio.sleep(0.002)
        waited = loop.time() - start
        self.kill_waits.append(waited)
        self.counters["kill_acked_left_unverified"] += sum(len(n.acked) for n in doomed)

    def _carry_over(self, t: Transfer) -> None:
        node = t.node
        if not t.kind and not node.dead and not node.refuse:
            for kind in ("kill", "freeze"):
                if self.carry[kind]:      # one drawn earlier found its node dead: this transfer takes it
                    self.carry[kind] -= 1
                    self.counters[f"{kind}_carried_over"] += 1
                    t.kind = kind
                    break

    def _inject(self, t: Transfer) -> None:
        node = t.node
        if t.kind in ("refuse", "drop_done"):
            self.injected[t.kind] += 1
            t.faulted = True
        elif t.kind in ("kill", "freeze"):
            if node.dead:
                self.skipped[t.kind] += 1     # an earlier kill got its node already: it fails all the same,
                self.carry[t.kind] += 1       # and the fault goes to the next transfer without one
                return
            self.injected[t.kind] += 1
            t.faulted = True
            if t.kind == "kill":
                self._kill(node)
            else:
                self._freeze(node, self.freeze_rng.uniform(*FREEZE_S))

    async def _collector(self) -> None:
        loop = asyncio.get_running_loop()
        next_scan = loop.time() + 0.5
        while self.ended < self.n:
            for o in self.rt.pop_outcomes():
                t = self.pending_p.pop(o.transfer_id, None)
                if t is None:
                    t = self.hung_p.pop(o.transfer_id, None)
                    if t is None:
                        self.counters["unknown_outcomes"] += 1
                        continue
                    self.counters["late_outcomes"] += 1
                t.outcome = o
                if not t.p_hung:
                    t.node.active -= 1
                self.last_outcome = time.monotonic()
                took = o.finished_s - t.t_begin
                if not t.p_hung:
                    self.lat_all.append(took)
                    (self.lat_ok if o.ok else self.lat_fail).append(took)
                    if t.kind:
                        self.lat_kind[t.kind].append(took)
                if o.ok:
                    t.node.acked.add(t.tid)
                else:
                    self.reasons[reason_key(o.reason)] += 1
                    if not t.kind:
                        self._collateral(t, o)
                self._check(t)
            self._free_released()
            if loop.time() >= next_scan:
                next_scan = loop.time() + 0.5
                self._scan_p_bound()
                self._watch_nodes()
            await asyncio.sleep(0.002)

    def _free_released(self) -> None:
        """Give the source blocks P no longer reads back to P's cache."""
        for tid in self.rt.pop_released():
            src = self.src_of.pop(tid, None)
            if src is not None:
                self.p_src.release(src)

    def _scan_p_bound(self) -> None:
        """Count as hung what has no outcome at P ``P_BOUND_S`` after its step began."""
        now = time.perf_counter()
        for tid, t in list(self.pending_p.items()):
            if now - t.t_begin > P_BOUND_S:
                del self.pending_p[tid]
                t.p_hung = True
                t.node.active -= 1
                self.hung_p[tid] = t
                self.examples["hung_p"].append(f"{tid} kind={t.kind or 'none'} node=d{t.node.slot}")
                self._classify(t, "hung")   # counted now; a late outcome still gets D checked

    def _collateral(self, t: Transfer, o) -> None:
        """Why a transfer without a fault of its own failed: its node's condition during its life."""
        node = t.node
        now = asyncio.get_running_loop().time()
        if node.killed or node.dead:
            where = "node killed"
        elif node.last_freeze and node.last_freeze >= now - (o.finished_s - t.t_begin) - 6.0:
            where = "node frozen"
        else:
            where = "healthy node"
            if len(self.examples["collateral_healthy"]) < 20:
                self.examples["collateral_healthy"].append(
                    f"{t.tid} d{node.slot}{' refuse' if node.refuse else ''} took {o.finished_s - t.t_begin:.3f}s: "
                    f"{o.reason[:200]}")
        self.collateral_where[where] += 1
