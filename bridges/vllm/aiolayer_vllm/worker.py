"""The worker side (model-runner thread): hands steps and layers to aiolayer and reports results.

It owns its rank's aiolayer ``Runtime`` (started with the KV caches; one per TP/DP rank, see ``ranks``)
and uses only its public, thread-safe API. Every call here returns at once: ``save_kv_layer`` hands a layer to the step,
``wait_for_save`` does no network I/O, and D's registrations are handed to the runtime's loop
(``Runtime.receive``). Results come back from thread-safe queues in ``transfer_results``.
Nothing here raises for one request (vLLM would take the engine down): a request that cannot be
served fails alone, logged (D: failed_recving; P: not sent, its blocks handed back when finished).
"""

from __future__ import annotations

import collections
import functools
import logging
from collections.abc import Mapping
from typing import Any

import msgspec

from aiolayer import ReceiveSpec, Registration, Runtime, RuntimeStateError, Step
from aiolayer.faults import install_hooks

from .config import BridgeConfig
from .debug import corrupter, zero_blocks
from .draft import draft_layers
from .identity import identity
from .layout import describe
from .metadata import AiolayerMetadata, RecvReq
from .modes import AiolayerWorkerMeta, SendFiguresOut
from .publish import RegistrationPublisher
from .ranks import Topology, rank_transfer_id, writers_of_d
from .sends import SendBook
from .stats import AiolayerStats, Observations, delta, totals
from .threads import unpinned
from .timeline import p_stages, stage
from .wake import Waker

log = logging.getLogger(__name__)


