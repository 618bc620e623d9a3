"""Session records: one session's token state as checksummed bytes, and back (no directory logic).

A record is what a server writes so that a session outlives its process: the tokenizer's
hash, the session's key (namespace and id), its ``seq``, the UTF-8 text, the IDs and the
session's :meth:`toktier.Session.certificate`, closed by a CRC-32 checksum over all of it::

    magic "TTSR" | u16 version | u16 0 | u32 header bytes | u64 text bytes | u64 ids   (24 bytes, little-endian)
    header (JSON: tokenizer hash/name/specials, namespace, session, seq, window, certificate, op_key)
    text (UTF-8) | ids (uint32, little-endian) | CRC-32 (u32) of everything before it

This module owns the format only: :func:`encode_record` / :func:`decode_record` convert
bytes, :func:`write_record` / :func:`read_record` move them to and from a path they are
given (write: temp file, fsync, atomic rename, fsync of the directory, so a crash leaves the
old record or the new one, never a torn one), :func:`split_records` cuts a concatenation of
records (a tokenizer cache's file: one record per cached entry, session id ``""``) back into
records, and :func:`restore_session` turns a record
back into a :class:`~toktier.Session` through ``Session.from_state`` (an O(N) tiling check
under the certificate, no encode).  Which files exist, when they are written and what a
failed restore costs are the server's business.

A record is trusted for nothing: a truncated or bit-flipped one fails the checksum
(:class:`CorruptRecord`), one for another tokenizer or format version is
:class:`ForeignRecord`, and a state that is not the reference encoding of its text makes
``from_state`` raise :class:`toktier.InvalidState` (the certificate, a sha256 of the state,
is recomputed: a record well formed but wrong is refused too).  The checksum proves integrity, not
origin: read records only from a directory only this user can write.

>>> from toktier import Session, load_tokenizer
>>> tok = load_tokenizer("cl100k_base")
>>> s = Session(tok, "hello world")
>>> rec = SessionRecord.of(s, namespace=1000, session_id="chat-1", seq=3)
>>> back = decode_record(encode_record(rec))
>>> (back.session, back.seq, restore_session(tok, back).append("!").ids.tolist() == tok.encode("hello world!").tolist())
('chat-1', 3, True)
>>> decode_record(encode_record(rec)[:-1])
Traceback (most recent call last):
...
toktier.persist.CorruptRecord: record is truncated or corrupt (checksum mismatch)
"""

from __future__ import annotations

import json
import os
import secrets
import struct
import zlib
from dataclasses import dataclass
from typing import Iterator, Union

import numpy as np

from .errors import TokTierError
from .registry import FrozenTokenizer
from .session import Session, state_certificate

#: Bumped on any layout change; a record of another version is foreign (a miss), never parsed.
FORMAT_VERSION = 2  # 2: CRC-32 instead of blake2b-256
MAGIC = b"TTSR"
_PREFIX = struct.Struct("<4sHHIQQ")
_DIGEST = 4  # CRC-32: corruption is what it is for (zlib's runs at ~7 GB/s here, blake2b at 1.4)
#: A header is a few hundred bytes; anything much bigger is not one of ours.
_MAX_HEADER = 1 << 20

Namespace = Union[int, str]


class RecordError(TokTierError, ValueError):
    """A session record that cannot be used (the server counts it as a miss and removes it)."""


class CorruptRecord(RecordError):
    """Truncated, bit-flipped or not a record at all: the checksum or the layout does not hold."""


class ForeignRecord(RecordError):
    """An intact record this server must not use: another format version, tokenizer or session key."""


@dataclass(frozen=True, slots=True)
class SessionRecord:
    """One session's state as written: ``text`` is UTF-8, ``ids`` uint32."""

    tokenizer_hash: str
    tokenizer_name: str
    specials: str
    namespace: Namespace
    session: str
    seq: int
    window: int
    text: bytes
    ids: np.ndarray
    certificate: str
    #: The key of the op that produced this state (a server answers its re-send from it).
    op_key: str = ""

    @classmethod
    def of(cls, session: Session, *, namespace: Namespace, session_id: str, seq: int) -> "SessionRecord":
        """A record of ``session``'s current state (copies it; the session may change afterwards)."""
        tok = session.tokenizer
        return cls.from_parts(tok, namespace=namespace, session=session_id, seq=seq, window=session.window,
                              text=session.text.encode("utf-8"), ids=np.array(session.ids, dtype=np.uint32))

    @classmethod
    def from_parts(cls, tok: FrozenTokenizer, *, namespace: Namespace, session: str, seq: int, window: int,
                   text: bytes, ids: np.ndarray, op_key: str = "") -> "SessionRecord":
        """A record of a copied ``(text, ids)`` state of ``tok``; computes its certificate (O(N) sha256)."""
        ids = np.ascontiguousarray(ids, dtype=np.uint32)
        return cls(tok.hash, tok.name, tok.specials, namespace, session, int(seq), int(window), bytes(text), ids,
                   state_certificate(tok, text, ids), op_key)

    @property
    def nbytes(self) -> int:
        """Bytes on disk, besides the few hundred of the header: the text plus 4 per token."""
        return len(self.text) + 4 * len(self.ids)


