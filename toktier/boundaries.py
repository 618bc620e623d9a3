"""Stable boundaries of a whole string, and the two helpers every boundary search uses.

`stable_char_positions(tok, text)` lists every character index q (0 < q < len)
that the tokenizer's family certifies as a synchronizing boundary and that no
added-token literal occurrence spans.  With ``standalone=True`` it keeps only
positions where text[:q] may also be tokenized on its own (see
`Family.chunk_stable`), which is what cutting a text into chunks needs.

`char_byte_offsets` (character -> UTF-8 byte offsets) and `LiteralFilter` (drop
positions some literal occurrence spans) are the one copy of each, shared by this
module, the full path's chunk cuts (``fullpath.py``), the session's repair
(``session.py``) and the GPU host models (``gpu/``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .literals import LiteralIndex
    from .registry import FrozenTokenizer


def char_byte_offsets(text: str) -> tuple[np.ndarray, np.ndarray]:
    """(code points uint32[n], byte offset of each char int64[n+1]).

    >>> cps, offs = char_byte_offsets("aé中😀")
    >>> cps.tolist(), offs.tolist()
    ([97, 233, 20013, 128512], [0, 1, 3, 6, 10])
    """
    cps = np.frombuffer(text.encode("utf-32-le"), dtype="<u4")
    clen = 1 + (cps >= 0x80).astype(np.int64) + (cps >= 0x800) + (cps >= 0x10000)
    offs = np.zeros(len(cps) + 1, dtype=np.int64)
    np.cumsum(clen, out=offs[1:])
    return cps, offs


class LiteralFilter:
    """Byte positions of one buffer that no added-token literal occurrence in it spans.

    `buf` starts at byte `origin` of the text; positions are text byte offsets and must
    lie in [origin, origin + len(buf)].  A position is kept when no occurrence [a, b)
    has a < q < b (``LiteralIndex.crossed``); the caller makes `buf` reach far enough
    (the longest literal) on both sides of the positions it asks about.

    >>> from toktier.literals import LiteralIndex
    >>> f = LiteralFilter(LiteralIndex(["<|x|>"]), b"a<|x|>b", origin=10)
    >>> f.keep(np.array([11, 12, 16, 17])).tolist(), f.filter(np.array([11, 12, 16])).tolist()
    ([True, False, True, True], [11, 16])
    """

    __slots__ = ("crossed", "origin")

    def __init__(self, literals: "LiteralIndex", buf: bytes, origin: int = 0) -> None:
        self.crossed = literals.crossed(buf)
        self.origin = origin

    def keep(self, pos: np.ndarray) -> np.ndarray:
        """bool mask over `pos`: True where no literal occurrence spans the position."""
        return ~self.crossed[pos - self.origin] if self.origin else ~self.crossed[pos]

    def filter(self, pos: np.ndarray, byte_pos: np.ndarray | None = None) -> np.ndarray:
        """The positions `pos` that are kept; `byte_pos` gives their byte offsets when `pos` are not."""
        return pos[self.keep(pos if byte_pos is None else byte_pos)]


def stable_char_positions(tok: FrozenTokenizer, text: str, *, standalone: bool = False) -> np.ndarray:
    fam = tok.family_info
    if fam is None or len(text) < 2:
        return np.zeros(0, dtype=np.int64)
    cps, offs = char_byte_offsets(text)
    pred = fam.chunk_stable if standalone else fam.stable
    q = np.flatnonzero(pred(tok.classes, cps[:-1], cps[1:])) + 1
    if tok.literals and len(q):
        q = LiteralFilter(tok.literals, text.encode("utf-8")).filter(q, offs[q])
    return q
