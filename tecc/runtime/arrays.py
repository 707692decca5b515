"""Arrays at the runtime's boundary: what an argument looks like to argument binding
(`describe`), how it reaches a kernel, and the copies between host and device.

Two kinds of argument (docs/runtime.md, "Arguments"):

- **Host arrays** -- NumPy arrays, and any DLPack object living in CPU memory (a CPU torch
  tensor). They are *staged*: the runtime uploads a C-contiguous copy to the device before the
  launches and copies the outputs back into the caller's array after them. Because the kernel
  only ever sees the contiguous copy, a non-contiguous NumPy array is accepted for any buffer.
- **Device arrays** -- any DLPack or `__cuda_array_interface__` object in GPU memory (torch,
  CuPy, JAX, a cuda.core `StridedMemoryView`). They are used *in place*: the kernel gets their
  data pointer and argument binding checks their shape, strides and dtype as they are.

cuda.core's `StridedMemoryView` does the interop (DLPack first, then the CUDA array interface):
it gives the data pointer (element 0), shape, strides in elements and the NumPy dtype, with
bfloat16 from ml_dtypes. Nothing here imports cuda.core at module level, so describing NumPy
arrays works on a machine without CUDA.
"""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ..ir import dtype as dt
from ..ir.dtype import DType
from ..ir.errors import DTypeError, ShapeError, TeccError
from .host import ArrayInfo, contiguous_strides

# DLPack device types (dlpack.h, DLDeviceType) the runtime tells apart.
KDL_CPU = 1
KDL_CUDA = 2
KDL_CUDA_HOST = 3  # pinned host memory, device-accessible
KDL_CUDA_MANAGED = 13

# DLPack type codes (dlpack.h, DLDataTypeCode) and the tecc dtype of each (code, bits).
KDL_INT, KDL_UINT, KDL_FLOAT, KDL_BFLOAT, KDL_BOOL = 0, 1, 2, 4, 6
KDL_FLOAT8_E4M3FN, KDL_FLOAT8_E5M2 = 10, 12  # dlpack.h 1.1: kDLFloat8_e4m3fn, kDLFloat8_e5m2
_FROM_DLPACK: dict[tuple[int, int], DType] = {
    (KDL_INT, 32): dt.int32,
    (KDL_INT, 64): dt.int64,
    (KDL_FLOAT, 16): dt.float16,
    (KDL_FLOAT, 32): dt.float32,
    (KDL_FLOAT, 64): dt.float64,
    (KDL_BFLOAT, 16): dt.bfloat16,
    (KDL_BOOL, 8): dt.bool_,
    (KDL_FLOAT8_E4M3FN, 8): dt.float8_e4m3,
    (KDL_FLOAT8_E5M2, 8): dt.float8_e5m2,
}
_TO_DLPACK: dict[DType, tuple[int, int]] = {d: key for key, d in _FROM_DLPACK.items()}
_CODE_NAMES = {KDL_INT: "int", KDL_UINT: "uint", KDL_FLOAT: "float", 3: "opaque handle", KDL_BFLOAT: "bfloat",
               5: "complex", KDL_BOOL: "bool"}


def dtype_from_dlpack(code: int, bits: int, lanes: int = 1) -> DType:
    """The tecc dtype of a DLPack `DLDataType` (code, bits, lanes); DTypeError if none."""
    if lanes != 1:
        raise DTypeError(f"DLPack vector dtypes (lanes={lanes}) are not supported; pass a scalar-typed array")
    found = _FROM_DLPACK.get((code, bits))
    if found is None:
        name = f"{_CODE_NAMES.get(code, f'code {code}')}{bits}"
        raise DTypeError(f"DLPack dtype {name} has no tecc equivalent; use one of {', '.join(dt.ALL_DTYPES)}")
    return found


def dlpack_dtype(dtype: DType) -> tuple[int, int, int]:
    """The DLPack `DLDataType` (code, bits, lanes) of a tecc dtype."""
    code, bits = _TO_DLPACK[dtype]
    return code, bits, 1


def tecc_dtype(np_dtype: Any) -> DType:
    """The tecc dtype of a NumPy dtype (bfloat16 from ml_dtypes included); DTypeError if none.

    Non-native byte order is refused: the device reads little-endian values."""
    d = np.dtype(np_dtype)
    found = _TECC_DTYPES.get(d)
    if found is not None:
        return found
    if not d.isnative:
        raise DTypeError(f"dtype {d.str} has non-native byte order; convert with a.astype(a.dtype.newbyteorder('='))")
    found = dt.as_dtype(d)
    _TECC_DTYPES[d] = found
    return found


