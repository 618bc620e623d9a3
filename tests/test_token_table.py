"""The token table comes from the engine: ids, spans, uncertain ids, and the load-time cross-check."""

from __future__ import annotations

import doctest
import json

import numpy as np
import pytest

import toktier
from toktier import bundled, registry, token_table
from toktier.token_table import TokenTable, cross_check

from crafted import VARIANTS, declared_id_table


def _variant(name: str):
    return next(v for v in VARIANTS if v.name == name)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    made: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in made:
            made[name] = _variant(name).build(tmp_path_factory.mktemp(name))
        return made[name]
    return get


def test_doctests():
    for mod in (token_table, registry):
        res = doctest.testmod(mod)
        assert res.failed == 0 and res.attempted > 0, mod.__name__


def test_issue_reproducer_gives_reference_lengths(files):
    """The reproducer of issue 11: a literal inserted at the start of a spliceable session."""
    from tokenizers import Tokenizer

    for name, body, lit in [("gap-id", " people" * 80, "<|gap|>"), ("vocab-word-special", " this" * 80, "hello")]:
        path = files(name)["name_or_path"]
        tok, ref = toktier.load_tokenizer(path), Tokenizer.from_file(str(path))
        r = toktier.Session(tok, body).edit(0, 0, lit)
        want = ref.encode(lit + body, add_special_tokens=False).ids
        assert r.path is toktier.RepairPath.FIRST_WINDOW and r.ids.tolist() == want
    tok = toktier.load_tokenizer(files("byte-char-plain")["name_or_path"])
    s = toktier.Session(tok, " the" * 64 + " e")
    s.edit(257, 257, "\x01")  # once an IndexError in the run search
    assert np.array_equal(s.ids, Tokenizer.from_file(str(files("byte-char-plain")["name_or_path"])).encode(
        s.text, add_special_tokens=False).ids)


def test_added_token_ids_are_the_engines(files):
    from tokenizers import Tokenizer

    for name in ("gap-id", "reversed-list", "shuffled-list", "id-override", "same-declared-id", "duplicate-entry",
                 "vocab-word-plain"):
        path = files(name)["name_or_path"]
        tok, ref = toktier.load_tokenizer(path), Tokenizer.from_file(str(path))
        declared = {t["content"]: t["id"] for t in json.loads(open(path, encoding="utf-8").read())["added_tokens"]}
        for content in declared:
            i = ref.token_to_id(content)
            assert tok.table.literal_ids[content] == i, (name, content)
            assert content.encode() in (tok.table.token_bytes[i], *tok.table.alternatives.get(i, ()))
        assert any(tok.table.literal_ids[c] != i for c, i in declared.items()), f"{name}: declared ids all held"


def test_ambiguous_ids_are_uncertain_with_every_spelling(files):
    tok = toktier.load_tokenizer(files("byte-char-plain")["name_or_path"])
    i = tok.table.literal_ids["\u0120"]
    assert tok.table.uncertain[i] and set(tok.table.alternatives[i]) == {b" ", "\u0120".encode()}
    assert tok.table.token_bytes[i] == b" "  # the shortest spelling: what ordinary text holds
    tok = toktier.load_tokenizer(**files("tt-shared-id"))
    assert set(tok.table.alternatives[100300]) == {b"<|p|>", b"<|q|>"}
    tok = toktier.load_tokenizer(files("unk-missing-byte")["name_or_path"])
    assert not tok.spliceable and "0x01" in tok.family_reason and "'<unk>'" in tok.family_reason


def test_canonical_spans_are_walked_not_summed():
    t = TokenTable.build({0: b"a", 1: [b"b", b"zz"], 2: b"c", 3: [b"x", b"xy"], 4: b"y", 5: [b"d", b"e"]},
                         literal_ids={}, problems=())
    assert t.uncertain_ids().tolist() == [1, 3, 5]
    assert t.canonical_spans_ok(np.array([0, 1, 2], dtype=np.uint32), b"abc")
    assert not t.canonical_spans_ok(np.array([0, 1, 2], dtype=np.uint32), b"azzc")  # the other spelling
    assert not t.canonical_spans_ok(np.array([0, 5, 2], dtype=np.uint32), b"aec")  # lengths sum, bytes differ
    # Id 3 as "x" then "y", or as "xy": both spellings fit where it starts, so the walk refuses to guess.
    assert not t.canonical_spans_ok(np.array([3, 4], dtype=np.uint32), b"xy")
    assert t.spans_consistent(np.array([3], dtype=np.uint32), b"xy")  # (consistent, just not canonical)
    assert not t.spans_consistent(np.array([0, 2], dtype=np.uint32), b"abc")


def test_cross_check_catches_a_declared_id_table(files):
    tok = toktier.load_tokenizer(files("gap-id")["name_or_path"])
    assert cross_check(tok.table, tok.engine.encode_batch, [lit.content for lit in tok.engine.literals]) == []
    bad = declared_id_table(files("gap-id")["name_or_path"])
    problems = cross_check(bad, tok.engine.encode_batch, [lit.content for lit in tok.engine.literals])
    assert problems and "<|gap|>" in problems[0]


def test_engine_failures_are_typed(files, monkeypatch):
    tok = toktier.load_tokenizer("cl100k_base", engine="reference")  # the reference's own failures

    class Panic(BaseException):  # what pyo3 raises for a Rust panic
        pass

    Panic.__name__ = "PanicException"

    def boom(*a, **k):
        raise Panic("no entry found for key")

    monkeypatch.setattr(tok.engine._enc, "encode_to_numpy", boom)
    with pytest.raises(toktier.ReferenceEngineError, match="no entry found"):
        tok.encode("hello")
    with pytest.raises(toktier.ReferenceEngineError):
        toktier.Session(tok, "hello")


def test_unknown_json_shapes_are_refused_or_served(tmp_path):
    src = bundled.BUNDLED["llama3"].path()
    j = json.loads(src.read_text(encoding="utf-8"))
    j["model"]["merges"] = j["model"]["merges"][:10] + [["no-such", "symbol"]]
    p = tmp_path / "tokenizer.json"
    p.write_text(json.dumps(j), encoding="utf-8")
    with pytest.raises(toktier.UnsupportedTokenizer, match="not a loadable tokenizer.json"):
        toktier.load_tokenizer(p)


def test_unknown_ids_are_never_proven_by_a_walk():
    t = TokenTable.build({0: b"a", 1: b"<unk>"}, literal_ids={}, problems=(), unknown=[1])
    assert t.uncertain[1] and not t.canonical_spans_ok(np.array([0, 1], dtype=np.uint32), b"a<unk>")
    assert t.canonical_spans_ok(np.array([0, 0], dtype=np.uint32), b"aa")
