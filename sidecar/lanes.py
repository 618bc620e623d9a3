"""Per-key FIFO execution for the event loop: ops on one session run one at a time, in order.

>>> import asyncio
>>> async def demo():
...     lanes, seen = Lanes(), []
...     async def job(tag):
...         await asyncio.sleep(0.01 if tag == "slow" else 0)
...         seen.append(tag)
...     lanes.submit("a", lambda: job("slow")); lanes.submit("a", lambda: job("after"))
...     lanes.submit("b", lambda: job("other"))
...     while len(lanes): await asyncio.sleep(0.005)
...     return seen
>>> asyncio.run(demo())
['other', 'slow', 'after']
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Awaitable, Callable, Hashable

log = logging.getLogger(__name__)

Job = Callable[[], Awaitable[None]]


class Lanes:
    """At most one job per key runs at a time, in submission order; keys run concurrently.

    A key is *idle* when nothing for it is running or queued; the server runs small
    ops for idle keys synchronously, skipping the lane (and its task) altogether."""

    def __init__(self) -> None:
        self._queues: dict[Hashable, deque[Job]] = {}
        self._tasks: set[asyncio.Task] = set()

    def idle(self, key: Hashable) -> bool:
        return key not in self._queues

    def __len__(self) -> int:
        """Keys with work running or queued."""
        return len(self._queues)

    def submit(self, key: Hashable, job: Job) -> None:
        q = self._queues.get(key)
        if q is not None:
            q.append(job)
            return
        self._queues[key] = deque()
        task = asyncio.get_running_loop().create_task(self._drain(key, job))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _drain(self, key: Hashable, job: Job) -> None:
        try:
            while True:
                try:
                    await job()
                except Exception:  # jobs answer their own errors; this guards the lane against bugs
                    log.exception("lane job for %r failed", key)
                q = self._queues[key]
                if not q:
                    return
                job = q.popleft()
        finally:
            self._queues.pop(key, None)
