"""The real-text corpus used by differential tests and benchmarks (toktier.tools.corpus)."""

from __future__ import annotations

import re
import time

import pytest

from toktier.tools import corpus
from toktier.tools.corpus import CATEGORIES, LARGE_KINDS, Sample, chat_wrap, large_text, samples

CJK_IDEOGRAPH = re.compile("[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0003134f]")
ARABIC_LETTER = re.compile("[\u0621-\u064a]")
ARABIC_DIACRITIC = re.compile("[\u064b-\u0652]")
CYRILLIC = re.compile("[\u0400-\u04ff]")
LONE_CR = re.compile("\r(?!\n)")


@pytest.fixture(scope="module")
def default_samples() -> list[Sample]:
    return samples()


def by_category(items: list[Sample], category: str) -> list[Sample]:
    return [s for s in items if s.category == category]


def test_every_category_present(default_samples):
    assert tuple(sorted({s.category for s in default_samples})) == tuple(sorted(CATEGORIES))
    for s in default_samples:
        assert s.category in CATEGORIES
        assert s.name.startswith(s.category + "/")
    names = [s.name for s in default_samples]
    assert len(names) == len(set(names))


def test_texts_nonempty_valid_utf8_and_bounded(default_samples):
    for s in default_samples:
        assert isinstance(s.text, str) and s.text, s.name
        s.text.encode("utf-8")  # raises on lone surrogates
        assert len(s.text) <= 200_000, s.name


def test_max_chars_per_sample_is_respected():
    small = samples(max_chars_per_sample=500, seed=1)
    assert {s.category for s in small} == set(CATEGORIES)
    for s in small:
        assert 0 < len(s.text) <= 500, s.name


def test_samples_deterministic():
    a = samples(max_chars_per_sample=20_000, seed=7)
    b = samples(max_chars_per_sample=20_000, seed=7)
    assert a == b
    assert a is not b  # a fresh list each call; callers may mutate it
    c = samples(max_chars_per_sample=20_000, seed=8)
    assert [s.text for s in a] != [s.text for s in c]


def test_cjk_contains_ideographs(default_samples):
    cjk = by_category(default_samples, "cjk")
    assert any(len(CJK_IDEOGRAPH.findall(s.text)) >= 50 for s in cjk)
    faker_cjk = [s for s in cjk if s.name == "cjk/faker"]
    assert faker_cjk and CJK_IDEOGRAPH.search(faker_cjk[0].text)


def test_arabic_letters_and_diacritics(default_samples):
    arabic = by_category(default_samples, "arabic")
    assert all(ARABIC_LETTER.search(s.text) for s in arabic)
    # Faker's ar_AA word lists and the emoji package's Arabic names carry harakat.
    assert sum(len(ARABIC_DIACRITIC.findall(s.text)) for s in arabic) >= 20


def test_cyrillic_letters(default_samples):
    assert all(CYRILLIC.search(s.text) for s in by_category(default_samples, "cyrillic"))


def test_emoji_has_zwj_skin_tones_and_flags():
    for items in (samples(), samples(max_chars_per_sample=300, seed=3)):
        text = "".join(s.text for s in by_category(items, "emoji"))
        assert "\u200d" in text
        assert any(0x1F3FB <= ord(ch) <= 0x1F3FF for ch in text)  # skin-tone modifiers
        assert re.search("[\U0001F1E6-\U0001F1FF]{2}", text)  # regional-indicator flags


def test_crlf_has_crlf_and_lone_cr():
    for items in (samples(), samples(max_chars_per_sample=1_000, seed=2)):
        crlf = by_category(items, "crlf")
        assert all("\r\n" in s.text for s in crlf)
        assert any(LONE_CR.search(s.text) for s in crlf)


