"""The listening socket and peer credentials."""

from __future__ import annotations

import os
import socket
import stat
import struct

_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
BACKLOG = 512


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket (SO_PEERCRED);
    (-1, -1, -1) when the kernel cannot tell."""
    try:
        return _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    except OSError:
        return (-1, -1, -1)


def bind_unix_socket(path: str, group: int | None) -> socket.socket:
    """A listening Unix socket at ``path`` with mode 0600 (0660 and ``group`` when set).

    The umask is tightened around ``bind`` so the file never exists with wider
    permissions.  A stale socket file (nobody accepting) is replaced; a live one or
    a non-socket file is an error."""
    if os.path.lexists(path):
        st = os.lstat(path)
        if not stat.S_ISSOCK(st.st_mode):
            raise FileExistsError(f"{path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            os.unlink(path)
        else:
            raise FileExistsError(f"another server is accepting on {path}")
        finally:
            probe.close()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    mode = 0o660 if group is not None else 0o600
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o777 & ~mode)
    try:
        sock.bind(path)
    except BaseException:
        sock.close()
        raise
    finally:
        os.umask(old)
    os.chmod(path, mode)
    if group is not None:
        os.chown(path, -1, group)
    sock.listen(BACKLOG)
    return sock
