"""Errors the client raises.

Two kinds, kept apart (as h11 and asyncpg do):

* :class:`RemoteError` subclasses: the sidecar answered with a typed error frame.
  Each wire :class:`~toktier_client.protocol.ErrorCode` maps to exactly one class
  here, and the classes carry the same names and builtin bases as the core
  library's (``UnknownTokenizer`` is a ``KeyError``, ``InvalidEditRange`` a
  ``ValueError``, ``ReferenceEngineError`` a ``RuntimeError``...), so ``except
  KeyError`` works the same in-process and over the socket.  The mapping is by
  code, never by message text; structured fields travel as frame fields
  (``SessionMiss.reason``).  This package does not import ``toktier``: it
  depends on the wire protocol only.
* Local conditions: :class:`ConnectionLost` (the socket died),
  :class:`ProtocolError` (the *server* sent something this client cannot
  understand), :class:`SegmentAccessDenied`, :class:`SegmentGone` (a reply named a shared-memory segment that
  no longer exists because a later op on the same session already replaced it),
  :class:`SessionClosed` (the session ended before its reply could be mapped),
  :class:`ServerIdentityError` (whoever listens on the socket, or owns a segment, is not the
  expected server uid) and :class:`InsecureRuntimeDir` (the socket's directory is not private).
"""

from __future__ import annotations

from .protocol import Error, ErrorCode


class TokTierError(Exception):
    """Base class of every error this package raises."""


class RemoteError(TokTierError):
    """The sidecar refused or failed a request; ``code`` is the wire error code,
    ``request_id`` the id of the request it answers (0 for the connection)."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str = "", *, request_id: int = 0) -> None:
        super().__init__(message)
        self.request_id = request_id

    def __str__(self) -> str:  # KeyError subclasses would quote the message otherwise
        return str(self.args[0]) if self.args else ""

    @classmethod
    def _from_frame(cls, frame: Error) -> "RemoteError":
        """This class's instance for ``frame`` (subclasses with fields read theirs)."""
        return cls(frame.message, request_id=frame.id)


class SessionMiss(RemoteError, KeyError):
    """The session is unknown to the sidecar (never opened, closed, evicted or lost in a restart).

    ``reason`` says why, as the core's ``SessionMiss.reason`` does: ``"closed"``,
    ``"ttl"``, ``"memory"``, ``"capacity"``, ``"shutdown"`` or ``"unknown"``.
    Answer it by re-opening the session with its full text (``Client.session(...,
    recover=True)`` does this automatically)."""

    code = ErrorCode.SESSION_MISS

    def __init__(self, message: str = "", *, request_id: int = 0, reason: str = "unknown") -> None:
        super().__init__(message, request_id=request_id)
        self.reason = reason

    @classmethod
    def _from_frame(cls, frame: Error) -> "SessionMiss":
        return cls(frame.message, request_id=frame.id, reason=frame.reason or "unknown")


class SessionConflict(RemoteError):
    """The session changed since the state this client last saw (``expect_seq`` mismatch),
    e.g. a retried op after a dropped connection, or another connection using the same id."""

    code = ErrorCode.SESSION_CONFLICT


class UnknownTokenizer(RemoteError, KeyError):
    """No tokenizer with that name or hash is served; the message lists what exists."""

    code = ErrorCode.UNKNOWN_TOKENIZER


class TokenizerMismatch(RemoteError, ValueError):
    """The session is bound to a different tokenizer than the request names."""

    code = ErrorCode.TOKENIZER_MISMATCH


class TokenizerDataMissing(RemoteError, FileNotFoundError):
    """A bundled tokenizer whose reference data is not installed on the sidecar host."""

    code = ErrorCode.TOKENIZER_DATA_MISSING


class UnsupportedTokenizer(RemoteError, ValueError):
    """A tokenizer file the sidecar cannot load at all (not a tokenizer.json / tiktoken rank file)."""

    code = ErrorCode.UNSUPPORTED_TOKENIZER


class ReferenceEngineError(RemoteError, RuntimeError):
    """The reference tokenizer engine itself failed on this text (the message names its error).

    Not a TokTier bug and not retryable as is: TokTier has no answer where its reference has none."""

    code = ErrorCode.REFERENCE_ENGINE_ERROR


class InvalidState(RemoteError, ValueError):
    """A primed ``(text, ids)`` state that is not the reference encoding (or a corrupt certificate)."""

    code = ErrorCode.INVALID_STATE


class InvalidEditRange(RemoteError, ValueError):
    """An edit's [start, end) is reversed or outside the session text (code-point offsets)."""

    code = ErrorCode.INVALID_EDIT_RANGE


class InvalidText(RemoteError, ValueError):
    """Text that is not valid Unicode / UTF-8 (e.g. lone surrogates)."""

    code = ErrorCode.INVALID_TEXT


class BadRequest(RemoteError, ValueError):
    """A well-framed message the sidecar does not accept (wrong shape, wrong field types)."""

    code = ErrorCode.BAD_REQUEST


class BadFrame(RemoteError):
    """A frame the sidecar could not decode at all; the sidecar drops the connection."""

    code = ErrorCode.BAD_FRAME


class FrameTooLarge(RemoteError):
    """A frame longer than the sidecar's maximum; the sidecar drops the connection."""

    code = ErrorCode.FRAME_TOO_LARGE


class TooLarge(RemoteError):
    """The op would grow a session (or a stateless text) beyond the sidecar's limit."""

    code = ErrorCode.TOO_LARGE