# NumPy dtype -> tecc dtype, filled on first sight: `dt.as_dtype` costs ~8 us (it tries the
# ml_dtypes comparisons), a dict hit ~0.1 us. NumPy dtypes hash and compare by kind, size and
# byte order, so a cached answer is the one `as_dtype` would give again; only successes are kept.
_TECC_DTYPES: dict[np.dtype, DType] = {}


# ---- describing arguments ----------------------------------------------------------------------

def is_host_array(obj: Any) -> bool:
    """True for arrays the runtime stages through host memory: NumPy arrays and CPU DLPack objects."""
    if isinstance(obj, np.ndarray):
        return True
    # Look on the type: evaluating the attribute may raise (torch refuses it for a tensor that
    # requires grad), and that refusal should surface where the view is made, naming the argument.
    if hasattr(type(obj), "__cuda_array_interface__") or hasattr(obj, "__cuda_array_interface__"):
        return False
    device = getattr(obj, "__dlpack_device__", None)
    if device is not None:
        return int(device()[0]) == KDL_CPU
    raise TeccError(
        f"cannot pass a {type(obj).__name__} as an array: expected a NumPy array or an object "
        "supporting DLPack or __cuda_array_interface__ (torch, CuPy, JAX, ...)"
    )


def numpy_info(a: np.ndarray) -> ArrayInfo:
    """Shape, strides in elements and dtype of a NumPy array, as it is (not as it will be staged)."""
    dtype = tecc_dtype(a.dtype)
    itemsize = a.dtype.itemsize
    strides = []
    for s in a.strides:
        if s % itemsize != 0:
            raise ShapeError(
                f"array strides {a.strides} (bytes) are not multiples of the element size {itemsize}; "
                "pass np.ascontiguousarray(a)"
            )
        strides.append(s // itemsize)
    return ArrayInfo(tuple(int(n) for n in a.shape), tuple(strides), dtype)


def strided_view(obj: Any, stream_ptr: int = -1) -> Any:
    """cuda.core's `StridedMemoryView` of a DLPack / CUDA-array-interface object.

    `stream_ptr` is the consumer stream: the producer's pending work on the array is ordered
    before it (DLPack passes it to `__dlpack__(stream=...)`, the CUDA array interface waits on an
    event); -1 asks for no ordering (metadata only)."""
    from cuda.core.utils import StridedMemoryView

    try:
        return StridedMemoryView.from_any_interface(obj, stream_ptr)
    except (BufferError, NotImplementedError, TypeError, ValueError, RuntimeError) as exc:
        # RuntimeError: the producer refused to export (torch: a tensor that requires grad)
        retyped = _fp8_byte_view(obj, stream_ptr)
        if retyped is not None:
            return retyped
        raise TeccError(f"cannot view {type(obj).__name__} as a strided device array: {exc}") from exc


class Fp8View:
    """The StridedMemoryView of an fp8 torch tensor's bytes (its `view(torch.uint8)`: cuda.core
    refuses torch's fp8 DLPack codes, "Unsupported AOTI dtype code: 24"), standing for the tensor:
    the bytes' pointer, shape, strides and stream ordering, the tensor's own tecc dtype."""

    def __init__(self, view: Any, dtype: DType) -> None:
        self._view, self.tecc_dtype = view, dtype

    def __getattr__(self, name: str) -> Any:
        return getattr(self._view, name)


def _fp8_byte_view(obj: Any, stream_ptr: int) -> Fp8View | None:
    """`Fp8View` of a torch fp8 tensor, or None for anything else."""
    from cuda.core.utils import StridedMemoryView

    torch = sys.modules.get("torch")
    if torch is None or not isinstance(obj, torch.Tensor):
        return None
    dtype = attribute_dtype(obj.dtype)
    if dtype is None or not dtype.name.startswith("float8"):
        return None
    try:
        return Fp8View(StridedMemoryView.from_any_interface(obj.view(torch.uint8), stream_ptr), dtype)
    except (BufferError, NotImplementedError, TypeError, ValueError, RuntimeError):
        return None


def view_info(view: Any) -> ArrayInfo:
    """Shape, strides in elements and dtype of a `StridedMemoryView` (strides None = contiguous)."""
    shape = tuple(int(n) for n in view.shape)
    strides = view.strides
    return ArrayInfo(shape, contiguous_strides(shape) if strides is None else tuple(int(s) for s in strides),
                     _view_dtype(view))


def _view_dtype(view: Any) -> DType:
    """The tecc dtype of a StridedMemoryView. cuda.core may name no NumPy dtype for DLPack's fp8
    codes (kDLFloat8_e4m3fn, kDLFloat8_e5m2: torch.float8_e4m3fn tensors); the producer's own
    dtype (by name, `attribute_dtype`) says it then."""
    if isinstance(view, Fp8View):
        return view.tecc_dtype
    try:
        np_dtype = view.dtype
    except (TypeError, NotImplementedError, ValueError) as exc:
        found = attribute_dtype(getattr(getattr(view, "exporting_obj", None), "dtype", None))
        if found is None:
            raise DTypeError(f"the array's dtype has no tecc equivalent ({exc})") from exc
        return found
    return tecc_dtype(np_dtype)


def describe(arg: Any) -> ArrayInfo:
    """What argument binding needs of `arg`: its shape, strides in elements and tecc dtype.

    NumPy arrays are described as they are (a non-contiguous array reports its strides; the
    executor stages a contiguous copy, see `as_argument`); device arrays through cuda.core's
    StridedMemoryView, without stream ordering."""
    if is_host_array(arg):
        return numpy_info(_as_numpy(arg))
    return view_info(strided_view(arg, -1))


def _as_numpy(obj: Any) -> np.ndarray:
    if isinstance(obj, np.ndarray):
        return obj
    try:
        return np.from_dlpack(obj)
    except (BufferError, TypeError, RuntimeError) as exc:
        raise TeccError(
            f"cannot read the CPU {type(obj).__name__} through DLPack ({exc}); pass a NumPy array instead"
        ) from exc


# ---- arguments ready to launch ----------------------------------------------------------------

@dataclass
class Argument:
    """One array argument, described and ready to launch.

    Host path: `staged` is the C-contiguous host array that is uploaded (and that outputs are
    downloaded into); `writeback` is the caller's array when `staged` is a copy of it, so results
    are copied on into it. Device path: `ptr` is the data pointer the kernel gets and `view`
    keeps the StridedMemoryView (and through it the producer's array) alive."""

    source: Any
    info: ArrayInfo  # as the kernel sees it: the staged copy for host arrays
    staged: np.ndarray | None = None
    writeback: np.ndarray | None = None
    ptr: int = 0
    device_id: int = -1
    readonly: bool = False
    view: Any = None

    @property
    def is_host(self) -> bool:
        return self.staged is not None

    @property
    def nbytes(self) -> int:
        count = 1
        for n in self.info.shape:
            count *= n
        return count * self.info.dtype.bytes


def as_argument(obj: Any, where: str = "argument", stream_ptr: int = -1) -> Argument:
    """Describe `obj` for a launch. Host arrays get a C-contiguous staging array (no copy when
    already contiguous); device arrays a StridedMemoryView ordered after the producer's work on
    `stream_ptr`. Errors name `where` ("argument 1 (B) of matmul")."""
    try:
        if is_host_array(obj):
            array = _as_numpy(obj)
            staged = array if array.flags.c_contiguous else array.copy(order="C")
            info = numpy_info(staged)
            return Argument(obj, info, staged=staged, writeback=None if staged is array else array,
                            readonly=not array.flags.writeable)
        view = strided_view(obj, stream_ptr)
        if not view.is_device_accessible:
            raise TeccError("its memory is not accessible from the GPU")
        return Argument(obj, view_info(view), ptr=int(view.ptr), device_id=int(view.device_id),
                        readonly=bool(view.readonly), view=view)
    except TeccError as exc:
        raise type(exc)(f"{where}: {exc}") from exc


# ---- device memory ----------------------------------------------------------------------------

def allocate(device: Any, nbytes: int, stream: Any) -> Any:
    """A cuda.core device Buffer of at least `nbytes` (at least 1 byte, so a zero-size array
    still gets a valid pointer), stream-ordered on `stream` from the device's memory resource."""
    return device.allocate(max(int(nbytes), 1), stream=stream)


def _host_buffer(array: np.ndarray) -> Any:
    from cuda.core import Buffer

    # A non-owning cuda.core Buffer over the NumPy data; `owner` keeps the array alive.
    # cuMemcpyAsync accepts pageable host pointers under unified addressing (64-bit Linux).
    return Buffer.from_handle(array.ctypes.data, array.nbytes, owner=array)


def _prefix(buf: Any, nbytes: int) -> Any:
    """The first `nbytes` of device Buffer `buf` (Buffer copies need equal sizes)."""
    if buf.size == nbytes:
        return buf
    from cuda.core import Buffer

    return Buffer.from_handle(int(buf.handle), nbytes, owner=buf)


def upload(array: np.ndarray, dst: Any, stream: Any) -> None:
    """Copy the C-contiguous host `array` into the start of device Buffer `dst` on `stream`."""
    if array.nbytes == 0:
        return
    _prefix(dst, array.nbytes).copy_from(_host_buffer(array), stream=stream)


def download(src: Any, array: np.ndarray, stream: Any) -> None:
    """Copy the start of device Buffer `src` into the C-contiguous, writeable host `array` on
    `stream`. The copy into pageable memory completes before the call returns (CUDA's rule for
    device-to-pageable copies), but callers still synchronize `stream` to see kernel errors."""
    if array.nbytes == 0:
        return
    _prefix(src, array.nbytes).copy_to(_host_buffer(array), stream=stream)


def to_device(array: np.ndarray, device: Any, stream: Any) -> Any:
    """A new device Buffer holding a C-contiguous copy of `array`."""
    staged = array if array.flags.c_contiguous else array.copy(order="C")
    buf = allocate(device, staged.nbytes, stream)
    upload(staged, buf, stream)
    return buf


# ---- fast argument keys (the executor's launch cache) ------------------------------------------
#
# A repeated call with device arrays of the same layout should not pay for a StridedMemoryView per
# argument. `device_key` reads what argument checking depends on straight from the argument and
# returns it as a hashable key, plus the data pointer. Three readers, tried in this order:
#
# - **attributes**, for torch-like tensors (`data_ptr()`, `shape`, `stride()`, `dtype`,
#   `get_device()`, ...; detected on the class, torch is never imported): each is a C call of
#   ~0.1 us, where torch's `__dlpack__(stream=...)` costs ~15 us (Python, and a torch Stream
#   object per call). Reading attributes orders no stream, so the executor does what `__dlpack__`
#   would have done on every hit: its stream waits on the producer's current stream
#   (`producer_stream`) when the two differ;
# - the DLPack capsule's DLTensor (DLPack first, as StridedMemoryView does);
# - the `__cuda_array_interface__` dict.
#
# The executor only trusts a key it has seen agree with the full path (`key_agrees`), so a reader
# that misreads some producer costs misses, never a wrong launch.

# dlpack.h: DLManagedTensorVersioned.flags bit 0 marks a read-only tensor.
DLPACK_FLAG_READ_ONLY = 1


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):  # dlpack.h before 1.0: capsule name "dltensor"
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


