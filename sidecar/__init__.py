"""The TokTier sidecar: the only I/O in TokTier.

A uvloop Unix-socket server that keeps tokenization sessions for a colocated
inference engine and hands their token IDs over in shared memory.

* :mod:`sidecar.connection`: sans-IO protocol state (framing, handshake, limits)
* :mod:`sidecar.service`: session logic over :mod:`toktier` and the store
* :mod:`sidecar.shm`: shared-memory arenas (layout, lifetimes)
* :mod:`sidecar.server`: the asyncio adapter (lanes, workers, admission, shutdown)
* :mod:`sidecar.shadow`: the background verifier (sampling, bounded queue, worker thread,
  metrics) around the pure check in :mod:`toktier.verifier`
* :mod:`sidecar.metrics`, :mod:`sidecar.sdnotify`, :mod:`sidecar.cli`
* ``sidecar/systemd/``: unit files

The wire protocol is defined once, in ``toktier_client.protocol``.
"""

from .config import ServerConfig
from .server import Sidecar

__all__ = ["ServerConfig", "Sidecar"]
