"""Open-loop load test of the sidecar: stateful sessions vs. the same sidecar used statelessly.

One sidecar process (``python -m toktier_sidecar.cli``, started the systemd way) serves both modes, on the
same cores, one after the other:

* ``stateful``: each agent session is a sidecar session; a call sends only its change
  (``AsyncSession.append`` / ``edit``; compactions ``sync`` the new full text; session starts
  ``open`` with the whole context).
* ``stateless``: the same calls, each sent as the session's whole new text (``AsyncClient.encode``),
  which the sidecar re-tokenizes in full, as a stateless front end does.

The load generator runs in its own process (``python -m bench.load_test --worker``), with uvloop
and several connections.  Arrivals are Poisson at the offered rate (open loop: a call's latency is
measured from its scheduled arrival, so a slow server cannot slow the offered load down); each
arrival takes the next call of an idle agent session.  The sessions and their calls come from the
calibrated mixture trace (:mod:`bench.traces`); a session whose calls run out is closed and a new
one starts (a full-context call).  Per level it reports P50/P99 per op type, completions, errors,
its own CPU use (so it is visibly not the bottleneck), the sidecar's CPU use and the slowest
appends (size and latency: what sets the P99).  A first level of ``warmup_s`` seconds at the start
rate is run and discarded (fresh sessions, cold caches).  A level stops issuing calls once enough of
them missed the SLO that its P99 is over it whatever the rest would do.  The ladder of
rates grows x1.5 until two levels in a row miss P99 < 50 ms on appends, the append P50 itself
passes 50 ms, or calls are still unanswered after the drain time (saturation).  Capacity = the highest
offered rate below the first level that misses (append P99 >= 50 ms, an error, or a call unanswered).

    python -m bench.load_test --quick
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLO_MS = 50.0
MAX_SCRIPT_CALLS = 80  # calls kept per scripted session (then it ends and a new one starts)


@dataclasses.dataclass(frozen=True)
class Mixture:
    """Which sessions the load uses: the calibrated trace, optionally with contexts clipped."""

    name: str
    sessions: int
    start_median: float
    start_p90: float
    max_context: int
    stateful_start: float  # first offered rate (calls/s) of each mode's ladder
    stateless_start: float
    seed: int = 7


MIXTURES = {
    # the calibrated agent mixture, contexts capped at 1M chars to keep setup short
    # (stateless starts low: one full re-tokenization of its larger contexts outlasts the SLO)
    "agent": Mixture("agent", 24, 350_000, 2_000_000, 1_000_000, stateful_start=10.0, stateless_start=0.5),
    # shorter contexts (median 30K chars), where a stateless front end can meet the SLO at all
    "short": Mixture("short", 24, 30_000, 80_000, 150_000, stateful_start=10.0, stateless_start=2.0),
}


# ---------------------------------------------------------------------------------------------
# worker (the load generator process)
# ---------------------------------------------------------------------------------------------


def _session_scripts(mix: Mixture, tok_family: str):
    """Per session: the start text and its later calls (op, delta, start, end, full text length)."""
    from bench import traces as T

    cfg = dataclasses.replace(T.TraceConfig(), start_median=mix.start_median, start_p90=mix.start_p90,
                              max_context=mix.max_context, min_context=min(10_000, mix.start_median // 2))
    header, calls = T.generate_mixture(mix.sessions + 8, mix.seed, cfg, family=tok_family)
    by_sid: dict[str, list[dict]] = {}
    for c in calls:
        by_sid.setdefault(c["sid"], []).append(c)
    scripts = []
    for sid, cs in by_sid.items():
        cs.sort(key=lambda c: c["call"])
        cs = cs[:MAX_SCRIPT_CALLS]
        ops = []
        for call in T.replay(header, cs):
            if call.op == "start":
                ops.append(("start", call.text, 0, 0))
            elif call.op == "append":
                ops.append(("append", call.delta, 0, 0))
            elif call.op == "edit":
                ops.append(("edit", call.delta, call.start, call.end))
            else:
                ops.append(("compact", call.text, 0, 0))
        scripts.append(ops)
    return scripts


class _Agent:
    __slots__ = ("idx", "ops", "pos", "text", "session", "lock", "client", "gen")

    def __init__(self, idx: int) -> None:
        self.idx, self.ops, self.pos, self.text = idx, [], 0, ""
        self.session = None
        self.lock = asyncio.Lock()  # an agent's calls are sequential
        self.client = None
        self.gen = 0


async def _worker(args) -> dict:
    import uvloop  # noqa: F401  (the loop is installed by the caller)

    from toktier_client import AsyncClient

    mix = MIXTURES[args.mixture]
    if args.scripts:
        with open(args.scripts) as f:
            scripts = [[tuple(op) for op in ops] for ops in json.load(f)]
    else:
        scripts = _session_scripts(mix, args.family)
    rng = random.Random(args.seed)
    clients = [await AsyncClient(args.socket, client_name=f"loadgen-{i}").connect() for i in range(args.connections)]
    pool = list(scripts)
    agents = [_Agent(i) for i in range(mix.sessions)]
    next_script = 0

    def assign(agent: _Agent) -> None:
        nonlocal next_script
        agent.ops = pool[next_script % len(pool)]
        next_script += 1
        agent.pos = 0
        agent.gen += 1

    async def run_op(agent: _Agent) -> tuple[str, int]:
        """Perform the agent's next call; returns its op type and the characters it carried."""
        if agent.pos >= len(agent.ops):
            if agent.session is not None:
                await agent.session.close()
                agent.session = None
            assign(agent)
        op, payload, a, b = agent.ops[agent.pos]
        agent.pos += 1
        c = agent.client
        if args.mode == "stateful":
            if op == "start":
                agent.session = await c.session(f"lt-{agent.idx}-{agent.gen}-{secrets.token_hex(2)}", text=payload)
            elif op == "append":
                await agent.session.append(payload)
            elif op == "edit":
                await agent.session.edit(a, b, payload)
            else:
                await agent.session.sync(payload)
        else:
            if op == "start" or op == "compact":
                agent.text = payload
            elif op == "append":
                agent.text = agent.text + payload
            else:
                agent.text = agent.text[:a] + payload + agent.text[b:]
            r = await c.encode(agent.text)
            del r
        return op, len(payload)

    # set-up: every agent starts a session (untimed)
    t0 = time.perf_counter()
    for ag in agents:
        ag.client = clients[ag.idx % len(clients)]
        assign(ag)
        await run_op(ag)
    setup_s = time.perf_counter() - t0

    loop = asyncio.get_running_loop()
    levels = []
    warmup: dict | None = None
    warming = args.warmup_s > 0  # a first, discarded level at the start rate
    rate = args.start_rate
    misses = 0
    while rate <= args.max_rate and misses < 2:
        lat: dict[str, list[float]] = {}
        errors = 0
        done = 0
        waiting = 0
        arrivals = []
        t = 0.0
        duration = max(args.duration, args.min_calls / rate)  # enough calls for a percentile at low rates
        if warming:
            duration = args.warmup_s
        while True:
            t += rng.expovariate(rate)
            if t >= duration:
                break
            arrivals.append(t)

        lags: list[float] = []
        # Sequential test: once this many append/edit calls exceed the SLO, the level's P99 is
        # over the SLO whatever the remaining calls do (np.percentile over n <= len(arrivals)
        # values), so the level stops issuing calls: a certain miss need not run to the end.
        n_max = len(arrivals)
        certain_miss = n_max - math.floor(0.99 * (n_max - 1)) if n_max else 1
        over = 0
        slowest: list[tuple[float, str, int]] = []  # (ms, op, chars carried) of appends/edits

        async def one(sched: float) -> None:
            nonlocal errors, done, waiting, over
            lags.append((loop.time() - sched) * 1e3)  # how late the generator issued the call
            idle = [ag for ag in agents if not ag.lock.locked()]
            ag = rng.choice(idle) if idle else rng.choice(agents)
            if not idle:
                waiting += 1  # every session busy: queue behind one
            async with ag.lock:
                try:
                    op, nchars = await run_op(ag)
                    ms = (loop.time() - sched) * 1e3
                    lat.setdefault(op, []).append(ms)
                    done += 1
                    if op in ("append", "edit"):
                        slowest.append((ms, op, nchars))
                        over += ms >= SLO_MS
                except Exception as exc:  # noqa: BLE001 - counted and reported
                    errors += 1
                    if errors <= 3:
                        print(f"[loadgen] {type(exc).__name__}: {exc}", file=sys.stderr)

        cpu0 = time.process_time()
        side0 = _proc_cpu(args.sidecar_pid)
        base = loop.time() + 0.05
        tasks = []
        for a in arrivals:
            if over >= certain_miss or errors:
                break
            delay = base + a - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one(base + a)))
        sent_wall = loop.time() - base
        _, pending = await asyncio.wait(tasks, timeout=args.drain) if tasks else (set(), set())
        for p in pending:
            p.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        wall = loop.time() - base
        cpu = time.process_time() - cpu0
        side = _proc_cpu(args.sidecar_pid) - side0
        allc = [x for xs in lat.values() for x in xs]
        app = lat.get("append", []) + lat.get("edit", [])
        row = {"rate": rate, "offered": len(arrivals), "issued": len(tasks), "completed": done, "errors": errors,
               "timed_out": len(pending), "wall_s": wall, "send_wall_s": sent_wall,
               "loadgen_cpu_s": cpu, "loadgen_cores": cpu / wall if wall else 0.0,
               "loadgen_cpu_us_per_call": cpu / max(1, done) * 1e6,
               "sidecar_cpu_s": side, "sidecar_cores": side / wall if wall else 0.0,
               "achieved_rate": done / wall if wall else 0.0, "all_sessions_busy": waiting,
               "send_lag_p50_ms": float(np.percentile(lags, 50)) if lags else float("nan"),
               "send_lag_p99_ms": float(np.percentile(lags, 99)) if lags else float("nan"),
               "ops": {op: {"n": len(xs), "p50": float(np.percentile(xs, 50)), "p99": float(np.percentile(xs, 99))}
                       for op, xs in lat.items()},
               "all_p50": float(np.percentile(allc, 50)) if allc else float("nan"),
               "all_p99": float(np.percentile(allc, 99)) if allc else float("nan"),
               "append_p50": float(np.percentile(app, 50)) if app else float("nan"),
               "append_p99": float(np.percentile(app, 99)) if app else float("nan")}
        row["stopped_early"] = len(tasks) < len(arrivals)
        row["slowest_appends"] = [{"ms": round(ms, 1), "op": op, "chars": n} for ms, op, n in sorted(slowest)[-4:]]
        row["meets_slo"] = (bool(app) and row["append_p99"] < SLO_MS and not pending and not errors
                            and not row["stopped_early"])
        if warming:
            warming, warmup = False, row
            print(f"[loadgen {args.mode}/{args.mixture}] warm-up (discarded): {done} calls at {rate:.1f}/s, append "
                  f"P99 {row['append_p99']:.2f} ms, slowest {row['slowest_appends']}", file=sys.stderr, flush=True)
            continue
        levels.append(row)
        print(f"[loadgen {args.mode}/{args.mixture}] rate {rate:8.1f}/s  done {done:5d}/{len(arrivals):<5d} "
              f"{'(stopped: SLO certainly missed) ' if row['stopped_early'] else ''}"
              f"append P50 {row['append_p50']:8.2f} P99 {row['append_p99']:9.2f} ms  all P99 {row['all_p99']:9.1f} ms "
              f" loadgen {row['loadgen_cores']:.2f} cores (send lag P99 {row['send_lag_p99_ms']:.2f} ms)  sidecar "
              f"{row['sidecar_cores']:.2f} cores", file=sys.stderr,
              flush=True)
        misses = 0 if row["meets_slo"] else misses + 1
        if pending or (wall > 3 * duration) or not (row["append_p50"] <= SLO_MS) or row["stopped_early"] and \
                over > len(app) / 2:
            break  # saturated: the backlog would only grow
        rate *= args.step
    for ag in agents:
        if ag.session is not None:
            try:
                await ag.session.close()
            except Exception:  # noqa: BLE001
                pass
    for c in clients:
        await c.close()
    capacity = 0.0  # the highest rate below the first level that misses the SLO (monotone, conservative)
    for lv in levels:
        if not lv["meets_slo"]:
            break
        capacity = lv["rate"]
    ok = [lv["rate"] for lv in levels if lv["meets_slo"]]
    return {"mode": args.mode, "mixture": dataclasses.asdict(mix), "setup_s": setup_s, "warmup": warmup,
            "levels": levels,
            "capacity": capacity, "best_passing_rate": max(ok) if ok else 0.0, "lowest_rate": args.start_rate,
            "duration_s": args.duration}


