"""Tokenizer families: one module per family, listed here.

A family module (``cl100k.py``, ``qwen.py``, ``o200k.py``, ``deepseek.py``) holds
the family's exact pre-tokenizer regex(es), its stable-boundary table (its module
docstring), its class patterns, its family-specific predicate bits and its GPU rule
id, and declares them in one `FamilySpec` (``SPEC``), as tiktoken_ext plugins
return constructor kwargs.  What all families share (the predicate over the derived
stable-pair grids, the NFC condition, `Family`, `GpuRules`) is in ``base.py``; the derivation
is ``derive.py``, cuts inside long pieces ``glue.py``; the registry and
`detect_family` over it are here.

A family is recognized from the exact pattern tuple, never from a name:

>>> from toktier.families import cl100k
>>> detect_family("none", (cl100k.CL100K_TIKTOKEN,), True, ())
(Family(name='cl100k', nfc=False, exclude_k_pairs=False), None)
>>> gpu_rules((cl100k.CL100K_TIKTOKEN,)), gpu_rules(("x",))
(<GpuRules.CL100K_TT: 'cl100k_tt'>, None)
>>> sorted(FAMILIES)
['cl100k', 'deepseek', 'o200k', 'qwen']
"""

from __future__ import annotations

from . import cl100k, deepseek, o200k, qwen
from .base import CLASS_PATTERNS, I, K, L, M, N, W, Family, FamilySpec, GpuRules

FAMILIES: dict[str, FamilySpec] = {m.SPEC.name: m.SPEC for m in (cl100k, qwen, o200k, deepseek)}

# Exact pre-tokenizer patterns (application order) recognized per family.
KNOWN_PATTERNS: dict[tuple[str, ...], str] = {
    splits: spec.name for spec in FAMILIES.values() for splits in spec.splits
}
_GPU_RULES: dict[tuple[str, ...], GpuRules] = {
    splits: rules for spec in FAMILIES.values() for splits, rules in spec.splits.items()
}

#: Class-table bits the GPU models read beyond a family's own (`charclass` layout): every
#: family's, so one table serves every rule set.
GPU_CLASS_PATTERNS: dict[int, str] = {b: p for spec in FAMILIES.values() for b, p in spec.gpu_class_patterns.items()}
#: Every pattern bit of the class table (`charclass` layout), e.g. for a test's own prober.
TABLE_PATTERNS: dict[int, str] = {
    **CLASS_PATTERNS, **{b: p for spec in FAMILIES.values() for b, p in spec.class_patterns.items()},
    **GPU_CLASS_PATTERNS,
}

# The historical private names (tests and tools import them).
_CL100K_HF = cl100k.CL100K_HF
_CL100K_TIKTOKEN = cl100k.CL100K_TIKTOKEN
_QWEN = qwen.QWEN
_O200K = o200k.O200K
_DEEPSEEK_K = deepseek.K_CLASS + "+"
_DEEPSEEK = deepseek.DEEPSEEK

__all__ = ["CLASS_PATTERNS", "FAMILIES", "GPU_CLASS_PATTERNS", "KNOWN_PATTERNS", "TABLE_PATTERNS", "Family",
           "FamilySpec", "GpuRules", "I", "K", "L", "M", "N", "W", "detect_family", "gpu_rules"]


def gpu_rules(split_patterns: tuple[str, ...]) -> GpuRules | None:
    """The GPU rule set modelling these exact pre-tokenizer patterns, or None."""
    return _GPU_RULES.get(tuple(split_patterns))


def detect_family(normalizer: str, split_patterns: tuple[str, ...], byte_level: bool,
                  problems: tuple[str, ...]) -> tuple[Family | None, str | None]:
    """Return (family, None) when proven, else (None, reason)."""
    if problems:
        return None, "; ".join(problems)
    if not byte_level:
        return None, "not a byte-level BPE: token bytes do not tile the text"
    name = KNOWN_PATTERNS.get(tuple(split_patterns))
    if name is None:
        return None, "pre-tokenizer pattern(s) match no family with a derived stable-boundary rule"
    if normalizer not in ("none", "nfc"):
        return None, f"normalizer {normalizer} has no proven splice rule"
    spec = FAMILIES[name]
    return Family(name=name, nfc=normalizer == "nfc", exclude_k_pairs=spec.exclude_k_pairs,
                  extra_patterns=tuple(sorted(spec.class_patterns.items())),
                  slash_after_newline=spec.slash_after_newline, kinds=spec.kinds,
                  stable_grid=spec.stable_grid), None
