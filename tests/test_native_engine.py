"""The native engine against the real reference tokenizers, at both levels.

Pieces: the compiled scanner's split of every literal-free segment equals HF's own
pre-tokenizer (llama3, deepseek, qwen3, with their production class tables) and, for
every single-regex rule set (tiktoken's cl100k and o200k forms included), the ``regex``
module's matches, with a class table probed from ``regex`` itself (both sides then read
the same Unicode tables).  IDs and token byte offsets: equal to the reference encode on
real text, adversarial text, literals, long runs and texts NFC changes.  Load-time
certification, the engine choice, demotion by the shadow verifier, thread safety and
the full path's chunks are covered too.
"""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import toktier
from adversarial import ATOMS
from conftest import ALL_TOKENIZERS, HF_TOKENIZERS, get_tokenizer
from gpu_refs import regex_pieces, regex_table
from toktier.errors import UnsupportedTokenizer
from toktier.families import FAMILIES
from toktier.gpu.pretok_model import split_literals
from toktier.gpu.tables import bpe_tables
from toktier.native import _core, certify
from toktier.token_table import byte_level_alphabet
from toktier.tools.corpus import chat_wrap, large_text, samples
from toktier.verifier import Served, Verifier

pytestmark = pytest.mark.skipif(_core is None, reason="toktier.native._engine is not built")

REGEX_RULES = {str(rules): splits[0] for spec in FAMILIES.values() for splits, rules in spec.splits.items()
               if len(splits) == 1}
EXTRA = ["'", "'s", "'re", "'LL", "ſ", "/", "//", "\u0301", "\u0300", "ǅ", "ʰ", "あ", "ー", "・", "A", "a", "\n",
         "\r", " ", "  ", ".", "..", "\t", "\u200d", "中", "Ab", "aB", "\u3000", "\x00", "1", "゛", "\u00a0",
         "'Ve", "x'", "+/", "/\n", "ABCあ", "Ǆ", "\U0001d400", "A-z", "!a", "{|", "ー・"]
adv = st.lists(st.sampled_from(ATOMS + EXTRA * 2), max_size=120).map("".join)
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _corpus(n_chars: int = 12_000) -> list[tuple[str, str]]:
    return [(s.name, s.text[:n_chars]) for s in samples(max_chars_per_sample=n_chars)]


def _stable(tok, text: str) -> str:
    return tok.engine.normalize(text) if tok.family_info.nfc else text


def _spans(starts: np.ndarray, n: int) -> list[tuple[int, int]]:
    ends = [*starts[1:].tolist(), n]
    return list(zip(starts.tolist(), ends))


def check_ids(tok, text: str, tally) -> None:
    ref = tok.engine.encode(text)
    ids, starts = tok.native.encode_with_starts(text)
    assert np.array_equal(ids, ref), f"{tok.name}: ids differ for {text[:200]!r}"
    if starts is not None:  # None: NFC changed the text and the reference encoded it
        lens = tok.token_len[ref].astype(np.int64)
        assert np.array_equal(starts, np.concatenate(([0], np.cumsum(lens)[:-1])) if len(ref) else starts)
    tally(tok, "ids", len(ref))


def check_hf_pieces(tok, text: str, tally) -> None:
    n = 0
    for a, b, lit in split_literals(tok, text):
        if lit is not None:
            continue
        seg = text[a:b]
        ref = [o for _, o in tok.engine.pre_tokenize(seg)]
        starts, flags = tok.native.pieces(seg)
        assert (flags == -1).all()
        got = _spans(starts, len(seg))
        assert got == ref, f"{tok.name}: pieces differ in {seg[:200]!r}"
        n += len(ref)
    tally(tok, "pieces", n)


def _regex_engine(rules: str):
    """A native engine whose class table comes from the `regex` module (the pieces oracle's tables)."""
    tok = get_tokenizer("o200k_base" if rules == "o200k" else "cl100k_base")
    bt = bpe_tables(tok)
    return _core.CoreEngine(rules, regex_table(), bt.byte_to_id, bt.pair_keys, bt.pair_rank, bt.pair_merged,
                            bt.pair_bits, bt.vocab_keys, bt.vocab_ids, bt.vocab_bits, bt.tok_off, bt.tok_blob,
                            bt.max_piece_lookup, bt.whole_piece_lookup, False, [], [])


# -- certification and choice --------------------------------------------------------------

@pytest.mark.parametrize("name", ALL_TOKENIZERS)
def test_every_bundled_tokenizer_certifies(name):
    tok = get_tokenizer(name)
    assert tok.native is not None, tok.native_reason
    assert tok.engine_label == "native"
    assert "native engine, certified" in tok.explain()
    assert certify.bpe_consistency(tok, bpe_tables(tok)) is None


def test_reference_choice_and_required_native():
    tok = toktier.load_tokenizer("cl100k_base", engine="reference")
    assert tok.native is None and tok.engine_label == "tiktoken"
    assert "engine='reference'" in tok.explain()
    with pytest.raises(ValueError, match="engine must be one of"):
        toktier.load_tokenizer("cl100k_base", engine="fast")


def test_uncertifiable_tokenizer_keeps_the_reference_with_a_reason(tmp_path):
    # A tokenizer without a proven family: "auto" serves it through the reference, "native" refuses.
    import json

    src = get_tokenizer("llama3").engine.path
    cfg = json.loads(open(src, encoding="utf-8").read())
    cfg["pre_tokenizer"] = {"type": "Whitespace"}
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(cfg), encoding="utf-8")
    tok = toktier.load_tokenizer(str(path))
    assert tok.native is None and "no proven family" in tok.native_reason
    with pytest.raises(UnsupportedTokenizer, match="native engine cannot serve"):
        toktier.load_tokenizer(str(path), engine="native")


def test_inconsistent_merges_are_refused():
    tok = get_tokenizer("cl100k_base")
    bt = bpe_tables(tok)
    bad = bt.pair_merged.copy()
    used = np.flatnonzero(bt.pair_keys != np.uint64(0xFFFFFFFFFFFFFFFF))
    bad[used[0]] = (int(bad[used[0]]) + 1) % len(tok.token_bytes)
    from dataclasses import replace

    assert certify.bpe_consistency(tok, replace(bt, pair_merged=bad)) is not None


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
def test_self_check_catches_a_wrong_engine(name):
    # The corpus must notice an engine that splits by the wrong rule set.
    tok = get_tokenizer(name)
    wrong = "qwen" if tok.native.rules != "qwen" else "cl100k_hf"
    eng, _ = toktier.native.build(tok)
    eng._core = _core.CoreEngine(wrong, *_core_args(tok))
    assert certify.self_check(tok, eng) is not None


def _walk_starts(tok, ids: np.ndarray, data: bytes) -> list[int]:
    """Each token's byte start, found by reading the text: a token covers whichever of its byte
    strings the text holds there (o200k_harmony's id 200018 is two literals)."""
    starts, pos = [], 0
    for i in ids.tolist():
        starts.append(pos)
        spellings = {b for b in (tok.token_bytes[i], *tok.table.alternatives.get(i, ())) if data.startswith(b, pos)}
        assert len(spellings) == 1, (i, data[pos:pos + 30])
        pos += len(spellings.pop())
    assert pos == len(data)
    return starts


def test_o200k_harmony_certifies_and_is_exact_with_every_literal(tally):
    """gpt-oss's tokenizer: 1,091 literals, one id (200018) spelled two ways.  Certified (the
    self-check reads that id's span from the text), and exact with every literal in context, the
    two spellings side by side, a literal cut short, and in sessions that splice around them."""
    tok = get_tokenizer("o200k_harmony")
    assert tok.native is not None, tok.native_reason
    assert tok.table.alternatives.keys() == {200018}
    lits = sorted(tok.table.literal_ids)
    texts = []
    for k in range(0, len(lits), 64):
        texts.append("".join(f"x{lit}y {lit}\n{lit}{lit} 12{lit}ab {lit[:-1]} " for lit in lits[k:k + 64]))
    texts += ["<|endofprompt|><|reserved_200018|> <|reserved_200018|>x<|endofprompt|>\n<|reserved_20001",
              "<|start|>assistant<|channel|>final<|message|>Hi<|return|><|start|>user<|message|>ok<|end|>"]
    for text in texts:
        ids, starts = tok.native.encode_with_starts(text)
        ref = tok.engine.encode(text)
        assert np.array_equal(ids, ref)
        assert starts is None or starts.tolist() == _walk_starts(tok, ref, text.encode())
        tally(tok, "ids", len(ref))
    s = toktier.Session(tok, texts[-2] * 50)
    for delta in ["more <|endofprompt|> text", "<|reserved_200018|>", " and plain words " * 40, "<|end|>\n"]:
        s.append(delta)
        assert s.ids.tolist() == tok.encode(s.text).tolist()
    s.edit(10, 40, "<|reserved_200018|> edited <|endofprompt|>")
    assert s.ids.tolist() == tok.encode(s.text).tolist()


def _core_args(tok):
    from toktier import charclass
    from toktier.families import GPU_CLASS_PATTERNS

    fam = tok.family_info
    table = charclass.class_table(tok.engine, tok.hash, {**fam.class_patterns(), **GPU_CLASS_PATTERNS}, folds=True)
    bt = bpe_tables(tok)
    return (table, bt.byte_to_id, bt.pair_keys, bt.pair_rank, bt.pair_merged, bt.pair_bits, bt.vocab_keys,
            bt.vocab_ids, bt.vocab_bits, bt.tok_off, bt.tok_blob, bt.max_piece_lookup, bt.whole_piece_lookup,
            fam.nfc, [], [], tok.token_len, tok.table.uncertain.astype(np.uint8))


# -- pieces ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", HF_TOKENIZERS)
def test_pieces_equal_hf_pre_tokenizer_on_real_text(name, tally):
    tok = get_tokenizer(name)
    for _, text in _corpus():
        check_hf_pieces(tok, _stable(tok, text), tally)


@pytest.mark.parametrize("name", HF_TOKENIZERS)
@SETTINGS
@given(text=adv)
def test_pieces_equal_hf_pre_tokenizer_on_adversarial_text(name, text, tally):
    tok = get_tokenizer(name)
    check_hf_pieces(tok, _stable(tok, text), tally)


@pytest.mark.parametrize("rules", sorted(REGEX_RULES))
def test_pieces_equal_regex_on_real_text(rules):
    eng = _regex_engine(rules)
    for name, text in _corpus():
        starts, _ = eng.pieces(text)
        assert _spans(starts, len(text)) == regex_pieces(REGEX_RULES[rules], text), name


