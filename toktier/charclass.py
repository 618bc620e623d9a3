r"""Per-code-point character classes probed out of the reference engine.

Python's `unicodedata` is not the reference: its Unicode version differs from the
one compiled into Oniguruma (HF `tokenizers`) or the Rust `regex` crate
(tiktoken), and ~10K code points change class between versions.  So each class
bit is computed by running the class regex through the engine itself over every
code point, and the table is cached on disk keyed by the engine (`class_key`: regex
engine, version, normalizer; not the vocabulary, so files of one engine share it).

One table per tokenizer, one probe (`probe_table`), one disk cache (`class_table`:
``$TOKTIER_CACHE_DIR/classes/<engine class_key>-<TABLE_VERSION>.npz``).  The table is
``uint32[0x110000]``, one word per code point; which pattern sets each bit is declared
by the families (``families/``), the bit positions here:

====== ================================================ ==============================
bits   meaning (every bit probed from the engine)       read by
====== ================================================ ==============================
0      L  = ``\p{L}``                                   predicate, GPU
1      N  = ``\p{N}``                                   predicate, GPU
2      M  = ``\p{M}``                                   predicate, GPU
3      W  = ``\s``                                      predicate, GPU
4      K  = DeepSeek's CJK/kana run class               predicate (DeepSeek), GPU
5      UP = ``[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]`` (o200k)  GPU
6      LO = ``[\p{Ll}\p{Lm}\p{Lo}\p{M}]`` (o200k)        GPU
7      PS = ``[\p{P}\p{S}]`` (DeepSeek)                 GPU
8-15   contraction fold: the ASCII letter c in          GPU
       ``sdmtrevl`` with ``(?i:c)`` matching this code
       point (``S``, ``ſ`` -> ``s``), else 0
16     NFC_INERT (`nfc_inert_mask`; NFC families only)  predicate (NFC families)
====== ================================================ ==============================

The GPU kernels read bits 0-15 (``cuda_src/tt_common.cuh`` masks the rest); the
stable-boundary predicate reads the ``uint8`` *host view* (`host_view`): bits 0-4
as above and NFC_INERT as bit 5 (``families.I``).  A request probes only the bits
its caller names; the cache records which bits were probed, so the GPU's bits
(about 2 s of probing for an HF engine) are added to the cached table the first
time the GPU path asks for them, never by a process that only splices.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Protocol

import numpy as np

L, N, M, W, K = 1, 2, 4, 8, 16
UP, LO, PS = 1 << 5, 1 << 6, 1 << 7
FOLD_SHIFT = 8
FOLD = 0xFF << FOLD_SHIFT
NFC_INERT = 1 << 16
CONTRACTION_LETTERS = "sdmtrevl"  # the letters of the contraction suffixes 's 't 're 've 'm 'll 'd
TABLE_VERSION = "v2"

# Host view (uint8): table bit -> host bit.  I (NFC-inert) moves from bit 16 to bit 5.
HOST_I = 1 << 5
_TABLE_BITS = {L: L, N: N, M: M, W: W, K: K, HOST_I: NFC_INERT}
assert NFC_INERT >> 11 == HOST_I


class _Prober(Protocol):
    def probe_class(self, pattern: str) -> np.ndarray: ...


def cache_dir() -> Path:
    """`$TOKTIER_CACHE_DIR`, else `~/.cache/toktier`."""
    return Path(os.environ.get("TOKTIER_CACHE_DIR") or Path.home() / ".cache" / "toktier")


#: Hangul vowel and trailing jamo: they compose with the syllable before them by arithmetic, with
#: no decomposition entry to show it.
_HANGUL_VT = frozenset(range(0x1161, 0x1176)) | frozenset(range(0x11A8, 0x11C3))


def nfc_inert_mask(normalize) -> np.ndarray:
    """Code points c at which NFC text may be cut: NFC(u + c + v) == NFC(u) + c + NFC(v)'s parts.

    c qualifies when it and the first character of its canonical decomposition
    have combining class 0 and are never the second character of a canonical
    composition (including Hangul V/T jamo), NFC leaves c unchanged, c is assigned
    in Python's Unicode database, and the reference engine's own normalizer leaves
    it unchanged too.  This is ICU's
    "boundary before" condition, made stricter.  Unicode's normalization stability
    policy (decompositions and combining classes of assigned characters never
    change; no new compositions of existing characters) makes the properties read
    from Python's older database valid for the engine's newer one; characters
    Python does not know are excluded.
    """
    import unicodedata

    second: set[int] = set(_HANGUL_VT)
    mask = np.zeros(0x110000, dtype=bool)
    first_of: dict[int, int] = {}
    for cp in range(0x110000):
        if 0xD800 <= cp <= 0xDFFF:
            continue
        ch = chr(cp)
        dec = unicodedata.decomposition(ch)
        if dec and not dec.startswith("<") and len(dec.split()) == 2:
            second.add(int(dec.split()[1], 16))
        if unicodedata.combining(ch) or unicodedata.category(ch) == "Cn":
            continue
        if unicodedata.normalize("NFC", ch) != ch:
            continue  # singletons, exclusions: never in NFC text
        d0 = unicodedata.normalize("NFD", ch)[0]
        if unicodedata.combining(d0):
            continue
        mask[cp] = True
        first_of[cp] = ord(d0)
    for cp, d0 in first_of.items():
        if cp in second or d0 in second:
            mask[cp] = False  # could compose with the character before it
    cands = np.flatnonzero(mask)
    # Ask the engine: every candidate must come back unchanged.  They are all
    # boundaries by the properties above, so one normalize of their concatenation
    # answers for all of them unless something disagrees; then check one by one.
    step = 4096
    for lo in range(0, len(cands), step):
        chunk = cands[lo : lo + step]
        text = chunk.astype("<u4").tobytes().decode("utf-32-le")
        if normalize(text) != text:
            for cp in chunk:
                if normalize(chr(cp)) != chr(cp):
                    mask[cp] = False
    return mask


#: Code points below this hold every character with a canonical decomposition or a nonzero
#: combining class in Python's Unicode database (the last: U+2FA1D, a CJK compatibility ideograph).
_NORMALIZATION_RANGE = 0x30000


def nfc_mark_table(normalize) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The compiled lane's NFC quick check data (``repair.hpp``, `Lane::nfc_stable`): (table,
    maybe, pairs).

    `table`, uint8[0x110000]: the canonical combining class of a mark NFC leaves alone in canonical
    order, else 0xFF.  A mark qualifies when NFC leaves it unchanged on its own (no singleton or
    non-starter decomposition), Python's Unicode database knows it, and the reference engine's own
    normalizer leaves it unchanged after a private-use character (which composes with nothing).
    Marks with a nonzero class that are never the second character of a canonical decomposition
    never compose with what precedes them (NFC_Quick_Check Yes).  The others (`maybe`: Devanagari
    nukta, Bengali and Tamil vowel signs, combining accents) compose with the character before
    them exactly when that character is a starter and the two are one of `pairs` (uint64,
    ``first << 21 | second``, sorted: the canonical decompositions NFC recomposes, by Python's
    normalizer or the engine's); the lane takes one only right after an NFC-inert character that
    it does not compose with.  Hangul vowel and trailing jamo compose by arithmetic, not by pairs:
    they never qualify.

    Then a text of NFC-inert characters (`nfc_inert_mask`) and such marks, each run of marks in
    nondecreasing class order, is its own NFC (UAX #15's quick check answering yes, its "maybe"
    answers decided by the character before).  Python's Unicode database and the engine's may
    differ in age either way (the engine here leaves U+11935 U+11930 alone, Python composes
    them): the stability policy keeps the classes and decompositions of a character both know
    the same, a character Python does not know never qualifies, and one only the engine does
    not know is to it a starter that composes with nothing, which splits runs into parts that
    stay in order and composes nothing the check let through.  Inert characters' entries are
    never read (the lane tests the inert bit first).
    """
    import unicodedata

    decomposed: list[tuple[int, int]] = []
    marks: list[tuple[int, int]] = []
    for cp in range(_NORMALIZATION_RANGE):
        if 0xD800 <= cp <= 0xDFFF:
            continue
        ch = chr(cp)
        dec = unicodedata.decomposition(ch)
        if dec and not dec.startswith("<") and len(dec.split()) == 2:
            first, second = (int(x, 16) for x in dec.split())
            decomposed.append((first, second))
        if cp in _HANGUL_VT or unicodedata.category(ch) == "Cn" or unicodedata.normalize("NFC", ch) != ch:
            continue
        if unicodedata.category(ch).startswith("M") or unicodedata.combining(ch):
            marks.append((cp, unicodedata.combining(ch)))
    seconds = {b for _, b in decomposed}
    # the lane reads a mark's class from the table for every non-inert mark: a starter mark
    # (class 0) qualifies only as a "maybe" one (others of class 0 that are not inert are not
    # certain to be starters NFC leaves alone)
    kept = [(cp, ccc) for cp, ccc in marks if ccc or cp in seconds]
    probe = "".join("\ue000" + chr(cp) for cp, _ in kept)
    if normalize(probe) != probe:
        kept = [(cp, ccc) for cp, ccc in kept if normalize("\ue000" + chr(cp)) == "\ue000" + chr(cp)]
    table = np.full(0x110000, 0xFF, dtype=np.uint8)
    for cp, ccc in kept:
        table[cp] = ccc
    maybe = np.array(sorted(cp for cp, _ in kept if cp in seconds), dtype=np.uint32)
    # pairs NFC recomposes, by either normalizer (an excluded composite stays decomposed)
    pair_texts = [chr(a) + chr(b) for a, b in decomposed]
    ref = normalize("\ue000".join(pair_texts)).split("\ue000")
    if len(ref) != len(pair_texts):
        ref = [normalize(t) for t in pair_texts]
    pairs = sorted({(a << 21) | b for (a, b), t, r in zip(decomposed, pair_texts, ref)
                    if r != t or unicodedata.normalize("NFC", t) != t})
    table.setflags(write=False)
    return table, maybe, np.array(pairs, dtype=np.uint64)


