"""Incremental rendering: the text a chat template adds for messages appended at the end of a
conversation, rendered from a short window of it instead of all of it.

This module owns the window scheme, its run-time checks, and the per-template locality probe
that decides which appended messages may use it (the design notes of `toktier.chat`, built).
`toktier.conversation` calls it; whenever it answers None the caller renders everything and
diffs, which is always exact.

The window scheme
-----------------
Stored: the text S of render(old, gp) (or the part of it after a pinned run's marker, see
`cut`) and L, the length of S without the generation prompt (None: unknown, derived here).
The window of `old` is ``head + old[c:]``: c leaves WINDOW to WINDOW + STEP - 1 old messages and moves in
steps of STEP (STATE_STEP with the state head below; so one op's render is the next op's window
render: `Memo`); head = [old[0]], the
last user message before c and, when that one wraps a tool response, the query before it
(templates key on the first message: system prompt, BOS; and on the last query: Qwen3's think
blocks).  A conversation too short for that is its own window (then every render below is the
exact render).  Let H = render(head), A = render(window), B = render(window + new, gp),
C = render(window + new), with `new` all the messages one op appends (rendered after the window
at once: the same text as appending them one at a time, each through the first one's window
grown by the messages before it, with fewer renders; see `append`).

Head schemes.  Scheme 0 is the head above.  Scheme 1, the *state head*, adds the latest message
of every role before c (DeepSeek V3 carries state across the whole conversation: only the first
tool output ever opens the outputs block, so a window needs an earlier tool output in its head);
its head may end with text the template emits only at the end of a conversation (DeepSeek
closing the outputs block), so the anchor is where A and H part rather than len(H).  The probe
decides per kind and scheme; a conversation uses the scheme that served last first.

Checks, all at run time (any failure: None):

1. A starts with H, and the window's own text A[len(H):] equals S right before L (the boundary
   messages rendered both ways agree; when they do not, the window is moved one message back,
   WIDER - 1 times at most: a window must not start inside a group the template renders as one,
   such as Qwen3's consecutive tool turns).  When the window holds a pinned run's marker, the
   renders are compared from right after the marker instead (what precedes it belongs to
   earlier segments: Qwen3 renders an empty think block before a *last* assistant turn only):
   A's text after the marker must be all of S, and H is not rendered (this is tried first).
2. B and C start with H (the head renders alike); with the generation prompt, B's text after
   the anchor starts with C's.

Appending m may change the window's own earlier text (Qwen3 closes a group of tool turns only
after the last one): with q the length B and A share after the anchor, the new text is
S[:L - len(A) + len(H) + q] + B[len(H) + q:], an edit of the stored text from the first
difference, and the new L is L - len(A) + len(C).

Checks 1-2 do not prove that text outside the window is unaffected (Qwen3 drops every earlier
think block when a new user query arrives; DeepSeek V3 opens only the conversation's first tool
output with a begin tag; a template may quote an early message).  The locality probe decides that,
per template, render arguments, generation-prompt setting and message *kind* (role, reasoning,
tool calls), on first use of each kind: representatives of the kind are appended at every split
of probe conversations (tool turns, think blocks in both spellings, late system messages, empty
contents, user turns wrapping tool responses, new queries after long tool chains), windowed and
full, second in a two-message append, and again right after a marker; the kind is local when a
windowed result (a window smaller than the
history: a whole-history window is exact by construction and proves nothing) passed the checks
at least once and was exact every time one did.  It is a check over those probes, not a
proof: a template whose far-context dependence none of them exercises would be misjudged, which
is why `Conversation(incremental=False)` exists.  Verdicts are kept in a small LRU keyed by the
template source, its special tokens, the render arguments and the setting.

Texts are `Rope`s (persistent piece chains): an append near the end of a 2M-character text
copies only the few pieces it reads, never the whole text.

>>> from toktier.chat import ChatTemplate
>>> t = ChatTemplate("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
...                  "{% if add_generation_prompt %}<assistant>{% endif %}")
>>> r = lambda ms, gp: t.render(ms, add_generation_prompt=gp)
>>> old, new = [{"role": "user", "content": str(i)} for i in range(9)], [{"role": "tool", "content": "x"}]
>>> s = r(old, True)
>>> got = append(r, old, new, s, None, True, True)
>>> s[:got.start] + got.text == r(old + new, True), got.end == len(r(old + new, False))
(True, True)
>>> v = locality(t, {}, True)
>>> v.allows(new), ("tool", False, False) in v.local
(True, True)
"""

from __future__ import annotations

import bisect
import collections
import hashlib
import json
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .renderer import REASONING_FIELDS, Renderer
from .errors import ChatTemplateError, InvalidChatInput
from .text_diff import match_forward

