"""Socket and segment permissions, SO_PEERCRED admission, per-peer namespaces.

Peers under another uid are forked children that drop privileges (``os.setuid``),
so these tests need root; they are skipped otherwise."""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
import traceback

import pytest

from toktier_client import Client
from sidecar_harness import llama3, registry, sidecar, start_sidecar  # noqa: F401  (fixtures)

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a peer under another uid")


def as_user(uid: int, gid: int, fn) -> dict:
    """Run ``fn()`` in a forked child under uid/gid; returns its JSON-able result."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        os.close(r)
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            out = {"ok": fn()}
        except BaseException as exc:
            out = {"error": type(exc).__name__, "bases": [c.__name__ for c in type(exc).__mro__],
                   "message": str(exc), "tb": traceback.format_exc()}
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
def public_dir():
    """A directory other users can traverse (pytest's tmp dirs are 0700)."""
    d = tempfile.mkdtemp(prefix="toktier-sec-")
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def sidecar(start_sidecar, public_dir):
    return start_sidecar(socket_path=os.path.join(public_dir, "a.sock"))


def test_socket_and_segment_modes(sidecar):
    assert stat.S_IMODE(os.stat(sidecar.path).st_mode) == 0o600
    with Client(sidecar.path) as c:
        r = c.session("m", text="hello").last
        st = os.stat("/dev/shm/" + r.segment.lstrip("/"))
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid()
        name = r.segment.split("-", 1)[1]
        assert len(name) >= 22  # 128 random bits, url-safe base64


def test_group_mode(start_sidecar, public_dir):
    sc = start_sidecar(group=NOBODY, socket_path=os.path.join(public_dir, "g.sock"))
    st = os.stat(sc.path)
    assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == NOBODY
    with Client(sc.path) as c:
        seg = os.stat("/dev/shm/" + c.session("g", text="x").last.segment.lstrip("/"))
        assert stat.S_IMODE(seg.st_mode) == 0o640 and seg.st_gid == NOBODY


@needs_root
def test_other_uid_cannot_connect_by_default(sidecar):
    def attempt():
        Client(sidecar.path, reconnect=False)
    out = as_user(NOBODY, NOBODY, attempt)
    assert out.get("error") == "ConnectionLost" and "Permission denied" in out["message"], out  # 0600 file


@needs_root
def test_peercred_refuses_unlisted_uid(sidecar):
    os.chmod(sidecar.path, 0o666)  # even if the file mode is opened up, SO_PEERCRED decides

    def attempt():  # it trusts root's sidecar (expected_server_uid): the refusal is the server's
        Client(sidecar.path, reconnect=False, expected_server_uid=0)
    out = as_user(NOBODY, NOBODY, attempt)
    assert out.get("error") == "PermissionDenied" and "PermissionError" in out["bases"], out
    with Client(sidecar.path) as c:  # the owner is still served
        assert len(c.session("owner", text="ok").last.ids) == 1


@needs_root
def test_admitted_uid_gets_its_own_namespace(start_sidecar, public_dir, llama3):
    sc = start_sidecar(allowed_uids=frozenset({0, NOBODY}), group=NOBODY,
                       socket_path=os.path.join(public_dir, "n.sock"))
    with Client(sc.path) as c:
        c.session("secret", text="root's text")

    def peer():
        import toktier_client as tc
        with tc.Client(sc.path, reconnect=False, expected_server_uid=0) as c:
            try:
                c.call(tc.protocol.Append(id=c.next_id(), session="secret", text="x"))
                saw = "root's session"
            except tc.SessionMiss:
                saw = "miss"
            s = c.session("secret", text="nobody's text")  # same id, different namespace
            ids = s.last.ids.tolist()
            return {"saw": saw, "ids": ids, "segment_mode": oct(os.stat("/dev/shm/" + s.last.segment[1:]).st_mode)}
    out = as_user(NOBODY, NOBODY, peer)
    assert "ok" in out, out
    assert out["ok"]["saw"] == "miss"
    assert out["ok"]["ids"] == llama3.encode("nobody's text").tolist()
    with Client(sc.path) as c:
        s = c.session("secret", text="root's text")
        assert s.last.path == "noop"  # untouched by the other peer
        assert c.stats().sessions == 2


@needs_root
def test_segments_unreadable_by_other_users(sidecar):
    with Client(sidecar.path) as c:
        seg = c.session("priv", text="private").last.segment

    def peek():
        from toktier_client.shm import Mapping
        Mapping.open(seg)
    out = as_user(NOBODY, NOBODY, peek)
    assert out.get("error") == "SegmentAccessDenied" and "PermissionError" in out["bases"], out


@needs_root
def test_shared_namespace_when_configured(start_sidecar, public_dir, llama3):
    sc = start_sidecar(allowed_uids=frozenset({0, NOBODY}), group=NOBODY, shared_namespace=True,
                       socket_path=os.path.join(public_dir, "shared.sock"))
    with Client(sc.path) as c:
        c.session("team", text="shared text")
        assert c.welcome.namespace == "shared"

    def peer():
        import toktier_client as tc
        with tc.Client(sc.path, reconnect=False, expected_server_uid=0) as c:
            return c.session("team", text="shared text, extended").last.path
    out = as_user(NOBODY, NOBODY, peer)
    assert out.get("ok") in ("first_window", "widened"), out  # it found root's session and repaired it
