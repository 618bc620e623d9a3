"""Exact token caches without a session id: L0 (whole input) and L1 (longest prefix by content).

A stateless front end sends each request's whole text.  `PrefixCache.encode(text)` returns
exactly ``tokenizer.encode(text)`` and reuses what earlier calls tokenized:

>>> import toktier
>>> tok = toktier.load_tokenizer("cl100k_base")
>>> cache = toktier.PrefixCache(tok)
>>> system = "You are a careful assistant. " * 300            # ~8.7K chars, shared
>>> cache.encode(system + "Q: 2+2?").layer
'miss'
>>> r = cache.encode(system + "Q: 3+3?")                      # another request, same prompt
>>> r.layer, r.ids.tolist() == tok.encode(system + "Q: 3+3?").tolist()
('l1', True)
>>> cache.encode(system + "Q: 3+3?").layer                    # the same text again
'l0'

What it owns: the entry store, its two indexes, the byte bound and the counters.

Storage (shared copy-on-write).  An entry is one cached text with its IDs, immutable once
stored.  Its text is cut into ``BLOCK_BYTES`` blocks; block k's *anchor* is a chained hash
``h_k = H(h_{k-1}, block_k)``, so two texts that share a prefix share its anchors.  Each distinct
anchor is one *text node* (the block's bytes, its parent node, its depth), interned in a dict: the
nodes form a tree in which an entry is a path from the root plus a private *tail* (its last,
partial block).  IDs are stored the same way, ``ID_BLOCK`` tokens (and their token-start
checkpoints) per *id node*, in a tree whose paths are shared by derivation: an entry repaired
from another keeps the other's id nodes before the first changed token.  So N branches of one
100K-character prompt hold one copy of the prompt's blocks plus N tails.  A node lives while an
entry ends at it or a child hangs below it.

Lookup.  L0: the whole text's key (the last anchor chained with the tail) in an LRU of at most
`l0_max_entries` keys; the entry's bytes are compared with the text before its IDs are served.
L1: the deepest anchor of the text present in the tree (binary search: a path's anchors are all
present), its path's bytes compared with the text, then among the entries ending at that node
and the child blocks below it (at most ``MAX_CANDIDATES`` each, most recent first) the one that
shares the most bytes.  Any mismatch in a verified byte range is a miss: a hash collision costs
time, never IDs.  L1 needs one whole block in common (shorter prefixes are cheap to encode).

Repair.  The matched entry's state is copied into a private `Session` (text, IDs and token-start
checkpoints as stored: no encode, no O(N) derivation) and synced to the new text: the differing
tail becomes an edit, spliced with its certificate or re-encoded by the full path, so the IDs are
the reference's whatever was cached.  The matched entry is never mutated; the new text becomes
a new entry sharing the matched one's nodes.

Live sessions (the hot path).  The session that produced an entry stays live with it for the
``HOT_STATES`` most recent entries, together with the request's str.  A request is first compared
with those texts as str (``startswith``: memcmp, no UTF-8 conversion, no hashing): when one is a
prefix of it (the agent's next turn), or shares the longest prefix with it (a retry, a branch),
and no stored entry shares more (checked at that text's last shared node, as L1 would), the
request is answered from that session: only the unmatched rest is converted to UTF-8 and repaired
as an edit, only its new blocks are hashed and stored.  An extension moves the session on to the
new entry (no copy), and so does a retry (its last turn replaced); a branch that parts further
back repairs a copy and leaves the original live.  A stored text sent again after a retry (an L0
hit) is repaired back from the retry's session the same way.  Anything else takes the general
path above, whose session then becomes live.  So an agent's call costs a memcmp of its text plus
the repair, not an O(N) conversion, hashing and copy.

Memory.  Bounded in bytes, LRU: `l1_max_bytes` bounds the entry store (text and id nodes charged
once each however many entries share them, each entry's private tail, checkpoints and spans,
plus estimated per-object overheads for the indexes, ``*_OVERHEAD`` below).  L0 holds no data of
its own: it is an index of keys into the store (``L0_KEY_BYTES`` each), bounded by count; an entry
evicted from the store leaves L0 too.  Live sessions are charged to the same bound (their buffers
and the str they keep, ``HOT_OVERHEAD`` each) and are dropped first, least recent first, when the
store needs room: under memory pressure the cache loses speed before it loses entries.  Entries
in use by a concurrent call are skipped by eviction until that call ends (a short, bounded
overshoot).

Threads.  `encode` may be called from several threads: one lock guards the indexes and counters;
tokenization (the repair or the full encode) and the O(N) copies run outside it.
`CacheResult.ids` is a read-only view of a live session's buffer (no copy per call); a live
session about to change copies its buffer first when a view handed out earlier may still be held
(copy-on-write), so a result never changes, however long it is kept.

Defaults.  Both layers on: unlike a boundary cache that trusts its splice, these answers are the
reference's by construction, so caching costs memory, never correctness.  ``l1_max_bytes`` 256 MiB
holds ~100M distinct characters of context (about 2 bytes per character: text plus IDs);
``l0_max_entries`` 4096 keys cost ~0.6 MiB.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterator, Literal, TypeVar

import numpy as np

from .errors import InvalidCacheConfig
from .fullpath import FullPath
from .offsets import STRIDE
from .registry import FrozenTokenizer
from .session import Session, _byte_offset, _to_utf8

BLOCK_BYTES = 4096  # text block = anchor spacing: one hash call and one node per 4 KiB
ID_BLOCK = 1024  # tokens per id node (a multiple of STRIDE: checkpoints split with the ids)
MAX_CANDIDATES = 32  # entries and child blocks compared at the matched node (most recent first)
HEADROOM = 4096  # spare token capacity of a repair session (a turn's append fits without regrowth)
HOT_STATES = 8  # repair sessions kept live (the latest entries': one per active conversation)
HOT_STEAL_BYTES = 1 << 16  # a live session replaces at most this (or 1/8 of its text) in place, else a copy
# Estimated CPython overheads (objects, dict slots, array headers), charged with the data:
TEXT_NODE_OVERHEAD = 384
ID_NODE_OVERHEAD = 320
ENTRY_OVERHEAD = 768
L0_KEY_BYTES = 160
HOT_OVERHEAD = 2048  # a live Session's objects besides its buffers

assert ID_BLOCK % STRIDE == 0

Layer = Literal["l0", "l1", "miss"]


@dataclass(frozen=True, slots=True)
class CacheResult:
    """One `PrefixCache.encode` answer.

    `ids` equals ``tokenizer.encode(text)``: read-only, and never changed by later calls (copy
    it to write to it).  `first_changed`
    is the first token index where `ids` differ from the matched entry's (the KV reuse point;
    0 on a miss, ``len(ids)`` on an exact hit); `reused_chars` the characters of the text covered by
    ``ids[:first_changed]`` (a character split across that token boundary is not counted).
    """

    ids: np.ndarray
    layer: Layer
    reused_chars: int
    first_changed: int


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    """A snapshot of a cache's counters, shaped for Prometheus labels.

    lookups[(layer, result)]  layer "l0"/"l1", result "hit"/"miss": every call looks up L0 (when
                              enabled), and L1 (when enabled) after an L0 miss
    evictions[layer]          L0 keys dropped by the count bound; L1 entries dropped by the byte bound
    reused_bytes[layer]       text bytes whose tokens a hit took from the cache
    bytes_held[layer]         L0: its keys; L1: the entry store (see the module docstring)
    entries[layer]            L0 keys; L1 stored entries
    collisions                anchors or keys found whose bytes differed (served as misses)
    full_fallbacks            L1 hits whose repair took the full path (still exact)
    not_stored                texts larger than the whole byte bound (served, not kept)
    """

    lookups: dict[tuple[str, str], int]
    evictions: dict[str, int]
    reused_bytes: dict[str, int]
    bytes_held: dict[str, int]
    entries: dict[str, int]
    collisions: int
    full_fallbacks: int
    not_stored: int


def _chain(prev: int, block: memoryview) -> int:
    """Anchor of `block` after anchor `prev`: process-salted SipHash (Python's `hash`), ~5 GB/s.

    Not collision-proof (64 bits) and it need not be: every match is verified byte for byte."""
    return hash((prev, hash(block)))


def _common(a: bytes, b: bytes, off: int) -> int:
    """Length of the common prefix of `a` and ``b[off:]``."""
    n = min(len(a), len(b) - off)
    if n <= 0:
        return 0
    if b.startswith(a if n == len(a) else a[:n], off):
        return n
    x = np.frombuffer(a, dtype=np.uint8, count=n)
    y = np.frombuffer(b, dtype=np.uint8, count=n, offset=off)
    return int(np.argmax(x != y))


def _char_starts(data: bytes | memoryview) -> int:
    """Characters starting in UTF-8 `data` (bytes that are not continuation bytes)."""
    if not len(data):
        return 0
    arr = np.frombuffer(data, dtype=np.uint8)
    return len(arr) - int(np.count_nonzero((arr & 0xC0) == 0x80))


def _frozen(a: np.ndarray) -> np.ndarray:
    out = np.array(a, dtype=np.uint32, copy=True)
    out.flags.writeable = False
    return out


class _TextNode:
    """One shared text block: the prefix of `depth` blocks whose last anchor is `key`."""

    __slots__ = ("key", "depth", "data", "parent", "chars", "children", "terminal")

    def __init__(self, key: int, depth: int, data: bytes, parent: _TextNode | None) -> None:
        self.key, self.depth, self.data, self.parent = key, depth, data, parent
        self.chars = (parent.chars if parent else 0) + (len(data) if data.isascii() else _char_starts(data))
        self.children: dict[int, _TextNode] = {}
        self.terminal: dict[_Entry, None] = {}  # entries whose indexed text ends here, oldest first


class _IdNode:
    """One shared block of `ID_BLOCK` token IDs and their checkpoints (None: entries that do not tile)."""

    __slots__ = ("ids", "cps", "parent", "users")

    def __init__(self, ids: np.ndarray, cps: np.ndarray | None, parent: _IdNode | None) -> None:
        self.ids, self.cps, self.parent = ids, cps, parent
        self.users = 0  # child nodes + entries ending here

    @property
    def nbytes(self) -> int:
        return self.ids.nbytes + (self.cps.nbytes if self.cps is not None else 0) + ID_NODE_OVERHEAD


class _Entry:
    """One cached text and its IDs: a text path + tail and an id path + tail.  Immutable once stored."""

    __slots__ = ("l0_key", "text_leaf", "tail", "nbytes", "nchars", "ascii", "id_leaf", "id_tail", "cp_tail",
                 "ntokens", "dirty", "charge", "pins", "in_l0")

    @property
    def repairable(self) -> bool:
        return self.cp_tail is not None


_Node = TypeVar("_Node", "_TextNode", "_IdNode")


def _path(leaf: _Node | None) -> list[_Node]:
    """The nodes from the root down to `leaf` (text or id tree alike: each node knows its parent)."""
    out = []
    while leaf is not None:
        out.append(leaf)
        leaf = leaf.parent
    out.reverse()
    return out


class _Hot:
    """A live repair session whose state is exactly `entry`'s, with the entry's text as the caller's str
    (compared with a request by memcmp, no UTF-8 conversion) and the entry's node paths."""

    __slots__ = ("entry", "text", "session", "path", "id_path", "charge")

    def __init__(self, entry: _Entry, text: str, session: Session, path: list[_TextNode],
                 id_path: list[_IdNode]) -> None:
        self.entry, self.text, self.session, self.path, self.id_path = entry, text, session, path, id_path
        self.charge = session.nbytes + sys.getsizeof(text) + 8 * (len(path) + len(id_path)) + HOT_OVERHEAD


def _common_chars(a: str, b: str) -> int:
    """Length of the common prefix of two str: a binary search whose probes are memcmp (`startswith`
    of a slice of `b` at an offset of `a`): about one copy and one compare of the shared part."""
    lo, hi = 0, min(len(a), len(b))  # a[:lo] == b[:lo]; the answer is at most hi
    while hi - lo > 64:
        mid = (lo + hi + 1) // 2
        if a.startswith(b[lo:mid], lo):
            lo = mid
        else:
            hi = mid - 1
    while lo < hi and a[lo] == b[lo]:
        lo += 1
    return lo


def _exact_below(node: _TextNode, rest: bytes) -> _Entry | None:
    """The repairable entry whose text is `node`'s prefix followed by exactly `rest`, if stored:
    down `rest`'s whole blocks through `node`'s subtree, then a tail equal to the remainder."""
    B = BLOCK_BYTES
    k = 0
    while len(rest) - k >= B:
        node = next((c for c in node.children.values() if rest.startswith(c.data, k)), None)
        if node is None:
            return None
        k += B
    tail = rest[k:]
    return next((e for e in node.terminal if e.repairable and e.tail == tail), None)


def _handed_out(ids: np.ndarray) -> np.ndarray:
    """A result's IDs: a read-only view of a session's buffer (no copy; `_unshare` protects it)."""
    ids.flags.writeable = False
    return ids


def _unshare(session: Session) -> None:
    """Copy-on-write before a live session changes: when a view handed out earlier (a result the
    caller still holds, or anything derived from it) references its id buffer, the session gets a
    private copy first.  Every such view references the buffer (numpy views keep their owner), so
    a reference count above the session's own and the call's means one may exist."""
    buf = session._ids._buf
    if sys.getrefcount(buf) > 3:  # the GrowableU32's slot, `buf`, getrefcount's argument
        session._ids._buf = buf.copy()


def _path_onto(leaf: _Node | None, prefix: list[_Node], length: int) -> list[_Node]:
    """`_path(leaf)` (of `length` nodes) reusing `prefix`, a path known to share its top: walks up only
    to where the two meet (O(new nodes))."""
    out = []
    k = length
    while leaf is not None and not (k <= len(prefix) and leaf is prefix[k - 1]):
        out.append(leaf)
        leaf = leaf.parent
        k -= 1
    out.reverse()
    return prefix[:k] + out


def _chain_into(prev: int, data: bytes) -> tuple[list[int], int]:
    """(the anchors of `data`'s whole blocks, the text's key: the last anchor chained with the
    tail) for `data` starting at a block boundary after a text whose last anchor is `prev` (0: none).
    Only the new anchors are made: the shared ones are the matched path's keys, never listed again
    (a list of every key was O(text / block) per hit: ~80 us at 1M characters)."""
    B = BLOCK_BYTES
    mv = memoryview(data)
    h = prev
    anchors: list[int] = []
    k = 0
    for k in range(B, len(data) + 1, B):
        h = _chain(h, mv[k - B : k])
        anchors.append(h)
    return anchors, _chain(h, mv[k:])


def _positive_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise InvalidCacheConfig(f"{name} must be an integer >= {minimum}, not {value!r}")
    return int(value)


class PrefixCache:
    """Exact L0 + L1 token caches for one tokenizer (see the module docstring).

    `l0_max_entries`: whole-text keys kept (LRU).  `l1_max_bytes`: bytes of the entry store
    (text, IDs, index; LRU).  `enable_l0` / `enable_l1`: look up by whole text / by prefix (the
    store serves both).  `window`, `full_path`: passed to the repair sessions (`Session`).
    """

    def __init__(self, tokenizer: FrozenTokenizer, *, l0_max_entries: int = 4096, l1_max_bytes: int = 256 << 20,
                 enable_l0: bool = True, enable_l1: bool = True, window: int | None = None,
                 full_path: FullPath | None = None) -> None:
        if not isinstance(tokenizer, FrozenTokenizer):
            raise TypeError(f"tokenizer must be a FrozenTokenizer (toktier.load_tokenizer), not "
                            f"{type(tokenizer).__name__}")
        if not (enable_l0 or enable_l1):
            raise InvalidCacheConfig("enable_l0 and enable_l1 are both False: nothing would be cached "
                                     "(call tokenizer.encode directly instead)")
        self.tokenizer = tokenizer
        self._l0_max = _positive_int("l0_max_entries", l0_max_entries, 1 if enable_l0 else 0)
        self._max_bytes = _positive_int("l1_max_bytes", l1_max_bytes, 0)
        self._enable_l0, self._enable_l1 = bool(enable_l0), bool(enable_l1)
        if window is not None:
            _positive_int("window", window, 16)
        self._window = window
        self._full_path = full_path or FullPath()
        # Repair needs a proven family; other tokenizers re-encode every op, so only L0 can help.
        self._repairable = tokenizer.spliceable
        self._lock = threading.Lock()
        self._nodes: dict[int, _TextNode] = {}
        self._lru: OrderedDict[_Entry, None] = OrderedDict()
        self._l0: OrderedDict[int, _Entry] = OrderedDict()
        self._hot: OrderedDict[_Entry, _Hot] = OrderedDict()  # LRU, charged in _bytes, evicted first
        self._hot_bytes = 0
        self._bytes = 0
        self._lookups = {(layer, res): 0 for layer in ("l0", "l1") for res in ("hit", "miss")}
        self._evictions = {"l0": 0, "l1": 0}
        self._reused = {"l0": 0, "l1": 0}
        self._collisions = self._fallbacks = self._not_stored = 0

    # -- public -----------------------------------------------------------------------------
    def encode(self, text: str) -> CacheResult:
        """``tokenizer.encode(text)``, reusing any cached entry that shares a prefix with `text`."""
        if self._hot and isinstance(text, str):
            r = self._encode_hot(text)
            if r is not None:
                return r
        data = _to_utf8(text)
        nchars = len(text)
        anchors, key = self._anchors_of(data)
        with self._lock:
            if self._enable_l0:
                hit = self._l0_lookup(key, data)
                if hit is not None:
                    entry = hit
                    self._touch(entry)
                    self._lookups["l0", "hit"] += 1
                    self._reused["l0"] += len(data)
            else:
                hit = None
            match = None
            if hit is None and self._enable_l1:
                match = self._l1_lookup(anchors, data)
                self._lookups["l1", "hit" if match else "miss"] += 1
                if match is not None:
                    entry = match[0]
                    entry.pins += 1
                    self._touch(entry)
        if hit is not None:
            ids = self._materialize_ids(_path(entry.id_leaf), entry)
            return CacheResult(ids, "l0", nchars, len(ids))
        if match is None:
            session = Session(self.tokenizer, text, window=self._window, full_path=self._full_path)
            ids = _handed_out(session.ids)
            stored = self._store(session, data, nchars, text.isascii(), anchors, key, None)
            self._keep_hot(stored, text, session, None)
            return CacheResult(ids, "miss", 0, 0)
        entry, common, path = match
        try:
            id_path = _path(entry.id_leaf)
            if common == len(data) == entry.nbytes:  # the same text, found by prefix
                ids = self._materialize_ids(id_path, entry)
                with self._lock:
                    self._reused["l1"] += len(data)
                return CacheResult(ids, "l1", nchars, len(ids))
            session = self._session_of(entry, _path(entry.text_leaf), id_path)
            op = session._sync_utf8(data, nchars, common)
            b = session._raw_start(op.first_changed) or 0
            reused = b if text.isascii() else self._chars_before(path, data, b)
            ids = _handed_out(op.ids)
            stored = self._store(session, data, nchars, text.isascii(), anchors, key,
                                 (path, id_path, common, op.first_changed), fallback=op.path.value == "full",
                                 reused_bytes=b)
            self._keep_hot(stored, text, session, None)
            return CacheResult(ids, "l1", reused, op.first_changed)
        finally:
            with self._lock:
                entry.pins -= 1
                self._evict()

    def stats(self) -> PrefixCacheStats:
        """Counters and bytes held (a snapshot)."""
        with self._lock:
            return PrefixCacheStats(
                lookups=dict(self._lookups), evictions=dict(self._evictions), reused_bytes=dict(self._reused),
                bytes_held={"l0": len(self._l0) * L0_KEY_BYTES, "l1": self._bytes},
                entries={"l0": len(self._l0), "l1": len(self._lru)},
                collisions=self._collisions, full_fallbacks=self._fallbacks, not_stored=self._not_stored)

    @property
    def nbytes(self) -> int:
        """Bytes charged: the entry store plus the L0 keys."""
        with self._lock:
            return self._bytes + len(self._l0) * L0_KEY_BYTES

    def clear(self) -> None:
        """Drop every entry (counters are kept)."""
        with self._lock:
            for entry in list(self._lru):
                if not entry.pins:
                    self._drop(entry)

    # -- lookups (under the lock) -----------------------------------------------------------
    def _l0_lookup(self, key: int, data: bytes) -> _Entry | None:
        entry = self._l0.get(key)
        if entry is None:
            self._lookups["l0", "miss"] += 1
            return None
        if entry.nbytes != len(data) or not self._same_text(entry, data):
            self._collisions += 1
            self._lookups["l0", "miss"] += 1
            return None
        self._l0.move_to_end(key)
        return entry

    @staticmethod
    def _same_text(entry: _Entry, data: bytes) -> bool:
        path = _path(entry.text_leaf)
        B = BLOCK_BYTES
        if not all(data.startswith(node.data, i * B) for i, node in enumerate(path)):
            return False
        return data.startswith(entry.tail, len(path) * B)

    def _l1_lookup(self, anchors: list[int], data: bytes) -> tuple[_Entry, int, list[_TextNode]] | None:
        """(entry, bytes it shares with `data`, the verified node path) or None."""
        nodes = self._nodes
        lo, hi = 0, len(anchors)
        while lo < hi:  # the deepest anchor present (a stored path holds all anchors above it)
            mid = (lo + hi + 1) // 2
            node = nodes.get(anchors[mid - 1])
            if node is not None and node.depth == mid:
                lo = mid
            else:
                hi = mid - 1
        if lo == 0:
            return None
        node = nodes[anchors[lo - 1]]
        path = _path(node)
        B = BLOCK_BYTES
        if not all(data.startswith(n.data, i * B) for i, n in enumerate(path)):
            self._collisions += 1
            return None
        off = lo * B
        best, best_len = None, -1
        for i, entry in enumerate(reversed(node.terminal)):
            if i == MAX_CANDIDATES:
                break
            if entry.repairable:
                n = _common(entry.tail, data, off)
                if n > best_len:
                    best, best_len = entry, n
        for i, child in enumerate(reversed(node.children.values())):
            if i == MAX_CANDIDATES:
                break
            n = _common(child.data, data, off)
            if n > best_len:
                below = self._entry_below(child)
                if below is not None:
                    best, best_len = below, n
        if best is None:
            return None
        return best, off + best_len, path

    @staticmethod
    def _entry_below(node: _TextNode) -> _Entry | None:
        """The most recent repairable entry ending at `node` or in its subtree (nearest first)."""
        stack = [node]
        while stack:
            n = stack.pop()
            for entry in reversed(n.terminal):
                if entry.repairable:
                    return entry
            stack.extend(n.children.values())
        return None

    # -- hot states: a request sharing most of a recent entry's text ----------------------------
    def _encode_hot(self, text: str) -> CacheResult | None:
        """The answer from a live session when a hot entry's text is the longest cached prefix of
        `text` (None: the general path decides).  The shared part is compared as str (memcmp) and
        never converted or hashed; only the rest is converted to UTF-8."""
        B = BLOCK_BYTES
        n = len(text)
        with self._lock:
            best, m = None, 0
            for h in reversed(self._hot.values()):  # a whole hot text first: the agent's append
                k = h.entry.nchars
                if m < k <= n and text.startswith(h.text):
                    best, m = h, k
            if best is None:  # a retry or a branch: the longest common prefix with a hot text
                for h in reversed(self._hot.values()):
                    if m == n:
                        break
                    if len(h.text) <= m or h.text[m] != text[m]:
                        continue  # its common prefix is at most m: not worth an O(m) compare
                    k = _common_chars(text, h.text)
                    if k > m:
                        best, m = h, k
                if best is None:
                    return None
            entry, session = best.entry, best.session
            if m == n == entry.nchars:  # the same text again
                ids = _handed_out(session.ids)
                l0 = self._enable_l0 and entry.in_l0 and self._l0.get(entry.l0_key) is entry
                if l0:
                    self._l0.move_to_end(entry.l0_key)
                elif self._enable_l0:
                    self._lookups["l0", "miss"] += 1
                layer = "l0" if l0 else "l1"
                self._lookups[layer, "hit"] += 1
                self._reused[layer] += entry.nbytes
                self._touch(entry)
                self._hot.move_to_end(entry)
                return CacheResult(ids, layer, n, len(ids))
            mb = entry.nbytes if m == entry.nchars else _byte_offset(session._text, entry.nchars, m)
            path = best.path
            d = min(mb // B, len(path))
            if d == 0:
                return None  # less than a block in common: not an L1 hit from this entry
            sdata = _to_utf8(text[m:])
            with memoryview(session._text) as mv:
                rest = bytes(mv[d * B : mb]) + sdata  # the text's UTF-8 from block d on
            own = mb - d * B
            node = path[d - 1]
            # An entry holding the very text (a retry's original sent again) is served from this
            # session too; otherwise one sharing more than this one would pass through `node`: its
            # tail or a child block.
            exact = _exact_below(node, rest)
            if exact is None:
                for i, other in enumerate(reversed(node.terminal)):
                    if i == MAX_CANDIDATES:
                        break
                    if other is not entry and other.repairable and _common(other.tail, rest, 0) > own:
                        return None
                mine = path[d] if d < len(path) else None
                for i, child in enumerate(reversed(node.children.values())):
                    if i == MAX_CANDIDATES:
                        break
                    if child is not mine and _common(child.data, rest, 0) > own:
                        return None
            l0 = exact is not None and self._enable_l0 and exact.in_l0 and self._l0.get(exact.l0_key) is exact
            if self._enable_l0 and not l0:
                self._lookups["l0", "miss"] += 1
            self._lookups["l0" if l0 else "l1", "hit"] += 1
            entry.pins += 1
            self._touch(entry)
            if exact is not None:
                exact.pins += 1
                self._touch(exact)
                if l0:
                    self._l0.move_to_end(exact.l0_key)
                self._reused["l0" if l0 else "l1"] += len(rest) + d * B
            if entry.nbytes - mb <= max(HOT_STEAL_BYTES, entry.nbytes >> 3):
                # an extension, or a retry of its last turn: the live session moves on to the new text
                self._unhot(entry)
            else:  # a branch far back: the hot entry stays live (as the least recent), a copy is repaired
                self._hot.move_to_end(entry, last=False)
                ids, cps, dirty = session._parts()
                session = Session._adopt(self.tokenizer, bytearray(session._text), entry.nchars, entry.ascii, [ids],
                                         [cps], dirty, window=self._window, full_path=self._full_path,
                                         headroom=HEADROOM)
        try:
            _unshare(session)
            op = session._apply(mb, entry.nbytes, sdata, n - entry.nchars)
            ids = _handed_out(op.ids)
            if exact is not None:  # stored already: the session becomes its live one
                self._keep_hot(exact, text, session, None)
                return CacheResult(ids, "l0" if l0 else "l1", n, len(ids))
            b = session._raw_start(op.first_changed)
            with memoryview(session._text) as mv:
                if b is None:
                    b = reused = 0
                elif b <= mb:
                    reused = m - _char_starts(mv[b:mb])
                else:
                    reused = m + _char_starts(mv[mb:b])
                off = d * B if session._parts()[1] is not None else 0  # a state that does not tile: whole
                new = bytes(mv[off:])
            anchors, key = _chain_into(path[d - 1].key if off else 0, new)
            stored = self._store(session, new, n, text.isascii(), anchors, key,
                                 (path, best.id_path, mb, op.first_changed), fallback=op.path.value == "full",
                                 reused_bytes=b, data_offset=off, anchors_from=d if off else 0)
            if stored is not None and stored.repairable and off and stored.text_leaf is not None:
                paths = (_path_onto(stored.text_leaf, path, stored.text_leaf.depth),
                         _path_onto(stored.id_leaf, best.id_path, stored.ntokens // ID_BLOCK))
                self._keep_hot(stored, text, session, paths)
            return CacheResult(ids, "l1", reused, op.first_changed)
        finally:
            with self._lock:
                entry.pins -= 1
                if exact is not None:
                    exact.pins -= 1
                self._evict()

    def _keep_hot(self, entry: _Entry | None, text: str, session: Session,
                  paths: tuple[list[_TextNode], list[_IdNode]] | None) -> None:
        """Keep `session` (whose state is exactly `entry`'s) live for the next request extending it."""
        if entry is None or HOT_STATES <= 0 or not self._enable_l1 or not entry.repairable or entry.text_leaf is None:
            return  # (an entry shorter than a block is found by L0 alone: its whole-text hash is cheap)
        path, id_path = paths or (_path(entry.text_leaf), _path(entry.id_leaf))
        hot = _Hot(entry, text, session, path, id_path)
        with self._lock:
            if entry not in self._lru:
                return  # evicted meanwhile
            self._unhot(entry)
            self._hot[entry] = hot
            self._bytes += hot.charge
            self._hot_bytes += hot.charge
            while len(self._hot) > HOT_STATES:
                self._unhot(next(iter(self._hot)))
            self._evict()

    # -- repair -----------------------------------------------------------------------------
    def _session_of(self, entry: _Entry, path: list[_TextNode], id_path: list[_IdNode]) -> Session:
        text = bytearray().join([n.data for n in path] + [entry.tail])
        ids = [n.ids for n in id_path] + [entry.id_tail]
        cps = [n.cps for n in id_path] + [entry.cp_tail]
        return Session._adopt(self.tokenizer, text, entry.nchars, entry.ascii, ids, cps, entry.dirty,
                              window=self._window, full_path=self._full_path, headroom=HEADROOM)

    @staticmethod
    def _materialize_ids(id_path: list[_IdNode], entry: _Entry) -> np.ndarray:
        return np.concatenate([n.ids for n in id_path] + [entry.id_tail])

    @staticmethod
    def _chars_before(path: list[_TextNode], data: bytes, b: int) -> int:
        """Characters starting in ``data[:b]`` (b within the verified prefix: the path's nodes count them)."""
        d = min(b // BLOCK_BYTES, len(path))
        base = path[d - 1].chars if d else 0
        return base + _char_starts(memoryview(data)[d * BLOCK_BYTES : b])

    # -- store (takes the lock) -------------------------------------------------------------
    def _store(self, session: Session, data: bytes, nchars: int, ascii_only: bool, anchors: list[int], key: int,
               base: tuple[list[_TextNode], list[_IdNode], int, int] | None, *, fallback: bool = False,
               reused_bytes: int = 0, data_offset: int = 0, anchors_from: int = 0) -> _Entry | None:
        """Keep `session`'s state (the encoding of `data`) as a new entry sharing `base`'s nodes; the
        entry holding that state now (None: not stored).

        `base`: (the matched text path, its id path, bytes in common, first changed token).
        `data_offset`: `data` is the text's UTF-8 from that byte on (a multiple of ``BLOCK_BYTES``, at
        most base's shared blocks: the bytes before it are in base's nodes).  `anchors[i]` is block
        ``anchors_from + i``'s anchor (the blocks before are base's path, at most its shared ones)."""
        ids, cps, dirty = session._parts()
        repairable = self._repairable and cps is not None
        B, M = BLOCK_BYTES, ID_BLOCK
        off = data_offset
        with self._lock:
            if base is not None:
                self._reused["l1"] += reused_bytes
                self._fallbacks += fallback
            if self._max_bytes == 0:
                self._not_stored += 1
                return None
            n_blocks = anchors_from + len(anchors)
            if not self._enable_l0 and not (repairable and n_blocks):
                return None  # nothing could ever find it: L1 needs a whole block and a repairable state
            created: list[_TextNode] = []
            parent: _TextNode | None = None
            depth = 0
            if repairable:
                if base is not None:
                    depth = min(base[2] // B, len(base[0]))
                    parent = base[0][depth - 1] if depth else None
                if depth < anchors_from:
                    raise AssertionError("the anchors start after the shared blocks")  # a caller's bug
                for k in range(depth, n_blocks):
                    a = anchors[k - anchors_from]
                    node = self._nodes.get(a)
                    if node is not None:
                        if node.parent is parent and node.depth == k + 1 and data.startswith(node.data, k * B - off):
                            parent, depth = node, k + 1
                            continue
                        self._collisions += 1  # the rest of the text stays in the tail
                        break
                    node = _TextNode(a, k + 1, data[k * B - off : (k + 1) * B - off], parent)
                    self._nodes[node.key] = node
                    if parent is not None:
                        parent.children[node.key] = node
                    self._bytes += len(node.data) + TEXT_NODE_OVERHEAD
                    created.append(node)
                    parent, depth = node, k + 1
            tail = data[depth * B - off :]
            if not created and parent is not None:
                for other in parent.terminal:  # the same text stored already (a concurrent call, an
                    if other.tail == tail:      # evicted L0 key): keep one copy
                        self._touch(other)
                        self._index_l0(key, other)
                        return other
            entry = _Entry()
            entry.l0_key, entry.text_leaf, entry.tail = key, parent, tail
            entry.nbytes, entry.nchars, entry.ascii = off + len(data), nchars, ascii_only
            entry.ntokens, entry.dirty, entry.pins, entry.in_l0 = len(ids), dirty, 0, False
            # IDs: keep the matched entry's id nodes before the first changed token, add the rest.
            shared = min(base[3] // M, len(base[1])) if base is not None and repairable else 0
            id_parent = base[1][shared - 1] if shared else None
            for j in range(shared, len(ids) // M):
                node_cps = _frozen(cps[j * (M // STRIDE) : (j + 1) * (M // STRIDE)]) if repairable else None
                node = _IdNode(_frozen(ids[j * M : (j + 1) * M]), node_cps, id_parent)
                if id_parent is not None:
                    id_parent.users += 1
                self._bytes += node.nbytes
                id_parent = node
            n_full = (len(ids) // M) * M
            entry.id_leaf, entry.id_tail = id_parent, _frozen(ids[n_full:])
            entry.cp_tail = _frozen(cps[n_full // STRIDE :]) if repairable else None
            if id_parent is not None:
                id_parent.users += 1
            if parent is not None:
                parent.terminal[entry] = None
            entry.charge = (len(tail) + entry.id_tail.nbytes + (entry.cp_tail.nbytes if repairable else 0)
                            + 24 * len(dirty) + ENTRY_OVERHEAD)
            self._bytes += entry.charge
            self._lru[entry] = None
            self._index_l0(key, entry)
            self._evict()
            if entry in self._lru:
                return entry
            self._not_stored += 1  # larger than the whole bound: evicted at once
            self._evictions["l1"] -= 1
            return None

    def _index_l0(self, key: int, entry: _Entry) -> None:
        if not self._enable_l0:
            return
        old = self._l0.get(key)
        if old is not None and old is not entry:
            old.in_l0 = False
        self._l0[key] = entry
        self._l0.move_to_end(key)
        entry.in_l0 = True
        while len(self._l0) > self._l0_max:
            _, dropped = self._l0.popitem(last=False)
            dropped.in_l0 = False
            self._evictions["l0"] += 1

    def _touch(self, entry: _Entry) -> None:
        self._lru.move_to_end(entry)
        leaf = entry.text_leaf
        if leaf is not None:  # most recent last among the candidates at its node
            del leaf.terminal[entry]
            leaf.terminal[entry] = None

    def _evict(self) -> None:
        while self._bytes > self._max_bytes and self._hot:  # live sessions first: only speed is lost
            self._unhot(next(iter(self._hot)))
        while self._bytes > self._max_bytes:
            victim = next((e for e in self._lru if not e.pins), None)
            if victim is None:
                return  # everything left is in use by a concurrent call: evicted when it ends
            self._drop(victim)
            self._evictions["l1"] += 1

    def _unhot(self, entry: _Entry) -> None:
        hot = self._hot.pop(entry, None)
        if hot is not None:
            self._bytes -= hot.charge
            self._hot_bytes -= hot.charge

    def _drop(self, entry: _Entry) -> None:
        del self._lru[entry]
        self._bytes -= entry.charge
        self._unhot(entry)
        if entry.in_l0 and self._l0.get(entry.l0_key) is entry:
            del self._l0[entry.l0_key]
        entry.in_l0 = False
        node = entry.text_leaf
        if node is not None:
            del node.terminal[entry]
        while node is not None and not node.terminal and not node.children:
            del self._nodes[node.key]
            if node.parent is not None:
                del node.parent.children[node.key]
            self._bytes -= len(node.data) + TEXT_NODE_OVERHEAD
            node = node.parent
        inode = entry.id_leaf
        if inode is not None:
            inode.users -= 1
        while inode is not None and inode.users == 0:
            self._bytes -= inode.nbytes
            inode = inode.parent
            if inode is not None:
                inode.users -= 1

    # -- persistence (additive: a server writes entries behind and adopts them after a restart) --
    def entries(self) -> Iterator[tuple[bytes, np.ndarray]]:
        """``(text as UTF-8, ids)`` of every stored entry, most recently used first: what a server
        writes so that the cache outlives its process (`adopt` takes them back).

        The list of entries is taken under the lock; each is materialized (O(its size)) when the
        iterator reaches it, outside the lock (entries are immutable, so one evicted meanwhile
        still reads whole).  The arrays are new, the caller's to keep."""
        with self._lock:
            live = list(reversed(self._lru))
        for entry in live:
            text = b"".join([n.data for n in _path(entry.text_leaf)] + [entry.tail])
            yield text, self._materialize_ids(_path(entry.id_leaf), entry)

    def adopt(self, text: str | bytes, ids: np.ndarray, certificate: str) -> None:
        """Store a ``(text, ids)`` state written earlier (`entries`, with its
        ``toktier.session.state_certificate``) as an entry, as if `encode` had just tokenized it.

        Checked the way `Session.from_state` checks a session's state: the certificate must be
        this tokenizer's over exactly this text and these IDs, then an O(N) tiling check (no
        encode); without it the text is encoded once and must give `ids`.  Raises
        `toktier.InvalidState` (nothing stored) when `ids` are not the reference encoding of
        `text`.  Counts no lookup; subject to the byte bound like any entry."""
        data = _to_utf8(text) if isinstance(text, str) else bytes(text)
        nchars = len(data) if data.isascii() else len(data.decode("utf-8"))
        session = Session._from_state_utf8(self.tokenizer, data, nchars, ids, certificate=certificate,
                                           window=self._window, full_path=self._full_path)
        anchors, key = self._anchors_of(data)
        self._store(session, data, nchars, data.isascii(), anchors, key, None)

    @staticmethod
    def _anchors_of(data: bytes) -> tuple[list[int], int]:
        """The block anchors and the whole-text key of `data` (`encode`'s and `adopt`'s lookups)."""
        B = BLOCK_BYTES
        mv = memoryview(data)
        anchors: list[int] = []
        h = 0
        for lo in range(0, len(data) - B + 1, B):
            h = _chain(h, mv[lo : lo + B])
            anchors.append(h)
        return anchors, _chain(h, mv[len(anchors) * B :])
