r"""Glued pairs: where a long pre-tokenizer piece may be cut at the BPE level (issue 13, part 3).

A run of one character class (``=====``, a DNA string, a base64 line of letters) can
be a single piece of any length, with no stable boundary (``base.py``) inside it: a
change there used to re-tokenize the whole text.  Inside such a piece the session
splices at a *token* boundary instead, and two facts make that exact:

1. **Pre-tokenizer.**  A boundary between characters x = text[c-1] and y = text[c] is
   *glued* when, for the family's regex, (a) no scan ever places a piece boundary
   between them, and (b) every scan whose match holds x and y continues that match to
   the same end, determined by text[c-1:] alone.  So the window's scan (which starts
   at the window edge) and the true scans of the old and new text agree on every piece
   boundary from c on, whatever their match started with.
2. **BPE** (the ``bpe`` crate's "valid encoding" corollaries, github/rust-gems): a
   sub-sequence of a piece's BPE encoding is the BPE encoding of its bytes; two valid
   encodings that share a token at the same position concatenate to the valid
   encoding of the joined bytes; and a text has one valid encoding.  Merge-by-rank BPE
   (HF merges, tiktoken ranks) has these properties when the piece is encoded by
   merges, i.e. is not itself a vocabulary entry: the session asks for a glued stretch
   longer than the longest token on the cut's side, inside the window.

So old tokens up to a token t at c, fresh window tokens from t on (same start, same
id), is the new piece's encoding; the same on the right of the change with the old
tokens after t'.  The session finds c among its agreeing token runs
(``session.py``, `Session._find_left`), exactly where it looks for stable boundaries.

Glued pairs, by family (classes probed from the reference engine, ``charclass.py``):

cl100k / Llama-3, Qwen (``X?L+``, ``\x20?P+[\r\n]*`` with P = [^\s L N]):
    L->L, unless text[c-2] or text[c-3] is ``'`` (a contraction ``'s``/``'re`` may end
    at c).  A letter match is ``X?L+`` (greedy to the end of the letter run) or a
    contraction; no other alternative holds a letter.
    P->P (P = not L, N, W; marks and ``'`` included).  A match holding two P
    characters is ``\x20?P+[\r\n]*`` (``X?L+`` holds one P, the contraction none),
    greedy to the end of the P run and its line breaks.
o200k (case-aware words ``X?[UP]*[LO]+C?`` / ``X?[UP]+[LO]*C?``, UP = [Lu Lt Lm Lo M],
LO = [Ll Lm Lo M], C a contraction suffix; `case_table` probes UP and LO):
    x->y for x a letter (or a mark that continues a word: the nearest non-mark before it
    is a letter) and y a letter or mark, unless x in LO and y in UP only (``aB`` starts a
    word at B), and unless text[c-2] or text[c-3] is ``'`` (a suffix ``'s`` ends a word).
    A word match holds such a pair as UP*->UP or ->LO; which alternative matched, and
    where its [LO] part ends, is decided by the same text after c, so every scan ends at
    the same place.  Marks after punctuation are punctuation (M is also in P below), so
    a mark run is word-like only after a letter.  An upper-only pair (``AB``) needs its
    run of upper-only letters to start after a character outside UP: after Lo/Lm/M
    letters (``ขขAB``) ``[UP]*`` backtracks to the last LO character when no lower-case
    letter follows, so whether the word starts at ``ข`` or at ``A`` depends on later text.
    Likewise a Lo/Lm/M character glues only if its UP run does not follow a lower-only
    letter (after ``ß`` a mark is in the word's [LO] part; a scan starting at the mark
    puts it in [UP]* and may run on through ``ǅǅaa``).
    P->P for P = not L, N, W, M (``\x20?P+[\r\n/]*``), except from a slash that follows
    line breaks (it is the match's suffix: ``=\n/`` ends before ``#``).
DeepSeek (stage 3 on segments between digit triples and CJK/kana runs):
    P->P for ASCII punctuation and symbols (``\x20?[\p{P}\p{S}]+[\r\n]*``; the
    ``[ASCII punct][A-Za-z]+`` alternative holds one of them).  (L|M)->(L|M) outside K
    when x is not an ASCII letter (``X?[L M]+``; the ASCII alternative cannot hold x).
    A->A for ASCII letters only where the letter run is seen to end at a character
    that is neither L nor M (or at the end of the text): then the ASCII alternative
    and ``X?[L M]+`` end at the same place.
NFC families additionally need both characters NFC-inert (then normalization leaves
them and their neighbourhood unchanged).  Whitespace runs are never glued (``\s*[\r\n]+``
looks to the end of the run, so an appended line break moves an earlier boundary), nor
digit runs (``\p{N}{1,3}`` counts from the run's start).
"""

