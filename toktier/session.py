"""Per-session token state and its exact incremental repair.

State (small, per session, apart from the shared immutable tokenizer):

    text    bytearray, UTF-8                          grows in place
    ids     uint32[n]                                 GrowableU32
    starts  uint32[n/64]  byte offset of every 64th   SparseOffsets (offsets.py): any token's
                          token                       start from a checkpoint + token lengths
    dirty   [(a, b, d)]   NFC families only: spans the normalizer changes (see below)

About 4 bytes per token plus the text (plus growth capacity).  Every op returns exactly
``tokenizer.encode(new_text)``:

Repair of an edit T -> T' = T[:s] + X + T[e:] (an append is s = e = len(T)):

1. Re-tokenize a window W = T'[p:r] around the change (p = s - w_left,
   r = end of X + w_right, snapped to character boundaries; w defaults to twice the
   longest token, 256 bytes for every bundled tokenizer).
2. Left of the change, align W's tokens with the cached ones by (start, id) and
   take agreeing runs, longest first.  Accept a run when it has >= 2 tokens,
   covers more bytes than the longest token, and holds a *stable boundary* q1
   (a family predicate on text[q1-1], text[q1], see families/) that no
   added-token literal spans in T or T'.  Right of the change likewise (cached
   offsets shifted by len(X) - (e - s)), giving q2.  At a side that reaches the
   text's end no boundary is needed.
   Inside a long piece (a run of ``=``, DNA, spaces, digits) there is no stable
   boundary; then a token start of an agreeing run is accepted where the pair around
   it is *glued* (``families/glue.py``: no scan separates it, and every scan ends the
   piece at the same place) or where a whole digit-triple token ends/starts: BPE's
   valid-encoding properties make old tokens up to it plus fresh tokens from it the
   new piece's encoding.  Window edges are moved to cached token starts so that the
   fresh tokens of such a piece line up with the cached ones.
3. Splice: ids = cached[:k1] + fresh[q1:q2] + cached[k2:]; the fresh tokens'
   bytes must tile T'[q1:q2] exactly (this also certifies that an NFC normalizer
   left the span unchanged).
4. Otherwise double the failing side's window (at most 5 times), then
   re-tokenize the whole text (the full path: slower, never wrong).

NFC families, local certification: where the normalizer changes the text (a
decomposed file name), the tokens tile the *normalized* text.  The session keeps token
starts in normalized coordinates and remembers each such span (raw range, byte delta;
``nfc_spans.py``: spans between NFC-inert characters, so NFC of the text is NFC of the
pieces).  A repair window is cut before NFC-inert characters outside every span
(`_nfc_edges`), so NFC of the window is the matching slice of NFC of the text; the
window's own spans (old ones it covers, new ones the change brings) map its fresh token
starts to raw positions, the session's spans map the cached ones, and the splice is
accepted at stable boundaries (inert on both sides, hence outside every span) exactly as
elsewhere.  The committed spans are the old ones outside the splice plus the window's
inside it.  So decomposed text costs nothing extra, wherever it is and however it
arrives; only a change inside a run of more than `MAX_EDGE_STEPS` combining characters
takes the full path.

Where it can, the first window's splice runs in compiled code (``native/repair.hpp``, the
same certificate): an append shorter than a window the lane keeps on one thread is one call,
`RepairLane.append_commit`, which reads an ASCII str's bytes in place, splices into the
session's buffers and grows the text; Python only updates the counters and builds the
result.  An op right after the process slept finds every cache and TLB entry cold, and each
Python step then costs microseconds (see bench/RESULTS.md, "the one-call append").

Unsupported families (`tokenizer.family is None`) always take the full path, which
for large texts encodes chunks cut at standalone-stable boundaries in parallel
(`fullpath.py`).  A session is not thread-safe: the caller orders ops on it.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from .buffers import Allocator, GrowableU32, spare_room
from .errors import InvalidEditRange, InvalidState, InvalidText
from .families import I
from .fullpath import FullPath, nfc_form_of
from .nfc_spans import SpanMap, nfc_spans
from .native import LANE_PARALLEL_MIN_BYTES
from .native import _core as _native  # None in a tree nobody built
from .offsets import STRIDE, SparseOffsets
from .repair_window import WindowContext, case_table_of, char_at, digit_table_of, run_edge
from .registry import FrozenTokenizer

MAX_WIDENINGS = 5
MAX_EDGE_STEPS = 64  # characters an NFC window edge may move to reach an NFC-inert one
MAX_TEXT_BYTES = 1 << 32  # token start offsets are uint32
PRIME_HEADROOM = 4096  # tokens (and 8x as many text bytes) of spare room in a restored session, at least
PRIME_SPARE_TEXT = 1 << 18  # from this size a primed text gets spare room (one copy less at its first op)


class RepairPath(str, enum.Enum):
    """How an op's result was produced."""

    NOOP = "noop"  # the text did not change
    FIRST_WINDOW = "first_window"  # spliced with the initial window
    WIDENED = "widened"  # spliced after widening the window `widenings` times
    FULL = "full"  # whole text re-tokenized (see `OpResult.reason`)


class OpResult(NamedTuple):
    """Outcome of one session op (immutable).  `ids` is a view valid until the next op.

    A named tuple rather than a frozen dataclass: `append`'s compiled path builds it with one
    C-level ``tuple.__new__``, where a frozen dataclass runs a Python ``__init__`` with an
    ``object.__setattr__`` per field (~40 us when an op's code is cold, as after the process
    slept: more than the splice of a short append)."""

    ids: np.ndarray
    first_changed: int  # first token index that differs from the previous state
    path: RepairPath
    widenings: int = 0
    reason: str | None = None  # why the full path was taken


_new_tuple = tuple.__new__  # OpResult without its Python-level __new__ (all five fields given)
_FIRST_WINDOW = RepairPath.FIRST_WINDOW


@dataclass(slots=True)
class SessionStats:
    """Per-session outcome counters."""

    ops: int = 0
    noop: int = 0
    first_window: int = 0
    widened: int = 0
    full: int = 0
    widenings: int = 0
    glued: int = 0  # splices cut inside a long piece (``families/glue.py``), counted in first_window/widened too
    tokens_retokenized: int = 0  # tokens produced by window or full encodes
    lane: int = 0  # first-window splices done by the compiled lane (counted in first_window too)
    full_reasons: dict[str, int] = field(default_factory=dict)


def _to_utf8(text: str) -> bytes:
    if not isinstance(text, str):
        raise InvalidText(f"text must be str, not {type(text).__name__}")
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidText(f"text is not valid Unicode at index {exc.start} ({exc.reason})") from None


def _exclusive_cumsum(lengths: np.ndarray, base: int) -> np.ndarray:
    out = np.empty(len(lengths), dtype=np.int64)
    if len(lengths):
        out[0] = 0
        np.cumsum(lengths[:-1], out=out[1:])
    return out + base


@dataclass(slots=True)
class _Side:
    ok: bool
    cached_idx: int = 0  # k: cached token index at the boundary
    fresh_idx: int = 0  # j: fresh token index at the boundary
    pos: int = 0  # boundary byte position (new-text coordinates)
    glued: bool = False  # a token boundary inside a long piece (``families/glue.py``), not a stable one


