"""Conversations: messages in, exact token IDs out, sampled IDs kept verbatim.

This module owns `Conversation`: a chat's messages, their rendering through a chat template
(`toktier.chat`), the token state of that rendering (one `Session` per text segment), pinned runs
of sampled IDs, forks, rollbacks and the drift report.  Junctions (what the template emits after a
generated turn) come from `toktier.junctions`, history matching from `toktier.message_match`, the
cutting of a re-render's changes into edits from `toktier.text_diff`.

Text-only conversations (no sampled IDs)
----------------------------------------
``ids == encode(render(messages, add_generation_prompt=...))`` after every op, where encode is the
reference tokenizer (`FrozenTokenizer.encode`).  Appended messages whose kinds the template renders
locally are rendered through a window of the last few messages (`toktier.render_window`: probed per
template and kind, cross-checked at the boundary on every op) and become one `Session.edit` near
the end: no op then touches the whole text (no full render, no whole-text comparison).  Every other
op, and every append whose checks fail, renders the whole list and diffs it with the stored text
(exact for every template): one change is one `Session.sync` edit; several separate changes (Qwen3
drops the `<think>` block of every assistant turn since the last user query once a new query
arrives, and appends the new turn) are cut into separate edits by `toktier.text_diff` (exact by
construction), each repaired in its own window: a rewritten earlier turn costs a repair around the
rewritten span, never a re-encode.  A conversation with no messages has the empty text (templates
refuse to render none).  `render_stats` counts windowed and full renders; `incremental=False`
renders everything on every op.  Nothing an append does is O(text) in Python: texts are
`render_window.Rope`s (an edit near the end shares everything before it), the messages' role
indices are kept for the window's head (found by bisection), and results snapshot the text in
O(1) (joined on first access of `.text`).

Atomic ops: an op computes every render first, then edits the sessions (one edited in place is
rebuilt from its old text if a later step fails: a text segment's IDs are the reference encoding
of its text), then commits the new state; a failed op leaves the conversation as it was, so a
retry applies once.  `messages` are read-only views, each frozen once, on first read (equal to the
plain dicts, which are copies of the caller's; copies are plain); `num_messages` and `num_chars`
cost O(1); `fast_path = False` makes every internal session take the full path (the shadow
verifier's switch).

Token-in-token-out: the definition
----------------------------------
`append_generated(S)` pins the sampled IDs S.  A conversation with messages m[0..n) holding pinned
runs S_1..S_r for the assistant messages at indices k_1 < ... < k_r is defined as follows.

- Marked messages m~: m with each message k_i replaced by ``{"role": "assistant", "content":
  MARK_i}`` (MARK_i a unique letters-and-digits string).  S_i stands for the whole generated turn
  (reasoning, content, tool calls as the model wrote them), so the template renders none of them.
  (The harmony renderer's marker also keeps the turn's call names, which name the tool results
  after it and render nothing: `Renderer.marker_message`.)
- J = `derive_junction(template, tokenizer)`: the stop texts and whether a stop is also the next
  turn's start (GLM style).  A run *stopped* when its decoded bytes end with a stop text; else it
  was truncated (max_tokens).  S_i' = S_i, except that with a stop-is-start template the tokens
  spelling a trailing stop are stripped (the template renders the next turn's start itself).
- after_i(R): in a rendered text R holding MARK_i exactly once, the offset right after MARK_i, plus
  the length of the stop text R has there when run i stopped and J's stop is not a start token (the
  sampled stop stands for the rendered one).  A truncated run's remainder therefore starts with the
  whole post-content text (Qwen3: ``<|im_end|>\\n``).
- Text segments: X_0 = R_1[0:], X_i = R_{i+1}[after_i(R_{i+1}):] for 0 < i < r, and the tail
  X_r = R_end[after_r(R_end):] (X_0 = R_end when r = 0), where R_i = render(m~[:k_i],
  add_generation_prompt=True) is the prompt run i continued and R_end = render(m~,
  add_generation_prompt=<the conversation's setting>).
- **IDs = encode(X_0) + S_1' + encode(X_1) + S_2' + ... + S_r' + encode(X_r)**: every text segment
  is tokenized on its own, from its junction; the text is X_0 + dec(S_1') + X_1 + ... + X_r.

With no runs this is the text-only contract.  The message recorded for run i is
``{"role": "assistant", "content": <dec(S_i) without its stop>}`` (invalid UTF-8 decodes to
U+FFFD), with a ``<think>...</think>`` head moved to ``reasoning_content`` when the template reads
that field (Qwen3 renders both forms identically); or the caller's own ``message=`` (e.g. with
parsed tool calls), which then only decides matching and the drift reference.

Drift: `drift` is the first index where the IDs differ from encode(render(m, add_generation_prompt
=...)) of the real messages (None when equal).  A shadow `Session` over that full render is synced on
every op (an edit, not a re-encode; its text rendered through a window like the live one) and
compared from the last index known equal.  `track_drift=False` keeps no shadow: `drift` is then
None and results say ``drift_tracked=False`` (not computed, rather than "equal").
``track_drift="on_read"`` keeps the shadow but leaves it behind on every op (results say
``drift=None, drift_tracked=False``); reading `Conversation.drift` brings it up to date as one
plan and one edit for all the ops since (the appended messages rendered through one window,
anything else rendered whole and diffed) and answers exactly what ``track_drift=True`` would:
an RL rollout that wants the drift of a finished trajectory pays the token-in turns of a
conversation without a drift reference, and a fraction of the per-op syncs once.  The template
then renders the real messages only when the drift is read, so a template that refuses them
raises there (with ``track_drift=True`` the op itself would have raised).  Drift appears
when sampled IDs are not the canonical tokenization of their text, when the template renders a
generated turn otherwise than the model wrote it (Qwen3 dropping its `<think>` block later), or
when a stop token is stripped or replaced.

Once the IDs have drifted at index d, appends after it cannot move the drift: the live IDs up to d
stay, and so do the shadow's tokens up to d as long as its edits start past a stable boundary
after token d (plus the longest literal: `Conversation._guard`, the repair's own certificate).
Such an edit waits (its text is rendered and kept, not tokenized) and the waiting edits are applied
as one before anything else reads or edits the shadow (an edit before that point, a rollback, a
branch); `drift` is d meanwhile.  An RL rollout that sampled one non-canonical token early then
pays for the shadow's renders only.

Changing history
----------------
`set_messages(new)`: d = the longest prefix the stored and the new list share under the matching
mode (`toktier.message_match`).  The conversation keeps its stored messages[:d] (what its IDs were
built from) and takes new[d:].  Runs at indices < d stay pinned; a run at or after d cannot be
kept (its prompt or itself changed): the conversation branches at d, the run's message (if still
in the list) becomes ordinary text, the segment before the first dropped run becomes the live tail
again and is synced (an edit) to its new text.  The result reports `branched_at` and
`dropped_runs`.  `rollback(n)` is the same with new = messages[:n].  Changes after the last run
only edit the tail segment: earlier segments are frozen (they are what the model saw).

>>> import toktier
>>> from toktier.chat import ChatTemplate
>>> tok = toktier.load_tokenizer("cl100k_base")
>>> t = ChatTemplate("{% for m in messages %}{{ m.role }}:{{ m.content }}<|endoftext|>\\n{% endfor %}"
...                  "{% if add_generation_prompt %}assistant:{% endif %}", {"eos_token": "<|endoftext|>"})
>>> c = Conversation(tok, t)
>>> r = c.append_messages([{"role": "user", "content": " Hi"}])
>>> r.ids.tolist() == tok.encode(c.text).tolist(), r.drift
(True, None)
>>> r = c.append_generated(tok.encode(" Hello!<|endoftext|>"))
>>> c.messages[-1], c.text.endswith("Hello!<|endoftext|>\\nassistant:"), r.drift
({'role': 'assistant', 'content': ' Hello!'}, True, None)
>>> r = c.append_generated([*tok.encode(" Hel"), *tok.encode("lo!<|endoftext|>")])  # not canonical
>>> r.drift == r.first_changed, c.text.endswith("assistant: Hello!<|endoftext|>\\nassistant:")
(True, True)
"""

