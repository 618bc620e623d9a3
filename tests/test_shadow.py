"""Shadow verifier: fault injection, sampling statistics, saturation, and the history check.

* At 10% sampling the verifier catches every sampled faulty result (all five fault
  kinds) and reports nothing on clean ones.
* Over many faulty requests the detected fraction and the mean gap between
  detections match the sampling rate (binomial / geometric tolerance).
* A saturated verifier (worker held on an Event the test controls) drops and
  counts samples while `offer` keeps returning and serving continues.
* History: IDs from a long-lived engine after long (>= 4K chars) prefixes equal
  those of a fresh process, for every bundled tokenizer; the verifier's
  reference is a new object per batch.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import threading

import numpy as np
import pytest

from conftest import ALL_TOKENIZERS, get_tokenizer
from toktier import Session, list_tokenizers
from toktier.corpus import large_text, samples
from toktier.faults import KINDS, FaultInjector, FaultNotApplicable, corrupt
from toktier.shadow import ShadowVerifier, first_difference

SEED = int(os.environ.get("TOKTIER_TEST_SEED", "0"))


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


@pytest.mark.parametrize("name", ["cl100k_base", "llama3"])
def test_catches_every_sampled_fault_and_no_false_positive(name, tally):
    tok = get_tokenizer(name)
    inj = FaultInjector(rate=0.3, seed=SEED)
    served: dict[int, tuple[str, str | None]] = {}
    reports = []
    with ShadowVerifier({tok.hash: tok}, rate=0.1, seed=SEED + 1, queue_size=10_000,
                        on_mismatch=reports.append) as v:
        for i, text in enumerate(_texts(600, SEED)):
            ids, kind = inj.maybe_corrupt(tok, text, tok.encode(text))
            if v.offer(tok.hash, text, ids, context={"request": i}):
                served[i] = (text, kind)
        assert v.drain(timeout=120)
        st = v.stats
    faulty = {i for i, (_, kind) in served.items() if kind}
    assert st.checked == len(served) and st.dropped == 0 and st.errors == 0
    assert {r.context["request"] for r in reports} == faulty, f"seed={SEED}"
    assert st.mismatches == len(faulty) > 0
    # every kind was injected, and the sampled ones include more than one kind
    assert set(inj.injected) == set(KINDS), inj.injected
    assert len({served[i][1] for i in faulty}) >= 3
    for r in reports:
        text = served[r.context["request"]][0]
        assert r.text is None  # keep_text=False
        ref = tok.encode(text)
        assert r.reference_len == len(ref) and r.first_diff <= len(ref)
        assert list(r.reference_window) == ref[r.window_start : r.first_diff + 9].tolist()
    tally(tok, "shadow", st.checked)


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
    with ShadowVerifier({tok.hash: tok}, rate=1.0, keep_text=True, fresh="nocache") as v:
        assert v.offer(tok.hash, text, bad)
        assert v.offer(tok.hash, text, ids)
        assert v.drain(timeout=60)
        assert v.stats.mismatches == 1 and v.stats.checked == 2
        rep = v.reports[0]
    assert rep.text == text and rep.first_diff == first_difference(bad, ids)
    tally(tok, "shadow", 2)


def test_resplit_not_applicable_is_explicit():
    tok = get_tokenizer("cl100k_base")
    with pytest.raises(FaultNotApplicable):
        corrupt(tok, "This ", tok.encode("This "), "resplit", random.Random(0))
    with pytest.raises(FaultNotApplicable):
        corrupt(tok, "", tok.encode(""), "substitute", random.Random(0))


def test_detection_rate_matches_sampling_rate():
    """Detected faulty requests ~ Binomial(n, rate); gaps between detections ~ Geometric(rate)."""
    tok = get_tokenizer("cl100k_base")
    rate, n = 0.1, 2000
    inj = FaultInjector(rate=1.0, seed=SEED, kinds=("substitute", "delete", "duplicate", "swap"))
    words = ["alpha ", "beta ", "gamma ", "delta ", "42 ", "x\n"]
    rng = random.Random(SEED)
    detected = []
    with ShadowVerifier({tok.hash: tok}, rate=rate, seed=SEED + 7, queue_size=n) as v:
        v.on_mismatch = lambda r: detected.append(r.context["request"])
        for i in range(n):
            text = "".join(rng.choice(words) for _ in range(8))
            bad, _ = inj.maybe_corrupt(tok, text, tok.encode(text))
            v.offer(tok.hash, text, bad, context={"request": i})
        assert v.drain(timeout=120)
        assert v.stats.mismatches == v.stats.checked == v.stats.sampled == len(detected)
    k = len(detected)
    sd = math.sqrt(n * rate * (1 - rate))
    assert abs(k - n * rate) <= 5 * sd, (k, n * rate, sd)
    first = sorted(detected)
    gaps = np.diff([-1, *first])
    # mean gap of a geometric(rate) is 1/rate; its sd is sqrt(1-rate)/rate per gap
    mean_sd = math.sqrt(1 - rate) / rate / math.sqrt(len(gaps))
    assert abs(gaps.mean() - 1 / rate) <= 5 * mean_sd, (gaps.mean(), 1 / rate)


class _Blocking:
    """A reference whose encode waits on an Event the test controls."""

    def __init__(self, tok, entered: threading.Event, release: threading.Event) -> None:
        self.tok, self.entered, self.release = tok, entered, release

    def encode_batch(self, texts):
        self.entered.set()
        assert self.release.wait(timeout=60)
        return [self.tok.encode(t) for t in texts]


def test_saturated_verifier_drops_and_serving_continues(tally):
    tok = get_tokenizer("cl100k_base")
    entered, release = threading.Event(), threading.Event()
    v = ShadowVerifier({tok.hash: tok}, rate=1.0, queue_size=4, batch_size=1, batch_window=0.0,
                       reference_factory=lambda t: _Blocking(t, entered, release))
    try:
        s = Session(tok)
        assert v.offer(tok.hash, "", s.ids)  # the worker takes it and blocks
        assert entered.wait(timeout=30)
        results: list[bool] = []
        materialized: list[int] = []
        material = large_text(20_000, seed=SEED, kind="code")

        def text_of_session() -> str:  # lazy: called only for a sample that gets queued
            materialized.append(1)
            return s.text

        def serve() -> None:
            for i in range(200):
                r = s.append(material[i * 100 : (i + 1) * 100])
                results.append(v.offer(tok.hash, text_of_session, r.ids))

        t = threading.Thread(target=serve)
        t.start()
        t.join(timeout=120)  # liveness, not a timing threshold: a blocking offer never returns
        assert not t.is_alive(), "offer blocked while the verifier was saturated"
        assert np.array_equal(s.ids, tok.encode(s.text))  # serving continued, exactly
        st = v.stats
        assert results.count(True) == 4 and st.dropped == 196 and st.queue_depth == 4
        assert len(materialized) == 4  # dropped samples never built the O(N) text
        assert st.checked == 0
        release.set()
        assert v.drain(timeout=60)
        st = v.stats
        assert st.checked == 5 and st.mismatches == 0 and st.dropped == 196
        tally(tok, "shadow", st.checked)
    finally:
        release.set()
        v.close()


def test_disable_on_mismatch_and_reenable():
    tok = get_tokenizer("cl100k_base")
    disabled = []
    with ShadowVerifier({tok.hash: tok}, rate=1.0, disable_on_mismatch=True,
                        on_disable=lambda h, rep: disabled.append(h)) as v:
        assert not v.is_disabled(tok.hash)
        v.offer(tok.hash, "hello world", [1, 2, 3])
        v.offer(tok.hash, "hello again", [4])
        assert v.drain(timeout=60)
        assert v.is_disabled(tok.hash) and disabled == [tok.hash]  # callback once
        assert v.stats.disabled == (tok.hash,)
        assert v.reenable(tok.hash) and not v.is_disabled(tok.hash)
        assert not v.reenable(tok.hash)


def test_unknown_tokenizer_counts_an_error_and_worker_survives():
    tok = get_tokenizer("cl100k_base")
    with ShadowVerifier({tok.hash: tok}, rate=1.0) as v:
        v.offer("no-such-hash", "x", [1])
        v.offer(tok.hash, "x", tok.encode("x"))
        assert v.drain(timeout=60)
        st = v.stats
    assert st.errors == 1 and st.checked == 1 and st.mismatches == 0


def test_prometheus_metrics():
    prometheus_client = pytest.importorskip("prometheus_client")
    tok = get_tokenizer("cl100k_base")
    reg = prometheus_client.CollectorRegistry()
    with ShadowVerifier({tok.hash: tok}, rate=0.5, seed=1, metrics=reg, queue_size=1) as v:
        for i in range(20):
            v.offer(tok.hash, f"text {i}", tok.encode(f"text {i}") if i % 2 else [0])
        assert v.drain(timeout=60)
        st = v.stats
        label = {"tokenizer": tok.hash[:16]}
        get = reg.get_sample_value
        assert get("toktier_shadow_checked_total", label) == st.checked
        assert (get("toktier_shadow_mismatches_total", label) or 0) == st.mismatches
        assert get("toktier_shadow_dropped_total") == st.dropped
        assert get("toktier_shadow_sample_rate") == 0.5
        v.set_rate(0.25)
        assert get("toktier_shadow_sample_rate") == 0.25


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
    process (no history) must give identical IDs, for every bundled tokenizer."""
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
        got = []
        for i, p in enumerate(probes):
            engine.encode(mixed[40_000 + 8000 * i : 48_000 + 8000 * i])  # a long prefix first
            engine.encode(p + code[6000 + 5000 * i : 11_000 + 5000 * i])  # and a long overlap
            got.append(engine.encode(p).tolist())
        live[name] = got
        # the verifier's references are new objects per batch and agree too
        from toktier.shadow import fresh_reference

        a = fresh_reference(tok)
        assert a is not tok.engine
        assert [x.tolist() for x in a.encode_batch(probes)] == got
    proc = subprocess.run([sys.executable, "-c", _FRESH_PROCESS], input=json.dumps({n: probes for n in toks}),
                          capture_output=True, text=True, timeout=300, check=True)
    fresh = json.loads(proc.stdout)
    for name, tok in toks.items():
        assert fresh[name] == live[name], f"{name}: a long-lived engine's IDs differ from a fresh process"
        tally(tok, "history", len(probes))


