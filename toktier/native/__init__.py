"""The native engine: a compiled encoder that returns exactly the reference's IDs, certified per tokenizer.

`attach(tok, choice)` runs at load: it builds the engine over the tokenizer's probed
class table and BPE tables (the ones the GPU path uses, ``toktier/gpu/tables.py``) and
certifies it (``certify.py``); only then does `FrozenTokenizer.encode_fast` (session
windows, big appends, the full path's chunks) go through it.  A tokenizer it cannot
certify keeps the reference engine and says why (`FrozenTokenizer.explain`).  The
shadow verifier demotes an engine on a confirmed mismatch (`NativeEngine.demote`): from
then on that tokenizer's encodes go to the reference again.

`reference` encodes (`FrozenTokenizer.encode`, the verifier, the tests' expectations)
never touch this module.
"""

from __future__ import annotations

import os
import threading
from typing import Literal

import numpy as np

EngineChoice = Literal["auto", "native", "reference"]
ENGINE_CHOICES = ("auto", "native", "reference")

try:
    from . import _engine as _core
    BUILD_ERROR: str | None = None
except ImportError as exc:  # a source tree nobody built (`pip install -e .` builds it)
    _core = None
    BUILD_ERROR = f"the compiled module toktier.native._engine is not built ({exc})"


CORES = os.cpu_count() or 1
#: Idle piece caches an engine keeps (each ~7.5 MiB: slots 4, hot front 2, the long-piece table 1.5
#: and its arenas); more concurrent calls make more, then drop them.
MAX_IDLE_CACHES = 2 * CORES
#: Piece caches an engine makes ahead of need (`NativeEngine.__init__`), at most (~7.5 MiB each)
PREWARM_CACHES = 4
#: Inserted bytes per extra thread of the compiled lane (it cuts windows of 24 KB and more into
#: chunks of at least 12 KB; repair.hpp PARALLEL_MIN_BYTES / CHUNK_MIN_BYTES)
LANE_CHUNK_BYTES = 12 * 1024
#: Windows shorter than this are encoded on one thread whatever caches the lane is lent
#: (repair.hpp PARALLEL_MIN_BYTES): `Session.append`'s one-call path serves appends up to it
LANE_PARALLEL_MIN_BYTES = 24 * 1024


