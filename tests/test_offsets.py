"""Sparse token offsets: every lookup equals the dense prefix sum of token byte lengths."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from toktier.offsets import STRIDE, SparseOffsets

TOKEN_LEN = np.array([1, 2, 3, 5, 8, 13, 128], dtype=np.uint32)  # byte length per token id


def dense_starts(ids: np.ndarray) -> np.ndarray:
    lens = TOKEN_LEN[ids].astype(np.int64)
    return np.concatenate(([0], np.cumsum(lens)[:-1])) if len(ids) else np.zeros(0, np.int64)


def check(off: SparseOffsets, ids: np.ndarray) -> None:
    dense = dense_starts(ids)
    total = int(TOKEN_LEN[ids].sum()) if len(ids) else 0
    assert np.array_equal(off.starts(ids, 0, len(ids)), dense)
    for lo, hi in [(0, 1), (STRIDE - 1, STRIDE + 2), (len(ids) // 2, len(ids)), (len(ids) - 1, len(ids))]:
        lo, hi = max(0, lo), min(len(ids), hi)
        assert np.array_equal(off.starts(ids, lo, hi), dense[lo:hi])
    for pos in {0, 1, total // 3, total - 1, total, total + 7, *dense[:: max(1, len(ids) // 50)].tolist()}:
        assert off.locate(ids, int(pos)) == int(np.searchsorted(dense, pos, "left")), pos
    longer = np.concatenate((ids, np.arange(5, dtype=np.uint32)))  # a buffer with room after the ids
    for k in {*range(0, len(ids), max(1, len(ids) // 40)), len(ids) - 1} - {-1}:
        assert off.start_of(longer, k) == int(dense[k]), k


ids_strategy = st.lists(st.integers(0, len(TOKEN_LEN) - 1), max_size=400).map(lambda x: np.array(x, np.uint32))


@settings(max_examples=200, deadline=None)
@given(ids=ids_strategy, splices=st.lists(st.tuples(st.integers(0, 400), st.integers(0, 400), ids_strategy),
                                          max_size=6), given_lens=st.booleans())
def test_locate_and_starts_match_the_dense_prefix_sum_through_splices(ids, splices, given_lens):
    off = SparseOffsets(TOKEN_LEN)
    off.rebuild(ids)
    check(off, ids)
    for a, b, mid in splices:
        k1, k2 = sorted((min(a, len(ids)), min(b, len(ids))))
        start_k1 = int(dense_starts(ids)[k1]) if k1 < len(ids) else int(TOKEN_LEN[ids].sum())
        ids = np.concatenate((ids[:k1], mid, ids[k2:])).astype(np.uint32)
        off.reserve_for(len(ids))
        off.rebuild(ids, k1, start_k1, lens=TOKEN_LEN[ids] if given_lens else None)  # the caller's lengths
        check(off, ids)


def test_memory_is_one_checkpoint_per_stride():
    ids = np.zeros(64_000, dtype=np.uint32)
    off = SparseOffsets(TOKEN_LEN)
    off.rebuild(ids)
    assert off.nbytes <= 4 * (len(ids) // STRIDE) * 1.5 + 64


@settings(max_examples=200, deadline=None)
@given(ids=ids_strategy, stale=ids_strategy)
def test_rebuild_all_equals_the_dense_prefix_sum(ids, stale):
    """The compiled whole-state pass (session starts and restores) against the dense sum, over an
    offsets object that held another state before (its checkpoints must all be replaced)."""
    off = SparseOffsets(TOKEN_LEN)
    off.rebuild(stale)
    total = off.rebuild_all(ids)
    assert total == int(TOKEN_LEN[ids].sum(dtype=np.int64))
    assert len(off.checkpoints()) == -(-len(ids) // STRIDE)
    check(off, ids)


def test_rebuild_all_refuses_an_id_outside_the_table():
    off = SparseOffsets(TOKEN_LEN)
    with pytest.raises(IndexError):
        off.rebuild_all(np.array([0, len(TOKEN_LEN)], dtype=np.uint32))


def test_the_compiled_pass_is_the_one_tested_where_built():
    from toktier.native import BUILD_ERROR, _core
    assert (_core is None) == (BUILD_ERROR is not None)
    if _core is not None:
        out = np.zeros(2, dtype=np.uint32)
        ids = np.arange(len(TOKEN_LEN), dtype=np.uint32)
        assert _core.token_checkpoints(ids, TOKEN_LEN, STRIDE, out) == int(TOKEN_LEN.sum())
        assert _core.token_checkpoints(np.array([99], np.uint32), TOKEN_LEN, STRIDE, out) == -1


@settings(max_examples=60, deadline=None)
@given(ids=ids_strategy.filter(len))
def test_start_of_is_starts_in_both_paths(ids):
    """`start_of` (the compiled `token_start` where built, numpy otherwise) answers as `starts`."""
    import toktier.offsets as offsets_module

    off = SparseOffsets(TOKEN_LEN)
    off.rebuild(ids)
    want = off.starts(ids, 0, len(ids))
    compiled = offsets_module._native
    for native in {compiled, None}:
        offsets_module._native = native
        try:
            for k in {0, len(ids) - 1, len(ids) // 2, min(len(ids) - 1, STRIDE)}:
                assert off.start_of(ids, k) == int(want[k]), (native is None, k)
        finally:
            offsets_module._native = compiled


def test_token_start_refuses_what_it_cannot_answer():
    from toktier.native import _core
    if _core is None:
        pytest.skip("the compiled module is not built")
    off = SparseOffsets(TOKEN_LEN)
    ids = np.array([0, 1, 2, 3, 4, 5, 6, 0, 1, 2], dtype=np.uint32)
    off.rebuild(ids)
    cps = off.checkpoints()
    assert _core.token_start(ids, TOKEN_LEN, cps, STRIDE, 9) == int(TOKEN_LEN[ids[:9]].sum())
    with pytest.raises(IndexError):
        _core.token_start(ids, TOKEN_LEN, cps, STRIDE, 10)
    with pytest.raises(IndexError):
        _core.token_start(np.array([10**6, 0], np.uint32), TOKEN_LEN, cps, STRIDE, 1)
    with pytest.raises(TypeError, match="uint32"):
        _core.token_start(ids.astype(np.int64), TOKEN_LEN, cps, STRIDE, 1)
