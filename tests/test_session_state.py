"""Sessions as values: forks, primed states (certified or verified), and the injected full path."""

from __future__ import annotations

import random

import numpy as np
import pytest

import toktier
from toktier import persist
from conftest import get_tokenizer
from toktier.fullpath import FullPath, FullPathConfig
from toktier.gpu import bpe_model
from toktier.tools.corpus import ADVERSARIAL_ATOMS, large_text


def _pieces(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(ADVERSARIAL_ATOMS + (" word", ". ", "\n", "x = 1\n")) for _ in range(n))


@pytest.mark.parametrize("name", ["llama3", "o200k_base", "qwen3"])
def test_forks_are_independent_and_exact(name, tally):
    tok = get_tokenizer(name)
    rng = random.Random(name)
    root = toktier.Session(tok, large_text(5000, seed=2))
    forks = [root.fork() for _ in range(3)]
    for s in [root, *forks]:
        for _ in range(6):
            if rng.random() < 0.6:
                s.append(_pieces(rng, 5))
            else:
                a = rng.randrange(s.num_chars + 1)
                s.edit(a, min(s.num_chars, a + rng.randrange(4)), _pieces(rng, 3))
            assert np.array_equal(s.ids, tok.encode(s.text))
            tally(tok, "session")
    texts = {s.text for s in [root, *forks]}
    assert len(texts) == 4  # every branch went its own way
    assert forks[0].stats.ops == 6 and root.stats.ops == 6  # counters are per session


def test_fork_uses_its_own_allocator_and_shares_nothing():
    tok = get_tokenizer("cl100k_base")
    got = []

    def alloc(n: int) -> np.ndarray:
        buf = np.empty(n, dtype=np.uint32)
        got.append(buf)
        return buf

    a = toktier.Session(tok, "hello world " * 50)
    b = a.fork(allocator=alloc)
    assert got and np.shares_memory(b.ids_buffer, got[-1]) and not np.shares_memory(a.ids_buffer, b.ids_buffer)
    before = a.ids.copy()
    b.edit(0, 5, "HELLO")
    assert np.array_equal(a.ids, before) and a.text.startswith("hello")


@pytest.mark.parametrize("name", ["cl100k_base", "llama3", "qwen3"])
def test_from_state_with_a_certificate_does_not_encode(name, monkeypatch):
    tok = get_tokenizer(name)
    s = toktier.Session(tok, large_text(20_000, seed=4, kind="mixed"))
    text, ids, cert = s.text, s.ids.copy(), s.certificate()

    class NoEncode(FullPath):
        def encode(self, tok, text):  # a certified state must not be re-encoded
            raise AssertionError("encoded")

    t = toktier.Session.from_state(tok, text, ids, certificate=cert, full_path=NoEncode())
    assert t.text == text and np.array_equal(t.ids, ids)
    r = t.append(" and then some more words.")
    assert np.array_equal(r.ids, tok.encode(t.text)) and r.path is not toktier.RepairPath.FULL


def test_from_state_verifies_what_it_cannot_certify():
    tok = get_tokenizer("llama3")
    text = "def pipeline(x):\n    return x  # 12345\n" * 20
    ids = tok.encode(text)
    s = toktier.Session.from_state(tok, text, ids)  # no certificate: one encode, equal: accepted
    assert np.array_equal(s.ids, ids)
    bad = ids.copy()
    bad[7] = bad[8]
    with pytest.raises(toktier.InvalidState, match="first difference at token 7"):
        toktier.Session.from_state(tok, text, bad)
    with pytest.raises(toktier.InvalidState):  # a certificate for other IDs does not certify these
        toktier.Session.from_state(tok, text, bad, certificate=s.certificate())
    with pytest.raises(toktier.InvalidState, match="outside"):
        toktier.Session.from_state(tok, text, np.array([10**7], dtype=np.uint32))
    other = get_tokenizer("o200k_base")  # a certificate is bound to its tokenizer
    with pytest.raises(toktier.InvalidState):
        toktier.Session.from_state(other, text, ids, certificate=s.certificate())


def test_certificate_binds_tokenizer_text_and_ids():
    tok = get_tokenizer("cl100k_base")
    s = toktier.Session(tok, "abc def")
    c = s.certificate()
    assert c == toktier.Session(tok, "abc def").certificate()
    s.append("g")
    assert s.certificate() != c
    assert toktier.Session(get_tokenizer("cl100k_base", "none"), "abc def").certificate() != c


