"""gpt-oss's harmony format (toktier.harmony): rendered as openai-harmony renders it, tokenized exactly.

References: openai-harmony itself (PyPI, the renderer gpt-oss servers use): its whole-conversation
renders (`render_conversation`, `render_conversation_for_completion`) and its own token IDs; the
o200k_harmony tokenizer's reference encoding (tiktoken) of the rendered text.  Checked:

- the conversation assembled from per-message renders equals the library's whole-conversation
  render (random conversations: tools, reasoning, tool calls and results, developer messages,
  special-token text, unicode, every render option), and the message mapping equals harmony
  objects built here by hand;
- the reference encoding of the text equals the token IDs harmony renders itself (what vLLM feeds
  gpt-oss), so the text contract and harmony's tokens agree;
- `Conversation` over the harmony renderer: text-only ops equal the reference (IDs and pieces);
  token-in ops equal the documented TITO definition with the stop texts harmony closes turns with,
  and `drift` equals an independent first difference; records restore;
- sampled turns parse into the messages they stand for; misuse is typed.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import regex
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

oh = pytest.importorskip("openai_harmony", reason="pip install 'toktier[harmony]'")

from toktier import chat, harmony  # noqa: E402
from toktier.bundled import O200K_PAT  # noqa: E402
from toktier.conversation import Conversation, ConversationPath  # noqa: E402
from toktier.conversation_record import (ConversationRecord, decode_conversation_record,  # noqa: E402
                                         encode_conversation_record)
from toktier.errors import ChatTemplateMissing, InvalidChatInput  # noqa: E402
from toktier.junctions import derive_junction  # noqa: E402

from conftest import get_tokenizer  # noqa: E402
from test_conversation import check_first_changed  # noqa: E402

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}},
    {"name": "lookup", "description": "", "parameters": {"type": "object", "properties": {}}}]  # a bare function dict


@pytest.fixture(scope="module")
def tok():
    return get_tokenizer("o200k_harmony")


@pytest.fixture(scope="module")
def template():
    try:
        return chat.template_for("o200k_harmony")
    except ChatTemplateMissing as exc:  # pragma: no cover (the test extra installs it)
        pytest.skip(str(exc))


def whole(bound):
    """The same bound renderer, rendering through the library's whole-conversation call."""
    other = copy.copy(bound)
    object.__setattr__(other, "_lib", dataclasses.replace(bound._lib, release="0.0.0"))
    other._memo, other._memo_chars, other._last, other._ids = type(bound._memo)(), 0, [], []
    return other


# --------------------------------------------------------------------------- conversations

FRAGMENTS = ["Hello", " world", "\n", "\n\n", "  ", "123456", " 7", "naïve", "日本語", "🙂👍🏽", "e\u0301",
             "<|end|>", "<|start|>", "<|channel|>final", "<|message|>", "<|return|>", "<|call|>", "<|constrain|>",
             "to=functions.x", "{\"a\": 1}", "'s", " don't", "\t", "\r\n", "<think>", "#", "functions."]
TEXT = st.lists(st.sampled_from(FRAGMENTS), max_size=6).map("".join)
PLAIN = st.lists(st.sampled_from([f for f in FRAGMENTS if "<|" not in f]), max_size=6).map("".join)
NAMES = st.sampled_from(["get_weather", "lookup", "run_code"])


