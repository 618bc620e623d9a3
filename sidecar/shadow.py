"""The sidecar's shadow verifier: sampling, a bounded queue, one worker thread, metrics.

The check itself is the pure core :class:`toktier.verifier.Verifier`; this module
runs it in the background for the server (DESIGN §5):

* **Sampling happens once, here:** the server's dispatch asks `Shadow.sampled`
  per served result (only it knows that building a sample costs an O(N) text
  decode) and offers only the chosen ones; `offer` never samples again.
* **`offer` never blocks:** when the queue is full the sample is dropped and
  counted before it is built (``sample()`` is called only when there is room), and
  its IDs are copied (a served array may be a view that the next op overwrites).
* **A budget, so verification cannot slow other clients down:** a sample longer
  than ``max_chars`` code points is skipped (before it is built, when the caller
  says its size), and at most ``chars_per_second`` code points are checked per
  second on average (a token bucket holding up to ``max(chars_per_second,
  max_chars)``, so a sample up to ``max_chars`` is always checked eventually, however
  low the rate: a bucket smaller than a sample would silently check nothing).  The
  default, 256K code points a second (about a fifth of a core for the HF reference),
  kept another client's append P99 within 1.05x of the verifier-off figure while a 1M
  budget raised it 4.8x (``python -m bench.exact_load --part shadow``).  Re-encoding a 12M-character
  session holds a core (and the GIL) for seconds; with the budget the worker's
  share of the CPU is bounded.  Every skipped sample is counted as dropped with
  its reason: ``queue_full``, ``oversized`` or ``budget``.
* **One worker thread** drains the queue in batches (up to ``batch_size`` items or
  ``batch_window`` seconds of gathering) and calls the core per tokenizer.
* A mismatch is logged with its reproducer (`MismatchReport.to_json`), counted,
  kept in `Shadow.reports`, and with ``disable_on_mismatch`` disables the
  tokenizer's fast path (`is_disabled`) until `reenable` (SIGHUP in the server).
* Prometheus metrics ``toktier_shadow_*`` on the server's registry.

>>> import toktier
>>> from toktier_sidecar.service import Sample
>>> reg = toktier.Registry()
>>> tok = reg.load("cl100k_base")
>>> with Shadow(reg.get, ShadowConfig(rate=1.0)) as shadow:
...     shadow.sampled()
...     shadow.offer(Sample(tok.hash, "hello world", tok.encode("hello world"), {}))
...     shadow.offer(lambda: Sample(tok.hash, "hello world", [1, 2], {"request": 2}))
...     shadow.drain(30)
...     (shadow.stats.checked, shadow.stats.mismatches, shadow.reports[0].context)
True
True
True
True
(2, 1, {'request': 2})
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Union

import numpy as np

from toktier import FrozenTokenizer
from toktier.verifier import MismatchReport, Served, Verifier, VerifierConfig

if TYPE_CHECKING:
    from .service import Sample

log = logging.getLogger(__name__)

Offer = Union["Sample", Callable[[], "Sample | None"]]


@dataclass(frozen=True)
class ShadowConfig:
    """The background verifier's knobs (the server fills them from `ServerConfig`)."""

    #: Fraction of served results `Shadow.sampled` chooses, in [0, 1].
    rate: float = 0.01
    #: Seed of the sampler (None: unpredictable); tests make sampling reproducible.
    seed: int | None = None
    #: Samples waiting for the worker; beyond it, offers are dropped and counted.
    queue_size: int = 1024
    #: A check batch: at most this many samples, gathered for at most `batch_window` seconds.
    batch_size: int = 64
    batch_window: float = 0.05
    #: On a mismatch, disable the tokenizer's fast path until `Shadow.reenable`.
    disable_on_mismatch: bool = False
    #: Most recent reports kept in `Shadow.reports`.
    max_reports: int = 100
    #: Samples longer than this many code points are not checked (0: no limit).
    max_chars: int = 256 * 1024
    #: Code points checked per second on average (0: no limit); bursts up to max(this, max_chars).
    chars_per_second: int = 256 * 1024
    #: The core's reference policy.  The server's default: private cache-free references
    #: built when a tokenizer loads and never rebuilt (a build holds the GIL for up to
    #: ~0.3 s at a time, which stalled every in-flight append when it happened mid-traffic).
    verifier: VerifierConfig = field(default_factory=lambda: VerifierConfig(fresh="nocache", rebuild_every=None))

    def __post_init__(self) -> None:
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"rate must be in [0, 1], not {self.rate}")
        if self.queue_size < 1 or self.batch_size < 1 or self.max_reports < 1:
            raise ValueError("queue_size, batch_size and max_reports must be >= 1")
        if self.batch_window < 0:
            raise ValueError(f"batch_window must be >= 0, not {self.batch_window}")
        if self.max_chars < 0 or self.chars_per_second < 0:
            raise ValueError("max_chars and chars_per_second must be >= 0 (0: no limit)")


