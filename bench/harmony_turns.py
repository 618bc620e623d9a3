"""gpt-oss agent rollouts: per-turn prompt IDs through the harmony format (issue 17, gpt-oss).

This module owns the gpt-oss conversation benchmark: a seeded agent rollout in harmony's terms
(reasoning, 1-2 tool calls per turn with JSON arguments, real tool results of realistic sizes from
`bench.conversation_replay`'s material, now and then a final answer and a new user request), and
a per-turn replay of it through each engine, every checked turn compared with the exact IDs.

Engines (timed per turn: everything from the turn's input to the next prompt's IDs as an array):

* ``toktier``: ``toktier.Conversation(tok, tools=...)`` (openai-harmony's renderer, `toktier.harmony`):
  text mode ``append_messages([assistant, *results])``; tokens mode ``append_generated(sampled,
  then=results)`` (the sampled turn as gpt-oss writes it: analysis, then a call to
  ``functions.*`` ending ``<|call|>``, or a final answer ending ``<|return|>``).
* ``harmony``: what a server that serves gpt-oss through openai-harmony does per request (vLLM):
  the OpenAI messages mapped to harmony messages, then the library's
  ``render_conversation_for_completion`` of the whole conversation, which returns token IDs
  (-> numpy).  Its IDs differ from the text contract only where a message spells a special token
  (none here: tests/test_harmony.py).
* ``render+tiktoken``: the whole conversation rendered to text (toktier's harmony renderer, fresh
  each turn as a stateless front end has it) then tiktoken ``encode_to_numpy`` of all of it.

Checked turns (every ``--every``-th and the last): in text mode every engine's IDs equal the
reference encoding (tiktoken) of the full render; in tokens mode toktier's IDs are compared with
nothing else (the TITO definition is tests/test_harmony.py's) and its ``drift`` is reported.

Usage: ``python -m bench.harmony_turns [--chars 1000000] [--modes text,tokens] [--every 8]``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np

BUCKETS = ((0, "<100K"), (100_000, "100K"), (300_000, "300K"), (1_000_000, "1M"), (2_000_000, "2M+"))


@dataclass(frozen=True)
class Turn:
    assistant: dict  # the message the sampled turn stands for
    completion: str  # the sampled text (harmony, after ``<|start|>assistant``), its stop included
    results: tuple[dict, ...]


def make_rollout(target_chars: int, seed: int = 0) -> tuple[list[dict], list[Turn], list[dict]]:
    """(start messages, turns, tools) of a seeded gpt-oss agent rollout reaching `target_chars`."""
    from bench import conversation_replay as cr

    rng = random.Random(seed)
    start = [{"role": "system", "content": "You are a careful coding agent. Use the tools; answer briefly."},
             {"role": "user", "content": "The test suite fails on CI. Find out why and fix it."}]
    turns: list[Turn] = []
    chars, n = 2_000, 0
    while chars < target_chars:
        reasoning = cr._prose(rng, cr._lognormal(rng, 300, 1_500, 40, 6_000))
        if rng.random() < 0.08:  # a final answer, then the user asks for more
            answer = cr._prose(rng, cr._lognormal(rng, 600, 2_500, 80, 6_000))
            assistant = {"role": "assistant", "reasoning_content": reasoning, "content": answer}
            completion = (f"<|channel|>analysis<|message|>{reasoning}<|end|><|start|>assistant<|channel|>final"
                          f"<|message|>{answer}<|return|>")
            results = ({"role": "user", "content": cr._prose(rng, cr._lognormal(rng, 150, 600, 20, 2_000))},)
        else:
            name = cr._pick(rng, cr.TOOL_WEIGHTS)
            make, median, p90, hi = cr.TOOL_RESULT[name]
            args, output = make(rng, cr._lognormal(rng, median, p90, 40, hi))
            arguments = json.dumps(args, ensure_ascii=False)
            call_id = f"call_{n}"
            assistant = {"role": "assistant", "reasoning_content": reasoning, "content": "",
                         "tool_calls": [{"id": call_id, "type": "function",
                                         "function": {"name": name, "arguments": arguments}}]}
            completion = (f"<|channel|>analysis<|message|>{reasoning}<|end|><|start|>assistant to=functions.{name}"
                          f"<|channel|>commentary <|constrain|>json<|message|>{arguments}<|call|>")
            results = ({"role": "tool", "tool_call_id": call_id, "content": output},)
        turns.append(Turn(assistant, completion, results))
        chars += len(completion) + sum(len(str(m["content"])) for m in results) + 60
        n += 1
    return start, turns, list(cr.TOOLS)


def _bucket(chars: int) -> str:
    label = BUCKETS[0][1]
    for lo, name in BUCKETS:
        if chars >= lo:
            label = name
    return label


def run(target_chars: int, modes: list[str], every: int, seed: int) -> dict:
    import tiktoken

    import toktier
    from toktier import chat, harmony

    tok = toktier.load_tokenizer("o200k_harmony")
    template = chat.template_for("o200k_harmony")
    enc = harmony._library().encoding
    ref = tiktoken.Encoding("o200k_harmony_ref", pat_str=tok.engine.pat_str, mergeable_ranks=tok.engine._args[2],
                            special_tokens=dict(tok.table.literal_ids))
    start, turns, tools = make_rollout(target_chars, seed)
    out: dict = {"chars": target_chars, "turns": len(turns), "modes": {}}
    for mode in modes:
        conv = toktier.Conversation(tok, tools=tools)
        conv.append_messages(start)
        messages = list(start)
        times: dict[str, list[tuple[int, float]]] = {"toktier": [], "harmony": [], "render+tiktoken": []}
        drifted = checked = 0
        rng = random.Random(seed + 1)
        for k, turn in enumerate(turns):
            messages = messages + [turn.assistant, *turn.results]
            got: dict[str, np.ndarray] = {}
            order = list(times)
            rng.shuffle(order)
            for name in order:
                t0 = time.perf_counter()
                if name == "toktier":
                    if mode == "text":
                        r = conv.append_messages([turn.assistant, *turn.results])
                    else:
                        sampled = enc.encode(turn.completion, allowed_special="all")
                        r = conv.append_generated(sampled, then=list(turn.results))
                    ids = r.ids
                elif name == "harmony":
                    bound = template.bind(tools=tools)  # (a server maps each request's messages afresh)
                    ids = np.asarray(bound.library_tokens(chat.prepare_messages(messages), True), dtype=np.uint32)
                else:
                    text = template.bind(tools=tools)(chat.prepare_messages(messages), True)
                    ids = ref.encode_to_numpy(text, allowed_special="all")
                dt = time.perf_counter() - t0
                times[name].append((conv.num_chars, dt))
                got[name] = ids
            if k % every == 0 or k == len(turns) - 1:
                checked += 1
                want = tok.encode(template.render(messages, add_generation_prompt=True, tools=tools))
                for name, ids in got.items():
                    if name == "toktier" and mode == "tokens":
                        continue
                    if not np.array_equal(np.asarray(ids), want):
                        raise SystemExit(f"{name} diverged from the exact IDs at turn {k} ({mode} mode)")
            drifted += r.drift is not None
        rows = {}
        for name, pts in times.items():
            by: dict[str, list[float]] = {}
            for chars, dt in pts:
                by.setdefault(_bucket(chars), []).append(dt)
            rows[name] = {b: {"n": len(v), "p50_ms": statistics.median(v) * 1e3,
                              "p99_ms": sorted(v)[min(len(v) - 1, int(len(v) * 0.99))] * 1e3} for b, v in by.items()}
        out["modes"][mode] = {"rows": rows, "checked": checked, "turns_with_drift": drifted,
                              "render_stats": str(conv.render_stats)}
    return out


def report(res: dict) -> None:
    print(f"# gpt-oss rollouts (o200k_harmony, openai-harmony renderer): {res['turns']} turns to "
          f"{res['chars']:,} characters")
    for mode, m in res["modes"].items():
        print(f"\n## {mode} mode ({m['checked']} turns checked; drift on {m['turns_with_drift']} turns; "
              f"{m['render_stats']})\n")
        buckets = [b for _, b in BUCKETS if b in m["rows"]["toktier"]]
        print("| context | toktier P50 / P99 ms | harmony (library render) P50 ms | render+tiktoken P50 ms "
              "| harmony ÷ toktier | render+tiktoken ÷ toktier |")
        print("|---|---|---|---|---|---|")
        for b in buckets:
            t, h, r = (m["rows"][e][b] for e in ("toktier", "harmony", "render+tiktoken"))
            print(f"| {b} (n={t['n']}) | {t['p50_ms']:.3f} / {t['p99_ms']:.2f} | {h['p50_ms']:.2f} | {r['p50_ms']:.2f} "
                  f"| {h['p50_ms'] / t['p50_ms']:.1f}x | {r['p50_ms'] / t['p50_ms']:.1f}x |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chars", type=int, default=1_000_000)
    ap.add_argument("--modes", default="text,tokens")
    ap.add_argument("--every", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    res = run(args.chars, args.modes.split(","), args.every, args.seed)
    report(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
