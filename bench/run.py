"""One command for the agent-trace benchmark suite: tables, figures, goal checks.

    python -m bench.run --quick      # < 10 minutes on 2 cores
    python -m bench.run --full       # everything (longer traces, more samples, longer load levels)

Steps (each prints its tables as it finishes; progress bars on stderr):

1. engines: the stratified agent trace (100K..4M-character contexts) through TokTier and every
   peer (:mod:`bench.agent_trace`), with divergence counts;
2. outcomes: the calibrated mixture trace through TokTier (window outcomes, TTL hit shares), and a
   many-appends campaign of the same shape on small contexts (the first-window rate);
3. chats: replays of real ShareGPT chats, one append per message (:mod:`bench.real_chats`);
4. memory: a session grown to 500K tokens;
5. load: the open-loop sidecar load test, stateful vs. stateless (:mod:`bench.load_test`);
6. figures in ``bench/figures/`` and a goal summary; ``--write-results`` also replaces the
   "Agent traces (issue 6)" section of ``bench/RESULTS.md`` with the tables of this run.

Results (JSON) and the trace files (JSONL, seeded) go to ``--out`` (default: a temp folder).
Times are measured, never asserted; ratios are against peers measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIG_DIR = os.path.join(ROOT, "bench", "figures")
RESULTS_MD = os.path.join(ROOT, "bench", "RESULTS.md")
SECTION = "## Agent traces (issue 6)"
WARM_EXACT = ("fastokens-input-cache", "gigatoken", "fastokens-segment-cache", "fastokens", "tiktoken")

# calls: per session in the agent trace (sessions_per_size sessions per context size, default 1);
# samples: calls per size on which the slow engines are timed; seam_*: plain-text appends;
# adv_*: adversarial seams; mix_*: mixture replay through TokTier;
# camp_sessions: the many-appends window-outcome campaign (mixture shape, small contexts);
# chat_*: replays of real ShareGPT chats (0 conversations = every complete record);
# load_*: seconds per load level, drain time, minimum calls per level.
PRESETS = {
    "smoke": {"calls": 6, "samples": 2, "sizes": (100_000, 300_000),
              "seam_calls": 6, "seam_sizes": (300_000,),
              "adv_tokenizers": ("llama3",), "adv_sessions": 3, "adv_calls": 20,
              "mix_sessions": 4, "mix_check": 0.05, "heavy_sessions": 0, "camp_sessions": 3,
              "chat_conversations": 50, "chat_tokenizers": ("llama3",),
              "load_duration": 1.5, "load_drain": 4.0, "mixtures": ("short",)},
    "quick": {"calls": 30, "samples": 3,
              "seam_calls": 20,
              "adv_tokenizers": ("llama3", "o200k_base", "deepseek_v4"), "adv_sessions": 10, "adv_calls": 40,
              "mix_sessions": 24, "mix_check": 0.02, "heavy_sessions": 0, "camp_sessions": 100,
              "chat_conversations": 2000, "chat_tokenizers": ("llama3",),
              "load_duration": 4.0, "load_drain": 8.0, "load_min_calls": 200},
    "full": {"calls": 30, "sessions_per_size": 7, "samples": 10,
             "seam_calls": 200, "seam_sizes": (1_000_000, 2_000_000, 4_000_000),
             "adv_tokenizers": ("llama3", "cl100k_base", "o200k_base", "o200k_harmony", "deepseek_v4", "qwen3"),
             "adv_sessions": 120, "adv_calls": 100,
             "mix_sessions": 300, "mix_check": 0.05, "heavy_sessions": 100, "camp_sessions": 1500,
             "chat_conversations": 0, "chat_tokenizers": ("llama3", "o200k_base", "deepseek_v4", "qwen3"),
             "load_duration": 15.0, "load_drain": 20.0, "load_min_calls": 200},
}


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.floating, float)):
        return None if (isinstance(x, float) and math.isnan(x)) else float(x)
    if isinstance(x, np.integer):
        return int(x)
    return x


# ---------------------------------------------------------------------------------------------
# goals
# ---------------------------------------------------------------------------------------------


def goals(res: dict) -> list[dict]:
    from bench.agent_trace import latency_table

    out = []
    for key, label in (("engines", "agent trace"), ("seams", "plain-text appends")):
        eng = res.get(key)
        if eng:
            out += _latency_goals(eng, label, latency_table)
    return out + _other_goals(res)


def _latency_goals(eng: dict, label: str, latency_table) -> list[dict]:
    out = []
    if eng:
        rows = latency_table(eng)
        p50 = {(r["engine"], r["bucket"]): r["p50"] for r in rows}
        ratios = {}
        for size in eng["sizes"]:
            tk = p50.get(("toktier", size))
            peers = {n: p50[(n, size)] for n in WARM_EXACT if (n, size) in p50}
            if tk and peers:
                best = min(peers, key=peers.get)
                ratios[size] = (best, peers[best] / tk)
        for size, need in ((1_000_000, 2.0), (4_000_000, 10.0)):
            if size in ratios:
                best, r = ratios[size]
                out.append({"goal": f"repair P50 >= {need:g}x faster than the fastest warm exact peer at "
                                     f"{size / 1e6:g}M chars ({label})", "measured": f"{r:.2f}x (fastest peer: {best})",
                            "met": r >= need})
        if ("hf-tokenizers", 1_000_000) in p50 and ("toktier", 1_000_000) in p50:
            r = p50[("hf-tokenizers", 1_000_000)] / p50[("toktier", 1_000_000)]
            out.append({"goal": f"repair P50 >= 300x faster than HF tokenizers at 1M chars ({label})",
                        "measured": f"{r:.0f}x",
                        "met": r >= 300})
        if len(ratios) >= 2:
            seq = [ratios[s][1] for s in sorted(ratios)]
            grows = all(b >= a * 0.9 for a, b in zip(seq, seq[1:]))
            out.append({"goal": f"the lead over the fastest warm exact peer grows with context ({label})",
                        "measured": " -> ".join(f"{x:.2f}x" for x in seq), "met": grows})
        d = eng["divergences"].get("toktier", {})
        ds = eng["divergences"].get("toktier-sync", {})
        out.append({"goal": f"zero divergences for TokTier ({label})",
                    "measured": f"{d.get('diverged')} of {d.get('checked')} calls (ops)" +
                                (f", {ds.get('diverged')} of {ds.get('checked')} (sync)" if ds else ""),
                    "met": d.get("diverged") == 0 and ds.get("diverged", 0) == 0})
    return out


def _other_goals(res: dict) -> list[dict]:
    out = []
    fw = total = 0
    for part in ("engines", "seams", "outcomes", "outcomes_heavy", "outcomes_campaign"):
        o = (res.get(part) or {}).get("outcomes") or {}
        fw += o.get("first_window", 0)
        total += sum(o.values())
    for r in res.get("chats") or []:
        fw += r["outcomes"].get("first_window", 0)
        total += sum(r["outcomes"].values())
    if total:
        # With k misses in n, a 95% upper bound on the miss rate (rule of three when k = 0).
        bound = 3.0 / total if fw == total else None
        out.append({"goal": ">= 99.99% of appends/edits splice on the first window",
                    "measured": f"{fw / total:.4%} of {total:,}" +
                                (f" (95% upper bound on the miss rate {bound:.4%})" if bound is not None else ""),
                    "met": fw / total >= 0.9999})
    o = res.get("outcomes")
    if o:
        out.append({"goal": "zero divergences for TokTier (mixture replay, checked states)",
                    "measured": f"{o['mismatches']} of {o['checked']} checked", "met": o["mismatches"] == 0})
    chats = res.get("chats") or []
    if chats:
        bad = sum(r["mismatches"] for r in chats)
        out.append({"goal": "zero divergences for TokTier (real ShareGPT chats, every final state checked)",
                    "measured": f"{bad} of {sum(r['checked'] for r in chats):,} conversations "
                                f"({sum(r['appends'] for r in chats):,} appends) over "
                                f"{', '.join(r['tokenizer'] for r in chats)}", "met": bad == 0})
    adv = res.get("adversarial") or []
    if adv:
        tk = [(r["tokenizer"], r["divergences"][n]) for r in adv for n in ("toktier", "toktier-sync")
              if n in r["divergences"]]
        bad = sum(d["diverged"] for _, d in tk)
        out.append({"goal": "zero divergences for TokTier (adversarial seams)",
                    "measured": f"{bad} of {sum(d['checked'] for _, d in tk)} calls over "
                                f"{', '.join(dict.fromkeys(t for t, _ in tk))}", "met": bad == 0})
    load = res.get("load")
    if load:
        for mix in dict.fromkeys(r["mixture"]["name"] for r in load["runs"]):
            caps = {r["mode"]: r for r in load["runs"] if r["mixture"]["name"] == mix}
            if "stateful" in caps and "stateless" in caps:
                sf, sl = caps["stateful"]["capacity"], caps["stateless"]["capacity"]
                lowest = caps["stateless"]["lowest_rate"]
                if sl:
                    r, text = sf / sl, f"{sf:.1f}/s vs {sl:.1f}/s = {sf / sl:.1f}x"
                elif not sf:
                    r, text = 0.0, "neither mode met the SLO at any tested level"
                else:
                    r = sf / lowest if sf else 0.0
                    text = (f"{sf:.1f}/s vs stateless below {lowest:g}/s (missed the SLO at every level): "
                            f"> {r:.0f}x")
                out.append({"goal": f"sidecar capacity at P99 < 50 ms >= 20x stateless ({mix} mixture)",
                            "measured": text, "met": r >= 20 and sf > 0})
    return out


def print_goals(gs: list[dict]) -> None:
    print("\n## Goals (ratios from this run)")
    for g in gs:
        print(f"  [{'met' if g['met'] else 'NOT met':>7}] {g['goal']}: {g['measured']}")


# ---------------------------------------------------------------------------------------------
# figures
# ---------------------------------------------------------------------------------------------

_STYLE = {
    "toktier": ("#d62728", "o", 2.6), "toktier-sync": ("#ff9896", "o", 1.6),
    "hf-tokenizers": ("#1f77b4", "s", 1.4), "tiktoken": ("#17becf", "s", 1.4),
    "fastokens": ("#2ca02c", "^", 1.4), "fastokens-input-cache": ("#98df8a", "^", 1.4),
    "fastokens-segment-cache": ("#bcbd22", "^", 1.4), "gigatoken": ("#9467bd", "D", 1.4),
    "gigatoken-cold": ("#c5b0d5", "D", 1.4), "l0-exact": ("#7f7f7f", "x", 1.2),
    "l1-special-prefix": ("#8c564b", "v", 1.2), "overlap-resync": ("#e377c2", "v", 1.2),
}


def figures(res: dict, fig_dir: str = FIG_DIR) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    from bench.agent_trace import latency_table

    os.makedirs(fig_dir, exist_ok=True)
    made = []
    eng = res.get("engines")
    if eng:
        rows = latency_table(eng)
        fig, ax = plt.subplots(figsize=(9, 6))
        for name in eng["engines"]:
            rs = sorted((r for r in rows if r["engine"] == name), key=lambda r: r["bucket"])
            if not rs:
                continue
            color, marker, lw = _STYLE.get(name, ("black", ".", 1))
            x = [r["bucket"] for r in rs]
            ax.plot(x, [r["p50"] for r in rs], marker=marker, color=color, lw=lw, label=f"{name} P50")
            ax.plot(x, [r["p90"] for r in rs], color=color, lw=0.8, ls=":", alpha=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("context size at the call (characters; session start size)")
        ax.set_ylabel("per-call latency (ms), P50 solid, P90 dotted")
        ax.set_title(f"Agent-trace calls (append/edit), {eng['tokenizer']}: latency vs context size")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=2, loc="upper left")
        fig.tight_layout()
        path = os.path.join(fig_dir, "latency_vs_context.png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        made.append(path)
    # window outcomes
    parts = [(k, res.get(k)) for k in ("engines", "seams", "outcomes", "outcomes_heavy", "outcomes_campaign")
             if res.get(k)]
    parts += [(f"chats:{r['tokenizer']}", r) for r in res.get("chats") or []]
    if parts:
        labels = ["first window"] + [f"widened x{i}" for i in range(1, 6)] + ["full fallback"]
        fig, ax = plt.subplots(figsize=(9, 4.8))
        width = 0.8 / len(parts)
        for j, (k, p) in enumerate(parts):
            w = {int(a): b for a, b in (p.get("widenings") or {}).items()}
            o = p.get("outcomes") or {}
            counts = [o.get("first_window", 0)] + [w.get(i, 0) for i in range(1, 6)] + [o.get("full", 0)]
            xs = np.arange(len(labels)) + (j - (len(parts) - 1) / 2) * width
            total = sum(o.values())
            name = f"real ShareGPT chats ({k[6:]})" if k.startswith("chats:") else {
                    "engines": "stratified agent trace (all sizes)", "seams": "plain-text appends",
                    "outcomes": "mixture trace",
                    "outcomes_heavy": "mixture trace, heavy variant",
                    "outcomes_campaign": "campaign (mixture shape, small contexts)"}[k]
            bars = ax.bar(xs, [max(c, 0) for c in counts], width, label=f"{name} (n={total})")
            for b, c in zip(bars, counts):
                if c:
                    ax.annotate(str(c), (b.get_x() + b.get_width() / 2, c), ha="center", va="bottom", fontsize=7)
        ax.set_yscale("symlog", linthresh=1)
        ax.set_xticks(np.arange(len(labels)), labels, rotation=20)
        ax.set_ylabel("appends + edits")
        ax.set_title("TokTier repair outcome per append/edit")
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(fig_dir, "window_outcomes.png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        made.append(path)
    load = res.get("load")
    if load:
        mixes = list(dict.fromkeys(r["mixture"]["name"] for r in load["runs"]))
        fig, axes = plt.subplots(1, len(mixes), figsize=(6 * len(mixes), 4.8), squeeze=False)
        for ax, mix in zip(axes[0], mixes):
            for r in (r for r in load["runs"] if r["mixture"]["name"] == mix):
                lv = r["levels"]
                color = "#d62728" if r["mode"] == "stateful" else "#1f77b4"
                x = [v["rate"] for v in lv]
                ax.plot(x, [v["append_p99"] for v in lv], marker="o", color=color, label=f"{r['mode']} append P99")
                ax.plot(x, [v["append_p50"] for v in lv], marker=".", ls="--", color=color,
                        label=f"{r['mode']} append P50")
            ax.axhline(load["slo_ms"], color="black", lw=0.8, ls=":", label=f"SLO {load['slo_ms']:.0f} ms")
            ax.set_xscale("log")
            ax.set_yscale("log")
            for axis in (ax.xaxis, ax.yaxis):
                axis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
                axis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            m = next(r["mixture"] for r in load["runs"] if r["mixture"]["name"] == mix)
            ax.set_title(f"{mix} mixture (start median {m['start_median'] / 1e3:.0f}K chars, "
                         f"max {m['max_context'] / 1e6:g}M)", fontsize=9)
            ax.set_xlabel("offered load (calls/s, Poisson)")
            ax.set_ylabel("latency from scheduled arrival (ms)")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        fig.suptitle(f"Sidecar open-loop load test, {load['tokenizer']}, {load['cpus']} CPUs: stateful vs stateless")
        fig.tight_layout()
        path = os.path.join(fig_dir, "load_latency.png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        made.append(path)
    return made


# ---------------------------------------------------------------------------------------------
# RESULTS.md section (tables of this run; prose is written by people)
# ---------------------------------------------------------------------------------------------


def markdown(res: dict) -> str:
    from bench.agent_trace import latency_table, start_table

    L = []
    m = res["machine"]
    L.append(f"Command: `{res['command']}` ({res['preset']}), {res['elapsed_s'] / 60:.1f} min. Machine: "
             f"{m.get('cpus')} CPUs ({m.get('cpu', '?')}), {m.get('mem_gb', '?')} GB RAM, no GPU, Python "
             f"{m['python']}; tokenizers {m.get('tokenizers')}, tiktoken {m.get('tiktoken')}, fastokens "
             f"{m.get('fastokens')}, gigatoken {m.get('gigatoken')}; load average at start "
             f"{', '.join(f'{x:.1f}' for x in m['loadavg_start'])}.")
    for key in ("engines", "seams"):
        eng = res.get(key)
        if eng:
            L += _engines_md(eng, key)
    return _md_rest(res, L)


def _engines_md(eng: dict, key: str) -> list[str]:
    from bench.agent_trace import calls_per_size, latency_table, start_table

    L = []
    if eng:
        s = eng["trace_summary"]
        L.append("")
        title = "agent trace, chat template" if key == "engines" else "plain-text appends, no template (seams anywhere)"
        L.append(f"### Per-call latency by context size: {title} ({eng['tokenizer']}, append/edit calls, "
                 f"{calls_per_size(eng)}; reference, tiktoken, gigatoken-cold and L0 timed on "
                 f"{eng['samples']} calls per size)")
        L.append("")
        L.append(f"Stratified trace: appended chars per call P50 {s['append_p50']:.0f} / P90 {s['append_p90']:.0f}, "
                 f"{s['edits']} template edits (think blocks dropped).")
        L.append("")
        L.append("| engine | context | n | P50 ms | P90 ms | P99 ms | P50 vs TokTier | served MB/core-s | "
                 "scanned chars/call | scanned Mchars/core-s |")
        L.append("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
        for r in latency_table(eng):
            L.append(f"| {r['engine']} | {r['bucket'] / 1e6:g}M | {r['n']} | {r['p50']:.2f} | {r['p90']:.2f} | "
                     f"{r['p99']:.2f} | {r['ratio_p50']:.1f}x | {r['served_mb_per_core_s']:.1f} | "
                     f"{r['scanned_chars_per_call']:,.0f} | {r['scanned_mchars_per_core_s']:.2f} |")
        L.append("")
        L.append("Session start (one full-context call per size), ms:")
        L.append("")
        st = start_table(eng)
        names = list(dict.fromkeys(r["engine"] for r in st))
        L.append("| engine | " + " | ".join(f"{x / 1e6:g}M" for x in eng["sizes"]) + " |")
        L.append("|---|" + "--:|" * len(eng["sizes"]))
        for n in names:
            cells = {r["bucket"]: r["ms"] for r in st if r["engine"] == n}
            L.append(f"| {n} | " + " | ".join(f"{cells[x]:.0f}" if x in cells else "-" for x in eng["sizes"]) + " |")
        L.append("")
        L.append("Divergences from the reference (every call an engine served was checked):")
        L.append("")
        L.append("| engine | calls checked | diverged | by op | first example |")
        L.append("|---|--:|--:|---|---|")
        for n, d in eng["divergences"].items():
            ex = d["examples"][0] if d["examples"] else ""
            L.append(f"| {n} | {d['checked']} | {d['diverged']} | {d['by_op'] or ''} | {ex} |")
        L.append("")
        L.append(f"Truth per call: {eng['truth_source']} (reference = HF ran on that call; agreement = TokTier, "
                 f"fastokens and gigatoken identical; adjudicated = a fresh reference encode). Cache hit/miss/"
                 f"partial counts: {eng['cache_stats']}.")
    return L


def _md_rest(res: dict, L: list[str]) -> str:
    adv = res.get("adversarial") or []
    if adv:
        L.append("")
        L.append("### Adversarial seams: divergences per engine (every call checked against the reference)")
        L.append("")
        names = list(dict.fromkeys(n for r in adv for n in r["divergences"]))
        L.append("| engine | " + " | ".join(f"{r['tokenizer']}" for r in adv) + " |")
        L.append("|---|" + "--:|" * len(adv))
        for n in names:
            cells = []
            for r in adv:
                d = r["divergences"].get(n)
                cells.append(f"{d['diverged']} / {d['checked']}" if d else "-")
            L.append(f"| {n} | " + " | ".join(cells) + " |")
        L.append("")
        for r in adv:
            for n, d in r["divergences"].items():
                if d["examples"]:
                    L.append(f"- {r['tokenizer']} {n}: e.g. `{json.dumps(d['examples'][0], ensure_ascii=False)}`")
    for key in ("outcomes", "outcomes_heavy", "outcomes_campaign"):
        o = res.get(key)
        if not o:
            continue
        tot = sum(o["outcomes"].values())
        s = o["trace_summary"]
        L.append("")
        variant = " (heavy variant)" if o["heavy"] else ""
        if o.get("small_contexts"):
            variant = " (campaign: the mixture's appends and edits on 10K-400K-char contexts)"
        L.append(f"### Window outcomes, mixture trace{variant} ({o['sessions']} sessions, seed {o['seed']})")
        L.append("")
        L.append(f"Trace shape: {s['calls']} calls, appended chars P50/P90 {s['append_p50']:.0f}/"
                 f"{s['append_p90']:.0f}, "
                 f"context P10/P50/P90 {s['context_p10_chars'] / 1e3:,.0f}K/{s['context_p50_chars'] / 1e3:,.0f}K/"
                 f"{s['context_p90_chars'] / 1e3:,.0f}K chars (max {s['context_max_chars'] / 1e6:.1f}M), "
                 f"calls per turn "
                 f"P50/P90 {s['calls_per_turn_p50']:.0f}/{s['calls_per_turn_p90']:.0f}, full-context calls "
                 f"{s['full_context_share']:.1%}, {s['edits']} edits, {s['compactions']} compactions.")
        L.append("")
        L.append("| outcome | count | share |")
        L.append("|---|--:|--:|")
        for k in ("first_window", "widened", "full"):
            L.append(f"| {k} | {o['outcomes'].get(k, 0)} | {o['outcomes'].get(k, 0) / max(1, tot):.4%} |")
        L.append("")
        L.append(f"Widenings histogram {o['widenings']}; full-path reasons {o['full_reasons'] or 'none'}; TokTier "
                 f"latency by op: " + ", ".join(f"{k} P50 {v['p50']:.2f} / P99 {v['p99']:.2f} ms (n={v['n']})"
                                              for k, v in o["latency_ms"].items()) +
                 f". States checked against the reference: {o['checked']}, mismatches {o['mismatches']}.")
        L.append("")
        L.append("Token-state TTL hit share under the trace's pauses: " +
                 ", ".join(f"{k}: {v:.1%}" for k, v in o["ttl"].items()) + ".")
    chats = res.get("chats") or []
    if chats:
        L.append("")
        L.append(f"### Real chats replayed ({chats[0]['source']}): every message one append, every final state "
                 f"checked against the reference")
        L.append("")
        L.append(f"The packaged JSON file is cut off; its {chats[0]['records_in_file']:,} complete records were "
                 f"read. Real human/assistant chats (prose, code, many languages), not agent tool use.")
        L.append("")
        L.append("| tokenizer | conversations | appends | context P50 / max chars | first window | widened | full | "
                 "final states checked | mismatches | append P50 / P99 ms | sampled: TokTier P50 vs full "
                 "re-tokenization P50 ms |")
        L.append("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
        for r in chats:
            o, a, rs = r["outcomes"], r["append_ms"], r["reference_sampled"]
            L.append(f"| {r['tokenizer']} | {r['conversations']:,} | {r['appends']:,} | "
                     f"{r['context_p50_chars']:,.0f} / {r['context_max_chars']:,} | {o.get('first_window', 0):,} | "
                     f"{o.get('widened', 0)} | {o.get('full', 0)} | {r['checked']:,} | {r['mismatches']} | "
                     f"{a['p50']:.2f} / {a['p99']:.2f} | {rs['toktier_p50_ms']:.2f} vs {rs['reference_p50_ms']:.2f} "
                     f"(n={rs['n']}) |")
    mem = res.get("memory")
    if mem:
        f = mem["final"]
        L.append("")
        L.append(f"### Session memory: {f['tokens']:,} tokens after {f['appends']} appends of 1.4K chars: "
                 f"{f['nbytes'] / 2**20:.1f} MiB in the session = text {f['text_bytes'] / 2**20:.1f} MiB + arrays "
                 f"{(f['nbytes'] - f['text_bytes']) / 2**20:.1f} MiB ({f['bytes_per_token_arrays']:.2f} B/token; "
                 f"{f['bytes_per_token_total']:.2f} B/token with the text); traced allocation growth "
                 f"{f['rss_delta'] / 2**20:.1f} MiB; exact: {mem['exact']}.")
    load = res.get("load")
    if load:
        L.append("")
        L.append(f"### Open-loop sidecar load test ({load['tokenizer']}, {load['cpus']} CPUs, load generator in its "
                 f"own process; SLO append P99 < {load['slo_ms']:.0f} ms)")
        L.append("")
        L.append("| mixture | mode | offered/s | completed | append P50 ms | append P99 ms | start P50 ms | "
                 "compact P50 ms | loadgen cores | loadgen us/call | send lag P99 ms | sidecar cores | SLO |")
        L.append("|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|")
        # "stopped early": enough calls had missed the SLO that the level's P99 was already over it
        for r in load["runs"]:
            for lv in r["levels"]:
                ops = lv["ops"]
                f2 = lambda d: f"{d['p50']:.1f}" if d else "-"  # noqa: E731
                L.append(f"| {r['mixture']['name']} | {r['mode']} | {lv['rate']:.1f} | "
                         f"{lv['completed']}/{lv['offered']} | "
                         f"{lv['append_p50']:.2f} | {lv['append_p99']:.2f} | {f2(ops.get('start'))} | "
                         f"{f2(ops.get('compact'))} | {lv['loadgen_cores']:.2f} | "
                         f"{lv['loadgen_cpu_us_per_call']:.0f} | "
                         f"{lv.get('send_lag_p99_ms', float('nan')):.2f} | "
                         f"{lv['sidecar_cores']:.2f} | "
                         f"{'yes' if lv['meets_slo'] else 'no (stopped early)' if lv.get('stopped_early') else 'no'} |")
    gs = res.get("goals") or []
    if gs:
        L.append("")
        L.append("### Goals (measured in this run)")
        L.append("")
        for g in gs:
            L.append(f"- **{'met' if g['met'] else 'not met'}**: {g['goal']}: {g['measured']}")
    return "\n".join(L) + "\n"


MARK = "<!-- bench.run --write-results: generated tables below; the prose above is kept -->"


def write_results_section(body: str) -> None:
    """Replace the generated part of this suite's section; prose written above MARK is kept."""
    text = open(RESULTS_MD).read() if os.path.exists(RESULTS_MD) else "# Benchmark results\n"
    start = text.find(SECTION)
    prose = ""
    if start != -1:
        nxt = text.find("\n## ", start + len(SECTION))
        old = text[start : (len(text) if nxt == -1 else nxt + 1)]
        if MARK in old:
            prose = old[len(SECTION) : old.index(MARK)].strip("\n") + "\n\n"
    new = f"{SECTION}\n\n{prose}{MARK}\n\n{body}"
    if start == -1:
        text = text.rstrip("\n") + "\n\n" + new
    else:
        text = text[:start] + new + ("" if nxt == -1 else "\n" + text[nxt + 1:])
    with open(RESULTS_MD, "w") as f:
        f.write(text)