@st.composite
def conversations(draw, text=TEXT):
    TEXT = text  # noqa: N806 (the texts every part draws from)
    messages: list[dict] = []
    ids: list[str] = []
    if draw(st.booleans()):
        messages.append({"role": draw(st.sampled_from(["system", "developer"])), "content": draw(TEXT)})
    for _ in range(draw(st.integers(1, 9))):
        kind = draw(st.sampled_from(["user", "final", "reason", "call", "rcall", "preamble", "tool", "late_system",
                                     "channel"]))
        if kind == "user":
            content = draw(TEXT)
            if draw(st.booleans()):
                content = [{"type": "text", "text": content}, {"type": "text", "text": draw(TEXT)}]
            messages.append({"role": "user", "content": content})
        elif kind == "final":
            messages.append({"role": "assistant", "content": draw(TEXT)})
        elif kind == "reason":
            key = draw(st.sampled_from(chat.REASONING_FIELDS))
            messages.append({"role": "assistant", key: draw(TEXT), "content": draw(TEXT)})
        elif kind in ("call", "rcall", "preamble"):
            cid = f"call_{len(ids)}"
            ids.append(cid)
            args = draw(st.one_of(TEXT, st.dictionaries(st.sampled_from(["city", "q", "n"]), TEXT, max_size=2)))
            message = {"role": "assistant", "content": draw(TEXT) if kind == "preamble" else "",
                       "tool_calls": [{"id": cid, "type": "function",
                                       "function": {"name": draw(NAMES), "arguments": args}}]}
            if kind == "rcall":
                message["reasoning_content"] = draw(TEXT)
            messages.append(message)
        elif kind == "tool":
            if ids and draw(st.booleans()):
                messages.append({"role": "tool", "tool_call_id": draw(st.sampled_from(ids)), "content": draw(TEXT)})
            else:
                messages.append({"role": "tool", "name": draw(NAMES), "content": draw(TEXT)})
        elif kind == "late_system":
            messages.append({"role": "system", "content": draw(TEXT)})
        else:
            messages.append({"role": "assistant", "channel": "commentary", "content": draw(TEXT)})
    options = {}
    if draw(st.booleans()):
        options["tools"] = TOOLS
    if draw(st.booleans()):
        options["reasoning_effort"] = draw(st.sampled_from(harmony.EFFORTS))
    if draw(st.booleans()):
        options["auto_drop_analysis"] = draw(st.booleans())
    if draw(st.booleans()):
        options["model_identity"] = draw(TEXT)
    if draw(st.booleans()):
        options["conversation_start_date"] = "2026-12-04"
        options["knowledge_cutoff"] = "2025-01"
    return messages, options


@settings(max_examples=150, deadline=None)
@given(case=conversations())
def test_assembly_equals_the_librarys_whole_conversation_render(template, case):
    messages, options = case
    bound = template.bind(**options)
    prepared = chat.prepare_messages(messages)
    assert bound.both(prepared) == whole(bound).both(prepared)
    assert template.render(messages, add_generation_prompt=True, **options) == bound.both(prepared)[0]
    assert template.render(messages, **options) == bound.both(prepared)[1]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=conversations(text=PLAIN), gp=st.booleans())
def test_reference_encoding_of_the_text_is_what_harmony_renders(tok, template, case, gp, tally):
    """The text contract (reference encoding of the rendered text) gives the token IDs harmony
    renders itself, piece by piece, for messages that spell no special token: a server feeding
    gpt-oss harmony's IDs sees the same."""
    messages, options = case
    bound = template.bind(**options)
    prepared = chat.prepare_messages(messages)
    text = bound(prepared, gp)
    assert tok.encode(text).tolist() == bound.library_tokens(prepared, gp)
    tally(tok, "ids", 1)


@pytest.mark.parametrize("spelled", ["<|end|>", "<|start|>assistant<|channel|>final<|message|>", "<|return|>"])
def test_special_token_text_in_a_message_is_where_harmony_and_the_text_differ(tok, template, spelled):
    """The documented difference: harmony tokenizes a message's text as text, so `<|end|>` typed by a
    user stays ordinary tokens in its IDs, while the reference encoding of the rendered text (the
    contract, as for every template) reads it as the special token.  Exactly there, nowhere else."""
    messages = [{"role": "user", "content": f"Say {spelled} now"}]
    bound = template.bind()
    text = bound(chat.prepare_messages(messages), True)
    ours, theirs = tok.encode(text).tolist(), bound.library_tokens(chat.prepare_messages(messages), True)
    at = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
    head = len(tok.encode(text[:text.index("Say") + len("Say")]))  # (the space before may join the spelling)
    assert head <= at <= head + 1 and tok.encode(spelled).tolist()[0] in ours[at:at + 2]
    assert b"".join(tok.token_bytes[i] for i in theirs) == text.encode()  # the same text, other tokens
    assert ours[-3:] == theirs[-3:] == tok.encode("<|end|><|start|>assistant").tolist()


