r"""Qwen (Qwen2 / Qwen3 tokenizer.json): the cl100k pattern with single-digit numbers.

Stable-boundary table (rules A-F: ``base.py``; the cl100k table: ``cl100k.py``; the
NFC condition: ``base.py``):

Qwen (``\p{N}`` single digits; otherwise as cl100k)  — same table with N->N
    removed; A-F hold.  Qwen3's tokenizer.json adds an NFC normalizer: see below.
"""

from __future__ import annotations

from .base import FamilySpec, GpuRules

QWEN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

SPEC = FamilySpec(name="qwen", splits={(QWEN,): GpuRules.QWEN})
