"""Conversation fixes and incremental rendering (toktier.render_window), each checked differentially.

- Sampled IDs that are in range but unassigned (gaps) are refused, vectorised.
- `num_messages` / `num_chars` and read-only `messages` (no copy per access).
- `fast_path` reaches every internal session, present and future.
- Every op is atomic: a failure injected into a session edit leaves the conversation as it was,
  and the retry gives exactly what a twin that never failed gives.
- Incremental rendering: the windowed text equals the full render (and the IDs the reference
  encoding of it) on real ShareGPT chats, adversarial messages and hypothesis op sequences, for the
  bundled templates and for crafted non-local ones, which must fall back; the locality verdicts of
  the bundled templates.
- `track_drift=False`.
"""

from __future__ import annotations

import copy
import json
import pickle
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from toktier import chat, render_window
from toktier.conversation import Conversation
from toktier.errors import InvalidTokenIds
from toktier.session import RepairPath, Session

from conftest import get_tokenizer
from test_conversation import ADVERSARIAL, FAMILIES, _message, call, family, for_family, reference, sharegpt_tool_chats
from test_conversation_tito import Model

EOT = "{% for m in messages %}{{ m.role }}:{{ m.content }}<|endoftext|>\n{% endfor %}" \
      "{% if add_generation_prompt %}assistant:{% endif %}"


def eot_conversation(**kw) -> Conversation:
    tok = get_tokenizer("cl100k_base")
    return Conversation(tok, chat.ChatTemplate(EOT, {"eos_token": "<|endoftext|>"}), **kw)


def full_text(conv: Conversation) -> str:
    if not conv.messages:
        return ""
    return conv.template.render(list(conv.messages), add_generation_prompt=conv.add_generation_prompt,
                                **conv.render_kwargs)


def state(conv: Conversation) -> tuple:
    return (conv.ids.tolist(), conv.text, list(conv.messages), len(conv.text), len(conv.messages), conv.drift,
            [r.ids.tolist() for r in conv.generated])


# --------------------------------------------------------------------------- 1a: unassigned ids

def test_unassigned_sampled_ids_are_refused():
    conv = eot_conversation()
    tok = conv.tokenizer
    assert tok.token_len[100256] == 0 and 100256 < len(tok.table)  # a gap in cl100k_base's ids
    conv.append_messages([{"role": "user", "content": " Hi"}])
    before = state(conv)
    with pytest.raises(InvalidTokenIds, match="100256"):
        conv.append_generated([100256])
    good = tok.encode(" Hello").tolist()
    with pytest.raises(InvalidTokenIds, match=r"100256, 100261") as err:
        conv.append_generated(np.array([*good, 100261, 100256, 100261], dtype=np.int64))
    assert "unassigned" in str(err.value)
    assert state(conv) == before and not conv.generated
    conv.append_generated(good + tok.encode("<|endoftext|>").tolist())  # assigned ids still pass
    assert conv.generated[0].text == " Hello<|endoftext|>"



@pytest.mark.parametrize("engine", ["native", "reference"])
def test_sampled_ids_are_checked_and_joined_alike_on_either_engine(engine):
    """The native engine checks and joins sampled IDs in one compiled pass, the reference path in
    numpy and Python: the same bytes, the same refusals (a wide integer is range-checked before
    the cast to uint32, where 2**32 + 5 would wrap to id 5)."""
    import toktier

    tok = toktier.load_tokenizer("cl100k_base", engine=engine)
    assert (tok.native is not None) == (engine == "native")
    conv = Conversation(tok, chat.ChatTemplate(EOT, {"eos_token": "<|endoftext|>"}))
    conv.append_messages([{"role": "user", "content": " Hi"}])
    vocab = len(tok.table)
    for bad, why in (([vocab], str(vocab)), (np.array([5, vocab], np.uint32), str(vocab)),
                     (np.array([2**32 + 5], np.int64), str(2**32 + 5)), (np.array([-3], np.int32), "-3"),
                     (np.array([5, 100256], np.uint32), "unassigned")):
        with pytest.raises(InvalidTokenIds, match=why):
            conv.append_generated(bad)
    text = " Ünïcode 漢字, emoji 🎉 and <|endoftext|>"
    ids = tok.encode(text)
    for given in (ids, ids.astype(np.int64), ids.tolist()):
        twin = Conversation(tok, chat.ChatTemplate(EOT, {"eos_token": "<|endoftext|>"}))
        twin.append_messages([{"role": "user", "content": " Hi"}])
        twin.append_generated(given)
        assert twin.generated[0].text == text and twin.generated[0].stop == "<|endoftext|>"
        assert twin.messages[-1]["content"] == text[: -len("<|endoftext|>")]


# --------------------------------------------------------------------------- 1b: cheap read access