class _DLManagedTensorVersioned(ctypes.Structure):  # dlpack.h 1.x: capsule name "dltensor_versioned"
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p), ("flags", ctypes.c_uint64), ("dl_tensor", _DLTensor)]


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_capsule_name = ctypes.pythonapi.PyCapsule_GetName
_capsule_name.restype = ctypes.c_char_p
_capsule_name.argtypes = [ctypes.py_object]


def device_key(obj: Any, stream_ptr: int, pointer_device: Any) -> tuple[tuple[Any, ...], int] | None:
    """(key, data pointer) of a device array, read from its DLPack capsule or CUDA array interface,
    or None when this argument must take the full path (host arrays, zero-size arrays, producers
    that do not answer the way the reader expects, a CUDA-array-interface stream to wait on).

    The key holds what the checks read: the device, dtype, shape, strides and read-only flag as
    the producer reports them. A torch-like tensor read by attribute orders no stream: the caller
    must make `stream_ptr` wait on `producer_stream(key)`'s answer before launching.
    `__dlpack__(stream=stream_ptr)` is called every time, so the producer still orders its pending
    work before the consumer stream (DLPack's rule), exactly as the full path's StridedMemoryView
    does. For a CUDA-array-interface object the device is the pointer's (`pointer_device(ptr)`,
    cuPointerGetAttribute), since the dict does not say it."""
    kind = type(obj)
    if kind is np.ndarray:
        return None
    current_stream = _ATTRIBUTE_TYPES.get(kind, _UNSEEN)
    if current_stream is _UNSEEN:
        current_stream = _learn_attribute_type(kind)
    try:
        if current_stream is not None:
            return _attribute_key(obj, kind)
        if hasattr(kind, "__dlpack__"):
            return _dlpack_key(obj, stream_ptr)
        cai = getattr(obj, "__cuda_array_interface__", None)
        if cai is not None:
            return _cai_key(cai, stream_ptr, pointer_device)
    except Exception:  # noqa: BLE001 - whatever the producer raises, the full path reports it properly
        return None
    return None


