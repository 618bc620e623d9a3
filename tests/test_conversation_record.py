"""Conversation records: a conversation written as bytes and replayed equals the one written.

Random op sequences (text only, and token-in with runs, branches, rollbacks and forks) are
recorded, round-tripped through bytes and restored; the restored conversation must equal the
original in IDs (checked against the reference by the op models of the conversation tests),
text, messages, runs and drift, and must go on equal under one more op.  Damage, another
tokenizer or format, a replay that gives other IDs and messages msgpack cannot carry are
typed errors, never a conversation.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import toktier
from toktier.conversation import Conversation
from toktier.conversation_record import (
    ConversationRecord, ReplayMismatch, UnserializableConversation, decode_conversation_record,
    encode_conversation_record,
)
from toktier.persist import CorruptRecord, ForeignRecord

from conftest import get_tokenizer
from test_conversation import _OPS, FAMILIES, _run_ops, family
from test_conversation_tito import _OP, Model, _run_tito_ops


def round_trip(conv: Conversation, tok, **kw) -> Conversation:
    rec = ConversationRecord.of(conv, tok, namespace=kw.pop("namespace", 1000), conversation="c", seq=7, **kw)
    data = encode_conversation_record(rec)
    back = decode_conversation_record(data)
    assert back == rec
    return back.restore(tok)


def assert_same(a: Conversation, b: Conversation) -> None:
    assert b.ids.tolist() == a.ids.tolist()
    assert b.text == a.text
    assert b.messages == a.messages
    assert b.drift == a.drift
    assert [(r.message_index, r.sampled.tolist(), r.ids.tolist(), r.stop) for r in b.generated] == \
        [(r.message_index, r.sampled.tolist(), r.ids.tolist(), r.stop) for r in a.generated]
    assert (b.match, b.add_generation_prompt, b.track_drift, dict(b.render_kwargs)) == \
        (a.match, a.add_generation_prompt, a.track_drift, dict(a.render_kwargs))


@pytest.mark.parametrize("name", sorted(FAMILIES))
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(ops=_OPS)
def test_text_conversations_replay_equal(name, ops, tally):
    conv = _run_ops(name, ops, tally)
    back = round_trip(conv, conv.tokenizer)
    assert_same(conv, back)
    more = [{"role": "user", "content": "and one more question"}]
    assert back.append_messages(more).ids.tolist() == conv.append_messages(more).ids.tolist()


@pytest.mark.parametrize("name", ["qwen3", "llama3_1", "glm_special", "minimax_text"])
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(ops=st.lists(_OP, min_size=1, max_size=8), on_read=st.booleans())
def test_token_in_conversations_replay_equal(name, ops, on_read, tally):
    m = _run_tito_ops(name, ops, tally, track_drift="on_read" if on_read else True)
    back = round_trip(m.conv, m.tok)
    assert_same(m.conv, back)
    # Both go on alike: a tool result, then a sampled turn (checked against the definition).
    m.check(m.conv.append_messages([{"role": "user", "content": "next"}]), tally)
    back.append_messages([{"role": "user", "content": "next"}])
    m.check(m.generate(m.sample("fine")), tally)
    back.append_generated(m.runs[-1][1])
    assert_same(m.conv, back)


def test_template_and_settings_come_from_the_record(tally):
    """The template source is stored: the restored conversation renders with it, not with
    whatever the name resolves to now; settings and render kwargs come back too."""
    m = Model("qwen3", agp=False, match="loose_tool_call", enable_thinking=False)
    m.conv.append_messages([{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}])
    m.generate(m.sample("A"))
    rec = ConversationRecord.of(m.conv, m.tok, namespace="*", conversation="c", seq=3, op_key="k",
                                template_ref=("registered", "qwen3"))
    back = decode_conversation_record(encode_conversation_record(rec))
    assert (back.namespace, back.seq, back.op_key, back.template_ref) == ("*", 3, "k", ["registered", "qwen3"])
    assert back.template_source == m.template.source and back.render_kwargs == {"enable_thinking": False}
    assert_same(m.conv, back.restore(m.tok))
    assert back.restore(m.tok, template=m.template).template is m.template  # an equal compiled copy is reused


def test_damage_identity_and_mismatch_are_typed():
    tok, template = family("llama3_1")
    conv = Conversation(tok, template)
    conv.append_messages([{"role": "user", "content": "hello there"}])
    conv.append_generated(tok.encode("Hi!<|eot_id|>"))
    rec = ConversationRecord.of(conv, tok, namespace=1, conversation="c", seq=2)
    data = encode_conversation_record(rec)
    for i in (0, 5, 20, len(data) // 2, len(data) - 1):
        bad = bytearray(data)
        bad[i] ^= 0x10
        with pytest.raises((CorruptRecord, ForeignRecord)):
            decode_conversation_record(bytes(bad))
    with pytest.raises(CorruptRecord):
        decode_conversation_record(data[:-3])
    with pytest.raises(CorruptRecord):
        decode_conversation_record(b"")
    with pytest.raises(CorruptRecord):  # a session record is not a conversation record
        from toktier.persist import SessionRecord, encode_record
        decode_conversation_record(encode_record(SessionRecord.of(toktier.Session(tok, "x"), namespace=1,
                                                                  session_id="s", seq=1)))
    newer = bytearray(data)
    newer[4] += 1  # format version
    body = bytes(newer[:-4])
    import zlib
    with pytest.raises(ForeignRecord):
        decode_conversation_record(body + zlib.crc32(body).to_bytes(4, "little"))
    with pytest.raises(ForeignRecord):
        rec.restore(get_tokenizer("cl100k_base"))
    # Intact, but replaying it gives other IDs (as a build rendering otherwise would): refused.
    other = ConversationRecord.from_state(conv.state(), np.append(conv.ids, 13), tok, namespace=1, conversation="c",
                                          seq=2)
    with pytest.raises(ReplayMismatch):
        other.restore(tok)
    changed = decode_conversation_record(encode_conversation_record(rec))
    changed.messages[0]["content"] = "hello here"
    with pytest.raises(ReplayMismatch):
        changed.restore(tok)


def test_unserializable_render_kwargs_are_refused():
    tok, template = family("llama3_1")
    conv = Conversation(tok, template, custom=object())
    conv.append_messages([{"role": "user", "content": "hi"}])
    with pytest.raises(UnserializableConversation, match="cannot be recorded"):
        encode_conversation_record(ConversationRecord.of(conv, tok, namespace=1, conversation="c", seq=1))


def test_replay_refuses_a_run_without_its_assistant_message():
    tok, template = family("llama3_1")
    conv = Conversation(tok, template)
    conv.append_messages([{"role": "user", "content": "hi"}])
    conv.append_generated(tok.encode("Hello<|eot_id|>"))
    state = conv.state()
    import dataclasses
    for runs in (((0, state.runs[0][1]),), ((5, state.runs[0][1]),)):
        with pytest.raises(toktier.errors.InvalidConversationOp, match="pinned run"):
            Conversation.replay(tok, dataclasses.replace(state, runs=runs))


def test_doctest():
    import doctest

    from toktier import conversation_record
    assert doctest.testmod(conversation_record).failed == 0
