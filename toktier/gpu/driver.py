"""PyCUDA driver for the GPU full path (imported lazily; pycuda is optional).

``available_driver()`` returns a `GpuDriver` when pycuda (or, failing that, CuPy)
imports and a CUDA device exists, else None: ``import toktier`` and
``import toktier.gpu`` never need either.  The kernels are built once per
architecture with ``nvcc -cubin`` (cached under ``$TOKTIER_CACHE_DIR/cubin``) or
taken from ``$TOKTIER_CUBIN``; ``$TOKTIER_GPU_BACKEND`` = ``pycuda`` | ``cupy``
forces a backend.

Per tokenizer the driver uploads the tables of ``tables.py`` once (class table,
pair and vocab hash tables, token bytes) and keeps one device `TTTables` struct.
Per input-size bucket (a power of two of UTF-8 bytes, >= 4 KiB) it allocates the
buffers of one `TTBufs` struct (``cuda_src/tt_common.cuh``) and captures the whole
bytes-to-ids chain as a CUDA graph per (bucket, tokenizer) (CuPy's stream capture;
on pycuda, which wraps no graph API, the driver API through `cuda_graph.py`).  A
request is:

1. host: UTF-8 encode, find added-token literals (byte offsets, leftmost-longest);
2. async copies of the bytes, literal spans and the meta header into the bucket;
3. one graph launch (decode, classify, the family's piece-start rules with their
   scans, piece compaction, dispatch by length, BPE, output compaction);
4. **sync 1**: read the 16-int meta header (token count, status);
5. **sync 2**: copy ids and spans back.

Every count (characters, pieces, dispatch lists, tokens) lives in device memory;
kernel grids depend only on the bucket capacity.  A status bit (o200k chain
fixpoint longer than the captured rounds) sends the request to the CPU instead.
"""

from __future__ import annotations

import functools
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..families import GpuRules
from .tables import bpe_tables, class_table, rules_for


def cuda_src_dir() -> Path:
    """Where the kernel sources are: $TOKTIER_CUDA_SRC, the source tree (editable installs), or
    the copy a wheel installs under ``<prefix>/share/toktier/cuda_src``."""
    env = os.environ.get("TOKTIER_CUDA_SRC")
    if env:
        return Path(env)
    tree = Path(__file__).resolve().parents[2] / "cuda_src"
    if (tree / MAIN_SOURCE).exists():
        return tree
    import sysconfig

    return Path(sysconfig.get_path("data")) / "share" / "toktier" / "cuda_src"


MAIN_SOURCE = "toktier.cu"
THREADS = 256
SCAN_TILE = 1024
NSCRATCH = 24
META_SLOTS = 16
META = dict(NBYTES=0, NCHARS=1, NPIECES=2, NTOKENS=3, STATUS=4, NSMALL=5, NWARP=6, NBLOCK=7, CHANGED=8, NLITS=9)
MIN_BUCKET = 1 << 12
O200K_ROUNDS = 3  # chain-fixpoint rounds captured; a longer cascade sets a status bit -> CPU

# TTBufs field order (cuda_src/tt_common.cuh); every field is 8 bytes.
_PER_BYTE_I32 = ("byte_lit", "cidx", "boff", "clit", "pstart", "piece_b0", "piece_b1", "piece_lit", "pcnt",
                 "list_small", "list_warp", "list_block", "spans")
_BUF_FIELDS = (["buf", "meta", "lit_s", "lit_e", "lit_id", "byte_lit", "cidx", "cps", "boff", "clit", "cls", "pstart"]
               + [f"S{i}" for i in range(NSCRATCH)]
               + ["aggs", "piece_b0", "piece_b1", "piece_lit", "pcnt", "list_small", "list_warp", "list_block",
                  "out_tok", "scr_a", "scr_b", "scr_c", "ids", "spans", "cap_bytes", "cap_lits"])


