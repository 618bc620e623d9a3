"""Edit scripts between two renders of a conversation: a few small edits instead of one wide one.

This module owns turning an old and a new text into a short list of edits.  `Session.sync` makes
one edit from the first to the last changed character; when a template rewrites several places
(Qwen3 drops the `<think>` block of *every* assistant turn since the previous user query once a
new query arrives, and the new turn is appended at the end), that one edit spans everything in
between, and the repair re-tokenizes all of it.  `edit_script` finds the unchanged stretches
between the changes instead: at each difference it looks for the next `ANCHOR` characters of one
side in the other (a deletion or an insertion), skips the text both sides share, and repeats.

Whatever it finds, the script is exact: every skipped stretch is compared, so applying the edits to
the old text gives the new text.  It only decides how the change is cut; when it finds no cut
smaller than the single edit (a replacement, too many changes) it returns that single edit.

>>> old, new = "sys A <think>x</think> B <think>y</think> C end", "sys A  B  C more end"
>>> edit_script(old, new, anchor=2)
[(6, 22, ''), (25, 41, ''), (43, 43, ' more')]
>>> apply(old, edit_script(old, new, anchor=2)) == new
True
"""

from __future__ import annotations

from .native import _core as _native  # None in a tree nobody built

Edit = tuple[int, int, str]  # replace old[start:end] by the text (old-text character offsets)

ANCHOR = 32  # characters that must match to resynchronise: short anchors find spurious matches
MAX_EDITS = 64  # beyond this many changes one wide edit is as good


def edit_script(old: str, new: str, *, anchor: int = ANCHOR, max_edits: int = MAX_EDITS) -> list[Edit]:
    """Edits, ascending and non-overlapping in `old` coordinates, that turn `old` into `new`
    ([] when equal).  Apply them from the last to the first so that offsets stay valid."""
    p = match_forward(old, 0, new, 0, min(len(old), len(new)))
    if p == len(old) == len(new):
        return []
    s = _match_backward(old, len(old), new, len(new), min(len(old), len(new)) - p)
    oe, ne = len(old) - s, len(new) - s
    single = [(p, oe, new[p:ne])]
    edits: list[Edit] = []
    i, j = p, p
    while i < oe or j < ne:
        if i >= oe or j >= ne or len(edits) >= max_edits:
            edits.append((i, oe, new[j:ne]))
            break
        # At a difference: old lost a stretch (the next new text reappears later in old), or new
        # gained one (the next old text reappears later in new); take the shorter.
        deleted = old.find(new[j:j + anchor], i + 1, oe) if ne - j >= anchor else -1
        inserted = new.find(old[i:i + anchor], j + 1, ne) if oe - i >= anchor else -1
        if deleted < 0 and inserted < 0:
            edits.append((i, oe, new[j:ne]))
            break
        if inserted < 0 or (deleted >= 0 and deleted - i <= inserted - j):
            edits.append((i, deleted, ""))
            i = deleted
        else:
            edits.append((i, i, new[j:inserted]))
            j = inserted
        m = match_forward(old, i, new, j, min(oe - i, ne - j))
        i, j = i + m, j + m
    edits = _merge(edits)
    cost = sum(e - s_ + len(t) for s_, e, t in edits)
    return edits if cost < (oe - p) + (ne - p) else single


def apply(old: str, edits: list[Edit]) -> str:
    """`old` with `edits` applied (the reference the tests check scripts against)."""
    out, at = [], 0
    for start, end, text in edits:
        out += (old[at:start], text)
        at = end
    out.append(old[at:])
    return "".join(out)


def _merge(edits: list[Edit]) -> list[Edit]:
    out: list[Edit] = []
    for start, end, text in edits:
        if out and out[-1][1] == start:
            s0, _e0, t0 = out[-1]
            out[-1] = (s0, end, t0 + text)
        else:
            out.append((start, end, text))
    return out


def match_forward(a: str, i: int, b: str, j: int, limit: int) -> int:
    """Length of the common run a[i:] / b[j:] (at most `limit`; 0 <= i <= len(a), 0 <= j <= len(b)):
    compared in place by the native module (`common_prefix`), else slices compared in doubling
    chunks (C comparisons), then a binary search inside the first chunk that differs."""
    if _native is not None:
        return _native.common_prefix(a, i, b, j, limit)
    return _match_forward_slices(a, i, b, j, max(0, min(limit, len(a) - i, len(b) - j)))


def _match_forward_slices(a: str, i: int, b: str, j: int, limit: int) -> int:
    k, chunk = 0, 256
    while k < limit:
        c = min(chunk, limit - k)
        if a[i + k:i + k + c] == b[j + k:j + k + c]:
            k, chunk = k + c, chunk * 2
            continue
        lo, hi = 0, c  # a[..lo] equal, a[..hi] not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if a[i + k:i + k + mid] == b[j + k:j + k + mid]:
                lo = mid
            else:
                hi = mid
        return k + lo
    return limit


def _match_backward(a: str, ai: int, b: str, bj: int, limit: int) -> int:
    """Length of the common run ending at a[:ai] / b[:bj] (at most `limit`)."""
    k, chunk = 0, 256
    while k < limit:
        c = min(chunk, limit - k)
        if a[ai - k - c:ai - k] == b[bj - k - c:bj - k]:
            k, chunk = k + c, chunk * 2
            continue
        lo, hi = 0, c
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if a[ai - k - mid:ai - k] == b[bj - k - mid:bj - k]:
                lo = mid
            else:
                hi = mid
        return k + lo
    return limit
