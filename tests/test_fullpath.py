"""Parallel chunked full path == one reference encode, on real and adversarial text."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adversarial import ATOMS
from conftest import ALL_TOKENIZERS, get_tokenizer
from toktier.tools.corpus import large_text, samples
from toktier.fullpath import FullPathConfig, chunk_cuts, encode_full

SMALL = FullPathConfig(chunk_chars=64, min_parallel_chars=0)


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
def test_chunked_equals_reference_on_real_text(name, tally):
    tok = get_tokenizer(name)
    for s in samples(max_chars_per_sample=30_000):
        assert np.array_equal(encode_full(tok, s.text, SMALL), tok.encode(s.text)), s.name
        tally(tok, "fullpath")
    big = large_text(400_000, seed=4, kind="mixed")
    cfg = FullPathConfig(chunk_chars=16_384, min_parallel_chars=0)
    assert len(chunk_cuts(tok, big, cfg.chunk_chars)) > 5
    assert np.array_equal(encode_full(tok, big, cfg), tok.encode(big))


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.lists(st.sampled_from(ATOMS), max_size=300).map("".join))
def test_chunked_equals_reference_on_adversarial_text(name, text, tally):
    tok = get_tokenizer(name)
    cfg = FullPathConfig(chunk_chars=8, min_parallel_chars=0)
    assert np.array_equal(encode_full(tok, text, cfg), tok.encode(text))
    tally(tok, "fullpath")


def test_unsupported_family_is_one_encode(tmp_path):
    import json

    import toktier

    cfg = json.loads(open(get_tokenizer("llama3").engine.path, encoding="utf-8").read())
    cfg["normalizer"] = {"type": "Lowercase"}
    p = tmp_path / "lower.json"
    p.write_text(json.dumps(cfg), encoding="utf-8")
    tok = toktier.load_tokenizer(p)
    assert tok.family is None and chunk_cuts(tok, "Hello world " * 100, 16) == []
    assert np.array_equal(encode_full(tok, "Hello World " * 100, SMALL), tok.encode("Hello World " * 100))
