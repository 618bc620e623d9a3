"""Spans an NFC normalizer changes, and the map between raw and normalized byte positions.

NFC families (Qwen3's tokenizer.json) tokenize the *normalized* text, so where the
normalizer rewrites bytes (a decomposed ``e\\u0301``, a compatibility character, Hangul
jamo) the tokens tile NFC(text), not text.  A span here is a run of non-NFC-inert
characters with the inert character before it (class ``I``, ``charclass.nfc_inert_mask``):
NFC(text) is the concatenation of NFC of the pieces between span edges, so each span can
be normalized on its own and only those the normalizer actually changes are kept, as
``(raw start, raw end, byte delta)``.

`nfc_edits` finds those spans as the reference normalizes (literals split off first, a gap
normalized on its own; all spans in one normalizer call); `nfc_form` applies them, certified by
the literals, for the native engine and the GPU to encode; `nfc_spans` gives them in bytes for
a session's dirty spans.

`SpanMap` converts positions between the raw text and its normalized form.  A position
strictly inside a span has no counterpart on the other side (the normalizer rewrote those
bytes); every position between two NFC-inert characters lies outside all spans, which is
why the session's stable boundaries (both sides inert in NFC families) always convert.
"""

from __future__ import annotations

import numpy as np

from .families import I

Span = tuple[int, int, int]  # (raw start, raw end, normalized length - raw length), bytes

#: More changed spans than this and a text is left unspliceable: each repair would map
#: positions through them all.
MAX_NFC_SPANS = 4096

#: A private-use character: NFC-inert on both sides, so NFC of spans joined by it is the spans'
#: NFC joined by it (one normalizer call for all of a text's spans).
_SEP = "\ue000"

Edit = tuple[int, int, str]  # (raw start, raw end, normalized), characters


def _runs(tok, text: str, native) -> tuple[np.ndarray, np.ndarray]:
    """Maximal runs [a, b) of non-NFC-inert characters (the native engine's scan, else the class table)."""
    if native is not None:
        r = native.nfc_runs(text)
        return r[0::2], r[1::2]
    cps = np.frombuffer(text.encode("utf-32-le"), dtype="<u4")
    bad = ((tok.classes[cps] & I) == 0).view(np.int8)
    d = np.diff(np.concatenate(([0], bad, [0])).astype(np.int8))
    return np.flatnonzero(d == 1), np.flatnonzero(d == -1)


def nfc_edits(tok, text: str, native=None, literals: np.ndarray | None = None,
              runs: np.ndarray | None = None) -> list[Edit] | None:
    """Where the tokenizer's normalizer changes `text` as its reference applies it: (start, end,
    normalized) character spans, sorted, [] when it changes nothing; None when a literal holds a
    character NFC may change, or a literal is matched on normalized text (``normalized=True``).

    Each span is a run of non-NFC-inert characters with the inert character before it, unless a
    literal ends there: the reference splits literals off the raw text and normalizes each gap on
    its own (a ``>`` ending a literal never composes with a U+0338 after it).  NFC of a gap is NFC
    of its pieces cut before each inert character (``charclass.nfc_inert_mask``), so normalizing
    these spans (in one call, joined by `_SEP`) normalizes the text.  `native`: the `NativeEngine`
    whose literal split is the reference's (default ``tok.native``); without one the literals are
    not looked at (callers that have none verify what they build).  `literals`, `runs`: its
    `literal_spans` and `nfc_runs` of `text`, when the caller has them.
    """
    nat = native if native is not None else tok.native
    ra, rb = _runs(tok, text, nat) if runs is None else (runs[0::2], runs[1::2])
    if not len(ra):
        return []
    starts = np.where(ra > 0, ra - 1, ra)
    if nat is not None:
        if any(lit.normalized for lit in tok.engine.literals):
            return None
        lits = nat.literal_spans(text) if literals is None else literals
        la, lb = lits[0::2], lits[1::2]
        if len(la):
            k = np.searchsorted(la, rb, "left") - 1  # the last literal starting before each run ends
            if np.any((k >= 0) & (lb[np.maximum(k, 0)] > ra)):
                return None
            k = np.searchsorted(la, ra - 1, "right") - 1
            ends_here = (k >= 0) & (lb[np.maximum(k, 0)] == ra)  # a literal ends where the run starts
            starts = np.where(ends_here, ra, starts)
    # spans that touch become one (as the session's dirty spans always were)
    first = np.concatenate(([True], starts[1:] > rb[:-1]))
    last = np.concatenate((first[1:], [True]))
    return _rewrites(tok.engine.normalize, text, starts[first].tolist(), rb[last].tolist())