def test_mapping_equals_harmony_objects_built_by_hand(template):
    R = oh.Role
    messages = [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "reasoning_content": "Need the tool.", "content": "Checking.",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                                      "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "{\"t\": 21}"},
        {"role": "assistant", "thinking": "Warm.", "content": "Il fait 21 degrés."},
        {"role": "developer", "content": "Be shorter."},
        {"role": "user", "content": [{"type": "text", "text": "Et "}, {"type": "text", "text": "demain ?"}]},
    ]
    system = oh.SystemContent.new().with_reasoning_effort(oh.ReasoningEffort.HIGH)
    tools = [oh.ToolDescription.new("get_weather", "Weather for a city", parameters=TOOLS[0]["function"]["parameters"]),
             oh.ToolDescription.new("lookup", "", parameters={"type": "object", "properties": {}})]
    by_hand = [
        oh.Message.from_role_and_content(R.SYSTEM, system),
        oh.Message.from_role_and_content(R.DEVELOPER, oh.DeveloperContent.new().with_instructions("Answer in French.")
                                         .with_function_tools(tools)),
        oh.Message.from_role_and_content(R.USER, "Weather in Paris?"),
        oh.Message.from_role_and_content(R.ASSISTANT, "Need the tool.").with_channel("analysis"),
        oh.Message.from_role_and_content(R.ASSISTANT, "Checking.").with_channel("commentary"),
        oh.Message.from_role_and_content(R.ASSISTANT, '{"city": "Paris"}').with_channel("commentary")
        .with_recipient("functions.get_weather").with_content_type("<|constrain|>json"),
        oh.Message.from_author_and_content(oh.Author.new(R.TOOL, "functions.get_weather"), '{"t": 21}')
        .with_channel("commentary").with_recipient("assistant"),
        oh.Message.from_role_and_content(R.ASSISTANT, "Warm.").with_channel("analysis"),
        oh.Message.from_role_and_content(R.ASSISTANT, "Il fait 21 degrés.").with_channel("final"),
        oh.Message.from_role_and_content(R.DEVELOPER, oh.DeveloperContent.new().with_instructions("Be shorter.")),
        oh.Message.from_role_and_content(R.USER, "Et demain ?"),
    ]
    enc = harmony._library().encoding
    for drop in (True, False):
        expected = enc.decode_utf8(enc.render_conversation_for_completion(
            oh.Conversation.from_messages(by_hand), R.ASSISTANT, oh.RenderConversationConfig(auto_drop_analysis=drop)))
        got = template.render(messages, add_generation_prompt=True, tools=TOOLS, reasoning_effort="high",
                              auto_drop_analysis=drop)
        assert got == expected
        assert ("Need the tool." in got) is not drop  # the analysis before the first final one


def test_no_leading_system_message_puts_the_tools_first(template):
    text = template.render([{"role": "user", "content": "hi"}], tools=TOOLS[:1])
    assert text.index("<|start|>developer<|message|># Tools") < text.index("<|start|>user")
    assert "# Instructions" not in text
    assert "<|start|>developer" not in template.render([{"role": "user", "content": "hi"}])


# --------------------------------------------------------------------------- sampled turns

def test_junction_is_derived_from_the_renders(tok, template):
    j = derive_junction(template, tok)
    assert (j.stops, j.junction, j.stop_is_start, j.reason) == (("<|end|>", "<|return|>", "<|call|>"), "", False, None)
    assert j.stop_ids == tuple(tok.encode(s).tolist()[0] for s in j.stops)
    assert all(len(tok.encode(s)) == 1 for s in j.stops)


@pytest.mark.parametrize("text,message", [
    ("<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Done.",
     {"role": "assistant", "content": "Done.", "reasoning_content": "Think."}),
    ("<|channel|>final<|message|>Only 🙂", {"role": "assistant", "content": "Only 🙂"}),
    ("<|channel|>analysis<|message|>Call it.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather"
     " <|constrain|>json<|message|>{\"city\":\"Oslo\"}",
     {"role": "assistant", "reasoning_content": "Call it.",
      "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"}}]}),
    ("not a harmony turn", {"role": "assistant", "content": "not a harmony turn"}),
    ("<|channel|>commentary to=browser.search<|message|>{}", {"role": "assistant", "content":
                                                              "<|channel|>commentary to=browser.search<|message|>{}"}),
])
def test_generated_turns_parse_into_messages(template, text, message):
    assert template.generated_message(text) == message


MARK = "QQMARKQQ{}ZZ"
CLOSERS = ("<|end|>", "<|return|>", "<|call|>")  # how harmony closes a message, rendered or sampled