def test_num_messages_num_chars_and_read_only_messages(tally):
    m = Model("qwen3")
    conv = m.conv
    assert (conv.num_messages, conv.num_chars, conv.messages) == (0, 0, ())
    conv.append_messages([{"role": "user", "content": "weather?"}])
    m.generate(m.sample("<tool_call>\n{}\n</tool_call>"),
               message={"role": "assistant", "content": "", "tool_calls": [call("get_weather", {"city": "Oslo"})]})
    conv.append_messages([{"role": "tool", "content": "cold"}])
    m.generate(m.sample("Cold."))
    for c in (conv, conv.fork()):
        assert c.num_messages == len(c.messages) == 4
        assert c.num_chars == len(c.text)
    messages = conv.messages
    assert conv.messages is messages  # no copy per access
    first = messages[1]
    with pytest.raises(TypeError, match="read-only"):
        first["content"] = "changed"
    with pytest.raises(TypeError):
        first["tool_calls"].append({})
    with pytest.raises(TypeError):
        first["tool_calls"][0]["function"]["arguments"]["city"] = "Rome"
    with pytest.raises(TypeError):
        first.update(role="user")
    # Equal to, and encoded like, the plain prepared dicts; copies are plain and mutable.
    assert list(messages[:3]) == chat.prepare_messages(
        [{"role": "user", "content": "weather?"},
         {"role": "assistant", "content": "", "tool_calls": [call("get_weather", {"city": "Oslo"})]},
         {"role": "tool", "content": "cold"}])
    assert json.loads(json.dumps(list(messages))) == list(messages)
    deep = copy.deepcopy(messages)
    deep[1]["tool_calls"][0]["function"]["arguments"]["city"] = "Rome"
    assert type(deep[1]) is dict and type(deep[1]["tool_calls"]) is list
    assert pickle.loads(pickle.dumps(messages[1])) == messages[1]
    assert messages[1]["tool_calls"][0]["function"]["arguments"]["city"] == "Oslo"
    # Re-sending the views is the same history.
    r = conv.set_messages(list(messages))
    assert r.path.value == "noop" and conv.messages == messages
    r = conv.rollback(2)
    m.keep_runs_before(2)
    m.check(r, tally)
    assert conv.num_chars == len(conv.text) and conv.num_messages == 2 and conv.messages != messages


# --------------------------------------------------------------------------- 1c: fast_path

def test_fast_path_reaches_every_session(tally):
    m = Model("qwen3")
    conv = m.conv
    conv.append_messages([{"role": "user", "content": "first"}])
    m.generate(m.sample("one"))
    conv.fast_path = False
    assert not conv.fast_path and not conv._tail.fast_path and not conv._shadow.fast_path
    r = conv.append_messages([{"role": "user", "content": "second question, longer"}])
    m.check(r, tally)
    assert r.repair is RepairPath.FULL
    r = m.generate(m.sample("two"))  # a new live segment: created with the setting
    m.check(r, tally)
    assert not conv._tail.fast_path and not conv._shadow.fast_path
    branch = conv.fork()
    assert not branch.fast_path and not branch._tail.fast_path
    r = conv.rollback(1)  # a frozen segment becomes live again: forked with the setting
    m.keep_runs_before(1)
    m.check(r, tally)
    assert not conv._tail.fast_path
    conv.fast_path = True
    r = conv.append_messages([{"role": "user", "content": "third"}])
    m.check(r, tally)
    assert conv._tail.fast_path and r.repair is not RepairPath.FULL
    text_only = Conversation(*family("llama3_1"))
    text_only.fast_path = False
    assert text_only.append_messages([{"role": "user", "content": "hi"}]).repair is RepairPath.FULL


# --------------------------------------------------------------------------- 1d: atomic ops

class Boom(RuntimeError):
    pass


def fail_once(monkeypatch, target, name: str) -> list[int]:
    """Make `target.name` (an instance or the Session class) raise `Boom` on its next call only."""
    calls = [0]
    original = getattr(target, name)

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 1:
            raise Boom(f"injected failure in {name}")
        return original(*args, **kwargs)
    monkeypatch.setattr(target, name, wrapper)
    return calls


def _with_runs(name: str = "qwen3") -> Model:
    m = Model(name)
    m.conv.append_messages([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "u1"}])
    m.generate(m.sample("a1"))
    m.conv.append_messages([{"role": "tool", "content": "t1"}, {"role": "user", "content": "u2"}])
    m.generate(m.sample("a2"))
    m.conv.append_messages([{"role": "user", "content": "u3"}])
    return m


