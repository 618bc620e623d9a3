"""Fault injection for exactness tooling: corrupt served token IDs on purpose.

Used by the shadow-verifier tests and by ``toktier verify --inject-faults`` to
prove that a check catches each kind of wrong answer a tokenizer bug produces:

=============  ===============================================================
kind           what changes
=============  ===============================================================
substitute     one ID replaced by another valid ID
delete         one ID removed (length - 1)
duplicate      one ID repeated (length + 1)
swap           two adjacent, different IDs exchanged
resplit        the tail's text re-split differently: same length, same bytes,
               different IDs (the silent kind a length or decode check misses)
=============  ===============================================================

Every corruption returns IDs that differ from the input (or raises
`FaultNotApplicable`); `FaultInjector` applies one to a known fraction of
results with a seeded RNG and records what it did.

>>> import numpy as np, toktier
>>> tok = toktier.load_tokenizer("cl100k_base")
>>> text = "total = 1234567\\n"
>>> ids = tok.encode(text)
>>> bad = corrupt(tok, text, ids, "resplit", random.Random(0))
>>> len(bad) == len(ids), bad.tolist() != ids.tolist()
(True, True)
>>> b"".join(tok.token_bytes[i] for i in bad) == text.encode()
True
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from toktier.registry import FrozenTokenizer

KINDS: tuple[str, ...] = ("substitute", "delete", "duplicate", "swap", "resplit")

# How many trailing tokens a re-split may rewrite.  Small on purpose: the fault
# must look like a plausible seam bug near the end of an appended text.
_RESPLIT_MAX_TOKENS = 12
# When no re-split exists that close to the end (BPE output is often the only
# segmentation with that few tokens), wider suffixes are searched (at most 256 tokens).
_RESPLIT_WIDER = (24, 64, 256)


class FaultNotApplicable(ValueError):
    """The requested corruption cannot change these IDs (e.g. a swap of [7, 7])."""


_BYTES_TO_ID: dict[str, dict[bytes, int]] = {}
_LOCK = threading.Lock()


def _bytes_to_id(tok: FrozenTokenizer) -> dict[bytes, int]:
    with _LOCK:
        table = _BYTES_TO_ID.get(tok.hash)
        if table is None:
            table = {}
            literal = {lit.content.encode("utf-8") for lit in tok.engine.literals}
            for i, b in enumerate(tok.token_bytes):
                if b and b not in literal:
                    table.setdefault(b, i)
            _BYTES_TO_ID[tok.hash] = table
        return table


def corrupt(tok: FrozenTokenizer, text: str, ids: Sequence[int] | np.ndarray, kind: str,
            rng: random.Random) -> np.ndarray:
    """Return a corrupted copy of `ids` (uint32) that differs from `ids`."""
    a = np.asarray(ids, dtype=np.uint32).copy()
    n = len(a)
    if kind == "substitute":
        if n == 0:
            raise FaultNotApplicable("no ID to substitute")
        i = rng.randrange(n)
        vocab = len(tok.token_bytes)
        new = rng.randrange(vocab - 1)
        a[i] = new if new < a[i] else new + 1  # uniform over the other IDs
        return a
    if kind == "delete":
        if n == 0:
            raise FaultNotApplicable("no ID to delete")
        return np.delete(a, rng.randrange(n))
    if kind == "duplicate":
        if n == 0:
            raise FaultNotApplicable("no ID to duplicate")
        i = rng.randrange(n)
        return np.insert(a, i, a[i])
    if kind == "swap":
        cand = np.flatnonzero(a[:-1] != a[1:]) if n >= 2 else np.zeros(0, dtype=np.int64)
        if not len(cand):
            raise FaultNotApplicable("no two adjacent different IDs")
        i = int(cand[rng.randrange(len(cand))])
        a[i], a[i + 1] = a[i + 1], a[i]
        return a
    if kind == "resplit":
        return _resplit(tok, text, a, rng)
    raise ValueError(f"unknown fault kind {kind!r}; known: {', '.join(KINDS)}")


def _resplit(tok: FrozenTokenizer, text: str, a: np.ndarray, rng: random.Random) -> np.ndarray:
    """Same length, same bytes, different IDs, within the last few tokens.

    First try what a seam bug does: encode the tail's text as two parts split at
    another character and keep it when that gives as many tokens as before.
    Otherwise move one byte across an adjacent pair of tokens when both new byte
    strings are tokens of the vocabulary.
    """
    n = len(a)
    if n < 2:
        raise FaultNotApplicable("a re-split needs at least two tokens")
    tb = tok.token_bytes
    raw = text.encode("utf-8")
    lengths = [len(tb[i]) for i in a[-_RESPLIT_MAX_TOKENS:]]
    order = list(range(2, min(_RESPLIT_MAX_TOKENS, n) + 1))
    rng.shuffle(order)
    for m in order:
        off = len(raw) - sum(lengths[-m:])
        if off < 0 or (off < len(raw) and (raw[off] & 0xC0) == 0x80):
            continue  # not a character boundary
        tail = raw[off:].decode("utf-8", errors="strict") if off <= len(raw) else ""
        cuts = list(range(1, len(tail)))
        rng.shuffle(cuts)
        old = a[n - m:]
        for c in cuts[:64]:
            new = np.concatenate([tok.encode(tail[:c]), tok.encode(tail[c:])]).astype(np.uint32)
            if len(new) == m and not np.array_equal(new, old):
                out = a.copy()
                out[n - m:] = new
                return out
    vocab = _bytes_to_id(tok)
    longest = max(len(b) for b in vocab)
    widths = [*range(2, min(_RESPLIT_MAX_TOKENS, n) + 1), *(w for w in _RESPLIT_WIDER if w < n)]
    if n <= _RESPLIT_WIDER[-1]:
        widths.append(n)
    for m in widths:
        old = a[n - m:]
        joined = b"".join(tb[i] for i in old)
        alt = _other_segmentation(joined, m, old, vocab, longest, rng)
        if alt is not None:
            out = a.copy()
            out[n - m:] = alt
            return out
    raise FaultNotApplicable("no same-length re-split of the tail exists")


def _other_segmentation(data: bytes, m: int, old: np.ndarray, vocab: dict[bytes, int], longest: int,
                        rng: random.Random) -> np.ndarray | None:
    """Another segmentation of `data` into exactly m vocabulary tokens, or None."""
    size = len(data)
    full = (1 << (m + 1)) - 1
    # reach[i]: bit k set when data[:i] splits into k tokens (k <= m)
    reach = [0] * (size + 1)
    reach[0] = 1
    for i in range(size):
        r = reach[i]
        if not r:
            continue
        r = (r << 1) & full
        for j in range(i + 1, min(size, i + longest) + 1):
            if data[i:j] in vocab:
                reach[j] |= r
    if not (reach[size] >> m) & 1:
        return None
    for _ in range(16):  # random walks back from (size, m)
        out: list[int] = []
        i, k = size, m
        while i > 0:
            preds = [h for h in range(max(0, i - longest), i)
                     if (reach[h] >> (k - 1)) & 1 and data[h:i] in vocab]
            h = rng.choice(preds)
            out.append(vocab[data[h:i]])
            i, k = h, k - 1
        alt = np.array(out[::-1], dtype=np.uint32)
        if not np.array_equal(alt, old):
            return alt
    return None


@dataclass
class FaultInjector:
    """Corrupt a known fraction of results, reproducibly.

    `maybe_corrupt` returns ``(ids, kind)``; kind is None for untouched results.
    When the drawn kind cannot change a result, the next kind in `kinds` that can
    is used (substitution always can, for non-empty IDs), so the injected fraction
    stays exactly the drawn fraction.

    >>> import toktier
    >>> tok = toktier.load_tokenizer("cl100k_base")
    >>> inj = FaultInjector(rate=1.0, seed=3)
    >>> ids = tok.encode("abc def ghi")
    >>> bad, kind = inj.maybe_corrupt(tok, "abc def ghi", ids)
    >>> kind in KINDS and bad.tolist() != ids.tolist()
    True
    """

    rate: float = 0.1
    kinds: tuple[str, ...] = KINDS
    seed: int = 0
    injected: dict[str, int] = field(default_factory=dict)
    seen: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"rate must be in [0, 1], not {self.rate}")
        unknown = set(self.kinds) - set(KINDS)
        if unknown or not self.kinds:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}; known: {', '.join(KINDS)}")
        self._rng = random.Random(self.seed)
        self._lock = threading.Lock()

    def maybe_corrupt(self, tok: FrozenTokenizer, text: str,
                      ids: Sequence[int] | np.ndarray) -> tuple[np.ndarray, str | None]:
        with self._lock:
            self.seen += 1
            if self._rng.random() >= self.rate or len(ids) == 0:
                return np.asarray(ids, dtype=np.uint32), None
            first = self._rng.randrange(len(self.kinds))
            sub_seed = self._rng.getrandbits(64)
        rng = random.Random(sub_seed)
        for k in range(len(self.kinds)):
            kind = self.kinds[(first + k) % len(self.kinds)]
            try:
                bad = corrupt(tok, text, ids, kind, rng)
            except FaultNotApplicable:
                continue
            with self._lock:
                self.injected[kind] = self.injected.get(kind, 0) + 1
            return bad, kind
        bad = corrupt(tok, text, ids, "substitute", rng)
        with self._lock:
            self.injected["substitute"] = self.injected.get("substitute", 0) + 1
        return bad, "substitute"
