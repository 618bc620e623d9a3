"""TokTier client: exact incremental tokenization served by a local sidecar.

Token IDs come back as read-only numpy ``uint32`` views of POSIX shared memory
(no copy, no Python list).  See ``toktier_client.shm`` for the segment layout and
lifetimes, ``toktier_client.protocol`` for the wire format, ``toktier_client.core``
for the sans-IO client core that ``Client`` and ``AsyncClient`` both drive.
"""

from ._conversation import AsyncConversationHandle, ConversationHandle, ConversationResult
from .aio import AsyncClient, AsyncSession
from .client import Client, Session
from .errors import (
    BadFrame,
    BadRequest,
    ChatTemplateError,
    ChatTemplateMissing,
    ConnectionLost,
    FrameTooLarge,
    InsecureRuntimeDir,
    InternalError,
    InvalidChatInput,
    InvalidConversationOp,
    InvalidEditRange,
    InvalidText,
    InvalidTokenIds,
    JunctionUnavailable,
    Overloaded,
    PermissionDenied,
    ProtocolError,
    ReferenceEngineError,
    InvalidState,
    RemoteError,
    RequestTimeout,
    ResourceExhausted,
    SegmentAccessDenied,
    SegmentGone,
    ServerIdentityError,
    SessionClosed,
    SessionConflict,
    SessionMiss,
    ShuttingDown,
    TokenizerDataMissing,
    TokenizerMismatch,
    TokTierError,
    TooLarge,
    UnknownTokenizer,
    UnsupportedTokenizer,
    VersionMismatch,
)
from .paths import default_socket_path
from .protocol import PROTOCOL_VERSION
from .shm import Result

__all__ = [
    "AsyncClient", "AsyncSession", "Client", "Session", "Result", "PROTOCOL_VERSION",
    "TokTierError", "RemoteError", "SessionMiss", "SessionConflict", "UnknownTokenizer",
    "TokenizerMismatch", "TokenizerDataMissing", "InvalidEditRange", "InvalidText", "BadRequest",
    "BadFrame", "FrameTooLarge", "TooLarge", "Overloaded", "PermissionDenied", "VersionMismatch",
    "ShuttingDown", "InternalError", "ConnectionLost", "ProtocolError", "RequestTimeout", "SegmentGone", "SegmentAccessDenied",
    "UnsupportedTokenizer", "ReferenceEngineError", "InvalidState", "ResourceExhausted", "SessionClosed",
    "ServerIdentityError", "InsecureRuntimeDir", "default_socket_path",
    "ConversationHandle", "AsyncConversationHandle", "ConversationResult",
    "ChatTemplateMissing", "ChatTemplateError", "InvalidChatInput", "InvalidTokenIds",
    "InvalidConversationOp", "JunctionUnavailable",
]
