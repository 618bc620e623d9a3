"""Verification core (`toktier.verifier`): fault injection, freshness, cache-free references, reports.

* The core catches every checked faulty result (all five fault kinds: ID
  substitution, deletion, duplication, adjacent swap, same-length tail re-split)
  and reports nothing on clean ones, in both freshness modes.
* Freshness: ``"batch"`` builds a new reference per check; ``"nocache"`` builds one
  private reference (at `prepare`) and rebuilds it every ``rebuild_every`` checks;
  a mismatch it reports is confirmed by a brand-new object first.
* The cache-free reference is built with public tokenizers API and returns the
  reference IDs (differential against ``tok.encode``, for every HF tokenizer).
* History: IDs from a long-lived engine after long (>= 4K chars) prefixes equal
  those of a fresh process, for every bundled tokenizer; so do the verifier's
  references, cache-free ones included.

The background side (sampling statistics, queue saturation, disable/re-enable,
metrics) is tested in ``tests/sidecar/test_sidecar_shadow.py``.
"""

from __future__ import annotations

import doctest
import json
import logging
import os
import random
import subprocess
import sys
import threading

import numpy as np
import pytest

import toktier.verifier
from conftest import ALL_TOKENIZERS, get_tokenizer
from toktier import list_tokenizers
from toktier.tools.corpus import large_text, samples
from toktier.tools.faults import KINDS, FaultInjector, FaultNotApplicable, corrupt
from toktier.verifier import (
    HFReference,
    MismatchReport,
    Served,
    Verifier,
    VerifierConfig,
    first_difference,
    fresh_reference,
)

SEED = int(os.environ.get("TOKTIER_TEST_SEED", "0"))
HF_TOKENIZERS = ("llama3", "qwen3", "deepseek_v4")


def _texts(n: int, seed: int) -> list[str]:
    """n real texts of 200-1500 chars from the multilingual corpus."""
    pool = [s.text for s in samples(max_chars_per_sample=20_000)]
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        t = rng.choice(pool)
        k = rng.randrange(200, 1500)
        a = rng.randrange(max(1, len(t) - k))
        out.append(t[a : a + k])
    return out


def test_doctests():
    result = doctest.testmod(toktier.verifier)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("name, fresh", [("cl100k_base", "batch"), ("llama3", "batch"), ("llama3", "nocache")])
def test_catches_every_checked_fault_and_no_false_positive(name, fresh, tally):
    """10% of 600 served results (30% of them faulty) are checked in batches of 32."""
    tok = get_tokenizer(name)
    inj = FaultInjector(rate=0.3, seed=SEED)
    pick = random.Random(SEED + 1)
    v = Verifier(VerifierConfig(fresh=fresh))
    checked: dict[int, tuple[str, str | None]] = {}
    batch: list[Served] = []
    reports: list[MismatchReport] = []
    for i, text in enumerate(_texts(600, SEED)):
        ids, kind = inj.maybe_corrupt(tok, text, tok.encode(text))
        if pick.random() < 0.1:
            checked[i] = (text, kind)
            batch.append(Served(text, ids, {"request": i}))
        if len(batch) == 32:
            reports += v.check(tok, batch)
            batch = []
    reports += v.check(tok, batch)
    faulty = {i for i, (_, kind) in checked.items() if kind}
    assert {r.context["request"] for r in reports} == faulty, f"seed={SEED}"
    assert len(reports) == len(faulty) > 0
    # every kind was injected, and the checked ones include more than one kind
    assert set(inj.injected) == set(KINDS), inj.injected
    assert len({checked[i][1] for i in faulty}) >= 3
    for r in reports:
        text = checked[r.context["request"]][0]
        assert r.text is None  # keep_text=False
        assert r.tokenizer_hash == tok.hash and r.text_chars == len(text)
        ref = tok.encode(text)
        assert r.reference_len == len(ref) and r.first_diff <= len(ref)
        assert list(r.reference_window) == ref[r.window_start : r.first_diff + 9].tolist()
    tally(tok, "shadow", len(checked))


