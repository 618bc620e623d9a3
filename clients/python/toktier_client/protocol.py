"""The TokTier wire protocol: the one definition, imported by the sidecar and the clients.

Transport: a Unix stream socket.  Each message is one *frame*::

    +----------------------+-------------------------------+
    | length: u32, big-end | body: msgpack, `length` bytes |
    +----------------------+-------------------------------+

The body is one msgspec Struct from a tagged union (tag field ``"t"``).  A
receiver enforces a maximum body length *before* buffering it, so a peer that
claims 4 GB is refused after 4 bytes.

Conversation::

    client                                  sidecar
    Hello(version)              ------->
                                <-------    Welcome(version, limits)   | Error(fatal)
    Open/Append/Edit/Sync/      ------->
    Encode/Close/Stats/
    ListTokenizers/Ping (id=N)
                                <-------    Ids/Closed/StatsReply/TokenizerList/Pong/Error (id=N)
    ConvOpen/ConvAppendMessages/ ------->
    ConvSetMessages/ConvAppendGenerated/
    ConvFork/ConvRollback/ConvClose (id=N)
                                <-------    ConvIds/Closed/Error (id=N)
    Release(segment)            ------->    (no reply)

Requests carry a client-chosen ``id``; replies carry the same ``id`` and may arrive
out of order (different sessions proceed concurrently; ops on one session are
applied in arrival order).  Token IDs never travel in frames: an ``Ids`` reply
says where they are in shared memory (see ``toktier_client.shm``).

Text offsets (``Edit.start``/``Edit.end``) count Unicode code points, as Python
``str`` indices do.  Enum-like strings are ``Literal`` types (msgspec refuses
other values at decode time, as ``bad_request``).  New fields are only ever added
with defaults, so older peers keep decoding newer messages.

The sidecar serves each request type with one handler (``toktier_sidecar.service.HANDLERS``);
adding an op is one Struct here, one handler there, one client method.  A new op is a new
tag, not a new ``PROTOCOL_VERSION``: a sidecar that predates it answers ``bad_request``
(unknown tag) for that request only, and the connection goes on.  The version changes only
when an existing message changes incompatibly.

Conversations (the ``Conv*`` ops, ``toktier.Conversation`` on the sidecar) take chat
messages as msgpack maps (JSON-able values only: no pickle, no extension types) and
answer with :class:`ConvIds`: the same shared-memory handover as ``Ids`` plus what a
conversation result says.  Sampled IDs (``ConvAppendGenerated.ids``) are the one place
token IDs travel in a frame: packed little-endian uint32, at most ``MAX_GENERATED_IDS``.

>>> frame = encode_frame(Hello(version=PROTOCOL_VERSION))
>>> FrameDecoder(max_frame=1024).feed(frame)[0] == frame[4:]
True
>>> REQUEST_DECODER.decode(frame[4:]) == Hello(version=PROTOCOL_VERSION)
True
"""

from __future__ import annotations

import enum
import struct
from typing import Any, ClassVar, Literal, Union

import msgspec

PROTOCOL_VERSION = 1

#: Default maximum frame body: 4 bytes per code point (UTF-8 worst case) of the
#: sidecar's default maximum session text (16 Mi code points), plus 64 KiB for the
#: message envelope, so a full-text ``Sync`` of the largest allowed session fits.
DEFAULT_MAX_SESSION_CHARS = 16 * 1024 * 1024
DEFAULT_MAX_FRAME = 4 * DEFAULT_MAX_SESSION_CHARS + 64 * 1024

HEADER = struct.Struct(">I")

#: Longest session id, in UTF-8 bytes.  Ids are store keys, lane keys and tombstones, and
#: error messages quote them: bounded, they cost the sidecar a known amount per session.
MAX_SESSION_ID_BYTES = 256
#: Longest ``op_key`` (the client's idempotency key for one op), in UTF-8 bytes.
MAX_OP_KEY_BYTES = 64

