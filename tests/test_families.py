"""Stable boundaries against the reference, at the pre-tokenizer piece level and the ID level.

For every position the family predicate certifies, on real multilingual text and
on adversarial text:

* pieces: the reference pre-tokenizer puts a piece boundary there, the pieces
  right of it are the pieces of the suffix alone, and the pieces left of it are
  those of text[:q+1] (HF engines expose their pre-tokenizer; tiktoken does not,
  so tiktoken families are checked at the ID level, which implies the pieces'
  BPE results agree);
* ids: the reference IDs have a token starting at q, the IDs after it are the
  suffix's own IDs, and the IDs before it do not depend on text past q+1
  (standalone positions: on nothing past q at all).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adversarial import adversarial_text
from conftest import ALL_TOKENIZERS, HF_TOKENIZERS, get_tokenizer
from toktier.boundaries import char_byte_offsets, stable_char_positions
from toktier.tools.corpus import samples

SUFFIX = "Zq 9\n"  # arbitrary continuation for the left-side independence check


def _piece_starts(tok, text: str) -> list[tuple[str, tuple[int, int]]]:
    return tok.engine.pre_tokenize(text)


def check_pieces(tok, text: str, positions, tally) -> None:
    pieces = _piece_starts(tok, text)
    starts = {a for _, (a, _b) in pieces}
    for q in positions:
        q = int(q)
        assert q in starts, f"no piece boundary at {q}: {text[max(0, q - 8):q]!r}|{text[q:q + 8]!r}"
        right = [(p, (a - q, b - q)) for p, (a, b) in pieces if a >= q]
        assert _piece_starts(tok, text[q:]) == right, f"suffix pieces differ at {q}"
        left = [pc for pc in pieces if pc[1][1] <= q]
        assert [pc for pc in _piece_starts(tok, text[: q + 1]) if pc[1][1] <= q] == left
    tally(tok, "pieces", len(positions))


def check_ids(tok, text: str, positions, tally, standalone: bool) -> None:
    ids = tok.encode(text)
    _, offs = char_byte_offsets(text)
    tok_starts = np.concatenate(([0], np.cumsum(tok.token_len[ids], dtype=np.int64)))[:-1]
    for q in positions:
        q = int(q)
        k = int(np.searchsorted(tok_starts, offs[q]))
        assert k < len(ids) and tok_starts[k] == offs[q], f"no token starts at char {q}"
        assert np.array_equal(ids[k:], tok.encode(text[q:])), f"suffix ids differ at {q}"
        left_text = text[:q] if standalone else text[: q + 1] + SUFFIX
        left = tok.encode(left_text)
        assert np.array_equal(left[:k], ids[:k]), f"prefix ids depend on text past {q}"
        if standalone:
            assert len(left) == k
    tally(tok, "ids", len(positions))


def _supported(name: str):
    tok = get_tokenizer(name)
    if tok.family is None:
        pytest.skip(f"{name}: no family ({tok.family_reason})")
    return tok


def _real_texts(n_chars: int = 3000):
    out = []
    for s in samples(max_chars_per_sample=20_000):
        out.append((s.name, s.text[:n_chars]))
    return out


@pytest.mark.parametrize("name", HF_TOKENIZERS)
def test_pieces_real_text(name, tally):
    tok = _supported(name)
    rng = random.Random(0)
    for sample_name, text in _real_texts():
        text = tok.engine.normalize(text)  # piece offsets refer to normalized text
        pos = stable_char_positions(tok, text)
        pos = sorted(rng.sample(list(pos), min(25, len(pos))))
        check_pieces(tok, text, pos, tally)


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
@pytest.mark.parametrize("standalone", [False, True])
def test_ids_real_text(name, standalone, tally):
    tok = _supported(name)
    rng = random.Random(1)
    for sample_name, text in _real_texts(1500):
        if tok.family_info.nfc:
            text = tok.engine.normalize(text)
        pos = stable_char_positions(tok, text, standalone=standalone)
        pos = sorted(rng.sample(list(pos), min(12, len(pos))))
        check_ids(tok, text, pos, tally, standalone)


@pytest.mark.parametrize("name", HF_TOKENIZERS)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=adversarial_text)
def test_pieces_adversarial(name, text, tally):
    tok = _supported(name)
    text = tok.engine.normalize(text)
    check_pieces(tok, text, stable_char_positions(tok, text), tally)


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=adversarial_text)
def test_ids_adversarial(name, text, tally):
    tok = _supported(name)
    if tok.family_info.nfc:
        text = tok.engine.normalize(text)
    check_ids(tok, text, stable_char_positions(tok, text), tally, standalone=False)
    check_ids(tok, text, stable_char_positions(tok, text, standalone=True), tally, standalone=True)


def test_known_unstable_pairs_are_rejected():
    """Pairs the derivation says are crossable must never be certified."""
    cl, o2 = _supported("cl100k_base"), _supported("o200k_base")
    ds = _supported("deepseek_v4")
    # punctuation -> letter (absorbed prefix), space -> letter, digit -> digit, \r -> \n
    for text in [",a", " a", "12", "\r\n", "  "]:
        assert 1 not in stable_char_positions(cl, text), text
    # o200k: letter -> apostrophe (contraction suffix), lower -> mark
    assert 1 not in stable_char_positions(o2, "s'")
    assert 1 not in stable_char_positions(o2, "a\u0301")
    # DeepSeek: inside a kana run (one piece) and kana -> its combining voicing mark
    assert 1 not in stable_char_positions(ds, "アア")
    assert 1 not in stable_char_positions(ds, "か\u3099")
    # (cl100k letter -> mark and DeepSeek kana -> in-run punctuation are stable: the derived tables)
    assert 1 in stable_char_positions(cl, "a\u0301b") and 1 in stable_char_positions(ds, "ア・")
    # but the classic stable ones are certified
    assert 1 in stable_char_positions(cl, "a ") and 1 in stable_char_positions(cl, "a1")
    assert 1 in stable_char_positions(cl, "a,") and 1 in stable_char_positions(o2, "a,")


def test_literal_spanning_positions_are_rejected():
    tok = _supported("cl100k_base")
    text = "x <|endoftext|> y"
    inside = range(text.index("<|") + 1, text.index("|>") + 2)
    pos = set(stable_char_positions(tok, text).tolist())
    assert not pos & set(inside)


@pytest.mark.parametrize("widened", ["punct->letter", "space->letter", "letter->apostrophe", "any"])
def test_suite_catches_a_widened_predicate(monkeypatch, widened, tally):
    """Mutation check: a predicate certifying one crossable pair too many must be caught."""
    from toktier import families

    tok = _supported("o200k_base")
    original = families.Family.stable
    extra = {
        "punct->letter": lambda c, x, y: ((c[x] & (families.L | families.N | families.W)) == 0) & ((c[y] & families.L) != 0),
        "space->letter": lambda c, x, y: ((c[x] & families.W) != 0) & ((c[y] & families.L) != 0),
        "letter->apostrophe": lambda c, x, y: ((c[x] & families.L) != 0) & (y == 0x27),
        "any": lambda c, x, y: np.ones(len(x), bool),
    }[widened]
    monkeypatch.setattr(families.Family, "stable", lambda self, c, x, y: original(self, c, x, y) | extra(c, x, y))
    texts = ["Hello, world. (see) it's: x='a'", "we'll go  now and\tthen 'quoted' \"words\""]
    with pytest.raises(AssertionError):
        for text in texts:
            check_ids(tok, text, stable_char_positions(tok, text), tally, standalone=False)


NFC_ATOMS = ["a", "e", "é", "e\u0301", "\u0301", "\u0323", "\u0327", "A", "\u030a", "Å", "\u212b", "\u1100",
             "\u1161", "\u11a8", "가", "각", "か", "\u3099", "が", "中", "，", " ", "1", "\u0f71", "\u0f72",
             "ḍ", "\u0307", "ṩ", "ﬁ", "ǅ", "\u0345", "ω", "\u1fbe"]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(u=st.lists(st.sampled_from(NFC_ATOMS), max_size=8).map("".join),
       v=st.lists(st.sampled_from(NFC_ATOMS), max_size=8).map("".join))
def test_nfc_splits_at_inert_pairs(u, v, tally):
    """At a pair of NFC-inert characters the reference normalizer splits: NFC(u+v) = NFC(u) + NFC(v)."""
    from toktier.families import I

    tok = _supported("qwen3")
    text = u + v
    if len(u) == 0 or len(v) == 0:
        return
    c = tok.classes
    if c[ord(u[-1])] & I and c[ord(v[0])] & I:
        assert tok.engine.normalize(text) == tok.engine.normalize(u) + tok.engine.normalize(v)
        tally(tok, "nfc")


def test_each_family_is_one_module_and_the_docstrings_run():
    """Every family module declares one SPEC whose patterns the registry recognizes; `>>>` lines hold."""
    import doctest

    from toktier import bundled, boundaries, charclass, families
    from toktier.families import base, cl100k, deepseek, o200k, qwen

    for mod in (cl100k, qwen, o200k, deepseek):
        assert families.FAMILIES[mod.SPEC.name] is mod.SPEC and "Stable-boundary table" in mod.__doc__
        for splits in mod.SPEC.splits:
            fam, why = families.detect_family("none", splits, True, ())
            assert why is None and fam.name == mod.SPEC.name and fam.exclude_k_pairs == mod.SPEC.exclude_k_pairs
    assert bundled.CL100K_PAT is cl100k.CL100K_TIKTOKEN and bundled.O200K_PAT is o200k.O200K
    for mod in (families, base, charclass, boundaries):
        res = doctest.testmod(mod)
        assert res.failed == 0 and res.attempted > 0, mod.__name__
