r"""o200k / gpt-oss: case-aware words with contraction suffixes, digit triples, ``/`` chains.

Stable-boundary table (the general argument: ``base.py``; the derivation: ``derive.py``):

o200k / gpt-oss
    ==========================================================  ====================
    alternative                                                 adjacent pairs
    ==========================================================  ====================
    [^\r\n\p{L}\p{N}]?[Lu Lt Lm Lo M]*[Ll Lm Lo M]+(contraction)?  (X|'|/|sp|ws)->(L|M),
    [^\r\n\p{L}\p{N}]?[Lu Lt Lm Lo M]+[Ll Lm Lo M]*(contraction)?  M->(L|M), (L|M)->(L|M),
                                                                (L|M)->', '->L
    \p{N}{1,3}                                                  N->N
    \x20?[^\s\p{L}\p{N}]+[\r\n/]*                               sp->(X|M|'|/),
                                                                (X|M|'|/)->(X|M|'|/|R),
                                                                R->(R|/)
    \s*[\r\n]+ | \s+(?!\S) | \s+                                W->W
    ==========================================================  ====================
    Letters are followed inside a match only by letters, marks or the contraction
    apostrophe, so L->(N|X|/|W) is a boundary.  Whitespace other than the space and
    \r\n starts only a whitespace run or a word (optional prefix), so ws->(X|'|/) is a
    boundary.  R is followed inside a match only by R, / or whitespace, and nothing
    holds L->R.  No gaps.  Lower-case followed by upper-case letters is a boundary
    too (no word alternative continues [Ll] with [Lu Lt]), but the host class table
    has no case bits, so the predicate cannot see it (see the fine pairs below).

    .. derived stable-pair table (python -m toktier.families.derive --write)

    Kinds (group, fine kind, code points; the representatives are in ``KINDS``):

    L   Lu  Lu, Lt (upper only), not contraction letters
    L   Ll  Ll (lower only), not contraction letters
    L   Lo  Lm, Lo (both upper and lower)
    L   c1  s t m d (and the long s), lower case
    L   C1  S T M D
    L   c2  r v
    L   C2  R V
    L   ce  e
    L   CE  E
    L   cl  l
    L   CL  L
    M   M   \p{M}
    N   N   \p{N}
    X   X   neither \p{L}, \p{M}, \p{N} nor \s, except ' and /
    '   '   the apostrophe
    /   /   the slash
    sp  sp  the space
    R   R   \r and \n
    ws  ws  \s other than the space, \r, \n

    Stable pairs (row: x group, column: y group; + = certified):

         L  M  N  X  '  / sp  R ws
      L  .  .  +  +  .  +  +  +  +
      M  .  .  +  .  .  .  +  .  +
      N  +  +  .  +  +  +  +  +  +
      X  .  .  +  .  .  .  +  .  +
      '  .  .  +  .  .  .  +  .  +
      /  .  .  +  .  .  .  +  .  +
     sp  .  .  +  .  .  .  .  .  .
      R  +  +  +  +  +  .  .  .  .
     ws  .  .  +  +  +  +  .  .  .

    Stable at the fine level but not certified (their group pair holds an unstable fine
    pair; the predicate's groups do not tell the fine kinds apart): Ll->Lu, Ll->C1, Ll->C2,
    Ll->CE, Ll->CL, c1->Lu, c1->C1, c1->C2, c1->CE, c1->CL, c2->Lu, c2->C1, c2->C2, c2->CL,
    ce->Lu, ce->C1, ce->C2, ce->CE, ce->CL, cl->Lu, cl->C1, cl->C2, cl->CE.

    .. end derived table
"""

from __future__ import annotations

from ..charclass import LO, UP, L, M, N, W
from .base import FamilySpec, GpuRules, Kind, KindTable
from .cl100k import DIGITS, SPACES

#: tiktoken form (``tiktoken_ext/openai_public.py``: o200k_base's ``pat_str``).
O200K = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
#: The word alternatives' "upper" and "lower" sets (the GPU model's UP and LO bits).
UPPER_CLASS = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
LOWER_CLASS = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"

#: Groups: letters, marks, digits, other (not L M N W), ', /, the space, \r \n, other whitespace.
#: Fine kinds: the letter cases the word alternatives tell apart, and the contraction letters by case.
KINDS = KindTable(
    groups=("L", "M", "N", "X", "'", "/", "sp", "R", "ws"),
    class_rules=((W, "ws"), (L, "L"), (M, "M"), (N, "N"), (0, "X")),
    special=((0x0A, "R"), (0x0D, "R"), (0x20, "sp"), (0x27, "'"), (0x2F, "/")),
    kinds=(
        Kind("Lu", "L", "AZÉΩЖİ\u212a\U0001d400ǅᾈKQǄ", "Lu, Lt (upper only), not contraction letters"),
        Kind("Ll", "L", "azéßωжǆ\U0001d41axkqǉ", "Ll (lower only), not contraction letters"),
        Kind("Lo", "L", "中あアم한ʰーˆ", "Lm, Lo (both upper and lower)"),
        Kind("c1", "L", "stmd\u017f", "s t m d (and the long s), lower case"),
        Kind("C1", "L", "STMD", "S T M D"),
        Kind("c2", "L", "rv", "r v"),
        Kind("C2", "L", "RV", "R V"),
        Kind("ce", "L", "e", "e"),
        Kind("CE", "L", "E", "E"),
        Kind("cl", "L", "l", "l"),
        Kind("CL", "L", "L", "L"),
        Kind("M", "M", "\u0301\u0651\u093f\u20dd\u3099", r"\p{M}"),
        Kind("N", "N", DIGITS, r"\p{N}"),
        Kind("X", "X", ",.!-_(<|=#…€©\U0001f600\u200d\x00\x1f\x7f\ufeff\ue000\u00ad・\"@\\",
             r"neither \p{L}, \p{M}, \p{N} nor \s, except ' and /"),
        Kind("'", "'", "'", "the apostrophe"),
        Kind("/", "/", "/", "the slash"),
        Kind("sp", "sp", " ", "the space"),
        Kind("R", "R", "\r\n", r"\r and \n"),
        Kind("ws", "ws", SPACES, r"\s other than the space, \r, \n"),
    ),
)

#: Derived (``derive.py``); rows: x group, columns: y group, ``+``: certified.
STABLE_GRID = """
     L  M  N  X  '  / sp  R ws
  L  .  .  +  +  .  +  +  +  +
  M  .  .  +  .  .  .  +  .  +
  N  +  +  .  +  +  +  +  +  +
  X  .  .  +  .  .  .  +  .  +
  '  .  .  +  .  .  .  +  .  +
  /  .  .  +  .  .  .  +  .  +
 sp  .  .  +  .  .  .  .  .  .
  R  +  +  +  +  +  .  .  .  .
 ws  .  .  +  +  +  +  .  .  .
"""

SPEC = FamilySpec(
    name="o200k",
    splits={(O200K,): GpuRules.O200K},
    gpu_class_patterns={UP: UPPER_CLASS, LO: LOWER_CLASS},
    slash_after_newline=True,
    kinds=KINDS,
    stable_grid=STABLE_GRID,
)
