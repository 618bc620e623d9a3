"""Conversations outlive the process: ``--state-dir`` and ``--state-store`` keep their records.

A real sidecar writes each conversation's record behind (``toktier.conversation_record``); after
a graceful restart, a SIGKILL of a real ``toktier serve``, or on another sidecar sharing a real
Valkey/Redis server, the conversation's next op restores it (a replay) and goes on with the IDs
the in-process ``toktier.Conversation`` doing the same ops has (text-only turns are also the
reference encoding of the full render).  A record behind the client (a crash lost ops), a
damaged or foreign record, are counted misses, never other IDs; ConvClose forgets a record not
restored yet; a conversation that ends loses its record.
"""

from __future__ import annotations

import os
import secrets
import signal
import sys
import time

import numpy as np
import pytest

import toktier
from toktier.conversation_record import decode_conversation_record
from toktier_client import Client
from toktier_client import errors as E
from toktier_client import protocol as P
from toktier_sidecar.statedir import CONV_SUFFIX, key_digest, record_name
from sidecar_harness import registry, start_sidecar, wait_until  # noqa: F401  (fixtures)
from test_conversation_ops import TOOLS, same, toks  # noqa: F401  (fixture)
from test_state_dir import restores, serve
from test_state_preload import preload as preload_counts
from test_state_preload import preloaded
from test_state_store import store_server  # noqa: F401  (fixture)

KIND = "conversation"


def conv_path(state_dir, conversation: str) -> str:
    name = record_name((KIND, os.getuid()), conversation)
    assert name.endswith(CONV_SUFFIX)
    return os.path.join(str(state_dir), name)


def wait_for_conv_record(state_dir, conversation: str, seq: int, timeout: float = 30):
    """The conversation's record once it reached ``seq`` (written behind: poll the file)."""
    path = conv_path(state_dir, conversation)
    box = []

    def reached() -> bool:
        try:
            with open(path, "rb") as f:
                rec = decode_conversation_record(f.read())
        except (OSError, toktier.TokTierError):
            return False
        box.append(rec)
        return rec.seq == seq
    assert wait_until(reached, timeout), f"record of conversation {conversation!r} never reached seq {seq}"
    return box[-1]


FIRST = [{"role": "system", "content": "You are terse. 数字 🎉"}, {"role": "user", "content": "What is 2+2?"}]
MORE = [{"role": "user", "content": "And 3+3? Say <|im_end|> literally."}]


@pytest.mark.parametrize("preload", [True, False])
def test_conversation_outlives_a_graceful_restart(start_sidecar, tmp_path, toks, preload):
    """With restore at start the first op usually finds the conversation replayed (held) already;
    without it, the op replays it: the same IDs either way."""
    state = tmp_path / "state"
    sc = start_sidecar(tokenizers=("llama3", "qwen3"), state_dir=str(state), state_flush_delay=0.01,
                       state_preload=preload)
    tok = toks["qwen3"]
    local = toktier.Conversation(tok, tools=TOOLS)
    with Client(sc.path) as c:
        h = c.conversation("kept", tokenizer="qwen3", tools=TOOLS)
        same(h.append_messages(FIRST), local.append_messages(FIRST))
        gen = tok.encode("<think>\nTwo and two.\n</think>\n\n4<|im_end|>")
        r = h.append_generated(gen)
        same(r, local.append_generated(gen))
        sc.restart()  # graceful: pending records are written at shutdown
        assert os.path.exists(conv_path(state, "kept"))
        r2 = h.append_messages(MORE)  # the same client and handle: restored, then appended
        same(r2, local.append_messages(MORE))
        assert r2.seq == r.seq + 1 and r2.drift == local.drift
        assert restores(sc)["ok"] == 1
        again = c.conversation("kept", tokenizer="qwen3", tools=TOOLS)  # attach: same options, same state
        assert np.array_equal(again.last.ids, local.ids) and again.last.seq == r2.seq
        with pytest.raises(E.SessionConflict):  # other options conflict, as before the restart
            c.conversation("kept", tokenizer="qwen3")
        gen2 = tok.encode("6<|im_end|>")
        same(h.append_generated(gen2), local.append_generated(gen2))
        assert h.close()
    assert wait_until(lambda: not os.path.exists(conv_path(state, "kept")))  # it ended: its record goes


