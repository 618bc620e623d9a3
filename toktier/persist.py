"""Session records: one session's token state as checksummed bytes, and back (no directory logic).

A record is what a server writes so that a session outlives its process: the tokenizer's
hash, the session's key (namespace and id), its ``seq``, the UTF-8 text, the IDs, closed by a
CRC-32 checksum over all of it::

    magic "TTSR" | u16 version | u16 0 | u32 header bytes | u64 text bytes | u64 ids   (24 bytes, little-endian)
    header (JSON: tokenizer hash/name/specials, namespace, session, seq, window, chars, op_key[, certificate])
    text (UTF-8) | ids (uint32, little-endian) | CRC-32 (u32) of everything before it

Format 3 (this build writes it) stores the text's character count (``chars``: a restore no
longer decodes the text to count it) and no certificate; format 2 (the previous build's) has
no count and a sha256 certificate.  Both are read: an upgrade loses no session (a format-2
record is verified the format-2 way, and rewritten as format 3 by its session's next change).

This module owns the format only: :func:`encode_record` / :func:`decode_record` convert
bytes, :func:`write_record` / :func:`read_record` move them to and from a path they are
given (write: temp file, fsync, atomic rename, fsync of the directory, so a crash leaves the
old record or the new one, never a torn one), :func:`split_records` cuts a concatenation of
records (a tokenizer cache's file: one record per cached entry, session id ``""``) back into
records, and :func:`restore_session` turns a record back into a :class:`~toktier.Session`
(no encode).  Which files exist, when they are written and what a failed restore costs are
the server's business.

What a restore verifies, and why that is enough
-----------------------------------------------
The guarantee: a corrupt or foreign record is a counted miss, never wrong IDs; a record is
bound to the tokenizer hash and to the text it claims, and verified before use.  What can go
wrong with a record, and what catches it:

1. *Damage* (bit rot, a truncated or torn write, a short read, a partial store value): the
   CRC-32 over the whole record (:class:`CorruptRecord`), plus sizes that must add up.  CRC-32
   detects every burst of up to 32 bits, every 1- and 2-bit error in records up to 512 MB and
   any truncation; random damage beyond that escapes it with probability 2^-32.  A damaged
   ID array has a second, independent check below (the token lengths must tile the text), and
   an ID outside the vocabulary is refused before anything indexes with it.
2. *Not ours to use* (another format version, tokenizer or session key: an older build, a
   config change, a renamed or copied file): the version in the prefix, the tokenizer hash
   compared with the serving tokenizer's (:class:`ForeignRecord`), the key compared by the
   server.  These are identity checks, not integrity ones: such a record is intact.
3. *Well formed but not the reference encoding* (a writer bug, e.g. a text paired with
   another state's IDs): the IDs' byte lengths must sum to the text's length (and, for NFC
   families, the token bytes must spell it) -- the check that binds IDs to the text they
   claim, O(N) over the IDs, no encode; a state that cannot be shown to tile is verified by
   encoding it once (``toktier.InvalidState`` when it differs).  What no check short of an
   encode catches is IDs that tile their text but are not its canonical split; records hold
   only what a :class:`~toktier.Session` produced, whose IDs are the reference's by
   construction, and the sidecar's shadow verifier samples results in production.
4. *Forged* (someone who can write the directory or the store writes a record of their
   choosing): nothing in the record can refuse it.  A CRC is recomputable by anyone, and so
   is an unkeyed hash stored in the header next to the data it hashes -- format 2's sha256
   certificate proved no more about origin than the CRC does.  Origin is the job of access
   control: a state directory private to the server's uid (checked at start), a store behind
   its ACL/password.

Format 2 recomputed that sha256 on every restore (~1 ms per 1M characters here, the largest
part of a restore after the UTF-8 decode that counted characters).  Its only contribution
beyond the CRC was 256 instead of 32 bits against random damage the CRC already checked, and
it was computed by the writer from the very arrays it wrote, so it could not catch case 3
either.  Format 3 drops it and keeps the checks that catch something: the CRC (1), identity
(2), ID range and tiling (3).  The stored character count is covered by the CRC like the text
(a cheap consistency check refuses counts no UTF-8 text of that size can have).

Stored token offsets were measured and not added: checking them needs every token's length
(the gather the tiling check does anyway), after which the checkpoints cost ~0.1-0.2 ms per 1M
characters; trusting them unchecked would drop the tiling check (3).

>>> from toktier import Session, load_tokenizer
>>> tok = load_tokenizer("cl100k_base")
>>> s = Session(tok, "hello world")
>>> rec = SessionRecord.of(s, namespace=1000, session_id="chat-1", seq=3)
>>> back = decode_record(encode_record(rec))
>>> (back.session, back.seq, back.nchars, restore_session(tok, back).append("!").ids.tolist() == tok.encode("hello world!").tolist())
('chat-1', 3, 11, True)
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

#: Written by this build; a record of a version not in `READ_VERSIONS` is foreign (a miss), never parsed.
FORMAT_VERSION = 3  # 3: the character count stored, no certificate needed; 2: CRC-32 instead of blake2b-256
#: Versions this build reads (2: the previous build's records survive an upgrade).
READ_VERSIONS = (2, 3)
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
    """One session's state as written: ``text`` is UTF-8, ``ids`` uint32 (a read-only view of the
    record's bytes when decoded).  ``certificate`` is format 2's sha256 (:func:`state_certificate`),
    ``""`` when absent (format 3 session records); ``nchars`` the text's character count, -1 when
    the record does not say (format 2)."""

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
    nchars: int = -1
    version: int = FORMAT_VERSION

    @classmethod
    def of(cls, session: Session, *, namespace: Namespace, session_id: str, seq: int,
           certify: bool = False) -> "SessionRecord":
        """A record of ``session``'s current state (copies it; the session may change afterwards)."""
        tok = session.tokenizer
        return cls.from_parts(tok, namespace=namespace, session=session_id, seq=seq, window=session.window,
                              text=session.text.encode("utf-8"), ids=np.array(session.ids, dtype=np.uint32),
                              nchars=session.num_chars, certify=certify)

    @classmethod
    def from_parts(cls, tok: FrozenTokenizer, *, namespace: Namespace, session: str, seq: int, window: int,
                   text: bytes, ids: np.ndarray, op_key: str = "", nchars: int | None = None,
                   certify: bool = False) -> "SessionRecord":
        """A record of a copied ``(text, ids)`` state of ``tok``.  ``nchars``: the text's character
        count when the caller knows it (else counted here, O(N)).  ``certify``: also compute the
        sha256 certificate (O(N); only for readers that ask for one, such as
        ``PrefixCache.adopt``: a session restore does not)."""
        ids = np.ascontiguousarray(ids, dtype=np.uint32)
        text = bytes(text)
        if nchars is None:
            nchars = _count_chars(text)
        return cls(tok.hash, tok.name, tok.specials, namespace, session, int(seq), int(window), text, ids,
                   state_certificate(tok, text, ids) if certify else "", op_key, int(nchars))

    @property
    def nbytes(self) -> int:
        """Bytes on disk, besides the few hundred of the header: the text plus 4 per token."""
        return len(self.text) + 4 * len(self.ids)


