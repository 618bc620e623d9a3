"""The listening socket, its private directory, and peer credentials."""

from __future__ import annotations

import os
import socket
import stat
import struct
from typing import TYPE_CHECKING

from toktier_client.paths import check_private_dir

if TYPE_CHECKING:
    from .config import ServerConfig

_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
BACKLOG = 512


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket (SO_PEERCRED);
    (-1, -1, -1) when the kernel cannot tell."""
    try:
        return _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    except OSError:
        return (-1, -1, -1)


def runtime_dir_for(config: "ServerConfig") -> str:
    """The server's private runtime directory (instance lock files): ``runtime_dir``, else the
    socket's directory; verified private (raises ``InsecureRuntimeDir``, a PermissionError)."""
    directory = config.runtime_dir or os.path.dirname(os.path.abspath(config.socket_path))
    check_private_dir(directory, allow_root_owner=True)
    return directory


def ensure_socket_dir(path: str, group: int | None) -> str:
    """Create the socket's directory if missing (0700; 0710 with a group, whose members must
    reach the socket), then verify it: a real directory owned by this uid (or root), that
    group and others cannot write to, else ``InsecureRuntimeDir``.  An impostor could
    otherwise swap the socket in a shared directory."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.lexists(directory):
        os.makedirs(os.path.dirname(directory), exist_ok=True)
        try:
            os.mkdir(directory, 0o710 if group is not None else 0o700)
        except FileExistsError:
            pass  # created meanwhile: verified below like any existing one
        else:
            if group is not None:
                os.chown(directory, -1, group)
                os.chmod(directory, 0o710)  # mkdir's mode is filtered by the umask
    check_private_dir(directory, allow_root_owner=True)
    return directory


def bind_unix_socket(path: str, group: int | None) -> socket.socket:
    """A listening Unix socket at ``path`` with mode 0600 (0660 and ``group`` when set), in a
    private directory (:func:`ensure_socket_dir`).

    The umask is tightened around ``bind`` so the file never exists with wider
    permissions.  A stale socket file (nobody accepting) is replaced; a live one or
    a non-socket file is an error."""
    ensure_socket_dir(path, group)
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
