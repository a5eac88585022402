"""aiolayer's figures in vLLM's connector stats: the worker's deltas per interval, and their Prometheus metrics.

Each worker reports what changed since its last report (bytes, transfers by outcome, refusals,
deadline expiries) plus the current queue depths and the interval's worst hand-off bucket, and the
interval's timings (``Observations``: each finished transfer's duration, each layer's landing), as
lists of seconds like vLLM's own connectors ship them. vLLM ships the stats to its logger process,
aggregates them across workers (``aggregate``: counters add, levels take the worst, timings join)
and hands them to ``AiolayerPromMetrics.observe``, which feeds vLLM's own ``/metrics``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

if TYPE_CHECKING:
    from aiolayer import Outcome, Received

# the runtime's causes of a failed receive (aiolayer.runtime.receive.receiver.FAILURE_CAUSES), less "refused"
FAILURE_CAUSES = ("deadline", "aborted", "prefill_failed")

# counted since the last report: summed across workers and intervals
COUNTERS = ("bytes_sent", "bytes_received", "sends_finished", "sends_failed", "receives_finished",
            "receives_failed", "control_rejected", "deadline_expiries", "integrity_verified", "integrity_mismatch",
            "fence_timeouts", "fences_unconfirmed", *(f"receives_failed_{c}" for c in FAILURE_CAUSES),
            "receives_refused", "timings_dropped", "sends_layerwise", "sends_bulk")
# levels: the worst across workers
GAUGES = ("bridge_depth", "sending", "receiving", "writes_in_flight", "handoff_p99_s")
_TRANSFER_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# observed this interval, in seconds: joined across workers, each one a Prometheus histogram observation
HISTOGRAMS = {
    "send_seconds": (
        "a finished send (P, one per rank's transfer): the forward handed its first layer -> D's verdict on DONE",
        _TRANSFER_BUCKETS),
    "receive_seconds": (
        "a finished receive (D, one per rank's transfer): registered -> P's DONE accepted (all layers landed)",
        _TRANSFER_BUCKETS),
    "layer_landing_seconds": (
        "per layer of a finished send, seen by its writer (P): the forward handed the layer -> its write "
        "completed in D's memory (D sees no single layer land: the writes are one-sided)",
        (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)),
}
MAX_OBSERVATIONS = 8192   # per histogram and report: a worker whose stats nobody reads stays bounded


def totals(snap: dict) -> dict[str, float]:
    """The connector's figures from a runtime metrics snapshot (aiolayer.runtime.metrics.snapshot)."""
    transfers = snap["transfers"]
    p99 = snap["handoff_p99_s"]
    failures = snap.get("receive_failures", {})
    return {
        "bytes_sent": snap["bytes_sent"], "bytes_received": snap["bytes_received"],
        "sends_finished": transfers.get(("send", "finished"), 0), "sends_failed": transfers.get(("send", "failed"), 0),
        "receives_finished": transfers.get(("receive", "finished"), 0),
        "receives_failed": transfers.get(("receive", "failed"), 0),
        "control_rejected": sum(snap["rejected"].values()), "deadline_expiries": sum(snap["deadlines"].values()),
        "integrity_verified": snap["integrity"].get("verified", 0),
        "integrity_mismatch": snap["integrity"].get("mismatch", 0),
        # a release not on its writer's word: P's writes unresolved past the quarantine, D's fence on the grace
        "fence_timeouts": snap["fence_timeouts"], "fences_unconfirmed": snap.get("fences_unconfirmed", 0),
        # D: receives_failed by cause (receiver.FAILURE_CAUSES); a refused registration is no receive
        **{f"receives_failed_{c}": failures.get(c, 0) for c in FAILURE_CAUSES},
        "receives_refused": failures.get("refused", 0),
        "timings_dropped": 0,   # the worker's own (Observations.into): past MAX_OBSERVATIONS per report
        "sends_layerwise": 0, "sends_bulk": 0,   # the worker's own too: finished sends by mode
        "bridge_depth": snap["queues"]["bridge"], "sending": snap["queues"]["sending"],
        "receiving": snap["queues"]["receiving"], "writes_in_flight": snap["queues"]["writes_in_flight"],
        "handoff_p99_s": p99 if p99 != float("inf") else 1.0,   # beyond the last bucket: at least 1 s
    }


def delta(now: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: (now[k] - before.get(k, 0) if k in COUNTERS else now[k]) for k in (*COUNTERS, *GAUGES)}


