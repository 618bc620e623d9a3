"""Prometheus metrics for the sidecar (``prometheus_client``, a private registry per server).

Exposed on an optional localhost port (``--metrics-port``).  Gauges that mirror
state (sessions live, bytes held, shared memory) are read at scrape time from the
store and the arena pool, so they can never drift from the truth.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# Latency buckets from 50 µs (a cached small append) to 10 s (a multi-MB full encode).
LATENCY_BUCKETS = (5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class _StateCollector:
    """Reads live state at scrape time."""

    def __init__(self, snapshot: Callable[[], dict]) -> None:
        self._snapshot = snapshot

    def collect(self):
        s = self._snapshot()
        yield GaugeMetricFamily("toktier_sessions_live", "Sessions currently open", value=s["sessions"])
        yield GaugeMetricFamily("toktier_session_bytes_held", "Bytes held by open sessions (text + token arrays)",
                                value=s["bytes_held"])
        yield GaugeMetricFamily("toktier_shm_bytes", "Bytes of live shared-memory segments", value=s["shm_bytes"])
        yield GaugeMetricFamily("toktier_shm_segments", "Live shared-memory segments", value=s["shm_segments"])
        yield GaugeMetricFamily("toktier_connections", "Open client connections", value=s["connections"])
        ended = CounterMetricFamily("toktier_sessions_ended", "Sessions ended, by cause", labels=["cause"])
        for cause, n in s["ended"].items():
            ended.add_metric([cause], n)
        yield ended
        yield CounterMetricFamily("toktier_sessions_opened", "Sessions opened", value=s["opened"])
        yield CounterMetricFamily("toktier_session_misses", "Requests for sessions that are not open",
                                  value=s["misses"])
        routes = CounterMetricFamily("toktier_full_path_encodes", "Whole-text encodes (session starts, "
                                     "fallbacks, big windows), by where they ran", labels=["route"])
        for route, n in s["full_path"].items():
            routes.add_metric([route], n)
        yield routes
        yield CounterMetricFamily("toktier_full_path_chars", "Characters encoded by the full path",
                                  value=s["full_path_chars"])


class Metrics:
    """All sidecar metrics, registered in ``self.registry``."""

    def __init__(self, snapshot: Callable[[], dict]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("toktier_requests", "Requests by op and outcome", ["op", "outcome"],
                                registry=self.registry)
        self.repair_paths = Counter("toktier_repair_paths", "Session op results by repair path", ["path"],
                                    registry=self.registry)
        self.latency = Histogram("toktier_request_seconds", "Request latency inside the sidecar, by op", ["op"],
                                 buckets=LATENCY_BUCKETS, registry=self.registry)
        self.protocol_errors = Counter("toktier_protocol_errors", "Connections or frames refused, by code",
                                       ["code"], registry=self.registry)
        self.registry.register(_StateCollector(snapshot))
        self._children: dict[tuple, tuple] = {}
        self._server = None

    def observe(self, op: str, outcome: str, seconds: float, path: str | None = None) -> None:
        """Count one finished request (label children are cached: this runs on every op)."""
        children = self._children.get((op, outcome, path))
        if children is None:
            children = self._children[(op, outcome, path)] = (
                self.requests.labels(op, outcome), self.latency.labels(op),
                self.repair_paths.labels(path) if path is not None else None,
            )
        req, lat, rep = children
        req.inc()
        lat.observe(seconds)
        if rep is not None:
            rep.inc()

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Start the HTTP exporter (a daemon thread); returns the bound port."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        self._server = server
        return server.server_port

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
