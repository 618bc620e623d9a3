r"""DeepSeek (V3/V4 tokenizer.json): three ``Split`` stages, each applied inside the previous pieces.

Stable-boundary table (the general argument: ``base.py``; the derivation: ``derive.py``):

DeepSeek (V3/V4: three Split stages, each applied inside the previous pieces)
    1. ``\p{N}{1,3}``: every digit is matched; gaps contain no digit: N->(not N) and
       (not N)->N are boundaries.
    2. ``[一-龥぀-ゟ゠-ヿ]+``: runs of K are isolated, so every K|non-K edge is a
       boundary; stage 3 then splits inside a run (``文・`` -> ``文``, ``・``).  K
       holds letters (KL), the two combining kana marks (KM) and non-letters (KX:
       U+30FB, U+309B, ... and unassigned code points) that stage 3 treats as
       punctuation or as "other".
    3. =============================================  ==========================
       alternative                                    adjacent pairs
       =============================================  ==========================
       [ASCII punct][A-Za-z]+                         P->A, A->A
       [^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+           (ws|sp|N|other)->(L|M), (L|M)->(L|M)
       \x20?[\p{P}\p{S}]+[\r\n]*                      sp->P|S, (P|S)->(P|S), ->R, R->R
       \s*[\r\n]+ | \s+(?!\S) | \s+                   W->W
       gaps (chars no alternative can start at)       other->other
       =============================================  ==========================
       Letters are followed only by letters or marks.  A whitespace char is always
       matched (``\s+``), so gaps never contain W.  R is followed inside a match only
       by R or whitespace, and the letter prefix excludes \r\n.  P|S can be no
       letter's prefix, so ASCII punctuation before a non-ASCII letter (not
       ``[A-Za-z]``) is a boundary.  Here A = ASCII letters, P = ASCII punctuation and
       symbols, X = everything else that is neither L, M, N nor W (P|S and "other"
       alike: the host class table has no P|S bit).

    .. derived stable-pair table (python -m toktier.families.derive --write)

    Kinds (group, fine kind, code points; the representatives are in ``KINDS``):

    A   A   [A-Za-z]
    L   L   other letters, not in K
    KL  KL  letters in K
    KM  KM  marks in K
    KX  KP  \p{P}|\p{S} in K
    KX  KO  the rest of K (unassigned)
    M   M   \p{M}, not in K
    N   N   \p{N}
    P   P   ASCII punctuation and symbols
    X   XP  other \p{P}|\p{S}, not in K
    X   XO  neither L M N W P S (controls, format, private use)
    sp  sp  the space
    R   R   \r and \n
    ws  ws  \s other than the space, \r, \n

    Stable pairs (row: x group, column: y group; + = certified):

         A  L KL KM KX  M  N  P  X sp  R ws
      A  .  .  +  +  +  .  +  +  +  +  +  +
      L  .  .  +  +  +  .  +  +  +  +  +  +
     KL  +  +  .  .  +  +  +  +  +  +  +  +
     KM  +  +  .  .  +  +  +  +  +  +  +  +
     KX  +  +  .  .  .  +  +  +  +  +  +  +
      M  .  .  +  +  +  .  +  +  +  +  +  +
      N  +  +  +  +  +  +  .  +  +  +  +  +
      P  .  +  +  +  +  +  +  .  .  +  .  +
      X  .  .  +  +  +  .  +  .  .  +  .  +
     sp  .  .  +  +  +  .  +  .  .  .  .  .
      R  +  +  +  +  +  +  +  +  +  .  .  .
     ws  .  .  +  +  +  .  +  +  +  .  .  .

    Stable at the fine level but not certified (their group pair holds an unstable fine
    pair; the predicate's groups do not tell the fine kinds apart): KP->KL, KP->KM, KP->KO,
    KO->KP, P->XO, XP->A, XP->L, XP->M, XP->XO, XO->P, XO->XP, XO->R, sp->XO.

    .. end derived table
"""

from __future__ import annotations

from ..charclass import PS, K, L, M, N, W
from .base import FamilySpec, GpuRules, Kind, KindTable
from .cl100k import DIGITS, SPACES

