"""The ``>>>`` examples in the sidecar-side modules' docstrings are invariants: run them."""

from __future__ import annotations

import doctest

import pytest

import toktier_sidecar.lanes
import toktier_sidecar.shadow
import toktier.store
import toktier_client._conversation
import toktier_client._session
import toktier_client.core
import toktier_client.protocol

MODULES = [toktier.store, toktier_client.protocol, toktier_client.core, toktier_client._session, toktier_sidecar.lanes,
           toktier_sidecar.shadow, toktier_client._conversation]


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
