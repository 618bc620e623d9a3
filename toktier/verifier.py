"""Verification core: re-encode served results with a reference that has no history, and compare.

Pure: no thread, queue, sampler or metrics.  `Verifier.check(tok, served)` encodes
the texts with a reference engine object and returns one `MismatchReport` per
result whose IDs differ.  Who samples, where checks run and what is counted is the
caller's business (the sidecar's background worker is :mod:`toktier_sidecar.shadow`).

>>> import toktier
>>> tok = toktier.load_tokenizer("cl100k_base")
>>> v = Verifier()
>>> good = Served("hello world", tok.encode("hello world"))
>>> [r.first_diff for r in v.check(tok, [good, Served("hello world", [1, 2], {"request": 7})])]
[0]

Background checking in-process, without the sidecar: hand batches to an executor
you own (the core starts no thread; `check` is safe to call from several threads).

>>> from concurrent.futures import ThreadPoolExecutor
>>> with ThreadPoolExecutor(1, thread_name_prefix="verify") as pool:
...     pending = pool.submit(v.check, tok, [good])
...     pending.result()
[]

Reference freshness (DESIGN §7: a long-lived engine once returned different IDs
after an earlier long encode), `VerifierConfig.fresh`:

``"batch"`` (default)
    a brand-new reference object per `check` (HF: ``Tokenizer.from_str`` of the
    tokenizer.json text, read once per `Verifier`; tiktoken: a new ``Encoding``).
    Building one holds the GIL (dev VM: ~0.3 s for llama3/qwen3/deepseek, ~0.1 s
    for o200k): batch the results, and keep it out of latency-critical processes.
``"nocache"``
    one private reference object per tokenizer (never the serving one) built with
    its cross-call state switched off through public API: for an HF BPE model the
    model is rebuilt with ``tokenizers.models.BPE(vocab, merges, cache_capacity=0,
    ...)`` (no word cache exists), and kept only if the tokenizer then serializes
    exactly as the file did (``Tokenizer.to_str``); tiktoken's ``CoreBPE`` keeps no
    cross-call state.  It is rebuilt every ``rebuild_every`` checks (None: never),
    and a mismatch is confirmed with a brand-new object before it is reported.  A
    tokenizer whose model offers no public way to drop its cache (e.g. an HF
    Unigram model) gets a brand-new object per check instead.  Call `prepare` when
    the tokenizer loads so the GIL-holding build does not land mid-traffic.

A `MismatchReport` carries the tokenizer hash, the sha256 of the text, the first
differing index and the two ID windows around it (the text itself only with
``keep_text=True``), plus the caller's context; ``to_json`` is its log form.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Literal, Mapping, Protocol, Sequence

import numpy as np

from .registry import FrozenTokenizer

log = logging.getLogger("toktier.verifier")

Freshness = Literal["batch", "nocache"]

# IDs shown on each side of the first difference in a report.
REPORT_WINDOW = 8


class Reference(Protocol):
    """A reference engine object: ``encode_batch(texts)`` gives each text's IDs."""

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]: ...


ReferenceFactory = Callable[[FrozenTokenizer], Reference]


@dataclass(frozen=True)
class VerifierConfig:
    """How references are built and what a report keeps."""

    fresh: Freshness = "batch"
    #: ``"nocache"``: checks served by one private reference before it is rebuilt (None: never).
    rebuild_every: int | None = 1000
    #: Put the served text in each report (it may hold user data; the sha256 is always there).
    keep_text: bool = False
    #: IDs on each side of the first difference in a report.
    report_window: int = REPORT_WINDOW

    def __post_init__(self) -> None:
        if self.fresh not in ("batch", "nocache"):
            raise ValueError(f"fresh must be 'batch' or 'nocache', not {self.fresh!r}")
        if self.rebuild_every is not None and self.rebuild_every < 1:
            raise ValueError(f"rebuild_every must be >= 1 or None, not {self.rebuild_every}")
        if self.report_window < 0:
            raise ValueError(f"report_window must be >= 0, not {self.report_window}")


@dataclass(frozen=True, slots=True)
class Served:
    """A served result to check: the text and the IDs that were returned for it.

    The caller owns `ids`: copy them first if the array is a view that a later op
    may overwrite.
    """

    text: str
    ids: np.ndarray | Sequence[int]
    context: Mapping[str, Any] = field(default_factory=dict)  # echoed in a report (session id, op...)


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


# -- references ------------------------------------------------------------------------------

# tokenizers.models.BPE constructor options, as the tokenizer.json model section names them.
_BPE_OPTIONS = ("dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix", "fuse_unk",
                "byte_fallback", "ignore_merges")


