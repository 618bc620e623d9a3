"""The sidecar's Prometheus metrics, scraped over HTTP from a real server (Unix socket, shared
memory) after ops through the real client: counters and labels reflect the ops, the exporter
answers /metrics only, the sample-rate gauge is the configured rate, and the log says where the
metrics are served."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import toktier
from toktier_client import Client

from sidecar_harness import start_sidecar, registry, llama3, shm_names  # noqa: F401 (pytest fixtures)


def scrape(port: int, path: str = "/metrics") -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        return resp.read().decode()


def samples(body: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of an exposition."""
    out = {}
    for fam in text_string_to_metric_families(body):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(body_samples: dict, name: str, **labels: str) -> float:
    return body_samples.get((name, tuple(sorted(labels.items()))), 0.0)


def total(body_samples: dict, name: str, **labels: str) -> float:
    """Sum of ``name`` over every label set that includes ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in body_samples.items() if n == name and want <= set(ls))


def test_counters_reflect_session_ops_per_tokenizer(start_sidecar, llama3):
    sc = start_sidecar(metrics_port=0)
    code = "def f(x):\n    return x * 2  # a comment\n" * 60
    run = "x = " + "a" * 3000 + " end"
    with Client(sc.path) as c:
        s = c.session("code", text=code, tokenizer="llama3")
        r_run = c.session("run", text=run, tokenizer="llama3")
        edited = "x = " + "a" * 1496 + "b" + "a" * 1504 + " end"
        ops = []  # (path, tokens, widenings, the session text after the op)
        for op, text in ((lambda: s.append(" more"), code + " more"),
                         (lambda: s.append("\nprint(f(21))\n"), code + " more\nprint(f(21))\n"),
                         (lambda: s.edit(0, 3, "async def"), "async def" + (code + " more\nprint(f(21))\n")[3:]),
                         (lambda: r_run.edit(1500, 1500, "b"), edited),  # inside a long run: widens
                         (lambda: r_run.append(""), edited)):  # nothing changed: noop
            r = op()
            assert np.array_equal(r.ids, llama3.encode(text))  # (a view valid until the next op)
            ops.append((r.path, len(r.ids), r.widenings, text))
        body = samples(scrape(sc.sidecar.metrics_port))
        store = sc.sidecar.service.store
        retokenized = sum(store.peek(k).session.stats.tokens_retokenized for k in store.keys())

    paths = Counter(path for path, _, _, _ in ops)
    tokens = sum(n for _, n, _, _ in ops)
    nbytes = sum(len(text.encode()) for _, _, _, text in ops)
    open_tokens = len(llama3.encode(code)) + len(llama3.encode(run))
    open_bytes = len(code.encode()) + len(run.encode())
    assert paths["noop"] == 1 and paths["first_window"] >= 2
    assert value(body, "toktier_session_ops_total", tokenizer="llama3", path="full") == 2 + paths["full"]
    for p in ("first_window", "widened", "noop"):  # the two opens were full encodes
        assert value(body, "toktier_session_ops_total", tokenizer="llama3", path=p) == paths[p], p
    assert value(body, "toktier_result_tokens_total", tokenizer="llama3") == open_tokens + tokens
    assert value(body, "toktier_result_bytes_total", tokenizer="llama3") == open_bytes + nbytes
    assert value(body, "toktier_repair_widenings_total", tokenizer="llama3") == sum(w for _, _, w, _ in ops)
    # re-tokenized: exactly what the sessions' own counters say (their starts included)
    assert value(body, "toktier_retokenized_tokens_total", tokenizer="llama3") == retokenized
    # reused = sum over ops of max(0, result - re-tokenized): at least the totals' difference, at
    # most every op's result; most of each repaired result was kept
    reused = value(body, "toktier_reused_tokens_total", tokenizer="llama3")
    assert open_tokens + tokens - retokenized <= reused <= tokens
    assert reused > 0.8 * tokens
    # bytes: estimated per op at its result's bytes per token (0 when nothing was kept)
    assert 0.5 * nbytes < value(body, "toktier_reused_bytes_total", tokenizer="llama3") <= nbytes
    # requests and latency: one per request, labelled by the tokenizer that served it
    assert value(body, "toktier_requests_total", op="append", outcome="ok") == 3
    assert value(body, "toktier_request_seconds_count", op="append", tokenizer="llama3") == 3
    assert value(body, "toktier_request_seconds_count", op="edit", tokenizer="llama3") == 2
    assert value(body, "toktier_request_seconds_count", op="open", tokenizer="llama3") == 2
    # session starts are not fallbacks
    assert total(body, "toktier_full_path_fallbacks_total") == paths["full"]


def test_fallbacks_are_counted_by_reason(start_sidecar):
    sc = start_sidecar(metrics_port=0)
    sc.sidecar.service.fast_path_disabled = lambda tokenizer_hash: True  # what a confirmed mismatch does
    with Client(sc.path) as c:
        s = c.session("fb", text="hello", tokenizer="llama3")
        for piece in (" world", "!", " again"):
            assert s.append(piece).path == "full"
    body = samples(scrape(sc.sidecar.metrics_port))
    assert value(body, "toktier_full_path_fallbacks_total", tokenizer="llama3",
                 reason="fast path disabled for this session") == 3
    assert value(body, "toktier_session_ops_total", tokenizer="llama3", path="full") == 4
    assert value(body, "toktier_reused_tokens_total", tokenizer="llama3") == 0  # everything re-tokenized
    assert value(body, "toktier_reused_bytes_total", tokenizer="llama3") == 0


def test_tokenizer_label_is_a_loaded_tokenizer_never_a_client_guess(start_sidecar):
    sc = start_sidecar(metrics_port=0, lazy_load=False)
    with Client(sc.path) as c:
        with pytest.raises(KeyError):
            c.encode("x", tokenizer="no-such-tokenizer-123")
        c.encode("stateless", tokenizer="llama3")
        c.ping()
    text = scrape(sc.sidecar.metrics_port)
    assert "no-such-tokenizer-123" not in text
    body = samples(text)
    assert value(body, "toktier_request_seconds_count", op="encode", tokenizer="llama3") == 1
    assert value(body, "toktier_request_seconds_count", op="encode", tokenizer="") == 1  # the refused one
    assert value(body, "toktier_request_seconds_count", op="ping", tokenizer="") == 1
    assert value(body, "toktier_requests_total", op="encode", outcome="unknown_tokenizer") == 1


@pytest.mark.parametrize("rate", [0.01, 0.25, 0.0])
def test_sample_rate_gauge_is_the_configured_rate(start_sidecar, rate):
    sc = start_sidecar(metrics_port=0, verify_rate=rate)
    body = samples(scrape(sc.sidecar.metrics_port))
    assert ("toktier_shadow_sample_rate", ()) in body
    assert value(body, "toktier_shadow_sample_rate") == rate


def test_only_the_metrics_path_is_served(start_sidecar):
    sc = start_sidecar(metrics_port=0)
    port = sc.sidecar.metrics_port
    for path in ("/", "/foo", "/metrics/", "/metrics/x", "/favicon.ico", "/debug/vars"):
        with pytest.raises(urllib.error.HTTPError) as ei:
            urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10)
        assert ei.value.code == 404, path
        assert b"toktier_" not in ei.value.read()
    assert "toktier_requests_total" in scrape(port, "/metrics")
    assert "toktier_requests_total" in scrape(port, "/metrics?debug=1")  # a query string is no other path


def test_build_info_tokenizer_info_and_process_metrics(start_sidecar, llama3):
    sc = start_sidecar(metrics_port=0)
    body = samples(scrape(sc.sidecar.metrics_port))
    build = [dict(ls) for (n, ls), v in body.items() if n == "toktier_build_info" and v == 1]
    assert len(build) == 1 and build[0]["version"] == toktier.__version__
    assert build[0]["python"] == ".".join(map(str, sys.version_info[:3]))
    info = [dict(ls) for (n, ls), v in body.items() if n == "toktier_tokenizer_info" and v == 1]
    assert {"tokenizer": "llama3", "hash": llama3.hash[:16], "family": llama3.family or "",
            "engine": llama3.engine_label, "spliceable": "true" if llama3.spliceable else "false",
            "specials": "all"} in info
    if os.path.exists("/proc/self/stat"):
        assert value(body, "process_resident_memory_bytes") > 0
        assert value(body, "process_open_fds") > 0
        assert value(body, "process_cpu_seconds_total") > 0


def test_log_says_where_metrics_are_served(start_sidecar, caplog):
    with caplog.at_level(logging.INFO, logger="toktier_sidecar.metrics"):
        sc = start_sidecar(metrics_port=0)
    url = f"http://127.0.0.1:{sc.sidecar.metrics_port}/metrics"
    assert any(url in rec.getMessage() for rec in caplog.records), [r.getMessage() for r in caplog.records]


def test_toktier_serve_process_logs_its_metrics_url(tmp_path):
    """A real ``toktier serve`` process: its log names the metrics URL, which serves the metrics."""
    sock_dir = tmp_path / "run"
    sock_dir.mkdir(mode=0o700)
    prefix = f"ttmetrics{os.getpid()}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "toktier_sidecar.cli", "--socket", str(sock_dir / "t.sock"), "--tokenizer",
         "cl100k_base", "--metrics-port", "0", "--verify-rate", "0.01", "--shm-prefix", prefix],
        stderr=subprocess.PIPE, text=True, cwd=tmp_path,
    )
    try:
        url = None
        log_lines = []
        deadline = time.monotonic() + 120
        while url is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            log_lines.append(line)
            m = re.search(r"metrics served on (http://127\.0\.0\.1:\d+/metrics)", line)
            url = m.group(1) if m else None
        assert url, "".join(log_lines)
        with Client(str(sock_dir / "t.sock")) as c:
            c.session("p", text="hello", tokenizer="cl100k_base").append(" world")
        with urllib.request.urlopen(url, timeout=10) as resp:
            body = samples(resp.read().decode())
        assert value(body, "toktier_session_ops_total", tokenizer="cl100k_base", path="full") == 1
        assert total(body, "toktier_session_ops_total", tokenizer="cl100k_base") == 2
        assert value(body, "toktier_shadow_sample_rate") == 0.01
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert shm_names(prefix) == []


def test_readme_documents_every_served_metric(start_sidecar):
    """The README's Metrics table names exactly the metric families a server exposes (the shadow
    verifier's included)."""
    sc = start_sidecar(metrics_port=0, verify_rate=0.5)
    with Client(sc.path) as c:
        c.session("doc", text="hello", tokenizer="llama3").append(" world")
    body = scrape(sc.sidecar.metrics_port)
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("## Metrics"):]
    documented = {n for pair in re.findall(r"^\| `([a-z_*]+)`(?:, `([a-z_]+)`)?", section, re.M) for n in pair if n}
    served = {t for t in re.findall(r"^# TYPE (\S+)", body, re.M) if not t.endswith("_created")}
    assert documented - served == {"process_*"} or not os.path.exists("/proc/self/stat")
    assert {t for t in served - documented if not t.startswith("process_")} == set()