#: Most sampled IDs one ``ConvAppendGenerated`` carries: 1 Mi IDs (4 MiB packed), above the longest
#: generation any model emits in one turn (today 128K-256K tokens), and far below the frame limit.
MAX_GENERATED_IDS = 1 << 20
#: Longest chat template source a ``ConvOpen`` carries, in UTF-8 bytes: the biggest Hugging Face
#: templates are ~20 KB; the sidecar compiles and keeps each distinct one, so it is bounded.
MAX_TEMPLATE_BYTES = 256 * 1024

#: ``"all"``: special-token literals in the text are special tokens; ``"none"``: plain text.
Specials = Literal["all", "none"]
#: How the sidecar got a result (``toktier.RepairPath`` values).
RepairPathName = Literal["noop", "first_window", "widened", "full"]
#: Which cache answered a stateless encode (``toktier.CacheResult.layer``, plus ``"off"``):
#: ``"l0"`` the same whole text was cached, ``"l1"`` a cached text sharing a prefix was
#: repaired, ``"miss"`` the cache was consulted and the text tokenized in full, ``"off"`` no
#: cache was consulted (not asked for, disabled on the server, or a session result).
CacheLayer = Literal["l0", "l1", "miss", "off"]
#: How a conversation compares the messages it is sent with those it holds (``toktier.Conversation``'s
#: ``match``): ``strict``; ``loose_tool_call`` (tool-call arguments compared as JSON); ``role_content_only``.
MatchMode = Literal["strict", "loose_tool_call", "role_content_only"]
#: ConvOpen.track_drift: True (drift in every result), False (none) or "on_read" (ConvDrift computes it).
DriftMode = Union[bool, Literal["on_read"]]
#: One chat message as a template sees it: ``role`` plus any JSON-able fields.
Message = dict[str, Any]


class ErrorCode(str, enum.Enum):
    """Typed error codes; the client maps each to one exception class."""

    SESSION_MISS = "session_miss"
    SESSION_CONFLICT = "session_conflict"
    UNKNOWN_TOKENIZER = "unknown_tokenizer"
    TOKENIZER_MISMATCH = "tokenizer_mismatch"
    TOKENIZER_DATA_MISSING = "tokenizer_data_missing"
    UNSUPPORTED_TOKENIZER = "unsupported_tokenizer"
    REFERENCE_ENGINE_ERROR = "reference_engine_error"
    INVALID_STATE = "invalid_state"
    INVALID_EDIT_RANGE = "invalid_edit_range"
    INVALID_TEXT = "invalid_text"
    BAD_REQUEST = "bad_request"
    BAD_FRAME = "bad_frame"
    FRAME_TOO_LARGE = "frame_too_large"
    TOO_LARGE = "too_large"
    OVERLOADED = "overloaded"
    PERMISSION_DENIED = "permission_denied"
    VERSION_MISMATCH = "version_mismatch"
    SHUTTING_DOWN = "shutting_down"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    CHAT_TEMPLATE_MISSING = "chat_template_missing"
    CHAT_TEMPLATE_ERROR = "chat_template_error"
    INVALID_CHAT_INPUT = "invalid_chat_input"
    INVALID_TOKEN_IDS = "invalid_token_ids"
    INVALID_CONVERSATION_OP = "invalid_conversation_op"
    JUNCTION_UNAVAILABLE = "junction_unavailable"
    INTERNAL = "internal"


class _Msg(msgspec.Struct, tag_field="t", omit_defaults=True, frozen=True):
    """Base of every wire message (private: parameters are typed ``Request`` / ``Reply``)."""

    #: True for a request that gets no reply (``Release``).
    one_way: ClassVar[bool] = False


# --------------------------------------------------------------------- requests


class Hello(_Msg, tag="hello"):
    """First frame of every connection."""

    version: int
    client: str = ""


