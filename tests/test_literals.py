"""The literal index against a brute-force reading of 'some occurrence spans i, or starts at i after
possible whitespace other than a line break'."""

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
            if start > 0 and (buf[start - 1] in b" \t\x0b\x0c\x1c\x1d\x1e\x1f" or buf[start - 1] >= 0x80):
                out[start] = True
            start = buf.find(b, start + 1)
    return out


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["<", "|", ">", "im", "_", "start", "think", "/", "a", "x", "<|im_start|>",
                                  " ", "\n", "\t", "\u00a0"]),
                max_size=40).map("".join), st.lists(st.sampled_from(LITS), min_size=1, max_size=6, unique=True))
def test_crossed_equals_brute_force(text, lits):
    buf = text.encode()
    assert LiteralIndex(lits).crossed(buf).tolist() == brute(buf, lits)


def test_multibyte_literals():
    lits = ["<｜User｜>", "<｜Assistant｜>"]
    buf = "hi <｜User｜> there".encode()
    assert LiteralIndex(lits).crossed(buf).tolist() == brute(buf, lits)
