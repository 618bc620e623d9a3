"""Front-end tokenization caches in the style of serving routers, implemented faithfully.

They see only each request's whole text (what a router gets after rendering the chat template)
and wrap the reference engine (HF ``tokenizers`` ``encode(text, add_special_tokens=False)``, or
tiktoken ``encode(text, allowed_special="all")``) for whatever they cannot answer from cache.
None of them proves its answer; the benchmark counts how often each differs from the reference.

* :class:`ExactMatchCache` (SMG "L0"): whole-input hash -> IDs, LRU over a bounded number of
  entries.  Exact by construction; on agent traffic every call's text is new, so it misses.
* :class:`SpecialBoundaryPrefixCache` (SMG / Dynamo "L1"): the request is cut after every
  added-token literal (leftmost-longest, as the reference extracts them); a chained hash names
  each prefix ending at such a boundary; the deepest cached prefix supplies its IDs and only the
  suffix after it is tokenized, then concatenated.  Exact as long as the reference really
  tokenizes the segments between added tokens independently and every literal is one token.
* :class:`OverlapResyncCache` (TensorRT-LLM style): per conversation, the previous text and IDs;
  when the new text extends the old one, back off ``K`` tokens from the end, re-tokenize from
  that token's start, and accept the splice when the first ``K - 1`` re-tokenized IDs agree with
  the cached ones (the last cached token may legitimately grow); otherwise, or when the text is
  not an extension, tokenize in full.  A few agreeing tokens do not prove the pre-tokenizer would
  place a boundary there, so this one can diverge.

All of them return a fresh ``uint32`` array per call (an O(N) copy, as these caches hand a token
vector back to the server), and their O(N) steps (hashing, scanning for literals, prefix compare)
run in C (hashlib, re, bytes), not in Python loops.
"""

from __future__ import annotations

import hashlib
import re
from collections import OrderedDict

import numpy as np

from . import Request

_U32 = np.uint32


def _literal_regex(tok) -> re.Pattern | None:
    lits = sorted({lit.content for lit in tok.engine.literals}, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, lits))) if lits else None


class _Cached:
    kind = "cache"
    name = "?"

    def __init__(self, tok) -> None:
        self._tok = tok
        self._encode = tok.encode  # the reference engine
        self.hits = 0
        self.misses = 0
        self.partial = 0  # answered from cache plus a re-tokenized suffix
        self.scanned_chars = 0  # characters handed to the tokenizer

    def _full(self, text: str) -> np.ndarray:
        self.scanned_chars += len(text)
        return self._encode(text)

    def close(self, session: str) -> None:
        pass


class ExactMatchCache(_Cached):
    name = "l0-exact"
    MAX_ENTRIES = 64

    def __init__(self, tok) -> None:
        super().__init__(tok)
        self._lru: OrderedDict[bytes, np.ndarray] = OrderedDict()

    def __call__(self, req: Request) -> np.ndarray:
        key = hashlib.blake2b(req.text.encode("utf-8"), digest_size=16).digest()
        ids = self._lru.get(key)
        if ids is not None:
            self._lru.move_to_end(key)
            self.hits += 1
            return ids.copy()
        self.misses += 1
        ids = self._full(req.text)
        self._lru[key] = ids
        if len(self._lru) > self.MAX_ENTRIES:
            self._lru.popitem(last=False)
        return ids.copy()


class SpecialBoundaryPrefixCache(_Cached):
    name = "l1-special-prefix"
    MAX_ENTRIES = 1 << 16

    def __init__(self, tok) -> None:
        super().__init__(tok)
        self._re = _literal_regex(tok)
        lit_ids = []
        for lit in tok.engine.literals:
            ids = tok.encode(lit.content)
            if len(ids) == 1:
                lit_ids.append(int(ids[0]))
        self._is_lit = np.zeros(len(tok.token_len), dtype=bool)  # id -> "is an added-token literal"
        self._is_lit[sorted(set(lit_ids))] = True
        # chained prefix hash -> (ids array that holds the prefix, number of tokens of the prefix)
        self._lru: OrderedDict[bytes, tuple[np.ndarray, int]] = OrderedDict()

    def _boundaries(self, text: str) -> tuple[list[int], list[bytes]]:
        """Char offsets just after each literal, and the chained hash of each prefix."""
        ends = [m.end() for m in self._re.finditer(text)] if self._re is not None else []
        keys, h, prev = [], b"", 0
        for e in ends:
            h = hashlib.blake2b(h + text[prev:e].encode("utf-8"), digest_size=16).digest()
            keys.append(h)
            prev = e
        return ends, keys

    def __call__(self, req: Request) -> np.ndarray:
        text = req.text
        ends, keys = self._boundaries(text)
        hit = None
        for i in range(len(keys) - 1, -1, -1):
            v = self._lru.get(keys[i])
            if v is not None:
                hit = (i, v)
                break
        if hit is None:
            self.misses += 1
            ids = self._full(text)
        else:
            i, (arr, n) = hit
            self._lru.move_to_end(keys[i])
            suffix = text[ends[i]:]
            if suffix:
                self.partial += 1
                self.scanned_chars += len(suffix)
                ids = np.concatenate([arr[:n], self._encode(suffix)])
            else:
                self.hits += 1
                ids = arr[:n].copy()
        # register every boundary of this request: the j-th literal is the j-th literal token
        pos = np.flatnonzero(self._is_lit[ids])
        if len(pos) == len(keys):
            for key, p in zip(keys, pos):
                self._lru[key] = (ids, int(p) + 1)
                self._lru.move_to_end(key)
            while len(self._lru) > self.MAX_ENTRIES:
                self._lru.popitem(last=False)
        return ids


class OverlapResyncCache(_Cached):
    name = "overlap-resync"
    BACKOFF = 4

    def __init__(self, tok) -> None:
        super().__init__(tok)
        self._tlen = tok.token_len.astype(np.int64)
        self._state: dict[str, tuple[bytes, np.ndarray, np.ndarray]] = {}  # text, ids, token byte ends

    def _remember(self, session: str, data: bytes, ids: np.ndarray) -> None:
        self._state[session] = (data, ids, np.cumsum(self._tlen[ids]))

    def __call__(self, req: Request) -> np.ndarray:
        data = req.text.encode("utf-8")
        old = self._state.get(req.session)
        ids = None
        if old is not None and len(data) >= len(old[0]) and data.startswith(old[0]) and len(old[1]) > self.BACKOFF:
            odata, oids, oends = old
            n = len(oids)
            k = self.BACKOFF
            p = int(oends[n - k - 1])
            while p > 0 and (data[p] & 0xC0) == 0x80 and k < n - 1:  # never start inside a UTF-8 char
                k += 1
                p = int(oends[n - k - 1])
            suffix = data[p:].decode("utf-8")
            self.scanned_chars += len(suffix)
            fresh = self._encode(suffix)
            if len(fresh) >= k - 1 and np.array_equal(fresh[: k - 1], oids[n - k : n - 1]):
                self.partial += 1
                ids = np.concatenate([oids[: n - k], fresh])
                ends = np.concatenate([oends[: n - k], p + np.cumsum(self._tlen[fresh])])
                self._state[req.session] = (data, ids, ends)
                return ids
        self.misses += 1
        ids = self._full(req.text)
        self._remember(req.session, data, ids)
        return ids.copy()

    def close(self, session: str) -> None:
        self._state.pop(session, None)
