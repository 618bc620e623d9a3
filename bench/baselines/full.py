"""Full re-tokenization of every request with a peer library (stateless front ends).

Each class encodes ``req.text`` whole, every call, as a stateless server does after rendering the
chat template (added/special tokens recognized, no BOS added).  Peers are built from the *same*
tokenizer file as the reference:

* HF ``tokenizers``: the reference engine object itself (``encode(text, add_special_tokens=False)``).
* tiktoken: an ``Encoding`` built from the tokenizer's byte vocabulary, its pre-tokenizer regex
  and its added tokens (for a ``tokenizer.json`` whose BPE ranks are its IDs, e.g. Llama 3), or
  the reference Encoding for rank files.
* fastokens 0.3.5: ``Tokenizer.from_file``; every call uses its array path ``encode_batch_flat([text])``
  -> ``np.frombuffer(ids, uint32)`` (a read-only view of one bytes object; no per-token Python
  objects).  ``FASTOKENS_INPUT_CACHE=<n>`` is read by the native
  constructor (``Tokenizer::build_with_options`` calls ``input_cache_from_env``; the cache is used
  by ``encode_scanned``), so :class:`FastokensInputCache` sets the variable around construction
  only.  ``enable_segment_cache(max_bytes)`` caches the text segments between added tokens.
* gigatoken 0.10.0: ``gigatoken.Tokenizer(path)``, whose ``encode`` returns a uint32 ndarray (its
  array path; the ``np.asarray`` below is no copy); "prewarmed" reuses one object that has already
  encoded the session text, "cold" builds a fresh object before each timed call (build untimed).
"""

from __future__ import annotations

import gzip
import os
import tempfile
from pathlib import Path

import numpy as np

from . import EngineUnavailable, Request

_U32 = np.uint32


def _hf_path(tok) -> str | None:
    return getattr(tok.engine, "path", None) if tok.engine.engine_name != "tiktoken" else None


def _tiktoken_source(tok) -> tuple[str, dict[str, int], dict[bytes, int]]:
    """(pattern, special tokens, mergeable ranks) of the tokenizer, for tiktoken-style peers."""
    eng = tok.engine
    if eng.engine_name == "tiktoken":
        name, pat, ranks, specials = eng._args
        return pat, dict(specials), ranks
    cfg = eng._config
    model = cfg.get("model", {})
    if model.get("type") != "BPE" or not model.get("ignore_merges"):
        raise EngineUnavailable("tiktoken needs a BPE whose ranks are its IDs (ignore_merges)")
    pre = cfg.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    pats = [s["pattern"]["Regex"] for s in steps if s.get("type") == "Split" and "Regex" in s.get("pattern", {})]
    if len(pats) != 1 or cfg.get("normalizer"):
        raise EngineUnavailable("tiktoken needs exactly one split regex and no normalizer")
    added = {c: i for c, i in tok.table.literal_ids.items()}  # the engine's ids, not the file's
    added_ids = set(added.values())
    ranks = {b: i for i, b in enumerate(eng.token_bytes) if b and i not in added_ids}
    return pats[0], added, ranks


class _Stateless:
    kind = "stateless"
    name = "?"

    def close(self, session: str) -> None:
        pass


class HFFull(_Stateless):
    name = "hf-tokenizers"

    def __init__(self, tok) -> None:
        if tok.engine.engine_name == "tiktoken":
            raise EngineUnavailable("reference is a tiktoken rank file; no tokenizer.json")
        self._tok = tok.engine._tok

    def __call__(self, req: Request) -> np.ndarray:
        return np.asarray(self._tok.encode(req.text, add_special_tokens=False).ids, dtype=_U32)


class TiktokenFull(_Stateless):
    name = "tiktoken"

    def __init__(self, tok) -> None:
        import tiktoken

        pat, specials, ranks = _tiktoken_source(tok)
        self._enc = tiktoken.Encoding(name=f"bench-{tok.name}", pat_str=pat, mergeable_ranks=ranks,
                                      special_tokens=specials)

    def __call__(self, req: Request) -> np.ndarray:
        return self._enc.encode_to_numpy(req.text, allowed_special="all").astype(_U32, copy=False)


