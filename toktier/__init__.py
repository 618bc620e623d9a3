"""TokTier: exact, stateful, incremental tokenization for agentic LLM serving.

The public surface is small:

>>> import toktier
>>> tok = toktier.load_tokenizer("cl100k_base")
>>> s = toktier.Session(tok, "Hello")
>>> r = s.append(" world")
>>> r.ids.tolist() == tok.encode("Hello world").tolist()
True

Every op's IDs equal the reference tokenizer's encoding of the whole current
text; a repair that cannot be certified falls back to full tokenization.
"""

from .errors import (
    ChatTemplateError,
    ChatTemplateMissing,
    InvalidCacheConfig,
    InvalidChatInput,
    InvalidConversationOp,
    InvalidEditRange,
    InvalidState,
    InvalidText,
    InvalidTokenIds,
    JunctionUnavailable,
    ReferenceEngineError,
    TokenizerDataMissing,
    TokTierError,
    UnknownTokenizer,
    UnsupportedTokenizer,
)
from . import chat
from .chat import ChatTemplate
from .conversation import Conversation, ConversationPath, ConversationResult, GeneratedRun
from .fullpath import FullPath, FullPathConfig
from .junctions import Junction, derive_junction
from .prefix_cache import CacheResult, PrefixCache, PrefixCacheStats
from .registry import FrozenTokenizer, Registry, list_tokenizers, load_tokenizer
from .session import OpResult, RepairPath, Session, SessionStats
from .store import EndCause, SessionMiss, SessionStore

__all__ = [
    "CacheResult",
    "ChatTemplate",
    "ChatTemplateError",
    "ChatTemplateMissing",
    "Conversation",
    "ConversationPath",
    "ConversationResult",
    "EndCause",
    "FrozenTokenizer",
    "FullPath",
    "FullPathConfig",
    "GeneratedRun",
    "InvalidCacheConfig",
    "InvalidChatInput",
    "InvalidConversationOp",
    "InvalidEditRange",
    "InvalidState",
    "InvalidText",
    "InvalidTokenIds",
    "Junction",
    "JunctionUnavailable",
    "OpResult",
    "PrefixCache",
    "PrefixCacheStats",
    "Registry",
    "ReferenceEngineError",
    "RepairPath",
    "Session",
    "SessionMiss",
    "SessionStats",
    "SessionStore",
    "TokTierError",
    "TokenizerDataMissing",
    "UnknownTokenizer",
    "UnsupportedTokenizer",
    "chat",
    "derive_junction",
    "list_tokenizers",
    "load_tokenizer",
]
__version__ = "0.1.0"
