"""Errors round-trip: every sidecar-side error class arrives at the client as the class of the
same name and builtin bases, with its structured fields; every wire code has one client class."""

from __future__ import annotations

import asyncio
import inspect

import pytest

import toktier
import toktier.errors as core_errors
from toktier_sidecar import errors as SE
from toktier.store import SessionMiss as CoreSessionMiss
from toktier_client import AsyncClient, Client
from toktier_client import errors as E
from toktier_client import protocol as P
from toktier_client.core import ClientConnection, Failed
from sidecar_harness import llama3, registry, sidecar, start_sidecar  # noqa: F401  (fixtures)

WELCOME = P.Welcome(version=P.PROTOCOL_VERSION, server="t", max_frame=1 << 20, max_session_chars=10,
                    max_inflight=4, default_tokenizer="x")


def builtin_bases(cls: type) -> set[type]:
    return {b for b in cls.__mro__ if b.__module__ == "builtins"}


# The sidecar raises these (the core's own classes and the sidecar's); each must arrive as itself.
RAISED = [
    CoreSessionMiss(("ns", "conv-1"), "ttl"),
    core_errors.UnknownTokenizer("tokenizer 'nope' is not served; served: llama3"),
    core_errors.UnsupportedTokenizer("not a tokenizer.json"),
    core_errors.TokenizerDataMissing("install the data"),
    core_errors.InvalidEditRange("edit [5, 3) is reversed"),
    core_errors.InvalidText("lone surrogate at 3"),
    core_errors.ReferenceEngineError("engine panicked: index out of range"),
    core_errors.InvalidState("the IDs are not the reference encoding of the text"),
    core_errors.ChatTemplateMissing("no chat template is registered for 'cl100k_base'"),
    core_errors.ChatTemplateError("chat template 'qwen3' failed: TemplateError: no tools"),
    core_errors.InvalidChatInput("message 0 has no role"),
    core_errors.InvalidTokenIds("sampled ID 10000000 is outside the tokenizer's 128256 ids"),
    core_errors.InvalidConversationOp("rollback(5): the conversation has 2 message(s)"),
    core_errors.JunctionUnavailable("the template renders the generated turn more than once"),
    SE.SessionConflict("session 's' is at seq 4, not 2"),
    SE.TokenizerMismatch("other tokenizer"),
    SE.TooLarge("too long"),
    SE.Overloaded("too many"),
    SE.BadRequest("bad window"),
    SE.ShuttingDown("bye"),
    SE.ResourceExhausted("shared memory is exhausted"),
]
# Core errors no request can raise, so they need no wire code: InvalidCacheConfig is raised while
# the server's config is built (ServerConfig, `toktier serve` exits with its message), and every
# PrefixCache the sidecar creates takes that validated config.
# The chat-template and conversation errors travel: the conversation ops (toktier_sidecar.conversations)
# raise them (tests/sidecar/test_conversation_ops.py raises each through a real sidecar).
NOT_ON_THE_WIRE = {core_errors.InvalidCacheConfig}


def test_every_core_error_class_has_its_own_code_and_client_twin():
    core_classes = [c for _, c in inspect.getmembers(core_errors, inspect.isclass)
                    if issubclass(c, core_errors.TokTierError) and c is not core_errors.TokTierError]
    sidecar_classes = [c for _, c in inspect.getmembers(SE, inspect.isclass)
                       if issubclass(c, SE.SidecarError) and c is not SE.SidecarError]
    raised = {type(e) for e in RAISED}
    assert (set(core_classes) - NOT_ON_THE_WIRE) | set(sidecar_classes) | {CoreSessionMiss} <= raised, \
        "add new errors to RAISED"
    codes = [SE.code_for(e) for e in RAISED]
    assert None not in codes and len(set(codes)) == len(codes)  # one code per class


def test_every_wire_code_maps_to_one_client_class():
    assert set(E.ERRORS_BY_CODE) == set(P.ErrorCode)
    assert len(set(E.ERRORS_BY_CODE.values())) == len(P.ErrorCode)
    for code, cls in E.ERRORS_BY_CODE.items():
        assert cls.code is code and issubclass(cls, E.RemoteError)


