"""Hypothesis strategies for adversarial tokenizer input.

Alphabets are chosen to sit on every rule of every family: digit runs of all
kinds, whitespace of all kinds (CR/LF split, U+3000, U+0085, NBSP), contractions
in both cases, o200k case changes, combining marks and NFC-composable pairs,
kana with DeepSeek's in-class punctuation, fractions and superscripts, emoji ZWJ
sequences, control characters, and fragments of added-token literals.
"""

from __future__ import annotations

from hypothesis import strategies as st

from toktier.tools.corpus import ADVERSARIAL_ATOMS

ATOMS = list(ADVERSARIAL_ATOMS)

atom = st.sampled_from(ATOMS)
adversarial_text = st.lists(atom, min_size=0, max_size=60).map("".join)
nonempty_adversarial_text = st.lists(atom, min_size=1, max_size=60).map("".join)
