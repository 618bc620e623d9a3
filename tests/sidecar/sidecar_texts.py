"""Seeded text and op generators for sidecar tests (seams that move token boundaries)."""

from __future__ import annotations

import random

FRAGMENTS = [
    "def pipe", "line(x):\n", "    return x", " + 1\n", "Hello", ", world", "!", " ", "  ", "\n\n", "\t",
    "123", "4567", "89", "don't", "'s", "'LL", "naïve café", "東京タワー", "🙂", "👩‍💻", " <|eot_id|>",
    "<|begin_of_text|>", "```python\n", "```\n", "{\"k\": [1, 2]}", "...", "—", "\r\n", "ÅÄÖ", "x" * 40,
]


def fragment(rng: random.Random) -> str:
    return "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 6)))


def random_op(rng: random.Random, text: str) -> tuple[str, tuple]:
    """("append", (t,)) | ("edit", (start, end, t)) | ("sync", (full,)) applicable to ``text``."""
    r = rng.random()
    if r < 0.6 or not text:
        return "append", (fragment(rng),)
    if r < 0.85:
        start = rng.randint(0, len(text))
        end = min(len(text), start + rng.randint(0, 12))
        return "edit", (start, end, fragment(rng) if rng.random() < 0.8 else "")
    cut = rng.randint(max(0, len(text) - 40), len(text))
    return "sync", (text[:cut] + fragment(rng),)


def apply_op(text: str, kind: str, args: tuple) -> str:
    if kind == "append":
        return text + args[0]
    if kind == "edit":
        start, end, t = args
        return text[:start] + t + text[end:]
    return args[0]
