"""CUDA graph capture on a raw ``CUstream``, through the driver API (libcuda) by ctypes.

PyCUDA (2026.1, the newest) wraps contexts, streams and launches but not stream
capture or graphs, so the pycuda backend captures its stream here: begin capture,
run the request's launches (pycuda's ``cuLaunchKernel`` calls are recorded, not
run), end capture, instantiate once per (bucket, tokenizer), then launch the
executable graph once per request.  Everything lives in the context pycuda made
current; this module only needs the stream's handle.

Capture is thread-local (``CU_STREAM_CAPTURE_MODE_THREAD_LOCAL``): the sidecar's
other threads may touch CUDA meanwhile without invalidating the capture or being
refused by it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable

CAPTURE_MODE_THREAD_LOCAL = 1

_P = ctypes.c_void_p
# exported symbol -> (the cuda.h name it implements, argument types); every call returns CUresult
SIGNATURES: dict[str, tuple[str, list]] = {
    "cuStreamBeginCapture_v2": ("cuStreamBeginCapture", [_P, ctypes.c_int]),
    "cuStreamEndCapture": ("cuStreamEndCapture", [_P, ctypes.POINTER(_P)]),
    "cuGraphInstantiateWithFlags": ("cuGraphInstantiate", [ctypes.POINTER(_P), _P, ctypes.c_ulonglong]),
    "cuGraphUpload": ("cuGraphUpload", [_P, _P]),
    "cuGraphLaunch": ("cuGraphLaunch", [_P, _P]),
    "cuGraphDestroy": ("cuGraphDestroy", [_P]),
    "cuGetErrorName": ("cuGetErrorName", [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]),
}


class CudaGraphError(RuntimeError):
    """A driver call of graph capture or launch failed (the message names the call and CUresult)."""


@functools.lru_cache(maxsize=1)
def driver_api() -> ctypes.CDLL:
    """libcuda with the argument types above set (raises OSError when there is no driver)."""
    lib = ctypes.CDLL(ctypes.util.find_library("cuda") or "libcuda.so.1")
    for sym, (_, args) in SIGNATURES.items():
        fn = getattr(lib, sym)
        fn.argtypes = args
        fn.restype = ctypes.c_int
    return lib


def _check(lib: ctypes.CDLL, rc: int, call: str) -> None:
    if rc == 0:
        return
    name = ctypes.c_char_p()
    known = lib.cuGetErrorName(rc, ctypes.byref(name)) == 0 and name.value
    raise CudaGraphError(f"{call} failed: {name.value.decode() if known else 'CUresult'} ({rc})")


class GraphExec:
    """An instantiated graph; `launch` replays the captured launches on a stream.

    Lives as long as the driver's bucket that captured it (the process): a handful per
    tokenizer, so it is never destroyed explicitly.
    """

    def __init__(self, lib: ctypes.CDLL, graph: ctypes.c_void_p, exe: ctypes.c_void_p) -> None:
        self._lib, self._graph, self._exe = lib, graph, exe

    def upload(self, stream: int) -> None:
        """Do the graph's one-time device set-up now rather than on the first request."""
        _check(self._lib, self._lib.cuGraphUpload(self._exe, _P(stream)), "cuGraphUpload")

    def launch(self, stream: int) -> None:
        _check(self._lib, self._lib.cuGraphLaunch(self._exe, _P(stream)), "cuGraphLaunch")


def capture(stream: int, run: Callable[[], None], lib: ctypes.CDLL | None = None) -> GraphExec:
    """Record what `run` enqueues on `stream` (a ``CUstream`` handle) and instantiate it."""
    lib = lib or driver_api()
    _check(lib, lib.cuStreamBeginCapture_v2(_P(stream), CAPTURE_MODE_THREAD_LOCAL), "cuStreamBeginCapture")
    graph = _P()
    try:
        run()
    except BaseException:  # leave capture mode, or the stream stays unusable
        if lib.cuStreamEndCapture(_P(stream), ctypes.byref(graph)) == 0 and graph:
            lib.cuGraphDestroy(graph)
        raise
    rc = lib.cuStreamEndCapture(_P(stream), ctypes.byref(graph))
    if rc != 0:
        if graph:
            lib.cuGraphDestroy(graph)
        _check(lib, rc, "cuStreamEndCapture")
    exe = _P()
    rc = lib.cuGraphInstantiateWithFlags(ctypes.byref(exe), graph, 0)
    if rc != 0:
        lib.cuGraphDestroy(graph)
        _check(lib, rc, "cuGraphInstantiate")
    return GraphExec(lib, graph, exe)
