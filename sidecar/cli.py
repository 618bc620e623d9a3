"""``toktier serve``: run the sidecar.

    toktier serve [--socket PATH] [--tokenizer NAME ...] [--config FILE.toml] [--metrics-port N] ...

With no ``--tokenizer`` it serves the bundled default (llama3).  A TOML config
file may set any :class:`toktier_sidecar.config.ServerConfig` field by name; flags given
on the command line win.  Under systemd it accepts a socket-activated listener
(``LISTEN_FDS``) and reports readiness (``Type=notify``) once it serves, without waiting for
``--state-dir``'s restore at start (see :mod:`toktier_sidecar.server`); SIGTERM drains
in-flight requests, unlinks every shared-memory segment and exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import grp
import logging
import sys
from typing import Sequence

import uvloop

from toktier.errors import InvalidCacheConfig

from .config import DEFAULT_TOKENIZER, ServerConfig, default_socket_path
from .heap import MMAP_THRESHOLD, check_retain, keep_big_allocations
from .server import Sidecar
from .statedir import InsecureStateDir
from .statestore import InvalidStateStore

log = logging.getLogger("toktier_sidecar.cli")


def _size(text: str) -> int:
    """Bytes from '512M', '2G', '1048576'."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def _bool(text: str) -> bool:
    """'true'/'false' (also 1/0, yes/no, on/off), for flags that default to on."""
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, not {text!r}")


def _switch(p: argparse.ArgumentParser, flag: str, dest: str, help_on: str, help_off: str) -> None:
    """``--FLAG`` / ``--FLAG=false`` / ``--no-FLAG`` (the spelling SGLang Model Gateway's flags use,
    plus a way to turn off what is on by default)."""
    group = p.add_mutually_exclusive_group()
    group.add_argument(f"--{flag}", dest=dest, type=_bool, nargs="?", const=True, default=None, metavar="BOOL",
                       help=help_on)
    group.add_argument(f"--no-{flag}", dest=dest, action="store_false", default=None, help=help_off)


def _group(text: str) -> int:
    return int(text) if text.isdigit() else grp.getgrnam(text).gr_gid


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="toktier serve", description="Run the TokTier tokenization sidecar.")
    p.add_argument("--socket", dest="socket_path",
                   help=f"Unix socket path (default: $TOKTIER_SOCKET, else {default_socket_path()}; its directory "
                        "is created 0700 and must be private)")
    p.add_argument("--tokenizer", dest="tokenizers", action="append",
                   help=f"tokenizer to preload (name or tokenizer file); repeatable; the first is the default "
                        f"(default {DEFAULT_TOKENIZER})")
    p.add_argument("--config", help="TOML file with ServerConfig fields")
    lazy = p.add_mutually_exclusive_group()
    lazy.add_argument("--lazy-load", dest="lazy_load", action="store_true", default=None,
                      help="let clients load other bundled tokenizers on first use (default: off)")
    lazy.add_argument("--no-lazy-load", dest="lazy_load", action="store_false", default=None,
                      help="serve only the preloaded tokenizers (the default)")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on 127.0.0.1:PORT")
    p.add_argument("--metrics-addr", help="metrics bind address (default 127.0.0.1)")
    p.add_argument("--allow-uid", dest="allowed_uids", type=int, action="append",
                   help="admit this peer uid (repeatable; default: the server's own uid)")
    p.add_argument("--allow-gid", dest="allowed_gids", type=int, action="append", help="admit peers in this gid")
    p.add_argument("--group", type=_group, help="group owning the socket (0660) and segments (0640)")
    p.add_argument("--shared-namespace", action="store_true", default=None,
                   help="one session namespace for all admitted peers (default: per peer uid)")
    p.add_argument("--memory-budget", type=_size, help="bytes of session state before LRU eviction (e.g. 512M)")
    p.add_argument("--ttl", dest="session_ttl", type=float, help="seconds a session may stay unused (default 3600)")
    p.add_argument("--max-connections", type=int)
    p.add_argument("--max-sessions", type=int, help="open sessions before LRU eviction (default 16384)")
    p.add_argument("--max-inflight", type=int, help="unanswered requests per connection")
    p.add_argument("--max-session-chars", type=int)
    p.add_argument("--window", type=int, help="repair window in bytes (default: twice the tokenizer's longest token)")
    p.add_argument("--workers", type=int, help="threads in each worker pool (bulk: opens and encodes; repair: big changes)")
    p.add_argument("--inline-chars", type=int,
                   help="ops carrying at most this many code points run on the event loop (default 16384)")
    p.add_argument("--shm-prefix", help="shared-memory name prefix (default toktier)")
    p.add_argument("--runtime-dir", help="private directory for the instance lock that lets a restart remove a "
                                         "crashed run's segments (default: the socket's directory)")
    p.add_argument("--handshake-timeout", type=float, help="seconds a connection has to send Hello (default 10)")
    p.add_argument("--idle-timeout", type=float,
                   help="close connections idle this many seconds, unless they hold bound sessions (default 600; 0 = never)")
    p.add_argument("--max-buffered-bytes", type=_size,
                   help="bytes of incomplete frames all connections may buffer together (default 256M)")
    p.add_argument("--verify-rate", type=float,
                   help="fraction of results the shadow verifier re-encodes in the background (default 0.01; 0 = off)")
    p.add_argument("--verify-max-chars", type=int,
                   help="the verifier skips sampled results longer than this many code points (default 262144)")
    p.add_argument("--verify-chars-per-second", type=int,
                   help="code points the verifier may re-encode per second (default 1048576; 0 = no limit)")
    p.add_argument("--verify-disable-on-mismatch", action="store_true", default=None,
                   help="on a confirmed mismatch, serve that tokenizer by full tokenization until SIGHUP")
    p.add_argument("--no-gpu", dest="gpu", action="store_false", default=None,
                   help="keep every whole-text encode on the CPU (default: the GPU takes large ones when present)")
    _switch(p, "tokenizer-cache-enable-l0", "tokenizer_cache_enable_l0",
            "cached encodes look up the whole text (default: on; the answer is verified byte for byte)",
            "no whole-text lookups")
    p.add_argument("--tokenizer-cache-l0-max-entries", dest="tokenizer_cache_l0_max_entries", type=int,
                   help="whole-text keys per cache, LRU (default 4096, ~160 bytes each)")
    _switch(p, "tokenizer-cache-enable-l1", "tokenizer_cache_enable_l1",
            "cached encodes reuse the longest cached prefix and tokenize the rest (default: on; exact)",
            "no prefix lookups")
    p.add_argument("--tokenizer-cache-l1-max-memory", dest="tokenizer_cache_l1_max_memory", type=_size,
                   help="bytes each cache (one per tokenizer and namespace) may hold, LRU, besides "
                        "--memory-budget (e.g. 256M, 1G; default 256M)")
    p.add_argument("--state-dir", dest="state_dir",
                   help="keep every session's state in this private directory (created 0700) so that a restart "
                        "resumes sessions by repair, not by re-encoding (default: off)")
    _switch(p, "state-preload", "state_preload",
            "restore --state-dir's sessions at start, in the background, most recent first, within --memory-budget "
            "(default: on; serving starts at once, a session not restored yet is restored by its first op)",
            "restore each session only when its first op comes")
    p.add_argument("--state-store", dest="state_store", metavar="URL",
                   help="share session state with other nodes through a Valkey/Redis server: redis://HOST[:PORT][/DB], "
                        "rediss://, valkey://, valkeys:// or unix:///PATH/TO/SOCKET[?db=N] (needs toktier[redis]; "
                        "default: off)")
    p.add_argument("--state-store-prefix", dest="state_store_prefix",
                   help="prefix of the keys written to --state-store (default 'toktier:')")
    p.add_argument("--state-store-max-value", dest="state_store_max_value", type=_size,
                   help="largest session record stored, e.g. 64M (default 64M: a 16M-character session)")
    p.add_argument("--state-store-timeout", dest="state_store_timeout", type=float,
                   help="seconds a store call may take before it counts as failed (default 2)")
    p.add_argument("--malloc-retain", dest="malloc_retain", type=_size,
                   help="freed bytes the heap may keep, with allocations under 32M served from it (renders of "
                        "megabyte messages otherwise fault their strings in again; default 256M; 0 = glibc's "
                        "defaults)")
    p.add_argument("--log-level", default="INFO")
    return p


