"""Tensor maps at launch: what a TMA kernel's by-value `CUtensorMap` parameters need, their
encoding (cuTensorMapEncodeTiled), and a launch that passes them.

A kernel that uses TMA tile copies (tecc/ir/tma_stmt.py) takes, after its ordinary parameters,
one 128-byte tensor map per global buffer it copies from, in the order of
`KernelInfo.tensor_maps`. The IR fixes only the map's element type, box and swizzle
(`TensorMapSpec`, stored in the artifact manifest); its global part -- the base address, every
dimension and stride -- comes from the array bound to the buffer at each launch, so a kernel
with a symbolic M is encoded anew for each M, by the runtime alone (a loaded artifact needs no
compiler).

- `TensorMapSpec`: kernel parameter name, dtype, box (outermost first, as tecc's indices), swizzle,
  and the runs of the array's dimensions the map merges (`merge`, tecc/ir/tma_stmt.py).
- `encode_arguments(spec, ptr, shape, strides)`: the arguments of cuTensorMapEncodeTiled, in the
  driver's order (innermost dimension first), checked: merged dimensions whose strides chain,
  16-byte aligned base and strides, a contiguous innermost dimension, dimensions below 2^32,
  strides below 2^40. Pure; the CPU tests check it.
- `encode_tensor_map(args)`: the driver call (needs a GPU); returns the 128 map bytes.
- `pack_parameters(params)`: the `void*[]` kernelParams array of a launch whose parameters are
  pointers (int), NumPy scalars and encoded maps (`EncodedTensorMap`); cuda.core's `launch`
  takes no raw structure by value (it accepts its own TensorMapDescriptor only), so these
  launches go through cuLaunchKernel (`prepare_packed`: a packed launch kept and repeated per configuration, stream and parameters). Pure up to the addresses; the CPU tests
  read the packed bytes back.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ..ir import dtype as dt
from ..ir.dtype import DType
from ..ir.errors import LaunchError, ShapeError
from ..ir.tma_stmt import merged_geometry, unchained

TENSOR_MAP_BYTES = 128
TENSOR_MAP_ALIGN = 64
GLOBAL_ALIGN = 16
MAX_DIM = 1 << 32
MAX_STRIDE = 1 << 40

# CUtensorMapDataType values (cuda.h): the element types tecc copies with TMA
DATA_TYPES: dict[str, int] = {"uint8": 0, "uint16": 1, "int32": 3, "int64": 5, "float16": 6,
                              "float32": 7, "float64": 8, "bfloat16": 9, "int8": 0,
                              # fp8 moves as bytes (CU_TENSOR_MAP_DATA_TYPE_UINT8): TMA copies, never converts
                              "float8_e4m3": 0, "float8_e5m2": 0}
# CUtensorMapSwizzle values
SWIZZLES = {"none": 0, "32B": 1, "64B": 2, "128B": 3}
INTERLEAVE_NONE = 0
L2_PROMOTION_256B = 3
OOB_FILL_NONE = 0   # out-of-bounds elements read as zeros


@dataclass(frozen=True)
class TensorMapSpec:
    """One tensor-map parameter: the kernel's global buffer parameter `param` seen as boxes of
    `box` elements (outermost first) of `dtype`, written to shared memory with `swizzle`."""

    param: str
    dtype: DType
    box: tuple[int, ...]
    swizzle: str
    merge: tuple[int, ...] = ()   # array dimensions per map dimension; (): one each

    @property
    def name(self) -> str:
        return f"{self.param}_tmap"

    def to_json(self) -> dict[str, Any]:
        merge = {"merge": list(self.merge)} if self.merge else {}
        return {"param": self.param, "dtype": self.dtype.name, "box": list(self.box), "swizzle": self.swizzle,
                **merge}

    @staticmethod
    def from_json(j: Mapping[str, Any]) -> "TensorMapSpec":
        return TensorMapSpec(str(j["param"]), dt.as_dtype(j["dtype"]), tuple(int(b) for b in j["box"]),
                             str(j["swizzle"]), tuple(int(n) for n in j.get("merge", ())))


@dataclass(frozen=True)
class EncodeArguments:
    """cuTensorMapEncodeTiled's arguments, innermost dimension first (the driver's order)."""

    data_type: int
    rank: int
    address: int
    dims: tuple[int, ...]
    strides: tuple[int, ...]      # bytes, rank - 1 entries: dimensions 1.. (dimension 0 is contiguous)
    box: tuple[int, ...]
    element_strides: tuple[int, ...]
    interleave: int
    swizzle: int
    l2_promotion: int
    oob_fill: int


def encode_arguments(spec: TensorMapSpec, ptr: int, shape: Sequence[int], strides: Sequence[int],
                     where: str = "") -> EncodeArguments:
    """The encode call's arguments for array (`ptr`, `shape`, `strides` in elements, outermost
    first) bound to `spec.param`; ShapeError naming `where` when TMA cannot address it."""
    where = where or f"tensor map of {spec.param}"
    spans = spec.merge or (1,) * len(shape)
    if sum(spans) != len(shape) or len(spans) != len(spec.box) or len(strides) != len(shape):
        raise ShapeError(f"{where}: a {len(shape)}-dimensional array for a {len(spec.box)}-dimensional tensor map "
                         f"(merging runs of {list(spans)} dimensions)")
    if spec.merge:
        d = unchained(spans, shape, strides)
        if d is not None:
            raise ShapeError(f"{where}: the map merges dimensions {d} and {d + 1} (sizes {shape[d]}, {shape[d + 1]}), "
                             f"whose strides {strides[d]}, {strides[d + 1]} elements do not chain (stride[d] == "
                             "size[d + 1] * stride[d + 1]); pass a contiguous array")
        shape, strides = merged_geometry(spans, shape, strides)
    esize = spec.dtype.bytes
    if ptr % GLOBAL_ALIGN:
        raise ShapeError(f"{where}: TMA needs a {GLOBAL_ALIGN}-byte aligned base address, got {ptr:#x}; "
                         "pass an aligned array")
    if shape[-1] > 1 and strides[-1] != 1:
        raise ShapeError(f"{where}: TMA needs a contiguous innermost dimension, its stride is {strides[-1]}")
    for n in shape:
        if not 0 < n < MAX_DIM:
            raise ShapeError(f"{where}: dimension {n} is outside TMA's [1, 2^32)")
    byte_strides = []
    for n, s in zip(shape[:-1], strides[:-1]):
        b = s * esize
        if b % GLOBAL_ALIGN or not 0 < b < MAX_STRIDE:
            raise ShapeError(f"{where}: stride {s} elements ({b} bytes) of a dimension of size {n}; TMA needs strides "
                             f"that are positive multiples of {GLOBAL_ALIGN} bytes below 2^40 (pad the rows)")
        byte_strides.append(b)
    if spec.dtype.name not in DATA_TYPES or spec.swizzle not in SWIZZLES:
        raise ShapeError(f"{where}: TMA cannot copy {spec.dtype} with swizzle {spec.swizzle}")
    rank = len(shape)
    return EncodeArguments(
        data_type=DATA_TYPES[spec.dtype.name], rank=rank, address=int(ptr),
        dims=tuple(int(n) for n in reversed(shape)), strides=tuple(reversed(byte_strides)),
        box=tuple(reversed(spec.box)), element_strides=(1,) * rank, interleave=INTERLEAVE_NONE,
        swizzle=SWIZZLES[spec.swizzle], l2_promotion=L2_PROMOTION_256B, oob_fill=OOB_FILL_NONE)


class EncodedTensorMap:
    """The 128 bytes of one encoded CUtensorMap, a by-value kernel parameter."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        if len(data) != TENSOR_MAP_BYTES:
            raise LaunchError(f"an encoded tensor map has {TENSOR_MAP_BYTES} bytes, got {len(data)}")
        self.data = bytes(data)


