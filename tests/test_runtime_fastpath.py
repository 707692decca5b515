"""The executor's launch cache, without a GPU: a repeated call with device arrays of the same
layout skips describing and binding and relaunches for the new data pointers; any change to
what the checks read (shape, strides, dtype, device, read-only flag, pointer alignment) takes
the full path again, and arrays that overlap an output are refused (the kernels' pointers are
`__restrict__`). Device arrays are fakes with `__cuda_array_interface__`, or torch-like fakes read
by attribute (whose producer stream the executor waits on); the driver is a stub."""

from __future__ import annotations

import sys
import types

import ml_dtypes
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
    """What StridedMemoryView reports for a FakeDeviceArray (strides in elements), or for a
    TorchLike: what cuda.core's torch bridge reads from the tensor, here its backing array."""

    def __init__(self, obj):
        if isinstance(obj, TorchLike):
            a = obj.array
            self.ptr, self.readonly, self.shape, self.dtype = a.ctypes.data, False, a.shape, a.dtype
            self.strides = tuple(st // a.itemsize for st in a.strides)
            self.device_id, self.is_device_accessible = obj.device, True
            return
        cai = obj.__cuda_array_interface__
        self.ptr, self.readonly = cai["data"]
        self.shape = cai["shape"]
        self.dtype = np.dtype(cai["typestr"])
        self.strides = None if cai["strides"] is None else tuple(s // self.dtype.itemsize for s in cai["strides"])
        self.device_id = 0
        self.is_device_accessible = True


class FakeTorchDtype:
    """A torch dtype as far as tecc looks at one: hashable, named `torch.<name>`."""

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"torch.{self.name}"


TORCH_DTYPES = {np.dtype(np.float32): FakeTorchDtype("float32"), np.dtype(np.float64): FakeTorchDtype("float64"),
                np.dtype(ml_dtypes.bfloat16): FakeTorchDtype("bfloat16"), np.dtype(np.int32): FakeTorchDtype("int32")}


class TorchLike:
    """torch.Tensor's accessors over a NumPy array that plays the device memory (properties and
    methods of the class, as torch's are). The package that defines the class ("faketorch", see
    `faketorch`) answers its current stream. `exported` counts DLPack exports, which fail."""

    is_cuda = True

    def __init__(self, array, device=0, requires_grad=False, neg=False, dtype=None):
        self.array, self.device, self._requires_grad, self.neg = array, device, requires_grad, neg
        self._dtype = dtype or TORCH_DTYPES[array.dtype]
        self.exported = 0

    @property
    def shape(self):
        return tuple(self.array.shape)  # torch.Size is a tuple

    @property
    def dtype(self):
        return self._dtype

    @property
    def requires_grad(self):
        return self._requires_grad

    def data_ptr(self):
        return self.array.ctypes.data

    def stride(self):
        return tuple(st // self.array.itemsize for st in self.array.strides)

    def get_device(self):
        return self.device

    def is_neg(self):
        return self.neg

    def is_conj(self):
        return False

    def __dlpack_device__(self):
        return (arrays.KDL_CUDA, self.device)

    def new_empty(self, shape, dtype):
        """torch's Tensor.new_empty: fresh (poisoned) memory of the dtype on this device."""
        numpy_dtype = next(k for k, v in TORCH_DTYPES.items() if v is dtype)
        return type(self)(np.full(tuple(shape), np.nan, numpy_dtype), device=self.device, dtype=dtype)

    def __dlpack__(self, stream=None, max_version=None):
        self.exported += 1
        raise BufferError("a fake tensor cannot be exported")


TorchLike.__module__ = "faketorch"


@pytest.fixture
def faketorch(monkeypatch):
    """The package "faketorch" as torch looks to the attribute reader: `_C._cuda_getCurrentRawStream`
    answers the current stream, `current[device]` (default 0, torch's NULL default stream)."""
    package = types.ModuleType("faketorch")
    package.current = {0: 0}
    package._C = types.SimpleNamespace(_cuda_getCurrentRawStream=lambda index: package.current[index])
    package.capturing = [False]  # what torch.cuda.is_current_stream_capturing() answers
    package.cuda = types.SimpleNamespace(is_current_stream_capturing=lambda: package.capturing[0])
    monkeypatch.setitem(sys.modules, "faketorch", package)
    monkeypatch.setattr(arrays, "_ATTRIBUTE_TYPES", {})  # learn the fake types afresh in each test
    return package


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
        self._stream_temps = {}
        self._dummy = None
        self.kernels = {k.name: f"<kernel {k.name}>" for k in host.kernels}
        self._max_threads = {k.name: 1024 for k in host.kernels}
        self._init_launch_cache()
        self.submitted = []
        self.waits = []

    def _submit(self, kernel, config, params, stream=None):
        self.submitted.append((kernel, config.grid, config.block, list(params)))

    def _record_and_wait(self, producer):
        self.waits.append((producer, len(self.submitted)))  # the wait comes before that many launches

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
    assert (f.calls_cached, f.calls_checked) == (0, 1)
    again = axpy_arrays(base=0x9000_0000)
    f(*again)
    assert full_path == {"views": 3, "binds": 1}, "the second call should be a cache hit"
    assert (f.calls_cached, f.calls_checked) == (1, 1), "the executor counts the hit"
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


def _torch_and_axpy_executor():
    """torch (skips without it or its CUDA) and a CudaExecutor of AXPY_SOURCE on the default stream."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    from cuda.core import Program, ProgramOptions

    device = rt_cuda.current_device()
    cubin = bytes(Program(AXPY_SOURCE, "c++", ProgramOptions(arch=rt_cuda.device_arch(device))).compile("cubin").code)
    return torch, CudaExecutor(axpy_program(), cubin)


@pytest.mark.gpu
def test_torch_calls_hit_the_cache_and_still_refuse_overlap():
    torch, f = _torch_and_axpy_executor()
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


# ---- the attribute reader: torch-like tensors --------------------------------------------------

def _layout(name):
    """A (backing array, TorchLike) of one layout the key must describe as the full path does."""
    base = np.arange(4 * 8 * 6, dtype=np.float32).reshape(4, 8, 6)
    if name == "contiguous":
        a = base
    elif name == "strided":
        a = base[:, ::2, 1::3]
    elif name == "transposed":
        a = base[0].T
    elif name == "sliced":
        a = base[1:3, 2:, 4:]
    elif name == "0-d":
        a = base[1, 2, 3, ...]
    elif name == "bf16":
        a = base.astype(ml_dtypes.bfloat16)[:, :5].transpose(2, 0, 1)
    else:
        a = base.astype(np.float64)[::-1][:, 1]  # negative stride
    return TorchLike(a)


@pytest.mark.parametrize("layout", ["contiguous", "strided", "transposed", "sliced", "0-d", "bf16", "reversed"])
def test_the_attribute_key_says_what_the_full_path_view_says(full_path, faketorch, layout):
    t = _layout(layout)
    key, ptr = arrays.device_key(t, 0x5EED, None)
    arg = arrays.as_argument(t, "t")
    assert key == (TorchLike, 0, t.dtype, t.array.shape, arg.info.strides, False), f"{layout}: key {key}, view {arg.info}"
    assert ptr == arg.ptr == t.array.ctypes.data and t.exported == 0
    assert arrays.key_agrees(key, ptr, arg), f"{layout}: key {key} disagrees with the view {arg.info}"
    assert arg.info.dtype == arrays.attribute_dtype(t.dtype)


@pytest.mark.parametrize("lie", ["stride", "data_ptr", "dtype", "device"])
def test_an_attribute_key_that_disagrees_with_the_full_path_is_never_cached(full_path, faketorch, lie):
    class Lying(TorchLike):
        def stride(self):
            true = super().stride()
            return (true[0] + 1,) + true[1:] if lie == "stride" else true

        def data_ptr(self):
            return super().data_ptr() + (64 if lie == "data_ptr" else 0)

        def get_device(self):
            return 1 if lie == "device" else 0

    Lying.__module__ = "faketorch"

    def lying(a):
        return Lying(a, dtype=FakeTorchDtype("float64") if lie == "dtype" else None)

    program = strided_copy_program()
    f = StubExecutor(program)
    backing = np.zeros((8, 6), np.float32), np.zeros((8, 6), np.float32)
    for _ in range(2):
        f(lying(backing[0]), TorchLike(backing[1]))
    assert f._calls == {} and full_path["binds"] == 2, f"a key lying about its {lie} must stay a miss"


def test_torch_like_calls_hit_and_wait_on_the_producer_stream_only_when_it_differs(full_path, faketorch):
    f = StubExecutor(axpy_program())
    args = [TorchLike(np.zeros(4096, np.float32)) for _ in range(3)]
    f(*args)
    assert full_path == {"views": 3, "binds": 1} and len(f._calls) == 1
    faketorch.current[0] = 0x5EED  # torch works on the executor's own stream: nothing to order
    f(*args)
    assert full_path["binds"] == 1 and f.waits == []
    faketorch.current[0] = 0x1234  # a side stream: one wait per hit, before its launch, every hit
    f(*args)
    f(*args)
    assert f.waits == [(0x1234, 2), (0x1234, 3)] and full_path["binds"] == 1
    assert [r.kernel for r in f.last_launches] == ["axpy"]


def test_the_legacy_default_stream_has_two_handles():
    assert rt_cuda.same_stream(0, 1) and rt_cuda.same_stream(1, 0) and rt_cuda.same_stream(0x1234, 0x1234)
    assert not rt_cuda.same_stream(0, 2) and not rt_cuda.same_stream(1, 0x1234)
    f = StubExecutor(axpy_program())
    f._stream_ptr = 1  # cuda.core's default stream (CU_STREAM_LEGACY); torch's default reports NULL
    f._wait_for_stream(0)
    assert f.waits == []
    f._wait_for_stream(0x1234)
    assert f.waits == [(0x1234, 0)]


def test_the_wait_records_on_the_producer_stream_and_waits_on_the_executors(monkeypatch):
    from cuda.bindings import driver

    calls = []
    ok = driver.CUresult.CUDA_SUCCESS
    monkeypatch.setattr(driver, "cuEventRecord", lambda event, stream: calls.append(("record", event, int(stream))) or (ok,))
    monkeypatch.setattr(driver, "cuStreamWaitEvent",
                        lambda stream, event, flags: calls.append(("wait", event, int(stream))) or (ok,))
    f = StubExecutor(axpy_program())
    f.device.create_event = lambda: types.SimpleNamespace(handle="<event>")
    CudaExecutor._record_and_wait(f, 0x1234)
    CudaExecutor._record_and_wait(f, 0x1234)
    assert calls == [("record", "<event>", 0x1234), ("wait", "<event>", 0x5EED)] * 2


@pytest.mark.parametrize("change", ["shape", "stride", "dtype", "device", "requires_grad"])
def test_any_change_to_a_torch_like_key_is_a_miss(full_path, faketorch, change):
    f = StubExecutor(strided_copy_program())
    a, out = np.zeros((8, 6), np.float32), np.zeros((8, 6), np.float32)
    f(TorchLike(a), TorchLike(out))
    if change == "shape":
        other = TorchLike(np.zeros((8, 5), np.float32)), TorchLike(np.zeros((8, 5), np.float32))
    elif change == "stride":
        other = TorchLike(np.zeros((6, 8), np.float32).T), TorchLike(out)
    elif change == "dtype":
        other = TorchLike(np.zeros((8, 6), np.float64)), TorchLike(out)
    elif change == "device":
        other = TorchLike(a, device=1), TorchLike(out)
    else:
        other = TorchLike(a, requires_grad=True), TorchLike(out)
    key = f._argument_keys(other)[0]
    assert key not in f._calls
    with pytest.raises(TeccError) if change in ("dtype", "device") else _no_error():
        f(*other)
    assert full_path["binds"] == 2 or change == "device"


class _no_error:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_tensors_the_attribute_reader_refuses_take_the_full_path(faketorch):
    assert arrays.device_key(TorchLike(np.zeros(4, np.float32), neg=True), 1, None) is None
    assert arrays.device_key(TorchLike(np.zeros((3, 0), np.float32)), 1, None) is None
    cpu = TorchLike(np.zeros(4, np.float32))
    cpu.is_cuda = False
    assert arrays.device_key(cpu, 1, None) is None


def test_a_tensor_type_without_a_current_stream_is_read_through_dlpack(faketorch, monkeypatch):
    monkeypatch.delitem(sys.modules, "faketorch")  # no package that says its current stream
    t = TorchLike(np.zeros(4, np.float32))
    assert arrays.device_key(t, 1, None) is None and t.exported == 1
    assert arrays._ATTRIBUTE_TYPES[TorchLike] is None
    package = types.ModuleType("faketorch")
    package.cuda = types.SimpleNamespace(current_stream=lambda index: types.SimpleNamespace(cuda_stream=0x77))
    monkeypatch.setitem(sys.modules, "faketorch", package)
    assert arrays.producer_current_stream(TorchLike)(0) == 0x77  # torch's public accessor, when _C has none


@pytest.mark.gpu
def test_a_hit_waits_for_torch_work_queued_on_a_side_stream(monkeypatch):
    torch, f = _torch_and_axpy_executor()
    n = 1 << 20
    x, y, out = torch.zeros(n, device="cuda"), torch.ones(n, device="cuda"), torch.empty(n, device="cuda")
    f(x, y, out)  # the miss that fills the cache
    torch.cuda.synchronize()
    checked = []
    monkeypatch.setattr(f, "_call_checked", lambda args: checked.append(args))
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time on the side stream before x is written
        x.fill_(2.0)
        f(x, y, out)  # a hit: the executor's stream must wait for the fill
    torch.cuda.synchronize()
    assert checked == [], "the call on the side stream should be a launch-cache hit"
    wrong = (out != 2.5 * 2.0 + 1.0).sum().item()
    assert wrong == 0, f"axpy after a fill on torch's side stream: {wrong} of {n} elements read x before the fill"


def test_a_torch_like_hit_rechecks_alignment_and_overlap(full_path, faketorch):
    f = StubExecutor(axpy_program())
    x, y, out = (np.zeros(4097, np.float32) for _ in range(3))
    f(TorchLike(x[:4096]), TorchLike(y[:4096]), TorchLike(out[:4096]))
    with pytest.raises(ShapeError, match=r"argument 0 \(x\) of axpy: its data pointer .* is not aligned"):
        f(TorchLike(x[1:]), TorchLike(y[:4096]), TorchLike(out[:4096]))
    with pytest.raises(ShapeError, match=r"argument 0 \(x\) and argument 2 \(out\) of axpy overlap"):
        f(TorchLike(x[:4096]), TorchLike(y[:4096]), TorchLike(x[:4096]))
    assert len(f.submitted) == 1 and full_path["binds"] == 3


def test_a_call_that_leaves_its_output_out_hits_the_cache_without_reading_the_outputs_key(full_path, faketorch,
                                                                                          monkeypatch):
    """f(x, y) on torch-like tensors: the first call takes the full path (the allocator makes
    `out` with x.new_empty, the executor binds and launches) and teaches the executor; a later
    call with inputs of the same keys makes its output the same way and relaunches on its
    pointer, reading only the inputs' keys. A changed input key is a miss again."""
    from tecc.runtime.runnable import RunnableKernel

    faketorch.float32 = TORCH_DTYPES[np.dtype(np.float32)]  # the package's dtype the allocator asks for
    host = axpy_program()
    kernel = RunnableKernel(host)
    stub = kernel._executor = StubExecutor(host)
    x, y = TorchLike(np.ones(4096, np.float32)), TorchLike(np.ones(4096, np.float32))
    first = kernel(x, y)
    assert isinstance(first, TorchLike) and first.array.shape == (4096,) and full_path["binds"] == 1
    assert len(stub._allocating) == 1
    reads = []
    real_read = arrays.device_key
    monkeypatch.setattr(arrays, "device_key", lambda obj, *a: reads.append(obj) or real_read(obj, *a))
    x2, y2 = TorchLike(np.ones(4096, np.float32)), TorchLike(np.ones(4096, np.float32))
    second = kernel(x2, y2)
    assert full_path["binds"] == 1, "a hit binds nothing"
    assert reads == [x2, y2], "only the inputs' keys are read"
    params = stub.submitted[-1][3]
    assert params[:3] == [x2.data_ptr(), y2.data_ptr(), second.data_ptr()] and second is not first
    assert second.dtype is x.dtype and second.array.shape == (4096,)
    kernel(TorchLike(np.ones(100, np.float32)), TorchLike(np.ones(100, np.float32)))  # new shape: a miss
    assert full_path["binds"] == 2 and len(stub._allocating) == 2


def test_an_allocating_hit_still_rechecks_alignment(full_path, faketorch):
    from tecc.runtime.runnable import RunnableKernel

    faketorch.float32 = TORCH_DTYPES[np.dtype(np.float32)]
    host = axpy_program()
    kernel = RunnableKernel(host)
    stub = kernel._executor = StubExecutor(host)
    kernel(TorchLike(np.ones(64, np.float32)), TorchLike(np.ones(64, np.float32)))
    backing = np.ones(65, np.float32)
    shifted = TorchLike(backing[1:])  # 4 bytes off the 16-byte alignment the kernel needs
    assert stub.call_allocating((shifted, TorchLike(np.ones(64, np.float32)))) is None
    with pytest.raises(TeccError, match="align"):
        kernel(shifted, TorchLike(np.ones(64, np.float32)))


def _followed_stream_stub(host, faketorch, monkeypatch, cls=None):
    """A stub executor of `host` (a StubExecutor, or of `cls`) that follows the producer's torch
    stream (stream 0x5EED) and takes its temporaries from torch's allocator (uint8 tensors of
    the fake torch)."""
    uint8 = FakeTorchDtype("uint8")
    monkeypatch.setitem(TORCH_DTYPES, np.dtype(np.uint8), uint8)
    faketorch.uint8 = uint8
    f = (cls or StubExecutor)(host)
    f.follows_producer = True
    f._stream_ptr = 0x5EED
    f._home_stream = (f.stream, 0x5EED)
    monkeypatch.setattr(StubExecutor, "_use_stream", lambda self, handle: None)
    return f


TMA_TEMPORARY_SIZES = (256, 128, 256)


def tma_temporary_gemm():
    """The host program (built for sm_90) of C = T·Wᵀ where T = X / (row sum of X + 1) is a
    temporary the GEMM reads by TMA, as a model graph's GEMMs read its intermediates."""
    import tecc as tc

    M, K, N = TMA_TEMPORARY_SIZES
    X = tc.placeholder((M, K), "bfloat16", name="X")
    W = tc.placeholder((N, K), "bfloat16", name="W")
    r, k = tc.reduce_axis(K, name="r"), tc.reduce_axis(K, name="k")
    s = tc.compute((M,), lambda i: tc.sum(tc.cast(X[i, r], "float32"), axis=r), name="s")
    T = tc.compute((M, K), lambda i, c: tc.cast(tc.cast(X[i, c], "float32") / (s[i] + 1.0), "bfloat16"), name="T")
    C = tc.compute((M, N), lambda i, j: tc.cast(tc.sum(tc.cast(T[i, k], "float32") * tc.cast(W[j, k], "float32"),
                                                       axis=k), "bfloat16"), name="C")
    host = tc.build([X, W, C], target="cuda", arch="sm_90").host
    assert any(m.param == "T" for kern in host.kernels for m in kern.tensor_maps), "the GEMM reads T by TMA"
    return host


def test_a_tma_map_of_a_followed_stream_temporary_is_cached_and_reencoded_for_its_pointer(full_path, faketorch,
                                                                                           monkeypatch):
    """A program whose GEMM reads an intermediate (a temporary) by TMA, as a model graph's GEMMs
    read the graph's intermediates: its calls are cached like any other (they were not, and every
    call took the full path), and each hit encodes the temporary's map for the temporary's pointer
    of that call (taken from the followed torch stream)."""
    M, K, N = TMA_TEMPORARY_SIZES
    host = tma_temporary_gemm()
    f = _followed_stream_stub(host, faketorch, monkeypatch)
    monkeypatch.setattr(StubExecutor, "_tensor_map", lambda self, spec, ptr, shape, strides: ("map", spec.param, ptr))
    bf16 = ml_dtypes.bfloat16
    args = [TorchLike(np.ones((M, K), bf16)), TorchLike(np.ones((N, K), bf16)), TorchLike(np.zeros((M, N), bf16))]
    f(*args)
    assert full_path["binds"] == 1 and len(f._calls) == 1, "the call with a temporary's tensor map is cached"
    f._stream_temps.clear()  # the next call's temporaries come from the allocator afresh: new pointers
    f(*args)
    assert full_path["binds"] == 1, "a hit binds nothing"
    launches = f.submitted[-len(host.kernels):]
    t_map = next(p for _, _, _, params in launches for p in params if isinstance(p, tuple) and p[1] == "T")
    (kept,) = [entry for key, entry in f._stream_temps.items() if key[:2] == ("signature", 0x5EED)]
    t_ptr = kept[3][[name for name, _, _ in kept[0]].index("T")]
    assert t_map == ("map", "T", t_ptr), "the map is encoded for this call's temporary"
    writer = next(params for kern, _, _, params in launches if kern == "<kernel T_kernel>")
    assert t_ptr in writer, "the kernel writing T and the GEMM's map see the same temporary"


def chained_products_on_torch(f, n, seed):
    """(tecc's, float64 NumPy's) X·W·W·W·W of `f` (_chained_products(n) built for CUDA) on fresh
    CUDA torch tensors drawn from `seed`, the output poisoned before the call."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, n, device="cuda", generator=g)
    w = torch.randn(n, n, device="cuda", generator=g) / n ** 0.5
    out = torch.full((n, n), float("nan"), device="cuda")
    f(x, w, out)
    torch.cuda.synchronize()
    wd = w.double().cpu().numpy()
    return out.double().cpu().numpy(), x.double().cpu().numpy() @ wd @ wd @ wd @ wd


def _chained_products(n=32, links=4):
    """X·W·W·W·W as `links` contraction stages: the first links-1 products are temporaries, each
    live from the launch writing it to the next one reading it."""
    import tecc as tc

    X = tc.placeholder((n, n), "float32", name="X")
    W = tc.placeholder((n, n), "float32", name="W")

    def product(prev, step):
        k = tc.reduce_axis(n, name=f"k{step}")
        return tc.compute((n, n), lambda i, j: tc.sum(prev[i, k] * W[k, j], axis=k), name=f"T{step}")

    out = X
    for step in range(links):
        out = product(out, step)
    return [X, W, out]


def test_temporaries_whose_launches_do_not_overlap_share_a_storage():
    """T0 (launches 0-1) and T2 (2-3) share; T1 (1-2) overlaps both, so it has its own; a
    zero_init temporary never shares (marshal.shared_storage)."""
    import dataclasses

    import tecc as tc
    from tecc.runtime.marshal import shared_storage

    host = tc.build(_chained_products(), target="sim").host
    assert [c.kernel for c in host.calls] == ["T0_kernel", "T1_kernel", "T2_kernel", "T3_kernel"]
    storage = shared_storage(host, plan_launches(host))
    assert storage["T0"] == storage["T2"] and storage["T1"] != storage["T0"], storage
    zeroed = dataclasses.replace(host, temps=tuple(dataclasses.replace(t, zero_init=t.name == "T0")
                                                   for t in host.temps))
    storage = shared_storage(zeroed, plan_launches(zeroed))
    assert storage["T0"] == "T0" and storage["T2"] != storage["T1"], storage


def test_followed_stream_temporaries_of_disjoint_launches_get_one_pointer(full_path, faketorch, monkeypatch):
    """On torch's allocator (a followed stream) T0 and T2 are one allocation, on the full path
    and on a launch-cache hit; T1, alive between them, is another."""
    import tecc as tc

    host = tc.build(_chained_products(), target="sim").host
    f = _followed_stream_stub(host, faketorch, monkeypatch)
    args = [TorchLike(np.ones((32, 32), np.float32)) for _ in range(3)]
    for call in range(2):
        f(*args)
        # each launch's pointer for each temporary it passes, by the host program's argument names
        seen = [{name: params[pos] for pos, name in enumerate(c.args) if name.startswith("T") and name != "T3"}
                for c, (_, _, _, params) in zip(host.calls, f.submitted[-4:])]
        assert seen[0]["T0"] == seen[1]["T0"] and seen[1]["T1"] == seen[2]["T1"] and seen[2]["T2"] == seen[3]["T2"]
        assert seen[0]["T0"] == seen[2]["T2"] and seen[1]["T1"] != seen[1]["T0"], (call, seen)
    assert (f.calls_checked, f.calls_cached) == (1, 1)


@pytest.mark.gpu
def test_chained_products_with_shared_temporaries_match_float64_on_torch_tensors():
    """X·W·W·W·W on CUDA torch tensors, whose temporaries T0 and T2 share one allocation from
    torch's allocator: three calls (the first checked, then launch-cache hits, fresh inputs each)
    against NumPy in float64."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    import tecc as tc

    n = 256
    f = tc.build(_chained_products(n), target="cuda")
    for seed in range(3):
        got, want = chained_products_on_torch(f, n, seed)
        worst = np.unravel_index(np.argmax(np.abs(got - want)), want.shape)
        assert np.allclose(got, want, rtol=1e-4, atol=1e-4), (seed, worst, got[worst], want[worst], f.plan)
    executor = f.executor
    assert executor._storage["T0"] == executor._storage["T2"] and executor.calls_cached == 2


def test_a_prepared_launch_runs_a_followed_call_on_new_pointers(full_path, faketorch, monkeypatch):
    """CudaExecutor.prepared (what a registered torch op relaunches with, tecc/torch/ops.py): a
    cached call of one launch on torch tensors, its stream the producer's, made a callable of
    the data pointers. It launches on new pointers without reading a key or taking the full
    path, and refuses (launching nothing) a misaligned pointer, a stale entry and an executor
    whose launches are watched (debug_sync)."""
    from tecc.runtime.launch_cache import LaunchEntry

    f = _followed_stream_stub(axpy_program(), faketorch, monkeypatch)
    launched = []
    monkeypatch.setattr(rt_cuda, "_cuda_core_launch",
                        lambda stream, config, kernel, *params: launched.append((stream.handle, kernel, params)))
    cached = f.keyed_call(tuple(TorchLike(np.zeros(4096, np.float32)) for _ in range(3)))
    assert cached is not None and cached.follow
    go = f.prepared(LaunchEntry(cached, f.cache_generation))
    assert go is not None
    seen = dict(full_path)
    ptrs = [0x9000_0000, 0x9010_0000, 0x9020_0000]
    assert go(ptrs) and len(launched) == 1 and full_path == seen
    stream, kernel, params = launched[0]
    assert stream == 0x5EED and kernel == "<kernel axpy>" and [p for p in params if p in ptrs] == ptrs
    assert f.calls_relaunched == 1 and [r.kernel for r in f.last_launches] == ["axpy"]
    assert not go([0x9000_0004, 0x9010_0000, 0x9020_0000]) and len(launched) == 1
    f.debug_sync = True
    assert not go(ptrs) and len(launched) == 1
    f.debug_sync = False
    f.cache_generation += 1
    assert not go(ptrs) and len(launched) == 1


def test_a_call_of_several_launches_is_not_prepared(full_path, faketorch, monkeypatch):
    from test_runtime_graphs import two_kernel_program

    from tecc.runtime.launch_cache import LaunchEntry

    f = _followed_stream_stub(two_kernel_program(), faketorch, monkeypatch)
    cached = f.keyed_call(tuple(TorchLike(np.zeros(4096, np.float32)) for _ in range(3)))
    assert cached is not None and f.prepared(LaunchEntry(cached, f.cache_generation)) is None