@pytest.mark.parametrize("exc", RAISED, ids=lambda e: type(e).__name__)
def test_error_frames_decode_to_the_same_class_sans_io(exc):
    """sidecar exception -> its Error frame -> bytes -> the client core -> the same class."""
    frame = SE.error_frame(7, exc)
    conn = ClientConnection()
    conn.feed(P.encode_frame(WELCOME))
    conn.send(P.Stats(id=7))
    (ev,) = conn.feed(P.encode_frame(frame))
    assert isinstance(ev, Failed) and ev.id == 7
    err = ev.error
    assert type(err).__name__ == type(exc).__name__
    assert builtin_bases(type(err)) == builtin_bases(type(exc))
    assert (err.request_id, str(err)) == (7, str(exc))
    if isinstance(exc, CoreSessionMiss):
        assert err.reason == exc.reason == "ttl"


def test_a_bug_is_internal_and_names_only_the_class():
    frame = SE.error_frame(3, ZeroDivisionError("secret detail"))
    assert frame.code is P.ErrorCode.INTERNAL and "secret" not in frame.message
    assert isinstance(E.error_from_frame(frame), E.InternalError)


def test_old_error_frames_without_reason_still_decode():
    import msgspec

    body = msgspec.msgpack.encode({"t": "error", "id": 4, "code": "session_miss", "message": "gone"})
    err = E.error_from_frame(P.REPLY_DECODER.decode(body))
    assert type(err) is E.SessionMiss and err.reason == "unknown" and err.request_id == 4


@pytest.mark.parametrize("exc", RAISED + [RuntimeError("a bug")], ids=lambda e: type(e).__name__)
def test_error_round_trip_over_a_real_socket(sidecar, exc, monkeypatch):
    """The sidecar raises ``exc`` while serving a real request; both clients get its twin."""
    def boom(name, specials):
        if name == "boom":
            raise exc
        return real(name, specials)

    real = sidecar.sidecar.service.find_tokenizer
    monkeypatch.setattr(sidecar.sidecar.service, "find_tokenizer", boom)
    expected = "InternalError" if type(exc) is RuntimeError else type(exc).__name__
    with Client(sidecar.path) as c:
        with pytest.raises(E.RemoteError) as ei:
            c.encode("text", tokenizer="boom")
        err = ei.value
        assert type(err).__name__ == expected and err.request_id > 0
        if expected != "InternalError":
            assert builtin_bases(type(err)) == builtin_bases(type(exc)) and str(err) == str(exc)
        if isinstance(exc, CoreSessionMiss):
            assert err.reason == "ttl"
        assert c.ping().id > 0  # the connection goes on

    async def via_async() -> E.RemoteError:
        async with AsyncClient(sidecar.path) as ac:
            with pytest.raises(E.RemoteError) as ei:
                await ac.session("s", tokenizer="boom", text="x")
            return ei.value

    assert type(asyncio.run(via_async())).__name__ == expected


def test_session_miss_reason_over_the_wire(sidecar):
    with Client(sidecar.path) as c:
        s = c.session("ending", text="bye")
        s.close()
        with pytest.raises(E.SessionMiss) as ei:
            c.call(P.Append(id=c.next_id(), session="ending", text="!"))
        assert ei.value.reason == toktier.EndCause.CLOSED.value and isinstance(ei.value, KeyError)
        with pytest.raises(E.SessionMiss) as ei:
            c.call(P.Append(id=c.next_id(), session="never", text="!"))
        assert ei.value.reason == "unknown"


def test_reference_engine_failure_mid_op_is_typed_and_keeps_the_session(sidecar, llama3, monkeypatch):
    import numpy as np
    import toktier.session as ts

    original = ts.Session.append

    def failing(self, text):
        if text == "<panic>":
            raise core_errors.ReferenceEngineError("the engine panicked")
        return original(self, text)

    monkeypatch.setattr(ts.Session, "append", failing)
    with Client(sidecar.path) as c:
        s = c.session("ref", text="Hello")
        with pytest.raises(RuntimeError) as ei:
            s.append("<panic>")
        assert type(ei.value) is E.ReferenceEngineError and "panicked" in str(ei.value)
        r = s.append(" world")  # expected failure: the session was not ended
        assert np.array_equal(r.ids, llama3.encode("Hello world"))
