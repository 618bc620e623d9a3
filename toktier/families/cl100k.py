r"""cl100k / Llama-3: GPT-4's pre-tokenizer, in its HF form (Llama-3's tokenizer.json) and its tiktoken form.

Stable-boundary table (rules A-F and the general argument: ``base.py``):

cl100k / Llama-3 (HF form and tiktoken form with possessives, ``\s++$``, ``\s*[\r\n]``)
    ========================================  ==================================
    alternative                               adjacent pairs it can contain
    ========================================  ==================================
    '(?i:s|t|re|ve|m|ll|d)                    '->L, L->L
    [^\r\n\p{L}\p{N}]?\p{L}+                  (W-R|other)->L, L->L
    \p{N}{1,3}                                N->N
    \x20?[^\s\p{L}\p{N}]+[\r\n]*              space->P, P->P, P->R, R->R
    \s*[\r\n]+ | \s+(?!\S) | \s+ | \s++$      W->W
    ========================================  ==================================
    No pair ends in W-R except W->W (A).  Nothing follows a letter except a letter
    (B; M and ' are "other" here).  Digits touch only digits (C, D).  R is followed
    inside a match only by R or whitespace (F), and no match holds L->R (E).  The
    pattern matches every character, so there are no gaps.
"""

from __future__ import annotations

from .base import FamilySpec, GpuRules

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

SPEC = FamilySpec(
    name="cl100k",
    splits={(CL100K_HF,): GpuRules.CL100K_HF, (CL100K_TIKTOKEN,): GpuRules.CL100K_TT},
)