class _HostGpu:
    """A GPU encoder standing in for the device: the host model of the GPU algorithm."""

    def __init__(self) -> None:
        self.calls = 0

    def try_encode(self, tok, text, utf8=None, form=None):
        from toktier.gpu.router import gpu_form

        assert utf8 is None or bytes(utf8) == text.encode("utf-8")  # a session hands over its own UTF-8
        self.calls += 1
        if form is None:
            form = gpu_form(tok, text)  # as the router does
        return bpe_model.encode(tok, form) if form is not None and len(text) > 1000 else None


def test_session_uses_the_full_path_it_is_given():
    tok = get_tokenizer("llama3")
    gpu = _HostGpu()
    fp = FullPath(FullPathConfig(min_parallel_chars=4096, native_min_parallel_chars=4096,
                                native_window_parallel_chars=4096), gpu=gpu)
    s = toktier.Session(tok, large_text(30_000, seed=5), full_path=fp)
    assert gpu.calls == 1 and fp.stats().gpu == 1 and fp.stats().encodes == 1
    r = s.append(large_text(8_000, seed=6))  # a big append: its window goes to the full path too
    assert np.array_equal(r.ids, tok.encode(s.text))
    assert fp.stats().encodes >= 2 and gpu.calls == fp.stats().encodes
    s.append(" small")
    assert fp.stats().encodes == gpu.calls  # small windows stay on the session's thread


def test_router_is_asked_once_per_encode():
    """The old router tried the GPU, then called the CPU path that tried it again."""
    from toktier.gpu.router import Router

    class CountingDriver:
        calls = 0

        def encode(self, tok, text):
            CountingDriver.calls += 1
            raise AssertionError("declined requests never reach the driver")

        def verified(self, tok):
            return False  # self-check failed: the router must decline without encoding

    tok = get_tokenizer("cl100k_base")
    r = Router(driver=CountingDriver())
    fp = FullPath(gpu=r)
    text = large_text(10_000, seed=1)
    assert np.array_equal(fp.encode(tok, text), tok.encode(text))
    assert r.counts == {"gpu": 0, "cpu": 1, "spill": 0} and CountingDriver.calls == 0


def test_certified_state_with_nfc_changing_text_is_accepted():
    """A certified qwen3 state whose text NFC changes is valid: primed, exact, and it splices."""
    tok = get_tokenizer("qwen3")
    s = toktier.Session(tok, "re\u0301sume\u0301.txt\n" + large_text(8_000, seed=3, kind="english"))
    t = toktier.Session.from_state(tok, s.text, s.ids, certificate=s.certificate())
    r = t.append(" one more sentence.")
    assert np.array_equal(r.ids, tok.encode(t.text)) and r.path is toktier.RepairPath.FIRST_WINDOW


@pytest.mark.parametrize("ids", [[-1, 5], [1.5, 2.0], [[1, 2]], ["a"], [10**7]])
def test_from_state_refuses_malformed_ids_with_a_typed_error(ids):
    tok = get_tokenizer("cl100k_base")
    with pytest.raises(toktier.InvalidState):
        toktier.Session.from_state(tok, "hello world", ids)


def test_from_state_accepts_a_plain_list_and_an_empty_state():
    tok = get_tokenizer("cl100k_base")
    s = toktier.Session.from_state(tok, "hello world", tok.encode("hello world").tolist())
    assert s.append("!").ids.tolist() == tok.encode("hello world!").tolist()
    assert toktier.Session.from_state(tok, "", []).num_tokens == 0


# -- session records (toktier.persist): format 3, and format 2 read by this build ----------------
class _NoEncode(FullPath):
    def encode(self, tok, text):  # a record that verifies must not be re-encoded
        raise AssertionError("encoded")


@pytest.mark.parametrize("name", ["llama3", "o200k_base", "qwen3"])
def test_format3_record_restores_without_an_encode_or_a_certificate(name, monkeypatch):
    from toktier import persist

    tok = get_tokenizer(name)
    text = large_text(30_000, seed=8, kind="mixed") + " 🚀 naïve café — 東京 ✅ " + "e\u0301 decomposed"
    s = toktier.Session(tok, text)
    rec = persist.SessionRecord.of(s, namespace=7, session_id="c", seq=4)
    assert rec.certificate == "" and rec.nchars == len(text)
    data = persist.encode_record(rec)
    monkeypatch.setattr(persist, "state_certificate", lambda *a: pytest.fail("a format-3 restore hashed the state"))
    monkeypatch.setattr(toktier.session, "state_certificate", lambda *a: pytest.fail("hashed the state"))
    back = persist.decode_record(data)
    assert (back.version, back.nchars, back.seq, back.session) == (3, len(text), 4, "c")
    t = persist.restore_session(tok, back, full_path=_NoEncode())
    assert t.text == text and t.num_chars == len(text) and np.array_equal(t.ids, s.ids)
    for more in (" and then some more words.", "e\u0301!"):
        r = t.append(more)
        assert np.array_equal(r.ids, tok.encode(t.text)) and r.path is not toktier.RepairPath.FULL