class Model:
    """The test's own account of a harmony token-in conversation (the TITO definition of
    toktier/conversation.py, with the rendered closer a sampled stop stands for)."""

    def __init__(self, tok, template, **options):
        self.tok, self.template, self.options = tok, template, options
        self.conv = Conversation(tok, **options)
        self.runs: list[tuple[int, list[int], bool]] = []  # (message index, sampled ids, stopped)

    def expected(self) -> tuple[list[int], str]:
        messages = list(self.conv.messages)
        marked = list(messages)
        for i, (k, _s, _stop) in enumerate(self.runs):
            marked[k] = {"role": "assistant", "content": MARK.format(i)}

        def cut(text: str, i: int) -> str:
            at = text.index(MARK.format(i)) + len(MARK.format(i))
            if self.runs[i][2]:
                at += next((len(c) for c in CLOSERS if text.startswith(c, at)), 0)
            return text[at:]

        ids: list[int] = []
        text = ""
        for i, (k, sampled, _stop) in enumerate(self.runs):
            segment = self.template.render(marked[:k], add_generation_prompt=True, **self.options)
            segment = cut(segment, i - 1) if i else segment
            ids += self.tok.encode(segment).tolist() + sampled
            text += segment + b"".join(self.tok.token_bytes[j] for j in sampled).decode("utf-8", "replace")
        segment = self.template.render(marked, add_generation_prompt=True, **self.options) if messages else ""
        if self.runs:
            segment = cut(segment, len(self.runs) - 1)
        return ids + self.tok.encode(segment).tolist(), text + segment

    def drift(self) -> int | None:
        ref = self.tok.encode(self.template.render(list(self.conv.messages), add_generation_prompt=True,
                                                   **self.options)).tolist() if self.conv.messages else []
        ids = self.conv.ids.tolist()
        at = next((i for i, (a, b) in enumerate(zip(ids, ref)) if a != b), None)
        return at if at is not None or len(ids) == len(ref) else min(len(ids), len(ref))

    def check(self, result, tally) -> None:
        ids, text = self.expected()
        assert result.ids.tolist() == ids == self.conv.ids.tolist()
        assert result.text == text == self.conv.text
        assert result.drift == self.drift() == self.conv.drift
        tally(self.tok, "tito", 1)

    def generate(self, completion: str, then=None, stop: str | None = "<|return|>"):
        """gpt-oss's sampled turn: `completion` as harmony's encoder spells it, then its stop."""
        return self.generate_ids(harmony._library().encoding.encode(completion + (stop or ""), allowed_special="all"),
                                 then)

    def generate_ids(self, ids, then=None):
        at = len(self.conv.messages)
        result = self.conv.append_generated(ids, then=then)
        # Stopped: the decoded run ends with a stop text, however it was meant (the definition).
        data = b"".join(self.tok.token_bytes[i] for i in ids)
        self.runs.append((at, list(ids), any(data.endswith(c.encode()) for c in CLOSERS)))
        return result


def test_tito_definition_and_drift(tok, template, tally):
    m = Model(tok, template, tools=TOOLS, reasoning_effort="low")
    m.check(m.conv.append_messages([{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "Weather in Oslo, and 2+2?"}]), tally)
    call = ("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
            "to=functions.get_weather <|constrain|>json<|message|>{\"city\":\"Oslo\"}")
    r = m.generate(call, then=[{"role": "tool", "name": "get_weather", "content": "{\"t\": -3}"}], stop="<|call|>")
    m.check(r, tally)
    assert r.path is ConversationPath.GENERATED
    assert m.conv.messages[2]["tool_calls"][0]["function"] == {"name": "get_weather",
                                                               "arguments": "{\"city\":\"Oslo\"}"}
    assert m.conv.text.endswith("<|call|><|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
                                "{\"t\": -3}<|end|><|start|>assistant")
    # gpt-oss writes the recipient after the channel; the re-render puts it after the role: drift.
    assert r.drift is not None
    final = "<|channel|>analysis<|message|>Cold.<|end|><|start|>assistant<|channel|>final<|message|>-3 °C; 4."
    m.check(m.generate(final), tally)
    m.check(m.conv.append_messages([{"role": "user", "content": "Thanks! <|end|> 🙂"}]), tally)
    m.check(m.generate("<|channel|>final<|message|>You're welcome.", stop=None), tally)  # truncated: no stop
    m.check(m.conv.append_messages([{"role": "user", "content": "Bye"}]), tally)
    r = m.conv.rollback(4)  # back past two runs
    m.runs = [run for run in m.runs if run[0] < 4]
    m.check(r, tally)
    m.check(m.conv.append_messages([{"role": "user", "content": "again"}]), tally)


