"""GPU host models (regex-free pre-tokenizer, round-parallel BPE) against the references.

Piece level: every piece boundary of every literal-free segment equals the
reference pre-tokenizer's (HF engines expose theirs; the tiktoken-form patterns
are run through the ``regex`` module with a class table probed from ``regex``,
see ``gpu_refs.py``).  ID level: the host models' IDs equal the reference encode
(tiktoken and HF, production class tables probed from each engine), and the
spans tile the text.  Real multilingual text from ``toktier.tools.corpus`` and
adversarial text from ``adversarial.py``.
"""

from __future__ import annotations

import doctest

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adversarial import ATOMS
from conftest import ALL_TOKENIZERS, HF_TOKENIZERS, get_tokenizer
from gpu_refs import regex_pieces, regex_table
from toktier.tools.corpus import chat_wrap, large_text, samples
from toktier.charclass import FOLD_SHIFT, LO, UP
from toktier.families import FAMILIES, GpuRules
from toktier.families.o200k import O200K
from toktier.gpu import bpe_model, pretok_model, router, tables
from toktier.gpu.pretok_model import segment_pieces, split_literals
from toktier.fullpath import FullPath

# Rule sets modelling one regex (all but DeepSeek's three stages), from the family modules.
REGEX_RULES = {str(rules): splits[0] for spec in FAMILIES.values() for splits, rules in spec.splits.items()
               if len(splits) == 1}

# Atoms that sit on the o200k/cl100k rules beyond ATOMS: marks, Lm/Lo/Lt letters, slashes, contractions.
EXTRA = ["'", "'s", "'re", "'LL", "ſ", "/", "//", "\u0301", "\u0300", "ǅ", "ʰ", "あ", "ー", "・", "A", "a", "\n",
         "\r", " ", "  ", ".", "..", "\t", "\u200d", "中", "Ab", "aB", "\u3000", "\x00", "1", "゛"]
adv = st.lists(st.sampled_from(ATOMS + EXTRA * 2), max_size=80).map("".join)
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _corpus(n_chars: int = 12_000) -> list[tuple[str, str]]:
    return [(s.name, s.text[:n_chars]) for s in samples(max_chars_per_sample=n_chars)]


def _nfc_ok(tok, text: str) -> bool:
    return not tok.family_info.nfc or tok.engine.normalize(text) == text


def _stable(tok, text: str) -> str:
    """NFC families: the NFC form (which NFC leaves unchanged: what the GPU route accepts)."""
    return tok.engine.normalize(text) if tok.family_info.nfc else text


def check_hf_pieces(tok, text: str, tally) -> None:
    tbl, rules = tables.class_table(tok), tables.rules_for(tok)
    n = 0
    for a, b, lit in split_literals(tok, text):
        if lit is not None:
            continue
        seg = text[a:b]
        ref = [o for _, o in tok.engine.pre_tokenize(seg)]
        got = segment_pieces(seg, tbl, rules)
        if ref != got:
            k = next(i for i, (x, y) in enumerate(zip(ref + [None], got + [None])) if x != y)
            ctx = ref[max(0, k - 1):k + 2]
            raise AssertionError(f"{tok.name}: piece {k} differs near {[seg[x:y] for x, y in ctx]}: "
                                 f"ref {ref[k:k + 2]} got {got[k:k + 2]} in {seg[:200]!r}")
        n += len(ref)
    tally(tok, "pieces", n)


def check_ids(tok, text: str, tally) -> None:
    ids, spans = bpe_model.encode_with_spans(tok, text)
    ref = tok.encode(text)
    assert np.array_equal(ids, ref), f"{tok.name}: ids differ for {text[:200]!r}"
    raw = text.encode("utf-8")
    assert b"".join(tok.token_bytes[i] for i in ids.tolist()) == raw
    lens = tok.token_len[ids].astype(np.int64)
    assert np.array_equal(spans, np.concatenate(([0], np.cumsum(lens)[:-1])) if len(ids) else spans)
    tally(tok, "ids", len(ids))


# -- piece level ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", HF_TOKENIZERS)
def test_pieces_equal_hf_pre_tokenizer_on_real_text(name, tally):
    tok = get_tokenizer(name)
    for sname, text in _corpus():
        check_hf_pieces(tok, _stable(tok, text), tally)


