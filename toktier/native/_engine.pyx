# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# distutils: language = c++
"""Thin Cython binding of ``engine.hpp``: borrows the tables, reads a str's code points in place.

`CoreEngine` keeps a reference to every numpy array whose memory the C++ engine reads,
so the tables live exactly as long as it does.  `encode` reads the str's PEP 393
buffer directly (no UTF-8 encode of the text) and runs without the GIL; each call
borrows a piece cache (`PieceCacheBox`) that no other call uses meanwhile (the
Python side lends them), so concurrent encodes share nothing mutable.
"""

from libc.stdint cimport int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memcmp, memcpy
from libcpp cimport bool as cbool
from libcpp.vector cimport vector
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.buffer cimport (PyObject_GetBuffer, PyBuffer_Release, PyBUF_C_CONTIGUOUS, PyBUF_FORMAT,
                             PyBUF_WRITABLE)

import numpy as np


cdef extern from "Python.h":
    char* PyByteArray_AS_STRING(object)
    Py_ssize_t PyByteArray_GET_SIZE(object)
    int PyByteArray_Resize(object, Py_ssize_t) except -1
    int PyUnicode_KIND(object)
    void* PyUnicode_DATA(object)
    Py_ssize_t PyUnicode_GET_LENGTH(object)
    int PyUnicode_IS_ASCII(object)
    ctypedef struct PyByteArrayObject:
        Py_ssize_t ob_alloc