# ---------------------------------------------------------------------------------------------


def _per_tokenizer(label: str, names, show, run, skip: tuple[type[BaseException], ...] = (Exception,)
                   ) -> list[dict]:
    """``run(name)`` for each tokenizer, printing each result; one raising ``skip`` (its data is
    missing) is reported and skipped."""
    out = []
    for name in names:
        try:
            r = run(name)
        except skip as exc:
            print(f"{label}: {name} skipped ({type(exc).__name__}: {exc})")
            continue
        show(r)
        out.append(r)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="the < 10 minute version (default)")
    g.add_argument("--full", action="store_true", help="everything")
    g.add_argument("--smoke", action="store_true", help="a one-minute check that every step runs")
    ap.add_argument("--tokenizer", default="llama3")
    ap.add_argument("--steps", default="engines,seams,adversarial,outcomes,chats,memory,load",
                    help="comma list of steps to run")
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "toktier-bench"))
    ap.add_argument("--figures", default=FIG_DIR)
    ap.add_argument("--from-json", help="redraw figures/tables from a results.json instead of running")
    ap.add_argument("--write-results", action="store_true", help="replace this suite's section of bench/RESULTS.md")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # tables appear as each step ends, even when piped
    preset = "full" if args.full else "smoke" if args.smoke else "quick"
    P = PRESETS[preset]
    os.makedirs(args.out, exist_ok=True)
    from bench import agent_trace as A

    if args.from_json:
        with open(args.from_json) as f:
            res = json.load(f)
    else:
        steps = args.steps.split(",")
        res = {"preset": preset, "machine": A.machine(), "command": "python -m bench.run --" + preset,
               "tokenizer": args.tokenizer}
        t_all = time.perf_counter()
        progress = not args.no_progress
        res["step_s"] = {}
        _t = [time.perf_counter()]

        def lap(name: str) -> None:
            now = time.perf_counter()
            res["step_s"][name] = now - _t[0]
            print(f"[{name}: {now - _t[0]:.0f} s]", file=sys.stderr, flush=True)
            _t[0] = now
        if "engines" in steps:
            res["engines"] = A.bench_engines(args.tokenizer, P.get("sizes", A.SIZES), P["calls"], P["samples"],
                                             seed=args.seed, out_dir=args.out, progress=progress,
                                             sessions_per_size=P.get("sessions_per_size", 1))
            A.print_engines(res["engines"])
            lap("engines")
        if "seams" in steps:
            res["seams"] = A.bench_engines(args.tokenizer, P.get("seam_sizes", (1_000_000, 4_000_000)),
                                           P["seam_calls"], 0, seed=args.seed + 5, engines=A.SEAM_ENGINES,
                                           out_dir=args.out, progress=progress, family="none")
            A.print_engines(res["seams"])
            lap("seams")
        if "adversarial" in steps:
            res["adversarial"] = _per_tokenizer(
                "adversarial seams", P["adv_tokenizers"], A.print_adversarial,
                lambda name: A.bench_adversarial(name, P["adv_sessions"], P["adv_calls"], seed=args.seed + 11,
                                                 progress=progress))
            lap("adversarial")
        if "outcomes" in steps:
            res["outcomes"] = A.bench_outcomes(args.tokenizer, P["mix_sessions"], seed=args.seed + 1,
                                               check_rate=P["mix_check"], out_dir=args.out, progress=progress)
            A.print_outcomes(res["outcomes"])
            if P["heavy_sessions"]:
                res["outcomes_heavy"] = A.bench_outcomes(args.tokenizer, P["heavy_sessions"], seed=args.seed + 2,
                                                         check_rate=P["mix_check"], heavy=True, out_dir=args.out,
                                                         progress=progress)
                A.print_outcomes(res["outcomes_heavy"])
            if P["camp_sessions"]:
                res["outcomes_campaign"] = A.bench_outcomes(args.tokenizer, P["camp_sessions"], seed=args.seed + 3,
                                                            check_rate=0.01, out_dir=args.out, progress=progress,
                                                            small_contexts=True)
                A.print_outcomes(res["outcomes_campaign"])
            lap("outcomes")
        if "chats" in steps:
            from bench import real_chats
            from toktier.errors import TokenizerDataMissing

            res["chats"] = _per_tokenizer(
                "real chats", P["chat_tokenizers"], real_chats.print_replay,
                lambda name: real_chats.replay(name, P["chat_conversations"], seed=args.seed, progress=progress),
                skip=(real_chats.DatasetMissing, TokenizerDataMissing))
            lap("chats")
        if "memory" in steps:
            res["memory"] = A.bench_memory(args.tokenizer)
            A.print_memory(res["memory"])
            lap("memory")
        if "load" in steps:
            from bench import load_test

            res["load"] = load_test.run(args.tokenizer, P.get("mixtures", ("agent", "short")),
                                        duration=P["load_duration"], drain=P["load_drain"], out_dir=args.out, seed=args.seed,
                                        min_calls=P.get("load_min_calls", 12))
            load_test.print_results(res["load"])
            lap("load")
        res["elapsed_s"] = time.perf_counter() - t_all
        res["machine"]["loadavg_end"] = os.getloadavg()
    for key in ("engines", "seams"):
        for r in (res.get(key) or {}).get("records", []):
            r.pop("sid", None)
    res["goals"] = goals(res)
    print_goals(res["goals"])
    made = figures(res, args.figures)
    print("\nfigures: " + ", ".join(os.path.relpath(p, ROOT) for p in made))
    if not args.from_json:
        path = os.path.join(args.out, "results.json")
        with open(path, "w") as f:
            json.dump(_jsonable(res), f)
        print(f"results: {path}; traces: {args.out}/*.jsonl")
    md = markdown(res)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(md)
    if args.write_results:
        write_results_section(md)
        print(f"wrote the '{SECTION}' section of {os.path.relpath(RESULTS_MD, ROOT)}")
    print(f"elapsed {res.get('elapsed_s', 0) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
