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
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from aiolayer import ReceiveSpec, Registration, Runtime, RuntimeStateError, Step, TransferSpec
from aiolayer.faults import install_hooks

from .config import BridgeConfig
from .debug import corrupter, zero_blocks
from .draft import draft_layers
from .identity import identity
from .layout import describe
from .metadata import AiolayerMetadata, RecvReq, SendReq
from .modes import AiolayerWorkerMeta, SendFiguresOut
from .publish import RegistrationPublisher
from .ranks import (Topology, rank_transfer_id, refused_d_ranks, routes_for_p, whole_blocks, writers_into,
                    writers_of_d)
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
        self._req_of: dict[str, str] = {}                 # P: (rank) transfer id -> vLLM request id
        self._open_sends: dict[str, set[str]] = {}        # P: request id -> its sends not yet quiet
        self._recv_of: dict[str, tuple[str, list[int]]] = {}   # D: transfer id -> (request id, its blocks)
        # D: (transfer id, reason, (request id, blocks) or None = look up the transfer id), any thread
        self._recv_failures: collections.deque = collections.deque()
        self._sending: set[str] = set()                   # P: request ids with a send not yet reported
        self._released: set[str] = set()                  # P: ... whose sends are quiet
        self._finished: set[str] = set()                  # P: ... that vLLM reported finished
        self._load_errors: set[int] = set()
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
        for req_id, tid in meta.cancels:
            self._cancel(req_id, tid)
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
        """P: one step's sends; one that cannot start is logged and its blocks handed back."""
        specs = []
        for send in sends:
            self._sending.add(send.req_id)
            planned, d_tp = send.params.prefill_tp, len(send.params.decode_ranks)
            if planned and planned != self.topology.tp_size:
                reason = (f"P has tensor-parallel size {self.topology.tp_size} but the request was planned for "
                          f"tensor-parallel size {planned} (prefill_tp): not sent")
                self._refuse_send(send, reason, functools.partial(refused_d_ranks, self.topology, planned, d_tp))
                continue
            if send.refused:   # e.g. P's and D's KV cache groups disagree
                self._refuse_send(send, send.refused, functools.partial(self._d_ranks_written, d_tp))
                continue
            try:
                mine = self._rank_specs(send)
            except Exception as exc:  # noqa: BLE001 - one request's bad spec must not stop the step
                log.error("request %s: transfer %s not sent: %s", send.req_id, send.transfer_id, exc)
                self._released.add(send.req_id)   # nothing reads its blocks
                continue
            if not mine:   # this rank holds no head that D needs from it (replicas, MLA)
                self._released.add(send.req_id)
                continue
            self._open_sends[send.req_id] = {spec.transfer_id for spec in mine}
            self._req_of.update((spec.transfer_id, send.req_id) for spec in mine)
            specs += mine
        if not specs:
            return
        try:
            self._active_step = self._rt.begin_step(specs)
            self._handed = bytearray(len(self.layer_index))
            self._step_tids = [spec.transfer_id for spec in specs]
        except Exception as exc:  # noqa: BLE001 - refused before anything was queued: no write started
            log.error("aiolayer: %d transfers not sent: %s", len(specs), exc)
            for spec in specs:
                self._send_quiet(spec.transfer_id)

    def _d_ranks_written(self, d_tp: int) -> list[int]:
        return [route.d_rank for route in routes_for_p(self.topology, d_tp)]

    def _refuse_send(self, send: SendReq, reason: str, refused: Callable[[], list[int]]) -> None:
        """P: nothing of the request can be written, e.g. it was planned for a P of another
        tensor-parallel size (the proxy's view of us is stale: writing would leave D with heads nobody
        wrote, or waiting for ranks that do not exist), or P's and D's KV cache groups disagree. Each D
        rank ``refused()`` lists (those waiting for this rank's word) gets FAILED with the reason."""
        log.error("request %s: transfer %s: %s", send.req_id, send.transfer_id, reason)
        specs = []
        try:
            for d_rank in refused():
                spec = send.transfer_spec(d_rank)
                if spec.transfer_id not in self._req_of:   # else another request's live send: its outcome is its own
                    specs.append(spec)
        except Exception as exc:  # noqa: BLE001 - D cannot be addressed: its own deadline ends the transfer
            log.error("request %s: D not told: %s", send.req_id, exc)
            specs = []
        if not specs:
            self._released.add(send.req_id)
            return
        self._open_sends[send.req_id] = {spec.transfer_id for spec in specs}
        self._req_of.update((spec.transfer_id, send.req_id) for spec in specs)
        for spec in specs:
            try:
                self._rt.refuse_send(spec, reason)
            except Exception as exc:  # noqa: BLE001 - the runtime is gone: D's own deadline ends it
                log.error("transfer %s: refusal not handed over: %s", spec.transfer_id, exc)
                self._send_quiet(spec.transfer_id)

    def _rank_specs(self, send: SendReq) -> list[TransferSpec]:
        """This P rank's transfers of one request: one per D rank it writes (whole blocks or head slices)."""
        d_tp = len(send.params.decode_ranks)
        specs = []
        for route in routes_for_p(self.topology, d_tp):
            spec = send.transfer_spec(route.d_rank, layerwise=send.layerwise, src_from=send.src_from,
                                  route=None if whole_blocks(route, self.topology, d_tp) else route,
                                  writers=writers_into(self.topology, d_tp, route.d_rank))
            if spec.transfer_id in self._req_of:
                raise ValueError(f"transfer {spec.transfer_id} is already sent by request "
                                 f"{self._req_of[spec.transfer_id]}")
            specs.append(spec)
        return specs

    def _send_quiet(self, tid: str) -> None:
        """P: a send of ours can no longer read its blocks; its request's are free once all of them are."""
        req_id = self._req_of.pop(tid, None)
        if req_id is None:
            return
        open_sends = self._open_sends.get(req_id)
        if open_sends is not None:
            open_sends.discard(tid)
            if open_sends:
                return
            del self._open_sends[req_id]
        self._released.add(req_id)

    def _cancel(self, req_id: str, tid: str) -> None:
        """P: vLLM freed the blocks of ``req_id`` (preempted): its sends must fail, never say DONE."""
        for rank_tid in sorted(self._open_sends.get(req_id, ())):   # none: never started, or already quiet
            if self._req_of.get(rank_tid) != req_id:
                continue
            try:
                self._rt.cancel_send(rank_tid, "preempted at P: vLLM freed its blocks")
            except Exception:  # logged; the send then ends by its own deadlines
                log.exception("transfer %s: cancel failed", rank_tid)

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
        try:
            self._active_step.layer_ready(layer)
            if not self._draft and 0 not in self._handed:   # the step's last layer: its write starts now
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
                for layer in self._draft:   # the drafter ran all its passes: its layers are final
                    step.layer_ready(layer)
                self._end_step()
            except Exception:  # as in save_kv_layer
                log.exception("aiolayer: step %d not closed", step.id)
                self._active_step, self._step_tids = None, []

    # --- results --------------------------------------------------------------------------------

    def transfer_results(self, finished_req_ids) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) for this pass."""
        sending: set[str] = set()
        recving: set[str] = set()
        failed: set[str] = set()
        if self.runtime is None:
            return sending, recving, failed
        for outcome in self.runtime.pop_outcomes():
            self._timings.sent(outcome)
            p_stages(outcome)
            if self._figures is not None:
                self._figures.add(self._req_of.get(outcome.transfer_id), outcome)
            if not outcome.ok:
                log.warning("aiolayer transfer %s failed: %s", outcome.transfer_id, outcome.reason)
        for tid in self.runtime.pop_released():
            self._send_quiet(tid)
        self._finished.update(r for r in finished_req_ids if r in self._sending)   # only ours: no leak
        sending = self._released & self._finished     # vLLM wants ids it told us are finished
        self._released -= sending
        self._finished -= sending
        self._sending -= sending
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
            self._load_errors.update(blocks)
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

    def load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self.runtime is not None:
            self.runtime.stop()
            self.runtime = None
