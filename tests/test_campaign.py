"""Long differential campaigns (``--runslow``): many seeded session replays per tokenizer.

Set TOKTIER_CAMPAIGN_SECONDS (default 120 per tokenizer) and TOKTIER_TEST_SEED to
explore; a failure prints the seed, the sample and the op that diverged.
"""

from __future__ import annotations

import os
import random
import time

import pytest

from conftest import ALL_TOKENIZERS, get_tokenizer
from test_session import random_ops, replay
from toktier.tools.corpus import samples


@pytest.mark.slow
@pytest.mark.parametrize("name", ALL_TOKENIZERS)
def test_session_campaign(name, tally):
    tok = get_tokenizer(name)
    budget = float(os.environ.get("TOKTIER_CAMPAIGN_SECONDS", "120"))
    base_seed = int(os.environ.get("TOKTIER_TEST_SEED", "0")) * 1_000_003
    corpus = samples(max_chars_per_sample=60_000)
    deadline = time.monotonic() + budget
    seed = base_seed
    while time.monotonic() < deadline:
        seed += 1
        sample = corpus[seed % len(corpus)]
        text = sample.text
        if tok.family_info is not None and tok.family_info.nfc:
            text = tok.engine.normalize(text)
        rng = random.Random(seed)
        ops = random_ops(rng, text, 25, [1, 2, 5, 40, 300, 1400, 1400, 5000])
        replay(tok, ops, tally, seed=(name, sample.name, seed), window=rng.choice([64, 512, 512]))
