"""One repair attempt's window: which of its candidate positions may be spliced at.

`WindowContext` holds a window's text (new-text byte positions, code points, literal
filters, NFC spans) and answers, for candidate token starts, whether each is a stable
boundary (``families/``), a glued cut inside a long piece or a whole-digit-piece edge
(``families/glue.py``).  The look-backs that glue rules need beyond the window (a run's
start, a whitespace run's line breaks, an ASCII letter run's end) read the session's text;
o200k's look-backs are remembered per session (`Session._lookback`), so appends to a run
that spans the whole text cost O(append).  The per-tokenizer tables the cuts read
(`digit_table_of`, `case_table_of`) are built once and kept on the tokenizer.
"""

from __future__ import annotations

import numpy as np

from .boundaries import LiteralFilter, char_byte_offsets
from .families import L, M, W
from .families.glue import CASE_LO, CASE_UP, case_table, digit_piece_tokens, glue_mask
from .nfc_spans import SpanMap
from .registry import FrozenTokenizer


def digit_table_of(tok: FrozenTokenizer) -> np.ndarray | None:
    """Whole-digit-piece tokens of `tok` (``families/glue.py``), built once per tokenizer."""
    table = tok.derived.get("digit_piece_tokens", False)
    if table is False:
        table = tok.derived.setdefault("digit_piece_tokens", digit_piece_tokens(tok.family_info, tok.token_bytes))
    return table


def case_table_of(tok: FrozenTokenizer) -> np.ndarray:
    """o200k's word classes for `tok`, probed once per tokenizer (~0.2 s, then cached on disk)."""
    table = tok.derived.get("o200k_case")
    if table is None:
        table = case_table(tok)
        up = (table & CASE_UP) != 0
        tok.derived.setdefault("o200k_up_masks", (up, up & ((table & CASE_LO) == 0)))
        table = tok.derived.setdefault("o200k_case", table)
    return table


def ascii_kind(b: int) -> bytes | None:
    """The bytes of `b`'s run kind: ASCII letters, digits, ASCII whitespace, else `b` itself;
    None for a non-ASCII byte."""
    if b >= 0x80:
        return None
    if 0x41 <= b <= 0x5A or 0x61 <= b <= 0x7A:
        return bytes(range(0x41, 0x5B)) + bytes(range(0x61, 0x7B))
    if 0x30 <= b <= 0x39:
        return bytes(range(0x30, 0x3A))
    if b in b" \t\r\n\x0b\x0c":  # a whitespace run's pieces depend on its line breaks: one kind
        return b" \t\r\n\x0b\x0c"
    return bytes([b])


def run_edge(text: bytearray, i: int, step: int) -> int:
    """From byte i, the end (step 1: first byte after) or start (step -1: first byte of) of the
    run of i's ASCII kind (`ascii_kind`); i itself when it is not ASCII."""
    kind = ascii_kind(text[i])
    if kind is None:
        return i if step < 0 else i
    member = np.zeros(256, dtype=bool)
    member[np.frombuffer(kind, dtype=np.uint8)] = True
    n, chunk = len(text), 4096
    if step > 0:
        j = i
        while j < n:
            seg = np.frombuffer(bytes(text[j : j + chunk]), dtype=np.uint8)
            out = np.flatnonzero(~member[seg])
            if len(out):
                return j + int(out[0])
            j, chunk = j + len(seg), chunk * 4
        return n
    j = i + 1
    while j > 0:
        lo = max(0, j - chunk)
        seg = np.frombuffer(bytes(text[lo:j]), dtype=np.uint8)
        out = np.flatnonzero(~member[seg])
        if len(out):
            return lo + int(out[-1]) + 1
        j, chunk = lo, chunk * 4
    return 0


def char_at(text: bytearray, i: int) -> int:
    """Code point of the UTF-8 character starting at byte `i`."""
    lead = text[i]
    n = 1 if lead < 0x80 else 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
    return ord(bytes(text[i : i + n]).decode("utf-8"))