class Open(_Msg, tag="open"):
    """Create session ``session`` with ``text``; if it exists (same tokenizer), sync it to ``text``.

    ``tokenizer`` is a served name or a content hash; empty means the sidecar's
    default.  ``specials="none"`` treats special-token literals as plain text.
    ``window`` 0 means the sidecar's default repair window.  With
    ``bind_to_connection`` the session is closed when this connection closes.
    Open is idempotent: re-sending it always yields exactly ``text``'s tokens.

    ``create_only`` (recovery re-opens) refuses with ``session_conflict`` when the
    session already exists, unless it was created by this very request (same
    ``op_key``): a recovering client never overwrites what another writer rebuilt.
    """

    id: int
    session: str
    tokenizer: str = ""
    text: str = ""
    specials: Specials = "all"
    window: int = 0
    bind_to_connection: bool = False
    create_only: bool = False
    op_key: str = ""


class Append(_Msg, tag="append"):
    """Append ``text``.  ``expect_seq`` >= 0 refuses the op unless the session is at that seq.

    ``op_key`` (at most ``MAX_OP_KEY_BYTES``, unique per op) makes a re-sent op safe: when
    the session's latest op carried the same key, the sidecar answers with that op's result
    instead of a conflict (the first send was applied, its reply was lost).  Edit and Sync
    take it too."""

    id: int
    session: str
    text: str
    expect_seq: int = -1
    tokenizer: str = ""
    op_key: str = ""


class Edit(_Msg, tag="edit"):
    """Replace code points [start, end) of the session text with ``text``."""

    id: int
    session: str
    start: int
    end: int
    text: str
    expect_seq: int = -1
    tokenizer: str = ""
    op_key: str = ""


class Sync(_Msg, tag="sync"):
    """Make the session text equal ``text`` (the sidecar diffs it against the stored text)."""

    id: int
    session: str
    text: str
    expect_seq: int = -1
    tokenizer: str = ""
    op_key: str = ""


class Encode(_Msg, tag="encode"):
    """Stateless full encode of ``text``; the reply's segment is a one-shot handoff.

    ``cache``: answer through the sidecar's exact prefix cache for this tokenizer, reusing the
    tokens of any earlier cached encode sharing a prefix with ``text`` (caches are kept per
    namespace, as sessions are: the peer's uid, or one shared); the IDs are the same either
    way, the reply's ``layer`` says which cache answered.  A sidecar
    that predates the field ignores it (and its reply says ``layer="off"``)."""

    id: int
    text: str
    tokenizer: str = ""
    specials: Specials = "all"
    cache: bool = False


class Close(_Msg, tag="close"):
    """Close a session and unlink its segment."""

    id: int
    session: str


class Stats(_Msg, tag="stats"):
    id: int


class ListTokenizers(_Msg, tag="list_tokenizers"):
    id: int


class Ping(_Msg, tag="ping"):
    """Liveness round trip; answered with ``Pong`` without touching any session."""

    id: int


class Release(_Msg, tag="release"):
    """The client has mapped handoff ``segment``; the sidecar unlinks its name.  No reply."""

    one_way: ClassVar[bool] = True

    segment: str


# ---------------------------------------------------------------- conversations


