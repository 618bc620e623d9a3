"""The CUDA kernels, run on the CPU by an emulator, equal the reference (no GPU needed).

``cuda_emu.cpp`` compiles ``cuda_src/toktier.cu`` as C++20 (threads and barriers
for ``__syncthreads``, warp exchange slots for shuffles/ballots/reductions) and
``gpu_emu.EmuBackend`` plugs it into the production driver, so this runs the real
launch sequence of every family: decode, classify, piece-start rules and scans,
piece compaction, dispatch, thread/warp/block BPE, output compaction, the meta
header and the CPU fallback on a status bit.  Slow per request (threads on two
cores), so each test sends a few dense texts.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

import numpy as np
import pytest

from adversarial import ATOMS
from conftest import ALL_TOKENIZERS, get_tokenizer
from toktier.tools.corpus import chat_wrap, samples
import toktier
from toktier.fullpath import FullPath

gpu_emu = pytest.importorskip("gpu_emu")


@pytest.fixture(scope="module")
def drv():
    try:
        d = gpu_emu.emulated_driver()
    except RuntimeError as exc:  # the emulator did not compile here
        pytest.skip(f"CUDA emulator build failed: {exc}")
    if d is None:
        pytest.skip("no C++20 compiler for the CUDA emulator")
    return d


def _check(drv, tok, text: str, tally) -> None:
    if tok.family_info.nfc:
        text = tok.engine.normalize(text)  # what the router sends an NFC family: NFC-stable text
    ids, spans = drv.encode(tok, text)
    ref = tok.encode(text)
    if not np.array_equal(ids, ref):
        k = int(np.flatnonzero(np.concatenate([ids[: len(ref)] != ref[: len(ids)], [True]]))[0])
        raise AssertionError(f"{tok.name}: token {k}: got {[tok.token_bytes[i] for i in ids[k:k + 3]]} "
                             f"want {[tok.token_bytes[i] for i in ref[k:k + 3]]}")
    want = np.concatenate(([0], np.cumsum(tok.token_len[ref].astype(np.int64))[:-1])) if len(ref) else spans
    assert np.array_equal(spans, want)
    tally(tok, "emu-ids", len(ids))


def _real_mix(n_each: int = 250) -> str:
    return "".join(s.text[:n_each] for s in samples(max_chars_per_sample=4000))


LONG_PIECES = ("x" * 50 + " " + "ab" * 100 + " " + "=" * 300 + " " + "0123456789" * 20 + " " + "\u4e2d" * 70
               + " " + "Zq" * 40 + "\n" + " " * 200 + "y")


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
def test_emulated_kernels_equal_reference(drv, name, tally):
    tok = get_tokenizer(name)
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    adversarial = "".join(rng.choice(ATOMS + ["'s", "/", "\u0301", "ʰ", "ǅ", "\n/", ".."]) for _ in range(600))
    for text in (_real_mix(), LONG_PIECES, adversarial):
        try:
            _check(drv, tok, text, tally)
        except AssertionError as exc:
            raise AssertionError(f"seed {seed}: {exc}") from None


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
def test_emulated_block_bpe_on_pieces_longer_than_a_bitmap_chunk(drv, name, tally):
    """Block-per-piece BPE walks a piece in 8192-pair bitmap chunks: runs of equal-rank
    pairs (all-candidate words, odd runs crossing word and chunk boundaries) and random
    two-letter pieces whose candidate runs have every length."""
    tok = get_tokenizer(name)
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    src = (Path(__file__).parent.parent / "cuda_src" / "tt_bpe.cuh").read_text()
    chunk = 32 * int(re.search(r"#define TT_BLOCK_THREADS (\d+)", src).group(1))  # TT_BM_BITS
    ab = "".join(rng.choice("ab") for _ in range(2 * chunk + 77))
    for text in (" " * (chunk + 1) + "x", "=" * (2 * chunk + 3), "a" * (chunk - 1) + " " + ab):
        blocks = drv.backend.block_pieces
        try:
            _check(drv, tok, text, tally)
        except AssertionError as exc:
            raise AssertionError(f"seed {seed}: {exc}") from None
        assert drv.backend.block_pieces > blocks  # the text reached the block kernel


@pytest.mark.parametrize("name, fam", [("llama3", "llama3"), ("deepseek_v4", "deepseek"), ("cl100k_base", "chatml")])
def test_emulated_literals(drv, name, fam, tally):
    tok = get_tokenizer(name)
    text = chat_wrap([("system", "Be brief."), ("user", "héllo 12345 'tis  \n\n"), ("assistant", "中文 ok")], fam)
    _check(drv, tok, text + "<|endoftext|>", tally)


def test_emulated_status_bit_falls_back_exactly(drv, tally, monkeypatch):
    """A chain fixpoint not reached within the captured rounds sets a status bit: the CPU answers."""
    tok = get_tokenizer("o200k_base")
    text = "a..\n/b ..\n/..\n/x"  # zones whose [\r\n/]* chains swallow the next line's R and '/'
    before = drv.fallbacks
    _check(drv, tok, text, tally)
    assert drv.fallbacks == before  # resolved on the device
    monkeypatch.setattr(gpu_emu.driver, "O200K_ROUNDS", 0)  # only the convergence check is captured
    fresh = gpu_emu.emulated_driver()
    _check(fresh, tok, text, tally)
    assert fresh.fallbacks == 1


def test_emulated_router_self_check_and_route(drv):
    from toktier.gpu.router import Router

    tok = get_tokenizer("cl100k_base")
    assert drv.verified(tok)  # the driver's one-time self-check text, through the kernels
    r = Router(driver=drv)
    text = _real_mix(120)
    assert np.array_equal(FullPath(gpu=r).encode(tok, text), tok.encode(text)) and r.last_route == "gpu"
    assert np.array_equal(FullPath(gpu=r).encode(tok, "tiny"), tok.encode("tiny")) and r.last_route == "cpu"
    # a session start hands over the UTF-8 it holds: the driver takes bytes, and spans stay on the device
    s = toktier.Session(tok, text, full_path=FullPath(gpu=r))
    assert r.last_route == "gpu" and np.array_equal(s.ids, tok.encode(text)) and not text.isascii()
    ids, spans = drv.encode(tok, text.encode("utf-8"), with_spans=False)
    assert spans is None and np.array_equal(ids, tok.encode(text))


@pytest.mark.parametrize("name,fam", [("deepseek_v4", "deepseek"), ("llama3", "llama3")])
def test_emulated_router_uploads_the_native_literals(drv, name, fam, tally):
    """Through the router the driver gets the native engine's literal scan (`literal_bytes`), not
    its own: a chat full of literals, after multi-byte text, must still equal the reference."""
    from toktier.gpu.router import Router

    tok = get_tokenizer(name)
    text = chat_wrap([("user", _real_mix(40)), ("assistant", "中文 é ok")] * 3, fam)
    assert len(tok.native.literal_bytes(text)[0]) >= 6
    r = Router(driver=drv)
    ids = FullPath(gpu=r).encode(tok, text)
    assert r.last_route == "gpu" and np.array_equal(ids, tok.encode(text))
    tally(tok, "emu-ids", len(ids))


def test_emulated_router_sends_an_nfc_family_its_normalized_form(drv, tally):
    """qwen3 text the normalizer changes (near literals too) goes to the kernels in the form its
    reference tokenizes (`gpu_form`), no longer to the CPU."""
    from toktier.gpu.router import Router

    tok = get_tokenizer("qwen3")
    text = _real_mix(60) + "e\u0301<|im_end|>\u0338 \u212b>\u0338 \u1fbe" * 20
    assert tok.engine.normalize(text) != text
    r = Router(driver=drv)
    ids = FullPath(gpu=r).encode(tok, text)
    assert r.last_route == "gpu" and np.array_equal(ids, tok.encode(text))
    s = toktier.Session(tok, text, full_path=FullPath(gpu=r))
    assert r.last_route == "gpu" and np.array_equal(s.ids, tok.encode(text)) and s._dirty
    tally(tok, "emu-ids", len(ids))


@pytest.mark.parametrize("op", ["tt_scan_max", "tt_scan_min_rev", "tt_scan_sum"])
def test_emulated_scans_beyond_one_aggregate_chunk(drv, op):
    """Device-wide scans over more than 256 tiles (the aggregate scan's chunk loop)."""
    from toktier.gpu import driver as gd

    rng = np.random.default_rng(7)
    n = 256 * gd.SCAN_TILE + 4321
    data = rng.integers(-1000, 1000, n, dtype=np.int32)
    if op == "tt_scan_sum":
        data = (data > 600).astype(np.int32)
        want = np.cumsum(data)
    elif op == "tt_scan_max":
        want = np.maximum.accumulate(data)
    else:
        want = np.minimum.accumulate(data[::-1])[::-1]
    buf = data.copy()
    nptr = np.array([n], dtype=np.int32)
    aggs = np.zeros(n // gd.SCAN_TILE + 2, dtype=np.int32)
    tiles = -(-n // gd.SCAN_TILE)
    p = lambda a: np.intp(a.ctypes.data)  # noqa: E731
    drv._fn(f"{op}_tiles")(tiles, 256, (p(buf), p(nptr), p(aggs)))
    drv._fn(f"{op}_aggs")(1, 256, (p(aggs), p(nptr)))
    drv._fn(f"{op}_apply")(tiles, 256, (p(buf), p(nptr), p(aggs)))
    assert np.array_equal(buf, want)
