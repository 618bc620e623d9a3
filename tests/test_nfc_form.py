"""An NFC family's text that the normalizer changes is encoded natively in its normalized form.

`nfc_spans.nfc_form` rewrites qwen3 text the way its reference does (literals split off the raw
text, each gap NFC-normalized on its own); the native engine then encodes the result with its NFC
check off.  Checked against independent oracles: Python's `unicodedata` NFC of the gaps between the
literals a leftmost-longest regex finds (the normalizer level), HF's pre-tokenizer on those gaps
(the piece level), and the reference's IDs for `encode_fast`, the chunked full path and session
starts (the ID level).  Before, one such character anywhere in a 1M-character start sent it all to
the reference (0.2 s instead of 4 ms).
"""

from __future__ import annotations

import re
import unicodedata

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import toktier
from conftest import get_tokenizer
from toktier.fullpath import FullPathConfig, encode_full
from toktier.nfc_spans import nfc_edits, nfc_form
from toktier.tools.corpus import large_text

# Characters the normalizer rewrites or composes (decomposed accents, singletons, Hangul jamo,
# a U+0338 that composes with a '<'/'>' unless a literal ends there, orphan marks), characters it
# keeps though they are not NFC-inert, the joining separator itself, and qwen3's literals.
ATOMS = ("e\u0301", "A\u030a", "\u212b", "\u212a", "\u1fbe", "\u1100\u1161", "\u11a8", "o\u0308\u0304",
         "\u0958", "\u0338", ">\u0338", "<\u0338", "=\u0338", "\u0301", "\u0345", "\u0301\u0316", "ΐ", "가",
         "α\u0301\u0345", "\ue000", "\ue000\u0301", "<|im_end|>", "<|im_start|>", "<think>", "</think>",
         "<|endoftext|>", "<|im_end|", " ", "\n", "x", "K", "résumé ", "word ", "12", "中文", "'s")
SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
texts = st.lists(st.sampled_from(ATOMS), max_size=60).map("".join)


@pytest.fixture(scope="module")
def tok():
    t = get_tokenizer("qwen3")
    if t.native is None:
        pytest.skip(f"no native engine for qwen3: {t.explain()}")
    return t


def _literal_re(tok) -> re.Pattern:
    lits = sorted((lit.content for lit in tok.engine.literals if lit.content), key=len, reverse=True)
    return re.compile("|".join(map(re.escape, lits)))  # leftmost, longest first: HF's split


def _gaps(tok, text: str) -> list[tuple[str, bool]]:
    """(part, is_literal) in order, by an independent leftmost-longest literal split."""
    out, pos = [], 0
    for m in _literal_re(tok).finditer(text):
        out += [(text[pos:m.start()], False), (m.group(), True)]
        pos = m.end()
    return out + [(text[pos:], False)]


def _expected_form(tok, text: str) -> str:
    return "".join(p if lit else unicodedata.normalize("NFC", p) for p, lit in _gaps(tok, text))


@SETTINGS
@given(text=texts)
def test_form_is_nfc_of_each_gap_between_literals(tok, text, tally):
    form = nfc_form(tok, text)
    assert form == _expected_form(tok, text), repr(text)
    if form == text:
        assert form is text  # unchanged texts are not copied (callers test identity)
    tally(tok, "nfc-form")


@SETTINGS
@given(text=texts)
def test_pieces_of_the_form_equal_hf_pre_tokenizer_on_normalized_gaps(tok, text, tally):
    form = nfc_form(tok, text)
    want, at = [], 0
    for part, lit in _gaps(tok, text):
        if lit:
            want.append(at)
            at += len(part)
            continue
        norm = unicodedata.normalize("NFC", part)
        want += [at + a for _, (a, _b) in tok.engine.pre_tokenize(norm)]
        at += len(norm)
    starts, _flags = tok.native.pieces(form)
    assert starts.tolist() == want, repr(text)
    tally(tok, "pieces", len(want))


@SETTINGS
@given(text=texts)
def test_native_paths_equal_the_reference_on_text_nfc_changes(tok, text, tally):
    ref = tok.encode(text)
    before = tok.native.nfc_fallbacks
    assert np.array_equal(tok.encode_fast(text), ref), repr(text)
    assert np.array_equal(toktier.Session(tok, text).ids, ref), repr(text)
    assert tok.native.nfc_fallbacks == before  # served natively, never by the reference
    tally(tok, "ids", len(ref))