class NativeEngine:
    """The compiled encoder of one certified tokenizer; thread-safe (a piece cache per call, lent)."""

    def __init__(self, tok, core, rules: str) -> None:
        self._tok = tok
        self._core = core
        self.rules = rules
        # Piece caches, lent one per call: any thread may use any of them (never two at once), so
        # they stay warm across the full path's short-lived chunk threads and server workers.
        self.pool = _core.CachePool(MAX_IDLE_CACHES)
        self.demoted: str | None = None  # why it no longer serves (a confirmed shadow mismatch)
        self.nfc_fallbacks = 0  # NFC-family texts `nfc_form` could not certify: the reference encoded them
        self.nfc_rewrites = 0  # NFC-family texts the normalizer changes, encoded in their normalized form
        self._lane = None
        self.lane_threads = CORES  # threads the compiled lane may use for one big window
        # threads a chunked encode runs on (the caller and the engine's kept helpers): it takes a
        # piece cache per thread, not per chunk, so a text may be cut into more chunks than this
        self.chunk_threads = core.chunk_threads
        # The caches a parallel op takes at once, made now on a thread of their own: each new one
        # costs the kernel 11-15 ms of page zeroing here, which a window edit of a 50K-character
        # tool result (two caches) paid on its own thread: 17-19 ms, 0.7 ms with the caches made
        # (measured 2026-12-05).
        threading.Thread(target=self.pool.fill, args=(min(self.chunk_threads, PREWARM_CACHES),),
                         name="toktier-cache-prewarm", daemon=True).start()

    @property
    def active(self) -> bool:
        return self.demoted is None

    def demote(self, reason: str) -> None:
        """Stop serving: every later encode of this tokenizer goes to the reference engine."""
        if self.demoted is None:
            self.demoted = reason

    def _take(self):
        return self.pool.take()

    def _give(self, cache) -> None:
        self.pool.give(cache)

    def encode(self, text: str) -> np.ndarray:
        """Exactly ``tok.encode(text)`` (uint32)."""
        return self.encode_with_starts(text, want_starts=False)[0]

    def encode_with_starts(self, text: str, want_starts: bool = True) -> tuple[np.ndarray, np.ndarray | None]:
        """(IDs, UTF-8 byte offset of each token or None).  NFC families: offsets are in the text's
        own coordinates when NFC leaves it unchanged; otherwise the reference encodes it (no offsets)."""
        if self.demoted is not None:
            return self._tok.engine.encode_fast(text), None
        cache = self._take()
        try:
            status, ids, starts = self._core.encode(text, cache, want_starts, True)
            if status == _core.SURROGATE:  # the reference's answer, typed error included
                return self._tok.engine.encode_fast(text), None
            if status == _core.NEEDS_NFC:
                form = self.normalized(text)
                if form is None:
                    return self._tok.engine.encode_fast(text), None
                # the text's own offsets only when the normalizer left it as it is
                status, ids, starts = self._core.encode(form, cache, want_starts and form is text, False)
        finally:
            self._give(cache)
        return ids, starts

    def normalized(self, text: str) -> str | None:
        """`text` as an NFC family's reference tokenizes it (`nfc_spans.nfc_form`): `text` itself when
        its normalizer leaves it as it is; None when the reference must encode it (counted)."""
        from ..nfc_spans import nfc_form

        runs = self.nfc_runs(text)
        lane = self._lane
        if len(runs) and lane is not None and lane.nfc_stable(text):
            # Characters NFC may change, and UAX #15's quick check says NFC leaves the text as it
            # is (so every gap between its literals too): Thai, Hindi, Bengali text need no
            # normalizer call (30-90 ms at 1M).  (Without such characters `nfc_form` answers at once.)
            return text
        form = nfc_form(self._tok, text, self, runs)
        if form is None:
            self.nfc_fallbacks += 1
        elif form is not text:
            self.nfc_rewrites += 1
        return form

    def nfc_runs(self, text: str) -> np.ndarray:
        """Runs of characters an NFC normalizer may change, flat (start, end) pairs (`CoreEngine.nfc_runs`)."""
        return self._core.nfc_runs(text)

    def joined(self, ids: np.ndarray) -> bytes | None:
        """The tokens' bytes concatenated, or None for an id out of range or unassigned (`CoreEngine.joined`)."""
        return self._core.joined(ids)

    def spells(self, ids: np.ndarray, data: bytes) -> bool:
        """Whether the tokens' canonical bytes concatenate to `data` (`CoreEngine.spells`)."""
        return self._core.spells(ids, data)

    def utf8_offsets(self, text: str, positions: np.ndarray) -> np.ndarray:
        """UTF-8 byte offsets of ascending character offsets (`CoreEngine.utf8_offsets`)."""
        return self._core.utf8_offsets(text, positions)

    def literal_spans(self, text: str) -> np.ndarray:
        """The literals the engine splits off first, flat (start, end) pairs (`CoreEngine.literal_spans`)."""
        return self._core.literal_spans(text)

    def literal_bytes(self, text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The literals the engine splits off `text` first as (UTF-8 start, UTF-8 end, token id), int32
        arrays: what the GPU driver uploads (its Python scan of the bytes costs 0.5-2.5 ms per 1M)."""
        spans, ids = self._core.literal_spans(text, True)
        offs = self._core.utf8_offsets(text, spans).astype(np.int32) if len(spans) else spans.astype(np.int32)
        return offs[0::2].copy(), offs[1::2].copy(), ids.astype(np.int32)

    def encode_chunks(self, text: str, cuts: list[int], check_nfc: bool = True) -> np.ndarray | None:
        """Exactly ``tok.encode(text)`` for `text` cut at `cuts` (standalone-stable character offsets,
        `fullpath.chunk_cuts`), on this thread and the kept helpers, a piece cache per thread, in
        compiled code; None when a chunk needs the reference (an NFC-changeable character, a
        surrogate): the caller encodes chunk by chunk then.
        `check_nfc` False: `text` is its own `normalized` form (the caller made it so)."""
        if self.demoted is not None:
            return None
        caches = [self._take() for _ in range(min(len(cuts) + 1, self.chunk_threads))]
        try:
            status, ids, _ = self._core.encode_chunks(text, cuts, caches, False, check_nfc)
        finally:
            for cache in caches:
                self._give(cache)
        return ids if status == 0 else None

    def start_chunks(self, text: str, cuts: list[int], check_nfc: bool = True):
        """A session start's first pass (`_engine.CoreEngine.start_chunks`): `text` encoded at `cuts`
        (standalone-stable, possibly none), a piece cache per thread; the `StagedStart` whose `write`
        lays the ids, the UTF-8 and the checkpoints out in the session's own buffers, or None when a
        chunk needs the reference (an NFC-changeable character, a surrogate) or the engine is demoted."""
        if self.demoted is not None:
            return None
        caches = [self._take() for _ in range(min(len(cuts) + 1, self.chunk_threads))]
        try:
            table = self._tok.table
            status, staged = self._core.start_chunks(text, cuts, caches, self._tok.token_len,
                                                     table.uncertain if table.any_uncertain else None, check_nfc)
        finally:
            for cache in caches:
                self._give(cache)
        return staged if status == 0 else None

    def cuts(self, text: str, chunk_chars: int) -> list[int]:
        """Standalone-stable character offsets cutting `text` about every `chunk_chars` characters
        (`fullpath.chunk_cuts`, compiled: `RepairLane.text_cuts`)."""
        return self.lane().text_cuts(text, chunk_chars)

    def lane(self):
        """The compiled first-window splice of edits and appends (``repair.hpp``), built once per engine."""
        lane = self._lane
        if lane is None:
            tok = self._tok
            fam = tok.family_info
            group = fam._group_table(tok.classes)
            pairs = np.asarray(fam._tables()[1], dtype=np.uint8)
            if group is None:
                raise RuntimeError("the family's group table needs a read-only class table")
            from ..charclass import W, nfc_mark_table
            from ..families import I

            # NFC families: windows holding marks NFC leaves alone (Thai, Devanagari, ...) are
            # taken too, not only all-inert ones (~50 ms, once per engine)
            marks, maybe, composes = nfc_mark_table(tok.engine.normalize) if fam.nfc else (None, None, None)
            lane = self._lane = _core.RepairLane(
                self._core, tok.token_len, tok.table.uncertain.astype(np.uint8), group, pairs,
                tok.max_token_bytes, [lit.content for lit in tok.engine.literals if lit.content],
                tok.classes, W, marks, I if fam.nfc else 0, maybe, composes)
        return lane

    def edit_lane(self, text: bytearray, s: int, e: int, data: bytes, ids: np.ndarray, checkpoints: np.ndarray,
                  stride: int, window: int):
        """(status, k1, k2, left cut, right cut, fresh count, mid) of the compiled first-window splice
        (`RepairLane.edit`)."""
        lane = self.lane()
        cache = self._take()
        try:
            return lane.edit(text, s, e, data, ids, checkpoints, stride, window, window, cache)
        finally:
            self._give(cache)

    def edit_commit(self, text: bytearray, s: int, e: int, data: bytes, ids: np.ndarray, n: int, checkpoints: np.ndarray,
                    n_cp: int, stride: int, window: int):
        """`edit_lane`, then its splice written in place into the session's buffers (`RepairLane.edit_commit`):
        (status, k1, k2, left cut, right cut, fresh count, first changed, new n, new n_cp, mid)."""
        lane = self.lane()
        # a big window is encoded in chunks, a thread (and a cache) per core; one under
        # LANE_PARALLEL_MIN_BYTES stays on this thread, so it takes one cache
        small = len(data) + 2 * window < LANE_PARALLEL_MIN_BYTES
        k = 1 if small else min(self.lane_threads, 1 + len(data) // LANE_CHUNK_BYTES)
        caches = [self._take() for _ in range(k)]
        try:
            return lane.edit_commit(text, s, e, data, ids, n, checkpoints, n_cp, stride, window, window, caches)
        finally:
            for cache in caches:
                self._give(cache)

    @property
    def block_scanner(self) -> tuple[bool, str]:
        """(on, why it is off or ""): whether ASCII stretches are pre-tokenized 128 characters at a
        time (decided at load from the probed class table and the rule set; engine.hpp,
        `Engine::build_block`)."""
        return self._core.block_scanner

    def pieces(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """(piece start character offsets, literal id per piece or -1) of the native pre-tokenizer."""
        return self._core.pieces(text)

    def bpe(self, piece: bytes) -> np.ndarray:
        """BPE IDs of one piece's bytes."""
        cache = self._take()
        try:
            return self._core.bpe(piece, cache)
        finally:
            self._give(cache)


def build(tok) -> tuple[NativeEngine | None, str | None]:
    """An uncertified engine for `tok`, or (None, why it cannot have one)."""
    if _core is None:
        return None, BUILD_ERROR
    if tok.family_info is None:
        return None, f"no proven family ({tok.family_reason})"
    from .. import charclass
    from ..families import GPU_CLASS_PATTERNS
    from ..gpu.tables import bpe_tables, model_gap, rules_for

    gap = model_gap(tok)
    if gap is not None:
        return None, gap
    rules = rules_for(tok)
    if rules is None:
        return None, "no scanner models this pre-tokenizer"
    fam = tok.family_info
    extra = None
    if fam.nfc:
        extra = {charclass.NFC_INERT: lambda: charclass.nfc_inert_mask(tok.engine.normalize)}
    table = charclass.class_table(tok.engine, tok.engine.class_key, {**fam.class_patterns(), **GPU_CLASS_PATTERNS},
                                  folds=True, extra=extra)
    bt = bpe_tables(tok)
    lit_ids = tok.table.literal_ids  # the ids the engine emits (never a file's declared ids)
    lits = [lit for lit in tok.engine.literals if lit.content]
    first = [(lit.content, int(lit_ids[lit.content])) for lit in lits if not lit.normalized]
    second = [(lit.content, int(lit_ids[lit.content])) for lit in lits if lit.normalized]
    core = _core.CoreEngine(str(rules), table, bt.byte_to_id, bt.pair_keys, bt.pair_rank, bt.pair_merged,
                            bt.pair_bits, bt.vocab_keys, bt.vocab_ids, bt.vocab_bits, bt.tok_off, bt.tok_blob,
                            bt.max_piece_lookup, bt.whole_piece_lookup, fam.nfc, first, second,
                            tok.token_len, tok.table.uncertain.astype(np.uint8))
    return NativeEngine(tok, core, str(rules)), None


def attach(tok, choice: EngineChoice) -> tuple[NativeEngine | None, str | None]:
    """Build and certify the native engine of `tok` for load choice `choice`.

    Returns (engine, None) or (None, why the reference engine serves).  ``"native"``
    raises `UnsupportedTokenizer` instead of returning a reason.
    """
    if choice not in ENGINE_CHOICES:
        raise ValueError(f"engine must be one of {ENGINE_CHOICES}, not {choice!r}")
    if choice == "reference":
        return None, "the reference engine was asked for (engine='reference')"
    from .certify import certify

    eng, why = build(tok)
    if eng is not None:
        why = certify(tok, eng)
        if why is not None:
            eng = None
        else:
            try:
                eng.lane()  # built now, so no session op pays for it
            except (RuntimeError, ValueError) as exc:
                eng, why = None, f"the compiled repair lane cannot be built ({exc})"
    if eng is None and choice == "native":
        from ..errors import UnsupportedTokenizer

        raise UnsupportedTokenizer(f"{tok.name}: the native engine cannot serve it: {why}")
    return eng, why