def probe_table(prober: _Prober, patterns: dict[int, str], *, folds: bool = False,
                extra: dict[int, Callable[[], np.ndarray]] | None = None,
                table: np.ndarray | None = None) -> np.ndarray:
    """The one probe: uint32[0x110000] with each pattern's code points OR-ed in at its bit.

    `prober.probe_class(pattern)` is a bool mask over code points (an engine, or a
    test's `regex` module prober); `extra` maps bits to mask builders (NFC_INERT);
    `folds` sets the contraction-fold byte (bits 8-15).  Adds to `table` when given.
    """
    if table is None:
        table = np.zeros(0x110000, dtype=np.uint32)
    for bit, pattern in patterns.items():
        table[prober.probe_class(pattern)] |= np.uint32(bit)
    for bit, make_mask in (extra or {}).items():
        table[make_mask()] |= np.uint32(bit)
    if folds:
        for ch in CONTRACTION_LETTERS:
            mask = prober.probe_class(f"(?i:{ch})")
            table[mask] = (table[mask] & np.uint32(~FOLD & 0xFFFFFFFF)) | np.uint32(ord(ch) << FOLD_SHIFT)
    return table


def _bits(keys) -> int:
    out = 0
    for b in keys:
        out |= b
    return out


def _load(path: Path) -> tuple[np.ndarray | None, int]:
    try:
        with np.load(path, allow_pickle=False) as z:
            table, probed = z["table"], int(z["probed"])
        if table.shape == (0x110000,) and table.dtype == np.uint32:
            return table, probed
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None, 0