def encode_record(rec: SessionRecord) -> bytes:
    """The record's bytes (see the module docstring for the layout)."""
    header = json.dumps({
        "tokenizer_hash": rec.tokenizer_hash, "tokenizer_name": rec.tokenizer_name, "specials": rec.specials,
        "namespace": rec.namespace, "session": rec.session, "seq": rec.seq, "window": rec.window,
        "certificate": rec.certificate, "op_key": rec.op_key,
    }, separators=(",", ":")).encode("utf-8")
    ids = np.ascontiguousarray(rec.ids, dtype="<u4").tobytes()
    body = b"".join((_PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(header), len(rec.text), len(rec.ids)),
                     header, rec.text, ids))
    return body + struct.pack("<I", zlib.crc32(body))


def decode_record(data: bytes) -> SessionRecord:
    """The record in ``data``; :class:`CorruptRecord` or :class:`ForeignRecord` (version) otherwise.
    Checks integrity only: :func:`restore_session` checks it against a tokenizer."""
    view = memoryview(data)
    if len(view) < _PREFIX.size + _DIGEST:
        raise CorruptRecord(f"record is truncated ({len(view)} bytes)")
    magic, version, _zero, n_header, n_text, n_ids = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise CorruptRecord("not a session record (bad magic)")
    if version != FORMAT_VERSION:
        # Checked before the checksum: a future layout may place it elsewhere.
        raise ForeignRecord(f"record format version {version}; this build reads version {FORMAT_VERSION}")
    body_len = len(view) - _DIGEST
    if struct.pack("<I", zlib.crc32(view[:body_len])) != bytes(view[body_len:]):
        raise CorruptRecord("record is truncated or corrupt (checksum mismatch)")
    if n_header > _MAX_HEADER or _PREFIX.size + n_header + n_text + 4 * n_ids != body_len:
        raise CorruptRecord("record sizes do not add up")
    at = _PREFIX.size
    try:
        h = json.loads(bytes(view[at:at + n_header]))
        at += n_header
        text = bytes(view[at:at + n_text])
        at += n_text
        ids = np.frombuffer(view[at:at + 4 * n_ids], dtype="<u4").astype(np.uint32)
        return SessionRecord(str(h["tokenizer_hash"]), str(h["tokenizer_name"]), str(h["specials"]),
                             h["namespace"], str(h["session"]), int(h["seq"]), int(h["window"]), text, ids,
                             str(h["certificate"]), str(h.get("op_key", "")))
    except (ValueError, KeyError, TypeError) as exc:  # checksummed yet malformed: a writer bug
        raise CorruptRecord(f"record header is malformed ({exc})") from None


def restore_session(tok: FrozenTokenizer, rec: SessionRecord, **kwargs: object) -> Session:
    """A session over the record's state, certified by its certificate (``Session.from_state``:
    an O(N) check, no encode).  :class:`ForeignRecord` when ``tok`` is not the record's
    tokenizer; :class:`toktier.InvalidState` when the state is not the reference encoding;
    :class:`CorruptRecord` when the text is not UTF-8.  ``kwargs`` go to ``from_state``."""
    if rec.tokenizer_hash != tok.hash:
        raise ForeignRecord(f"record is for tokenizer {rec.tokenizer_name} ({rec.tokenizer_hash[:12]}), "
                            f"not {tok.name} ({tok.hash[:12]})")
    data = rec.text
    try:  # the character count; decoding (only non-ASCII text needs it) also proves it is UTF-8
        nchars = len(data) if data.isascii() else len(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise CorruptRecord("record text is not UTF-8") from None
    # From the UTF-8 as stored: a str round trip cost ~0.6 ms per 1M characters.
    return Session._from_state_utf8(tok, data, nchars, rec.ids, certificate=rec.certificate,  # type: ignore[arg-type]
                                    **kwargs)


def write_record(path: str, rec: SessionRecord) -> int:
    """Write ``rec`` to ``path`` crash-safely (see :func:`write_bytes`); returns the bytes written."""
    return write_bytes(path, encode_record(rec))


def write_bytes(path: str, data: bytes) -> int:
    """Write ``data`` to ``path`` crash-safely (temp file in the same directory, fsync, rename,
    fsync of the directory); returns the bytes written.  The file is created 0600."""
    directory = os.path.dirname(path) or "."
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:  # the rename itself must survive a power loss
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return len(data)


def split_records(data: bytes) -> Iterator[memoryview]:
    """The records of a concatenation of encoded records (a tokenizer cache's file), each as
    its own bytes for :func:`decode_record`, by the sizes in each record's prefix.  Raises
    :class:`CorruptRecord` where the sizes run past the end (the records before it are yielded:
    each is checked on its own by its checksum).

    >>> tok_rec = lambda text: SessionRecord("h", "t", "all", 0, "", 0, 0, text, np.zeros(0, np.uint32), "")
    >>> [decode_record(r).text for r in split_records(encode_record(tok_rec(b"a")) + encode_record(tok_rec(b"bc")))]
    [b'a', b'bc']
    """
    view = memoryview(data)
    at = 0
    while at < len(view):
        if len(view) - at < _PREFIX.size + _DIGEST:
            raise CorruptRecord(f"{len(view) - at} trailing bytes are not a record")
        _magic, _version, _zero, n_header, n_text, n_ids = _PREFIX.unpack_from(view, at)
        end = at + _PREFIX.size + n_header + n_text + 4 * n_ids + _DIGEST
        if n_header > _MAX_HEADER or end > len(view):
            raise CorruptRecord("record sizes run past the end of the data")
        yield view[at:end]
        at = end


def read_record(path: str) -> SessionRecord:
    """The record in the file at ``path`` (``OSError`` when unreadable; see :func:`decode_record`)."""
    with open(path, "rb") as f:
        return decode_record(f.read())
