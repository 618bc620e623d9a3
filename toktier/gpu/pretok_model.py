r"""Regex-free pre-tokenizer: per-character piece starts from classes, runs and scans.

This is the numpy host model of ``cuda_src/tt_pretok.cuh``.  Every step is an
elementwise rule, a shift by one or two characters, or a (segmented) prefix /
suffix max-min scan, i.e. exactly what the kernels do with one thread per code
point and block scans.  Input: the code points of one *segment* (text between
added-token literals, which are split out first); output: ``bool[n]``, True
where a pre-tokenizer piece starts.

Notation: c = text[i], p = text[i-1], pp = text[i-2], y = the character after a
run.  Classes come from the probed table (``tables.py``): L = \p{L}, N = \p{N},
M = \p{M}, W = \s, R = {\r,\n}, P = "other" (per family below), SP = U+0020.
A *run* is a maximal stretch of one class.  "p joins c" means the piece that
starts at p continues over c.  The regex engines scan leftmost-first: at the
scan position the first alternative that matches wins and the scan resumes at
its end, so a derivation follows one scan through each run.

cl100k / Llama-3 (``cl100k_hf``; ``cl100k_tt`` = tiktoken form), Qwen (``qwen``)
------------------------------------------------------------------------------
Alternatives: (1) ``'(s|t|re|ve|m|ll|d)`` (case-insensitive), (2) ``X?L+`` with
X = [^\r\n L N], (3) ``N{1,3}`` (Qwen: ``N``), (4) ``SP?P+R*`` with P = [^\s L N],
(5) ``\s*R+``, (6) ``\s+(?!\S)``, (7) ``\s+``; the tiktoken form adds ``\s++$``
before (5) and writes (5), (7) with single characters (same pieces: ``\s*``
backtracks to the last R of the whitespace run either way).

* N run [s,e): starts at s, s+3, s+6, ... (Qwen: every digit).  Nothing absorbs a
  digit: X and P exclude N, whitespace alternatives exclude it.
* W run [s,e) followed by y (or the end).  Entry a = s, except that a P run just
  before it ends in (4) whose ``R*`` takes the run's leading R characters, so
  a = s + (their count).  From a: if the run has an R at or after a, (5) ends at
  the last one, r: start at a, then at r+1.  The R-free rest [b,e): at the end of
  text (6) takes it whole; before y, (6) backtracks one character (``(?!\S)``), so
  e-1 starts a piece (if b < e-1, [b,e-1) is one piece).  tiktoken form: at the end
  of the text ``\s++$`` takes [a,e) whole, so r+1 is no start there.
  => starts: a; r+1 (if r >= a, r+1 < e, not tt-at-end); e-1 (if y exists and
  text[e-1] is not R).  Consequence used below: *the last whitespace character
  before y starts a piece unless it is R*.
* L run at s: (2) lets p join when p is at a scan position and p in X.  p in
  W-R: it is the last whitespace character before s, so it starts (above) and
  joins.  p in P: p starts iff its P run is p alone (pp not P) and pp is not SP
  (SP + P is (4)).  p = R, N: never joins.
  => start at s unless p in W-R, or (p in P, pp not in P, pp != SP).
  Inside the run: if p = ' joined, (1) is tried first: ``'s 't 'm 'd`` end at
  s+1, ``'re 've 'll`` at s+2; the rest of the run starts a piece.
* P run at s: starts unless p = SP (the last whitespace char, which (4) takes
  together with the whole P run).  Inside: no starts (P+ is greedy; (1) and (2)
  need a letter right after the first character).

DeepSeek (``deepseek``: three Split stages)
-------------------------------------------
Each stage splits every piece of the previous one (matches included).  Stage 1
``\p{N}{1,3}`` isolates digit triples (stage 3 leaves them whole: digits are O,
see below); stage 2 ``[一-龥぀-ゟ゠-ヿ]+`` (class K) cuts the rest into K runs and
non-K runs; stage 3 runs on each of these *segments* separately (the end of a
segment is an end of text for ``(?!\S)``).  K runs are split further by stage 3:
they hold letters, marks (U+3099), P (U+30FB) and S (U+309B) characters.
Stage 3: (1) ``A[A-Za-z]+`` (A = ASCII punctuation), (2) ``X?[L M]+`` with
X = [^\r\n L P S], (3) ``SP?[P S]+R*``, (4)-(6) whitespace as above.  O = neither L, M, P, S nor W:
no alternative starts at O unless (2) does (O then L/M); unmatched characters
between matches form one piece.

* N: as cl100k.  A segment starts where a digit run ends or K-ness changes.
* W run: as cl100k HF form, y must lie in the segment, entry after the R
  characters taken by a (3) piece (p in P S).
* LM run at s: X joins: p in W-R (last whitespace char) or p in O.  Also (1):
  p in A, c in [A-Za-z], p at a scan position (its P S run is p alone and pp !=
  SP).  Then (1) stops at the first non-[A-Za-z] character of the run, which
  starts the rest.
* PS run: starts unless p = SP.
* O at i: starts iff it begins a match (y in L M) or p is not O (a gap starts).

o200k / gpt-oss (``o200k``)
---------------------------
Alternatives: (1) ``X? U* l+ C?``, (2) ``X? U+ l* C?`` with U = [Lu Lt Lm Lo M],
l = [Ll Lm Lo M] (type U = upper only, l = lower only, B = both: Lm Lo M),
X = [^\r\n L N], C = contraction; (3) ``N{1,3}``; (4) ``SP?Q+[\r\n/]*`` with
Q = [^\s L N] (P and M); (5)-(7) whitespace as cl100k HF.

* Word piece from scan position j over a word stretch (L/M chars) ending at w1:
  k = end of the U/B run from j.  If type(k) = l, (1) ends at the first U after
  k.  Otherwise (the rest is U/B up to w1) (1) backtracks to the last B, bb, and
  ends at bb+1; with no B, (2) takes [j, w1).  Hence inside a word segment
  [w0, w1): a start at each U whose preceding l/B run (clipped at w0) contains
  an l; and, for the tail after the last l (from the first U after it, or from w0
  if there is no l), a start at (last B of the tail)+1 if that is < w1.  An M at
  a scan position behaves as a B (X = M then the word, or no X: same end).
* P chars (not W N L M).  At a scan position a P char with a word char next
  begins (1)/(2) as X; otherwise (4) begins a *zone*: Q+ swallows P and M up to
  the next letter L (or W, N, end), then ``[\r\n/]*`` swallows a *chain* of R and
  '/' characters (the R prefix of the next W run, a '/' prefix of the next blob,
  and so on: resolved by a fixpoint, each round a few scans.  In every case we
  analysed, stripping a blob's leading '/' does not change whether it ends in a
  zone, so one round reaches the fixpoint; the kernels capture
  ``driver.O200K_ROUNDS`` rounds plus a convergence check, and a request that has
  not converged sets a status bit and is answered by the CPU).  Within a *blob* (a
  run of L M P chars) every P run is at a scan position unless swallowed by a zone,
  so a zone starts at a P run [s,e) with e-s >= 2, or e = blob end, or s = blob
  start with p = SP (SP + Q+); it covers everything up to the next L.
* Contraction C = ``'(s|t|re|ve|m|ll|d)`` right after a word piece: an apostrophe
  P run with a word character before it.  If that character was itself taken by a
  contraction the apostrophe is at a scan position instead and starts an X word
  piece (which can take a contraction again): along a chain of such apostrophes
  absorption alternates, counted with a segmented scan.
* Word stretch start (first non-zone word char of a blob stretch): p joins if p is
  a non-absorbed single P (X) or p in W-R; after a zone, R, N, or the start, it
  starts.  After absorbed contraction letters the rest of the stretch starts.
"""