def test_a_final_turn_drifts_only_at_its_stop(tok, template, tally):
    """A canonical final turn re-renders alike but for its closer (`<|return|>` sampled,
    `<|end|>` rendered): the drift is exactly there."""
    m = Model(tok, template)
    m.check(m.conv.append_messages([{"role": "user", "content": "Say hi."}]), tally)
    before = m.conv.num_tokens
    completion = "<|channel|>final<|message|>Hi there!"
    n = len(harmony._library().encoding.encode(completion, allowed_special="all"))
    r = m.generate(completion)
    m.check(r, tally)
    assert r.drift == before + n and m.conv.ids[before + n] == tok.encode("<|return|>")[0]
    r = m.conv.append_messages([{"role": "user", "content": "Again."}])
    m.check(r, tally)
    assert r.drift == before + n  # an append after the drift point cannot move it


ROLL = st.lists(st.tuples(st.sampled_from(["user", "final", "call", "trunc", "set", "rollback", "fork"]),
                          st.integers(0, 50), TEXT), min_size=1, max_size=7)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(ops=ROLL)
def test_random_tito_sequences(tok, template, ops, tally):
    m = Model(tok, template, tools=TOOLS)
    m.conv.append_messages([{"role": "user", "content": "start"}])
    for kind, at, text in ops:
        if not m.conv.messages:
            m.conv.append_messages([{"role": "user", "content": "again"}])
        messages = list(m.conv.messages)
        if kind == "user":
            r = m.conv.append_messages([{"role": "user", "content": text}])
        elif kind == "final":
            r = m.generate(f"<|channel|>analysis<|message|>{text}!<|end|><|start|>assistant<|channel|>final"
                           f"<|message|>{text}")
        elif kind == "call":
            r = m.generate("<|channel|>commentary to=functions.lookup <|constrain|>json<|message|>{}",
                           then=[{"role": "tool", "name": "lookup", "content": text}], stop="<|call|>")
        elif kind == "trunc":
            r = m.generate(f"<|channel|>final<|message|>{text}", stop=None)
        elif kind == "set":
            k = at % len(messages)
            if messages[k]["role"] != "user":
                continue
            messages[k] = {**messages[k], "content": str(messages[k].get("content") or "") + text + "."}
            r = m.conv.set_messages(messages)
            m.runs = [run for run in m.runs if run[0] < k]
        elif kind == "rollback":
            n = at % (len(messages) + 1)
            r = m.conv.rollback(n)
            m.runs = [run for run in m.runs if run[0] < n]
        else:
            m.conv = m.conv.fork()
            r = m.conv.append_messages([{"role": "user", "content": text}])
        m.check(r, tally)


# --------------------------------------------------------------------------- text-only conversations

def check(conv: Conversation, result, tally) -> None:
    """The IDs equal the reference encoding of the full render, and between special tokens every
    pre-tokenizer piece of the pattern (the `regex` module: a third engine) starts at a token start."""
    tok = conv.tokenizer
    text = conv.template.render(list(conv.messages), add_generation_prompt=conv.add_generation_prompt,
                                **conv.render_kwargs) if conv.messages else ""
    ref = tok.encode(text).tolist()
    assert result.ids.tolist() == conv.ids.tolist() == ref and result.text == conv.text == text
    assert result.drift is None
    specials = set(tok.table.literal_ids.values())
    run: list[int] = []
    for i in [*ref, None]:
        if i is not None and i not in specials:
            run.append(i)
            continue
        if run:
            chunk = b"".join(tok.token_bytes[j] for j in run).decode("utf-8")
            starts = set(np.cumsum([0, *(len(tok.token_bytes[j]) for j in run)]).tolist())
            for piece in regex.finditer(O200K_PAT, chunk):
                assert len(chunk[:piece.start()].encode()) in starts, chunk[max(0, piece.start() - 10):piece.end()]
            tally(tok, "pieces", 1)
            run = []
    tally(tok, "ids", 1)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(case=conversations(), cuts=st.lists(st.integers(1, 9), min_size=1, max_size=4), agp=st.booleans())
