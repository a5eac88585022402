"""The soak's pool of decode node processes: starting, attaching, killing, replacing, freezing, reaping, picking."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time

from aiolayer.runtime.control.plane import ControlClient
from aiolayer.harness.node import NodeProcess

from ..faults import NODE_ARGS, NODE_ENV
from .common import DRIVER_TIMEOUTS, rss_mb


class Node:
    """One decode node process of the pool (a replacement is a new ``Node``)."""

    def __init__(self, slot: int, proc: NodeProcess, refuse: bool) -> None:
        self.slot = slot
        self.proc = proc
        self.refuse = refuse
        self.control = proc.control
        self.port = int(self.control.rsplit(":", 1)[1])
        self.incarnation = proc.info.get("incarnation", "")
        self.pid = proc.pid
        self.client: ControlClient | None = None
        self.dead = False
        self.killed = False            # by the soak (an unexpected death is reported apart)
        self.frozen_until = 0.0
        self.acked: set[str] = set()   # P acknowledged, D not verified yet
        self.cont: asyncio.TimerHandle | None = None
        self.held = 0                  # transfers allocated here, not yet released
        self.active = 0                # transfers allocated here, no outcome at P yet
        self.rss_first = 0.0
        self.last_freeze = 0.0         # loop time of the last SIGSTOP
        self.killed_at = 0.0           # perf_counter of the SIGKILL
        self.successor: "Node | None" = None

    def up(self, now: float) -> bool:
        return not self.dead and self.client is not None and now >= self.frozen_until


class SoakNodes:
    """``Soak``'s node pool (a mixin): ``pool`` (one slot per decode rank), ``refuse_node``, ``all_nodes``."""

    def _init_nodes(self) -> None:
        self.pool: list[Node | None] = []
        self.refuse_node: Node | None = None
        self.all_nodes: list[Node] = []   # every node ever started, the dead included
        self.node_pids: list[int] = []
        self.restarts = 0

    # --- set-up / tear-down (blocking, main thread) --------------------------------------------

    def _start_pool(self) -> None:
        """Start the decode nodes (in parallel) and the refusing one; raise the first start error."""
        starts = [threading.Thread(target=self._start_slot, args=(i,)) for i in range(self.ranks)]
        self.pool = [None] * self.ranks
        self._start_errors: list[BaseException] = []
        for th in starts:
            th.start()
        self.refuse_node = self._start_node(-1, refuse=True)
        for th in starts:
            th.join()
        if self._start_errors:
            raise self._start_errors[0]

    def _start_slot(self, slot: int) -> None:
        try:
            self.pool[slot] = self._start_node(slot)
        except BaseException as exc:  # noqa: BLE001 - re-raised by _start_pool()
            self._start_errors.append(exc)

    def _stop_pool(self) -> None:
        """Stop every node (in parallel), and kill any whose stop timed out."""
        stoppers = [threading.Thread(target=self._reap, args=(n,)) for n in self.all_nodes]
        for th in stoppers:
            th.start()
        for th in stoppers:
            th.join(20)
        for node in self.all_nodes:   # a stop that timed out: make sure
            if node.proc.proc is not None and node.proc.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    node.proc.proc.kill()
                with contextlib.suppress(Exception):
                    node.proc.proc.wait(5)

    def _start_node(self, slot: int, refuse: bool = False, port: int = 0) -> Node:
        extra = [*NODE_ARGS, "--engine-id", "soak-refuse" if refuse else f"soak-d{slot}"]
        if refuse:
            extra.append("--refuse-writes")
        if port:
            extra += ["--port", str(port)]
        proc = NodeProcess(self.d_shape, extra_args=extra, env=NODE_ENV).start()
        self.node_pids.append(proc.pid)
        node = Node(slot, proc, refuse)
        self.all_nodes.append(node)
        return node

    @staticmethod
    def _reap(node: Node) -> None:
        node.proc.stop(timeout=5.0)
        with contextlib.suppress(Exception):
            node.proc._stderr.close()   # noqa: SLF001 - one temporary file per node, no fd kept for the dead

    # --- on the driver's loop ------------------------------------------------------------------

    async def _attach(self, node: Node) -> None:
        client = ControlClient(node.control, DRIVER_TIMEOUTS)
        await client.start(self._spawn)
        node.client = client
        node.rss_first = rss_mb(node.pid)

    def _kill(self, node: Node) -> None:
        if node.dead:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(node.pid, signal.SIGKILL)
        node.killed = True
        node.killed_at = time.perf_counter()
        self._node_gone(node)

    def _node_gone(self, node: Node) -> None:
        node.dead = True
        if node.cont is not None:
            node.cont.cancel()
            node.cont = None
        client, node.client = node.client, None
        if client is not None:
            self._spawn(client.close(), name="close client")
        if node is self.refuse_node or (not node.refuse and self.pool[node.slot] is node):
            self._spawn(self._replace(node), name=f"replace d{node.slot}")

    async def _replace(self, old: Node) -> None:
        await asyncio.to_thread(self._reap, old)
        # diagnostics: AIOLAYER_SOAK_RESTART_PORT=same|new (default: alternate)
        policy = os.environ.get("AIOLAYER_SOAK_RESTART_PORT", "alternate")
        port = old.port if policy == "same" or (policy == "alternate" and self.restarts % 2 == 0) else 0
        self.restarts += 1
        for attempt in range(4):
            try:
                new = await asyncio.to_thread(self._start_node, old.slot, old.refuse, port)
                await self._attach(new)
            except Exception as exc:  # noqa: BLE001 - the port may be taken: a fresh one next time
                self.counters["restart_errors"] += 1
                self.examples["restart_errors"].append(f"{type(exc).__name__}: {str(exc)[:200]}")
                port = 0
                await asyncio.sleep(0.5)
                continue
            self.counters["restarts_same_port" if port else "restarts_new_port"] += 1
            old.successor = new
            new.started_at = time.perf_counter()
            if old.refuse:
                self.refuse_node = new
            else:
                self.pool[old.slot] = new
            return
        self.counters["slots_lost"] += 1

    def _freeze(self, node: Node, seconds: float) -> None:
        if node.dead:
            return
        loop = asyncio.get_running_loop()
        with contextlib.suppress(ProcessLookupError):
            os.kill(node.pid, signal.SIGSTOP)
        until = loop.time() + seconds
        node.last_freeze = loop.time()
        if until > node.frozen_until:
            node.frozen_until = until
            if node.cont is not None:
                node.cont.cancel()
            node.cont = loop.call_at(until, self._thaw, node)

    def _thaw(self, node: Node) -> None:
        node.cont = None
        if not node.dead:
            with contextlib.suppress(ProcessLookupError):
                os.kill(node.pid, signal.SIGCONT)

    def _pick(self) -> Node | None:
        now = asyncio.get_running_loop().time()
        up = [n for n in self.pool if n is not None and n.up(now)]
        if not up:
            return None
        # by transfers in flight, not blocks held: a fresh replacement must not draw the whole window
        least = min(n.active for n in up)
        return self.pick_rng.choice([n for n in up if n.active == least])

    def _watch_nodes(self) -> None:
        for node in list(self.pool) + [self.refuse_node]:
            if node is not None and not node.dead and node.proc.proc.poll() is not None:
                self.unexpected_deaths.append({"slot": node.slot, "refuse": node.refuse,
                                               "rc": node.proc.proc.returncode,
                                               "stderr": node.proc.stderr_text()[-1500:]})
                self._node_gone(node)