from __future__ import annotations

import numpy as np

from .base import I, Family
from ..charclass import K, L, M, N, W

_APOS = 0x27
CASE_UP, CASE_LO = 1, 2  # `case_table` bits: o200k's [Lu Lt Lm Lo M] and [Ll Lm Lo M]


def _o200k_words(cls: np.ndarray, cps: np.ndarray, case: np.ndarray, before_up_only: int,
                 before_up: int) -> np.ndarray:
    """o200k's glued word pairs (bool[n-1]); see the module docstring."""
    n = len(cps)
    cps = cps.astype(np.int64)
    bits = case[cps]
    up = (bits & CASE_UP) != 0
    lo = (bits & CASE_LO) != 0
    up_only, lo_only, both = up & ~lo, lo & ~up, up & lo
    letter = (cls & L) != 0
    mark = (cls & M) != 0
    apos = cps == _APOS
    idx = np.arange(n)

    def last_before(mask: np.ndarray) -> np.ndarray:  # index of the last True at or before i, -1 if none
        return np.maximum.accumulate(np.where(mask, idx, -1))

    def apos_within3(at: np.ndarray) -> np.ndarray:  # an apostrophe 1-3 characters before `at`
        out = np.zeros(len(at), dtype=bool)
        for k in (1, 2, 3):
            j = at - k
            out |= (j < 0) | apos[np.maximum(j, 0)]
        return out

    # a mark continues a word only after a letter that ends no contraction suffix
    lnm = last_before(~mark)
    word_mark = mark & (lnm >= 0) & letter[np.maximum(lnm, 0)] & ~apos_within3(np.maximum(lnm, 0))
    word = letter | word_mark
    # upper-only pairs: the upper-only run must follow a character outside UP
    k = last_before(~up_only)
    first_up_only = np.where(k >= 0, cps[np.maximum(k, 0)], before_up_only)
    upper_clean = (first_up_only < 0) | ~((case[np.maximum(first_up_only, 0)] & CASE_UP) != 0)
    # UP-and-LO characters (Lo, Lm, marks): their UP run must follow a character that is not
    # lower-only, else the word is in its [LO] part from an earlier start
    k = last_before(~up)
    first_up = np.where(k >= 0, cps[np.maximum(k, 0)], before_up)
    fb = case[np.maximum(first_up, 0)]
    both_clean = (first_up < 0) | ~(((fb & CASE_LO) != 0) & ((fb & CASE_UP) == 0))
    x, y = slice(0, n - 1), slice(1, n)
    ok = word[x] & (up | lo)[y] & ~(lo[x] & up_only[y])
    ok &= ~(up_only[x] & up_only[y]) | upper_clean[x]
    ok &= ~both[x] | both_clean[x]
    guard = np.ones(n - 1, dtype=bool)
    guard &= ~np.concatenate(([True], apos[: n - 2])) & ~np.concatenate(([True, True], apos[: max(n - 3, 0)]))[: n - 1]
    return ok & guard


