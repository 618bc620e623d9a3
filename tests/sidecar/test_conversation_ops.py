"""Conversation ops end to end: a real sidecar, real socket, real shared memory, real tokenizers
(llama3, qwen3) and their registered chat templates.

Every result is checked three ways: against the in-process ``toktier.Conversation`` doing the same
ops (ids, first_changed, first_changed_message, drift), against the reference encoding of the full
render for text-only conversations (``toktier.chat.render`` then the real tokenizer), and as a
zero-copy view of a shared-memory mapping.  Then: the asyncio client, typed errors, the memory
budget, the TTL, re-sent ops, ids apart from sessions, work off the event loop, metrics, the shadow
verifier; hypothesis op sequences against the in-process conversation; and the
new wire messages round-trip without a sidecar."""

from __future__ import annotations

import asyncio
import copy
import mmap
import re
import time
import urllib.request

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import toktier
from toktier import chat
from toktier_client import AsyncClient, Client
from toktier_client import errors as E
from toktier_client import protocol as P
from toktier_client._conversation import pack_ids
from sidecar_harness import registry, start_sidecar  # noqa: F401  (fixtures)
from sidecar_harness import backing, shm_names, wait_until
from sidecar_raw import Raw

TOOLS = [{"type": "function", "function": {"name": "calc", "description": "Evaluate an arithmetic expression",
                                           "parameters": {"type": "object",
                                                          "properties": {"expr": {"type": "string"}},
                                                          "required": ["expr"]}}}]


@pytest.fixture(scope="module")
def toks(registry) -> dict[str, toktier.FrozenTokenizer]:
    return {name: registry.get(name) if name == "llama3" else registry.load(name) for name in ("llama3", "qwen3")}


@pytest.fixture
def sc(start_sidecar, toks):
    return start_sidecar(tokenizers=("llama3", "qwen3"))


def reference(tok: toktier.FrozenTokenizer, template: chat.ChatTemplate, messages: list[dict],
              **kwargs) -> np.ndarray:
    """The exact IDs of a text-only conversation: render it all, encode it all."""
    if not messages:
        return np.zeros(0, dtype=np.uint32)
    return np.asarray(tok.encode(chat.render(messages, template, add_generation_prompt=True, **kwargs)))


def same(wire, local, tok=None, template=None, messages=None, **kwargs) -> None:
    """A wire result equals the in-process one (and the reference when ``messages`` is given)."""
    assert np.array_equal(wire.ids, local.ids)
    assert (wire.first_changed, wire.first_changed_message, wire.drift) == \
        (local.first_changed, local.first_changed_message, local.drift)
    assert wire.chars == len(local.text)
    assert isinstance(backing(wire.ids), mmap.mmap), "ids are not a view of a shared-memory mapping"
    assert not wire.ids.flags.writeable and wire.ids.dtype == np.uint32 and wire.valid
    if messages is not None:
        assert np.array_equal(wire.ids, reference(tok, template, messages, **kwargs))
        assert wire.drift is None and wire.messages == len(messages)


def same_state(wire, conv: toktier.Conversation) -> None:
    """A fork's first result shows the conversation's whole state."""
    assert np.array_equal(wire.ids, conv.ids) and wire.drift == conv.drift and wire.chars == len(conv.text)
    assert wire.messages == len(conv.messages) and isinstance(backing(wire.ids), mmap.mmap)