@pytest.mark.parametrize("name", ["llama3", "qwen3"])
def test_format2_records_are_read_and_verified_as_before(name):
    from toktier import persist

    tok = get_tokenizer(name)
    text = large_text(20_000, seed=9, kind="mixed") + " 🚀 ✅"
    s = toktier.Session(tok, text)
    rec = persist.SessionRecord.of(s, namespace=1000, session_id="old", seq=2, certify=True)
    back = persist.decode_record(persist.encode_record(rec, version=2))
    assert (back.version, back.nchars, back.certificate) == (2, -1, s.certificate())
    t = persist.restore_session(tok, back, full_path=_NoEncode())  # its certificate matches: no encode
    assert t.num_chars == len(text) and np.array_equal(t.append("!").ids, tok.encode(text + "!"))
    swapped = rec.ids.copy()
    swapped[[1, 2]] = swapped[[2, 1]]
    liar = persist.SessionRecord(rec.tokenizer_hash, rec.tokenizer_name, rec.specials, 1000, "old", 2, 0, rec.text,
                                 swapped, rec.certificate)  # the certificate is of other IDs: verified by an encode
    with pytest.raises(toktier.InvalidState):
        persist.restore_session(tok, persist.decode_record(persist.encode_record(liar, version=2)))


def test_format3_record_checks():
    from toktier import persist

    tok = get_tokenizer("llama3")
    text = "hello world, hello tokens 🚀"
    good = tok.encode(text).astype(np.uint32)

    def record(ids, nchars=len(text), **kw):
        return persist.SessionRecord(tok.hash, tok.name, tok.specials, 0, "x", 1, 0, text.encode(), ids, "",
                                     nchars=nchars, **kw)

    back = persist.decode_record(persist.encode_record(record(good)))
    assert np.array_equal(persist.restore_session(tok, back).ids, good)
    # Another state's IDs (lengths that do not tile the text): verified by an encode, refused.
    with pytest.raises(toktier.InvalidState, match="not the reference"):
        persist.restore_session(tok, record(tok.encode(text + " more").astype(np.uint32)))
    with pytest.raises(toktier.InvalidState, match="outside"):  # before anything indexes with it
        persist.restore_session(tok, record(np.array([len(tok.table) + 5], dtype=np.uint32)))
    for nchars in (len(text) * 5, len(text.encode()) + 1, 0):  # no UTF-8 text of this size has that many
        with pytest.raises(persist.CorruptRecord, match="characters"):
            persist.restore_session(tok, record(good, nchars=nchars))
    ascii_rec = persist.SessionRecord(tok.hash, tok.name, tok.specials, 0, "x", 1, 0, b"plain", tok.encode("plain"),
                                      "", nchars=4)
    with pytest.raises(persist.CorruptRecord):
        persist.restore_session(tok, ascii_rec)
    with pytest.raises(persist.ForeignRecord, match="tokenizer"):
        persist.restore_session(get_tokenizer("cl100k_base"), back)
    data = bytearray(persist.encode_record(record(good)))
    data[4:6] = (9).to_bytes(2, "little")
    with pytest.raises(persist.ForeignRecord, match="version 9"):
        persist.decode_record(bytes(data))
    data = bytearray(persist.encode_record(record(good)))
    data[len(data) // 2] ^= 0x10
    with pytest.raises(persist.CorruptRecord, match="checksum"):
        persist.decode_record(bytes(data))


def test_persist_doctests():
    import doctest

    from toktier import persist

    res = doctest.testmod(persist)
    assert res.failed == 0 and res.attempted > 0


def test_writing_an_older_format_needs_its_certificate_and_a_known_version():
    tok = toktier.load_tokenizer("cl100k_base")
    s = toktier.Session(tok, "hello world")
    plain = persist.SessionRecord.of(s, namespace=0, session_id="a", seq=1)
    with pytest.raises(ValueError, match="certify=True"):
        persist.encode_record(plain, version=2)
    with pytest.raises(ValueError, match="cannot write record format 7"):
        persist.encode_record(plain, version=7)
    old = persist.decode_record(persist.encode_record(
        persist.SessionRecord.of(s, namespace=0, session_id="a", seq=1, certify=True), version=2))
    assert (old.version, old.nchars) == (2, -1)  # what the previous build wrote: no count
    assert persist.restore_session(tok, old).append("!").ids.tolist() == tok.encode("hello world!").tolist()