#: Old messages rendered with the new ones (besides the head): at least WINDOW, fewer than
#: WINDOW + STEP.  Deepseek renders a tool output differently after another tool output, so at
#: least one; two keeps the boundary check strong.
WINDOW = 2
STEP = 2
#: STEP for the state head (scheme 1): each move of c changes that head too, so a move costs two
#: renders (the window's and the head's), not one.  Measured on DeepSeek V3's template
#: (`bench.conversation_cpu`): 4 gave 1.04-1.07x CPU per turn over 2, while a wider step on
#: scheme 0 lost on Qwen3, whose renders cost ~5 us a message.
STATE_STEP = 4
WIDER = 3  # windows tried per step: the usual one, then one and two messages wider

Render = Callable[[list[dict], bool], str]  # (messages, add_generation_prompt) -> text
Kind = tuple[str, bool, bool]  # (role, has reasoning, has tool calls)


@dataclass(frozen=True)
class Appended:
    """A windowed append: the stored text from `start` on becomes `text`."""

    start: int  # L: the stored text before it is kept
    text: str  # replaces stored[start:]
    end: int  # the new L (the new text's length without the generation prompt)
    windowed: bool = True  # a step rendered less than the whole history (else every render was exact)


def kind(message: Mapping[str, Any]) -> Kind:
    """What the probe tells apart: the role, reasoning (a field, or a think block in the content)
    and tool calls."""
    content = message.get("content")
    reasoning = any(message.get(k) for k in REASONING_FIELDS) or (isinstance(content, str) and "</think>" in content)
    return str(message.get("role")), bool(reasoning), bool(message.get("tool_calls"))


def window(old: Sequence[dict], wider: int = 0, roles: Mapping[str, Sequence[int]] | None = None,
           scheme: int = 0) -> tuple[list[dict], list[dict]]:
    """(head, window) of `old` (see the module docstring); head is [] when the window is all of it.

    The window's start c moves in steps of STEP, so consecutive appends share it and a render
    of one op (the window plus its new message) is the next op's window render (`Memo`);
    `wider` moves it that many messages back (a window must not start inside a group the
    template renders as one, such as Qwen3's consecutive tool turns).  `roles`: role -> the
    ascending indices of old's messages with it, when the caller keeps them (else old is scanned
    back, possibly to its start).

    `scheme` 1 (the *state head*) adds to the head the latest message of every role before c,
    in order: for templates that carry state across the conversation in a way one message of a
    role settles (DeepSeek V3 opens only the conversation's first tool output with a begin tag:
    with an earlier tool output in the head, the window renders later ones as the full render
    does).  The probe decides per kind and scheme whether that is enough (`Locality`)."""
    n = len(old)
    step = STATE_STEP if scheme == 1 else STEP
    c = n - WINDOW - (n - WINDOW) % step - wider
    if c <= 1:
        return [], list(old)
    head = [old[0]]
    picked = [0]
    last_user = None
    if roles is None:
        candidates: Iterable[int] = (u for u in range(c - 1, 0, -1) if old[u].get("role") == "user")
    else:
        users = roles.get("user", ())
        k = bisect.bisect_left(users, c)
        candidates = (users[i] for i in range(k - 1, -1, -1) if users[i] > 0)
    for u in candidates:
        if last_user is None:
            last_user = u
        if not _wraps_tool_response(old[u].get("content")):
            if u != last_user:
                head.append(old[u])
                picked.append(u)
            break
    if last_user is not None:
        head.append(old[last_user])
        picked.append(last_user)
    if scheme == 1:
        extra = set(_latest_per_role(old, c, roles).values()) - set(picked)
        if extra:
            order = sorted({*picked, *extra})
            head = [old[i] for i in order]
    return head, [*head, *old[c:]]


def _latest_per_role(old: Sequence[dict], c: int, roles: Mapping[str, Sequence[int]] | None) -> dict[str, int]:
    """role -> the index of its latest message in old[1:c] (old[0] is always in the head)."""
    if roles is not None:
        out = {}
        for role, where in roles.items():
            k = bisect.bisect_left(where, c)
            if k and where[k - 1] > 0:
                out[role] = where[k - 1]
        return out
    out = {}
    for i in range(c - 1, 0, -1):
        out.setdefault(str(old[i].get("role")), i)
    return out


