"""Prometheus metrics for the sidecar (``prometheus_client``, a private registry per server).

Served over HTTP at ``/metrics`` only (any other path answers 404) on an optional
port (``--metrics-port``, bound to ``--metrics-addr``, default 127.0.0.1); the
sidecar logs the address it serves them on.  Every metric is listed, with its
labels and meaning, in the README's "Metrics" section.

* Gauges that mirror state (sessions live, bytes held, shared memory) are read at
  scrape time from the store and the arena pool, so they can never drift from the truth.
* Per-op counters are recorded by :meth:`Metrics.record_op`, which the session
  service calls once per applied op (``SessionService.on_op``); request counts and
  latency by :meth:`Metrics.observe`, once per answered request.
* The tokenizer caches' counters and bytes (``toktier_tokenizer_cache_*``) are read at scrape
  time from each :class:`toktier.PrefixCache`'s own ``stats()``, summed per tokenizer name (over
  namespaces and specials variants), so they cannot drift from the caches either.
* Restore at start (``toktier_state_preload_*``): the counter is recorded by the server as
  records are restored, claimed or released; the gauges (pending, held, seconds) are read at
  scrape time from the server's :class:`~toktier_sidecar.statedir.Preload` (``watch_preload``).
* The ``tokenizer`` label is a loaded tokenizer's name (bounded by what the
  sidecar serves; a name a client asks for that is not loaded is never a label).
"""

from __future__ import annotations

import logging
import platform
import socket
import threading
from socketserver import ThreadingMixIn
from typing import Any, Callable, Iterable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

import toktier
from toktier_client import protocol as P

log = logging.getLogger(__name__)