cdef inline int _room_for(object text, Py_ssize_t size) except -1:
    # CPython grows a bytearray by an eighth, and a regrowth of a session's text copies all of
    # it to fresh memory (page faults included: 0.05 ms a time at 100K-500K here): a text growing
    # by 16K appends regrew on every second one at 100K.  Grown by half at least, with the size
    # set back at once (a shrink to no less than half the allocation keeps the allocation).
    # (Past twice its size it grows once, exactly, as CPython does: the shrink would give it back.
    # Without memory for the room, nothing changes: the exact growth may still fit.)
    cdef Py_ssize_t n = PyByteArray_GET_SIZE(text)
    if size + 1 <= (<PyByteArrayObject*><void*>text).ob_alloc or size <= n or size > 2 * n:
        return 0
    try:
        PyByteArray_Resize(text, max(size, n + n // 2))
    except MemoryError:
        return 0
    PyByteArray_Resize(text, n)  # a shrink: it keeps the allocation and cannot fail
    return 0


cdef extern from "engine.hpp" namespace "ttn":
    cdef cppclass Tables:
        const uint32_t* cls
        const uint32_t* byte_to_id
        const uint64_t* pair_keys
        const uint32_t* pair_rank
        const uint32_t* pair_merged
        int pair_bits
        const uint64_t* vocab_keys
        const uint32_t* vocab_ids
        int vocab_bits
        const uint32_t* tok_off
        const uint8_t* tok_blob
        int max_piece_lookup
        cbool whole_piece_lookup
        int rules

    cdef cppclass Literal:
        int64_t a, b, id

    cdef cppclass Trie:
        void add(const uint32_t* cps, int64_t n, int64_t id) except +

    cdef cppclass PieceCache:
        PieceCache() except + nogil
        uint64_t hits, misses
        void clear()

    cdef cppclass Output:
        vector[uint32_t] ids
        vector[int64_t] starts
        cbool want_starts

    cdef cppclass ChunkSums:
        vector[int64_t] len
        vector[char] uncertain
        vector[char] bad
        const uint32_t* token_len
        const uint8_t* uncertain_ids
        int64_t token_len_n
        const uint8_t* len8
        size_t n_len8

    cdef cppclass Engine:
        Tables t
        vector[uint8_t] len8
        Trie lit1, lit2
        cbool nfc
        cbool block_cl
        cbool simd_classify
        const char* block_reason
        void build_block()
        int encode[T](const T* s, int64_t n, cbool ascii, cbool check_nfc, PieceCache& cache, Output& out) except + nogil
        int encode_chunks[T](const T* s, int64_t n, cbool ascii, const vector[int64_t]& cuts,
                             const vector[PieceCache*]& caches, cbool want_starts, vector[Output]& outs,
                             vector[int64_t]& nbytes, cbool check_nfc) except + nogil
        void literals[T](const T* s, int64_t n, vector[Literal]& lits) except + nogil
        @staticmethod
        size_t chunk_threads()
        void nfc_runs[T](const T* s, int64_t n, vector[int64_t]& out) except + nogil
        void utf8_offsets[T](const T* s, int64_t n, const int64_t* pos, int64_t k, int64_t* out) nogil
        void assemble_chunks[T](const T* s, int64_t n, cbool ascii, const vector[int64_t]& cuts,
                                const vector[Output]& outs, const vector[int64_t]& nbytes, ChunkSums& sums,
                                uint32_t* ids, uint8_t* u8, uint32_t* cp, int64_t stride) except + nogil
        void pieces[T](const T* s, int64_t n, vector[int64_t]& starts, vector[int64_t]& lit_flags) except + nogil
        void bpe(const uint8_t* p, uint32_t n, PieceCache& cache, vector[uint32_t]& out) except + nogil
        @staticmethod
        int64_t hot_entry(const uint8_t* p, uint32_t n)
        size_t n_records()
        void build_short_vocab() except + nogil
        vector[uint32_t] short_answers() except +
        void build_fast_tables() except + nogil
        void build_records(const uint32_t* token_len, const uint8_t* uncertain, int64_t n_ids,
                           int64_t n_vocab) except +


RULES = {"cl100k_hf": 0, "cl100k_tt": 1, "qwen": 2, "o200k": 3, "deepseek": 4}
NEEDS_NFC = 1
SURROGATE = 2
#: Longest text the engine takes (its segment offsets are uint32); longer ones go to the reference.
MAX_CHARS = 1 << 30


cdef class PieceCacheBox:
    """One BPE piece cache of one engine, lent to one call at a time (`NativeEngine._take`)."""

    cdef PieceCache* c

    def __cinit__(self):
        # Without the GIL: a new cache's 6 MiB of fresh pages cost the kernel 11-15 ms of zeroing
        # on the VMs here, which a thread filling the pool (`CachePool.fill`, started by
        # `NativeEngine.__init__`) may then pay while others run Python.
        cdef PieceCache* c
        with nogil:
            c = new PieceCache()
        self.c = c

    def __dealloc__(self):
        del self.c

    @property
    def hits(self):
        return self.c.hits

    @property
    def misses(self):
        return self.c.misses

    @staticmethod
    def hot_entry(bytes piece):
        """The hot front set (`PieceCache::hot`, two entries) that `piece`'s ids go to, or -1 (tests)."""
        return Engine.hot_entry(<const uint8_t*>piece, <uint32_t>len(piece))


cdef class CachePool:
    """The idle piece caches of one engine, lent one per call (`take`, `give`): any thread may use
    any of them, never two at once, so they stay warm across calls, sessions and threads.  Both
    methods run no Python code while they touch the list, so the GIL makes each one atomic (no
    lock to take: a session op with cold caches pays for every object it touches)."""

    cdef list slots  # `limit` slots, the first `n` holding idle caches, the rest None
    cdef Py_ssize_t n, limit

    def __init__(self, Py_ssize_t limit):
        if limit < 0:
            raise ValueError("a cache pool's limit cannot be negative")
        # fixed slots, not a list that grows and shrinks: a pop from a list of one reallocates it
        self.slots = [None] * limit
        self.n = 0
        self.limit = limit

    cpdef PieceCacheBox take(self):
        """An idle cache, or a new one when none is idle."""
        if self.n:
            self.n -= 1
            cache = self.slots[self.n]
            self.slots[self.n] = None
            return cache
        return PieceCacheBox()

    cpdef give(self, PieceCacheBox cache):
        """Return a cache taken from this pool (dropped when `limit` are idle already)."""
        if cache is None:
            raise TypeError("give() takes a PieceCacheBox, not None")
        if self.n < self.limit:
            self.slots[self.n] = cache
            self.n += 1

    def fill(self, Py_ssize_t want):
        """Make caches until `want` are idle (at most the limit); returns how many it made.  Each
        is built without the GIL (`PieceCacheBox`): run on a thread of its own, this takes a new
        cache's page zeroing off the first op that needs one more cache than the pool holds."""
        cdef Py_ssize_t made = 0
        while self.n < min(want, self.limit):
            self.give(PieceCacheBox())
            made += 1
        return made

    def __len__(self):
        return self.n


cdef object _u32(const uint32_t* p, size_t n):
    out = np.empty(n, dtype=np.uint32)
    cdef uint32_t[::1] v = out
    if n:
        memcpy(&v[0], p, n * sizeof(uint32_t))
    return out


cdef object _i64(const int64_t* p, size_t n):
    out = np.empty(n, dtype=np.int64)
    cdef int64_t[::1] v = out
    if n:
        memcpy(&v[0], p, n * sizeof(int64_t))
    return out


cdef int _chunk_args(cuts, list caches, int64_t n, vector[int64_t]& cv, vector[PieceCache*]& cc) except -1:
    """`cuts` (ascending, strictly inside a text of n characters) and the piece caches of the
    threads that may encode its chunks (one at least, one per chunk at most; each thread uses one
    for every chunk it takes), checked and copied for `Engine::encode_chunks`."""
    cdef int64_t prev = 0
    cdef PieceCacheBox box
    for c in cuts:
        if not prev < c < n:
            raise ValueError("cuts must be ascending offsets strictly inside the text")
        cv.push_back(c)
        prev = c
    if not 1 <= len(caches) <= cv.size() + 1:
        raise ValueError("one piece cache per thread: at least one, at most one per chunk")
    for box in caches:
        cc.push_back(box.c)
    return 0


cdef int _encode_chunks(Engine* e, str text, const vector[int64_t]& cv, const vector[PieceCache*]& cc,
                        cbool want_starts, vector[Output]& outs, vector[int64_t]& nbytes,
                        cbool check_nfc=True) except? -1:
    """`Engine::encode_chunks` over `text`'s own code points (its PEP 393 width), without the GIL."""
    cdef int kind = PyUnicode_KIND(text)
    cdef void* data = PyUnicode_DATA(text)
    cdef int64_t n = PyUnicode_GET_LENGTH(text)
    cdef cbool ascii = PyUnicode_IS_ASCII(text) != 0
    cdef int status
    with nogil:
        if kind == 1:
            status = e.encode_chunks[uint8_t](<const uint8_t*>data, n, ascii, cv, cc, want_starts, outs, nbytes,
                                                   check_nfc)
        elif kind == 2:
            status = e.encode_chunks[uint16_t](<const uint16_t*>data, n, ascii, cv, cc, want_starts, outs, nbytes,
                                                   check_nfc)
        else:
            status = e.encode_chunks[uint32_t](<const uint32_t*>data, n, ascii, cv, cc, want_starts, outs, nbytes,
                                                   check_nfc)
    return status


cdef extern from "Python.h":
    object PyByteArray_FromStringAndSize(const char* s, Py_ssize_t n)
    char* PyByteArray_AS_STRING(object)
    int PyByteArray_Resize(object, Py_ssize_t n) except -1


cdef class StagedStart:
    """A session start encoded chunk by chunk (`CoreEngine.start_chunks`), not yet laid out:
    `write` puts the ids, the text's UTF-8 and the checkpoints where the session keeps them, one
    chunk at a time on this thread and the kept helpers.  Holds the text (its code points are read
    again) and the length tables."""

    cdef vector[Output] outs
    cdef vector[int64_t] nbytes
    cdef vector[int64_t] cuts
    cdef ChunkSums sums
    cdef object text, engine, tl, un
    cdef int64_t n
    cdef int kind
    cdef cbool ascii
    cdef readonly size_t num_ids
    cdef readonly int64_t num_bytes
    cdef readonly bint tiles  # after `write`: every chunk's canonical token lengths sum to its bytes
    cdef readonly bint uncertain  # after `write`: a token is flagged uncertain (its span needs the exact check)
    cdef bint written

    def write(self, uint32_t[::1] ids, uint32_t[::1] checkpoints, int64_t stride, Py_ssize_t spare=0):
        """Second pass: the ids into ``ids[:num_ids]`` and the checkpoints into ``checkpoints``
        (``checkpoints[j]``: the byte start of token ``j * stride``, exact when `tiles`); returns
        the text's UTF-8 as a new bytearray (allocated with `spare` more bytes, which the next
        appends grow into without a copy when `spare` is under half of it), or None when an id
        lies outside the length table (the caller takes the general path).  Once only: the chunk
        outputs are freed after."""
        if self.engine is None:  # made directly, not by `CoreEngine.start_chunks`: nothing to write
            raise TypeError("a StagedStart comes from CoreEngine.start_chunks")
        if self.written:
            raise RuntimeError("StagedStart.write: already written")
        if <size_t>ids.shape[0] < self.num_ids:
            raise ValueError("ids must hold num_ids")
        if stride <= 0 or checkpoints.shape[0] < (<int64_t>self.num_ids + stride - 1) // stride:
            raise ValueError("checkpoints must hold ceil(num_ids / stride) and stride must be positive")
        if spare < 0:
            raise ValueError("spare must not be negative")
        # uninitialized: the threads write it all; a minor shrink keeps the allocation (CPython)
        text = PyByteArray_FromStringAndSize(NULL, self.num_bytes + spare)
        if spare:
            PyByteArray_Resize(text, self.num_bytes)
        cdef uint8_t* u8 = <uint8_t*>PyByteArray_AS_STRING(text)
        cdef uint32_t* ip = &ids[0] if ids.shape[0] else NULL
        cdef uint32_t* cp = &checkpoints[0] if checkpoints.shape[0] else NULL
        cdef void* data = PyUnicode_DATA(self.text)
        cdef CoreEngine eng = self.engine
        self.written = True
        with nogil:
            if self.kind == 1:
                eng.e.assemble_chunks[uint8_t](<const uint8_t*>data, self.n, self.ascii, self.cuts, self.outs,
                                               self.nbytes, self.sums, ip, u8, cp, stride)
            elif self.kind == 2:
                eng.e.assemble_chunks[uint16_t](<const uint16_t*>data, self.n, self.ascii, self.cuts, self.outs,
                                                self.nbytes, self.sums, ip, u8, cp, stride)
            else:
                eng.e.assemble_chunks[uint32_t](<const uint32_t*>data, self.n, self.ascii, self.cuts, self.outs,
                                                self.nbytes, self.sums, ip, u8, cp, stride)
        self.outs.clear()
        self.outs.shrink_to_fit()
        cdef size_t i
        self.tiles = True
        for i in range(self.sums.len.size()):
            if self.sums.bad[i]:
                return None
            self.tiles = self.tiles and self.sums.len[i] == self.nbytes[i]
            self.uncertain = self.uncertain or self.sums.uncertain[i] != 0
        return text


cdef class CoreEngine:
    """The compiled encoder over borrowed tables (see ``toktier/native/engine.hpp``)."""

    cdef Engine* e
    cdef object _keep
    cdef object _records  # (token_len as given, it and uncertain as built into the records)
    cdef object _seen  # the last (token_len, uncertain) objects `_same_records` found equal
    cdef uint32_t _n_ids  # ids in the token blob (`e.t.tok_off` has one offset more)

    def __cinit__(self):
        self.e = new Engine()
        self._keep = []

    def __dealloc__(self):
        del self.e

    def __init__(self, str rules, cls, byte_to_id, pair_keys, pair_rank, pair_merged, int pair_bits,
                 vocab_keys, vocab_ids, int vocab_bits, tok_off, tok_blob, int max_piece_lookup,
                 bint whole_piece_lookup, bint nfc, list literals_first, list literals_second,
                 token_len=None, uncertain=None):
        arrays = [np.ascontiguousarray(a) for a in (cls, byte_to_id, pair_keys, pair_rank, pair_merged,
                                                     vocab_keys, vocab_ids, tok_off, tok_blob)]
        want = (np.uint32, np.uint32, np.uint64, np.uint32, np.uint32, np.uint64, np.uint32, np.uint32, np.uint8)
        for a, dt in zip(arrays, want):
            if a.dtype != dt:
                raise TypeError(f"table of dtype {a.dtype}, expected {np.dtype(dt)}")
        if len(arrays[0]) != 0x110000 or len(arrays[1]) != 256:
            raise ValueError("class table must have 0x110000 entries and byte_to_id 256")
        if len(arrays[2]) != 1 << pair_bits or len(arrays[5]) != 1 << vocab_bits:
            raise ValueError("hash table sizes do not match their bit counts")
        if len(arrays[8]) == 0:
            arrays[8] = np.zeros(1, np.uint8)
        self._keep = arrays
        cdef const uint32_t[::1] c0 = arrays[0]
        cdef const uint32_t[::1] b2i = arrays[1]
        cdef const uint64_t[::1] pk = arrays[2]
        cdef const uint32_t[::1] pr = arrays[3]
        cdef const uint32_t[::1] pm = arrays[4]
        cdef const uint64_t[::1] vk = arrays[5]
        cdef const uint32_t[::1] vi = arrays[6]
        cdef const uint32_t[::1] to = arrays[7]
        cdef const uint8_t[::1] tb = arrays[8]
        if rules not in RULES:
            raise ValueError(f"unknown rule set {rules!r}")
        self.e.t.rules = RULES[rules]
        self.e.t.cls = &c0[0]
        self.e.t.byte_to_id = &b2i[0]
        self.e.t.pair_keys = &pk[0]
        self.e.t.pair_rank = &pr[0]
        self.e.t.pair_merged = &pm[0]
        self.e.t.pair_bits = pair_bits
        self.e.t.vocab_keys = &vk[0]
        self.e.t.vocab_ids = &vi[0]
        self.e.t.vocab_bits = vocab_bits
        self.e.t.tok_off = &to[0]
        self.e.t.tok_blob = &tb[0]
        self._n_ids = to.shape[0] - 1
        self.e.t.max_piece_lookup = max_piece_lookup
        self.e.t.whole_piece_lookup = whole_piece_lookup
        self.e.nfc = nfc
        # Without the GIL: the tables and the self-spelled marks (each short token's merges, ~50 ms
        # for a merges-first vocabulary) are built on a loader thread while the sidecar's event loop
        # and other sessions run.
        with nogil:
            self.e.build_short_vocab()
            self.e.build_fast_tables()
        cdef const uint32_t[::1] tl
        cdef const uint8_t[::1] un
        if token_len is not None:  # per-token records: what a window's tokens read, one line each
            tl = np.ascontiguousarray(token_len, dtype=np.uint32)
            un = np.ascontiguousarray(uncertain, dtype=np.uint8)
            if len(tl) != len(un) or len(tl) == 0:
                raise ValueError("token_len and uncertain must be non-empty and of one length")
            self.e.build_records(&tl[0], &un[0], len(tl), len(arrays[7]) - 1)
            self._records = (token_len, np.asarray(tl), np.asarray(un))  # (`_same_records`)
        cdef uint32_t[::1] cps
        for second, lits in ((False, literals_first), (True, literals_second)):
            for content, lid in lits:
                if not content:
                    continue
                cps = np.frombuffer(content.encode("utf-32-le"), dtype=np.uint32).copy()
                if second:
                    self.e.lit2.add(&cps[0], len(cps), lid)
                else:
                    self.e.lit1.add(&cps[0], len(cps), lid)

    def encode(self, str text, PieceCacheBox cache, bint want_starts=False, bint check_nfc=True):
        """(status, ids uint32, byte starts int64 or None); status NEEDS_NFC: an NFC family's text
        holds a character NFC might change (the caller checks it with the reference normalizer);
        SURROGATE: the text holds a lone surrogate or is longer than MAX_CHARS (the caller lets the
        reference answer, which raises on a surrogate)."""
        if PyUnicode_GET_LENGTH(text) > MAX_CHARS:
            return SURROGATE, None, None
        cdef Output out
        out.want_starts = want_starts
        cdef int kind = PyUnicode_KIND(text)
        cdef void* data = PyUnicode_DATA(text)
        cdef int64_t n = PyUnicode_GET_LENGTH(text)
        cdef cbool ascii = PyUnicode_IS_ASCII(text) != 0
        cdef int status
        with nogil:
            if kind == 1:
                status = self.e.encode[uint8_t](<const uint8_t*>data, n, ascii, check_nfc, cache.c[0], out)
            elif kind == 2:
                status = self.e.encode[uint16_t](<const uint16_t*>data, n, ascii, check_nfc, cache.c[0], out)
            else:
                status = self.e.encode[uint32_t](<const uint32_t*>data, n, ascii, check_nfc, cache.c[0], out)
        if status != 0:
            return status, None, None
        ids = _u32(out.ids.data(), out.ids.size())
        starts = _i64(out.starts.data(), out.starts.size()) if want_starts else None
        return 0, ids, starts

    def encode_chunks(self, str text, cuts, list caches, bint want_starts=False, bint check_nfc=True):
        """`encode` of `text` cut at character offsets `cuts` (ascending, each a standalone-stable
        boundary), on up to len(caches) threads at once (this one included; 1 to len(cuts) + 1
        caches), each thread with its own cache for every chunk it takes: (status, ids, byte
        starts or None).  `check_nfc` False: the caller vouches that the family's normalizer
        leaves `text` as it is."""
        if PyUnicode_GET_LENGTH(text) > MAX_CHARS:
            return SURROGATE, None, None
        cdef int64_t n = PyUnicode_GET_LENGTH(text)
        cdef vector[int64_t] cv
        cdef vector[PieceCache*] cv_caches
        _chunk_args(cuts, caches, n, cv, cv_caches)
        cdef vector[Output] outs
        cdef vector[int64_t] nbytes
        cdef int status = _encode_chunks(self.e, text, cv, cv_caches, want_starts, outs, nbytes, check_nfc)
        if status != 0:
            return status, None, None
        cdef size_t total = 0, i, j, at = 0
        for i in range(outs.size()):
            total += outs[i].ids.size()
        ids = np.empty(total, dtype=np.uint32)
        cdef uint32_t[::1] iv = ids
        cdef int64_t[::1] sv
        cdef int64_t base = 0
        starts = np.empty(total, dtype=np.int64) if want_starts else None
        if want_starts:
            sv = starts
        for i in range(outs.size()):
            if outs[i].ids.size():
                memcpy(&iv[at], outs[i].ids.data(), outs[i].ids.size() * sizeof(uint32_t))
            if want_starts:
                for j in range(outs[i].starts.size()):
                    sv[at + j] = outs[i].starts[j] + base
            at += outs[i].ids.size()
            base += nbytes[i]
        return 0, ids, starts

    cdef bint _same_records(self, token_len, uncertain):
        """Whether `token_len` and `uncertain` (None: no id is) are the tables the per-token records
        were built from (then `Engine::len8` summarizes them).  The same objects come on every
        session start: compared once, then by identity."""
        if self._records is None:
            return False
        if self._seen is not None and self._seen[0] is token_len and self._seen[1] is uncertain:
            return True
        given, tl, un = self._records
        lens = np.asarray(token_len)
        same = lens.shape == tl.shape and bool(np.array_equal(lens, tl))
        if same:
            same = not un.any() if uncertain is None else bool(np.array_equal(np.asarray(uncertain) != 0, un != 0))
        read_only = not lens.flags.writeable and (uncertain is None or not np.asarray(uncertain).flags.writeable)
        if same and read_only:  # (a writable table may change under an identity check)
            self._seen = (token_len, uncertain)
        return same

    def start_chunks(self, str text, cuts, list caches, token_len, uncertain=None, bint check_nfc=True):
        """A session start's first pass: `encode_chunks` of `text` at `cuts` (may be empty: one
        chunk, on this thread).  `token_len` (uint32 per id) and `uncertain` (uint8 per id, or None
        when no id is) are what `StagedStart.write` sums; `check_nfc` as in `encode_chunks`.
        Returns (status, `StagedStart` or None)."""
        if PyUnicode_GET_LENGTH(text) > MAX_CHARS:
            return SURROGATE, None
        cdef StagedStart st = StagedStart.__new__(StagedStart)
        cdef int64_t n = PyUnicode_GET_LENGTH(text)
        cdef vector[PieceCache*] cv_caches
        _chunk_args(cuts, caches, n, st.cuts, cv_caches)
        lens = np.ascontiguousarray(token_len, dtype=np.uint32)
        if len(lens) == 0:
            raise ValueError("token_len must not be empty")
        cdef const uint32_t[::1] tl = lens
        cdef const uint8_t[::1] un
        st.tl = lens  # the threads read them: kept alive with the staged start
        st.sums.token_len = &tl[0]
        st.sums.token_len_n = tl.shape[0]
        if uncertain is not None:
            flags = np.ascontiguousarray(uncertain, dtype=np.uint8)
            if len(flags) != len(lens):
                raise ValueError("uncertain must have one flag per token_len entry")
            un = flags
            st.un = flags
            st.sums.uncertain_ids = &un[0]
        if self._same_records(token_len, uncertain):  # then the walk reads one byte per token
            st.sums.len8 = self.e.len8.data()
            st.sums.n_len8 = self.e.len8.size()
        st.text = text
        st.engine = self
        st.n = n
        st.kind = PyUnicode_KIND(text)
        st.ascii = PyUnicode_IS_ASCII(text) != 0
        cdef int status = _encode_chunks(self.e, text, st.cuts, cv_caches, False, st.outs, st.nbytes, check_nfc)
        if status != 0:
            return status, None
        cdef size_t i
        for i in range(st.outs.size()):
            st.num_ids += st.outs[i].ids.size()
            st.num_bytes += st.nbytes[i]
        return 0, st

    def joined(self, ids):
        """The tokens' bytes concatenated (uint32 `ids`; what decoding them to bytes gives), or None
        when an id is outside the table or has no bytes (unassigned): the caller's error path says
        which.  Two passes in compiled code: lengths and checks, then one copy a token."""
        cdef const uint32_t[::1] iv = ids
        cdef const uint32_t* to = self.e.t.tok_off
        cdef const uint8_t* blob = self.e.t.tok_blob
        cdef size_t n = iv.shape[0], i
        cdef uint32_t tid, o, ln, n_ids = self._n_ids
        cdef int64_t total = 0
        cdef bint ok = True
        with nogil:
            for i in range(n):
                tid = iv[i]
                if tid >= n_ids:
                    ok = False
                    break
                ln = to[tid + 1] - to[tid]
                if ln == 0:
                    ok = False
                    break
                total += ln
        if not ok:
            return None
        out = PyBytes_FromStringAndSize(NULL, total)
        cdef char* dst = PyBytes_AS_STRING(out)
        cdef int64_t pos = 0
        with nogil:
            for i in range(n):
                tid = iv[i]
                o = to[tid]
                ln = to[tid + 1] - o
                memcpy(dst + pos, blob + o, ln)
                pos += ln
        return out

    def spells(self, ids, data) -> bool:
        """Whether the canonical bytes of the tokens `ids` (uint32) concatenate to `data` (bytes-like):
        a session's proof that an NFC family's tokens tile the normalized text, one memcmp a token."""
        cdef const uint32_t[::1] iv = np.ascontiguousarray(ids, dtype=np.uint32)
        cdef const uint8_t[::1] dv = memoryview(data).cast("B") if len(data) else np.zeros(1, np.uint8)
        cdef const uint32_t* to = self.e.t.tok_off
        cdef const uint8_t* blob = self.e.t.tok_blob
        cdef const uint8_t* d = &dv[0]
        cdef int64_t nd = len(data), pos = 0
        cdef size_t n = iv.shape[0], i
        cdef uint32_t tid, o, ln, n_ids = self._n_ids
        cdef bint ok = True
        with nogil:
            for i in range(n):
                tid = iv[i]
                if tid >= n_ids:
                    ok = False
                    break
                o = to[tid]
                ln = to[tid + 1] - o
                if pos + ln > nd or (ln and memcmp(blob + o, d + pos, ln) != 0):
                    ok = False
                    break
                pos += ln
        return ok and pos == nd

    def literal_spans(self, str text, bint with_ids=False):
        """The added-token literals `encode` splits off `text` first, as flat (start, end) character
        offset pairs (int64), in order; `with_ids`: (those pairs, each literal's token id uint32)."""
        cdef vector[Literal] lits
        cdef int kind = PyUnicode_KIND(text)
        cdef void* data = PyUnicode_DATA(text)
        cdef int64_t n = PyUnicode_GET_LENGTH(text)
        with nogil:
            if kind == 1:
                self.e.literals[uint8_t](<const uint8_t*>data, n, lits)
            elif kind == 2:
                self.e.literals[uint16_t](<const uint16_t*>data, n, lits)
            else:
                self.e.literals[uint32_t](<const uint32_t*>data, n, lits)
        out = np.empty(2 * lits.size(), dtype=np.int64)
        ids = np.empty(lits.size(), dtype=np.uint32)
        cdef int64_t[::1] ov = out
        cdef uint32_t[::1] iv = ids
        cdef size_t i
        for i in range(lits.size()):
            ov[2 * i] = lits[i].a
            ov[2 * i + 1] = lits[i].b
            iv[i] = <uint32_t>lits[i].id
        return (out, ids) if with_ids else out

    def utf8_offsets(self, str text, positions):
        """The UTF-8 byte offsets in `text` of the ascending character offsets `positions` (int64)."""
        pos = np.ascontiguousarray(positions, dtype=np.int64)
        if len(pos) > 1 and np.any(pos[1:] < pos[:-1]):
            raise ValueError("positions must be ascending")
        out = np.empty(len(pos), dtype=np.int64)
        if not len(pos):
            return out
        cdef const int64_t[::1] pv = pos
        cdef int64_t[::1] ov = out
        cdef int kind = PyUnicode_KIND(text)
        cdef void* data = PyUnicode_DATA(text)
        cdef int64_t n = PyUnicode_GET_LENGTH(text), k = len(pos)
        with nogil:
            if kind == 1:
                self.e.utf8_offsets[uint8_t](<const uint8_t*>data, n, &pv[0], k, &ov[0])
            elif kind == 2:
                self.e.utf8_offsets[uint16_t](<const uint16_t*>data, n, &pv[0], k, &ov[0])
            else:
                self.e.utf8_offsets[uint32_t](<const uint32_t*>data, n, &pv[0], k, &ov[0])
        return out

    def nfc_runs(self, str text):
        """Maximal runs of characters an NFC normalizer may rewrite or compose with what precedes
        them (non-ASCII, not NFC-inert), as flat (start, end) character offset pairs (int64)."""
        cdef vector[int64_t] out
        cdef int kind = PyUnicode_KIND(text)
        cdef void* data = PyUnicode_DATA(text)
        cdef int64_t n = PyUnicode_GET_LENGTH(text)
        if PyUnicode_IS_ASCII(text):
            return np.zeros(0, dtype=np.int64)
        with nogil:
            if kind == 1:
                self.e.nfc_runs[uint8_t](<const uint8_t*>data, n, out)
            elif kind == 2:
                self.e.nfc_runs[uint16_t](<const uint16_t*>data, n, out)
            else:
                self.e.nfc_runs[uint32_t](<const uint32_t*>data, n, out)
        return _i64(out.data(), out.size())

    @property
    def chunk_threads(self):
        """The most threads a chunked encode runs on (the cores: the caller and the kept helpers)."""
        return Engine.chunk_threads()

    def short_answers(self):
        """The ids (sorted, uint32) a whole-piece lookup answers for a piece of 2-18 bytes spelling
        them: every such token under whole-piece lookup, else those whose own bytes merge to
        themselves (`Engine::mark_self_spelled`; tests)."""
        cdef vector[uint32_t] ids = self.e.short_answers()
        return _u32(ids.data(), ids.size())

    @property
    def block_scanner(self):
        """(on, reason it is off or ""): whether the block scanner (`Engine::pretok_block`) serves."""
        return bool(self.e.block_cl), self.e.block_reason.decode()

    @property
    def block_classifier(self):
        """"compare" when the block scanner classifies characters (of any str width, wide ones
        saturated to bytes) by byte comparisons (`Engine::simd_bits`, proven equal to the class
        table over U+0000..U+00FF at load), "table" when it reads the table per character, ""
        when the block scanner is off."""
        if not self.e.block_cl:
            return ""
        return "compare" if self.e.simd_classify else "table"

    def use_block_scanner(self, bint on):
        """Switch the block scanner off, or back on where `build_block` allows it (tests and A/B
        compare it with the per-character scanner); returns whether it is on.  Not while another
        call uses this engine."""
        if on:
            self.e.build_block()
        else:
            self.e.block_cl = False
        return bool(self.e.block_cl)

    def pieces(self, str text):
        """(piece start character offsets int64, literal id per piece or -1): the pre-tokenizer's
        split after the literal split (campaigns compare it with the reference's pieces)."""
        cdef vector[int64_t] starts, flags
        cdef int kind = PyUnicode_KIND(text)
        cdef void* data = PyUnicode_DATA(text)
        cdef int64_t n = PyUnicode_GET_LENGTH(text)
        with nogil:
            if kind == 1:
                self.e.pieces[uint8_t](<const uint8_t*>data, n, starts, flags)
            elif kind == 2:
                self.e.pieces[uint16_t](<const uint16_t*>data, n, starts, flags)
            else:
                self.e.pieces[uint32_t](<const uint32_t*>data, n, starts, flags)
        return _i64(starts.data(), starts.size()), _i64(flags.data(), flags.size())

    def bpe(self, bytes piece, PieceCacheBox cache):
        """BPE ids of one piece's bytes (tests and the load-time consistency check)."""
        cdef vector[uint32_t] out
        cdef const uint8_t* p = piece
        cdef uint32_t n = len(piece)
        with nogil:
            self.e.bpe(p, n, cache.c[0], out)
        return _u32(out.data(), out.size())


cdef int _u32_buffer(object obj, Py_buffer* view, cbool writable=False) except -1:
    """`view` of a 1-D C-contiguous uint32 buffer (released by the caller), checked in C: typed
    memoryviews cost a Python object and a format parse each, ~150 instruction-cache misses per
    call when a session op's code is cold (callgrind)."""
    PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (PyBUF_WRITABLE if writable else 0))
    cdef const char* f = view.format
    if f != NULL:
        while f[0] == b'@' or f[0] == b'=' or f[0] == b'<':
            f += 1
    if view.itemsize != 4 or view.ndim != 1 or f == NULL or not (f[0] == b'I' or f[0] == b'L') or f[1] != 0:
        fmt = b"" if view.format == NULL else <bytes>view.format
        size = view.itemsize
        PyBuffer_Release(view)
        raise TypeError(f"a 1-D uint32 buffer was expected, not format {fmt!r} of {size} bytes")
    return 0


cdef int _byte_buffer(object obj, Py_buffer* view) except -1:
    """`view` of a C-contiguous buffer read as bytes (a bytearray, bytes), released by the caller."""
    PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS)
    return 0


