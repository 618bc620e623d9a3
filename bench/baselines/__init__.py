"""What a serving front end would use instead of TokTier, behind one small interface.

Every engine answers "the token IDs of this request's whole text" for a stream of requests that
belong to sessions.  Three kinds:

* ``stateless`` full re-tokenization with a peer library (:mod:`bench.baselines.full`): HF
  ``tokenizers`` (the reference), tiktoken, fastokens (plain, with its whole-input cache
  ``FASTOKENS_INPUT_CACHE``, with its segment cache), gigatoken (prewarmed and cold).
* ``cache`` front-end caches in the style of serving routers (:mod:`bench.baselines.caches`):
  an exact-match whole-input cache (SMG L0), a prefix cache at special-token boundaries
  (SMG / Dynamo L1), an overlap-resync prefix cache (TensorRT-LLM style).  They see only the
  request text, as a router does, and are *not* guaranteed exact: the benchmark counts how often
  their IDs differ from the reference.
* ``stateful``: TokTier sessions (:mod:`bench.baselines.toktier_engine`), driven by the op
  (append / edit / full-text sync) or by the full text alone (``toktier-sync``).

An engine is built for one :class:`toktier.FrozenTokenizer` by :func:`build`; the names are
those of :data:`ENGINES`.  An engine that cannot be built for a tokenizer (a peer that lacks the
format) raises :class:`EngineUnavailable` and is skipped by the benchmarks, which say so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Protocol

import numpy as np

__all__ = ["ENGINES", "Engine", "EngineUnavailable", "Request", "build", "describe"]


class EngineUnavailable(RuntimeError):
    """This peer cannot serve this tokenizer here (missing package or format)."""


@dataclass(frozen=True)
class Request:
    """One call of a session: the whole new text, and how it differs from the previous one.

    ``kind`` is "start" (new session), "append", "edit" (replace chars [start, end) of the old
    text by ``delta``) or "compact" (a full-context rewrite: only ``text`` is meaningful).
    """

    session: str
    kind: Literal["start", "append", "edit", "compact"]
    text: str
    delta: str = ""
    start: int = 0
    end: int = 0


class Engine(Protocol):
    name: str
    kind: Literal["stateless", "cache", "stateful"]

    def __call__(self, req: Request) -> np.ndarray:
        """The IDs of ``req.text`` (uint32; may be a view valid until the next call)."""

    def close(self, session: str) -> None:
        """Forget per-session state (no-op for stateless engines)."""


def _registry() -> dict[str, tuple[str, Callable]]:
    from . import caches, full, toktier_engine

    return {
        "toktier": ("TokTier session: append / edit / sync ops (repair)", toktier_engine.TokTierOps),
        "toktier-sync": ("TokTier session fed the full text only (sync: common prefix + repair)",
                         toktier_engine.TokTierSync),
        "hf-tokenizers": ("HF tokenizers full re-tokenization (the reference)", full.HFFull),
        "tiktoken": ("tiktoken full re-tokenization (Encoding built from the same vocab)", full.TiktokenFull),
        "fastokens": ("fastokens full re-tokenization, no caches", full.FastokensFull),
        "fastokens-input-cache": ("fastokens with FASTOKENS_INPUT_CACHE (whole-input prefix cache)",
                                  full.FastokensInputCache),
        "fastokens-segment-cache": ("fastokens with enable_segment_cache (segments between added tokens)",
                                    full.FastokensSegmentCache),
        "gigatoken": ("gigatoken full re-tokenization, prewarmed object", full.GigatokenWarm),
        "gigatoken-cold": ("gigatoken on a freshly built tokenizer object (cold caches; build not timed)",
                           full.GigatokenCold),
        "l0-exact": ("exact-match whole-input cache (SMG L0 style) over HF tokenizers", caches.ExactMatchCache),
        "l1-special-prefix": ("prefix cache at special-token boundaries (SMG/Dynamo L1 style) over HF tokenizers",
                              caches.SpecialBoundaryPrefixCache),
        "overlap-resync": ("overlap-resync prefix cache (TensorRT-LLM style, back off 4 tokens) over HF tokenizers",
                           caches.OverlapResyncCache),
    }


ENGINES: tuple[str, ...] = (
    "toktier", "toktier-sync", "hf-tokenizers", "tiktoken", "fastokens", "fastokens-input-cache",
    "fastokens-segment-cache", "gigatoken", "gigatoken-cold", "l0-exact", "l1-special-prefix", "overlap-resync",
)


def describe(name: str) -> str:
    return _registry()[name][0]


def build(name: str, tok) -> Engine:
    """Build engine ``name`` for the frozen tokenizer ``tok`` (raises EngineUnavailable)."""
    reg = _registry()
    if name not in reg:
        raise KeyError(f"unknown engine {name!r}; known: {', '.join(ENGINES)}")
    return reg[name][1](tok)