class HFReference:
    """A new HF tokenizer object parsed from tokenizer.json text, set up like `HFEngine`.

    With ``cache=False`` a BPE model is rebuilt through the public constructor with
    ``cache_capacity=0``; `history_free` says whether that worked (the rebuilt
    tokenizer serializes exactly as the original, so only the cache differs).
    """

    def __init__(self, source: str, *, specials_as_text: bool, cache: bool = True) -> None:
        self._source, self._specials_as_text = source, specials_as_text
        self._tok = self._parse()
        self.history_free = False
        if not cache:
            self.history_free = self._drop_cache()

    def _parse(self) -> Any:
        import tokenizers

        tok = tokenizers.Tokenizer.from_str(self._source)
        tok.no_truncation()  # as HFEngine: a prompt's tokens are never cut
        tok.no_padding()
        tok.encode_special_tokens = self._specials_as_text
        return tok

    def _drop_cache(self) -> bool:
        from tokenizers.models import BPE

        model = json.loads(self._source).get("model") or {}
        if model.get("type") != "BPE":
            return False  # no public cache switch (e.g. Unigram): the caller builds per check
        try:
            merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
            options = {k: model[k] for k in _BPE_OPTIONS if model.get(k) is not None}
            before = self._tok.to_str()
            self._tok.model = BPE(model["vocab"], merges, cache_capacity=0, **options)
            if self._tok.to_str() == before:
                return True
            log.warning("a cache-free BPE model does not serialize as the file's; using per-check references")
        except Exception as exc:  # an unexpected model shape: fall back, never guess
            log.warning("cannot build a cache-free BPE model (%r); using per-check references", exc)
        self._tok = self._parse()
        return False

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        encs = self._tok.encode_batch_fast(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.uint32) for e in encs]


class _EngineReference:
    """A non-HF engine's ``fresh_copy()``."""

    def __init__(self, engine: Any, history_free: bool) -> None:
        self._engine, self.history_free = engine, history_free

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return self._engine.encode_batch(texts)


def _is_hf(tok: FrozenTokenizer) -> bool:
    return getattr(tok.engine, "engine_name", "") == "tokenizers" and bool(getattr(tok.engine, "path", None))


def _read_source(tok: FrozenTokenizer) -> str:
    with open(tok.engine.path, encoding="utf-8") as f:
        return f.read()


def fresh_reference(tok: FrozenTokenizer, *, cache: bool = True, source: str | None = None) -> Reference:
    """A new reference engine object for `tok`, sharing no state with `tok.engine`.

    HF: parsed again from the tokenizer.json text (`source`, else read from the
    file); tiktoken and other engines: ``engine.fresh_copy()``.  ``cache=False``
    asks for one whose cross-call cache is off: check ``history_free`` on the
    result (False when the engine offers no public way to switch it off).
    """
    if _is_hf(tok):
        text = source if source is not None else _read_source(tok)
        return HFReference(text, specials_as_text=tok.engine.specials == "none", cache=cache)
    # tiktoken's CoreBPE keeps no state between calls; of other engines nothing is known
    return _EngineReference(tok.engine.fresh_copy(), history_free=tok.engine.engine_name == "tiktoken")


class _Private:
    __slots__ = ("ref", "used")

    def __init__(self, ref: Reference) -> None:
        self.ref, self.used = ref, 0


# -- the verifier ----------------------------------------------------------------------------

