"""TokTier as a benchmark engine: one :class:`toktier.Session` per trace session.

:class:`TokTierOps` drives the session with the op the client knows (append, edit, full-text
sync for compactions), as the sidecar client does.  :class:`TokTierSync` gets only the whole
request text, like the cache baselines, and calls ``Session.sync`` (common prefix/suffix, then
the same repair).  ``last`` holds the last :class:`toktier.OpResult` (path, widenings).
"""

from __future__ import annotations

import numpy as np

from toktier import Session

from . import Request


class TokTierOps:
    kind = "stateful"
    name = "toktier"
    WINDOW = None  # the session default

    def __init__(self, tok) -> None:
        self._tok = tok
        self._sessions: dict[str, Session] = {}
        self.last = None

    def __call__(self, req: Request) -> np.ndarray:
        s = self._sessions.get(req.session)
        if req.kind == "start" or s is None:
            s = self._sessions[req.session] = Session(self._tok, req.text, window=self.WINDOW)
            self.last = None
            return s.ids
        r = self._op(s, req)
        self.last = r
        return r.ids

    def _op(self, s: Session, req: Request):
        if req.kind == "append":
            return s.append(req.delta)
        if req.kind == "edit":
            return s.edit(req.start, req.end, req.delta)
        return s.sync(req.text)

    def session(self, name: str) -> Session | None:
        return self._sessions.get(name)

    def close(self, session: str) -> None:
        self._sessions.pop(session, None)


class TokTierSync(TokTierOps):
    name = "toktier-sync"

    def _op(self, s: Session, req: Request):
        return s.sync(req.text)
