"""The sidecar's background verifier (`toktier_sidecar.shadow.Shadow`): sampling, queue, worker, metrics.

* Sampling happens once (`Shadow.sampled`); over many faulty results the detected
  fraction and the mean gap between detections match the rate (binomial /
  geometric tolerance), and `offer` itself never samples.
* A saturated worker (held on an Event the test controls) drops and counts
  samples while `offer` keeps returning and serving continues; a dropped sample
  is never built.
* A mismatch disables the tokenizer's fast path (callback once) until re-enabled;
  an unknown tokenizer counts an error and the worker survives; the Prometheus
  metric names are those the sidecar has always exported.
* The server builds it from `ServerConfig` with the cache-free reference policy.

The pure check (fault kinds, freshness, reports) is tested in ``tests/test_shadow.py``;
the served path end to end in ``test_sidecar_e2e.py``.
"""

from __future__ import annotations

import math
import os
import random
import threading

import numpy as np
import pytest

from conftest import get_tokenizer
from toktier_sidecar.service import Sample
from toktier_sidecar.shadow import Shadow, ShadowConfig
from sidecar_harness import make_config, registry  # noqa: F401  (fixture)
from toktier import Session
from toktier.tools.corpus import large_text
from toktier.tools.faults import FaultInjector
from toktier.verifier import Verifier, VerifierConfig

SEED = int(os.environ.get("TOKTIER_TEST_SEED", "0"))


def _resolver(*toks):
    return {t.hash: t for t in toks}.__getitem__


def _sample(tok, text, ids, **context) -> Sample:
    return Sample(tok.hash, text, ids, context)


def test_detection_rate_matches_sampling_rate():
    """Detected faulty requests ~ Binomial(n, rate); gaps between detections ~ Geometric(rate)."""
    tok = get_tokenizer("cl100k_base")
    rate, n = 0.1, 2000
    inj = FaultInjector(rate=1.0, seed=SEED, kinds=("substitute", "delete", "duplicate", "swap"))
    words = ["alpha ", "beta ", "gamma ", "delta ", "42 ", "x\n"]
    rng = random.Random(SEED)
    detected = []
    cfg = ShadowConfig(rate=rate, seed=SEED + 7, queue_size=n, verifier=VerifierConfig())
    with Shadow(_resolver(tok), cfg, on_mismatch=lambda r: detected.append(r.context["request"])) as sh:
        for i in range(n):
            text = "".join(rng.choice(words) for _ in range(8))
            bad, _ = inj.maybe_corrupt(tok, text, tok.encode(text))
            if sh.sampled():
                assert sh.offer(_sample(tok, text, bad, request=i))
        assert sh.drain(timeout=120)
        st = sh.stats
        assert st.mismatches == st.checked == st.offered == st.queued == len(detected)
        assert st.dropped == 0 and st.errors == 0
    k = len(detected)
    sd = math.sqrt(n * rate * (1 - rate))
    assert abs(k - n * rate) <= 5 * sd, (k, n * rate, sd)
    first = sorted(detected)
    gaps = np.diff([-1, *first])
    # mean gap of a geometric(rate) is 1/rate; its sd is sqrt(1-rate)/rate per gap
    mean_sd = math.sqrt(1 - rate) / rate / math.sqrt(len(gaps))
    assert abs(gaps.mean() - 1 / rate) <= 5 * mean_sd, (gaps.mean(), 1 / rate)


def test_offer_does_not_sample_again():
    """Sampling is the caller's one decision: at rate 0 `sampled` never says yes, yet an
    offer made anyway is checked."""
    tok = get_tokenizer("cl100k_base")
    with Shadow(_resolver(tok), ShadowConfig(rate=0.0, verifier=VerifierConfig())) as sh:
        assert not any(sh.sampled() for _ in range(1000))
        for i in range(20):
            assert sh.offer(_sample(tok, f"t{i}", tok.encode(f"t{i}")))
        assert sh.drain(timeout=60)
        assert sh.stats.checked == 20


