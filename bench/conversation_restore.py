"""What keeping a conversation across a restart costs: record size, write and restore time.

For each family and size, a token-in rollout of ``bench.conversation_replay.make_rollout`` (tool
calls, think blocks, sampled turns pinned verbatim) is built as one ``toktier.Conversation``, then:

* *snapshot*: ``Conversation.state()`` plus a copy of the IDs (what the sidecar's loop thread does);
* *encode*: ``ConversationRecord.from_state`` + ``encode_conversation_record`` (the writer thread);
* *restore*: ``decode_conversation_record`` + ``ConversationRecord.restore`` (a replay: one render
  and encode of the whole conversation, one windowed op per sampled run, IDs checked against the
  record's CRC);
* *warm turn*: the median of the rollout's last turns on the live conversation (sampled IDs pinned,
  tool results appended), for scale.

Timings are ``time.perf_counter`` medians of ``--reps`` runs in one process (the machine is shared:
read ratios).  Every restored conversation is compared with the live one (IDs, text, drift); the
script exits 1 on any difference.

    python -m bench.conversation_restore --families qwen3,llama3_1 --chars 100000,1000000
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

import toktier
from toktier.conversation_record import ConversationRecord, decode_conversation_record, encode_conversation_record

from .conversation_replay import make_rollout


def build(ro, warm_turns: int) -> tuple[toktier.Conversation, list[float]]:
    conv = toktier.Conversation(ro.tokenizer, ro.template, **ro.render_kwargs)
    conv.append_messages(ro.start)
    times = []
    for i, turn in enumerate(ro.turns):
        t0 = time.perf_counter()
        conv.append_generated(turn.sampled)
        conv.append_messages(list(turn.results))
        if i >= len(ro.turns) - warm_turns:
            times.append(time.perf_counter() - t0)
    return conv, times


def measure(family: str, chars: int, reps: int) -> dict:
    ro = make_rollout(family, chars, seed=0)
    conv, warm = build(ro, warm_turns=min(16, len(ro.turns)))
    tok = ro.tokenizer
    snap, enc, res = [], [], []
    ok = True
    for _ in range(reps):
        t0 = time.perf_counter()
        state, ids = conv.state(), np.array(conv.ids)
        t1 = time.perf_counter()
        data = encode_conversation_record(ConversationRecord.from_state(state, ids, tok, namespace=0,
                                                                        conversation="c", seq=1))
        t2 = time.perf_counter()
        back = decode_conversation_record(data).restore(tok, template=ro.template)
        t3 = time.perf_counter()
        snap.append(t1 - t0)
        enc.append(t2 - t1)
        res.append(t3 - t2)
        ok &= bool(np.array_equal(back.ids, conv.ids)) and back.text == conv.text and back.drift == conv.drift
    return dict(family=family, chars=conv.num_chars, tokens=conv.num_tokens, turns=len(ro.turns), bytes=len(data),
                snapshot=statistics.median(snap), encode=statistics.median(enc), restore=statistics.median(res),
                warm=statistics.median(warm), ok=ok)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--families", default="qwen3,llama3_1,deepseek_v3")
    ap.add_argument("--chars", default="100000,1000000")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    print("| family | chars | tokens | runs | record bytes (per char) | snapshot ms | encode ms | restore ms "
          "| warm turn P50 ms | restore ÷ warm turn | equal |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    bad = 0
    for family in args.families.split(","):
        for chars in (int(x) for x in args.chars.split(",")):
            r = measure(family, chars, args.reps)
            bad += not r["ok"]
            print(f"| {family} | {r['chars']:,} | {r['tokens']:,} | {r['turns']} | {r['bytes']:,} "
                  f"({r['bytes'] / r['chars']:.2f}) | {1e3 * r['snapshot']:.2f} | {1e3 * r['encode']:.2f} "
                  f"| {1e3 * r['restore']:.1f} | {1e3 * r['warm']:.2f} | {r['restore'] / r['warm']:.0f}x "
                  f"| {r['ok']} |", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
