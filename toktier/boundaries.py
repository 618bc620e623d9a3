"""Stable boundaries of a whole string, for chunked full tokenization and tests.

`stable_char_positions(tok, text)` lists every character index q (0 < q < len)
that the tokenizer's family certifies as a synchronizing boundary and that no
added-token literal occurrence spans.  With ``standalone=True`` it keeps only
positions where text[:q] may also be tokenized on its own (see
`Family.chunk_stable`), which is what cutting a text into chunks needs.
"""

from __future__ import annotations

import numpy as np

from .registry import FrozenTokenizer


def char_byte_offsets(text: str) -> tuple[np.ndarray, np.ndarray]:
    """(code points uint32[n], byte offset of each char int64[n+1])."""
    cps = np.frombuffer(text.encode("utf-32-le"), dtype="<u4")
    clen = 1 + (cps >= 0x80).astype(np.int64) + (cps >= 0x800) + (cps >= 0x10000)
    offs = np.zeros(len(cps) + 1, dtype=np.int64)
    np.cumsum(clen, out=offs[1:])
    return cps, offs


def stable_char_positions(tok: FrozenTokenizer, text: str, *, standalone: bool = False) -> np.ndarray:
    fam = tok.family_info
    if fam is None or len(text) < 2:
        return np.zeros(0, dtype=np.int64)
    cps, offs = char_byte_offsets(text)
    pred = fam.chunk_stable if standalone else fam.stable
    q = np.flatnonzero(pred(tok.classes, cps[:-1], cps[1:])) + 1
    if tok.literals and len(q):
        crossed = tok.literals.crossed(text.encode("utf-8"))
        q = q[~crossed[offs[q]]]
    return q