@dataclass(frozen=True)
class ShadowStats:
    """A snapshot of the background verifier's counters."""

    offered: int  # results offered (the sampler chose them)
    queued: int  # put on the queue
    dropped: int  # offered but not checked: queue full, oversized or over the budget
    checked: int  # compared with the reference
    mismatches: int
    errors: int  # unknown tokenizer or reference failure (not compared)
    rate: float
    queue_depth: int
    disabled: tuple[str, ...]  # tokenizer hashes whose fast path is disabled
    dropped_by_reason: dict[str, int] = field(default_factory=dict)  # queue_full / oversized / budget


class _Item:
    __slots__ = ("hash", "served")

    def __init__(self, h: str, served: Served) -> None:
        self.hash, self.served = h, served


_STOP = object()


class Shadow:
    """Background re-encoding of sampled served results; see the module docstring.

    `resolve` maps a tokenizer hash to its `FrozenTokenizer` (raising KeyError for
    an unknown one, e.g. ``registry.get``); `verifier` is the core (built from
    ``config.verifier`` when omitted; tests inject blocking or broken ones);
    `metrics` a prometheus_client ``CollectorRegistry``; `on_mismatch(report)` and
    `on_disable(tokenizer_hash, report)` run on the worker thread.
    """

    def __init__(self, resolve: Callable[[str], FrozenTokenizer], config: ShadowConfig = ShadowConfig(), *,
                 verifier: Verifier | None = None, metrics: Any = None,
                 on_mismatch: Callable[[MismatchReport], None] | None = None,
                 on_disable: Callable[[str, MismatchReport], None] | None = None,
                 start: bool = True) -> None:
        self.config = config
        self.core = verifier if verifier is not None else Verifier(config.verifier)
        self._resolve = resolve
        self.on_mismatch = on_mismatch
        self.on_disable = on_disable
        self._rate = config.rate
        self._rng = random.Random(config.seed)
        self._queue: queue.Queue = queue.Queue(maxsize=config.queue_size)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._counts = dict(offered=0, queued=0, dropped=0, checked=0, mismatches=0, errors=0)
        self._dropped_by: dict[str, int] = {}
        # token bucket, refilled in _affordable; it holds at least one sample of max_chars
        self._bucket = float(max(config.chars_per_second, config.max_chars))
        self._budget = self._bucket
        self._budget_at = time.monotonic()
        self._done = 0  # items taken off the queue and finished (checked or errored)
        self._disabled: dict[str, MismatchReport] = {}
        self.reports: deque[MismatchReport] = deque(maxlen=config.max_reports)
        self._closed = False
        self._metrics = _Metrics(metrics, self) if metrics is not None else None
        if self._metrics:
            self._metrics.rate.set(self._rate)
        self._thread = threading.Thread(target=self._run, name="toktier-shadow", daemon=True)
        if start:
            self._thread.start()

    # -- request path (the event loop) ---------------------------------------------------------
    def sampled(self) -> bool:
        """Draw one sample decision at `rate`: the only place results are sampled."""
        return self._rng.random() < self._rate

    def offer(self, sample: Offer, chars: int | None = None) -> bool:
        """Queue a sampled result for checking; True when it was queued.  Never blocks.

        `sample` is a ``Sample`` or a zero-argument callable returning one (or None:
        nothing to check, e.g. the session ended).  The callable runs on the caller's
        thread and only when the queue has room and `chars` (the sample's size in code
        points, when the caller knows it) is within the budget, so a dropped sample
        never pays its O(N) text and ID copy.
        """
        with self._lock:
            if self._closed:
                return False
            self._counts["offered"] += 1
        limit = self.config.max_chars
        if chars is not None and limit and chars > limit:
            self._drop("oversized")
            return False
        if self._queue.full():  # cheap early drop: skip materializing text and IDs
            self._drop("queue_full")
            return False
        if chars is not None and not self._affordable(chars):
            self._drop("budget")
            return False
        s = sample() if callable(sample) else sample
        if s is None:
            return False
        if chars is None:  # size known only now
            if limit and len(s.text) > limit:
                self._drop("oversized")
                return False
            if not self._affordable(len(s.text)):
                self._drop("budget")
                return False
        served = Served(s.text, np.array(s.ids, dtype=np.uint32, copy=True), dict(s.context or {}))
        with self._lock:
            self._counts["queued"] += 1  # before the put: drain() never sees a finished item uncounted
        try:
            self._queue.put_nowait(_Item(s.tokenizer_hash, served))
        except queue.Full:
            self._drop("queue_full", queued=True)
            return False
        return True

    def _affordable(self, chars: int) -> bool:
        """Take ``chars`` from the budget (a token bucket refilled at ``chars_per_second``)."""
        rate = self.config.chars_per_second
        if not rate:
            return True
        with self._lock:
            now = time.monotonic()
            self._budget = min(self._bucket, self._budget + (now - self._budget_at) * rate)
            self._budget_at = now
            if chars > self._budget:
                return False
            self._budget -= chars
            return True

    def _drop(self, reason: str, queued: bool = False) -> None:
        with self._idle:
            self._counts["dropped"] += 1
            self._dropped_by[reason] = self._dropped_by.get(reason, 0) + 1
            if queued:
                self._counts["queued"] -= 1
                self._idle.notify_all()
        if self._metrics:
            self._metrics.dropped.labels(reason=reason).inc()

    def is_disabled(self, tokenizer_hash: str) -> bool:
        """Whether a mismatch disabled this tokenizer's fast path."""
        return tokenizer_hash in self._disabled

    def disabled_report(self, tokenizer_hash: str) -> MismatchReport | None:
        return self._disabled.get(tokenizer_hash)

    def reenable(self, tokenizer_hash: str) -> bool:
        """Operator action: re-enable the fast path.  True when it was disabled."""
        with self._lock:
            was = self._disabled.pop(tokenizer_hash, None) is not None
        if self._metrics:
            self._metrics.disabled.labels(tokenizer=tokenizer_hash[:16]).set(0)
        return was

    def prepare(self, tok: FrozenTokenizer) -> None:
        """Build `tok`'s private reference now, on the caller's (loading) thread."""
        self.core.prepare(tok)

    # -- configuration and state ---------------------------------------------------------------
    @property
    def rate(self) -> float:
        return self._rate

    def set_rate(self, rate: float) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"rate must be in [0, 1], not {rate}")
        self._rate = float(rate)
        if self._metrics:
            self._metrics.rate.set(self._rate)

    @property
    def stats(self) -> ShadowStats:
        with self._lock:
            c = dict(self._counts)
            disabled = tuple(sorted(self._disabled))
            by_reason = dict(self._dropped_by)
        return ShadowStats(**c, rate=self._rate, queue_depth=self._queue.qsize(), disabled=disabled,
                           dropped_by_reason=by_reason)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every queued sample is finished; False on timeout (tests, shutdown)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._done < self._counts["queued"]:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self, timeout: float | None = 10.0) -> None:
        """Stop accepting samples, finish the queued ones, stop the worker."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._thread.is_alive():
            while True:  # the stop marker must get in even if the queue is full
                try:
                    self._queue.put(_STOP, timeout=0.1)
                    break
                except queue.Full:
                    if not self._thread.is_alive():
                        break
            self._thread.join(timeout)

    def __enter__(self) -> "Shadow":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- worker --------------------------------------------------------------------------------
    def _run(self) -> None:
        cfg = self.config
        while True:
            first = self._queue.get()
            if first is _STOP:
                return
            batch = [first]
            stop = False
            deadline = time.monotonic() + cfg.batch_window
            while len(batch) < cfg.batch_size:
                left = deadline - time.monotonic()
                try:
                    item = self._queue.get(timeout=left) if left > 0 else self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is _STOP:
                    stop = True
                    break
                batch.append(item)
            try:
                self._check_batch(batch)
            except Exception:  # never let the worker die; count and go on
                log.exception("shadow verifier batch failed")
                self._finish(len(batch), errors=len(batch))
            if stop:
                return

    def _check_batch(self, batch: list[_Item]) -> None:
        groups: dict[str, list[Served]] = {}
        for item in batch:
            groups.setdefault(item.hash, []).append(item.served)
        for h, served in groups.items():
            try:
                reports = self.core.check(self._resolve(h), served)
            except Exception as exc:
                log.warning("shadow verifier cannot check %d sample(s) of tokenizer %s: %r", len(served), h[:16], exc)
                self._finish(len(served), errors=len(served))
                continue
            for rep in reports:  # before _finish: drain() returns after the callbacks ran
                self._on_mismatch(rep)
            self._finish(len(served), checked=len(served), mismatches=len(reports), tokenizer=h)

    def _finish(self, n: int, *, checked: int = 0, mismatches: int = 0, errors: int = 0,
                tokenizer: str = "") -> None:
        with self._idle:
            self._counts["checked"] += checked
            self._counts["mismatches"] += mismatches
            self._counts["errors"] += errors
            self._done += n
            self._idle.notify_all()
        if self._metrics:
            label = tokenizer[:16] or "unknown"
            if checked:
                self._metrics.checked.labels(tokenizer=label).inc(checked)
            if mismatches:
                self._metrics.mismatches.labels(tokenizer=label).inc(mismatches)
            if errors:
                self._metrics.errors.inc(errors)

    def _on_mismatch(self, rep: MismatchReport) -> None:
        self.reports.append(rep)
        log.error("shadow verifier mismatch: %s", rep.to_json())
        newly_disabled = False
        if self.config.disable_on_mismatch:
            with self._lock:
                if rep.tokenizer_hash not in self._disabled:
                    self._disabled[rep.tokenizer_hash] = rep
                    newly_disabled = True
            if newly_disabled and self._metrics:
                self._metrics.disabled.labels(tokenizer=rep.tokenizer_hash[:16]).set(1)
        for cb, args in ((self.on_mismatch, (rep,)),
                         (self.on_disable if newly_disabled else None, (rep.tokenizer_hash, rep))):
            if cb is None:
                continue
            try:
                cb(*args)
            except Exception:
                log.exception("shadow verifier callback failed")


class _Metrics:
    """prometheus_client metrics on the server's CollectorRegistry."""

    def __init__(self, registry: Any, owner: Shadow) -> None:
        from prometheus_client import Counter, Gauge

        kw = dict(registry=registry)
        p = "toktier_shadow"
        self.checked = Counter(f"{p}_checked", "Sampled results re-encoded by the reference", ["tokenizer"], **kw)
        self.mismatches = Counter(f"{p}_mismatches", "Sampled results that differed from the reference",
                                  ["tokenizer"], **kw)
        self.dropped = Counter(f"{p}_dropped", "Sampled results not checked, by reason: queue_full, oversized "
                               "(longer than the verifier's max chars) or budget (over its chars per second)",
                               ["reason"], **kw)
        self.errors = Counter(f"{p}_errors", "Samples that could not be checked", **kw)
        self.rate = Gauge(f"{p}_sample_rate", "Fraction of served results sampled for verification", **kw)
        self.queue_depth = Gauge(f"{p}_queue_depth", "Samples waiting for the verifier", **kw)
        self.queue_depth.set_function(owner._queue.qsize)
        self.disabled = Gauge(f"{p}_fast_path_disabled", "1 when a mismatch disabled the tokenizer's fast path",
                              ["tokenizer"], **kw)
