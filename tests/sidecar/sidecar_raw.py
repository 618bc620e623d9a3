"""Raw-socket helpers for adversity tests: speak (or mangle) the protocol by hand."""

from __future__ import annotations

import socket
import threading

import numpy as np

from toktier_client import Client
from toktier_client import protocol as P


class Raw:
    """A hand-driven connection: ``send(bytes)``, ``replies()`` until the server closes or goes quiet."""

    def __init__(self, path: str, hello: bool = True) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(5)
        self.sock.connect(path)
        self.decoder = P.FrameDecoder(1 << 30)
        self.closed = False
        if hello:
            self.send(P.encode_frame(P.Hello(version=P.PROTOCOL_VERSION)))
            (w,) = self.replies(1)
            assert isinstance(w, P.Welcome)

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def replies(self, n: int | None = None, timeout: float = 5.0) -> list:
        """Read until ``n`` replies arrived (or EOF when ``n`` is None)."""
        out: list = []
        self.sock.settimeout(timeout)
        while n is None or len(out) < n:
            try:
                data = self.sock.recv(1 << 16)
            except (ConnectionResetError, socket.timeout):
                data = b""
            if not data:
                self.closed = True
                break
            out += [P.REPLY_DECODER.decode(b) for b in self.decoder.feed(data)]
        return out

    def close(self) -> None:
        self.sock.close()


class Bystander:
    """A well-behaved client in a thread, appending to its session and checking every reply
    against the reference until stopped."""

    def __init__(self, path: str, tok) -> None:
        self.path, self.tok = path, tok
        self.ops = 0
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Bystander":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)
        assert not self.errors, self.errors
        assert self.ops > 0

    def _run(self) -> None:
        try:
            with Client(self.path, reconnect=False) as c:
                text = "bystander:"
                s = c.session("bystander", text=text)
                while not self._stop.is_set() or self.ops < 3:
                    piece = f" step {self.ops}, ok."
                    r = s.append(piece)
                    text += piece
                    if not np.array_equal(r.ids, self.tok.encode(text)):
                        raise AssertionError(f"wrong ids after {self.ops} ops")
                    self.ops += 1
        except BaseException as exc:  # reported by __exit__
            self.errors.append(exc)