# The driver's one-time self-check text per tokenizer (rotated copies of it): every class and rule.
SELF_CHECK = (
    "Hello, World! It's 12,345.67 -- don't STOP'LL we'VE \t tabs\r\n\r\n  and  spaces   \n"
    "def f(x):\n    return x**2  # comment\n\tif a<b>c: pass\n"
    "HTTPServer camelCase iPhone ǅemal ʰa résumé naïve e\u0301 Ω жЯ Ⅻ ½ ² ١٢٣ ０１２\n"
    "中文字符。日本語のテキスト・カタカナー、ひらがな゛ 한국어 텍스트 مرحبا بالعالم \u064e\u0651\n"
    "😀 👨\u200d👩\u200d👧 🇺🇸 👍🏽 \ufe0f ... !!! ??? «quote» — … €100 © a/b//c\n/x .\n/.. "
    "\u3000\u00a0\x0b\x0c\x85\u2028 1234567890123 x" + "a" * 300 + " " + "=" * 150 + "\n"
    "<|endoftext|><|im_start|>user\n<think>x</think><|eot_id|><｜User｜><｜Assistant｜>\n"
)


class GpuUnavailable(RuntimeError):
    pass


class _PyCudaBackend:
    name = "pycuda"

    def __init__(self, device: int) -> None:
        import pycuda.driver as cuda

        cuda.init()
        self.cuda = cuda
        self.ctx = cuda.Device(device).retain_primary_context()
        self.ctx.push()
        self.stream = cuda.Stream()

    def arch(self) -> str:
        major, minor = self.cuda.Context.get_device().compute_capability()
        return f"sm_{major}{minor}"

    def load(self, cubin: str):
        mod = self.cuda.module_from_file(cubin)

        def get(name):
            fn = mod.get_function(name)
            return lambda grid, block, args: fn(*args, block=(block, 1, 1), grid=(grid, 1), stream=self.stream)

        return get

    def alloc(self, nbytes: int):
        return self.cuda.mem_alloc(max(nbytes, 8))

    def to_device(self, arr: np.ndarray):
        return self.cuda.to_device(np.ascontiguousarray(arr))

    def pinned(self, n: int, dtype) -> np.ndarray:
        return self.cuda.pagelocked_zeros(n, dtype=dtype)

    def htod(self, dst, src: np.ndarray) -> None:
        self.cuda.memcpy_htod_async(int(dst), src, self.stream)

    def dtoh(self, dst: np.ndarray, src) -> None:
        self.cuda.memcpy_dtoh_async(dst, int(src), self.stream)

    def sync(self) -> None:
        self.stream.synchronize()

    def capture(self, run):
        from .cuda_graph import capture  # pycuda has no graph API: the driver API by ctypes

        handle = self.stream.handle
        ge = capture(handle, run)
        ge.upload(handle)
        return lambda: ge.launch(handle)

    def enter(self) -> None:
        self.ctx.push()

    def leave(self) -> None:
        self.cuda.Context.pop()


class _CupyBackend:
    name = "cupy"

    def __init__(self, device: int) -> None:
        import cupy

        self.cp = cupy
        cupy.cuda.Device(device).use()
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self._keep: list = []

    def arch(self) -> str:
        cc = self.cp.cuda.Device().compute_capability
        return f"sm_{cc}"

    def load(self, cubin: str):
        mod = self.cp.RawModule(path=cubin)
        cache: dict = {}

        def get(name):
            fn = cache.get(name)
            if fn is None:
                fn = cache[name] = mod.get_function(name)
            def launch(grid, block, args):
                with self.stream:  # RawKernel launches on the current stream
                    fn((grid,), (block,), args)

            return launch

        return get

    def alloc(self, nbytes: int):
        return _Ptr(self.cp.cuda.alloc(max(nbytes, 8)))

    def to_device(self, arr: np.ndarray):
        a = self.cp.asarray(np.ascontiguousarray(arr))
        return _Ptr(a.data, a)

    def pinned(self, n: int, dtype) -> np.ndarray:
        mem = self.cp.cuda.alloc_pinned_memory(max(1, n * np.dtype(dtype).itemsize))
        self._keep.append(mem)
        return np.frombuffer(mem, dtype=dtype, count=n)

    def htod(self, dst, src: np.ndarray) -> None:
        rt = self.cp.cuda.runtime
        rt.memcpyAsync(int(dst), src.ctypes.data, src.nbytes, rt.memcpyHostToDevice, self.stream.ptr)

    def dtoh(self, dst: np.ndarray, src) -> None:
        rt = self.cp.cuda.runtime
        rt.memcpyAsync(dst.ctypes.data, int(src), dst.nbytes, rt.memcpyDeviceToHost, self.stream.ptr)

    def sync(self) -> None:
        self.stream.synchronize()

    def capture(self, run):
        self.stream.begin_capture()
        try:
            run()
        finally:
            graph = self.stream.end_capture()
        return lambda: graph.launch(self.stream)

    def enter(self) -> None:
        pass

    def leave(self) -> None:
        pass


