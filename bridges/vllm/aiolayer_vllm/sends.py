"""P's send book (model-runner thread): which request each of this rank's sends belongs to, and when a
request's blocks are free for vLLM again.

A request may have several sends (one per D rank this P rank writes); its blocks are free once every one of
them is quiet (the runtime no longer reads them) and vLLM reported the request finished. Nothing here raises
for one request: a send that cannot start is logged and its blocks handed back.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable

from aiolayer import Runtime, TransferSpec

from .metadata import SendReq
from .ranks import Topology, refused_d_ranks, routes_for_p, whole_blocks, writers_into

log = logging.getLogger(__name__)


class SendBook:
    def __init__(self, topology: Topology, runtime: Callable[[], Runtime]) -> None:
        self.topology = topology
        self._rt = runtime                                # the rank's runtime, once started
        self._req_of: dict[str, str] = {}                 # (rank) transfer id -> vLLM request id
        self._open_sends: dict[str, set[str]] = {}        # request id -> its sends not yet quiet
        self._sending: set[str] = set()                   # request ids with a send not yet reported
        self._released: set[str] = set()                  # ... whose sends are quiet
        self._finished: set[str] = set()                  # ... that vLLM reported finished

    def request_of(self, transfer_id: str) -> str | None:
        return self._req_of.get(transfer_id)

    def plan(self, sends: Iterable[SendReq]) -> list[TransferSpec]:
        """One step's sends: the specs to begin; one that cannot start is refused or released here."""
        specs = []
        for send in sends:
            self._sending.add(send.req_id)
            planned, d_tp = send.params.prefill_tp, len(send.params.decode_ranks)
            if planned and planned != self.topology.tp_size:
                reason = (f"P has tensor-parallel size {self.topology.tp_size} but the request was planned for "
                          f"tensor-parallel size {planned} (prefill_tp): not sent")
                self._refuse(send, reason, functools.partial(refused_d_ranks, self.topology, planned, d_tp))
                continue
            if send.refused:   # e.g. P's and D's KV cache groups disagree
                self._refuse(send, send.refused, functools.partial(self._d_ranks_written, d_tp))
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
        return specs

    def _d_ranks_written(self, d_tp: int) -> list[int]:
        return [route.d_rank for route in routes_for_p(self.topology, d_tp)]

    def _refuse(self, send: SendReq, reason: str, refused: Callable[[], list[int]]) -> None:
        """Nothing of the request can be written, e.g. it was planned for a P of another tensor-parallel
        size (the proxy's view of us is stale: writing would leave D with heads nobody wrote, or waiting
        for ranks that do not exist), or P's and D's KV cache groups disagree. Each D rank ``refused()``
        lists (those waiting for this rank's word) gets FAILED with the reason."""
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
                self._rt().refuse_send(spec, reason)
            except Exception as exc:  # noqa: BLE001 - the runtime is gone: D's own deadline ends it
                log.error("transfer %s: refusal not handed over: %s", spec.transfer_id, exc)
                self.quiet(spec.transfer_id)

    def _rank_specs(self, send: SendReq) -> list[TransferSpec]:
        """This P rank's transfers of one request: one per D rank it writes (whole blocks or head slices)."""
        topo, d_tp = self.topology, len(send.params.decode_ranks)
        specs = []
        for route in routes_for_p(topo, d_tp):
            spec = send.transfer_spec(route.d_rank, layerwise=send.layerwise, src_from=send.src_from,
                                      route=None if whole_blocks(route, topo, d_tp) else route,
                                      writers=writers_into(topo, d_tp, route.d_rank))
            if spec.transfer_id in self._req_of:
                raise ValueError(f"transfer {spec.transfer_id} is already sent by request "
                                 f"{self._req_of[spec.transfer_id]}")
            specs.append(spec)
        return specs

    def quiet(self, tid: str) -> None:
        """A send of ours can no longer read its blocks; its request's are free once all of them are."""
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

    def cancel(self, req_id: str) -> None:
        """vLLM freed the blocks of ``req_id`` (preempted): its sends must fail, never say DONE."""
        for rank_tid in sorted(self._open_sends.get(req_id, ())):   # none: never started, or already quiet
            if self._req_of.get(rank_tid) != req_id:
                continue
            try:
                self._rt().cancel_send(rank_tid, "preempted at P: vLLM freed its blocks")
            except Exception:  # logged; the send then ends by its own deadlines
                log.exception("transfer %s: cancel failed", rank_tid)

    def finished_sending(self, finished_req_ids: Iterable[str]) -> set[str]:
        """The requests whose blocks vLLM may have back: finished there, and every send of theirs quiet."""
        self._finished.update(r for r in finished_req_ids if r in self._sending)   # only ours: no leak
        done = self._released & self._finished     # vLLM wants ids it told us are finished
        self._released -= done
        self._finished -= done
        self._sending -= done
        return done
