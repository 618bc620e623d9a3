"""`toktier demo`: replay a growing agent-style session, repair vs. full re-tokenization.

Each step appends a chunk of real text (median ~1.4K chars) to a session and
checks the repaired IDs against the reference encoding of the whole text, timing
both.  It exits non-zero on any mismatch (there should be none).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import numpy as np

from toktier.registry import load_tokenizer
from toktier.session import Session

from .corpus import large_text


@dataclass(frozen=True)
class DemoConfig:
    tokenizer: str = "llama3"
    start_chars: int = 100_000
    steps: int = 40
    seed: int = 0
    kind: str = "code"


def run_demo(cfg: DemoConfig, out=print) -> int:
    tok = load_tokenizer(cfg.tokenizer)
    rng = random.Random(cfg.seed)
    sizes = [max(1, int(rng.lognormvariate(np.log(1400), 1.0))) for _ in range(cfg.steps)]
    material = large_text(cfg.start_chars + sum(sizes), seed=cfg.seed, kind=cfg.kind)
    out(f"tokenizer {tok.name} (family {tok.family}, hash {tok.hash[:12]}); "
        f"session starts with {cfg.start_chars:,} chars of real {cfg.kind}")
    session = Session(tok, material[: cfg.start_chars])
    pos = cfg.start_chars
    out(f"{'step':>4} {'context':>10} {'append':>7} {'tokens':>9} {'repair ms':>10} {'full ms':>9} "
        f"{'speedup':>8}  path")
    mismatches = 0
    for i, n in enumerate(sizes):
        chunk = material[pos : pos + n]
        pos += n
        t0 = time.perf_counter()
        r = session.append(chunk)
        t1 = time.perf_counter()
        ref = tok.encode(session.text)
        t2 = time.perf_counter()
        ok = np.array_equal(r.ids, ref)
        mismatches += not ok
        rep, full = (t1 - t0) * 1e3, (t2 - t1) * 1e3
        out(f"{i:>4} {session.num_chars:>10,} {n:>7,} {session.num_tokens:>9,} {rep:>10.3f} {full:>9.2f} "
            f"{full / rep:>7.0f}x  {r.path.value}{'' if ok else '  MISMATCH'}")
    st = session.stats
    out(f"outcomes: first_window={st.first_window} widened={st.widened} full={st.full} "
        f"(initial encode counts as full); mismatches={mismatches}")
    return 1 if mismatches else 0