# ---- the attribute reader ----------------------------------------------------------------------

# What a class must have to be read by attribute: torch.Tensor's accessors, each answered in C.
TENSOR_ATTRIBUTES = ("data_ptr", "stride", "shape", "dtype", "is_cuda", "get_device", "requires_grad",
                     "is_neg", "is_conj", "__dlpack__")

_UNSEEN = object()

# Argument type -> its producer's current-stream reader (device ordinal -> CUstream handle), or
# None for a type read otherwise; filled on first sight of each type.
_ATTRIBUTE_TYPES: dict[type, Callable[[int], int] | None] = {}


def _learn_attribute_type(kind: type) -> Callable[[int], int] | None:
    """Whether `kind` is read by attribute: it has every TENSOR_ATTRIBUTES and its producer says
    what its current stream is (`producer_current_stream`); the answer is kept for the type."""
    current_stream = None
    if all(hasattr(kind, name) for name in TENSOR_ATTRIBUTES):
        current_stream = producer_current_stream(kind)
    _ATTRIBUTE_TYPES[kind] = current_stream
    return current_stream


def producer_current_stream(kind: type) -> Callable[[int], int] | None:
    """The function giving the CUstream handle a torch-like producer is queuing work on for a
    device ordinal, found in the package that defines `kind` (already imported, since `kind`'s
    instances exist): `_C._cuda_getCurrentRawStream` (torch's C accessor, what Triton and
    Inductor call, ~0.1 us), else `cuda.current_stream(index).cuda_stream` (public, ~2 us).
    None when neither exists: the type is then read through DLPack."""
    package = sys.modules.get(kind.__module__.partition(".")[0])
    raw = getattr(getattr(package, "_C", None), "_cuda_getCurrentRawStream", None)
    if callable(raw):
        return raw  # type: ignore[no-any-return]
    current = getattr(getattr(package, "cuda", None), "current_stream", None)
    if callable(current):
        return lambda index: int(current(index).cuda_stream)
    return None


