"""Command line: `toktier demo | serve | tokenizers | verify`."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve":
        from sidecar.cli import main as serve_main  # the sidecar owns all I/O

        return int(serve_main(argv[1:]) or 0)
    if argv and argv[0] == "verify":
        from .verify import main as verify_main

        return int(verify_main(argv[1:]) or 0)
    parser = argparse.ArgumentParser(prog="toktier", description="Exact incremental tokenization")
    sub = parser.add_subparsers(dest="cmd", required=True)
    demo = sub.add_parser("demo", help="replay a growing session: repair vs. full re-tokenization")
    demo.add_argument("--tokenizer", default="llama3")
    demo.add_argument("--start-chars", type=int, default=100_000)
    demo.add_argument("--steps", type=int, default=40)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--kind", default="code", choices=["code", "english", "mixed", "multilingual"])
    sub.add_parser("tokenizers", help="list bundled tokenizers and their families")
    sub.add_parser("serve", help="start the sidecar (see `toktier serve --help`)")
    sub.add_parser("verify", help="differential campaigns against the reference tokenizers (`toktier verify --help`)")
    args = parser.parse_args(argv)
    if args.cmd == "demo":
        from .demo import DemoConfig, run_demo

        return run_demo(DemoConfig(args.tokenizer, args.start_chars, args.steps, args.seed, args.kind))
    if args.cmd == "tokenizers":
        from .errors import TokenizerDataMissing
        from .registry import list_tokenizers, load_tokenizer

        for name in list_tokenizers():
            try:
                tok = load_tokenizer(name)
                print(f"{name:<14} family={tok.family or '-':<10} hash={tok.hash[:16]}"
                      + (f"  ({tok.family_reason})" if tok.family_reason else ""))
            except TokenizerDataMissing as exc:
                print(f"{name:<14} unavailable: {exc}")
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
