"""GPU full path: regex-free pre-tokenizer and round-parallel BPE.

The kernels live in ``cuda_src/``; this package holds their numpy *host models*
(``pretok_model``, ``bpe_model``), the device table layouts (``tables``), the
PyCUDA driver (``driver``, imported lazily) and the router (``router``), which a
`toktier.fullpath.FullPath` is given to try the GPU first.

Nothing here imports pycuda at import time: ``import toktier.gpu`` works on any
machine.  The host models are exact: they are tested against the reference
pre-tokenizer at the piece level and against the reference encode at the ID level.

>>> import toktier, toktier.gpu
>>> tok = toktier.load_tokenizer("cl100k_base")
>>> toktier.gpu.encode(tok, "Hello world").tolist() == tok.encode("Hello world").tolist()
True
"""

from __future__ import annotations

from .bpe_model import encode, encode_with_spans
from .pretok_model import pieces, supported_rules
from .router import Router, RouterConfig

__all__ = ["Router", "RouterConfig", "encode", "encode_with_spans", "pieces", "supported_rules"]