def _count_chars(data: bytes) -> int:
    """Characters of UTF-8 ``data`` (code points: bytes that are not continuation bytes)."""
    if data.isascii():
        return len(data)
    return int(np.count_nonzero((np.frombuffer(data, dtype=np.uint8) & 0xC0) != 0x80))


def encode_record(rec: SessionRecord, *, version: int = FORMAT_VERSION) -> bytes:
    """The record's bytes (see the module docstring for the layout).  ``version=2`` writes what
    the previous build reads (a downgrade that keeps its sessions, and the upgrade tests): it
    needs the record's sha256 certificate (``SessionRecord.of(..., certify=True)``)."""
    fields = {
        "tokenizer_hash": rec.tokenizer_hash, "tokenizer_name": rec.tokenizer_name, "specials": rec.specials,
        "namespace": rec.namespace, "session": rec.session, "seq": rec.seq, "window": rec.window,
    }
    if version == 2:
        if not rec.certificate:
            raise ValueError("a format-2 record carries a certificate: make the record with certify=True")
        fields.update(certificate=rec.certificate, op_key=rec.op_key)  # format 2's key order
    elif version == FORMAT_VERSION:
        fields.update(chars=rec.nchars if rec.nchars >= 0 else _count_chars(rec.text), op_key=rec.op_key)
        if rec.certificate:
            fields["certificate"] = rec.certificate
    else:
        raise ValueError(f"cannot write record format {version}; this build writes versions 2 and {FORMAT_VERSION}")
    header = json.dumps(fields, separators=(",", ":")).encode("utf-8")
    ids = np.ascontiguousarray(rec.ids, dtype="<u4").tobytes()
    body = b"".join((_PREFIX.pack(MAGIC, version, 0, len(header), len(rec.text), len(rec.ids)),
                     header, rec.text, ids))
    return body + struct.pack("<I", zlib.crc32(body))


