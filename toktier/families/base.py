r"""Tokenizer families and their synchronizing (stable) boundaries: what all families share.

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
One predicate covers all supported families (rules A-F); each family's table
shows why each rule holds for it, and the family-specific exclusions.

Rule A  x not in W, y in W minus R       (end of a non-space run, start of spaces)
Rule B  x in L, y not in L|N|M|W, y != ' (end of a letter run, start of punctuation)
Rule C  x not in N, y in N               (start of a digit run)
Rule D  x in N, y not in N               (end of a digit run)
Rule E  x in L, y in R                   (a letter run ends at a line break)
Rule F  x in R, y not in W               (a line-break run ends; o200k: y != /)

Why E and F hold in every family: R (\r, \n) occurs in a match only inside a
whitespace alternative (whitespace only) or at the *end* of a punctuation match
(``[\r\n]*``; o200k ``[\r\n/]*``, hence its exclusion), and the optional prefix of
every letter alternative excludes \r\n.  So no match holds L->R or R->(non-space);
the match holding x ends at q whatever follows, because y cannot extend it.  These
two pairs are what makes one word per line, separator lines and table rows splice
(each line is otherwise one piece of letters or punctuation).

Each family is one module of this package, holding its exact pre-tokenizer
regex(es), its table, its class patterns, its family-specific predicate bits and
its GPU rule id: ``cl100k.py`` (cl100k / Llama-3), ``qwen.py``, ``o200k.py``
(o200k / gpt-oss), ``deepseek.py``.  ``__init__.py`` lists them.

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

import enum
from dataclasses import dataclass, field

import numpy as np

from ..charclass import HOST_I, K, L, M, N, W

# Class bits of the predicate's uint8 table (`charclass.host_view`).  I (NFC-inert) only in NFC families.
I = HOST_I

CLASS_PATTERNS: dict[int, str] = {L: r"\p{L}", N: r"\p{N}", M: r"\p{M}", W: r"\s"}


class GpuRules(str, enum.Enum):
    """Which rule set of the GPU pre-tokenizer models reproduces a pattern (``gpu/pretok_model.py``,
    ``cuda_src/tt_pretok.cuh``).  Each family module maps its patterns to one; the values are the
    ids the tests, benchmarks and kernel launches have always used.

    >>> GpuRules("qwen") is GpuRules.QWEN, GpuRules.CL100K_TT == "cl100k_tt", f"{GpuRules.O200K}"
    (True, True, 'o200k')
    """

    CL100K_HF = "cl100k_hf"  # cl100k HF form, also Llama-3
    CL100K_TT = "cl100k_tt"  # cl100k tiktoken form (``\s++$``)
    QWEN = "qwen"  # single digits
    O200K = "o200k"
    DEEPSEEK = "deepseek"

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


@dataclass(frozen=True)
class FamilySpec:
    """What a family module declares (its `SPEC`); `__init__.py` collects them."""

    name: str
    #: Each exact pre-tokenizer pattern tuple (application order) the family covers, and the
    #: GPU rule set that models it.
    splits: dict[tuple[str, ...], GpuRules]
    #: Class bits the predicate reads beyond L N M W (probed into the host table).
    class_patterns: dict[int, str] = field(default_factory=dict)
    #: Class bits the family's GPU model reads beyond those (probed when the GPU asks).
    gpu_class_patterns: dict[int, str] = field(default_factory=dict)
    #: Rule B excludes x, y both in K (DeepSeek: CJK/kana runs are isolated pieces).
    exclude_k_pairs: bool = False
    #: Rule F excludes y = "/" (o200k: punctuation matches end with ``[\r\n/]*``).
    slash_after_newline: bool = False


@dataclass(frozen=True)
class Family:
    """A proven family: its name, whether it normalizes with NFC, and class needs."""

    name: str
    nfc: bool
    exclude_k_pairs: bool  # DeepSeek: CJK/kana runs are isolated pieces
    #: The family module's own class bits beyond `CLASS_PATTERNS` (bit, pattern), from its spec.
    extra_patterns: tuple[tuple[int, str], ...] = field(default=(), repr=False, compare=False)
    #: Rule F excludes y = "/" (o200k).
    slash_after_newline: bool = field(default=False, repr=False)

    @property
    def label(self) -> str:
        return f"{self.name}+nfc" if self.nfc else self.name

    def class_patterns(self) -> dict[int, str]:
        """Host-table bits this family's predicate reads, with the patterns that probe them."""
        return {**CLASS_PATTERNS, **dict(self.extra_patterns)}

    def stable(self, classes: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Vectorized predicate: is the boundary between code points x and y stable?

        `classes` is the probed uint8 table; x, y are equal-length uint32 arrays.

        >>> fam = Family("cl100k", nfc=False, exclude_k_pairs=False)
        >>> t = np.zeros(0x110000, dtype=np.uint8); t[ord("a")] = L; t[ord(" ")] = W; t[ord("1")] = N
        >>> fam.stable(t, np.array([ord("a"), ord(" "), ord(","), ord("a")]),
        ...                np.array([ord(" "), ord("a"), ord("a"), ord("1")])).tolist()
        [True, False, False, True]
        >>> t[10] = W  # "\\n" (rules E and F: a line break after a letter, and before non-space)
        >>> fam.stable(t, np.array([ord("a"), 10, 10, ord(",")]), np.array([10, ord("a"), ord(","), 10])).tolist()
        [True, True, True, False]
        """
        cx = classes[x]
        cy = classes[y]
        y_r = (y == 0x0A) | (y == 0x0D)
        rule_a = ((cx & W) == 0) & ((cy & W) != 0) & ~y_r
        rule_b = ((cx & L) != 0) & ((cy & (L | N | M | W)) == 0) & (y != 0x27)
        if self.exclude_k_pairs:
            rule_b &= ~(((cx & K) != 0) & ((cy & K) != 0))
        rule_cd = ((cx & N) != 0) != ((cy & N) != 0)
        rule_e = ((cx & L) != 0) & y_r
        rule_f = ((x == 0x0A) | (x == 0x0D)) & ((cy & W) == 0)
        if self.slash_after_newline:
            rule_f &= y != 0x2F
        ok = rule_a | rule_b | rule_cd | rule_e | rule_f
        if self.nfc:
            ok &= ((cx & I) != 0) & ((cy & I) != 0)
        return ok

    def chunk_stable(self, classes: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Stable *and* safe to tokenize text[:q] standalone (no look-ahead past q).

        Rule C with x in W is excluded: ``\\s+(?!\\S)`` splits a space run before a
        digit differently from one at the end of the text.
        """
        return self.stable(classes, x, y) & ((classes[x] & W) == 0)