class ConvOpen(_Msg, tag="conv_open"):
    """Create conversation ``conversation`` (no messages yet), or attach to it if it exists with
    the same tokenizer and options (the reply then shows its current state).

    ``template``: None for the tokenizer's registered template (``toktier.chat.template_for``),
    a registered template name (``"llama3_1"``, ``"deepseek_v3"``...), or a Jinja source (at
    most ``MAX_TEMPLATE_BYTES``).  ``template_kwargs`` become template variables
    (``enable_thinking=False``, ``tools=[...]``...): JSON-able values only.  ``stop_texts``:
    extra stop strings a generation may end with (besides the template's eos and the
    tokenizer's added tokens).  ``create_only`` refuses with ``session_conflict`` when the
    conversation exists.  ``track_drift=False`` keeps no drift reference (the exact re-render of
    the messages, repaired on every op): results then have ``drift=None`` and
    ``drift_tracked=False``, and token-in ops cost about half as much.  ``track_drift="on_read"``
    keeps the reference but brings it up to date only when :class:`ConvDrift` asks (one
    repair for all the ops since): results have ``drift=None`` and ``drift_tracked=False``, ops
    cost what they cost without it, and ``ConvDrift`` answers what every op's ``drift`` would.

    Conversation ids are their own namespace (per peer, as session ids are): a session and a
    conversation may share an id.  ``Close`` closes sessions; ``ConvClose`` conversations."""

    id: int
    conversation: str
    tokenizer: str = ""
    template: str | None = None
    template_kwargs: dict[str, Any] = {}
    match: MatchMode = "strict"
    add_generation_prompt: bool = True
    stop_texts: list[str] = []
    create_only: bool = False
    op_key: str = ""
    track_drift: DriftMode = True


class ConvAppendMessages(_Msg, tag="conv_append_messages"):
    """Append ``messages``.  ``expect_seq`` and ``op_key`` work as they do for ``Append``."""

    id: int
    conversation: str
    messages: list[Message]
    expect_seq: int = -1
    op_key: str = ""


class ConvSetMessages(_Msg, tag="conv_set_messages"):
    """Make the conversation's messages equal ``messages`` (the first changed message and the first
    changed rendered character become one exact edit)."""

    id: int
    conversation: str
    messages: list[Message]
    expect_seq: int = -1
    op_key: str = ""


class ConvAppendGenerated(_Msg, tag="conv_append_generated"):
    """Append sampled token IDs verbatim: ``ids`` is packed little-endian uint32 (4 bytes each, at
    most ``MAX_GENERATED_IDS``); every ID must be below the tokenizer's vocabulary size
    (else ``invalid_token_ids``).  ``then``: messages that follow the generated turn (tool
    results, the next user turn), appended in the same op (as a ``ConvAppendMessages`` right
    after it would, rendered and repaired once)."""

    id: int
    conversation: str
    ids: bytes
    expect_seq: int = -1
    op_key: str = ""
    then: list[dict[str, Any]] = []


class ConvFork(_Msg, tag="conv_fork"):
    """Create conversation ``new`` as a copy of ``conversation`` (which is unchanged); ``new`` must
    not exist.  ``expect_seq`` refers to ``conversation``."""

    id: int
    conversation: str
    new: str
    expect_seq: int = -1
    op_key: str = ""


class ConvRollback(_Msg, tag="conv_rollback"):
    """Back to the conversation's first ``n_messages`` messages (``toktier.Conversation.rollback``;
    more than it holds is ``invalid_conversation_op``)."""

    id: int
    conversation: str
    n_messages: int
    expect_seq: int = -1
    op_key: str = ""


class ConvDrift(_Msg, tag="conv_drift"):
    """Read the conversation's drift now (``toktier.Conversation.drift``): answered with
    :class:`ConvDriftIs`.  Changes nothing the client sees (the seq stays); with
    ``track_drift="on_read"`` the sidecar brings the drift reference up to date here, which may
    fail as the ops it skipped would have (``chat_template_error``: the template refused a real
    message that a generated turn's marker stood for).  ``expect_seq`` as for the other ops."""

    id: int
    conversation: str
    expect_seq: int = -1


class ConvClose(_Msg, tag="conv_close"):
    """Close a conversation and unlink its segment; answered with ``Closed``."""

    id: int
    conversation: str


Request = Union[Hello, Open, Append, Edit, Sync, Encode, Close, Stats, ListTokenizers, Ping, Release, ConvOpen,
                ConvAppendMessages, ConvSetMessages, ConvAppendGenerated, ConvFork, ConvRollback, ConvDrift,
                ConvClose]
SESSION_OPS = (Open, Append, Edit, Sync, Close)
CONVERSATION_OPS = (ConvOpen, ConvAppendMessages, ConvSetMessages, ConvAppendGenerated, ConvFork, ConvRollback,
                    ConvDrift, ConvClose)