def current_stream_reader(obj: Any) -> Callable[[int], int] | None:
    """For a device tensor read by attribute (torch), its producer's current-stream reader
    (device ordinal -> CUstream handle); None for anything else (NumPy, CPU tensors, DLPack and
    CUDA-array-interface objects)."""
    kind = type(obj)
    if kind is np.ndarray:
        return None
    reader = _ATTRIBUTE_TYPES.get(kind, _UNSEEN)
    if reader is _UNSEEN:
        reader = _learn_attribute_type(kind)
    if reader is None or not getattr(obj, "is_cuda", False):
        return None
    return reader  # type: ignore[return-value]


def allocate_like(obj: Any, nbytes: int, zero: bool) -> tuple[int, Any]:
    """(data pointer, owner) of `nbytes` of device memory (at least 1) from the allocator of the
    torch-like tensor `obj`'s package, on its device and its current stream (torch's caching
    allocator: stream-ordered, and taken from the graph's private pool under CUDA-graph
    capture); zeroed on that stream when `zero`. The memory lives as long as `owner`."""
    package = sys.modules[type(obj).__module__.partition(".")[0]]
    make = obj.new_zeros if zero else obj.new_empty
    owner = make((max(int(nbytes), 1),), dtype=package.uint8)
    return int(owner.data_ptr()), owner


SIGNATURES_KEPT = 8  # per executor: the call signatures whose arena pointers stream_temporaries remembers


