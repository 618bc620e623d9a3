#!/usr/bin/env bash
# Start the main job: the sidecar, serving the bundled default tokenizer (llama3) on a Unix
# socket: $TOKTIER_SOCKET, else the one default every part of TokTier uses
# (toktier_client.paths: $XDG_RUNTIME_DIR/toktier/toktier.sock, /run/toktier/toktier.sock as
# root, else /tmp/toktier-<uid>/toktier.sock, in a private 0700 directory).
#
# Installs into .venv (an editable `pip install -e .`, which compiles the native engine) only
# when the install is missing or stale: no import of toktier/toktier_sidecar/toktier_client,
# or a change to what an editable install bakes in (pyproject.toml, setup.py, the native
# engine's C++/Cython sources, the Python version) since the last install.  When up to date it
# starts offline and silent.  TOKTIER_START_DRY_RUN=1 only prints that decision.
#
# Arguments replace the default command and pass through to `toktier`, e.g.
# `bash scripts/start.sh demo` (a replay of a growing session, repair vs. full
# re-tokenization) or `bash scripts/start.sh serve --help`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
stamp_file=.venv/.toktier-install-stamp

# What an editable install depends on beyond the Python sources it links to.
install_stamp() {
  {
    .venv/bin/python -c 'import sys; print(sys.version)'
    for f in pyproject.toml setup.py setup.cfg MANIFEST.in; do
      [[ -f "$f" ]] && { echo "$f"; cat "$f"; }
    done
    # (not *.cpp: _engine.cpp is Cython's output, rewritten by every build)
    find toktier/native -type f \( -name '*.pyx' -o -name '*.pxd' -o -name '*.hpp' -o -name '*.h' \) 2>/dev/null | LC_ALL=C sort | while read -r f; do echo "$f"; cat "$f"; done
  } | sha256sum | cut -d' ' -f1
}

install_reason() {
  if [[ ! -x .venv/bin/python ]]; then
    echo "no .venv"
  elif ! .venv/bin/python -c 'import toktier, toktier_sidecar, toktier_client' >/dev/null 2>&1; then
    echo "toktier is not importable from .venv"
  elif [[ ! -f "$stamp_file" ]]; then
    echo "no install stamp"
  elif [[ "$(cat "$stamp_file")" != "$(install_stamp)" ]]; then
    echo "pyproject.toml, setup.py or the native sources changed since the last install"
  fi
}

reason="$(install_reason)"
if [[ "${TOKTIER_START_DRY_RUN:-0}" == 1 ]]; then
  if [[ -n "$reason" ]]; then echo "install: $reason"; else echo "up to date"; fi
  exit 0
fi
if [[ -n "$reason" ]]; then
  echo "start.sh: installing into .venv ($reason)" >&2
  if [[ ! -x .venv/bin/python ]]; then
    "$PY" -m venv .venv
    .venv/bin/python -m pip install -q --upgrade pip >/dev/null
  fi
  log=.venv/install.log
  if ! .venv/bin/python -m pip install -q -e . >"$log" 2>&1; then
    cat "$log" >&2
    echo "start.sh: pip install failed (log above, also in $log)" >&2
    exit 1
  fi
  install_stamp > "$stamp_file"
fi

if [[ $# -eq 0 ]]; then
  # The one default path (this also creates its private directory); a client without
  # $TOKTIER_SOCKET finds the sidecar there.
  sock="$(.venv/bin/python -c '
try:
    from toktier_client.paths import default_socket_path
except ImportError:  # an older client: `toktier serve` applies its own default
    raise SystemExit(0)
print(default_socket_path())')"
  set -- serve ${sock:+--socket "$sock"}
fi
exec .venv/bin/toktier "$@"
