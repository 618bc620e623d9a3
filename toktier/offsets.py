"""Byte offsets of a session's tokens, kept sparsely: one checkpoint per 64 tokens.

A repair needs the byte start of the cached tokens near the change, never all of
them.  Storing every start doubled a session's arrays (ids 4 B + starts 4 B per
token); one checkpoint per ``STRIDE`` tokens (0.06 B/token) plus the token byte
lengths (a per-tokenizer table) recovers any start in O(STRIDE).

    cp[j] = byte start of token j * STRIDE            (uint32, GrowableU32)

Tokens have at least one byte, so starts are strictly increasing and ``locate``
(the first token starting at or after a byte position) is a binary search over
the checkpoints plus a cumulative sum inside one block.
"""

from __future__ import annotations

import numpy as np

from .buffers import GrowableU32
from .native import _core as _native  # the compiled checkpoint pass; None in a tree nobody built

STRIDE = 64


class SparseOffsets:
    """Checkpointed token byte starts for one token sequence (see the module docstring)."""

    __slots__ = ("_cp", "_token_len")

    def __init__(self, token_len: np.ndarray) -> None:
        self._cp = GrowableU32()
        self._token_len = token_len  # byte length per token id (the tokenizer's table)

    @property
    def nbytes(self) -> int:
        return self._cp.nbytes

    def copy(self) -> "SparseOffsets":
        """An independent copy (for `Session.fork`)."""
        new = SparseOffsets(self._token_len)
        new._cp = GrowableU32(capacity=self._cp.n)
        new._cp.assign(self._cp.view())
        return new

    def checkpoints(self) -> np.ndarray:
        """The checkpoints (uint32 view: the byte start of every `STRIDE`-th token), for compiled readers."""
        return self._cp.view()

    def raw(self) -> tuple[np.ndarray, int]:
        """(the whole checkpoint buffer, checkpoints used), for a compiled commit that writes in place
        and then calls `set_count`."""
        return self._cp.buffer, self._cp.n

    def set_count(self, n_cp: int) -> None:
        """Checkpoints used after a compiled commit wrote them into `raw()`'s buffer."""
        self._cp.n = n_cp

    def has_room_for(self, n_tokens: int) -> bool:
        """Whether the checkpoint buffer holds `n_tokens` tokens' checkpoints without growing."""
        return -(-n_tokens // STRIDE) <= len(self._cp.buffer)

    def reserve_for(self, n_tokens: int) -> None:
        """Allocate for `n_tokens` tokens now (so a later rebuild cannot fail half-way)."""
        self._cp.reserve(-(-n_tokens // STRIDE))

    def rebuild_all(self, ids: np.ndarray) -> int:
        """All checkpoints of `ids`, the first token at byte 0 (a session start, a restore); returns
        the tokens' total byte length.  One compiled pass over the ids where the native module is
        built (a gather, a sum and a cumsum in numpy cost ~4x as much: 4M characters, ~3 ms)."""
        n_cp = -(-len(ids) // STRIDE)
        if _native is not None and len(ids) and ids.dtype == np.uint32 and ids.flags.c_contiguous:
            self._cp.reserve(n_cp)
            total = _native.token_checkpoints(ids, self._token_len, STRIDE, self._cp.buffer)
            if total >= 0:
                self._cp.n = n_cp
                return int(total)
        lens = np.take(self._token_len, ids)
        self.rebuild(ids, lens=lens)
        return int(lens.sum(dtype=np.int64))

    def rebuild(self, ids: np.ndarray, first_token: int = 0, first_start: int = 0,
                lens: np.ndarray | None = None) -> None:
        """Recompute the checkpoints from token `first_token` (whose start is `first_start`) on.

        Checkpoints of earlier tokens are kept: a splice never moves the tokens before it.
        `lens`, when the caller already has it, is the byte length of every token of `ids`.
        """
        j0 = -(-first_token // STRIDE)  # first checkpoint at or after first_token
        b0 = j0 * STRIDE
        n_cp = -(-len(ids) // STRIDE)
        if b0 >= len(ids):
            self._cp.n = min(self._cp.n, n_cp)
            return
        if lens is None:
            start = first_start + int(self._token_len[ids[first_token:b0]].sum(dtype=np.int64))  # token b0
            lens = self._token_len[ids[b0:]]
        else:
            start = first_start + int(lens[first_token:b0].sum(dtype=np.int64))
            lens = lens[b0:]
        pad = -len(lens) % STRIDE
        if pad:
            lens = np.concatenate((lens, np.zeros(pad, dtype=lens.dtype)))
        block = lens.reshape(-1, STRIDE).sum(axis=1, dtype=np.int64)  # bytes per block of STRIDE tokens
        cp = np.empty(len(block), dtype=np.int64)
        cp[0] = start
        np.cumsum(block[:-1], out=cp[1:])
        cp[1:] += start
        self._cp.replace(j0, self._cp.n, cp.astype(np.uint32))

    def locate(self, ids: np.ndarray, pos: int) -> int:
        """Index of the first token starting at or after byte `pos` (len(ids) if none)."""
        n = len(ids)
        if n == 0:
            return 0
        cp = self._cp.view()
        j = int(cp.searchsorted(np.uint32(pos), "right")) - 1  # uint32 needle: no int64 copy of cp
        if j < 0:
            return 0
        b = j * STRIDE
        block = self._starts_from(ids, b, int(cp[j]), min(n, b + STRIDE))
        return b + int(block.searchsorted(pos, "left"))

    def start_of(self, ids: np.ndarray, k: int) -> int:
        """Byte start of token `k` (``starts(ids, k, k + 1)[0]``; `ids` may be a longer buffer): the
        checkpoint's value plus at most ``STRIDE - 1`` lengths, in one compiled call where built
        (`starts`' seven numpy calls cost ~40 us right after a repair, their code evicted)."""
        if _native is not None:
            return _native.token_start(ids, self._token_len, self._cp.buffer, STRIDE, k)
        b = k - k % STRIDE
        start = int(self._cp.buffer[k // STRIDE])
        if k > b:
            start += int(np.take(self._token_len, ids[b:k]).sum(dtype=np.int64))
        return start

    def starts(self, ids: np.ndarray, lo: int, hi: int) -> np.ndarray:
        """Byte starts (int64) of tokens lo..hi-1."""
        if hi <= lo:
            return np.zeros(0, dtype=np.int64)
        j = lo // STRIDE
        b = j * STRIDE
        return self._starts_from(ids, b, int(self._cp.view()[j]), hi)[lo - b :]

    def _starts_from(self, ids: np.ndarray, b: int, start_b: int, hi: int) -> np.ndarray:
        lens = self._token_len[ids[b : hi - 1]].astype(np.int64)
        out = np.empty(hi - b, dtype=np.int64)
        out[0] = start_b
        np.cumsum(lens, out=out[1:])
        out[1:] += start_b
        return out
