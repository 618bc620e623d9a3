"""Junctions: what a chat template emits after an assistant turn's content, derived by probing.

This module owns finding, for one template and tokenizer, where a *sampled* assistant turn ends
and the template's own text resumes.  Nothing here is hand-listed per model family: probe
conversations (an assistant turn whose content is a unique marker, then nothing / a user turn /
a tool turn) are rendered through the template, and the text right after the marker is matched
against the stop candidates: the template config's `eos_token`, the caller's extra stop texts
(e.g. a generation_config's extra eos ids, spelled out), and the tokenizer's added-token
literals.

- `stops`: the stop texts a generation may end with.  Qwen3 / ChatML `<|im_end|>`, Llama 3
  `<|eot_id|>`, DeepSeek V3 `<｜end▁of▁sentence｜>`, a MiniMax-like custom EOS `[e~[`.
- `junction`: what the template emits after the stop when the conversation ends there (Qwen3's
  and MiniMax's ``"\\n"``, ``""`` for Llama 3 and DeepSeek).  A generation stops *at* the stop
  token, so this text is never sampled: it is rendered, and tokenized with what follows.
- `stop_is_start`: GLM-style templates emit nothing after an assistant turn; the *next* turn's
  start token (`<|user|>`, `<|observation|>`) is what generation stops at.  Then every start
  token that follows an assistant turn is a stop, the junction is empty, and a sampled turn's
  trailing stop is ambiguous (it may not be the start of the turn that actually follows): a
  conversation strips it and lets the template render the next turn's start.  Only those start
  tokens are stops then: a run ending with the config's eos is kept whole (as a truncated one).
- `bridges`: the text between a message of each role and generated content, as the template
  renders it with the generation prompt (DeepSeek V3 after tool output: ``<｜tool▁outputs▁end｜>``
  instead of ``<｜Assistant｜>``): a diagnostic, the conversation renders prefixes itself.

A stop text that the tokenizer has no single token for (a crafted template's `[e~[` on a
vocabulary without it) is still a stop: a sampled run ends with it when its decoded bytes end
with that text, whatever tokens spell it.

>>> from toktier.chat import ChatTemplate
>>> from toktier import load_tokenizer
>>> t = ChatTemplate("{% for m in messages %}<|im_start|>{{ m.role }}\\n{{ m.content }}<|im_end|>\\n{% endfor %}",
...                  {"eos_token": "<|im_end|>"})
>>> j = derive_junction(t, load_tokenizer("cl100k_base"))
>>> (j.stops, j.junction, j.stop_is_start)
(('<|im_end|>',), '\\n', False)
"""

from __future__ import annotations

import secrets
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .chat import ChatTemplate
from .errors import ChatTemplateError, InvalidChatInput

if TYPE_CHECKING:
    from .registry import FrozenTokenizer


@dataclass(frozen=True)
class Junction:
    """How one template ends an assistant turn (see the module docstring)."""

    stops: tuple[str, ...]  # stop texts, the one the template renders first; () when none was found
    stop_ids: tuple[int | None, ...]  # the single token id of each stop, None when it is several tokens
    junction: str  # text the template emits after the stop at the end of a conversation
    stop_is_start: bool  # the stop is the next turn's start token (GLM style)
    after_content: str  # everything the template emits after the content at the end of a conversation
    bridges: Mapping[str, str] = field(default_factory=dict)  # role -> text between it and generated content
    reason: str | None = None  # why no stop was found, when stops is ()

    def stop_of(self, data: bytes) -> str | None:
        """The stop text `data` (a sampled run's bytes) ends with, or None (a truncated run)."""
        for stop in sorted(self.stops, key=len, reverse=True):  # most specific first
            if data.endswith(stop.encode("utf-8")):
                return stop
        return None


def new_marker(tag: str = "") -> str:
    """A content string no message holds and no template rewrites (letters and digits only:
    `trim`, `tojson` and escaping leave it as is)."""
    return f"TOKTIERMARK{secrets.token_hex(8)}{tag}X"