class Memo:
    """The last few renders used, keyed by the identity of the messages (stored messages are never
    changed) and the generation-prompt flag.  One per conversation; not thread-safe.

    `both(messages)`: the renders with and without the generation prompt from one render, or
    None (`chat.BoundTemplate.both`); a render with the prompt then keeps the one without it
    too, which an append asks for next."""

    def __init__(self, size: int = 12, both: Callable[[list[dict]], tuple[str, str] | None] | None = None) -> None:
        self.size = size
        self._both = both
        self._entries: dict[tuple[tuple[int, ...], bool], tuple[list[dict], str]] = {}

    def render(self, render: Render, messages: list[dict], gp: bool) -> str:
        ids = tuple(map(id, messages))
        key = (ids, gp)
        hit = self._entries.get(key)
        if hit is not None and all(a is b for a, b in zip(hit[0], messages)):
            # least recently used first out: a head rendered every op (the system prompt) stays
            self._entries[key] = self._entries.pop(key)
            return hit[1]
        pair = self._both(messages) if gp and self._both is not None else None
        if pair is None:
            text = render(messages, gp)
        else:
            text = pair[0]
            self._keep((ids, False), messages, pair[1])
        self._keep((ids, gp), messages, text)
        return text

    def copy(self, both: Callable[[list[dict]], tuple[str, str] | None] | None = None) -> Memo:
        """A memo holding the same renders (a fork's: its messages are the same objects), rendering
        with `both` from now on; the two never share an entry table (each is one conversation's)."""
        new = Memo(self.size, both)
        new._entries = dict(self._entries)
        return new

    def _keep(self, key: tuple[tuple[int, ...], bool], messages: list[dict], text: str) -> None:
        if key not in self._entries and len(self._entries) >= self.size:
            del self._entries[next(iter(self._entries))]
        self._entries[key] = (messages, text)


def _wraps_tool_response(content: Any) -> bool:
    # The ChatML / Hermes convention of a user turn carrying tool output: such a turn is not the
    # query templates look back for (Qwen3's last_query_index), so the window keeps the query too.
    return isinstance(content, str) and content.startswith("<tool_response>") and content.endswith("</tool_response>")


#: A compact non-ASCII str's size past its characters (and their terminator), as this CPython has it.
_NONASCII_HEADER = sys.getsizeof("\xe9") - 2


def _str_width(s: str) -> int:
    """Bytes per character of `s` as CPython stores it (the widest character decides), in O(1)
    from the object's size (a 100K-character str's ``max`` costs a third of a millisecond); a
    size that does not fit the compact layout falls back to reading the characters."""
    if s.isascii():
        return 1
    room, per = sys.getsizeof(s) - _NONASCII_HEADER, len(s) + 1
    if room % per == 0 and room // per in (1, 2, 4):
        return room // per
    top = ord(max(s))
    return 1 if top < 0x100 else 2 if top < 0x10000 else 4


