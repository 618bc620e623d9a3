"""Sidecar-side errors and the one table that maps every error class to a wire code.

Core errors (``toktier.errors``) keep their classes; the client re-raises each
code as the class of the same name and builtin bases (``toktier_client.errors``),
with the same structured fields (``SessionMiss.reason``).
"""

from __future__ import annotations

from toktier.errors import (
    ChatTemplateError,
    ChatTemplateMissing,
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
from toktier.store import SessionMiss
from toktier_client.protocol import Error, ErrorCode


class SidecarError(TokTierError):
    """Base of errors raised by the sidecar itself; ``code`` is the wire code."""

    code = ErrorCode.INTERNAL


class SessionConflict(SidecarError):
    """``expect_seq`` does not match the session's current seq."""

    code = ErrorCode.SESSION_CONFLICT


class TokenizerMismatch(SidecarError, ValueError):
    """The request names a tokenizer other than the one the session is bound to."""

    code = ErrorCode.TOKENIZER_MISMATCH


class TooLarge(SidecarError):
    """The op would exceed the maximum text per session (or per stateless encode)."""

    code = ErrorCode.TOO_LARGE


class Overloaded(SidecarError):
    """A concurrency limit was hit."""

    code = ErrorCode.OVERLOADED


class BadRequest(SidecarError, ValueError):
    """A well-formed request with unacceptable values (window, specials...)."""

    code = ErrorCode.BAD_REQUEST


class ShuttingDown(SidecarError):
    code = ErrorCode.SHUTTING_DOWN


class ResourceExhausted(SidecarError):
    """The host could not give this request shared memory (``/dev/shm`` full: ENOSPC, or
    ENOMEM).  Raised when a segment is created or grown, before any ID is written to it, so
    the failure is this request's alone (no SIGBUS later)."""

    code = ErrorCode.RESOURCE_EXHAUSTED


_CORE_CODES: dict[type[BaseException], ErrorCode] = {
    SessionMiss: ErrorCode.SESSION_MISS,
    UnknownTokenizer: ErrorCode.UNKNOWN_TOKENIZER,
    UnsupportedTokenizer: ErrorCode.UNSUPPORTED_TOKENIZER,
    TokenizerDataMissing: ErrorCode.TOKENIZER_DATA_MISSING,
    InvalidEditRange: ErrorCode.INVALID_EDIT_RANGE,
    InvalidText: ErrorCode.INVALID_TEXT,
    # The reference engine itself failed on this text: expected (not a TokTier bug); the
    # client re-raises it as its own ReferenceEngineError (a RuntimeError, as in the core).
    ReferenceEngineError: ErrorCode.REFERENCE_ENGINE_ERROR,
    InvalidState: ErrorCode.INVALID_STATE,
    # Conversations (toktier.chat, toktier.Conversation): the template or the messages are the
    # caller's to fix; the client re-raises each as its own class of the same name.
    ChatTemplateMissing: ErrorCode.CHAT_TEMPLATE_MISSING,
    ChatTemplateError: ErrorCode.CHAT_TEMPLATE_ERROR,
    InvalidChatInput: ErrorCode.INVALID_CHAT_INPUT,
    InvalidTokenIds: ErrorCode.INVALID_TOKEN_IDS,
    InvalidConversationOp: ErrorCode.INVALID_CONVERSATION_OP,
    JunctionUnavailable: ErrorCode.JUNCTION_UNAVAILABLE,
}


def code_for(exc: BaseException) -> ErrorCode | None:
    """The wire code for an expected error, or None for a bug (reported as ``internal``)."""
    if isinstance(exc, SidecarError):
        return exc.code
    for cls, code in _CORE_CODES.items():
        if isinstance(exc, cls):
            return code
    return None


#: Longest message an error frame carries: messages quote client input (ids, names), and an
#: error reply must never cost more than the request that caused it.
MAX_MESSAGE_CHARS = 1024


def error_frame(request_id: int, exc: BaseException) -> Error:
    """The one ``Error`` frame for a failed request: its code, its message and its structured
    fields (``reason`` for a session miss).  A bug becomes ``internal`` with the exception's
    class name only (the traceback is logged, never sent)."""
    code = code_for(exc)
    if code is None:
        return Error(id=request_id, code=ErrorCode.INTERNAL, message=f"internal error: {type(exc).__name__}")
    reason = exc.reason if isinstance(exc, SessionMiss) else ""
    message = str(exc)
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[: MAX_MESSAGE_CHARS - 3] + "..."
    return Error(id=request_id, code=code, message=message, reason=reason[:64])
