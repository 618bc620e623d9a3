"""The deployment pieces as shipped: the systemd units pass ``systemd-analyze verify`` and score
<= 2.0 on ``systemd-analyze security --offline``; the units, sysusers.d, tmpfiles.d and config
agree with each other and apply (``scripts/install-service.sh --root``: real systemd-sysusers and
systemd-tmpfiles into a staging root); the sandbox's W^X rule holds for a real sidecar; and
``scripts/start.sh`` installs only when the install is missing or stale."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import toktier

ROOT = Path(__file__).resolve().parents[2]
UNITS = ROOT / "sidecar" / "systemd"
SERVICE, SOCKET = UNITS / "toktier.service", UNITS / "toktier.socket"
INSTALL = ROOT / "scripts" / "install-service.sh"
MAX_EXPOSURE = 2.0


def need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.skip(f"{tool} is not installed (systemd's tools; the check needs them)")
    return path


def directives(path: Path) -> dict[str, list[str]]:
    """{key: [values in order]} of a unit file, continuation lines joined."""
    out: dict[str, list[str]] = {}
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")) and "=" in line:
            k, v = line.split("=", 1)
            out.setdefault(k.strip(), []).append(v.strip())
    return out


def exec_start() -> list[str]:
    (cmd,) = directives(SERVICE)["ExecStart"]
    return shlex.split(cmd)


def test_security_exposure_is_at_most_2():
    tool = need("systemd-analyze")
    out = subprocess.run([tool, "security", "--offline=yes", "--no-pager", str(SERVICE)],
                         capture_output=True, text=True, timeout=60)
    m = re.search(r"Overall exposure level for toktier\.service: (\d+\.\d+)", out.stdout + out.stderr)
    assert m, out.stdout + out.stderr
    assert float(m.group(1)) <= MAX_EXPOSURE, out.stdout


def test_units_pass_systemd_analyze_verify(tmp_path):
    """Verified as shipped except ExecStart's venv (which exists only once installed): pointed at
    an executable here, everything else unchanged."""
    tool = need("systemd-analyze")
    fake = tmp_path / "venv" / "bin" / "toktier"
    fake.parent.mkdir(parents=True)
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    service = SERVICE.read_text()
    assert service.count("/opt/toktier/venv/bin/toktier ") == 1
    (tmp_path / "toktier.service").write_text(service.replace("/opt/toktier/venv/bin/toktier ", f"{fake} "))
    shutil.copy(SOCKET, tmp_path / "toktier.socket")
    out = subprocess.run([tool, "verify", "--man=no", str(tmp_path / "toktier.service"),
                          str(tmp_path / "toktier.socket")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "toktier" not in out.stdout + out.stderr, out.stdout + out.stderr


def test_units_sysusers_tmpfiles_and_config_agree():
    svc, sock = directives(SERVICE), directives(SOCKET)
    argv = exec_start()
    # ExecStart runs the venv the install helper builds, never whatever `toktier` is on PATH
    assert argv[0] == "/opt/toktier/venv/bin/toktier" and argv[1] == "serve"
    assert re.search(r'^prefix=/opt/toktier$', INSTALL.read_text(), re.M)
    opt = {argv[i]: argv[i + 1] for i in range(2, len(argv) - 1, 2)}
    (listen,) = sock["ListenStream"]
    assert opt["--socket"] == listen == "/run/toktier/toktier.sock"
    assert opt["--config"] == "/etc/toktier/toktier.toml"
    assert opt["--group"] == sock["SocketGroup"][0] == "toktier-clients" in svc["SupplementaryGroups"]
    assert svc["User"] == sock["SocketUser"] == ["toktier"] and sock["SocketMode"] == ["0660"]
    sysusers = (UNITS / "toktier.sysusers").read_text().splitlines()
    assert "g toktier-clients  -" in sysusers
    assert any(re.match(r"u toktier\s", x) for x in sysusers)
    assert any(re.match(r"m toktier\s+toktier-clients$", x) for x in sysusers)
    assert "d /run/toktier 0750 toktier toktier-clients -" in (UNITS / "toktier.tmpfiles").read_text()
    # the class-table cache and the data dir are the unit's own writable directories
    env = dict(e.split("=", 1) for e in svc["Environment"])
    assert svc["CacheDirectory"] == ["toktier"] and env["TOKTIER_CACHE_DIR"] == "%C/toktier"
    assert svc["StateDirectory"] == ["toktier"] and env["TOKTIER_DATA_DIR"] == "%S/toktier/data"
    assert "/run/toktier" in svc["ReadWritePaths"] and "/dev/shm" in svc["ReadWritePaths"]
    assert "RuntimeDirectory" not in svc  # it would remove the socket's directory at every stop
    assert "ExecStartPre" not in svc  # the server's startup sweep removes stale segments
    # the command line parses as `toktier serve` arguments (the group resolved on the target)
    from toktier_sidecar import cli

    args = cli.build_parser().parse_args([a if a != "toktier-clients" else "0" for a in argv[2:]])
    assert args.socket_path == listen


def test_install_helper_stages_users_runtime_dir_units_and_config(tmp_path):
    need("systemd-sysusers")
    need("systemd-tmpfiles")
    root = tmp_path / "root"
    out = subprocess.run(["bash", str(INSTALL), "--root", str(root)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    passwd = {ln.split(":")[0]: ln.split(":") for ln in (root / "etc/passwd").read_text().splitlines()}
    group = {ln.split(":")[0]: ln.split(":") for ln in (root / "etc/group").read_text().splitlines()}
    uid, home = int(passwd["toktier"][2]), passwd["toktier"][5]
    clients_gid = int(group["toktier-clients"][2])
    assert home == "/var/lib/toktier" and "toktier" in group["toktier-clients"][3].split(",")
    run = (root / "run/toktier").stat()
    assert (run.st_mode & 0o7777, run.st_uid, run.st_gid) == (0o750, uid, clients_gid)
    assert (root / "etc/systemd/system/toktier.service").read_text() == SERVICE.read_text()
    assert (root / "etc/systemd/system/toktier.socket").read_text() == SOCKET.read_text()
    # the staged config is a valid sidecar config that admits the clients' group
    from toktier_sidecar import cli

    config = cli.load_config(cli.build_parser().parse_args(["--config", str(root / "etc/toktier/toktier.toml")]))
    assert config.allowed_gids == frozenset({clients_gid}) and config.tokenizers == ("llama3",)
    assert config.metrics_addr == "127.0.0.1" and config.metrics_port
    # an existing config is kept; another prefix rewrites ExecStart
    (root / "etc/toktier/toktier.toml").write_text('tokenizers = ["cl100k_base"]\n')
    out = subprocess.run(["bash", str(INSTALL), "--root", str(root), "--prefix", "/srv/tt"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (root / "etc/toktier/toktier.toml").read_text() == 'tokenizers = ["cl100k_base"]\n'
    assert "ExecStart=/srv/tt/venv/bin/toktier serve" in (root / "etc/systemd/system/toktier.service").read_text()


def _mdwe_available() -> bool:
    """PR_SET_MDWE (Linux 6.3+): the kernel's own MemoryDenyWriteExecute= (refuse W+X mappings)."""
    return os.uname().sysname == "Linux" and tuple(int(x) for x in re.findall(r"\d+", os.uname().release)[:2]) >= (6, 3)