# Text-only scripts: (op, argument).  Each exercises what makes conversations hard: Qwen3 drops an
# earlier <think> block once a new user turn arrives (not append-only), tool calls and results,
# special-token text inside contents, empty contents, unicode, edits of early messages, rollbacks.
QWEN_SCRIPT = [
    ("append_messages", [{"role": "system", "content": "You are terse."},
                         {"role": "user", "content": "What is 2+2? 数字 🎉 naïve"}]),
    ("append_messages", [{"role": "assistant", "reasoning_content": "Two and two.", "content": "4"},
                         {"role": "user", "content": "And 3+3?"}]),
    ("append_messages", [{"role": "assistant", "content": "",
                          "tool_calls": [{"type": "function",
                                          "function": {"name": "calc", "arguments": {"expr": "3+3"}}}]},
                         {"role": "tool", "content": "6"}]),
    ("append_messages", [{"role": "assistant", "content": "6."},
                         {"role": "user", "content": "Say <|im_end|> then <|im_start|>user literally"}]),
    ("set_messages", "edit-first-user"),
    ("append_messages", [{"role": "assistant", "content": ""}, {"role": "user", "content": ""}]),
    ("rollback", 3),
    ("set_messages", "same"),
    ("append_messages", [{"role": "user", "content": "Again, please.\n\n\n   "}]),
]
LLAMA_SCRIPT = [
    ("append_messages", [{"role": "system", "content": "Cutting Knowledge Date: now"},
                         {"role": "user", "content": "Hello <|eot_id|> there 🎉"}]),
    ("append_messages", [{"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "Tell me more."}]),
    ("set_messages", "edit-first-user"),
    ("append_messages", [{"role": "assistant", "content": "x = 1\n" * 40}]),
    ("rollback", 1),
    ("append_messages", [{"role": "user", "content": ""}]),
    ("set_messages", "same"),
]


def step(messages: list[dict], op: str, arg):
    """The (op, argument) to send and the messages after it."""
    if op == "append_messages":
        return arg, messages + copy.deepcopy(arg)
    if op == "rollback":
        return arg, messages[:arg]
    if arg == "same":
        return copy.deepcopy(messages), messages
    new = copy.deepcopy(messages)
    first_user = next(i for i, m in enumerate(new) if m["role"] == "user")
    new[first_user]["content"] += " (edited)"
    return new, new


CASES = [("qwen3", QWEN_SCRIPT, {"tools": TOOLS}), ("qwen3", QWEN_SCRIPT, {"enable_thinking": False}),
         ("llama3", LLAMA_SCRIPT, {})]


@pytest.mark.parametrize("name,script,kwargs", CASES, ids=["qwen3-tools", "qwen3-no-thinking", "llama3"])
def test_text_only_ops_equal_in_process_and_reference(sc, toks, name, script, kwargs):
    tok = toks[name]
    template = chat.template_for(tok)
    local = toktier.Conversation(tok, **kwargs)
    messages: list[dict] = []
    with Client(sc.path) as c:
        h = c.conversation(f"conv-{name}", tokenizer=name, **kwargs)
        assert h.last is not None and len(h.last.ids) == 0 and h.last.messages == 0
        previous = h.last
        for op, arg in script:
            sent, messages = step(messages, op, arg)
            wire = getattr(h, op)(sent)
            same(wire, getattr(local, op)(copy.deepcopy(sent)), tok, template, messages, **kwargs)
            assert not previous.valid  # a later op ended the earlier view's lease
            previous = wire
        # Forks branch from the shared state; each branch equals a fresh conversation of its messages.
        branch = h.fork(f"conv-{name}-b")
        same_state(branch.last, local)
        assert np.array_equal(branch.last.ids, reference(tok, template, messages, **kwargs))
        local_b = local.fork()
        a_msgs = messages + [{"role": "user", "content": "branch A"}]
        b_msgs = messages + [{"role": "user", "content": "branch B ünïcode"}]
        same(h.append_messages(a_msgs[-1:]), local.append_messages(a_msgs[-1:]), tok, template, a_msgs, **kwargs)
        same(branch.append_messages(b_msgs[-1:]), local_b.append_messages(b_msgs[-1:]), tok, template, b_msgs,
             **kwargs)
        fresh = toktier.Conversation(tok, **kwargs)
        fresh.set_messages(b_msgs)
        assert np.array_equal(branch.last.ids, fresh.ids)
        assert c.stats().conversations == 2
        assert h.close() and branch.close() and not branch.close()
        assert c.stats().conversations == 0
    assert wait_until(lambda: len(shm_names(sc.prefix)) == 0)


@pytest.mark.parametrize("name,stop", [("qwen3", "<|im_end|>"), ("llama3", "<|eot_id|>")])
def test_generated_ids_are_kept_verbatim_as_in_process(sc, toks, name, stop):
    tok = toks[name]
    local = toktier.Conversation(tok)
    prompt = [{"role": "user", "content": "Write a haiku about tokens."}]
    with Client(sc.path) as c:
        h = c.conversation("tito", tokenizer=name)
        same(h.append_messages(prompt), local.append_messages(prompt))
        canonical = tok.encode("Bytes become words,\nwords become numbers." + stop)
        for ids in (np.asarray(canonical, dtype=np.uint32), np.asarray(canonical, dtype=np.int64).tolist()):
            same(h.append_generated(ids), local.append_generated(ids))
            same(h.append_messages([{"role": "user", "content": "Another."}]),
                 local.append_messages([{"role": "user", "content": "Another."}]))
        # Not the canonical tokenization of its text: kept verbatim, so the IDs drift from a re-render.
        odd = [*tok.encode(" Hel"), *tok.encode("lo there"), *tok.encode(stop)]
        wire, mine = h.append_generated(np.asarray(odd, dtype=np.int32)), local.append_generated(odd)
        same(wire, mine)
        assert wire.drift is not None and wire.drift <= wire.first_changed + len(odd)
        assert wire.messages == len(local.messages)
        # A truncated run (no stop), then a rollback past it: text-only again, the reference again.
        same(h.append_messages([{"role": "user", "content": "Short."}]),
             local.append_messages([{"role": "user", "content": "Short."}]))
        same(h.append_generated(tok.encode("Cut off mid")), local.append_generated(tok.encode("Cut off mid")))
        wire = h.rollback(1)
        same(wire, local.rollback(1), tok, chat.template_for(tok), prompt)


@pytest.mark.parametrize("name,stop", [("qwen3", "<|im_end|>"), ("llama3", "<|eot_id|>")])
def test_generated_then_tool_results_in_one_op(sc, toks, name, stop):
    """``append_generated(ids, then=...)`` over the wire equals the in-process op, and the state
    equals the two separate ops (checked on a second in-process conversation)."""
    tok = toks[name]
    local, twin = toktier.Conversation(tok, tools=TOOLS), toktier.Conversation(tok, tools=TOOLS)
    prompt = [{"role": "user", "content": "What is 6*7? Use the tool."}]
    results = [{"role": "tool", "tool_call_id": "c1", "content": "42"}]
    with Client(sc.path) as c:
        h = c.conversation("then", tokenizer=name, tools=TOOLS)
        same(h.append_messages(prompt), local.append_messages(prompt))
        twin.append_messages(prompt)
        ids = tok.encode("Calling the calculator." + stop)
        wire = h.append_generated(ids, then=results)
        same(wire, local.append_generated(ids, then=results))
        twin.append_generated(ids)
        separate = twin.append_messages(results)
        assert np.array_equal(wire.ids, separate.ids) and wire.drift == separate.drift
        assert wire.messages == len(prompt) + 1 + len(results) == len(twin.messages)
        with pytest.raises(E.BadRequest):  # `then` is checked like any messages
            h.append_generated(ids, then=[{"content": "no role"}])
        assert h.append_generated(ids, then=[]).messages == wire.messages + 1  # no messages after it: as before


def test_track_drift_off_keeps_no_reference(sc, toks):
    """``track_drift=False`` on the wire is the core's: same IDs, ``drift`` None and said to be
    untracked, and it is one of the options an attach must repeat."""
    tok = toks["qwen3"]
    local = toktier.Conversation(tok, track_drift=False)
    with Client(sc.path) as c:
        h = c.conversation("nodrift", tokenizer="qwen3", track_drift=False)
        assert h.last.drift_tracked is False
        same(h.append_messages([{"role": "user", "content": "hi"}]), local.append_messages([{"role": "user",
                                                                                               "content": "hi"}]))
        odd = [*tok.encode(" Hel"), *tok.encode("lo"), *tok.encode("<|im_end|>")]  # would drift
        r = h.append_generated(odd, then=[{"role": "user", "content": "more"}])
        same(r, local.append_generated(odd, then=[{"role": "user", "content": "more"}]))
        assert r.drift is None and not r.drift_tracked
        with pytest.raises(E.SessionConflict):
            c.conversation("nodrift", tokenizer="qwen3")  # track_drift differs
        tracked = c.conversation("drift", tokenizer="qwen3")
        assert tracked.last.drift_tracked is True
        with pytest.raises(E.BadRequest):
            c.conversation("bad", tokenizer="qwen3", incremental=False)  # the core's own parameter


def test_track_drift_on_read_computes_drift_when_asked(sc, toks):
    """``track_drift="on_read"`` on the wire is the core's: results without drift, the same IDs,
    and ``drift()`` (ConvDrift) equal to an eagerly tracking in-process twin's drift after any
    number of ops, without changing the seq or ending the last result's view; a drift read
    that fails (the template refusing a real message the marker stood for) is typed and leaves
    the conversation serving; a fork carries the reference left behind; the mode is one of the
    options an attach must repeat; a track_drift=False conversation answers None."""
    tok = toks["llama3"]
    source = ("{% for m in messages %}{% if m.role == 'assistant' and 'boom' in m.content %}"
              "{{ raise_exception('no boom here') }}{% endif %}<{{ m.role }}>{{ m.content }}<|eot_id|>{% endfor %}"
              "{% if add_generation_prompt %}<assistant>{% endif %}")
    eager = toktier.Conversation(tok, chat.ChatTemplate(source, {"eos_token": "<|eot_id|>"}))
    split = [i for ch in " split reply" for i in tok.encode(ch).tolist()] + tok.encode("<|eot_id|>").tolist()
    with Client(sc.path) as c:
        h = c.conversation("onread", tokenizer="llama3", template=source, track_drift="on_read")
        assert h.last.drift_tracked is False and h.drift() is None
        same(h.append_messages([{"role": "user", "content": "hi"}]), eager.append_messages([{"role": "user",
                                                                                               "content": "hi"}]))
        for turn in range(4):
            ids = tok.encode(f" answer {turn}<|eot_id|>").tolist() if turn % 2 else split
            r = h.append_generated(ids, then=[{"role": "tool", "content": f"result {turn}"}])
            want = eager.append_generated(ids, then=[{"role": "tool", "content": f"result {turn}"}])
            assert r.ids.tolist() == want.ids.tolist() and r.drift is None and not r.drift_tracked
            if turn % 2:  # read after two ops: one catch-up for both
                assert h.drift() == want.drift is not None
                assert r.valid and h.last.seq == r.seq  # nothing changed
        with pytest.raises(E.SessionConflict):
            c.conversation("onread", tokenizer="llama3", template=source)  # track_drift differs
        g = h.fork("onread-fork")
        assert g.last.drift is None and g.drift() == eager.drift
        twin = eager.fork()  # (an eager twin would refuse the op below)
        twin.track_drift = False
        r = h.append_generated(tok.encode(" boom<|eot_id|>"))  # the op renders the marker: served
        assert r.ids.tolist() == twin.append_generated(tok.encode(" boom<|eot_id|>")).ids.tolist()
        for _ in range(2):
            with pytest.raises(E.ChatTemplateError, match="no boom"):
                h.drift()
        assert r.valid
        h.rollback(r.messages - 1)
        assert h.drift() == eager.drift
        with pytest.raises(ValueError, match="on_read"):
            c.conversation("bad", tokenizer="llama3", track_drift="sometimes")
        off = c.conversation("off", tokenizer="llama3", track_drift=False)
        off.append_messages([{"role": "user", "content": "hi"}])
        off.append_generated(split)
        assert off.drift() is None


def test_then_is_checked_like_appended_messages(start_sidecar, toks):
    """Bad `then` messages are refused before anything changes: not JSON-able (bad_request), too
    big for the server (too_large); the conversation is as before and goes on."""
    sc = start_sidecar(tokenizers=("llama3",), max_session_chars=5_000)
    tok = toks["llama3"]
    local = toktier.Conversation(tok)
    with Client(sc.path) as c:
        h = c.conversation("checked", tokenizer="llama3")
        same(h.append_messages([{"role": "user", "content": "hi"}]), local.append_messages([{"role": "user",
                                                                                               "content": "hi"}]))
        ids = tok.encode("hello<|eot_id|>")
        with pytest.raises(E.TooLarge):
            h.append_generated(ids, then=[{"role": "tool", "content": "x" * 6_000}])
        with pytest.raises(E.BadRequest, match=r"then\[0\]\.role"):
            h.append_generated(ids, then=[{"content": "no role"}])
        with pytest.raises(E.BadRequest, match=r"then\[1\]\.content is bytes"):  # msgpack carries it, JSON cannot
            h.append_generated(ids, then=[{"role": "tool", "content": "ok"}, {"role": "tool", "content": b"\x00"}])
        r = h.append_generated(ids, then=[{"role": "ipython", "content": "ok"}])
        same(r, local.append_generated(ids, then=[{"role": "ipython", "content": "ok"}]))


async def test_async_generated_then(sc, toks):
    tok = toks["qwen3"]
    local = toktier.Conversation(tok)
    async with AsyncClient(sc.path) as c:
        h = await c.conversation("async-then", tokenizer="qwen3")
        prompt = [{"role": "user", "content": "hi"}]
        same(await h.append_messages(prompt), local.append_messages(prompt))
        ids, then = tok.encode("hello<|im_end|>"), [{"role": "user", "content": "and then?"}]
        same(await h.append_generated(ids, then=then), local.append_generated(ids, then=then))
        assert await h.close()


async def test_async_client_many_conversations_concurrently(sc, toks):
    tok = toks["qwen3"]
    template = chat.template_for(tok)

    async def one(c: AsyncClient, i: int) -> int:
        local = toktier.Conversation(tok)
        h = await c.conversation(f"async-{i}", tokenizer="qwen3")
        messages: list[dict] = []
        for op, arg in QWEN_SCRIPT[: 3 + i % 5]:
            sent, messages = step(messages, op, arg)
            same(await getattr(h, op)(sent), getattr(local, op)(copy.deepcopy(sent)), tok, template, messages)
        b = await h.fork(f"async-{i}-fork")
        same_state(b.last, local)
        gen = tok.encode(f"Answer {i}.<|im_end|>")
        same(await b.append_generated(gen), local.fork().append_generated(gen))
        assert await b.close() and await h.close()
        return 1

    async with AsyncClient(sc.path) as c:
        assert sum(await asyncio.gather(*(one(c, i) for i in range(8)))) == 8
        assert (await c.stats()).conversations == 0


def test_errors_are_typed_on_the_client(sc, toks):
    tok = toks["qwen3"]
    with Client(sc.path) as c:
        h = c.conversation("err", tokenizer="qwen3")
        with pytest.raises(E.InvalidConversationOp):  # nothing to continue yet
            h.append_generated(tok.encode("hi"))
        h.append_messages([{"role": "user", "content": "hi"}])
        with pytest.raises(E.BadRequest, match=r"messages\[0\]\.role"):
            h.append_messages([{"content": "no role"}])
        with pytest.raises(E.BadRequest, match=r"messages\[1\]\.content\[0\]\.data is bytes"):
            h.append_messages([{"role": "user", "content": "ok"},
                               {"role": "user", "content": [{"type": "image", "data": b"\x89PNG"}]}])
        with pytest.raises(E.InvalidTokenIds) as ei:
            h.append_generated([1, 2, 10_000_000])
        assert isinstance(ei.value, ValueError)
        with pytest.raises(E.InvalidConversationOp):
            h.rollback(5)
        with pytest.raises(ValueError):  # local misuse: nothing is sent
            h.append_generated([-1])
        with pytest.raises(TypeError):
            h.append_messages({"role": "user", "content": "a message, not a list"})
        r = h.append_messages([{"role": "user", "content": "still usable"}])  # failed ops changed nothing
        assert r.messages == 2 and r.seq == h.last.seq
        # Another writer changed it: this handle's next op conflicts instead of applying blindly.
        other = c.conversation("err", tokenizer="qwen3")
        other.append_messages([{"role": "user", "content": "from elsewhere"}])
        with pytest.raises(E.SessionConflict):
            h.append_messages([{"role": "user", "content": "stale"}])
        with pytest.raises(E.SessionConflict):  # a drift read checks the seq too
            h.drift()
        with pytest.raises(E.SessionConflict):  # attaching with other options
            c.conversation("err", tokenizer="qwen3", enable_thinking=False)
        with pytest.raises(E.SessionConflict):
            c.conversation("err", tokenizer="qwen3", create_only=True)
        with pytest.raises(E.TokenizerMismatch):
            c.conversation("err", tokenizer="llama3")
        with pytest.raises(E.BadRequest, match="template_kwargs"):
            c.conversation("kw", tokenizer="qwen3", match_mode=b"bytes")
        with pytest.raises(E.InvalidChatInput):  # the core refuses render arguments it owns
            c.conversation("kw2", tokenizer="qwen3", continue_final_message=True)
        with pytest.raises(E.ChatTemplateError):
            c.conversation("bad-template", tokenizer="qwen3", template="{% for m in messages %}")
        raising = c.conversation("raises", tokenizer="qwen3",
                                 template="{% for m in messages %}{{ raise_exception('no ' + m.role) }}{% endfor %}")
        with pytest.raises(E.ChatTemplateError, match="no user"):
            raising.append_messages([{"role": "user", "content": "x"}])
        with pytest.raises(E.UnknownTokenizer):
            c.conversation("nope", tokenizer="no-such-tokenizer")
        # Unknown and closed conversations miss, with the reason.
        assert other.close()
        with pytest.raises(E.SessionMiss) as ei:
            other.append_messages([{"role": "user", "content": "gone"}])
        assert ei.value.reason == "closed" and "conversation 'err'" in str(ei.value)
        with pytest.raises(E.SessionMiss) as ei:
            other.drift()
        assert ei.value.reason == "closed"
        with pytest.raises(E.SessionMiss) as ei:
            c.call(P.ConvAppendMessages(id=c.next_id(), conversation="never", messages=[]))
        assert ei.value.reason == "unknown"
        with pytest.raises(E.SessionMiss) as ei:
            c.call(P.ConvDrift(id=c.next_id(), conversation="never"))
        assert ei.value.reason == "unknown"
        assert c.ping().id > 0  # the connection goes on


def test_template_missing_is_typed(start_sidecar, toks):
    sc = start_sidecar(tokenizers=("llama3", "cl100k_base"))
    with Client(sc.path) as c:
        with pytest.raises(E.ChatTemplateMissing) as ei:
            c.conversation("raw", tokenizer="cl100k_base")
        assert isinstance(ei.value, LookupError)
        # A caller's template works for any tokenizer; registered names are accepted too.
        h = c.conversation("raw", tokenizer="cl100k_base", template="{% for m in messages %}{{ m.content }}|"
                                                                      "{% endfor %}")
        r = h.append_messages([{"role": "user", "content": "hello"}, {"role": "user", "content": " world"}])
        assert r.ids.tolist() == list(sc.sidecar.service.registry.get("cl100k_base").encode("hello| world|"))
        named = c.conversation("named", tokenizer="llama3", template="llama3_1")
        assert named.append_messages([{"role": "user", "content": "hi"}]).messages == 1


def test_gpt_oss_conversations_render_through_harmony(start_sidecar, registry):
    """o200k_harmony's registered renderer is openai-harmony's (toktier.harmony) on the wire too:
    text ops equal the reference encoding of harmony's render, sampled turns (analysis + tool call
    to `<|call|>`, then a final answer to `<|return|>`) equal the in-process conversation, the
    render options travel, and a fork branches."""
    oh = pytest.importorskip("openai_harmony", reason="pip install 'toktier[harmony]'")
    sc = start_sidecar(tokenizers=("llama3", "o200k_harmony"))
    assert oh is not None
    tok = registry.load("o200k_harmony")
    template = chat.template_for("o200k_harmony")
    kw = {"tools": TOOLS, "reasoning_effort": "high"}
    local = toktier.Conversation(tok, **kw)
    prompt = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "6*7? 🙂 <|end|>"}]

    def sampled(text: str) -> list[int]:
        return tok.encode(text).tolist()

    with Client(sc.path) as c:
        h = c.conversation("gpt-oss", tokenizer="o200k_harmony", **kw)
        same(h.append_messages(prompt), local.append_messages(prompt), tok, template, prompt, **kw)
        call = sampled("<|channel|>analysis<|message|>Use calc.<|end|><|start|>assistant<|channel|>commentary "
                       "to=functions.calc <|constrain|>json<|message|>{\"expr\":\"6*7\"}<|call|>")
        results = [{"role": "tool", "name": "calc", "content": "42"}]
        same(h.append_generated(call, then=results), local.append_generated(call, then=results))
        final = sampled("<|channel|>final<|message|>42.<|return|>")
        wire = h.append_generated(final)
        same(wire, local.append_generated(final))
        assert wire.drift is not None  # the re-render closes turns with <|end|> and orders the header otherwise
        branch = h.fork("gpt-oss-b")
        same_state(branch.last, local)
        more = [{"role": "user", "content": "And 7*8?"}]
        same(branch.append_messages(more), local.fork().append_messages(more))
        assert h.close() and branch.close()


def test_bad_frames_are_bad_requests_naming_the_field(sc):
    r = Raw(sc.path)
    bodies = [
        {"t": "conv_append_messages", "id": 5, "conversation": "x", "messages": [3]},
        {"t": "conv_open", "id": 6, "conversation": "x", "match": "fuzzy"},
        {"t": "conv_open", "id": 8, "conversation": "x" * (P.MAX_SESSION_ID_BYTES + 1)},
    ]
    r.send(b"".join(P.HEADER.pack(len(b)) + b for b in map(msgspec.msgpack.encode, bodies)))
    replies = {e.id: e for e in r.replies(3)}
    assert {i: e.code for i, e in replies.items()} == {5: P.ErrorCode.BAD_REQUEST, 6: P.ErrorCode.BAD_REQUEST,
                                                       8: P.ErrorCode.BAD_REQUEST}
    assert "$.messages[0]" in replies[5].message and "match" in replies[6].message
    r.send(P.encode_frame(P.ConvOpen(id=9, conversation="x", tokenizer="qwen3")))
    r.send(P.encode_frame(P.ConvAppendGenerated(id=10, conversation="x", ids=b"\x01\x02\x03")))
    opened, odd = r.replies(2)
    assert isinstance(opened, P.ConvIds) and odd.code is P.ErrorCode.BAD_REQUEST and "multiple of 4" in odd.message
    r.close()


def test_resent_op_is_answered_not_applied_twice(sc):
    with Client(sc.path) as c:
        h = c.conversation("resend", tokenizer="llama3")
        req = P.ConvAppendMessages(id=c.next_id(), conversation="resend", expect_seq=h.last.seq, op_key="w.1",
                                   messages=[{"role": "user", "content": "once"}])
        first = c.call(req)
        again = c.call(P.ConvAppendMessages(id=c.next_id(), conversation="resend", expect_seq=h.last.seq,
                                            op_key="w.1", messages=[{"role": "user", "content": "once"}]))
        assert isinstance(again, P.ConvIds)
        assert (again.seq, again.count, again.messages) == (first.seq, first.count, 1)
        fork = P.ConvFork(id=c.next_id(), conversation="resend", new="resend-2", op_key="w.2")
        assert c.call(fork).seq == c.call(P.ConvFork(id=c.next_id(), conversation="resend", new="resend-2",
                                                     op_key="w.2")).seq
        with pytest.raises(E.SessionConflict):  # a fork to an existing id, not a re-send
            c.call(P.ConvFork(id=c.next_id(), conversation="resend", new="resend-2", op_key="w.3"))


def test_conversation_ids_are_apart_from_session_ids(sc, toks):
    with Client(sc.path) as c:
        s = c.session("shared-id", tokenizer="llama3", text="plain text")
        h = c.conversation("shared-id", tokenizer="llama3")
        h.append_messages([{"role": "user", "content": "hi"}])
        assert s.close()  # Close ends the session only
        r = h.append_messages([{"role": "user", "content": "still here"}])
        assert r.messages == 2 and c.stats().sessions == 0 and c.stats().conversations == 1
        assert c.call(P.ConvClose(id=c.next_id(), conversation="shared-id")).existed


def test_eviction_under_a_tiny_memory_budget(start_sidecar, toks):
    sc = start_sidecar(tokenizers=("llama3",), memory_budget=600_000)
    body = "lorem ipsum dolor sit amet " * 1500  # ~40K characters per conversation
    with Client(sc.path) as c:
        handles = []
        for i in range(8):
            h = c.conversation(f"big-{i}", tokenizer="llama3")
            h.append_messages([{"role": "user", "content": f"{i} {body}"}])
            handles.append(h)
        st = c.stats()
        assert st.bytes_held <= 600_000 and st.evictions["memory"] >= 1
        assert 1 <= st.conversations < 8
        with pytest.raises(E.SessionMiss) as ei:
            handles[0].append_messages([{"role": "user", "content": "evicted?"}])
        assert ei.value.reason == "memory"
        r = handles[-1].append_messages([{"role": "user", "content": "the latest survives"}])
        assert np.array_equal(r.ids, reference(toks["llama3"], chat.template_for(toks["llama3"]),
                                               [{"role": "user", "content": f"7 {body}"},
                                                {"role": "user", "content": "the latest survives"}]))
        assert len(shm_names(sc.prefix)) == c.stats().conversations  # evicted segments are unlinked


def test_charged_size_is_honest(start_sidecar, toks):
    """The budget charge grows with the conversation and covers what the process holds for it."""
    import tracemalloc

    sc = start_sidecar(tokenizers=("llama3",))
    store = sc.sidecar.service.store
    with Client(sc.path) as c:
        h = c.conversation("sized", tokenizer="llama3")
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        h.append_messages([{"role": "user", "content": "word " * 20_000}, {"role": "assistant", "content": "ok"}])
        grown = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        charged = store.stats().bytes_held
        assert charged >= 100_000 + 4 * len(h.last.ids)  # text and IDs at least
        # Measured: ~410 KB traced (text, IDs, offsets, messages) for ~540 KB charged (with the segment).
        assert 0.8 * grown <= charged <= 2.5 * grown + 64 * 1024


def test_ttl_ends_idle_conversations(start_sidecar):
    sc = start_sidecar(tokenizers=("llama3",), session_ttl=0.4)
    with Client(sc.path) as c:
        h = c.conversation("idle", tokenizer="llama3")
        h.append_messages([{"role": "user", "content": "hi"}])
        time.sleep(0.7)
        with pytest.raises(E.SessionMiss) as ei:
            h.append_messages([{"role": "user", "content": "too late"}])
        assert ei.value.reason == "ttl"
        assert shm_names(sc.prefix) == []


def test_big_ops_run_off_the_event_loop_with_the_same_ids(start_sidecar, toks, monkeypatch):
    import threading

    sc = start_sidecar(tokenizers=("qwen3",), inline_chars=16)
    tok = toks["qwen3"]
    local = toktier.Conversation(tok)
    book = sc.sidecar.service.conversations
    threads: set[str] = set()
    publish = book.publish

    def recording(*args, **kwargs):
        threads.add(threading.current_thread().name.rpartition("_")[0])
        return publish(*args, **kwargs)

    monkeypatch.setattr(book, "publish", recording)
    with Client(sc.path) as c:
        h = c.conversation("pooled", tokenizer="qwen3")
        messages: list[dict] = []
        for op, arg in QWEN_SCRIPT:
            sent, messages = step(messages, op, arg)
            same(getattr(h, op)(sent), getattr(local, op)(copy.deepcopy(sent)), tok, chat.template_for(tok), messages)
        big = [{"role": "user", "content": "汉字 and ascii " * 20_000}]  # grows the segment
        same(h.append_messages(big), local.append_messages(big))
    assert threads == {"toktier-bulk", "toktier-repair"}  # opens in bulk, changes in repair: never the loop


def test_conversation_metrics(start_sidecar):
    sc = start_sidecar(tokenizers=("qwen3",), metrics_port=0)
    with Client(sc.path) as c:
        h = c.conversation("m", tokenizer="qwen3")
        h.append_messages([{"role": "user", "content": "hi"}])
        h.append_generated(sc.sidecar.service.registry.get("qwen3").encode(" Hel" "lo<|im_end|>"))
        with urllib.request.urlopen(f"http://127.0.0.1:{sc.sidecar.metrics_port}/metrics", timeout=10) as resp:
            body = resp.read().decode()
    assert re.search(r'toktier_conversation_ops_total\{op="conv_append_messages",tokenizer="qwen3"\} 1\.0', body)
    assert re.search(r'toktier_conversation_ops_total\{op="conv_open",tokenizer="qwen3"\} 1\.0', body)
    assert re.search(r"^toktier_conversations_live 1\.0", body, re.M)
    assert re.search(r'toktier_requests_total\{op="conv_append_generated",outcome="ok"\} 1\.0', body)


# ------------------------------------------------------------------ wire, without a sidecar
REQUESTS = [
    P.ConvOpen(id=1, conversation="c", tokenizer="qwen3", template="{{ x }}", template_kwargs={"tools": TOOLS},
               match="loose_tool_call", add_generation_prompt=False, stop_texts=["<|end|>"], create_only=True,
               op_key="k"),
    P.ConvOpen(id=2, conversation="c"),
    P.ConvAppendMessages(id=3, conversation="c", messages=[{"role": "user", "content": [{"type": "text"}]}],
                         expect_seq=4, op_key="k"),
    P.ConvSetMessages(id=4, conversation="c", messages=[]),
    P.ConvAppendGenerated(id=5, conversation="c", ids=pack_ids(np.arange(10, dtype=np.uint64))),
    P.ConvFork(id=6, conversation="c", new="d", expect_seq=2),
    P.ConvRollback(id=7, conversation="c", n_messages=0),
    P.ConvClose(id=8, conversation="c"),
    P.ConvOpen(id=9, conversation="c", track_drift="on_read"),
    P.ConvOpen(id=10, conversation="c", track_drift=False),
    P.ConvDrift(id=11, conversation="c", expect_seq=3),
]


@pytest.mark.parametrize("msg", REQUESTS, ids=lambda m: type(m).__name__)
def test_requests_round_trip(msg):
    frame = P.encode_frame(msg)
    (body,) = P.FrameDecoder().feed(frame)
    assert P.REQUEST_DECODER.decode(body) == msg


def test_replies_round_trip_and_old_fields_default():
    for drift in (None, 0, 17):
        reply = P.ConvIds(id=1, segment="/s", offset=64, count=3, seq=2, first_changed=1, tokenizer="h",
                          first_changed_message=1, drift=drift, chars=9, messages=2)
        assert P.REPLY_DECODER.decode(P.encode_frame(reply)[4:]) == reply
    minimal = msgspec.msgpack.encode({"t": "conv_ids", "id": 1, "segment": "/s", "offset": 64, "count": 0, "seq": 1,
                                      "first_changed": 0, "tokenizer": "h"})
    got = P.REPLY_DECODER.decode(minimal)
    assert (got.drift, got.first_changed_message, got.chars, got.messages) == (None, 0, 0, 0)
    for drift in (None, 5):
        reply = P.ConvDriftIs(id=2, drift=drift, seq=7, drift_tracked=drift is not None)
        assert P.REPLY_DECODER.decode(P.encode_frame(reply)[4:]) == reply
    with pytest.raises(msgspec.ValidationError, match="track_drift"):
        P.REQUEST_DECODER.decode(msgspec.msgpack.encode({"t": "conv_open", "id": 1, "conversation": "c",
                                                         "track_drift": "sometimes"}))
    assert P.StatsReply(id=1, sessions=0, bytes_held=0, shm_bytes=0, shm_segments=0, opened=0, closed=0, misses=0,
                        evictions={}, connections=0, uptime_s=0.0).conversations == 0


def test_pack_ids_accepts_integer_arrays_and_lists_only():
    want = np.array([0, 1, 2**32 - 1], dtype="<u4").tobytes()
    for ids in ([0, 1, 2**32 - 1], np.array([0, 1, 2**32 - 1], dtype=np.uint32),
                np.array([0, 1, 2**32 - 1], dtype=np.int64), np.array([0, 1, 2**32 - 1], dtype=np.uint64)):
        assert pack_ids(ids) == want
    assert pack_ids([]) == b"" and pack_ids(np.zeros(0, dtype=np.float32)) == b""
    for bad, exc in (([2**32], ValueError), ([-1], ValueError), ([1.5], TypeError), ([[1]], ValueError),
                     (["1"], TypeError)):
        with pytest.raises(exc):
            pack_ids(bad)


def test_an_op_failing_midway_republishes_every_id_next(sc, toks, monkeypatch):
    """A typed failure after the core changed its state (the reference engine failing deep inside):
    the conversation stays, and the next result shows all of its IDs, not a stale segment."""
    tok = toks["llama3"]
    local = toktier.Conversation(tok)
    original = toktier.Conversation.append_messages

    def applied_then_failed(self, messages):
        result = original(self, messages)
        if messages and messages[0].get("content") == "boom":
            raise toktier.ReferenceEngineError("the engine failed after the op applied")
        return result

    with Client(sc.path) as c:
        h = c.conversation("midway", tokenizer="llama3")
        same(h.append_messages([{"role": "user", "content": "hi"}]),
             local.append_messages([{"role": "user", "content": "hi"}]))
        monkeypatch.setattr(toktier.Conversation, "append_messages", applied_then_failed)
        with pytest.raises(E.ReferenceEngineError):
            h.append_messages([{"role": "user", "content": "boom"}])
        monkeypatch.setattr(toktier.Conversation, "append_messages", original)
        local.append_messages([{"role": "user", "content": "boom"}])
        last = [{"role": "user", "content": "after"}]
        wire = h.append_messages(last)
        assert np.array_equal(wire.ids, local.append_messages(last).ids)


def test_shadow_verifier_checks_text_only_conversations(start_sidecar, toks):
    sc = start_sidecar(tokenizers=("qwen3",), verify_rate=1.0)
    tok = toks["qwen3"]
    with Client(sc.path) as c:
        h = c.conversation("verified", tokenizer="qwen3")
        messages: list[dict] = []
        for op, arg in QWEN_SCRIPT:
            sent, messages = step(messages, op, arg)
            getattr(h, op)(sent)
        h.append_generated(tok.encode("Fine.<|im_end|>"))  # not sampled: IDs need not encode the text
    verifier = sc.sidecar.verifier
    assert wait_until(lambda: verifier.stats.checked >= len(QWEN_SCRIPT))
    assert verifier.stats.mismatches == 0


# ------------------------------------------------------------------ properties
# Adversarial pieces: special-token text, think tags, combining marks, astral characters, JSON
# syntax, whitespace runs, the empty string.
PIECES = ["hello", " ", "\n\n", "数字", "🎉", "<|im_end|>", "<|im_start|>assistant", "<think>", "</think>", "{\"a\":",
          "\t  ", "e\u0301", "ǅ", ""]
contents = st.lists(st.sampled_from(PIECES), max_size=6).map("".join)
plain_messages = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]), "content": contents})
op_lists = st.lists(st.one_of(
    st.tuples(st.just("append_messages"), st.lists(plain_messages, min_size=1, max_size=3)),
    st.tuples(st.just("edit"), st.integers(0, 8), contents),
    st.tuples(st.just("rollback"), st.integers(0, 8)),
    st.tuples(st.just("append_generated"), contents),
), min_size=1, max_size=6)
# Values a client may send that JSON cannot hold: refused as bad_request, never an internal error.
odd_values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**63 - 1), st.floats(),
                                    st.text(max_size=5), st.binary(max_size=3)),
                          lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                  st.dictionaries(st.one_of(st.text(max_size=3), st.integers(0, 9)),
                                                                  inner, max_size=3)), max_leaves=8)


