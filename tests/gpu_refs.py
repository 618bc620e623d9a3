"""Reference piece splitters for the GPU host-model tests.

tiktoken has no piece API, so the tiktoken-form patterns (cl100k with ``\\s++$``,
o200k) are run through the ``regex`` module (tiktoken's own educational
reference uses it), and the host model is given a class table probed from the
``regex`` module itself: the test checks the derivation of the rules, with both
sides on the same Unicode tables.  The production tables (probed from tiktoken)
are checked at the ID level against tiktoken.
"""

from __future__ import annotations

import functools

import numpy as np
import regex

from toktier.engines import all_code_points
from toktier.charclass import probe_table
from toktier.families import TABLE_PATTERNS


class RegexProber:
    """`probe_class` through the `regex` module (same interface as the engines)."""

    @functools.cached_property
    def _all(self) -> tuple[np.ndarray, str]:
        cps = all_code_points()
        return cps, cps.astype("<u4").tobytes().decode("utf-32-le")

    def probe_class(self, pattern: str) -> np.ndarray:
        cps, s = self._all
        mask = np.zeros(0x110000, dtype=bool)
        hits = [m.start() for m in regex.finditer(pattern, s)]
        mask[cps[np.array(hits, dtype=np.int64)]] = True
        return mask


@functools.lru_cache(maxsize=1)
def regex_table() -> np.ndarray:
    return probe_table(RegexProber(), TABLE_PATTERNS, folds=True)


@functools.lru_cache(maxsize=8)
def compiled(pattern: str):
    return regex.compile(pattern)


def regex_pieces(pattern: str, text: str) -> list[tuple[int, int]]:
    """Spans of the pattern's matches; unmatched stretches become pieces too (HF Split Isolated)."""
    out, pos = [], 0
    for m in compiled(pattern).finditer(text):
        if m.start() > pos:
            out.append((pos, m.start()))
        if m.end() > m.start():
            out.append(m.span())
        pos = m.end()
    if pos < len(text):
        out.append((pos, len(text)))
    return out