#: Class ``K``: the CJK ideographs, hiragana and katakana of stage 2 (without its ``+``).
K_CLASS = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]"
#: Stage 3's punctuation/symbol set (the GPU model's PS bit).
PS_CLASS = r"[\p{P}\p{S}]"

DEEPSEEK = (
    r"\p{N}{1,3}",
    K_CLASS + "+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
    "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
)

_ASCII_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_ASCII_PUNCT = "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"

#: Groups: ASCII letters, other letters, K letters / marks / non-letters, marks, digits, ASCII
#: punctuation, other (not L M N W), the space, \r \n, other whitespace.
#: Fine kinds: K's non-letters and the other code points split into P|S and the rest.
KINDS = KindTable(
    groups=("A", "L", "KL", "KM", "KX", "M", "N", "P", "X", "sp", "R", "ws"),
    class_rules=((W, "ws"), (K | L, "KL"), (K | M, "KM"), (K, "KX"), (L, "L"), (M, "M"), (N, "N"), (0, "X")),
    special=tuple((ord(c), "A") for c in _ASCII_LETTERS) + tuple((ord(c), "P") for c in _ASCII_PUNCT)
    + ((0x0A, "R"), (0x0D, "R"), (0x20, "sp")),
    kinds=(
        Kind("A", "A", "azAZsqKk", "[A-Za-z]"),
        Kind("L", "L", "éßΩж한ǅʰİ\u212aم\U0001d400\u017fª", "other letters, not in K"),
        Kind("KL", "KL", "中文あアーヿ\u4e00\u9fa5ぁ", "letters in K"),
        Kind("KM", "KM", "\u3099\u309a", "marks in K"),
        Kind("KP", "KX", "・゠゛゜", r"\p{P}|\p{S} in K"),
        Kind("KO", "KX", "\u3040\u3097\u3098", "the rest of K (unassigned)"),
        Kind("M", "M", "\u0301\u0651\u093f\u20dd", r"\p{M}, not in K"),
        Kind("N", "N", DIGITS, r"\p{N}"),
        Kind("P", "P", _ASCII_PUNCT, "ASCII punctuation and symbols"),
        Kind("XP", "X", "…€©\U0001f600、。«¡¿‐", r"other \p{P}|\p{S}, not in K"),
        Kind("XO", "X", "\x00\x1f\x7f\u200d\ufeff\ue000\u00ad", r"neither L M N W P S (controls, format, private use)"),
        Kind("sp", "sp", " ", "the space"),
        Kind("R", "R", "\r\n", r"\r and \n"),
        Kind("ws", "ws", SPACES, r"\s other than the space, \r, \n"),
    ),
)

#: Derived (``derive.py``); rows: x group, columns: y group, ``+``: certified.
STABLE_GRID = """
     A  L KL KM KX  M  N  P  X sp  R ws
  A  .  .  +  +  +  .  +  +  +  +  +  +
  L  .  .  +  +  +  .  +  +  +  +  +  +
 KL  +  +  .  .  +  +  +  +  +  +  +  +
 KM  +  +  .  .  +  +  +  +  +  +  +  +
 KX  +  +  .  .  .  +  +  +  +  +  +  +
  M  .  .  +  +  +  .  +  +  +  +  +  +
  N  +  +  +  +  +  +  .  +  +  +  +  +
  P  .  +  +  +  +  +  +  .  .  +  .  +
  X  .  .  +  +  +  .  +  .  .  +  .  +
 sp  .  .  +  +  +  .  +  .  .  .  .  .
  R  +  +  +  +  +  +  +  +  +  .  .  .
 ws  .  .  +  +  +  .  +  +  +  .  .  .
"""

SPEC = FamilySpec(
    name="deepseek",
    splits={DEEPSEEK: GpuRules.DEEPSEEK},
    class_patterns={K: K_CLASS},
    gpu_class_patterns={PS: PS_CLASS},
    exclude_k_pairs=True,
    kinds=KINDS,
    stable_grid=STABLE_GRID,
)