class Rope:
    """An immutable text kept as a chain of pieces, so that replacing its end does not copy it.

    A conversation's text grows by a few thousand characters per op and is edited near its end;
    building each new text as one `str` would copy all of it on every op (a 2M-character text
    costs milliseconds to copy and page in).  A `Rope` is persistent: `replace_from` returns a new
    rope that shares every piece before the edit; reads near the end (`slice`, `endswith`) walk
    only the last pieces.  `str(rope)` joins once (the result is kept).

    >>> r = Rope.of("hello world").replace_from(6, "there").replace_from(11, "!")
    >>> str(r), len(r), r.slice(4, 8), r.endswith("re!")
    ('hello there!', 12, 'o th', True)
    """

    __slots__ = ("_prev", "_base", "_lo", "_hi", "_len", "_joined", "_width", "_base_width")

    def __init__(self, prev: Rope | None, base: str, lo: int, hi: int, base_width: int = 0) -> None:
        self._prev, self._base, self._lo, self._hi = prev, base, lo, hi
        self._len = (prev._len if prev is not None else 0) + hi - lo
        self._joined: str | None = base if prev is None and lo == 0 and hi == len(base) else None
        # Bytes per character of `base` as a str holds it (1, 2 or 4), and the most of any piece:
        # the joined text's size without joining it (`nbytes`).  Found once per new piece.
        self._base_width = base_width or _str_width(base)
        self._width = max(self._base_width, prev._width if prev is not None else 1)

    @classmethod
    def of(cls, text: str | Rope) -> Rope:
        return text if isinstance(text, Rope) else cls(None, text, 0, len(text))

    def __len__(self) -> int:
        return self._len

    @property
    def nbytes(self) -> int:
        """About what the joined text holds as a str (its characters at the widest piece's width),
        in O(1): what a server charges its memory budget for the text."""
        return self._len * self._width

    def __str__(self) -> str:
        if self._joined is None:
            pieces, node = [], self
            while node is not None and node._joined is None:
                pieces.append(node._base[node._lo:node._hi])
                node = node._prev
            if node is not None:
                pieces.append(node._joined)
            joined = "".join(reversed(pieces))
            # One piece from now on: the text is kept once (ropes derived from this one share it,
            # and the older pieces go when nothing else holds them).
            self._prev, self._base, self._lo, self._hi, self._joined = None, joined, 0, len(joined), joined
            self._base_width = self._width
        return self._joined

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (Rope, str)):
            return len(self) == len(other) and str(self) == str(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def slice(self, a: int, b: int) -> str:
        """self[a:b] for 0 <= a <= b <= len (cost: the pieces from `a` to the end)."""
        if self._joined is not None:
            return self._joined[a:b]
        pieces, node, end = [], self, self._len
        while node is not None and end > a:
            start = end - (node._hi - node._lo)
            if node._joined is not None:
                pieces.append(node._joined[max(a, 0):min(b, end)])
                break
            if start < b:
                lo, hi = node._lo + max(a - start, 0), node._lo + min(b, end) - start
                pieces.append(node._base[lo:hi])
            node, end = node._prev, start
        return "".join(reversed(pieces))

    def equals(self, a: int, text: str, i: int, n: int) -> bool:
        """Whether self[a:a + n] == text[i:i + n] (both in range), compared piece by piece in place
        (`text_diff.match_forward`), without joining or slicing either."""
        if a < 0 or i < 0 or a + n > self._len or i + n > len(text):
            return False
        if self._joined is not None:
            return match_forward(self._joined, a, text, i, n) == n
        node, end = self, self._len
        while node is not None and end > a:  # pieces from the end back to a
            start = end - (node._hi - node._lo)
            if node._joined is not None:  # (a joined node is the whole text before `end`)
                lo, hi = a, min(a + n, end)
                return hi <= lo or match_forward(node._joined, lo, text, i, hi - lo) == hi - lo
            lo, hi = max(a, start), min(a + n, end)
            if lo < hi and match_forward(node._base, node._lo + lo - start, text, i + lo - a, hi - lo) != hi - lo:
                return False
            node, end = node._prev, start
        return True

    def endswith(self, suffix: str) -> bool:
        n = len(self)
        return len(suffix) <= n and self.slice(n - len(suffix), n) == suffix

    def concat(self, other: Rope | str) -> Rope:
        """self + other, sharing both ropes' pieces (cost: the pieces of `other`, not its length;
        a conversation's first run after a long prompt appends the whole prompt to its prefix)."""
        if isinstance(other, str):
            return self.replace_from(len(self), other)
        if not len(self):
            return other
        pieces, node = [], other
        while node is not None:
            if node._joined is not None:
                pieces.append((node._joined, 0, len(node._joined), node._base_width))
                break
            pieces.append((node._base, node._lo, node._hi, node._base_width))
            node = node._prev
        out = self
        for base, lo, hi, width in reversed(pieces):
            if hi > lo:
                out = Rope(out, base, lo, hi, width)
        return out

    def replace_from(self, start: int, text: str) -> Rope:
        """self[:start] + text, sharing the pieces before `start`."""
        node, end = self, self._len
        while node is not None and end - (node._hi - node._lo) >= start and end > 0:
            end -= node._hi - node._lo  # this whole piece lies at or after `start`
            node = node._prev
        if node is not None and end > start:  # `start` falls inside this piece: keep its head
            node = Rope(node._prev, node._base, node._lo, node._hi - (end - start), node._base_width)
        if not text:
            return node if node is not None else Rope(None, "", 0, 0)
        return Rope(node, text, 0, len(text))


def append(render: Render, old: Sequence[dict], new: Sequence[dict], stored: str | Rope, L: int | None,
           stored_gp: bool, gp: bool, cut: Callable[[str], int | None] | None = None,
           memo: Memo | None = None, roles: Mapping[str, Sequence[int]] | None = None,
           scheme: int = 0) -> Appended | None:
    """The windowed append of `new` to `old` (module docstring), or None when a check fails.

    `stored` is the text the caller holds for `old` (rendered with `stored_gp`), `L` its length
    without the generation prompt if known; the result is rendered with `gp`.  `cut(text)`: where
    the stored text starts inside a render of the window (right after a pinned run's marker), or
    None; absent, the stored text is the whole render.  `roles`, `scheme`: see `window`.

    The window is found for `old` and every new message is rendered after it at once: one render
    of the window plus all of `new` (and one without the generation prompt).  Appending them one at
    a time through that window (each step's window grown by the messages before it, as the
    locality probe tries a message second in an append) gives the same text: every step's text
    after the anchor is its render's, so only the last render reaches the result; the steps
    before it would only render more.
    """
    if not old or not new:
        return None
    if memo is not None:
        plain = render
        render = lambda messages, agp: memo.render(plain, messages, agp)  # noqa: E731
    return _append_all(render, list(old), list(new), Rope.of(stored), L, stored_gp, gp, cut, roles, scheme)


def _append_all(render: Render, old: list[dict], new: list[dict], stored: Rope, L: int | None, stored_gp: bool,
                gp: bool, cut: Callable[[str], int | None] | None,
                roles: Mapping[str, Sequence[int]] | None = None, scheme: int = 0) -> Appended | None:
    """The windowed append of `new` to `old` (see `append`).

    Renders are compared from an anchor on: the end of the head's text, or, when the window
    reaches back over a pinned run's marker, the point right after the marker (what precedes it
    belongs to earlier segments).  The new render may differ from the window's old text anywhere
    after the anchor (Qwen3 closes a tool-response group only after its last tool turn, and
    renders an empty think block before a *last* assistant turn only): the stored text is edited
    from the first difference."""
    n = len(stored)
    try:
        # The boundary disagrees: one message further back, twice at most.
        for head, ctx in (window(old, wider, roles, scheme) for wider in range(WIDER)):
            A = render(ctx, False)
            if L is None:
                G = ""
                if stored_gp:
                    Ag = render(ctx, True)
                    if not Ag.startswith(A):
                        return None
                    G = Ag[len(A):]
                if not stored.endswith(G):
                    return None
                L = n - len(G)
            if not 0 <= L <= n:
                return None
            if cut is not None:
                # Compared from right after the run's marker: when A's text after it is the stored
                # text, exactly, that is the whole check, wherever the marker falls in the window,
                # so the head's own render (which only tells where the window's text starts) is
                # not needed.  A token-in turn's window nearly always holds the last marker.
                a = cut(A)
                if a is not None and len(A) - a == L and stored.equals(0, A, a, L):
                    h, crossing = a, True
                    break
            H = render(head, False) if head else ""
            # The window's own text starts where A and H part (H may end with what the template
            # emits only at the end of a conversation, e.g. DeepSeek closing its tool outputs).
            if A.startswith(H):
                h = len(H)
            elif scheme == 1:
                h = match_forward(A, 0, H, 0, min(len(A), len(H)))
            else:
                continue
            own = len(A) - h  # the window's own text: A[h:]
            crossing = cut is not None and (own > L or not head)
            if not crossing:
                if own > L or (not head and own != L) or not stored.equals(L - own, A, h, own):
                    continue
                a: int | None = h
            else:  # compare what follows the run's marker
                a = cut(A) if cut is not None else None
                if a is None or len(A) - a != L or A[a:] != stored.slice(0, L):
                    continue
            break
        else:
            return None
        base = L - (len(A) - a)  # where A[a:] starts in the stored text
        B = render([*ctx, *new], gp)
        b = _anchor(B, A, h, crossing, cut)
        if b is None:
            return None
        end = base + len(B) - b
        if gp:
            C = render([*ctx, *new], False)
            c = _anchor(C, A, h, crossing, cut)
            # B[b:] starts with C[c:] (the render without the prompt)
            if c is None or len(B) - b < len(C) - c or match_forward(B, b, C, c, len(C) - c) != len(C) - c:
                return None
            end = base + len(C) - c
    except (ChatTemplateError, InvalidChatInput):
        return None
    # The new text: stored[:base + q] + B[b + q:], q the length the window's old and new texts
    # (A[a:], B[b:]) share.  (base + q <= L <= len(stored): the edit starts inside the stored text.)
    q = match_forward(A, a, B, b, min(len(A) - a, len(B) - b))
    # Windowed only when the window left messages out (a window holding them all renders exactly).
    return Appended(base + q, B[b + q:], end, len(ctx) < len(old))


def _anchor(text: str, A: str, h: int, crossing: bool, cut: Callable[[str], int | None] | None) -> int | None:
    """Where `text` (a render of the window plus the new message) is compared from: after the
    head's text as the window render `A` has it (A[:h], which `text` must start with), or after
    the marker."""
    if not crossing:
        return h if len(text) >= h and match_forward(text, 0, A, 0, h) == h else None
    assert cut is not None
    return cut(text)


# --------------------------------------------------------------------------- the locality probe

def _probes() -> tuple[list[tuple[list[dict], int]], list[dict]]:
    """(probe conversations with the first split to try in each, the catalog of kinds)."""
    def call(i: int) -> dict:
        return {"id": f"c{i}", "type": "function", "function": {"name": "lookup", "arguments": {"q": f"q{i}"}}}

    sys_ = {"role": "system", "content": "You are a careful assistant."}
    u = [{"role": "user", "content": f"question {i}?"} for i in range(4)]
    a_plain = [{"role": "assistant", "content": f"answer {i}."} for i in range(4)]
    a_reason = [{"role": "assistant", "reasoning_content": f"thinking {i}", "content": f"reply {i}"} for i in range(4)]
    a_think = [{"role": "assistant", "content": f"<think>\nhm {i}\n</think>\n\nsaid {i}"} for i in range(3)]
    a_call = [{"role": "assistant", "content": "", "tool_calls": [call(i)]} for i in range(4)]
    a_rcall = [{"role": "assistant", "reasoning_content": f"plan {i}", "content": "", "tool_calls": [call(i)]}
               for i in range(3)]
    tool = [{"role": "tool", "tool_call_id": f"c{i}", "content": f"result {i}"} for i in range(4)]
    wrapped = {"role": "user", "content": "<tool_response>\nwrapped\n</tool_response>"}
    empty_u, empty_a = {"role": "user", "content": ""}, {"role": "assistant", "content": ""}
    ipython = {"role": "ipython", "content": "{\"out\": 1}"}
    whole = [
        [sys_, u[0], a_rcall[0], tool[0], a_call[1], tool[1], a_reason[0], u[1], a_think[0], tool[2], a_plain[0],
         u[2], a_reason[1]],
        [u[0], a_reason[0], u[1], a_reason[1], tool[0], tool[1], a_rcall[1], tool[2], u[2], a_think[1], u[3]],
        [sys_, u[0], a_think[0], wrapped, a_reason[2], tool[0], a_rcall[2], tool[1], a_reason[3], wrapped, a_plain[1]],
        [u[0], a_plain[0], {"role": "system", "content": "A late rule."}, u[1], a_call[2], tool[3], a_plain[2],
         empty_u, empty_a, u[2], a_think[2], u[3], a_plain[3]],
        [sys_, u[0], a_call[3], ipython, a_plain[1], u[1], a_reason[1], ipython, u[2], a_plain[2], tool[1]],
        [u[0], a_reason[0], tool[0], tool[1], tool[2], a_reason[1], tool[3], a_call[0], tool[0], a_plain[0]],
        # The last user message wraps a tool response (Qwen3 then looks further back for the query).
        [sys_, u[1], a_call[0], wrapped, tool[0], tool[1], a_reason[0], tool[2], a_rcall[0], tool[3], a_think[1],
         tool[0], a_plain[0]],
        # New queries after long tool chains (Qwen3 drops the think blocks since the previous query).
        [sys_, u[0], a_reason[0], tool[0], tool[1], tool[2], u[1], a_rcall[0], tool[3], tool[0], tool[1], u[2],
         a_think[0], tool[2], a_call[1], tool[3], u[3], a_plain[0], tool[0], tool[1], u[0]],
        [u[0], a_think[1], tool[0], tool[1], a_plain[1], tool[2], {"role": "system", "content": "Late."}, tool[3],
         u[1], a_rcall[1], tool[0], tool[1], tool[2], tool[3], u[2]],
    ]
    # One of each kind, appended at every split of every conversation above.
    catalog = [u[3], a_plain[3], a_reason[3], a_think[2], a_call[3], a_rcall[2], tool[3], wrapped, empty_u, empty_a,
               {"role": "system", "content": "Later rule."}, ipython]
    # And systematically: every ordered pair of kinds ending a conversation (state that the last
    # two messages leave for the next one, e.g. DeepSeek V3 closing tool outputs at the end).
    pairs = [u[2], a_plain[2], a_reason[2], a_call[2], tool[2], {"role": "system", "content": ""}, empty_a, ipython]
    conversations = [(c, 2) for c in whole]
    for prefix in ([sys_, u[0], a_call[0], tool[0], tool[1]], [u[0], a_reason[0], tool[0], u[1], a_plain[0]]):
        for x in pairs:
            conversations.extend(([*prefix, x, y], len(prefix) + 2) for y in pairs)  # only the final split
    return conversations, catalog


#: Head schemes (`window`): the plain head, then the state head.
SCHEMES = (0, 1)


class Locality:
    """The probe's verdicts for one template, render arguments and generation-prompt setting,
    filled in per message kind and head scheme on first use (thread-safe)."""

    def __init__(self, template: Renderer, render_kwargs: Mapping[str, Any], gp: bool) -> None:
        self.template, self.render_kwargs, self.gp = template, dict(render_kwargs), gp
        self._verdicts: dict[tuple[Kind, int], bool] = {}
        self._lock = threading.Lock()  # held while a verdict is probed (one probe of a key at a time)
        self.probes = 0  # windowed appends tried so far
        # Background probes (`schemes_for(wait=False)`): the keys asked for and not decided yet,
        # in order, and the thread working through them (None when idle).  `_queued` guards both.
        self._queue: collections.deque[tuple[Kind, int]] = collections.deque()
        self._queued = threading.Condition(threading.Lock())
        self._worker: threading.Thread | None = None
        self.background_errors = 0  # background probes that raised (their verdict: not local)

    @property
    def local(self) -> frozenset[Kind]:
        """Kinds that append through a window under some head scheme (of those decided)."""
        return frozenset(k for (k, _), ok in self._verdicts.items() if ok)

    @property
    def nonlocal_(self) -> frozenset[Kind]:
        """Kinds decided under every head scheme and local under none."""
        decided = {k for k, _ in self._verdicts}
        return frozenset(k for k in decided if all(self._verdicts.get((k, s)) is False for s in SCHEMES))

    def allows(self, messages: Sequence[Mapping[str, Any]]) -> bool:
        """Whether every message's kind appends exactly through the window (probing new kinds)."""
        return self.scheme_for(messages) is not None

    def scheme_for(self, messages: Sequence[Mapping[str, Any]]) -> int | None:
        """The first head scheme under which every message's kind is local (one scheme serves a
        whole append), or None."""
        return next(self.schemes_for(messages), None)

    def schemes_for(self, messages: Sequence[Mapping[str, Any]], prefer: int = 0, *,
                    wait: bool = True) -> Iterator[int]:
        """The head schemes under which every message's kind is local, `prefer` first; lazily:
        a scheme is probed only when the caller asks for the next one (the state head only once
        the plain one did not serve).

        `wait=False`: nothing is probed on the caller's thread.  A scheme with an undecided kind
        (and none known to fail) ends the search: its undecided kinds are handed to a background
        thread (`settle` waits for it) and no later scheme is tried meanwhile, so the caller
        renders everything (exact) until the verdicts are in.  A probe costs 0.1-0.6 s of
        renders; in a server it would stall the first op of every new message kind or tool list."""
        kinds = list(dict.fromkeys(kind(m) for m in messages))
        verdicts = self._verdicts
        # Every kind decided local under the preferred scheme (every op of a settled conversation):
        # that scheme first, without sorting kinds or schemes.
        if all(verdicts.get((k, prefer)) for k in kinds):
            yield prefer
            rest: Iterable[int] = [s for s in SCHEMES if s != prefer]
        else:
            rest = sorted(SCHEMES, key=lambda s: s != prefer)
        for scheme in rest:
            # Kinds already known to fail first: a scheme that cannot serve is rejected unprobed.
            kinds.sort(key=lambda k: self._verdicts.get((k, scheme)) is not False)
            if wait:
                if all(self.verdict(k, scheme) for k in kinds):
                    yield scheme
                continue
            known = [self._verdicts.get((k, scheme)) for k in kinds]
            if False in known:
                continue
            if None in known:
                self._probe_later([(k, scheme) for k, ok in zip(kinds, known) if ok is None])
                return
            yield scheme

    def settle(self, timeout: float | None = None) -> bool:
        """Wait until the background probes asked for so far are decided; False on timeout."""
        with self._queued:
            return self._queued.wait_for(lambda: self._worker is None, timeout)

    def _probe_later(self, keys: list[tuple[Kind, int]]) -> None:
        with self._queued:
            for key in keys:
                if key not in self._queue:
                    self._queue.append(key)
            if self._worker is None and self._queue:
                self._worker = threading.Thread(target=self._drain, name="toktier-locality-probe", daemon=True)
                self._worker.start()

    def _drain(self) -> None:
        """The background prober: decides the queued keys in order, then ends (`_worker` is reset
        in the same lock hold that finds the queue empty, so no key is ever left unserved)."""
        # `Thread.start` returned to the op on its own thread only once this thread ran; hand it
        # the GIL back now, not after the probe's setup and first split (4 ms, measured).
        _let_others_run()
        key = None
        try:
            while True:
                with self._queued:
                    if key is not None:
                        self._queue.popleft()
                    if not self._queue:
                        self._worker = None
                        self._queued.notify_all()
                        return
                    key = self._queue[0]
                try:
                    # The GIL is let go before every split a probe tries (Qwen3's template: 0.4 ms
                    # apart at the median, 5.5 ms at most), so a serving thread waits about that
                    # long for it, not the whole probe.
                    self.verdict(*key, pause=_let_others_run)
                except Exception:  # a template raising what renders never do: not local, counted
                    with self._lock:
                        self._verdicts.setdefault(key, False)
                    self.background_errors += 1
        except BaseException:
            with self._queued:
                self._queue.clear()
                self._worker = None
                self._queued.notify_all()
            raise

    def verdict(self, k: Kind, scheme: int = 0, *, pause: Callable[[], None] | None = None) -> bool:
        """Whether kind `k` appends exactly through windows of head `scheme` (probed on first use;
        `pause` is called before each split the probe tries)."""
        ok = self._verdicts.get((k, scheme))
        if ok is None:
            with self._lock:
                ok = self._verdicts.get((k, scheme))
                if ok is None:
                    ok = self._verdicts[(k, scheme)] = self._probe(k, scheme, pause)
        return ok

    def probe_all(self) -> "Locality":
        for k in {kind(m) for m in _probes()[1]}:
            for scheme in SCHEMES:
                self.verdict(k, scheme)
        return self

    def _probe(self, k: Kind, scheme: int = 0, pause: Callable[[], None] | None = None) -> bool:
        """Every representative of kind `k` appended at every split of every probe conversation
        (windows of head `scheme`): True when it passed the checks at least once and was exact
        every time it did."""
        plain = self.template.bind(**self.render_kwargs)

        # Windows repeat across splits, representatives and both L variants.  A render with the
        # generation prompt also gives the one without it where the template allows (`both`):
        # the probe asks for both of nearly every list, so a template's probes cost ~30% less
        # (qwen3, all kinds: 2.0 -> 1.4 s; the first op that meets a new kind pays its probe).
        memo = Memo(512, plain.both)

        def render(messages: list[dict], agp: bool) -> str:
            return memo.render(plain, messages, agp)

        conversations, catalog = _probes()
        representatives = [m for m in catalog if kind(m) == k]
        gp, seen = self.gp, False
        for probe, first in conversations:
            # Windows smaller than the history only: a window that is all of it renders exactly.
            for j in range(first, len(probe) + 1):
                if pause is not None:
                    pause()
                old = probe[:j]
                if not window(old, 0, None, scheme)[0]:
                    continue
                try:
                    stored = render(old, gp)
                    known = len(render(old, False)) if gp else len(stored)
                except (ChatTemplateError, InvalidChatInput):
                    continue
                for message in representatives:
                    try:
                        full = render([*old, message], gp)
                        full_end = len(render([*old, message], False)) if gp else len(full)
                    except (ChatTemplateError, InvalidChatInput):
                        continue
                    for L in (None, known):
                        got = append(render, old, [message], stored, L, gp, gp, scheme=scheme)
                        if got is None or not got.windowed:  # a whole-history window proves nothing
                            continue
                        self.probes += 1
                        seen = True
                        if stored[:got.start] + got.text != full or got.end != full_end:
                            return False
                    # The same message second in one append: its window is the first one's, grown
                    # by the message before it (`append` keeps a batch's window).  Tried where that
                    # first message alone appends exactly through its window (else its own kind,
                    # not this one, decides).
                    if j >= first + 1 and window(probe[:j - 1], 0, None, scheme)[0]:
                        try:
                            before = render(probe[:j - 1], gp)
                        except (ChatTemplateError, InvalidChatInput):
                            continue
                        one = append(render, probe[:j - 1], [probe[j - 1]], before, None, gp, gp, scheme=scheme)
                        if one is None or before[:one.start] + one.text != stored:
                            continue
                        got = append(render, probe[:j - 1], [probe[j - 1], message], before, None, gp, gp,
                                     scheme=scheme)
                        if got is not None and got.windowed:
                            self.probes += 1
                            if before[:got.start] + got.text != full or got.end != full_end:
                                return False
                    if kind(old[-1]) == ("assistant", False, False) and \
                            not self._after_marker(render, old, message, scheme):
                        return False
        return seen

    def _after_marker(self, render: Render, old: list[dict], message: dict, scheme: int = 0) -> bool:
        """The same append after a pinned run: the last old message is a marker, the stored text
        what follows it; exact after the marker whenever the checks pass (True when they fail)."""
        mark = "TOKTIERPROBEMARKX"
        old = [*old[:-1], {"role": "assistant", "content": mark}]

        def cut(text: str) -> int | None:
            at = text.find(mark)
            return at + len(mark) if at >= 0 and text.find(mark, at + 1) < 0 else None
        try:
            rendered, full = render(old, self.gp), render([*old, message], self.gp)
            full_end = len(render([*old, message], False)) if self.gp else len(full)
        except (ChatTemplateError, InvalidChatInput):
            return True
        at, at_full = cut(rendered), cut(full)
        if at is None or at_full is None:
            return True
        stored = rendered[at:]
        got = append(render, old, [message], stored, None, self.gp, self.gp, cut, scheme=scheme)
        if got is None or not got.windowed:
            return True
        self.probes += 1
        return stored[:got.start] + got.text == full[at_full:] and got.end == full_end - at_full


def _let_others_run() -> None:
    time.sleep(0)  # releases the GIL: a thread waiting for it takes it now


_CACHE: collections.OrderedDict[str, Locality] = collections.OrderedDict()
_CACHE_SIZE = 64
_LOCK = threading.Lock()


def locality(template: Renderer, render_kwargs: Mapping[str, Any], gp: bool) -> Locality:
    """The (shared, lazily probed) `Locality` of `template` with `render_kwargs` and generation
    prompt `gp`: kept in a small LRU keyed by what the verdicts are a function of."""
    key = hashlib.sha256(json.dumps([template.source, dict(template.special_tokens), gp, WINDOW, STEP, STATE_STEP,
                                     SCHEMES, dict(render_kwargs)], sort_keys=True, default=repr).encode()).hexdigest()
    with _LOCK:
        hit = _CACHE.get(key)
        if hit is None:
            hit = _CACHE[key] = Locality(template, render_kwargs, gp)
            while len(_CACHE) > _CACHE_SIZE:
                _CACHE.popitem(last=False)
        else:
            _CACHE.move_to_end(key)
        return hit


def probe_locality(template: Renderer, render_kwargs: Mapping[str, Any], gp: bool) -> Locality:
    """`locality(...)` with every kind of the probe catalog decided."""
    return locality(template, render_kwargs, gp).probe_all()
