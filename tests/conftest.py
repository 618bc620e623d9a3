"""Shared fixtures: real reference tokenizers, slow-test gating, and a differential-check tally.

The tally prints, at the end of the run, how many differential checks ran per
tokenizer family and level (pieces / ids / session), so a run reports its own
coverage.
"""

from __future__ import annotations

import collections
import os

import pytest
from hypothesis import settings

import toktier
from toktier.errors import TokenizerDataMissing

ALL_TOKENIZERS = ("cl100k_base", "o200k_base", "llama3", "deepseek_v4", "qwen3")
HF_TOKENIZERS = ("llama3", "deepseek_v4", "qwen3")

_TALLY: collections.Counter = collections.Counter()

# Failures print a reproduction blob; `pytest --hypothesis-seed=N` replays a run.
settings.register_profile("toktier", print_blob=True)
settings.load_profile("toktier")


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run slow differential campaigns")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long campaigns (run with --runslow)")
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_WorkerTallies())


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


# Under pytest-xdist (scripts/test.sh runs the suite on every core) each worker process counts its
# own checks: it hands them over when it finishes, and the controller, which prints the summary,
# adds them up.
def pytest_sessionfinish(session):
    out = getattr(session.config, "workeroutput", None)
    if out is not None:  # an xdist worker
        out["toktier_tally"] = [[label, level, n] for (label, level), n in _TALLY.items()]


class _WorkerTallies:
    """Registered only where xdist is installed (the hook is xdist's: pytest refuses it without);
    only a controller calls it."""

    @staticmethod
    def pytest_testnodedown(node, error):
        for label, level, n in getattr(node, "workeroutput", {}).get("toktier_tally", []):
            _TALLY[(label, level)] += n


def pytest_terminal_summary(terminalreporter):
    if not _TALLY:
        return
    terminalreporter.section("differential checks against the reference")
    for (label, level), n in sorted(_TALLY.items()):
        terminalreporter.write_line(f"{label:<12} {level:<10} {n:>10,}")


class Tally:
    """Counts differential checks: `tally(tok, "ids", n)`."""

    def __call__(self, tok: toktier.FrozenTokenizer, level: str, n: int = 1) -> None:
        _TALLY[(tok.family or f"none:{tok.name}", level)] += n

    def labelled(self, label: str, level: str, n: int) -> None:
        """Counts under a label of the caller's choosing (e.g. many crafted files of one family)."""
        _TALLY[(label, level)] += n


@pytest.fixture(scope="session")
def tally() -> Tally:
    return Tally()


_LOADED: dict[tuple[str, str], toktier.FrozenTokenizer] = {}


def get_tokenizer(name: str, specials: str = "all") -> toktier.FrozenTokenizer:
    """Load once per test run; skip (with the reason) when the data is not installed."""
    key = (name, specials)
    if key not in _LOADED:
        try:
            _LOADED[key] = toktier.load_tokenizer(name, specials=specials)
        except TokenizerDataMissing as exc:
            if os.environ.get("CI") and name != "qwen3":
                raise
            pytest.skip(str(exc))
    return _LOADED[key]


@pytest.fixture(params=ALL_TOKENIZERS)
def tok(request) -> toktier.FrozenTokenizer:
    return get_tokenizer(request.param)


@pytest.fixture(params=HF_TOKENIZERS)
def hf_tok(request) -> toktier.FrozenTokenizer:
    return get_tokenizer(request.param)