class WorkerSide:
    def __init__(self, config: BridgeConfig, is_producer: bool, is_consumer: bool, num_blocks: int,
                 topology: Topology | None = None, block_size: int = 16, head_size: int = 64,
                 engine_core_pid: int | None = None, model_facts: dict | None = None,
                 cpu_kernel: str | None = None, draft_start: int | None = None) -> None:
        self.config = config
        self.topology = topology or Topology()
        self.model_facts = dict(model_facts or {})   # identity.model_facts: the model's part of the fingerprint
        self.num_blocks = num_blocks
        self.block_size, self.head_size = block_size, head_size
        self.cpu_kernel = cpu_kernel     # vLLM CPU's attention kernel: what a block holds token by token
        self.draft_start = draft_start   # the drafter's first layer number (``draft``); None: no drafter KV
        self._draft: tuple[int, ...] = ()   # its runtime layers: handed over when the step ends
        self.is_producer = is_producer
        self.is_consumer = is_consumer
        self.runtime: Runtime | None = None
        self.layer_index: dict[str, int] = {}
        self._views: Mapping[str, tuple[Any, ...]] = {}
        self._active_step: Step | None = None
        self._handed = bytearray()                        # P: the active step's layers handed over (1 each)
        self._to_hand = 0                                 # P: ... of its layers still to come (the drafter's aside)
        self._recv_of: dict[str, tuple[str, list[int]]] = {}   # D: transfer id -> (request id, its blocks)
        # D: (transfer id, reason, (request id, blocks) or None = look up the transfer id), any thread
        self._recv_failures: collections.deque = collections.deque()
        self._sends = SendBook(self.topology, lambda: self._rt)   # P: its sends' requests, their blocks' release
        self._reported: dict[str, float] = {}             # the totals of the last stats report
        self._publisher = RegistrationPublisher(self.topology)   # D: one HTTP client for every registration
        self._timings = Observations()                    # timings (and refusals) since then
        self._figures = SendFiguresOut() if config.transfer_mode == "auto" else None   # for the scheduler
        self._step_tids: list[str] = []                   # P: the transfers of the step being saved (timeline)
        # D: wakes the scheduler side's parked wait as a receive ends (``wake``); None: it never waits
        self._waker = Waker(engine_core_pid, config.node.engine_id) \
            if is_consumer and engine_core_pid is not None else None

    @property
    def _rt(self) -> Runtime:
        """The rank's runtime, once ``register_kv_caches`` started it."""
        if self.runtime is None:
            raise RuntimeStateError("aiolayer: no runtime before the KV caches are registered")
        return self.runtime

    # --- set-up --------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict) -> None:
        """Start this rank's runtime (its own endpoint, ``ranks``) and publish its caches with their
        head geometry (``layout``), so that engines of another TP size can write head slices. The
        runtime answers topology queries with this rank's identity (``identity``) from its start."""
        topo, node = self.topology, self.config.node
        layout = describe(kv_caches, self.num_blocks, self.block_size, self.head_size, topo.local_heads(), topo.mla,
                          cpu_kernel=self.cpu_kernel)
        self._views = layout.views
        self.layer_index = {name: i for i, name in enumerate(layout.names)}
        self._draft = draft_layers(layout.names, self.draft_start)
        node = msgspec.structs.replace(node, engine_id=topo.engine_id(node.engine_id),
                                       control_port=topo.control_port(node.control_port))
        # the block size is in model_facts only where blocks pair block for block (connector.group_facts)
        facts = {**self.model_facts, "layers": len(layout.names),
                 "head_size": self.head_size, "total_kv_heads": topo.total_kv_heads, "mla": topo.mla,
                 "cache_tensor_dtype": str(next(iter(layout.views.values()))[0].dtype)}
        with unpinned():   # the loop and Mooncake's threads must not share the forward's pinned core
            runtime = Runtime(node, self.config.timeouts)
            if self.config.debug_corrupt_received:
                install_hooks(runtime, inbound_filter=corrupter(self._views, layout.names, self._blocks_of))
            runtime.set_identity(identity(topo, self.is_producer, self.is_consumer, facts))
            self.runtime = runtime.start()
        self.runtime.on_stop(self._close_on_loop)
        if self._waker is not None:
            self.runtime.on_outcome(self._waker.wake)
        try:
            layout.register(self.runtime)
        except BaseException:
            self.runtime.stop()
            raise
        log.info("aiolayer %s: %d layers, %d blocks of %d bytes (%s), control %s", node.engine_id,
                 len(layout.names), layout.num_blocks, layout.block_bytes, layout.kind, self.runtime.control_endpoint)

    # --- per step (model-runner thread) ----------------------------------------------------------

    def bind(self, meta: AiolayerMetadata) -> None:
        for req_id, _tid in meta.cancels:
            self._sends.cancel(req_id)
        for recv in meta.recvs:
            if self._track_recv(recv):
                self._receive(recv)
        for _req_id, tid in meta.aborts:
            tid = self._rank_tid(tid)
            try:
                self._rt.abort_receive(tid, "request aborted at D")
            except Exception:  # the runtime is gone: the transfer ends with it
                log.exception("transfer %s: abort not handed over", tid)
        if meta.sends:
            self._begin_sends(meta.sends)

    def _blocks_of(self, transfer_id: str) -> list[int] | None:
        owner = self._recv_of.get(transfer_id)
        return None if owner is None else owner[1]

    def _rank_tid(self, transfer_id: str) -> str:
        return rank_transfer_id(transfer_id, self.topology.tp_rank, self.topology.tp_size)

    def _receive(self, recv: RecvReq) -> None:
        """D: register before anything is published; a refused registration fails the request alone.

        This rank waits for every P rank that writes into it (``ranks.writers_of_d``); its fence asks
        the P ranks that actually reached the transfer (whichever DP rank ran the request), never an
        endpoint named in the request."""
        tid = self._rank_tid(recv.transfer_id)
        try:
            params = recv.params
            writers = writers_of_d(self.topology, params.prefill_tp)
            spec = ReceiveSpec(transfer_id=tid, block_ids=recv.block_ids, token=params.token,
                               first_block=recv.first_block, senders=len(writers))
            announce = functools.partial(self._publish, url=params.notify_url, transfer_id=params.transfer_id) \
                if params.notify_url else None
            stage(tid, "d_bound")
            self._rt.receive(spec, announce)
        except Exception as exc:  # noqa: BLE001 - a bad spec or a stopped runtime: this request fails
            log.error("transfer %s: not registered: %s", tid, exc)
            self._recv_failures.append((tid, f"not registered: {type(exc).__name__}: {exc}", None))

    def _track_recv(self, recv: RecvReq) -> bool:
        """D: map the transfer to its request; a second request for a live transfer id fails alone."""
        tid = self._rank_tid(recv.transfer_id)
        other = self._recv_of.get(tid)
        if other is not None:
            reason = f"transfer {tid} is already received by request {other[0]}"
            self._recv_failures.append((tid, reason, (recv.req_id, recv.written)))
            return False
        self._recv_of[tid] = (recv.req_id, recv.written)
        return True

    def _begin_sends(self, sends) -> None:
        """P: one step's sends (``SendBook.plan``) begin as one step of the runtime."""
        specs = self._sends.plan(sends)
        if not specs:
            return
        try:
            self._active_step = self._rt.begin_step(specs)
            self._handed = bytearray(len(self.layer_index))
            self._to_hand = len(self.layer_index) - len(self._draft)
            self._step_tids = [spec.transfer_id for spec in specs]
        except Exception as exc:  # noqa: BLE001 - refused before anything was queued: no write started
            log.error("aiolayer: %d transfers not sent: %s", len(specs), exc)
            for spec in specs:
                self._sends.quiet(spec.transfer_id)

    async def _publish(self, reg: Registration, url: str, transfer_id: str) -> None:
        """D's announce: the registration to the proxy (``publish``); raising gives the transfer up."""
        await self._publisher.publish(reg, url, transfer_id, self._rt.timeouts)
        stage(reg.transfer_id, "d_published")

    async def _close_on_loop(self) -> None:
        if self._waker is not None:
            self._waker.close()   # on the loop, its only thread
        await self._publisher.close()

    def save_kv_layer(self, layer_name: str) -> None:
        """P: ``layer_name``'s KV is written (vLLM's cache update, or the layer's end): hand it over, once."""
        layer = self.layer_index.get(layer_name)
        if self._active_step is None or layer is None or layer in self._draft or self._handed[layer]:
            return   # no send this step, a layer not transferred, the drafter's (at the end), or handed already
        self._handed[layer] = 1
        self._to_hand -= 1
        try:
            self._active_step.layer_ready(layer)
            if not self._draft and not self._to_hand:   # the step's last layer: its write starts now
                self._end_step()
        except Exception:  # the runtime is gone: its sends fail by their own deadlines
            log.exception("aiolayer: layer %s not handed over", layer_name)
            self._active_step = None

    def _end_step(self) -> None:
        """Close the active step (``Step.end`` wakes the loop: its last layer's write starts now)."""
        step, self._active_step = self._active_step, None
        for tid in self._step_tids:
            stage(tid, "p_last_layer")
        self._step_tids = []
        if step is not None:
            step.end()

    def wait_for_save(self) -> None:
        step = self._active_step
        if step is not None:   # a step whose last layer was not handed over yet (a drafter's come now)
            try:
                # the drafter ran all its passes, and every kernel of the step was launched: every layer is
                # final, one never handed too (a drafter vLLM skipped this step): late, not a failed send
                for layer in [i for i, handed in enumerate(self._handed) if not handed]:
                    step.layer_ready(layer)
                self._end_step()
            except Exception:  # as in save_kv_layer
                log.exception("aiolayer: step %d not closed", step.id)
                self._active_step, self._step_tids = None, []

    # --- results --------------------------------------------------------------------------------

    def transfer_results(self, finished_req_ids) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) for this pass."""
        recving: set[str] = set()
        failed: set[str] = set()
        if self.runtime is None:
            return set(), recving, failed
        for outcome in self.runtime.pop_outcomes():
            self._timings.sent(outcome)
            p_stages(outcome)
            if self._figures is not None:
                self._figures.add(self._sends.request_of(outcome.transfer_id), outcome)
            if not outcome.ok:
                log.warning("aiolayer transfer %s failed: %s", outcome.transfer_id, outcome.reason)
        for tid in self.runtime.pop_released():
            self._sends.quiet(tid)
        sending = self._sends.finished_sending(finished_req_ids)
        for result in self.runtime.pop_received():
            self._timings.received(result)
            stage(result.transfer_id, "d_done", result.finished_s)
            stage(result.transfer_id, "d_reported")
            self._record_received(self._recv_of.pop(result.transfer_id, None), result.transfer_id, result.ok,
                                  result.reason, recving, failed)
        while self._recv_failures:
            tid, reason, owner = self._recv_failures.popleft()
            self._timings.refused += 1   # never reached the runtime: no receive there counts it
            owner = owner if owner is not None else self._recv_of.pop(tid, None)
            self._record_received(owner, tid, False, reason, recving, failed)
        return sending, recving, failed

    def _record_received(self, owner: tuple[str, list[int]] | None, tid: str, ok: bool, reason: str,
                         recving: set, failed: set) -> None:
        if owner is None:
            return
        req_id, blocks = owner
        recving.add(req_id)   # failed receives are reported as finished too (vLLM's contract)
        if not ok:
            failed.add(req_id)
            log.warning("aiolayer receive %s (request %s) failed: %s", tid, req_id, reason)
        elif self.config.debug_zero_received:
            zero_blocks(self._views, blocks)

    def worker_meta(self) -> AiolayerWorkerMeta | None:
        """P, ``transfer_mode`` auto: the figures of the sends finished since the last step (``modes.py``)."""
        return self._figures.take() if self._figures is not None else None

    def stats(self) -> AiolayerStats | None:
        """What changed since the last report (None: nothing), read without waiting for the loop.

        vLLM asks after every step. The figures are the snapshot the loop last published (read whole:
        walking the loop's own dicts from this thread can raise); a count the loop has not published
        yet comes with a later report.
        """
        runtime = self.runtime
        snap = None if runtime is None else runtime.published_metrics
        if snap is None:
            return None
        current = totals(snap)
        stats = AiolayerStats(data=self._timings.into(delta(current, self._reported)))
        self._reported = current
        return None if stats.is_empty() else stats

    def shutdown(self) -> None:
        """Never raises: vLLM's worker shutdown calls it with no guard, and the rest of its own clean-up
        (the EC transfer, the profiler) comes after it."""
        runtime, self.runtime = self.runtime, None
        if runtime is not None:
            try:
                runtime.stop()
            except Exception:   # logged: a stop past its deadline must not skip vLLM's clean-up
                log.exception("aiolayer: runtime stop incomplete at shutdown")