# Latency buckets from 50 µs (a cached small append) to 10 s (a multi-MB full encode).
LATENCY_BUCKETS = (5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

#: Distinct full-path reasons labelled per tokenizer; any further one is counted as "other".
#: The core's reasons are a handful of fixed sentences (one per tokenizer for "not
#: spliceable"), so this only guards the label set against a future free-form reason.
MAX_REASONS = 32

#: The only path the HTTP exporter answers.
METRICS_PATH = "/metrics"


_NO_PRELOAD = {"pending": 0, "held": 0, "held_bytes": 0, "seconds": 0.0}


class _PreloadCollector:
    """Restore at start, read at scrape time (``Preload.snapshot()``; zeros without one)."""

    def __init__(self) -> None:
        self._snapshot: Callable[[], dict] = lambda: _NO_PRELOAD

    def collect(self):
        s = self._snapshot()
        yield GaugeMetricFamily("toktier_state_preload_pending", "Session records (--state-dir) the restore at "
                                "start has still to consider (0 once it is done)", value=s["pending"])
        yield GaugeMetricFamily("toktier_state_preload_held", "Sessions restored at start and held until their "
                                "first op (not yet open)", value=s["held"])
        yield GaugeMetricFamily("toktier_state_preload_held_bytes", "Bytes those held sessions take, counted "
                                "against --memory-budget with the open sessions'", value=s["held_bytes"])
        yield GaugeMetricFamily("toktier_state_preload_seconds", "Seconds the restore at start took (so far, "
                                "while it runs)", value=s["seconds"])


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
        yield GaugeMetricFamily("toktier_conversations_live", "Conversations currently open (in the session "
                                "store, next to the sessions)", value=s.get("conversations", 0))
        conv_ended = CounterMetricFamily("toktier_conversations_ended", "Conversations ended, by cause (shutdown: "
                                         "their records are kept with --state-dir / --state-store)",
                                         labels=["cause"])
        for cause, n in s.get("conversations_ended", {}).items():
            conv_ended.add_metric([cause], n)
        yield conv_ended


CacheStats = Callable[[], Iterable[tuple[str, toktier.PrefixCacheStats]]]


class _CacheCollector:
    """The tokenizer caches (cached encodes), from their own counters at scrape time."""

    def __init__(self, cache_stats: CacheStats) -> None:
        self._cache_stats = cache_stats

    def collect(self):
        lookups = CounterMetricFamily("toktier_tokenizer_cache_lookups", "Tokenizer cache lookups of cached "
                                      "encodes, by layer and result (hit or miss; L1 is looked up after an L0 "
                                      "miss)", labels=["tokenizer", "layer", "result"])
        evictions = CounterMetricFamily("toktier_tokenizer_cache_evictions", "Tokenizer cache evictions: L0 keys "
                                        "over the entry count, L1 entries over the byte bound",
                                        labels=["tokenizer", "layer"])
        reused = CounterMetricFamily("toktier_tokenizer_cache_reused_bytes", "Text bytes whose tokens cache hits "
                                     "took from the cache", labels=["tokenizer", "layer"])
        held = GaugeMetricFamily("toktier_tokenizer_cache_bytes", "Bytes the tokenizer caches hold (L0: its keys; "
                                 "L1: the entry store both layers answer from)", labels=["tokenizer", "layer"])
        sums: dict[tuple[str, ...], list[int]] = {}  # (family, labels...) -> [value]
        for name, st in self._cache_stats():
            for (layer, result), n in st.lookups.items():
                sums.setdefault(("lookups", name, layer, result), [0])[0] += n
            for family, values in (("evictions", st.evictions), ("reused", st.reused_bytes),
                                   ("held", st.bytes_held)):
                for layer, n in values.items():
                    sums.setdefault((family, name, layer), [0])[0] += n
        families = {"lookups": lookups, "evictions": evictions, "reused": reused, "held": held}
        for (family, *labels), (n,) in sorted(sums.items()):
            families[family].add_metric(labels, n)
        yield from families.values()


class _InfoCollector:
    """``toktier_build_info``, ``toktier_tokenizer_info`` and, when the shadow verifier is off
    (it owns the gauge when on), ``toktier_shadow_sample_rate 0``."""

    def __init__(self, tokenizers: Iterable[toktier.FrozenTokenizer], verify_rate: float) -> None:
        self._tokenizers = tokenizers
        self._verify_rate = verify_rate
        self._build = {"version": toktier.__version__, "protocol": str(P.PROTOCOL_VERSION),
                       "python": platform.python_version(), "implementation": platform.python_implementation()}

    def collect(self):
        build = GaugeMetricFamily("toktier_build_info", "Always 1; the labels say which build serves",
                                  labels=list(self._build))
        build.add_metric(list(self._build.values()), 1)
        yield build
        info = GaugeMetricFamily("toktier_tokenizer_info", "Always 1 per loaded tokenizer; the labels say how it "
                                 "is served", labels=["tokenizer", "hash", "family", "engine", "spliceable", "specials"])
        for tok in self._tokenizers:
            info.add_metric([tok.name, tok.hash[:16], tok.family or "", tok.engine_label,
                             "true" if tok.spliceable else "false", tok.specials], 1)
        yield info
        if self._verify_rate <= 0:
            yield GaugeMetricFamily("toktier_shadow_sample_rate", "Fraction of served results sampled for "
                                    "verification (the configured --verify-rate)", value=0.0)


class Metrics:
    """All sidecar metrics, registered in ``self.registry``.

    ``snapshot`` returns the live state (:meth:`SessionService.snapshot`); ``tokenizers`` is the
    server's :class:`toktier.Registry` (names for labels, ``toktier_tokenizer_info``);
    ``verify_rate`` the configured shadow-verifier rate (the verifier reports it while on);
    ``cache_stats`` the tokenizer caches' (name, stats) pairs (:meth:`SessionService.cache_stats`).
    """

    def __init__(self, snapshot: Callable[[], dict], tokenizers: toktier.Registry | None = None,
                 verify_rate: float = 0.0, *, process: bool = True, cache_stats: CacheStats = list) -> None:
        self.registry = CollectorRegistry()
        self._tokenizers = tokenizers if tokenizers is not None else toktier.Registry()
        r = dict(registry=self.registry)
        self.requests = Counter("toktier_requests", "Requests answered, by op and outcome (ok or the error code)",
                                ["op", "outcome"], **r)
        self.repair_paths = Counter("toktier_repair_paths", "Session results by repair path (all tokenizers)",
                                    ["path"], **r)
        self.latency = Histogram("toktier_request_seconds", "Request latency inside the sidecar, by op and "
                                 "tokenizer", ["op", "tokenizer"], buckets=LATENCY_BUCKETS, **r)
        self.protocol_errors = Counter("toktier_protocol_errors", "Connections or frames refused, by code",
                                       ["code"], **r)
        tk = ["tokenizer"]
        self.session_ops = Counter("toktier_session_ops", "Session ops applied (opens, appends, edits, syncs), "
                                   "by tokenizer and repair path", ["tokenizer", "path"], **r)
        self.result_tokens = Counter("toktier_result_tokens", "Tokens in session op results (what a stateless "
                                     "tokenizer would have produced)", tk, **r)
        self.retokenized_tokens = Counter("toktier_retokenized_tokens", "Tokens produced by encodes during session "
                                          "ops (repair windows and full encodes)", tk, **r)
        self.reused_tokens = Counter("toktier_reused_tokens", "Result tokens served from kept state, not "
                                     "re-tokenized (result minus re-tokenized, per op)", tk, **r)
        self.result_bytes = Counter("toktier_result_bytes", "UTF-8 bytes of session text after each op", tk, **r)
        self.reused_bytes = Counter("toktier_reused_bytes", "Bytes of session text served from kept state, "
                                    "estimated per op as text bytes x reused tokens / result tokens", tk, **r)
        self.widenings = Counter("toktier_repair_widenings", "Repair-window widenings (x2 each) before a splice",
                                 tk, **r)
        self.fallbacks = Counter("toktier_full_path_fallbacks", "Ops on an open session re-tokenized in full, by "
                                 "the core's reason", ["tokenizer", "reason"], **r)
        self.state_restores = Counter("toktier_state_restore", "Session and conversation records (--state-dir, "
                                      "--state-store) an op tried to restore, by result: ok, or a miss (corrupt, foreign, stale, "
                                      "invalid, error, store_error) answered like a session that is not open",
                                      ["result"], **r)
        self.state_store_ops = Counter("toktier_state_store_ops", "Calls to the shared state store (--state-store), "
                                       "by op (get, set, delete, ping) and result (ok, miss, too_large, error, "
                                       "skipped: not tried during the backoff after an error)", ["op", "result"], **r)
        self.state_preload = Counter("toktier_state_preload_sessions", "Restore at start (--state-dir), by "
                                     "result: restored (read, verified and held), claimed (a held session's first "
                                     "op opened it: a warm repair), released (a held session dropped for open "
                                     "sessions' memory, its TTL or a Close; its record stays), skipped_budget (not "
                                     "restored: over --memory-budget or --max-sessions), raced (its first op came "
                                     "first: restored on demand); failed records count in toktier_state_restore",
                                     ["result"], **r)
        self.cache_restores = Counter("toktier_tokenizer_cache_restored_entries", "Tokenizer cache (L1) entries "
                                      "read from --state-dir at start, by result: ok, or not adopted (corrupt, "
                                      "foreign, invalid, error)", ["result"], **r)
        self.conversation_ops = Counter("toktier_conversation_ops", "Conversation ops applied, by tokenizer and op "
                                        "(conv_open, conv_append_messages, conv_set_messages, conv_append_generated, "
                                        "conv_fork, conv_rollback)", ["tokenizer", "op"], **r)
        self.conversation_drift = Counter("toktier_conversation_drifted_results", "Conversation results whose IDs "
                                          "drift from the exact re-render of their messages (sampled IDs kept "
                                          "verbatim)", tk, **r)
        self.registry.register(_StateCollector(snapshot))
        self.registry.register(_InfoCollector(self._tokenizers, verify_rate))
        self.registry.register(_CacheCollector(cache_stats))
        self._preload = _PreloadCollector()
        self.registry.register(self._preload)
        if process:
            ProcessCollector(registry=self.registry)
        self._children: dict[tuple, tuple] = {}
        self._op_children: dict[tuple, tuple] = {}
        self._reasons: dict[str, set[str]] = {}
        self._names: dict[str, str] = {}  # tokenizer name or hash -> label (loaded tokenizers only)
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None
        self.url: str | None = None

    def watch_preload(self, snapshot: Callable[[], dict]) -> None:
        """Export the restore at start's gauges (``snapshot``: :meth:`Preload.snapshot`)."""
        self._preload._snapshot = snapshot

    # -------------------------------------------------------------- recording
    def tokenizer_label(self, name_or_hash: str) -> str:
        """The label of a loaded tokenizer (its name); "" for none or one that is not loaded."""
        if not name_or_hash:
            return ""
        label = self._names.get(name_or_hash)
        if label is None:
            try:
                label = self._tokenizers.get(name_or_hash).name
            except KeyError:  # not loaded (a client's guess): never a label value
                return ""
            self._names[name_or_hash] = label
        return label

    def observe(self, op: str, outcome: str, seconds: float, path: str | None = None, tokenizer: str = "") -> None:
        """Count one answered request; ``tokenizer`` is the name or hash the reply or request
        names ("" for none).  Label children are cached: this runs on every request."""
        tok = self.tokenizer_label(tokenizer)
        key = (op, outcome, path, tok)
        children = self._children.get(key)
        if children is None:
            children = self._children[key] = (
                self.requests.labels(op, outcome), self.latency.labels(op, tok),
                self.repair_paths.labels(path) if path is not None else None,
            )
        req, lat, rep = children
        req.inc()
        lat.observe(seconds)
        if rep is not None:
            rep.inc()

    def record_op(self, tokenizer: str, path: str, tokens: int, retokenized: int, nbytes: int,
                  widenings: int = 0, reason: str | None = None) -> None:
        """Count one applied session op (any thread): its repair ``path``, the ``tokens`` and
        ``nbytes`` of its result, the tokens ``retokenized`` to produce it, and for an op that
        fell back to the full path the core's ``reason`` (None for a session start)."""
        key = (tokenizer, path)
        c = self._op_children.get(key)
        if c is None:
            c = self._op_children[key] = (
                self.session_ops.labels(tokenizer, path), self.result_tokens.labels(tokenizer),
                self.retokenized_tokens.labels(tokenizer), self.reused_tokens.labels(tokenizer),
                self.result_bytes.labels(tokenizer), self.reused_bytes.labels(tokenizer),
                self.widenings.labels(tokenizer),
            )
        ops, res_t, retok_t, reuse_t, res_b, reuse_b, widen = c
        ops.inc()
        res_t.inc(tokens)
        retok_t.inc(retokenized)
        reused = max(0, tokens - retokenized)
        if reused:
            reuse_t.inc(reused)
            reuse_b.inc(nbytes * reused // tokens)
        res_b.inc(nbytes)
        if widenings:
            widen.inc(widenings)
        if reason is not None:
            self.fallbacks.labels(tokenizer, self._reason_label(tokenizer, reason)).inc()

    def record_conversation(self, tokenizer: str, op: str, drifted: bool) -> None:
        """Count one applied conversation op (any thread); ``drifted``: its result's IDs differ
        from the exact re-render of its messages."""
        self.conversation_ops.labels(tokenizer, op).inc()
        if drifted:
            self.conversation_drift.labels(tokenizer).inc()

    def _reason_label(self, tokenizer: str, reason: str) -> str:
        seen = self._reasons.setdefault(tokenizer, set())
        if reason in seen:
            return reason
        if len(seen) >= MAX_REASONS:
            return "other"
        seen.add(reason)
        return reason

    # ------------------------------------------------------------- exporting
    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` over HTTP on ``addr:port`` (a daemon thread; 404 for any other
        path) and log the URL; returns the bound port (``port`` 0: an ephemeral one)."""
        family, addr = _best_family(addr, port)
        app = _only_metrics(make_wsgi_app(self.registry))
        server_class = type("_MetricsServer", (_ThreadingWSGIServer,), {"address_family": family})
        server = make_server(addr, port, app, server_class=server_class, handler_class=_QuietHandler)
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, name="toktier-metrics", daemon=True)
        self._thread.start()
        bound = server.server_port
        host = f"[{addr}]" if family == socket.AF_INET6 else addr
        self.url = f"http://{host}:{bound}{METRICS_PATH}"
        log.info("metrics served on %s", self.url)
        return bound

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    """A thread per scrape; worker threads never block shutdown."""

    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    """No access log line per scrape (a Prometheus server scrapes every few seconds)."""

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the stdlib's name)
        pass


def _only_metrics(app: Callable) -> Callable:
    """Wrap the exporter so that it answers ``/metrics`` and nothing else (404)."""

    def route(environ: dict, start_response: Callable) -> Iterable[bytes]:
        if environ.get("PATH_INFO", "") != METRICS_PATH:
            body = b"not found: metrics are served at /metrics\n"
            start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8"),
                                             ("Content-Length", str(len(body)))])
            return [body]
        return app(environ, start_response)

    return route


def _best_family(addr: str, port: int) -> tuple[socket.AddressFamily, str]:
    """AF_INET or AF_INET6 for ``addr`` (as ``http.server`` chooses)."""
    infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, sockaddr = infos[0]
    return family, sockaddr[0]
