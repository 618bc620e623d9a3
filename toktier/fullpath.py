"""The full path: whole-text tokenization for session starts, syncs and fallbacks.

Large texts are cut at *standalone-stable* boundaries (`Family.chunk_stable`: a
stable boundary whose left side may also be tokenized on its own, and which no
added-token literal spans) into ~64 KB chunks, encoded with the engine's batch API
(HF `encode_batch_fast` and tiktoken `encode_batch` release the GIL and run on all
cores), and concatenated.  By the splice theorem the result equals one reference
encode of the whole text.  Cuts are searched only near each target offset, so
choosing them costs O(chunks), not O(text).  Texts below the parallel threshold,
unsupported families and texts without a usable cut near a target are encoded in
one piece (a chunk simply grows to the next cut).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .boundaries import char_byte_offsets
from .registry import FrozenTokenizer

_SEARCH = 2048  # characters searched after each target offset for a cut


@dataclass(frozen=True)
class FullPathConfig:
    chunk_chars: int = 65_536
    min_parallel_chars: int = 131_072
    # HF `encode` holds the GIL for its whole run; the batch API releases it.  Above
    # this size even a one-piece encode goes through the batch API, so a server
    # thread doing a session start never freezes the event loop.
    min_gil_free_chars: int = 16_384
    # Try the GPU path first (toktier.gpu.router); it declines without a device, for
    # small texts and unsupported families, and under back-pressure.
    use_gpu: bool = True


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
            crossed = tok.literals.crossed(seg.encode("utf-8"))
            _, offs = char_byte_offsets(seg)
            cand = cand[~crossed[offs[cand - base]]]
        if len(cand):
            cuts.append(int(cand[0]))
            target = int(cand[0]) + chunk_chars
        else:
            target += _SEARCH  # no cut here: the chunk grows
    return cuts


def encode_full(tok: FrozenTokenizer, text: str, cfg: FullPathConfig = FullPathConfig()) -> np.ndarray:
    """Exactly `tok.encode(text)`: on the GPU when one takes it, else in parallel chunks
    when the text is large enough, else one reference encode."""
    if cfg.use_gpu:
        from .gpu.router import try_gpu  # never calls encode_full: no recursion

        ids = try_gpu(tok, text)
        if ids is not None:
            return ids
    # tiktoken's batch API is a Python thread pool over an encode that already releases
    # the GIL; on these machines it never beat one encode (bench/full_path.py), so only
    # HF engines are chunked.
    chunked = tok.engine.engine_name == "tokenizers" and len(text) >= cfg.min_parallel_chars
    cuts = chunk_cuts(tok, text, cfg.chunk_chars) if chunked else []
    if not cuts:
        if len(text) < cfg.min_gil_free_chars:
            return tok.encode(text)
        return tok.encode_batch([text])[0]
    bounds = [0, *cuts, len(text)]
    parts = tok.encode_batch([text[a:b] for a, b in zip(bounds[:-1], bounds[1:])])
    return np.concatenate(parts).astype(np.uint32, copy=False)
