"""Spans an NFC normalizer changes, and the map between raw and normalized byte positions.

NFC families (Qwen3's tokenizer.json) tokenize the *normalized* text, so where the
normalizer rewrites bytes (a decomposed ``e\\u0301``, a compatibility character, Hangul
jamo) the tokens tile NFC(text), not text.  A span here is a run of non-NFC-inert
characters with the inert character before it (class ``I``, ``charclass.nfc_inert_mask``):
NFC(text) is the concatenation of NFC of the pieces between span edges, so each span can
be normalized on its own and only those the normalizer actually changes are kept, as
``(raw start, raw end, byte delta)``.

`SpanMap` converts positions between the raw text and its normalized form.  A position
strictly inside a span has no counterpart on the other side (the normalizer rewrote those
bytes); every position between two NFC-inert characters lies outside all spans, which is
why the session's stable boundaries (both sides inert in NFC families) always convert.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .boundaries import char_byte_offsets
from .families import I

if TYPE_CHECKING:
    from .registry import FrozenTokenizer

Span = tuple[int, int, int]  # (raw start, raw end, normalized length - raw length), bytes

#: More candidate spans than this and a text is left unspliceable: normalizing each span
#: separately would cost more than the full path it saves.
MAX_NFC_SPANS = 4096


def nfc_spans(tok: "FrozenTokenizer", text: bytes) -> tuple[list[Span], bytes] | None:
    """The spans of `text` the tokenizer's normalizer changes, and the text with them normalized.

    A candidate span covers a run of non-NFC-inert characters, starting at the inert
    character before it and ending before the next inert one.  Returns the spans the
    engine's normalizer changes (sorted) and the piecewise-normalized text, or None when
    there are none or more than `MAX_NFC_SPANS` candidates.
    """
    s = text.decode("utf-8")
    cps = np.frombuffer(s.encode("utf-32-le"), dtype="<u4")
    inert = (tok.classes[cps] & I) != 0
    bad = np.flatnonzero(~inert)
    if not len(bad) or tok.engine.normalize(s) == s:  # one call settles most texts (Thai, Hindi: marks NFC keeps)
        return None
    # Each non-inert character's span: [the inert character before it, the next inert one).
    inert_idx = np.flatnonzero(inert)
    if len(inert_idx):
        k = np.searchsorted(inert_idx, bad)  # inert characters before each bad one
        starts = np.where(k > 0, inert_idx[np.maximum(k - 1, 0)], 0)
        ends = np.where(k < len(inert_idx), inert_idx[np.minimum(k, len(inert_idx) - 1)], len(cps))
    else:
        starts, ends = np.zeros_like(bad), np.full_like(bad, len(cps))
    spans: list[list[int]] = []
    for a, b in zip(starts.tolist(), ends.tolist()):
        if spans and a <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], b)
        else:
            spans.append([a, b])
        if len(spans) > MAX_NFC_SPANS:
            return None
    _, offs = char_byte_offsets(s)
    out: list[Span] = []
    parts: list[bytes] = []
    prev = 0
    for a, b in spans:
        raw = s[a:b]
        norm = tok.engine.normalize(raw)
        if norm == raw:
            continue
        ra, rb = int(offs[a]), int(offs[b])
        nb = norm.encode("utf-8")
        parts += [text[prev:ra], nb]
        prev = rb
        out.append((ra, rb, len(nb) - (rb - ra)))
    if not out:
        return None
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
