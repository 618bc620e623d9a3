"""The literal index against a brute-force reading of 'some occurrence spans i'."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from toktier.literals import LiteralIndex

LITS = ["<|im_start|>", "<|im", "im_", "|>", "<|", "<think>", "</think>", "<think></think>", "aa", "aaa"]


def brute(buf: bytes, lits: list[str]) -> list[bool]:
    out = [False] * (len(buf) + 1)
    for lit in lits:
        b = lit.encode()
        start = buf.find(b)
        while start != -1:
            for i in range(start + 1, start + len(b)):
                out[i] = True
            start = buf.find(b, start + 1)
    return out


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["<", "|", ">", "im", "_", "start", "think", "/", "a", "x", "<|im_start|>"]),
                max_size=40).map("".join), st.lists(st.sampled_from(LITS), min_size=1, max_size=6, unique=True))
def test_crossed_equals_brute_force(text, lits):
    buf = text.encode()
    assert LiteralIndex(lits).crossed(buf).tolist() == brute(buf, lits)


def test_multibyte_literals():
    lits = ["<｜User｜>", "<｜Assistant｜>"]
    buf = "hi <｜User｜> there".encode()
    assert LiteralIndex(lits).crossed(buf).tolist() == brute(buf, lits)
