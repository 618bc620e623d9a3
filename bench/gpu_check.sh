#!/usr/bin/env bash
# One GPU session's check of the GPU full path: install, build, exactness suite, latency, GB/s.
# About 5 minutes on an H200 with CuPy, up to 8 with the pycuda build (each step has a timeout).  Prepare the carried folder first (bench/gpu_prepare.sh), then on
# the GPU machine, from the repo root:
#
#     bash bench/gpu_check.sh [.gpucarry]
#
# Steps (each bounded by `timeout`, so one slow step cannot eat the session):
#   1. install the carried wheels into /tmp/site (no index, no network);
#   2. build pycuda from its sdist if carried (<= 4 min; TOKTIER_SKIP_PYCUDA=1 skips it; without
#      pycuda the image's CuPy drives the same kernels, cubin and launch sequence);
#   3. nvcc -cubin cuda_src/toktier.cu for this GPU's architecture, then a driver smoke test
#      (builds a GpuDriver, encodes two texts, prints any exception whole);
#   4. tests/test_gpu_device.py (-m gpu): IDs and spans == the reference for every family,
#      on real multilingual text (1M characters too), literals, adversarial text;
#   5. bench/gpu_bench.py: single-request latency at 1K, 100K, 1M, 4M characters and bulk GB/s;
#   6. bench/gpu_profile.py (only when GPU_CHECK_STEPS names "profile"): time per stage and kernel;
#   7. bench/gpu_session_start.py (only when GPU_CHECK_STEPS names "starts"): session starts, the GPU
#      path vs TokTier's CPU path on all cores vs fastokens and gigatoken (carried wheels).
# GPU_CHECK_STEPS (default "tests bench") picks steps 4-7.
# Results also land in $OUT (log, gpu_bench.json) when $OUT is set.
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
C=${1:-.gpucarry}
OUTDIR=${OUT:-/tmp/gpu_check_out}
mkdir -p "$OUTDIR" /tmp/site
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
step() { echo; echo "== [$(( $(date +%s) - T0 ))s] $*"; }

step "machine"
nvidia-smi -L || true
nvcc --version | tail -1 || true
$PY --version

step "wheels"
if compgen -G "$C/wheels/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$C"/wheels/*.whl \
    || echo "wheel install failed"
fi
export PYTHONPATH=/tmp/site:$PWD/$C/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
[[ -d "$C/data" ]] && export TOKTIER_DATA_DIR=$PWD/$C/data
export TOKTIER_CACHE_DIR=/tmp/toktier-cache

step "pycuda"
if [[ -n "${TOKTIER_SKIP_PYCUDA:-}" ]]; then
  echo "TOKTIER_SKIP_PYCUDA set: using CuPy"
elif $PY -c "import pycuda.driver" 2>/dev/null; then
  echo "pycuda present"
elif compgen -G "$C/sdist/pycuda-*.tar.gz" >/dev/null; then
  timeout 240 $PY -m pip install -q --no-index --no-build-isolation --no-deps --target /tmp/site "$C"/sdist/pycuda-*.tar.gz \
    && echo "pycuda built" || echo "pycuda build failed: using CuPy"
else
  echo "no pycuda sdist carried: using CuPy"
fi
if ! $PY -c "from toktier.gpu import driver as d; n, why = d._probe(); print('backend probe:', n, why); raise SystemExit(n is None)"; then
  echo "no GPU backend (pycuda or CuPy with a device): nothing to check"; exit 3
fi

step "cubin"
export TOKTIER_CUBIN=$($PY - <<'PY'
from toktier.gpu import driver as d
name, why = d._probe()
if name == "cupy":
    import cupy
    arch = "sm_" + cupy.cuda.Device().compute_capability
else:
    import pycuda.driver as cuda
    cuda.init()
    mj, mn = cuda.Device(0).compute_capability()
    arch = f"sm_{mj}{mn}"
print(d.build_cubin(arch))
PY
)
echo "TOKTIER_CUBIN=$TOKTIER_CUBIN"
[[ -n "$TOKTIER_CUBIN" ]] || { echo "cubin build failed"; exit 4; }

step "driver smoke (a failure here is printed whole; available_driver() would hide it as a skip)"
timeout 120 $PY - <<'PY' 2>&1 | tee "$OUTDIR/gpu_smoke.log"
import time, traceback
import numpy as np
import toktier
from toktier.gpu import driver as d
try:
    t = time.perf_counter()
    drv = d.GpuDriver()
    print(f"driver up ({drv.backend.name}) in {time.perf_counter() - t:.2f} s")
    tok = toktier.load_tokenizer("cl100k_base")
    for text in ("Hello, world! It's 12,345.", d.SELF_CHECK * 40):
        t = time.perf_counter(); ids, spans = drv.encode(tok, text); dt = time.perf_counter() - t
        ref = tok.encode(text)
        print(f"{len(text)} chars: {len(ids)} ids, equal={np.array_equal(ids, ref)}, {dt * 1e3:.1f} ms (first call)")
    print("graph_error:", drv.graph_error)
except Exception:
    traceback.print_exc()
PY

STEPS=${GPU_CHECK_STEPS:-tests bench}
TEST_RC=0; BENCH_RC=0; PROF_RC=0; START_RC=0
if [[ " $STEPS " == *" tests "* ]]; then
step "exactness suite (tests/test_gpu_device.py)"
timeout 240 $PY -m pytest tests/test_gpu_device.py -m gpu -q -rfE --maxfail=25 --durations=8 -p no:cacheprovider 2>&1 | tee "$OUTDIR/gpu_tests.log"
TEST_RC=${PIPESTATUS[0]}
fi
if [[ " $STEPS " == *" bench "* ]]; then
step "latency and throughput (bench/gpu_bench.py)"
OUT=$OUTDIR timeout 150 $PY bench/gpu_bench.py 2>&1 | tee "$OUTDIR/gpu_bench.log"
BENCH_RC=${PIPESTATUS[0]}
fi
if [[ " $STEPS " == *" profile "* ]]; then
step "stage and kernel profile (bench/gpu_profile.py)"
OUT=$OUTDIR timeout 150 $PY bench/gpu_profile.py 2>&1 | tee "$OUTDIR/gpu_profile.log"
PROF_RC=${PIPESTATUS[0]}
fi

if [[ " $STEPS " == *" starts "* ]]; then
step "session starts: GPU vs CPU path vs peers (bench/gpu_session_start.py)"
$PY -c "import toktier.native._engine" 2>/dev/null && echo "native engine: built for this Python" \
  || echo "native engine: not built for this Python (carry toktier/native/_engine.cpython-312-*.so)"
OUT=$OUTDIR timeout 240 $PY bench/gpu_session_start.py 2>&1 | tee "$OUTDIR/gpu_session_start.log"
START_RC=${PIPESTATUS[0]}
fi

step "done: tests rc=$TEST_RC bench rc=$BENCH_RC profile rc=$PROF_RC starts rc=$START_RC"
[[ $TEST_RC -eq 0 && $BENCH_RC -eq 0 && $PROF_RC -eq 0 && $START_RC -eq 0 ]]