class _Ptr:
    """A device allocation that converts to its address (keeps the owner alive)."""

    def __init__(self, mem, owner=None) -> None:
        self.mem, self.owner = mem, owner

    def __int__(self) -> int:
        return int(self.mem.ptr)


@functools.lru_cache(maxsize=1)
def _probe() -> tuple[str | None, str]:
    """(backend name, reason): pycuda first, then CuPy; None when neither has a device."""
    want = os.environ.get("TOKTIER_GPU_BACKEND", "")
    reasons = []
    for name in ("pycuda", "cupy"):
        if want and name != want:
            continue
        try:
            if name == "pycuda":
                import pycuda.driver as cuda

                cuda.init()
                count = cuda.Device.count()
            else:
                import cupy

                count = cupy.cuda.runtime.getDeviceCount()
            if count >= 1:
                return name, "ok"
            reasons.append(f"{name}: no CUDA device")
        except Exception as exc:  # ImportError, or a broken CUDA install / no driver
            reasons.append(f"{name}: {type(exc).__name__}: {exc}")
    return None, "; ".join(reasons) or "no backend"


def build_cubin(arch: str, out_dir: Path | None = None) -> Path:
    """nvcc -cubin of cuda_src/toktier.cu for `arch`, cached by source hash."""
    import hashlib
    import shutil
    import subprocess

    from ..charclass import cache_dir

    h = hashlib.sha256()
    for f in sorted(cuda_src_dir().glob("*.cu*")):
        h.update(f.name.encode() + f.read_bytes())
    out_dir = out_dir or cache_dir() / "cubin"
    out = out_dir / f"toktier-{arch}-{h.hexdigest()[:16]}.cubin"
    if out.is_file():
        return out
    nvcc = shutil.which("nvcc") or next((str(p) for p in sorted(Path("/usr/local").glob("cuda*/bin/nvcc"))), "nvcc")
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    subprocess.run([nvcc, f"-arch={arch}", "-cubin", "-O3", "--std=c++17", "-o", str(tmp), MAIN_SOURCE],
                   cwd=str(cuda_src_dir()), check=True, capture_output=True, text=True)
    os.replace(tmp, out)
    return out


def available_driver() -> "GpuDriver | None":
    """A new driver, or None without pycuda/GPU (never raises).  Building one compiles or
    loads the kernels: the caller (a `Router`) keeps it."""
    name, _why = _probe()
    if name is None:
        return None
    try:
        return GpuDriver()
    except Exception:
        return None


def unavailable_reason() -> str:
    return _probe()[1]


@dataclass
class _Bucket:
    cap: int
    cap_lits: int
    arrays: dict = field(default_factory=dict)
    struct: object = None
    host_meta: np.ndarray | None = None
    host_buf: np.ndarray | None = None     # page-locked staging (async copies)
    host_ids: np.ndarray | None = None
    host_spans: np.ndarray | None = None
    graphs: dict = field(default_factory=dict)  # tok hash -> graph exec


@dataclass
class _Tok:
    rules: GpuRules
    arrays: dict
    struct: object
    literal_re: object | None
    literal_ids: dict