@pytest.mark.parametrize("kind", KINDS)
def test_each_fault_kind_is_detected(kind, tally):
    tok = get_tokenizer("o200k_base")
    rng = random.Random(SEED)
    text = large_text(3000, seed=SEED, kind="mixed")
    ids = tok.encode(text)
    bad = corrupt(tok, text, ids, kind, rng)
    assert not np.array_equal(bad, ids)
    if kind == "resplit":  # the silent kind: same length, same bytes
        assert len(bad) == len(ids)
        assert b"".join(tok.token_bytes[i] for i in bad) == b"".join(tok.token_bytes[i] for i in ids)
    v = Verifier(VerifierConfig(fresh="nocache", keep_text=True))
    reports = v.check(tok, [Served(text, bad), Served(text, ids)])
    assert len(reports) == 1
    rep = reports[0]
    assert rep.text == text and rep.first_diff == first_difference(bad, ids)
    assert rep.served_len == len(bad) and rep.reference_len == len(ids)
    tally(tok, "shadow", 2)


def test_resplit_not_applicable_is_explicit():
    tok = get_tokenizer("cl100k_base")
    with pytest.raises(FaultNotApplicable):
        corrupt(tok, "This ", tok.encode("This "), "resplit", random.Random(0))
    with pytest.raises(FaultNotApplicable):
        corrupt(tok, "", tok.encode(""), "substitute", random.Random(0))


def test_report_json_is_a_reproducer():
    tok = get_tokenizer("cl100k_base")
    text = "hello world, hello again"
    ids = tok.encode(text)
    bad = np.concatenate([ids[:3], [7], ids[4:]]).astype(np.uint32)
    (rep,) = Verifier(VerifierConfig(report_window=2)).check(tok, [Served(text, bad, {"session": "s1"})])
    doc = json.loads(rep.to_json())
    assert doc["first_diff"] == 3 and doc["window_start"] == 1 and doc["context"] == {"session": "s1"}
    assert doc["served_window"] == bad[1:6].tolist() and doc["reference_window"] == ids[1:6].tolist()
    assert doc["text"] is None and len(doc["text_sha256"]) == 64
    assert doc["tokenizer_hash"] == tok.hash


def test_config_is_validated():
    with pytest.raises(ValueError):
        VerifierConfig(fresh="sometimes")
    with pytest.raises(ValueError):
        VerifierConfig(rebuild_every=0)
    with pytest.raises(ValueError):
        VerifierConfig(report_window=-1)


def test_empty_check_builds_nothing_and_reference_errors_propagate():
    tok = get_tokenizer("cl100k_base")
    built = []

    def broken(t):
        built.append(t)
        raise RuntimeError("reference exploded")

    v = Verifier(reference_factory=broken)
    assert v.check(tok, []) == [] and built == []
    with pytest.raises(RuntimeError, match="exploded"):
        v.check(tok, [Served("x", tok.encode("x"))])


def test_check_runs_on_a_thread_the_caller_owns():
    """The core starts no thread: checks run wherever they are called."""
    tok = get_tokenizer("cl100k_base")
    before = set(threading.enumerate())
    v = Verifier(VerifierConfig(fresh="nocache"))
    v.prepare(tok)
    assert v.check(tok, [Served("x", [1])])[0].first_diff == 0
    assert set(threading.enumerate()) == before


# -- freshness --------------------------------------------------------------------------------


def test_verifier_uses_a_new_reference_per_check(monkeypatch):
    tok = get_tokenizer("cl100k_base")
    made = []
    original = toktier.verifier.fresh_reference

    def recording(t, **kw):
        ref = original(t, **kw)
        made.append(ref)
        return ref

    monkeypatch.setattr(toktier.verifier, "fresh_reference", recording)
    v = Verifier()  # default fresh="batch"
    for i in range(3):
        assert v.check(tok, [Served(f"batch {i}", tok.encode(f"batch {i}"))]) == []
    assert len(made) == 3 and len({id(r) for r in made}) == 3
    assert all(r is not tok.engine for r in made)


