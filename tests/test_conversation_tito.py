"""Token-in-token-out: junctions derived by probing, sampled IDs pinned, drift reported exactly.

The expected IDs are computed here, independently, from the definition in toktier/conversation.py's
docstring: encode(X_0) + S_1' + encode(X_1) + ... + S_r' + encode(X_r), the text segments cut out
of renders of the marked messages (this file's own markers and cutting), each encoded by the
reference on its own.  `drift` is checked against the first mismatch with the reference encoding of
the full render of the conversation's messages.  Junctions are checked on the bundled templates and
on crafted ones reproducing each quirk: a Qwen3-like `<|im_end|>` + newline, a GLM-like stop that is
the next turn's start, a MiniMax-like custom EOS `[e~[` + newline; each on a real tokenizer that
has the stop as one special token, and again on one that spells it as text.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from toktier import chat
from toktier.conversation import Conversation, ConversationPath
from toktier.errors import InvalidChatInput, InvalidConversationOp, InvalidTokenIds, JunctionUnavailable
from toktier.junctions import derive_junction

from conftest import get_tokenizer
from test_conversation import ADVERSARIAL, call, family, for_family, sharegpt_tool_chats

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# (the newline is an expression: trim_blocks eats a literal one after a block tag)
GLM = ("[gMASK]<sop>{% for m in messages %}{% if m.role == 'tool' %}<|observation|>{% else %}<|{{ m.role }}|>"
       "{% endif %}{{ '\\n' + m.content }}{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
# GLM's role tokens as llama3 special tokens (reserved 10/11/12/13 stand for user/assistant/observation/system).
GLM_SPECIAL = (GLM.replace("<|observation|>", "<|reserved_special_token_12|>")
               .replace("<|{{ m.role }}|>", "<|reserved_special_token_{{ {'user': 10, 'assistant': 11, 'system': 13}"
                                             "[m.role] }}|>")
               .replace("<|assistant|>", "<|reserved_special_token_11|>"))
MINIMAX = ("{% for m in messages %}]~b]{{ m.role }}\n{{ m.content }}[e~[\n{% endfor %}"
           "{% if add_generation_prompt %}]~b]ai\n{% endif %}")

# name -> (tokenizer, template source or registered name, special tokens, conversation kwargs,
#          expected (stops, stop ids are single tokens, junction, stop_is_start))
CRAFTED = {
    "chatml_special": ("qwen3", CHATML, {"eos_token": "<|im_end|>"}, {}, (("<|im_end|>",), True, "\n", False)),
    "chatml_text": ("llama3", CHATML, {"eos_token": "<|im_end|>"}, {}, (("<|im_end|>",), False, "\n", False)),
    "glm_special": ("llama3", GLM_SPECIAL, {"eos_token": "<|end_of_text|>"}, {},
                    (("<|reserved_special_token_10|>", "<|reserved_special_token_12|>"), True, "", True)),
    "glm_text": ("llama3", GLM, {"eos_token": "<|end_of_text|>"}, {"stop_texts": ("<|user|>", "<|observation|>")},
                 (("<|observation|>", "<|user|>"), False, "", True)),
    "minimax_text": ("qwen3", MINIMAX, {"eos_token": "[e~["}, {}, (("[e~[",), False, "\n", False)),
    "minimax_special": ("deepseek_v4", MINIMAX.replace("[e~[", "<｜end▁of▁sentence｜>"),
                        {"eos_token": "<｜end▁of▁sentence｜>"}, {}, (("<｜end▁of▁sentence｜>",), True, "\n", False)),
}
BUNDLED = {"llama3_1": (("<|eot_id|>",), ""), "deepseek_v3": (("<｜end▁of▁sentence｜>",), ""),
           "qwen3": (("<|im_end|>",), "\n")}


def crafted(name: str):
    tok_name, source, specials, kw, expected = CRAFTED[name]
    return get_tokenizer(tok_name), chat.ChatTemplate(source, specials, name=name), kw, expected


def setup(name: str):
    """(tokenizer, template, conversation kwargs, the stop text, whether it is also a start token)."""
    if name in CRAFTED:
        tok, template, kw, (stops, _single, _junction, is_start) = crafted(name)
        return tok, template, kw, stops[-1] if is_start else stops[0], is_start
    tok, template = family(name)
    return tok, template, {}, BUNDLED[name][0][0], False


# --------------------------------------------------------------------------- junctions

@pytest.mark.parametrize("name", sorted(BUNDLED))
def test_bundled_junctions(name):
    tok, template = family(name)
    j = derive_junction(template, tok)
    stops, junction = BUNDLED[name]
    assert (j.stops, j.junction, j.stop_is_start, j.reason) == (stops, junction, False, None)
    assert j.stop_ids == tuple(tok.table.literal_ids[s] for s in stops)  # each stop is one special token
    if name == "deepseek_v3":  # the bridge after tool output replaces the assistant header
        assert j.bridges == {"user": "<｜Assistant｜>", "tool": "<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"}
    if name == "qwen3":
        assert derive_junction(template, tok, enable_thinking=False).bridges["user"].endswith("</think>\n\n")


@pytest.mark.parametrize("name", sorted(CRAFTED))
def test_crafted_junctions(name):
    tok, template, kw, (stops, single, junction, is_start) = crafted(name)
    j = derive_junction(template, tok, **kw)
    assert (j.stops, j.junction, j.stop_is_start) == (stops, junction, is_start)
    assert all((i is not None) == single for i in j.stop_ids), j.stop_ids
    for stop, i in zip(j.stops, j.stop_ids):
        if i is not None:
            assert tok.encode(stop).tolist() == [i]
        else:  # spelled as text: several tokens
            assert len(tok.encode(stop)) > 1


def test_no_stop_found_is_reported():
    tok = get_tokenizer("llama3")
    j = derive_junction(chat.ChatTemplate("{% for m in messages %}{{ m.content }}|{% endfor %}"), tok)
    assert j.stops == () and "no stop candidate" in j.reason and j.junction == "|"


# --------------------------------------------------------------------------- the definition, independently

MARK = "QQMARKQQ{}ZZ"


def expected(tok, template, messages, runs, agp, is_start, kw):
    """IDs and text by the documented TITO definition.  runs: [(message index, sampled ids, stop text | None)]."""
    marked = list(messages)
    for i, (k, _s, _stop) in enumerate(runs):
        marked[k] = {"role": "assistant", "content": MARK.format(i)}

    def cut(text: str, i: int) -> str:
        at = text.index(MARK.format(i)) + len(MARK.format(i))
        stop = runs[i][2]
        if stop is not None and not is_start and text.startswith(stop, at):
            at += len(stop)
        return text[at:]

    def kept(i: int) -> list[int]:
        ids, stop = list(runs[i][1]), runs[i][2]
        if stop is not None and is_start:
            n = len(tok.encode(stop))  # the stop as the sampler spelled it (tests sample canonical stops)
            ids = ids[:-n]
        return ids

    def decode(ids: list[int]) -> str:
        return b"".join(tok.token_bytes[i] for i in ids).decode("utf-8", "replace")

    ids: list[int] = []
    text = ""
    for i, (k, _s, _stop) in enumerate(runs):
        rendered = template.render(marked[:k], add_generation_prompt=True, **kw)
        segment = cut(rendered, i - 1) if i else rendered
        ids += tok.encode(segment).tolist() + kept(i)
        text += segment + decode(kept(i))
    segment = template.render(marked, add_generation_prompt=agp, **kw) if messages else ""
    if runs:
        segment = cut(segment, len(runs) - 1)
    return ids + tok.encode(segment).tolist(), text + segment


def independent_drift(tok, template, conv) -> int | None:
    ref = tok.encode(template.render(list(conv.messages), add_generation_prompt=conv.add_generation_prompt,
                                     **conv.render_kwargs)).tolist() if conv.messages else []
    ids = conv.ids.tolist()
    for i, (a, b) in enumerate(zip(ids, ref)):
        if a != b:
            return i
    return None if len(ids) == len(ref) else min(len(ids), len(ref))


class Model:
    """The test's own record of a conversation's history and its runs."""

    def __init__(self, name: str, agp: bool = True, match: str = "strict", track_drift: bool | str = True,
                 **render_kwargs):
        self.tok, self.template, kw, self.stop, self.is_start = setup(name)
        self.kw = render_kwargs
        self.conv = Conversation(self.tok, self.template, add_generation_prompt=agp, match=match,
                                 stop_texts=kw.get("stop_texts", ()), track_drift=track_drift, **render_kwargs)
        self.runs: list[tuple[int, list[int], str | None]] = []

    def check(self, result, tally=None, *, read_drift: bool = True) -> None:
        """The op's IDs and text against the definition; its drift against the independent
        re-render (with ``track_drift="on_read"``: the result has none, and `drift` is read, so
        that the reference catches up, only when `read_drift`)."""
        conv = self.conv
        ids, text = expected(self.tok, self.template, list(conv.messages), self.runs, conv.add_generation_prompt,
                             self.is_start, self.kw)
        assert result.ids.tolist() == ids == conv.ids.tolist()
        assert result.text == text == conv.text
        if conv.track_drift is True:
            assert result.drift == independent_drift(self.tok, self.template, conv) == conv.drift
        else:
            assert result.drift is None and not result.drift_tracked and conv.drift_tracked
            if read_drift:
                assert conv.drift == independent_drift(self.tok, self.template, conv)
        assert [(r.message_index, r.sampled.tolist()) for r in conv.generated] == [(k, s) for k, s, _ in self.runs]
        if tally is not None:
            tally(self.tok, "tito", 1)

    def sample(self, text: str, stop: bool = True) -> list[int]:
        """IDs a model could sample for `text` (canonical), plus the stop token(s)."""
        return self.tok.encode(text).tolist() + (self.tok.encode(self.stop).tolist() if stop else [])

    def generate(self, ids: list[int], **kw):
        at = len(self.conv.messages)  # the generated turn's message (`then` messages follow it)
        result = self.conv.append_generated(ids, **kw)
        # Stopped: the decoded run ends with the stop text (however it was meant: the definition).
        stopped = b"".join(self.tok.token_bytes[i] for i in ids).endswith(self.stop.encode())
        self.runs.append((at, list(ids), self.stop if stopped else None))
        return result

    def keep_runs_before(self, d: int) -> None:
        self.runs = [r for r in self.runs if r[0] < d]


TITO_NAMES = sorted(BUNDLED) + sorted(CRAFTED)


@pytest.mark.parametrize("name", TITO_NAMES)
def test_tito_definition_and_drift(name, tally):
    m = Model(name)
    user = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2? Think first."}]
    m.check(m.conv.append_messages(user), tally)
    answer = "<think>\nTwo plus two.\n</think>\n\nIt is 4." if name == "qwen3" else "It is 4."
    r = m.generate(m.sample(answer))
    m.check(r, tally)
    assert r.path is ConversationPath.GENERATED and r.first_changed == len(m.tok.encode(
        m.template.render(user, add_generation_prompt=True)))
    recorded = m.conv.messages[-1]
    if name == "qwen3":  # reasoning split out, as the template reads it
        assert recorded == {"role": "assistant", "content": "It is 4.", "reasoning_content": "Two plus two."}
    else:
        assert recorded == {"role": "assistant", "content": "It is 4."}
    # The remainder after the run starts at the junction.
    tool_turn = [{"role": "tool", "content": "4"}]
    m.check(m.conv.append_messages([{"role": "user", "content": "And 3+3?"}]), tally)
    m.check(m.generate(m.sample("6")), tally)
    m.check(m.conv.append_messages(tool_turn), tally)
    if name == "deepseek_v3":  # the prompt after tool output ends with the bridge, not the assistant header
        assert m.conv.text.endswith("<｜tool▁output▁end｜><｜tool▁outputs▁end｜>")
    # A truncated run (max_tokens): no stop, the remainder carries the whole post-content text.
    r = m.generate(m.sample("A long answer that was cut", stop=False))
    m.check(r, tally)
    assert m.conv.generated[-1].stop is None
    m.check(m.conv.append_messages([{"role": "user", "content": "ok"}]), tally)
    # Real drift: a word sampled as two tokens where the reference has one.
    word = m.tok.encode(" conversation").tolist()
    assert len(word) == 1
    split = m.tok.encode(" convers").tolist() + m.tok.encode("ation").tolist()
    before = m.conv.num_tokens
    ids = m.tok.encode("Yes").tolist() + split + m.sample(".")
    r = m.generate(ids)
    m.check(r, tally)
    assert r.drift is not None and r.drift <= before + len(m.tok.encode("Yes")) + 1
    if name in ("llama3_1", "deepseek_v3", "chatml_special"):  # canonical runs, no rewriting: drift only there
        assert r.drift == r.first_changed + len(m.tok.encode("Yes"))


@pytest.mark.parametrize("name", TITO_NAMES)
def test_generated_then_equals_the_two_ops(name, tally):
    """`append_generated(ids, then=msgs)` is `append_generated(ids)` then `append_messages(msgs)`:
    the same IDs (checked against the definition), text, drift, messages and runs, every turn
    (canonical, split and truncated runs, tool results and user turns after them)."""
    m, twin = Model(name), Model(name)
    start = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "List the files. 数字 🎉"}]
    m.check(m.conv.append_messages(start), tally)
    twin.conv.append_messages(start)
    turns = [("Calling ls.", [{"role": "tool", "content": "a.py\nb.py"}], True),
             ("", [{"role": "tool", "content": "{}"}, {"role": "user", "content": "Now read a.py <|im_end|>"}], True),
             ("Reading it now", [{"role": "tool", "content": "print('hi')"}], False)]
    for text, then, stop in turns:
        ids = m.sample(text, stop=stop)
        if not stop and not ids:
            ids = m.tok.encode("x").tolist()
        r = m.generate(ids, then=then)
        m.check(r, tally)
        twin.generate(ids)
        r2 = twin.conv.append_messages(then)
        assert (r.ids.tolist(), r.text, r.drift) == (r2.ids.tolist(), r2.text, r2.drift)
        assert m.conv.messages == twin.conv.messages and r.first_changed_message == m.runs[-1][0]
    split = [i for ch in "split turn" for i in m.tok.encode(ch).tolist()] + m.sample("")
    m.check(m.generate(split, then=[{"role": "user", "content": "thanks"}]), tally)
    twin.generate(split)
    assert twin.conv.append_messages([{"role": "user", "content": "thanks"}]).ids.tolist() == m.conv.ids.tolist()
    with pytest.raises(InvalidChatInput):  # `then` is checked like appended messages, before any change
        m.conv.append_generated(m.sample("x"), then=[{"content": "no role"}])
    m.check(m.conv.append_messages([]), tally)


def test_qwen3_think_drop_is_drift_with_token_in(tally):
    m = Model("qwen3")
    m.check(m.conv.append_messages([{"role": "user", "content": "q1"}]), tally)
    r = m.generate(m.sample("<think>\nreasoning\n</think>\n\nanswer"))
    m.check(r, tally)
    assert r.drift is None  # canonical sampled IDs: the same as the re-render
    run_start = r.first_changed
    r = m.conv.append_messages([{"role": "user", "content": "q2"}])
    m.check(r, tally)
    # The re-render drops the earlier think block; the pinned IDs keep what the model wrote.
    assert r.drift == run_start and "reasoning" in m.conv.text
    assert r.first_changed > run_start  # only the tail changed


@pytest.mark.parametrize("name", ["qwen3", "glm_special", "minimax_text"])
def test_rollback_and_fork_equal_fresh_conversations(name, tally):
    m = Model(name)
    script = [("msgs", [{"role": "user", "content": "first question"}]), ("gen", "first answer"),
              ("msgs", [{"role": "user", "content": "second"}, {"role": "tool", "content": "result"}]),
              ("gen", "second answer"), ("msgs", [{"role": "user", "content": "third"}]), ("gen", "third")]

    def build(steps, upto_messages=None):
        fresh = Model(name)
        for kind, arg in steps:
            n = len(fresh.conv.messages)
            if upto_messages is not None and n >= upto_messages:
                break
            if kind == "msgs":
                arg = arg[: None if upto_messages is None else upto_messages - n]
                fresh.conv.append_messages(arg)
            else:
                fresh.generate(fresh.sample(arg))
        return fresh

    for kind, arg in script:
        m.check(m.conv.append_messages(arg) if kind == "msgs" else m.generate(m.sample(arg)), tally)
    total = len(m.conv.messages)
    for n in range(total, -1, -1):
        branch = m.conv.fork()
        result = branch.rollback(n)
        fresh = build(script, n)
        built = fresh.conv
        assert result.ids.tolist() == built.ids.tolist(), n
        assert branch.text == built.text and branch.messages == built.messages
        assert result.drift == built.drift
        fresh.conv = branch
        fresh.check(result, tally)
        # a rolled-back branch goes on like a fresh one
        more = [{"role": "user", "content": "again"}]
        assert branch.append_messages(more).ids.tolist() == built.append_messages(more).ids.tolist()
    m.check(m.conv.append_messages([]), tally)  # the original is untouched by its forks


@pytest.mark.parametrize("name", ["qwen3", "deepseek_v3", "glm_text", "minimax_special"])
def test_forks_diverge_like_fresh_conversations(name, tally):
    m = Model(name)
    m.conv.append_messages([{"role": "system", "content": "shared"}, {"role": "user", "content": "question"}])
    m.generate(m.sample("shared answer"))
    m.check(m.conv.append_messages([{"role": "user", "content": "roll out"}]), tally)
    original = (m.conv.ids.tolist(), m.conv.text)
    branches = []
    for i, answer in enumerate(["left rollout", "right rollout, longer", ""]):
        b = Model(name)
        b.conv, b.runs = m.conv.fork(), list(m.runs)
        b.check(b.generate(b.sample(answer)), tally)
        b.check(b.conv.append_messages([{"role": "tool", "content": f"result {i}"}]), tally)
        b.check(b.generate(b.sample(f"done {i}")), tally)
        branches.append(b)
    assert (m.conv.ids.tolist(), m.conv.text) == original
    for i, b in enumerate(branches):  # each equals a conversation built from scratch
        fresh = Model(name)
        fresh.conv.append_messages(list(b.conv.messages)[:2])
        for k, sampled, _stop in b.runs:
            fresh.conv.append_messages(list(b.conv.messages)[len(fresh.conv.messages):k])
            fresh.generate(sampled)
        assert fresh.conv.ids.tolist() == b.conv.ids.tolist() and fresh.conv.text == b.conv.text
        assert fresh.conv.drift == b.conv.drift


@pytest.mark.parametrize("name", ["qwen3", "deepseek_v3", "glm_special"])
def test_forks_of_one_prompt_probe_the_junction_once(name, monkeypatch, tally):
    """Rollouts forked from one prompt share the junction the first of them derives (each one
    probed the template again: ~0.7 ms), forks of forks too; a fresh conversation derives its
    own.  Every rollout still follows the definition."""
    import toktier.conversation as conversation

    calls = []
    real = conversation.derive_junction
    monkeypatch.setattr(conversation, "derive_junction", lambda *a, **k: calls.append(1) or real(*a, **k))
    m = Model(name)
    m.check(m.conv.append_messages([{"role": "system", "content": "shared"}, {"role": "user", "content": "go"}]), tally)
    for i in range(3):
        b = Model(name)
        b.conv, b.runs = m.conv.fork(), list(m.runs)
        b.check(b.generate(b.sample(f"rollout {i}"), then=[{"role": "tool", "content": f"result {i}"}]), tally)
        c = Model(name)
        c.conv, c.runs = b.conv.fork(), list(b.runs)
        c.check(c.generate(c.sample(f"deeper {i}")), tally)
    assert len(calls) == 1
    fresh = Model(name)
    fresh.check(fresh.conv.append_messages([{"role": "user", "content": "alone"}]), tally)
    fresh.check(fresh.generate(fresh.sample("own junction")), tally)
    assert len(calls) == 2


@pytest.mark.parametrize("name", sorted(BUNDLED))
def test_real_chats_with_every_assistant_turn_sampled(name, tally):
    """ShareGPT chats with tool calls woven in: each plain assistant turn is sampled (its canonical IDs
    plus the stop), every other message is appended as text; checked after every op."""
    for messages in sharegpt_tool_chats(2, max_chars=4_000, seed=3):
        m = Model(name)
        for msg in for_family(name, messages):
            if msg["role"] == "assistant" and not msg.get("tool_calls") and m.conv.messages:
                r = m.generate(m.sample(msg["content"]))
            else:
                r = m.conv.append_messages([msg])
            m.check(r, tally)
        assert len(m.conv.generated) >= 1


@pytest.mark.parametrize("thinking", [True, False])
def test_render_kwargs_reach_every_segment(thinking, tally):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    m = Model("qwen3", tools=tools, enable_thinking=thinking)
    m.check(m.conv.append_messages([{"role": "user", "content": "weather?"}]), tally)
    assert m.conv.text.startswith("<|im_start|>system\n# Tools")
    assert m.conv.text.endswith("</think>\n\n") != thinking
    sampled = m.sample('<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>')
    m.check(m.generate(sampled), tally)
    m.check(m.conv.append_messages([{"role": "tool", "content": "sunny"}]), tally)
    m.check(m.generate(m.sample("Sunny.")), tally)


def test_history_change_before_a_run_branches(tally):
    m = Model("qwen3")
    m.conv.append_messages([{"role": "user", "content": "u1"}])
    m.generate(m.sample("a1"))
    m.conv.append_messages([{"role": "user", "content": "u2"}])
    m.generate(m.sample("a2"))
    m.check(m.conv.append_messages([{"role": "user", "content": "u3"}]), tally)
    messages = list(m.conv.messages)
    # Change after both runs: the tail is edited, runs kept.
    edited = [*messages[:4], {"role": "user", "content": "u3 edited"}]
    r = m.conv.set_messages(edited)
    m.check(r, tally)
    assert r.dropped_runs == 0 and r.branched_at == 4
    # Change before the second run: it is dropped (its message stays, as text).
    edited = [*messages[:2], {"role": "user", "content": "u2 edited"}, *messages[3:4]]
    run2_start = m.conv.generated[1]
    r = m.conv.set_messages(edited)
    m.keep_runs_before(2)
    m.check(r, tally)
    assert (r.path, r.branched_at, r.dropped_runs, r.first_changed_message) == (ConversationPath.BRANCH, 2, 1, 2)
    assert run2_start.message_index == 3 and len(m.conv.generated) == 1
    # Change the first message: no run survives; the IDs are the text-only reference again.
    r = m.conv.set_messages([{"role": "user", "content": "u1!"}, *list(m.conv.messages)[1:]])
    m.keep_runs_before(0)
    m.check(r, tally)
    assert r.dropped_runs == 1 and r.drift is None and not m.conv.generated


def test_loose_matching_keeps_a_run_that_strict_drops(tally):
    for mode, kept in [("strict", 0), ("loose_tool_call", 1)]:
        m = Model("qwen3", match=mode)
        m.conv.append_messages([{"role": "user", "content": "weather in Oslo?"}])
        sampled = m.sample('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
        parsed = {"role": "assistant", "content": "", "tool_calls": [call("get_weather", {"city": "Oslo"})]}
        m.generate(sampled, message=parsed)
        m.check(m.conv.append_messages([{"role": "tool", "content": "cold"}]), tally)
        resent = [*m.conv.messages]
        resent[1] = {**parsed, "tool_calls": [call("get_weather", {"city": "Oslo"}, as_string=True)]}
        r = m.conv.set_messages([*resent, {"role": "user", "content": "thanks"}])
        m.keep_runs_before(1 if kept == 0 else 99)
        m.check(r, tally)
        assert len(m.conv.generated) == kept and r.dropped_runs == 1 - kept


def test_adversarial_history_with_runs(tally):
    m = Model("qwen3")
    m.check(m.conv.append_messages(ADVERSARIAL), tally)
    m.check(m.generate(m.sample("<|im_start|>user\nfake turn<|im_end|> e\u0301 <tool_call>")), tally)
    m.check(m.conv.append_messages(ADVERSARIAL[1:3]), tally)
    m.check(m.generate(m.sample("")), tally)  # only the stop token


def test_add_generation_prompt_false_pins_after_the_prompt(tally):
    m = Model("llama3_1", agp=False)
    m.check(m.conv.append_messages([{"role": "user", "content": "hi"}]), tally)
    assert not m.conv.text.endswith("assistant<|end_header_id|>\n\n")
    r = m.generate(m.sample("hello"))
    m.check(r, tally)
    assert m.conv.text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\nhello<|eot_id|>")
    assert r.drift is None
    # with the tool result after it in the same op, and a non-canonical run (drift)
    split = [i for ch in "again" for i in m.tok.encode(ch).tolist()] + m.sample("")
    r = m.generate(split, then=[{"role": "ipython", "content": "{\"out\": 2}"}])
    m.check(r, tally)
    assert r.drift is not None and not m.conv.text.endswith("assistant<|end_header_id|>\n\n")


def test_stop_is_start_strips_the_ambiguous_token(tally):
    m = Model("glm_special")
    m.check(m.conv.append_messages([{"role": "user", "content": "call a tool"}]), tally)
    observation = m.tok.encode("<|reserved_special_token_12|>").tolist()
    r = m.conv.append_generated(m.tok.encode("calling").tolist() + observation)
    m.runs.append((1, m.tok.encode("calling").tolist() + observation, "<|reserved_special_token_12|>"))
    m.is_start = True
    m.check(r, tally)
    run = m.conv.generated[0]
    assert run.stop == "<|reserved_special_token_12|>" and run.ids.tolist() == m.tok.encode("calling").tolist()
    m.check(m.conv.append_messages([{"role": "tool", "content": "result"}]), tally)
    assert "calling<|reserved_special_token_12|>\nresult" in m.conv.text
    assert m.conv.drift is None


def test_misuse_is_typed():
    m = Model("qwen3")
    with pytest.raises(InvalidConversationOp, match="add messages first"):
        m.conv.append_generated([1, 2])
    m.conv.append_messages([{"role": "user", "content": "x"}])
    vocab = len(m.tok.table)
    for bad in ([vocab], [-1], [[1, 2]], ["a"], [1.5]):
        with pytest.raises(InvalidTokenIds):
            m.conv.append_generated(bad)
    with pytest.raises(InvalidConversationOp, match="no IDs"):
        m.conv.append_generated([])
    with pytest.raises(InvalidChatInput, match="assistant"):
        m.conv.append_generated([1], message={"role": "user", "content": "x"})
    before = (m.conv.ids.tolist(), m.conv.text)
    drops = chat.ChatTemplate("{% for m in messages %}{% if m.role != 'assistant' %}{{ m.content }}{% endif %}"
                              "{% endfor %}", {"eos_token": "<|im_end|>"})
    conv = Conversation(m.tok, drops)
    conv.append_messages([{"role": "user", "content": "x"}])
    with pytest.raises(JunctionUnavailable, match="not at all"):
        conv.append_generated(m.sample("y"))
    assert conv.ids.tolist() == m.tok.encode("x").tolist() and not conv.generated  # nothing changed
    assert (m.conv.ids.tolist(), m.conv.text) == before



def test_drift_on_read_refusals_and_state():
    """``track_drift="on_read"``: a bad value is refused; a template that refuses a real generated
    message (which an op never renders in this mode, the marker standing for it) lets the op
    through and raises when `drift` is read, every time, leaving the conversation as it was; a
    rollback past that message makes the drift readable again.  `state()` and `replay` keep
    the mode (the replayed reference starts in step)."""
    from toktier.errors import ChatTemplateError

    tok = get_tokenizer("llama3")
    with pytest.raises(InvalidConversationOp, match="on_read"):
        Conversation(tok, chat.ChatTemplate("{{ messages[0].content }}"), track_drift="sometimes")
    source = ("{% for m in messages %}{% if m.role == 'assistant' and 'boom' in m.content %}"
              "{{ raise_exception('no boom here') }}{% endif %}<{{ m.role }}>{{ m.content }}<|eot_id|>{% endfor %}"
              "{% if add_generation_prompt %}<assistant>{% endif %}")
    template = chat.ChatTemplate(source, {"eos_token": "<|eot_id|>"})
    eager = Conversation(tok, template)
    lazy = Conversation(tok, template, track_drift="on_read")
    for conv in (eager, lazy):
        conv.append_messages([{"role": "user", "content": "hi"}])
        conv.append_generated(tok.encode(" fine<|eot_id|>"), then=[{"role": "user", "content": "again"}])
    assert lazy.drift is None == eager.drift
    sampled = tok.encode(" boom<|eot_id|>")
    with pytest.raises(ChatTemplateError, match="no boom"):
        eager.append_generated(sampled)
    r = lazy.append_generated(sampled)
    assert r.drift is None and not r.drift_tracked
    before = (lazy.ids.tolist(), lazy.text, len(lazy.messages))
    for _ in range(2):
        with pytest.raises(ChatTemplateError, match="no boom"):
            lazy.drift
        assert (lazy.ids.tolist(), lazy.text, len(lazy.messages)) == before
    lazy.rollback(3)
    assert lazy.drift == independent_drift(tok, template, lazy) is None
    split = [i for ch in " ok" for i in tok.encode(ch).tolist()] + tok.encode("<|eot_id|>").tolist()
    lazy.append_generated(split, then=[{"role": "user", "content": "more"}])
    state = lazy.state()
    assert state.track_drift == "on_read"
    twin = Conversation.replay(tok, state)
    assert twin.track_drift == "on_read" and twin.ids.tolist() == lazy.ids.tolist()
    assert twin.drift == lazy.drift == independent_drift(tok, template, lazy) is not None


# --------------------------------------------------------------------------- properties

_WORDS = st.lists(st.sampled_from(["word", " conversation", " 123", "\n", "é", "e\u0301", " <|im_end|>", "🙂",
                                   " ", "{\"a\": 1}", "<think>", "</think>"]), max_size=6).map("".join)
_OP = st.tuples(st.sampled_from(["user", "tool", "gen", "gen_then", "gen_split", "gen_trunc", "edit", "rollback",
                                 "fork"]),
                st.integers(0, 1 << 16), _WORDS)


def _run_tito_ops(name: str, ops, tally, track_drift: bool | str = True) -> Model:
    m = Model(name, track_drift=track_drift)
    m.conv.append_messages([{"role": "user", "content": "start"}])
    for kind, at, text in ops:
        if not m.conv.messages:  # rolled back to nothing: a prompt first
            m.conv.append_messages([{"role": "user", "content": "again"}])
        messages = list(m.conv.messages)
        if kind in ("user", "tool"):
            r = m.conv.append_messages([{"role": kind, "content": text}])
        elif kind == "gen":
            r = m.generate(m.sample(text))
        elif kind == "gen_then":  # the generated turn and the tool results after it, in one op
            r = m.generate(m.sample(text), then=[{"role": "tool", "content": text or "ok"}])
            assert r.first_changed_message == m.runs[-1][0]
        elif kind == "gen_split":  # a non-canonical spelling: one character per token where possible
            ids = [i for ch in text for i in m.tok.encode(ch).tolist()] + m.sample("")
            r = m.generate(ids)
        elif kind == "gen_trunc":
            if not text:
                continue
            r = m.generate(m.sample(text, stop=False))
        elif kind == "edit":
            k = at % len(messages)
            messages[k] = {**messages[k], "content": (messages[k].get("content") or "") + text}
            r = m.conv.set_messages(messages)
            if text:  # message k changed: runs from k on cannot be kept
                m.keep_runs_before(k)
        elif kind == "rollback":
            n = at % (len(messages) + 1)
            r = m.conv.rollback(n)
            m.keep_runs_before(n)
        else:
            m.conv = m.conv.fork()
            r = m.conv.append_messages([{"role": "user", "content": text}])
        m.check(r, tally, read_drift=at % 3 == 0)  # (on_read: the reference catches up over several ops)
    assert m.conv.drift == independent_drift(m.tok, m.template, m.conv)
    return m


@pytest.mark.parametrize("name", ["qwen3", "llama3_1", "glm_special", "minimax_text"])
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(ops=st.lists(_OP, min_size=1, max_size=8))
def test_random_tito_sequences(name, ops, tally):
    _run_tito_ops(name, ops, tally)


@pytest.mark.parametrize("name", ["qwen3", "llama3_1", "deepseek_v3", "glm_special", "minimax_text"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(ops=st.lists(_OP, min_size=1, max_size=10))
def test_random_tito_sequences_with_drift_on_read(name, ops, tally):
    """``track_drift="on_read"``: the same IDs and texts, results without drift, and `drift`, read
    after some ops only, equal to the independent re-render's: the reference catches up over
    every kind of op since its last read (appends through one window, edits, rollbacks and
    branches rendered whole, forks carrying the reference left behind)."""
    _run_tito_ops(name, ops, tally, track_drift="on_read")


@pytest.mark.slow
@pytest.mark.parametrize("name", TITO_NAMES)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(ops=st.lists(_OP, min_size=1, max_size=14))
def test_random_tito_sequences_long(name, ops, tally):
    _run_tito_ops(name, ops, tally)


@pytest.mark.parametrize("track_drift", [True, "on_read"])
@pytest.mark.parametrize("name", sorted(BUNDLED) + ["glm_special", "minimax_text", "chatml_text"])
def test_drift_reference_waits_after_the_drift_point(name, track_drift, tally):
    """Once the IDs drift (a non-canonical sample early on), later appends after the drift point
    leave the drift reference's edit for later (`Conversation._defers`): every op's IDs and drift
    still equal the definition and the independent re-render, through appends, generated turns,
    a fork, an edit and a rollback before the drift point (which bring the reference up to date),
    and the deferral must have happened (with ``track_drift="on_read"``, at the reads)."""
    from toktier.tools.corpus import large_text

    material = large_text(40_000)
    m = Model(name, track_drift=track_drift)
    pos = 0

    def text(n: int) -> str:
        nonlocal pos
        pos += n
        return material[pos - n:pos]

    m.check(m.conv.append_messages([{"role": "user", "content": text(400)}]), tally)
    words = text(300)
    split = [i for ch in words for i in m.tok.encode(ch).tolist()] + m.sample("")  # one token a character
    m.check(m.generate(split, then=[{"role": "tool", "content": text(900)}]), tally)
    assert m.conv.drift is not None
    waited = 0
    for turn in range(6):
        if turn % 2:
            m.check(m.generate(m.sample(text(250)), then=[{"role": "tool", "content": text(1200)}]), tally)
        else:
            m.check(m.conv.append_messages([{"role": "user", "content": text(500)}]), tally)
        waited += m.conv._shadow_lag is not None
        if turn == 3:  # a fork carries the waiting reference; both go on exactly
            other = Model(name, track_drift=track_drift)
            other.conv, other.runs = m.conv.fork(), list(m.runs)
            other.check(other.conv.append_messages([{"role": "user", "content": text(300)}]), tally)
            other.check(other.generate(m.sample(text(200))), tally)
    assert waited >= 3, waited
    # An edit after the first run but before the waiting edits: the reference catches up first.
    if m.conv._shadow_lag is None:
        m.check(m.conv.append_messages([{"role": "user", "content": text(500)}]), tally)
    assert m.conv._shadow_lag is not None
    messages = list(m.conv.messages)
    k = len(messages) - 1
    messages[k] = {**messages[k], "content": messages[k]["content"] + " (edited)"}
    r = m.conv.set_messages(messages)
    m.keep_runs_before(k)
    m.check(r, tally)
    assert m.conv.generated and m.conv._shadow_lag is None
    messages = list(m.conv.messages)
    messages[0] = {**messages[0], "content": messages[0]["content"] + " (edited)"}  # before the drift point
    r = m.conv.set_messages(messages)
    m.keep_runs_before(0)  # message 0 changed: no run after it is kept
    m.check(r, tally)
    m.check(m.generate(split, then=[{"role": "tool", "content": text(800)}]), tally)
    m.check(m.conv.append_messages([{"role": "user", "content": text(600)}]), tally)
    r = m.conv.rollback(2)  # back before the sampled turn
    m.keep_runs_before(2)
    m.check(r, tally)
    m.check(m.generate(m.sample(text(200)), then=[{"role": "tool", "content": text(700)}]), tally)


def test_drift_reference_does_not_wait_where_an_append_can_move_the_drift():
    """A drift point with no stable boundary after it: the run "  " pinned as two " " tokens
    (the re-render has one "  " token: drift 1); appending "y" re-tokenizes the re-render as
    [" ", " y"], so the drift moves to 2.  A guard at token 1's own end (no boundary, no literal
    margin) would let that edit wait and keep reporting 1; the real guard finds no boundary and
    the reference is edited at once."""
    tok = get_tokenizer("llama3")
    template = chat.ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}")
    conv = Conversation(tok, template, add_generation_prompt=False)
    conv.append_messages([{"role": "user", "content": "x"}])
    space = tok.encode(" ").tolist()
    r = conv.append_generated(space + space, message={"role": "assistant", "content": "  "})
    assert r.drift == independent_drift(tok, template, conv) == 1
    r = conv.append_messages([{"role": "user", "content": "y"}])
    assert r.drift == independent_drift(tok, template, conv) == 2
    assert conv._shadow_lag is None


_MATERIAL: list[str] = []


def _material() -> str:
    if not _MATERIAL:
        from toktier.tools.corpus import large_text

        _MATERIAL.append(large_text(60_000))
    return _MATERIAL[0]


_LONG_OP = st.tuples(st.sampled_from(["user", "tool", "gen", "gen_then", "gen_then", "gen_split", "edit", "rollback",
                                      "fork"]),
                     st.integers(0, 1 << 16), st.integers(0, 59_000), st.integers(0, 900))


@pytest.mark.parametrize("name", ["qwen3", "llama3_1", "deepseek_v3", "glm_special"])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(ops=st.lists(_LONG_OP, min_size=4, max_size=12))
def test_random_tito_sequences_with_long_turns(name, ops, tally):
    """The random sequences with real text of up to 900 characters a message, long enough that
    edits of the drift reference past the drift point wait (`Conversation._defers`) and catch up
    under random rollbacks, edits and forks: every op checked as in `test_random_tito_sequences`."""
    text = _material()
    _run_tito_ops(name, [(kind, at, text[a:a + n]) for kind, at, a, n in ops], tally)


def test_doctests():
    import doctest

    from toktier import conversation, junctions, message_match

    for module in (conversation, junctions, message_match):
        res = doctest.testmod(module)
        assert res.attempted >= 2 and res.failed == 0, module.__name__


@pytest.mark.parametrize("name", sorted(BUNDLED))
def test_result_texts_are_snapshots_across_runs_forks_and_rollbacks(name, tally):
    """Results keep the text of their own op (O(1) rope snapshots of the text before the tail and
    the tail, joined on first access), read only after later runs, a fork's ops, and a rollback
    that drops runs (the text before the tail is cut back to the kept runs); every op is checked
    against the TITO definition on a twin conversation driven alike."""
    m, twin = Model(name), Model(name)
    tool = "ipython" if name == "llama3_1" else "tool"
    unread, texts = [], []

    def both(op):
        res, twin_res = op(m), op(twin)
        twin.check(twin_res, tally)  # reads twin_res.text; `res.text` stays unread until the end
        unread.append(res)
        texts.append(twin.conv.text)  # (m's own ropes stay unjoined until the end)

    start = [{"role": "system", "content": "Agent <|eot_id|>."}, {"role": "user", "content": "go 🙂"}]
    both(lambda x: x.conv.append_messages(start))
    for i in range(5):
        ids = m.sample(f"call {i} <｜tool▁outputs▁begin｜>" if i % 2 else f"step {i}")
        both(lambda x: x.generate(ids))
        both(lambda x: x.conv.append_messages([{"role": tool, "content": f"out {i} " * (i + 2)}]))
    branch = m.conv.fork()
    branch.append_generated(m.sample("a fork's own turn"))
    for x in (m, twin):
        x.keep_runs_before(5)
    both(lambda x: x.conv.rollback(5))  # drops the runs at or after message 5
    assert len(m.conv.generated) == 2
    both(lambda x: x.generate(x.sample("again")))
    both(lambda x: x.conv.append_messages([{"role": tool, "content": "late"}]))
    assert [r.text for r in unread] == texts  # first read now, after every later op
    assert branch.text.startswith(texts[10]) and branch.num_chars == len(branch.text)
    assert m.conv.num_chars == len(m.conv.text) and m.conv.ids.tolist() == twin.conv.ids.tolist()