from __future__ import annotations

import bisect
import copy
import enum
import functools
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from . import chat, render_window
from .boundaries import stable_char_positions
from .buffers import GrowableU32, spare_room
from .chat import ChatTemplate
from .errors import InvalidChatInput, InvalidConversationOp, InvalidTokenIds, JunctionUnavailable
from .fullpath import FullPath
from .junctions import Junction, derive_junction, new_marker
from .message_match import check_mode, common_prefix
from .render_window import Appended, Locality, Rope
from .session import OpResult, RepairPath, Session
from .text_diff import edit_script, match_forward

if TYPE_CHECKING:
    from .registry import FrozenTokenizer

_RESERVED = frozenset({"messages", "add_generation_prompt", "continue_final_message"})

#: `track_drift` value: the drift reference catches up only when `Conversation.drift` is read.
DRIFT_ON_READ = "on_read"
_NEVER = 1 << 62  # "no live change yet" for `_pending_first`


def check_drift_mode(value: Any) -> bool | str:
    """`track_drift` as a conversation keeps it: True (every op's result has `drift`), False (no
    drift reference) or ``"on_read"``; `InvalidConversationOp` for anything else."""
    if value is True or value is False or (isinstance(value, str) and value == DRIFT_ON_READ):
        return value
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise InvalidConversationOp(f"track_drift={value!r}: use True (drift in every result), False (no drift "
                                f"reference) or {DRIFT_ON_READ!r} (computed when Conversation.drift is read)")


class ConversationPath(str, enum.Enum):
    """What an op did to the conversation's text."""

    NOOP = "noop"  # the text did not change
    APPEND = "append"  # text was added at the end only
    EDIT = "edit"  # earlier rendered text changed too (a non-append template): one repaired edit
    GENERATED = "generated"  # sampled IDs were pinned
    BRANCH = "branch"  # the history differs from the stored one before its end (see `branched_at`)
    ROLLBACK = "rollback"


@dataclass(frozen=True, eq=False)
class ConversationResult:
    """Outcome of one conversation op.  `ids` is a read-only view valid until the next op."""

    ids: np.ndarray
    first_changed: int  # every token before it is unchanged (the KV reuse point); exact for a single change
    first_changed_message: int  # first message index the op changed (or added)
    drift: int | None  # first index where ids differ from the exact re-render-and-encode; None if equal
    path: ConversationPath
    repair: RepairPath  # how the live text segment's session (for append_generated: the prompt's) got its IDs
    branched_at: int | None = None  # message index where a re-sent history diverged from the stored one
    dropped_runs: int = 0  # pinned runs given up (the history changed at or before them)
    _parts: tuple[Rope, ...] = field(default=(), repr=False)
    drift_tracked: bool = True  # False: `drift` not computed (None) in this op (track_drift False or "on_read")
    windowed: bool = False  # the new text was rendered from a window of the messages (`toktier.render_window`)

    @functools.cached_property
    def text(self) -> str:
        """The conversation's text after the op (joined on first access)."""
        return "".join(map(str, self._parts))

    @property
    def num_chars(self) -> int:
        """len(text), in O(1) (the text is not joined)."""
        return sum(len(p) for p in self._parts)

    @property
    def text_nbytes(self) -> int:
        """About what `text` holds as a str, in O(1) (`Rope.nbytes`): a server's memory charge."""
        return _text_nbytes(self._parts)


@dataclass(frozen=True, eq=False)
class GeneratedRun:
    """A pinned run of sampled IDs (see the module docstring)."""

    message_index: int
    sampled: np.ndarray  # the IDs as given (read-only)
    ids: np.ndarray  # the IDs kept in the conversation: sampled, less a stripped stop-is-start token
    stop: str | None  # the stop text the run ended with; None when truncated
    text: str  # decoded `ids`
    marker: str = field(repr=False)


@dataclass(frozen=True, eq=False)
class ConversationState:
    """Everything a conversation's IDs are a function of (see the module docstring's definition),
    detached from it: its settings, the stored messages (plain dicts, never mutated: shared, not
    copied) and its pinned runs as (message index, sampled IDs as given).  `Conversation.state`
    takes it in O(messages); `Conversation.replay` rebuilds an equal conversation from it
    (`toktier.conversation_record` stores it)."""

    template: ChatTemplate
    render_kwargs: Mapping[str, Any]
    match: str
    add_generation_prompt: bool
    stop_texts: tuple[str, ...]
    track_drift: bool | str
    incremental: bool
    messages: tuple[dict, ...]
    runs: tuple[tuple[int, np.ndarray], ...]


@dataclass
class RenderStats:
    """How the conversation's ops rendered: through a window of the messages, or everything."""

    windowed: int = 0  # renders of the live text or the drift reference done through a window
    full: int = 0  # renders of all messages (non-local templates and kinds, checks that failed, edits)


@dataclass
class _Text:
    """A planned new text for one session: `edit` = (start, replacement of old[start:]) when it
    came from a window, else None (the session is synced to `text`, diffed)."""

    text: Rope
    end: int | None  # its length without the generation prompt, when known
    edit: tuple[int, str] | None = None
    windowed: bool = False  # rendered through a window (`toktier.render_window`)