class WindowContext:
    """One repair attempt's local text: candidate-boundary checks in old and new text."""

    def __init__(self, tok: FrozenTokenizer, T: bytearray, s: int, e: int, data: bytes, p: int, r: int,
                 wtext: str, window: bytes, wmap: SpanMap, fnorm: np.ndarray,
                 lookback: dict[str, tuple[int, int]]) -> None:
        self.tok, self.s, self.e, self.data, self.p, self.r = tok, s, e, data, p, r
        # NFC families: the window's normalizer-changed spans (window-local) and the fresh
        # tokens' starts in normalized window-local coordinates.
        self.wmap, self.fnorm = wmap, fnorm
        self.window, self.ends_text, self.T, self.lookback = window, r == len(T), T, lookback
        self._glue_sums: np.ndarray | None = None
        self.cps, offs = char_byte_offsets(wtext)
        offs += p
        self.char_starts = offs[:-1]  # new-text byte position of each window char
        lit = tok.literals
        if lit:
            # Literal occurrences spanning a candidate lie within `reach` bytes of the window.
            reach = lit.max_len
            lo = max(0, p - reach)
            hi_old = min(len(T), r + reach)
            self.lits_new = LiteralFilter(lit, bytes(T[lo:s]) + data + bytes(T[e:hi_old]), lo)
            self.lits_old = LiteralFilter(lit, bytes(T[lo:hi_old]), lo)
        self.delta = len(data) - (e - s)

    def glued_positions(self, cand: np.ndarray, left: bool) -> np.ndarray:
        """The candidates (sorted new-text byte positions) where a long piece may be cut at a token
        boundary (``families/glue.py``): glued, with a glued stretch longer than the longest token
        on the cut's side inside the window and free of added-token literals.

        Left of the change the stretch ends at the cut; right of it, it starts at the cut, which
        lies three characters past the change (the glue rules read text[c-3:c+1] unchanged).
        """
        if not len(cand):
            return cand
        tok = self.tok
        n = len(self.cps)
        if self._glue_sums is None:
            g = glue_mask(tok.family_info, tok.classes, self.cps, ends_text=self.ends_text,
                          lead_clean=self._lead_whitespace_clean(),
                          tail_ok=tok.family_info.name == "deepseek" and self._ascii_run_tail_ok(),
                          **self._o200k_context())
            self._glue_sums = np.concatenate(([0], np.cumsum(~g)))  # non-glued boundaries before j
        sums = self._glue_sums
        span = tok.max_token_bytes + 1  # bytes the glued stretch must cover on the cut's side
        ci = np.searchsorted(self.char_starts, cand)
        ok = (ci > 0) & (ci < n)
        ci_c = np.clip(ci, 1, n - 1)
        ok &= self.char_starts[ci_c] == cand
        if left:
            # boundaries lo..ci all glued, chars lo-1..ci covering `span` bytes before the cut;
            # c + 1 still old text (the whitespace rule reads it)
            ok &= ci_c + 1 < int(np.searchsorted(self.char_starts, self.s))
            lo = np.searchsorted(self.char_starts, cand - span, "right")  # char lo-1 starts <= cand - span
            hi = ci_c + 1
        else:
            first = int(np.searchsorted(self.char_starts, self.s + len(self.data)))
            ok &= ci_c >= first + 3
            lo = ci_c
            hi = np.searchsorted(self.char_starts, cand + span, "left") + 1  # boundaries ci..hi-1
        ok &= (lo >= 1) & (hi <= n)
        lo_c, hi_c = np.clip(lo, 0, n), np.clip(hi, 0, n)
        ok &= sums[hi_c] - sums[lo_c] == 0
        if self.tok.literals and ok.any():
            lit = self.tok.literals
            stretches = np.flatnonzero(ok) if lit.occurs(self.window) else ()  # usually none: one search
            for i in stretches:
                a = int(self.char_starts[max(lo_c[i] - 1, 0)]) - self.p
                b = int(self.char_starts[hi_c[i]]) - self.p if hi_c[i] < n else len(self.window)
                if lit.occurs(self.window[a:b]):
                    ok[i] = False
            ok &= self.lits_new.keep(cand)
            ok &= self.lits_old.keep(np.where(cand < self.s, cand, cand - self.delta))
        return cand[ok]

    def _lead_whitespace_clean(self) -> bool:
        """Whether the text before the window ends in spaces/tabs back to a non-space or the start.

        Remembered per session like the o200k look-backs: appends to a long space run scan only
        the bytes added since the last op."""
        T, p = self.T, self.p
        floor, known = 0, True
        hit = self.lookback.get("spaces")
        if hit is not None and hit[0] <= p:
            floor, known = hit[0], bool(hit[1])
        result, i, chunk = known, p, 256
        while i > floor:
            lo = max(floor, i - chunk)
            seg = np.frombuffer(bytes(T[lo:i]), dtype=np.uint8)
            other = np.flatnonzero((seg != 0x20) & (seg != 0x09))
            if len(other):
                j = lo + int(other[-1])
                while j > 0 and (T[j] & 0xC0) == 0x80:
                    j -= 1
                result = not (self.tok.classes[char_at(T, j)] & W)
                break
            i, chunk = lo, chunk * 4
        self.lookback["spaces"] = (p, int(result))
        return result

    def _o200k_context(self) -> dict:
        """o200k: its word classes, and the last characters before the window outside its
        upper-only and UP sets (the word rules look back to where a run of them starts)."""
        tok = self.tok
        if tok.family_info.name != "o200k":
            return {}
        case = case_table_of(tok)
        up, up_only = tok.derived["o200k_up_masks"]
        return {"case": case, "before_up_only": self._last_before_window(up_only, "o200k-up-only"),
                "before_up": self._last_before_window(up, "o200k-up")}

    def _last_before_window(self, inside: np.ndarray, key: str) -> int:
        """Code point of the last character before the window start p that `inside` excludes, or -1.

        A run can be the whole text (a DNA string): the session remembers how far back it has
        looked, so a later op scans only the text added since (appends cost O(append))."""
        T, p = self.T, self.p
        floor, known = 0, -1
        hit = self.lookback.get(key)
        if hit is not None and hit[0] <= p:
            floor, known = hit
        i, chunk, found = p, 1024, None
        while i > floor:
            lo = max(floor, i - chunk)
            while lo > floor and (T[lo] & 0xC0) == 0x80:
                lo -= 1
            seg = bytes(T[lo:i])
            if seg.isascii():
                cps = np.frombuffer(seg, dtype=np.uint8)
            else:
                cps = np.frombuffer(seg.decode("utf-8").encode("utf-32-le"), dtype="<u4")
            out = np.flatnonzero(~inside[cps])
            if len(out):
                found = int(cps[out[-1]])
                break
            i, chunk = lo, chunk * 4
        result = known if found is None else found
        self.lookback[key] = (p, result)
        return result

    def _ascii_run_tail_ok(self) -> bool:
        """Whether the ASCII letters at the old text's position r (the window's end) run on to a
        character that is neither L nor M, or to the end of the text."""
        T, r = self.T, self.r
        chunk = 256
        while r < len(T):
            seg = np.frombuffer(bytes(T[r : r + chunk]), dtype=np.uint8)
            other = np.flatnonzero(~(((seg >= 0x41) & (seg <= 0x5A)) | ((seg >= 0x61) & (seg <= 0x7A))))
            if len(other):
                return not (self.tok.classes[char_at(T, r + int(other[0]))] & (L | M))
            r += chunk
            chunk *= 4
        return True

    def digit_cuts(self, cand: np.ndarray, pieces: np.ndarray) -> np.ndarray:
        """The candidates whose `pieces` token (the token ending or starting there, agreeing in
        old and new text) is a whole digit-triple piece: a piece boundary in every scan."""
        table = digit_table_of(self.tok)
        if table is None or not len(cand):
            return cand[:0]
        ok = table[pieces]
        if self.tok.literals and ok.any():
            ok &= self.lits_new.keep(cand)
            ok &= self.lits_old.keep(np.where(cand < self.s, cand, cand - self.delta))
        return cand[ok]

    def stable_positions(self, cand: np.ndarray, old_too: bool, delta: int = 0) -> np.ndarray:
        """The candidates (new-text byte positions, sorted) that are certified boundaries."""
        if not len(cand):
            return cand
        ci = np.searchsorted(self.char_starts, cand)
        ok = (ci > 0) & (ci < len(self.char_starts))
        ci_c = np.clip(ci, 1, len(self.char_starts) - 1)
        ok &= self.char_starts[ci_c] == cand
        fam = self.tok.family_info
        ok &= fam.stable(self.tok.classes, self.cps[ci_c - 1], self.cps[ci_c])
        if self.tok.literals:
            ok &= self.lits_new.keep(cand)
            # Old-text position: left of the edit it is unchanged, right of it shifted back.
            ok &= self.lits_old.keep(np.where(cand < self.s, cand, cand - self.delta))
        return cand[ok]