OPS = {
    "append": lambda c: c.append_messages([{"role": "tool", "content": "result"}]),
    "append_user": lambda c: c.append_messages([{"role": "user", "content": "new query"}]),
    "edit_tail": lambda c: c.set_messages([*c.messages[:-1], {"role": "user", "content": "u3 edited"}]),
    "drop_run": lambda c: c.set_messages([*c.messages[:2], {"role": "user", "content": "u1 again"}]),
    "rollback": lambda c: c.rollback(3),
    "generate": lambda c: c.append_generated(c.tokenizer.encode("answer<|im_end|>")),
}


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("where", ["tail_edit", "tail_sync", "shadow_edit", "class_edit", "class_sync"])
def test_a_failed_op_changes_nothing_and_the_retry_is_exact(op, where, monkeypatch):
    m = _with_runs()
    conv, twin = m.conv, m.conv.fork()
    before = state(conv)
    target = {"tail_edit": (conv._tail, "edit"), "tail_sync": (conv._tail, "sync"),
              "shadow_edit": (conv._shadow, "edit"), "class_edit": (Session, "edit"),
              "class_sync": (Session, "sync")}[where]
    calls = fail_once(monkeypatch, *target)
    try:
        OPS[op](conv)
    except Boom:
        assert state(conv) == before
    else:  # this op does not reach that method: nothing was injected
        assert calls[0] == 0
        return
    monkeypatch.undo()
    got, want = OPS[op](conv), OPS[op](twin)
    assert got.ids.tolist() == want.ids.tolist() == conv.ids.tolist()
    assert (got.first_changed, got.drift, got.path, got.text) == (want.first_changed, want.drift, want.path, want.text)
    assert state(conv) == state(twin)
    fresh = Conversation(conv.tokenizer, conv.template)
    fresh.set_messages(list(conv.messages))
    if not conv.generated:
        assert conv.ids.tolist() == fresh.ids.tolist()


def test_a_failed_text_only_append_changes_nothing(monkeypatch, tally):
    conv = Conversation(*family("llama3_1"))
    conv.append_messages(for_family("llama3_1", ADVERSARIAL)[:6])
    before = state(conv)
    fail_once(monkeypatch, conv._tail, "edit")
    fail_once(monkeypatch, conv._tail, "sync")
    with pytest.raises(Boom):
        conv.append_messages([{"role": "user", "content": "more"}])
    assert state(conv) == before
    r = conv.append_messages([{"role": "user", "content": "more"}])  # the rebuilt session has no fault
    assert r.ids.tolist() == reference(conv.tokenizer, conv.template, list(conv.messages)).tolist()
    assert conv.num_messages == 7


# --------------------------------------------------------------------------- 2: locality verdicts

KINDS = {"user": ("user", False, False), "assistant": ("assistant", False, False),
         "assistant_reasoning": ("assistant", True, False), "assistant_calls": ("assistant", False, True),
         "tool": ("tool", False, False), "system": ("system", False, False)}


@pytest.mark.parametrize("name, nonlocal_, state_head", [("llama3_1", set(), set()), ("qwen3", {"user"}, set()),
                                                         ("deepseek_v3", {"system"}, {"tool"})])
def test_bundled_template_locality(name, nonlocal_, state_head):
    """DeepSeek V3 renders only the conversation's first tool output with a begin tag: a tool turn
    is local only with the state head (scheme 1: the latest tool output before the window in the
    head); its system messages, gathered up front, are local under no scheme."""
    _tok, template = family(name)
    for gp in (True, False):
        verdict = render_window.probe_locality(template, {}, gp)
        for label, kind in KINDS.items():
            assert (kind in verdict.nonlocal_) == (label in nonlocal_), (name, gp, label)
            assert (kind in verdict.local) == (label not in nonlocal_), (name, gp, label)
            if label not in nonlocal_:
                assert verdict.verdict(kind, 0) == (label not in state_head), (name, gp, label)
                assert verdict.scheme_for([{"role": label.split("_")[0], "content": "x"}]) is not None


# Crafted templates that are not local: each must fall back where it is not, and stay exact.
CRAFTED = {
    # the message count up front: the window's head never matches
    "counts": ("{{ messages|length }} messages\n{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
               "{% if add_generation_prompt %}<assistant>{% endif %}", set(KINDS)),
    # numbered messages: the boundary check catches the renumbering
    "numbered": ("{% for m in messages %}{{ loop.index }}. <{{ m.role }}>{{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}", set(KINDS)),
    # the last user message on top
    "last_user_on_top": ("{% set ns = namespace(q='') %}{% for m in messages %}{% if m.role == 'user' %}"
                         "{% set ns.q = m.content %}{% endif %}{% endfor %}[{{ ns.q }}]\n"
                         "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}", set()),  # check 2 catches it
    # system messages gathered up front, wherever they are (DeepSeek V3 style)
    "systems_up_front": ("{% for m in messages %}{% if m.role == 'system' %}{{ m.content }}\n{% endif %}{% endfor %}"
                         "{% for m in messages %}{% if m.role != 'system' %}<{{ m.role }}>{{ m.content }}\n{% endif %}"
                         "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}", {"system"}),
    # a tool turn quotes the task (the second message), which the window does not hold
    "quotes_the_task": ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% if m.role == 'tool' %}"
                        " [task: {{ messages[1].content }}]{% endif %}\n{% endfor %}"
                        "{% if add_generation_prompt %}<assistant>{% endif %}", {"tool"}),
}