def test_verifier_uses_a_new_reference_per_batch(monkeypatch):
    from toktier import shadow

    tok = get_tokenizer("cl100k_base")
    made = []
    original = shadow.fresh_reference

    def recording(t, **kw):
        ref = original(t, **kw)
        made.append(ref)
        return ref

    monkeypatch.setattr(shadow, "fresh_reference", recording)
    with ShadowVerifier({tok.hash: tok}, rate=1.0, batch_window=0.0) as v:  # default fresh="batch"
        for i in range(3):
            v.offer(tok.hash, f"batch {i}", tok.encode(f"batch {i}"))
            assert v.drain(timeout=60)
        assert v.stats.checked == 3 and v.stats.mismatches == 0
    assert len(made) == 3 and len({id(r) for r in made}) == 3
    assert all(r is not tok.engine for r in made)


@pytest.mark.parametrize("rebuild_every, same_after_3", [(None, True), (2, False)])
def test_prepare_builds_the_private_reference_once(rebuild_every, same_after_3):
    """`prepare` builds the nocache reference up front (a GIL-holding build kept out of
    traffic); checks reuse it, rebuilding only every `rebuild_every` batches."""
    tok = get_tokenizer("llama3")
    with ShadowVerifier({tok.hash: tok}, rate=1.0, fresh="nocache", rebuild_every=rebuild_every) as v:
        v.prepare(tok)
        ref = v._refs[tok.hash][0]
        v.prepare(tok)
        assert v._refs[tok.hash][0] is ref  # idempotent
        for text in ("one", "two", "three"):  # one batch each
            assert v.offer(tok.hash, text, tok.encode(text))
            assert v.drain(timeout=30)
        assert v.stats.checked == 3 and v.stats.mismatches == 0
        assert (v._refs[tok.hash][0] is ref) == same_after_3
