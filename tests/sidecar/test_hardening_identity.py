"""Issue 15, impostors: one default socket path in a private directory, and a client that
checks who listens (SO_PEERCRED) and who owns every segment before trusting either.

Impostors run under another uid (forked children that drop privileges): those tests need root."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import socket
import stat
import subprocess
import sys
import tempfile

import numpy as np
import posix_ipc
import pytest

from toktier_client import AsyncClient, Client, InsecureRuntimeDir, ServerIdentityError
from toktier_client.paths import default_socket_path
from toktier_client.shm import HEADER_DTYPE, LAYOUT_VERSION, MAGIC, Mapping
from toktier_sidecar import ServerConfig
from toktier_sidecar.listen import bind_unix_socket
from sidecar_harness import llama3, registry, sidecar, start_sidecar  # noqa: F401  (fixtures)

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run an impostor under another uid")


def as_user(uid: int, fn) -> dict:
    """``fn()`` in a forked child under ``uid``; its JSON-able result or error."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            out = {"ok": fn()}
        except BaseException as exc:
            out = {"error": type(exc).__name__, "message": str(exc)}
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return json.loads(data)


@pytest.fixture
def env(monkeypatch):
    for name in ("TOKTIER_SOCKET", "XDG_RUNTIME_DIR", "TOKTIER_SERVER_UID"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


# ------------------------------------------------------------------ the one default path
def test_default_path_rules(env, tmp_path):
    env.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    path = default_socket_path()
    assert path == str(tmp_path / "toktier" / "toktier.sock")
    st = os.lstat(tmp_path / "toktier")
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
    env.setenv("TOKTIER_SOCKET", "/somewhere/else.sock")
    assert default_socket_path() == "/somewhere/else.sock"
    env.delenv("TOKTIER_SOCKET")
    env.delenv("XDG_RUNTIME_DIR")
    expected = "/run/toktier/toktier.sock" if os.geteuid() == 0 else f"/tmp/toktier-{os.geteuid()}/toktier.sock"
    assert default_socket_path(ensure_dir=False) == expected
    assert ServerConfig().socket_path == expected  # `toktier serve` uses the same function
    out = subprocess.run([sys.executable, "-c", "from toktier_client.paths import default_socket_path; "
                          "print(default_socket_path(ensure_dir=False))"], capture_output=True, text=True,
                         env={k: v for k, v in os.environ.items() if k not in ("TOKTIER_SOCKET", "XDG_RUNTIME_DIR")})
    assert out.stdout.strip() == expected, out.stderr


@needs_root
def test_default_path_for_an_unprivileged_user_is_a_private_tmp_dir(env):
    d = f"/tmp/toktier-{NOBODY}"
    shutil.rmtree(d, ignore_errors=True)
    try:
        out = as_user(NOBODY, lambda: default_socket_path())
        assert out == {"ok": f"{d}/toktier.sock"}, out
        st = os.lstat(d)
        assert st.st_uid == NOBODY and stat.S_IMODE(st.st_mode) == 0o700
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_insecure_runtime_dirs_are_refused(env, tmp_path):
    env.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    d = tmp_path / "toktier"
    d.mkdir(mode=0o700)
    os.chmod(d, 0o777)  # writable by everyone
    with pytest.raises(InsecureRuntimeDir, match="writable by group or others"):
        default_socket_path()
    d.rmdir()
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    d.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(InsecureRuntimeDir, match="symlink"):
        default_socket_path()
    with pytest.raises(InsecureRuntimeDir, match="symlink"):
        Client()  # no path: the same rule, before any connect
    if os.geteuid() == 0:
        d.unlink()
        d.mkdir(mode=0o700)
        os.chown(d, NOBODY, NOBODY)  # pre-created by another user
        with pytest.raises(InsecureRuntimeDir, match="owned by uid 65534"):
            default_socket_path()
    # the server refuses to bind in a shared directory too
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    with pytest.raises(InsecureRuntimeDir):
        bind_unix_socket(str(shared / "t.sock"), None)


def test_client_and_server_default_to_toktier_socket(env, tmp_path, start_sidecar, llama3):
    path = str(tmp_path / "priv" / "t.sock")
    sc = start_sidecar(socket_path=path)
    env.setenv("TOKTIER_SOCKET", path)
    with Client() as c:
        assert np.array_equal(c.session("d", text="hello").last.ids, llama3.encode("hello"))

    async def main():
        async with AsyncClient() as c:
            return (await c.ping()).monotonic > 0
    assert asyncio.run(main())
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    assert sc.path == path


# ------------------------------------------------------------------ SO_PEERCRED and segment owners
@pytest.fixture
def impostor():
    """A listener run by uid 65534 in a public directory; yields (path, received bytes)."""
    d = tempfile.mkdtemp(prefix="toktier-imp-")
    os.chmod(d, 0o1777)  # a shared directory, like /tmp: the impostor binds first
    path = os.path.join(d, "imp.sock")
    r, w = os.pipe()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.close(ready_r)
        got = b""
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            srv = socket.socket(socket.AF_UNIX)
            srv.bind(path)
            os.chmod(path, 0o666)
            srv.listen(8)
            os.write(ready_w, b"1")
            srv.settimeout(10)
            for _ in range(3):  # every client connects once
                conn, _ = srv.accept()
                conn.settimeout(1)
                try:
                    while chunk := conn.recv(65536):
                        got += chunk
                except OSError:
                    pass
                conn.close()
        except BaseException:
            pass
        os.write(w, got)
        os._exit(0)
    os.close(w)
    os.close(ready_w)
    assert os.read(ready_r, 1) == b"1"
    received = bytearray()
    yield path, received, lambda: received.extend(_finish(pid, r))
    shutil.rmtree(d, ignore_errors=True)


def _finish(pid: int, r: int) -> bytes:
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return data


@needs_root
def test_client_refuses_an_impostor_before_sending_anything(env, impostor):
    path, received, finish = impostor
    with pytest.raises(ServerIdentityError, match="uid 65534"):
        Client(path, reconnect=False)
    with pytest.raises(ServerIdentityError):
        Client(path)  # reconnecting clients do not retry an identity failure either

    async def main():
        with pytest.raises(ServerIdentityError, match="uid 65534"):
            await AsyncClient(path, reconnect=False).connect()
    asyncio.run(main())
    finish()
    assert bytes(received) == b""  # not even Hello reached it


@needs_root
def test_expected_server_uid_from_env_and_kwarg(env, sidecar):
    env.setenv("TOKTIER_SERVER_UID", "12345")
    with pytest.raises(ServerIdentityError, match="expected server uid 12345"):
        Client(sidecar.path, reconnect=False)
    with Client(sidecar.path, reconnect=False, expected_server_uid=os.geteuid()) as c:  # kwarg wins
        assert c.ping().monotonic > 0


@needs_root
def test_segments_owned_by_another_uid_are_refused(env):
    name = f"/ttimp-{secrets.token_hex(8)}"

    def plant():  # a well-formed segment, readable by all, owned by the impostor
        shm = posix_ipc.SharedMemory(name, flags=posix_ipc.O_CREX, mode=0o644, size=4096)
        header = np.zeros(1, HEADER_DTYPE)
        header["magic"], header["layout"], header["capacity"] = MAGIC, LAYOUT_VERSION, 8
        os.pwrite(shm.fd, header.tobytes(), 0)
        shm.close_fd()
        return True
    assert as_user(NOBODY, plant) == {"ok": True}
    try:
        with pytest.raises(ServerIdentityError, match="owned by uid 65534"):
            Mapping.open(name)  # expected owner: our own uid
        with pytest.raises(ServerIdentityError):
            Mapping.open(name, owner_uid=0)
        assert len(Mapping.open(name, owner_uid=NOBODY).ids) == 8  # the configured server uid is trusted
    finally:
        posix_ipc.unlink_shared_memory(name)
