"""GPU exactness suite: the kernels' IDs and spans equal the reference (needs a GPU).

Marked ``gpu``; every test skips cleanly when neither pycuda nor CuPy can reach a
CUDA device (CI, most machines).  ``bench/gpu_check.sh`` runs it on a GPU machine.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adversarial import ATOMS
from conftest import ALL_TOKENIZERS, get_tokenizer
from toktier.tools.corpus import chat_wrap, large_text, samples
from toktier.gpu import driver as gpu_driver
from toktier.fullpath import FullPath

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def drv():
    d = gpu_driver.available_driver()
    if d is None:
        pytest.skip(f"no GPU driver: {gpu_driver.unavailable_reason()}")
    return d


def _check(drv, tok, text: str, tally=None) -> None:
    if tok.family_info.nfc:
        text = tok.engine.normalize(text)  # what the router sends an NFC family: NFC-stable text
    ids, spans = drv.encode(tok, text)
    ref = tok.encode(text)
    if not np.array_equal(ids, ref):
        k = int(np.flatnonzero(np.concatenate([ids[: len(ref)] != ref[: len(ids)], [True]]))[0])
        raise AssertionError(f"{tok.name}: ids differ at token {k} of {len(ref)} (got {len(ids)}): "
                             f"got {[tok.token_bytes[i] for i in ids[k:k + 3]]} "
                             f"want {[tok.token_bytes[i] for i in ref[k:k + 3]]}")
    want = np.concatenate(([0], np.cumsum(tok.token_len[ref].astype(np.int64))[:-1])) if len(ref) else spans
    assert np.array_equal(spans, want), f"{tok.name}: spans differ"
    if tally is not None:
        tally(tok, "gpu-ids", len(ids))


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
def test_gpu_equals_reference_on_real_text(drv, name, tally):
    tok = get_tokenizer(name)
    for s in samples(max_chars_per_sample=50_000):
        _check(drv, tok, s.text, tally)


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
def test_gpu_equals_reference_on_large_text(drv, name, tally):
    tok = get_tokenizer(name)
    for n, kind in ((1_000_000, "multilingual"), (300_000, "code")):
        _check(drv, tok, large_text(n, seed=5, kind=kind), tally)


@pytest.mark.parametrize("name", ["llama3", "deepseek_v4", "cl100k_base", "qwen3"])
def test_gpu_literals(drv, name, tally):
    tok = get_tokenizer(name)
    fam = {"llama3": "llama3", "deepseek_v4": "deepseek"}.get(name, "chatml")
    text = chat_wrap([("system", "Be brief."), ("user", "héllo 12345 'tis  \n\n"), ("assistant", "中文 ok")] * 50, fam)
    _check(drv, tok, text + "<|endoftext|>", tally)


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=st.lists(st.sampled_from(ATOMS + ["'s", "/", "\u0301", "ʰ", "ǅ", "  ", "\n/", ".."]), max_size=200))
def test_gpu_equals_reference_on_adversarial_text(drv, name, parts, tally):
    tok = get_tokenizer(name)
    _check(drv, tok, "".join(parts), tally)


def test_gpu_uses_graphs(drv):
    tok = get_tokenizer("cl100k_base")
    _check(drv, tok, large_text(50_000, seed=2))
    assert drv.graph_error is None, drv.graph_error


def test_router_sends_large_segments_to_gpu(drv):
    from toktier.gpu.router import Router

    tok = get_tokenizer("o200k_base")
    r = Router(driver=drv)
    text = large_text(20_000, seed=9)
    assert np.array_equal(FullPath(gpu=r).encode(tok, text), tok.encode(text))
    assert r.last_route == "gpu"


def test_router_sends_an_nfc_family_its_normalized_form(drv, tally):
    """qwen3 text the normalizer changes goes to the GPU in the form its reference tokenizes."""
    from toktier.gpu.router import Router

    tok = get_tokenizer("qwen3")
    text = large_text(300_000, seed=9, kind="code") + "e\u0301<|im_end|>\u0338 \u212b>\u0338 \u1fbe" * 200
    assert tok.engine.normalize(text) != text
    r = Router(driver=drv)
    ids = FullPath(gpu=r).encode(tok, text)
    assert r.last_route == "gpu" and np.array_equal(ids, tok.encode(text))
    tally(tok, "gpu-ids", len(ids))


@pytest.mark.parametrize("name,fam", [("deepseek_v4", "deepseek"), ("llama3", "llama3"), ("qwen3", "chatml")])
def test_router_uploads_the_native_literals(drv, name, fam, tally):
    """Through the router the driver gets the native engine's literal scan, not its own."""
    from toktier.gpu.router import Router

    tok = get_tokenizer(name)
    body = large_text(180_000, seed=7, kind="multilingual")
    text = chat_wrap([("user", body[k:k + 3_000]) for k in range(0, len(body), 3_000)], fam)
    r = Router(driver=drv)
    ids = FullPath(gpu=r).encode(tok, text)
    assert r.last_route == "gpu" and np.array_equal(ids, tok.encode(text))
    tally(tok, "gpu-ids", len(ids))