@pytest.mark.parametrize("name", HF_TOKENIZERS)
@SETTINGS
@given(text=adv)
def test_pieces_equal_hf_pre_tokenizer_on_adversarial_text(name, text, tally):
    tok = get_tokenizer(name)
    if _nfc_ok(tok, text):
        check_hf_pieces(tok, text, tally)


@pytest.mark.parametrize("rules", sorted(REGEX_RULES))
def test_pieces_equal_regex_on_real_text(rules):
    tbl = regex_table()
    for sname, text in _corpus():
        assert segment_pieces(text, tbl, rules) == regex_pieces(REGEX_RULES[rules], text), sname


@pytest.mark.parametrize("rules", sorted(REGEX_RULES))
@SETTINGS
@given(text=adv)
def test_pieces_equal_regex_on_adversarial_text(rules, text):
    assert segment_pieces(text, regex_table(), rules) == regex_pieces(REGEX_RULES[rules], text)


@pytest.mark.parametrize("text, pieces", [
    ("HTTPServer camelCase", ["HTTPServer", " camel", "Case"]),
    ("ABCあDEF", ["ABCあ", "DEF"]),
    ("it's's's", ["it's", "'s's"]),
    ("a.\n/b", ["a", ".\n/", "b"]),
    ("..\u0301a", ["..\u0301", "a"]),
    (" \u0301ABC", [" \u0301", "ABC"]),
])
def test_o200k_rules_examples(text, pieces):
    got = segment_pieces(text, regex_table(), GpuRules.O200K)
    assert [text[a:b] for a, b in got] == pieces
    assert got == regex_pieces(O200K, text)


def test_tiktoken_form_differs_at_trailing_whitespace():
    text = "x \n  "
    hf = segment_pieces(text, regex_table(), GpuRules.CL100K_HF)
    tt = segment_pieces(text, regex_table(), GpuRules.CL100K_TT)
    assert [text[a:b] for a, b in hf] == ["x", " \n", "  "]
    assert [text[a:b] for a, b in tt] == ["x", " \n  "]


# -- ID level ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ALL_TOKENIZERS)
def test_ids_equal_reference_on_real_text(name, tally):
    tok = get_tokenizer(name)
    for sname, text in _corpus():
        check_ids(tok, _stable(tok, text), tally)
    check_ids(tok, _stable(tok, large_text(60_000, seed=3, kind="multilingual")), tally)


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
@SETTINGS
@given(text=adv)
def test_ids_equal_reference_on_adversarial_text(name, text, tally):
    tok = get_tokenizer(name)
    if _nfc_ok(tok, text):
        check_ids(tok, text, tally)


@pytest.mark.parametrize("name, fam", [("llama3", "llama3"), ("deepseek_v4", "deepseek"), ("qwen3", "chatml"),
                                       ("cl100k_base", "chatml")])
def test_literals_split_first(name, fam, tally):
    tok = get_tokenizer(name)
    turns = [("system", "You are helpful."), ("user", "Hi 12345 <|im_start|> 'tis  \n\n"),
             ("assistant", "héllo wörld 中文")]
    text = chat_wrap(turns, fam, add_generation_prompt=True) + "<|endoftext|>"
    check_ids(tok, text, tally)


@pytest.mark.parametrize("name", ["cl100k_base", "llama3"])
def test_specials_as_plain_text(name, tally):
    tok = get_tokenizer(name, specials="none")
    check_ids(tok, "a<|endoftext|>b<|eot_id|>c", tally)


# -- tables --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["cl100k_base", "llama3"])
def test_hash_tables_find_every_entry(name):
    tok = get_tokenizer(name)
    t = tables.bpe_tables(tok)
    used = np.flatnonzero(t.pair_keys != tables.EMPTY64)
    assert len(used) * 2 <= len(t.pair_keys)
    keys = t.pair_keys[used]
    assert np.array_equal(tables.hash_lookup(t.pair_keys, t.pair_bits, keys), used)
    missing = tables.hash_lookup(t.pair_keys, t.pair_bits, keys ^ np.uint64(1 << 63))
    assert (missing == -1).all()
    ids = np.arange(0, 5000, dtype=np.int64)
    offs = t.tok_off.astype(np.int64)
    got = bpe_model.vocab_lookup(t, t.tok_blob, offs[ids], offs[ids + 1] - offs[ids])
    assert np.array_equal(got, ids)