def test_large_start_with_rewrites_near_literals_is_native_chunked_and_exact(tok, tally):
    base = large_text(300_000, seed=4, kind="code")
    parts = [base[i:i + 3_000] + ATOMS[(i // 3_000) % len(ATOMS)] for i in range(0, len(base), 3_000)]
    text = "".join(parts)
    assert tok.engine.normalize(text) != text
    ref = tok.encode(text)
    rewrites, fallbacks = tok.native.nfc_rewrites, tok.native.nfc_fallbacks
    cfg = FullPathConfig(native_min_parallel_chars=10_000, chunk_chars=20_000)
    assert np.array_equal(encode_full(tok, text, cfg), ref)
    assert (tok.native.nfc_rewrites, tok.native.nfc_fallbacks) == (rewrites + 1, fallbacks)
    s = toktier.Session(tok, text)
    assert np.array_equal(s.ids, ref)
    for piece in (" tail e\u0301", "<|im_end|>\u0338", " more\n"):
        r = s.append(piece)
        assert np.array_equal(r.ids, tok.encode(s.text))
    tally(tok, "ids", len(ref))


def test_an_unchanged_text_starts_on_the_staged_path(tok):
    text = large_text(200_000, seed=6, kind="multilingual")
    text = tok.engine.normalize(text)
    assert nfc_form(tok, text) is text and not text.isascii()
    s = toktier.Session(tok, text)
    assert np.array_equal(s.ids, tok.encode(text)) and s._tiles and not s._dirty


def test_edits_skip_a_literal_that_ends_before_a_mark(tok):
    text = "a<|im_end|>\u0338b>\u0338"
    # the U+0338 after the literal stays alone (HF splits the literal off first); the one after a
    # plain '>' composes with it
    assert nfc_edits(tok, text) == [(13, 15, "\u226f")]
    assert nfc_form(tok, text) == "a<|im_end|>\u0338b\u226f"


@SETTINGS
@given(parts=st.lists(st.tuples(st.integers(0, 200), st.sampled_from(ATOMS)), max_size=12),
       wide=st.sampled_from(["", "中", "😀"]))
def test_compiled_helpers_equal_python(tok, parts, wide):
    """`nfc_runs` (ASCII skipped 64 characters at a time), `utf8_offsets` and `spells` against Python."""
    from toktier.nfc_spans import _runs

    text = wide + "".join("a" * n + atom for n, atom in parts)  # runs at every offset of a 64-block
    got = tok.native.nfc_runs(text)
    ra, rb = _runs(tok, text, None)  # the class table, read in numpy
    assert got[0::2].tolist() == ra.tolist() and got[1::2].tolist() == rb.tolist()
    pos = sorted({0, len(text), *(p for p in got.tolist())})
    assert tok.native.utf8_offsets(text, pos).tolist() == [len(text[:p].encode("utf-8")) for p in pos]
    ids = tok.encode(text)
    raw = text.encode("utf-8")
    spelled = b"".join(tok.token_bytes[i] for i in ids.tolist())
    assert tok.native.spells(ids, spelled)
    assert tok.native.spells(ids, raw) == (spelled == raw)
    if len(spelled):
        assert not tok.native.spells(ids, spelled[:-1] + bytes([spelled[-1] ^ 1]))
        assert not tok.native.spells(ids, spelled + b"x")


def test_spells_refuses_ids_outside_the_table(tok):
    n = len(tok.token_bytes)
    for bad in (n, 2**32 - 1):
        assert not tok.native.spells(np.array([bad], dtype=np.uint32), b"ab")
    assert tok.native.spells(np.zeros(0, dtype=np.uint32), b"") and not tok.native.spells(np.zeros(0, np.uint32), b"a")


def test_utf8_offsets_refuses_unsorted_positions_and_clamps_out_of_range(tok):
    with pytest.raises(ValueError, match="ascending"):
        tok.native.utf8_offsets("aé中", [2, 1])
    assert tok.native.utf8_offsets("aé中", [-5, 0, 3, 99]).tolist() == [0, 0, 6, 6]