def encode_tensor_map(args: EncodeArguments, where: str = "tensor map") -> EncodedTensorMap:
    """cuTensorMapEncodeTiled through cuda.bindings (needs the CUDA driver, i.e. a GPU)."""
    from cuda.bindings import driver  # type: ignore[import-untyped]

    err, tmap = driver.cuTensorMapEncodeTiled(
        driver.CUtensorMapDataType(args.data_type), args.rank, args.address,
        [driver.cuuint64_t(d) for d in args.dims], [driver.cuuint64_t(s) for s in args.strides],
        [driver.cuuint32_t(b) for b in args.box], [driver.cuuint32_t(e) for e in args.element_strides],
        driver.CUtensorMapInterleave(args.interleave), driver.CUtensorMapSwizzle(args.swizzle),
        driver.CUtensorMapL2promotion(args.l2_promotion), driver.CUtensorMapFloatOOBfill(args.oob_fill))
    if err != driver.CUresult.CUDA_SUCCESS:
        raise LaunchError(f"{where}: cuTensorMapEncodeTiled failed ({err.name}) for dims {args.dims}, strides "
                          f"{args.strides} bytes, box {args.box}, swizzle {args.swizzle}")
    return EncodedTensorMap(ctypes.string_at(int(tmap.getPtr()), TENSOR_MAP_BYTES))