# ---------------------------------------------------------------------- replies


class Welcome(_Msg, tag="welcome"):
    version: int
    server: str
    max_frame: int
    max_session_chars: int
    max_inflight: int
    default_tokenizer: str
    namespace: Literal["", "shared", "peer-uid"] = ""


class Ids(_Msg, tag="ids"):
    """Where the result's token IDs are: ``count`` uint32 at byte ``offset`` of ``segment``.

    ``seq`` is the session's op counter after this op (0 for stateless encodes); the
    segment header holds the seq of the state it currently shows.  ``handoff`` marks
    a one-shot segment the client must ``Release`` after mapping it.

    For an encode, ``layer`` says which cache answered (:data:`CacheLayer`), ``first_changed``
    is the first token that differs from the matched cache entry's (0 on a miss or with no
    cache; ``count`` on a whole-text hit) and ``reused_chars`` how many characters of the text
    the cache covered; ``path`` is always ``"full"`` (it describes session repairs)."""

    id: int
    segment: str
    offset: int
    count: int
    seq: int
    first_changed: int
    path: RepairPathName
    tokenizer: str
    widenings: int = 0
    handoff: bool = False
    layer: CacheLayer = "off"
    reused_chars: int = 0


class Closed(_Msg, tag="closed"):
    id: int
    existed: bool


class TokenizerInfo(msgspec.Struct, frozen=True, omit_defaults=True):
    name: str
    hash: str
    family: str = ""
    specials: Specials = "all"


class TokenizerList(_Msg, tag="tokenizers"):
    id: int
    available: list[str]
    loaded: list[TokenizerInfo]
    default: str = ""


class StatsReply(_Msg, tag="stats_reply"):
    id: int
    sessions: int
    bytes_held: int
    shm_bytes: int
    shm_segments: int
    opened: int
    closed: int
    misses: int
    evictions: dict[str, int]
    connections: int
    uptime_s: float
    inflight: int = 0  # requests being processed off the event loop (workers, queued lanes)
    verified: int = 0  # results re-encoded by the shadow verifier
    mismatches: int = 0  # ... that differed from the reference (each one is logged with a reproducer)
    conversations: int = 0  # conversations open (``sessions`` counts the others; the store, its budget and
    # ``opened``/``closed``/``misses``/``evictions`` are shared by both)


class Pong(_Msg, tag="pong"):
    """The answer to ``Ping``: the sidecar's ``time.monotonic()`` when it answered."""

    id: int
    monotonic: float


class Error(_Msg, tag="error"):
    """A typed failure of request ``id`` (0 when the request could not be identified).
    ``fatal`` means the sidecar closes the connection after this frame.  ``reason``
    is machine-readable detail: for ``session_miss``, why the session is not open
    (a ``toktier.EndCause`` value: ``closed``, ``ttl``, ``memory``, ... or ``unknown``)."""

    id: int
    code: ErrorCode
    message: str
    fatal: bool = False
    reason: str = ""


class ConvIds(_Msg, tag="conv_ids"):
    """A conversation op's result: ``count`` uint32 IDs at byte ``offset`` of ``segment``, as in
    :class:`Ids` (the conversation's own segment, rewritten in place from ``first_changed`` by
    its next op), plus what only a conversation says: ``first_changed_message`` (index of the
    first message whose tokens changed), ``drift`` (the first token index where the IDs differ
    from the exact re-render and re-tokenization of the messages, None when they are equal:
    only sampled IDs can drift; always None with ``drift_tracked`` False: see ``ConvOpen``),
    ``chars`` (the rendered text's length in code points) and ``messages`` (how many messages
    the conversation holds).

    A reply of its own rather than more ``Ids`` fields: a session result has no messages and
    no drift (a defaulted ``drift=None`` on every session reply would read as "no drift"),
    and a conversation result has no repair ``path``, cache ``layer`` or ``handoff``."""

    id: int
    segment: str
    offset: int
    count: int
    seq: int
    first_changed: int
    tokenizer: str
    first_changed_message: int = 0
    drift: int | None = None
    chars: int = 0
    messages: int = 0
    drift_tracked: bool = True