def case_table(tok) -> np.ndarray:
    """uint8 per code point: o200k's two word classes, probed from the reference engine (cached)."""
    from ..charclass import LO, UP, class_table
    from .o200k import LOWER_CLASS, UPPER_CLASS

    table = class_table(tok.engine, tok.engine.class_key, {UP: UPPER_CLASS, LO: LOWER_CLASS})
    return (((table & UP) != 0) * CASE_UP + ((table & LO) != 0) * CASE_LO).astype(np.uint8)


def whitespace_glue(cls: np.ndarray, cps: np.ndarray, lead_clean: bool) -> np.ndarray:
    r"""bool[n-1]: j -> the boundary between cps[j] and cps[j+1] lies inside a run of spaces/tabs.

    Every family scans whitespace with ``\s*[\r\n]+ | \s+(?!\S) | \s+`` (tiktoken's
    cl100k adds ``\s++$``).  Inside a run, pieces start at its entry, after its last line
    break, and at its last character before a non-space.  So the boundary before c is
    glued when text[c-1], text[c], text[c+1] are spaces or tabs (c is neither of the last
    two) and the run holds no line break (nor any other whitespace) from its start to c:
    then every scan holding text[c-1] started its match at the run's entry or inside it,
    and ends it where the run's remainder, the same text in every scan, says.  Without
    that last condition an appended ``\n`` would move an earlier piece start
    (``\n`` + spaces + ``\n`` is one piece, ``\n`` and spaces before it was appended).
    """
    n = len(cps)
    st = (cps == 0x20) | (cps == 0x09)
    is_w = (cls & W) != 0
    idx = np.arange(n)
    # start of the whitespace run holding each position (0: it reaches the stretch's start)
    non_w = np.where(~is_w, idx, -1)
    run_start = np.maximum.accumulate(non_w) + 1
    bad = np.where(is_w & ~st, idx, -1)
    last_bad = np.maximum.accumulate(bad)
    clean = last_bad < run_start
    if not lead_clean:
        clean &= run_start > 0
    out = np.zeros(max(n - 1, 0), dtype=bool)
    if n >= 3:
        # boundary j between j and j+1: chars j, j+1, j+2 spaces/tabs, clean through j+1
        out[:-1] = st[:-2] & st[1:-1] & st[2:] & clean[1:-1]
    return out


