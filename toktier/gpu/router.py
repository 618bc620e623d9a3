"""Decide per request whether the GPU takes a full tokenization; the output contract never changes.

Large texts (default above 2 KB of UTF-8) of a supported family go to the GPU
when a driver is available and has passed its one-time self-check for that
tokenizer; small texts, unsupported families, NFC families whose text NFC would
change, and requests arriving while ``max_inflight`` GPU requests are running
(back-pressure) are declined (``try_encode`` returns None) and the caller, a
`toktier.fullpath.FullPath`, encodes them on the CPU.  Added-token literals are
split out inside the GPU path itself, so a text with literals is one GPU request.

>>> import toktier
>>> from toktier.fullpath import FullPath
>>> from toktier.gpu.router import Router
>>> tok = toktier.load_tokenizer("cl100k_base")
>>> r = Router()                       # no GPU here: every request is declined
>>> fp = FullPath(gpu=r)
>>> fp.encode(tok, "hello world").tolist() == tok.encode("hello world").tolist()
True
>>> r.last_route
'cpu'
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from .tables import rules_for


@dataclass(frozen=True)
class RouterConfig:
    min_gpu_bytes: int = 2048          # segments at or below this stay on the CPU
    max_inflight: int = 4              # GPU requests in flight before spilling to the CPU


def gpu_eligible(tok, text: str, cfg: RouterConfig = RouterConfig()) -> tuple[bool, str]:
    """(eligible, reason) for sending `text` to the GPU path (ignoring device availability)."""
    rules = rules_for(tok)
    if rules is None:
        return False, "family has no GPU pre-tokenizer model"
    n = len(text)  # UTF-8 bytes lie in [n, 4n]: encode only when that does not decide
    if n * 4 <= cfg.min_gpu_bytes or (n <= cfg.min_gpu_bytes and len(text.encode("utf-8")) <= cfg.min_gpu_bytes):
        return False, "small"
    fam = tok.family_info
    if fam is not None and fam.nfc and tok.engine.normalize(text) != text:
        return False, "NFC changes the text"
    return True, "ok"


class Router:
    """Chooses GPU or CPU per request (a `toktier.fullpath.GpuEncoder`); thread-safe; counts its
    decisions ("gpu", "cpu": declined, "spill": declined under back-pressure)."""

    def __init__(self, cfg: RouterConfig = RouterConfig(), driver=None, use_gpu: bool | None = None) -> None:
        self.cfg = cfg
        self._driver = driver
        self._want_gpu = use_gpu
        self._lock = threading.Lock()
        self._inflight = 0
        self.counts = {"gpu": 0, "cpu": 0, "spill": 0}
        self.last_route = ""

    def driver(self):
        """The GPU driver, or None when there is no pycuda/GPU (probed once)."""
        if self._want_gpu is False:
            return None
        if self._driver is None:
            from .driver import available_driver

            self._driver = available_driver() or False
        return self._driver or None

    def try_encode(self, tok, text: str, utf8: bytes | None = None) -> np.ndarray | None:
        """IDs from the GPU, or None when the request belongs on the CPU (the caller encodes it there).
        `utf8`: `text`'s UTF-8 when the caller has it (the driver then does not encode it again)."""
        drv = self.driver()  # probed once; cheap None without a device
        if drv is None:
            self._count("cpu")
            return None
        ok, _why = gpu_eligible(tok, text, self.cfg)
        drv = drv if ok else None
        if drv is not None and hasattr(drv, "verified") and not drv.verified(tok):
            drv = None
        if drv is not None:
            with self._lock:
                spill = self._inflight >= self.cfg.max_inflight
                if not spill:
                    self._inflight += 1
            if spill:
                self._count("spill")
            else:
                try:
                    ids = drv.encode(tok, text if utf8 is None else utf8, with_spans=False)[0]
                    self._count("gpu")
                    return ids
                finally:
                    with self._lock:
                        self._inflight -= 1
        else:
            self._count("cpu")
        return None

    def _count(self, route: str) -> None:
        with self._lock:
            self.counts[route] += 1
            self.last_route = route
