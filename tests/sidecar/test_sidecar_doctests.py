"""The ``>>>`` examples in the sidecar-side modules' docstrings are invariants: run them."""

from __future__ import annotations

import doctest

import pytest

import sidecar.lanes
import toktier.store
import toktier_client.protocol


@pytest.mark.parametrize("module", [toktier.store, toktier_client.protocol, sidecar.lanes], ids=lambda m: m.__name__)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