def _aligned_tensor_map(data: bytes) -> tuple[Any, int]:
    """A buffer holding `data` at a 64-byte aligned address (CUtensorMap's alignment; ctypes
    before Python 3.13 has no `_align_`): the buffer, and that address."""
    buffer = (ctypes.c_char * (TENSOR_MAP_BYTES + TENSOR_MAP_ALIGN))()
    address = -(-ctypes.addressof(buffer) // TENSOR_MAP_ALIGN) * TENSOR_MAP_ALIGN
    ctypes.memmove(address, data, TENSOR_MAP_BYTES)
    return buffer, address


_SCALARS: dict[type, Any] = {
    np.int32: ctypes.c_int32, np.int64: ctypes.c_int64, np.bool_: ctypes.c_bool,
    np.float32: ctypes.c_float, np.float64: ctypes.c_double, np.float16: ctypes.c_uint16,
}


class PackedParameters:
    """A launch's kernelParams: `address` is a `void**` to one pointer per parameter, each to
    that parameter's bytes; the storage lives as long as this object."""

    def __init__(self, params: Sequence[Any]) -> None:
        self.storage: list[Any] = []
        self.sizes: list[int] = []
        addresses: list[int] = []
        for p in params:
            if isinstance(p, EncodedTensorMap):
                value, address = _aligned_tensor_map(p.data)
                self.storage.append(value)
                self.sizes.append(TENSOR_MAP_BYTES)
                addresses.append(address)
                continue
            if isinstance(p, (bool, np.bool_)):
                value = ctypes.c_bool(bool(p))
            elif isinstance(p, (int, np.integer)) and type(p) not in _SCALARS:
                value = ctypes.c_uint64(int(p))   # a device pointer
            elif type(p) in _SCALARS:
                ctype = _SCALARS[type(p)]
                value = ctype(int(np.asarray(p).view(np.uint16))) if type(p) is np.float16 else ctype(p.item())
            else:
                raise LaunchError(f"cannot pass a {type(p).__name__} as a kernel parameter")
            self.storage.append(value)
            self.sizes.append(ctypes.sizeof(value))
            addresses.append(ctypes.addressof(value))
        self.pointers = (ctypes.c_void_p * max(len(addresses), 1))(*addresses)

    @property
    def address(self) -> int:
        return ctypes.addressof(self.pointers)

    def parameter_bytes(self, i: int) -> bytes:
        """The bytes parameter `i` passes (what the kernel reads)."""
        return ctypes.string_at(int(self.pointers[i] or 0), self.sizes[i])


def prepare_packed(stream_handle: int, kernel_handle: Any, grid: Sequence[int], block: Sequence[int], shmem: int,
                   params: Sequence[Any]) -> Callable[[], None]:
    """A launch with `params` packed by value (tensor maps included), ready to repeat:
    calling it runs cuLaunchKernel on the packed block (kept alive by the closure). A cuda.core
    kernel's handle is a CUkernel; the driver launches it as a CUfunction (CUDA 12: a
    context-less kernel cast to CUfunction)."""
    from cuda.bindings import driver

    packed = PackedParameters(params)
    handle = kernel_handle if isinstance(kernel_handle, driver.CUfunction) else driver.CUfunction(int(kernel_handle))
    dims = tuple(int(g) for g in grid) + tuple(int(b) for b in block)
    stream = driver.CUstream(int(stream_handle))
    address, smem, launch, ok = packed.address, int(shmem), driver.cuLaunchKernel, driver.CUresult.CUDA_SUCCESS

    def run() -> None:
        (err,) = launch(handle, *dims, smem, stream, address, 0)
        if err != ok:
            raise LaunchError(f"cuLaunchKernel failed: {err.name}")
    run.packed = packed  # type: ignore[attr-defined]  # the bytes live as long as the launch
    return run


def launch_packed(stream_handle: int, kernel_handle: Any, grid: Sequence[int], block: Sequence[int], shmem: int,
                  params: Sequence[Any]) -> None:
    """cuLaunchKernel with `params` packed by value (tensor maps included), once."""
    prepare_packed(stream_handle, kernel_handle, grid, block, shmem, params)()
