"""aiolayer's figures in vLLM's connector stats: the worker's deltas per interval, and their Prometheus metrics.

Each worker reports what changed since its last report (bytes, transfers by outcome, refusals,
deadline expiries) plus the current queue depths and the interval's worst hand-off bucket. vLLM
ships the stats to its logger process, aggregates them across workers (``aggregate``) and hands
them to ``AiolayerPromMetrics.observe``, which feeds vLLM's own ``/metrics``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

# counted since the last report: summed across workers and intervals
COUNTERS = ("bytes_sent", "bytes_received", "sends_finished", "sends_failed", "receives_finished",
            "receives_failed", "control_rejected", "deadline_expiries", "integrity_verified", "integrity_mismatch",
            "fence_timeouts", "fences_unconfirmed")
# levels: the worst across workers
GAUGES = ("bridge_depth", "sending", "receiving", "writes_in_flight", "handoff_p99_s")


def totals(snap: dict) -> dict[str, float]:
    """The connector's figures from a runtime metrics snapshot (aiolayer.runtime.metrics.snapshot)."""
    transfers = snap["transfers"]
    p99 = snap["handoff_p99_s"]
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
        "bridge_depth": snap["queues"]["bridge"], "sending": snap["queues"]["sending"],
        "receiving": snap["queues"]["receiving"], "writes_in_flight": snap["queues"]["writes_in_flight"],
        "handoff_p99_s": p99 if p99 != float("inf") else 1.0,   # beyond the last bucket: at least 1 s
    }


def delta(now: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: (now[k] - before.get(k, 0) if k in COUNTERS else now[k]) for k in (*COUNTERS, *GAUGES)}


@dataclass
class AiolayerStats(KVConnectorStats):
    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {k: 0 for k in (*COUNTERS, *GAUGES)}

    def aggregate(self, other: KVConnectorStats) -> "AiolayerStats":
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v if k in COUNTERS else max(self.data.get(k, 0), v)
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in COUNTERS)


class AiolayerPromMetrics(KVConnectorPromMetrics):
    """``vllm:aiolayer_*`` counters and gauges, one series per engine."""

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

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            per_engine = self._metrics.get(name)
            if per_engine is None:
                continue
            if name in COUNTERS:
                if value > 0:
                    per_engine[engine_idx].inc(value)
            else:
                per_engine[engine_idx].set(value)
