"""Session starts on a GPU machine: the GPU path against TokTier's CPU path and the CPU peers (needs a GPU).

    python bench/gpu_session_start.py [--tokenizers llama3,o200k_base] [--sizes 100000,1000000,4000000]

The question it answers: on a node that has a GPU *and* many cores, which engine should take a
session start?  Per tokenizer and size, on the same three texts (``bench.peers.session_starts``:
chat-wrapped code, a different text per repetition so no whole-input cache can answer), the
median of three of:

* ``toktier Session(tok, ctx) (gpu)``: a session start whose full path has the GPU router
  (what ``toktier serve`` does on a GPU machine): UTF-8, literal scan, uploads, the kernels,
  ids + spans back, then the session's offsets;
* ``toktier Session(tok, ctx) (full path)`` / ``toktier encode_full``: the CPU path on all of
  the machine's cores (the native engine when its extension is built for this Python, else HF
  chunks: the ``cpu engine`` line says which);
* fastokens 0.3.5 and gigatoken 0.10.0: a fresh object warmed on an unrelated text (construction
  untimed), and one warm object across the three texts.

Every row's ids are compared with the reference (HF ``tokenizers`` / tiktoken) on every text;
``exact`` says so.  Writes ``$OUT/gpu_session_start.json`` when $OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import toktier  # noqa: E402
from toktier import Session  # noqa: E402
from toktier.fullpath import FullPath  # noqa: E402
from toktier.gpu.router import Router  # noqa: E402

from bench.peers import fastokens_factory, gigatoken_factory, session_starts  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizers", default="llama3,o200k_base")
    ap.add_argument("--sizes", default="100000,1000000,4000000")
    ap.add_argument("--content", default=None,
                    help="body kind of the context texts (bench.peers.body_text; default: code)")
    args = ap.parse_args(argv)
    router = Router()
    gpu_path = FullPath(gpu=router)
    rows = []
    print(f"cores={os.cpu_count()}")
    for name in args.tokenizers.split(","):
        tok = toktier.load_tokenizer(name)
        print(f"{name}: cpu engine {tok.engine_label}", flush=True)
        peers = {}
        for label, factory in (("fastokens", fastokens_factory), ("gigatoken", gigatoken_factory)):
            try:
                make = factory(tok)
                make()("warm up")
                peers[label] = make
            except Exception as exc:  # a peer missing on this machine is reported, not fatal
                print(f"  {label} unavailable: {type(exc).__name__}: {exc}")
        for size in (int(s) for s in args.sizes.split(",")):
            gpu_session = Session(tok, "warm the tables and graphs " * 200, full_path=gpu_path)
            del gpu_session
            out, exact = session_starts(tok, size, peers, None, content=args.content, extra={
                "toktier Session(tok, ctx) (gpu)": lambda c: Session(tok, c, full_path=gpu_path).ids})
            for label in sorted(out, key=out.get):
                rows.append(dict(tokenizer=name, chars=size, content=args.content or "code", engine=label,
                                 ms=out[label], exact=exact[label]))
                print(f"  {size:>9,} {label:<52} {out[label]:9.2f} ms  exact={exact[label]}", flush=True)
    print(f"full path with the GPU router: {gpu_path.stats()}; routes {router.counts}")
    if os.environ.get("OUT"):
        name = f"gpu_session_start{'_' + args.content if args.content else ''}.json"
        Path(os.environ["OUT"], name).write_text(json.dumps(rows, indent=1))
    return 0 if all(r["exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