class Session:
    """A growing/edited text and its token IDs, always equal to the reference encoding.

    >>> from toktier import load_tokenizer
    >>> s = Session(load_tokenizer("cl100k_base"), "def pipe")
    >>> r = s.append("line(x):")
    >>> (s.text, r.ids.tolist() == s.tokenizer.encode(s.text).tolist(), r.first_changed)
    ('def pipeline(x):', True, 1)
    """

    def __init__(self, tokenizer: FrozenTokenizer, text: str = "", *, window: int | None = None,
                 allocator: Allocator | None = None, full_path: FullPath | None = None) -> None:
        if window is None:
            window = default_window(tokenizer)
        if window < 16:
            raise ValueError(f"window must be at least 16 bytes, not {window}")
        self.tokenizer = tokenizer
        self.window = int(window)
        # Whole-text encodes (session start, fallbacks, huge windows); injected like the
        # allocator: a server passes one with its GPU router and exports its counters.
        self.full_path = full_path or FullPath()
        self.stats = SessionStats()
        self._text = bytearray()
        self._nchars = 0
        self._ascii = True
        self._ids = GrowableU32(allocator)
        self._starts = SparseOffsets(tokenizer.token_len)
        # Splices need a proven family and token bytes that tile the text.
        self._spliceable = tokenizer.family_info is not None
        self._why_not = tokenizer.family_reason
        self._tiles = True  # token bytes tile the text (empty text trivially)
        # NFC families: text spans the normalizer changes, as (raw start, raw end, byte delta), sorted,
        # and the raw <-> normalized position map they define.  Token starts are normalized coordinates.
        self._dirty: list[tuple[int, int, int]] = []
        self._dmap = SpanMap([])
        # Long-piece look-backs (o200k word runs): key -> (checked up to byte, last code point before
        # it outside the key's set, -1 if none); valid while the text before that byte is unchanged.
        self._lookback: dict[str, tuple[int, int]] = {}
        # An operator (e.g. the shadow verifier on a mismatch) may switch splicing off.
        self.fast_path = True
        if text:
            form = None
            if isinstance(text, str):
                # (an NFC family's text the normalizer changes is encoded in its normalized form)
                form = nfc_form_of(self.tokenizer, text) if self._spliceable else None
                if form is text and self._start(text):
                    return
            data = _to_utf8(text)
            if len(data) >= MAX_TEXT_BYTES:
                raise InvalidText(f"session text would exceed {MAX_TEXT_BYTES} bytes (uint32 token offsets)")
            self._full(data, len(text), reason="initial text", text=text, form=form)

    def _start(self, text: str) -> bool:
        """The session start through the native engine's staged chunks (`FullPath.start`): the IDs, the
        text's UTF-8 and the checkpoints written by the chunk threads straight into this session's
        buffers, so the calling thread copies nothing of the whole text (`_full` encoded it to bytes,
        concatenated the chunks' IDs, then copied both and walked the IDs for the checkpoints: ~4 ms
        of a 4M-character start).  False, with nothing changed: `_full` serves it (no native engine,
        a GPU, anything the proof below does not cover).  `text` must be its own `nfc_form_of`."""
        tok = self.tokenizer
        if not self._spliceable:
            return False
        # The caller found `text` to be its own `nfc_form_of` (its tokens tile it as a normalizer-free
        # family's do); one the normalizer changes goes to `_full` and `_install_offsets` (the spans
        # it changes, kept as dirty spans).
        staged = self.full_path.start(tok, text, check_nfc=False)
        if staged is None:
            return False
        if staged.num_bytes >= MAX_TEXT_BYTES:
            raise InvalidText(f"session text would exceed {MAX_TEXT_BYTES} bytes (uint32 token offsets)")
        if staged.num_bytes >= 1 << 16:
            digit_table_of(tok)  # as in `_full`: once per tokenizer, inside this slower op
            if tok.family_info.name == "o200k":
                case_table_of(tok)
        n = staged.num_ids
        # A large start gets room for the next ops' tokens and text, as a restore does (`_prime`):
        # the first append after a 4M-character start copied both buffers (1.4 ms) to grow them.
        # A small one (a conversation's new tail segment, every generated turn) gets none: it
        # would hold 16 KiB idle for good once the segment freezes.
        big = staged.num_bytes >= PRIME_SPARE_TEXT
        room = spare_room(n, PRIME_HEADROOM) if big else 0
        text_room = spare_room(staged.num_bytes, 8 * PRIME_HEADROOM) if big else 0
        self._ids.reserve(n + room)
        self._starts.reserve_for(n + room)
        cp_buf, _ = self._starts.raw()
        data = staged.write(self._ids.buffer, cp_buf, STRIDE, text_room)
        if data is None:  # an id outside the length table (never from a built engine)
            return False
        self._ids.n = n
        self._text = data
        self._nchars = len(text)
        self._ascii = text.isascii()
        ids = self._ids.view()
        # Each chunk's canonical token lengths tile its bytes (so the checkpoints written from the
        # chunks' byte starts are the canonical prefix sums) and no uncertain token spans other
        # bytes: what `_install_offsets` proves from the same sums; otherwise its general path.
        if staged.tiles and (not staged.uncertain or tok.table.canonical_spans_ok(ids, data)):
            self._starts.set_count(-(-n // STRIDE))
            self._tiles = True
            self._set_dirty([])
        else:
            self._install_offsets(ids, bytes(data))
        self.stats.full += 1
        self.stats.tokens_retokenized += n
        self.stats.full_reasons["initial text"] = self.stats.full_reasons.get("initial text", 0) + 1
        return True

    # -- forks and primed sessions ---------------------------------------------
    def fork(self, *, allocator: Allocator | None = None) -> "Session":
        """An independent session with this one's text and IDs (a copy: O(N) memcpy, no encode).

        Branches (retries, parallel sub-agents, tree search) fork a shared prefix and go on
        separately; ops on either never affect the other.  Counters start at zero.

        >>> from toktier import load_tokenizer
        >>> a = Session(load_tokenizer("cl100k_base"), "shared prompt. ")
        >>> b = a.fork()
        >>> _ = a.append("left"); _ = b.append("right")
        >>> (a.text, b.text)
        ('shared prompt. left', 'shared prompt. right')
        """
        new = Session.__new__(Session)
        new.tokenizer, new.window, new.full_path = self.tokenizer, self.window, self.full_path
        new.stats = SessionStats()
        new._text = bytearray(self._text)
        new._nchars, new._ascii = self._nchars, self._ascii
        new._ids = GrowableU32(allocator, capacity=self._ids.n)
        new._ids.assign(self._ids.view())
        new._starts = self._starts.copy()
        new._spliceable, new._why_not, new._tiles = self._spliceable, self._why_not, self._tiles
        new._set_dirty(list(self._dirty))
        new._lookback = dict(self._lookback)
        new.fast_path = self.fast_path
        return new

    def certificate(self) -> str:
        """A checksum binding this tokenizer's hash, the text and the IDs (see `from_state`).

        It proves integrity, not origin: accept certificates only from a store you own.
        """
        return state_certificate(self.tokenizer, bytes(self._text), self._ids.view())

    @classmethod
    def from_state(cls, tokenizer: FrozenTokenizer, text: str, ids: np.ndarray, *, certificate: str | None = None,
                   window: int | None = None, allocator: Allocator | None = None,
                   full_path: FullPath | None = None) -> "Session":
        """A session primed with known `(text, ids)`, certified without re-encoding where it can.

        With the `certificate` an earlier `Session.certificate()` gave for exactly this
        tokenizer, text and IDs, the state is accepted after an O(N) check that the token
        bytes tile the text (no encode).  Without one (or with one that does not match, or
        when tiling cannot be shown) the text is encoded once and must give `ids`.  Either way a state that is not the
        reference encoding raises `InvalidState`; the session is never primed with it.

        >>> from toktier import load_tokenizer
        >>> tok = load_tokenizer("cl100k_base")
        >>> s = Session(tok, "hello world")
        >>> t = Session.from_state(tok, s.text, s.ids, certificate=s.certificate())
        >>> t.append("!").ids.tolist() == tok.encode("hello world!").tolist()
        True
        """
        return cls._from_state_utf8(tokenizer, _to_utf8(text), len(text), ids, certificate=certificate, window=window,
                                    allocator=allocator, full_path=full_path, text=text)

    @classmethod
    def _from_state_utf8(cls, tokenizer: FrozenTokenizer, data: bytes, nchars: int, ids: np.ndarray, *,
                         certificate: str | None = None, window: int | None = None, allocator: Allocator | None = None,
                         full_path: FullPath | None = None, text: str | None = None,
                         checksummed: bool = False) -> "Session":
        """`from_state` of valid UTF-8 `data` holding `nchars` characters (`text`: the same as a str,
        when the caller has it; decoded only if the state must be verified by encoding).

        `checksummed`: the caller vouches for the state's integrity and origin (a session record
        whose checksum held, read from a store only this server writes: `toktier.persist`), so
        it is accepted as a certified one is, without a certificate: IDs in range and token
        bytes that tile the text (O(N), no encode), else verified by one encode."""
        if len(data) >= MAX_TEXT_BYTES:
            raise InvalidText(f"session text would exceed {MAX_TEXT_BYTES} bytes (uint32 token offsets)")
        ids = _checked_ids(ids, len(tokenizer.table))
        s = cls(tokenizer, window=window, allocator=allocator, full_path=full_path)
        certified = checksummed or (certificate is not None and certificate == state_certificate(tokenizer, data, ids))
        if certified:
            s._prime(data, nchars, ids)
            if not s._spliceable or s._tiles:
                return s
            # The bytes cannot be shown to tile (too many NFC spans, an unproven ambiguous id):
            # not necessarily corrupt, so verify the way an uncertified state is verified.
        if text is None:
            text = data.decode("utf-8")
        ref = s.full_path.encode(tokenizer, text)
        if not np.array_equal(ref, ids):
            m = min(len(ref), len(ids))
            diff = np.flatnonzero(ref[:m] != ids[:m])
            at = int(diff[0]) if len(diff) else m
            raise InvalidState(f"the IDs are not the reference encoding of the text (first difference at token {at}"
                               f" of {len(ids)}; the reference has {len(ref)})")
        s._prime(data, nchars, ref)
        return s

    def _prime(self, data: bytes, nchars: int, ids: np.ndarray) -> None:
        """Install a state known to be the reference encoding of `data` (with room for the next op's
        tokens and text, so that the first op after a restore does not copy the state again)."""
        room = spare_room(len(ids), PRIME_HEADROOM)
        self._ids.reserve(len(ids) + room)
        if self._spliceable:
            self._starts.reserve_for(len(ids) + room)
            self._install_offsets(ids, data)
        self._ids.assign(ids)
        if len(data) >= PRIME_SPARE_TEXT:  # allocated with spare room, which `del` keeps (< half of it)
            text = bytearray(len(data) + spare_room(len(data), 8 * PRIME_HEADROOM))
            text[: len(data)] = data
            del text[len(data) :]
            self._text = text
        else:
            self._text[:] = data
        self._nchars = nchars
        self._ascii = data.isascii()

    # -- package-internal: states kept outside a session (`toktier.prefix_cache`) --------------
    def _parts(self) -> tuple[np.ndarray, np.ndarray | None, tuple[tuple[int, int, int], ...]]:
        """(ids, token-start checkpoints or None when no splice is provable, NFC spans), views valid
        until the next op: what `_adopt` needs besides the text to rebuild this state without work."""
        tiled = self._spliceable and self._tiles
        return self._ids.view(), (self._starts.checkpoints() if tiled else None), tuple(self._dirty)

    @classmethod
    def _adopt(cls, tokenizer: FrozenTokenizer, text: bytearray, nchars: int, ascii_only: bool,
               ids: list[np.ndarray], checkpoints: list[np.ndarray] | None, dirty: tuple[tuple[int, int, int], ...],
               *, window: int | None = None, full_path: FullPath | None = None, headroom: int = 0) -> "Session":
        """A session over a state that a session of this tokenizer derived and `_parts` exported,
        kept unmodified since and handed back in pieces (concatenated here, O(N) memcpy).

        Installed as is: no encode, no tiling check (`from_state` is the checked way in for states
        from elsewhere).  `checkpoints` None: the token bytes do not tile the text (full path only).
        Takes ownership of `text`; `headroom` tokens of spare capacity avoid a regrowth copy.
        """
        s = cls(tokenizer, window=window, full_path=full_path)
        n = sum(len(part) for part in ids)
        s._ids = GrowableU32(capacity=n + headroom)
        if n:
            np.concatenate(ids, out=s._ids.buffer[:n])
        s._ids.n = n
        if s._spliceable and checkpoints is not None:
            n_cp = sum(len(part) for part in checkpoints)
            if n_cp != -(-n // STRIDE):
                raise InvalidState(f"{n_cp} checkpoints for {n} tokens (expected one per {STRIDE})")
            s._starts.reserve_for(n + headroom)
            if n_cp:
                np.concatenate(checkpoints, out=s._starts.raw()[0][:n_cp])
            s._starts.set_count(n_cp)
        else:
            s._tiles = False
        s._set_dirty(list(dirty))
        s._text = text
        s._nchars = nchars
        s._ascii = ascii_only
        return s

    def _raw_start(self, k: int) -> int | None:
        """Byte offset in the text where token `k` starts (the text's length for k = num_tokens); a
        start inside an NFC-changed span maps to the span's start.  None when the token bytes do not
        tile the text (then no token has a known position)."""
        if not (self._spliceable and self._tiles):
            return None
        if k >= self._ids.n:
            return len(self._text)
        norm = self._starts.start_of(self._ids.buffer, k)
        return int(self._dmap.to_raw(np.array([norm]), "floor")[0]) if self._dmap else norm

    # -- read access --------------------------------------------------------
    @property
    def text(self) -> str:
        return self._text.decode("utf-8")

    @property
    def ids(self) -> np.ndarray:
        """All token IDs (uint32 view, valid until the next op)."""
        return self._ids.view()

    @property
    def ids_buffer(self) -> np.ndarray:
        """The whole backing array of `ids` (its identity changes when it grows)."""
        return self._ids.buffer

    @property
    def num_tokens(self) -> int:
        return self._ids.n

    @property
    def num_chars(self) -> int:
        return self._nchars

    @property
    def num_bytes(self) -> int:
        return len(self._text)

    @property
    def nbytes(self) -> int:
        """Bytes held: text plus token arrays (capacity)."""
        return len(self._text) + self._ids.nbytes + self._starts.nbytes

    # -- ops ------------------------------------------------------------------
    def append(self, text: str) -> OpResult:
        nat = self.tokenizer.native
        if (nat is not None and nat.demoted is None and type(text) is str and self._tiles and not self._dirty
                and self.fast_path and self._spliceable and self.full_path.gpu is None and self._ids.n):
            # One compiled call for the common op (`RepairLane.append_commit`): the UTF-8, the
            # first window's certified splice, the text's growth.  With its code and data cold
            # (an op after the process slept), each Python step it saves costs microseconds.
            ids, starts = self._ids, self._starts
            # Room first: a lane that finds a buffer too small has encoded its window for nothing
            # (the general path encodes it again).  An append adds fewer tokens than it has
            # characters, nearly always, plus the window's re-encoded tokens; growth is 1.5x, so
            # this allocates about as rarely as the commit itself would.
            # (only appends whose window stays on one thread: longer ones take the chunked lane below)
            max_bytes = LANE_PARALLEL_MIN_BYTES - 2 * self.window
            if len(text) < max_bytes:
                self._room_for_tokens(ids.n + len(text) + self.window)
            cp, n_cp = starts.raw()
            done = nat.lane().append_commit(nat.pool, self._text, text, ids.buffer, ids.n, cp, n_cp, STRIDE,
                                            self.window, max_bytes)
            if done is not None:
                stats = self.stats
                if done[0] == 0:
                    ids.n = done[2]
                    starts.set_count(done[3])
                    self._nchars += len(text)
                    self._ascii = self._ascii and text.isascii()
                    # (`_lookback` stays whole: its entries end at or before the old text's end)
                    stats.ops += 1
                    stats.tokens_retokenized += done[4]
                    stats.lane += 1
                    stats.first_window += 1
                    return _new_tuple(OpResult, (ids.view(), done[1], _FIRST_WINDOW, 0, None))
                stats.tokens_retokenized += done[1]  # declined: the general path, without the lane
                end = len(self._text)
                return self._apply(end, end, _to_utf8(text), len(text), lane=False)
        data = _to_utf8(text)
        end = len(self._text)
        return self._apply(end, end, data, len(text))

    def edit(self, start: int, end: int, text: str) -> OpResult:
        """Replace characters [start, end) of the current text by `text`."""
        if not (isinstance(start, int) and isinstance(end, int)) or not 0 <= start <= end <= self._nchars:
            raise InvalidEditRange(
                f"edit range [{start}, {end}) is outside the text (0 <= start <= end <= {self._nchars})"
            )
        data = _to_utf8(text)
        s, e = self._char_to_byte(start, end)
        return self._apply(s, e, data, len(text) - (end - start))

    def sync(self, full_text: str) -> OpResult:
        """Make the session text equal `full_text`; the differing middle becomes an edit."""
        return self._sync_utf8(_to_utf8(full_text), len(full_text))

    def _sync_utf8(self, new: bytes, nchars: int, known_prefix: int = 0) -> OpResult:
        """`sync` to UTF-8 `new` of `nchars` characters.  The caller may vouch that the first
        `known_prefix` bytes equal the current text's (`prefix_cache` verified them already), which
        skips comparing them again."""
        old = self._text
        n_old, n_new = len(old), len(new)
        if n_new >= n_old and new.startswith(old):  # the common agent case: an append
            return self._apply(n_old, n_old, new[n_old:], nchars - self._nchars)
        m = min(n_old, n_new)
        kp = min(max(known_prefix, 0), m)
        a = np.frombuffer(old, dtype=np.uint8, count=m - kp, offset=kp)
        b = np.frombuffer(new, dtype=np.uint8, count=m - kp, offset=kp)
        diff = np.flatnonzero(a != b)
        prefix = kp + (int(diff[0]) if len(diff) else m - kp)
        limit = m - prefix
        a_rev = np.frombuffer(old, dtype=np.uint8)[n_old - limit:][::-1]
        b_rev = np.frombuffer(new, dtype=np.uint8)[n_new - limit:][::-1]
        rdiff = np.flatnonzero(a_rev != b_rev)
        suffix = int(rdiff[0]) if len(rdiff) else limit
        del a, b, a_rev, b_rev  # release views of the bytearray before it is resized
        while 0 < prefix < n_old and (old[prefix] & 0xC0) == 0x80:
            prefix -= 1
        while suffix > 0 and (old[n_old - suffix] & 0xC0) == 0x80:
            suffix -= 1
        s, e = prefix, n_old - suffix
        middle = new[prefix : n_new - suffix]
        return self._apply(s, e, middle, nchars - self._nchars)

    # -- internals ------------------------------------------------------------
    def _char_to_byte(self, start: int, end: int) -> tuple[int, int]:
        if self._ascii:
            return start, end
        if _native is not None:  # compiled: ~10x numpy's temporaries deep inside a long text
            s = _native.char_offset_to_byte(self._text, self._nchars, start)
            if end == start:
                return s, s
            rest = memoryview(self._text)[s:]  # the end counted on from the start: one long scan, not two
            try:
                return s, s + _native.char_offset_to_byte(rest, self._nchars - start, end - start)
            finally:
                rest.release()  # (before the text is resized)
        return _byte_offset(self._text, self._nchars, start), _byte_offset(self._text, self._nchars, end)

    def _apply(self, s: int, e: int, data: bytes, dchars: int, lane: bool = True) -> OpResult:
        """Replace bytes [s, e) by `data` (`dchars` characters more); `lane` False: the compiled lane
        declined this op already (`append`), so the repair starts on the general path."""
        self.stats.ops += 1
        if s == e and not data:
            self.stats.noop += 1
            return OpResult(self._ids.view(), self._ids.n, RepairPath.NOOP)
        if len(self._text) - (e - s) + len(data) >= MAX_TEXT_BYTES:
            raise InvalidText(f"session text would exceed {MAX_TEXT_BYTES} bytes (uint32 token offsets)")
        if not self._spliceable:
            reason = f"tokenizer not spliceable: {self._why_not}"
        elif not self.fast_path:
            reason = "fast path disabled for this session"
        elif not self._tiles:
            reason = ("token bytes do not tile the text (the normalizer changes it, or a token's byte span is "
                      "unproven): no splice is provable")
        else:
            result = self._repair(s, e, data, dchars, lane)
            if isinstance(result, OpResult):
                return result
            reason = result
        new_text = bytes(self._text[:s]) + data + bytes(self._text[e:])
        return self._full(new_text, self._nchars + dchars, reason)

    def _full(self, new_text: bytes, nchars: int, reason: str, text: str | None = None,
              form: str | None = None) -> OpResult:
        """Re-tokenize all of `new_text` (UTF-8; `text`: the same as a str when the caller has it,
        `form`: its `nfc_form_of`)."""
        tok = self.tokenizer
        if len(new_text) >= 1 << 16 and self._spliceable:
            # once per tokenizer, inside this slower op: a long piece's first cut should not pay for it
            digit_table_of(tok)
            if tok.family_info.name == "o200k":
                case_table_of(tok)
        if text is None:
            text = new_text.decode("utf-8")
        ids = self.full_path.encode(tok, text, new_text, form)  # GPU or parallel chunks when large
        old = self._ids.view()
        m = min(len(old), len(ids))
        diff = np.flatnonzero(old[:m] != ids[:m])
        first_changed = int(diff[0]) if len(diff) else (m if len(old) != len(ids) else len(ids))
        del old
        self._ids.reserve(len(ids))  # allocate before mutating anything
        if self._spliceable:
            self._starts.reserve_for(len(ids))
            self._install_offsets(ids, new_text, text)
        self._ids.assign(ids)
        self._text[:] = new_text
        self._lookback = {}
        self._nchars = nchars
        self._ascii = new_text.isascii()
        self.stats.full += 1
        self.stats.tokens_retokenized += len(ids)
        self.stats.full_reasons[reason] = self.stats.full_reasons.get(reason, 0) + 1
        return OpResult(self._ids.view(), first_changed, RepairPath.FULL, 0, reason)

    def _install_offsets(self, ids: np.ndarray, text: bytes, chars: str | None = None) -> None:
        """Token starts for `ids`, the reference encoding of `text`; sets `_tiles` and `_dirty`.

        The tokens' bytes tile the text, or (NFC families) tile it with each span the
        normalizer changes replaced by its normalized form: then starts are kept in those
        normalized coordinates and the spans are remembered, so that repairs anywhere else
        still splice (a decomposed file name early in a session costs nothing later).
        Otherwise no splice is provable for this text (`_tiles` False).  `chars`: `text` decoded,
        when the caller has it.
        """
        tok = self.tokenizer
        if not tok.family_info.nfc or text.isascii():
            # Lengths (and the uncertain ids' spans) prove tiling here, as in `_tiles_exactly`: the
            # checkpoints and the total in one compiled pass, no per-token lengths array.
            if self._starts.rebuild_all(ids) == len(text) and (
                    not tok.table.has_uncertain(ids) or tok.table.canonical_spans_ok(ids, text)):
                self._tiles = True
                self._set_dirty([])
                return
        lens = np.take(tok.token_len, ids)  # ~2x faster than a fancy index here (1M chars: 0.4 vs 0.7 ms)
        dirty: list[tuple[int, int, int]] = []
        ok = self._tiles_exactly(ids, text, lens)
        if not ok and self.tokenizer.family_info.nfc:
            found = nfc_spans(self.tokenizer, text, chars)
            if found is not None:
                dirty, normalized = found
                ok = self._tiles_exactly(ids, normalized, lens)
        if ok:
            self._starts.rebuild(ids, lens=lens)
        else:
            self._starts.rebuild(ids[:0])
            dirty = []
        self._tiles = ok
        self._set_dirty(dirty)

    def _set_dirty(self, spans: list[tuple[int, int, int]]) -> None:
        self._dirty = spans
        self._dmap = SpanMap(spans)

    def _norm(self, x: int) -> int:
        """Normalized-coordinate position of raw byte position `x` (outside every dirty span)."""
        return self._dmap.norm(x)

    def _lane_committed(self, s: int, e: int, data: bytes, dchars: int, first_changed: int, new_n: int,
                        new_cp: int) -> OpResult:
        """The result of a splice the compiled lane wrote into the buffers: counts and text updated."""
        self._ids.n = new_n
        self._starts.set_count(new_cp)
        self._finish_text(s, e, data, dchars)
        self.stats.first_window += 1
        return OpResult(self._ids.view(), first_changed, RepairPath.FIRST_WINDOW, 0)

    def _lane_after_dirty(self, s: int, e: int, data: bytes) -> tuple[int, int, int] | None:
        """The compiled lane's splice for a session holding spans the NFC normalizer changes
        (`_dirty`, which the lane cannot read), when the change lies far enough after all of
        them: (first changed token, new token count, new checkpoint count), committed in place,
        or None with nothing changed.

        After the last span, normalized positions (the token starts') are the raw ones plus one
        constant, so the lane runs on the text from a checkpoint r0 past the spans: its bytes,
        its tokens and its checkpoints less that checkpoint's start.  The lane treats r0 as a
        text start (no cut needed there) and reads literals and token edges before its window,
        so the change must lie further from r0 than all of that can reach: two windows, the
        longest token and the longest literal.  (Without this, one decomposed file name early in
        a Qwen session sent every later op to the Python repair: 11x slower for 1.4K appends.)"""
        tok = self.tokenizer
        last = self._dirty[-1][1]  # raw end of the last span (the spans are sorted)
        reach = 2 * self.window + tok.max_token_bytes + (tok.literals.max_len if tok.literals else 0) + 64
        if s - reach < last:
            return None
        shift = self._norm(last) - last  # normalized minus raw, everywhere after the last span
        cp, n_cp = self._starts.raw()
        j0 = int(np.searchsorted(cp[:n_cp], s - reach + shift, side="right")) - 1
        if j0 <= 0:
            return None
        c0 = int(cp[j0])
        r0, k0 = c0 - shift, j0 * STRIDE
        if r0 < last or k0 >= self._ids.n:
            return None
        sub_cp = np.array(cp[j0:], dtype=np.uint32)  # the checkpoints from j0, with the buffer's room
        sub_cp[: n_cp - j0] -= np.uint32(c0)
        text = memoryview(self._text)[r0:]
        try:
            status, _k1, _k2, _q1, _q2, nfresh, first_changed, new_n, new_cp, mid = tok.native.edit_commit(
                text, s - r0, e - r0, data, self._ids.buffer[k0:], self._ids.n - k0, sub_cp, n_cp - j0, STRIDE,
                self.window)
        finally:
            text.release()  # (before the text grows)
        self.stats.tokens_retokenized += nfresh
        if status != 0 or mid is not None:  # declined, or certified with a buffer short: nothing written
            return None
        cp[j0: j0 + new_cp] = sub_cp[:new_cp] + np.uint32(c0)
        return first_changed + k0, new_n + k0, new_cp + j0

    def _repair(self, s: int, e: int, data: bytes, dchars: int, lane: bool = True) -> OpResult | str:
        """The spliced result, or why no splice was certified."""
        tok = self.tokenizer
        T = self._text
        n_old = len(T)
        if (lane and not self._dirty and self._ids.n and tok.engine_label == "native"
                and not (self.full_path.gpu is not None and self.full_path.is_parallel(len(data) + 2 * self.window, tok))):
            # The compiled lane does the first window's splice in one call, with the same
            # certificate (a big window in chunks, a thread per core); when it declines, the path
            # below runs from scratch.  (Changes a GPU could take go below: their window goes there.)
            # It also writes the splice into the buffers when they have room (no Python array work).
            # Room first, so that the lane commits in place (a buffer too small makes the splice
            # go through `_commit` below: Python array work, ~0.1-0.5 ms).  Half a token per byte
            # covers nearly all text; an estimate short of it only costs that slower commit.
            self._room_for_tokens(self._ids.n + len(data) // 2 + self.window)
            cp_buf, n_cp = self._starts.raw()
            status, k1, k2, q1, q2, nfresh, first_changed, new_n, new_cp, mid = tok.native.edit_commit(
                T, s, e, data, self._ids.buffer, self._ids.n, cp_buf, n_cp, STRIDE, self.window)
            self.stats.tokens_retokenized += nfresh
            if status == 0:
                self.stats.lane += 1
                if mid is not None:  # certified, but a buffer must grow first
                    return self._commit(s, e, data, dchars, _Side(True, k1, 0, q1), _Side(True, k2, 0, q2), mid,
                                        len(data) - (e - s), 0, [])
                return self._lane_committed(s, e, data, dchars, first_changed, new_n, new_cp)
        elif lane and self._dirty and self._ids.n and tok.engine_label == "native" and self.full_path.gpu is None:
            self._room_for_tokens(self._ids.n + len(data) // 2 + self.window)
            committed = self._lane_after_dirty(s, e, data)
            if committed is not None:  # (the spans the normalizer changes are all before s: they stay)
                self.stats.lane += 1
                return self._lane_committed(s, e, data, dchars, *committed)
        lx = len(data)
        delta = lx - (e - s)
        nfc = tok.family_info.nfc
        wl = wr = self.window
        if s >= 2 * wl and T[s - 1] < 0x80 and bytes(T[s - wl : s]).count(T[s - 1]) == wl:
            # the change follows a run of one byte: a cut inside it needs agreeing tokens over a
            # stretch longer than the longest token, which one window of the run rarely holds
            wl *= 2
        for widenings in range(MAX_WIDENINGS + 2):
            if widenings > MAX_WIDENINGS:
                # Last try: a side still failing is inside a long run of one kind of character
                # (an edit inside 100K ``a``: every later token of the run changes); take the
                # window to the run's end, O(run) rather than O(text).
                grown = self._run_window(s, e, wl, wr, left.ok, right.ok)
                if grown is None:
                    break
                wl, wr = grown
            p = max(0, s - wl)
            while p > 0 and (T[p] & 0xC0) == 0x80:
                p -= 1
            r = min(n_old, e + wr)
            while r < n_old and (T[r] & 0xC0) == 0x80:
                r += 1
            # Edges at cached token starts: inside a long piece the fresh tokens then line up
            # with the cached ones (a run of one character tokenizes from its start).
            p, r = self._token_edges(p, r, s, e)
            if nfc:
                edges = self._nfc_edges(p, r, s, e)
                if edges is None:
                    return "no NFC-safe window edge (long runs of combining characters around the change)"
                p, r = edges
            window = bytes(T[p:s]) + data + bytes(T[e:r])
            try:
                wtext = window.decode("utf-8")
            except UnicodeDecodeError as exc:  # only reachable through a broken caller offset
                raise InvalidText(f"edit splits a UTF-8 sequence ({exc.reason})") from None
            # NFC families: the window's own spans the normalizer changes (old ones inside it, and
            # any the change brings); its tokens tile the normalized window.
            wmap, wnorm = SpanMap([]), window
            if nfc and not window.isascii():
                found = nfc_spans(tok, window)
                if found is not None:
                    wmap, wnorm = SpanMap(found[0]), found[1]
            # A huge change (a tool result of 100K+ chars) is a full encode of its own:
            # give it the parallel full path; small windows stay on this thread.
            big = self.full_path.is_parallel(len(wtext), tok)
            fresh = self.full_path.encode(tok, wtext) if big else tok.encode_fast(wtext)
            self.stats.tokens_retokenized += len(fresh)
            if tok.table.has_uncertain(fresh) and not tok.table.canonical_spans_ok(fresh, wnorm):
                # Fresh starts come from canonical lengths: unproven once a token may span other bytes.
                return "window holds a token whose byte span the text does not prove (see TokenTable)"
            fnorm = _exclusive_cumsum(tok.token_len[fresh], 0)  # normalized, window-local
            ctx = WindowContext(tok, T, s, e, data, p, r, wtext, window, wmap, fnorm, self._lookback)
            left = _Side(True, 0, 0, 0) if p == 0 else self._find_left(ctx, fresh)
            right = (_Side(True, self._ids.n, len(fresh), n_old + delta) if r == n_old
                     else self._find_right(ctx, fresh, delta))
            if left.ok and right.ok and left.fresh_idx <= right.fresh_idx:
                mid = fresh[left.fresh_idx : right.fresh_idx]
                lo, hi = (int(v) for v in wmap.to_norm(np.array([left.pos - p, right.pos - p])))
                if lo >= 0 and hi >= 0 and self._tiles_exactly(mid, wnorm[lo:hi]):
                    return self._commit(s, e, data, dchars, left, right, mid, delta, widenings,
                                        [(a + p, b + p, d) for a, b, d in wmap.spans])
                return "spliced tokens do not tile the new text (the normalizer changed it)"
            if not left.ok:
                wl *= 2
            if not right.ok:
                wr *= 2
        return f"no certified splice after {MAX_WIDENINGS} widenings"

    def _run_window(self, s: int, e: int, wl: int, wr: int, left_ok: bool, right_ok: bool) -> tuple[int, int] | None:
        """Window widths for one more try: each failing side's next doubling, or past the ASCII run
        (letters, digits, whitespace, or one repeated byte) around it when that is wider; None
        when the failing sides already reach the text's ends.  `wl`, `wr` are the doubled widths
        (not tried yet)."""
        T = self._text
        if (left_ok or wl // 2 >= s) and (right_ok or wr // 2 >= len(T) - e):
            return None
        if not left_ok and s > 0:
            wl = max(wl, s - run_edge(T, s - 1, -1) + self.window)
        if not right_ok and e < len(T):
            wr = max(wr, run_edge(T, e, 1) - e + self.window)
        return wl, wr

    def _token_edges(self, p: int, r: int, s: int, e: int) -> tuple[int, int]:
        """p moved left to the start of the cached token holding it, r right to the next token start."""
        ids = self._ids.view()
        n = len(ids)
        if p > 0 and n:
            k = self._starts.locate(ids, self._dmap.norm(p, "floor"))
            if k > 0:
                q = int(self._cached_raw(ids, k - 1, k)[0])
                if 0 <= q <= p:
                    p = q
        if r < len(self._text) and n:
            k = self._starts.locate(ids, self._dmap.norm(r, "ceil"))
            q = int(self._cached_raw(ids, k, k + 1)[0]) if k < n else len(self._text)
            if q >= r:
                r = q
        T = self._text  # byte-level tokens may start inside a character: back to character starts
        while p > 0 and (T[p] & 0xC0) == 0x80:
            p -= 1
        while r < len(T) and (T[r] & 0xC0) == 0x80:
            r += 1
        return min(p, s), max(r, e)

    def _nfc_edges(self, p: int, r: int, s: int, e: int) -> tuple[int, int] | None:
        """Window edges moved out to NFC-inert characters outside every old span.

        NFC of a window cut before inert characters is the matching slice of NFC of the
        text, so its tokens and spans are the text's.  None when no such edge lies within
        `MAX_EDGE_STEPS` characters (a long run of combining marks).
        """
        T, n, dmap = self._text, len(self._text), self._dmap
        classes = self.tokenizer.classes
        for _ in range(MAX_EDGE_STEPS):
            span = dmap.inside(p)
            if span is not None:
                p = span[0]
            if p == 0 or classes[char_at(T, p)] & I:
                break
            p -= 1
            while p > 0 and (T[p] & 0xC0) == 0x80:
                p -= 1
        else:
            return None
        for _ in range(MAX_EDGE_STEPS):
            span = dmap.inside(r)
            if span is not None:
                r = span[1]
            if r >= n or classes[char_at(T, r)] & I:
                break
            r += 1
            while r < n and (T[r] & 0xC0) == 0x80:
                r += 1
        else:
            return None
        return min(p, s), max(r, e)

    def _tiles_exactly(self, ids: np.ndarray, text: bytes, lens: np.ndarray | None = None) -> bool:
        """Whether the tokens' bytes concatenate to `text`.

        Byte-level BPE without a normalizer emits tokens whose bytes are the input's
        own, so matching lengths prove it for every id with one fixed span; an id
        that may span other bytes (`TokenTable` "uncertain") is proven by walking the
        text, and NFC families (the normalizer may rewrite text) compare all bytes.
        """
        tok = self.tokenizer
        if lens is None:
            lens = tok.token_len[ids]
        if int(lens.sum(dtype=np.int64)) != len(text):
            return False
        if tok.table.has_uncertain(ids) and not tok.table.canonical_spans_ok(ids, text):
            return False
        if tok.family_info.nfc and not text.isascii():  # (NFC leaves ASCII as it is: lengths prove it)
            return _spells(tok, ids, lens, text)
        return True

    def _runs(self, c_starts: np.ndarray, c_ids: np.ndarray, f_starts: np.ndarray,
              f_ids: np.ndarray) -> list[tuple[int, int, int]]:
        """Agreeing runs as (cached_lo, fresh_lo, length), longest first."""
        _, ci, fi = np.intersect1d(c_starts, f_starts, assume_unique=True, return_indices=True)
        agree = c_ids[ci] == f_ids[fi]
        ci, fi = ci[agree], fi[agree]
        if not len(ci):
            return []
        breaks = np.flatnonzero((np.diff(ci) != 1) | (np.diff(fi) != 1)) + 1
        bounds = np.concatenate(([0], breaks, [len(ci)]))
        runs = [(int(ci[a]), int(fi[a]), int(b - a)) for a, b in zip(bounds[:-1], bounds[1:])]
        runs.sort(key=lambda t: (-t[2], -t[0]))
        return runs

    def _cached_raw(self, ids: np.ndarray, k_lo: int, k_hi: int) -> np.ndarray:
        """Raw byte starts of cached tokens k_lo..k_hi-1; tokens starting inside an NFC span get
        distinct negative markers (they have no raw position and never agree with a fresh start)."""
        c = self._starts.starts(ids, k_lo, k_hi)
        if not self._dmap:
            return c
        raw = self._dmap.to_raw(c)
        bad = raw < 0
        if bad.any():
            raw[bad] = -(1 << 40) - np.flatnonzero(bad)
        return raw

    @staticmethod
    def _fresh_raw(ctx: "WindowContext") -> np.ndarray:
        """Raw new-text byte starts of the fresh tokens (negative markers inside the window's spans)."""
        raw = ctx.wmap.to_raw(ctx.fnorm) if ctx.wmap else ctx.fnorm.copy()
        bad = raw < 0
        raw += ctx.p
        if bad.any():
            raw[bad] = -(1 << 41) - np.flatnonzero(bad)
        return raw

    def _find_left(self, ctx: "WindowContext", fresh: np.ndarray) -> _Side:
        ids = self._ids.view()
        dmap = self._dmap
        k_lo = self._starts.locate(ids, dmap.norm(ctx.p))  # p lies outside every span (`_nfc_edges`)
        k_hi = self._starts.locate(ids, dmap.norm(ctx.s, "floor"))
        # fresh tokens starting before the change (a span the change joins counts as changed)
        s_norm = int(ctx.wmap.to_norm(np.array([ctx.s - ctx.p]), "floor")[0]) if ctx.wmap else ctx.s - ctx.p
        j_hi = int(np.searchsorted(ctx.fnorm, s_norm, "left"))
        c_starts = self._cached_raw(ids, k_lo, k_hi)
        c_ids = ids[k_lo:k_hi]
        fstarts = self._fresh_raw(ctx)[:j_hi]
        runs = [(c0, f0, n) for c0, f0, n in self._runs(c_starts, c_ids, fstarts, fresh[:j_hi])
                if self._run_ok(c_starts, c_ids, c0, n)]
        for glued in (False, True):  # a stable boundary anywhere first; else a cut inside a long piece
            for c0, f0, length in runs:
                run = c_starts[c0 + 1 : c0 + length]  # token starts with an agreeing token before
                inside = (run > ctx.p) & (run < ctx.s)
                cand = run[inside]
                if glued:  # the token before a digit cut is a whole triple
                    good = _sorted_union(ctx.glued_positions(cand, left=True),
                                      ctx.digit_cuts(cand, c_ids[c0 : c0 + length - 1][inside]))
                else:
                    good = ctx.stable_positions(cand, old_too=True)
                if len(good):
                    q = int(good[-1])
                    off = c0 + 1 + int(np.searchsorted(run, q))
                    return _Side(True, k_lo + off, f0 + (off - c0), q, glued)
        return _Side(False)

    def _find_right(self, ctx: "WindowContext", fresh: np.ndarray, delta: int) -> _Side:
        ids = self._ids.view()
        dmap = self._dmap
        k_lo = self._starts.locate(ids, dmap.norm(ctx.e, "ceil"))
        k_hi = self._starts.locate(ids, dmap.norm(ctx.r))  # r lies outside every span
        new_mid_end = ctx.s + len(ctx.data)
        e_norm = (int(ctx.wmap.to_norm(np.array([new_mid_end - ctx.p]), "ceil")[0]) if ctx.wmap
                  else new_mid_end - ctx.p)
        j_lo = int(np.searchsorted(ctx.fnorm, e_norm, "left"))
        c_starts = self._cached_raw(ids, k_lo, k_hi)
        c_starts = np.where(c_starts >= 0, c_starts + delta, c_starts)  # raw, in new coordinates
        c_ids = ids[k_lo:k_hi]
        fstarts = self._fresh_raw(ctx)[j_lo:]
        runs = [(c0, f0, n) for c0, f0, n in self._runs(c_starts, c_ids, fstarts, fresh[j_lo:])
                if self._run_ok(c_starts, c_ids, c0, n)]
        for glued in (False, True):
            for c0, f0, length in runs:
                run = c_starts[c0 + 1 : c0 + length]
                inside = run > new_mid_end
                cand = run[inside]
                if glued:  # the token at a digit cut is a whole triple
                    good = _sorted_union(ctx.glued_positions(cand, left=False),
                                      ctx.digit_cuts(cand, c_ids[c0 + 1 : c0 + length][inside]))
                else:
                    good = ctx.stable_positions(cand, old_too=True, delta=delta)
                if len(good):
                    q = int(good[0])
                    off = c0 + 1 + int(np.searchsorted(run, q))
                    return _Side(True, k_lo + off, j_lo + f0 + (off - c0), q, glued)
        return _Side(False)

    def _run_ok(self, c_starts: np.ndarray, c_ids: np.ndarray, c0: int, length: int) -> bool:
        """DESIGN conditions (1) and (2): >= 2 tokens, covering more than the longest token."""
        if length < 2:
            return False
        last = c0 + length - 1
        end = int(c_starts[last]) + int(self.tokenizer.token_len[c_ids[last]])
        return end - int(c_starts[c0]) > self.tokenizer.max_token_bytes

    def _room_for_tokens(self, n_tokens: int) -> None:
        """Capacity for `n_tokens` tokens in the id and checkpoint buffers (1.5x growth).  Each is
        checked: they grow by their own sizes, so the ID buffer can have room where the checkpoints
        do not (the compiled commit then declines, and the splice goes through `_commit`)."""
        if n_tokens > len(self._ids.buffer):
            self._ids.reserve(n_tokens)
        if not self._starts.has_room_for(n_tokens):
            self._starts.reserve_for(n_tokens)

    def _finish_text(self, s: int, e: int, data: bytes, dchars: int) -> None:
        """The text side of a committed splice (the token arrays are already updated)."""
        grow = len(data) - (e - s)
        if grow > 0 and _native is not None:  # room by half, not CPython's eighth (`reserve_text`)
            _native.reserve_text(self._text, len(self._text) + grow)
        if s == e == len(self._text):
            self._text += data
        else:
            self._text[s:e] = data
        if self._lookback:
            self._lookback = {k: v for k, v in self._lookback.items() if v[0] <= s}
        self._nchars += dchars
        self._ascii = self._ascii and data.isascii()  # conservative after deletions

    def _commit(self, s: int, e: int, data: bytes, dchars: int, left: _Side, right: _Side,
                mid: np.ndarray, delta: int, widenings: int, wspans: list[tuple[int, int, int]]) -> OpResult:
        k1, k2 = left.cached_idx, right.cached_idx
        old_seg = self._ids.view()[k1:k2].copy()
        # Allocate before mutating anything: a failed allocation leaves the session intact.
        new_n = self._ids.n - (k2 - k1) + len(mid)
        self._ids.reserve(new_n)
        self._starts.reserve_for(new_n)
        self._ids.replace(k1, k2, mid)
        # Tokens before k1 did not move; starts are normalized coordinates (dirty spans before k1).
        self._starts.rebuild(self._ids.view(), k1, self._norm(left.pos))
        if self._dirty or wspans:
            # Spans never straddle a stable boundary (both its characters are NFC-inert): keep the
            # old ones left of the splice, take the window's between its boundaries, shift the rest.
            old_right = right.pos - delta
            self._set_dirty([sp for sp in self._dirty if sp[1] <= left.pos]
                            + [sp for sp in wspans if sp[0] >= left.pos and sp[1] <= right.pos]
                            + [(a + delta, b + delta, d) for a, b, d in self._dirty if a >= old_right])
        first_changed = _first_difference(self._ids.view(), k1, old_seg, len(mid))
        self._finish_text(s, e, data, dchars)
        if left.glued or right.glued:
            self.stats.glued += 1
        path = RepairPath.FIRST_WINDOW if widenings == 0 else RepairPath.WIDENED
        if widenings:
            self.stats.widened += 1
            self.stats.widenings += widenings
        else:
            self.stats.first_window += 1
        return OpResult(self._ids.view(), first_changed, path, widenings)


def _spells(tok: FrozenTokenizer, ids: np.ndarray, lens: np.ndarray, text: bytes) -> bool:
    """Whether the tokens' canonical bytes concatenate to `text` (lengths already sum to it)."""
    if tok.native is not None:  # its token blob is the same one, compared in compiled code
        return tok.native.spells(ids, text)
    from .errors import UnsupportedTokenizer
    from .gpu.tables import bpe_tables  # the token bytes as one blob (built once per tokenizer)

    try:
        bt = bpe_tables(tok) if len(ids) >= 64 else None
    except UnsupportedTokenizer:
        bt = None
    if bt is None:
        return b"".join(map(tok.token_bytes.__getitem__, ids.tolist())) == text
    lens = lens.astype(np.int64)
    shift = bt.tok_off[ids].astype(np.int64) - _exclusive_cumsum(lens, 0)
    idx = np.repeat(shift, lens) + np.arange(len(text), dtype=np.int64)
    return bool(np.array_equal(bt.tok_blob[idx], np.frombuffer(text, dtype=np.uint8)))


def _sorted_union(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Sorted, duplicate-free union of two sorted arrays (``np.union1d`` imports ``numpy.ma``, ~10 ms
    on first use, which would land in some session's op)."""
    if not len(b):
        return a
    if not len(a):
        return b
    c = np.sort(np.concatenate((a, b)), kind="stable")
    return c[np.concatenate(([True], c[1:] != c[:-1]))]


def _byte_offset(text: bytearray, nchars: int, c: int) -> int:
    """Byte offset of character `c` of UTF-8 `text` (len(text) when c == nchars).

    Counts character starts from the nearer end, a stretch at a time: a stretch of as many bytes
    as characters are still to pass holds at most that many starts, so the bytes read are about
    the distance's own (one stretch for ASCII, a few for wider text) and an edit near either end
    of a long text costs O(distance), not O(text).
    """
    n = len(text)
    if c >= nchars:
        return n
    arr = np.frombuffer(text, dtype=np.uint8)
    try:
        if c <= nchars // 2:
            lo, seen = 0, 0  # character starts in arr[:lo]
            while lo < n:
                hi = min(n, lo + max(c + 1 - seen, 4096))
                starts = np.flatnonzero((arr[lo:hi] & 0xC0) != 0x80)
                if seen + len(starts) > c:
                    return lo + int(starts[c - seen])
                seen, lo = seen + len(starts), hi
        else:
            want, hi, seen = nchars - c, n, 0  # the want-th character start counting from the end
            while hi > 0:
                lo = max(0, hi - max(want - seen, 4096))
                starts = np.flatnonzero((arr[lo:hi] & 0xC0) != 0x80)
                if seen + len(starts) >= want:
                    return lo + int(starts[len(starts) - (want - seen)])
                seen, hi = seen + len(starts), lo
    finally:
        del arr  # release the buffer export before the bytearray is resized
    raise AssertionError("character count out of sync with the text")  # pragma: no cover


def _checked_ids(ids: object, vocab: int) -> np.ndarray:
    """`ids` as contiguous uint32, or `InvalidState` (a 1-D sequence of integers in [0, vocab))."""
    try:
        arr = np.asarray(ids)
    except (TypeError, ValueError) as exc:
        raise InvalidState(f"ids must be a 1-D sequence of integers ({exc})") from None
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise InvalidState(f"ids must be a 1-D sequence of integers, not {arr.ndim}-D {arr.dtype}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= vocab):
        bad = int(arr.min()) if int(arr.min()) < 0 else int(arr.max())
        raise InvalidState(f"id {bad} is outside the tokenizer's {vocab} ids")
    return np.ascontiguousarray(arr, dtype=np.uint32)


def state_certificate(tokenizer: FrozenTokenizer, text: bytes, ids: np.ndarray) -> str:
    """sha256 over (tokenizer hash, text, IDs), each length-prefixed: what `Session.certificate` gives."""
    h = hashlib.sha256()
    raw_ids = np.ascontiguousarray(ids, dtype="<u4").tobytes()
    for part in (tokenizer.hash.encode(), text, raw_ids):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


def default_window(tokenizer: FrozenTokenizer) -> int:
    """Bytes re-tokenized on each side of a change before any widening.

    A certifying run must cover more bytes than the longest token, so a window of
    twice that usually certifies at once (0 widenings in 1,747 appends of the
    multilingual/adversarial corpus for each of llama3, o200k_base, deepseek_v4 and
    qwen3; 192 bytes already widened once) while re-tokenizing as little as possible:
    for a small append the window is most of the text encoded (256 instead of 512
    bytes: P50 1.9 -> 1.5 ms at 1.4K-character appends).
    """
    return max(64, 2 * tokenizer.max_token_bytes)


def _first_difference(new: np.ndarray, k1: int, old_seg: np.ndarray, mid_len: int) -> int:
    """First index where `new` differs from the old ids, old[k1:] = old_seg ++ new[k1 + mid_len:].

    Compares in doubling chunks, so the work is proportional to the answer's
    distance from k1 (repeated text can push it past the replaced segment).
    Returns len(new) when nothing changed.
    """
    tail0 = k1 + mid_len
    n_old = k1 + len(old_seg) + (len(new) - tail0)
    i, chunk = 0, 64
    while True:
        hi = i + chunk
        a = new[k1 + i : k1 + hi]
        head = old_seg[i:hi]
        rest = max(0, hi - max(i, len(old_seg)))
        t_lo = tail0 + max(0, i - len(old_seg))
        b = np.concatenate((head, new[t_lo : t_lo + rest])) if rest else head
        m = min(len(a), len(b))
        d = np.flatnonzero(a[:m] != b[:m])
        if len(d):
            return k1 + i + int(d[0])
        if len(a) < chunk or len(b) < chunk:
            return k1 + i + m if len(new) != n_old else len(new)
        i, chunk = hi, chunk * 2