cdef extern from "repair.hpp" namespace "ttn":
    int64_t char_byte_offset(const uint8_t* b, int64_t n, int64_t nchars, int64_t c) nogil

    cdef cppclass LaneTables:
        const uint32_t* token_len
        const uint8_t* uncertain
        int64_t n_ids
        const uint8_t* group
        const uint8_t* pairs
        int64_t n_pairs
        int64_t max_token_bytes
        int64_t max_literal
        const uint8_t* classes
        uint8_t w_bit
        const uint8_t* nfc_marks
        uint8_t inert_bit

    cdef cppclass LaneResult:
        int status
        int64_t k1, k2, q, q2, fresh
        const uint32_t* mid
        int64_t n_mid

    cdef cppclass Lane

    cdef cppclass Cached "ttn::Lane::Cached":
        const uint32_t* ids
        int64_t N
        const uint32_t* cp
        int64_t n_cp, stride
        const Lane* lane

    cdef cppclass Buffers "ttn::Lane::Buffers":
        uint32_t* ids
        int64_t n, cap
        uint32_t* cp
        int64_t n_cp, cp_cap, stride

    const uint8_t* utf8_of(const void* data, int kind, int64_t n, int64_t& n_out) except + nogil

    cdef cppclass Lane:
        const Engine* eng
        LaneTables t
        Trie lit_bytes
        vector[uint64_t] nfc_maybe
        vector[uint64_t] nfc_pairs
        int edit(const uint8_t* T, int64_t n_old, int64_t s, int64_t e, const uint8_t* data, int64_t n_data,
                 const Cached& C, int64_t wl, int64_t wr, PieceCache& cache, const vector[PieceCache*]& more,
                 LaneResult& res) except + nogil
        cbool commit(const LaneResult& res, Buffers& b, int64_t& first_changed) nogil
        void text_cuts[T](const T* s, int64_t n, int64_t chunk, vector[int64_t]& cuts) except + nogil
        cbool nfc_stable[T](const T* s, int64_t n) nogil
        void build_fast_len()