def _proc_cpu(pid: int) -> float:
    """User+system CPU seconds of a process and its threads."""
    if not pid:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return 0.0


def worker_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--socket", required=True)
    ap.add_argument("--mode", choices=["stateful", "stateless"], required=True)
    ap.add_argument("--mixture", choices=list(MIXTURES), default="agent")
    ap.add_argument("--family", default="llama3")
    ap.add_argument("--start-rate", type=float, default=5.0)
    ap.add_argument("--max-rate", type=float, default=5000.0)
    ap.add_argument("--step", type=float, default=1.5)
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--drain", type=float, default=10.0)
    ap.add_argument("--min-calls", type=int, default=12, help="a level lasts long enough for this many calls")
    ap.add_argument("--warmup-s", type=float, default=0.0,
                    help="seconds of a first level at the start rate that is run and discarded")
    ap.add_argument("--connections", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sidecar-pid", type=int, default=0)
    ap.add_argument("--scripts", help="JSON file of prepared session scripts (else generated here)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    import uvloop

    res = uvloop.run(_worker(args))
    with open(args.out, "w") as f:
        json.dump(res, f)
    return 0


# ---------------------------------------------------------------------------------------------
# orchestration (this process starts the sidecar and the generator processes)
# ---------------------------------------------------------------------------------------------


def start_sidecar(sock_path: str, prefix: str, tokenizer: str) -> tuple[subprocess.Popen, socket.socket]:
    notify_path = sock_path + ".notify"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(notify_path)
    env = dict(os.environ, PYTHONPATH=ROOT, NOTIFY_SOCKET=notify_path)
    proc = subprocess.Popen(
        [sys.executable, "-m", "toktier_sidecar.cli", "--socket", sock_path, "--tokenizer", tokenizer, "--shm-prefix",
         prefix, "--log-level", "WARNING", "--max-inflight", "4096"], cwd=ROOT, env=env)
    notify.settimeout(180)
    while b"READY=1" not in notify.recv(4096):
        pass
    return proc, notify


def run(tokenizer: str = "llama3", mixtures=("agent", "short"), duration: float = 4.0, drain: float = 8.0,
        out_dir: str | None = None, seed: int = 0, min_calls: int = 12, warmup_s: float = 5.0) -> dict:
    from bench.traces import family_template

    tmp = tempfile.mkdtemp(prefix="toktier-load-")
    out_dir = out_dir or tmp
    sock_path = os.path.join(tmp, "load.sock")
    prefix = f"ttload{secrets.token_hex(3)}"
    proc, notify = start_sidecar(sock_path, prefix, tokenizer)
    results = []
    try:
        for mixture in mixtures:
            scripts_path = os.path.join(out_dir, f"load-scripts-{mixture}.json")
            with open(scripts_path, "w") as f:  # both modes replay exactly the same calls
                json.dump(_session_scripts(MIXTURES[mixture], family_template(tokenizer)), f)
            for mode in ("stateful", "stateless"):
                mix = MIXTURES[mixture]
                start = mix.stateful_start if mode == "stateful" else mix.stateless_start
                out = os.path.join(out_dir, f"load-{mixture}-{mode}.json")
                cmd = [sys.executable, "-m", "bench.load_test", "--worker", "--socket", sock_path, "--mode", mode,
                       "--mixture", mixture, "--family", family_template(tokenizer), "--start-rate", str(start),
                       "--duration", str(duration), "--drain", str(drain), "--seed", str(seed),
                       "--min-calls", str(min_calls), "--warmup-s", str(warmup_s),
                       "--sidecar-pid", str(proc.pid), "--scripts", scripts_path, "--out", out]
                t0 = time.perf_counter()
                subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), check=True)
                with open(out) as f:
                    r = json.load(f)
                r["elapsed_s"] = time.perf_counter() - t0
                results.append(r)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        notify.close()
    return {"tokenizer": tokenizer, "slo_ms": SLO_MS, "runs": results, "cpus": os.cpu_count()}