@pytest.mark.parametrize("rebuild_every, same_after_3", [(None, True), (2, False)])
def test_prepare_builds_the_private_reference_once(rebuild_every, same_after_3):
    """`prepare` builds the nocache reference up front (a GIL-holding build kept out of
    traffic); checks reuse it, rebuilding only every `rebuild_every` checks."""
    tok = get_tokenizer("llama3")
    v = Verifier(VerifierConfig(fresh="nocache", rebuild_every=rebuild_every))
    assert v.private_reference(tok.hash) is None
    v.prepare(tok)
    ref = v.private_reference(tok.hash)
    assert ref is not None and ref.history_free
    v.prepare(tok)
    assert v.private_reference(tok.hash) is ref  # idempotent
    for text in ("one", "two", "three"):  # one check each
        assert v.check(tok, [Served(text, tok.encode(text))]) == []
    assert (v.private_reference(tok.hash) is ref) == same_after_3


def test_batch_mode_prepares_nothing():
    tok = get_tokenizer("cl100k_base")
    v = Verifier()
    v.prepare(tok)
    assert v.private_reference(tok.hash) is None


class _Drifted:
    """A private reference gone wrong (the DESIGN §7 symptom): every ID off by one."""

    history_free = True

    def __init__(self, real):
        self.real = real

    def encode_batch(self, texts):
        return [ids + 1 for ids in self.real.encode_batch(texts)]


def test_nocache_mismatch_is_confirmed_by_a_brand_new_reference(monkeypatch, caplog):
    tok = get_tokenizer("cl100k_base")
    original = toktier.verifier.fresh_reference

    def drifting_private(t, *, cache=True, **kw):
        ref = original(t, cache=cache, **kw)
        return ref if cache else _Drifted(ref)

    monkeypatch.setattr(toktier.verifier, "fresh_reference", drifting_private)
    v = Verifier(VerifierConfig(fresh="nocache", rebuild_every=None))
    v.prepare(tok)
    drifted = v.private_reference(tok.hash)
    assert isinstance(drifted, _Drifted)
    good = Served("hello world", tok.encode("hello world"))
    with caplog.at_level(logging.WARNING, logger="toktier.verifier"):
        assert v.check(tok, [good]) == []  # the private one disagreed; a new one did not
    assert "disagreed" in caplog.text
    assert v.private_reference(tok.hash) is None  # dropped: the next check builds a new one
    v.prepare(tok)
    (rep,) = v.check(tok, [good, Served("hello world", [1, 2])])  # a real mismatch is confirmed
    assert rep.served_window == (1, 2)


def test_a_model_without_a_public_cache_switch_gets_a_new_reference_per_check(monkeypatch):
    tok = get_tokenizer("cl100k_base")
    original = toktier.verifier.fresh_reference
    made = []

    class Cached:  # e.g. an HF Unigram model: its cache cannot be switched off publicly
        history_free = False

        def __init__(self, ref):
            self.ref = ref

        def encode_batch(self, texts):
            return self.ref.encode_batch(texts)

    def recording(t, **kw):
        made.append(Cached(original(t, **kw)))
        return made[-1]

    monkeypatch.setattr(toktier.verifier, "fresh_reference", recording)
    v = Verifier(VerifierConfig(fresh="nocache", rebuild_every=None))
    v.prepare(tok)
    assert len(made) == 1
    for i in range(2):
        assert v.check(tok, [Served(f"x{i}", tok.encode(f"x{i}"))]) == []
    assert len(made) == 3 and len({id(r) for r in made}) == 3


# -- the cache-free reference -------------------------------------------------------------------


@pytest.mark.parametrize("specials", ["all", "none"])
@pytest.mark.parametrize("name", HF_TOKENIZERS)
def test_cache_free_reference_returns_the_reference_ids(name, specials, tally):
    """Differential: the BPE model rebuilt with ``cache_capacity=0`` (public constructor)
    encodes exactly as ``tok.encode``, texts with repeated words (the cache's hits) and
    special-token literals included."""
    tok = get_tokenizer(name, specials)
    ref = fresh_reference(tok, cache=False)
    assert isinstance(ref, HFReference) and ref.history_free
    specials_text = "".join(lit.content for lit in tok.engine.literals[:20])
    texts = _texts(40, SEED + 3) + [
        large_text(30_000, seed=SEED, kind="mixed"),
        large_text(10_000, seed=SEED, kind="code"),
        ("repeat repeat repeat " * 200) + specials_text + " <|endoftext|><|begin_of_text|>",
        "",
    ]
    for _ in range(2):  # the second pass would hit a word cache, if there were one
        got = ref.encode_batch(texts)
        for text, ids in zip(texts, got):
            assert np.array_equal(ids, tok.encode(text)), (name, specials, text[:80])
    tally(tok, "shadow", 2 * len(texts))