LANE_STATUS = {0: "ok", 1: "no certified cut in the first window", 2: "one-byte run before the change",
               3: "a character NFC may change in the window", 4: "a fresh token without a fixed span",
               5: "invalid UTF-8", 6: "fresh tokens do not spell the new text"}


cdef class RepairLane:
    """The compiled first-window splice of an edit or append (``repair.hpp``) for one tokenizer."""

    cdef Lane* lane
    cdef object _keep

    def __cinit__(self):
        self.lane = new Lane()
        self._keep = []

    def __dealloc__(self):
        del self.lane

    def __init__(self, CoreEngine core, token_len, uncertain, group, pairs, int max_token_bytes, list literals,
                 classes=None, int w_bit=0, nfc_marks=None, int inert_bit=0, nfc_maybe=None, nfc_pairs=None):
        """`classes` (the tokenizer's uint8 class table) and its whitespace bit `w_bit` let the lane
        cut big windows into chunks encoded on several threads (`edit_commit` with several caches).
        `nfc_marks`, `nfc_maybe`, `nfc_pairs` (NFC families: `charclass.nfc_mark_table`, with the
        class table's NFC-inert bit `inert_bit`) let it take windows holding marks NFC leaves alone
        (`Lane::nfc_stable`)."""
        arrays = [np.ascontiguousarray(token_len, dtype=np.uint32), np.ascontiguousarray(uncertain, dtype=np.uint8),
                  np.ascontiguousarray(group, dtype=np.uint8), np.ascontiguousarray(pairs, dtype=np.uint8)]
        if classes is not None:
            arrays.append(np.ascontiguousarray(classes, dtype=np.uint8))
            if len(arrays[4]) != 0x110000 or not 0 < w_bit < 256:
                raise ValueError("the class table must have 0x110000 entries and w_bit one of its bits")
        if len(arrays[0]) != len(arrays[1]) or len(arrays[2]) != 0x110000 or len(arrays[3]) == 0:
            raise ValueError("lane tables have the wrong sizes")
        if nfc_marks is not None:
            if classes is None or not 0 < inert_bit < 256:
                raise ValueError("nfc_marks needs the class table and its NFC-inert bit")
            arrays.append(np.ascontiguousarray(nfc_marks, dtype=np.uint8))
            if len(arrays[5]) != 0x110000:
                raise ValueError("nfc_marks must have 0x110000 entries")
        if core.e.n_records() < len(arrays[0]):
            raise ValueError("the engine was built without per-token records (CoreEngine token_len=...)")
        self._keep = [core, arrays]
        cdef const uint32_t[::1] tl = arrays[0]
        cdef const uint8_t[::1] un = arrays[1]
        cdef const uint8_t[::1] gr = arrays[2]
        cdef const uint8_t[::1] pa = arrays[3]
        self.lane.eng = core.e
        self.lane.t.token_len = &tl[0]
        self.lane.t.uncertain = &un[0]
        self.lane.t.n_ids = len(arrays[0])
        self.lane.t.group = &gr[0]
        self.lane.t.pairs = &pa[0]
        self.lane.t.n_pairs = len(arrays[3])
        self.lane.t.max_token_bytes = max_token_bytes
        cdef const uint8_t[::1] cl
        if classes is not None:
            cl = arrays[4]
            self.lane.t.classes = &cl[0]
            self.lane.t.w_bit = w_bit
        cdef const uint8_t[::1] nm
        if nfc_marks is not None:
            nm = arrays[5]
            self.lane.t.nfc_marks = &nm[0]
            self.lane.t.inert_bit = inert_bit
            maybe = np.asarray(nfc_maybe if nfc_maybe is not None else [], dtype=np.int64)
            if len(maybe) and (maybe.min() < 0 or maybe.max() >= 0x110000):
                raise ValueError("nfc_maybe holds code points")
            self.lane.nfc_maybe.assign((int(maybe.max()) // 64 + 1) if len(maybe) else 0, 0)
            for c in maybe.tolist():
                self.lane.nfc_maybe[c >> 6] |= (<uint64_t>1) << (c & 63)
            for x in sorted(int(v) for v in (nfc_pairs if nfc_pairs is not None else [])):
                self.lane.nfc_pairs.push_back(x)
        cdef uint32_t[::1] bs
        longest = 0
        for content in literals:
            raw = content.encode("utf-8")
            if not raw:
                continue
            longest = max(longest, len(raw))
            bs = np.frombuffer(raw, dtype=np.uint8).astype(np.uint32)
            self.lane.lit_bytes.add(&bs[0], len(bs), 1)
        self.lane.t.max_literal = longest
        self.lane.build_fast_len()

    def text_cuts(self, str text, int64_t chunk):
        """Standalone-stable character offsets cutting `text` about every `chunk` characters for
        `CoreEngine.encode_chunks` (`Lane::text_cuts`: `fullpath.chunk_cuts` compiled); [] when
        the lane was built without the class table."""
        cdef int kind = PyUnicode_KIND(text)
        cdef void* data = PyUnicode_DATA(text)
        cdef int64_t n = PyUnicode_GET_LENGTH(text)
        cdef vector[int64_t] cuts
        with nogil:
            if kind == 1:
                self.lane.text_cuts[uint8_t](<const uint8_t*>data, n, chunk, cuts)
            elif kind == 2:
                self.lane.text_cuts[uint16_t](<const uint16_t*>data, n, chunk, cuts)
            else:
                self.lane.text_cuts[uint32_t](<const uint32_t*>data, n, chunk, cuts)
        return [cuts[i] for i in range(cuts.size())]

    def nfc_stable(self, str text):
        """Whether `text` passes the lane's NFC quick check (`Lane::nfc_stable`, NFC families: then
        NFC leaves it as it is), or None when the lane has no NFC tables.  The lane runs it on each
        window; `NativeEngine.normalized` on whole texts."""
        if self.lane.t.nfc_marks == NULL:
            return None
        cdef int kind = PyUnicode_KIND(text)
        cdef void* data = PyUnicode_DATA(text)
        cdef int64_t n = PyUnicode_GET_LENGTH(text)
        cdef cbool ok
        with nogil:  # (a whole text's check: ~1 ms a million characters)
            if kind == 1:
                ok = self.lane.nfc_stable[uint8_t](<const uint8_t*>data, n)
            elif kind == 2:
                ok = self.lane.nfc_stable[uint16_t](<const uint16_t*>data, n)
            else:
                ok = self.lane.nfc_stable[uint32_t](<const uint32_t*>data, n)
        return ok

    def edit(self, text, int64_t s, int64_t e, bytes data, ids, checkpoints, int64_t stride, int64_t wl,
             int64_t wr, PieceCacheBox cache):
        """(status, k1, k2, left cut, right cut, fresh count, mid ids or None) for replacing bytes
        [s, e) of `text` (the session's UTF-8 text, bytearray or bytes) by `data`; `ids` are its
        tokens (uint32, contiguous) and `checkpoints` the byte start of every `stride`-th token."""
        cdef const uint8_t[::1] T = text
        cdef const uint32_t[::1] I = ids
        cdef const uint32_t[::1] CP = checkpoints
        cdef const uint8_t* d = data
        cdef LaneResult res
        cdef Cached C
        cdef vector[PieceCache*] no_more
        cdef int64_t n_old = len(T), n_data = len(data), N = len(I)
        if n_old == 0 or N == 0 or len(CP) != (N + stride - 1) // stride or not 0 <= s <= e <= n_old:
            return 1, 0, 0, 0, 0, 0, None
        C.ids = &I[0]
        C.N = N
        C.cp = &CP[0]
        C.n_cp = len(CP)
        C.stride = stride
        C.lane = self.lane
        with nogil:
            self.lane.edit(&T[0], n_old, s, e, d, n_data, C, wl, wr, cache.c[0], no_more, res)
        if res.status != 0:
            return res.status, 0, 0, 0, 0, res.fresh, None
        return 0, res.k1, res.k2, res.q, res.q2, res.fresh, _u32(res.mid, res.n_mid)

    def edit_commit(self, text, int64_t s, int64_t e, bytes data, ids_buffer, int64_t n, cp_buffer, int64_t n_cp,
                    int64_t stride, int64_t wl, int64_t wr, list caches):
        """`edit`, then its splice written in place: `ids_buffer[:n]` are the session's tokens and
        `cp_buffer[:n_cp]` their checkpoints (both uint32, writable, with spare capacity).

        Returns (status, k1, k2, left cut, right cut, fresh count, first changed, new n, new
        n_cp, mid).  Status 0 with mid None: committed, the buffers hold the new state.  Status 0
        with mid: certified but a buffer is too small, nothing written (the caller grows it and
        splices `mid` itself).  Other statuses: declined, nothing written.  `caches`: one piece
        cache, or more (a big window is then encoded in chunks, one thread per extra cache)."""
        cdef Py_buffer bt, bi, bc
        _byte_buffer(text, &bt)
        try:
            _u32_buffer(ids_buffer, &bi, True)
            try:
                _u32_buffer(cp_buffer, &bc, True)
                try:
                    return self._edit_commit(<const uint8_t*>bt.buf, bt.len, s, e, data, <uint32_t*>bi.buf,
                                             bi.len // 4, n, <uint32_t*>bc.buf, bc.len // 4, n_cp, stride, wl, wr,
                                             caches)
                finally:
                    PyBuffer_Release(&bc)
            finally:
                PyBuffer_Release(&bi)
        finally:
            PyBuffer_Release(&bt)

    cdef object _edit_commit(self, const uint8_t* T, int64_t n_old, int64_t s, int64_t e, bytes data, uint32_t* I,
                             int64_t n_ids, int64_t n, uint32_t* CP, int64_t n_cps, int64_t n_cp, int64_t stride,
                             int64_t wl, int64_t wr, list caches):
        cdef const uint8_t* d = data
        cdef LaneResult res
        cdef Cached C
        cdef Buffers B
        cdef vector[PieceCache*] more
        cdef PieceCacheBox cache = caches[0]
        cdef PieceCacheBox extra
        for extra in caches[1:]:
            more.push_back(extra.c)
        cdef int64_t n_data = len(data), first = 0
        cdef cbool done = False
        if (n_old == 0 or n == 0 or n > n_ids or n_cp != (n + stride - 1) // stride or n_cp > n_cps
                or not 0 <= s <= e <= n_old):
            return 1, 0, 0, 0, 0, 0, 0, n, n_cp, None
        C.ids = I
        C.N = n
        C.cp = CP
        C.n_cp = n_cp
        C.stride = stride
        C.lane = self.lane
        B.ids = I
        B.n = n
        B.cap = n_ids
        B.cp = CP
        B.n_cp = n_cp
        B.cp_cap = n_cps
        B.stride = stride
        with nogil:
            self.lane.edit(T, n_old, s, e, d, n_data, C, wl, wr, cache.c[0], more, res)
            if res.status == 0:
                done = self.lane.commit(res, B, first)
        if res.status != 0:
            return res.status, 0, 0, 0, 0, res.fresh, 0, n, n_cp, None
        if done:
            return 0, res.k1, res.k2, res.q, res.q2, res.fresh, first, B.n, B.n_cp, None
        return 0, res.k1, res.k2, res.q, res.q2, res.fresh, 0, n, n_cp, _u32(res.mid, res.n_mid)

    def append_commit(self, CachePool pool, bytearray text, str data, ids_buffer, int64_t n, cp_buffer,
                      int64_t n_cp, int64_t stride, int64_t window, int64_t max_data_bytes):
        """A session append in one call: `data` (a str) appended to `text` (the session's UTF-8
        bytearray) with the first window's certified splice written in place, as `edit_commit`
        does with one piece cache from `pool`.

        Returns (0, first changed, new n, new n_cp, fresh count): committed, and `text` holds the
        new bytes.  (status, fresh count) with status > 0: the lane declined (`LANE_STATUS`),
        nothing written.  None: not done, nothing written (`data` is empty, not encodable as UTF-8
        or `max_data_bytes` long or longer, the text would reach 4 GiB, or a buffer lacks room):
        the caller takes the general path.
        The UTF-8 of an ASCII str is its own buffer (PEP 393), so an ASCII append copies nothing
        before the splice."""
        cdef const char* d
        cdef int64_t nd
        if PyUnicode_IS_ASCII(data):
            d = <const char*>PyUnicode_DATA(data)
            nd = PyUnicode_GET_LENGTH(data)
        else:  # into this thread's scratch (valid through the edit and commit below)
            if PyUnicode_GET_LENGTH(data) >= max_data_bytes:
                return None  # (its UTF-8 is no shorter: not converted only to be refused)
            d = <const char*>utf8_of(PyUnicode_DATA(data), PyUnicode_KIND(data), PyUnicode_GET_LENGTH(data), nd)
            if d == NULL:
                return None  # a lone surrogate: the general path raises InvalidText for it
        if nd == 0 or nd >= max_data_bytes:
            return None
        cdef Py_buffer bi, bc
        cdef LaneResult res
        cdef Cached C
        cdef Buffers B
        cdef vector[PieceCache*] no_more
        cdef int64_t n_old = PyByteArray_GET_SIZE(text), first = 0, new_n, new_cp, lm
        cdef Py_buffer bt
        if n_old == 0 or n <= 0 or n_old + nd >= (<int64_t>1 << 32):  # token offsets are uint32
            return None
        cdef PieceCacheBox cache
        _u32_buffer(ids_buffer, &bi, True)
        try:
            _u32_buffer(cp_buffer, &bc, True)
            try:
                if n > bi.len // 4 or n_cp != (n + stride - 1) // stride or n_cp > bc.len // 4:
                    return None
                C.ids = <uint32_t*>bi.buf
                C.N = n
                C.cp = <uint32_t*>bc.buf
                C.n_cp = n_cp
                C.stride = stride
                C.lane = self.lane
                # An export of the text while the GIL is released: another thread resizing it meanwhile
                # (a session shared without a lock) gets a BufferError, never freed memory under the lane.
                _byte_buffer(text, &bt)
                cache = pool.take()
                try:
                    with nogil:
                        self.lane.edit(<const uint8_t*>bt.buf, n_old, n_old, n_old, <const uint8_t*>d, nd, C, window,
                                       window, cache.c[0], no_more, res)
                finally:
                    pool.give(cache)
                    PyBuffer_Release(&bt)
                if res.status != 0:
                    return res.status, res.fresh
                lm = res.n_mid
                new_n = n - (res.k2 - res.k1) + lm
                new_cp = (new_n + stride - 1) // stride
                if new_n > bi.len // 4 or new_cp > bc.len // 4:
                    return None  # a buffer must grow first: the general path does it
                # The text grows before any token is written: a failed resize leaves the session as it was.
                _room_for(text, n_old + nd)
                PyByteArray_Resize(text, n_old + nd)
                memcpy(PyByteArray_AS_STRING(text) + n_old, d, nd)
                B.ids = <uint32_t*>bi.buf
                B.n = n
                B.cap = bi.len // 4
                B.cp = <uint32_t*>bc.buf
                B.n_cp = n_cp
                B.cp_cap = bc.len // 4
                B.stride = stride
                self.lane.commit(res, B, first)  # cannot refuse: the room was checked above
                return 0, first, B.n, B.n_cp, res.fresh
            finally:
                PyBuffer_Release(&bc)
        finally:
            PyBuffer_Release(&bi)


def char_offset_to_byte(text, int64_t nchars, int64_t c):
    """Byte offset of character `c` of `text` (a session's UTF-8 bytearray or bytes, `nchars`
    characters; its length when c >= nchars), counted from the nearer end (`char_byte_offset`)."""
    cdef Py_buffer bt
    cdef int64_t out
    if c < 0 or nchars < 0:
        raise ValueError("character offsets are not negative")
    _byte_buffer(text, &bt)
    try:
        with nogil:
            out = char_byte_offset(<const uint8_t*>bt.buf, bt.len, nchars, c)
    finally:
        PyBuffer_Release(&bt)
    return out


def token_start(ids, token_len, checkpoints, int64_t stride, int64_t k):
    """Byte start of token `k` of `ids` (uint32, at least k + 1 of them; a session's whole buffer
    may be passed) from its `checkpoints` (`toktier.offsets`): the checkpoint's value plus the
    lengths of at most ``stride - 1`` tokens.  Raw buffers, no typed memoryviews: what a session
    asks once per op, where numpy's own calls cost ~25 us with their code cold after a repair."""
    cdef Py_buffer bi, bl, bc
    cdef int64_t total, j
    cdef uint32_t t
    _u32_buffer(ids, &bi)
    try:
        _u32_buffer(token_len, &bl)
        try:
            _u32_buffer(checkpoints, &bc)
            try:
                if stride <= 0 or k < 0 or k >= bi.shape[0] or k // stride >= bc.shape[0]:
                    raise IndexError(f"token {k} is outside the ids or their checkpoints")
                total = (<const uint32_t*>bc.buf)[k // stride]
                for j in range(k - k % stride, k):
                    t = (<const uint32_t*>bi.buf)[j]
                    if t >= bl.shape[0]:
                        raise IndexError(f"id {t} is outside token_len")
                    total += (<const uint32_t*>bl.buf)[t]
                return total
            finally:
                PyBuffer_Release(&bc)
        finally:
            PyBuffer_Release(&bl)
    finally:
        PyBuffer_Release(&bi)


cdef inline uint32_t _cp(const void* p, int kind, Py_ssize_t i) noexcept nogil:
    if kind == 1:
        return (<const uint8_t*>p)[i]
    if kind == 2:
        return (<const uint16_t*>p)[i]
    return (<const uint32_t*>p)[i]


cdef inline Py_ssize_t _run_same(const void* a, int ka, const void* b, int kb, Py_ssize_t n) noexcept nogil:
    """Elements a[0:n] and b[0:n] (code points of PEP 393 widths ka, kb) equal before the first
    that differs (n when none does): 64-element blocks by memcmp where both widths agree, then
    one element at a time."""
    cdef Py_ssize_t k = 0
    if ka == kb:
        while k + 64 <= n and memcmp(<const uint8_t*>a + k * ka, <const uint8_t*>b + k * ka, 64 * ka) == 0:
            k += 64
    while k < n and _cp(a, ka, k) == _cp(b, kb, k):
        k += 1
    return k


def common_prefix(str a, Py_ssize_t i, str b, Py_ssize_t j, Py_ssize_t limit):
    """Length of the common run of a[i:] and b[j:], at most `limit` (`text_diff.match_forward`
    without a copy): code points compared in place, whatever the two strs' widths."""
    cdef Py_ssize_t na = PyUnicode_GET_LENGTH(a), nb = PyUnicode_GET_LENGTH(b)
    if i < 0 or j < 0:
        raise IndexError(f"common_prefix: negative offset ({i}, {j})")
    cdef Py_ssize_t n = min(limit, na - i, nb - j)  # (an offset past its string's end: nothing in common)
    if n <= 0:
        return 0
    cdef int ka = PyUnicode_KIND(a), kb = PyUnicode_KIND(b)
    cdef const uint8_t* pa = <const uint8_t*>PyUnicode_DATA(a) + i * ka
    cdef const uint8_t* pb = <const uint8_t*>PyUnicode_DATA(b) + j * kb
    return _run_same(pa, ka, pb, kb, n)


def reserve_text(bytearray text, Py_ssize_t size):
    """Make room for `text` to grow to `size` bytes without another copy, growing it by half at
    least (CPython's own growth is an eighth); its contents and length stay as they are."""
    _room_for(text, size)


def token_checkpoints(const uint32_t[::1] ids, const uint32_t[::1] token_len, int64_t stride, uint32_t[::1] out):
    """One pass over `ids`: ``out[j]`` = the byte start of token ``j * stride`` (the session's
    checkpoints, `toktier.offsets`), returned with the tokens' total byte length; -1 when an id
    is outside `token_len` or a start does not fit in uint32 (the caller then takes numpy's path).
    `out` holds at least ``ceil(len(ids) / stride)`` slots."""
    cdef Py_ssize_t n = ids.shape[0], nv = token_len.shape[0], i = 0, k, end, j = 0
    cdef int64_t total = 0
    cdef int64_t limit = 0xFFFFFFFF
    cdef uint32_t t
    cdef bint bad = False
    if stride <= 0 or out.shape[0] < (n + stride - 1) // stride:
        raise ValueError("token_checkpoints: stride must be positive and out must hold ceil(len(ids) / stride)")
    with nogil:
        while i < n and not bad:
            if total > limit:
                bad = True
                break
            out[j] = <uint32_t>total
            j += 1
            end = i + stride if i + stride < n else n
            for k in range(i, end):  # a block per checkpoint: no division per token
                t = ids[k]
                if t >= nv:
                    bad = True
                    break
                total += token_len[t]
            i = end
    return -1 if bad else total