def test_class_table_layout():
    tok = get_tokenizer("o200k_base")
    tbl = tables.class_table(tok)
    assert tbl.dtype == np.uint32 and tbl.shape == (0x110000,)
    assert (tbl[ord("A")] & UP) and not (tbl[ord("A")] & LO)
    assert (tbl[ord("あ")] & UP) and (tbl[ord("あ")] & LO)
    assert (tbl[ord("ſ")] >> FOLD_SHIFT) & 0xFF == ord("s")
    assert np.array_equal(tbl & 0x0F, tok.classes & 0x0F)


def test_one_probe_one_cache_adds_missing_bits(tmp_path, monkeypatch):
    """The splice path probes its bits; the GPU's are added to the same cached table later, once."""
    from toktier import charclass as C

    monkeypatch.setenv("TOKTIER_CACHE_DIR", str(tmp_path))
    calls: list[str] = []

    def mask(pattern):
        return np.arange(0x110000) % (len(pattern) + 1) == 0

    class Prober:
        def probe_class(self, pattern):
            calls.append(pattern)
            return mask(pattern)

    nfc = np.arange(0x110000) % 7 == 0
    host = C.probe_classes(Prober(), {C.L: r"\p{L}", C.W: r"\s"}, "tok", {C.HOST_I: lambda: nfc})
    assert calls == [r"\p{L}", r"\s"] and host.dtype == np.uint8
    assert np.array_equal((host & C.HOST_I) != 0, nfc) and np.array_equal((host & C.L) != 0, mask(r"\p{L}"))
    full = C.class_table(Prober(), "tok", {C.L: r"\p{L}", C.W: r"\s", C.UP: "[up]"}, folds=True)
    assert calls[2:] == ["[up]"] + [f"(?i:{c})" for c in C.CONTRACTION_LETTERS]  # only the missing bits
    assert np.array_equal((full & C.NFC_INERT) != 0, nfc) and np.array_equal((full & C.UP) != 0, mask("[up]"))
    del calls[:]
    again = C.probe_classes(Prober(), {C.L: r"\p{L}", C.W: r"\s"}, "tok", {C.HOST_I: lambda: nfc})
    assert calls == [] and np.array_equal(again, host)
    assert [p.name for p in tmp_path.iterdir()] == ["classes"]
    assert [p.name for p in (tmp_path / "classes").iterdir()] == [f"tok-{C.TABLE_VERSION}.npz"]


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
def test_one_class_table_serves_predicate_and_gpu(name):
    """The GPU table extends the predicate's (same probe, same cache): its host view is tok.classes."""
    from toktier.charclass import HOST_I, K, L, M, N, W, host_view

    tok = get_tokenizer(name)
    tbl = tables.class_table(tok)
    want = L | N | M | W | (K if tok.family_info.exclude_k_pairs else 0) | (HOST_I if tok.family_info.nfc else 0)
    assert np.array_equal(host_view(tbl, want), tok.classes)
    if tok.family_info.exclude_k_pairs:  # (other families never read K; one engine's files share the table)
        assert tbl[ord("中")] & K and not tbl[ord("a")] & K


@pytest.mark.parametrize("name, rules", [("cl100k_base", GpuRules.CL100K_TT), ("o200k_base", GpuRules.O200K),
                                         ("llama3", GpuRules.CL100K_HF), ("deepseek_v4", GpuRules.DEEPSEEK),
                                         ("qwen3", GpuRules.QWEN)])
def test_rule_ids_come_from_the_family_modules(name, rules):
    assert sorted(REGEX_RULES) == ["cl100k_hf", "cl100k_tt", "o200k", "qwen"]
    assert pretok_model.supported_rules() == ("cl100k_hf", "cl100k_tt", "qwen", "o200k", "deepseek")
    assert tables.rules_for(get_tokenizer(name)) is rules


# -- router (no GPU here: CPU, same output) ------------------------------------------------

