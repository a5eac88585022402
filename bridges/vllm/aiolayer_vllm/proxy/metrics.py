"""The proxy's ``/metrics``: request outcomes and stage latencies, through prometheus_client.

Each app has its own ``CollectorRegistry`` (never the process-global one), so several proxies in one
process do not clash. The gauges (pending transfers, each backend's load and health) are read from
the proxy's state when scraped.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

# from a local CPU engine's milliseconds to a queued long prompt's minutes
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# the classic text format every Prometheus reads (the newest client's default names 1.0.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _StateGauges(Collector):
    """Gauges read from the proxy's state at scrape time."""

    def __init__(self, state) -> None:
        self.state = state

    def collect(self):
        pending = GaugeMetricFamily("aiolayer_proxy_pending_transfers",
                                    "Requests the proxy is serving now (transfers in its table)")
        pending.add_metric([], len(self.state.pending))
        outstanding = GaugeMetricFamily("aiolayer_proxy_backend_outstanding",
                                        "Requests each backend is working on (its lease count)", labels=["role", "url"])
        healthy = GaugeMetricFamily("aiolayer_proxy_backend_healthy",
                                    "1 while the backend passes its health check, else 0", labels=["role", "url"])
        for b in self.state.pool.all:
            outstanding.add_metric([b.role, b.url], b.outstanding)
            healthy.add_metric([b.role, b.url], int(b.healthy))
        return [pending, outstanding, healthy]


class ProxyMetrics:
    def __init__(self, state) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("aiolayer_proxy_requests", "Requests by how they ended: ok, or the error type "
                                "the client got (client_disconnect when it left first)", ["outcome"], registry=r)
        self.bindings = Counter("aiolayer_proxy_bindings", "Requests by how P learned D's blocks: late (P and D "
                                "sent the request at once) or d_first (P sent it once D registered)", ["binding"],
                                registry=r)
        self.routes = Counter("aiolayer_proxy_routes", "Requests by where their prompt was prefilled: remote "
                              "(P, its KV sent to D) or local (D itself: --local-prefill-max-tokens)", ["route"],
                              registry=r)
        self.rejected_registrations = Counter("aiolayer_proxy_rejected_registrations",
                                              "D registrations refused for a wrong token", registry=r)
        self.ttft = Histogram("aiolayer_proxy_time_to_first_token_seconds",
                              "Streams: from the proxy taking the request to D's first token", buckets=BUCKETS,
                              registry=r)
        self.registration = Histogram("aiolayer_proxy_registration_seconds", "From the proxy taking the request "
                                      "to D registering its transfer (D queued it, allocated its blocks)",
                                      buckets=BUCKETS, registry=r)
        self.prefill = Histogram("aiolayer_proxy_prefill_seconds", "P's prefill call, from D's registration "
                                 "to P's answer (successful ones)", buckets=BUCKETS, registry=r)
        self.relay = Histogram("aiolayer_proxy_relay_seconds", "Streams: from D's first token relayed to the "
                               "stream's end", buckets=BUCKETS, registry=r)
        self.request = Histogram("aiolayer_proxy_request_seconds", "Whole requests, from the proxy taking them "
                                 "to their last byte (failed ones too)", buckets=BUCKETS, registry=r)
        r.register(_StateGauges(state))

    def stage(self, stage: str, seconds: float) -> None:
        """An exchange reached ``stage`` ``seconds`` after the proxy took it."""
        if stage == "registered":
            self.registration.observe(seconds)
        elif stage == "first_chunk":
            self.ttft.observe(seconds)

    def text(self) -> bytes:
        return generate_latest(self.registry)
