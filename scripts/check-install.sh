#!/usr/bin/env bash
# The package as a user installs it: a fresh virtual environment, `pip install .` (a
# wheel build, not editable), then `toktier serve` on a private socket and one client
# session through the installed `toktier_client`, checked against the reference.
# Run by .ci/run after the test suite.  Usage: bash scripts/check-install.sh
# (PYTHON=python3.10 bash scripts/check-install.sh checks the oldest supported Python.)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
work="$(mktemp -d)"
server_pid=""
cleanup() {
  if [[ -n "$server_pid" ]] && kill -0 "$server_pid" 2>/dev/null; then
    kill -TERM "$server_pid" && wait "$server_pid" || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

"$PY" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q --upgrade pip >/dev/null
"$work/venv/bin/python" -m pip install -q .
"$work/venv/bin/toktier" --version

sock="$work/run/toktier.sock"
mkdir -m 0700 "$work/run"
# A TOML config (tomllib, or tomli before Python 3.11) names the tokenizer.
printf 'tokenizers = ["cl100k_base"]\nverify_rate = 0.5\n' > "$work/toktier.toml"
(cd "$work" && exec "$work/venv/bin/toktier" serve --socket "$sock" --config "$work/toktier.toml") &
server_pid=$!

# From a directory outside the checkout, so nothing is imported from the source tree.
cd "$work"
"$work/venv/bin/python" - "$sock" <<'EOF'
import sys, time

import toktier
import toktier_client

sock = sys.argv[1]
deadline = time.monotonic() + 60
while True:
    try:
        client = toktier_client.Client(sock)
        break
    except (OSError, toktier_client.TokTierError):
        if time.monotonic() > deadline:
            raise SystemExit("the installed sidecar did not come up within 60 s")
        time.sleep(0.2)
tok = toktier.load_tokenizer("cl100k_base")
# The wheel carries the compiled engine, and it certifies on this machine.
assert tok.engine_label == "native", tok.native_reason
s = client.session("install-check", tokenizer="cl100k_base")
text = ""
for piece in ["def pipe", "line(x):\n", "    return x  # 12345\n" * 40, "<|endoftext|> done"]:
    r = s.append(piece)
    text += piece
    assert r.ids.tolist() == tok.encode(text).tolist(), "installed sidecar diverged from the reference"
assert "site-packages" in toktier.__file__ and "site-packages" in toktier_client.__file__
print(f"install check: toktier {toktier.__version__} serve + client OK ({len(r.ids)} tokens, path {r.path})")
client.close()
EOF