def test_router_routes_and_keeps_contract():
    tok = get_tokenizer("cl100k_base")
    r = router.Router()
    text = large_text(5000, seed=1)
    assert np.array_equal(FullPath(gpu=r).encode(tok, text), tok.encode(text))
    assert router.gpu_eligible(tok, "short")[1] == "small"
    assert router.gpu_eligible(tok, text)[0]

    class FakeDriver:  # the router's only dependency on a driver: encode(str or its UTF-8) -> (ids, spans)
        def encode(self, tok, text, *, with_spans=True, literals=None):
            ids, spans = bpe_model.encode_with_spans(tok, text if isinstance(text, str) else text.decode("utf-8"))
            return ids, (spans if with_spans else None)

    r2 = router.Router(driver=FakeDriver())
    assert np.array_equal(FullPath(gpu=r2).encode(tok, text), tok.encode(text)) and r2.last_route == "gpu"
    assert np.array_equal(FullPath(gpu=r2).encode(tok, "tiny"), tok.encode("tiny")) and r2.last_route == "cpu"


def test_router_nfc_quick_check():
    tok = get_tokenizer("qwen3")
    assert not router.gpu_eligible(tok, "e\u0301" * 3000)[0]
    assert router.gpu_eligible(tok, "é" * 3000)[0]


def test_doctests():
    import toktier.gpu as g

    for mod in (g, router, pretok_model):
        res = doctest.testmod(mod)
        assert res.failed == 0 and res.attempted > 0


@pytest.mark.parametrize("name", ["deepseek_v4", "qwen3", "llama3", "cl100k_base"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_literal_soup(name, data, tally):
    """Overlapping literals and fragments: special / non-special, normalized=True literals in the gaps."""
    tok = get_tokenizer(name)
    lits = sorted({lit.content for lit in tok.engine.literals})
    frags = [s[: len(s) // 2] for s in lits[:40]] + [s[len(s) // 2:] for s in lits[:40]] + ["x", " ", "<", "｜", "\n"]
    parts = data.draw(st.lists(st.sampled_from(lits[:60] + lits[-60:] + frags), max_size=25))
    text = "".join(parts)
    if _nfc_ok(tok, text):
        check_ids(tok, text, tally)


@pytest.mark.parametrize("name", ALL_TOKENIZERS + ("o200k_harmony",))
@SETTINGS
@given(data=st.data())
def test_native_literal_bytes_equal_the_driver_scan(name, data, tally):
    """The router hands the driver the native engine's literals (`NativeEngine.literal_bytes`): the
    same (UTF-8 start, end, id) triples as the driver's own scan of the bytes (`LiteralFinder`)."""
    tok = get_tokenizer(name)
    if tok.native is None:
        pytest.skip(f"no native engine: {tok.explain()}")
    lits = sorted({lit.content for lit in tok.engine.literals if lit.content})
    frags = [s[: len(s) // 2] for s in lits[:40]] + [s[len(s) // 2:] for s in lits[:40]]
    parts = data.draw(st.lists(st.sampled_from(lits[:60] + lits[-60:] + frags + ["x", " ", "<", "｜", "\n", "é", "中",
                                                                                  "😀", "\u0301"]), max_size=40))
    text = "".join(parts)
    finder = pretok_model.literal_finder(tok)
    want = finder.find(text.encode("utf-8")) if finder is not None else []
    got = tok.native.literal_bytes(text)
    assert [tuple(t) for t in zip(*(a.tolist() for a in got))] == [tuple(w) for w in want], repr(text)
    tally(tok, "literals", len(want))


def test_tables_refuse_a_rank_with_two_merged_tokens():
    """The kernels carry one merged id per round; a table breaking that must not reach them."""
    from toktier.errors import UnsupportedTokenizer
    from toktier.gpu.tables import _check_one_merge_per_rank

    rank = np.array([3, 1, 1, 2], dtype=np.uint32)
    _check_one_merge_per_rank(rank, np.array([9, 7, 7, 8], dtype=np.uint32))  # tiktoken shape: same id
    with pytest.raises(UnsupportedTokenizer, match="merge rank 1 yields two tokens"):
        _check_one_merge_per_rank(rank, np.array([9, 7, 6, 8], dtype=np.uint32))