def stream_temporaries(obj: Any, temps: Sequence[tuple[str, int, bool]], kept: dict[Any, Any],
                       stream_ptr: int, storage: Mapping[str, str] | None = None,
                       ranges: Mapping[str, tuple[int, int]] | None = None) -> tuple[list[int], list[Any]]:
    """(data pointers, owners) of a call's kernel temporaries, each (name, bytes, zero_init), for
    a call on torch-like `obj`'s current stream `stream_ptr`. Temporaries whose launches do not
    overlap share memory: placed by their live ranges (`ranges`, marshal.live_ranges:
    arena.layout), or grouped by `storage[name]` (marshal.shared_storage) without them.

    Under CUDA-graph capture each call takes its own from the graph's pool (allocate_like: one
    block laid out by storage, a zero_init temporary apart), so replays find them where the
    capture put them. Otherwise they live in the stream's arena (arena.py), which every executor
    calling on that stream shares: launches on one stream run in order, so no program's
    temporaries are in use while another's kernels run, and a stream holds one working set (its
    largest program's), not one per program. A zero_init temporary (left zero by every kernel
    that changes it) is kept apart in `kept` under (stream, its storage). This saves the
    allocation (and for zero_init the memset) of every call, and gives a repeated call the same
    pointers (what the executor's CUDA graphs are keyed by). `kept` also remembers, per call
    signature `temps`, its layout and pointers in the arena last used (and so holds that arena).
    Whether the stream is capturing is asked once per call."""
    from . import arena

    package = sys.modules[type(obj).__module__.partition(".")[0]]
    # torch's C entry point when there is one (its Python wrapper costs a microsecond per call)
    capturing = getattr(getattr(package, "_C", None), "_cuda_isCurrentStreamCapturing", None)
    if (capturing or package.cuda.is_current_stream_capturing)():
        plan = arena.layout(temps, storage, ranges)
        base, block = allocate_like(obj, plan.nbytes, False) if plan.nbytes else (0, None)
        ptrs, owners = [], [block]
        for (_, nbytes, zero), offset in zip(temps, plan.offsets):
            if offset is None:
                ptr, owner = allocate_like(obj, nbytes, zero)
                ptrs.append(ptr)
                owners.append(owner)
            else:
                ptrs.append(base + offset)
        return ptrs, owners
    signature = ("signature", stream_ptr, id(temps))
    entry = kept.get(signature)
    if entry is None or entry[0] is not temps:
        known = [k for k in kept if k[0] == "signature"]
        if len(known) >= SIGNATURES_KEPT:  # a new tuple each full-path call: forget the old ones
            for k in known:
                del kept[k]
        entry = (temps, arena.layout(temps, storage, ranges), None, [], [])
    plan = entry[1]
    area = arena.stream_arena(getattr(obj, "device", None), stream_ptr, plan.nbytes,
                              lambda nbytes: allocate_like(obj, nbytes, False)) if plan.nbytes else None
    if entry[2] is area and entry[3]:
        return entry[3], entry[4]
    ptrs = []
    owners: list[Any] = [area]
    for (name, nbytes, zero), offset in zip(temps, plan.offsets):
        if offset is not None:
            assert area is not None
            ptrs.append(area.ptr + offset)
            continue
        key = ("zero_init", stream_ptr, storage[name] if storage is not None else name)
        found = kept.get(key)
        if found is None or found[2] < nbytes:
            ptr, owner = allocate_like(obj, nbytes, zero)
            found = kept[key] = (ptr, owner, nbytes)
        ptrs.append(found[0])
        owners.append(found[1])
    kept[signature] = (temps, plan, area, ptrs, owners)
    return ptrs, owners


def producer_stream(key: tuple[Any, ...]) -> Callable[[int], int] | None:
    """For a key read by attribute, its producer's current-stream reader (what the executor must
    wait on before launching); None for DLPack and CUDA-array-interface keys, whose reading
    already ordered the streams or found nothing to order."""
    kind = key[0]
    return _ATTRIBUTE_TYPES.get(kind) if isinstance(kind, type) else None


def _attribute_key(obj: Any, kind: type) -> tuple[tuple[Any, ...], int] | None:
    """Key and pointer of a torch-like tensor: (type, device ordinal, dtype object, shape, strides
    in elements, requires_grad), or None when it must take the full path: not on a CUDA device,
    a conjugate or negative view (torch's lazy bits: the memory does not hold the values the
    tensor stands for), zero-size.

    The type is in the key so that a subclass is judged apart from its base; requires_grad so
    that whatever the full path decides for such a tensor holds for every tensor with the key."""
    if not obj.is_cuda or obj.is_neg() or obj.is_conj():
        return None
    shape = obj.shape
    if 0 in shape:
        return None
    ptr = obj.data_ptr()
    if not ptr:
        return None
    return (kind, obj.get_device(), obj.dtype, shape, obj.stride(), obj.requires_grad), ptr


