"""What every chat renderer shares: the `Renderer` interface a conversation needs, the
preparation of messages (plain JSON types, as transformers prepares them), and the names a
message's reasoning is passed under.

`toktier.chat` (Jinja templates, the template registry) and `toktier.harmony` (gpt-oss's
harmony format) both build on this module; it imports neither.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from .errors import InvalidChatInput

#: Names a message's reasoning is passed under; templates read the first, gpt-oss's `thinking`.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

Messages = Sequence[Mapping[str, Any]]


class Renderer(abc.ABC):
    """What a conversation needs of a chat format: a Jinja `ChatTemplate`, or gpt-oss's harmony
    renderer (`toktier.harmony.HarmonyTemplate`).

    Attributes: `name`, `origin`, `source` (what identifies the renderer: the Jinja source),
    `special_tokens` (named tokens: `eos_token` is the junction probe's first stop candidate),
    `kind` ("jinja" or "harmony": how a conversation record rebuilds it) and `generation_stops`
    (stop texts the format itself declares besides eos).
    """

    kind: ClassVar[str]
    generation_stops: ClassVar[tuple[str, ...]] = ()
    name: str
    origin: str
    source: str
    special_tokens: Mapping[str, str]

    @abc.abstractmethod
    def render(self, messages: Messages, *, add_generation_prompt: bool = False,
               continue_final_message: bool | str = False, tools: Sequence[Mapping[str, Any]] | None = None,
               documents: Sequence[Mapping[str, Any]] | None = None, **kwargs: Any) -> str:
        """The rendered text of `messages`."""

    @abc.abstractmethod
    def render_prepared(self, messages: list[dict], *, add_generation_prompt: bool = False,
                        tools: Sequence[Mapping[str, Any]] | None = None,
                        documents: Sequence[Mapping[str, Any]] | None = None, **kwargs: Any) -> str:
        """`render` of a list `prepare_messages` returned."""

    @abc.abstractmethod
    def bind(self, *, tools: Sequence[Mapping[str, Any]] | None = None,
             documents: Sequence[Mapping[str, Any]] | None = None, **kwargs: Any) -> Any:
        """The renderer with its arguments prepared once: ``bound(messages, add_generation_prompt)``
        renders a prepared list; ``bound.both(messages)`` gives (with the prompt, without it) from
        one render, or None where that is not proven."""

    @abc.abstractmethod
    def generated_message(self, text: str, ids: Sequence[int] | None = None) -> dict:
        """The assistant message a sampled turn's decoded text (without its stop) stands for;
        `ids`: the sampled IDs of that text, where known (a parser may read them instead)."""

    def marker_message(self, recorded: Mapping[str, Any], marker: str) -> dict:
        """The message that stands for a sampled turn (recorded as `recorded`) in the marked
        renders of a token-in conversation: an assistant message whose content is `marker`."""
        return {"role": "assistant", "content": marker}


def prepare_messages(messages: Messages) -> list[dict]:
    """`messages` as every render prepares them (dicts of plain JSON types, None-valued keys
    dropped; reasoning not yet aliased), for keeping and comparing (`toktier.conversation`).
    Unlike `render`, an empty list is allowed; preparing twice changes nothing."""
    if isinstance(messages, (list, tuple)) and len(messages) == 0:
        return []
    return _prepare_messages(messages)


def _prepare_messages(messages: Messages) -> list[dict]:
    """The messages rebuilt from plain JSON types (`_plain`: message objects become dicts on the
    way), top-level None values dropped.  One pass: a token-in turn prepares its messages on
    every op."""
    messages = getattr(messages, "messages", messages)
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise InvalidChatInput(f"messages is a list of message dicts, got {type(messages).__name__}")
    if len(messages) == 0:
        raise InvalidChatInput("cannot render an empty conversation: pass at least one message")
    chat = []
    for message in messages:
        record = type(message) is dict or isinstance(message, Mapping) or _is_record(message)
        plain = _plain(message) if record else None
        if type(plain) is not dict:  # (a model whose dump is not a mapping, too)
            raise InvalidChatInput(f"each message is a dict (or a dataclass / pydantic model), got {message!r}")
        # APIs send `content=None` / `tool_calls=None`; templates handle a missing key, not a None.
        chat.append({k: v for k, v in plain.items() if v is not None})
    return chat


def _is_record(value: Any) -> bool:
    """A dataclass instance or a pydantic-style model (`model_dump`): what `_plain` turns into a dict."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return True
    return callable(getattr(value, "model_dump", None))


#: Exact types `_plain` returns as they are.
_LEAF_TYPES = frozenset({str, int, float, bool})


def _plain(value: Any) -> Any:
    # Everything the sandboxed template sees is rebuilt from plain JSON types: subclasses and
    # rich objects carry methods the sandbox does not know to be unsafe.
    kind = type(value)
    if value is None or kind in _LEAF_TYPES:
        return value
    # The exact containers first: messages are mostly plain dicts, lists and strs, and the
    # `Mapping` check below is an ABC lookup.
    if kind is dict:
        return {k if type(k) is str else _plain(k): _plain(v) for k, v in value.items()}
    if kind is list:
        return [_plain(v) for v in value]
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, np.generic):
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"  # media objects: templates test presence, never read them