class Conversation:
    """A chat whose token IDs stay exact as messages are added, edited, generated and rolled back.

    `template`: a `ChatTemplate`, a registered template name, a Jinja source string, or None for the
    tokenizer's registered template (`toktier.chat.template_for`).  `match`: how re-sent histories
    are compared (`toktier.message_match`).  `stop_texts`: extra stop strings a generation may end
    with (e.g. a generation_config's extra eos tokens, spelled out), besides the template's
    eos_token and the tokenizer's added tokens.  `track_drift=False`: no drift reference is kept
    (token-in callers that do not need `drift` save its render and repair on every op); results
    then have ``drift=None`` and ``drift_tracked=False``.  ``track_drift="on_read"``: results have no
    drift either; `drift` is computed when read (see the module docstring).  `incremental=False`:
    every op renders all messages (the reference behaviour; the default renders appends through a
    window where the template is checked local, `toktier.render_window`).
    `probe_in_background=True`: the first op that appends a message kind the template's locality
    probe has not decided yet (per template, render arguments and setting: a new tool list is a new
    probe) renders everything, exactly, and the probe (0.1-0.6 s of renders) runs on a background
    thread, which lets the GIL go before each split it tries (~0.4 ms apart); later ops use its
    verdicts (`locality.settle()` waits).  The default probes on the op's own thread, as
    deterministic callers (tests, offline replays) want; a server should not let one op wait for it.
    `render_kwargs` become template variables and arguments (`tools=`, `documents=`,
    `enable_thinking=`, ...).  Not thread-safe.
    """

    def __init__(self, tokenizer: FrozenTokenizer, template: ChatTemplate | str | None = None, *,
                 match: str = "strict", add_generation_prompt: bool = True, stop_texts: Sequence[str] = (),
                 full_path: FullPath | None = None, track_drift: bool | str = True, incremental: bool = True,
                 probe_in_background: bool = False, **render_kwargs: Any) -> None:
        reserved = _RESERVED & set(render_kwargs)
        if reserved:
            raise InvalidChatInput(f"{sorted(reserved)} cannot be conversation render arguments: messages come from "
                                   "the ops, add_generation_prompt is its own argument, and a conversation never "
                                   "continues a final message (append_generated pins the continuation instead)")
        self.tokenizer = tokenizer
        self.template = _resolve_template(tokenizer, template)
        self.match = check_mode(match)
        self.add_generation_prompt = bool(add_generation_prompt)
        self.track_drift = check_drift_mode(track_drift)
        self.incremental = bool(incremental)
        self.probe_in_background = bool(probe_in_background)
        # A private copy: a caller changing its tools list later must not change renders mid-conversation.
        self.render_kwargs: Mapping[str, Any] = types.MappingProxyType(copy.deepcopy(render_kwargs))
        self.render_stats = RenderStats()
        # Tools, documents and keywords prepared for the template once, not on every render.
        self._bound = self.template.bind(**self.render_kwargs)
        self._stop_texts = tuple(stop_texts)
        # one for all its sessions (a tail segment's session is made on every generated turn)
        self._full_path = full_path if full_path is not None else FullPath()
        self._fast_path = True
        self._junction = _JunctionCell()  # shared with forks: the probe's answer is theirs too
        self._locality: Locality | None = None
        self._memo = render_window.Memo(both=self._render_both)
        self._scheme = 0  # the head scheme of the last windowed append (`render_window.window`)
        # The messages as rendered (plain dicts, never mutated), the same with every pinned run's
        # message replaced by its marker (what the text segments are cut from), and read-only views
        # for callers of the first len(_views) of them (the rest are frozen when `messages` is read).
        self._messages: list[dict] = []
        self._marked: list[dict] = []
        self._views: list[Mapping[str, Any]] = []
        self._views_tuple: tuple[Mapping[str, Any], ...] | None = ()
        # role -> ascending indices of its messages (windows find their head messages by bisection)
        self._roles: dict[str, list[int]] = {}
        self._runs: list[GeneratedRun] = []
        # Run i's marker is this plus its index: drawn once (an entropy read per op cost ~2% of a turn)
        self._marker_base = new_marker()
        # Frozen text segment i (X_i) precedes run i: its text, its session (shared by forks, never
        # mutated: forked before it becomes live again) and where its tokens start; characters of
        # the text up to the end of run i.
        self._seg_texts: list[Rope] = []
        self._seg_sessions: list[Session] = []
        self._seg_starts: list[int] = []
        self._run_starts: list[int] = []
        self._run_chars: list[int] = []
        self._tail = self._session("")
        self._tail_text = _EMPTY  # texts are `Rope`s: an op near the end never copies the whole text
        # X_0 + dec(S_1') + ... + dec(S_r'): the text before the tail (results snapshot it in O(1)).
        self._prefix = _EMPTY
        self._tail_end: int | None = 0  # the tail's length without the generation prompt (None: unknown)
        # With runs: every segment's and run's IDs concatenated (the tail's are kept current from
        # its first changed token on); without runs the tail session's IDs are the IDs.
        self._all: GrowableU32 | None = None
        # With runs (and track_drift): a session over the exact full render of the real messages.
        self._shadow: Session | None = None
        self._shadow_text = _EMPTY
        self._shadow_end: int | None = 0
        self._equal_upto = 0  # ids[:k] == shadow ids[:k] is known
        # Drift established at token d: (d, c) such that no shadow edit starting at character c or
        # later can change the shadow's tokens up to d (`_guard`); while one holds, edits of the
        # shadow after c are deferred and the session lags the rope from character `_shadow_lag`.
        self._drift_guard: tuple[int, int] | None = None
        self._shadow_lag: int | None = None
        # track_drift="on_read": ops leave the drift reference behind; it catches up (one plan and
        # one edit for every op since) when `drift` is read.  The real messages it was last in
        # step with (None: in step), whether an op since changed more than the end of the list,
        # and the earliest token the live IDs changed at since.
        self._drift_synced: list[dict] | None = None
        self._drift_full = False
        self._pending_first = _NEVER

    # -- read access -------------------------------------------------------------------------
    @property
    def ids(self) -> np.ndarray:
        """All token IDs (read-only uint32 view, valid until the next op)."""
        view = (self._all.view() if self._all is not None else self._tail.ids).view()
        view.setflags(write=False)
        return view

    @property
    def num_tokens(self) -> int:
        return self._all.n if self._all is not None else self._tail.num_tokens

    @property
    def num_messages(self) -> int:
        """How many messages the conversation holds (O(1))."""
        return len(self._messages)

    @property
    def num_chars(self) -> int:
        """The length of `text` in characters (O(1): the text is not joined)."""
        return (self._run_chars[-1] if self._run_chars else 0) + len(self._tail_text)

    @property
    def text_nbytes(self) -> int:
        """About what `text` holds as a str, in O(1) (see `ConversationResult.text_nbytes`)."""
        return _text_nbytes(self._parts())

    @property
    def text(self) -> str:
        """The conversation's text (joined on every access: prefer `num_chars` for its length)."""
        return "".join(map(str, self._parts()))

    @property
    def messages(self) -> tuple[Mapping[str, Any], ...]:
        """The messages as prepared for the template: read-only dicts (nested lists read-only too),
        each frozen once (on the first read after it was stored); the tuple is built once per change,
        not per access.  Copies (`dict(m)`, `copy.deepcopy`) are plain, mutable dicts and lists."""
        if self._views_tuple is None:
            # Frozen on first read, not per op: the stored dicts never change, so a view made now
            # equals one made when the message was stored (an RL loop may never read them).
            views, stored = self._views, self._messages
            views += [_frozen(m) for m in stored[len(views):]]
            self._views_tuple = tuple(views)
        return self._views_tuple

    @property
    def generated(self) -> tuple[GeneratedRun, ...]:
        """The pinned runs, in order."""
        return tuple(self._runs)

    @property
    def junction(self) -> Junction:
        """The template's junction (derived by probing on first use; see `toktier.junctions`)."""
        cell = self._junction
        if cell.junction is None:  # (forks deriving it at once on two threads store equal answers)
            cell.junction = derive_junction(self.template, self.tokenizer, stop_texts=self._stop_texts,
                                            **self.render_kwargs)
        return cell.junction

    @property
    def locality(self) -> Locality:
        """Which appended message kinds this template renders through a window (each kind probed on first use)."""
        if self._locality is None:
            self._locality = render_window.locality(self.template, self.render_kwargs,
                                                          self.add_generation_prompt)
        return self._locality

    @property
    def drift(self) -> int | None:
        """First index where the IDs differ from the exact re-render (None: equal, or not tracked)."""
        return self._drift()

    @property
    def drift_tracked(self) -> bool:
        """Whether `drift` is computed (every op's result has it only with ``track_drift=True``)."""
        return bool(self.track_drift)

    @property
    def fast_path(self) -> bool:
        """Whether the internal sessions may splice (False: every change is re-encoded by the full
        path, as the shadow verifier asks after a mismatch).  Applies to every live session and to
        the ones created later; frozen segments are never edited."""
        return self._fast_path

    @fast_path.setter
    def fast_path(self, value: bool) -> None:
        self._fast_path = bool(value)
        self._tail.fast_path = self._fast_path
        if self._shadow is not None:
            self._shadow.fast_path = self._fast_path

    # -- ops -----------------------------------------------------------------------------------
    def append_messages(self, messages: Sequence[Mapping[str, Any]]) -> ConversationResult:
        """Add messages at the end (the stored history is kept as is: no matching)."""
        new = _prepare(messages)
        n = len(self._messages)
        if not new:
            return self._result(self.num_tokens, n, ConversationPath.NOOP, RepairPath.NOOP)
        return self._apply([*self._messages, *new], n, None)

    def set_messages(self, messages: Sequence[Mapping[str, Any]]) -> ConversationResult:
        """Make the history `messages` (the whole list): the shared prefix (under `match`) is kept,
        the rest is rendered, and the changed text is repaired as edits (never re-encoded)."""
        new = _prepare(messages)
        d = common_prefix(self._messages, new, self.match)
        if d == len(self._messages) == len(new):  # the same history: nothing to render
            return self._result(self.num_tokens, d, ConversationPath.NOOP, RepairPath.NOOP)
        branched = d if d < len(self._messages) else None
        return self._apply([*self._messages[:d], *new[d:]], d, branched)

    def rollback(self, n_messages: int) -> ConversationResult:
        """Back to the first `n_messages` messages (runs among them stay pinned)."""
        n = len(self._messages)
        if isinstance(n_messages, bool) or not isinstance(n_messages, int) or not 0 <= n_messages <= n:
            raise InvalidConversationOp(f"rollback({n_messages!r}): the conversation has {len(self._messages)} "
                                        f"message(s); pass 0 <= n_messages <= {len(self._messages)}")
        return self._apply(self._messages[:n_messages], n_messages, None, rollback=True)

    def append_generated(self, ids: Any, *, message: Mapping[str, Any] | None = None,
                         then: Sequence[Mapping[str, Any]] = ()) -> ConversationResult:
        """Pin sampled IDs (the model's continuation of the current prompt) verbatim.

        The prompt is the render with the generation prompt, whatever `add_generation_prompt` says;
        the recorded assistant message is decoded from `ids` unless `message` is given.  `then`:
        messages that follow the generated turn (an agent's tool results, the next user turn),
        appended in the same op: the state and IDs are those of `append_generated` followed by
        `append_messages(then)`, but the new text is rendered and repaired once, not twice.
        """
        sampled, data = _checked_ids(ids, self.tokenizer)
        after = _prepare(then) if then else []
        if not self._messages:
            raise InvalidConversationOp("append_generated needs a prompt: add messages first (sampled IDs continue "
                                        "the rendered conversation)")
        if len(sampled) == 0:
            raise InvalidConversationOp("append_generated got no IDs: pass the sampled IDs (with their stop token)")
        junction = self.junction
        stop, kept = _split_stop(self.tokenizer, junction, sampled, data)
        content = data[: len(data) - len(stop.encode("utf-8"))] if stop else data
        if message is None:
            # the sampled IDs of the content too, where the stop is one token (a parser may read them)
            spelled = kept if len(kept) < len(sampled) else sampled
            if stop and len(spelled) == len(sampled):
                last = self.tokenizer.token_bytes[int(sampled[-1])] if len(sampled) else b""
                spelled = sampled[:-1] if last == stop.encode("utf-8") else None
            recorded = self.template.generated_message(content.decode("utf-8", "replace"), ids=spelled)
        else:
            recorded = _prepare([message])[0]
            if recorded.get("role") != "assistant":
                raise InvalidChatInput(f"append_generated(message=...) records an assistant turn, got role "
                                       f"{recorded.get('role')!r}")
        run = GeneratedRun(len(self._messages), _readonly(sampled), _readonly(kept), stop,
                           (data if len(kept) == len(sampled) else content).decode("utf-8", "replace"),
                           f"{self._marker_base}R{len(self._runs)}X")
        gp = self.add_generation_prompt
        marker = self.template.marker_message(recorded, run.marker)
        messages, marked = [*self._messages, recorded, *after], [*self._marked, marker, *after]
        runs = [*self._runs, run]
        # 1. Every render and marker search (may raise: nothing has changed yet).
        # The prompt: the live tail already is it when the conversation renders the generation prompt.
        prompt = self._tail_text if gp else Rope.of(self._tail_of(self._marked, self._runs, True))
        tail = self._after_run(marked, run)
        shadow = None
        if self.track_drift is True:
            if self._shadow is None:  # no runs yet: the tail is the exact full render
                shadow = self._plan(self._messages, [recorded, *after], self._tail_text, self._tail_end, None, messages)
            else:
                shadow = self._plan(self._messages, [recorded, *after], self._shadow_text, self._shadow_end, None,
                                    messages)

        # 2. Sessions (in place ones are rebuilt from their old text if a step fails).
        undo: list[tuple[str, Rope]] = [("_tail", self._tail_text)]
        old_messages, old_end = self._messages, self._tail_end
        try:
            new_shadow = self._shadow
            if self.track_drift and new_shadow is None:  # the first run: the tail is the exact full render
                new_shadow = self._tail.fork()
                self._shadow_text = self._tail_text  # (restored below on failure)
            base = self._tail_base()
            if prompt is self._tail_text:  # the live tail is the prompt already: no O(text) comparison
                res = OpResult(self._tail.ids, self._tail.num_tokens, RepairPath.NOOP)
            else:
                res = self._tail.sync(str(prompt))
            new_tail = self._session(str(tail.text))
            deferred = (shadow is not None and new_shadow is self._shadow
                        and self._defers(shadow, base + res.first_changed))
            if shadow is not None and not deferred:
                assert new_shadow is not None
                if new_shadow is self._shadow:
                    undo.append(("_shadow", self._shadow_text))
                    self._catch_up()
                shadow_changed, shadow_repair = self._shadow_edit(new_shadow, shadow)
        except BaseException:
            if self._shadow is None:
                self._shadow_text = _EMPTY
            self._undo(undo)
            raise

        # 3. Commit (nothing below can fail).
        first = base + res.first_changed
        self._equal_upto = min(self._equal_upto, first)
        if self._all is None:
            # Room for this op's run and new tail, and for later turns: a long prompt's first run
            # then copies its IDs once, not again when the tail is appended.
            n = self._tail.num_tokens + len(kept) + new_tail.num_tokens
            self._all = GrowableU32(capacity=n + spare_room(n, 4096))
            self._all.assign(self._tail.ids)
        else:
            self._all.replace(first, self._all.n, self._tail.ids[res.first_changed:])
        self._seg_texts.append(prompt)
        self._prefix = self._prefix.concat(prompt).concat(run.text)  # (pieces shared, not joined)
        self._seg_sessions.append(self._tail)
        self._seg_starts.append(base)
        self._run_starts.append(self._all.n)
        self._run_chars.append((self._run_chars[-1] if self._run_chars else 0) + len(prompt) + len(run.text))
        self._all.replace(self._all.n, self._all.n, kept)
        self._runs = runs
        self._set_messages(messages, marked, len(self._messages))
        self._tail, self._tail_text, self._tail_end = new_tail, tail.text, tail.end
        self._all.replace(self._all.n, self._all.n, self._tail.ids)
        if self.track_drift == DRIFT_ON_READ:
            if self._shadow is None:
                self._shadow, self._shadow_end = new_shadow, old_end
            self._left_behind(old_messages, first, full=False)
        elif shadow is not None:
            if deferred:
                self._defer(shadow)
            else:
                self._shadow = new_shadow
                if shadow_repair is not RepairPath.NOOP:
                    self._equal_upto = min(self._equal_upto, shadow_changed)
            self._shadow_text, self._shadow_end = shadow.text, shadow.end
        return self._result(first, run.message_index, ConversationPath.GENERATED, res.path,
                            windowed=tail.windowed)

    def fork(self) -> "Conversation":
        """An independent conversation with this one's state (frozen segments shared, the live ones
        copied): rollouts branching from a shared prefix."""
        new = Conversation.__new__(Conversation)
        new.tokenizer, new.template, new.match = self.tokenizer, self.template, self.match
        new.add_generation_prompt, new.render_kwargs = self.add_generation_prompt, self.render_kwargs
        new.track_drift, new.incremental = self.track_drift, self.incremental
        new.probe_in_background = self.probe_in_background
        new.render_stats = RenderStats()
        new._stop_texts, new._full_path, new._junction = self._stop_texts, self._full_path, self._junction
        new._fast_path, new._locality = self._fast_path, self._locality
        new._memo = self._memo.copy(both=new._render_both)  # the parent's renders serve the fork's first op
        new._scheme = self._scheme
        # Stored dicts and views are never mutated in place: the lists are copied, not the messages.
        new._messages, new._marked, new._views = list(self._messages), list(self._marked), list(self._views)
        new._views_tuple = self._views_tuple
        new._roles = {role: list(where) for role, where in self._roles.items()}
        new._runs, new._marker_base = list(self._runs), self._marker_base
        new._seg_texts, new._seg_sessions = list(self._seg_texts), list(self._seg_sessions)
        new._seg_starts, new._run_starts = list(self._seg_starts), list(self._run_starts)
        new._run_chars = list(self._run_chars)
        new._bound, new._prefix = self._bound, self._prefix
        new._tail, new._tail_text, new._tail_end = self._tail.fork(), self._tail_text, self._tail_end
        new._all = None
        if self._all is not None:
            new._all = GrowableU32(capacity=self._all.n + spare_room(self._all.n, 4096))  # (its next op's room)
            new._all.assign(self._all.view())
        new._shadow = self._shadow.fork() if self._shadow is not None else None
        new._shadow_text, new._shadow_end = self._shadow_text, self._shadow_end
        new._equal_upto = self._equal_upto
        new._drift_guard, new._shadow_lag = self._drift_guard, self._shadow_lag
        new._drift_synced, new._drift_full = self._drift_synced, self._drift_full  # (a list never changed)
        new._pending_first = self._pending_first
        return new

    def state(self) -> ConversationState:
        """This conversation's state, detached (O(messages): the messages and sampled IDs are
        shared, both immutable); `replay` makes a conversation with the same IDs from it."""
        return ConversationState(self.template, self.render_kwargs, self.match, self.add_generation_prompt,
                                 self._stop_texts, self.track_drift, self.incremental, tuple(self._messages),
                                 tuple((run.message_index, run.sampled) for run in self._runs))

    @classmethod
    def replay(cls, tokenizer: FrozenTokenizer, state: ConversationState, *,
               full_path: FullPath | None = None, probe_in_background: bool = False) -> "Conversation":
        """A conversation equal to the one `state` was taken from: its messages appended and its
        runs pinned in order (each run with its recorded message), so its IDs, text, drift and
        messages are the same by the definition above (what led there, set_messages branches and
        rollbacks included, leaves nothing else behind).  One render and encode of the whole
        conversation, plus one windowed op per run (with the messages up to the next run, `then`):
        a session start's cost, not a repair's.  The drift reference is built once at the end (one
        full render and encode), not kept up to date op by op.  `probe_in_background`: the
        conversation's setting after the replay (see the class)."""
        conv = cls(tokenizer, state.template, match=state.match, add_generation_prompt=state.add_generation_prompt,
                   stop_texts=state.stop_texts, full_path=full_path, track_drift=False,
                   incremental=state.incremental, **state.render_kwargs)
        messages, at = state.messages, 0
        ends = [index for index, _ in state.runs[1:]] + [len(messages)]
        for (index, sampled), end in zip(state.runs, ends):
            if not at <= index < end or messages[index].get("role") != "assistant":
                raise InvalidConversationOp(f"a pinned run at message {index} needs an assistant message there, "
                                            f"after message {at} (the state holds {len(messages)} messages)")
            if index > at:
                conv.append_messages(messages[at:index])
            # the messages up to the next run come with it: one render and repair per run
            conv.append_generated(sampled, message=messages[index], then=messages[index + 1:end])
            at = end
        if at < len(messages):
            conv.append_messages(messages[at:])
        conv.track_drift = check_drift_mode(state.track_drift)
        # (the replay itself probes inline: one op per run, each a full render while a probe waited)
        conv.probe_in_background = bool(probe_in_background)
        if conv.track_drift and conv._runs:  # as append_generated keeps it: the exact full render of the messages
            gp = conv.add_generation_prompt
            text = conv._render(conv._messages, gp)
            conv.render_stats.full += 1
            conv._shadow, conv._shadow_text = conv._session(text), Rope.of(text)
            conv._shadow_end = None if gp else len(text)
            conv._equal_upto = 0
            conv._drift_guard = conv._shadow_lag = None
        return conv

    # -- internals -----------------------------------------------------------------------------
    def _apply(self, merged: list[dict], d: int, branched_at: int | None, *,
               rollback: bool = False) -> ConversationResult:
        """Make the stored list `merged`, whose first `d` messages are the stored ones.

        Three phases, so that an op either happens whole or not at all: every render (nothing
        changes), the session edits (a session edited in place is rebuilt from its old text if any
        step fails), then the commit of the new state (nothing there can fail)."""
        keep = bisect.bisect_left(self._runs, d, key=lambda run: run.message_index)  # runs are in message order
        runs = self._runs[:keep]
        dropped = len(self._runs) - keep
        marked = [*self._marked[:d], *merged[d:]]
        # An append (nothing stored changed, no run dropped) may be rendered through a window.
        added = merged[d:] if d == len(self._messages) and not dropped and not rollback else None

        # 1. Renders.
        if dropped:
            old_text, old_end = self._seg_texts[keep], None
        else:
            old_text, old_end = self._tail_text, self._tail_end
        cut = self._cut(runs[-1]) if runs else None
        tail = self._plan(self._marked, added, old_text, old_end, cut, marked, runs)
        shadow = None
        if keep and self.track_drift is True:
            shadow = self._plan(self._messages, added, self._shadow_text, self._shadow_end, None, merged)
        old_messages = self._messages

        # 2. Sessions.
        undo: list[tuple[str, Rope]] = []
        try:
            if dropped:  # the segment before the first dropped run is live again
                session = self._seg_sessions[keep].fork()
                session.fast_path = self._fast_path
            else:
                session = self._tail
                undo.append(("_tail", self._tail_text))
            changed, repair = self._edit(session, old_text, tail)
            # An append after the drift point: the drift reference may wait (`_defers`).
            deferred = (shadow is not None and not dropped and added is not None
                        and self._defers(shadow, self._tail_base() + changed))
            if shadow is not None and not deferred:
                assert self._shadow is not None
                undo.append(("_shadow", self._shadow_text))
                self._catch_up()
                shadow_changed, shadow_repair = self._shadow_edit(self._shadow, shadow)
        except BaseException:
            self._undo(undo)
            raise

        # 3. Commit.
        floor = None
        if dropped:
            floor = self._run_starts[keep]
            if self._all is not None:
                self._all.n = floor
            del self._seg_texts[keep:], self._seg_sessions[keep:], self._seg_starts[keep:], self._run_starts[keep:]
            del self._run_chars[keep:]
            self._prefix = self._prefix.replace_from(self._run_chars[-1] if self._run_chars else 0, "")
            self._runs = runs
        if tail.edit is None:
            grew = str(tail.text).startswith(str(old_text))
        else:
            grew = tail.edit[1].startswith(old_text.slice(tail.edit[0], len(old_text)))
        self._tail, self._tail_text, self._tail_end = session, tail.text, tail.end
        self._set_messages(merged, marked, d)
        base = self._tail_base()
        first = base + changed if repair is not RepairPath.NOOP else self.num_tokens
        if floor is not None:
            first = min(first, floor)
        if not keep:  # text-only again: the tail is the exact full render
            self._all, self._shadow, self._shadow_text, self._shadow_end = None, None, _EMPTY, 0
            self._drift_guard = self._shadow_lag = None
            self._drift_synced, self._drift_full, self._pending_first = None, False, _NEVER
        else:
            assert self._all is not None
            self._all.replace(base + changed, self._all.n, self._tail.ids[changed:])
            self._equal_upto = min(self._equal_upto, first)
            if self.track_drift == DRIFT_ON_READ:
                self._left_behind(old_messages, first, full=added is None)
            elif shadow is not None:
                if deferred:
                    self._defer(shadow)
                elif shadow_repair is not RepairPath.NOOP:
                    self._equal_upto = min(self._equal_upto, shadow_changed)
                self._shadow_text, self._shadow_end = shadow.text, shadow.end
        if rollback:
            path = ConversationPath.ROLLBACK
        elif branched_at is not None or dropped:
            path = ConversationPath.BRANCH
        elif repair is RepairPath.NOOP:
            path = ConversationPath.NOOP
        else:
            path = ConversationPath.APPEND if grew else ConversationPath.EDIT
        return self._result(first, d, path, repair, branched_at, dropped, windowed=tail.windowed)

    def _plan(self, old: list[dict], added: list[dict] | None, stored: Rope, end: int | None,
              cut: Callable[[str], int | None] | None, new: list[dict],
              runs: list[GeneratedRun] | None = None) -> _Text:
        """The new text of one session (the live tail when `runs` is given, else the drift
        reference): `added` appended to `old` through a window when allowed and every check
        passes, else everything rendered (`new` marked with `runs`)."""
        got = self._windowed(old, added, stored, end, cut)
        if got is not None:
            self.render_stats.windowed += 1
            return _Text(stored.replace_from(got.start, got.text), got.end, (got.start, got.text), True)
        self.render_stats.full += 1
        gp = self.add_generation_prompt
        text = self._tail_of(new, runs, gp) if runs is not None else self._render(new, gp)
        return _Text(Rope.of(text), None if gp else len(text))

    def _windowed(self, old: list[dict], added: list[dict] | None, stored: Rope, end: int | None,
                  cut: Callable[[str], int | None] | None) -> Appended | None:
        if not (self.incremental and added and old):
            return None
        gp = self.add_generation_prompt
        # A renderer that appends exactly by construction (harmony's assembly) goes first.
        got = self._bound.append(old, added, stored, end, gp, cut)
        if got is not None:
            return got
        # The scheme that served last first: a template whose state only the state head fixes
        # (DeepSeek V3) then does not fail the plain head's checks on every op.
        for scheme in self.locality.schemes_for(added, self._scheme, wait=not self.probe_in_background):
            got = render_window.append(self._render, old, added, stored, end, gp, gp, cut, self._memo, self._roles,
                                       scheme)
            if got is not None:
                self._scheme = scheme
                return got
        return None

    def _after_run(self, marked: list[dict], run: GeneratedRun) -> _Text:
        """The tail after pinning `run` (its marker message is `marked[len(self._marked)]`, the
        messages after it follow the run): through a window when allowed, else the full render
        of the marked messages."""
        gp = self.add_generation_prompt
        cut = self._cut(self._runs[-1]) if self._runs else None
        got = self._windowed(self._marked, marked[len(self._marked):], self._tail_text, self._tail_end, cut)
        if got is not None:
            at = self._cut(run)(got.text)
            if at is not None and got.end - got.start - at >= 0:
                self.render_stats.windowed += 1
                return _Text(Rope.of(got.text[at:]), got.end - got.start - at, None, True)
        self.render_stats.full += 1
        text = self._tail_of(marked, [*self._runs, run], gp)
        return _Text(Rope.of(text), None if gp else len(text))

    def _edit(self, session: Session, old: Rope, new: _Text) -> tuple[int, RepairPath]:
        """Make `session`'s text (`old`) `new.text`: the windowed edit as one `Session.edit` near the
        end (no whole-text comparison), else `_sync`."""
        if new.edit is None:
            return _sync(session, str(old), str(new.text))
        start, text = new.edit
        same = _common_prefix(old.slice(start, len(old)), 0, text)  # the old generation prompt usually starts it
        res = session.edit(start + same, len(old), text[same:])
        return res.first_changed, res.path

    def _undo(self, undo: list[tuple[str, Rope]]) -> None:
        # A session that raised mid-edit may hold a half-made state: rebuild it from its old text
        # (a text segment's IDs are the reference encoding of its text by definition).
        for attr, text in undo:
            setattr(self, attr, self._session(str(text)))
            if attr == "_shadow":  # rebuilt from its text as it was: in step with it, no guard known
                self._shadow_lag = self._drift_guard = None

    def _set_messages(self, messages: list[dict], marked: list[dict], d: int) -> None:
        """Store `messages` (the first `d` are the stored ones) and their marked twins and views."""
        del self._views[d:]  # (views of messages[d:] are made when `messages` is read)
        self._views_tuple = None
        for where in self._roles.values():
            del where[bisect.bisect_left(where, d):]
        for i in range(d, len(messages)):
            self._roles.setdefault(str(messages[i].get("role")), []).append(i)
        self._messages, self._marked = messages, marked

    def _result(self, first: int, message: int, path: ConversationPath, repair: RepairPath,
                branched_at: int | None = None, dropped: int = 0, *, windowed: bool = False) -> ConversationResult:
        eager = self.track_drift is True
        return ConversationResult(self.ids, first, message, self._drift() if eager else None, path, repair,
                                  branched_at, dropped, self._parts(), drift_tracked=eager, windowed=windowed)

    def _parts(self) -> tuple[Rope, ...]:
        # O(1): both ropes are immutable, so a result keeps the text of its op.
        return (self._prefix, self._tail_text) if self._runs else (self._tail_text,)

    def _tail_base(self) -> int:
        if not self._runs:
            return 0
        return self._run_starts[-1] + len(self._runs[-1].ids)

    def _session(self, text: str) -> Session:
        session = Session(self.tokenizer, text, full_path=self._full_path)
        session.fast_path = self._fast_path
        return session

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        if not messages:
            return ""
        return self._bound(messages, add_generation_prompt)

    def _render_both(self, messages: list[dict]) -> tuple[str, str] | None:
        """`_render(messages, True)` and `_render(messages, False)` from one render, when the template
        proves that possible (`chat.BoundTemplate.both`), else None."""
        return self._bound.both(messages) if messages else None

    def _tail_of(self, marked: list[dict], runs: list[GeneratedRun], add_generation_prompt: bool) -> str:
        """The text after the last run (the whole render without runs), per the TITO definition;
        `marked` holds each run's marker message."""
        text = self._render(marked, add_generation_prompt)
        if not runs:
            return text
        return text[self._after(text, runs[-1]):]

    def _cut(self, run: GeneratedRun) -> Callable[[str], int | None]:
        """Where the text after `run` starts in a render holding its marker (None: not exactly once)."""
        def cut(text: str) -> int | None:
            try:
                return self._after(text, run)
            except JunctionUnavailable:
                return None
        return cut

    def _after(self, text: str, run: GeneratedRun) -> int:
        at = text.find(run.marker)
        if at < 0 or text.find(run.marker, at + 1) >= 0:
            raise JunctionUnavailable(
                f"chat template {self.template.name!r} renders the generated assistant turn at message "
                f"{run.message_index} {'not at all' if at < 0 else 'more than once'}, so its sampled IDs have no "
                "single place in the text; use text messages (set_messages) for this template")
        pos = at + len(run.marker)
        junction = self.junction
        if run.stop is not None and not junction.stop_is_start:
            for stop in (run.stop, *junction.stops):
                if text.startswith(stop, pos):
                    return pos + len(stop)
        return pos

    def _drift(self) -> int | None:
        if self._shadow is None or self._all is None:
            return None
        if self._drift_synced is not None:
            self._catch_up_drift()
        if self._shadow_lag is not None:  # deferred edits: only while the guard of the drift point holds
            assert self._drift_guard is not None
            return self._drift_guard[0]
        a, b = self._all.view(), self._shadow.ids
        at = _first_mismatch(a, b, min(self._equal_upto, len(a), len(b)))
        self._equal_upto = min(len(a), len(b)) if at is None else at
        if at is None or at >= min(len(a), len(b)):
            self._drift_guard = None
        elif self._drift_guard is None or self._drift_guard[0] != at:
            self._drift_guard = self._guard(at)
        return at

    # -- the drift reference left behind (track_drift="on_read") -------------------------------
    def _left_behind(self, synced: list[dict], first: int, *, full: bool) -> None:
        """Note an op that left the drift reference behind: `synced` the real messages before it,
        `first` the live IDs' first changed token, `full`: not an append at the end of the list."""
        if self._drift_synced is None:
            self._drift_synced = synced
        self._drift_full = self._drift_full or full
        self._pending_first = min(self._pending_first, first)

    def _catch_up_drift(self) -> None:
        """Bring the drift reference in step with the messages: the ops since it last was are
        one plan (appended messages through a window when allowed, else everything rendered and
        diffed) and one edit, waiting as an eager op's would past a guarded drift point.  A
        failure (the template refusing the real messages, which the op itself did not render)
        leaves it behind as it was, and raises."""
        synced = self._drift_synced
        assert synced is not None and self._shadow is not None
        messages = self._messages
        if not self._drift_full and len(synced) == len(messages):  # only appends of nothing since
            self._drift_synced, self._pending_first = None, _NEVER
            return
        added = None if self._drift_full or len(synced) > len(messages) else messages[len(synced):]
        plan = self._plan(synced, added, self._shadow_text, self._shadow_end, None, messages)
        deferred = self._defers(plan, self._pending_first)
        if not deferred:
            old = self._shadow_text
            try:
                self._catch_up()
                changed, repair = self._shadow_edit(self._shadow, plan)
            except BaseException:
                self._undo([("_shadow", old)])  # (`_catch_up` may have run: rebuilt from the text it lagged)
                raise
        if deferred:
            self._defer(plan)
        elif repair is not RepairPath.NOOP:
            self._equal_upto = min(self._equal_upto, changed)
        self._shadow_text, self._shadow_end = plan.text, plan.end
        self._drift_synced, self._drift_full, self._pending_first = None, False, _NEVER

    # -- the drift reference after the drift point -------------------------------------------
    def _guard(self, d: int) -> tuple[int, int] | None:
        """(d, c): a character c of the drift reference such that an edit of it starting at c or
        later leaves its tokens up to d as they are, or None.  c is past a stable boundary t after
        token d (`boundaries.stable_char_positions`: a synchronizing boundary no literal spans)
        by the longest literal: the characters at t stay, so does every literal occurrence near
        it, and the tokens before t (d among them) are those of any text that starts the same
        up to c.  The shadow is in step with its text here."""
        shadow = self._shadow
        assert shadow is not None and self._shadow_lag is None
        end = shadow._raw_start(d + 1)  # byte where token d ends
        if end is None:
            return None
        raw = shadow._text
        at = end if shadow._ascii else len(bytes(raw[:end]).decode("utf-8", "replace"))  # (once per drift point)
        span = max(self.tokenizer.literals.max_len if self.tokenizer.literals else 0, 1)
        window = self._shadow_text.slice(at, min(len(self._shadow_text), at + 2 * span + 512))
        for q in stable_char_positions(self.tokenizer, window).tolist():
            if span <= q and q + span <= len(window):
                return d, at + q + span
        return None

    def _defers(self, shadow: _Text, first_live: int) -> bool:
        """Whether this op's edit of the drift reference may wait: a drift point d is guarded, the
        live IDs change only after it, and the reference's edit starts at the guard or later (its
        tokens up to d stay: the drift is still d)."""
        guard = self._drift_guard
        # (in step: the guard is of the drift the last op reported, `_equal_upto` = d)
        return (guard is not None and shadow.edit is not None and first_live > guard[0]
                and shadow.edit[0] >= guard[1] and (self._shadow_lag is not None or self._equal_upto == guard[0]))

    def _defer(self, shadow: _Text) -> None:
        assert shadow.edit is not None
        start = shadow.edit[0]
        self._shadow_lag = start if self._shadow_lag is None else min(self._shadow_lag, start)

    def _catch_up(self) -> None:
        """Apply the deferred edits of the drift reference (one edit from the earliest)."""
        lag = self._shadow_lag
        if lag is None:
            return
        shadow = self._shadow
        assert shadow is not None
        res = shadow.edit(lag, shadow.num_chars, self._shadow_text.slice(lag, len(self._shadow_text)))
        self._shadow_lag = None
        if res.path is not RepairPath.NOOP:
            self._equal_upto = min(self._equal_upto, res.first_changed)

    def _shadow_edit(self, session: Session, new: _Text) -> tuple[int, RepairPath]:
        """`_edit` of the drift reference (in step with `_shadow_text`); a guard the edit may
        reach is dropped."""
        guard = self._drift_guard
        if guard is not None and (new.edit is None or new.edit[0] < guard[1]):
            self._drift_guard = None
        return self._edit(session, self._shadow_text, new)