def test_tiktoken_references_are_history_free():
    tok = get_tokenizer("o200k_base")
    ref = fresh_reference(tok, cache=False)
    assert ref.history_free
    assert np.array_equal(ref.encode_batch(["hi there"])[0], tok.encode("hi there"))


def test_non_bpe_hf_model_falls_back_to_per_check_references():
    """A WordLevel tokenizer.json: no BPE cache to switch off, so `history_free` stays False."""
    source = json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
        "normalizer": None, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "hello": 1, "world": 2}, "unk_token": "[UNK]"},
    })
    ref = HFReference(source, specials_as_text=False, cache=False)
    assert ref.history_free is False
    assert ref.encode_batch(["hello world there"])[0].tolist() == [1, 2, 0]


def test_reference_ignores_the_files_truncation():
    """A tokenizer.json that asks for truncation: the reference, like the engine, never cuts."""
    tok = get_tokenizer("llama3")
    with open(tok.engine.path, encoding="utf-8") as f:
        doc = json.load(f)
    doc["truncation"] = {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}
    ref = HFReference(json.dumps(doc), specials_as_text=False, cache=False)
    text = "one two three four five six seven"
    assert ref.history_free
    assert np.array_equal(ref.encode_batch([text])[0], tok.encode(text))


# -- history: long-lived engine vs a fresh process ------------------------------------------

_FRESH_PROCESS = """
import json, sys, toktier
job = json.load(sys.stdin)
out = {}
for name, probes in job.items():
    tok = toktier.load_tokenizer(name)
    out[name] = [tok.encode(p).tolist() for p in probes]
json.dump(out, sys.stdout)
"""


def test_history_long_prefixes_match_a_fresh_process(tally):
    """Encode probes after long (>= 4K chars) prefixes on one long-lived engine; a fresh
    process (no history) must give identical IDs, for every bundled tokenizer.  So must
    the verifier's references, the cache-free ones after the same long prefixes too."""
    toks = {}
    for name in sorted(set(ALL_TOKENIZERS) | set(list_tokenizers())):
        try:
            toks[name] = get_tokenizer(name)
        except pytest.skip.Exception:
            continue
    # one text per kind (a new seed would rebuild the generated pools: slow), sliced many ways
    mixed = large_text(160_000, seed=SEED, kind="mixed")
    code = large_text(60_000, seed=SEED, kind="code")
    probes = [mixed[i * 9000 : i * 9000 + 6000] for i in range(3)] + [code[:6000]]
    probes += [p[: 4096 + 37 * i] for i, p in enumerate(probes)] + ["hello world", " 12345\r\n<|endoftext|>"]
    live: dict[str, list[list[int]]] = {}
    for name, tok in toks.items():
        engine = tok.engine  # long-lived: it has served every earlier test in this process
        private = fresh_reference(tok, cache=False)  # long-lived too, as the sidecar keeps it
        got, got_private = [], []
        for i, p in enumerate(probes):
            for enc in (engine.encode, lambda t: private.encode_batch([t])[0]):
                enc(mixed[40_000 + 8000 * i : 48_000 + 8000 * i])  # a long prefix first
                enc(p + code[6000 + 5000 * i : 11_000 + 5000 * i])  # and a long overlap
            got.append(engine.encode(p).tolist())
            got_private.append(private.encode_batch([p])[0].tolist())
        live[name] = got
        assert got_private == got, name
        a = fresh_reference(tok)  # a new object per batch agrees too
        assert a is not tok.engine
        assert [x.tolist() for x in a.encode_batch(probes)] == got
    proc = subprocess.run([sys.executable, "-c", _FRESH_PROCESS], input=json.dumps({n: probes for n in toks}),
                          capture_output=True, text=True, timeout=300, check=True)
    fresh = json.loads(proc.stdout)
    for name, tok in toks.items():
        assert fresh[name] == live[name], f"{name}: a long-lived engine's IDs differ from a fresh process"
        tally(tok, "history", len(probes))