def load_config(args: argparse.Namespace) -> ServerConfig:
    values: dict[str, object] = {}
    if args.config:
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10: the same parser, as a package
            import tomli as tomllib

        with open(args.config, "rb") as f:
            values.update(tomllib.load(f))
    for f in dataclasses.fields(ServerConfig):
        v = getattr(args, f.name, None)
        if v is not None:
            values[f.name] = v
    for name in ("tokenizers",):
        if name in values:
            values[name] = tuple(values[name])  # type: ignore[arg-type]
    for name in ("allowed_uids", "allowed_gids"):
        if name in values:
            values[name] = frozenset(values[name])  # type: ignore[arg-type]
    unknown = set(values) - {f.name for f in dataclasses.fields(ServerConfig)}
    if unknown:
        raise SystemExit(f"unknown config keys: {', '.join(sorted(unknown))}")
    window = int(values.get("window", 0))  # type: ignore[arg-type]
    if window and window < 16:
        raise SystemExit(f"window must be 0 (the session default) or at least 16 bytes, not {window}")
    rate = float(values.get("verify_rate", 0.0))  # type: ignore[arg-type]
    if not 0.0 <= rate <= 1.0:
        raise SystemExit(f"verify-rate must be in [0, 1], not {rate}")
    if "max_session_chars" in values and "max_frame" not in values:
        values["max_frame"] = 4 * int(values["max_session_chars"]) + 64 * 1024  # type: ignore[arg-type]
    memory = values.get("tokenizer_cache_l1_max_memory")
    if isinstance(memory, str):  # TOML may spell it as the flag does: "256M"
        try:
            values["tokenizer_cache_l1_max_memory"] = _size(memory)
        except ValueError:
            raise SystemExit(f"tokenizer_cache_l1_max_memory must be bytes or a size like 256M or 1G, "
                             f"not {memory!r}") from None
    for name in ("state_store_max_value", "malloc_retain"):
        size = values.get(name)
        if isinstance(size, str):
            try:
                values[name] = _size(size)
            except ValueError:
                raise SystemExit(f"{name} must be bytes or a size like 64M, not {size!r}") from None
    try:
        check_retain(values.get("malloc_retain", 0))
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    try:
        return ServerConfig(**values)  # type: ignore[arg-type]
    except InvalidCacheConfig as exc:
        raise SystemExit(str(exc)) from None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point for ``toktier serve``; ``argv`` is the argument list after ``serve``."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = load_config(args)
    why_not = keep_big_allocations(config.malloc_retain)
    if why_not is None:
        log.info("heap: allocations under %d MiB from the heap, up to %d MiB of it kept when freed",
                 MMAP_THRESHOLD >> 20, config.malloc_retain >> 20)
    else:
        log.info("heap: default malloc settings (%s)", why_not)
    try:
        sidecar = Sidecar(config)
    except (InsecureStateDir, InvalidStateStore) as exc:
        raise SystemExit(f"toktier serve: {exc}") from None
    uvloop.run(sidecar.run())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
