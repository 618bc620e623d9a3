"""Where the sidecar listens: the one default socket path, and the private-directory check.

Owns the rule that the server (``toktier serve``), the clients (``Client()`` /
``AsyncClient()`` without a path) and ``scripts/start.sh`` all follow:

1. ``$TOKTIER_SOCKET`` when set (used as given);
2. else ``$XDG_RUNTIME_DIR/toktier/toktier.sock``;
3. else ``/run/toktier/toktier.sock`` when running as root;
4. else ``/tmp/toktier-<uid>/toktier.sock``.

For 2-4 the directory is created with mode 0700 when missing and verified before
use (:func:`ensure_private_dir`): a real directory (not a symlink), owned by this
uid, not writable by group or others.  Otherwise :class:`InsecureRuntimeDir` is
raised: in a shared directory such as ``/tmp`` another user could create the
directory first and put an impostor socket in it.

    python -c "from toktier_client.paths import default_socket_path; print(default_socket_path())"
"""

from __future__ import annotations

import os
import stat

from .errors import InsecureRuntimeDir

SOCKET_ENV = "TOKTIER_SOCKET"
SOCKET_NAME = "toktier.sock"


def default_socket_dir() -> str:
    """The private directory of the default socket (rules 2-4; ``$TOKTIER_SOCKET`` ignored)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return os.path.join(runtime, "toktier")
    if os.geteuid() == 0:
        return "/run/toktier"
    return f"/tmp/toktier-{os.geteuid()}"


def default_socket_path(*, ensure_dir: bool = True) -> str:
    """The socket path to serve on / connect to (see the module docstring).

    With ``ensure_dir`` (the default) the default directory is created 0700 if missing and
    verified; ``ensure_dir=False`` only computes the path (help texts, config defaults)."""
    explicit = os.environ.get(SOCKET_ENV)
    if explicit:
        return explicit
    directory = default_socket_dir()
    if ensure_dir:
        ensure_private_dir(directory)
    return os.path.join(directory, SOCKET_NAME)


def ensure_private_dir(path: str, *, create: bool = True) -> str:
    """Create ``path`` with mode 0700 (one level; its parent must exist) unless it exists, then
    verify it is private; returns ``path``.  Raises :class:`InsecureRuntimeDir` otherwise."""
    if create:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            raise InsecureRuntimeDir(f"cannot create the socket directory {path}: {exc}") from None
    check_private_dir(path)
    return path


def check_private_dir(path: str, *, allow_root_owner: bool = False) -> None:
    """Raise :class:`InsecureRuntimeDir` unless ``path`` is a real directory owned by this uid
    (or by root when ``allow_root_owner``) that group and others cannot write to."""
    try:
        st = os.lstat(path)  # lstat: a symlink is refused, not followed
    except OSError as exc:
        raise InsecureRuntimeDir(f"socket directory {path} is not usable: {exc}") from None
    uid = os.geteuid()
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        problem = "is a symlink" if stat.S_ISLNK(st.st_mode) else "is not a directory"
    elif st.st_uid != uid and not (allow_root_owner and st.st_uid == 0):
        problem = f"is owned by uid {st.st_uid}, not {uid}"
    elif st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        problem = f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    else:
        return
    raise InsecureRuntimeDir(
        f"refusing socket directory {path}: it {problem}; another user could plant an impostor socket there. "
        f"Remove it, or set ${SOCKET_ENV} to a socket in a private directory"
    )
