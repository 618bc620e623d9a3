"""Graph capture's call sequence and error paths (`toktier/gpu/cuda_graph.py`), without a GPU.

The real driver calls run on a device in `tests/test_gpu_device.py::test_gpu_uses_graphs`;
here a recording stand-in for libcuda checks what must hold whatever the driver says:
capture mode is always left (a stream left capturing refuses every later launch), a
failed capture frees its graph, and errors name the call and the CUresult.
"""

from __future__ import annotations

import ctypes

import pytest

from toktier.gpu.cuda_graph import CudaGraphError, capture

STREAM = 0x5EED


class RecordingDriver:
    """Answers each driver call with a chosen CUresult and records the calls."""

    def __init__(self, fail: str = "") -> None:
        self.fail = fail
        self.calls: list[str] = []

    def _rc(self, name: str) -> int:
        self.calls.append(name)
        return 901 if name == self.fail else 0  # CUDA_ERROR_STREAM_CAPTURE_INVALIDATED

    def cuStreamBeginCapture_v2(self, stream, mode):
        assert stream.value == STREAM and mode == 1  # thread-local capture
        return self._rc("begin")

    def cuStreamEndCapture(self, stream, graph_ref):
        ctypes.cast(graph_ref, ctypes.POINTER(ctypes.c_void_p))[0] = 0x6A
        return self._rc("end")

    def cuGraphInstantiateWithFlags(self, exe_ref, graph, flags):
        ctypes.cast(exe_ref, ctypes.POINTER(ctypes.c_void_p))[0] = 0xE7
        return self._rc("instantiate")

    def cuGraphUpload(self, exe, stream):
        return self._rc("upload")

    def cuGraphLaunch(self, exe, stream):
        assert exe.value == 0xE7 and stream.value == STREAM
        return self._rc("launch")

    def cuGraphDestroy(self, graph):
        return self._rc("destroy")

    def cuGetErrorName(self, rc, name_ref):
        ctypes.cast(name_ref, ctypes.POINTER(ctypes.c_char_p))[0] = b"CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"
        return 0


def test_capture_records_then_launches():
    lib = RecordingDriver()
    ge = capture(STREAM, lambda: lib.calls.append("run"), lib=lib)
    ge.upload(STREAM)
    ge.launch(STREAM)
    assert lib.calls == ["begin", "run", "end", "instantiate", "upload", "launch"]


def test_a_failing_launch_inside_capture_still_ends_it():
    lib = RecordingDriver()

    def run():
        raise RuntimeError("launch refused during capture")

    with pytest.raises(RuntimeError, match="launch refused"):
        capture(STREAM, run, lib=lib)
    assert lib.calls == ["begin", "end", "destroy"]


@pytest.mark.parametrize("fail, tail", [("begin", ["begin"]), ("end", ["begin", "end", "destroy"]),
                                        ("instantiate", ["begin", "end", "instantiate", "destroy"])])
def test_driver_errors_name_the_call(fail, tail):
    lib = RecordingDriver(fail)
    with pytest.raises(CudaGraphError, match=r"failed: CUDA_ERROR_STREAM_CAPTURE_INVALIDATED \(901\)"):
        capture(STREAM, lambda: None, lib=lib)
    assert lib.calls == tail