def test_sampled_is_reproducible_with_a_seed():
    tok = get_tokenizer("cl100k_base")
    draws = []
    for _ in range(2):
        with Shadow(_resolver(tok), ShadowConfig(rate=0.3, seed=5), start=False) as sh:
            draws.append([sh.sampled() for _ in range(200)])
    assert draws[0] == draws[1] and 30 < sum(draws[0]) < 90


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
    core = Verifier(reference_factory=lambda t: _Blocking(t, entered, release))
    sh = Shadow(_resolver(tok), ShadowConfig(rate=1.0, queue_size=4, batch_size=1, batch_window=0.0),
                verifier=core)
    try:
        s = Session(tok)
        assert sh.offer(_sample(tok, "", s.ids))  # the worker takes it and blocks
        assert entered.wait(timeout=30)
        results: list[bool] = []
        materialized: list[int] = []
        material = large_text(20_000, seed=SEED, kind="code")

        def sample_of_session() -> Sample:  # lazy: called only for a sample that gets queued
            materialized.append(1)
            return _sample(tok, s.text, s.ids)

        def serve() -> None:
            for i in range(200):
                s.append(material[i * 100 : (i + 1) * 100])
                results.append(sh.offer(sample_of_session))

        t = threading.Thread(target=serve)
        t.start()
        t.join(timeout=120)  # liveness, not a timing threshold: a blocking offer never returns
        assert not t.is_alive(), "offer blocked while the verifier was saturated"
        assert np.array_equal(s.ids, tok.encode(s.text))  # serving continued, exactly
        st = sh.stats
        assert results.count(True) == 4 and st.dropped == 196 and st.queue_depth == 4
        assert st.offered == 201 and st.queued == 5
        assert len(materialized) == 4  # dropped samples never built the O(N) text
        assert st.checked == 0
        release.set()
        assert sh.drain(timeout=60)
        st = sh.stats
        assert st.checked == 5 and st.mismatches == 0 and st.dropped == 196
        tally(tok, "shadow", st.checked)
    finally:
        release.set()
        sh.close()


def test_offered_ids_are_copied():
    """A served array may be a view the next op overwrites: the queued copy is what is checked."""
    tok = get_tokenizer("cl100k_base")
    entered, release = threading.Event(), threading.Event()
    core = Verifier(reference_factory=lambda t: _Blocking(t, entered, release))
    with Shadow(_resolver(tok), ShadowConfig(batch_window=0.0), verifier=core) as sh:
        ids = tok.encode("hello world").copy()
        assert sh.offer(_sample(tok, "hello world", ids))
        ids[:] = 0  # overwritten after the offer
        release.set()
        assert sh.drain(timeout=60)
        assert sh.stats.mismatches == 0 and sh.stats.checked == 1


def test_a_vanished_sample_is_not_queued():
    tok = get_tokenizer("cl100k_base")
    with Shadow(_resolver(tok), ShadowConfig(verifier=VerifierConfig())) as sh:
        assert not sh.offer(lambda: None)  # e.g. the session ended before the sample was built
        assert sh.drain(timeout=5)
        assert (sh.stats.offered, sh.stats.queued, sh.stats.dropped) == (1, 0, 0)


def test_disable_on_mismatch_and_reenable():
    tok = get_tokenizer("cl100k_base")
    disabled = []
    cfg = ShadowConfig(rate=1.0, disable_on_mismatch=True)
    with Shadow(_resolver(tok), cfg, on_disable=lambda h, rep: disabled.append(h)) as sh:
        sh.prepare(tok)
        assert not sh.is_disabled(tok.hash)
        sh.offer(_sample(tok, "hello world", [1, 2, 3]))
        sh.offer(_sample(tok, "hello again", [4]))
        assert sh.drain(timeout=60)
        assert sh.is_disabled(tok.hash) and disabled == [tok.hash]  # callback once
        assert sh.disabled_report(tok.hash).served_window == (1, 2, 3)
        assert sh.stats.disabled == (tok.hash,) and sh.stats.mismatches == 2
        assert sh.reenable(tok.hash) and not sh.is_disabled(tok.hash)
        assert not sh.reenable(tok.hash)


def test_mismatch_without_disable_keeps_the_fast_path():
    tok = get_tokenizer("cl100k_base")
    with Shadow(_resolver(tok), ShadowConfig(verifier=VerifierConfig())) as sh:
        sh.offer(_sample(tok, "hello world", [1]))
        assert sh.drain(timeout=60)
        assert sh.stats.mismatches == 1 and not sh.is_disabled(tok.hash)
        assert len(sh.reports) == 1


def test_unknown_tokenizer_counts_an_error_and_worker_survives():
    tok = get_tokenizer("cl100k_base")
    with Shadow(_resolver(tok), ShadowConfig(verifier=VerifierConfig())) as sh:
        sh.offer(Sample("no-such-hash", "x", [1], {}))
        sh.offer(_sample(tok, "x", tok.encode("x")))
        assert sh.drain(timeout=60)
        st = sh.stats
    assert st.errors == 1 and st.checked == 1 and st.mismatches == 0


