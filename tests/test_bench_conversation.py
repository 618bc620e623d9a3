"""Smoke test of the conversation benchmark (bench/conversation_replay.py): it must not rot.

Each family's rollout is replayed at the smallest size through every engine available here, in
both modes; the checks are the benchmark's own: no text-mode divergence from the exact re-render,
no drift for the re-rendering engines, and the TITO baseline's drift starting at the first
non-canonical sampled token (llama3_1, deepseek_v3: no template rewrites earlier turns there).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench` lives at the repository root

cr = pytest.importorskip("bench.conversation_replay")

ENGINES = ("toktier", "toktier-onread", "render+hf", "render+fastokens", "tito", "tito-full")


@pytest.mark.parametrize("family", sorted(cr.FAMILIES))
def test_replay_smallest(family):
    ro = cr.make_rollout(family, 10_000, seed=0)
    assert ro.turns and ro.turns[-1].prompt_chars >= 10_000
    assert any(t.split is not None for t in ro.turns), "token mode needs a non-canonical split to report drift"
    notes: list[str] = []
    for mode in ("text", "tokens+split"):
        res = cr.replay(ro, mode, ENGINES, log=notes.append)
        ran = set(res["engines"])
        assert "render+hf" in ran
        if cr.conversation_class()[0] is not None:
            assert "toktier" in ran, notes
        assert ("tito" in ran) == (mode != "text"), notes
        for name in ran - {"render+hf"}:
            assert len(res["times"][name]["<100K"]) == len(ro.turns)  # timed on every turn
        assert res["checked"] == len(ro.turns)
        rows = cr.summarize(res)
        assert rows and rows[0]["bucket"] == "<100K"
        if mode == "text":
            assert not any(res["diverged"].values()), res["diverged"]
            continue
        for name in ran & {"render+hf", "render+fastokens"}:
            assert all(d is None for _, d in res["drift"][name])  # they re-render: no sampled IDs kept
        if family != "qwen3":
            assert res["drift"]["tito"][-1][1] == res["first_split_at"]
        if "toktier" in ran:
            assert all(reported == ours for _, reported, ours in res["toktier_drift_reported"])
        if "toktier-onread" in ran:  # drift read on every checked turn (here: every turn)
            assert len(res["onread_drift_reported"]) == res["checked"]
            assert all(read == ours for _, read, ours in res["onread_drift_reported"])


def test_conversation_cpu_runs_and_compares_two_trees(capsys):
    """bench.conversation_cpu: one family and mode in this process, then the A/B driver against
    this same checkout (two subprocesses, each importing toktier from the tree it was given)."""
    cpu = pytest.importorskip("bench.conversation_cpu")
    got = cpu.measure("llama3_1", "tokens", 0, 8_000, renders=True)
    assert got["turns"] > 0 and got["p50_ms"] > 0 and got["renders_per_turn"] > 0
    assert {"render_2_us", "render_7_us", "render_13_us"} <= set(got)
    root = str(Path(__file__).resolve().parents[1])
    assert cpu.main(["--families", "llama3_1", "--modes", "text", "--lo", "0", "--hi", "6000", "--ab", root]) == 0
    out = capsys.readouterr().out
    assert "| llama3_1 text |" in out and "ab ÷ this" in out


def test_conversation_forks_smallest(capsys):
    """`bench/conversation_forks.py` at its smallest: every fork equals its unforked twin (the
    bench's own check), with or without the fastokens peer installed."""
    from bench import conversation_forks

    assert conversation_forks.main(["--sizes", "20000", "--forks", "2", "--turns", "2"]) == 0
    out = capsys.readouterr().out
    assert "| 20,000 |" in out and "mismatches: 0" in out
