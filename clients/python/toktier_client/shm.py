"""Shared-memory segment layout (the single definition) and the client's read-only mappings.

Every result's token IDs live in a POSIX shared-memory segment created by the
sidecar (``/dev/shm/<name>``, mode 0600 or 0640 with a configured group, name =
prefix + 128 random bits, so it cannot be guessed).  Layout, little-endian::

    byte 0                                                        64
    +-------+--------+-----------+----------+----------+----------+--------------------------------+
    | magic | layout | capacity  |   seq    |  count   | reserved | ids: uint32[capacity]          |
    | u32   | u32    | u64 elems | u64      | u64      | 32 bytes | ids[0:count] valid, rest spare |
    +-------+--------+-----------+----------+----------+----------+--------------------------------+
    0       4        8           16         24         32         64 (cache-line aligned)

* Session segments: one per session, owned by the session.  The sidecar writes
  the IDs *in place* (a repair rewrites only ``ids[first_changed:]``) and then
  stores ``seq``/``count``.  When a session outgrows ``capacity`` the sidecar
  creates a bigger segment, copies, and unlinks the old name; mappings of the
  old segment stay readable (unlinking never unmaps) but stop changing.  A
  segment the session left (moved to a bigger one, closed, expired, evicted,
  sidecar stopped) gets ``seq = RETIRED_SEQ`` (2**64 - 1), which no state has.
* Handoff segments (stateless ``Encode``): written once, ``seq`` = 0; the client
  maps one and sends ``Release`` so the sidecar unlinks the name; the pages are
  freed when the last numpy view of them is garbage-collected.

A :class:`Result`'s ``ids`` is a read-only numpy view straight over the mapping:
no copy, no Python list.  For a session result it is valid until the next op on
that session, or until the session moves to another segment or ends
(``Result.valid`` tells exactly); ``ids.copy()`` if you need it longer.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass

import numpy as np
import posix_ipc

from .errors import ProtocolError, SegmentAccessDenied, SegmentGone, ServerIdentityError
from .protocol import CacheLayer

MAGIC = 0x53544B54  # b"TKTS" read as a little-endian u32
LAYOUT_VERSION = 1
HEADER_BYTES = 64
HEADER_DTYPE = np.dtype(
    [
        ("magic", "<u4"),
        ("layout", "<u4"),
        ("capacity", "<u8"),
        ("seq", "<u8"),
        ("count", "<u8"),
        ("reserved", "<u8", (4,)),
    ]
)
IDS_DTYPE = np.dtype("<u4")
assert HEADER_DTYPE.itemsize == HEADER_BYTES
#: Header ``seq`` of a segment its session has left: no result's seq ever equals it.
RETIRED_SEQ = 2**64 - 1


def segment_bytes(capacity: int) -> int:
    """Size in bytes of a segment holding ``capacity`` IDs."""
    return HEADER_BYTES + capacity * IDS_DTYPE.itemsize


class Mapping:
    """A read-only mapping of one segment: ``header`` (a 1-element structured array) and
    ``ids`` (uint32[capacity]), both views of the same ``mmap`` (kept alive by numpy)."""

    __slots__ = ("name", "header", "ids")

    def __init__(self, name: str, header: np.ndarray, ids: np.ndarray) -> None:
        self.name = name
        self.header = header
        self.ids = ids

    @classmethod
    def open(cls, name: str, owner_uid: int | None = None) -> "Mapping":
        """Map segment ``name`` read-only; it must be owned by ``owner_uid`` (the server's verified
        uid; None: this process's uid), else :class:`ServerIdentityError`: a segment planted by
        someone else is never read."""
        try:
            seg = posix_ipc.SharedMemory(name, flags=0, read_only=True)
        except posix_ipc.ExistentialError:
            raise SegmentGone(f"shared-memory segment {name!r} no longer exists") from None
        except posix_ipc.PermissionsError:
            raise SegmentAccessDenied(f"no permission to map shared-memory segment {name!r}") from None
        try:
            owner = os.fstat(seg.fd).st_uid  # of the object we opened: no race with a rename
            expected = os.geteuid() if owner_uid is None else owner_uid
            if owner != expected:
                raise ServerIdentityError(
                    f"shared-memory segment {name!r} is owned by uid {owner}, not the server's uid {expected}; "
                    "refusing to read it")
            size = seg.size
            if size < HEADER_BYTES:
                raise ProtocolError(f"segment {name!r} is {size} bytes, smaller than its header")
            mm = mmap.mmap(seg.fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            seg.close_fd()
        header = np.frombuffer(mm, dtype=HEADER_DTYPE, count=1)
        if int(header["magic"][0]) != MAGIC or int(header["layout"][0]) != LAYOUT_VERSION:
            raise ProtocolError(f"segment {name!r} has an unknown layout")
        capacity = int(header["capacity"][0])
        if segment_bytes(capacity) > size:
            raise ProtocolError(f"segment {name!r} claims {capacity} IDs but is only {size} bytes")
        ids = np.frombuffer(mm, dtype=IDS_DTYPE, count=capacity, offset=HEADER_BYTES)
        return cls(name, header, ids)

    def view(self, offset: int, count: int) -> np.ndarray:
        """``count`` IDs starting at byte ``offset`` of the segment, as a view."""
        start = (offset - HEADER_BYTES) // IDS_DTYPE.itemsize
        if offset < HEADER_BYTES or (offset - HEADER_BYTES) % IDS_DTYPE.itemsize or start + count > len(self.ids):
            raise ProtocolError(f"reply points outside segment {self.name!r}")
        return self.ids[start : start + count]

    @property
    def seq(self) -> int:
        return int(self.header["seq"][0])


class Lease:
    """Live while a result is its session's latest state as this client knows it; the client
    ends it when a later op on the session succeeds, when the session is closed, and when the
    sidecar says the session is gone (miss, conflict).  Shared by nothing else."""

    __slots__ = ("live",)

    def __init__(self) -> None:
        self.live = True

    def end(self) -> None:
        self.live = False


@dataclass(frozen=True, slots=True)
class Result:
    """One op's outcome.  ``ids`` is a zero-copy read-only view of shared memory.

    ``first_changed``: index of the first ID that differs from the previous state
    (an engine can keep its KV cache for ``ids[:first_changed]``).  ``path``: how
    the sidecar got the answer (``noop``, ``first_window``, ``widened``, ``full``).

    A cached encode (``encode(..., cache=True)``) also says which cache answered: ``layer``
    ``"l0"`` (the same text), ``"l1"`` (a cached text sharing a prefix, repaired), ``"miss"``
    (tokenized in full, now cached) or ``"off"`` (no cache consulted: not asked for, or
    disabled on the sidecar); ``reused_chars`` the characters of the text whose tokens came
    from the cache; ``first_changed`` the first token that differs from the matched entry's
    (the KV reuse point: 0 on a miss, ``len(ids)`` on an L0 hit).
    """

    ids: np.ndarray
    first_changed: int
    path: str
    widenings: int
    seq: int
    tokenizer: str
    segment: str
    _mapping: Mapping
    _lease: Lease | None = None
    layer: CacheLayer = "off"
    reused_chars: int = 0

    @property
    def valid(self) -> bool:
        """True while ``ids`` still shows the session's current state: False once a later op
        ran (through any client), once the session moved to another segment, was closed,
        expired or evicted, or this client saw it missing.  Stateless results stay valid."""
        if self.seq == 0:
            return True  # a one-shot handoff: never rewritten
        if self._lease is not None and not self._lease.live:
            return False
        return self._mapping.seq == self.seq  # another client's op, or the sidecar retired it

    def __len__(self) -> int:
        return len(self.ids)
