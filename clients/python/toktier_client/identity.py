"""Who the client talks to: the server uid it expects, and the SO_PEERCRED check on connect.

Owns one rule, applied by both clients right after ``connect()`` and before the first
byte is sent (a prompt never reaches an impostor that bound the socket path first):
the peer's uid (from the kernel, ``SO_PEERCRED``) must be the expected server uid,
which is ``expected_server_uid=`` when given, else ``$TOKTIER_SERVER_UID``, else this
process's own uid.  Every shared-memory segment a reply names must be owned by that
same uid (checked in :meth:`toktier_client.shm.Mapping.open`).
"""

from __future__ import annotations

import os
import socket
import struct

from .errors import ServerIdentityError

SERVER_UID_ENV = "TOKTIER_SERVER_UID"
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def expected_server_uid(explicit: int | None = None) -> int:
    """``explicit``, else ``$TOKTIER_SERVER_UID``, else this process's effective uid."""
    if explicit is not None:
        return int(explicit)
    env = os.environ.get(SERVER_UID_ENV, "").strip()
    if env:
        try:
            return int(env)
        except ValueError:
            raise ServerIdentityError(f"${SERVER_UID_ENV} must be a numeric uid, not {env!r}") from None
    return os.geteuid()


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a connected Unix socket."""
    _pid, uid, _gid = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return uid


def verify_server(sock: socket.socket, expected_uid: int, path: str) -> None:
    """Raise :class:`ServerIdentityError` unless the peer of ``sock`` runs as ``expected_uid``."""
    try:
        uid = peer_uid(sock)
    except OSError as exc:
        raise ServerIdentityError(f"cannot tell who listens on {path} (SO_PEERCRED failed: {exc})") from None
    if uid != expected_uid:
        raise ServerIdentityError(
            f"the process listening on {path} runs as uid {uid}, not the expected server uid {expected_uid}; "
            f"refusing to talk to it (set expected_server_uid= or ${SERVER_UID_ENV} if the sidecar runs "
            "as another user)")
