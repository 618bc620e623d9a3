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
# The --state-store tests start a real Valkey/Redis server (Debian package redis-server); install
# it when missing and we can, else they skip with a note.
if ! command -v valkey-server >/dev/null && ! command -v redis-server >/dev/null; then
    if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
        echo "installing redis-server for the state-store tests" >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server >/dev/null 2>&1 \
            || { apt-get update -qq >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server >/dev/null 2>&1; } \
            || echo "note: could not install redis-server; the state-store tests will skip" >&2
    else
        echo "note: no redis-server or valkey-server (apt-get install redis-server as root); the state-store tests will skip" >&2
    fi
fi
bash scripts/fetch-chat-templates.sh
# The suite runs on up to 4 worker processes (pytest-xdist; one per core, whole test files per
# worker so module fixtures are built once): 11-12 minutes on 2 cores, against 16-17 in one
# process.  TOKTIER_TEST_WORKERS=0 runs it in this process (a debugger, `-x` on the first failure).
if [[ -z "${TOKTIER_TEST_WORKERS:-}" ]]; then
    cores=$(nproc 2>/dev/null || echo 1)
    TOKTIER_TEST_WORKERS=$(( cores < 4 ? cores : 4 ))
fi
exec .venv/bin/python -m pytest -n "$TOKTIER_TEST_WORKERS" --dist loadfile "$@"
