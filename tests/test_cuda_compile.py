"""The CUDA kernels compile cleanly (no GPU needed): nvcc -cubin for sm_90 and sm_80.

Warnings are errors: ``--Werror all-warnings`` (nvcc front end), ``-Xptxas -Werror``
(ptxas) and ``-Xcompiler -Wall,-Wextra`` for the host side.  Register spills are not
warnings here (``-warn-spills`` is off): the warp and block BPE kernels may spill a
few bytes on sm_80, which costs speed, not correctness.

Also checks that every kernel the driver launches exists in the cubin, and that the
driver's struct packing matches the header's static_asserts.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from toktier import charclass
from toktier.families import GpuRules
from toktier.gpu import cuda_graph, driver

NVCC = shutil.which("nvcc") or next((str(p) for p in sorted(Path("/usr/local").glob("cuda*/bin/nvcc"))), None)
SRC = driver.cuda_src_dir() / driver.MAIN_SOURCE
FLAGS = ["--Werror", "all-warnings", "-Xptxas", "-Werror", "-Xcompiler", "-Wall,-Wextra", "-O3", "--std=c++17"]

needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found")


@pytest.fixture(scope="module", params=["sm_90", "sm_80"])
def cubin(request, tmp_path_factory) -> bytes:
    if NVCC is None:
        pytest.skip("nvcc not found")
    out = tmp_path_factory.mktemp("cubin") / f"toktier_{request.param}.cubin"
    proc = subprocess.run([NVCC, f"-arch={request.param}", "-cubin", "-o", str(out), str(SRC), *FLAGS],
                          capture_output=True, text=True, cwd=str(driver.cuda_src_dir()), timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "warning" not in (proc.stdout + proc.stderr).lower(), proc.stdout + proc.stderr
    return out.read_bytes()


def _kernel_names(cubin: bytes) -> set[str]:
    return {m.decode() for m in re.findall(rb"\.text\.([A-Za-z0-9_]+)\x00", cubin)}


class _FakeBucket:
    cap = 1 << 16
    cap_lits = (1 << 15) + 1
    struct = 1
    arrays = {k: 1 for k in ["meta", "aggs", "cidx", *[f"S{i}" for i in range(driver.NSCRATCH)]]}


@needs_nvcc
@pytest.mark.parametrize("rules", list(GpuRules), ids=str)
def test_driver_launches_only_existing_kernels(cubin, rules):
    tk = driver._Tok(rules=rules, arrays={}, struct=1, literal_re=None, literal_ids={})
    launches = driver.GpuDriver._launches(None, _FakeBucket(), tk)  # type: ignore[arg-type]
    names = {name for name, *_ in launches}
    missing = names - _kernel_names(cubin)
    assert not missing, f"driver launches kernels the cubin lacks: {sorted(missing)}"


def test_struct_layout_matches_header():
    hdr = (driver.cuda_src_dir() / "tt_common.cuh").read_text()
    bufs = int(re.search(r"sizeof\(TTBufs\) == (\d+) \* 8", hdr).group(1))
    tabs = int(re.search(r"sizeof\(TTTables\) == (\d+) \* 8", hdr).group(1))
    assert bufs == len(driver._BUF_FIELDS)
    assert tabs == 13
    assert f"#define TT_NSCRATCH {driver.NSCRATCH}" in hdr
    for name, slot in driver.META.items():
        assert re.search(rf"#define TT_META_{name} {slot}\b", hdr), name
    # the class-table bits the kernels read are charclass's layout
    for name in ("L", "N", "M", "W", "K", "UP", "LO", "PS"):
        assert re.search(rf"#define TT_{name} {getattr(charclass, name)}u\b", hdr), name
    assert f"#define TT_FOLD_SHIFT {charclass.FOLD_SHIFT}" in hdr
    assert "cls_table[cp] & 0xFFFFu" in (driver.cuda_src_dir() / "tt_pretok.cuh").read_text()  # NFC_INERT unseen
    assert charclass.NFC_INERT > 0xFFFF


def test_every_kernel_source_ships_in_the_wheel():
    """pyproject's data-files list (where a wheel install finds the kernels) names every source."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    root = Path(__file__).resolve().parents[1]
    with open(root / "pyproject.toml", "rb") as f:
        shipped = tomllib.load(f)["tool"]["setuptools"]["data-files"]["share/toktier/cuda_src"]
    on_disk = sorted(f"cuda_src/{p.name}" for p in (root / "cuda_src").glob("*.cu*"))
    assert sorted(shipped) == on_disk


@needs_nvcc
@pytest.mark.parametrize("symbol", sorted(cuda_graph.SIGNATURES))
def test_graph_capture_calls_match_the_toolkit_header(symbol):
    """cuda_graph.py calls libcuda by ctypes (pycuda has no graph API): each exported symbol
    is what cuda.h maps its public name to, and takes as many arguments as we pass."""
    roots = [Path(NVCC).resolve().parent.parent, Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))]
    path = next((p for p in (r / "include" / "cuda.h" for r in roots) if p.is_file()), None)
    if path is None:
        pytest.skip(f"no cuda.h under {roots}")
    header = path.read_text(errors="replace")
    public, args = cuda_graph.SIGNATURES[symbol]
    # e.g. `#define cuStreamBeginCapture __CUDA_API_PTSZ(cuStreamBeginCapture_v2)`: the plain
    # symbol is the legacy ABI; every mapping of the public name must name our symbol
    maps = re.findall(rf"#define\s+{public}\s+(.*)", header)
    assert all(re.search(rf"\b{symbol}\b", m) for m in maps), f"cuda.h maps {public} to {maps}, not {symbol}"
    assert maps or symbol == public, f"cuda.h does not map {public} to {symbol}"
    decl = re.search(rf"CUresult CUDAAPI {public}\(([^)]*)\);", header)
    assert decl, f"cuda.h declares no {public}"
    assert len(decl.group(1).split(",")) == len(args), decl.group(0)
