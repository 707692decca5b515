"""The executor's launch cache, without a GPU: a repeated call with device arrays of the same
layout skips describing and binding and relaunches for the new data pointers; any change to
what the checks read (shape, strides, dtype, device, read-only flag, pointer alignment) takes
the full path again, and arrays that overlap an output are refused (the kernels' pointers are
`__restrict__`). Device arrays are fakes with `__cuda_array_interface__`; the driver is a stub."""

from __future__ import annotations

import numpy as np
import pytest

from tecc.ir import dtype as dt
from tecc.ir.errors import DTypeError, ShapeError, TeccError
from tecc.runtime import arrays
from tecc.runtime import cuda as rt_cuda
from tecc.runtime import marshal as rt_marshal
from tecc.runtime.cuda import CudaExecutor, plan_launches

from test_runtime import axpy_program, strided_copy_program


class FakeDeviceArray:
    """A device array as the CUDA array interface describes it (strides in bytes, or None)."""

    def __init__(self, shape, ptr, typestr="<f4", strides=None, readonly=False, stream=None):
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": typestr, "data": (ptr, readonly),
                                         "strides": strides, "version": 3, "stream": stream}


class FakeView:
    """What StridedMemoryView reports for a FakeDeviceArray (strides in elements)."""

    def __init__(self, obj):
        cai = obj.__cuda_array_interface__
        self.ptr, self.readonly = cai["data"]
        self.shape = cai["shape"]
        self.dtype = np.dtype(cai["typestr"])
        self.strides = None if cai["strides"] is None else tuple(s // self.dtype.itemsize for s in cai["strides"])
        self.device_id = 0
        self.is_device_accessible = True


class StubExecutor(CudaExecutor):
    """A CudaExecutor whose device, stream and driver are stand-ins: `_submit` records launches."""

    def __init__(self, host, *, alignment=16, debug_sync=False):
        self.host = host
        self._planned = plan_launches(host)
        self.device = type("FakeDevice", (), {"device_id": 0, "name": "stub", "set_current": lambda self: None})()
        self.stream = type("FakeStream", (), {"handle": 0x5EED, "sync": lambda self: None})()
        self.debug_sync = debug_sync
        self.alignment = alignment
        self.last_launches = []
        self._temps = {}
        self._dummy = None
        self.kernels = {k.name: f"<kernel {k.name}>" for k in host.kernels}
        self._max_threads = {k.name: 1024 for k in host.kernels}
        self._init_launch_cache()
        self.submitted = []

    def _submit(self, kernel, config, params):
        self.submitted.append((kernel, config.grid, config.block, list(params)))

    def _pointer_device(self, ptr):
        return 0


@pytest.fixture
def full_path(monkeypatch):
    """Counts the full path's work: StridedMemoryViews made and argument bindings."""
    counts = {"views": 0, "binds": 0}

    def view(obj, stream_ptr=-1):
        counts["views"] += 1
        return FakeView(obj)

    real_bind = rt_marshal.bind_arguments

    def bind(host, infos):
        counts["binds"] += 1
        return real_bind(host, infos)

    monkeypatch.setattr(arrays, "strided_view", view)
    monkeypatch.setattr(rt_marshal, "bind_arguments", bind)
    return counts


def axpy_arrays(n=4096, base=0x7000_0000, **kw):
    return [FakeDeviceArray((n,), base + k * 0x10_0000, **kw) for k in range(3)]


def test_a_repeated_call_relaunches_with_the_new_pointers_without_binding_again(full_path):
    f = StubExecutor(axpy_program())
    f(*axpy_arrays())
    assert full_path == {"views": 3, "binds": 1}
    again = axpy_arrays(base=0x9000_0000)
    f(*again)
    assert full_path == {"views": 3, "binds": 1}, "the second call should be a cache hit"
    first, second = f.submitted
    assert first[:3] == second[:3] == ("<kernel axpy>", (16, 1, 1), (256, 1, 1))
    assert second[3][:3] == [a.__cuda_array_interface__["data"][0] for a in again]
    assert second[3][3] == np.int32(4096) and type(second[3][3]) is np.int32
    assert [r.kernel for r in f.last_launches] == ["axpy"] and f.last_launches[0].grid == (16, 1, 1)


@pytest.mark.parametrize("change, error", [
    ("shape", None),
    ("dtype", DTypeError),
    ("readonly output", TeccError),
    ("misaligned", ShapeError),
])
def test_any_change_the_checks_read_takes_the_full_path(full_path, change, error):
    f = StubExecutor(axpy_program())
    f(*axpy_arrays())
    if change == "shape":
        args = axpy_arrays(n=4100)
    elif change == "dtype":
        args = axpy_arrays(typestr="<f8")
    elif change == "readonly output":
        args = axpy_arrays()
        args[2] = FakeDeviceArray((4096,), args[2].__cuda_array_interface__["data"][0], readonly=True)
    else:
        args = axpy_arrays(base=0x7000_0004)  # 4 bytes off the 16-byte alignment
    launched = len(f.submitted)
    if error is None:
        f(*args)
        assert full_path["binds"] == 2 and f.submitted[-1][3][3] == 4100 and f.submitted[-1][1] == (17, 1, 1)
    else:
        with pytest.raises(error, match="argument"):
            f(*args)
        assert len(f.submitted) == launched, "nothing may launch when a check fails"
        assert full_path["binds"] == 2 or error is DTypeError or change == "misaligned"


def test_a_changed_stride_takes_the_full_path_and_binds_the_new_stride(full_path):
    f = StubExecutor(strided_copy_program())
    out = FakeDeviceArray((8, 6), 0x5000_0000)
    f(FakeDeviceArray((8, 6), 0x4000_0000, strides=(24, 4)), out)
    f(FakeDeviceArray((8, 6), 0x4100_0000, strides=(24, 4)), out)
    assert full_path["binds"] == 1
    f(FakeDeviceArray((8, 6), 0x4200_0000, strides=(4, 32)), out)
    assert full_path["binds"] == 2
    assert f.submitted[-1][3][4:] == [1, 8]  # the stride variables of the transposed layout


def test_alignment_is_rechecked_on_every_hit(full_path):
    f = StubExecutor(axpy_program())
    f(*axpy_arrays())
    with pytest.raises(ShapeError, match=r"argument 0 \(x\) of axpy: its data pointer 0x70000004 is not aligned"):
        f(*axpy_arrays(base=0x7000_0004))
    relaxed = StubExecutor(axpy_program(), alignment=4)
    relaxed(*axpy_arrays())
    relaxed(*axpy_arrays(base=0x7000_0004))
    assert full_path["binds"] == 3 and len(relaxed.submitted) == 2  # the relaxed second call is a hit


def test_an_input_that_is_also_the_output_is_refused_naming_both(full_path):
    f = StubExecutor(axpy_program())
    x, y, _ = axpy_arrays()
    with pytest.raises(ShapeError, match=r"argument 0 \(x\) and argument 2 \(out\) of axpy overlap in memory"):
        f(x, y, x)
    assert f.submitted == []


def test_overlap_is_refused_even_when_the_layout_is_cached(full_path):
    f = StubExecutor(axpy_program())
    f(*axpy_arrays())
    x, y, _ = axpy_arrays(base=0x9000_0000)
    shifted = FakeDeviceArray((4096,), 0x9000_0000 + 4096 * 4 - 16)  # its first 16 bytes are x's last
    with pytest.raises(ShapeError, match=r"argument 0 \(x\) and argument 2 \(out\)"):
        f(x, y, shifted)
    assert len(f.submitted) == 1


def test_two_inputs_may_share_memory(full_path):
    f = StubExecutor(axpy_program())
    x, _, out = axpy_arrays()
    f(x, x, out)
    f(x, x, out)
    assert len(f.submitted) == 2 and full_path["binds"] == 1


def test_a_foreign_producer_stream_always_takes_the_full_path(full_path):
    f = StubExecutor(axpy_program())
    for _ in range(2):
        f(*axpy_arrays(stream=0x1234))
    assert full_path["binds"] == 2  # the full path is the one that waits on the producer's stream
    for _ in range(2):
        f(*axpy_arrays(stream=0x5EED))  # the executor's own stream: nothing to wait for
    assert full_path["binds"] == 3


def test_hits_go_through_a_wrapped_launch_and_debug_sync(full_path, monkeypatch):
    seen = []
    plain = CudaExecutor._launch

    def wrapped(self, info, grid, block, params):
        seen.append((info.name, grid, list(params)))
        return plain(self, info, grid, block, params)

    f = StubExecutor(axpy_program())
    f(*axpy_arrays())
    monkeypatch.setattr(CudaExecutor, "_launch", wrapped)  # what tc.profile() does
    f(*axpy_arrays(base=0x9000_0000))
    assert full_path["binds"] == 1 and seen == [("axpy", (16, 1, 1), f.submitted[-1][3])]

    synced = StubExecutor(axpy_program(), debug_sync=True)
    monkeypatch.setattr(CudaExecutor, "_synchronize", lambda self, message: seen.append("sync"))
    synced(*axpy_arrays())
    synced(*axpy_arrays(base=0x9000_0000))
    assert seen.count("sync") == 2


def test_host_arrays_are_never_cached():
    f = StubExecutor(axpy_program())
    assert f._argument_keys((np.zeros(4, np.float32),) * 3) is None
    assert f._calls == {}


def test_dlpack_keys_read_the_capsule_and_ask_for_stream_ordering_every_time():
    class CudaLooking:
        """A NumPy array exported through DLPack, claiming to live on a GPU (the capsule says CPU)."""

        def __init__(self, a):
            self.a, self.streams = a, []

        def __dlpack_device__(self):
            return (arrays.KDL_CUDA, 0)

        def __dlpack__(self, stream=None, max_version=None):
            self.streams.append(stream)
            return self.a.__dlpack__(max_version=max_version)

    a = np.zeros((4, 6), np.float32)[:, ::2]
    wrapper = CudaLooking(a)
    key, ptr = arrays.device_key(wrapper, 0x5EED, None)
    assert key == ("dlpack", arrays.KDL_CPU, 0, (2, 32, 1), (4, 3), (6, 2), False) and ptr == a.ctypes.data
    arrays.device_key(wrapper, 0x5EED, None)
    assert wrapper.streams == [0x5EED, 0x5EED]
    readonly = np.zeros(5)
    readonly.flags.writeable = False
    assert arrays.device_key(CudaLooking(readonly), 1, None)[0][-1] is True
    assert arrays.device_key(CudaLooking(np.zeros(0, np.float32)), 1, None) is None  # zero-size: full path


def test_a_key_is_trusted_only_when_it_agrees_with_the_full_path():
    arg = arrays.Argument(None, arrays.ArrayInfo((8, 6), (6, 1), dt.float32), ptr=0x4000, device_id=0)
    key = ("cai", "<f4", (8, 6), None, False, 0)
    assert arrays.key_agrees(key, 0x4000, arg)
    assert not arrays.key_agrees(key, 0x4010, arg)
    assert not arrays.key_agrees(("cai", "<f4", (8, 6), None, False, 1), 0x4000, arg)
    assert not arrays.key_agrees(("cai", "<f4", (8, 6), (4, 32), False, 0), 0x4000, arg)
    assert arrays.key_agrees(("dlpack", arrays.KDL_CUDA, 0, (2, 32, 1), (8, 6), (6, 1), False), 0x4000, arg)
    assert not arrays.key_agrees(("dlpack", arrays.KDL_CPU, 0, (2, 32, 1), (8, 6), (6, 1), False), 0x4000, arg)


# ---- on a GPU, with torch ----------------------------------------------------------------------

AXPY_SOURCE = """
extern "C" __global__ void axpy(const float* x, const float* y, float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = 2.5f * x[i] + y[i];
}
"""


@pytest.mark.gpu
def test_torch_calls_hit_the_cache_and_still_refuse_overlap():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    from cuda.core import Program, ProgramOptions

    device = rt_cuda.current_device()
    cubin = bytes(Program(AXPY_SOURCE, "c++", ProgramOptions(arch=rt_cuda.device_arch(device))).compile("cubin").code)
    f = CudaExecutor(axpy_program(), cubin)
    n = 10_001
    for seed in range(3):
        g = torch.Generator(device="cuda").manual_seed(seed)
        x, y = (torch.randn(n, device="cuda", generator=g) for _ in range(2))
        out = torch.full((n,), float("nan"), device="cuda")
        f(x, y, out)
        torch.cuda.synchronize()
        want = 2.5 * x.double() + y.double()
        worst = (out.double() - want).abs().max().item()
        assert worst < 1e-5, f"axpy via the launch cache, call {seed}: worst |error| {worst}"
    assert len(f._calls) == 1, "three calls with one layout should leave one cache entry"
    with pytest.raises(ShapeError, match=r"argument 0 \(x\) and argument 2 \(out\) of axpy overlap"):
        f(x, y, x)
    with pytest.raises(ShapeError, match="not aligned"):
        f(torch.zeros(n + 1, device="cuda")[1:], y, out)
