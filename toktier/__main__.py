"""`python -m toktier`: the `toktier` command, which lives in `toktier.tools.cli` (tooling, not the library)."""
from toktier.tools.cli import main

if __name__ == "__main__":  # importing this module (pydoc, autodoc) must not run the command
    raise SystemExit(main())