def _rewrites(normalize, text: str, starts: list[int], ends: list[int]) -> list[Edit]:
    """(start, end, normalized) for each span [starts[i], ends[i]) of `text` that `normalize` changes."""
    raws = [text[a:b] for a, b in zip(starts, ends)]
    joined = _SEP.join(raws)
    parts = None
    if joined.count(_SEP) == len(raws) - 1:  # no span holds the separator
        norm = normalize(joined)
        if norm == joined:
            return []
        parts = norm.split(_SEP)
    if parts is None or len(parts) != len(raws):
        parts = [normalize(r) for r in raws]  # (a text holding the separator: one call per span)
    return [(a, b, p) for a, b, r, p in zip(starts, ends, raws, parts) if p != r]


def nfc_form(tok, text: str, native=None, runs: np.ndarray | None = None) -> str | None:
    """`text` as the reference tokenizes it (`nfc_edits` applied: each gap between added-token
    literals NFC-normalized by the engine's own normalizer, the literals kept); `text` itself when
    that changes nothing; None when it is not certain.

    For an NFC family, the native engine's encode of the result without its NFC check equals the
    reference's encode of `text`.  Certified, not assumed: the literals the native engine finds in
    the result must be the same ones, shifted by the rewrites before them.  `native` as in
    `nfc_edits`; None also without a native engine, and the caller encodes with the reference.
    `runs`: the engine's `nfc_runs` of `text`, when the caller has them.
    """
    nat = native if native is not None else tok.native
    if nat is None:
        return None
    if runs is None:
        runs = nat.nfc_runs(text)
    if not len(runs):
        return text  # (nothing NFC may change: no literal scan either)
    lits = nat.literal_spans(text)
    edits = nfc_edits(tok, text, nat, lits, runs)
    if edits is None:
        return None
    if not edits:
        return text
    parts: list[str] = []
    ends_at: list[int] = []
    shift: list[int] = []  # length change of the rewrites up to each one
    prev = delta = 0
    for a, b, norm in edits:
        parts += [text[prev:a], norm]
        prev = b
        delta += len(norm) - (b - a)
        ends_at.append(b)
        shift.append(delta)
    parts.append(text[prev:])
    out = "".join(parts)
    j = np.searchsorted(np.array(ends_at, dtype=np.int64), lits, "right") - 1  # rewrites before each edge
    want = lits + np.where(j >= 0, np.array(shift, dtype=np.int64)[np.maximum(j, 0)], 0)
    return out if np.array_equal(nat.literal_spans(out), want) else None


def nfc_spans(tok, text: bytes, chars: str | None = None) -> tuple[list[Span], bytes] | None:
    """The spans of `text` the tokenizer's normalizer changes (`nfc_edits`), in bytes, and the text
    with them normalized; None when there are none, more than `MAX_NFC_SPANS`, or `nfc_edits`
    cannot say.  `chars`: `text` decoded, when the caller has it."""
    s = chars if chars is not None else text.decode("utf-8")
    edits = nfc_edits(tok, s)
    if not edits or len(edits) > MAX_NFC_SPANS:
        return None
    edges = np.array([x for a, b, _ in edits for x in (a, b)], dtype=np.int64)
    if tok.native is not None:
        offs = tok.native.utf8_offsets(s, edges).tolist()
    else:
        offs, at, nb = [], 0, 0
        for c in edges.tolist():
            nb += len(s[at:c].encode("utf-8"))
            offs.append(nb)
            at = c
    out: list[Span] = []
    parts: list[bytes] = []
    prev = 0
    for i, (_a, _b, norm) in enumerate(edits):
        ra, rb = offs[2 * i], offs[2 * i + 1]
        nb = norm.encode("utf-8")
        parts += [text[prev:ra], nb]
        out.append((ra, rb, len(nb) - (rb - ra)))
        prev = rb
    parts.append(text[prev:])
    return out, b"".join(parts)