def test_text_only_ops_equal_the_reference(tok, template, case, cuts, agp, tally):
    """Appends in batches (through the exact appender where the drop rule allows), an edit of the
    first message and a rollback, each checked against the reference encoding of the full render
    (IDs and pieces), with and without the generation prompt."""
    messages, options = case
    conv = Conversation(tok, add_generation_prompt=agp, **options)
    done = 0
    for n in cuts:
        if done >= len(messages):
            break
        before = conv.ids.tolist()
        r = conv.append_messages(messages[done:done + n])
        done = min(len(messages), done + n)
        check(conv, r, tally)
        check_first_changed(before, r)
    if "content" in conv.messages[0] and isinstance(conv.messages[0]["content"], str):
        edited = [dict(m) for m in conv.messages]
        edited[0]["content"] += " (edited)"
        check(conv, conv.set_messages(edited), tally)
    check(conv, conv.rollback(max(1, len(conv.messages) // 2)), tally)


def test_long_agent_conversation_appends_through_a_window(tok, template, tally):
    """An agent loop (user, tool calls and results) appends through the render window: most ops
    render a few messages, and every op equals the reference."""
    conv = Conversation(tok, tools=TOOLS)
    check(conv, conv.append_messages([{"role": "system", "content": "You are an agent."},
                                      {"role": "user", "content": "Find the weather in 12 cities."}]), tally)
    for i in range(12):
        check(conv, conv.append_messages([
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": f"c{i}", "type": "function",
                 "function": {"name": "get_weather", "arguments": {"city": f"C{i}"}}}]},
            {"role": "tool", "tool_call_id": f"c{i}", "content": f"{{\"t\": {i}}} " * 20}]), tally)
    check(conv, conv.append_messages([{"role": "assistant", "content": "All done."},
                                      {"role": "user", "content": "Thanks"}]), tally)
    assert conv.render_stats.windowed > 0


def test_records_restore_harmony_conversations(tok, template):
    conv = Conversation(tok, tools=TOOLS, reasoning_effort="high")
    conv.append_messages([{"role": "user", "content": "Weather in Rome?"}])
    conv.append_generated(harmony._library().encoding.encode(
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\":\"Rome\"}<|call|>",
        allowed_special="all"), then=[{"role": "tool", "name": "get_weather", "content": "sunny"}])
    rec = ConversationRecord.of(conv, tok, namespace=1, conversation="gpt-oss", seq=3)
    assert rec.template_kind == "harmony"
    back = decode_conversation_record(encode_conversation_record(rec)).restore(tok)
    assert back.ids.tolist() == conv.ids.tolist() and back.text == conv.text and back.drift == conv.drift
    assert isinstance(back.template, harmony.HarmonyTemplate)
    assert back.template.kind == "harmony"


# --------------------------------------------------------------------------- misuse

@pytest.mark.parametrize("messages,kwargs,says", [
    ([{"role": "user", "content": "x"}], {"temperature": 1}, "render arguments"),
    ([{"role": "user", "content": "x"}], {"reasoning_effort": "max"}, "reasoning_effort"),
    ([{"role": "user", "content": "x"}], {"auto_drop_analysis": "yes"}, "auto_drop_analysis"),
    ([{"role": "user", "content": "x"}], {"documents": [{"text": "d"}]}, "documents"),
    ([{"role": "user", "content": "x"}], {"continue_final_message": True}, "continue_final_message"),
    ([{"role": "user", "content": "x"}, {"role": "tool", "content": "r"}], {}, "tool message needs"),
    ([{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "zz", "content": "r"}], {},
     "tool message needs"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], {}, "text only"),
    ([{"role": "ipython", "content": "x"}], {}, "roles"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": "{}"}}]}], {}, "function name"),
    ([{"role": "user", "content": "x"}], {"tools": [{"type": "code_interpreter"}]}, "function tools"),
    ([], {}, "empty"),
])
def test_misuse_is_typed(template, messages, kwargs, says):
    with pytest.raises(InvalidChatInput, match=says):
        template.render(messages, **kwargs)


def test_names_and_errors_say_where_it_comes_from():
    assert "gpt_oss" in chat.template_names() and "o200k_harmony" in chat.template_names()
    assert isinstance(chat.template_for("gpt_oss"), harmony.HarmonyTemplate)
    with pytest.raises(InvalidChatInput, match="a name"):
        chat.render([{"role": "user", "content": "x"}], "gpt_oss")