MDWE_EXEC = textwrap.dedent("""
    import ctypes, os, sys
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(65, 1, 0, 0, 0) != 0:  # PR_SET_MDWE, MDWE_REFUSE_EXEC_GAIN
        sys.exit(f"PR_SET_MDWE failed: errno {ctypes.get_errno()}")
    os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
""")


@pytest.mark.skipif(not _mdwe_available(), reason="needs Linux >= 6.3 for PR_SET_MDWE (the unit's "
                    "MemoryDenyWriteExecute=, applied without systemd)")
def test_sidecar_serves_exactly_under_memory_deny_write_execute(tmp_path):
    """The unit sets MemoryDenyWriteExecute=yes: a real `toktier serve` (native engine, numpy,
    uvloop, msgspec, metrics) under the kernel's same W^X rule serves exact IDs."""
    from toktier_client import Client

    sock = tmp_path / "run" / "t.sock"
    sock.parent.mkdir(mode=0o700)
    probe = subprocess.run([sys.executable, "-c", MDWE_EXEC, "-c", "import mmap\ntry:\n mmap.mmap(-1, 4096, "
                            "prot=7)\nexcept OSError:\n print('refused')"], capture_output=True, text=True, timeout=60)
    if probe.returncode != 0 or probe.stdout.strip() != "refused":
        pytest.skip(f"PR_SET_MDWE not enforced here: {probe.stdout} {probe.stderr}")
    prefix = f"ttmdwe{os.getpid()}"
    proc = subprocess.Popen([sys.executable, "-c", MDWE_EXEC, "-m", "toktier_sidecar.cli", "--socket", str(sock),
                             "--tokenizer", "llama3", "--shm-prefix", prefix, "--metrics-port", "0"],
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        lines = []
        while True:
            line = proc.stderr.readline()
            assert line, "".join(lines)  # exited before serving
            lines.append(line)
            if "serving on" in line:
                break
        tok = toktier.load_tokenizer("llama3")
        with Client(str(sock)) as c:
            s = c.session("w^x", text="def f(x):\n    return x\n" * 50, tokenizer="llama3")
            text = "def f(x):\n    return x\n" * 50
            for piece in (" # one", "\nprint(f(2))\n", " 123 456"):
                text += piece
                assert np.array_equal(s.append(piece).ids, tok.encode(text))
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
    assert proc.returncode == 0


# ----------------------------------------------------------------------------- start.sh
FAKE_PYTHON = """#!/usr/bin/env bash
# A venv python that records pip calls instead of running them.
if [[ "${1:-}" == "-m" && "${2:-}" == "pip" ]]; then echo "pip ${*:3}" >> "$(dirname "$0")/../pip.log"; exit 0; fi
if [[ "$*" == *"import toktier"* ]]; then
  [[ -e "$(dirname "$0")/../broken" ]] && exit 1
  cd /  # import the real packages, not this fake project's toktier/ directory
fi
exec %s "$@"
"""


def test_start_sh_installs_only_when_missing_or_stale(tmp_path):
    """start.sh in a copy of the project whose .venv python records pip calls: the first start
    installs, later starts do not (offline: no pip at all), a change to pyproject.toml or to the
    native engine's sources reinstalls, a Python source change does not (the install is editable),
    nor does an unimportable install go unnoticed."""
    proj = tmp_path / "proj"
    (proj / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "start.sh", proj / "scripts" / "start.sh")
    (proj / "pyproject.toml").write_text('[project]\nname = "toktier"\n')
    (proj / "toktier" / "native").mkdir(parents=True)
    (proj / "toktier" / "native" / "engine.hpp").write_text("// v1\n")
    (proj / "toktier" / "session.py").write_text("# v1\n")
    venv_bin = proj / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "python").write_text(FAKE_PYTHON % shlex.quote(sys.executable))
    (venv_bin / "toktier").write_text('#!/usr/bin/env bash\necho "toktier $*"\n')
    for f in ("python", "toktier"):
        (venv_bin / f).chmod(0o755)
    pip_log = proj / ".venv" / "pip.log"

    def start(*extra_env: str) -> str:
        env = {**os.environ, "TOKTIER_SOCKET": str(tmp_path / "t.sock")}
        env.update(e.split("=", 1) for e in extra_env)
        out = subprocess.run(["bash", "scripts/start.sh"], cwd=proj, capture_output=True, text=True, env=env,
                             timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout

    def installs() -> int:
        return len(pip_log.read_text().splitlines()) if pip_log.exists() else 0

    assert start("TOKTIER_START_DRY_RUN=1").strip() == "install: no install stamp"
    assert start() == f"toktier serve --socket {tmp_path / 't.sock'}\n" and installs() == 1
    assert "install -q -e ." in pip_log.read_text()
    assert start("TOKTIER_START_DRY_RUN=1").strip() == "up to date"
    start()
    start()
    assert installs() == 1  # up to date: no pip, no package index
    (proj / "toktier" / "session.py").write_text("# v2\n")
    start()
    assert installs() == 1  # editable: Python sources are live
    (proj / "toktier" / "native" / "engine.hpp").write_text("// v2\n")
    assert start("TOKTIER_START_DRY_RUN=1").startswith("install: ")
    start()
    assert installs() == 2  # the compiled engine must be rebuilt
    (proj / "pyproject.toml").write_text('[project]\nname = "toktier"\nversion = "2"\n')
    start()
    assert installs() == 3
    start()
    assert installs() == 3
    (proj / ".venv" / "broken").write_text("")
    assert start("TOKTIER_START_DRY_RUN=1").strip() == "install: toktier is not importable from .venv"