_EMPTY = Rope.of("")


def _text_nbytes(parts: tuple[Rope, ...]) -> int:
    """The joined parts' size as a str: all their characters at the widest part's width."""
    width = max((p.nbytes // len(p) for p in parts if len(p)), default=1)
    return sum(len(p) for p in parts) * width


def _sync(session: Session, old: str, new: str) -> tuple[int, RepairPath]:
    """Make `session`'s text (`old`) `new`: one `Session.sync`, or the edits of
    `text_diff.edit_script` applied last to first when the change is several separate ones
    (each repaired in its own window).  Returns (a lower bound of the first changed token index,
    the costliest repair path taken)."""
    edits = edit_script(old, new) if session.tokenizer.spliceable else [(0, len(old), new)]
    if len(edits) <= 1:
        res = session.sync(new)
        return res.first_changed, res.path
    first, paths = session.num_tokens, set()
    for start, end, text in reversed(edits):
        res = session.edit(start, end, text)
        first = min(first, res.first_changed)
        paths.add(res.path)
    for path in (RepairPath.FULL, RepairPath.WIDENED, RepairPath.FIRST_WINDOW):
        if path in paths:
            return first, path
    return first, RepairPath.NOOP


def _common_prefix(old: str, start: int, text: str) -> int:
    """How many leading characters of `text` equal old[start:] (slices compared in C)."""
    return match_forward(old, start, text, 0, min(len(old) - start, len(text)))


def _resolve_template(tokenizer: FrozenTokenizer, template: chat.Renderer | str | None) -> chat.Renderer:
    if template is None:
        return chat.template_for(tokenizer)
    if isinstance(template, chat.Renderer):
        return template
    if isinstance(template, str):
        if template in chat.template_names():
            return chat.template_for(template)
        return ChatTemplate(template)
    raise InvalidChatInput(f"template must be a ChatTemplate (or HarmonyTemplate), a registered name "
                           f"{chat.template_names()}, a Jinja "
                           f"string or None, got {type(template).__name__}")


class _JunctionCell:
    """A conversation's junction, derived on first use (`Conversation.junction`) and shared by
    the conversation and its forks (same template, tokenizer, stop texts and render arguments),
    so that rollouts forked from one prompt probe the template once, not once each (~0.7 ms)."""

    __slots__ = ("junction",)

    def __init__(self) -> None:
        self.junction: Junction | None = None


def _prepare(messages: Sequence[Mapping[str, Any]]) -> list[dict]:
    prepared = chat.prepare_messages(messages)
    for i, message in enumerate(prepared):
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidChatInput(f"message {i} has no role (a non-empty string such as 'user'): {message!r:.120}")
    return prepared


def _refuse(self: Any, *args: Any, **kwargs: Any) -> None:
    raise TypeError("Conversation.messages are read-only: change a copy (dict(m), copy.deepcopy(m)) and pass it "
                    "to set_messages")


class _ReadOnlyDict(dict):
    """A stored message as callers see it: equal to (and JSON-encoded like) the dict it is; changes
    are refused; copies, deep copies and pickles are plain dicts."""

    __slots__ = ()
    __setitem__ = __delitem__ = __ior__ = clear = pop = popitem = setdefault = update = _refuse

    def copy(self) -> dict:
        return dict(self)

    def __copy__(self) -> dict:
        return dict(self)

    def __deepcopy__(self, memo: dict) -> dict:
        return {k: copy.deepcopy(v, memo) for k, v in self.items()}

    def __reduce_ex__(self, protocol: Any) -> Any:
        return dict, (dict(self),)


class _ReadOnlyList(list):
    """A list inside a stored message (tool calls, content parts): read-only like `_ReadOnlyDict`."""

    __slots__ = ()
    __setitem__ = __delitem__ = __iadd__ = __imul__ = append = extend = insert = pop = remove = clear = _refuse
    sort = reverse = _refuse

    def copy(self) -> list:
        return list(self)

    def __copy__(self) -> list:
        return list(self)

    def __deepcopy__(self, memo: dict) -> list:
        return [copy.deepcopy(v, memo) for v in self]

    def __reduce_ex__(self, protocol: Any) -> Any:
        return list, (list(self),)


def _frozen(value: Any) -> Any:
    """A read-only view of a prepared message (containers rebuilt once; strings and numbers shared)."""
    if isinstance(value, dict):
        return _ReadOnlyDict((k, _frozen(v)) for k, v in value.items())
    if isinstance(value, list):
        return _ReadOnlyList(_frozen(v) for v in value)
    return value  # str, int, float, bool, None, and tuples of those (prepared values are immutable)


def _checked_ids(ids: Any, tokenizer: FrozenTokenizer) -> tuple[np.ndarray, bytes]:
    """(`ids` as a uint32 array, their bytes concatenated); `InvalidTokenIds` unless every id is
    one the tokenizer assigned (in range, and not a gap: `TokenTable` gives unassigned ids no
    bytes).  The native engine checks and joins in one compiled pass; the checks below name
    the offending ids."""
    vocab = len(tokenizer.table)
    try:
        arr = np.asarray(ids)
    except (TypeError, ValueError) as exc:
        raise InvalidTokenIds(f"sampled IDs must be a 1-D sequence of integers ({exc})") from None
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise InvalidTokenIds(f"sampled IDs must be a 1-D sequence of integers, not {arr.ndim}-D {arr.dtype}")
    # (a wider integer type is range-checked before the cast: 2**32 + 5 would wrap to id 5)
    if arr.size and arr.dtype != np.uint32:
        _check_range(int(arr.min()), int(arr.max()), vocab)
    out = np.ascontiguousarray(arr, dtype=np.uint32)
    native = tokenizer.native
    data = native.joined(out) if native is not None else None
    if data is not None:
        return out, data
    if out.size:
        _check_range(0, int(out.max()), vocab)
        holes = tokenizer.token_len[out] == 0
        if holes.any():
            bad_ids = np.unique(out[holes])
            shown = ", ".join(str(i) for i in bad_ids[:8].tolist()) + (", ..." if len(bad_ids) > 8 else "")
            raise InvalidTokenIds(f"sampled ID(s) {shown} are unassigned in {tokenizer.name} (gaps in its id range: "
                                  "no token has them): were they sampled with another tokenizer?")
    return out, b"".join(map(tokenizer.token_bytes.__getitem__, out.tolist()))  # (no Python frame per ID)


def _check_range(lo: int, hi: int, vocab: int) -> None:
    if lo < 0 or hi >= vocab:
        bad = lo if lo < 0 else hi
        raise InvalidTokenIds(f"sampled ID {bad} is outside the tokenizer's {vocab} ids (0..{vocab - 1}): were they "
                              "sampled with another tokenizer?")


def _split_stop(tokenizer: FrozenTokenizer, junction: Junction, sampled: np.ndarray,
                data: bytes) -> tuple[str | None, np.ndarray]:
    """(the stop text the run ends with or None, the IDs to keep); `data`: the run's bytes.  With a
    stop-is-start template the tokens spelling the trailing stop are dropped; if they do not end
    exactly where the stop text begins, the run is kept whole and counts as truncated."""
    stop = junction.stop_of(data)
    if stop is None or not junction.stop_is_start:
        return stop, sampled
    need, k, lens = len(stop.encode("utf-8")), len(sampled), tokenizer.token_len
    while k > 0 and need > 0:
        need -= int(lens[sampled[k - 1]])
        k -= 1
    if need != 0:
        return None, sampled
    return stop, sampled[:k]


def _readonly(ids: np.ndarray) -> np.ndarray:
    out = np.array(ids, dtype=np.uint32)
    out.setflags(write=False)
    return out


def _first_mismatch(a: np.ndarray, b: np.ndarray, lo: int) -> int | None:
    """First index >= lo where a and b differ (a length difference counts), None if equal.
    Doubling chunks: the work is proportional to how far the answer lies from lo."""
    m = min(len(a), len(b))
    if lo < m and a[lo:m].tobytes() == b[lo:m].tobytes():
        lo = m  # the usual answer (an op's new IDs equal the reference's): one memcmp, 0.4-1.2 us
    i, chunk = lo, 256
    while i < m:
        hi = min(m, i + chunk)
        d = np.flatnonzero(a[i:hi] != b[i:hi])
        if len(d):
            return i + int(d[0])
        i, chunk = hi, chunk * 2
    return None if len(a) == len(b) else m
