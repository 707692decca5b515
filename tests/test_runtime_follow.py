"""An executor made without a stream launches a call whose device arrays are all torch tensors
on torch's current stream (no event wait), and other calls on its own stream (stub driver)."""

from __future__ import annotations

import numpy as np
from test_runtime_fastpath import (FakeDeviceArray, StubExecutor, TorchLike, axpy_program, faketorch,  # noqa: F401
                                   full_path)


class FollowingStub(StubExecutor):
    """A StubExecutor made as `CudaExecutor(host, cubin)` is (stream=None): it follows torch's
    current stream. `_submit` records the stream handle each launch went to."""

    follows_producer = True

    def __init__(self, host):
        super().__init__(host)
        self.streams = []

    def _use_stream(self, handle):
        handle = 1 if handle in (0, 1) else handle
        self.stream = type("FakeStream", (), {"handle": handle, "sync": lambda self: None})()
        self._stream_ptr = handle

    def _submit(self, kernel, config, params, stream=None):
        super()._submit(kernel, config, params, stream)
        self.streams.append(self._stream_ptr if stream is None else stream.handle)


def test_torch_calls_launch_on_torchs_current_stream_without_waiting(full_path, faketorch):
    f = FollowingStub(axpy_program())
    args = [TorchLike(np.zeros(4096, np.float32)) for _ in range(3)]
    faketorch.current[0] = 0x1234  # torch works on a side stream
    f(*args)  # the full path follows it too
    f(*args)  # a hit
    faketorch.current[0] = 0x5678  # another stream (a CUDA-graph capture's, say)
    f(*args)
    assert f.streams == [0x1234, 0x1234, 0x5678]
    assert f.waits == [], "launching on the producer's own stream leaves nothing to wait for"
    assert full_path["binds"] == 1 and len(f._calls) == 1


def test_other_device_arrays_run_on_the_executors_own_stream(full_path, faketorch):
    f = FollowingStub(axpy_program())
    faketorch.current[0] = 0x1234
    f(*[TorchLike(np.zeros(4096, np.float32)) for _ in range(3)])
    f(*[FakeDeviceArray((4096,), 0x7000_0000 + k * 0x10_0000) for k in range(3)])  # CUDA array interface
    assert f.streams == [0x1234, 0x5EED], "a call that follows no torch stream goes back to the executor's own"


def test_use_stream_names_the_legacy_stream_once_and_keeps_a_view_per_handle(monkeypatch):
    import cuda.core

    made = []

    def from_handle(handle):
        made.append(handle)
        return type("FakeStream", (), {"handle": handle})()

    monkeypatch.setattr(cuda.core, "Stream", type("Stream", (), {"from_handle": staticmethod(from_handle)}))
    f = StubExecutor(axpy_program())  # home stream 0x5EED
    f.follows_producer = True
    home = f.stream
    f._use_stream(0x1234)
    assert f._stream_ptr == 0x1234 and f.stream.handle == 0x1234
    f._use_stream(0x1234)
    f._use_stream(0)  # torch's default stream reports NULL: CU_STREAM_LEGACY, what DLPack expects
    assert f._stream_ptr == 1 and f.stream.handle == 1
    f._use_stream(0x1234)
    assert made == [0x1234, 1], "one cuda.core view per stream handle, made once"
    f._use_stream(0x5EED)
    assert f.stream is home, "the executor's own stream is used as it is"


def _two_kernels_through_a_temporary():
    """part[i] = x[i] (kernel stage1), out[i] = part[i] (kernel stage2): one temporary."""
    from tecc.ir import dtype as dt
    from tecc.ir.expr import Const, Var
    from tecc.ir.stmt import Buffer
    from tecc.runtime.host import Call, HostProgram, KernelInfo

    ONE = Const(1, dt.int32)

    n = Var("n", dt.int32, "size")
    x, out = Buffer("x", dt.float32, (n,)), Buffer("out", dt.float32, (n,))
    part = Buffer("part", dt.float32, (n,), zero_init=True)
    k1 = KernelInfo("stage1", (x, part, n), ((n + 255) // 256, ONE, ONE), (256, 1, 1))
    k2 = KernelInfo("stage2", (part, out, n), ((n + 255) // 256, ONE, ONE), (256, 1, 1))
    return HostProgram("staged", (x, out, n), (part,), (k1, k2),
                       (Call("stage1", ("x", "part", "n")), Call("stage2", ("part", "out", "n"))), ("out",))


def test_temporaries_of_a_followed_call_come_from_torch_kept_per_stream_and_per_call_under_capture(
        full_path, faketorch):
    faketorch.uint8 = "uint8"
    made = []

    class Allocating(TorchLike):
        def new_zeros(self, shape, dtype):
            array = np.zeros(shape, np.uint8)
            made.append((array.ctypes.data, dtype))
            return TorchLike(array, dtype=dtype)  # the owner

    Allocating.__module__ = "faketorch"
    f = FollowingStub(_two_kernels_through_a_temporary())
    args = [Allocating(np.zeros(1024, np.float32)) for _ in range(2)]
    faketorch.current[0] = 0x1234
    for _ in range(3):  # a miss, then two hits on one stream: one temporary, reused
        f(*args)
    assert full_path["binds"] == 1 and len(made) == 1, "one temporary per stream, from the tensor's allocator"
    faketorch.current[0] = 0x5678  # another stream gets its own
    f(*args)
    assert len(made) == 2
    faketorch.capturing[0] = True  # under CUDA-graph capture: one per call, from the graph's pool
    f(*args)
    f(*args)
    assert len(made) == 4
    assert all(dtype == "uint8" for _, dtype in made)
    temps_passed = [params[1] for kernel, _, _, params in f.submitted if kernel == "<kernel stage1>"]
    first, second, third, fourth = (ptr for ptr, _ in made)
    assert temps_passed == [first, first, first, second, third, fourth], "each launch gets its stream's or call's temporary"
    assert f._temps == {}, "the executor keeps no temporaries of its own for followed calls"