def test_json_and_logs_shapes(default_samples):
    js = by_category(default_samples, "json")
    assert any(s.text.lstrip().startswith("{") and '\n  "' in s.text for s in js)
    logs = by_category(default_samples, "logs")
    text = "".join(s.text for s in logs)
    assert re.search(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{6}Z", text)
    assert re.search(r"0x[0-9a-f]{6,}", text)
    assert "Traceback (most recent call last):" in text


def test_mixed_spans_scripts(default_samples):
    text = "".join(s.text for s in by_category(default_samples, "mixed"))
    for pattern in (CJK_IDEOGRAPH, ARABIC_LETTER, CYRILLIC, re.compile("[a-zA-Z]")):
        assert pattern.search(text), pattern.pattern


@pytest.mark.parametrize("n", [0, 1, 1_000, 100_000, 1_000_000])
@pytest.mark.parametrize("kind", LARGE_KINDS)
def test_large_text_exact_length(n, kind):
    text = large_text(n, seed=0, kind=kind)
    assert len(text) == n
    text.encode("utf-8")


def test_large_text_deterministic_and_seeded():
    assert large_text(50_000, seed=1) == large_text(50_000, seed=1)
    assert large_text(50_000, seed=1) != large_text(50_000, seed=2)
    assert large_text(50_000, seed=1, kind="code") != large_text(50_000, seed=1, kind="english")
    # A longer request extends material from the same sequence of pieces.
    assert large_text(200_000, seed=4, kind="english").startswith(large_text(10_000, seed=4, kind="english"))


def test_large_text_kinds_content():
    assert "def " in large_text(100_000, kind="code")
    assert CJK_IDEOGRAPH.search(large_text(300_000, kind="multilingual"))
    assert ARABIC_LETTER.search(large_text(300_000, kind="multilingual"))


def test_large_text_4m_fast():
    large_text(1_000, kind="mixed")  # load sources once
    start = time.perf_counter()
    text = large_text(4_000_000, seed=11, kind="mixed")
    elapsed = time.perf_counter() - start
    assert len(text) == 4_000_000
    assert elapsed < 2.0, elapsed


def test_large_text_rejects_bad_arguments():
    with pytest.raises(ValueError):
        large_text(10, kind="klingon")
    with pytest.raises(ValueError):
        large_text(-1)
    with pytest.raises(ValueError):
        samples(max_chars_per_sample=0)


TURNS = [("system", "Be brief."), ("user", "Hi 👋"), ("assistant", "Hello!"), ("tool", '{"ok": true}')]


def test_chat_wrap_chatml():
    out = chat_wrap(TURNS, "chatml")
    assert out.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 👋<|im_end|>\n")
    assert out.endswith('<|im_start|>tool\n{"ok": true}<|im_end|>\n')
    assert chat_wrap(TURNS[:2], "chatml", add_generation_prompt=True).endswith("<|im_start|>assistant\n")


def test_chat_wrap_llama3():
    out = chat_wrap(TURNS[:3], "llama3")
    assert out == (
        "<|begin_of_text|>"
        "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi 👋<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
    )


def test_chat_wrap_deepseek():
    out = chat_wrap(TURNS, "deepseek", add_generation_prompt=True)
    assert out == (
        "<｜begin▁of▁sentence｜>Be brief.<｜User｜>Hi 👋<｜Assistant｜>Hello!<｜end▁of▁sentence｜>"
        '<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>{"ok": true}<｜tool▁output▁end｜><｜tool▁outputs▁end｜>'
        "<｜Assistant｜>"
    )
    with pytest.raises(ValueError):
        chat_wrap([("narrator", "x")], "deepseek")
    with pytest.raises(ValueError):
        chat_wrap(TURNS, "gemma")  # type: ignore[arg-type]


def test_import_is_lazy():
    import subprocess
    import sys

    code = (
        "import sys, toktier.tools.corpus; "
        "print(any(m in sys.modules for m in ('faker', 'emoji', 'pydoc_data.topics')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    assert corpus.__doc__ and "owns" in corpus.__doc__


def test_missing_optional_sources_fall_back(monkeypatch):
    """Python builds without test/ (cjkencodings, decimaltestdata) or headers still cover everything."""
    for loader in ("_cjk_files", "_decimal_tests", "_c_sources"):
        monkeypatch.setattr(corpus, loader, lambda: ())
    items = corpus._samples.__wrapped__(2_000, 0)
    assert {s.category for s in items} == set(CATEGORIES)
    cjk = "".join(s.text for s in items if s.category == "cjk")
    assert CJK_IDEOGRAPH.search(cjk)
    assert any("\r\n" in s.text for s in items if s.category == "crlf")
