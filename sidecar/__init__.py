"""The TokTier sidecar: the only I/O in TokTier.

A uvloop Unix-socket server that keeps tokenization sessions for a colocated
inference engine and hands their token IDs over in shared memory.

* :mod:`toktier_sidecar.connection`: sans-IO protocol state (framing, handshake, limits)
* :mod:`toktier_sidecar.service`: session logic over :mod:`toktier` and the store
* :mod:`toktier_sidecar.conversations`: the conversation ops (``toktier.Conversation``), in the same store
* :mod:`toktier_sidecar.shm`: shared-memory arenas (layout, lifetimes)
* :mod:`toktier_sidecar.server`: the asyncio adapter (lanes, workers, admission, shutdown)
* :mod:`toktier_sidecar.shadow`: the background verifier (sampling, bounded queue, worker thread,
  metrics) around the pure check in :mod:`toktier.verifier`
* :mod:`toktier_sidecar.metrics`, :mod:`toktier_sidecar.sdnotify`, :mod:`toktier_sidecar.cli`
* ``sidecar/systemd/``: unit files

The wire protocol is defined once, in ``toktier_client.protocol``.
"""

from .config import ServerConfig
from .server import Sidecar

__all__ = ["ServerConfig", "Sidecar"]
