"""Tooling around the TokTier library: what checks, exercises and drives it, but never serves with it.

This package owns:

- `toktier.tools.cli`: the ``toktier`` console command (``python -m toktier`` too);
- `toktier.tools.verify`: ``toktier verify``, differential campaigns against the reference
  tokenizers (multiprocessing runner, shrinking, reproducers);
- `toktier.tools.corpus`: real-text corpora for tests and benchmarks, the adversarial atom
  alphabet, and the ``chat_wrap`` chat-template renderer;
- `toktier.tools.faults`: fault injection (deliberately wrong token IDs) for the shadow verifier's
  tests and ``toktier verify --inject-faults``;
- `toktier.tools.demo`: ``toktier demo``, a growing-session replay.

``import toktier`` never loads this package (``tests/test_layering.py`` checks it), and the core
modules never import from it: the dependency points from tools to the library only.  Its
third-party dependencies (rich, faker, emoji) come with the ``tools`` extra, not with the library.
"""
