"""Shadow verification: re-encode a sampled fraction of served results in the background.

The core is pure (no asyncio, no sockets): the sidecar, or any in-process user,
calls `ShadowVerifier.offer(tokenizer_hash, text, ids)` after serving a result.
`offer` never blocks: it draws a sample at `rate`, copies the IDs of a sampled
result and puts them on a bounded queue with ``put_nowait``; when the queue is
full the sample is dropped and counted.  One worker thread drains the queue in
batches, re-encodes each text with a reference engine object that carries no
state from earlier calls, and compares.

Reference freshness (DESIGN §7: a long-lived engine once returned different IDs
after an earlier long encode), selected by ``fresh=``:

``"batch"`` (default)
    a brand-new reference object per check batch (HF: ``Tokenizer.from_str`` of
    the cached tokenizer.json text; tiktoken: a new ``Encoding``).  Building one
    holds the GIL (measured on the dev VM: ~0.3 s for llama3/qwen3/deepseek,
    ~0.1 s for o200k), so batches are gathered for up to ``batch_window``
    seconds; in a latency-critical process prefer ``"nocache"`` or run the
    verifier in its own process.
``"nocache"``
    one private reference object per tokenizer (never the serving one) whose
    only cross-call state, HF's BPE word cache, is disabled (``_resize_cache(0)``
    and cleared per batch; tiktoken's CoreBPE keeps none), rebuilt every
    ``rebuild_every`` batches (None: never).  A mismatch is confirmed with a
    brand-new object before it counts.  Building a reference holds the GIL, so a
    latency-critical process calls `prepare` when it loads a tokenizer (the sidecar
    does, and never rebuilds): otherwise the first sampled result stalls every
    thread of the process for the build.

A mismatch produces a `MismatchReport` (tokenizer hash, sha256 of the text,
first differing index and the two ID windows around it; the text itself only
with ``keep_text=True``), is logged, counted, passed to ``on_mismatch``, and with
``disable_on_mismatch=True`` marks the tokenizer's fast path disabled
(`is_disabled`) until `reenable` (``on_disable`` is called once per disable).

>>> import toktier
>>> tok = toktier.load_tokenizer("cl100k_base")
>>> with ShadowVerifier({tok.hash: tok}, rate=1.0, seed=0) as v:
...     v.offer(tok.hash, "hello world", tok.encode("hello world"))
...     v.offer(tok.hash, "hello world", [1, 2])
...     v.drain()
...     (v.stats.checked, v.stats.mismatches, v.reports[0].first_diff)
True
True
True
(2, 1, 0)
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import random
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Literal, Mapping, Sequence

import numpy as np

from .registry import FrozenTokenizer

log = logging.getLogger("toktier.shadow")

Resolver = Mapping[str, FrozenTokenizer] | Callable[[str], FrozenTokenizer]
ReferenceFactory = Callable[[FrozenTokenizer], Any]  # returns an object with encode_batch(texts)

# IDs shown on each side of the first difference in a report.
REPORT_WINDOW = 8


@dataclass(frozen=True)
class MismatchReport:
    """A served result that differs from the reference: enough to reproduce it."""

    tokenizer_hash: str
    text_sha256: str
    text_chars: int
    served_len: int
    reference_len: int
    first_diff: int  # first index where served and reference IDs differ
    window_start: int  # index of served_window[0] / reference_window[0]
    served_window: tuple[int, ...]
    reference_window: tuple[int, ...]
    detected_at: float  # time.time()
    context: dict = field(default_factory=dict)  # caller-supplied (session id, op, path...)
    text: str | None = None  # only with keep_text=True

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False, sort_keys=True)


@dataclass(frozen=True)
class ShadowStats:
    """A snapshot of the verifier's counters."""

    offered: int  # results offered
    sampled: int  # enqueued for checking
    dropped: int  # sampled but the queue was full
    checked: int  # compared with the reference
    mismatches: int
    errors: int  # unknown tokenizer or reference failure (not compared)
    rate: float
    queue_depth: int
    disabled: tuple[str, ...]  # tokenizer hashes whose fast path is disabled


