"""Agent session traces: a seeded generator, JSONL files, and a replayer that rebuilds the texts.

A trace is a list of calls of agent sessions.  Its shape is calibrated to published measurements
of agent traffic (the numbers are parameters of :class:`TraceConfig`):

* appended characters per call: log-normal, median 1.4K, P90 ~11.5K (the heavier autonomous
  variant ``heavy``: median 3.8K, P90 ~30K);
* contexts from 10K to 4M characters; session starts log-normal around 300K characters (so the
  median call sees ~100K tokens once sessions have grown);
* calls per user turn: log-normal, median 4, P90 30;
* full-context calls (session starts and compactions, which rewrite the context to a summary two
  orders of magnitude larger than an append) are a few percent of calls;
* pauses: seconds between the calls of one turn (generation + tool run), minutes between turns
  (a human reading), and now and then hours to days (a session resumed later);
* chat-template wrapping with the tokenizer family's special tokens: a system prompt, user
  messages, assistant tool calls (sometimes with a ``<think>`` block that the template drops when
  the next user turn arrives: a non-append *edit*), tool results.

The texts come from real material shipped by installed packages (:func:`toktier.tools.corpus.large_text`:
CPython sources, the Python reference manual, JSON metadata, logs, multilingual Faker data).  A
trace file stores, per call, only where its text comes from (offsets into a per-session material
stream, itself a pure function of the session seed), so files stay small and every text is
rebuilt bit for bit by :func:`replay` on the same installed material (the header records the
Python, Faker and emoji versions the material comes from).

    python -m bench.traces --kind mixture --sessions 200 --seed 1 --out traces/mixture.jsonl
    python -m bench.traces --kind stratified --sizes 100000,1000000 --calls 40 --out traces/strat.jsonl

File format: the first line is a header ``{"trace": ..., "seed": ..., "config": {...},
"sessions": {sid: {"material": kind, "seed": s, "chars": n}}}``; every other line is one call
``{"sid", "call", "turn", "t", "op", "parts", ["start", "end"]}`` where ``parts`` is a list of
``[role, offset, n_chars, think_chars]`` to render with the chat template, and ``op`` is
"start" (new text = head + parts), "append" (old + parts), "edit" (old with chars [start, end)
removed, then parts appended: the template dropped an earlier think block) or "compact"
(new text = head + parts).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
from dataclasses import dataclass, field
from typing import Iterator

from toktier.tools.corpus import chat_wrap, large_text

__all__ = ["TraceConfig", "Renderer", "Call", "generate_mixture", "generate_stratified", "write", "read",
           "replay", "family_template"]

Z90 = 1.2815515655446004  # standard normal 90th percentile
THINK_OVERHEAD = len("<think>\n\n</think>\n")


def _lognormal(rng: random.Random, median: float, p90: float, lo: float, hi: float) -> float:
    sigma = math.log(p90 / median) / Z90
    return min(hi, max(lo, rng.lognormvariate(math.log(median), sigma)))


@dataclass(frozen=True)
class TraceConfig:
    append_median: float = 1400.0
    append_p90: float = 11_500.0
    start_median: float = 350_000.0
    start_p90: float = 2_000_000.0
    min_context: int = 10_000
    max_context: int = 4_000_000
    calls_per_turn_median: float = 4.0
    calls_per_turn_p90: float = 30.0
    turns_median: float = 5.0
    turns_p90: float = 20.0
    compact_rate: float = 0.015  # per call
    compact_ratio: float = 100.0  # compaction summary / append median
    think_rate: float = 0.3  # share of turns whose last assistant message has a think block
    call_gap_median_s: float = 6.0
    call_gap_p90_s: float = 30.0
    turn_pause_median_s: float = 150.0
    turn_pause_p90_s: float = 1500.0
    resume_rate: float = 0.05  # share of turn pauses that are hours to days instead
    session_arrival_s: float = 3600.0  # sessions start uniformly over this window
    materials: tuple[tuple[str, float], ...] = (("mixed", 0.5), ("code", 0.3), ("english", 0.1),
                                                ("multilingual", 0.1))

    @classmethod
    def heavy(cls) -> "TraceConfig":
        """The heavier autonomous-agent variant (median append 3.8K characters)."""
        return cls(append_median=3800.0, append_p90=30_000.0, calls_per_turn_median=8.0,
                   calls_per_turn_p90=34.0)


def family_template(tok_name: str) -> str:
    """The chat template family whose special tokens a tokenizer knows."""
    if tok_name.startswith("llama"):
        return "llama3"
    if tok_name.startswith("deepseek"):
        return "deepseek"
    return "chatml"


class Renderer:
    """Chat-template rendering of one turn (no head) for a template family."""

    def __init__(self, family: str) -> None:
        self.family = family
        self.head = chat_wrap([], family) if family != "none" else ""
        self.tool_role = "ipython" if family == "llama3" else "tool"
        self._overhead = {r: len(self.turn(r, "")) for r in ("system", "user", "assistant", "tool")}

    def turn(self, role: str, content: str) -> str:
        if self.family == "none":  # no template: contents concatenated, seams anywhere in the text
            return content
        if role == "tool":
            role = self.tool_role
        return chat_wrap([(role, content)], self.family)[len(self.head):]

    @staticmethod
    def assistant_content(body: str, think: str) -> str:
        return f"<think>\n{think}\n</think>\n{body}" if think else body

    def length(self, role: str, n: int, think_n: int = 0) -> int:
        return self._overhead[role] + n + ((think_n + THINK_OVERHEAD) if think_n else 0)

    def think_span(self, turn_start: int, think_n: int) -> tuple[int, int]:
        """Char span [a, b) of the think block inside an assistant turn rendered at turn_start."""
        a = turn_start + self._overhead_before_content("assistant")
        return a, a + think_n + THINK_OVERHEAD

    def _overhead_before_content(self, role: str) -> int:
        marker = "\x00"
        return self.turn(role, marker).index(marker)

    def render(self, material: str, parts: list) -> str:
        out = []
        for role, off, n, think_n in parts:
            if role == "assistant":
                think = material[off : off + think_n]
                out.append(self.turn(role, self.assistant_content(material[off + think_n : off + n], think)))
            else:
                out.append(self.turn(role, material[off : off + n]))
        return "".join(out)


# ---------------------------------------------------------------------------------------------
# generation
# ---------------------------------------------------------------------------------------------


class _SessionGen:
    """Generates the calls of one session; tracks lengths without building any text."""

    def __init__(self, sid: str, rng: random.Random, cfg: TraceConfig, rend: Renderer, material: str,
                 seed: int) -> None:
        self.sid, self.rng, self.cfg, self.rend = sid, rng, cfg, rend
        self.material, self.seed = material, seed
        self.off = 0  # next free offset in the material stream
        self.length = 0  # current text length in chars
        self.calls: list[dict] = []
        self.think: tuple[int, int] | None = None  # think span of the last assistant turn
        self.n_call = 0

    def _take(self, n: int) -> int:
        off = self.off
        self.off += n
        return off

    def _part(self, role: str, n: int, think_n: int = 0) -> list:
        return [role, self._take(n + think_n), n + think_n, think_n]

    def _emit(self, t: float, turn: int, op: str, parts: list, **extra) -> None:
        self.calls.append({"sid": self.sid, "call": self.n_call, "turn": turn, "t": round(t, 3), "op": op,
                           "parts": parts, **extra})
        self.n_call += 1

    def _context_parts(self, n_chars: int) -> list:
        """A system prompt and alternating user/assistant/tool turns totalling ~n_chars."""
        rng, cfg = self.rng, self.cfg
        parts = [self._part("system", int(_lognormal(rng, 2500, 8000, 200, 20_000)))]
        total = len(self.rend.head) + self.rend.length("system", parts[0][2])
        roles = ("user", "assistant", "tool", "tool", "assistant")
        i = 0
        while total < n_chars:
            role = roles[i % len(roles)]
            n = int(_lognormal(rng, cfg.append_median, cfg.append_p90, 20, 200_000))
            n = max(1, min(n, n_chars - total - self.rend.length(role, 0)))
            parts.append(self._part(role, n))
            total += self.rend.length(role, n)
            i += 1
        return parts

    def _parts_length(self, parts: list) -> int:
        return sum(self.rend.length(r, n - tn, tn) for r, _o, n, tn in parts)

    def start(self, t: float, n_chars: int) -> None:
        parts = self._context_parts(n_chars)
        self._emit(t, 0, "start", parts)
        self.length = len(self.rend.head) + self._parts_length(parts)

    def call_parts(self, first_of_turn: bool, last_of_turn: bool) -> list:
        rng, cfg = self.rng, self.cfg
        size = int(_lognormal(rng, cfg.append_median, cfg.append_p90, 50, 400_000))
        parts = []
        if first_of_turn:
            u = int(_lognormal(rng, 300, 3000, 5, 20_000))
            parts.append(self._part("user", u))
            size = max(50, size - u)
        a = int(_lognormal(rng, 180, 900, 10, 4000))
        think_n = int(_lognormal(rng, 800, 4000, 20, 20_000)) if last_of_turn and rng.random() < cfg.think_rate else 0
        parts.append(self._part("assistant", min(a, size), think_n))
        if size > a:
            parts.append(self._part("tool", size - a))
        return parts

    def turn(self, t: float, turn: int, n_calls: int) -> float:
        rng, cfg = self.rng, self.cfg
        for c in range(n_calls):
            if c:
                t += _lognormal(rng, cfg.call_gap_median_s, cfg.call_gap_p90_s, 0.5, 600)
            if rng.random() < cfg.compact_rate and self.length > 20 * cfg.append_median:
                n = int(_lognormal(rng, cfg.compact_ratio * cfg.append_median, 3 * cfg.compact_ratio *
                                   cfg.append_median, 5000, max(5000, self.length // 2)))
                parts = [self._part("system", int(_lognormal(rng, 2500, 8000, 200, 20_000))),
                         self._part("user", n)]
                self._emit(t, turn, "compact", parts)
                self.length = len(self.rend.head) + self._parts_length(parts)
                self.think = None
                continue
            parts = self.call_parts(c == 0, c == n_calls - 1)
            if c == 0 and self.think is not None:
                a, b = self.think
                self._emit(t, turn, "edit", parts, start=a, end=b)
                self.length -= b - a
            else:
                self._emit(t, turn, "append", parts)
            # remember the think span of this call's assistant turn (dropped at the next turn)
            self.think = None
            pos = self.length
            for role, _o, n, tn in parts:
                if role == "assistant" and tn:
                    self.think = self.rend.think_span(pos, tn)
                pos += self.rend.length(role, n - tn, tn)
            self.length = pos
            if self.length > cfg.max_context:
                break
        return t


def _pick(rng: random.Random, weighted: tuple[tuple[str, float], ...]) -> str:
    x, acc = rng.random() * sum(w for _, w in weighted), 0.0
    for k, w in weighted:
        acc += w
        if x < acc:
            return k
    return weighted[-1][0]


def _material_versions() -> dict:
    import importlib.metadata as md
    import platform

    out = {"python": platform.python_version()}
    for pkg in ("faker", "emoji"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


def _header(kind: str, seed: int, cfg: TraceConfig, family: str, sessions: dict) -> dict:
    return {"trace": kind, "seed": seed, "family": family, "config": dataclasses.asdict(cfg),
            "material": _material_versions(), "sessions": sessions, "format": 1}


def generate_mixture(n_sessions: int, seed: int, cfg: TraceConfig = TraceConfig(), family: str = "llama3"
                     ) -> tuple[dict, list[dict]]:
    """Sessions drawn from the calibrated distributions, arriving over ``cfg.session_arrival_s``."""
    rng = random.Random(f"mixture:{seed}")
    rend = Renderer(family)
    calls, sessions = [], {}
    for i in range(n_sessions):
        sid = f"m{i}"
        sseed = rng.randrange(1 << 30)
        g = _SessionGen(sid, random.Random(sseed), cfg, rend, _pick(rng, cfg.materials), sseed)
        t = rng.uniform(0, cfg.session_arrival_s)
        g.start(t, int(_lognormal(g.rng, cfg.start_median, cfg.start_p90, cfg.min_context, cfg.max_context)))
        n_turns = int(round(_lognormal(g.rng, cfg.turns_median, cfg.turns_p90, 1, 200)))
        for turn in range(1, n_turns + 1):
            if g.length > cfg.max_context:
                break
            if g.rng.random() < cfg.resume_rate:
                t += g.rng.uniform(3600, 2 * 86400)
            else:
                t += _lognormal(g.rng, cfg.turn_pause_median_s, cfg.turn_pause_p90_s, 5, 3 * 3600)
            n = int(round(_lognormal(g.rng, cfg.calls_per_turn_median, cfg.calls_per_turn_p90, 1, 300)))
            t = g.turn(t, turn, n)
        calls += g.calls
        sessions[sid] = {"material": g.material, "seed": sseed, "chars": g.off}
    calls.sort(key=lambda c: (c["t"], c["sid"], c["call"]))
    return _header("mixture", seed, cfg, family, sessions), calls


def generate_stratified(sizes: list[int], n_calls: int, seed: int, cfg: TraceConfig = TraceConfig(),
                        family: str = "llama3", sessions_per_size: int = 1) -> tuple[dict, list[dict]]:
    """``sessions_per_size`` sessions per context size, each starting at that size, with ``n_calls``
    calls (sizes, ops, think blocks; drawn from the calibrated per-call distributions); session j
    has the same call sequence at every size (no compactions: they would leave the size class;
    full-context calls are measured by the session starts).  A session grows ~3K characters per
    call, so many short sessions keep a size class near its size where one long one would not.
    Session ids: ``ctx{size}`` (one per size) or ``ctx{size}-{j}``."""
    if sessions_per_size < 1:
        raise ValueError(f"sessions_per_size must be >= 1, not {sessions_per_size}")
    cfg = dataclasses.replace(cfg, compact_rate=0.0, max_context=4 * max(sizes))  # never cut a session short
    rng = random.Random(f"stratified:{seed}")
    rend = Renderer(family)
    calls, sessions = [], {}
    for size, j in ((size, j) for size in sizes for j in range(sessions_per_size)):
        sid = f"ctx{size}" if sessions_per_size == 1 else f"ctx{size}-{j}"
        sseed = rng.randrange(1 << 30)
        g = _SessionGen(sid, random.Random(sseed), cfg, rend, "mixed", sseed)
        g.start(0.0, size)
        g.rng = random.Random(f"stratified-calls:{seed}" + (f":{j}" if j else ""))  # same calls at every size
        t, turn = 0.0, 0
        while g.n_call <= n_calls:
            turn += 1
            t += _lognormal(g.rng, cfg.turn_pause_median_s, cfg.turn_pause_p90_s, 5, 3 * 3600)
            n = int(round(_lognormal(g.rng, cfg.calls_per_turn_median, cfg.calls_per_turn_p90, 1, 300)))
            t = g.turn(t, turn, min(n, n_calls + 1 - g.n_call))
        calls += g.calls
        sessions[sid] = {"material": g.material, "seed": sseed, "chars": g.off}
    return _header("stratified", seed, cfg, family, sessions), calls


# ---------------------------------------------------------------------------------------------
# files and replay
# ---------------------------------------------------------------------------------------------


def write(path: str, header: dict, calls: list[dict]) -> None:
    with open(path, "w") as f:
        f.write(json.dumps(header) + "\n")
        for c in calls:
            f.write(json.dumps(c, separators=(",", ":")) + "\n")


def read(path: str) -> tuple[dict, list[dict]]:
    with open(path) as f:
        header = json.loads(f.readline())
        return header, [json.loads(line) for line in f if line.strip()]


@dataclass
class Call:
    """One replayed call: the session's whole new text and the change from the previous one."""

    sid: str
    index: int
    t: float
    op: str  # start | append | edit | compact
    text: str
    delta: str  # appended text (append), the replacement of [start, end) (edit)
    start: int = 0
    end: int = 0
    old_chars: int = 0
    record: dict = field(default_factory=dict, repr=False)


