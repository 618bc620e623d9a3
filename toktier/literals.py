"""Added-token literals near a candidate splice point.

The reference extracts added-token literals before pre-tokenization (HF: leftmost-
longest over the raw text, then over the normalized text for `normalized=True`
tokens; tiktoken: a leftmost-first alternation).  Which occurrence wins differs
between engines, but TokTier never needs to know: a splice point q is only
accepted when *no* occurrence of *any* literal spans it (starts before q and ends
after q), in the old text and in the new one.  Then every selection the engine can
make lies wholly left or wholly right of q, the selections right of q are those of
a scan started at q, and q is a hard boundary.

Occurrences are found with greedy trie regexes (one per first byte), each searched
again from one byte after each match start, so overlapping occurrences (a long literal whose pieces
are literals too) are all seen.  The longest occurrence at a start position is
enough: any shorter one at the same start spans a subset of the positions it spans.

>>> idx = LiteralIndex(["<|im_start|>", "<|im", "|>"])
>>> buf = b"ab<|im_start|>cd"
>>> [i for i, c in enumerate(idx.crossed(buf)) if c][:3]
[3, 4, 5]
>>> bool(idx.crossed(buf)[2]), bool(idx.crossed(buf)[14])
(False, False)
"""

from __future__ import annotations

import re
from typing import Iterable

import numpy as np


def _trie_regex(literals: list[bytes]) -> bytes:
    """A regex matching the longest of `literals` at a position (greedy trie)."""
    trie: dict = {}
    for lit in literals:
        node = trie
        for b in lit:
            node = node.setdefault(b, {})
        node[None] = True

    def emit(node: dict) -> bytes:
        terminal = None in node
        branches = [re.escape(bytes([b])) + emit(child) for b, child in sorted(
            ((k, v) for k, v in node.items() if k is not None), key=lambda kv: kv[0])]
        if not branches:
            return b""
        body = branches[0] if len(branches) == 1 else b"(?:" + b"|".join(branches) + b")"
        # Greedy optional: a longer literal is tried before stopping at this one.
        return b"(?:" + body + b")?" if terminal else body

    return emit(trie)


def first_byte_tries(literals: Iterable[bytes]) -> list[re.Pattern]:
    """One greedy trie regex per first byte: `re` finds a literal first byte at memchr
    speed, while one trie over literals with different first bytes is ~10-25x slower."""
    groups: dict[int, list[bytes]] = {}
    for lit in sorted(set(literals)):
        if lit:
            groups.setdefault(lit[0], []).append(lit)
    return [re.compile(_trie_regex(g), re.DOTALL) for g in groups.values()]


#: ASCII whitespace other than the line breaks (\s in every engine's ASCII range).
_SPACE_BEFORE = frozenset(b" \t\x0b\x0c\x1c\x1d\x1e\x1f")


class LiteralIndex:
    """Finds every position that some added-token literal occurrence spans."""

    def __init__(self, literals: Iterable[str]) -> None:
        encoded = {lit.encode("utf-8") for lit in literals if lit}
        self.max_len = max((len(b) for b in encoded), default=0)
        self._tries = first_byte_tries(encoded)

    def __bool__(self) -> bool:
        return bool(self._tries)

    def occurs(self, buf: bytes) -> bool:
        """Whether some literal occurs in `buf` (one search per first byte)."""
        return any(trie.search(buf) is not None for trie in self._tries)

    def crossed(self, buf: bytes) -> np.ndarray:
        r"""bool[len(buf)+1]: True at i when no boundary may be certified at i because of a literal.

        That is inside an occurrence [a, b) (a < i < b), and at an occurrence's start a when the
        character before it may be whitespace other than a line break: the text before a
        literal is pre-tokenized as if it ended there, so a space run's ``\s+(?!\S)`` keeps
        its last character (``"\xa0\xa0<|endoftext|>"``), which a following ``<`` of plain
        text would split off.  (Any non-ASCII character counts as possible whitespace here.)
        """
        out = None  # most windows hold no literal: one search per first byte, nothing else
        for trie in self._tries:  # literals with different first bytes never share a start
            m = trie.search(buf)
            while m is not None:
                a, b = m.span()
                lo = a + 1
                if a > 0 and (buf[a - 1] in _SPACE_BEFORE or buf[a - 1] >= 0x80):
                    lo = a
                if b > lo:
                    if out is None:
                        out = np.zeros(len(buf) + 2, dtype=np.int32)
                    out[lo] += 1
                    out[b] -= 1
                m = trie.search(buf, a + 1)  # the next start, even inside this occurrence
        if out is None:
            return np.zeros(len(buf) + 1, dtype=bool)
        return np.cumsum(out[: len(buf) + 1]) > 0
