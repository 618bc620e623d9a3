"""The full path: whole-text tokenization for session starts, syncs and fallbacks.

Large texts are cut at *standalone-stable* boundaries (`Family.chunk_stable`: a
stable boundary whose left side may also be tokenized on its own, and which no
added-token literal spans) into chunks of 8K-64K characters (about four per core, so a
20K-character append already runs on every core), encoded concurrently on threads of
this call (`encode_fast` releases the GIL), and concatenated.  By the splice theorem
the result equals one reference encode of the whole text.  Cuts are searched only near
each target offset, so choosing them costs O(chunks), not O(text).  Texts below the
parallel threshold, unsupported families and texts without a usable cut near a target
are encoded in one piece (a chunk simply grows to the next cut).

Why per-call threads and not HF's batch API: the batch API runs on one process-wide
rayon pool whose workers take newly submitted jobs only after their own queued work,
so in a server a 40K-character repair submitted during a 4M-character session start
waited for the whole start (943 ms instead of 25 ms, measured on 2 cores).  Threads
of its own let the OS share the cores between both.

A `FullPath` is what a `Session` is given (like its allocator): the CPU chunking above
plus an optional GPU encoder (`toktier.gpu.router.Router`, or anything with
``try_encode(tok, text) -> ids | None``), with counters a server exports.  The core
builds none on its own: a session without one gets a CPU-only `FullPath`.

>>> import toktier
>>> tok = toktier.load_tokenizer("cl100k_base")
>>> fp = FullPath()
>>> fp.encode(tok, "hello world").tolist() == tok.encode("hello world").tolist()
True
>>> fp.stats()
FullPathStats(encodes=1, gpu=0, chunked=0, chars=11)
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .boundaries import LiteralFilter, char_byte_offsets
from .registry import FrozenTokenizer

_SEARCH = 2048  # characters searched after each target offset for a cut


@dataclass(frozen=True)
class FullPathConfig:
    #: Characters per chunk; 0 = adaptive, n / (4 x cores) clamped to [8K, 64K] (measured on 2
    #: cores: 20K chars 7.5 -> 5.1 ms, 40K 19.6 -> 10.3 ms, 160K 77 -> 35 ms against one encode).
    chunk_chars: int = 0
    min_parallel_chars: int = 16_384
    #: Texts of at least this many characters are cut into chunks for the native engine's kept
    #: helper threads.  With a piece cache per thread and compiled cuts (10 us, 0.2 ms in Python),
    #: 64K-character texts encode 1.5-1.9x faster in two chunks than in one on 2 cores back to back
    #: (2026-12-04; it was 256K when each chunk took a thread and a cache of its own).  After 200 ms
    #: of idle time two chunks lose 11-13% below ~200K on a 2-vCPU VM (bench/RESULTS.md, 2026-12-04).
    native_min_parallel_chars: int = 49_152
    #: Native windows a session hands to this path rather than encoding them on its own thread
    #: (`is_parallel`: a GPU may take them; without one the compiled lane chunks them itself).
    native_window_parallel_chars: int = 262_144


class GpuEncoder(Protocol):
    """What a `FullPath` asks of a GPU: IDs for `text`, or None to keep it on the CPU."""

    def try_encode(self, tok: FrozenTokenizer, text: str, utf8: bytes | None = None,
                   form: str | None = None) -> np.ndarray | None: ...


@dataclass(frozen=True)
class FullPathStats:
    encodes: int = 0  # whole-text encodes served
    gpu: int = 0  # ... of which the GPU answered
    chunked: int = 0  # ... of which ran as parallel CPU chunks
    chars: int = 0  # characters encoded


def chunk_cuts(tok: FrozenTokenizer, text: str, chunk_chars: int) -> list[int]:
    """Character offsets where `text` may be cut into independently tokenized chunks."""
    fam = tok.family_info
    if fam is None:
        return []
    cuts: list[int] = []
    target = chunk_chars
    reach = tok.literals.max_len if tok.literals else 0
    while target < len(text) - 1:
        lo = max(1, target)
        window = text[lo - 1 : min(len(text), lo + _SEARCH + reach)]
        cps = np.frombuffer(window.encode("utf-32-le"), dtype="<u4")
        ok = fam.chunk_stable(tok.classes, cps[:-1], cps[1:])
        cand = np.flatnonzero(ok) + lo  # text positions q with pair (text[q-1], text[q])
        cand = cand[cand < lo + _SEARCH]
        if tok.literals and len(cand):
            # Literal occurrences spanning q lie within [q - reach, q + reach].
            base = max(0, lo - reach)
            seg = text[base : min(len(text), lo + _SEARCH + reach)]
            _, offs = char_byte_offsets(seg)
            cand = LiteralFilter(tok.literals, seg.encode("utf-8")).filter(cand, offs[cand - base])
        if len(cand):
            cuts.append(int(cand[0]))
            target = int(cand[0]) + chunk_chars
        else:
            target += _SEARCH  # no cut here: the chunk grows
    return cuts


def _adaptive_chunk(n_chars: int) -> int:
    return min(65_536, max(8_192, n_chars // (4 * (os.cpu_count() or 1))))


def encode_full(tok: FrozenTokenizer, text: str, cfg: FullPathConfig = FullPathConfig()) -> np.ndarray:
    """Exactly `tok.encode(text)` on the CPU: parallel chunks when the text is large enough,
    else one reference encode."""
    return _encode_cpu(tok, text, cfg)[0]


def nfc_form_of(tok: FrozenTokenizer, text: str) -> str | None:
    """`text` in the form `tok`'s reference tokenizes it: `text` itself (no normalizer to apply, or
    one that leaves it as it is), or an NFC family's text with the gaps between its literals
    normalized (`NativeEngine.normalized`); None when that is not known (no active native engine,
    or its form was not certified): the reference must encode it."""
    if tok.family_info is None or not tok.family_info.nfc or text.isascii():
        return text
    nat = tok.native
    if nat is None or nat.demoted is not None:
        return None
    return nat.normalized(text)


#: Chunks per chunk thread of a native chunked encode, at most (they are claimed as threads come
#: free, so one slow chunk, a dense-script stretch, does not hold up a whole thread's share), and
#: the characters a chunk gets at least, as far as a whole number of chunks per thread allows.
_NATIVE_CHUNKS_PER_THREAD = 2
_NATIVE_MIN_CHUNK = 32_768


def _native_cuts(tok: FrozenTokenizer, text: str, cfg: FullPathConfig) -> list[int]:
    """Where the native engine's chunks of `text` are cut (`NativeEngine.cuts`, compiled), from
    `native_min_parallel_chars` on: the same number of chunks for every chunk thread (three chunks
    on two threads leave one thread two thirds of the text), up to `_NATIVE_CHUNKS_PER_THREAD`
    while chunks keep `_NATIVE_MIN_CHUNK` characters.  `cfg.chunk_chars`, when set, fixes the size."""
    n = len(text)
    if n < cfg.native_min_parallel_chars:
        return []
    nat = tok.native
    if cfg.chunk_chars:
        return nat.cuts(text, cfg.chunk_chars)
    threads = nat.chunk_threads
    per = max(1, min(_NATIVE_CHUNKS_PER_THREAD, n // (threads * _NATIVE_MIN_CHUNK)))
    return nat.cuts(text, -(-n // (threads * per)))


def _encode_cpu(tok: FrozenTokenizer, text: str, cfg: FullPathConfig,
                form: str | None = None) -> tuple[np.ndarray, bool]:
    """(IDs, whether they were encoded in parallel chunks).  `form`: `nfc_form_of(tok, text)` when
    the caller has it."""
    # tiktoken encodes ~7x faster than HF and chunking it gained 1.0-1.5x on 2 cores (less
    # than its cut search costs below 160K characters), so it is never chunked.  The native
    # engine is chunked from `native_min_parallel_chars` on (`_native_cuts`).
    engine = tok.engine_label
    if engine == "native":
        nat = tok.native
        # An NFC family's text goes in the form its reference tokenizes (normalized between the
        # literals): a decomposed accent anywhere in a 1M-character start cost the reference's
        # 0.2 s before.  None: the reference encodes it.
        if form is None:
            form = nfc_form_of(tok, text)
        if form is not None:
            cuts = _native_cuts(tok, form, cfg)
            # one compiled call: the chunks on this thread and the kept helpers, no Python per chunk
            ids = nat.encode_chunks(form, cuts, check_nfc=False)
            if ids is not None:
                return ids, bool(cuts)
        # demoted, a surrogate (the reference raises its error), or no certified form
        engine = tok.engine.engine_name
    chunked = engine == "tokenizers" and len(text) >= cfg.min_parallel_chars
    size = (cfg.chunk_chars or _adaptive_chunk(len(text))) if chunked else 0
    cuts = chunk_cuts(tok, text, size) if chunked else []
    if not cuts:
        # the reference engine releases the GIL (HF batch API, tiktoken), so a server thread
        # doing a session start never freezes the event loop.
        return tok.engine.encode_fast(text), False
    bounds = [0, *cuts, len(text)]
    chunks = [text[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    with ThreadPoolExecutor(min(len(chunks), os.cpu_count() or 1), thread_name_prefix="toktier-chunk") as pool:
        parts = list(pool.map(tok.engine.encode_fast, chunks))
    return np.concatenate(parts).astype(np.uint32, copy=False), True


class FullPath:
    """Whole-text tokenization for sessions: the GPU when one is given and takes the text,
    else parallel CPU chunks.  Thread-safe; counts what it did (`stats`)."""

    def __init__(self, config: FullPathConfig = FullPathConfig(), gpu: GpuEncoder | None = None) -> None:
        self.config = config
        self.gpu = gpu
        self._lock = threading.Lock()
        self._counts = {"encodes": 0, "gpu": 0, "chunked": 0, "chars": 0}

    def encode(self, tok: FrozenTokenizer, text: str, utf8: bytes | None = None,
               form: str | None = None) -> np.ndarray:
        """Exactly `tok.encode(text)`; `utf8` is `text`'s UTF-8 when the caller holds it (the GPU
        takes bytes: encoding a large str again would cost more than its kernels), `form` its
        `nfc_form_of` (a session start asked already)."""
        ids = self.gpu.try_encode(tok, text, utf8, form) if self.gpu is not None else None
        on_gpu = ids is not None
        chunked = False
        if ids is None:
            ids, chunked = _encode_cpu(tok, text, self.config, form)
        with self._lock:
            c = self._counts
            c["encodes"] += 1
            c["gpu"] += on_gpu
            c["chunked"] += chunked
            c["chars"] += len(text)
        return ids

    def start(self, tok: FrozenTokenizer, text: str, check_nfc: bool = True):
        """A session start's first pass on the CPU, for `Session` to lay out in its own buffers
        (`toktier.native.NativeEngine.start_chunks`: the same IDs as `encode`, and no whole-text copy
        on the calling thread), or None: then `encode` serves it (a GPU is given, the reference
        engine serves `tok`, or a chunk needs the reference).  `check_nfc` False: the caller vouches
        that an NFC family's normalizer leaves `text` as it is (`NativeEngine.normalized`)."""
        nat = tok.native
        if self.gpu is not None or nat is None or not nat.active:
            return None
        cuts = _native_cuts(tok, text, self.config)
        staged = nat.start_chunks(text, cuts, check_nfc)
        if staged is None:
            return None
        with self._lock:
            c = self._counts
            c["encodes"] += 1
            c["chunked"] += bool(cuts)
            c["chars"] += len(text)
        return staged

    def is_parallel(self, n_chars: int, tok: FrozenTokenizer | None = None) -> bool:
        """Whether a text of `n_chars` characters is worth this path's parallel machinery
        (a session sends such windows here instead of one encode on its own thread)."""
        if tok is not None and tok.engine_label == "native":
            return n_chars >= self.config.native_window_parallel_chars
        return n_chars >= self.config.min_parallel_chars

    def stats(self) -> FullPathStats:
        with self._lock:
            return FullPathStats(**self._counts)
