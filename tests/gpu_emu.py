"""A driver backend that runs the CUDA kernels on the CPU (``cuda_emu.cpp``), for tests without a GPU.

It implements the backend interface of ``toktier.gpu.driver`` with host memory:
allocations are numpy buffers, copies are memmoves, "graph capture" replays the
captured launch sequence.  Everything above the kernels (bucket allocation, struct
packing, the launch sequence of each family, literal handling, the meta header)
is the production driver's code.
"""

from __future__ import annotations

import ctypes
import hashlib
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from toktier.gpu import driver

HERE = Path(__file__).resolve().parent
EMU_SRC = HERE / "cuda_emu.cpp"


def build() -> Path | None:
    """Compile the emulator (cached by source hash); None without a C++20 compiler."""
    gxx = shutil.which("g++") or shutil.which("c++")
    if gxx is None:
        return None
    h = hashlib.sha256(EMU_SRC.read_bytes())
    for f in sorted(driver.cuda_src_dir().glob("*.cu*")):
        h.update(f.read_bytes())
    out = Path(tempfile.gettempdir()) / f"toktier_cuda_emu_{h.hexdigest()[:16]}.so"
    if not out.is_file():
        tmp = out.with_suffix(".tmp.so")
        proc = subprocess.run([gxx, "-std=c++20", "-O1", "-fPIC", "-shared", "-pthread", f"-I{driver.cuda_src_dir()}",
                               "-x", "c++", str(EMU_SRC), "-o", str(tmp)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-4000:])
        tmp.replace(out)
    return out


class _Mem:
    def __init__(self, arr: np.ndarray) -> None:
        self.arr = arr

    def __int__(self) -> int:
        return int(self.arr.ctypes.data)


class EmuBackend:
    name = "emu"

    def __init__(self, lib_path: Path) -> None:
        self.lib = ctypes.CDLL(str(lib_path))
        self.lib.emu_launch.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                        ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64]
        self.launches = 0
        self.block_pieces = 0  # pieces run by tt_bpe_block (tests check what a text reached)

    def arch(self) -> str:
        return "emu"

    def load(self, cubin: str):
        def get(name):
            addr = ctypes.cast(getattr(self.lib, name), ctypes.c_void_p).value
            threaded = int("_scan_" in name or name in ("tt_bpe_warp", "tt_bpe_block"))

            def launch(grid, block, args):
                grid = self._useful_blocks(name, grid, args)
                kinds = tuple("i" if isinstance(a, np.int32) else "p" for a in args)
                sig = {("p",): 0, ("p", "p"): 1, ("p", "i", "i"): 2, ("p", "i"): 3, ("p", "p", "p"): 4}[kinds]
                vals = [int(a) & 0xFFFFFFFFFFFFFFFF for a in args] + [0] * (3 - len(args))
                self.launches += 1
                if name == "tt_bpe_block":
                    self.block_pieces += grid
                self.lib.emu_launch(addr, sig, grid, block, threaded, *vals)

            return launch

        return get

    @staticmethod
    def _useful_blocks(name: str, grid: int, args) -> int:
        """Skip blocks that exit at once on a GPU (beyond the device-side count): same result, less time."""
        if name.endswith(("_tiles", "_apply")) and "_scan_" in name:
            n = ctypes.c_int.from_address(int(args[1])).value
            return max(1, min(grid, -(-n // driver.SCAN_TILE)))
        if name in ("tt_bpe_warp", "tt_bpe_block"):
            meta = ctypes.c_uint64.from_address(int(args[0]) + 8).value  # TTBufs.meta
            cnt = ctypes.c_int.from_address(meta + 4 * driver.META["NWARP" if name == "tt_bpe_warp" else "NBLOCK"]).value
            per = 8 if name == "tt_bpe_warp" else 1
            return max(0, min(grid, -(-cnt // per)))
        return grid

    def alloc(self, nbytes: int):
        return _Mem(np.zeros(max(nbytes, 8), dtype=np.uint8))

    def to_device(self, arr: np.ndarray):
        return _Mem(np.ascontiguousarray(arr).copy())

    def pinned(self, n: int, dtype) -> np.ndarray:
        return np.zeros(n, dtype=dtype)

    def htod(self, dst, src: np.ndarray) -> None:
        ctypes.memmove(int(dst), src.ctypes.data, src.nbytes)

    def dtoh(self, dst: np.ndarray, src) -> None:
        ctypes.memmove(dst.ctypes.data, int(src), dst.nbytes)

    def sync(self) -> None:
        pass

    def capture(self, run):
        return run  # replaying the captured sequence == running it again

    def enter(self) -> None:
        pass

    def leave(self) -> None:
        pass


def emulated_driver() -> driver.GpuDriver | None:
    lib = build()
    if lib is None:
        return None
    return driver.GpuDriver(cubin="emulated", backend=EmuBackend(lib))
