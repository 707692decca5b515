"""Marshaling plan for kernel launches (pure: no device needed).

Which argument, temporary or bound variable feeds each kernel parameter (`plan_launches`), how
arguments are described and bound (`prepare_arguments`), and the checks on device arrays that
depend on their pointers: device, alignment, and overlap with an array the kernel writes (every
kernel pointer is `__restrict__`). `tecc.runtime.cuda` launches with what this module decides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..ir import dtype as dt
from ..ir.dtype import DType
from ..ir.errors import DeviceError, ShapeError, TeccError
from ..ir.expr import Var
from ..ir.stmt import Buffer
from . import arrays
from .arrays import Argument
from .host import ArrayInfo, HostProgram, KernelInfo, bind_arguments
from .tensor_map import TensorMapSpec

# Base alignment the generated code may assume of every global buffer: codegen turns contiguous
# float32/int32 accesses into 16-byte vector accesses (float4, int4) assuming 16-byte-aligned
# bases, as cudaMalloc gives (docs/codegen.md, "Vector accesses"). A misaligned vector access
# faults and poisons the whole CUDA context, so device arrays are checked before launching.
DEFAULT_ALIGNMENT = 16

# The by-value C type of a scalar kernel parameter, as cuda.core marshals it (a bare Python
# int would be passed as a pointer-sized integer, which is wrong for an `int` parameter).
_SCALAR_TYPES: dict[DType, type] = {
    dt.int32: np.int32,
    dt.int64: np.int64,
    dt.bool_: np.bool_,
    dt.float16: np.float16,
    dt.float32: np.float32,
    dt.float64: np.float64,
}


@dataclass(frozen=True)
class ParamSlot:
    """Where one kernel parameter's value comes from at a launch.

    kind 'array': the data pointer of argument `index` (in `host.buffer_params` order);
    kind 'temp': the data pointer of the temporary `name`;
    kind 'scalar': the bound value of the size/stride variable `name`, passed as `dtype`;
    kind 'tensor_map': the tensor map `map` of the array (index >= 0) or temporary (index -1)
    `name`, encoded from its pointer and shape at the launch (tensor_map.py)."""

    kind: str
    name: str
    index: int = -1
    dtype: DType = dt.int32
    map: TensorMapSpec | None = None


@dataclass(frozen=True)
class PlannedLaunch:
    kernel: KernelInfo
    slots: tuple[ParamSlot, ...]


def plan_launches(host: HostProgram) -> tuple[PlannedLaunch, ...]:
    """Resolve every call's argument names against the host program once: which argument,
    temporary or variable feeds each kernel parameter. Raises TeccError for an inconsistent
    host program (unknown kernel or name, wrong arity, dtype mismatch, unbindable variable)."""
    by_name = {b.name: (i, b) for i, b in enumerate(host.buffer_params)}
    temps = {t.name: t for t in host.temps}
    bindable = _bindable_var_names(host)
    planned = []
    for call in host.calls:
        try:
            info = host.kernel(call.kernel)
        except KeyError:
            raise TeccError(f"{host.name}: the call sequence launches unknown kernel {call.kernel!r}") from None
        if len(call.args) != len(info.params):
            raise TeccError(
                f"{host.name}: kernel {info.name} takes {len(info.params)} parameters, the call passes {len(call.args)}"
            )
        slots = []
        for param, name in zip(info.params, call.args):
            where = f"{host.name}: kernel {info.name}, parameter {param.name}"
            if isinstance(param, Buffer):
                if name in by_name:
                    index, module_buffer = by_name[name]
                    slots.append(ParamSlot("array", name, index=index))
                elif name in temps:
                    module_buffer = temps[name]
                    slots.append(ParamSlot("temp", name))
                else:
                    raise TeccError(f"{where}: {name!r} is neither an array parameter nor a temporary of the module")
                if module_buffer.dtype != param.dtype:
                    raise TeccError(f"{where}: expects {param.dtype} but {name} is {module_buffer.dtype}")
            else:
                if name not in bindable:
                    raise TeccError(
                        f"{where}: variable {name} is not a dimension or stride of any array argument, "
                        "so no call can determine its value"
                    )
                if param.dtype not in _SCALAR_TYPES:
                    raise TeccError(f"{where}: scalar parameters of dtype {param.dtype} are not supported")
                slots.append(ParamSlot("scalar", name, dtype=param.dtype))
        by_param = {p.name: a for p, a in zip(info.params, call.args) if isinstance(p, Buffer)}
        for spec in info.tensor_maps:
            name = by_param.get(spec.param)
            if name is None:
                raise TeccError(f"{host.name}: kernel {info.name} has a tensor map of {spec.param!r}, which is not one "
                                "of its buffer parameters")
            slots.append(ParamSlot("tensor_map", name, index=by_name[name][0] if name in by_name else -1, map=spec))
        planned.append(PlannedLaunch(info, tuple(slots)))
    return tuple(planned)


def live_ranges(planned: Sequence[PlannedLaunch]) -> dict[str, tuple[int, int]]:
    """Temporary -> (first, last): the positions in the call sequence of the first launch that
    passes it (or its tensor map) and of the last. A temporary no launch passes has none."""
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for position, launch in enumerate(planned):
        for slot in launch.slots:
            if slot.kind == "temp" or (slot.kind == "tensor_map" and slot.index < 0):
                first.setdefault(slot.name, position)
                last[slot.name] = position
    return {name: (position, last[name]) for name, position in first.items()}


def shared_storage(host: HostProgram, planned: Sequence[PlannedLaunch]) -> dict[str, str]:
    """Temporary -> the name of the storage it lives in: temporaries whose launches do not
    overlap in the call sequence share one (launches on one stream run in order, so a temporary
    first written after another's last reader may take its memory). A program's temporaries
    then take about its largest working set, not their sum (a 12-layer GPT-2 backward program
    stores each layer's GEMM outputs and activations: ~0.2 GiB a layer, each layer's dead once
    the layer's kernels ran). A zero_init temporary keeps a storage of its own (its kernels
    leave it zero for the next call, which a sharer would break), as does one no launch uses.
    Storages are reused first-fit, most recently freed first; a temporary's live range runs
    from the first launch that passes it (or its tensor map) to the last (`live_ranges`).
    (Temporaries in a stream's arena are placed by offset instead: arena.layout.)"""
    ranges = live_ranges(planned)
    storage: dict[str, str] = {t.name: t.name for t in host.temps}
    free: list[tuple[int, str]] = []  # (last launch of its latest temporary, storage)
    count = 0
    for name in sorted((t.name for t in host.temps if not t.zero_init and t.name in ranges),
                       key=lambda n: ranges[n][0]):
        first, last = ranges[name]
        reusable = [entry for entry in free if entry[0] < first]
        if reusable:
            entry = max(reusable)
            free.remove(entry)
            chosen = entry[1]
        else:
            chosen, count = f"storage{count}", count + 1
        storage[name] = chosen
        free.append((last, chosen))
    return storage


def _bindable_var_names(host: HostProgram) -> set[str]:
    """Names of the variables argument binding assigns: whole dimensions or strides of arrays."""
    names: set[str] = set()
    for b in host.buffer_params:
        for e in tuple(b.shape) + tuple(b.strides or ()):
            if isinstance(e, Var):
                names.add(e.name)
    return names


def prepare_arguments(host: HostProgram, args: Sequence[Any], stream_ptr: int = -1) -> tuple[list[Argument], dict[Var, int]]:
    """Describe `args` (in `host.buffer_params` order) and bind them: the launch-ready
    arguments and the value of every size and stride variable. ShapeError / DTypeError name the
    argument; host arrays get contiguous staging copies (see `arrays.as_argument`)."""
    buffers = host.buffer_params
    if len(args) != len(buffers):
        names = ", ".join(b.name for b in buffers)
        raise TeccError(f"{host.name} takes {len(buffers)} arrays ({names}), got {len(args)}")
    prepared = [
        arrays.as_argument(arg, f"argument {pos} ({buf.name}) of {host.name}", stream_ptr)
        for pos, (arg, buf) in enumerate(zip(args, buffers))
    ]
    env = bind_arguments(host, [p.info for p in prepared])
    outputs = set(host.outputs)
    for pos, (p, buf) in enumerate(zip(prepared, buffers)):
        if buf.name in outputs and p.readonly:
            raise TeccError(
                f"argument {pos} ({buf.name}) of {host.name}: the kernel writes it, but the array is read-only; "
                "pass a writable array (e.g. a.copy())"
            )
    return prepared, env


def check_device_arrays(host: HostProgram, prepared: Sequence[Argument], device_id: int,
                        alignment: int = DEFAULT_ALIGNMENT) -> None:
    """Device arrays must live on the executor's device and have data pointers aligned to
    `alignment` bytes (at least their element size). DeviceError / ShapeError name the argument."""
    for pos, (arg, buf) in enumerate(zip(prepared, host.buffer_params)):
        if arg.is_host:
            continue
        where = f"argument {pos} ({buf.name}) of {host.name}"
        if arg.device_id >= 0 and arg.device_id != device_id:
            raise DeviceError(
                f"{where} lives on CUDA device {arg.device_id}, but the kernel is loaded on device {device_id}; "
                "move it there first"
            )
        need = max(alignment, arg.info.dtype.bytes)
        if arg.nbytes > 0 and arg.ptr % need != 0:
            raise ShapeError(
                f"{where}: its data pointer {arg.ptr:#x} is not aligned to {need} bytes (a view at an offset "
                f"into a larger array?); tecc kernels may access global memory in {need}-byte vectors, so pass "
                "an aligned copy (e.g. x.clone() in torch, x.copy() in CuPy)"
            )


def byte_span(info: ArrayInfo) -> tuple[int, int]:
    """The bytes an array may touch, as offsets from its data pointer: [lo, hi). Negative strides
    reach below the pointer. A bounding range: interleaved views of one buffer overlap in it."""
    lo = hi = 0
    for n, st in zip(info.shape, info.strides):
        if st < 0:
            lo += (n - 1) * st
        else:
            hi += (n - 1) * st
    size = info.dtype.bytes
    return lo * size, (hi + 1) * size


def alias_pairs(host: HostProgram) -> tuple[tuple[int, int], ...]:
    """Pairs of argument positions that must not overlap in memory: every pair with at least one
    array the kernels write. Every pointer parameter is `__restrict__` (docs/codegen.md), and a
    restrict pointer promises that what is written through it is reached through no other pointer;
    two read-only inputs may share memory."""
    outputs = set(host.outputs)
    buffers = host.buffer_params
    return tuple((i, j) for i in range(len(buffers)) for j in range(i + 1, len(buffers))
                 if buffers[i].name in outputs or buffers[j].name in outputs)


def written_overlap(ptrs: Sequence[int], spans: Sequence[tuple[int, int]], written: Sequence[bool]) -> bool:
    """Whether two arrays overlap of which at least one is written: what `alias_pairs` and
    `check_aliasing` refuse, decided in O(n log n) instead of over every pair (a whole-graph
    program has a hundred arguments and thousands of pairs). Array k covers the bytes
    [ptrs[k] + spans[k][0], ptrs[k] + spans[k][1]), never empty. Sorted by their first byte, an
    array overlaps an earlier one exactly when it starts before the furthest end among them: so
    a sweep keeps the furthest end of all earlier arrays and of the written ones."""
    ranges = sorted((ptr + lo, ptr + hi, w) for ptr, (lo, hi), w in zip(ptrs, spans, written))
    end_any = end_written = -1 << 64
    for lo, hi, w in ranges:
        if lo < end_written or (w and lo < end_any):
            return True
        if hi > end_any:
            end_any = hi
        if w and hi > end_written:
            end_written = hi
    return False


class PointerChecks:
    """`written_overlap` and the alignment check of one argument list, for any pointers, in
    NumPy: the spans, written flags and alignments are made arrays once, and each new pointer set
    costs a sort and two running maxima in C (~25 us for ~400 arguments, where the Python sweep
    takes ~110 and the alignment loop ~10 more: a training step's program call sees a new pointer
    set every step). Same verdicts as `written_overlap` (ties in the sort: arrays starting at one
    byte overlap, whichever comes first)."""

    def __init__(self, spans: Sequence[tuple[int, int]], written: Sequence[bool], needs: Sequence[int]) -> None:
        self.lo = np.array([lo for lo, _ in spans], dtype=np.int64)
        self.hi = np.array([hi for _, hi in spans], dtype=np.int64)
        self.written = np.array(written, dtype=bool)
        self.needs = np.array(needs, dtype=np.int64)

    def passes(self, ptrs: Sequence[int]) -> bool:
        """Whether every pointer is aligned as its argument needs and no written array overlaps
        another array."""
        p = np.array(ptrs, dtype=np.int64)
        if np.any(p % self.needs):
            return False
        lo, hi = p + self.lo, p + self.hi
        order = np.argsort(lo, kind="stable")
        lo, hi, written = lo[order], hi[order], self.written[order]
        floor = np.iinfo(np.int64).min
        end_any = np.maximum.accumulate(hi)                              # furthest end so far
        end_written = np.maximum.accumulate(np.where(written, hi, floor))  # ... of a written one
        before_any = np.concatenate(([floor], end_any[:-1]))
        before_written = np.concatenate(([floor], end_written[:-1]))
        return not bool(np.any((lo < before_written) | (written & (lo < before_any))))


def check_aliasing(host: HostProgram, prepared: Sequence[Argument]) -> None:
    """Device arrays used in place must not overlap an array the kernels write (the kernels'
    pointers are `__restrict__`, so overlap is undefined behaviour: stale or torn results).
    ShapeError names both arguments. Host arrays are staged into their own buffers: never shared.
    Decided by `written_overlap` (a whole-graph program's first call has ~400 arguments and
    ~50,000 pairs); only when it finds an overlap are the pairs walked, to name them."""
    buffers = host.buffer_params
    outputs = set(host.outputs)
    used = [k for k, a in enumerate(prepared) if not a.is_host and a.nbytes != 0]
    if not written_overlap([prepared[k].ptr for k in used], [byte_span(prepared[k].info) for k in used],
                           [buffers[k].name in outputs for k in used]):
        return
    for i, j in alias_pairs(host):
        a, b = prepared[i], prepared[j]
        if a.is_host or b.is_host or a.nbytes == 0 or b.nbytes == 0:
            continue
        a_lo, a_hi = byte_span(a.info)
        b_lo, b_hi = byte_span(b.info)
        if a.ptr + a_lo < b.ptr + b_hi and b.ptr + b_lo < a.ptr + a_hi:
            written = " and ".join(n for n in (buffers[i].name, buffers[j].name) if n in host.outputs)
            raise ShapeError(
                f"argument {i} ({buffers[i].name}) and argument {j} ({buffers[j].name}) of {host.name} overlap in "
                f"memory, and the kernel writes {written}; its pointers are __restrict__, so pass arrays that do not "
                "share memory (e.g. a fresh output, or x.clone() of the input)"
            )


def tensor_map_geometry(host: HostProgram, name: str, env: dict[Var, int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shape and strides (elements) of the array or temporary `name` under the bound variables:
    what its tensor map is encoded from (arguments were checked against exactly these)."""
    from ..ir.evaluate import evaluate_int
    from .host import contiguous_strides

    buf = next((b for b in host.buffer_params if b.name == name), None)
    if buf is None:
        buf = next(t for t in host.temps if t.name == name)
    shape = tuple(evaluate_int(n, env) for n in buf.shape)
    strides = (tuple(evaluate_int(s, env) for s in buf.strides) if buf.strides is not None
               else contiguous_strides(shape))
    return shape, strides


def scalar_argument(dtype: DType, value: int) -> Any:
    """A scalar kernel argument of exactly `dtype`'s C type."""
    return _SCALAR_TYPES[dtype](value)