class Observations:
    """The timings of the transfers a worker saw end since its last report (model-runner thread), and
    the receives it failed itself before its runtime saw them (a bad spec, a transfer id already live)."""

    def __init__(self) -> None:
        self.taken: dict[str, list[float]] = {name: [] for name in HISTOGRAMS}
        self.dropped = 0
        self.refused = 0
        self.modes = {"sends_layerwise": 0, "sends_bulk": 0}   # finished sends by how they went

    def _add(self, name: str, seconds: float) -> None:
        if len(self.taken[name]) < MAX_OBSERVATIONS:
            self.taken[name].append(max(0.0, seconds))
        else:
            self.dropped += 1

    def sent(self, outcome: Outcome) -> None:
        if not outcome.ok or not outcome.layers:
            return
        self.modes["sends_layerwise" if outcome.layerwise else "sends_bulk"] += 1
        self._add("send_seconds", outcome.finished_s - min(t.handed_s for t in outcome.layers))
        for t in outcome.layers:
            self._add("layer_landing_seconds", t.landed_s - t.handed_s)

    def received(self, result: Received) -> None:
        if result.ok and result.registered_s:
            self._add("receive_seconds", result.finished_s - result.registered_s)

    def into(self, data: dict[str, Any]) -> dict[str, Any]:
        """``data`` with the interval's observations (the non-empty ones) and refusals; a fresh interval."""
        data.update((name, values) for name, values in self.taken.items() if values)
        data["receives_refused"] = data.get("receives_refused", 0) + self.refused
        data["timings_dropped"] = data.get("timings_dropped", 0) + self.dropped   # the histograms under-count
        for name, count in self.modes.items():
            data[name] = data.get(name, 0) + count
        self.modes = dict.fromkeys(self.modes, 0)
        self.taken = {name: [] for name in HISTOGRAMS}
        self.refused = self.dropped = 0
        return data


@dataclass
class AiolayerStats(KVConnectorStats):
    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        fresh: dict[str, Any] = {k: 0 for k in (*COUNTERS, *GAUGES)}
        self.data = fresh

    def aggregate(self, other: KVConnectorStats) -> "AiolayerStats":
        for k, v in other.data.items():
            if k in HISTOGRAMS:
                joined: list[float] = [*self.data.get(k, ()), *v]
                self.data[k] = joined
            else:
                self.data[k] = self.data.get(k, 0) + v if k in COUNTERS else max(self.data.get(k, 0), v)
        return self

    def reduce(self) -> dict[str, int | float]:
        """For vLLM's log line: the figures, and each timing's count and mean."""
        out: dict[str, int | float] = {k: v for k, v in self.data.items() if k not in HISTOGRAMS}
        for name in HISTOGRAMS:
            values: list[float] = self.data.get(name) or []
            out[f"{name}_count"] = len(values)
            if values:
                out[f"{name}_mean"] = round(sum(values) / len(values), 6)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in (*COUNTERS, *HISTOGRAMS))


class AiolayerPromMetrics(KVConnectorPromMetrics):
    """``vllm:aiolayer_*`` counters, gauges and histograms, one series per engine."""

    def __init__(self, vllm_config, metric_types, labelnames: list[str], per_engine_labelvalues) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        from vllm.v1.metrics.utils import create_metric_per_engine

        self._metrics: dict[str, Any] = {}
        for name in COUNTERS:
            metric = self._counter_cls(name=f"vllm:aiolayer_{name}", labelnames=labelnames,
                                       documentation=f"aiolayer {name.replace('_', ' ')}")
            self._metrics[name] = create_metric_per_engine(metric, per_engine_labelvalues)
        for name in GAUGES:
            metric = self._gauge_cls(name=f"vllm:aiolayer_{name}", labelnames=labelnames,
                                     documentation=f"aiolayer {name.replace('_', ' ')}",
                                     multiprocess_mode="mostrecent")
            self._metrics[name] = create_metric_per_engine(metric, per_engine_labelvalues)
        for name, (doc, buckets) in HISTOGRAMS.items():
            metric = self._histogram_cls(name=f"vllm:aiolayer_{name}", labelnames=labelnames,
                                         documentation=f"aiolayer: {doc}", buckets=list(buckets))
            self._metrics[name] = create_metric_per_engine(metric, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            per_engine = self._metrics.get(name)
            if per_engine is None:
                continue
            if name in HISTOGRAMS:
                for seconds in value:
                    per_engine[engine_idx].observe(seconds)
            elif name in COUNTERS:
                if value > 0:
                    per_engine[engine_idx].inc(value)
            else:
                per_engine[engine_idx].set(value)
