r"""o200k / gpt-oss: case-aware words with contraction suffixes, digit triples, ``/`` chains.

Stable-boundary table (rules A-F: ``base.py``):

o200k / gpt-oss
    ==========================================================  ====================
    alternative                                                 adjacent pairs
    ==========================================================  ====================
    [^\r\n\p{L}\p{N}]?[Lu Lt Lm Lo M]*[Ll Lm Lo M]+(contraction)?  other->L|M, (L|M)->(L|M),
    [^\r\n\p{L}\p{N}]?[Lu Lt Lm Lo M]+[Ll Lm Lo M]*(contraction)?  (L|M)->', '->L
    \p{N}{1,3}                                                  N->N
    \x20?[^\s\p{L}\p{N}]+[\r\n/]*                               space->P, P->P, P->R|/, R->R|/, /->R
    \s*[\r\n]+ | \s+(?!\S) | \s+                                W->W
    ==========================================================  ====================
    Letters are followed only by letters, marks or the contraction apostrophe
    (B excludes M and ').  Nothing ends in W-R unless it is whitespace (A).  C, D
    as cl100k.  R is followed inside a match only by R, / or whitespace (F, with
    y != / the family's exclusion); nothing holds L->R (E).  No gaps.
"""

from __future__ import annotations

from ..charclass import LO, UP
from .base import FamilySpec, GpuRules

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

SPEC = FamilySpec(
    name="o200k",
    splits={(O200K,): GpuRules.O200K},
    gpu_class_patterns={UP: UPPER_CLASS, LO: LOWER_CLASS},
    slash_after_newline=True,
)
