"""GPU full path: single-request latency and bulk throughput, against the CPU paths (needs a GPU).

    python bench/gpu_bench.py [--tokenizers cl100k_base,o200k_base,llama3] [--sizes 1000,100000,1000000,4000000]

Per tokenizer and size: median wall time of one ``GpuDriver.encode`` (UTF-8
encode, literal scan, uploads, one graph launch, two syncs, ids + spans back),
the reference single encode and the parallel CPU path (``fullpath.encode_full``,
best of 3 after a warm-up call) from the same run, and the GPU's exactness on
that text.  Bulk: back-to-back 4M-character requests, UTF-8 GB/s.  Targets from
the paper's GPU: >= 3.8 GB/s bulk, <= 1 ms per 1M-character request.  Writes
``$OUT/gpu_bench.json`` when $OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import toktier  # noqa: E402
from toktier.tools.corpus import large_text  # noqa: E402
from toktier.fullpath import encode_full  # noqa: E402
from toktier.gpu import driver as gpu_driver  # noqa: E402


def _time(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def driver_for(emulate: bool):
    """The GPU driver (or, with `emulate`, the CPU emulator of tests/gpu_emu.py), announced; None
    (and why, printed) when there is no GPU backend."""
    if emulate:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from gpu_emu import emulated_driver

        drv = emulated_driver()
    else:
        drv = gpu_driver.available_driver()
    if drv is None:
        print(f"no GPU driver: {gpu_driver.unavailable_reason()}")
        return None
    print(f"backend={drv.backend.name} cubin={drv.cubin}")
    return drv


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizers", default="cl100k_base,o200k_base,llama3,deepseek_v4")
    ap.add_argument("--sizes", default="1000,100000,1000000,4000000")
    ap.add_argument("--kind", default="mixed")
    ap.add_argument("--bulk-requests", type=int, default=8)
    ap.add_argument("--emulate", action="store_true", help="smoke-test on the CPU emulator (tests/gpu_emu.py)")
    args = ap.parse_args()
    drv = driver_for(args.emulate)
    if drv is None:
        return 2
    sizes = [int(s) for s in args.sizes.split(",")]
    results = []
    hdr = f"{'tokenizer':<12} {'chars':>9} {'MB':>6} {'gpu ms':>9} {'p90 ms':>8} {'ref ms':>9} {'cpu-par ms':>10} " \
          f"{'x ref':>7} {'exact':>5}"
    print(hdr)
    for name in args.tokenizers.split(","):
        tok = toktier.load_tokenizer(name)
        for n in sizes:
            text = large_text(n, seed=1, kind=args.kind)
            mb = len(text.encode("utf-8")) / 1e6
            ids, spans = drv.encode(tok, text)  # warm: tables, bucket, graph capture
            ref_t = _time(lambda: tok.encode(text), 1 if n >= 1_000_000 else 3)
            ref = tok.encode(text)
            exact = bool(np.array_equal(ids, ref))
            reps = 5 if n >= 1_000_000 else 20
            g = _time(lambda: drv.encode(tok, text), reps)
            encode_full(tok, text)  # warm: the engine's helper threads, its caches, the pages
            par = _time(lambda: encode_full(tok, text), 3)
            row = dict(tokenizer=name, chars=n, mbytes=mb, gpu_ms=1e3 * statistics.median(g),
                       gpu_p90_ms=1e3 * sorted(g)[int(0.9 * (len(g) - 1))], ref_ms=1e3 * min(ref_t),
                       cpu_parallel_ms=1e3 * min(par), exact=exact)
            results.append(row)
            print(f"{name:<12} {n:>9,} {mb:>6.2f} {row['gpu_ms']:>9.2f} {row['gpu_p90_ms']:>8.2f} "
                  f"{row['ref_ms']:>9.1f} {row['cpu_parallel_ms']:>10.1f} {row['ref_ms'] / row['gpu_ms']:>7.1f} "
                  f"{'yes' if exact else 'NO':>5}", flush=True)
        # bulk throughput: back-to-back requests of the largest size
        text = large_text(max(sizes), seed=2, kind=args.kind)
        nbytes = len(text.encode("utf-8"))
        drv.encode(tok, text)
        t = time.perf_counter()
        for _ in range(args.bulk_requests):
            drv.encode(tok, text)
        dt = time.perf_counter() - t
        gbs = nbytes * args.bulk_requests / dt / 1e9
        results.append(dict(tokenizer=name, bulk_gb_per_s=gbs, request_bytes=nbytes, requests=args.bulk_requests))
        print(f"{name:<12} bulk {args.bulk_requests} x {nbytes / 1e6:.1f} MB: {gbs:.3f} GB/s "
              f"(target 3.8); graphs={'on' if drv.graph_error is None else 'off: ' + drv.graph_error}; "
              f"cpu fallbacks={drv.fallbacks}", flush=True)
    out = os.environ.get("OUT")
    if out:
        Path(out, "gpu_bench.json").write_text(json.dumps(results, indent=1))
    return 0 if all(r.get("exact", True) for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