class GpuDriver:
    """Builds/loads the kernels, uploads tables once, runs requests (thread-safe, one at a time)."""

    def __init__(self, device: int = 0, cubin: str | None = None, use_graphs: bool = True, backend=None) -> None:
        if backend is None:  # tests inject a backend (tests/gpu_emu.py: the CPU emulator)
            name, why = _probe()
            if name is None:
                raise GpuUnavailable(why)
            backend = _PyCudaBackend(device) if name == "pycuda" else _CupyBackend(device)
        self.backend = backend
        be = self.backend
        try:
            self.cubin = str(cubin or os.environ.get("TOKTIER_CUBIN") or build_cubin(be.arch()))
            self._get = be.load(self.cubin)
        finally:
            be.leave()
        self._fns: dict = {}
        self._lock = threading.Lock()
        self._toks: dict[str, _Tok] = {}
        self._buckets: dict[int, _Bucket] = {}
        self.use_graphs = use_graphs
        self.graph_error: str | None = None
        self.fallbacks = 0
        self._verified: dict[str, bool] = {}

    def _fn(self, name: str):
        fn = self._fns.get(name)
        if fn is None:
            fn = self._fns[name] = self._get(name)
        return fn

    # -- tables --------------------------------------------------------------------------
    def _tok(self, tok) -> _Tok:
        entry = self._toks.get(tok.hash)
        if entry is not None:
            return entry
        rules = rules_for(tok)
        if rules is None:
            raise GpuUnavailable(f"{tok.name}: family {tok.family!r} has no GPU model")
        be = self.backend
        bt = bpe_tables(tok)
        host = {
            "cls_table": np.ascontiguousarray(class_table(tok), dtype=np.uint32),
            "byte_to_id": bt.byte_to_id, "pair_keys": bt.pair_keys, "pair_rank": bt.pair_rank,
            "pair_merged": bt.pair_merged, "vocab_keys": bt.vocab_keys, "vocab_ids": bt.vocab_ids,
            "tok_off": bt.tok_off, "tok_blob": bt.tok_blob if len(bt.tok_blob) else np.zeros(1, np.uint8),
        }
        arrays = {k: be.to_device(np.ascontiguousarray(v)) for k, v in host.items()}
        fields = [int(arrays[k]) for k in host] + [bt.pair_bits, bt.vocab_bits, bt.max_piece_lookup,
                                                   int(bt.whole_piece_lookup)]
        struct = be.to_device(np.array(fields, dtype=np.uint64))
        from .pretok_model import literal_finder

        entry = _Tok(rules, arrays, struct, literal_finder(tok), {})
        self._toks[tok.hash] = entry
        return entry

    # -- buffers -------------------------------------------------------------------------
    def _bucket(self, nbytes: int) -> _Bucket:
        cap = MIN_BUCKET
        while cap < nbytes:
            cap <<= 1
        bk = self._buckets.get(cap)
        if bk is not None:
            return bk
        be = self.backend
        cap_lits = cap // 2 + 1
        a: dict = {}
        a["buf"] = be.alloc(cap + 8)
        a["meta"] = be.alloc(META_SLOTS * 4)
        for k in ("lit_s", "lit_e", "lit_id"):
            a[k] = be.alloc(cap_lits * 4)
        for k in _PER_BYTE_I32:
            a[k] = be.alloc((cap + 1) * 4)
        for k in ("cps", "cls", "out_tok", "scr_a", "scr_b", "scr_c", "ids"):
            a[k] = be.alloc((cap + 1) * 4)
        for i in range(NSCRATCH):
            a[f"S{i}"] = be.alloc((cap + 1) * 4)
        a["aggs"] = be.alloc((cap // SCAN_TILE + 2) * 4)
        vals = [int(a[f]) for f in _BUF_FIELDS[:-2]] + [cap, cap_lits]
        struct = be.to_device(np.array(vals, dtype=np.uint64))
        bk = _Bucket(cap=cap, cap_lits=cap_lits, arrays=a, struct=struct,
                     host_meta=be.pinned(META_SLOTS, np.int32), host_buf=be.pinned(cap + 8, np.uint8),
                     host_ids=be.pinned(cap + 1, np.uint32), host_spans=be.pinned(cap + 1, np.int32))
        self._buckets[cap] = bk
        return bk

    # -- the launch sequence -------------------------------------------------------------
    def _launches(self, bk: _Bucket, tk: _Tok):
        """(kernel name, grid, block, args) in order; grids depend on capacity only."""
        B = np.intp(int(bk.struct))
        T = np.intp(int(tk.struct))
        cap = bk.cap
        g = (cap + THREADS - 1) // THREADS
        tiles = (cap + SCAN_TILE - 1) // SCAN_TILE
        meta = int(bk.arrays["meta"])
        n_bytes = np.intp(meta + 4 * META["NBYTES"])
        n_chars = np.intp(meta + 4 * META["NCHARS"])
        n_pieces = np.intp(meta + 4 * META["NPIECES"])
        aggs = np.intp(int(bk.arrays["aggs"]))
        S = [np.intp(int(bk.arrays[f"S{i}"])) for i in range(NSCRATCH)]
        L: list = []

        def k(name, grid, *args, block=THREADS):
            L.append((name, grid, block, args))

        def scan(op, data, n):
            k(f"{op}_tiles", tiles, data, n, aggs)
            k(f"{op}_aggs", 1, aggs, n)
            k(f"{op}_apply", tiles, data, n, aggs)

        mx, mn, sm = "tt_scan_max", "tt_scan_min_rev", "tt_scan_sum"
        k("tt_lead", g, B)
        k("tt_mark_literals", (bk.cap_lits + THREADS - 1) // THREADS, B)
        scan(sm, np.intp(int(bk.arrays["cidx"])), n_bytes)
        k("tt_decode", g, B)
        k("tt_classify", g, B, T)
        r = tk.rules
        if r in (GpuRules.CL100K_HF, GpuRules.CL100K_TT, GpuRules.QWEN):
            k("tt_cl100k_prep", g, B)
            for i, op in enumerate((mx, mx, mn, mn, mx)):
                scan(op, S[i], n_chars)
            k("tt_cl100k_starts", g, B, np.int32(r == GpuRules.QWEN), np.int32(r == GpuRules.CL100K_TT))
        elif r == GpuRules.DEEPSEEK:
            k("tt_deepseek_prep", g, B)
            for i, op in enumerate((mx, mx, mn, mn, mx, mx, mn, mn)):
                scan(op, S[i], n_chars)
            k("tt_deepseek_starts", g, B)
        elif r == GpuRules.O200K:
            k("tt_o200k_init", g, B)
            scan(mx, S[0], n_chars)
            scan(mx, S[1], n_chars)
            for rnd in range(O200K_ROUNDS + 1):
                check = rnd == O200K_ROUNDS
                k("tt_set_meta", 1, B, np.int32(META["CHANGED"]), np.int32(0), block=32)
                k("tt_o200k_round_a", g, B)
                scan(mx, S[3], n_chars)
                scan(mn, S[4], n_chars)
                scan(mn, S[5], n_chars)
                k("tt_o200k_round_b", g, B)
                scan(mx, S[6], n_chars)
                k("tt_o200k_round_c", g, B)
                scan(mx, S[7], n_chars)
                k("tt_o200k_round_d", g, B, np.int32(check))
            k("tt_o200k_status", 1, B, block=32)
            k("tt_o200k_final_a", g, B)
            for i, op in ((8, mx), (9, mn), (10, mn), (11, mx), (12, mx), (13, sm), (14, mx)):
                scan(op, S[i], n_chars)
            k("tt_o200k_final_b", g, B)
            scan(mx, S[15], n_chars)
            k("tt_o200k_final_c", g, B)
            k("tt_o200k_final_d", g, B)
            for i, op in ((17, mx), (18, mn), (19, mx), (20, mx), (21, mn), (22, mx)):
                scan(op, S[i], n_chars)
            k("tt_o200k_starts", g, B)
        else:
            raise GpuUnavailable(f"no kernels for rules {r!r}")
        k("tt_piece_flags", g, B)
        scan(sm, S[0], n_chars)
        k("tt_pieces", g, B)
        k("tt_dispatch", g, B, T)
        k("tt_bpe_small", g, B, T)
        k("tt_bpe_warp", ((cap // 33 + 1) + 7) // 8, B, T)
        k("tt_bpe_block", cap // 129 + 1, B, T)
        k("tt_count_flags", g, B)
        scan(sm, S[1], n_pieces)
        k("tt_emit", g, B, T)
        return L

    def _run_launches(self, launches) -> None:
        for name, grid, block, args in launches:
            self._fn(name)(int(grid), int(block), args)

    def _graph(self, bk: _Bucket, tok_hash: str, tk: _Tok):
        """Captured graph exec for (bucket, tokenizer), or None (graphs unsupported: direct launches)."""
        if not self.use_graphs:
            return None
        ge = bk.graphs.get(tok_hash)
        if ge is not None:
            return ge
        launches = self._launches(bk, tk)
        try:
            ge = self.backend.capture(lambda: self._run_launches(launches))
        except Exception as exc:  # pycuda without graph support, or capture refused
            self.graph_error = f"{type(exc).__name__}: {exc}"
            self.use_graphs = False
            return None
        bk.graphs[tok_hash] = ge
        return ge

    # -- requests ------------------------------------------------------------------------
    def encode(self, tok, text: str | bytes, *, with_spans: bool = True,
               literals: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
               ) -> tuple[np.ndarray, np.ndarray | None]:
        """(ids uint32, byte start of each token int64) == the reference encode of `text`.

        `text` may be given as its UTF-8 bytes (a session holds them already: re-encoding a 4M-
        character str costs ~10 ms, several times the kernels).  Without `with_spans` the spans
        stay on the device and None comes back (a session start needs only the ids).  `literals`:
        the added-token literals of `text` as (UTF-8 start, end, token id) arrays, when the caller
        found them (`NativeEngine.literal_bytes`); else the driver's own scan of the bytes."""
        raw = text if isinstance(text, (bytes, bytearray, memoryview)) else text.encode("utf-8")
        if not raw:
            return np.zeros(0, np.uint32), (np.zeros(0, np.int64) if with_spans else None)
        with self._lock:
            self.backend.enter()
            try:
                out = self._encode_locked(tok, raw, with_spans, literals)
            finally:
                self.backend.leave()
        if out is None:  # a status bit: the CPU answers, exactly
            self.fallbacks += 1
            from .bpe_model import encode_with_spans

            ids, spans = encode_with_spans(tok, text if isinstance(text, str) else bytes(raw).decode("utf-8"))
            return ids, (spans if with_spans else None)
        return out

    def _encode_locked(self, tok, raw: bytes, with_spans: bool = True, literals=None):
        be = self.backend
        tk = self._tok(tok)
        lit_s, lit_e, lit_id = [], [], []
        if literals is not None:
            lit_s, lit_e, lit_id = literals
        elif tk.literal_re is not None:
            for a, b_, lid in tk.literal_re.find(raw):
                lit_s.append(a), lit_e.append(b_), lit_id.append(lid)
        bk = self._bucket(max(len(raw), 2 * len(lit_s)))
        a = bk.arrays
        meta = bk.host_meta
        meta[:] = 0
        meta[META["NBYTES"]] = len(raw)
        meta[META["NLITS"]] = len(lit_s)
        bk.host_buf[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        be.htod(a["buf"], bk.host_buf[: len(raw)])
        lits = None
        if len(lit_s):
            lits = [np.ascontiguousarray(v, np.int32) for v in (lit_s, lit_e, lit_id)]  # alive until sync 1
            for key, arr in zip(("lit_s", "lit_e", "lit_id"), lits):
                be.htod(a[key], arr)
        be.htod(a["meta"], meta)
        ge = self._graph(bk, tok.hash, tk)
        if ge is not None:
            ge()
        else:
            self._run_launches(self._launches(bk, tk))
        be.dtoh(meta, a["meta"])
        be.sync()  # sync 1
        del lits
        if meta[META["STATUS"]] != 0:
            return None
        nt = int(meta[META["NTOKENS"]])
        if nt:
            be.dtoh(bk.host_ids[:nt], a["ids"])
            if with_spans:
                be.dtoh(bk.host_spans[:nt], a["spans"])
            be.sync()  # sync 2
        return bk.host_ids[:nt].copy(), (bk.host_spans[:nt].astype(np.int64) if with_spans else None)

    # -- self-check ----------------------------------------------------------------------
    def verified(self, tok) -> bool:
        """True once the GPU path reproduced the reference on a multilingual sample for `tok`.

        Run once per tokenizer before the router trusts the GPU; a mismatch disables
        the GPU for that tokenizer (misses cost time, never correctness).
        """
        ok = self._verified.get(tok.hash)
        if ok is None:
            text = "".join(SELF_CHECK[i:] + SELF_CHECK[:i] for i in range(0, len(SELF_CHECK), 61))
            if tok.family_info is not None and tok.family_info.nfc:
                text = tok.engine.normalize(text)  # the router sends NFC families only NFC-stable text
            try:
                ids, spans = self.encode(tok, text)
                ok = bool(np.array_equal(ids, tok.encode(text)))
            except Exception as exc:
                self.graph_error = self.graph_error or f"self-check failed: {exc}"
                ok = False
            self._verified[tok.hash] = ok
        return ok