_NO_SPANS = np.zeros(0, dtype=np.int64)
_NO_SPANS.flags.writeable = False  # shared by every empty SpanMap


class SpanMap:
    """Raw <-> normalized byte positions of a text whose NFC-changed spans are `spans`.

    >>> m = SpanMap([(2, 5, -1), (9, 10, 2)])  # 3 raw bytes -> 2, then 1 raw byte -> 3
    >>> m.to_norm(np.array([0, 2, 3, 5, 9, 10, 12])).tolist()
    [0, 2, -1, 4, 8, 11, 13]
    >>> m.to_raw(np.array([0, 2, 3, 4, 8, 9, 11, 13])).tolist()
    [0, 2, -1, 5, 9, -1, 10, 12]
    >>> m.to_norm(np.array([3]), inside="floor").tolist(), m.to_norm(np.array([3]), inside="ceil").tolist()
    ([2], [4])
    >>> SpanMap([]).to_raw(np.array([7])).tolist(), m.norm(12)
    ([7], 13)
    """

    __slots__ = ("spans", "_raw_a", "_raw_b", "_norm_a", "_norm_b", "_cum")

    def __init__(self, spans: list[Span]) -> None:
        self.spans = spans
        if not spans:
            # every session starts with no span (and most keep none): no array work for it
            self._raw_a = self._raw_b = self._norm_a = self._norm_b = self._cum = _NO_SPANS
            return
        arr = np.array(spans, dtype=np.int64).reshape(-1, 3)
        self._raw_a, self._raw_b, d = arr[:, 0], arr[:, 1], arr[:, 2]
        self._cum = np.cumsum(d)  # total delta of spans 0..i
        self._norm_a = self._raw_a + (self._cum - d)
        self._norm_b = self._raw_b + self._cum

    def __bool__(self) -> bool:
        return bool(self.spans)

    @staticmethod
    def _convert(x: np.ndarray, src_a: np.ndarray, src_b: np.ndarray, dst_a: np.ndarray, dst_b: np.ndarray,
                 shift: np.ndarray, inside: str) -> np.ndarray:
        x = np.asarray(x, dtype=np.int64)
        if not len(src_a):
            return x.copy()
        k = np.searchsorted(src_b, x, "right")  # spans ending at or before x
        out = x + np.where(k > 0, shift[np.maximum(k - 1, 0)], 0)
        kk = np.minimum(k, len(src_a) - 1)
        within = (k < len(src_a)) & (src_a[kk] < x)  # strictly inside span k (x < its end)
        if within.any():
            if inside == "invalid":
                out[within] = -1
            else:
                out[within] = (dst_a if inside == "floor" else dst_b)[kk[within]]
        return out

    def to_norm(self, x: np.ndarray, inside: str = "invalid") -> np.ndarray:
        """Normalized positions of raw positions `x`; inside a span: -1, or its start/end ("floor"/"ceil")."""
        return self._convert(x, self._raw_a, self._raw_b, self._norm_a, self._norm_b, self._cum, inside)

    def to_raw(self, y: np.ndarray, inside: str = "invalid") -> np.ndarray:
        """Raw positions of normalized positions `y` (the inverse of `to_norm` outside spans)."""
        return self._convert(y, self._norm_a, self._norm_b, self._raw_a, self._raw_b, -self._cum, inside)

    def norm(self, x: int, inside: str = "invalid") -> int:
        """Scalar `to_norm`."""
        if not self.spans:
            return x
        return int(self.to_norm(np.array([x]), inside)[0])

    def inside(self, x: int) -> tuple[int, int] | None:
        """The raw span (start, end) strictly containing raw position `x`, or None."""
        if not self.spans:
            return None
        k = int(np.searchsorted(self._raw_b, x, "right"))
        if k < len(self.spans) and self._raw_a[k] < x:
            return int(self._raw_a[k]), int(self._raw_b[k])
        return None
