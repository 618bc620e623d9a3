"""Rollouts forked from one long prompt (issue 17: `Conversation.fork`, token-in turns).

An RL rollout framework renders one prompt, forks it once per rollout, and feeds each fork the
model's sampled IDs and the tool results turn by turn.  For each prompt size this builds the
prompt (a system message, a task, then user messages of 5K characters of code up to the size),
makes ``--forks`` forks and times each fork's ``--turns`` token-in turns
(``append_generated(sampled, then=[tool result])``, 1.5K characters sampled, a 3K tool result),
against the stateless peer of `bench.conversation_replay`: render the fork's whole conversation
through the same template and encode it with fastokens (input cache on, array output; its cache
holds the shared prompt after the first fork).  Engines alternate op by op, so each op runs
after the other's cache sweep, as in the replay.  Reported: P50 ms of the first turn of a fork
(what forking costs), of the later turns, and of the peer.

Checked: each fork's IDs after its last turn equal those of a conversation built from the same
messages and sampled IDs without forking (forks are exact copies), and the peer's IDs are the HF
reference encode of its render on the last fork.

    python -m bench.conversation_forks [--sizes 100000,1000000] [--forks 8] [--turns 3]
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np


def main(argv: list[str] | None = None) -> int:
    import toktier
    from toktier.conversation import Conversation
    from toktier.tools.corpus import large_text

    from bench.conversation_replay import template_for

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="100000,1000000", help="prompt characters")
    ap.add_argument("--forks", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--track-drift", default="on_read", choices=("on", "off", "on_read"))
    args = ap.parse_args(argv)
    drift = {"on": True, "off": False, "on_read": "on_read"}[args.track_drift]

    tok = toktier.load_tokenizer("qwen3")
    template = template_for("qwen3")
    stop = tok.encode("<|im_end|>")
    try:  # (the `bench` extra; without it the forks are still timed and checked)
        from bench.baselines import EngineUnavailable
        from bench.peers import fastokens_factory

        peer = fastokens_factory(tok)()
    except (ImportError, EngineUnavailable) as exc:
        peer = None
        print(f"NOTE: the fastokens peer is unavailable ({exc}); no peer column")
    print(f"## forked rollouts — {platform.machine()}, qwen3, {args.forks} forks x {args.turns} turns, "
          f"track_drift={args.track_drift}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; P50 ms")
    print("\n| prompt chars | fork's first turn | later turns | render + fastokens | ratio (first / later) |")
    print("|---:|---:|---:|---:|---|")
    bad = 0
    for size in (int(x) for x in args.sizes.split(",")):
        code = large_text(size, seed=1, kind="code")
        prompt = [{"role": "system", "content": "You are a coding agent."},
                  {"role": "user", "content": "Task: read these files, then fix the failing test."},
                  *[{"role": "user", "content": code[i:i + 5000]} for i in range(0, len(code), 5000)]]
        base = Conversation(tok, template, track_drift=drift)
        base.append_messages(prompt)
        first, later, peer_ms = [], [], []
        for f in range(args.forks):
            sampled = [np.concatenate([tok.encode(large_text(1500, seed=100 * f + t, kind="english")), stop])
                       for t in range(args.turns)]
            tools = [[{"role": "tool", "content": large_text(3000, seed=100 * f + t + 50, kind="code")}]
                     for t in range(args.turns)]
            conv = base.fork()
            for t in range(args.turns):
                t0 = time.perf_counter()
                conv.append_generated(sampled[t], then=tools[t])
                (first if t == 0 else later).append(time.perf_counter() - t0)
                messages = list(conv.messages)
                if peer is not None:
                    t0 = time.perf_counter()
                    got = peer(template.render(messages, add_generation_prompt=True))
                    peer_ms.append(time.perf_counter() - t0)
            twin = Conversation(tok, template, track_drift=False)
            twin.append_messages(prompt)
            for t in range(args.turns):
                twin.append_generated(sampled[t], then=tools[t])
            if not np.array_equal(conv.ids, twin.ids):
                bad += 1
                print(f"MISMATCH: fork {f} of the {size:,}-character prompt differs from its unforked twin")
        if peer is not None and not np.array_equal(got, tok.encode(template.render(messages,
                                                                                    add_generation_prompt=True))):
            bad += 1
            print(f"MISMATCH: the peer's IDs at {size:,} characters")
        a, b = (1e3 * float(np.median(x)) if x else float("nan") for x in (first, later))
        if peer is None:
            print(f"| {size:,} | {a:.3f} | {b:.3f} | - | - |", flush=True)
            continue
        p = 1e3 * float(np.median(peer_ms))
        print(f"| {size:,} | {a:.3f} | {b:.3f} | {p:.3f} | {p / a:.1f}x / {p / b:.1f}x |", flush=True)
    print(f"\nmismatches: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
