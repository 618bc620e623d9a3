"""A Miles-style token-in-token-out (TITO) baseline: a pre-tokenized prefix plus tokenized deltas.

This module owns the baseline that RL rollout frameworks use instead of re-tokenizing the whole
conversation: the prompt IDs of the previous call and the sampled IDs are kept as they are, and
each call tokenizes only the messages appended since.  It is modelled on Miles' ``TITOTokenizer``
(radixark/miles, ``miles/utils/chat_template_utils/tito_tokenizer.py``, read for this model; no
code copied), which SGLang's native TITO on chat completions follows:

1. **Message level.**  The client sends the whole message list each call; the stored list must be
   a prefix of it, compared on the keys a template reads (role, content, reasoning_content,
   tool_calls; ``None``, ``""`` and ``[]`` count as equal), and appended roles must be allowed.
   Miles raises ``ValueError`` otherwise: :class:`NotAppendOnly` here.
2. **Template level.**  Only the appended messages are rendered.  Miles renders them after a
   synthetic two-message prefix, ``[dummy system, dummy assistant]`` (the dummy assistant carries
   the stored assistant's tool calls and a one-space reasoning), and tokenizes the text that the
   appended messages and the generation prompt add to it; when the longer render does not extend
   the shorter one it raises ``ValueError("rendered suffix diff failed")``: :class:`RenderNotPrefix`.
   ``delta="dummy"`` (the default) is that.  ``delta="full"`` renders the real stored messages
   instead (render(all) minus render(stored), the prefix check the SGLang reports describe);
   it costs two full renders per call but catches a template that rewrites earlier turns.
3. **Token level (the junction).**  Per-family ``merge_tokens`` overrides, hand-listed, are applied
   where the sampled IDs meet the delta: Qwen3's template writes ``<|im_end|>\\n`` but generation
   stops at ``<|im_end|>``, so the newline's ID is appended to a prefix that ends with it.
   Llama 3.1 and DeepSeek V3 templates write nothing after their stop tokens: no override.

What it does *not* do, because Miles does not: Qwen3's stock template drops earlier ``<think>``
blocks once a new user query arrives, so the exact render is not append-only.  Miles' answer is
to replace the template (its fixed Qwen3 template with ``clear_thinking=False`` keeps every think
block, i.e. it changes what the prompt is).  With the stock template, the dummy-prefix checks
above all pass and the result silently keeps the dropped blocks: its IDs differ from the exact
re-render from the first dropped block on.  With ``delta="full"`` the render check fails there;
``on_mismatch="raise"`` (Miles) raises :class:`RenderNotPrefix`, ``on_mismatch="full"`` renders
and encodes the whole conversation instead (sampled IDs are then re-tokenized, not kept) and
counts it in ``stats["full_fallbacks"]``.

Delta tokenization uses HF ``tokenizers`` (``encode(text, add_special_tokens=False)``, as Miles'
``tokenizer.encode`` does through transformers); the prefix is kept in a growing ``uint32`` numpy
buffer (amortised appends, the result is a view), which is cheaper than Miles' Python-list
concatenation: the baseline is given its strongest form.

>>> import toktier
>>> from toktier.chat import template_for
>>> tok = toktier.load_tokenizer("qwen3")
>>> s = TitoSession(tok, template_for("qwen3"))
>>> msgs = [{"role": "user", "content": "hi"}]
>>> prompt = s.start(msgs)
>>> s.add_completion(tok.encode("Hello!<|im_end|>"), {"role": "assistant", "content": "Hello!"})
>>> ids = s.step(msgs + [{"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "bye"}])
>>> from toktier.chat import render
>>> text = render(s.messages, template_for("qwen3"), add_generation_prompt=True)
>>> ids.tolist() == tok.encode(text).tolist()
True
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np

from toktier.chat import ChatTemplate

__all__ = ["MERGE_NEWLINE_AFTER_STOP", "NotAppendOnly", "RenderNotPrefix", "TitoSession", "merge_rule"]

_U32 = np.uint32
#: The keys a chat template reads; Miles compares stored and re-sent messages on these only.
TEMPLATE_KEYS = ("role", "content", "reasoning_content", "tool_calls")
#: Miles' synthetic prefix for rendering appended messages.
_DUMMY_SYSTEM = {"role": "system", "content": "dummy system"}
#: Templates whose text after the stop token is one newline (Miles' Qwen3 / Nemotron overrides).
MERGE_NEWLINE_AFTER_STOP = frozenset({"qwen3"})


class NotAppendOnly(ValueError):
    """The re-sent message list does not extend the stored one (Miles raises ValueError)."""


class RenderNotPrefix(ValueError):
    """The render with the appended messages does not extend the render without them."""


def _norm(value: Any) -> Any:
    # None, "" and [] render alike in Jinja (all falsy); clients swap them freely.
    return None if value is None or value == "" or value == [] else value


def _same_message(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    return all(_norm(a.get(k)) == _norm(b.get(k)) for k in TEMPLATE_KEYS)


def merge_rule(tok, template: ChatTemplate) -> tuple[int | None, tuple[int, ...]]:
    """(stop id, ids appended to a prefix that ends with it): the hand-listed per-family override."""
    eos = template.special_tokens.get("eos_token")
    stop = tok.engine._tok.token_to_id(eos) if eos else None
    if template.name in MERGE_NEWLINE_AFTER_STOP:
        return stop, tuple(int(i) for i in tok.encode("\n"))
    return stop, ()


class TitoSession:
    """One rollout's TITO state: stored messages and the IDs of the last prompt plus sampled IDs.

    ``start(messages)`` -> the first prompt (full render + encode); then per call
    ``add_completion(sampled_ids, assistant_message)`` and ``step(all_messages)`` -> the next
    prompt's IDs (a view of the session buffer, valid until the next call).
    """

    def __init__(self, tok, template: ChatTemplate, *, delta: Literal["dummy", "full"] = "dummy",
                 on_mismatch: Literal["raise", "full"] = "raise",
                 allowed_append_roles: Sequence[str] = ("tool", "user", "system", "assistant"),
                 **render_kwargs: Any) -> None:
        if delta not in ("dummy", "full") or on_mismatch not in ("raise", "full"):
            raise ValueError(f"delta must be 'dummy' or 'full', on_mismatch 'raise' or 'full'; "
                             f"got {delta!r}, {on_mismatch!r}")
        self._hf = tok.engine._tok
        self._template = template
        self._kwargs = render_kwargs
        self._delta = delta
        self._on_mismatch = on_mismatch
        self._roles = frozenset(allowed_append_roles)
        self._stop, self._after_stop = merge_rule(tok, template)
        self._buf = np.empty(1 << 16, dtype=_U32)
        self._n = 0
        self.messages: list[Mapping[str, Any]] = []
        self.stats = {"calls": 0, "full_fallbacks": 0, "junction_fixes": 0}

    # -- buffer ------------------------------------------------------------------------------
    def _extend(self, ids) -> None:
        ids = np.asarray(ids, dtype=_U32)
        need = self._n + len(ids)
        if need > len(self._buf):
            grown = np.empty(max(need, 2 * len(self._buf)), dtype=_U32)
            grown[:self._n] = self._buf[:self._n]
            self._buf = grown
        self._buf[self._n:need] = ids
        self._n = need

    def _encode(self, text: str) -> np.ndarray:
        return np.asarray(self._hf.encode(text, add_special_tokens=False).ids, dtype=_U32)

    @property
    def ids(self) -> np.ndarray:
        return self._buf[:self._n]

    # -- ops ---------------------------------------------------------------------------------
    def start(self, messages: Sequence[Mapping[str, Any]]) -> np.ndarray:
        """The first prompt: the whole conversation rendered and encoded."""
        self.messages = list(messages)
        self._n = 0
        self._extend(self._encode(self._render(self.messages, True)))
        return self.ids

    def add_completion(self, sampled_ids, assistant_message: Mapping[str, Any]) -> None:
        """Keep the sampled IDs verbatim; store the message the response parser made of them."""
        self._extend(sampled_ids)
        self.messages.append(assistant_message)

    def step(self, messages: Sequence[Mapping[str, Any]]) -> np.ndarray:
        """The next prompt's IDs for the client's whole message list (append-only)."""
        self.stats["calls"] += 1
        stored = self.messages
        if len(messages) < len(stored):
            raise NotAppendOnly(f"{len(messages)} messages re-sent, {len(stored)} stored")
        for i, old in enumerate(stored):
            if old is not messages[i] and not _same_message(old, messages[i]):
                raise NotAppendOnly(f"message {i} differs from the stored one")
        appended = list(messages[len(stored):])
        bad = [m.get("role") for m in appended if m.get("role") not in self._roles]
        if bad:
            raise NotAppendOnly(f"appended roles {bad} are not allowed after the prefix")
        if self._delta == "dummy":
            last = stored[-1] if stored else {}
            base = [_DUMMY_SYSTEM, {"role": "assistant", "content": "", "reasoning_content": " ",
                                    "tool_calls": last.get("tool_calls") or []}]
        else:
            base = stored
        without = self._render(base, False)
        with_new = self._render(base + appended, True)
        if not with_new.startswith(without):
            if self._on_mismatch == "raise":
                raise RenderNotPrefix(f"rendered suffix diff failed for {[m.get('role') for m in appended]}")
            self.stats["full_fallbacks"] += 1
            self.messages = list(messages)
            self._n = 0
            self._extend(self._encode(self._render(self.messages, True)))
            return self.ids
        if self._after_stop and self._n and self._buf[self._n - 1] == self._stop:
            self._extend(self._after_stop)  # the junction text the model never generates
            self.stats["junction_fixes"] += 1
        self._extend(self._encode(with_new[len(without):]))
        self.messages = list(messages)
        return self.ids

    def _render(self, messages: Sequence[Mapping[str, Any]], generation_prompt: bool) -> str:
        return self._template.render(messages, add_generation_prompt=generation_prompt, **self._kwargs)
