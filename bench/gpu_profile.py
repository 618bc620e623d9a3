"""Where one GPU full-path request spends its time, stage by stage and kernel by kernel (needs a GPU).

    python bench/gpu_profile.py [--tokenizers cl100k_base,o200k_base,llama3,deepseek_v4] [--sizes 1000000,4000000]

Per tokenizer and size, medians over a few requests of ``large_text(n, seed=1)``:

* ``utf8``: ``str.encode``; ``literals``: the host literal scan; ``stage``: the copy into
  page-locked memory; ``request``: one whole ``GpuDriver.encode``;
* ``graph``: one replay of the captured graph plus a stream sync, with that request's
  bytes already on the device and its meta header uploaded again (kernel time, one launch);
* ``d2h``: copying the ids and spans back, plus the host ``copy``/``astype``;
* kernels: the same launch list run directly, one stream sync after each launch, summed by
  kernel name (each includes a launch and a sync, ~10 us, so only the large ones matter).

The driver's internals are used on purpose: this is a diagnostic, not an API.  Writes
``$OUT/gpu_profile.json`` when $OUT is set.  ``--emulate`` smoke-tests it on the CPU emulator.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import toktier  # noqa: E402
from bench.gpu_bench import driver_for  # noqa: E402
from toktier.gpu import driver as gpu_driver  # noqa: E402
from toktier.tools.corpus import large_text  # noqa: E402


def _median_ms(fn, reps: int) -> float:
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return 1e3 * statistics.median(out)


def profile_one(drv, tok, text: str, reps: int) -> dict:
    be = drv.backend
    raw = text.encode("utf-8")
    row: dict = {"chars": len(text), "mbytes": len(raw) / 1e6}
    row["utf8_ms"] = _median_ms(lambda: text.encode("utf-8"), reps)
    drv.encode(tok, text)  # warm: tables, bucket, graph
    tk = drv._tok(tok)
    n_lits = 0
    if tk.literal_re is not None:
        n_lits = len(list(tk.literal_re.find(raw)))
        row["literals_ms"] = _median_ms(lambda: list(tk.literal_re.find(raw)), reps)
    row["literal_spans"] = n_lits
    bk = drv._bucket(max(len(raw), 2 * n_lits))
    row["bucket_bytes"] = bk.cap
    row["stage_ms"] = _median_ms(lambda: bk.host_buf.__setitem__(slice(0, len(raw)), np.frombuffer(raw, np.uint8)), reps)
    row["request_ms"] = _median_ms(lambda: drv.encode(tok, text), reps)
    ids, _ = drv.encode(tok, text)  # leaves this request's bytes and meta on the device
    row["tokens"] = len(ids)
    # The request uploads a fresh meta header (byte and literal counts, zeroed counters);
    # the kernels' atomic list counters live there, so every replay needs it again.
    meta0 = np.zeros_like(bk.host_meta)
    meta0[gpu_driver.META["NBYTES"]] = len(raw)
    meta0[gpu_driver.META["NLITS"]] = n_lits

    def reset():
        bk.host_meta[:] = meta0
        be.htod(bk.arrays["meta"], bk.host_meta)

    be.enter()
    try:
        ge = drv._graph(bk, tok.hash, tk)
        if ge is not None:
            def replay():
                reset()
                ge()
                be.sync()
            row["graph_ms"] = _median_ms(replay, reps)
        nt = len(ids)

        def d2h():
            be.dtoh(bk.host_ids[:nt], bk.arrays["ids"])
            be.dtoh(bk.host_spans[:nt], bk.arrays["spans"])
            be.sync()
        row["d2h_copy_ms"] = _median_ms(d2h, reps)
        row["d2h_host_ms"] = _median_ms(lambda: (bk.host_ids[:nt].copy(), bk.host_spans[:nt].astype(np.int64)), reps)
        row["d2h_ms"] = row["d2h_copy_ms"] + row["d2h_host_ms"]
        per = defaultdict(float)
        launches = drv._launches(bk, tk)
        for _ in range(reps):
            reset()
            for name, grid, block, args in launches:
                t = time.perf_counter()
                drv._fn(name)(int(grid), int(block), args)
                be.sync()
                per[name] += time.perf_counter() - t
        row["kernels_ms"] = {k: round(1e3 * v / reps, 3) for k, v in sorted(per.items(), key=lambda kv: -kv[1])}
        row["launches"] = len(launches)
    finally:
        be.leave()
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizers", default="cl100k_base,o200k_base,llama3,deepseek_v4")
    ap.add_argument("--sizes", default="1000000,4000000")
    ap.add_argument("--kind", default="mixed")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--emulate", action="store_true", help="smoke-test on the CPU emulator (tests/gpu_emu.py)")
    args = ap.parse_args()
    drv = driver_for(args.emulate)
    if drv is None:
        return 2
    rows = []
    for name in args.tokenizers.split(","):
        tok = toktier.load_tokenizer(name)
        for n in (int(s) for s in args.sizes.split(",")):
            for seed in (1, 2):
                row = {"tokenizer": name, "seed": seed, **profile_one(drv, tok, large_text(n, seed=seed, kind=args.kind), args.reps)}
                rows.append(row)
                top = ", ".join(f"{k} {v:.2f}" for k, v in list(row["kernels_ms"].items())[:6])
                print(f"{name:<12} {n:>9,} seed={seed} {row['mbytes']:.2f} MB lits={row['literal_spans']} "
                      f"request {row['request_ms']:.2f} ms = utf8 {row['utf8_ms']:.2f} + lits {row.get('literals_ms', 0):.2f} "
                      f"+ stage {row['stage_ms']:.2f} + graph {row.get('graph_ms', float('nan')):.2f} "
                      f"+ d2h {row['d2h_copy_ms']:.2f} copy + {row['d2h_host_ms']:.2f} host; kernels (sync each, {row['launches']} launches, "
                      f"sum {sum(row['kernels_ms'].values()):.2f}): {top}", flush=True)
    out = os.environ.get("OUT")
    if out:
        Path(out, "gpu_profile.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