def material_stream(meta: dict) -> str:
    return large_text(max(1, meta["chars"]), seed=meta["seed"], kind=meta["material"])


def replay(header: dict, calls: list[dict], sessions: set[str] | None = None) -> Iterator[Call]:
    """Rebuild every call's text in trace order (materials are built lazily per session)."""
    rend = Renderer(header["family"])
    materials: dict[str, str] = {}
    texts: dict[str, str] = {}
    for i, c in enumerate(calls):
        sid = c["sid"]
        if sessions is not None and sid not in sessions:
            continue
        if sid not in materials:
            materials[sid] = material_stream(header["sessions"][sid])
        mat = materials[sid]
        new = rend.render(mat, c["parts"])
        old = texts.get(sid, "")
        op = c["op"]
        if op in ("start", "compact"):
            text = rend.head + new
            call = Call(sid, i, c["t"], op, text, text, 0, len(old), len(old), c)
        elif op == "append":
            text = old + new
            call = Call(sid, i, c["t"], op, text, new, len(old), len(old), len(old), c)
        elif op == "edit":
            a, b = c["start"], c["end"]
            text = old[:a] + old[b:] + new
            call = Call(sid, i, c["t"], op, text, old[b:] + new, a, len(old), len(old), c)
        else:
            raise ValueError(f"unknown op {op!r}")
        texts[sid] = text
        yield call