def _outcome(fn):
    try:
        return fn()
    except (toktier.TokTierError, E.RemoteError) as exc:
        return type(exc).__name__


@settings(max_examples=25, deadline=None, print_blob=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(ops=op_lists)
def test_random_op_sequences_equal_in_process(sc, toks, ops):
    """Any sequence of ops gives the in-process conversation's IDs, first_changed and drift, or the
    same error class (over the wire, the client's twin of the core's class)."""
    tok = toks["qwen3"]
    local = toktier.Conversation(tok)
    with Client(sc.path) as c:
        h = c.conversation("prop", tokenizer="qwen3")
        try:
            for op, *args in ops:
                if op == "edit":
                    new = list(copy.deepcopy(local.messages))
                    if new:
                        new[args[0] % len(new)]["content"] = args[1]
                    calls = ("set_messages", new)
                elif op == "append_generated":
                    calls = (op, tok.encode(args[0] + "<|im_end|>"))
                else:
                    calls = (op, args[0])
                mine = _outcome(lambda: getattr(local, calls[0])(copy.deepcopy(calls[1])))
                wire = _outcome(lambda: getattr(h, calls[0])(calls[1]))
                if isinstance(mine, str):
                    assert wire == mine, (calls, wire, mine)
                else:
                    same(wire, mine)
        finally:
            h.close()


@settings(max_examples=40, deadline=None, print_blob=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(value=odd_values, where=st.sampled_from(["content", "extra"]))
def test_any_message_value_is_served_or_refused_as_bad_request(sc, value, where):
    with Client(sc.path) as c:
        h = c.conversation("odd", tokenizer="llama3")
        try:
            h.append_messages([{"role": "user", "content": "x", where: value}])
        except E.RemoteError as exc:
            assert type(exc) in (E.BadRequest, E.InvalidChatInput, E.ChatTemplateError), exc
        finally:
            h.close()


def test_which_conversation_ops_look_a_record_up(start_sidecar, tmp_path, monkeypatch):
    """With a shared --state-store every op on a conversation not held here looks its record up
    (persistence: tests/sidecar/test_conversation_state.py), except ConvClose, which deletes it
    unread; with the state dir alone only an indexed record is looked up."""
    from toktier_sidecar.conversations import conversation_key

    sc = start_sidecar(tokenizers=("llama3",), state_dir=str(tmp_path / "state"))
    key = conversation_key(0, "c")
    ops = (P.ConvOpen(id=1, conversation="c"), P.ConvAppendMessages(id=2, conversation="c", messages=[]),
           P.ConvFork(id=3, conversation="c", new="d"), P.ConvDrift(id=5, conversation="c"))
    assert not any(sc.sidecar._restorable(key, req) for req in ops)  # nothing indexed in the directory
    monkeypatch.setattr(sc.sidecar, "state_store", object())  # as if a store were configured
    assert all(sc.sidecar._restorable(key, req) for req in ops)
    assert not sc.sidecar._restorable(key, P.ConvClose(id=4, conversation="c"))


def test_match_modes_on_the_wire_are_the_cores(sc, toks):
    import json
    from typing import get_args

    from toktier.message_match import MATCH_MODES

    assert get_args(P.MatchMode) == MATCH_MODES
    tok = toks["qwen3"]
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "calc", "arguments": {"expr": "1+1"}}}]}
    history = [{"role": "user", "content": "1+1?"}, call, {"role": "tool", "content": "2"}]
    resent = copy.deepcopy(history)  # an agent harness re-serializes the arguments it sent
    resent[1]["tool_calls"][0]["function"]["arguments"] = json.dumps({"expr": "1+1"})
    resent.append({"role": "user", "content": "thanks"})
    with Client(sc.path) as c:
        for match in MATCH_MODES:
            local = toktier.Conversation(tok, match=match, tools=TOOLS)
            h = c.conversation(f"match-{match}", tokenizer="qwen3", match=match, tools=TOOLS)
            same(h.set_messages(history), local.set_messages(copy.deepcopy(history)))
            same(h.set_messages(resent), local.set_messages(copy.deepcopy(resent)))
