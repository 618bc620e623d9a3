"""The `toktier` console command: `toktier demo | serve | tokenizers | verify`, `toktier --version`.

This module owns argument dispatch and nothing else.  Each subcommand's module is imported inside
its own branch, so `toktier tokenizers` loads neither the server nor the campaign runner, and the
server is named in one constant (`SERVE_MODULE`).  ``python -m toktier`` runs :func:`main` through
a shim in ``toktier/__main__.py``; ``import toktier`` never loads this module.
"""

from __future__ import annotations

import argparse
import importlib
import sys

import toktier
from toktier.errors import TokenizerDataMissing, UnknownTokenizer

# Imported only by `toktier serve`: the library must not depend on the server that wraps it.
SERVE_MODULE = "toktier_sidecar.cli"

# Third-party modules of the ``tools`` extra: a missing one gets an install hint, not a traceback.
_TOOLS_EXTRA_MODULES = frozenset({"rich", "faker", "emoji"})


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="toktier", description="Exact incremental tokenization")
    parser.add_argument("--version", action="version", version=f"toktier {toktier.__version__}")
    sub = parser.add_subparsers(dest="cmd", required=True)
    demo = sub.add_parser("demo", help="replay a growing session: repair vs. full re-tokenization")
    demo.add_argument("--tokenizer", default="llama3")
    demo.add_argument("--start-chars", type=int, default=100_000)
    demo.add_argument("--steps", type=int, default=40)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--kind", default="code", choices=["code", "english", "mixed", "multilingual"])
    sub.add_parser("tokenizers", help="list bundled tokenizers and their families")
    # `serve` and `verify` own their parsers; these entries only make them show up in --help.
    sub.add_parser("serve", help="start the sidecar (see `toktier serve --help`)")
    sub.add_parser("verify", help="differential campaigns against the reference tokenizers (`toktier verify --help`)")
    return parser


def _tokenizers() -> int:
    """One line per bundled tokenizer.  A listing that could report every name succeeded (exit 0):
    a tokenizer whose data is not installed is listed as unavailable, its message (how to get the
    file) on stderr."""
    for name in toktier.list_tokenizers():
        try:
            tok = toktier.load_tokenizer(name)
        except TokenizerDataMissing as exc:
            print(f"{name:<14} unavailable (see stderr)")
            print(f"{name}: {exc}", file=sys.stderr)
            continue
        splicing = "splicing" if tok.spliceable else f"full path only ({tok.family_reason})"
        print(f"{name:<14} family={tok.family or '-':<10} hash={tok.hash[:16]}  {splicing}")
    return 0


def _dispatch(argv: list[str]) -> int:
    # `serve` and `verify` are routed before argparse so that their own --help and options work.
    if argv and argv[0] == "serve":
        serve = importlib.import_module(SERVE_MODULE)
        return int(serve.main(argv[1:]) or 0)
    if argv and argv[0] == "verify":
        from toktier.tools import verify

        return int(verify.main(argv[1:]) or 0)
    args = _build_parser().parse_args(argv)
    if args.cmd == "demo":
        from toktier.tools import demo

        return demo.run_demo(demo.DemoConfig(args.tokenizer, args.start_chars, args.steps, args.seed, args.kind))
    if args.cmd == "tokenizers":
        return _tokenizers()
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _dispatch(argv)
    except TokenizerDataMissing as exc:  # the message says how to get the file
        print(f"toktier: {exc}", file=sys.stderr)
        return 1
    except UnknownTokenizer as exc:  # the message lists the known names
        print(f"toktier: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        if exc.name not in _TOOLS_EXTRA_MODULES:
            raise
        print(f"toktier: {argv[0] if argv else 'this command'} needs {exc.name!r}: "
              f"pip install 'toktier[tools]'", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