def test_conversations_are_restored_at_start_and_held_until_their_first_op(start_sidecar, tmp_path, toks):
    state = tmp_path / "state"
    sc = start_sidecar(tokenizers=("llama3",), state_dir=str(state), state_flush_delay=0.01)
    tok = toks["llama3"]
    local = {name: toktier.Conversation(tok) for name in ("a", "b", "closed")}
    with Client(sc.path) as c:
        c.session("a", tokenizer="llama3", text="a session next to conversation a")
        handles = {name: c.conversation(name, tokenizer="llama3") for name in local}
        for name, h in handles.items():
            same(h.append_messages(FIRST), local[name].append_messages(FIRST))
            ids = tok.encode(f"Answer for {name}.<|eot_id|>")
            same(h.append_generated(ids), local[name].append_generated(ids))
        sc.restart()
        counts = preloaded(sc)
        assert counts["restored"] == 4 and counts["claimed"] == 0  # three conversations, one session
        assert sc.sidecar.service.conversations.live == 0  # held apart until their first op
        for name in ("a", "b"):
            r = handles[name].append_messages(MORE)
            same(r, local[name].append_messages(MORE))
        assert preload_counts(sc)["claimed"] == 2 and restores(sc)["ok"] == 2
        assert c.call(P.ConvClose(id=c.next_id(), conversation="closed")).existed  # a held one: forgotten
        assert wait_until(lambda: not os.path.exists(conv_path(state, "closed")))
        s = c.session("a", tokenizer="llama3", text="a session next to conversation a")
        assert s.last.first_changed == len(s.last.ids)  # the session of the same id, held apart
        assert preload_counts(sc)["claimed"] == 3


def test_forks_and_sessions_of_the_same_id_are_kept_apart(start_sidecar, tmp_path, toks):
    """Restored on demand (no restore at start): each key finds its own record."""
    state = tmp_path / "state"
    sc = start_sidecar(tokenizers=("llama3",), state_dir=str(state), state_flush_delay=0.01, state_preload=False)
    tok = toks["llama3"]
    local = toktier.Conversation(tok)
    with Client(sc.path) as c:
        c.session("same-id", tokenizer="llama3", text="a session of the same id")
        h = c.conversation("same-id", tokenizer="llama3")
        same(h.append_messages(FIRST), local.append_messages(FIRST))
        fork = h.fork("forked")
        forked = local.fork()
        sc.restart()
        same(fork.append_messages(MORE), forked.append_messages(MORE))
        same(h.append_generated(tok.encode("Four.<|eot_id|>")), local.append_generated(tok.encode("Four.<|eot_id|>")))
        s = c.session("same-id", tokenizer="llama3", text="a session of the same id")  # restored too, apart
        assert s.last.first_changed == len(s.last.ids)
        assert restores(sc)["ok"] == 3


@pytest.mark.parametrize("damage,result", [("flip", "corrupt"), ("truncate", "corrupt"),
                                           ("session_record", "corrupt"), ("behind", "stale")])
