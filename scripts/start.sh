#!/usr/bin/env bash
# Install TokTier into .venv and start the main job.
# Default: a demo replay of a growing agent session, repaired vs. full re-tokenization.
# Arguments pass through to `toktier` (e.g. `bash scripts/start.sh serve --socket /tmp/tt.sock`).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e '.[data]' -e ./clients/python
if [[ $# -eq 0 ]]; then set -- demo; fi
exec .venv/bin/toktier "$@"