def first_difference(a: np.ndarray, b: np.ndarray) -> int:
    """Index of the first differing element (len of the shorter when one is a prefix).

    >>> first_difference(np.array([1, 2, 3]), np.array([1, 5, 3]))
    1
    >>> first_difference(np.array([1, 2]), np.array([1, 2, 3]))
    2
    """
    m = min(len(a), len(b))
    d = np.flatnonzero(a[:m] != b[:m])
    return int(d[0]) if len(d) else m


class _HFReference:
    """A new HF tokenizer object built from cached tokenizer.json text."""

    def __init__(self, json_text: str, encode_special_tokens: bool, cache: bool = True) -> None:
        import tokenizers

        self._tok = tokenizers.Tokenizer.from_str(json_text)
        self._tok.encode_special_tokens = encode_special_tokens
        if not cache:
            self._tok.model._resize_cache(0)

    def clear(self) -> None:
        self._tok.model._clear_cache()

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        encs = self._tok.encode_batch_fast(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.uint32) for e in encs]


_JSON_CACHE: dict[str, str] = {}
_JSON_LOCK = threading.Lock()


def fresh_reference(tok: FrozenTokenizer, *, cache: bool = True) -> Any:
    """A new reference engine object for `tok`, sharing no state with `tok.engine`.

    HF: parsed again from the tokenizer.json text (read once and kept); tiktoken:
    ``engine.fresh_copy()``; anything else: ``engine.fresh_copy()``.
    """
    eng = tok.engine
    path = getattr(eng, "path", None)
    if getattr(eng, "engine_name", "") == "tokenizers" and path:
        with _JSON_LOCK:
            text = _JSON_CACHE.get(tok.hash)
            if text is None:
                with open(path, encoding="utf-8") as f:
                    text = _JSON_CACHE[tok.hash] = f.read()
        return _HFReference(text, encode_special_tokens=eng.specials == "none", cache=cache)
    return eng.fresh_copy()


class _Item:
    __slots__ = ("hash", "text", "ids", "context")

    def __init__(self, h: str, text: str, ids: np.ndarray, context: dict) -> None:
        self.hash, self.text, self.ids, self.context = h, text, ids, context


_STOP = object()