def summarize(header: dict, calls: list[dict]) -> dict:
    """Shape statistics of a trace (to compare with the calibration targets)."""
    import numpy as np

    rend = Renderer(header["family"])
    by_sid: dict[str, list[dict]] = {}
    for c in calls:
        by_sid.setdefault(c["sid"], []).append(c)
    appended, ctx, gaps, per_turn = [], [], [], []
    full = 0
    for sid, cs in by_sid.items():
        cs.sort(key=lambda c: c["call"])
        length = 0
        turn_counts: dict[int, int] = {}
        for prev, c in zip([None] + cs[:-1], cs):
            n = sum(rend.length(r, n - tn, tn) for r, _o, n, tn in c["parts"])
            if c["op"] in ("start", "compact"):
                full += 1
                length = len(rend.head) + n
            else:
                if c["op"] == "edit":
                    length -= c["end"] - c["start"]
                appended.append(n)
                length += n
                turn_counts[c["turn"]] = turn_counts.get(c["turn"], 0) + 1
            ctx.append(length)
            if prev is not None:
                gaps.append(c["t"] - prev["t"])
        per_turn += list(turn_counts.values())
    q = lambda xs, p: float(np.percentile(xs, p)) if len(xs) else float("nan")  # noqa: E731
    return {
        "sessions": len(by_sid), "calls": len(calls), "full_context_share": full / max(1, len(calls)),
        "edits": sum(c["op"] == "edit" for c in calls), "compactions": sum(c["op"] == "compact" for c in calls),
        "append_p50": q(appended, 50), "append_p90": q(appended, 90),
        "context_p50_chars": q(ctx, 50), "context_p10_chars": q(ctx, 10), "context_p90_chars": q(ctx, 90),
        "context_max_chars": max(ctx) if ctx else 0,
        "calls_per_turn_p50": q(per_turn, 50), "calls_per_turn_p90": q(per_turn, 90),
        "gap_p50_s": q(gaps, 50), "gap_p90_s": q(gaps, 90), "gap_p99_s": q(gaps, 99),
        "gaps": gaps,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kind", choices=["mixture", "stratified"], default="mixture")
    ap.add_argument("--sessions", type=int, default=100)
    ap.add_argument("--sizes", default="100000,300000,1000000,2000000,4000000")
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--heavy", action="store_true", help="the heavier autonomous-agent variant")
    ap.add_argument("--family", default="llama3", choices=["llama3", "chatml", "deepseek", "none"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    cfg = TraceConfig.heavy() if args.heavy else TraceConfig()
    if args.kind == "mixture":
        header, calls = generate_mixture(args.sessions, args.seed, cfg, args.family)
    else:
        header, calls = generate_stratified([int(x) for x in args.sizes.split(",")], args.calls, args.seed, cfg,
                                            args.family)
    write(args.out, header, calls)
    s = summarize(header, calls)
    s.pop("gaps")
    print(json.dumps(s, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
