#!/usr/bin/env bash
# Install TokTier into .venv and start the main job: the sidecar, serving the bundled
# default tokenizer (llama3) on a Unix socket ($TOKTIER_SOCKET, default
# ${XDG_RUNTIME_DIR:-/tmp}/toktier.sock).  Arguments replace the default command and
# pass through to `toktier`, e.g. `bash scripts/start.sh demo` (a replay of a growing
# session, repair vs. full re-tokenization) or `bash scripts/start.sh serve --help`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e .
if [[ $# -eq 0 ]]; then
  set -- serve --socket "${TOKTIER_SOCKET:-${XDG_RUNTIME_DIR:-/tmp}/toktier.sock}"
fi
exec .venv/bin/toktier "$@"