def attribute_dtype(producer_dtype: Any) -> DType | None:
    """The tecc dtype of a torch-like dtype object, from its name (`torch.bfloat16` ->
    bfloat16, `torch.float8_e4m3fn` -> float8_e4m3); None when tecc has no such dtype."""
    name = str(producer_dtype).rpartition(".")[2]
    return dt.ALL_DTYPES.get(name) or (dt.as_dtype(name) if name in ("float8_e4m3fn",) else None)


def _dlpack_key(obj: Any, stream_ptr: int) -> tuple[tuple[Any, ...], int] | None:
    device_type, device_id = obj.__dlpack_device__()
    if int(device_type) != KDL_CUDA:
        return None
    try:
        capsule = obj.__dlpack__(stream=stream_ptr, max_version=(1, 0))
    except TypeError:  # a producer from before DLPack 1.0 takes no max_version
        capsule = obj.__dlpack__(stream=stream_ptr)
    name = _capsule_name(capsule)
    if name == b"dltensor_versioned":
        managed = _DLManagedTensorVersioned.from_address(_capsule_pointer(capsule, name))
        readonly = bool(managed.flags & DLPACK_FLAG_READ_ONLY)
        tensor = managed.dl_tensor
    elif name == b"dltensor":
        tensor = _DLManagedTensor.from_address(_capsule_pointer(capsule, name)).dl_tensor
        readonly = False
    else:
        return None
    ndim = tensor.ndim
    shape = tuple(tensor.shape[:ndim]) if ndim else ()
    if 0 in shape or not tensor.data:
        return None  # zero-size: the full path substitutes a dummy pointer; not worth a cache entry
    strides = tuple(tensor.strides[:ndim]) if ndim and tensor.strides else None
    dtype = tensor.dtype
    key = ("dlpack", int(tensor.device.device_type), int(tensor.device.device_id),
           (dtype.code, dtype.bits, dtype.lanes), shape, strides, readonly)
    # `capsule` is dropped unconsumed on return: its destructor calls the producer's deleter.
    return key, int(tensor.data) + int(tensor.byte_offset)


def _cai_key(cai: Any, stream_ptr: int, pointer_device: Any) -> tuple[tuple[Any, ...], int] | None:
    stream = cai.get("stream")
    if stream is not None and stream != stream_ptr:
        return None  # the producer's stream must be waited on: the full path records that event
    ptr, readonly = cai["data"]
    shape = tuple(cai["shape"])
    if 0 in shape or not ptr:
        return None
    strides = cai.get("strides")
    key = ("cai", cai["typestr"], shape, None if strides is None else tuple(strides), bool(readonly),
           int(pointer_device(ptr)))
    return key, int(ptr)


def key_agrees(key: tuple[Any, ...], ptr: int, arg: Argument) -> bool:
    """Whether `device_key`'s reading of an argument says what the full path's Argument says
    (pointer, device, dtype, shape, strides in elements, read-only): only then may the key stand
    for the Argument on later calls."""
    if arg.is_host or arg.ptr != ptr:
        return False
    try:
        if isinstance(key[0], type):
            _, device_id, producer_dtype, shape, strides, _ = key
            found = attribute_dtype(producer_dtype)
            if found is None:
                return False
            dtype, readonly = found, False  # torch has no read-only tensors
        elif key[0] == "dlpack":
            _, device_type, device_id, (code, bits, lanes), shape, strides, readonly = key
            if device_type != KDL_CUDA:
                return False
            dtype = dtype_from_dlpack(code, bits, lanes)
        else:
            _, typestr, shape, byte_strides, readonly, device_id = key
            dtype = tecc_dtype(typestr)
            strides = None if byte_strides is None else _element_strides(byte_strides, dtype.bytes)
    except (DTypeError, TypeError, ValueError):
        return False
    if device_id != arg.device_id or readonly != arg.readonly:
        return False
    if strides is None:
        strides = contiguous_strides(shape)
    return arg.info == ArrayInfo(tuple(shape), tuple(strides), dtype)


def _element_strides(byte_strides: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    if any(s % itemsize for s in byte_strides):
        raise ValueError(f"byte strides {byte_strides} are not multiples of the element size {itemsize}")
    return tuple(s // itemsize for s in byte_strides)
