"""``transfer_mode``: how P sends each request's KV (layer-wise, bulk, or chosen per request: ``auto``).

With ``auto`` the scheduler asks ``aiolayer.protocol.mode.ModeChooser`` before each send and feeds it
what each finished send measured. The measurements come from P's workers: each finished send's
per-layer times, reduced to a few numbers (``SendFigures``), travel back with vLLM's worker-to-scheduler
metadata (``build_connector_worker_meta``, aggregated across workers by vLLM), and the scheduler joins
them to what it chose for that request. A request that names its own mode (``SendParams.transfer_mode``,
the proxy's ``x-aiolayer-transfer-mode`` header) is sent that way whatever the engine's mode. Nothing here
waits or does I/O.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aiolayer.protocol.mode import BULK, LAYERWISE, ModeChooser, SendMeasure, measured, step_bucket
from aiolayer.protocol.plan import use_layerwise

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata

if TYPE_CHECKING:
    from aiolayer import Outcome

log = logging.getLogger(__name__)
MAX_PENDING = 4096     # figures a worker keeps until the scheduler takes them, and choices remembered


@dataclass(frozen=True)
class SendFigures:
    """One finished send of a worker, reduced (``aiolayer.protocol.mode.measured``)."""

    req_id: str
    window_s: float
    tail_s: float
    busy_s: float
    nbytes: int
    layers: int


@dataclass
class AiolayerWorkerMeta(KVConnectorWorkerMetadata):
    """What P's workers measured since their last step, for the scheduler's ``auto`` mode."""

    sends: list[SendFigures] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, AiolayerWorkerMeta):
            return AiolayerWorkerMeta(self.sends + other.sends)
        return self


class SendFiguresOut:
    """Worker side: each finished send's figures, until the next ``take`` (bounded: a scheduler that
    never reads them costs nothing but the newest ``MAX_PENDING``)."""

    def __init__(self) -> None:
        self._pending: collections.deque[SendFigures] = collections.deque(maxlen=MAX_PENDING)

    def add(self, req_id: str | None, outcome: Outcome) -> None:
        if req_id is None or not outcome.ok or not outcome.layers:
            return
        window, tail, busy, layers = measured(outcome.layers, outcome.finished_s)
        self._pending.append(SendFigures(req_id, window, tail, busy, outcome.bytes, layers))

    def take(self) -> AiolayerWorkerMeta | None:
        if not self._pending:
            return None
        out = AiolayerWorkerMeta(list(self._pending))
        self._pending.clear()
        return out


@dataclass(frozen=True)
class _Chosen:
    mode: str
    step_tokens: int
    prompt_tokens: int
    dest: str


class ModePolicy:
    """Scheduler side: a request's mode, and (``auto``) the measurements that choose the next ones."""

    def __init__(self, transfer_mode: str, layerwise_min_tokens: int) -> None:
        self.transfer_mode = transfer_mode
        self.layerwise_min_tokens = layerwise_min_tokens
        self.chooser = ModeChooser() if transfer_mode == "auto" else None
        self._chosen: collections.OrderedDict[str, _Chosen] = collections.OrderedDict()
        self._last: dict[int, str] = {}    # step bucket -> the mode chosen last: a change is logged

    def layerwise(self, req_id: str, *, step_tokens: int, prompt_tokens: int, dest: str, requested: str = "") -> bool:
        """Whether this send goes layer-wise. ``requested`` (the request's own ``transfer_mode``) wins; such a
        send is not auto's choice, so its figures are not observed: auto chooses alike whatever other
        clients ask for."""
        if requested:
            log.debug("request %s: %s (asked for by the request)", req_id, requested)
            return requested == LAYERWISE
        if self.chooser is None:
            if self.transfer_mode == BULK:
                return False
            return use_layerwise(prompt_tokens, self.layerwise_min_tokens)
        choice = self.chooser.choose(step_tokens=step_tokens, prompt_tokens=prompt_tokens, dest=dest)
        predicted = {k: round(v * 1e3, 1) for k, v in choice.predicted_s.items()} or "-"
        log.debug("request %s: %s (%s; predicted ms %s)", req_id, choice.mode, choice.why, predicted)
        bucket = step_bucket(step_tokens)
        if self._last.get(bucket) != choice.mode:   # rare once the estimates settle: worth a line
            self._last[bucket] = choice.mode
            log.info("aiolayer transfer mode for steps of up to %d tokens: %s (%s; predicted ms %s)",
                     1 << bucket, choice.mode, choice.why, predicted)
        self._chosen[req_id] = _Chosen(choice.mode, step_tokens, prompt_tokens, dest)
        while len(self._chosen) > MAX_PENDING:
            self._chosen.popitem(last=False)
        return choice.mode == LAYERWISE

    def observe(self, meta: object) -> None:
        """The workers' figures (vLLM's aggregated ``kv_connector_worker_meta``) into the estimates; a
        request's every worker's send is one sample each. Figures of a request not chosen here: ignored."""
        if self.chooser is None or not isinstance(meta, AiolayerWorkerMeta):
            return
        for fig in meta.sends:
            chosen = self._chosen.get(fig.req_id)
            if chosen is None:
                continue
            self.chooser.observe(SendMeasure(
                mode=chosen.mode, step_tokens=chosen.step_tokens, prompt_tokens=chosen.prompt_tokens,
                dest=chosen.dest, window_s=fig.window_s, tail_s=fig.tail_s, busy_s=fig.busy_s,
                nbytes=fig.nbytes, layers=fig.layers))
        log.debug("transfer mode estimates: %s", self.chooser.snapshot())