def _ascii_letters(cps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    upper = (cps >= 0x41) & (cps <= 0x5A)
    lower = (cps >= 0x61) & (cps <= 0x7A)
    return upper, lower


def _ascii_punct(cps: np.ndarray) -> np.ndarray:
    return (((cps >= 0x21) & (cps <= 0x2F)) | ((cps >= 0x3A) & (cps <= 0x40))
            | ((cps >= 0x5B) & (cps <= 0x60)) | ((cps >= 0x7B) & (cps <= 0x7E)))


def glue_mask(fam: Family, classes: np.ndarray, cps: np.ndarray, *, ends_text: bool,
              lead_clean: bool = False, tail_ok: bool = False, case: np.ndarray | None = None,
              before_up_only: int = -1, before_up: int = -1) -> np.ndarray:
    """bool[len(cps)]: True at i >= 1 when the boundary between cps[i-1] and cps[i] is glued.

    `cps` is a stretch of the text (a repair window); `ends_text` says whether it ends
    where the text ends (DeepSeek's ASCII letter runs need to see their end);
    `lead_clean` whether a whitespace run reaching the stretch's first character holds
    only spaces and tabs from its start (see `whitespace_glue`); `tail_ok` whether an ASCII
    letter run reaching the stretch's last character ends, in the text, at a character
    that is neither L nor M, or at the text's end (DeepSeek); `case` o200k's word classes
    (`case_table`; without it no word pairs glue there); `before_up_only` / `before_up` the
    code point of the last character before the stretch that is not upper-only / not in UP
    (-1: none, the text starts there), for o200k runs reaching the stretch's start.

    >>> from toktier import load_tokenizer
    >>> tok = load_tokenizer("llama3")
    >>> cps = np.frombuffer("ab==c'sx".encode("utf-32-le"), dtype="<u4")
    >>> glue_mask(tok.family_info, tok.classes, cps, ends_text=True).astype(int).tolist()
    [0, 0, 0, 1, 0, 0, 0, 0]
    """
    n = len(cps)
    out = np.zeros(n, dtype=bool)
    if n < 2:
        return out
    cls = classes[cps]
    name = fam.name
    if name in ("cl100k", "qwen"):
        is_l = (cls & L) != 0
        is_p = (cls & (L | N | W)) == 0
        apos = cps == _APOS
        # text[c-2], text[c-3] for the boundary c = j + 1 (unknown, before the stretch: as if ')
        back2 = np.concatenate(([True], apos[:-2]))
        back3 = np.concatenate(([True, True], apos[:-3]))
        glued = (is_l[:-1] & is_l[1:] & ~back2[: n - 1] & ~back3[: n - 1]) | (is_p[:-1] & is_p[1:])
    elif name == "o200k":
        is_p = (cls & (L | N | W | M)) == 0
        # ``[\r\n/]*`` ends a punctuation match: a slash after line breaks (``=\n/#``) ends it
        slash = cps == 0x2F
        idx = np.arange(n)
        k = np.maximum.accumulate(np.where(~slash, idx, -1))
        before = cps[np.maximum(k, 0)]
        suffix_slash = slash & ((k < 0) | (before == 0x0A) | (before == 0x0D))
        glued = is_p[:-1] & is_p[1:] & ~suffix_slash[:-1]
        if case is not None:
            glued |= _o200k_words(cls, cps, case, before_up_only, before_up)
    elif name == "deepseek":
        upper, lower = _ascii_letters(cps)
        ascii_letter = upper | lower
        punct = _ascii_punct(cps)
        lm = ((cls & (L | M)) != 0) & ((cls & K) == 0)
        glued = (punct[:-1] & punct[1:]) | (lm[:-1] & lm[1:] & ~ascii_letter[:-1])
        # A->A: only inside an ASCII letter run whose end is seen, at a non-(L|M) character.
        aa = ascii_letter[:-1] & ascii_letter[1:]
        if aa.any():
            idx = np.arange(n)
            stop = ~ascii_letter  # the first non-ASCII-letter at or after each position
            nxt = np.where(stop, idx, n)
            nxt = np.minimum.accumulate(nxt[::-1])[::-1]
            end_char_ok = np.zeros(n + 1, dtype=bool)
            end_char_ok[:n] = ~((cls & (L | M)) != 0)
            end_char_ok[n] = ends_text or tail_ok
            glued |= aa & end_char_ok[nxt[1:]]
    else:
        return out
    glued |= whitespace_glue(cls, cps, lead_clean)
    if fam.nfc:
        inert = (cls & I) != 0
        glued &= inert[:-1] & inert[1:]
    out[1:] = glued
    return out


def digit_piece_tokens(fam: Family, token_bytes: list[bytes]) -> np.ndarray | None:
    r"""bool per id: the token is a whole digit piece (three ASCII digits; Qwen: one).

    In families that cut digit runs into triples (cl100k / Llama-3, o200k, DeepSeek's
    first stage, ``\p{N}{1,3}``) a token of three digits is a piece of its own, so its edges
    are piece boundaries in every scan that produced it: a session may cut there
    (``session.py``) although N->N pairs are not stable (the triples count from the run's
    start).  Qwen's ``\p{N}`` makes every digit a piece.  None for other families.
    """
    width = {"cl100k": 3, "o200k": 3, "deepseek": 3, "qwen": 1}.get(fam.name)
    if width is None:
        return None
    return np.array([len(b) == width and b.isdigit() for b in token_bytes], dtype=bool)
