"""Worker that drives PyPI ``toktier`` 0.3.0 (asu-idi) for ``bench/peers.py``, in its own venv.

The paper authors' package also imports as ``toktier``, so it cannot share a process with ours:
``bench/peers.py`` starts this file with ``.venv-peer/bin/python`` (a venv holding only
``toktier==0.3.0`` and its requirements) and talks to it over stdin/stdout.

Protocol (binary-safe, no third-party codec): each request is one JSON line, optionally followed
by exactly ``header["nbytes"]`` bytes of UTF-8 payload (the text or the delta).  Each reply is one
JSON line, followed by ``reply["nbytes"]`` bytes of little-endian uint32 token ids when ids were
asked for (``"want_ids": true``).  ``t_inner_s`` in a reply is ``time.perf_counter()`` measured
in this process around the library call only: it excludes the pipe, the JSON and the id export.

Two lanes:

* ``api_*``: the public session API, ``Tokenizer.encode(text, session=sid)``, on a tokenizer
  loaded with ``toktier.load(family, manifest=...)`` from a manifest that names *our* tokenizer
  file by its SHA-256 (the package's own manifest pins Meta's Llama-3.1 file, whose bytes differ,
  and fetching is impossible offline).  The timing includes the ``Encoding`` object with its ids
  tuple, which is what the API returns.  Which route ran is what ``explain()`` says.
* ``core_*``: its Rust core called directly (``_native.CallbackEncoder.native_fast_cpu`` over the
  same bytes, driven by ``_native.SessionStore.put/append``), with the repair spec of its
  ``llama_3_1_8b`` roster entry.  Its admission does *not* grant this route for our file (see
  ``explain()``), so this lane bypasses its certification: it is a diagnostic of what the core
  costs, not a route the package would serve.  The timing includes the core's ``dict`` with the
  whole stream as ``bytes`` (``all_ids``) and the repaired suffix.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

OUT = sys.stdout.buffer
IN = sys.stdin.buffer

OFFICIAL_FAMILY = "llama_3_1_8b"
LOCAL_FAMILY = "llama3_local"


def reply(obj: dict, payload: bytes = b"") -> None:
    obj["nbytes"] = len(payload)
    OUT.write(json.dumps(obj, default=str).encode() + b"\n")
    if payload:
        OUT.write(payload)
    OUT.flush()


class Peer:
    def __init__(self, tokenizer_json: str, home: str) -> None:
        os.environ.setdefault("TOKTIER_HOME", home)
        os.environ.setdefault("TOKTIER_OFFLINE", "1")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import numpy as np  # noqa: F401  (a requirement of the peer venv)
        import toktier
        from importlib.metadata import version
        from toktier.artifacts.manifest import ArtifactManifest

        self.info: dict = {"toktier_version": version("toktier"), "module": toktier.__file__}
        data = Path(tokenizer_json).read_bytes()
        sha = hashlib.sha256(data).hexdigest()
        self.info["our_file"] = {"path": tokenizer_json, "sha256": sha, "size": len(data)}
        # 1. Its own family id with its own manifest (what its README says to do).
        try:
            toktier.load(OFFICIAL_FAMILY, device="cpu")
            self.info["official_load"] = "ok"
        except Exception as exc:  # record exactly why
            self.info["official_load"] = f"{type(exc).__name__}: {exc}"
        official = ArtifactManifest.load(
            Path(toktier.__file__).parent / "artifacts/tables/artifact_manifest.v1.json")
        off_tok = official.get(OFFICIAL_FAMILY).file("tokenizer.json")
        self.info["official_tokenizer_json"] = {"sha256": off_tok.sha256, "size": off_tok.size}
        # 2. A manifest naming our file, staged in its cache directory.
        manifest = ArtifactManifest.from_mapping({LOCAL_FAMILY: {
            "repo_id": "local/toktier-bench-llama3", "revision": "0" * 40,
            "files": {"tokenizer.json": {"sha256": sha, "size": len(data)}}}})
        d = Path(os.environ["TOKTIER_HOME"]) / "cache/artifacts" / manifest.get(LOCAL_FAMILY).directory_name
        d.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(tokenizer_json, d / "tokenizer.json")
        self.tok = toktier.load(LOCAL_FAMILY, device="cpu", manifest=manifest)
        self.info["api_explain_at_load"] = self.tok.explain(summary=True)
        # 3. Its Rust core, directly, with the llama_3_1_8b repair spec.
        from toktier import _native
        from toktier.repair.registry import family_spec, pclass_table

        spec = family_spec(OFFICIAL_FAMILY, off_tok.sha256)
        self.info["core_spec"] = repr(spec)
        self.enc = _native.CallbackEncoder.native_fast_cpu(
            data, spec.family, sha, spec.margin, spec.effective_l_max, spec.has_normalizer, pclass_table())
        self.store = _native.SessionStore()
        self.key = self.store.register_fingerprint(hashlib.sha256(data).digest(), 64)
        self.handle: int | None = None
        self.n_sessions = 0

    # -- public API lane ---------------------------------------------------------------------
    def api_encode(self, text: str, session: str, want_ids: bool):
        t0 = time.perf_counter()
        enc = self.tok.encode(text, session=session)
        t = time.perf_counter() - t0
        ids = enc.ids
        ex = self.tok.explain(summary=True) if want_ids else None
        payload = _u32(ids) if want_ids else b""
        return {"t_inner_s": t, "n_ids": len(ids),
                "path": ex.get("last_execution_path") if ex else None,
                "backend": ex.get("last_execution_backend") if ex else None}, payload

    # -- Rust core lane ----------------------------------------------------------------------
    def core_start(self, text: str, want_ids: bool):
        if self.handle is not None:
            self.store.evict(self.handle)
        t0 = time.perf_counter()
        handle, _a, n = self.store.put(self.key, text, self.enc)
        t = time.perf_counter() - t0
        self.handle = handle
        payload = self.store.ids_bytes(handle) if want_ids else b""
        return {"t_inner_s": t, "n_ids": n}, payload

    def core_append(self, delta: str, want_ids: bool):
        rev = self.store.revision(self.handle)
        t0 = time.perf_counter()
        r = self.store.append(self.handle, delta, rev, self.enc)
        t = time.perf_counter() - t0
        return {"t_inner_s": t, "n_ids": r["n_ids"], "path": r["path"]}, (r["all_ids"] if want_ids else b"")


def _u32(ids) -> bytes:
    import numpy as np

    return np.asarray(ids, dtype=np.uint32).tobytes()


def main() -> int:
    peer: Peer | None = None
    while True:
        line = IN.readline()
        if not line:
            return 0
        req = json.loads(line)
        payload = IN.read(req.get("nbytes", 0)).decode("utf-8") if req.get("nbytes") else ""
        op = req["op"]
        want = bool(req.get("want_ids"))
        try:
            if op == "init":
                peer = Peer(req["tokenizer_json"], req["home"])
                reply({"ok": True, "info": peer.info})
            elif op == "api_encode":
                r, p = peer.api_encode(payload, req["session"], want)
                reply({"ok": True, **r}, p)
            elif op == "core_start":
                r, p = peer.core_start(payload, want)
                reply({"ok": True, **r}, p)
            elif op == "core_append":
                r, p = peer.core_append(payload, want)
                reply({"ok": True, **r}, p)
            elif op == "explain":
                reply({"ok": True, "explain": peer.tok.explain(),
                       "core_stats": peer.enc.stats()})
            elif op == "quit":
                reply({"ok": True})
                return 0
            else:
                reply({"ok": False, "error": f"unknown op {op!r}"})
        except Exception as exc:
            reply({"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()})


if __name__ == "__main__":
    sys.exit(main())