class ConvDriftIs(_Msg, tag="conv_drift_is"):
    """The answer to :class:`ConvDrift`: ``drift`` (None: the IDs equal the exact re-render, or
    ``drift_tracked`` is False: the conversation opened with ``track_drift=False``) at ``seq``."""

    id: int
    drift: int | None
    seq: int
    drift_tracked: bool = True


Reply = Union[Welcome, Ids, Closed, TokenizerList, StatsReply, Pong, Error, ConvIds, ConvDriftIs]

REQUEST_DECODER = msgspec.msgpack.Decoder(Request)
REPLY_DECODER = msgspec.msgpack.Decoder(Reply)


class _IdOnly(msgspec.Struct):
    """Decodes just the ``id`` of a frame that failed full validation (other fields are skipped
    unread, so an invalid UTF-8 text still yields its request id)."""

    id: int = 0


_ID_DECODER = msgspec.msgpack.Decoder(_IdOnly)


def salvage_request_id(body: bytes | memoryview) -> int | None:
    """The ``id`` of a malformed request body, or None if even that cannot be read."""
    try:
        return _ID_DECODER.decode(body).id
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):  # nested too deep
        return None


# ---------------------------------------------------------------------- framing


class FrameTooLargeError(Exception):
    """A frame header claims more than the receiver's maximum body length."""

    def __init__(self, claimed: int, limit: int) -> None:
        super().__init__(f"frame of {claimed} bytes exceeds the limit of {limit}")
        self.claimed = claimed
        self.limit = limit


class FrameDecoder:
    """Sans-IO frame splitter: ``feed(bytes) -> [body, ...]``.

    Buffers at most one partial frame (bounded by ``max_frame``).  Raises
    :class:`FrameTooLargeError` as soon as a header claims too much, without
    waiting for (or buffering) the claimed body.

    >>> d = FrameDecoder(max_frame=8)
    >>> d.feed(b"\\x00\\x00\\x00\\x02h"), d.feed(b"i\\x00"), d.buffered
    ([], [b'hi'], 1)
    """

    __slots__ = ("max_frame", "_buf", "_need")

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()
        self._need = -1  # body length of the frame being assembled, -1 = header not read yet

    @property
    def buffered(self) -> int:
        """Bytes of an incomplete frame held (0 at a frame boundary)."""
        return len(self._buf)

    @property
    def pending(self) -> int:
        """Body length the incomplete frame announced (0 at a frame boundary or mid-header):
        what a receiver with a buffer budget must reserve for it."""
        return max(self._need, 0)

    def feed(self, data: bytes | bytearray | memoryview) -> list[bytes]:
        buf = self._buf
        buf += data
        out: list[bytes] = []
        pos = 0
        n = len(buf)
        while True:
            if self._need < 0:
                if n - pos < 4:
                    break
                (need,) = HEADER.unpack_from(buf, pos)
                if need > self.max_frame:
                    del buf[:]
                    raise FrameTooLargeError(need, self.max_frame)
                self._need = need
                pos += 4
            if n - pos < self._need:
                break
            with memoryview(buf) as view:
                out.append(bytes(view[pos : pos + self._need]))
            pos += self._need
            self._need = -1
        if pos:
            del buf[:pos]
        return out


_ENCODER = msgspec.msgpack.Encoder()


def encode_frame(msg: Request | Reply, encoder: msgspec.msgpack.Encoder = _ENCODER) -> bytearray:
    """One frame (header + msgpack body) for ``msg``, built in a single buffer (no extra copy)."""
    buf = bytearray(4)
    encoder.encode_into(msg, buf, 4)
    HEADER.pack_into(buf, 0, len(buf) - 4)
    return buf
