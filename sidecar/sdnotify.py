"""systemd integration without libsystemd: socket activation and readiness notification.

* ``listen_fds()``: sockets passed by a ``.socket`` unit (``LISTEN_PID``/``LISTEN_FDS``,
  first fd 3), see sd_listen_fds(3).
* ``notify("READY=1")``: a datagram to ``$NOTIFY_SOCKET`` (``Type=notify``), see
  sd_notify(3); a leading ``@`` names an abstract socket.  A no-op outside systemd.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)

SD_LISTEN_FDS_START = 3


def listen_fds(unset_environment: bool = True) -> list[socket.socket]:
    """Sockets handed over by systemd for this process (empty when not socket-activated)."""
    try:
        pid = int(os.environ.get("LISTEN_PID", ""))
        n = int(os.environ.get("LISTEN_FDS", ""))
    except ValueError:
        return []
    if unset_environment:
        for var in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
            os.environ.pop(var, None)
    if pid != os.getpid() or n <= 0:
        return []
    socks = []
    for fd in range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + n):
        os.set_inheritable(fd, False)
        socks.append(socket.socket(fileno=fd))
    return socks


def notify(state: str) -> bool:
    """Send ``state`` (e.g. ``"READY=1\\nSTATUS=serving"``) to systemd.

    False when not under systemd or when the notification socket is gone (a
    status message must never take the server down)."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.sendall(state.encode())
    except OSError as exc:
        log.warning("sd_notify(%r) failed: %s", state.split("\n")[0], exc)
        return False
    return True