def derive_junction(template: ChatTemplate, tokenizer: FrozenTokenizer, *, stop_texts: Sequence[str] = (),
                    **render_kwargs: Any) -> Junction:
    """Probe `template` (rendered with `render_kwargs`: tools, enable_thinking, ...) and return its `Junction`."""
    mark = new_marker()
    user, other = f"{mark}U", f"{mark}V"
    literals = dict(tokenizer.table.literal_ids)
    eos = template.special_tokens.get("eos_token")
    # Candidates: the config's eos and the caller's stops first, then added tokens, longest first
    # (a literal whose text starts with a shorter one must win).
    preferred = [s for s in dict.fromkeys((eos, *template.generation_stops, *stop_texts)) if s]
    others = sorted((lit for lit in literals if lit not in preferred), key=len, reverse=True)

    def leading(text: str) -> str | None:
        hits = [c for c in preferred if text.startswith(c)]
        hits += [c for c in others if text.startswith(c)]
        return max(hits, key=len) if hits else None

    def after(messages: list[dict], until: str | None, **kw: Any) -> str | None:
        try:
            text = template.render(messages, **{**render_kwargs, **kw})
        except (ChatTemplateError, InvalidChatInput):
            return None
        if text.count(mark + "A") != 1:
            return None
        start = text.index(mark + "A") + len(mark) + 1
        if until is None:
            return text[start:]
        at = text.find(until, start)
        return text[start:at] if at >= 0 else None

    lead = [{"role": "user", "content": user}]
    assistant = {"role": "assistant", "content": mark + "A"}
    end = after([*lead, assistant], None)
    if end is None:  # some templates want a system message first
        lead = [{"role": "system", "content": f"{mark}S"}, *lead]
        end = after([*lead, assistant], None)
    if end is None:
        return Junction((), (), "", False, "", types.MappingProxyType({}),
                        "the template does not render an assistant turn's content exactly once after a user turn")
    nexts = {role: after([*lead, assistant, {"role": role, "content": other}], other)
             for role in ("user", "tool")}
    bridges = types.MappingProxyType(_bridges(template, lead, mark, render_kwargs))  # shared: read-only

    stop = leading(end)
    if stop is not None:
        junction = end[len(stop):]
        # The turn's own tail is what every following turn starts after: check it.
        consistent = all(n is None or n.startswith(stop) for n in nexts.values())
        # The config's eos and the caller's stops end a generation too, even where the template
        # renders another turn end (the sampled stop then stands for the rendered one).
        stops = [stop] + [s for s in dict.fromkeys(preferred) if s != stop]
        reason = None if consistent else "the stop is not emitted before every following turn"
        return Junction(tuple(stops), tuple(literals.get(s) for s in stops), junction, False, end, bridges, reason)
    starts = [s for s in (leading(n[len(end):]) for n in nexts.values() if n is not None and n.startswith(end)) if s]
    if starts:
        stops = tuple(dict.fromkeys(sorted(starts, key=len, reverse=True)))
        return Junction(stops, tuple(literals.get(s) for s in stops), end, True, end, bridges)
    return Junction((), (), end, False, end, bridges,
                    f"no stop candidate (eos_token {eos!r}, the stop_texts given, the tokenizer's added tokens) "
                    f"follows the assistant content: {end[:40]!r}")


def _bridges(template: ChatTemplate, lead: list[dict], mark: str, kwargs: Mapping[str, Any]) -> dict[str, str]:
    out: dict[str, str] = {}
    probes = {"user": lead,
              "tool": [*lead, {"role": "assistant", "content": f"{mark}C"},
                       {"role": "tool", "content": f"{mark}T"}]}
    for role, messages in probes.items():
        last = messages[-1]["content"]
        try:
            text = template.render(messages, **{**kwargs, "add_generation_prompt": True})
        except (ChatTemplateError, InvalidChatInput):
            continue
        if text.count(last) == 1:
            out[role] = text[text.index(last) + len(last):]
    return out
