"""Round-parallel BPE: the host model of ``cuda_src/tt_bpe.cuh``.

Schedule (all pieces at once, as the kernels run it):

1. Whole-piece lookup: tiktoken returns a piece's id when the piece is a
   mergeable token; HF does the same when the model has ``ignore_merges``.  The
   lookup goes through the device vocab hash table (FNV-1a-64, confirmed by a
   byte compare).
2. Every other piece starts as its bytes' single-byte ids.  Each *round* looks up
   every adjacent pair in the pair hash table, takes the minimum rank per piece,
   and merges all leftmost non-overlapping occurrences of that rank (in a run of
   consecutive occurrences, the 1st, 3rd, 5th ...).  A piece is done when it has
   no pair with a rank.

Sequential BPE (tiktoken's and HF's: the leftmost lowest-rank pair, one merge at a
time) reaches the same result whenever merging a pair never creates a pair of
lower rank than its own, which holds for vocabularies trained by BPE (a token is
ranked after its parts); the tests check it on every piece of the corpora.

Spans are the prefix sum of the output tokens' byte lengths (byte-level BPE
without a normalizer: token bytes tile the text).
"""

from __future__ import annotations

import numpy as np

from ..boundaries import char_byte_offsets
from .tables import EMPTY32, BpeTables, bpe_tables, fnv1a64, hash_lookup

INF = np.int64(1) << 40


def _pair_lookup(t: BpeTables, left: np.ndarray, right: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    keys = (left.astype(np.uint64) << np.uint64(32)) | right.astype(np.uint64)
    slot = hash_lookup(t.pair_keys, t.pair_bits, keys)
    hit = slot >= 0
    rank = np.full(len(keys), INF, dtype=np.int64)
    merged = np.zeros(len(keys), dtype=np.int64)
    rank[hit] = t.pair_rank[slot[hit]]
    merged[hit] = t.pair_merged[slot[hit]]
    return rank, merged


def vocab_lookup(t: BpeTables, buf: np.ndarray, starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Token id of each whole piece buf[starts:starts+lens], or -1."""
    out = np.full(len(starts), -1, dtype=np.int64)
    cand = np.flatnonzero((lens <= t.max_piece_lookup) & (lens > 0))
    if not len(cand):
        return out
    h = fnv1a64(buf, starts[cand], lens[cand])
    slot = hash_lookup(t.vocab_keys, t.vocab_bits, h)
    hit = slot >= 0
    cand, slot = cand[hit], slot[hit]
    ids = t.vocab_ids[slot].astype(np.int64)
    ok = ids != int(EMPTY32)
    cand, ids = cand[ok], ids[ok]
    # confirm bytes (a 64-bit hash collision must not produce a wrong id)
    tl = (t.tok_off[ids + 1].astype(np.int64) - t.tok_off[ids])
    good = tl == lens[cand]
    for j in np.flatnonzero(good):
        a, n_ = int(starts[cand[j]]), int(lens[cand[j]])
        o = int(t.tok_off[ids[j]])
        if not np.array_equal(buf[a:a + n_], t.tok_blob[o:o + n_]):
            good[j] = False
    out[cand[good]] = ids[good]
    return out


def bpe(t: BpeTables, buf: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Round-parallel BPE of the pieces buf[starts[i]:ends[i]]; returns (ids, piece index per id)."""
    starts = np.asarray(starts, dtype=np.int64)
    ends = np.asarray(ends, dtype=np.int64)
    lens = ends - starts
    npieces = len(starts)
    whole = vocab_lookup(t, buf, starts, lens) if t.whole_piece_lookup else np.full(npieces, -1, dtype=np.int64)
    done_p = np.flatnonzero(whole >= 0)
    todo = np.flatnonzero(whole < 0)
    # byte tokens of the remaining pieces
    tl = lens[todo]
    pid = np.repeat(todo, tl)
    first = np.zeros(len(todo) + 1, dtype=np.int64)
    np.cumsum(tl, out=first[1:])
    pos = np.arange(len(pid)) - np.repeat(first[:-1], tl) + np.repeat(starts[todo], tl)
    toks = t.byte_to_id[buf[pos]].astype(np.int64) if len(pos) else np.zeros(0, dtype=np.int64)
    while len(toks) > 1:
        same = pid[:-1] == pid[1:]
        rank, merged = _pair_lookup(t, toks[:-1], toks[1:])
        rank[~same] = INF
        minr = np.full(npieces, INF, dtype=np.int64)
        np.minimum.at(minr, pid[:-1], rank)
        cand = (rank < INF) & (rank == minr[pid[:-1]])
        if not cand.any():
            break
        prevc = np.concatenate(([False], cand[:-1]))
        begin = cand & ~prevc
        idx = np.arange(len(cand))
        rs = np.maximum.accumulate(np.where(begin, idx, 0))
        take = cand & ((idx - rs) % 2 == 0)
        j = np.flatnonzero(take)
        toks[j] = merged[j]
        keep = np.ones(len(toks), dtype=bool)
        keep[j + 1] = False
        toks, pid = toks[keep], pid[keep]
    all_ids = np.concatenate((whole[done_p], toks))
    all_pid = np.concatenate((done_p, pid))
    order = np.argsort(all_pid, kind="stable")
    return all_ids[order].astype(np.uint32), all_pid[order]


def encode_with_spans(tok, text: str) -> tuple[np.ndarray, np.ndarray]:
    """(ids, byte start of each token) by the host models: pre-tokenizer, then BPE.

    Equals ``tok.encode(text)`` for supported families (NFC families: on text that
    NFC leaves unchanged).
    """
    from .pretok_model import pieces

    t = bpe_tables(tok)
    buf = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    _, offs = char_byte_offsets(text)
    pcs = pieces(tok, text)
    if not pcs:
        return np.zeros(0, dtype=np.uint32), np.zeros(0, dtype=np.int64)
    arr = np.array([(a, b, -1 if lit is None else lit) for a, b, lit in pcs], dtype=np.int64)
    is_lit = arr[:, 2] >= 0
    plain = np.flatnonzero(~is_lit)
    ids_p, pid_p = bpe(t, buf, offs[arr[plain, 0]], offs[arr[plain, 1]])
    lit_idx = np.flatnonzero(is_lit)
    all_ids = np.concatenate((ids_p.astype(np.int64), arr[lit_idx, 2]))
    all_pid = np.concatenate((plain[pid_p], lit_idx))
    order = np.argsort(all_pid, kind="stable")
    ids = all_ids[order].astype(np.uint32)
    lens = tok.token_len[ids].astype(np.int64)
    spans = np.zeros(len(ids), dtype=np.int64)
    if len(ids):
        np.cumsum(lens[:-1], out=spans[1:])
    return ids, spans


def encode(tok, text: str) -> np.ndarray:
    """IDs by the host models (see `encode_with_spans`)."""
    return encode_with_spans(tok, text)[0]