def decode_record(data: bytes) -> SessionRecord:
    """The record in ``data`` (format 2 or 3); :class:`CorruptRecord` or :class:`ForeignRecord`
    (version) otherwise.  Checks integrity only: :func:`restore_session` checks it against a
    tokenizer, the server against the session key."""
    view = memoryview(data)
    if len(view) < _PREFIX.size + _DIGEST:
        raise CorruptRecord(f"record is truncated ({len(view)} bytes)")
    magic, version, _zero, n_header, n_text, n_ids = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise CorruptRecord("not a session record (bad magic)")
    if version not in READ_VERSIONS:
        # Checked before the checksum: a future layout may place it elsewhere.
        raise ForeignRecord(f"record format version {version}; this build reads versions "
                            f"{', '.join(map(str, READ_VERSIONS))}")
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
        # A view, not a copy: a restore copies the IDs into the session's own buffer anyway.
        ids = np.frombuffer(view[at:at + 4 * n_ids], dtype="<u4")
        if ids.dtype != np.uint32:  # a big-endian host
            ids = ids.astype(np.uint32)
        if version == 2:
            certificate, nchars = str(h["certificate"]), -1
        else:
            certificate, nchars = str(h.get("certificate", "")), int(h["chars"])
        return SessionRecord(str(h["tokenizer_hash"]), str(h["tokenizer_name"]), str(h["specials"]),
                             h["namespace"], str(h["session"]), int(h["seq"]), int(h["window"]), text, ids,
                             certificate, str(h.get("op_key", "")), nchars, version)
    except (ValueError, KeyError, TypeError) as exc:  # checksummed yet malformed: a writer bug
        raise CorruptRecord(f"record header is malformed ({exc})") from None


def restore_session(tok: FrozenTokenizer, rec: SessionRecord, **kwargs: object) -> Session:
    """A session over the record's state, without an encode (see the module docstring for what
    is verified).  :class:`ForeignRecord` when ``tok`` is not the record's tokenizer;
    :class:`toktier.InvalidState` when the state is not the reference encoding of its text (an
    ID outside the vocabulary, token lengths that do not tile the text and an encode that
    disagrees; format 2: a certificate that does not match and an encode that disagrees);
    :class:`CorruptRecord` when the text is not UTF-8 of the stated length.  ``kwargs`` go to
    ``Session.from_state``."""
    if rec.tokenizer_hash != tok.hash:
        raise ForeignRecord(f"record is for tokenizer {rec.tokenizer_name} ({rec.tokenizer_hash[:12]}), "
                            f"not {tok.name} ({tok.hash[:12]})")
    data = rec.text
    if rec.nchars >= 0:
        # Format 3: the count is checksummed with the text; refuse one no UTF-8 text of this size has.
        nchars = rec.nchars
        if not (nchars <= len(data) <= 4 * nchars) or (nchars != len(data) and data.isascii()):
            raise CorruptRecord(f"record says {nchars} characters for {len(data)} bytes of text")
        return Session._from_state_utf8(tok, data, nchars, rec.ids, checksummed=True,  # type: ignore[arg-type]
                                        **kwargs)
    try:  # format 2: the character count; decoding (only non-ASCII text needs it) also proves it is UTF-8
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
