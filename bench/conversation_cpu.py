"""CPU per conversation turn, one engine in one process (issue 17): where `bench.conversation_replay`
interleaves engines (so each runs after the others' cache sweeps), this times TokTier alone, back
to back, in thread CPU time: the figure to compare two builds with.

For each family and mode it replays the rollout of `bench.conversation_replay.make_rollout` through
`toktier.Conversation` (text mode: `append_messages`; tokens mode: `append_generated(...,
then=...)` with drift tracking; tokens+split: the same with the replay's non-canonical samples, so
the IDs drift from the re-render from the first turn on) and reports, over the turns whose prompt is in [--lo, --hi)
characters, the P50 thread time per turn and the template renders per turn (one render giving the
text both with and without the generation prompt counts once).  `--renders` also
times one render of a window of 2, 7 and 13 messages (the system prompt and the last messages).

``--ab DIR`` runs the same in a subprocess against the `toktier` package of another checkout (a
git worktree of an older commit, say), alternating the two trees `--rounds` times, and prints both
with their ratio.  Nothing is checked here: `bench.conversation_replay` and the tests do that.

    python -m bench.conversation_cpu
    python -m bench.conversation_cpu --ab /tmp/wt-base --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def measure(family: str, mode: str, lo: int, hi: int, renders: bool) -> dict:
    """P50 thread ms per turn and renders per turn (and, with `renders`, µs per window render)."""
    from bench.conversation_replay import Step, TokTierConv, make_rollout

    ro = make_rollout(family, hi, seed=0)
    eng = TokTierConv(ro, track_drift=mode != "text")
    messages = list(ro.start)
    eng.start(messages)
    count = [0]
    plain = eng.conv._render

    def counted(ms: list, gp: bool) -> str:
        count[0] += 1
        return plain(ms, gp)

    eng.conv._render = counted
    memo = getattr(eng.conv, "_memo", None)
    both = getattr(memo, "_both", None)
    if both is not None:  # one render that gives the text with and without the generation prompt
        def counted_both(ms: list) -> tuple[str, str] | None:
            pair = both(ms)
            count[0] += pair is not None
            return pair

        memo._both = counted_both
    times, turns = [], 0
    for t in ro.turns:
        messages = messages + [t.assistant, *t.results]
        sampled = None if mode == "text" else t.split if mode == "tokens+split" and t.split is not None else t.sampled
        step = Step(t.assistant, sampled, list(t.results), messages)
        t0 = time.thread_time()
        eng.turn(step)
        dt = time.thread_time() - t0
        if hasattr(eng, "settle"):
            eng.settle()  # a background locality probe ends before the next turn (untimed)
        if lo <= t.prompt_chars < hi:
            times.append(dt)
            turns += 1
    out = {"family": family, "mode": mode, "turns": turns, "p50_ms": 1e3 * statistics.median(times),
           "renders_per_turn": count[0] / max(len(ro.turns), 1)}
    if renders:
        from toktier.chat import prepare_messages

        prepared = prepare_messages(messages)
        for k in (1, 6, 12):
            window = prepared[:1] + prepared[-k:]
            samples = []
            for _ in range(200):
                t0 = time.thread_time()
                plain(window, False)
                samples.append(time.thread_time() - t0)
            out[f"render_{k + 1}_us"] = 1e6 * statistics.median(samples)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default="llama3_1,qwen3,deepseek_v3")
    ap.add_argument("--modes", default="text,tokens")
    ap.add_argument("--lo", type=int, default=100_000)
    ap.add_argument("--hi", type=int, default=300_000)
    ap.add_argument("--renders", action="store_true", help="also time one render of 2, 7 and 13 messages")
    ap.add_argument("--ab", help="another checkout's root: measure its toktier too, alternating")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # family/mode: measure and print JSON (subprocess)
    ap.add_argument("--tree", help=argparse.SUPPRESS)  # with --one: the checkout whose toktier to import
    args = ap.parse_args(argv)
    if args.one:
        # toktier from --tree, imported first (later imports reuse it); bench from this checkout.
        sys.path.insert(0, args.tree or str(ROOT))
        import toktier

        if not Path(toktier.__file__).resolve().is_relative_to(Path(args.tree or ROOT).resolve()):
            raise SystemExit(f"toktier came from {toktier.__file__}, not {args.tree or ROOT}")
        sys.path.insert(0, str(ROOT))
        family, mode = args.one.split("/")
        print(json.dumps(measure(family, mode, args.lo, args.hi, args.renders)))
        return 0
    if args.ab and not (Path(args.ab) / "toktier" / "__init__.py").is_file():
        raise SystemExit(f"--ab {args.ab}: not a TokTier checkout (no toktier/__init__.py there); make one with "
                         f"`git worktree add DIR COMMIT` and copy in or build its native module")
    trees = [("this", ROOT)] + ([("ab", Path(args.ab).resolve())] if args.ab else [])
    rows: dict[tuple[str, str, str], list[dict]] = {}
    for _ in range(args.rounds):
        for family in args.families.split(","):
            for mode in args.modes.split(","):
                for name, tree in trees:  # each in its own process, with its tree's toktier
                    cmd = [sys.executable, str(ROOT / "bench" / "conversation_cpu.py"), "--one", f"{family}/{mode}",
                           "--tree", str(tree), "--lo", str(args.lo), "--hi", str(args.hi)]
                    got = subprocess.run(cmd + (["--renders"] if args.renders else []), cwd=ROOT, capture_output=True,
                                         text=True, check=True)
                    rows.setdefault((family, mode, name), []).append(json.loads(got.stdout.splitlines()[-1]))
    print(f"## CPU per conversation turn, {args.lo:,}-{args.hi:,} characters (P50 thread ms; min over "
          f"{args.rounds} round(s))")
    head = "| family / mode | this: ms/turn | renders/turn |" + (" ab: ms/turn | ab ÷ this |" if args.ab else "")
    if args.renders:
        head += " render 2 / 7 / 13 msgs (µs) |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for family in args.families.split(","):
        for mode in args.modes.split(","):
            this = min(rows[(family, mode, "this")], key=lambda r: r["p50_ms"])
            line = f"| {family} {mode} | {this['p50_ms']:.3f} | {this['renders_per_turn']:.2f} |"
            if args.ab:
                other = min(rows[(family, mode, "ab")], key=lambda r: r["p50_ms"])
                line += f" {other['p50_ms']:.3f} | {other['p50_ms'] / this['p50_ms']:.2f}x |"
            if args.renders:
                line += " " + " / ".join(f"{this[f'render_{k}_us']:.1f}" for k in (2, 7, 13)) + " |"
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
