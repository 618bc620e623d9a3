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

from ..fullpath import nfc_form_of
from .tables import rules_for


@dataclass(frozen=True)
class RouterConfig:
    min_gpu_bytes: int = 2048          # segments at or below this stay on the CPU
    max_inflight: int = 4              # GPU requests in flight before spilling to the CPU


def gpu_eligible(tok, text: str, cfg: RouterConfig = RouterConfig()) -> tuple[bool, str]:
    """(eligible, reason) for sending `text` to the GPU path (ignoring device availability).
    An NFC family's text the normalizer changes is not; `Router` sends its `gpu_form` instead."""
    ok, why = _eligible_size(tok, text, cfg)
    if ok and gpu_form(tok, text) is not text:
        return False, "NFC changes the text"
    return ok, why


def gpu_form(tok, text: str) -> str | None:
    """What the GPU encodes for `text` (`fullpath.nfc_form_of`: `text`, or an NFC family's text in
    the form its reference tokenizes, certified; the kernels model the pre-tokenizer and BPE, not
    the normalizer); None: the CPU takes it."""
    form = nfc_form_of(tok, text)
    nat = tok.native
    if form is None and (nat is None or nat.demoted is not None):
        return text if tok.engine.normalize(text) == text else None  # no native engine to ask
    return form


def _eligible_size(tok, text: str, cfg: RouterConfig) -> tuple[bool, str]:
    rules = rules_for(tok)
    if rules is None:
        return False, "family has no GPU pre-tokenizer model"
    n = len(text)  # UTF-8 bytes lie in [n, 4n]: encode only when that does not decide
    if n * 4 <= cfg.min_gpu_bytes or (n <= cfg.min_gpu_bytes and len(text.encode("utf-8")) <= cfg.min_gpu_bytes):
        return False, "small"
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

    def try_encode(self, tok, text: str, utf8: bytes | None = None, form: str | None = None) -> np.ndarray | None:
        """IDs from the GPU, or None when the request belongs on the CPU (the caller encodes it there).
        `utf8`: `text`'s UTF-8 when the caller has it (the driver then does not encode it again);
        `form`: its `gpu_form` when the caller has it."""
        drv = self.driver()  # probed once; cheap None without a device
        if drv is None:
            self._count("cpu")
            return None
        ok, _why = _eligible_size(tok, text, self.cfg)
        if ok and form is None:
            form = gpu_form(tok, text)
        elif not ok:
            form = None
        if form is not text:
            utf8 = None  # (the normalized form's bytes differ from the caller's)
        drv = drv if form is not None else None
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
                    nat = tok.native  # its compiled literal scan of the str, when it serves this tokenizer
                    lits = nat.literal_bytes(form) if nat is not None and nat.demoted is None else None
                    ids = drv.encode(tok, form if utf8 is None else utf8, with_spans=False, literals=lits)[0]
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
