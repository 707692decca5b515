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

    def _submit(self, kernel, config, params):
        super()._submit(kernel, config, params)
        self.streams.append(self._stream_ptr)


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