class ShadowVerifier:
    """Background re-encoding of sampled served results; see the module docstring.

    Parameters: `tokenizers` maps a tokenizer hash to a `FrozenTokenizer` (a
    mapping, or a callable raising KeyError for unknown hashes — e.g.
    ``registry.get``); `rate` in [0, 1]; `queue_size` bounds pending samples;
    `batch_size` / `batch_window` bound a check batch (items / seconds spent
    gathering it); `seed` makes sampling reproducible; `reference_factory`
    builds the reference for a batch (tests inject blocking or broken ones);
    `metrics` is a prometheus_client CollectorRegistry to register counters on.
    """

    def __init__(
        self,
        tokenizers: Resolver,
        *,
        rate: float = 0.01,
        queue_size: int = 1024,
        keep_text: bool = False,
        disable_on_mismatch: bool = False,
        seed: int | None = None,
        batch_size: int = 64,
        batch_window: float = 0.05,
        fresh: Literal["batch", "nocache"] = "batch",
        rebuild_every: int | None = 1000,
        reference_factory: ReferenceFactory | None = None,
        on_mismatch: Callable[[MismatchReport], None] | None = None,
        on_disable: Callable[[str, MismatchReport], None] | None = None,
        max_reports: int = 100,
        metrics: Any = None,
        metric_prefix: str = "toktier_shadow",
        start: bool = True,
    ) -> None:
        if queue_size < 1 or batch_size < 1:
            raise ValueError("queue_size and batch_size must be >= 1")
        if fresh not in ("batch", "nocache"):
            raise ValueError(f"fresh must be 'batch' or 'nocache', not {fresh!r}")
        self._resolve = tokenizers.__getitem__ if isinstance(tokenizers, Mapping) else tokenizers
        self._rate = 0.0
        self.set_rate(rate)
        self.keep_text = keep_text
        self.disable_on_mismatch = disable_on_mismatch
        self.batch_size = batch_size
        self.batch_window = batch_window
        self.fresh = fresh
        self.rebuild_every = None if rebuild_every is None else max(1, rebuild_every)
        self._factory = reference_factory
        self.on_mismatch = on_mismatch
        self.on_disable = on_disable
        self._rng = random.Random(seed)
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._counts = dict(offered=0, sampled=0, dropped=0, checked=0, mismatches=0, errors=0)
        self._done = 0  # items taken off the queue and finished (checked or errored)
        self._disabled: dict[str, MismatchReport] = {}
        self.reports: deque[MismatchReport] = deque(maxlen=max_reports)
        self._refs: dict[str, tuple[Any, int]] = {}  # nocache mode: hash -> (reference, batches used)
        self._refs_lock = threading.Lock()  # `prepare` runs on loader threads, checks on the worker
        self._closed = False
        self._metrics = _Metrics(metrics, metric_prefix, self) if metrics is not None else None
        if self._metrics:
            self._metrics.rate.set(self._rate)
        self._thread = threading.Thread(target=self._run, name="toktier-shadow", daemon=True)
        if start:
            self._thread.start()

    # -- request path --------------------------------------------------------------------
    def offer(self, tokenizer_hash: str, text: str | Callable[[], str],
              ids: Sequence[int] | np.ndarray | Callable[[], Sequence[int] | np.ndarray],
              context: dict | None = None) -> bool:
        """Maybe sample this served result; True when it was enqueued for checking.

        Never blocks: a full queue drops the sample.  `text` and `ids` may be zero-argument
        callables, called (on the caller's thread) only for a sampled result, so an
        unsampled request pays no O(N) cost (e.g. ``lambda: session.text``).  Sampled IDs
        are copied (the caller's array may be a view that the next op overwrites).
        """
        with self._lock:
            self._counts["offered"] += 1
            if self._closed or self._rng.random() >= self._rate:
                return False
            self._counts["sampled"] += 1
        if self._queue.full():  # cheap early drop: skip materializing text and IDs
            self._drop()
            return False
        if callable(text):
            text = text()
        if callable(ids):
            ids = ids()
        item = _Item(tokenizer_hash, text, np.array(ids, dtype=np.uint32, copy=True), dict(context or {}))
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self._drop()
            return False
        return True

    def _drop(self) -> None:
        with self._idle:
            self._counts["sampled"] -= 1
            self._counts["dropped"] += 1
            self._idle.notify_all()
        if self._metrics:
            self._metrics.dropped.inc()

    def is_disabled(self, tokenizer_hash: str) -> bool:
        """Whether a confirmed mismatch disabled this tokenizer's fast path."""
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
        """Build `tok`'s private reference now, on the caller's thread (``fresh="nocache"``).

        Building one holds the GIL (~0.3 s for a large tokenizer.json on the dev VM), so
        do it when the tokenizer is loaded rather than on its first sampled result, in
        the middle of traffic.  Idempotent; a no-op in the other modes.
        """
        if self._factory is not None or self.fresh != "nocache":
            return
        with self._refs_lock:
            if tok.hash in self._refs:
                return
        ref = fresh_reference(tok, cache=False)
        with self._refs_lock:
            self._refs.setdefault(tok.hash, (ref, 0))

    # -- configuration and state -------------------------------------------------------
    @property
    def rate(self) -> float:
        return self._rate

    def set_rate(self, rate: float) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"rate must be in [0, 1], not {rate}")
        self._rate = float(rate)
        metrics = getattr(self, "_metrics", None)
        if metrics:
            metrics.rate.set(self._rate)

    @property
    def stats(self) -> ShadowStats:
        with self._lock:
            c = dict(self._counts)
            disabled = tuple(sorted(self._disabled))
        return ShadowStats(**c, rate=self._rate, queue_depth=self._queue.qsize(), disabled=disabled)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every enqueued sample is finished; False on timeout (tests, shutdown)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._done < self._counts["sampled"]:
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

    def __enter__(self) -> "ShadowVerifier":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- worker ------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is _STOP:
                return
            batch = [first]
            stop = False
            deadline = time.monotonic() + self.batch_window
            while len(batch) < self.batch_size:
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

    def _reference(self, tok: FrozenTokenizer) -> Any:
        if self._factory is not None:
            return self._factory(tok)
        if self.fresh == "batch":
            return fresh_reference(tok)
        with self._refs_lock:
            ref, used = self._refs.get(tok.hash, (None, 0))
        if ref is None or (self.rebuild_every is not None and used >= self.rebuild_every):
            ref, used = fresh_reference(tok, cache=False), 0
        with self._refs_lock:
            self._refs[tok.hash] = (ref, used + 1)
        if hasattr(ref, "clear"):
            ref.clear()
        return ref

    def _check_batch(self, batch: list[_Item]) -> None:
        groups: dict[str, list[_Item]] = {}
        for item in batch:
            groups.setdefault(item.hash, []).append(item)
        for h, items in groups.items():
            try:
                tok = self._resolve(h)
                ref = self._reference(tok)
                expected = ref.encode_batch([it.text for it in items])
            except Exception as exc:
                log.warning("shadow verifier cannot check %d sample(s) of tokenizer %s: %r", len(items), h[:16], exc)
                self._finish(len(items), errors=len(items))
                continue
            bad = [(it, exp) for it, exp in zip(items, expected) if not np.array_equal(it.ids, exp)]
            if bad and self._factory is None and self.fresh != "batch":
                # Confirm with a brand-new object before a mismatch counts.
                again = fresh_reference(tok).encode_batch([it.text for it, _ in bad])
                bad = [(it, exp) for (it, _), exp in zip(bad, again) if not np.array_equal(it.ids, exp)]
            reports = [self._report(it, exp) for it, exp in bad]
            for rep in reports:  # before _finish: drain() returns after the callbacks ran
                self._on_mismatch(rep)
            self._finish(len(items), checked=len(items), mismatches=len(reports), tokenizer=h)

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

    def _report(self, item: _Item, expected: np.ndarray) -> MismatchReport:
        i = first_difference(item.ids, expected)
        lo = max(0, i - REPORT_WINDOW)
        return MismatchReport(
            tokenizer_hash=item.hash,
            text_sha256=hashlib.sha256(item.text.encode("utf-8", "surrogatepass")).hexdigest(),
            text_chars=len(item.text),
            served_len=len(item.ids),
            reference_len=len(expected),
            first_diff=i,
            window_start=lo,
            served_window=tuple(int(x) for x in item.ids[lo : i + REPORT_WINDOW + 1]),
            reference_window=tuple(int(x) for x in expected[lo : i + REPORT_WINDOW + 1]),
            detected_at=time.time(),
            context=item.context,
            text=item.text if self.keep_text else None,
        )

    def _on_mismatch(self, rep: MismatchReport) -> None:
        self.reports.append(rep)
        log.error("shadow verifier mismatch: %s", rep.to_json())
        newly_disabled = False
        if self.disable_on_mismatch:
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
    """prometheus_client metrics on a caller-supplied CollectorRegistry."""

    def __init__(self, registry: Any, prefix: str, owner: ShadowVerifier) -> None:
        from prometheus_client import Counter, Gauge

        kw = dict(registry=registry)
        self.checked = Counter(f"{prefix}_checked", "Sampled results re-encoded by the reference",
                               ["tokenizer"], **kw)
        self.mismatches = Counter(f"{prefix}_mismatches", "Sampled results that differed from the reference",
                                  ["tokenizer"], **kw)
        self.dropped = Counter(f"{prefix}_dropped", "Samples dropped because the verifier queue was full", **kw)
        self.errors = Counter(f"{prefix}_errors", "Samples that could not be checked", **kw)
        self.rate = Gauge(f"{prefix}_sample_rate", "Fraction of served results sampled for verification", **kw)
        self.queue_depth = Gauge(f"{prefix}_queue_depth", "Samples waiting for the verifier", **kw)
        self.queue_depth.set_function(owner._queue.qsize)
        self.disabled = Gauge(f"{prefix}_fast_path_disabled", "1 when a mismatch disabled the tokenizer's fast path",
                              ["tokenizer"], **kw)