def test_a_harmony_record_on_a_server_without_the_package_is_a_foreign_record(tok, monkeypatch):
    from toktier.persist import ForeignRecord

    conv = Conversation(tok)
    conv.append_messages([{"role": "user", "content": "hi"}])
    data = encode_conversation_record(ConversationRecord.of(conv, tok, namespace=1, conversation="c", seq=1))
    monkeypatch.setitem(__import__("sys").modules, "openai_harmony", None)
    harmony._library.cache_clear()
    try:
        with pytest.raises(ForeignRecord, match="openai-harmony"):
            decode_conversation_record(data).restore(tok)
    finally:
        monkeypatch.undo()
        harmony._library.cache_clear()


def test_without_the_package_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "openai_harmony", None)  # import fails
    harmony._library.cache_clear()
    try:
        with pytest.raises(ChatTemplateMissing, match=r"pip install 'toktier\[harmony\]'"):
            chat.template_for("o200k_harmony")
    finally:
        monkeypatch.undo()
        harmony._library.cache_clear()
    assert isinstance(chat.template_for("o200k_harmony"), harmony.HarmonyTemplate)


def test_the_vocab_file_is_written_from_the_bundled_one(tmp_path, monkeypatch):
    """Offline: o200k_base.tiktoken comes from bpe-openai's file, checked by digest; a damaged
    copy is replaced."""
    monkeypatch.setenv("TOKTIER_DATA_DIR", str(tmp_path))
    path = harmony._vocab_dir() / harmony.O200K_FILE
    assert harmony._sha256(path) == harmony.O200K_SHA256
    path.write_bytes(b"damaged")
    assert harmony._sha256(harmony._vocab_dir() / harmony.O200K_FILE) == harmony.O200K_SHA256


PLAIN_HEADERS = ["<|channel|>final", "<|channel|>analysis", "<|channel|>commentary", "assistant<|channel|>final",
                 " to=functions.f<|channel|>commentary",
                 "<|channel|>commentary to=functions.get_weather <|constrain|>json",
                 "<|channel|>commentary to=functions.x json", "<|channel|>commentary to=functions.x<|constrain|>json"]
ODD_HEADERS = ["<|channel|>commentary to=browser.search", "<|channel|>final json",
               "<|channel|>commentary <|constrain|>json",
               "<|channel|>other", "<|channel|>commentary  to=functions.x",
               "to=functions.a<|channel|>commentary to=functions.b", "<|channel|>", "", "user<|channel|>final"]
HEADERS = PLAIN_HEADERS * 3 + ODD_HEADERS  # (mostly plain: the fast reading must be exercised)
BODIES = ["", "Hi", "x = 1\n", "{\"a\": [1, 2]}", "日本 🙂", "two\n\nlines", " to=functions.z"] * 3 \
    + ["<|end|>", "<|start|>"]


@settings(max_examples=400, deadline=None)
@given(parts=st.lists(st.tuples(st.sampled_from(HEADERS), st.sampled_from(BODIES)), min_size=1, max_size=4),
       joiner=st.sampled_from(["<|end|><|start|>assistant"] * 4 + ["<|end|><|start|>", "<|end|>",
                                                                    "<|call|><|start|>assistant"]),
       tail=st.sampled_from(["", "", "", "<|end|>", "<|end|><|start|>assistant"]))
def test_plain_turns_are_read_as_the_library_parses_them(template, parts, joiner, tail):
    """The fast reading of plain sampled turns (`_plain_turn`) gives the message the library's
    parser gives, on plain shapes and on every variant it must leave to the library."""
    text = parts[0][0] + "<|message|>" + parts[0][1]
    for header, body in parts[1:]:
        h = header if header.startswith(("assistant", "user")) or joiner.endswith("assistant") else "assistant" + header
        text += joiner + (h if not joiner.endswith("assistant") else h.removeprefix("assistant")) \
            + "<|message|>" + body
    text += tail
    ids = harmony._library().encoding.encode(text, allowed_special="all")
    assert template.generated_message(text, ids) == template.generated_message(text, ids, fast=False)