from __future__ import annotations

import numpy as np

from ..boundaries import char_byte_offsets
from ..charclass import FOLD_SHIFT, K, L, LO, M, N, PS, UP, W
from ..families import GpuRules
from ..literals import first_byte_tries

RULES = tuple(GpuRules)
_CL100K_LIKE = (GpuRules.CL100K_HF, GpuRules.CL100K_TT, GpuRules.QWEN)


def supported_rules() -> tuple[GpuRules, ...]:
    return RULES


# -- scan helpers (each is one kernel primitive) -------------------------------------------

def _prev(a: np.ndarray, fill=False, k: int = 1) -> np.ndarray:
    out = np.empty_like(a)
    out[:k] = fill
    out[k:] = a[:-k] if len(a) > k else a[:0]
    return out[: len(a)]


def _next(a: np.ndarray, fill=False, k: int = 1) -> np.ndarray:
    out = np.empty_like(a)
    out[len(a) - k:] = fill
    out[: len(a) - k] = a[k:]
    return out


def _last_flag(flag: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Largest j <= i with flag[j], else -1 (inclusive max-scan)."""
    return np.maximum.accumulate(np.where(flag, idx, -1)) if len(flag) else idx


def _next_flag(flag: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Smallest j >= i with flag[j], else n (inclusive reverse min-scan)."""
    n = len(flag)
    if not n:
        return idx
    return np.minimum.accumulate(np.where(flag, idx, n)[::-1])[::-1]


def _run_bounds(mask: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For positions inside runs of `mask`: (run start, run end); undefined elsewhere."""
    begin = mask & ~_prev(mask)
    end_next = mask & ~_next(mask)  # last element of a run
    s = np.maximum.accumulate(np.where(begin, idx, 0)) if len(mask) else idx
    e = _next_flag(end_next, idx) + 1
    return s, e


def _at(arr: np.ndarray, pos: np.ndarray, fill):
    """arr[pos] with out-of-range positions giving `fill`."""
    n = len(arr)
    ok = (pos >= 0) & (pos < n)
    out = np.full(pos.shape, fill, dtype=arr.dtype)
    out[ok] = arr[pos[ok]]
    return out


def _fold(cls: np.ndarray) -> np.ndarray:
    return ((cls >> np.uint32(FOLD_SHIFT)) & np.uint32(0xFF)).astype(np.uint8)


def _contraction_len(fold: np.ndarray) -> np.ndarray:
    """Length (1 or 2, else 0) of a contraction suffix whose letters start at each i."""
    f0 = fold
    f1 = _next(fold, 0)
    one = np.isin(f0, np.frombuffer(b"sdmt", dtype=np.uint8))
    two = ((f0 == ord("r")) & (f1 == ord("e"))) | ((f0 == ord("v")) & (f1 == ord("e"))) | (
        (f0 == ord("l")) & (f1 == ord("l")))
    return np.where(one, 1, np.where(two, 2, 0)).astype(np.int64)


def _whitespace_starts(isW, isR, absorbed_entry, y_exists_after, idx, n, tt_end_whole=False):
    """Piece starts inside whitespace runs (see module docstring, cl100k W-run rule).

    absorbed_entry[i] (for W positions): entry a of i's run; y_exists_after[i]: the
    run's successor y exists (inside the segment).
    """
    s, e = _run_bounds(isW, idx)
    a = absorbed_entry
    last_r = _last_flag(isR, idx)
    r = _at(last_r, e - 1, -1)
    st = isW & (idx == a)
    cond_r = isW & (r >= a) & (idx == r + 1) & (r + 1 < e)
    if tt_end_whole:
        cond_r &= ~(e == n)
    st |= cond_r
    st |= isW & y_exists_after & (idx == e - 1) & ~_at(isR, e - 1, True)
    return st, s, e


def _entry_after_r_prefix(isW, isR, absorb_run, idx):
    """Entry point a of each W run: after its leading R chars when absorb_run (per run start)."""
    s, e = _run_bounds(isW, idx)
    first_non_r = _next_flag(isW & ~isR, idx)
    a_abs = np.minimum(_at(first_non_r, s, 0), e)
    return np.where(_at(absorb_run, s, False), a_abs, s)


# -- cl100k / Llama-3 / Qwen ---------------------------------------------------------------

def _starts_cl100k(cps: np.ndarray, tbl: np.ndarray, rules: str) -> np.ndarray:
    n = len(cps)
    idx = np.arange(n)
    c = tbl[cps]
    isL = (c & L) != 0
    isN = (c & N) != 0
    isW = (c & W) != 0
    isR = (cps == 10) | (cps == 13)
    isP = ~(isL | isN | isW)
    sp = cps == 32
    st = np.zeros(n, dtype=bool)
    st[:1] = True
    # digits
    if rules == GpuRules.QWEN:
        st |= isN
    else:
        ns, _ = _run_bounds(isN, idx)
        st |= isN & ((idx - ns) % 3 == 0)
    # punctuation runs
    pP = _prev(isP)
    psp = _prev(sp)
    st |= isP & ~pP & ~psp
    # letter runs
    pL = _prev(isL)
    Lb = isL & ~pL
    join = (_prev(isW) & ~_prev(isR)) | (pP & ~_prev(isP, k=2) & ~_prev(sp, k=2))
    st |= Lb & ~join
    cj = Lb & join & (_prev(cps, 0) == 0x27)
    clen = _contraction_len(_fold(c))
    tgt = idx + clen
    split = cj & (clen > 0) & _at(isL, tgt, False) & (tgt > idx)
    # letters between idx and tgt are letters (folds exist only on letters), so tgt is in the run
    st[tgt[split]] = True
    # whitespace runs
    Ws, We = _run_bounds(isW, idx)
    a = _entry_after_r_prefix(isW, isR, _prev(isP), idx)
    y_exists = We < n
    wst, _, _ = _whitespace_starts(isW, isR, a, y_exists, idx, n, tt_end_whole=rules == GpuRules.CL100K_TT)
    return st | wst


# -- DeepSeek ------------------------------------------------------------------------------

_A_MASK = np.zeros(128, dtype=bool)
for _ch in "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~":
    _A_MASK[ord(_ch)] = True


def _starts_deepseek(cps: np.ndarray, tbl: np.ndarray) -> np.ndarray:
    n = len(cps)
    idx = np.arange(n)
    c = tbl[cps]
    isN = (c & N) != 0
    isK = ((c & K) != 0) & ~isN
    seg = ~isN
    segstart = seg & (~_prev(seg) | (isK != _prev(isK)))
    st = np.zeros(n, dtype=bool)
    st[:1] = True
    ns, _ = _run_bounds(isN, idx)
    st |= isN & ((idx - ns) % 3 == 0)
    st |= segstart
    inprev = seg & ~segstart                 # i-1 is in i's segment
    inprev2 = inprev & _prev(inprev)         # i-2 too
    innext = seg & _next(seg) & ~_next(segstart)  # i+1 is in i's segment
    isLM = seg & ((c & (L | M)) != 0)
    isPS = seg & ((c & PS) != 0) & ~isLM
    isW = seg & ((c & W) != 0)
    isR = (cps == 10) | (cps == 13)
    isO = seg & ~(isLM | isPS | isW)
    sp = cps == 32
    isA = (cps < 128) & _A_MASK[np.minimum(cps, 127)] & isPS
    isa = ((cps >= 65) & (cps <= 90)) | ((cps >= 97) & (cps <= 122))
    # LM runs
    pLM = _prev(isLM) & inprev
    Lb = isLM & ~pLM
    alt1 = inprev & _prev(isA) & isa & ~(inprev2 & (_prev(isPS, k=2) | _prev(sp, k=2)))
    join = inprev & ((_prev(isW) & ~_prev(isR)) | _prev(isO))
    join |= alt1
    st |= Lb & ~join
    _, LMe = _run_bounds(isLM, idx)
    non_a = _next_flag(~isa, idx)
    tgt = non_a
    split = Lb & alt1 & (tgt < LMe)
    st[tgt[split]] = True
    # P/S runs
    st |= isPS & ~(_prev(isPS) & inprev) & ~(_prev(sp) & inprev)
    # gaps and O-prefixed words
    st |= isO & ((_next(isLM) & innext) | ~(_prev(isO) & inprev))
    # whitespace
    _, We = _run_bounds(isW, idx)
    absorb = _prev(isPS) & inprev
    a = _entry_after_r_prefix(isW, isR, absorb, idx)
    y_exists = _at(seg & ~segstart, We, False)
    wst, _, _ = _whitespace_starts(isW, isR, a, y_exists, idx, n)
    return st | wst


# -- o200k ---------------------------------------------------------------------------------

def _starts_o200k(cps: np.ndarray, tbl: np.ndarray) -> np.ndarray:
    n = len(cps)
    idx = np.arange(n)
    c = tbl[cps]
    isL = (c & L) != 0
    isN = (c & N) != 0
    isW = (c & W) != 0
    isM = ((c & M) != 0) & ~isL
    isR = (cps == 10) | (cps == 13)
    isP = ~(isL | isN | isW | isM)
    sp = cps == 32
    slash = cps == 0x2F
    word = isL | isM
    up = (c & UP) != 0
    lo = (c & LO) != 0
    tU = word & up & ~lo
    tl = word & lo & ~up
    tB = word & up & lo
    clen_at = _contraction_len(_fold(c))
    chainable = isR | slash
    chain_end = _next_flag(~chainable, idx)  # first non-[\r\n/] at or after i
    last_L = _last_flag(isL, idx)
    absorbed = np.zeros(n, dtype=bool)
    for _round in range(n + 1):  # converges in a few rounds: each adds a chain further right
        blob = (isL | isM | isP) & ~absorbed
        bs, be = _run_bounds(blob, idx)
        Pm = isP & blob
        ps, pe = _run_bounds(Pm, idx)
        Pb = Pm & ~_prev(Pm)
        zs = Pb & (((pe - idx) >= 2) | (pe == be) | ((idx == bs) & _prev(sp)))
        last_zs = _last_flag(zs, idx)
        inzone = blob & (last_zs >= bs) & (last_zs > last_L)
        zend = inzone & ~_next(inzone)
        t = idx + 1
        chain_from = zend & (t == be) & _at(isR, t, False)
        new_abs = np.zeros(n, dtype=bool)
        starts = t[chain_from]
        if len(starts):
            ends = chain_end[starts]
            delta = np.zeros(n + 1, dtype=np.int64)
            np.add.at(delta, starts, 1)
            np.add.at(delta, ends, -1)
            new_abs = np.cumsum(delta[:n]) > 0
        if np.array_equal(new_abs, absorbed):
            break
        absorbed = new_abs
    st = np.zeros(n, dtype=bool)
    st[:1] = True
    ns, _ = _run_bounds(isN, idx)
    st |= isN & ((idx - ns) % 3 == 0)
    # whitespace: entry after the absorbed R prefix
    _, We = _run_bounds(isW, idx)
    Ws, _ = _run_bounds(isW, idx)
    first_free = _next_flag(isW & ~absorbed, idx)
    a = np.minimum(_at(first_free, Ws, 0), We)
    wst, _, _ = _whitespace_starts(isW, isR, a, We < n, idx, n)
    st |= wst
    # zones
    prev_in_blob = _prev(blob) & ~(idx == bs)
    st |= zs & ~(_prev(inzone) & prev_in_blob) & ~((idx == bs) & _prev(sp))
    # word stretches and contractions
    wz = word & blob & ~inzone
    ap_run = Pm & ~inzone & (cps == 0x27) & ((pe - idx) == 1)
    qlen = _at(clen_at, idx + 1, 0)
    qcand = ap_run & _prev(wz) & prev_in_blob & (qlen > 0)
    ws_s, ws_e = _run_bounds(wz, idx)
    # linked: the word stretch before q is exactly the letters of the previous candidate
    lstart = _at(ws_s, idx - 1, 0)
    prevq = lstart - 1
    linked = qcand & _at(qcand, prevq, False) & (_at(qlen, prevq, 0) == (idx - lstart))
    qn = np.cumsum(qcand)
    chain0 = np.maximum.accumulate(np.where(qcand & ~linked, qn, 0))
    absorbed_q = qcand & ((qn - chain0) % 2 == 0)
    # non-zone P runs start, except absorbed apostrophes
    st |= Pb & ~inzone & ~absorbed_q
    # consumed letters and the scan start after them
    consumed = np.zeros(n + 1, dtype=np.int64)
    qpos = idx[absorbed_q]
    np.add.at(consumed, qpos + 1, 1)
    np.add.at(consumed, qpos + 1 + qlen[absorbed_q], -1)
    consumed = np.cumsum(consumed[:n]) > 0
    after = qpos + 1 + qlen[absorbed_q]
    after = after[(after < n)]
    t_start = np.zeros(n, dtype=bool)
    t_start[after] = True
    t_start &= wz
    ws0 = wz & ~(_prev(wz) & prev_in_blob)
    pX = prev_in_blob & _prev(Pm & ~inzone)
    join0 = pX | (_prev(isW) & ~_prev(isR))
    st |= ws0 & ~join0 & ~consumed
    st |= t_start
    # f-rules inside word segments
    wseg = wz & ~consumed
    sflag = (ws0 & ~consumed) | t_start
    w0 = np.maximum.accumulate(np.where(sflag, idx, 0))
    w1 = _next_flag(_next(sflag, True) | ~_next(wseg, False), idx) + 1
    lastl = _last_flag(tl, idx)
    lastU = _last_flag(tU, idx)
    pl = _prev(lastl, -1)
    pU = _prev(lastU, -1)
    st |= wseg & tU & (idx > w0) & (pl > pU) & (pl >= w0)
    # tail rule, evaluated at segment starts
    seg_starts = idx[sflag & wseg]
    if len(seg_starts):
        s0 = seg_starts
        s1 = w1[s0]
        z = lastl[s1 - 1]
        has_l = z >= s0
        nextU = _next_flag(tU, idx)
        m = np.where(has_l, _at(nextU, z + 1, n), s0)
        m = np.minimum(m, s1)
        lastB = _last_flag(tB, idx)
        bb = lastB[s1 - 1]
        ok = (bb >= m) & (bb + 1 < s1)
        st[(bb + 1)[ok]] = True
    return st


# -- public ----------------------------------------------------------------------------------

def piece_starts(cps: np.ndarray, tbl: np.ndarray, rules: str) -> np.ndarray:
    """bool[n]: a piece starts at each True (one segment between literals)."""
    cps = np.asarray(cps, dtype=np.uint32)
    if len(cps) == 0:
        return np.zeros(0, dtype=bool)
    if rules in _CL100K_LIKE:
        return _starts_cl100k(cps, tbl, rules)
    if rules == GpuRules.DEEPSEEK:
        return _starts_deepseek(cps, tbl)
    if rules == GpuRules.O200K:
        return _starts_o200k(cps, tbl)
    raise ValueError(f"unknown rule set {rules!r}; known: {', '.join(RULES)}")


def segment_pieces(text: str, tbl: np.ndarray, rules: str) -> list[tuple[int, int]]:
    """(start, end) character offsets of the pieces of one literal-free segment."""
    cps = np.frombuffer(text.encode("utf-32-le"), dtype="<u4")
    st = np.flatnonzero(piece_starts(cps, tbl, rules))
    ends = np.append(st[1:], len(cps))
    return list(zip(st.tolist(), ends.tolist()))


class LiteralFinder:
    """Added-token literals in UTF-8 bytes, as the reference extracts them.

    HF: leftmost-longest over the text for literals with ``normalized=False``, then,
    in the gaps, for ``normalized=True`` ones (the family check guarantees there is
    no normalizer here, so the normalized gaps are the raw gaps).  tiktoken: one
    leftmost-first alternation; no special token is a prefix of another, so that is
    leftmost-longest too.  Each pass uses one greedy trie regex per first byte
    (``re`` searches a literal first byte at memchr speed; one trie over literals
    with different first bytes is ~25x slower) and takes the leftmost match among
    the groups; at equal starts the same group holds the longest.

    >>> f = LiteralFinder([(b"<|a|>", 1), (b"<|ab|>", 2), (b"<|a", 3), (b"|x", 4)], [(b"zz", 5)])
    >>> f.find(b"x<|ab|><|a|><|a|xzz")
    [(1, 7, 2), (7, 12, 1), (12, 15, 3), (15, 17, 4), (17, 19, 5)]
    """

    def __init__(self, first: list[tuple[bytes, int]], second: list[tuple[bytes, int]] = ()) -> None:
        self.ids = {c: i for c, i in (*first, *second)}
        self.passes = [first_byte_tries(c for c, _ in first), first_byte_tries(c for c, _ in second)]

    @staticmethod
    def _scan(res: list, raw: bytes, lo: int, hi: int) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        nxt = [r.search(raw, lo, hi) for r in res]
        pos = lo
        while True:
            best = None
            for g, m in enumerate(nxt):
                if m is not None and m.start() < pos:
                    m = nxt[g] = res[g].search(raw, pos, hi)
                if m is not None and (best is None or m.start() < nxt[best].start()):
                    best = g
            if best is None:
                return out
            m = nxt[best]
            out.append((m.start(), m.end()))
            pos = m.end()

    def find(self, raw: bytes) -> list[tuple[int, int, int]]:
        """(start, end, id) byte spans of the literals, in order."""
        spans = self._scan(self.passes[0], raw, 0, len(raw)) if self.passes[0] else []
        if self.passes[1]:
            gaps, prev = [], 0
            for a, b in spans + [(len(raw), len(raw))]:
                if a > prev:
                    gaps.extend(self._scan(self.passes[1], raw, prev, a))
                prev = b
            spans = sorted(spans + gaps)
        return [(a, b, self.ids[raw[a:b]]) for a, b in spans]


def _literal_ids(tok, contents: list[str]) -> dict[str, int]:
    """The id the engine emits for each literal (its own map, never a file's declared ids)."""
    ids = tok.table.literal_ids
    return {s: int(ids[s]) for s in contents}


def literal_finder(tok) -> LiteralFinder | None:
    """The tokenizer's literal finder (cached per tokenizer), or None without literals."""
    from .tables import derived

    d = derived(tok)
    if "literal_finder" not in d:
        lits = [lit for lit in tok.engine.literals if lit.content]
        ids = _literal_ids(tok, [lit.content for lit in lits])
        first = [(lit.content.encode("utf-8"), ids[lit.content]) for lit in lits if not lit.normalized]
        second = [(lit.content.encode("utf-8"), ids[lit.content]) for lit in lits if lit.normalized]
        d["literal_finder"] = LiteralFinder(first, second) if lits else None
    return d["literal_finder"]


def split_literals(tok, text: str) -> list[tuple[int, int, int | None]]:
    """Split `text` into (start, end, literal_id or None) character spans by added-token literals."""
    finder = literal_finder(tok)
    if finder is None:
        return [(0, len(text), None)] if text else []
    raw = text.encode("utf-8")
    found = finder.find(raw)
    if not found:
        return [(0, len(text), None)] if text else []
    _, offs = char_byte_offsets(text)
    keys = np.array(sorted({x for a, b, _ in found for x in (a, b)}), dtype=np.int64)
    b2c = dict(zip(keys.tolist(), np.searchsorted(offs, keys).tolist()))  # literal edges are char boundaries
    out: list[tuple[int, int, int | None]] = []
    pos = 0
    for a, b, lid in found:
        ca, cb = b2c[a], b2c[b]
        if ca > pos:
            out.append((pos, ca, None))
        out.append((ca, cb, lid))
        pos = cb
    if pos < len(text):
        out.append((pos, len(text), None))
    return out


def pieces(tok, text: str, tbl: np.ndarray | None = None, rules: str | None = None) -> list[tuple[int, int, int | None]]:
    """All pieces of `text`: (start, end, literal id or None), character offsets."""
    from .tables import class_table, rules_for

    rules = rules or rules_for(tok)
    if rules is None:
        raise ValueError(f"{tok.name}: no GPU pre-tokenizer model for family {tok.family!r}")
    tbl = class_table(tok) if tbl is None else tbl
    out: list[tuple[int, int, int | None]] = []
    for a, b, lit in split_literals(tok, text):
        if lit is not None:
            out.append((a, b, lit))
        else:
            out.extend((a + x, a + y, None) for x, y in segment_pieces(text[a:b], tbl, rules))
    return out
