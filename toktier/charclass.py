"""Per-code-point character classes probed out of the reference engine.

Python's `unicodedata` is not the reference: its Unicode version differs from the
one compiled into Oniguruma (HF `tokenizers`) or the Rust `regex` crate
(tiktoken), and ~10K code points change class between versions.  So each class
bit is computed by running the class regex through the engine itself over every
code point, and the table is cached on disk keyed by the tokenizer hash.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

import numpy as np


class _Prober(Protocol):
    def probe_class(self, pattern: str) -> np.ndarray: ...


def cache_dir() -> Path:
    """`$TOKTIER_CACHE_DIR`, else `~/.cache/toktier`."""
    return Path(os.environ.get("TOKTIER_CACHE_DIR") or Path.home() / ".cache" / "toktier")


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

    second: set[int] = set(range(0x1161, 0x1176)) | set(range(0x11A8, 0x11C3))
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


def probe_classes(engine: _Prober, patterns: dict[int, str], key: str, extra: dict | None = None) -> np.ndarray:
    """uint8[0x110000] of OR-ed class bits; read from / written to the disk cache."""
    path = cache_dir() / "classes" / f"{key}.npy"
    try:
        table = np.load(path, allow_pickle=False)
        if table.shape == (0x110000,) and table.dtype == np.uint8:
            table.setflags(write=False)
            return table
    except (OSError, ValueError):
        pass
    table = np.zeros(0x110000, dtype=np.uint8)
    for bit, pattern in patterns.items():
        table[engine.probe_class(pattern)] |= np.uint8(bit)
    for bit, make_mask in (extra or {}).items():
        table[make_mask()] |= np.uint8(bit)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp.npy")
        np.save(tmp, table, allow_pickle=False)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache only costs the probe next time
    table.setflags(write=False)
    return table
