r"""Tokenizer families and their synchronizing (stable) boundaries.

A *family* is recognized from a tokenizer's actual configuration — the exact
pre-tokenizer regex(es), the normalizer, the model flags — never from its name.
For each family we derive, alternative by alternative, which adjacent character
pairs (x, y) no single pre-tokenizer piece can contain.  A position q with
text[q-1] = x and text[q] = y for such a pair is a *stable boundary*:

* every scan places a piece boundary at q (no match can contain both x and y,
  and the gaps between matches cannot either — see each table);
* pieces right of q depend only on text[q:] (the regexes have no look-behind and
  no start anchor);
* pieces left of q depend only on text[:q+1] (the only look-ahead, ``(?!\S)``,
  reads one character past a match, and ``$`` never holds at q < len(text)).

BPE encodes each piece on its own, so for A and A' that agree on [0, q+1) and
B, B' that agree on [q-1, end), token lists splice exactly at q.  Added-token
literals are handled separately (``literals.py``: no occurrence may span q).

Character classes (probed from the reference engine's own regex engine, see
``charclass.py``): ``L`` = \p{L}, ``N`` = \p{N}, ``M`` = \p{M}, ``W`` = \s,
``R`` = {\r, \n}, ``'`` = U+0027, ``K`` = DeepSeek's CJK/kana run class.
One predicate covers all supported families (rules A-D); each family's table
shows why each rule holds for it, and the one family-specific exclusion.

Rule A  x not in W, y in W minus R       (end of a non-space run, start of spaces)
Rule B  x in L, y not in L|N|M|W, y != ' (end of a letter run, start of punctuation)
Rule C  x not in N, y in N               (start of a digit run)
Rule D  x in N, y not in N               (end of a digit run)

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
    (B; M and ' are "other" here).  Digits touch only digits (C, D).  The pattern
    matches every character, so there are no gaps.

Qwen (``\p{N}`` single digits; otherwise as cl100k)  — same table with N->N
    removed; A-D hold.  Qwen3's tokenizer.json adds an NFC normalizer: see below.

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
    as cl100k.  No gaps.

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
       non-W char followed by W-R (A).

NFC families (Qwen3's tokenizer.json: ``NFC`` normalizer, added tokens matched
on the raw text).  NFC(u + v) = NFC(u) + NFC(v) when v starts with a character
that has canonical combining class 0, is unchanged by NFC and is never the
second character of a canonical composition (class ``I``, see
``charclass.nfc_inert_mask``; ASCII, CJK ideographs, most letters and punctuation;
never combining marks, Hangul jamo V/T, or characters NFC changes).  NFC families
additionally require x and y to be in ``I``: then no composition or reordering
crosses q, NFC(text) splits at q, and the characters on both sides of q are
unchanged by normalization, so the pair rules apply to them as written.  The session also checks that each re-tokenized span's
token bytes tile the original text, i.e. that normalization left it unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Class bits in a per-code-point uint8 table.  I (NFC-inert) only in NFC families.
L, N, M, W, K, I = 1, 2, 4, 8, 16, 32

CLASS_PATTERNS: dict[int, str] = {L: r"\p{L}", N: r"\p{N}", M: r"\p{M}", W: r"\s"}

# Exact pre-tokenizer patterns (application order) recognized per family.
_CL100K_HF = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CL100K_TIKTOKEN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
    r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)
_QWEN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_O200K = "|".join(
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
_DEEPSEEK_K = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
_DEEPSEEK = (
    r"\p{N}{1,3}",
    _DEEPSEEK_K,
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
    "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
)

KNOWN_PATTERNS: dict[tuple[str, ...], str] = {
    (_CL100K_HF,): "cl100k",
    (_CL100K_TIKTOKEN,): "cl100k",
    (_QWEN,): "qwen",
    (_O200K,): "o200k",
    _DEEPSEEK: "deepseek",
}


@dataclass(frozen=True)
class Family:
    """A proven family: its name, whether it normalizes with NFC, and class needs."""

    name: str
    nfc: bool
    exclude_k_pairs: bool  # DeepSeek: CJK/kana runs are isolated pieces

    @property
    def label(self) -> str:
        return f"{self.name}+nfc" if self.nfc else self.name

    def class_patterns(self) -> dict[int, str]:
        pats = dict(CLASS_PATTERNS)
        if self.exclude_k_pairs:
            pats[K] = _DEEPSEEK_K.rstrip("+")
        return pats

    def stable(self, classes: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Vectorized predicate: is the boundary between code points x and y stable?

        `classes` is the probed uint8 table; x, y are equal-length uint32 arrays.

        >>> fam = Family("cl100k", nfc=False, exclude_k_pairs=False)
        >>> t = np.zeros(0x110000, dtype=np.uint8); t[ord("a")] = L; t[ord(" ")] = W; t[ord("1")] = N
        >>> fam.stable(t, np.array([ord("a"), ord(" "), ord(","), ord("a")]),
        ...                np.array([ord(" "), ord("a"), ord("a"), ord("1")])).tolist()
        [True, False, False, True]
        """
        cx = classes[x]
        cy = classes[y]
        not_r = (y != 0x0A) & (y != 0x0D)
        rule_a = ((cx & W) == 0) & ((cy & W) != 0) & not_r
        rule_b = ((cx & L) != 0) & ((cy & (L | N | M | W)) == 0) & (y != 0x27)
        if self.exclude_k_pairs:
            rule_b &= ~(((cx & K) != 0) & ((cy & K) != 0))
        rule_cd = ((cx & N) != 0) != ((cy & N) != 0)
        ok = rule_a | rule_b | rule_cd
        if self.nfc:
            ok &= ((cx & I) != 0) & ((cy & I) != 0)
        return ok

    def chunk_stable(self, classes: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Stable *and* safe to tokenize text[:q] standalone (no look-ahead past q).

        Rule C with x in W is excluded: ``\\s+(?!\\S)`` splits a space run before a
        digit differently from one at the end of the text.
        """
        return self.stable(classes, x, y) & ((classes[x] & W) == 0)


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
    return Family(name=name, nfc=normalizer == "nfc", exclude_k_pairs=name == "deepseek"), None
