"""Session starts laid out by the native engine's chunk threads (`Session._start`, `FullPath.start`,
`_engine.StagedStart`): the same IDs, text bytes, checkpoints and tiling verdict as the general
path (`Session._full`), against the real references, on every str width and on adversarial text."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import toktier
from adversarial import ATOMS
from conftest import ALL_TOKENIZERS, get_tokenizer
from crafted import VARIANTS
from toktier import Session
from toktier.errors import InvalidText
from toktier.fullpath import FullPath, FullPathConfig
from toktier.offsets import STRIDE, SparseOffsets
from toktier.session import _to_utf8
from toktier.tools.corpus import large_text, samples

# Many chunks (a thread each) on small texts, so chunk edges fall everywhere.
MANY = FullPathConfig(chunk_chars=1024, native_min_parallel_chars=0)


def _general(tok, text: str, fp: FullPath) -> Session:
    """The same start through `_full` (the path every start took before the staged one)."""
    s = Session(tok, "", full_path=fp)
    s._full(_to_utf8(text), len(text), reason="initial text", text=text)
    return s


def _check(tok, text: str, cfg: FullPathConfig = MANY) -> Session:
    fp = FullPath(cfg)
    s = Session(tok, text, full_path=fp)
    ref = tok.encode(text)
    assert np.array_equal(s.ids, ref)
    assert bytes(s._text) == text.encode("utf-8") and s.num_chars == len(text)
    g = _general(tok, text, FullPath(cfg))
    assert np.array_equal(s._starts.checkpoints(), g._starts.checkpoints())
    assert (s._tiles, s._dirty, s._ascii) == (g._tiles, g._dirty, g._ascii)
    if s._tiles:
        want = SparseOffsets(tok.token_len)
        want.rebuild(ref)
        assert np.array_equal(s._starts.checkpoints(), want.checkpoints())
    assert s.stats.full == 1 and s.stats.full_reasons == {"initial text": 1}
    assert fp.stats().encodes == 1
    return s


def _staged(tok, text: str) -> bool:
    """Whether `Session._start` takes `text` (else `_full` does)."""
    return tok.native is not None and not (tok.family_info.nfc and not text.isascii())


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
def test_start_equals_reference_and_general_path(name, tally):
    tok = get_tokenizer(name)
    texts = [s.text for s in samples(max_chars_per_sample=20_000)]
    texts += [large_text(40_000, seed=2, kind=k) for k in ("code", "english", "mixed", "multilingual")]
    texts += [
        "def f(x):\n    return x + 1\n" * 700,  # ASCII: the str's own bytes are copied
        "caf\u00e9 na\u00efve \u00a7 " * 900,  # 1-byte str, not ASCII: converted
        "\u4f60\u597d\u4e16\u754c\u3002 hello " * 700,  # 2-byte str
        "emoji \U0001F600 and text " * 800,  # 4-byte str
    ]
    staged = 0
    for text in texts:
        s = _check(tok, text)
        staged += _staged(tok, text)
        r = s.append(" tail 123\n")
        assert np.array_equal(r.ids, tok.encode(text + " tail 123\n"))
        r = s.edit(len(text) // 2, len(text) // 2 + 3, "x")
        assert np.array_equal(r.ids, tok.encode(s.text))
        tally(tok, "session")
    assert staged >= 4  # every family takes ASCII text through the staged start


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
def test_default_config_one_chunk_per_core(name):
    tok = get_tokenizer(name)
    text = large_text(300_000, seed=9, kind="code")
    fp = FullPath()
    s = Session(tok, text, full_path=fp)
    assert np.array_equal(s.ids, tok.encode(text)) and bytes(s._text) == text.encode()
    assert fp.stats().chunked == 1  # the staged start and `_full` (qwen3's non-ASCII text) alike


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.lists(st.sampled_from(ATOMS), min_size=1, max_size=300).map("".join))
def test_start_on_adversarial_text(name, text, tally):
    tok = get_tokenizer(name)
    _check(tok, text, FullPathConfig(chunk_chars=8, native_min_parallel_chars=0))
    tally(tok, "session")


def test_uncertain_tokens_are_proven_or_refused(tmp_path):
    """Two literals sharing one id (an id with two spellings): the start flags the id and the exact
    span check decides, as the general path does (proven for the canonical spelling, else not)."""
    v = next(v for v in VARIANTS if v.name == "tt-shared-id")
    tok = toktier.load_tokenizer(**v.build(tmp_path))
    assert tok.native is not None and tok.table.any_uncertain
    canon = tok.table.token_bytes[100300].decode()
    other = ({"<|p|>", "<|q|>"} - {canon}).pop()
    verdicts = set()
    for text in (f"a {canon} b " * 600, f"a {other} b " * 600, f"x {canon}{other} y " * 500, "plain words only " * 400):
        staged = tok.native.start_chunks(text, [])
        staged.write(np.empty(staged.num_ids, np.uint32), np.empty(-(-staged.num_ids // STRIDE), np.uint32), STRIDE)
        assert staged.uncertain == (canon in text or other in text)
        verdicts.add(_check(tok, text)._tiles)
    assert verdicts == {True, False}  # both outcomes of the span check were exercised


def test_a_chunk_that_does_not_tile_takes_the_general_path(monkeypatch):
    """Lengths that do not tile the chunks' bytes (a stand-in for any unproven state): the session
    falls back to `_install_offsets`, which proves tiling from the real lengths."""
    tok = get_tokenizer("llama3")
    nat = tok.native
    core = nat._core
    wrong = tok.token_len.copy()
    wrong[tok.encode(" the")[0]] += 1
    calls = []

    def start_chunks(text, cuts, caches, token_len, uncertain=None, check_nfc=True):
        status, staged = core.start_chunks(text, cuts, caches, wrong, uncertain, check_nfc)
        calls.append(staged)
        return status, staged

    class Core:
        def __getattr__(self, name):
            return getattr(core, name)

    fake = Core()
    fake.start_chunks = start_chunks
    monkeypatch.setattr(nat, "_core", fake)
    text = "the cat and the dog " * 2000
    s = _check(tok, text)
    assert calls and not calls[0].tiles and s._tiles


def test_staged_start_api_misuse():
    tok = get_tokenizer("llama3")
    nat = tok.native
    text = "hello world " * 1000
    staged = nat.start_chunks(text, [])
    assert staged.num_bytes == len(text) and staged.num_ids == len(tok.encode(text))
    n_cp = -(-staged.num_ids // STRIDE)
    with pytest.raises(ValueError, match="ids must hold"):
        staged.write(np.empty(staged.num_ids - 1, np.uint32), np.empty(n_cp, np.uint32), STRIDE)
    with pytest.raises(ValueError, match="checkpoints"):
        staged.write(np.empty(staged.num_ids, np.uint32), np.empty(n_cp - 1, np.uint32), STRIDE)
    ids = np.empty(staged.num_ids, np.uint32)
    data = staged.write(ids, np.empty(n_cp, np.uint32), STRIDE)
    assert bytes(data) == text.encode() and np.array_equal(ids, tok.encode(text)) and staged.tiles
    with pytest.raises(RuntimeError, match="already written"):
        staged.write(ids, np.empty(n_cp, np.uint32), STRIDE)
    with pytest.raises(ValueError, match="ascending"):
        nat.start_chunks(text, [5, 5])
    with pytest.raises(ValueError, match="one piece cache per thread"):
        nat._core.start_chunks(text, [5], [nat._take() for _ in range(3)], tok.token_len)
    with pytest.raises(ValueError, match="one piece cache per thread"):
        nat._core.start_chunks(text, [5], [], tok.token_len)
    from toktier.native._engine import StagedStart

    with pytest.raises(TypeError, match="start_chunks"):  # made by hand: refused, not a crash
        StagedStart().write(ids, np.empty(n_cp, np.uint32), STRIDE)


def test_staged_start_sums_the_tables_it_is_given():
    # `StagedStart.write` sums token lengths for the checkpoints and the tiling verdict; with the
    # engine's own tables it reads their one-byte summary (`Engine::len8`), with any other tables
    # those tables themselves.  Both must give those tables' sums: a changed length breaks the
    # tiling, and an id marked uncertain is reported, whichever way the walk went.
    tok = get_tokenizer("llama3")
    nat = tok.native
    text = large_text(20_000, seed=8, kind="code")
    cuts = nat.cuts(text, 4_000)
    ids = tok.encode(text)
    n_cp = -(-len(ids) // STRIDE)
    want = SparseOffsets(tok.token_len)
    want.rebuild(ids)

    def staged(token_len, uncertain):
        caches = [nat._take() for _ in range(2)]
        try:
            status, st = nat._core.start_chunks(text, cuts, caches, token_len, uncertain)
        finally:
            for c in caches:
                nat._give(c)
        assert status == 0
        out_ids, cps = np.empty(st.num_ids, np.uint32), np.empty(n_cp, np.uint32)
        data = st.write(out_ids, cps, STRIDE)
        assert np.array_equal(out_ids, ids) and bytes(data) == text.encode()
        return st, cps

    for lens in (tok.token_len, tok.token_len.copy()):  # the engine's own, and an equal writable copy
        st, cps = staged(lens, None)
        assert st.tiles and not st.uncertain and np.array_equal(cps, want.checkpoints())
    used = int(ids[len(ids) // 2])
    longer = tok.token_len.copy()
    longer[used] += 1
    st, _ = staged(longer, None)
    assert not st.tiles  # its sums are those of the table it was given
    marked = np.zeros(len(tok.token_len), np.uint8)
    marked[used] = 1
    st, cps = staged(tok.token_len, marked)
    assert st.tiles and st.uncertain and np.array_equal(cps, want.checkpoints())
    # A tokenizer whose own tables mark an id uncertain (o200k_harmony: 200018, two literals share
    # it): the summary leaves that id to the full tables, so the start reports it.
    harmony = get_tokenizer("o200k_harmony")
    assert harmony.table.uncertain[200018]
    for lit, flagged in (("<|endofprompt|>", True), ("<|end|>", False)):
        text = large_text(20_000, seed=9, kind="english") + lit + " tail"
        hn = harmony.native
        st = hn.start_chunks(text, hn.cuts(text, 4_000))
        out_ids, cps = np.empty(st.num_ids, np.uint32), np.empty(-(-st.num_ids // STRIDE), np.uint32)
        st.write(out_ids, cps, STRIDE)
        assert np.array_equal(out_ids, harmony.encode(text)) and st.uncertain == flagged


def test_what_the_staged_start_declines():
    qwen = get_tokenizer("qwen3")  # an NFC family's non-ASCII text: `_full` finds its spans
    text = "Cafe\u0301 and caf\u00e9 " * 400
    s = Session(qwen, text, full_path=FullPath(MANY))
    assert np.array_equal(s.ids, qwen.encode(text))
    with pytest.raises(InvalidText, match="not valid Unicode"):
        Session(get_tokenizer("llama3"), "ok \ud800 lone surrogate " * 100)
    with pytest.raises(InvalidText):
        Session(get_tokenizer("llama3"), b"bytes are not text")  # type: ignore[arg-type]
    ref = toktier.load_tokenizer("llama3", engine="reference")
    s = Session(ref, "reference engine " * 300)
    assert np.array_equal(s.ids, ref.encode(s.text)) and s.stats.full_reasons == {"initial text": 1}


def test_start_writes_into_the_allocators_buffer():
    tok = get_tokenizer("cl100k_base")
    made = []

    def alloc(n):
        made.append(np.zeros(n, np.uint32))
        return made[-1]

    text = large_text(30_000, seed=5, kind="english")
    s = Session(tok, text, allocator=alloc, full_path=FullPath(MANY))
    assert np.array_equal(s.ids, tok.encode(text))
    assert any(np.shares_memory(s.ids, m) for m in made)


def test_large_starts_leave_room_for_the_next_ops():
    """A large start leaves the restore's headroom (an eighth of its size), so its first appends,
    a tool result of 16K characters included, copy neither buffer; a small one (a conversation's
    new tail segment) leaves none."""
    import sys

    from toktier.session import PRIME_HEADROOM

    tok = get_tokenizer("llama3")
    small = Session(tok, "a short start " * 50)
    assert len(small._ids.buffer) == max(16, small.num_tokens)
    for size, delta in ((300_000, " and one more sentence."), (1_000_000, large_text(16_000, seed=6, kind="code"))):
        text = large_text(size, seed=4, kind="english")
        s = Session(tok, text)
        room = max(PRIME_HEADROOM, s.num_tokens // 8)
        assert len(s._ids.buffer) >= s.num_tokens + room
        assert sys.getsizeof(s._text) - len(s._text) >= max(8 * PRIME_HEADROOM, len(s._text) // 8)  # spare allocation
        ids_buf, text_buf = s._ids.buffer, s._text
        r = s.append(delta)
        assert s._ids.buffer is ids_buf and s._text is text_buf
        assert np.array_equal(r.ids, tok.encode(text + delta))