def test_bad_conversation_records_are_counted_misses(start_sidecar, tmp_path, damage, result):
    """Damage, a session's record under a conversation's name, and a record behind the client's
    seq (a crash lost the last ops: the client re-sends its messages) are counted misses, never
    other or older IDs; the directory's bad record goes."""
    state = tmp_path / "state"
    sc = start_sidecar(tokenizers=("llama3",), state_dir=str(state), state_flush_delay=0.01)
    path = conv_path(state, "bad")
    with Client(sc.path, reconnect_timeout=30) as c:
        h = c.conversation("bad", tokenizer="llama3")
        r = h.append_messages(FIRST)
        wait_for_conv_record(state, "bad", r.seq)
        data = bytearray(open(path, "rb").read())
        if damage == "behind":  # the record of an earlier op
            r = h.append_messages(MORE)
            wait_for_conv_record(state, "bad", r.seq)
        sc.stop()
        if damage == "flip":
            data[len(data) // 2] ^= 0x01
        elif damage == "truncate":
            del data[-10:]
        elif damage == "session_record":  # a session's record under a conversation's name
            from toktier.persist import SessionRecord, encode_record
            data = encode_record(SessionRecord.of(toktier.Session(toktier.load_tokenizer("llama3"), "x"),
                                                  namespace=os.getuid(), session_id="bad", seq=r.seq))
        open(path, "wb").write(bytes(data))
        sc.start()
        with pytest.raises(E.SessionMiss):
            h.append_messages([{"role": "assistant", "content": "ok"}])
        assert restores(sc)[result] == 1 and restores(sc)["ok"] == 0
        # the bad record is removed by the write-behind thread, not by the op itself
        assert wait_until(lambda: not os.path.exists(path))


def test_conv_close_forgets_a_record_not_restored_and_create_only_replaces_it(start_sidecar, tmp_path):
    state = tmp_path / "state"
    sc = start_sidecar(tokenizers=("llama3",), state_dir=str(state), state_flush_delay=0.01)
    with Client(sc.path) as c:
        c.conversation("gone", tokenizer="llama3").append_messages(FIRST)
        c.conversation("fresh", tokenizer="llama3").append_messages(FIRST)
    sc.restart()
    with Client(sc.path) as c:
        assert c.call(P.ConvClose(id=c.next_id(), conversation="gone")).existed
        assert not c.call(P.ConvClose(id=c.next_id(), conversation="gone")).existed
        h = c.conversation("fresh", tokenizer="llama3", create_only=True)  # a new one replaces the record
        assert len(h.last.ids) == 0 and h.last.messages == 0
    assert restores(sc)["ok"] == 0
    assert wait_until(lambda: not os.path.exists(conv_path(state, "gone")))


def test_sigkill_keeps_the_written_conversation(tmp_path, toks):
    """A real ``toktier serve`` killed with SIGKILL: the next process restores the conversation's
    record at its first op, which goes on with the in-process conversation's IDs."""
    tok = toks["llama3"]
    state, sock, prefix = tmp_path / "state", str(tmp_path / "t.sock"), f"ttcv{secrets.token_hex(4)}"
    args = [sys.executable, "-m", "toktier", "serve", "--socket", sock, "--shm-prefix", prefix,
            "--state-dir", str(state), "--log-level", "WARNING", "--workers", "2"]
    local = toktier.Conversation(tok)
    proc = serve(args, sock)
    try:
        with Client(sock, reconnect_timeout=60) as c:
            h = c.conversation("agent", tokenizer="llama3")
            for i in range(6):  # a burst of turns, written behind
                same(h.append_messages([{"role": "user", "content": f"step {i}: run the tests"}]),
                     local.append_messages([{"role": "user", "content": f"step {i}: run the tests"}]))
                ids = tok.encode(f"Ran {i} tests.<|eot_id|>")
                r = h.append_generated(ids)
                same(r, local.append_generated(ids))
            wait_for_conv_record(state, "agent", r.seq)
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
            proc = serve(args, sock)
            r2 = h.append_messages([{"role": "tool", "content": "all green"}])
            same(r2, local.append_messages([{"role": "tool", "content": "all green"}]))
            assert r2.seq == r.seq + 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert wait_for_conv_record(state, "agent", r2.seq).count == len(local.ids)  # kept for next time
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def test_conversation_continues_on_another_sidecar(store_server, start_sidecar, toks):  # noqa: F811
    """Two sidecars sharing one real Valkey/Redis server: a conversation opened on A goes on on B."""
    tok = toks["qwen3"]
    a = start_sidecar(tokenizers=("qwen3",), state_store=store_server.url, state_flush_delay=0.01)
    b = start_sidecar(tokenizers=("qwen3",), state_store=store_server.url, state_flush_delay=0.01)
    local = toktier.Conversation(tok)
    with Client(a.path) as ca:
        h = ca.conversation("roaming", tokenizer="qwen3")
        same(h.append_messages(FIRST), local.append_messages(FIRST))
        r = h.append_generated(tok.encode("4<|im_end|>"))
        same(r, local.append_generated(tok.encode("4<|im_end|>")))
    key = b"toktier:s:" + key_digest((KIND, os.getuid()), "roaming").encode()
    store = store_server.client()

    def written() -> bool:
        data = store.get(key)
        return data is not None and decode_conversation_record(data).seq == r.seq
    assert wait_until(written, 30)
    with Client(b.path) as cb:
        hb = cb.conversation("roaming", tokenizer="qwen3")  # restored from the store, then attached
        assert hb.last.seq == r.seq and np.array_equal(hb.last.ids, local.ids)
        same(hb.append_messages(MORE), local.append_messages(MORE))
        assert restores(b)["ok"] == 1
        assert hb.close()  # ConvClose deletes the shared record
    assert wait_until(lambda: store.exists(key) == 0)


@pytest.mark.parametrize("track_drift", [False, "on_read"])
def test_options_survive_the_restart(start_sidecar, tmp_path, toks, track_drift):
    """A restored conversation keeps what it was opened with (template kwargs, track_drift,
    match...): an attach with the same options finds it, one with other options conflicts; an
    on-read one answers ``drift()`` as an eager twin does."""
    state = tmp_path / "state"
    sc = start_sidecar(tokenizers=("qwen3",), state_dir=str(state), state_flush_delay=0.01)
    tok = toks["qwen3"]
    local = toktier.Conversation(tok, track_drift=track_drift, match="loose_tool_call", enable_thinking=False)
    eager = toktier.Conversation(tok, match="loose_tool_call", enable_thinking=False)
    opts = dict(tokenizer="qwen3", track_drift=track_drift, match="loose_tool_call", enable_thinking=False)
    with Client(sc.path) as c:
        h = c.conversation("opts", **opts)
        same(h.append_messages(FIRST), local.append_messages(FIRST))
        odd = [*tok.encode(" Fo"), *tok.encode("ur"), *tok.encode("<|im_end|>")]
        same(h.append_generated(odd), local.append_generated(odd))
        eager.append_messages(FIRST)
        eager.append_generated(odd)
    sc.restart()
    with Client(sc.path) as c:
        again = c.conversation("opts", **opts)
        assert np.array_equal(again.last.ids, local.ids) and not again.last.drift_tracked
        with pytest.raises(E.SessionConflict):
            c.conversation("opts", tokenizer="qwen3", match="loose_tool_call", enable_thinking=False)
        same(again.append_messages(MORE), local.append_messages(MORE))
        eager.append_messages(MORE)
        assert again.drift() == (eager.drift if track_drift else None)
        assert track_drift is False or eager.drift is not None  # (the odd split drifts)


def test_gpt_oss_conversation_outlives_a_restart(start_sidecar, tmp_path, registry):  # noqa: F811
    """A harmony conversation's record names its renderer (kind "harmony"); after a restart it
    replays through openai-harmony to the same IDs, runs and drift."""
    pytest.importorskip("openai_harmony", reason="pip install 'toktier[harmony]'")
    state = tmp_path / "state"
    sc = start_sidecar(tokenizers=("o200k_harmony",), state_dir=str(state), state_flush_delay=0.01)
    tok = registry.load("o200k_harmony")
    kw = {"tools": TOOLS, "reasoning_effort": "low"}
    local = toktier.Conversation(tok, **kw)
    first = [{"role": "user", "content": "6*7?"}]
    call = tok.encode("<|channel|>commentary to=functions.calc <|constrain|>json<|message|>{\"expr\":\"6*7\"}<|call|>")
    results = [{"role": "tool", "name": "calc", "content": "42"}]
    with Client(sc.path) as c:
        h = c.conversation("oss", tokenizer="o200k_harmony", **kw)
        same(h.append_messages(first), local.append_messages(first))
        wire = h.append_generated(call, then=results)
        same(wire, local.append_generated(call, then=results))
        rec = wait_for_conv_record(state, "oss", wire.seq)
        assert rec.template_kind == "harmony"
    sc.restart()
    with Client(sc.path) as c:
        again = c.conversation("oss", tokenizer="o200k_harmony", **kw)
        assert np.array_equal(again.last.ids, local.ids) and again.last.drift == local.drift
        more = [{"role": "user", "content": "And 6*8?"}]
        same(again.append_messages(more), local.append_messages(more))


@pytest.mark.parametrize("cause", ["ttl", "memory"])
def test_an_ended_conversation_loses_its_record(start_sidecar, tmp_path, cause):
    """As for sessions: a conversation that ends here (TTL, eviction for memory) has no record
    left in the directory (nothing would ever claim it), and its next op misses with that reason."""
    state = tmp_path / "state"
    extra = {"session_ttl": 0.6} if cause == "ttl" else {"memory_budget": 600_000}
    sc = start_sidecar(tokenizers=("llama3",), state_dir=str(state), state_flush_delay=0.01, **extra)
    body = "lorem ipsum dolor sit amet " * 1500  # ~40K characters
    with Client(sc.path) as c:
        first = c.conversation("first", tokenizer="llama3")
        r = first.append_messages([{"role": "user", "content": body}])
        wait_for_conv_record(state, "first", r.seq)
        if cause == "ttl":
            time.sleep(1.0)  # idle past the TTL (ended when next touched: the harness's sweep is hourly)
        else:
            for i in range(8):  # newer conversations push the first one out of the budget
                c.conversation(f"more-{i}", tokenizer="llama3").append_messages([{"role": "user", "content": body}])
        with pytest.raises(E.SessionMiss) as ei:
            first.append_messages([{"role": "user", "content": "still there?"}])
        assert ei.value.reason == cause
        assert wait_until(lambda: not os.path.exists(conv_path(state, "first")))


@pytest.mark.parametrize("preload", [False, True])
def test_a_fork_over_an_unrestored_record_replaces_it(start_sidecar, tmp_path, toks, preload):
    """A fork to an id whose record (from the previous run) was never opened takes that id over:
    the old record leaves the index (and, restored at start, its held state is released), the
    fork's record replaces its file, and a later restart restores the fork."""
    state = tmp_path / "state"
    sc = start_sidecar(tokenizers=("llama3",), state_dir=str(state), state_flush_delay=0.01, state_preload=preload)
    tok = toks["llama3"]
    with Client(sc.path) as c:
        c.conversation("old", tokenizer="llama3").append_messages([{"role": "user", "content": "the old one"}])
        h = c.conversation("src", tokenizer="llama3")
        h.append_messages(FIRST)
    sc.restart()
    local = toktier.Conversation(tok)
    local.append_messages(FIRST)
    if preload:
        assert preloaded(sc)["restored"] == 2
    with Client(sc.path) as c:
        h = c.conversation("src", tokenizer="llama3")  # restored
        fork = h.fork("old")  # over the record of "old", which nobody opened
        same_ids = np.array_equal(fork.last.ids, local.ids)
        assert same_ids
        assert not sc.sidecar.state_dir.indexed(conv_key("old"))
        if preload:
            assert not sc.sidecar.preload.held and preload_counts(sc)["released"] == 1
        r = fork.append_messages(MORE)
        same(r, local.append_messages(MORE))
        wait_for_conv_record(state, "old", r.seq)
    sc.restart()
    with Client(sc.path) as c:
        again = c.conversation("old", tokenizer="llama3")
        assert np.array_equal(again.last.ids, local.ids)


def conv_key(conversation: str):
    from toktier_sidecar.conversations import conversation_key
    return conversation_key(os.getuid(), conversation)