class Overloaded(RemoteError):
    """A limit on concurrency was hit (connections, in-flight requests, pending handoffs)."""

    code = ErrorCode.OVERLOADED


class PermissionDenied(RemoteError, PermissionError):
    """The sidecar does not admit this peer's uid/gid (SO_PEERCRED)."""

    code = ErrorCode.PERMISSION_DENIED


class VersionMismatch(RemoteError):
    """The sidecar speaks a different protocol version."""

    code = ErrorCode.VERSION_MISMATCH


class ShuttingDown(RemoteError):
    """The sidecar is shutting down and takes no new requests."""

    code = ErrorCode.SHUTTING_DOWN


class ResourceExhausted(RemoteError):
    """The sidecar host ran out of shared memory (``/dev/shm`` full, ENOSPC/ENOMEM) for this
    request.  Only this request failed (a session that could not grow was closed and its
    segment unlinked); every other session is intact.  Free memory, or raise ``/dev/shm``'s
    size (Docker: ``--shm-size``), then re-open."""

    code = ErrorCode.RESOURCE_EXHAUSTED


class ChatTemplateMissing(RemoteError, LookupError):
    """No chat template for the conversation's tokenizer on the sidecar (none registered, or its file
    not fetched there); the message says how to get one, or pass ``template=`` yourself."""

    code = ErrorCode.CHAT_TEMPLATE_MISSING


class ChatTemplateError(RemoteError, ValueError):
    """The chat template does not compile, or raised while rendering (the message carries the
    template's own message, e.g. its ``raise_exception`` text)."""

    code = ErrorCode.CHAT_TEMPLATE_ERROR


class InvalidChatInput(RemoteError, ValueError):
    """Messages, template variables or options a chat template cannot be given (the message
    names which)."""

    code = ErrorCode.INVALID_CHAT_INPUT


class InvalidTokenIds(RemoteError, ValueError):
    """Sampled token IDs the conversation's tokenizer does not have (outside its vocabulary; the
    message names one)."""

    code = ErrorCode.INVALID_TOKEN_IDS


class InvalidConversationOp(RemoteError, ValueError):
    """A conversation op its current state does not allow (a rollback past its length, sampled IDs
    with no prompt to continue...); the message says what the state allows."""

    code = ErrorCode.INVALID_CONVERSATION_OP


class JunctionUnavailable(RemoteError, ValueError):
    """The chat template gives sampled IDs no single place in the text (it does not render the
    generated turn exactly once): token-in-token-out is undefined for it; send text messages."""

    code = ErrorCode.JUNCTION_UNAVAILABLE


class InternalError(RemoteError):
    """An unexpected failure inside the sidecar (it is logged there)."""

    code = ErrorCode.INTERNAL


class ConnectionLost(TokTierError, ConnectionError):
    """The socket closed or failed before the reply arrived."""


class RequestTimeout(TokTierError, TimeoutError):
    """No reply within the client's ``timeout``.  The connection stays usable (a late reply is
    discarded); the request may still have been applied."""


class ProtocolError(TokTierError):
    """The sidecar sent something this client does not understand."""


class SegmentGone(TokTierError):
    """A reply's shared-memory segment was already unlinked by a later op on the session."""


class SegmentAccessDenied(TokTierError, PermissionError):
    """This process may not map the segment (it runs under another uid and the sidecar was not
    configured with a group it shares)."""


class SessionClosed(SessionMiss):
    """The op was answered, but its session ended (closed, expired or evicted through another
    connection) before this client could map the result's segment: there is no result to
    read.  A :class:`SessionMiss` with ``reason`` ``"closed"``; the client never returns a
    reply whose segment is already gone."""

    def __init__(self, message: str = "", *, request_id: int = 0, reason: str = "closed") -> None:
        super().__init__(message, request_id=request_id, reason=reason)


class ServerIdentityError(TokTierError, PermissionError):
    """The process listening on the socket (SO_PEERCRED), or the owner of a shared-memory
    segment a reply names, is not the expected server uid: possibly an impostor.  Nothing
    was sent to it.  Expected: this process's own uid, or ``expected_server_uid=`` /
    ``$TOKTIER_SERVER_UID`` when the sidecar runs as another user."""


class InsecureRuntimeDir(TokTierError, PermissionError):
    """The directory that holds (or would hold) the socket is not private: a symlink, not a
    directory, owned by another uid, or writable by group/others.  Another local user could
    place an impostor socket there."""


ERRORS_BY_CODE: dict[ErrorCode, type[RemoteError]] = {
    cls.code: cls
    for cls in (
        SessionMiss, SessionConflict, UnknownTokenizer, TokenizerMismatch, TokenizerDataMissing,
        UnsupportedTokenizer, InvalidEditRange, InvalidText, BadRequest, BadFrame, FrameTooLarge, TooLarge,
        Overloaded, PermissionDenied, VersionMismatch, ShuttingDown, ReferenceEngineError, InvalidState,
        ResourceExhausted, ChatTemplateMissing, ChatTemplateError, InvalidChatInput, InvalidTokenIds,
        InvalidConversationOp, JunctionUnavailable, InternalError,
    )
}


def error_from_frame(frame: Error) -> RemoteError:
    """The exception for a wire error frame: the class of its code, with the frame's fields."""
    return ERRORS_BY_CODE.get(frame.code, InternalError)._from_frame(frame)


def error_from_code(code: ErrorCode, message: str, request_id: int = 0, reason: str = "") -> RemoteError:
    """The exception for an error code (``error_from_frame`` without a frame)."""
    return error_from_frame(Error(id=request_id, code=code, message=message, reason=reason))