class Verifier:
    """Checks served results against references built by `config`'s freshness policy.

    `reference_factory`, when given, builds the reference for every `check` instead
    (tests inject blocking or broken ones; no confirmation then).  Holds per
    tokenizer the tokenizer.json text and, in ``"nocache"`` mode, the private
    reference; a lock guards them, so `prepare` may run on a loading thread while
    `check` runs on another.
    """

    def __init__(self, config: VerifierConfig = VerifierConfig(), *,
                 reference_factory: ReferenceFactory | None = None) -> None:
        self.config = config
        self._factory = reference_factory
        self._lock = threading.Lock()
        self._sources: dict[str, str] = {}  # tokenizer hash -> tokenizer.json text (HF)
        self._private: dict[str, _Private] = {}  # "nocache": tokenizer hash -> private reference

    def fresh(self, tok: FrozenTokenizer, *, cache: bool = True) -> Reference:
        """A brand-new reference for `tok` (the tokenizer.json text is read once and kept)."""
        source = None
        if _is_hf(tok):
            with self._lock:
                source = self._sources.get(tok.hash)
            if source is None:
                source = _read_source(tok)
                with self._lock:
                    source = self._sources.setdefault(tok.hash, source)
        return fresh_reference(tok, cache=cache, source=source)

    def prepare(self, tok: FrozenTokenizer) -> None:
        """Build `tok`'s private reference now, on the caller's thread (``"nocache"``).

        Building one takes ~0.7 s for a large tokenizer.json on the dev VM (parse,
        cache-free model, serialization check), holding the GIL for up to ~0.3 s at a
        time, so do it when the tokenizer is loaded rather than on its first check in
        the middle of traffic.  Idempotent; a no-op in ``"batch"`` mode.
        """
        if self._factory is not None or self.config.fresh != "nocache":
            return
        with self._lock:
            if tok.hash in self._private:
                return
        slot = _Private(self.fresh(tok, cache=False))
        if not getattr(slot.ref, "history_free", False):
            log.warning("tokenizer %s: no public way to switch its reference's cache off; "
                        "checks build a new reference each time", tok.hash[:16])
        with self._lock:
            self._private.setdefault(tok.hash, slot)

    def private_reference(self, tokenizer_hash: str) -> Reference | None:
        """The ``"nocache"`` private reference of a tokenizer, if one is built."""
        with self._lock:
            slot = self._private.get(tokenizer_hash)
        return None if slot is None else slot.ref

    def _reference(self, tok: FrozenTokenizer) -> tuple[Reference, bool]:
        """The reference for one check, and whether it is brand-new (no confirmation needed)."""
        if self._factory is not None:
            return self._factory(tok), True
        if self.config.fresh == "batch":
            return self.fresh(tok), True
        every = self.config.rebuild_every
        with self._lock:
            slot = self._private.get(tok.hash)
        if slot is None or (every is not None and slot.used >= every):
            slot = _Private(self.fresh(tok, cache=False))
            with self._lock:
                self._private[tok.hash] = slot
        if not getattr(slot.ref, "history_free", False):
            return self.fresh(tok), True
        with self._lock:
            slot.used += 1
        return slot.ref, False

    def check(self, tok: FrozenTokenizer, served: Sequence[Served]) -> list[MismatchReport]:
        """Re-encode every served text of tokenizer `tok`; one report per differing result.

        Raises what the reference raises (nothing was compared then).
        """
        if not served:
            return []
        ref, brand_new = self._reference(tok)
        bad = _differing(served, ref.encode_batch([s.text for s in served]))
        if bad and not brand_new:
            # Confirm with a brand-new object before a mismatch counts.
            confirmed = _differing([s for s, _ in bad], self.fresh(tok).encode_batch([s.text for s, _ in bad]))
            if len(confirmed) < len(bad):  # the private reference itself drifted (DESIGN §7)
                log.warning("tokenizer %s: the private reference disagreed with a new one on %d text(s); "
                            "rebuilding it", tok.hash[:16], len(bad) - len(confirmed))
                with self._lock:
                    if self._private.get(tok.hash) is not None and self._private[tok.hash].ref is ref:
                        del self._private[tok.hash]
            bad = confirmed
        if bad and tok.native is not None and tok.native.demoted is None:
            # A confirmed mismatch the native engine reproduces (its own encode of the text differs
            # from the reference): this tokenizer's fast encodes go back to the reference engine.
            # A mismatch it does not reproduce came from elsewhere (a splice, the caller); the
            # sidecar's `verify_disable_on_mismatch` answers those by switching splicing off.
            for s, expected in bad:
                if not np.array_equal(tok.native.encode(s.text), expected):
                    tok.native.demote(f"shadow verifier: the native engine differs from the reference on a "
                                      f"{len(s.text)}-character text (sha256 {_sha(s.text)[:16]})")
                    break
        return [self._report(tok.hash, s, expected) for s, expected in bad]

    def _report(self, tokenizer_hash: str, s: Served, expected: np.ndarray) -> MismatchReport:
        got = np.asarray(s.ids)
        i = first_difference(got, expected)
        w = self.config.report_window
        lo = max(0, i - w)
        return MismatchReport(
            tokenizer_hash=tokenizer_hash,
            text_sha256=hashlib.sha256(s.text.encode("utf-8", "surrogatepass")).hexdigest(),
            text_chars=len(s.text),
            served_len=len(got),
            reference_len=len(expected),
            first_diff=i,
            window_start=lo,
            served_window=tuple(int(x) for x in got[lo : i + w + 1]),
            reference_window=tuple(int(x) for x in expected[lo : i + w + 1]),
            detected_at=time.time(),
            context=dict(s.context),
            text=s.text if self.config.keep_text else None,
        )


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _differing(served: Sequence[Served], expected: Sequence[np.ndarray]) -> list[tuple[Served, np.ndarray]]:
    return [(s, e) for s, e in zip(served, expected, strict=True) if not np.array_equal(np.asarray(s.ids), e)]
