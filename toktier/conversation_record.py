"""Conversation records: what a conversation's IDs are a function of, as checksummed bytes, and back.

A session record (:mod:`toktier.persist`) stores a text and its IDs.  A conversation's IDs are
a function of its settings, messages and pinned runs (`toktier.conversation`'s definition), so
its record stores those, not the rendered text::

    magic "TTCR" | u16 version | u16 0 | u32 payload bytes        (12 bytes, little-endian)
    payload (msgpack map: tokenizer hash and name, namespace, conversation id, seq, op_key,
             the template itself (kind, source, special tokens, name), render kwargs, match,
             add_generation_prompt, stop_texts, track_drift, incremental, the messages,
             the runs as (message index, sampled uint32 IDs), the IDs' count and CRC-32)
    CRC-32 (u32) of everything before it

`ConversationRecord.restore` replays it (`Conversation.replay`: one render and encode of the
whole conversation, one windowed op per run) and then compares the IDs it got with the
recorded count and CRC-32.  What that guarantees, next to :mod:`toktier.persist`'s list:

1. *Damage*: the CRC-32 over the record (:class:`~toktier.persist.CorruptRecord`), and msgpack
   that must decode into the record's exact shape.
2. *Not ours to use*: the version, the tokenizer hash (:class:`~toktier.persist.ForeignRecord`);
   the key is the server's to compare.
3. *Not the IDs it had*: the replay's IDs are the reference's for the recorded messages by
   construction; they can still differ from the IDs the conversation had (a build whose
   template rendering or junction derivation changed, a template the record does not hold
   exactly).  The count and CRC-32 of the IDs catch that (:class:`ReplayMismatch`, a kind of
   ForeignRecord): the model's KV cache holds the old IDs, so such a record is a miss (the
   client re-sends its messages), never a conversation whose IDs silently changed.

The template's source is stored, not its name: a restored conversation renders with the template
it was opened with, even when the installed template files changed since.

>>> import toktier
>>> from toktier.conversation import Conversation
>>> tok = toktier.load_tokenizer("cl100k_base")
>>> t = toktier.chat.ChatTemplate("{% for m in messages %}{{ m.role }}:{{ m.content }}\\n{% endfor %}")
>>> c = Conversation(tok, t)
>>> _ = c.append_messages([{"role": "user", "content": "Hi"}])
>>> _ = c.append_generated(tok.encode(" Hello"))
>>> rec = ConversationRecord.of(c, tok, namespace=1000, conversation="chat-1", seq=2)
>>> back = decode_conversation_record(encode_conversation_record(rec)).restore(tok)
>>> back.ids.tolist() == c.ids.tolist(), back.messages == c.messages
(True, True)
"""

from __future__ import annotations

import struct
import zlib
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from .chat import ChatTemplate, Renderer
from .conversation import Conversation, ConversationState
from .errors import ChatTemplateMissing, TokTierError
from .persist import CorruptRecord, ForeignRecord

if TYPE_CHECKING:
    from .fullpath import FullPath
    from .registry import FrozenTokenizer

MAGIC = b"TTCR"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<4sHHI")
_CRC = struct.Struct("<I")


class ReplayMismatch(ForeignRecord):
    """The record replays to other IDs than the conversation had (this build renders or derives
    junctions otherwise): not usable, the client's IDs would silently change."""


class UnserializableConversation(TokTierError, TypeError):
    """A conversation whose messages or render kwargs are not msgpack-able (e.g. Python objects as
    template variables): it cannot have a record."""


class ConversationRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One conversation's record (see the module docstring)."""

    tokenizer_hash: str
    tokenizer_name: str
    namespace: int | str
    conversation: str
    seq: int
    op_key: str = ""
    #: How the server named the template when the conversation was opened (its attach check);
    #: opaque here.
    template_ref: list[str] = []
    template_source: str
    #: "jinja" (a `ChatTemplate` of `template_source`) or "harmony" (`toktier.harmony.HarmonyTemplate`).
    template_kind: str = "jinja"
    template_special_tokens: dict[str, str] = {}
    template_name: str = "custom"
    template_origin: str = "given by the caller"
    render_kwargs: dict[str, Any] = {}
    match: str = "strict"
    add_generation_prompt: bool = True
    stop_texts: list[str] = []
    track_drift: bool | str = True  # True, False or "on_read" (`toktier.conversation.check_drift_mode`)
    incremental: bool = True
    messages: list[dict[str, Any]] = []
    runs: list[tuple[int, bytes]] = []
    count: int = 0
    ids_crc: int = 0

    @classmethod
    def of(cls, conv: Conversation, tok: FrozenTokenizer, *, namespace: int | str, conversation: str, seq: int,
           op_key: str = "", template_ref: tuple[str, ...] = ()) -> ConversationRecord:
        """The record of ``conv`` now (its state and its IDs' count and CRC)."""
        return cls.from_state(conv.state(), conv.ids, tok, namespace=namespace, conversation=conversation, seq=seq,
                              op_key=op_key, template_ref=template_ref)

    @classmethod
    def from_state(cls, state: ConversationState, ids: np.ndarray, tok: FrozenTokenizer, *, namespace: int | str,
                   conversation: str, seq: int, op_key: str = "",
                   template_ref: tuple[str, ...] = ()) -> ConversationRecord:
        """The record of a conversation whose `Conversation.state()` was ``state`` and IDs ``ids``
        (taken together, e.g. on a server's loop thread; this part may run on any thread)."""
        t = state.template
        ids = np.ascontiguousarray(ids, dtype="<u4")
        return cls(tokenizer_hash=tok.hash, tokenizer_name=tok.name, namespace=namespace, conversation=conversation,
                   seq=seq, op_key=op_key, template_ref=list(template_ref), template_source=t.source,
                   template_kind=t.kind,
                   template_special_tokens=dict(t.special_tokens), template_name=t.name, template_origin=t.origin,
                   render_kwargs=dict(state.render_kwargs), match=state.match,
                   add_generation_prompt=state.add_generation_prompt, stop_texts=list(state.stop_texts),
                   track_drift=state.track_drift, incremental=state.incremental, messages=list(state.messages),
                   runs=[(int(k), np.ascontiguousarray(s, dtype="<u4").tobytes()) for k, s in state.runs],
                   count=len(ids), ids_crc=zlib.crc32(ids.data))

    def template(self) -> Renderer:
        """The recorded template, compiled (a server may reuse its own compiled copy when
        `template_kind`, `template_source` and `template_special_tokens` equal it)."""
        if self.template_kind == "harmony":
            from .harmony import HarmonyTemplate, _library

            if self.template_source != HarmonyTemplate.source:
                raise ForeignRecord(f"record renders with {self.template_source!r}, which this build does not have")
            try:
                _library()
            except ChatTemplateMissing as exc:  # a server without openai-harmony: a miss, as any foreign record
                raise ForeignRecord(f"record renders with openai-harmony: {exc}") from exc
            return HarmonyTemplate(name=self.template_name, origin=self.template_origin)
        if self.template_kind != "jinja":
            raise ForeignRecord(f"record renders with a {self.template_kind!r} template, which this build does "
                                "not have")
        return ChatTemplate(self.template_source, self.template_special_tokens, name=self.template_name,
                            origin=self.template_origin)

    def state(self, template: Renderer | None = None) -> ConversationState:
        """The recorded state; ``template`` (equal to the recorded one) saves compiling it."""
        if template is None or template.kind != self.template_kind or template.source != self.template_source \
                or dict(template.special_tokens) != self.template_special_tokens:
            template = self.template()
        runs = tuple((k, np.frombuffer(s, dtype="<u4").astype(np.uint32)) for k, s in self.runs)
        return ConversationState(template, self.render_kwargs, self.match, self.add_generation_prompt,
                                 tuple(self.stop_texts), self.track_drift, self.incremental, tuple(self.messages), runs)

    def restore(self, tok: FrozenTokenizer, *, template: Renderer | None = None,
                full_path: FullPath | None = None, probe_in_background: bool = False) -> Conversation:
        """The conversation again (`Conversation.replay`), its IDs checked against the recorded
        count and CRC-32 (:class:`ReplayMismatch` when they differ); ForeignRecord when ``tok``
        is not the recorded tokenizer."""
        if tok.hash != self.tokenizer_hash:
            raise ForeignRecord(f"record is for tokenizer {self.tokenizer_name} ({self.tokenizer_hash[:12]}), "
                                f"not {tok.name} ({tok.hash[:12]})")
        conv = Conversation.replay(tok, self.state(template), full_path=full_path,
                                   probe_in_background=probe_in_background)
        ids = np.ascontiguousarray(conv.ids, dtype="<u4")
        if len(ids) != self.count or zlib.crc32(ids.data) != self.ids_crc:
            raise ReplayMismatch(f"conversation {self.conversation[:64]!r} replays to {len(ids)} IDs that differ from "
                                 f"the {self.count} it had (this build renders its template or derives its "
                                 "junction otherwise)")
        return conv


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ConversationRecord)


def encode_conversation_record(rec: ConversationRecord) -> bytes:
    """The record's bytes; :class:`UnserializableConversation` when its messages or render kwargs
    hold values msgpack cannot carry."""
    try:
        payload = _encoder.encode(rec)
    except (TypeError, msgspec.EncodeError, UnicodeEncodeError) as exc:
        raise UnserializableConversation(f"conversation {rec.conversation[:64]!r} cannot be recorded: {exc} "
                                         "(messages and render kwargs must be JSON-like: strings, numbers, "
                                         "booleans, None, lists and string-keyed dicts)") from None
    head = _PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(payload))
    body = head + payload
    return body + _CRC.pack(zlib.crc32(body))


def decode_conversation_record(data: bytes | memoryview) -> ConversationRecord:
    """The record in ``data``: CorruptRecord when damaged, ForeignRecord for another format."""
    data = memoryview(data).cast("B")
    if len(data) < _PREFIX.size + _CRC.size:
        raise CorruptRecord("conversation record is truncated")
    magic, version, _, n = _PREFIX.unpack_from(data, 0)
    if magic != MAGIC:
        raise CorruptRecord("not a conversation record (bad magic)")
    if version != FORMAT_VERSION:
        raise ForeignRecord(f"conversation record format {version}; this build reads {FORMAT_VERSION}")
    end = _PREFIX.size + n
    if len(data) != end + _CRC.size or zlib.crc32(data[:end]) != _CRC.unpack_from(data, end)[0]:
        raise CorruptRecord("conversation record is truncated or corrupt (checksum mismatch)")
    try:
        rec = _decoder.decode(data[_PREFIX.size:end])
    except msgspec.DecodeError as exc:  # intact bytes of the wrong shape: a writer bug, never served
        raise CorruptRecord(f"conversation record does not decode: {exc}") from None
    for k, s in rec.runs:
        if len(s) % 4:
            raise CorruptRecord(f"conversation record's run at message {k} is not whole uint32 IDs")
    return rec
