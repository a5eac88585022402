"""The soak's D side: check each ended transfer at D, put it in its class, release it there, clean up orphans."""

from __future__ import annotations

import asyncio

from aiolayer.errors import AiolayerError, ControlRejected, RuntimeStateError
from aiolayer.protocol import messages as m
from aiolayer.protocol.codes import NackCode

from .common import CALL_S, D_BOUND_S, T
from .nodes import Node
from .pipeline import Transfer

# D's states that are no final word (still so at D's bound): the transfer counts as hung
D_UNSETTLED = ("registered", "aborting", "unreachable", "driver_error")


class SoakChecks:
    """``Soak``'s checks at D (a mixin): one task per ended transfer, and the allocations whose reply was lost."""

    def _init_checks(self) -> None:
        self.checks: set[asyncio.Task] = set()
        self.sem: asyncio.Semaphore | None = None          # status polls and releases
        self.sem_verify: asyncio.Semaphore | None = None   # verifications: never behind the polls
        self.orphans: list[tuple[Node, str, float]] = []

    def _check(self, t: Transfer) -> None:
        if self.stopping:
            return
        task = asyncio.get_running_loop().create_task(self._d_check(t))
        self.checks.add(task)
        task.add_done_callback(self.checks.discard)

    async def _d_check(self, t: Transfer) -> None:
        state, crc_ok = "driver_error", False
        try:
            state, crc_ok = await self._d_state(t)
            t.node.acked.discard(t.tid)
            if state in ("finished", "failed"):
                await self._release(t.node, t.tid)
            elif state in ("dead", "unknown"):
                t.node.held -= 1
        except Exception as exc:  # noqa: BLE001 - a driver bug must not hide a transfer: it counts as hung
            self.examples["driver_errors"].append(f"{t.tid}: {type(exc).__name__}: {exc}")
            if state not in ("finished", "failed"):
                state = "driver_error"
        finally:
            t.node.acked.discard(t.tid)
        if t.p_hung:
            return
        ok = t.outcome.ok
        if state == "finished" and not crc_ok:
            cls = "lost"
        elif ok:
            cls = ("finished" if state == "finished" else "ok_unverified" if state == "dead" else
                   "hung" if state in D_UNSETTLED else "lost")
        else:
            cls = "disagree" if state == "finished" else "hung" if state in D_UNSETTLED else "failed"
            if state == "unknown":
                self.counters["failed_d_unknown"] += 1
        if cls == "ok_unverified":
            self._why_unverified(t)
        if cls in ("lost", "hung", "disagree") and len(self.examples[cls]) < 20:
            self.examples[cls].append(f"{t.tid} kind={t.kind or 'none'} p_ok={ok} d={state} crc_ok={crc_ok} "
                                      f"reason={t.outcome.reason[:160]!r}")
        self._classify(t, cls)

    def _why_unverified(self, t: Transfer) -> None:
        """P ok although its D was killed: acknowledged before the kill, or after it by whom?"""
        node = t.node
        succ = node.successor
        after_kill = t.outcome.finished_s - node.killed_at
        heir = ("successor on the same port" if succ is not None and succ.port == node.port else
                "successor on another port" if succ is not None else "no successor yet")
        up_before = succ is not None and getattr(succ, "started_at", 1e18) <= t.outcome.finished_s
        key = (f"ok {'after' if after_kill > 0 else 'before'} the kill; {heir}"
               + (", up before the ack" if up_before else ""))
        self.unverified_why[key] += 1
        if after_kill > 0 and len(self.examples["ok_after_kill"]) < 20:
            self.examples["ok_after_kill"].append(f"{t.tid} ack {after_kill:.3f}s after SIGKILL; {heir}"
                                                  f"{', successor up before the ack' if up_before else ''}")

    def _classify(self, t: Transfer, cls: str) -> None:
        self.classes[cls] += 1
        self.by_kind[t.kind or "none"][cls] += 1
        self.ended += 1
        if self.rss_start is None and self.ended >= self.rss_after:
            self._measure_start()

    async def _d_state(self, t: Transfer) -> tuple[str, bool]:
        """D's final word on ``t``: (state, CRCs equal P's), waiting out fences, freezes and deadlines."""
        loop = asyncio.get_running_loop()
        node = t.node
        deadline = loop.time() + D_BOUND_S
        pause = 0.2
        verify = t.outcome.ok
        state = "unreachable"
        while True:
            if node.dead:
                return "dead", False
            client = node.client
            try:
                if client is None:
                    raise RuntimeStateError("no client")
                wait = node.frozen_until - loop.time()
                if wait > 0:               # we froze it: ask once it runs again
                    await asyncio.sleep(wait + 0.05)
                    continue
                if verify:
                    async with self.sem_verify:
                        reply = await client.call(m.VerifyRequest(transfer_id=t.tid), timeout=CALL_S)
                    return reply.state, (reply.crc_k, reply.crc_v) == t.crc
                async with self.sem:
                    reply = await client.call(m.StatusRequest(transfer_id=t.tid), timeout=CALL_S)
                state = reply.state
                if state == "finished":
                    verify = True
                    continue
                if state in ("failed", "unknown"):
                    return state, False
            except ControlRejected as exc:
                if exc.code == NackCode.UNKNOWN_TRANSFER:
                    return "unknown", False
                state = f"rejected_{exc.code}"
            except (AiolayerError, asyncio.TimeoutError):
                if node.dead:
                    return "dead", False
                state = "unreachable"
            if loop.time() >= deadline:
                return ("unreachable" if state.startswith("rejected") else state), False
            await asyncio.sleep(pause)
            pause = min(1.0, pause * 1.5)

    async def _release(self, node: Node, tid: str) -> bool:
        for _ in range(5):
            client = node.client
            if node.dead or client is None:
                node.held -= 1
                return False
            try:
                async with self.sem:
                    await client.call(m.ReleaseRequest(transfer_id=tid), timeout=CALL_S)
                self.counters["d_released"] += 1
                node.held -= 1
                return True
            except ControlRejected as exc:
                self.counters[f"d_release_rejected_{exc.code}"] += 1
                if exc.code == NackCode.UNKNOWN_TRANSFER:
                    node.held -= 1
                    return False
            except (AiolayerError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(0.5)
        self.counters["d_release_failed"] += 1
        return False

    async def _orphan_cleaner(self, final: bool = False) -> None:
        """Release allocations whose reply was lost (the node froze): once D failed them, or never had them."""
        loop = asyncio.get_running_loop()
        while True:
            keep = []
            for node, tid, since in self.orphans:
                if node.dead:
                    node.held -= 1
                    continue
                if node.client is None or loop.time() < node.frozen_until:
                    keep.append((node, tid, since))
                    continue
                client = node.client
                try:
                    await client.call(m.ReleaseRequest(transfer_id=tid), timeout=CALL_S)
                    self.counters["orphans_released"] += 1
                    node.held -= 1
                    continue
                except ControlRejected as exc:
                    if exc.code == NackCode.UNKNOWN_TRANSFER and loop.time() - since > 2 * CALL_S:
                        self.counters["orphans_never_registered"] += 1
                        node.held -= 1
                        continue
                except (AiolayerError, asyncio.TimeoutError):
                    pass
                if loop.time() - since > D_BOUND_S + T.receive:
                    self.counters["orphans_stuck"] += 1
                    self.examples["orphans_stuck"].append(tid)
                    node.held -= 1
                    continue
                keep.append((node, tid, since))
            self.orphans = keep
            if final and not keep:
                return
            await asyncio.sleep(1.0)