def _crafted_history() -> list[dict]:
    return [{"role": "system", "content": "sys"}, {"role": "user", "content": "the task"},
            {"role": "assistant", "content": "a1"}, {"role": "tool", "content": "t1"},
            {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"},
            {"role": "tool", "content": "t2"}, {"role": "assistant", "content": "a3"},
            {"role": "system", "content": "late rule"}, {"role": "tool", "content": "t3"},
            {"role": "user", "content": "q3"}, {"role": "assistant", "content": "a4"},
            {"role": "tool", "content": "t4"}, {"role": "tool", "content": "t5"}]


@pytest.mark.parametrize("name", sorted(CRAFTED))
def test_crafted_nonlocal_templates_fall_back(name, tally):
    source, nonlocal_ = CRAFTED[name]
    template = chat.ChatTemplate(source, {"eos_token": "<|im_end|>"}, name=name)
    tok = get_tokenizer("qwen3")
    verdict = render_window.probe_locality(template, {}, True)
    for label in nonlocal_:
        assert KINDS[label] not in verdict.local, label
    history = _crafted_history()
    for agp in (True, False):
        conv = Conversation(tok, template, add_generation_prompt=agp)
        for i in range(len(history)):
            r = conv.append_messages(history[i:i + 1])
            assert r.text == full_text(conv)
            assert r.ids.tolist() == tok.encode(full_text(conv)).tolist()
            tally(tok, "ids", 1)
        if name in ("counts", "numbered"):
            assert conv.render_stats.windowed == 0, name
        else:
            assert conv.render_stats.windowed > 0, name


# Background probes: a template source no other test renders (its own `render_window.locality` key).
def _fresh_template(tag: str) -> chat.ChatTemplate:
    return chat.ChatTemplate("{# " + tag + " #}{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                             "{% if add_generation_prompt %}<assistant>{% endif %}", {"eos_token": "<|im_end|>"},
                             name=tag)


def test_background_probe_renders_everything_until_its_verdicts_are_in(monkeypatch, tally):
    tok = get_tokenizer("qwen3")
    conv = Conversation(tok, _fresh_template("background probe test"), probe_in_background=True)
    locality = conv.locality
    started, release, threads = threading.Event(), threading.Event(), []
    plain = render_window.Locality._probe

    def held(self, k, scheme=0, pause=None):  # the probe waits for the test: the op must not
        threads.append(threading.current_thread().name)
        started.set()
        assert release.wait(30)
        return plain(self, k, scheme, pause)

    monkeypatch.setattr(render_window.Locality, "_probe", held)
    history = _crafted_history()

    def check(r):
        assert r.ids.tolist() == tok.encode(full_text(conv)).tolist()
        tally(tok, "ids", 1)

    check(conv.append_messages(history[:4]))
    r = conv.append_messages(history[4:5])  # a user turn: its kind is undecided, the prober holds
    check(r)
    assert started.wait(30)
    assert not r.windowed and conv.render_stats.windowed == 0 and conv.render_stats.full == 2
    assert locality.local == frozenset() and not locality.settle(timeout=0.05)
    assert threads == ["toktier-locality-probe"]
    release.set()
    assert locality.settle(timeout=60)
    assert KINDS["user"] in locality.local
    for i in range(5, len(history)):  # every kind gets its verdict in the background, then windows serve
        check(conv.append_messages(history[i:i + 1]))
        assert locality.settle(timeout=60)
    windowed = conv.render_stats.windowed
    check(conv.append_messages([{"role": "user", "content": "again"}, {"role": "assistant", "content": "sure"}]))
    assert conv.render_stats.windowed == windowed + 1
    assert set(threads) == {"toktier-locality-probe"} and locality.background_errors == 0
    # forks keep the setting; a replay probes inline, then takes the setting it is given
    assert conv.fork().probe_in_background
    assert Conversation.replay(tok, conv.state(), probe_in_background=True).probe_in_background


def test_background_probe_that_raises_leaves_the_kind_unwindowed(monkeypatch, tally):
    tok = get_tokenizer("qwen3")
    conv = Conversation(tok, _fresh_template("background probe failure test"), probe_in_background=True)

    def broken(self, k, scheme=0, pause=None):
        raise RuntimeError("a template bug the renders never showed")

    monkeypatch.setattr(render_window.Locality, "_probe", broken)
    history = _crafted_history()
    for i in range(0, len(history), 2):
        r = conv.append_messages(history[i:i + 2])
        assert r.ids.tolist() == tok.encode(full_text(conv)).tolist()
        tally(tok, "ids", 1)
        assert conv.locality.settle(timeout=60)
    assert conv.render_stats.windowed == 0
    assert conv.locality.background_errors > 0 and conv.locality.local == frozenset()
    assert KINDS["tool"] in conv.locality.nonlocal_  # both head schemes decided: not local


# --------------------------------------------------------------------------- 2: windowed = full

@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_windowed_appends_equal_the_full_render_on_real_chats(name, tally):
    tok, template = family(name)
    windowed = 0
    for messages in [for_family(name, ADVERSARIAL), *[for_family(name, c) for c in sharegpt_tool_chats(4)]]:
        for agp in (True, False):
            conv = Conversation(tok, template, add_generation_prompt=agp)
            full = Conversation(tok, template, add_generation_prompt=agp, incremental=False)
            i = 0
            while i < len(messages):
                step = 1 + i % 3  # one to three messages per op
                r, f = conv.append_messages(messages[i:i + step]), full.append_messages(messages[i:i + step])
                i += step
                assert r.text == f.text == full_text(conv)
                assert r.ids.tolist() == f.ids.tolist() == tok.encode(r.text).tolist()
                assert r.first_changed == f.first_changed and r.path == f.path
                tally(tok, "ids", 1)
            assert full.render_stats.windowed == 0
            windowed += conv.render_stats.windowed
    if name != "qwen3":  # (Qwen3: user turns are not local; DeepSeek V3's tool turns need the state head)
        assert windowed > 0


@pytest.mark.parametrize("name", ["qwen3", "llama3_1", "deepseek_v3"])
def test_windowed_token_in_turns_follow_the_definition(name, tally):
    """An agent loop with every assistant turn sampled: the windowed path (tail and drift
    reference) against the independent TITO definition after every op."""
    m = Model(name)
    m.check(m.conv.append_messages([{"role": "system", "content": "Agent."}, {"role": "user", "content": "go"}]),
            tally)
    windowed = 0
    for i in range(12):
        r = m.generate(m.sample(f"step {i}: calling a tool" + (" <think>x</think>" if i % 5 == 0 else "")))
        m.check(r, tally)
        r2 = m.conv.append_messages([{"role": "ipython" if name == "llama3_1" else "tool",
                                      "content": f"output {i} " * (i + 1)}])
        m.check(r2, tally)
        windowed += r.windowed + r2.windowed
        if i % 4 == 3:
            m.check(m.conv.append_messages([{"role": "user", "content": f"also {i}"}]), tally)
    assert m.conv.render_stats.windowed > 20 and windowed > 12


def test_track_drift_false(tally):
    m = Model("qwen3")
    quiet = Conversation(m.tok, m.template, track_drift=False)
    for conv in (m.conv, quiet):
        conv.append_messages([{"role": "user", "content": "q1"}])
    split = m.tok.encode(" convers").tolist() + m.tok.encode("ation").tolist() + m.sample("")
    r, q = m.generate(split), quiet.append_generated(split)
    m.check(r, tally)
    assert r.drift is not None and r.drift_tracked
    assert q.ids.tolist() == r.ids.tolist() and q.text == r.text
    assert q.drift is None and not q.drift_tracked and quiet.drift is None and quiet._shadow is None
    for conv in (m.conv, quiet):
        conv.append_messages([{"role": "tool", "content": "out"}])
    assert quiet.ids.tolist() == m.conv.ids.tolist()
    assert quiet.fork().append_messages([]).drift_tracked is False


# --------------------------------------------------------------------------- properties

_HISTORY = st.lists(_message(True), min_size=6, max_size=16)
_APPENDS = st.lists(st.lists(_message(True), min_size=1, max_size=3), min_size=1, max_size=6)


def _check_windowed(name: str, history, appends, agp: bool, tally) -> None:
    if name in CRAFTED:
        tok, template = get_tokenizer("qwen3"), chat.ChatTemplate(CRAFTED[name][0], name=name)
    else:
        tok, template = family(name)
        history, appends = for_family(name, history), [for_family(name, a) for a in appends]
    conv = Conversation(tok, template, add_generation_prompt=agp)
    try:
        conv.append_messages(history)
    except Exception:  # the template refuses this history (e.g. Llama 3.1 and several tool calls)
        return
    for msgs in appends:
        try:
            expected = template.render([*conv.messages, *msgs], add_generation_prompt=agp)
        except Exception:
            continue
        r = conv.append_messages(msgs)
        assert r.text == expected
        assert r.ids.tolist() == tok.encode(expected).tolist()
        tally(tok, "ids", 1)


@pytest.mark.parametrize("name", [*sorted(FAMILIES), "last_user_on_top", "quotes_the_task"])
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(history=_HISTORY, appends=_APPENDS, agp=st.booleans())
def test_random_windowed_appends(name, history, appends, agp, tally):
    _check_windowed(name, history, appends, agp, tally)


@pytest.mark.slow
@pytest.mark.parametrize("name", [*sorted(FAMILIES), *sorted(CRAFTED)])
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(history=_HISTORY, appends=_APPENDS, agp=st.booleans())
def test_random_windowed_appends_long(name, history, appends, agp, tally):
    _check_windowed(name, history, appends, agp, tally)


def test_render_window_doctests():
    import doctest

    res = doctest.testmod(render_window)
    assert res.attempted >= 2 and res.failed == 0


NUMBERED = "{% for m in messages %}[{{ loop.index }}]{{ m.role }}:{{ m.content }}\n{% endfor %}" \
           "{% if add_generation_prompt %}assistant:{% endif %}"


@pytest.mark.parametrize("scheme", [0, 1])
def test_the_text_after_a_marker_is_checked_against_the_stored_text(scheme):
    """The run-time check after a pinned run's marker: a window whose render of the old messages
    after the marker is not the stored text must be refused (None), whatever the head.  A template
    numbering its messages renders every message differently from a window; the same append
    through a local template is exact.  (Nothing else in the suite renders a window that fails
    this check: the locality probe keeps such templates off the windowed path.)"""
    mark = "MARKxR0X"
    old = [{"role": "system", "content": "s"}, *[{"role": r, "content": f"{r} {i}"}
                                                 for i in range(3) for r in ("user", "assistant")],
           {"role": "user", "content": "go"}, {"role": "assistant", "content": mark},
           {"role": "tool", "content": "result"}]
    new = [{"role": "tool", "content": "more"}, {"role": "user", "content": "next"}]

    def cut(text: str) -> int | None:
        at = text.find(mark)
        return None if at < 0 or text.find(mark, at + 1) >= 0 else at + len(mark)

    for source, local in ((NUMBERED, False), (EOT, True)):
        template = chat.ChatTemplate(source, {"eos_token": "<|endoftext|>"})
        r = lambda ms, gp: template.render(ms, add_generation_prompt=gp)  # noqa: E731
        stored = r(old, True)[cut(r(old, True)):]
        head, ctx = render_window.window(old, 0, None, scheme)
        assert head and len(ctx) < len(old) and mark in r(ctx[len(head):], False)  # a window holding the marker
        got = render_window.append(r, old, new, stored, None, True, True, cut, scheme=scheme)
        truth = r(old + new, True)
        if local:
            assert got is not None and got.windowed and stored[:got.start] + got.text == truth[cut(truth):]
            assert got.end == len(r(old + new, False)) - cut(truth)
        else:
            assert got is None


def test_state_left_by_the_last_messages_is_probed(tally):
    """Found by the long property run: DeepSeek V3 closes tool outputs at the very end only when
    the loop ends in tool state, which a system message (rendered up front) does not reset, so a
    user turn appended after [tool, system] must not be rendered from a window without the tool."""
    tok, template = family("deepseek_v3")
    history = [*[{"role": "user", "content": ""}] * 5, {"role": "tool", "content": ""}, {"role": "system", "content": ""}]
    for agp in (False, True):
        conv = Conversation(tok, template, add_generation_prompt=agp)
        conv.append_messages(history)
        r = conv.append_messages([{"role": "user", "content": ""}])
        assert r.text == full_text(conv) and r.ids.tolist() == tok.encode(r.text).tolist()
        tally(tok, "ids", 1)


# --------------------------------------------------------------------------- 3: per-turn cost, second pass

def test_rope_equals_the_string_it_stands_for():
    """`render_window.Rope` (the conversation's texts) against plain strings: random edits near
    and far from the end, ropes and strs appended (`concat`), joins in between, reads of every
    kind (seed printed on failure)."""
    import random

    for seed in range(200):
        rng = random.Random(seed)
        text = "".join(rng.choice("ab\u00e9\U0001f642") for _ in range(rng.randrange(0, 12)))
        rope = render_window.Rope.of(text)
        history = [(rope, text)]
        for _ in range(rng.randrange(1, 16)):
            start = rng.randrange(max(0, len(text) - 6), len(text) + 1) if rng.random() < 0.7 else \
                rng.randrange(0, len(text) + 1)
            piece = "".join(rng.choice("xyz\u00fc") for _ in range(rng.randrange(0, 6)))
            if rng.random() < 0.25:  # another rope (of any age) appended, or a str
                other_rope, other_text = rng.choice(history)
                if rng.random() < 0.3:
                    other_rope = other_text = piece
                text, rope = text + other_text, rope.concat(other_rope)
            else:
                text, rope = text[:start] + piece, rope.replace_from(start, piece)
            if rng.random() < 0.2:
                str(rope)
            history.append((rope, text))
            a = rng.randrange(0, len(text) + 1)
            b = rng.randrange(a, len(text) + 1)
            assert rope.slice(a, b) == text[a:b], seed
            assert len(rope) == len(text) and rope.endswith(text[a:]), seed
            # equals(a, other, i, n): against the same characters elsewhere, and one changed
            other = "q" + text[a:b] + "r"
            assert rope.equals(a, other, 1, b - a), seed
            if b > a:
                k = rng.randrange(a, b)
                changed = other[:1 + k - a] + ("Q" if text[k] != "Q" else "R") + other[2 + k - a:]
                assert not rope.equals(a, changed, 1, b - a), seed
            assert not rope.equals(a, other, 1, len(text) - a + 1), seed  # past the rope's end
        for r, t in history:  # persistent: every earlier rope still spells its own text
            assert str(r) == t and r == t, seed
            # Its size as a str: every character at the widest one's width (no more than the pieces').
            top = max(map(ord, t), default=0)
            assert r.nbytes >= len(t) * (1 if top < 0x100 else 2 if top < 0x10000 else 4), seed


def test_match_forward_compares_code_points_of_any_width():
    """`text_diff.match_forward` (the native `common_prefix` where built) against the slice
    comparison it replaces: strs of every width against each other, at every offset, with the
    first difference early, late, inside a 64-character block and at its edges."""
    import random

    from toktier import text_diff

    rng = random.Random(5)
    alphabet = ["a", "b", "\u00e9", "\u20ac", "\U0001f642"]
    for _ in range(400):
        base = "".join(rng.choice(alphabet[:rng.randrange(1, 6)]) for _ in range(rng.randrange(0, 300)))
        other = list(base)
        if other and rng.random() < 0.8:
            k = rng.choice([0, len(other) - 1, 63, 64, 65, 127, 128, rng.randrange(len(other))])
            if k < len(other):
                other[k] = "z"
        other = "".join(other)
        for _ in range(3):
            i, j = rng.randrange(0, len(base) + 1), rng.randrange(0, len(other) + 1)
            limit = rng.randrange(0, 400)
            # (the slice comparison's contract: a limit within both strings; the native one clamps)
            inside = min(limit, len(base) - i, len(other) - j)
            want = text_diff._match_forward_slices(base, i, other, j, inside)
            assert text_diff.match_forward(base, i, other, j, inside) == want
            assert text_diff.match_forward(base, i, other, j, limit) == want
            assert text_diff.match_forward(base, i, base, i, limit) == min(limit, len(base) - i)
    if text_diff._native is not None:  # a negative offset is a caller's bug, said so
        with pytest.raises(IndexError):
            text_diff._native.common_prefix("abc", -1, "abc", 0, 3)


@pytest.mark.parametrize("text", ["", "a", "ab" * 999, "\u00e9", "a" * 5000 + "\u00ff", "\u20ac" * 7,
                                  "a" * 300 + "\u20ac", "\U0001f642", "x" * 3 + "\U0001f642" + "\u00e9" * 9])
def test_str_width_is_the_widest_characters_width(text):
    """`render_window._str_width` (read from the object's size) against the characters themselves,
    for strs built every way (literals, concatenation, slices that narrow a wide str)."""
    top = max(map(ord, text), default=0)
    want = 1 if top < 0x100 else 2 if top < 0x10000 else 4
    assert render_window._str_width(text) == want
    assert render_window._str_width(text + "\u20ac") == max(want, 2)
    assert render_window._str_width((text + "\U0001f642")[:-1]) == want  # a slice gets the narrowest layout


# A template that carries state across the whole conversation the way DeepSeek V3 does: only the
# first tool output ever opens the outputs block, and the block is closed by whatever follows.
FIRST_OUTPUT = ("{% set ns = namespace(first=true, tool=false) %}{% for m in messages %}"
                "{% if m.role == 'tool' %}{% if ns.first %}<outputs>{% set ns.first = false %}{% else %}|{% endif %}"
                "<out>{{ m.content }}</out>{% set ns.tool = true %}"
                "{% else %}{% if ns.tool %}</outputs>{% endif %}{% set ns.tool = false %}"
                "<{{ m.role }}>{{ m.content }}{% endif %}{% endfor %}{% if ns.tool %}</outputs>{% endif %}"
                "{% if add_generation_prompt and not ns.tool %}<assistant>{% endif %}")


def _agent_turns(name: str, n: int, seed: int) -> list[list[dict]]:
    """Agent turns (assistant, tool outputs, now and then a user follow-up) with adversarial text:
    special-token spellings in tool arguments and outputs, think blocks, empty contents, unicode."""
    import random

    rng = random.Random(seed)
    specials = ["<|im_end|>\n<|im_start|>user", "<｜tool▁outputs▁begin｜>", "<|eot_id|>", "<｜end▁of▁sentence｜>", ""]
    turns = []
    for i in range(n):
        arg = {"path": f"src/{i}.py", "note": rng.choice(specials) + " Ünïcödé 🙂"}
        if name == "deepseek_v3":
            content = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>read\n```json\n"
                       + json.dumps(arg, ensure_ascii=False) + "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
            assistant = {"role": "assistant", "content": rng.choice(["", "Let me look. "]) + content}
        elif name == "llama3_1":
            assistant = {"role": "assistant", "content": json.dumps({"name": "read", "parameters": arg})}
        elif name == "qwen3":
            assistant = {"role": "assistant", "content": rng.choice(["", "Reading."]),
                         "reasoning_content": rng.choice(["", "think <|im_end|> hard", "plan"]),
                         "tool_calls": [call("read", arg, f"c{i}")]}
        else:
            assistant = {"role": "assistant", "content": rng.choice(["<think>x</think>ok", "", "a\u0301"])}
        role = "ipython" if name == "llama3_1" else "tool"
        outputs = [{"role": role, "content": rng.choice(specials) + f" out {i} " * rng.randrange(0, 30)}
                   for _ in range(1 if name == "llama3_1" else rng.randrange(1, 4))]
        if rng.random() < 0.25:
            outputs.append({"role": "user", "content": rng.choice(["", "next: " + rng.choice(specials)])})
        turns.append([assistant, *outputs])
    return turns


def _templates_for_batches():
    out = []
    for name in sorted(FAMILIES):
        out.append((name, *family(name)))
    tok = get_tokenizer("qwen3")
    out.append(("first_output", tok, chat.ChatTemplate(FIRST_OUTPUT, name="first_output")))
    for name in ("last_user_on_top", "systems_up_front", "quotes_the_task"):
        out.append((name, tok, chat.ChatTemplate(CRAFTED[name][0], name=name)))
    return out


@pytest.mark.parametrize("agp", [True, False])
def test_batched_windowed_appends_equal_the_full_render(agp, tally):
    """A whole agent turn appended in one op (the window is found for its first message and kept
    for the rest), every bundled template and the crafted ones, against the full render and the
    reference encoding after every op; then a rollback and a branch (the role index the windows
    use is cut back) and more windowed appends."""
    for name, tok, template in _templates_for_batches():
        start = [{"role": "system", "content": "Agent <|im_end|>."}, {"role": "user", "content": "Fix the bug."}]
        conv = Conversation(tok, template, add_generation_prompt=agp)
        conv.append_messages(start)
        for i, turn in enumerate(_agent_turns(name, 14, seed=len(name) + agp)):
            if name == "llama3_1":  # one result per call, as with Llama 3.1 JSON calls
                turn = turn[:2]
            if i % 3 == 1:  # the assistant message alone, then its outputs (a windowed single append)
                one = conv.append_messages(turn[:1])
                assert one.text == full_text(conv) and one.ids.tolist() == tok.encode(one.text).tolist(), (name, i)
                r = conv.append_messages(turn[1:])
            else:  # the whole turn in one op (one window for all of it)
                r = conv.append_messages(turn)
            expected = full_text(conv)
            assert r.text == expected and conv.num_chars == len(expected), (name, i)
            assert r.ids.tolist() == tok.encode(expected).tolist(), (name, i)
            tally(tok, "ids", 1)
        n = conv.num_messages
        for op in (lambda c: c.rollback(n - 3), lambda c: c.set_messages([*c.messages[:-2], {"role": "user",
                                                                                          "content": "redo"}])):
            op(conv)
            for turn in _agent_turns(name, 3, seed=7):
                r = conv.append_messages(turn[:2] if name == "llama3_1" else turn)
                assert r.text == full_text(conv), name
                assert r.ids.tolist() == tok.encode(r.text).tolist(), name
                tally(tok, "ids", 1)
        if name in ("llama3_1", "deepseek_v3", "first_output", "qwen3"):
            assert conv.render_stats.windowed > 0, name


def test_state_head_serves_templates_that_carry_state():
    """The state head (scheme 1): a tool output is not local with the plain head (the window may
    hold no earlier output, so it would open the block again) and is local with the latest
    output before the window in the head; DeepSeek V3 alike."""
    crafted = chat.ChatTemplate(FIRST_OUTPUT, name="first_output")
    for template in (crafted, family("deepseek_v3")[1]):
        verdict = render_window.Locality(template, {}, True)
        tool = ("tool", False, False)
        assert not verdict.verdict(tool, 0) and verdict.verdict(tool, 1), template.name
        assert list(verdict.schemes_for([{"role": "tool", "content": "x"}])) == [1]
    # Far-back state: the only earlier tool output is 40 messages before the window.
    tok = get_tokenizer("qwen3")
    conv = Conversation(tok, crafted)
    history = [{"role": "user", "content": "task"}, {"role": "assistant", "content": "call"},
               {"role": "tool", "content": "first"}]
    history += [{"role": "user" if i % 2 else "assistant", "content": f"m{i}"} for i in range(40)]
    conv.append_messages(history)
    before = conv.render_stats.windowed
    r = conv.append_messages([{"role": "tool", "content": "second"}, {"role": "assistant", "content": "done"}])
    assert r.windowed and conv.render_stats.windowed == before + 1
    assert r.text == full_text(conv) and "|<out>second</out>" in r.text and r.text.count("<outputs>") == 1
    assert r.ids.tolist() == tok.encode(r.text).tolist()


@pytest.mark.parametrize("name", ["deepseek_v3", "first_output"])
def test_state_head_token_in_turns_follow_the_definition(name, tally):
    """Token-in with a state-carrying template: tail, marker cut and drift reference all through
    windows, against the independent TITO definition and drift after every op."""
    if name == "first_output":
        m = Model("qwen3")
        m.template = chat.ChatTemplate(FIRST_OUTPUT, {"eos_token": "<|im_end|>"}, name=name)
        m.conv = Conversation(m.tok, m.template)
        m.stop, m.is_start = "<|im_end|>", False
    else:
        m = Model(name)
    m.check(m.conv.append_messages([{"role": "system", "content": "Agent."}, {"role": "user", "content": "go"}]),
            tally)
    for i, turn in enumerate(_agent_turns("deepseek_v3", 10, seed=3)):
        text = turn[0]["content"] + (" <｜tool▁outputs▁begin｜>" if i == 4 else "")
        ids = m.sample(text)
        if i % 4 == 1:  # a non-canonical split of the first token's bytes: drift
            first = m.tok.token_bytes[ids[0]]
            if len(first) > 1:
                a, b = m.tok.encode(first[:1].decode("latin-1")), m.tok.encode(first[1:].decode("latin-1"))
                if b"".join(m.tok.token_bytes[t] for t in [*a, *b]) == first:
                    ids = [*a.tolist(), *b.tolist(), *ids[1:]]
        m.check(m.generate(ids, message=turn[0] if i % 2 else None), tally)
        m.check(m.conv.append_messages(turn[1:]), tally)
    assert m.conv.render_stats.windowed > 10