def test_plain_turns_take_the_fast_reading(template):
    lib = harmony._library()
    for text in ["<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>final<|message|>b",
                 "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}"]:
        ids = lib.encoding.encode(text, allowed_special="all")
        assert harmony._plain_turn(lib, ids, text) is not None
    # IDs that are not the text's (another vocabulary): the library reads the text
    ids = lib.encoding.encode("<|channel|>final<|message|>b", allowed_special="all")
    assert harmony._plain_turn(lib, ids, "<|channel|>final<|message|>c") is None


def test_the_memo_shares_message_texts_and_is_bounded(tok, template, monkeypatch, tally):
    """A memo entry holds its message's own text object (no copy); the memo stays under its
    character bound (what it keeps alive after a rollback), and a conversation larger than the
    bound is still exact."""
    monkeypatch.setattr(harmony, "MEMO_CHARS", 20_000)
    conv = Conversation(tok, tools=TOOLS)
    conv.append_messages([{"role": "user", "content": "go"}])
    for i in range(40):
        conv.append_messages([{"role": "assistant", "reasoning_content": f"step {i}", "content": "",
                               "tool_calls": [{"id": f"c{i}", "type": "function",
                                               "function": {"name": "lookup", "arguments": "{}"}}]},
                              {"role": "tool", "tool_call_id": f"c{i}", "content": f"result {i} " * 300}])
        if i % 10 == 9:
            conv.append_messages([{"role": "assistant", "content": f"Answer {i}."},
                                  {"role": "user", "content": "more"}])
    check(conv, conv.rollback(20), tally)
    check(conv, conv.append_messages([{"role": "user", "content": "again"}]), tally)
    bound = conv._bound
    assert bound._memo_chars <= 20_000 + 4_000  # (the newest entry may exceed it alone)
    assert bound._memo_chars == sum(size for _, _, size in bound._memo.values())
    user = chat.prepare_messages([{"role": "user", "content": "x" * 5_000}])[0]
    pieces = bound._rendered(user, False, None)[0][2]
    assert any(piece is user["content"] for piece in pieces)  # shared, not copied


def test_forks_appended_from_threads_stay_exact(tok, template):
    """Forks share their renderer's caches; ops on them from several threads stay exact."""
    import sys
    import threading

    base = Conversation(tok, tools=TOOLS)
    base.append_messages([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
    forks = [base.fork() for _ in range(4)]
    errors: list[BaseException] = []

    def work(k: int, conv: Conversation) -> None:
        try:
            for i in range(25):
                final = (i + k) % 5 == 0
                msg = ({"role": "assistant", "reasoning_content": f"r{k}{i}", "content": f"done {k}.{i}"}
                       if final else
                       {"role": "assistant", "reasoning_content": f"r{k}{i}", "content": "",
                        "tool_calls": [{"id": f"k{k}c{i}", "type": "function",
                                        "function": {"name": "lookup", "arguments": {"q": i}}}]})
                after = [{"role": "user", "content": f"next {i}"}] if final else \
                    [{"role": "tool", "tool_call_id": f"k{k}c{i}", "content": f"out {k} {i}"}]
                r = conv.append_messages([msg, *after])
                ref = tok.encode(template.render(list(conv.messages), add_generation_prompt=True, tools=TOOLS))
                assert r.ids.tolist() == ref.tolist()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k, c)) for k, c in enumerate(forks)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: races show
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors[0]


def test_a_sampled_turn_cut_inside_a_character_is_kept_as_text(tok, template, tally):
    """max_tokens may stop gpt-oss inside a UTF-8 character: the run is pinned verbatim, the IDs
    follow the definition, and the message recorded is what the library's parser reads of it
    (the fast reading declines bytes that are not UTF-8)."""
    m = Model(tok, template)
    m.check(m.conv.append_messages([{"role": "user", "content": "emoji?"}]), tally)
    ids = harmony._library().encoding.encode("<|channel|>final<|message|>ok 𓀀", allowed_special="all")
    cut = ids[:-1]  # 𓀀 is four byte tokens: the last one is missing
    assert len(tok.encode("𓀀")) == 4
    r = m.generate_ids(cut)
    m.check(r, tally)
    text = b"".join(tok.token_bytes[i] for i in cut).decode("utf-8", "replace")
    assert harmony._plain_turn(harmony._library(), cut, text) is None
    assert m.conv.messages[-1] == template.generated_message(text, cut, fast=False)
