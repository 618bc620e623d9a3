r"""DeepSeek (V3/V4 tokenizer.json): three ``Split`` stages, and the one family-specific exclusion.

Stable-boundary table (rules A-F: ``base.py``):

DeepSeek (V3/V4: three Split stages, each applied inside the previous pieces)
    1. ``\p{N}{1,3}``: every digit is matched; gaps contain no digit -> C, D hold.
    2. ``[一-龥぀-ゟ゠-ヿ]+``: runs of K are isolated, so K|non-K edges are always
       boundaries; stage 3 then splits inside a run (``文・`` -> ``文``, ``・``).  K
       contains non-letters (e.g. U+30FB, U+309B) that stage 3 treats as
       punctuation, and a K run is cut off from its neighbours, so the stage-3
       argument for rule B does not carry over unchanged inside runs: **rule B
       excludes x, y both in K** (the family-specific exclusion; conservative).
    3. =============================================  ==========================
       alternative                                    adjacent pairs
       =============================================  ==========================
       [ASCII punct][A-Za-z]+                         P->L, L->L
       [^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+           (W-R|N|other)->(L|M), (L|M)->(L|M)
       \x20?[\p{P}\p{S}]+[\r\n]*                      space->P|S, (P|S)->(P|S), ->R, R->R
       \s*[\r\n]+ | \s+(?!\S) | \s+                   W->W
       gaps (chars no alternative can start at)       never W, L, M, P, S
       =============================================  ==========================
       Letters are followed only by letters or marks (B).  A whitespace char is
       always matched (``\s+``), so gaps never contain W, and no match has a
       non-W char followed by W-R (A).  R is followed inside a match only by R or
       whitespace, and the letter prefix excludes \r\n (E, F); stages 1-2 only add
       boundaries.
"""

from __future__ import annotations

from ..charclass import K, PS
from .base import FamilySpec, GpuRules

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

SPEC = FamilySpec(
    name="deepseek",
    splits={DEEPSEEK: GpuRules.DEEPSEEK},
    class_patterns={K: K_CLASS},
    gpu_class_patterns={PS: PS_CLASS},
    exclude_k_pairs=True,
)
