r"""Qwen (Qwen2 / Qwen3 tokenizer.json): the cl100k pattern with single-digit numbers.

Stable-boundary table (the cl100k table and argument: ``cl100k.py``; the NFC
condition: ``base.py``; the derivation: ``derive.py``):

Qwen (``\p{N}`` single digits; otherwise as cl100k) — the same alternatives with
    N->N removed: every digit is a piece of its own, so N->N is a boundary too.
    Qwen3's tokenizer.json adds an NFC normalizer: a pair is certified only when
    both characters are NFC-inert (``base.py``).

    .. derived stable-pair table (python -m toktier.families.derive --write)

    Kinds (group, fine kind, code points; the representatives are in ``KINDS``):

    L   L   letters other than the contraction letters
    L   c1  s t m d (any case, and the long s): a contraction suffix alone
    L   c2  r v: the first letter of 're 've
    L   ce  e: the second letter of 're 've
    L   cl  l: 'll
    N   N   \p{N}
    X   X   neither \p{L}, \p{N} nor \s (marks included), except '
    X   '   the apostrophe
    sp  sp  the space
    R   R   \r and \n
    ws  ws  \s other than the space, \r, \n

    Stable pairs (row: x group, column: y group; + = certified):

         L  N  X sp  R ws
      L  .  +  +  +  +  +
      N  +  +  +  +  +  +
      X  .  +  .  +  .  +
     sp  .  +  .  .  .  .
      R  +  +  +  .  .  .
     ws  .  +  +  .  .  .

    .. end derived table
"""

from __future__ import annotations

from .base import FamilySpec, GpuRules
from .cl100k import KINDS

QWEN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

#: Derived (``derive.py``); rows: x group, columns: y group, ``+``: certified.
STABLE_GRID = """
     L  N  X sp  R ws
  L  .  +  +  +  +  +
  N  +  +  +  +  +  +
  X  .  +  .  +  .  +
 sp  .  +  .  .  .  .
  R  +  +  +  .  .  .
 ws  .  +  +  .  .  .
"""

SPEC = FamilySpec(name="qwen", splits={(QWEN,): GpuRules.QWEN}, kinds=KINDS, stable_grid=STABLE_GRID)