def test_a_failing_callback_does_not_stop_the_worker():
    tok = get_tokenizer("cl100k_base")

    def boom(_rep):
        raise RuntimeError("callback failed")

    with Shadow(_resolver(tok), ShadowConfig(verifier=VerifierConfig()), on_mismatch=boom) as sh:
        sh.offer(_sample(tok, "a", [1]))
        assert sh.drain(timeout=60)
        sh.offer(_sample(tok, "b", tok.encode("b")))
        assert sh.drain(timeout=60)
        assert (sh.stats.checked, sh.stats.mismatches) == (2, 1)


def test_close_with_a_full_queue_and_offers_after_close():
    tok = get_tokenizer("cl100k_base")
    entered, release = threading.Event(), threading.Event()
    core = Verifier(reference_factory=lambda t: _Blocking(t, entered, release))
    sh = Shadow(_resolver(tok), ShadowConfig(queue_size=2, batch_size=1, batch_window=0.0), verifier=core)
    assert sh.offer(_sample(tok, "x", tok.encode("x")))
    assert entered.wait(timeout=30)  # the worker holds one; the queue takes two more
    assert [sh.offer(_sample(tok, "x", tok.encode("x"))) for _ in range(3)] == [True, True, False]
    closer = threading.Thread(target=sh.close)
    closer.start()
    release.set()
    closer.join(timeout=60)
    assert not closer.is_alive()
    assert not sh.offer(_sample(tok, "y", tok.encode("y")))
    assert (sh.stats.checked, sh.stats.dropped) == (3, 1)  # close finished the queued ones


def test_prometheus_metrics():
    prometheus_client = pytest.importorskip("prometheus_client")
    tok = get_tokenizer("cl100k_base")
    reg = prometheus_client.CollectorRegistry()
    cfg = ShadowConfig(rate=0.5, seed=1, queue_size=1, disable_on_mismatch=True, verifier=VerifierConfig())
    with Shadow(_resolver(tok), cfg, metrics=reg) as sh:
        for i in range(20):
            if sh.sampled():
                sh.offer(_sample(tok, f"text {i}", tok.encode(f"text {i}") if i % 2 else [0]))
        assert sh.drain(timeout=60)
        st = sh.stats
        assert st.checked > 0
        label = {"tokenizer": tok.hash[:16]}
        get = reg.get_sample_value
        assert get("toktier_shadow_checked_total", label) == st.checked
        assert (get("toktier_shadow_mismatches_total", label) or 0) == st.mismatches
        assert (get("toktier_shadow_dropped_total", {"reason": "queue_full"}) or 0) == st.dropped
        assert (get("toktier_shadow_errors_total") or 0) == st.errors == 0
        assert get("toktier_shadow_queue_depth") == 0
        assert get("toktier_shadow_sample_rate") == 0.5
        assert get("toktier_shadow_fast_path_disabled", label) == (1 if st.mismatches else None)
        sh.set_rate(0.25)
        assert get("toktier_shadow_sample_rate") == 0.25 and sh.rate == 0.25
        sh.reenable(tok.hash)
        assert get("toktier_shadow_fast_path_disabled", label) == 0


def test_config_is_validated():
    with pytest.raises(ValueError):
        ShadowConfig(rate=1.5)
    with pytest.raises(ValueError):
        ShadowConfig(queue_size=0)
    with pytest.raises(ValueError):
        ShadowConfig(batch_window=-1)
    assert ShadowConfig().verifier == VerifierConfig(fresh="nocache", rebuild_every=None)


def test_server_builds_it_from_its_config(tmp_path, registry):
    """`ServerConfig.verify_*` -> `ShadowConfig`; the cache-free private references are built at
    tokenizer load (`prepare`); no verifier at rate 0."""
    from toktier_sidecar import Sidecar

    sc = Sidecar(make_config(tmp_path, verify_rate=0.25, verify_disable_on_mismatch=True),
                 registry=registry, install_signals=False)
    try:
        sh = sc.verifier
        assert sh is not None and sh.rate == 0.25 and sh.config.disable_on_mismatch
        assert sh.config.verifier == VerifierConfig(fresh="nocache", rebuild_every=None)
        assert sc.service.fast_path_disabled == sh.is_disabled
        assert sc.service.on_tokenizer_loaded == sh.prepare
    finally:
        sc.verifier.close()
        sc.service.shutdown()
    off = Sidecar(make_config(tmp_path, verify_rate=0.0), registry=registry, install_signals=False)
    try:
        assert off.verifier is None
    finally:
        off.service.shutdown()


def test_cli_refuses_a_rate_outside_0_1():
    from toktier_sidecar.cli import build_parser, load_config

    assert load_config(build_parser().parse_args(["--verify-rate", "1"])).verify_rate == 1.0
    with pytest.raises(SystemExit, match="verify-rate"):
        load_config(build_parser().parse_args(["--verify-rate", "1.5"]))
