#!/usr/bin/env bash
# Install TokTier with its test extras into .venv and run the test suite.
# Extra pytest arguments pass through (e.g. `bash scripts/test.sh -k session`,
# `bash scripts/test.sh --runslow` for the long differential campaigns).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e '.[test]'
bash scripts/fetch-test-data.sh
bash scripts/fetch-chat-templates.sh
exec .venv/bin/python -m pytest "$@"