@pytest.mark.parametrize("rules", sorted(REGEX_RULES))
@SETTINGS
@given(text=adv)
def test_pieces_equal_regex_on_adversarial_text(rules, text):
    starts, _ = _regex_engine(rules).pieces(text)
    assert _spans(starts, len(text)) == regex_pieces(REGEX_RULES[rules], text)


@pytest.mark.parametrize("rules", sorted(REGEX_RULES))
def test_every_code_point_in_context_splits_as_regex(rules):
    # Each code point c (all 1,114,112 minus surrogates) between letters, after a space, after
    # an apostrophe, before digits and doubled: the contexts every alternative reads.
    eng = _regex_engine(rules)
    pat = REGEX_RULES[rules]
    cps = np.arange(0x110000, dtype=np.uint32)
    cps = cps[(cps < 0xD800) | (cps > 0xDFFF)]
    for lo in range(0, len(cps), 4096):
        chunk = cps[lo:lo + 4096].astype("<u4").tobytes().decode("utf-32-le")
        text = "".join(f"a{c}b {c}'{c}1{c}{c}A\n" for c in chunk)
        starts, _ = eng.pieces(text)
        assert _spans(starts, len(text)) == regex_pieces(pat, text), f"code points from U+{int(cps[lo]):04X}"


def _sparse_non_ascii_texts(width: str) -> list[str]:
    """ASCII of every class the block scanner tells apart, with one non-ASCII character after
    every 16 or more ASCII ones (at varying offsets of a 64-character word), so that views hold
    both. `width` "latin1": U+0080..U+00FF only (a 1-byte str that is not ASCII); "ucs2": each
    code point up to U+02FF, then every 13th up to U+FFFF and the 16-bit edges the comparison
    classifier's narrowing must keep non-ASCII (U+7FFF/U+8000/U+FFFF...); "ucs4": those and
    astral ones (every 4,099th, U+10000 and U+10FFFF), so every text is a 4-byte str."""
    cps = list(range(0x80, 0x100))
    if width != "latin1":
        cps = [*range(0x80, 0x300), *range(0x300, 0x10000, 13), 0x7FFF, 0x8000, 0x80FF, 0xFF00, 0xFFFD, 0xFFFF]
        cps = [c for c in cps if not 0xD800 <= c <= 0xDFFF]
    if width == "ucs4":
        astral = [*range(0x10000, 0x110000, 4099), 0x10FFFF, 0x1F600, 0x20000]
        cps = [c for pair in zip(cps, astral * (len(cps) // len(astral) + 1)) for c in pair]
    filler = ["it's ", "We'LL ", "abc", " 1234567 ", "x\r\n", "  \t\n", "!!", " ?", "'", "Z9", "\x0b\x0c", "\x1c"]
    texts, parts = [], []
    for k, c in enumerate(cps):
        # 16+ ASCII characters before each one: the block scanner's views start only there
        parts.append("".join(filler[(k * 7 + j * 5) % len(filler)] for j in range(4 + k % 4)) + chr(c))
        if len(parts) == 400:
            texts.append("".join(parts))
            parts = []
    texts.append("".join(parts))
    return texts


WIDTH_FLOOR = {"latin1": 0x80, "ucs2": 0x100, "ucs4": 0x10000}  # each text's widest character
WIDTH_LIMIT = {"latin1": 0x100, "ucs2": 0x10000, "ucs4": 0x110000}


@pytest.mark.parametrize("width", sorted(WIDTH_LIMIT))
def test_block_classifier_by_comparisons_agrees_around_non_ascii(width, tally):
    # The block scanner's comparison classifier (`Engine::simd_bits`) serves these three
    # families; its narrowing of 16- and 32-bit characters to bytes must keep every non-ASCII one.
    texts = _sparse_non_ascii_texts(width)
    assert all(WIDTH_FLOOR[width] <= max(map(ord, t)) < WIDTH_LIMIT[width] for t in texts)
    for name in ("llama3", "qwen3"):
        tok = get_tokenizer(name)
        assert tok.native._core.block_classifier == "compare"
        for text in texts:
            check_hf_pieces(tok, _stable(tok, text), tally)
            check_ids(tok, text, tally)
    tok = get_tokenizer("cl100k_base")
    assert tok.native._core.block_classifier == "compare"
    for text in texts:
        check_ids(tok, text, tally)
    for rules in ("cl100k_hf", "cl100k_tt", "qwen"):
        eng = _regex_engine(rules)
        assert eng.block_classifier == "compare"
        for text in texts:
            starts, _ = eng.pieces(text)
            assert _spans(starts, len(text)) == regex_pieces(REGEX_RULES[rules], text), rules


def _window_edge_texts(width: str) -> list[str]:
    """Long non-ASCII 1-byte, 2- or 4-byte strs: non-ASCII characters at and around every
    multiple of 8192 (where a windowed UTF-8 conversion would cut), pieces longer than 8K
    characters, literals between segments and a dense non-ASCII stretch."""
    wide = {"latin1": "\xe9\xa0", "ucs2": "\u00e9\u4e2d\u0100", "ucs4": "\u00e9\u4e2d\U0001F600"}[width]
    chars = list(large_text(41_000, seed=41, kind="code").encode("ascii", "ignore").decode())
    for edge in range(8192, len(chars), 8192):
        for d in (-17, -16, -3, -1, 0, 1, 2, 15, 16):
            chars[edge + d] = wide[(edge + d) % len(wide)]
    text = "".join(chars)
    parts = [text[:12_000], "x" * 9_000, " " * 10_000, text[12_000:20_000], "<|begin_of_text|>",
             wide * 3_000, "<|endoftext|>", text[20_000:], wide[-1]]
    return ["".join(parts), wide[-1] + "y" * 20_000 + wide[0], text]


@pytest.mark.parametrize("width", sorted(WIDTH_LIMIT))
def test_long_non_ascii_strs_give_exact_ids_and_offsets(width, tally):
    # A converted str's pieces are re-encoded to UTF-8 by the engine: every id and every token's
    # byte offset must be exact across long pieces, literals and runs of mixed UTF-8 lengths
    # (a windowed conversion tried for issue 14 and not kept had two such bugs; see RESULTS).
    _check_wide_strs(width, _window_edge_texts(width), tally)


def _check_wide_strs(width: str, texts: list[str], tally) -> None:
    """Ids and offsets of `texts` (each at most `width` wide, and as wide) on every tokenizer the
    native engine serves, against the reference."""
    assert all(WIDTH_FLOOR[width] <= max(map(ord, t)) < WIDTH_LIMIT[width] for t in texts)
    served = [get_tokenizer(name) for name in ALL_TOKENIZERS if get_tokenizer(name).native is not None]
    assert len(served) >= 4, "the bundled families the native engine certifies"
    for tok in served:
        for text in texts:
            check_ids(tok, _stable(tok, text), tally)


def _sparse_wide_texts(width: str) -> list[str]:
    """Mostly ASCII strs stored 1, 2 or 4 bytes a character, one wider character every d
    characters for d from 1 to past `engine.hpp`'s NARROW_AHEAD (512) and a batch's 256 pieces:
    wide characters at every offset in a 16-character group, at the edge of the narrowed stretch
    and of a batch, inside long ASCII pieces and between pieces."""
    wide = {"latin1": "\xe9\xa0", "ucs2": "\u00e9\u4e2d\u2019", "ucs4": "\u00e9\u4e2d\U0001F600"}[width]
    base = large_text(24_000, seed=43, kind="code").encode("ascii", "ignore").decode()
    texts = []
    for k, d in enumerate((1, 2, 3, 15, 16, 17, 97, 255, 511, 512, 513, 1030, 4099)):
        chars = list(base)
        for i in range(d // 2 + k, len(chars), d):
            chars[i] = wide[(i // d + k) % len(wide)]
        texts.append("".join(chars))
    # a wide character right after and right before ASCII pieces longer than the lookahead
    texts.append("".join(f"{wide[j % len(wide)]}{'a' * (500 + j)} {'7' * (520 + j)}\n" for j in range(40)))
    texts.append(" " * 5_000 + wide[0] + "\t" * 700 + wide[-1] + "x" * 3_000)
    return texts


@pytest.mark.parametrize("width", sorted(WIDTH_LIMIT))
def test_narrowed_utf8_of_wide_strs_gives_exact_ids_and_offsets(width, tally):
    # A 1-, 2- or 4-byte str's UTF-8 is built in a log whose ASCII stretches are narrowed ahead
    # of the pieces (engine.hpp `segment_log`): ids and every token's byte offset must be exact
    # wherever the wider characters fall.
    _check_wide_strs(width, _sparse_wide_texts(width), tally)


def test_block_classifier_keeps_the_table_when_comparisons_would_differ():
    # A class table whose ASCII classes the comparisons do not reproduce (U+001C as
    # whitespace, as Python's str.isspace has it) keeps the per-character table read.
    from toktier.charclass import W

    tok = get_tokenizer("cl100k_base")
    bt = bpe_tables(tok)
    table = regex_table().copy()
    table[0x1C] |= W
    eng = _core.CoreEngine("cl100k_hf", table, bt.byte_to_id, bt.pair_keys, bt.pair_rank, bt.pair_merged,
                           bt.pair_bits, bt.vocab_keys, bt.vocab_ids, bt.vocab_bits, bt.tok_off, bt.tok_blob,
                           bt.max_piece_lookup, bt.whole_piece_lookup, False, [], [])
    assert eng.block_scanner == (True, "")
    assert eng.block_classifier == "table"
    assert _regex_engine("cl100k_hf").block_classifier == "compare"


# -- IDs -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ALL_TOKENIZERS)
def test_ids_equal_reference_on_real_text(name, tally):
    tok = get_tokenizer(name)
    for _, text in _corpus(50_000):
        check_ids(tok, text, tally)


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
@SETTINGS
@given(text=adv)
def test_ids_equal_reference_on_adversarial_text(name, text, tally):
    check_ids(get_tokenizer(name), text, tally)


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
@pytest.mark.parametrize("kind", ["mixed", "code", "multilingual"])
def test_ids_equal_reference_on_large_text(name, kind, tally):
    tok = get_tokenizer(name)
    check_ids(tok, large_text(300_000, kind=kind), tally)


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
def test_literals_and_chat_templates(name, tally):
    tok = get_tokenizer(name)
    lits = [lit.content for lit in tok.engine.literals][:64]
    text = " x".join(f"{a}\n{b}{a}  \u00a0{b}" for a, b in zip(lits, reversed(lits)))
    check_ids(tok, text, tally)
    for style in ("chatml", "llama3", "deepseek"):
        check_ids(tok, chat_wrap([("user", "hi there"), ("assistant", "ok 'S done\n")], style, True), tally)


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
def test_specials_as_plain_text(name, tally):
    tok = get_tokenizer(name, specials="none")
    assert tok.native is not None, tok.native_reason
    lits = [lit.content for lit in get_tokenizer(name).engine.literals][:16]
    check_ids(tok, "a " + " b".join(lits), tally)


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
@pytest.mark.parametrize("text", [
    "a" * 20_000, " " * 20_000 + "x", "\n" * 5000 + " " * 5000, "1" * 9999, "!" * 30_000, "中" * 10_000,
    "ab" * 10_000, "\u00a0" * 3000 + "a", "'s" * 5000, "A" * 5000 + "a", "\u0301" * 4000, "é" * 5000,
    "/" * 3000 + "\n/" * 2000, "x" * 5000 + "\U0001f600" * 3000,
])
def test_long_runs(name, text, tally):
    check_ids(get_tokenizer(name), text, tally)


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
def test_bpe_of_long_pieces_agrees(name):
    # Each text is one pre-tokenizer piece of 100-600 bytes: the heap merge (pieces over 48 bytes).
    tok = get_tokenizer(name)
    for text in "abcdefghij" * 30, "!@#$%^&*()" * 30, "é" * 200, "xY" * 100, "ぁ" * 60:
        starts, _ = tok.native.pieces(text)
        if len(starts) == 1:
            assert np.array_equal(tok.native.bpe(text.encode()), tok.engine.encode(text)), text[:20]


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
def test_words_no_cache_has_seen_are_merged_exactly(name, tally):
    # A short encode (a window, an append) of words no piece cache has seen: every one merged
    # (engine.hpp, `merge_small`), with repeated pairs ("aaaa", "abab": the leftmost of equal
    # ranks merges first), the same new word twice in one batch, and runs of them between known
    # words; with a fresh cache, then with it warm.  IDs and offsets equal the reference's.
    import random

    tok = get_tokenizer(name)
    rng = random.Random(f"unseen_words:{name}")
    words = []
    for k in range(1500):
        n = rng.randint(2, 15)
        if k % 5 == 0:
            w = rng.choice("abxyz") * n
        elif k % 5 == 1:
            w = (rng.choice("ab") + rng.choice("cd")) * (n // 2 + 1)
        else:
            w = "".join(rng.choice("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(n))
        words.append(w)
        if k % 7 == 0:
            words.append(w)  # the same new word again, in the same batch
        if k % 11 == 0:
            words.append("the")
    text = " ".join(words)
    assert len(text) < 32 * 1024  # a short encode (engine.hpp SMALL_ENCODE)
    want = tok.engine.encode(text)
    cache = _core.PieceCacheBox()
    for _ in range(2):
        st, ids, _ = tok.native._core.encode(text, cache, False, True)
        assert st == 0 and np.array_equal(ids, want)
    check_ids(tok, text, tally)


def _reference_piece_answer(tok):
    """piece bytes -> the reference BPE model's ids for that one piece (no pre-tokenizer)."""
    eng = tok.engine
    if hasattr(eng, "_enc"):  # tiktoken: its encoder is asked first, then the merges
        return eng._enc._encode_single_piece
    chars = {b: ch for ch, b in byte_level_alphabet().items()}  # byte -> GPT-2's character for it
    model = eng._tok.model
    return lambda b: [t.id for t in model.tokenize("".join(chars[x] for x in b))]


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
def test_whole_piece_answers_are_the_reference_models_own(name):
    # A piece of 2-18 bytes that spells one vocab token may be answered by a lookup instead of
    # merges (engine.hpp, `short_accept`): every such token under whole-piece lookup (tiktoken, HF
    # `ignore_merges`), and for merges-first models (Qwen, DeepSeek) only the tokens whose own
    # bytes merge to themselves, marked at load.  The set of tokens the lookup answers must be
    # exactly those whose one-piece encode by the reference model is that token.
    tok = get_tokenizer(name)
    answer = _reference_piece_answer(tok)
    got = tok.native._core.short_answers()
    assert np.all(np.diff(got.astype(np.int64)) > 0), "answers are sorted and unique"
    want = [i for i, b in enumerate(tok.engine.token_bytes)
            if 2 <= len(b) <= 18 and list(answer(b)) == [i]]
    assert got.tolist() == want
    assert len(want) > 0.9 * sum(1 for b in tok.engine.token_bytes if 2 <= len(b) <= 18)


def test_tokens_the_merges_never_make_are_merged_not_looked_up(tmp_path, tally):
    # In the bundled merges-first vocabularies every regular token is its own merges' answer, so
    # the test above cannot tell "self-spelled only" from "every token".  Here Qwen3's merges lose
    # the last step of a few common words (the tokens stay in the vocab): the reference then
    # splits those words, and so must the engine, at load (`short_answers`) and on text.
    import json

    cfg = json.loads(open(get_tokenizer("qwen3").engine.path, encoding="utf-8").read())
    model = cfg["model"]
    gone = {"Ġthe", "Ġand", "ing", "Ġof", "tion"}
    model["merges"] = [m for m in model["merges"] if "".join(m.split(" ") if isinstance(m, str) else m) not in gone]
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(cfg, ensure_ascii=False), encoding="utf-8")
    tok = toktier.load_tokenizer(str(path), engine="native")
    ids = {w: model["vocab"][w] for w in gone}
    answer = _reference_piece_answer(tok)
    assert all(list(answer(tok.engine.token_bytes[i])) != [i] for i in ids.values())
    got = set(tok.native._core.short_answers().tolist())
    assert not got & set(ids.values())
    text = large_text(20_000, kind="english") + " the and of nation sing thing"
    check_ids(tok, text, tally)
    cache = _core.PieceCacheBox()  # a fresh cache: every word is looked up or merged here
    st, got_ids, _ = tok.native._core.encode(text, cache, False, True)
    assert st == 0 and np.array_equal(got_ids, tok.engine.encode(text))


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
def test_a_piece_whose_hot_entry_was_just_taken_is_encoded_again(name, tally):
    # The hot front (engine.hpp, `PieceCache::hot`: sets of two ways) is read for a whole batch of
    # pieces before any of them is encoded; a miss earlier in the batch can then move or evict the
    # entry a later piece found.  Three words whose answers go to one set, in every order, do
    # that: each must keep its own ids.  Single-token words, so a wrong answer is a different id.
    tok = get_tokenizer(name)
    sets: dict[int, list[bytes]] = {}
    trio = None
    for i, b in enumerate(tok.engine.token_bytes):
        if not (3 <= len(b) <= 12 and b[:1] == b" " and b[1:].isalpha() and b[1:].islower() and b.isascii()):
            continue
        same = sets.setdefault(_core.PieceCacheBox.hot_entry(b), [])
        if b not in same:
            same.append(b)
        if len(same) == 3:
            trio = [w.decode() for w in same]
            break
    assert trio, "no three single-token words share a hot set"
    a, b, c = trio
    assert len({tuple(tok.engine.encode(w).tolist()) for w in trio}) == 3
    filler = "1."  # one-byte pieces, which never use the hot front
    orders = [a + b + c, b + a + c, c + a + b, a + c + b, b + c + a, c + b + a, a + b + a + b]
    text = a + "".join(orders[k % len(orders)] + filler * k for k in range(0, 700, 7))
    check_ids(tok, text, tally)
    cache = _core.PieceCacheBox()  # one cache across calls, as a session's encodes share theirs
    for _ in range(2):
        st, ids, _ = tok.native._core.encode(text, cache, False, True)
        assert st == 0 and np.array_equal(ids, tok.engine.encode(text))


def test_lane_commit_refuses_buffers_of_the_wrong_kind():
    # The compiled lane writes the splice into the session's buffers in place: they must be 1-D,
    # writable uint32, else a typed error and nothing written.
    tok = get_tokenizer("llama3")
    s = toktier.Session(tok, "hello world")
    ids = s.ids.copy()
    cps, n_cp = s._starts.raw()
    lane, cache = tok.native.lane(), tok.native._take()
    try:
        args = (bytearray(b"hello world"), 11, 11, b" again")
        with pytest.raises(TypeError, match="uint32"):
            lane.edit_commit(*args, ids.astype(np.int64), len(ids), cps, n_cp, 64, 64, 64, [cache])
        frozen = ids.copy()
        frozen.flags.writeable = False
        with pytest.raises((ValueError, BufferError)):
            lane.edit_commit(*args, frozen, len(ids), cps, n_cp, 64, 64, 64, [cache])
        assert np.array_equal(frozen, ids)
    finally:
        tok.native._give(cache)
    assert np.array_equal(s.append(" again").ids, tok.engine.encode("hello world again"))


def _lane_state(s):
    cps, n_cp = s._starts.raw()
    return bytes(s._text), s._ids.buffer.copy(), s._ids.n, cps.copy(), n_cp


def _same_state(a, b) -> bool:
    return a[0] == b[0] and a[2] == b[2] and a[4] == b[4] and np.array_equal(a[1], b[1]) and np.array_equal(a[3], b[3])


def test_the_one_call_append_commits_exactly_or_writes_nothing(tally):
    # `RepairLane.append_commit` (Session.append's compiled path) either commits the text, the
    # IDs and the checkpoints together, or leaves all three as they were and says why.
    from toktier.native import LANE_CHUNK_BYTES
    from toktier.offsets import STRIDE

    tok = get_tokenizer("llama3")
    nat = tok.native
    lane = nat.lane()
    text = large_text(8_000, seed=5, kind="code")
    s = toktier.Session(tok, text)
    s.append(" warm")  # the first op after a start grows the buffers (the general path)
    text += " warm"

    def call(delta, limit=LANE_CHUNK_BYTES, ids_buffer=None):
        cps, n_cp = s._starts.raw()
        return lane.append_commit(nat.pool, s._text, delta, s._ids.buffer if ids_buffer is None else ids_buffer,
                                  s._ids.n, cps, n_cp, STRIDE, s.window, limit)

    for delta in ("", "\ud800 lone", "x" * 100, "\u00e9" * 100):  # empty, not encodable, at the length limit
        before = _lane_state(s)
        assert call(delta, limit=100 if len(delta) == 100 else LANE_CHUNK_BYTES) is None
        assert _same_state(_lane_state(s), before)
    idle = len(nat.pool)
    with pytest.raises(TypeError, match="uint32"):
        call(" typed", ids_buffer=s._ids.buffer.astype(np.int64))
    assert len(nat.pool) == idle  # a refused call keeps no cache
    # declined (one-byte runs: `LANE_STATUS` 2): nothing written, the status and the work done returned
    runs = toktier.Session(tok, "=" * 3000)
    runs.append("=")
    cps, n_cp = runs._starts.raw()
    before = _lane_state(runs)
    out = lane.append_commit(nat.pool, runs._text, "=" * 10, runs._ids.buffer, runs._ids.n, cps, n_cp, STRIDE,
                             runs.window, LANE_CHUNK_BYTES)
    assert out is not None and out[0] != 0 and len(out) == 2, out
    assert _same_state(_lane_state(runs), before)
    # committed: the text holds the new UTF-8 and the buffers the reference's IDs and checkpoints
    for delta in ("\n# caf\u00e9 \u4e2d\u6587 \U0001f600 done\n", "\nx = 1\n"):
        n_before = s._ids.n
        out = call(delta)
        assert out is not None and out[0] == 0, out
        _, first, new_n, new_cp, fresh = out
        s._ids.n, _ = new_n, s._starts.set_count(new_cp)
        s._nchars += len(delta)
        text += delta
        ref = tok.engine.encode(text)
        assert bytes(s._text) == text.encode("utf-8")
        assert np.array_equal(s.ids, ref) and fresh > 0 and 0 <= first <= n_before
        assert np.array_equal(s._starts.checkpoints(), _checkpoints_from_scratch(tok, s.ids))
        tally(tok, "session", 1)


@pytest.mark.parametrize("width", [1, 2, 4])
def test_the_one_call_append_writes_the_utf8_of_every_str_width(width, tally):
    # The one-call append converts a non-ASCII str to UTF-8 itself (in the thread's scratch, not
    # through CPython's cached copy): Latin-1 (1 byte a character), BMP (2) and astral (4) strs,
    # ASCII runs of every length around the wide characters (the converter takes four ASCII units
    # at a time), give the reference's bytes and IDs; a lone surrogate anywhere is refused with
    # the session unchanged.
    wide = {1: "\u00e9\u00ff", 2: "\u00e9\u4e2d\u2019", 4: "\u00e9\u4e2d\U0001f600"}[width]
    tok = get_tokenizer("llama3")
    text = large_text(6_000, seed=9, kind="english")
    s = toktier.Session(tok, text)
    deltas = [wide[i % len(wide)] + " word" * (i % 4) + "x" * i + wide for i in range(9)]
    deltas.append(" ".join(large_text(3_000, seed=4, kind="english").split()[:300]) + wide)
    for delta in deltas:
        assert max(map(ord, delta)) >= {1: 0x80, 2: 0x100, 4: 0x10000}[width]
        res = s.append(delta)
        text += delta
        assert bytes(s._text) == text.encode("utf-8")
        assert np.array_equal(res.ids, tok.engine.encode(text))
        tally(tok, "session", 1)
    assert s.stats.lane >= len(deltas) - 2, s.stats  # (served by the one-call path, not only the general one)
    for at in (0, 3, 5):
        bad = (wide * 2)[:at] + "\ud800" + wide + " tail"
        with pytest.raises(toktier.errors.InvalidText):
            s.append(bad)
        assert bytes(s._text) == text.encode("utf-8") and np.array_equal(s.ids, tok.engine.encode(text))


def test_an_id_buffer_with_room_does_not_hide_short_checkpoints(tally, monkeypatch):
    # The ID and checkpoint buffers grow by their own sizes: with room for the IDs but not for
    # the checkpoints, an append must still make room for both and commit in place (it declined
    # twice, then spliced through Python's `_commit`, when only the IDs were checked).
    commits = []
    plain = toktier.Session._commit
    monkeypatch.setattr(toktier.Session, "_commit", lambda self, *a: commits.append(1) or plain(self, *a))
    tok = get_tokenizer("llama3")
    text = large_text(4_000, seed=6, kind="code")
    s = toktier.Session(tok, text)
    s._ids.reserve(s._ids.n + 50_000)
    assert len(s._ids.buffer) > s._ids.n + 5_000 and not s._starts.has_room_for(s._ids.n + 5_000)
    delta = large_text(1_400, seed=7, kind="english")
    lane = s.stats.lane
    res = s.append(delta)
    assert s.stats.lane == lane + 1 and not commits, (s.stats, commits)
    assert np.array_equal(res.ids, tok.engine.encode(text + delta))
    tally(tok, "session", 1)


def test_session_appends_count_each_op_once_whichever_path_serves_them(tally):
    # The compiled append, its declines (general path without a second lane try), buffer growth,
    # long appends (the chunked lane) and non-str input: one op each, every result exact.
    from toktier.native import LANE_PARALLEL_MIN_BYTES

    tok = get_tokenizer("llama3")
    deltas = ["=" * 40, " x", "\u00e9t\u00e9 ", "a" * 7, large_text(LANE_PARALLEL_MIN_BYTES + 500, seed=2, kind="english"),
              " y", "", "\n<|eot_id|>", large_text(16_000, seed=3, kind="code")]
    s = _append_session(tok, "=" * 2000, deltas, tally)
    assert s.stats.ops == len(deltas)
    assert s.stats.lane >= 3 and s.stats.noop == 1, s.stats
    with pytest.raises(toktier.errors.InvalidText):
        s.append(b"bytes")
    with pytest.raises(toktier.errors.InvalidText):
        s.append("bad \ud800")
    assert s.stats.ops == len(deltas)


def test_an_append_to_an_exported_text_fails_and_leaves_the_session_intact(tally):
    # The text grows before any token is written, so a text that cannot be resized (a buffer of
    # it still exported) fails the op with the session unchanged, and the next op is exact.
    tok = get_tokenizer("llama3")
    text = large_text(5_000, seed=8, kind="english")
    s = toktier.Session(tok, text)
    s.append(" one")
    text += " one"
    before = _lane_state(s)
    view = memoryview(s._text)
    with pytest.raises(BufferError):
        s.append(" two")
    assert _same_state(_lane_state(s), before)
    view.release()
    r = s.append(" two")
    assert np.array_equal(r.ids, tok.engine.encode(text + " two"))
    tally(tok, "session", 1)


def test_the_cache_pool_lends_each_cache_to_one_taker_at_a_time():
    pool = _core.CachePool(3)
    with pytest.raises(ValueError):
        _core.CachePool(-1)
    held: set[int] = set()
    clash = []
    lock = threading.Lock()

    def worker():
        for _ in range(2000):
            c = pool.take()
            with lock:
                if id(c) in held:
                    clash.append(id(c))
                held.add(id(c))
            with lock:
                held.discard(id(c))
            pool.give(c)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not clash and len(pool) <= 3
    a, b = pool.take(), pool.take()
    assert a is not b
    with pytest.raises(TypeError):
        pool.give(None)
    for c in (a, b, _core.PieceCacheBox(), _core.PieceCacheBox()):
        pool.give(c)
    assert len(pool) == 3  # the fourth is dropped
    taken = [pool.take() for _ in range(4)]
    assert len({id(c) for c in taken}) == 4 and len(pool) == 0


def test_op_results_are_immutable():
    s = toktier.Session(get_tokenizer("llama3"), "hello")
    r = s.append(" world")
    with pytest.raises(AttributeError):
        r.first_changed = 0
    assert r.path == toktier.RepairPath.FIRST_WINDOW and r.widenings == 0 and r.reason is None


def test_nfc_changing_text_is_encoded_in_its_normalized_form(tally, monkeypatch):
    tok = get_tokenizer("qwen3")
    nat = tok.native
    text = "cafe\u0301 Å A\u030a <|im_end|>\u0338 " * 50
    assert tok.engine.normalize(text) != text
    rewrites, fallbacks = nat.nfc_rewrites, nat.nfc_fallbacks
    check_ids(tok, text, tally)
    assert (nat.nfc_rewrites, nat.nfc_fallbacks) == (rewrites + 1, fallbacks)
    assert nat.encode_with_starts(text)[1] is None  # (no offsets in the raw text's coordinates)
    inert = "caf\u00e9 \u00c5 " * 50  # NFC text of non-inert-free characters is served natively
    check_ids(tok, inert, tally)
    # a form in which the engine would find other literals is not certified: the reference encodes it
    real = nat.literal_spans
    monkeypatch.setattr(nat, "literal_spans", lambda t: real(t) if t is text else real(t)[2:])
    check_ids(tok, text, tally)
    assert (nat.nfc_rewrites, nat.nfc_fallbacks) == (rewrites + 2, fallbacks + 1)


# -- serving ---------------------------------------------------------------------------------

def test_threads_share_nothing_mutable():
    tok = get_tokenizer("llama3")
    texts = [large_text(40_000, seed=s, kind=k) for s in range(3) for k in ("mixed", "code")]
    want = [tok.engine.encode(t) for t in texts]
    errors: list[str] = []

    def work(k: int) -> None:
        for _ in range(3):
            for i in range(len(texts)):
                j = (i + k) % len(texts)
                if not np.array_equal(tok.native.encode(texts[j]), want[j]):
                    errors.append(f"thread {k} text {j}")

    _run_threads(work, 4)
    assert not errors


def _run_threads(work, n: int) -> None:
    """work(k) for k in range(n), each on its own thread, all at once; returns when all are done."""
    threads = [threading.Thread(target=work, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _chunk_jobs(tok, n_texts: int = 6):
    from toktier.fullpath import chunk_cuts

    texts = [large_text(24_000, seed=40 + s, kind=("mixed", "code", "english")[s % 3]) for s in range(n_texts)]
    return [(t, chunk_cuts(tok, t, 2_000 + 1_000 * (i % 3)), tok.engine.encode(t)) for i, t in enumerate(texts)]


def test_chunked_encodes_from_many_threads_share_the_helpers_exactly():
    # The engine keeps its helper threads between chunked calls (workers.hpp); callers claim
    # chunks too, so several server threads encoding at once, each with more chunks than there
    # are helpers, all finish, and each gets its own text's IDs.
    tok = get_tokenizer("llama3")
    jobs = _chunk_jobs(tok)
    assert all(len(cuts) >= 4 for _, cuts, _ in jobs)
    errors: list[str] = []

    def work(k: int) -> None:
        for r in range(4):
            for i in range(len(jobs)):
                text, cuts, want = jobs[(i + k + r) % len(jobs)]
                got = tok.native.encode_chunks(text, cuts)
                if got is None or not np.array_equal(got, want):
                    errors.append(f"thread {k} round {r} text {(i + k + r) % len(jobs)}")

    _run_threads(work, 6)
    assert not errors


def test_more_chunks_than_caches_from_many_threads_are_exact():
    # A chunked call lends one piece cache per thread, not per chunk (workers.hpp: the caller
    # is slot 0, each helper that joins takes the next slot): chunks outnumber caches here, and
    # several callers run at once, so a slot handed to two threads at a time would show up as
    # a wrong or torn cache entry somewhere in these IDs.
    tok = get_tokenizer("llama3")
    jobs = _chunk_jobs(tok)
    core = tok.native._core
    errors: list[str] = []

    def work(k: int) -> None:
        for r in range(3):
            for i in range(len(jobs)):
                text, cuts, want = jobs[(i + k + r) % len(jobs)]
                caches = [tok.native._take() for _ in range(1 + (i + k) % 3)]
                try:
                    status, got, _ = core.encode_chunks(text, cuts, caches, False)
                finally:
                    for c in caches:
                        tok.native._give(c)
                if status != 0 or not np.array_equal(got, want):
                    errors.append(f"thread {k} round {r} text {i} with {len(caches)} caches")

    _run_threads(work, 5)
    assert not errors


# Texts whose cut searches meet literals at and around the targets, whitespace runs longer than
# the search (no cut there: the target moves on), dense scripts and line breaks.
def _cut_texts(tok) -> list[str]:
    lits = [lit.content for lit in tok.engine.literals if lit.content][:6] or ["<|x|>"]
    out = []
    for kind in ("english", "code", "mixed", "multilingual"):
        base = large_text(40_000, seed=21, kind=kind)
        parts = [base[i:i + 997] + lits[(i // 997) % len(lits)] for i in range(0, len(base), 997)]
        out.append("".join(parts))
    out.append(("word " * 300 + " " * 5_000 + "\n\n" + "x" * 3_000 + "中文" * 2_000) * 3)
    out.append("".join(f"{lits[i % len(lits)]}\n{i} " for i in range(4_000)))
    return out


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
def test_compiled_cuts_equal_the_python_search(name):
    # `NativeEngine.cuts` (repair.hpp `Lane::text_cuts`) is `fullpath.chunk_cuts` compiled: the
    # same offsets for every chunk size, each one a standalone-stable position no literal crosses.
    from toktier.boundaries import stable_char_positions
    from toktier.fullpath import chunk_cuts

    tok = get_tokenizer(name)
    for text in _cut_texts(tok):
        ok = set(stable_char_positions(tok, text, standalone=True).tolist())
        for chunk in (1, 64, 1_000, 4_096, 65_536):
            got = tok.native.cuts(text, chunk)
            assert got == chunk_cuts(tok, text, chunk), (name, chunk, text[:40])
            assert all(q in ok for q in got)
        # encoded at those cuts: one reference encode (an NFC family's text NFC leaves as it is;
        # `check_nfc` off as `fullpath` does once it has the form, since any non-inert character
        # fails the engine's own quick check)
        if not tok.family_info.nfc or tok.engine.normalize(text) == text:
            cuts = tok.native.cuts(text, 2_048)
            ids = tok.native.encode_chunks(text, cuts, check_nfc=False)
            assert np.array_equal(ids, tok.engine.encode(text))


def test_compiled_cuts_of_odd_inputs():
    # No cut for a chunk size of zero or less, an empty or a too short text; a lone surrogate
    # (which the encode refuses with the reference's typed error) gets cuts, never an exception
    # (Python's search raised UnicodeEncodeError on one near a target).
    from toktier.fullpath import FullPathConfig, _encode_cpu

    tok = get_tokenizer("llama3")
    text = "hello world, " * 400
    assert tok.native.cuts(text, 0) == [] and tok.native.cuts(text, -5) == []
    assert tok.native.cuts("", 10) == [] and tok.native.cuts("ab", 10) == [] and tok.native.cuts("a", 1) == []
    bad = text[:2000] + "\udc80" + text[2000:]
    cuts = tok.native.cuts(bad, 1000)
    assert cuts and all(0 < q < len(bad) for q in cuts)
    with pytest.raises(toktier.ReferenceEngineError):
        _encode_cpu(tok, bad, FullPathConfig(chunk_chars=1000, native_min_parallel_chars=1))


@SETTINGS
@given(adv, st.integers(1, 40))
def test_compiled_cuts_equal_the_python_search_on_adversarial_text(text, chunk):
    from toktier.fullpath import chunk_cuts

    for name in ("llama3", "qwen3", "deepseek_v4", "o200k_base"):
        tok = get_tokenizer(name)
        assert tok.native.cuts(text, chunk) == chunk_cuts(tok, text, chunk), name


def test_an_engine_makes_the_caches_a_parallel_op_takes_ahead_of_need():
    # A new piece cache costs the kernel 11-15 ms of page zeroing here: made on a thread at load,
    # not by the first op that needs one more (a 50K-character window edit read 17-19 ms).
    import time

    from toktier.native import PREWARM_CACHES

    tok = toktier.load_tokenizer("llama3")  # a new load: its own engine and pool
    want = min(tok.native.chunk_threads, PREWARM_CACHES)
    deadline = time.monotonic() + 60
    while len(tok.native.pool) < want and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(tok.native.pool) >= want
    pool = _core.CachePool(3)
    assert pool.fill(5) == 3 and len(pool) == 3  # never past the limit
    assert pool.fill(2) == 0 and pool.fill(-1) == 0 and len(pool) == 3  # nothing to make
    assert len({id(pool.take()) for _ in range(3)}) == 3 and len(pool) == 0


def test_chunked_encodes_work_in_a_forked_child():
    # A child of fork() has none of its parent's helper threads (and may hold the pool's lock
    # as the fork found it): the engine makes the child a pool of its own.
    import os

    tok = get_tokenizer("llama3")
    jobs = _chunk_jobs(tok, 3)
    for text, cuts, want in jobs:  # the parent's helpers are running
        assert np.array_equal(tok.native.encode_chunks(text, cuts), want)
    pid = os.fork()
    if pid == 0:  # the child: no pytest machinery, an exit status only
        ok = all(np.array_equal(tok.native.encode_chunks(text, cuts), want) for text, cuts, want in jobs * 2)
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    for text, cuts, want in jobs:  # the parent's pool is untouched
        assert np.array_equal(tok.native.encode_chunks(text, cuts), want)


def test_verifier_mismatch_demotes_a_wrong_native_engine():
    tok = toktier.load_tokenizer("cl100k_base")
    assert tok.engine_label == "native"
    text = "x = 1234567"
    good = tok.encode(text)
    # A served result that is wrong while the native engine is right: not the engine's fault.
    reports = Verifier().check(tok, [Served(text, good[::-1].copy())])
    assert reports and tok.native.demoted is None and tok.engine_label == "native"
    # An engine that differs from the reference (Qwen's digit rule here) is sent back.
    tok.native._core = _core.CoreEngine("qwen", *_core_args(tok))
    served = tok.encode_fast(text)
    assert not np.array_equal(served, good)
    reports = Verifier().check(tok, [Served(text, served)])
    assert reports and tok.native.demoted and "shadow verifier" in tok.native.demoted
    assert tok.engine_label == "tiktoken"
    assert np.array_equal(tok.encode_fast(text), good)
    assert "reference engine (shadow verifier" in tok.explain()
    assert toktier.load_tokenizer("cl100k_base").engine_label == "native"  # a new load certifies afresh


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
def test_session_and_full_path_use_it_and_stay_exact(name):
    tok = get_tokenizer(name)
    text = _stable(tok, large_text(200_000, kind="mixed"))
    fp = toktier.FullPath()
    assert np.array_equal(fp.encode(tok, text), tok.engine.encode(text))
    s = toktier.Session(tok, text[:100_000])
    for k in range(100_000, 100_000 + 5 * 1400, 1400):
        r = s.append(text[k:k + 1400])
    assert np.array_equal(r.ids, tok.engine.encode(text[:100_000 + 5 * 1400]))


# -- the compiled append lane ----------------------------------------------------------------

def _append_session(tok, text: str, deltas: list[str], tally, check_every: int = 1) -> toktier.Session:
    s = toktier.Session(tok, text)
    for i, d in enumerate(deltas):
        check = i % check_every == 0 or i == len(deltas) - 1
        before = s.ids.copy() if check else None
        r = s.append(d)
        text += d
        if check:
            ref = tok.engine.encode(text)
            assert np.array_equal(r.ids, ref), f"{tok.name}: append {i} ({d[:40]!r}) diverged"
            tally(tok, "session", 1)
            m = min(len(ref), len(before))
            diff = np.flatnonzero(ref[:m] != before[:m])
            assert r.first_changed == (int(diff[0]) if len(diff) else m), f"{tok.name}: append {i}"
    return s


def _checkpoints_from_scratch(tok, ids: np.ndarray) -> np.ndarray:
    from toktier.offsets import SparseOffsets

    fresh = SparseOffsets(tok.token_len)
    fresh.reserve_for(len(ids))
    fresh.rebuild(ids)
    return fresh.checkpoints()


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
def test_lane_commit_in_place_and_when_buffers_must_grow(name, tally):
    # The lane writes its splice into the session's buffers when they have room, and hands the
    # splice back when one must grow first: both ways give the reference IDs, the exact
    # first_changed and the checkpoints a from-scratch rebuild gives.
    tok = get_tokenizer(name)
    text = _stable(tok, large_text(20_000, kind="code"))
    s = toktier.Session(tok, text)
    grown = in_place = 0
    deltas = _stable(tok, large_text(40_000, seed=7, kind="mixed"))
    for k in range(0, 28_000, 700):
        cap_ids, cap_cp = len(s._ids.buffer), len(s._starts.raw()[0])
        lane_before = s.stats.lane
        before = s.ids.copy()
        r = s.append(deltas[k:k + 700])
        ref = tok.engine.encode(s.text)
        assert np.array_equal(r.ids, ref)
        m = min(len(ref), len(before))
        diff = np.flatnonzero(ref[:m] != before[:m])
        assert r.first_changed == (int(diff[0]) if len(diff) else m)
        assert np.array_equal(s._starts.checkpoints(), _checkpoints_from_scratch(tok, s.ids))
        tally(tok, "session", 1)
        if s.stats.lane > lane_before:
            if len(s._ids.buffer) > cap_ids or len(s._starts.raw()[0]) > cap_cp:
                grown += 1
            else:
                in_place += 1
    assert grown and in_place, (grown, in_place)


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
def test_lane_appends_of_real_text_are_exact(name, tally):
    tok = get_tokenizer(name)
    base = _stable(tok, large_text(30_000, kind="code"))
    more = _stable(tok, large_text(40_000, seed=4, kind="mixed"))
    deltas = [more[k:k + n] for k, n in zip(range(0, 40_000, 1000), [1, 10, 1400, 3, 700] * 8)]
    s = _append_session(tok, base, deltas, tally, check_every=3)
    assert s.stats.lane > len(deltas) // 2, s.stats


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
@SETTINGS
@given(parts=st.lists(adv, min_size=1, max_size=12))
def test_lane_appends_of_adversarial_text_are_exact(name, parts, tally):
    tok = get_tokenizer(name)
    _append_session(tok, _stable(tok, "def f(x):\n    return x  # " * 20), [_stable(tok, p) for p in parts], tally)


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
def test_lane_chat_turns_with_literals(name, tally):
    tok = get_tokenizer(name)
    lits = [lit.content for lit in tok.engine.literals][:8] or [""]
    turns = [f"{lits[i % len(lits)]}user\n\nline {i} 'S\u00a0\u00a0{lits[(i + 1) % len(lits)]}" for i in range(40)]
    s = _append_session(tok, "system prompt. " * 40, turns, tally)
    assert s.stats.lane > 0


def test_lane_declines_what_it_cannot_certify(tally):
    tok = get_tokenizer("llama3")
    s = _append_session(tok, "=" * 2000, ["=" * 10, "a" * 7, " " * 300], tally)  # one-byte runs: Python path
    assert s.stats.first_window + s.stats.widened + s.stats.full > s.stats.lane
    z = np.zeros(0, np.uint32)
    status, *_ = tok.native.edit_lane(bytearray(b"x" * 300), 300, 300, "\u00e9".encode() * 3, z, z, 64, 256)
    assert status != 0  # no tokens: nothing to splice against


def test_a_lane_with_a_wrong_engine_is_caught(tally):
    # Mutation check: the lane splices what its engine encodes, so a lane driven by an engine
    # with the wrong rule set (Qwen's single digits for llama3) must produce a divergence the
    # differential check sees: these tests can fail.  (The load-time self-check refuses such an
    # engine: `test_self_check_catches_a_wrong_engine`.)
    tok = toktier.load_tokenizer("llama3")
    fam = tok.family_info
    wrong = _core.CoreEngine("qwen", *_core_args(tok))
    tok.native._lane = _core.RepairLane(wrong, tok.token_len, tok.table.uncertain.astype(np.uint8),
                                        fam._group_table(tok.classes), np.asarray(fam._tables()[1], np.uint8),
                                        tok.max_token_bytes, [])
    text = "def f(x):\n    return x + 1  # add\n" * 20
    s = toktier.Session(tok, text)
    text += " = 1234567"
    assert not np.array_equal(s.append(" = 1234567").ids, tok.engine.encode(text))
    assert s.stats.lane == 1


@pytest.mark.parametrize("flag", ["uncertain", "length"])
def test_the_lane_declines_a_window_holding_a_flagged_token(flag, tally):
    # The lane's tiling proof reads each fresh token's length from a one-byte-per-id summary of
    # the records (`Lane::fast_len`); an id whose record carries a flag (a span the text must
    # prove, or a canonical length other than its bytes) is left out of it, so a window holding
    # one goes to the Python path, which proves it from the text.  Mutation check: with the flag
    # ignored the lane would serve these appends (and for "length", splice wrong offsets).
    from toktier.charclass import W

    tok = toktier.load_tokenizer("llama3")
    fam = tok.family_info
    the = int(tok.encode(" the")[0])
    args = list(_core_args(tok))
    token_len, uncertain = args[-2].copy(), args[-1].copy()
    if flag == "uncertain":
        uncertain[the] = 1
    else:
        token_len[the] += 1
    args[-2:] = [token_len, uncertain]
    core = _core.CoreEngine(tok.native.rules, *args)
    tok.native._lane = _core.RepairLane(core, tok.token_len, tok.table.uncertain.astype(np.uint8),
                                        fam._group_table(tok.classes), np.asarray(fam._tables()[1], np.uint8),
                                        tok.max_token_bytes, [lit.content for lit in tok.engine.literals if lit.content],
                                        tok.classes, W)
    text = large_text(20_000, seed=3, kind="code").replace("the", "thy")  # no " the" in the first windows
    s = toktier.Session(tok, text)
    for delta, served in (("\nx = compute(y)\n", True), ("\ny = x + 1\n", True), (" and the cat\n", False)):
        lane = s.stats.lane
        r = s.append(delta)
        text += delta
        assert np.array_equal(r.ids, tok.engine.encode(text)), delta
        assert s.stats.lane == lane + served, (delta, s.stats)
        tally(tok, "session", 1)


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
@SETTINGS
@given(data=st.data())
def test_lane_edits_anywhere_are_exact(name, data, tally):
    # Inserts, deletions and replacements at random places of a real text: every op checked.
    tok = get_tokenizer(name)
    text = _stable(tok, large_text(6_000, seed=data.draw(st.integers(0, 3)), kind="mixed"))
    s = toktier.Session(tok, text)
    for _ in range(data.draw(st.integers(1, 6))):
        a = data.draw(st.integers(0, len(text)))
        b = data.draw(st.integers(a, min(len(text), a + 300)))
        new = _stable(tok, data.draw(adv))
        r = s.edit(a, b, new)
        text = text[:a] + new + text[b:]
        assert s.text == text
        assert np.array_equal(r.ids, tok.engine.encode(text)), f"{tok.name}: edit [{a}, {b}) <- {new[:40]!r}"
        tally(tok, "session", 1)


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
def test_lane_serves_most_edits_of_real_text(name, tally):
    tok = get_tokenizer(name)
    text = _stable(tok, large_text(50_000, kind="code"))
    s = toktier.Session(tok, text)
    import random

    rng = random.Random(7)
    for i in range(60):
        a = rng.randrange(len(text))
        b = min(len(text), a + rng.randrange(0, 200))
        new = _stable(tok, large_text(rng.randrange(1, 400), seed=i, kind="code"))
        r = s.edit(a, b, new)
        text = text[:a] + new + text[b:]
        if i % 6 == 0:
            assert np.array_equal(r.ids, tok.engine.encode(s.text))
            tally(tok, "session", 1)
    assert np.array_equal(r.ids, tok.engine.encode(s.text))
    assert s.stats.lane >= 40, s.stats


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
@pytest.mark.parametrize("text", ["a\ud800b", "\udfff", "x" * 100 + "\ud83d", "中\udc00文"])
def test_lone_surrogates_get_the_references_typed_error(name, text):
    # A str with a lone surrogate has no UTF-8: the references raise, so the native path must too
    # (never a silent encoding of some byte sequence).
    tok = get_tokenizer(name)
    with pytest.raises(toktier.ReferenceEngineError):
        tok.engine.encode_fast(text)
    with pytest.raises(toktier.ReferenceEngineError):
        tok.encode_fast(text)
    with pytest.raises(toktier.InvalidText):
        toktier.Session(tok, "ok").append(text)


@pytest.mark.parametrize("wide", ["\u0100", "\U0001F600"])
@pytest.mark.parametrize("at", [0, 255, 256, 300, 511, 767, 1023, 1024, 1098])
def test_a_lone_surrogate_anywhere_in_a_long_str_is_refused(wide, at):
    # The native surrogate scan works in blocks of 256 characters plus a tail: a surrogate in
    # any block, at a block's edge or in the tail, in a 2- or 4-byte str, must be seen.
    tok = get_tokenizer("llama3")
    chars = list(("hello world " * 100)[:1099] + wide)  # 4 blocks and a tail of 76
    chars[at] = "\udc80"
    text = "".join(chars)
    with pytest.raises(toktier.ReferenceEngineError):
        tok.engine.encode_fast(text)
    with pytest.raises(toktier.ReferenceEngineError):
        tok.encode_fast(text)
    chars[at] = "x"  # the same str without it encodes, and exactly
    assert np.array_equal(tok.encode_fast("".join(chars)), tok.engine.encode_fast("".join(chars)))


def test_lane_rejects_encoded_surrogates_and_truncated_utf8():
    tok = get_tokenizer("llama3")
    s = toktier.Session(tok, "hello world " * 50)
    ids, cp = s._ids.view(), s._starts.checkpoints()
    for bad in (b"\xed\xa0\x80", b"\xe4\xb8", b"\xff"):
        status, *_ = tok.native.edit_lane(s._text, len(s._text), len(s._text), bad, ids, cp, 64, s.window)
        assert status == 5  # LANE_BAD_UTF8: the session's own path decides (and raises InvalidText)


# -- compiled chunks (the full path's parallel encode) -----------------------------------------

@pytest.mark.parametrize("name", ALL_TOKENIZERS)
@pytest.mark.parametrize("kind", ["code", "mixed", "multilingual"])
def test_compiled_chunks_equal_one_reference_encode(name, kind, monkeypatch, tally):
    # Small chunks force many cuts (literals, long pieces and multi-byte text near them); the
    # compiled call encodes each chunk on its own thread, and the concatenation must be exactly
    # one reference encode of the whole text.  An NFC family's text goes in the form its reference
    # tokenizes (`nfc_spans.nfc_form`), with the chunk's NFC check off.
    from toktier.fullpath import FullPathConfig, _encode_cpu

    tok = get_tokenizer(name)
    base = large_text(60_000, seed=3, kind=kind)
    lits = [lit.content for lit in tok.engine.literals if lit.content][:8]
    text = "".join(base[i:i + 3_000] + (lits[(i // 3_000) % len(lits)] if lits else "")
                   for i in range(0, len(base), 3_000))
    answers = []
    real = tok.native.encode_chunks

    def spy(t, cuts, check_nfc=True):
        out = real(t, cuts, check_nfc)
        answers.append((len(cuts), out is not None))
        return out

    monkeypatch.setattr(tok.native, "encode_chunks", spy)
    cfg = FullPathConfig(chunk_chars=4_096, native_min_parallel_chars=1)
    ids, chunked = _encode_cpu(tok, text, cfg)
    assert chunked and answers and answers[0][0] >= 8
    assert np.array_equal(ids, tok.engine.encode(text))
    # (an NFC family's text goes in its normalized form: served too)
    assert answers[0][1], "the compiled call declined a text it can encode"
    tally(tok, "fullpath", 1)


def test_compiled_chunks_check_their_cuts():
    tok = get_tokenizer("llama3")
    box = [tok.native._take() for _ in range(4)]
    with pytest.raises(ValueError):
        tok.native._core.encode_chunks("abc def", [9], box[:2], False)
    with pytest.raises(ValueError):  # a cache per thread: none is too few
        tok.native._core.encode_chunks("abc def", [3], [], False)
    with pytest.raises(ValueError):  # and more threads than chunks too many
        tok.native._core.encode_chunks("abc def", [3], box[:3], False)
    with pytest.raises(ValueError):
        tok.native._core.encode_chunks("abc def", [4, 3], box[:3], False)
    text = "déjà vu, naïve café " * 50
    from toktier.fullpath import chunk_cuts

    cuts = chunk_cuts(tok, text, 250)[:3]
    assert len(cuts) == 3
    for caches in (box, box[:2], box[:1]):  # four chunks on four, two or one thread(s)
        status, ids, starts = tok.native._core.encode_chunks(text, cuts, caches, True)
        assert status == 0 and ids.tolist() == tok.engine.encode(text).tolist()
        lens = tok.token_len[ids].astype(np.int64)
        assert starts.tolist() == (np.cumsum(lens) - lens).tolist()
    for b in box:
        tok.native._give(b)


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
@pytest.mark.parametrize("threads", [1, 4])
def test_big_lane_windows_in_chunks_are_exact(name, threads, monkeypatch, tally):
    # A big append or edit is encoded in chunks on several threads (cut at standalone-stable
    # boundaries that no literal crosses); one thread gives the same IDs as four, and both are
    # the reference's.
    tok = get_tokenizer(name)
    monkeypatch.setattr(tok.native, "lane_threads", threads)
    lits = [lit.content for lit in tok.engine.literals if lit.content][:4]
    text = _stable(tok, large_text(30_000, kind="code"))
    s = toktier.Session(tok, text)
    for i, kind in enumerate(("english", "mixed", "multilingual", "code")):
        base = _stable(tok, large_text(40_000, seed=50 + i, kind=kind))
        delta = "".join(base[k:k + 7_000] + (lits[k // 7_000 % len(lits)] if lits else "")
                        for k in range(0, len(base), 7_000))
        before = s.ids.copy()
        lane = s.stats.lane
        r = s.append(delta)
        text += delta
        ref = tok.engine.encode(text)
        assert np.array_equal(r.ids, ref), f"{name} {kind}: append of {len(delta)} characters"
        m = min(len(ref), len(before))
        diff = np.flatnonzero(ref[:m] != before[:m])
        assert r.first_changed == (int(diff[0]) if len(diff) else m)
        if not tok.family_info.nfc or kind in ("english", "code"):
            assert s.stats.lane == lane + 1
        tally(tok, "session", 1)
    a = len(text) // 3
    r = s.edit(a, a + 10, _stable(tok, large_text(30_000, seed=9, kind="mixed")))
    text = s.text
    assert np.array_equal(r.ids, tok.engine.encode(text))


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
@pytest.mark.parametrize("threads", [1, 4])
def test_lane_windows_of_every_width_are_exact(name, threads, monkeypatch, tally):
    # The lane hands the engine a window's characters at their narrowest width: the bytes of an
    # ASCII window, two bytes a character when all are in the BMP, four when one is not (found
    # first, or only after a long BMP stretch, when the two-byte decode starts again wider).  Its
    # certified cuts read the characters around a byte position from the UTF-8 itself, so cuts
    # next to 2-, 3- and 4-byte characters are here too; big windows are cut into chunks.
    tok = get_tokenizer(name)
    monkeypatch.setattr(tok.native, "lane_threads", threads)
    english = large_text(30_000, seed=3, kind="english").replace("\u2019", "'")
    ascii_text = english.encode("ascii", "ignore").decode()
    wide = ["caf\u00e9 ", "\u4e2d\u6587 ", "\u2019s ", "\U0001F600 ", "\u0100\U0001d400"]
    deltas = {
        "ascii": ascii_text[:3_000],
        "bmp": "".join(ascii_text[k:k + 40] + wide[k // 40 % 3] for k in range(0, 3_000, 40)),
        "astral first": "\U0001F600 " + ascii_text[:2_000],
        "astral late": "\u00e9" + ascii_text[:26_000] + " \U0001F600",
        "big bmp": "".join(ascii_text[k:k + 500] + "\u4e2d\u2019 " for k in range(0, 30_000, 500)),
        "big mixed": "".join(ascii_text[k:k + 300] + wide[k // 300 % len(wide)] for k in range(0, 30_000, 300)),
        "wide only": "".join(wide) * 50,
    }
    lits = [lit.content for lit in tok.engine.literals if lit.content][:4]
    if lits:  # chunk cuts are checked against literal occurrences by byte position
        deltas["big literals"] = "".join(f"\u4e2d\u6587{lits[k % len(lits)]}\u00e9x" for k in range(2_500))
    text = _stable(tok, large_text(20_000, kind="code"))
    s = toktier.Session(tok, text)
    for kind, delta in deltas.items():
        delta = _stable(tok, delta)
        lane = s.stats.lane
        r = s.append(delta)
        text += delta
        assert np.array_equal(r.ids, tok.engine.encode(text)), f"{name}: {kind} append"
        if not tok.family_info.nfc or kind == "ascii":
            assert s.stats.lane == lane + 1, f"{name}: the lane did not serve the {kind} append"
        tally(tok, "session", 1)
    # edits whose windows start and end beside multi-byte characters
    for i, a in enumerate(range(len(text) - 20_000, len(text) - 200, 977)):
        new = _stable(tok, wide[i % len(wide)] + "x" + wide[(i + 1) % len(wide)])
        r = s.edit(a, a + 3, new)
        text = text[:a] + new + text[a + 3:]
        assert np.array_equal(r.ids, tok.engine.encode(text)), f"{name}: edit at {a}"
        tally(tok, "session", 1)


# -- the block scanner (`Engine::pretok_block`) -----------------------------------------------
# It decides up to 128 ASCII characters' piece starts at once from class bitmasks, and only where
# the probed table gives ASCII the classes its rules assume.  Its edges are where it could go
# wrong: a run, a contraction or a whitespace tail across the end of a view (which moves with the
# pieces), a non-ASCII character cutting a view short, a segment's end.  So: texts built from
# such atoms, shifted against the view edges, checked against the per-character scanner and
# against the references (HF's pre-tokenizer, the `regex` module, the reference encode).

BLOCK_TOKENIZERS = ("llama3", "cl100k_base", "qwen3", "o200k_base", "o200k_harmony", "deepseek_v4")
BLOCK_RULES = ("cl100k_hf", "cl100k_tt", "qwen", "o200k")
BLOCK_ATOMS = ["a", "Z", "word", " word", "  x", "s", "t", "re", "ve", "LL", "d", "M", "'", "'s", "'T", "'re", "'VE",
               "'ll", "'d", "'m", "''", "x's", " 's", "!'s", " ", "  ", "   ", "\t", "\n", "\r\n", "\n\n", " \n ",
               "\n  ", "\t\n", "\x0b", "\x0c", "1", "12", "123", "1234", "0", "!", "!!", " !", "...", "(", "_",
               "-", "/", "\x00", "\x1f", "\x7f", "\u00e9", "\u2019", "\u00a0", "\U0001f600",
               # o200k: words split before an uppercase letter after a lowercase one, contractions
               # are suffixes, and punctuation takes [\r\n/]* after its run
               "aB", "ABc", "Ab'S", "lL", "'lL", "!\n/", "/\n", "*/\n//", "\n/", ";\r\n/*", "/x",
               # DeepSeek: digits cut segments, control characters prefix letters or make gaps
               " 1", "  1", "a1b", "\x01", "\x01x", "\x01\x02", ".x", "\u4e2d"]
block_adv = st.builds(lambda pad, parts: "x" * pad + "".join(parts), st.integers(0, 140),
                      st.lists(st.sampled_from(BLOCK_ATOMS), max_size=200))


def _per_character(core, text: str):
    core.use_block_scanner(False)
    try:
        return core.pieces(text)[0]
    finally:
        core.use_block_scanner(True)


def _edge_texts() -> list[str]:
    """Runs of each class (and mixes) of lengths around 64, 128 and the 4096-character chunk,
    shifted by 0-3 characters, ended by each kind of follower."""
    out = []
    for run in ("a", "A", " ", "\n", "\r\n", " \n", "1", "!", "'s", "a'", "  a", "\t\n ", "x1", "'ll", "aB", "!\n/",
                "/\n", " 1", "\x01", "\x01a"):
        for n in (1, 2, 3, 62, 63, 64, 65, 125, 126, 127, 128, 129, 130, 255, 256, 4094, 4095, 4096, 4097):
            for shift in ("", "b", " b", "1!\n"):
                for tail in ("", "y", " y", "1", "\n", " ", "'s", "\u00e9"):
                    out.append(shift + run * n + tail)
    return out


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
def test_block_scanner_serves_where_proven(name):
    assert name in BLOCK_TOKENIZERS  # every bundled rule set has one now
    assert get_tokenizer(name).native.block_scanner == (True, "")


@pytest.mark.parametrize("name", BLOCK_TOKENIZERS)
def test_block_scanner_equals_per_character_scanner_at_view_edges(name):
    core = get_tokenizer(name).native._core
    for text in _edge_texts():
        assert np.array_equal(core.pieces(text)[0], _per_character(core, text)), repr(text[:80])


@pytest.mark.parametrize("name", BLOCK_TOKENIZERS)
@SETTINGS
@given(text=block_adv)
def test_block_scanner_equals_per_character_scanner_and_hf(name, text, tally):
    tok = get_tokenizer(name)
    text = _stable(tok, text)
    assert np.array_equal(tok.native._core.pieces(text)[0], _per_character(tok.native._core, text))
    if name in HF_TOKENIZERS:
        check_hf_pieces(tok, text, tally)
    check_ids(tok, text, tally)


@pytest.mark.parametrize("rules", BLOCK_RULES)
@SETTINGS
@given(text=block_adv)
def test_block_scanner_equals_regex(rules, text):
    eng = _regex_engine(rules)
    assert eng.block_scanner[0]
    starts, _ = eng.pieces(text)
    assert _spans(starts, len(text)) == regex_pieces(REGEX_RULES[rules], text)


@pytest.mark.parametrize("rules", BLOCK_RULES)
def test_block_scanner_on_every_short_ascii_context(rules):
    # Every string of up to 5 characters over the characters the rules tell apart, written one
    # after another: each 5-gram occurs at many offsets from the (moving) view edges.
    import itertools

    eng = _regex_engine(rules)
    # (o200k also tells apart an uppercase letter after a lowercase one, and the slash of a trailer)
    alphabet = "aS'tl 1\n\r!\t" + ("L/" if rules == "o200k" else "")
    grams = ["".join(p) for k in range(1, 6) for p in itertools.product(alphabet, repeat=k)]
    for lo in range(0, len(grams), 3000):
        text = "".join(grams[lo:lo + 3000])
        starts, _ = eng.pieces(text)
        assert _spans(starts, len(text)) == regex_pieces(REGEX_RULES[rules], text), f"grams from {lo}"


def test_block_scanner_deepseek_on_every_short_ascii_context(tally):
    # DeepSeek's three split stages have no one regex for `regex_pieces`: every 5-gram over the
    # characters its rules tell apart, against the per-character scanner (which the campaigns
    # certify) everywhere and against HF's own pre-tokenizer on every 8th stretch.
    import itertools

    tok = get_tokenizer("deepseek_v4")
    core = tok.native._core
    alphabet = "aS.( 1\n\r\t\x01!"
    grams = ["".join(p) for k in range(1, 6) for p in itertools.product(alphabet, repeat=k)]
    for j, lo in enumerate(range(0, len(grams), 3000)):
        text = "".join(grams[lo:lo + 3000])
        assert np.array_equal(core.pieces(text)[0], _per_character(core, text)), f"grams from {lo}"
        if j % 8 == 0:
            check_hf_pieces(tok, text, tally)


@pytest.mark.parametrize("name", BLOCK_TOKENIZERS)
@pytest.mark.parametrize("kind", ["english", "code"])
def test_block_scanner_ids_on_ucs2_and_ucs4_text(name, kind, tally):
    # Mostly ASCII text stored 2 or 4 bytes a character (one curly quote, one emoji): the block
    # scanner's views and the 8-at-a-time UTF-8 conversion of ASCII pieces, against the reference.
    tok = get_tokenizer(name)
    base = _stable(tok, large_text(60_000, seed=3, kind=kind))
    for extra in ("\u2019", "\U0001f600"):
        text = base[:30_000] + extra + base[30_000:] + extra
        check_ids(tok, text, tally)
        assert np.array_equal(tok.native._core.pieces(text)[0], _per_character(tok.native._core, text))


#: Letters of scripts whose runs are one piece (\p{L}+) in most families: CJK, kana and Hangul,
#: Cyrillic, Greek, Arabic and Thai, accented Latin; and all of them mixed.
_SCRIPTS = ("的是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自着去之过家学对可她里后小么心多天而能好都然没日于起还发成事只作当想看文无开手十用主行方又如前所本见经头面公同三已老从动两长知民样现分将外但身些与高意进把法此实回二理美点月明其种声全工己话儿者向情部正名定女问力机给等几很业最间新什打便位因重被走电四第门相次东政海口使教西再平真听世气信北少关并内加化由却代军产入先山五太水万市眼体别处总才场师书比住员九笑性通目华报立马命张活难神数件安表原车白应路期叫死常提感金何更反合放做系计或司利受光王果亲界及今京务制解各任至清物台象记边共风战干接它许八特觉望直服毛林题建南度统色字请交爱让认算论百吃义科怎元社术结六功指思非流每青管夫连远资队跟带花快条院变联言权往展该领传近留红治决周保达办运武半候七必城父强步完革深区即求品士转量空甚众技轻程告江语英基派满式李息写呢识极令黄德收脸钱党倒未持取设始版双历越史商千片容研像找友孩站广改议形委早房音火际则首单据导影失拿网香似斯专石若兵弟谁校读志飞观争究包组造落视济喜离虽坏兴切推器号装乐乎福",
            "あいうえおかきくけこさしすせそアイウエオカキクケコ한국어대한민국서울부산",
            "приветмирзначениестрокаαβγδεζηθικλμνξοπρστυφχψω",
            "مرحباالعالمكتابสวัสดีครับéèêëàâäôöûüçñß")
_SCRIPTS = (*_SCRIPTS, "".join(_SCRIPTS))


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
def test_bpe_of_non_ascii_pieces_of_every_length_agrees(name):
    # Pieces with non-ASCII bytes take the linked-list merge and the pair filter (engine.hpp,
    # `merge_linked`) up to SMALL_MAX bytes, the heap above: every length from one character to
    # well past 48 bytes (each side of the scan's rounding to 8 slots and of SMALL_MAX), with a
    # fresh piece cache so that every piece is merged, not looked up.  Single pieces only: the
    # reference encodes the same text.
    import random

    tok = get_tokenizer(name)
    rng = random.Random(f"non-ascii-pieces:{name}")
    checked, lengths = 0, set()
    for i in range(1500):
        alphabet = _SCRIPTS[i % len(_SCRIPTS)]
        text = "".join(rng.choices(alphabet, k=rng.randrange(1, 40)))
        if tok.family_info.nfc:
            text = tok.engine.normalize(text)
        starts, lits = tok.native.pieces(text)
        if len(starts) != 1 or lits[0] >= 0:
            continue
        got = tok.native._core.bpe(text.encode(), _core.PieceCacheBox())
        assert np.array_equal(got, tok.engine.encode(text)), (name, text)
        checked += 1
        lengths.add(len(text.encode()))
    # the lengths around the merge's limits were reached (every family keeps some runs whole)
    assert checked >= 200 and {n for n in lengths if 40 <= n <= 56}, (checked, sorted(lengths)[:20])


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
def test_short_pieces_of_many_ids_are_cached_and_exact(name):
    # A piece of at most 26 bytes (a slot's room) whose BPE is more than 6 ids (a slot's room: a
    # CJK run of 8 characters is 24 bytes and ~8 ids) keeps its ids in the long-piece table and a
    # marked slot (engine.hpp, `PieceCache::put`).  Until 2026-12-04 it was never found again:
    # every later encode re-merged it.  Both passes must equal the reference, and the second must
    # find every piece it merged in the first (no miss).
    import random

    tok = get_tokenizer(name)
    rng = random.Random(f"short-many-ids:{name}")
    core = tok.native._core
    runs, refs = [], []
    while len(runs) < 300:
        alphabet = _SCRIPTS[len(runs) % (len(_SCRIPTS) - 1)]
        run = "".join(rng.choices(alphabet, k=rng.randrange(3, 14)))
        if tok.family_info.nfc:
            run = tok.engine.normalize(run)
        starts, lits = tok.native.pieces(run)
        if len(starts) != 1 or lits[0] >= 0 or not 7 <= len(run.encode()) <= 26:
            continue
        runs.append(run)
        refs.append(tok.engine.encode(run))
    assert any(len(r) > 6 for r in refs), "no short piece of many ids: the case is not covered"
    cache = _core.PieceCacheBox()
    for run, ref in zip(runs, refs):  # each alone, through the piece path (`bpe`), merged the first time
        assert np.array_equal(core.bpe(run.encode(), cache), ref), run
    misses = cache.misses
    for run, ref in zip(runs, refs):
        assert np.array_equal(core.bpe(run.encode(), cache), ref), run
    assert cache.misses == misses, f"{cache.misses - misses} pieces merged again"
    text = "\n".join(runs)  # and inside a text, whose batch path shares the cache
    st, ids, _ = core.encode(text, cache, False, True)
    assert st == 0 and np.array_equal(ids, tok.engine.encode(text))
    assert cache.misses == misses


def test_reserve_text_makes_room_by_half_and_keeps_the_text():
    # A session's text is a bytearray grown in place by every op; CPython grows one by an eighth,
    # so `reserve_text` grows it by half at least, leaving its bytes and length as they were.
    import sys

    text = bytearray(b"abc\xe4\xb8\xad" * 20_000)
    before = bytes(text)
    _core.reserve_text(text, len(text) + 1_000)
    assert bytes(text) == before
    room = sys.getsizeof(text) - sys.getsizeof(bytearray())
    assert room >= len(text) * 3 // 2
    text += b"x" * (len(text) // 3)  # fits: no regrowth
    assert sys.getsizeof(text) - sys.getsizeof(bytearray()) == room
    # past twice its size the text is left alone (a shrink back would give the room away)
    small = bytearray(b"abcd" * 1000)
    alloc = sys.getsizeof(small)
    _core.reserve_text(small, 10 * len(small))
    assert bytes(small) == b"abcd" * 1000 and sys.getsizeof(small) == alloc
    # a text whose buffer is exported cannot move: the reference's BufferError, the text intact
    with memoryview(text):
        with pytest.raises(BufferError):
            _core.reserve_text(text, room + 1_000)  # past its room, within twice its size
    assert bytes(text) == before + b"x" * (len(before) // 3)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status and sets RLIMIT_AS")
def test_reserve_text_without_memory_for_the_room_changes_nothing():
    # `reserve_text` asks for half again; when that allocation fails, the text stays as it was
    # (the exact growth an op needs may still fit) and no MemoryError escapes.  A 64 MiB text in
    # a child process whose address space is capped 8 MiB above what it holds: the 96 MiB the
    # reservation asks for cannot be had.  (Without the cap the same call makes 32 MiB of room.)
    import subprocess

    script = """
import resource, sys
from toktier.native import _engine as core
text = bytearray(b"abcd" * (16 << 20))
n, head, tail = len(text), bytes(text[:16]), bytes(text[-16:])
if sys.argv[1] == "capped":
    vm = int(next(l for l in open("/proc/self/status") if l.startswith("VmSize:")).split()[1]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (vm + (8 << 20), resource.RLIM_INFINITY))
core.reserve_text(text, n + 1)
assert len(text) == n and bytes(text[:16]) == head and bytes(text[-16:]) == tail
print(sys.getsizeof(text) - n)
"""
    room = {}
    for mode in ("capped", "free"):
        out = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        room[mode] = int(out.stdout.split()[-1])
    assert room["free"] >= 16 << 20  # the reservation works where memory allows
    assert room["capped"] < 1 << 20  # and without it nothing was reserved, nothing raised