def save_npz(path: Path, **arrays: np.ndarray) -> None:
    """Write `arrays` to the cache file `path` atomically (a temporary file, then a rename)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp.npz")
        np.savez(tmp, **arrays)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache only costs the work next time


def class_table(prober: _Prober, key: str, patterns: dict[int, str], *, folds: bool = False,
                extra: dict[int, Callable[[], np.ndarray]] | None = None) -> np.ndarray:
    """The tokenizer's uint32 class table with (at least) the named bits, read-only.

    Read from / written to the one disk cache, keyed by `key` (the engine's `class_key`) and
    `TABLE_VERSION`; bits missing from the cached table are probed and added to it.
    """
    want = _bits(patterns) | _bits(extra or {}) | (FOLD if folds else 0)
    path = cache_dir() / "classes" / f"{key}-{TABLE_VERSION}.npz"
    table, probed = _load(path)
    if table is None:
        table, probed = np.zeros(0x110000, dtype=np.uint32), 0
    if want & ~probed:
        probe_table(prober, {b: p for b, p in patterns.items() if not b & probed}, table=table,
                    folds=folds and not FOLD & probed,
                    extra={b: f for b, f in (extra or {}).items() if not b & probed})
        probed |= want
        save_npz(path, table=table, probed=np.array(probed, dtype=np.uint32))
    table.setflags(write=False)
    return table


def host_view(table: np.ndarray, bits: int) -> np.ndarray:
    """The predicate's uint8 table: the named host bits (L N M W K, I) of a class table.

    >>> t = np.array([L | UP | (ord("s") << FOLD_SHIFT), W | NFC_INERT, K | PS], dtype=np.uint32)
    >>> host_view(t, L | W | K | HOST_I).tolist(), host_view(t, L | W).tolist()
    ([1, 40, 16], [1, 8, 0])
    """
    low = np.uint32(bits & (L | N | M | W | K))
    if bits & HOST_I:  # NFC_INERT (bit 16) -> HOST_I (bit 5)
        out = ((table & low) | ((table >> np.uint32(11)) & np.uint32(HOST_I))).astype(np.uint8)
    else:
        out = (table & low).astype(np.uint8)
    out.setflags(write=False)
    return out


def probe_classes(engine: _Prober, patterns: dict[int, str], key: str, extra: dict | None = None) -> np.ndarray:
    """uint8[0x110000] host view with the named host bits (`patterns`, `extra` keyed by host bit).

    The bits come from the tokenizer's one class table (`class_table`, cached on disk).
    """
    table = class_table(engine, key, {_TABLE_BITS[b]: p for b, p in patterns.items()},
                        extra={_TABLE_BITS[b]: f for b, f in (extra or {}).items()})
    return host_view(table, _bits(patterns) | _bits(extra or {}))
