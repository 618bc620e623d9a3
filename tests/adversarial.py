"""Hypothesis strategies for adversarial tokenizer input.

Alphabets are chosen to sit on every rule of every family: digit runs of all
kinds, whitespace of all kinds (CR/LF split, U+3000, U+0085, NBSP), contractions
in both cases, o200k case changes, combining marks and NFC-composable pairs,
kana with DeepSeek's in-class punctuation, fractions and superscripts, emoji ZWJ
sequences, control characters, and fragments of added-token literals.
"""

from __future__ import annotations

from hypothesis import strategies as st

ATOMS = [
    # letters: ASCII both cases, Latin-1, Greek, Cyrillic, Arabic (+ diacritics), CJK, kana
    "a", "b", "Z", "Q", "é", "ß", "Ω", "ж", "Я", "م", "ر", "\u064e", "\u0651", "中", "文", "あ", "ア",
    "・", "ー", "゛", "\u3099", "한", "ǅ", "ʰ",
    # combining marks and NFC-composable sequences
    "e\u0301", "\u0301", "\u0327", "A\u030a", "\u1100\u1161", "\u11a8", "Å",
    # digits
    "0", "1", "7", "9", "١", "٣", "０", "½", "²", "Ⅻ", "12345",
    # whitespace
    " ", "  ", "\t", "\n", "\r", "\r\n", "\n\n", "\u00a0", "\u3000", "\u2028", "\x0b", "\x0c", "\x85",
    # punctuation / symbols / contractions
    "'", "'s", "'S", "'ll", "'VE", "'d", "\"", "/", ".", ",", "!", "?", "-", "_", "(", ")", "{", "}",
    "<", ">", "|", "=", "#", "$", "。", "，", "、", "？", "«", "—", "…", "€", "©", "+", "*",
    # words in mixed case (o200k case rule), camelCase, code
    "Hello", "hello", "WORLD", "camelCase", "HTTPServer", "def", "self.x", "0x1F", "ID", "iPhone",
    # emoji, ZWJ sequences, variation selectors, flags
    "😀", "👨\u200d👩\u200d👧", "\u200d", "\ufe0f", "🇺🇸", "👍🏽",
    # control characters
    "\x00", "\x1f", "\x7f",
    # added-token literals and fragments (several families)
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|", "|>", "<|im_",
    "start|>", "<|begin_of_text|>", "<|eot_id|>", "<｜User｜>", "<｜Assistant｜>", "<｜", "｜>",
    "<tool_call>", "<|endofprompt|>",
]

atom = st.sampled_from(ATOMS)
adversarial_text = st.lists(atom, min_size=0, max_size=60).map("".join)
nonempty_adversarial_text = st.lists(atom, min_size=1, max_size=60).map("".join)
