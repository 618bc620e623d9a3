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


def probe_classes(engine: _Prober, patterns: dict[int, str], key: str) -> np.ndarray:
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
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp.npy")
        np.save(tmp, table, allow_pickle=False)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache only costs the probe next time
    table.setflags(write=False)
    return table