def _fastokens_tokenizer(tok, input_cache: str | None = None):
    try:
        import fastokens
    except ImportError as exc:  # pragma: no cover - optional peer
        raise EngineUnavailable(f"fastokens not installed: {exc}") from exc
    saved = os.environ.pop("FASTOKENS_INPUT_CACHE", None)
    if input_cache is not None:
        os.environ["FASTOKENS_INPUT_CACHE"] = input_cache
    try:
        path = _hf_path(tok)
        if path is not None:
            return fastokens.Tokenizer.from_file(path)
        pat, specials, _ranks = _tiktoken_source(tok)
        src = _plain_rank_file(tok)
        return fastokens.Tokenizer.from_tiktoken(src, pattern=pat, special_tokens=specials)
    finally:
        os.environ.pop("FASTOKENS_INPUT_CACHE", None)
        if saved is not None:
            os.environ["FASTOKENS_INPUT_CACHE"] = saved


def _plain_rank_file(tok) -> str:
    """A rank file path the peers can read (they do not read gzip)."""
    from toktier import bundled

    spec = bundled.BUNDLED.get(tok.name)
    if spec is None or spec.kind != "tiktoken":
        raise EngineUnavailable("no rank file for this tokenizer")
    p = spec.path()
    if p.suffix != ".gz":
        return str(p)
    out = Path(tempfile.gettempdir()) / f"toktier-bench-{tok.name}.tiktoken"
    if not out.exists():
        out.write_bytes(gzip.decompress(p.read_bytes()))
    return str(out)


class FastokensFull(_Stateless):
    name = "fastokens"

    def __init__(self, tok) -> None:
        self._t = _fastokens_tokenizer(tok)

    def __call__(self, req: Request) -> np.ndarray:
        # The array path: ``encode_batch_flat`` returns the ids as little-endian uint32 bytes, so
        # no Python int is made per token (``encode(text).ids`` is a list: ~10 ms at 1M chars).
        # Both caches (input, segment) serve this call as they serve ``encode``.
        flat, _offsets = self._t.encode_batch_flat([req.text])
        return np.frombuffer(flat, dtype=_U32)


class FastokensInputCache(FastokensFull):
    """fastokens with its whole-input prefix cache (the env var is read at construction)."""

    name = "fastokens-input-cache"
    ENTRIES = "64"

    def __init__(self, tok) -> None:
        self._t = _fastokens_tokenizer(tok, input_cache=self.ENTRIES)


class FastokensSegmentCache(FastokensFull):
    name = "fastokens-segment-cache"
    MAX_BYTES = 512 << 20

    def __init__(self, tok) -> None:
        self._t = _fastokens_tokenizer(tok)
        self._t.enable_segment_cache(self.MAX_BYTES)

    def stats(self) -> dict | None:
        return self._t.segment_cache_stats()


def _gigatoken(tok):
    try:
        import gigatoken
    except ImportError as exc:  # pragma: no cover - optional peer
        raise EngineUnavailable(f"gigatoken not installed: {exc}") from exc
    path = _hf_path(tok)
    if path is not None:
        return lambda: gigatoken.Tokenizer(path)
    _pat, specials, _ranks = _tiktoken_source(tok)
    pre = {"cl100k_base": "gpt4", "o200k_base": "o200k", "o200k_harmony": "o200k"}.get(tok.name)
    if pre is None:
        raise EngineUnavailable(f"no gigatoken pretokenizer preset for {tok.name}")
    src = _plain_rank_file(tok)
    return lambda: gigatoken.Tokenizer.from_tiktoken(src, pretokenizer=pre, special_tokens=specials)


class GigatokenWarm(_Stateless):
    name = "gigatoken"

    def __init__(self, tok) -> None:
        self._t = _gigatoken(tok)()

    def __call__(self, req: Request) -> np.ndarray:
        return np.asarray(self._t.encode(req.text), dtype=_U32)


class GigatokenCold(_Stateless):
    """A fresh gigatoken object per call: call :meth:`prepare` (untimed) before each timed call."""

    name = "gigatoken-cold"

    def __init__(self, tok) -> None:
        self._factory = _gigatoken(tok)
        self._next = None

    def prepare(self) -> None:
        self._next = self._factory()

    def __call__(self, req: Request) -> np.ndarray:
        t, self._next = (self._next or self._factory()), None
        return np.asarray(t.encode(req.text), dtype=_U32)
