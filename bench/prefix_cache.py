"""PrefixCache on a stateless front end's workload, against a full re-encode and a session, same run.

Workload per context size N: a shared system prompt (~30K chars) and `--convs` conversations
whose history brings them to N characters; every call resends the whole text (no session id).
Each turn grows a conversation by ~1.4K characters; every 4th turn is followed by a retry (the
last turn replaced by another one), and every conversation after the first starts as a branch
of the first one's current text (parallel sub-agents over one context).

Engines, timed on the same calls:
  cache    `PrefixCache.encode(text)`                       (reported per layer: l0 / l1 / miss)
  full     `tok.encode_fast(text)`                          (what a stateless server does today)
  session  `Session.append(delta)` / `sync(text)`           (a server that has a session id)

IDs of the cache are compared with the reference (`tok.encode`) on every 8th call.
The machine is shared: read the ratios, not the absolute numbers.

    python -m bench.prefix_cache --sizes 100000 1000000 --turns 24
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import toktier
from toktier.tools.corpus import large_text

SYSTEM_CHARS = 30_000
TURN_CHARS = 1_400


def run(tok_name: str, size: int, turns: int, convs: int) -> dict:
    tok = toktier.load_tokenizer(tok_name)
    material = large_text(size + (turns + 2) * convs * 2 * TURN_CHARS + 10 * TURN_CHARS)
    system = material[:SYSTEM_CHARS]
    cursor = SYSTEM_CHARS
    cache = toktier.PrefixCache(tok)
    times: dict[str, list[float]] = {"l0": [], "l1": [], "miss": [], "full": [], "session": []}
    calls = checked = 0

    def take(n: int) -> str:
        nonlocal cursor
        out = material[cursor : cursor + n]
        cursor += n
        return out

    def call(text: str, session: toktier.Session) -> None:
        nonlocal calls, checked
        t0 = time.perf_counter()
        r = cache.encode(text)
        t1 = time.perf_counter()
        if r.layer != "miss":
            times[r.layer].append(t1 - t0)
            t2 = time.perf_counter()
            tok.encode_fast(text)
            times["full"].append(time.perf_counter() - t2)
            old = session.text if session.num_chars <= len(text) else ""
            t3 = time.perf_counter()
            if old and text.startswith(old):
                session.append(text[len(old):])
            else:
                session.sync(text)
            times["session"].append(time.perf_counter() - t3)
        else:
            times["miss"].append(t1 - t0)
            session.sync(text)
        if calls % 8 == 0:
            assert np.array_equal(r.ids, tok.encode(text)), f"cache IDs differ from the reference ({r.layer})"
            checked += 1
        calls += 1

    history = take(size - SYSTEM_CHARS)
    texts = [system + history]
    sessions = [toktier.Session(tok)]
    call(texts[0], sessions[0])
    for c in range(1, convs):  # branches of the first conversation
        texts.append(texts[0] + f"\n[agent {c}] " + take(TURN_CHARS))
        sessions.append(sessions[0].fork())
        call(texts[c], sessions[c])
    for turn in range(turns):
        for c in range(convs):
            texts[c] += f"\n[turn {turn}] " + take(TURN_CHARS)
            call(texts[c], sessions[c])
            if turn % 4 == 3:  # a retry: the last turn replaced
                cut = texts[c].rfind("\n[turn ")
                call(texts[c][:cut] + f"\n[turn {turn} retry] " + take(TURN_CHARS), sessions[c])
                call(texts[c], sessions[c])  # the accepted answer again (an exact resend)
    st = cache.stats()
    p50 = {k: statistics.median(v) * 1e3 for k, v in times.items() if v}
    return {"size": size, "calls": calls, "checked": checked, "p50_ms": p50, "n": {k: len(v) for k, v in times.items()},
            "bytes_held": st.bytes_held, "lookups": st.lookups, "full_fallbacks": st.full_fallbacks}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", default="llama3")
    ap.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument("--turns", type=int, default=24)
    ap.add_argument("--convs", type=int, default=3)
    args = ap.parse_args(argv)
    print(f"tokenizer {args.tokenizer}, {args.convs} conversations, {args.turns} turns, P50 ms")
    print(f"{'size':>9} {'l1':>8} {'l0':>8} {'miss':>8} {'full':>8} {'session':>8} {'full/l1':>8} {'l1/sess':>8}"
          f" {'full/l0':>8} {'MB held':>8} {'checked':>8}")
    for size in args.sizes:
        r = run(args.tokenizer, size, args.turns, args.convs)
        p = r["p50_ms"]
        get = lambda k: p.get(k, float("nan"))  # noqa: E731
        print(f"{size:>9} {get('l1'):>8.2f} {get('l0'):>8.2f} {get('miss'):>8.1f} {get('full'):>8.2f} "
              f"{get('session'):>8.2f} {get('full') / get('l1'):>8.1f} {get('l1') / get('session'):>8.1f} "
              f"{get('full') / get('l0'):>8.1f} {r['bytes_held']['l1'] / 1e6:>8.1f} {r['checked']:>8}")
        print(f"{'':>9} calls {r['n']}, lookups {r['lookups']}, full fallbacks {r['full_fallbacks']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
