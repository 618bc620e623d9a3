"""Message matching: when a re-sent history is "the same" as the one a conversation holds.

This module owns comparing two message lists under a mode and finding the longest prefix they
share.  Agent harnesses re-serialize what they send (tool-call arguments as a JSON string one
time, a dict the next; `"{}"` for no arguments), so a conversation accepts three modes:

- ``strict``: messages compared as the template sees them (after `toktier.chat`'s preparation:
  None-valued keys dropped, plain JSON types, reasoning aliases filled in);
- ``loose_tool_call``: as strict, except that each tool call's `arguments` are compared as parsed
  JSON (a string holding JSON equals the object it spells; `"{}"`, `""`, `{}`, null and a missing
  `arguments` are all "no arguments");
- ``role_content_only``: only `role` and `content` (a missing content equals None).

>>> a = [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}]
>>> b = [{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}]
>>> common_prefix(a, b, "strict"), common_prefix(a, b, "loose_tool_call")
(0, 1)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from .chat import REASONING_FIELDS
from .errors import InvalidChatInput

MatchMode = Literal["strict", "loose_tool_call", "role_content_only"]
MATCH_MODES: tuple[str, ...] = ("strict", "loose_tool_call", "role_content_only")


def check_mode(mode: str) -> MatchMode:
    if mode not in MATCH_MODES:
        raise InvalidChatInput(f"match={mode!r} is not a matching mode; use one of {list(MATCH_MODES)}")
    return mode  # type: ignore[return-value]


def common_prefix(old: Sequence[Mapping[str, Any]], new: Sequence[Mapping[str, Any]], mode: str) -> int:
    """The number of leading messages `old` and `new` share under `mode` (both already prepared)."""
    key = _KEYS[check_mode(mode)]
    n = min(len(old), len(new))
    for i in range(n):
        if old[i] is not new[i] and key(old[i]) != key(new[i]):
            return i
    return n


def _strict(message: Mapping[str, Any]) -> Any:
    # What the template sees: a reasoning alias counts as the field it aliases.
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    rest = {k: v for k, v in message.items() if k not in REASONING_FIELDS}
    return _freeze(rest), _freeze(reasoning)


def _loose(message: Mapping[str, Any]) -> Any:
    calls = message.get("tool_calls")
    if isinstance(calls, (list, tuple)):
        message = {**message, "tool_calls": [_loose_call(c) for c in calls]}
    return _strict(message)


def _loose_call(call: Any) -> Any:
    if not isinstance(call, Mapping):
        return call
    fn = call.get("function")
    if isinstance(fn, Mapping):
        return {**call, "function": {**fn, "arguments": _parsed(fn.get("arguments"))}}
    if "arguments" in call or "name" in call:  # a flat {"name", "arguments"} call
        return {**call, "arguments": _parsed(call.get("arguments"))}
    return call


def _parsed(arguments: Any) -> Any:
    if isinstance(arguments, str):
        if not arguments.strip():
            arguments = {}
        else:
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return ("unparsed", arguments)  # compared as the string it is
    return _Parsed(_freeze({} if arguments is None else arguments, ordered=False))


@dataclass(frozen=True)
class _Parsed:
    """Tool-call arguments parsed as JSON and frozen (unordered objects)."""

    value: Any


def _role_content(message: Mapping[str, Any]) -> Any:
    return message.get("role"), _freeze(message.get("content"))


def _freeze(value: Any, ordered: bool = True) -> Any:
    # Hashable and type-exact (True != 1, 1 != 1.0 in JSON terms).  Key order counts where the
    # template sees it (`tojson` renders keys in order); parsed JSON objects compare unordered.
    if isinstance(value, _Parsed):
        return value
    if isinstance(value, Mapping):
        items = tuple((k, _freeze(v, ordered)) for k, v in value.items())
        return ("dict", items if ordered else frozenset(items))
    if isinstance(value, (list, tuple)):
        return ("list", tuple(_freeze(v, ordered) for v in value))
    return (type(value).__name__, value)


_KEYS = {"strict": _strict, "loose_tool_call": _loose, "role_content_only": _role_content}