def print_results(res: dict) -> None:
    print(f"\n## Open-loop load test of the sidecar ({res['tokenizer']}, {res['cpus']} CPUs, "
          f"SLO: append P99 < {res['slo_ms']:.0f} ms)")
    print(f"{'mixture':<8} {'mode':<10} {'rate/s':>8} {'done':>6} {'append P50':>11} {'P99':>9} "
          f"{'start P50':>10} {'compact P50':>12} {'loadgen cores':>14} {'sidecar cores':>14} {'SLO':>4}")
    caps: dict[str, dict[str, float]] = {}
    for r in res["runs"]:
        mix = r["mixture"]["name"]
        caps.setdefault(mix, {})[r["mode"]] = r["capacity"]
        for lv in r["levels"]:
            ops = lv["ops"]
            print(f"{mix:<8} {r['mode']:<10} {lv['rate']:>8.1f} {lv['completed']:>6} {lv['append_p50']:>11.2f} "
                  f"{lv['append_p99']:>9.2f} {ops.get('start', {}).get('p50', float('nan')):>10.1f} "
                  f"{ops.get('compact', {}).get('p50', float('nan')):>12.1f} {lv['loadgen_cores']:>14.2f} "
                  f"{lv['sidecar_cores']:>14.2f} {'yes' if lv['meets_slo'] else 'no':>4}")
    for mix, c in caps.items():
        sf, sl = c.get("stateful", 0.0), c.get("stateless", 0.0)
        lowest = next((r["lowest_rate"] for r in res["runs"]
                       if r["mixture"]["name"] == mix and r["mode"] == "stateless"), 0)
        if sl:
            ratio = f"{sf / sl:.1f}x"
        elif sf:
            ratio = f"> {sf / lowest:.0f}x (stateless misses the SLO even at {lowest:g}/s)"
        else:
            ratio = "neither mode met the SLO at any tested level"
        best = {r["mode"]: r.get("best_passing_rate", 0.0) for r in res["runs"] if r["mixture"]["name"] == mix}
        print(f"capacity at P99 < {res['slo_ms']:.0f} ms, {mix}: stateful {sf:.1f}/s, stateless {sl:.1f}/s -> {ratio}"
              f"   (highest passing level, ignoring earlier misses: stateful {best.get('stateful', 0):.1f}/s, "
              f"stateless {best.get('stateless', 0):.1f}/s)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--worker" in argv:
        return worker_main(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tokenizer", default="llama3")
    ap.add_argument("--mixtures", default="agent,short")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    res = run(args.tokenizer, args.mixtures.split(","), duration=4.0 if args.quick else 15.0)
    print_results(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
