r"""cl100k / Llama-3: GPT-4's pre-tokenizer, in its HF form (Llama-3's tokenizer.json) and its tiktoken form.

Stable-boundary table (the general argument and the NFC condition: ``base.py``; the
derivation: ``derive.py``):

cl100k / Llama-3 (HF form and tiktoken form with possessives, ``\s++$``, ``\s*[\r\n]``)
    ========================================  ==================================
    alternative                               adjacent pairs it can contain
    ========================================  ==================================
    '(?i:s|t|re|ve|m|ll|d)                    '->L, L->L
    [^\r\n\p{L}\p{N}]?\p{L}+                  (X|'|sp|ws)->L, L->L
    \p{N}{1,3}                                N->N
    \x20?[^\s\p{L}\p{N}]+[\r\n]*              sp->(X|'), (X|')->(X|'), (X|')->R, R->R
    \s*[\r\n]+ | \s+(?!\S) | \s+ | \s++$      W->W
    ========================================  ==================================
    X is everything neither letter, digit nor whitespace (marks included: the pattern
    never names \p{M}).  A letter is followed inside a match only by a letter, so
    L->(N|X|'|W) is always a boundary; whatever precedes it, the letter run ends at
    the letter (the contraction alternative reads the letters after ' only).  A digit
    touches only digits.  Whitespace other than the space and \r\n can start no
    match but a whitespace run or a letter run (the letter alternative's optional
    prefix), so ws->(X|') and ws->N are boundaries.  R is followed inside a match only
    by R or whitespace, and no match holds L->R.  The pattern matches every
    character, so there are no gaps.  Left of such a boundary only ``(?!\S)`` reads
    past a match end, one character: the pieces there depend on text[:q+1].

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
      N  +  .  +  +  +  +
      X  .  +  .  +  .  +
     sp  .  +  .  .  .  .
      R  +  +  +  .  .  .
     ws  .  +  +  .  .  .

    .. end derived table
"""

from __future__ import annotations

from ..charclass import L, N, W
from .base import FamilySpec, GpuRules, Kind, KindTable

#: HF form (``Split`` pre-tokenizer of Llama-3's tokenizer.json).
CL100K_HF = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
#: tiktoken form (``tiktoken_ext/openai_public.py``: cl100k_base's ``pat_str``).
CL100K_TIKTOKEN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
    r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)

#: Representatives shared with Qwen (the same pattern up to digit runs).
LETTERS = "aZéßΩж中あアم한ǅʰİ\u212a\U0001d400xkKQ"
DIGITS = "07٣½Ⅻ①\U0001d7d8"
OTHER = ",.!-_(<|=#…€©\U0001f600\u200d\x00\x1f\x7f\ufeff\ue000\u00ad/・\u0301\u0651\u093f\u20dd\u3099\"@"
SPACES = "\t\x0b\x0c\x85\xa0\u1680\u2000\u2028\u2029\u202f\u3000"

#: Groups: letters, digits, other (not L N W), the space, \r \n, other whitespace.  Fine kinds:
#: the contraction letters (``(?i)``: ``ſ`` is an s) apart from the other letters, ' apart from X.
KINDS = KindTable(
    groups=("L", "N", "X", "sp", "R", "ws"),
    class_rules=((W, "ws"), (L, "L"), (N, "N"), (0, "X")),
    special=((0x0A, "R"), (0x0D, "R"), (0x20, "sp")),
    kinds=(
        Kind("L", "L", LETTERS, "letters other than the contraction letters"),
        Kind("c1", "L", "stmdSTMD\u017f", "s t m d (any case, and the long s): a contraction suffix alone"),
        Kind("c2", "L", "rvRV", "r v: the first letter of 're 've"),
        Kind("ce", "L", "eE", "e: the second letter of 're 've"),
        Kind("cl", "L", "lL", "l: 'll"),
        Kind("N", "N", DIGITS, r"\p{N}"),
        Kind("X", "X", OTHER, r"neither \p{L}, \p{N} nor \s (marks included), except '"),
        Kind("'", "X", "'", "the apostrophe"),
        Kind("sp", "sp", " ", "the space"),
        Kind("R", "R", "\r\n", r"\r and \n"),
        Kind("ws", "ws", SPACES, r"\s other than the space, \r, \n"),
    ),
)

#: Derived (``derive.py``); rows: x group, columns: y group, ``+``: certified.
STABLE_GRID = """
     L  N  X sp  R ws
  L  .  +  +  +  +  +
  N  +  .  +  +  +  +
  X  .  +  .  +  .  +
 sp  .  +  .  .  .  .
  R  +  +  +  .  .  .
 ws  .  +  +  .  .  .
"""

SPEC = FamilySpec(
    name="cl100k",
    splits={(CL100K_HF,): GpuRules.CL100K_HF, (CL100K_TIKTOKEN,): GpuRules.CL100K_TT},
    kinds=KINDS,
    stable_grid=STABLE_GRID,
)
