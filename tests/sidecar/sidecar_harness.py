"""Fixtures for sidecar tests: a real sidecar (uvloop, Unix socket, POSIX shared memory)
serving real tokenizers, run in a background thread of the test process.

Test modules import the fixtures they use from here (not a ``conftest.py``: a
second ``conftest`` module would shadow the suite's root one, which other test
modules import helpers from)."""

from __future__ import annotations

import asyncio
import os
import secrets
import threading
import time
from dataclasses import replace

import numpy as np
import pytest
import uvloop

import toktier
from toktier_sidecar import ServerConfig, Sidecar


@pytest.fixture(scope="session")
def registry() -> toktier.Registry:
    """One registry for every test server, so a server starts without reloading tokenizers."""
    reg = toktier.Registry()
    reg.load("llama3")
    return reg


@pytest.fixture(scope="session")
def llama3(registry: toktier.Registry) -> toktier.FrozenTokenizer:
    return registry.get("llama3")


def shm_names(prefix: str) -> list[str]:
    """Segments in /dev/shm whose name starts with ``prefix-``."""
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix + "-"))


class SidecarThread:
    """A sidecar in a thread with its own uvloop event loop; restartable at the same socket."""

    def __init__(self, config: ServerConfig, registry: toktier.Registry) -> None:
        self.config = config
        self.registry = registry
        self.sidecar: Sidecar | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    @property
    def path(self) -> str:
        return self.config.socket_path

    @property
    def prefix(self) -> str:
        return self.config.shm_prefix

    def start(self) -> "SidecarThread":
        ready = threading.Event()
        self.sidecar = Sidecar(self.config, registry=self.registry, install_signals=False)

        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            task = asyncio.create_task(self.sidecar.run())
            waiter = asyncio.create_task(self.sidecar.wait_ready())
            await asyncio.wait([task, waiter], return_when=asyncio.FIRST_COMPLETED)
            if task.done() and task.exception() is not None:
                self.error = task.exception()  # failed to start: surface it from start()
            ready.set()
            await task

        def target() -> None:
            try:
                uvloop.run(main())
            except BaseException as exc:  # surfaced by stop()/start()
                self.error = exc
                ready.set()

        self._thread = threading.Thread(target=target, name="sidecar", daemon=True)
        self._thread.start()
        ready.wait(60)
        if self.error is not None:
            raise self.error
        return self

    def stop(self) -> None:
        if self._thread is None:
            return
        self._loop.call_soon_threadsafe(self.sidecar.request_stop)
        self._thread.join(30)
        assert not self._thread.is_alive(), "sidecar did not stop"
        self._thread = None
        if self.error is not None:
            raise self.error

    def restart(self) -> None:
        self.stop()
        self.start()


def make_config(tmp_path, **overrides) -> ServerConfig:
    base = ServerConfig(
        socket_path=str(tmp_path / "toktier.sock"),
        tokenizers=("llama3",),
        shm_prefix=f"tttest{secrets.token_hex(4)}",
        workers=2,
        sweep_interval=3600.0,
        verify_rate=0.0,  # tests that exercise the verifier turn it on explicitly
    )
    return replace(base, **overrides)


@pytest.fixture
def start_sidecar(tmp_path, registry):
    """Factory: ``start_sidecar(**config_overrides) -> SidecarThread``; stops them and checks
    that no shared-memory segment outlives its server."""
    started: list[SidecarThread] = []

    def factory(**overrides) -> SidecarThread:
        sub = tmp_path / f"s{len(started)}"
        sub.mkdir()
        st = SidecarThread(make_config(sub, **overrides), registry).start()
        started.append(st)
        return st

    yield factory
    for st in started:
        st.stop()
        assert shm_names(st.prefix) == [], "shared-memory segments leaked past shutdown"


@pytest.fixture
def sidecar(start_sidecar) -> SidecarThread:
    return start_sidecar()


def wait_until(cond, timeout: float = 20.0) -> bool:
    """Poll `cond` every 20 ms until it holds or `timeout` seconds pass; its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def backing(arr: np.ndarray):
    """The object at the bottom of a numpy view chain (a zero-copy result's is the mapped segment)."""
    base = arr
    while True:
        if isinstance(base, np.ndarray) and base.base is not None:
            base = base.base
        elif isinstance(base, memoryview):
            base = base.obj
        else:
            return base
