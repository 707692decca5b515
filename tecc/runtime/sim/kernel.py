"""Run one kernel under the emulator: compile it once, then execute it chunk by chunk.

A chunk is as many consecutive thread blocks as fit `MAX_LANES` lanes (and a memory budget for
shared and local memory); all their threads run together as vector lanes. Blocks of one chunk
execute in lockstep, which is one legal GPU schedule: a kernel whose result depends on the
order of its blocks has a data race the emulator does not claim to find.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from ...ir.dtype import as_dtype
from ...ir.errors import DTypeError, LaunchError, ShapeError, TeccError
from ...ir.evaluate import evaluate_int
from ...ir.expr import Var, const_int
from ...ir.stmt import Allocate, Buffer, PrimFunc, iter_stmts
from . import numerics as nm
from .async_copy import finish_async_copies
from .mbarrier import finish_mbarriers
from .bulk_store import finish_bulk_stores
from .warpgroup import finish_warpgroup
from .expr_compiler import Scope
from .lanes import LaneLayout
from .memory import GlobalMemory, span
from .state import LaneState
from .memory_intrinsics import uses_atomics
from .mbarrier import arrived_barriers
from .stmt_compiler import Runner, compile_stmt

# Lanes per chunk: large enough that NumPy's per-call overhead is amortized over many lanes,
# small enough that per-lane arrays (lanes * 4 bytes) stay in L2. Measured in docs/emulator.md.
MAX_LANES = 1 << 14
# Bytes of shared memory (with shadows) and local memory one chunk may hold.
CHUNK_MEMORY = 256 << 20
# CUDA's limits on a thread block (all compute capabilities tecc targets).
MAX_THREADS_PER_BLOCK = 1024
MAX_BLOCK = (1024, 1024, 64)


@dataclass(frozen=True)
class CompiledKernel:
    """A kernel turned into closures, plus what choosing a chunk size needs."""

    func: PrimFunc
    body: Runner
    scope: Scope
    shared_bytes_per_block: int  # with the race/initialization shadows (9 bytes per element)
    local_bytes_per_lane: int


_CACHE: "weakref.WeakKeyDictionary[PrimFunc, CompiledKernel]" = weakref.WeakKeyDictionary()


def compile_kernel(func: PrimFunc) -> CompiledKernel:
    """The compiled form of `func`, built on first use and cached for the kernel's lifetime."""
    hit = _CACHE.get(func)
    if hit is not None:
        return hit
    scope = Scope(func.name)
    for p in func.params:
        if isinstance(p, Buffer):
            if p.scope != "global":
                raise TeccError(f"kernel {func.name}: parameter {p.name} must be a global buffer, is {p.scope}")
            scope.bind_buffer(p)
        else:
            scope.bind_var(p)
    scope.tracks_fences = uses_atomics(func.body)
    scope.arrived_barriers = arrived_barriers(func.body)
    body = compile_stmt(func.body, scope)
    shared = local = 0
    for s in iter_stmts(func.body):
        if isinstance(s, Allocate):
            elems = 1
            for n in s.buffer.shape:
                elems *= const_int(n) or 0
            if s.buffer.scope == "shared":
                shared += elems * (s.buffer.dtype.bytes + 9)
            else:
                local += elems * 8
    compiled = CompiledKernel(func, body, scope, shared, local)
    _CACHE[func] = compiled
    return compiled


def flat_view(array: np.ndarray, name: str) -> tuple[np.ndarray, int]:
    """A writable 1-D view of the memory `array` spans, from its lowest address on, and the
    position of element 0 in it (nonzero with negative strides), so element offsets computed
    from the array's own strides index it at origin + offset."""
    if array.flags.c_contiguous:
        return array.reshape(-1), 0
    steps = []
    for s in array.strides:
        if s % array.itemsize:
            raise ShapeError(f"argument {name}: strides {array.strides} (bytes) are not whole elements")
        steps.append(s // array.itemsize)
    if any(n == 0 for n in array.shape):
        return array.reshape(-1), 0
    origin = -sum((n - 1) * s for n, s in zip(array.shape, steps) if s < 0)
    n = 1 + sum((n - 1) * abs(s) for n, s in zip(array.shape, steps))
    # reversing the axes of negative stride puts the lowest-addressed element first
    lowest = array[tuple(slice(None, None, -1) if s < 0 else slice(None) for s in steps)]
    return np.lib.stride_tricks.as_strided(lowest, shape=(n,), strides=(array.itemsize,)), origin


def simulate_kernel(func: PrimFunc, args: Mapping[str, np.ndarray | int], grid: tuple[int, int, int],
                    block: tuple[int, int, int], *, checks: bool = True) -> None:
    """Run `func` on the CPU with GPU semantics, writing its global buffers in place.

    `args` maps every parameter name to a NumPy array (buffers) or an int (size and stride
    variables). With `checks`, out-of-bounds accesses, shared-memory races and reads of
    uninitialized shared/local memory raise OutOfBoundsError, RaceError, UninitializedReadError."""
    compiled = compile_kernel(func)
    grid = _dims(grid, "grid", func.name)
    block = _dims(block, "block", func.name)
    _check_block(block, func.name)
    if 0 in grid:
        return
    env, memories = _bind(func, args)
    threads = block[0] * block[1] * block[2]
    total = grid[0] * grid[1] * grid[2]
    per_block = compiled.shared_bytes_per_block + compiled.local_bytes_per_lane * threads
    chunk = max(1, min(total, MAX_LANES // threads, CHUNK_MEMORY // max(per_block, 1)))
    scope = compiled.scope
    with np.errstate(all="ignore"):  # GPU arithmetic does not trap; neither do masked-off lanes
        for first in range(0, total, chunk):
            blocks = min(chunk, total - first)
            layout = LaneLayout(grid, block, first, blocks)
            st = LaneState(layout, len(scope.var_slots), len(scope.buffers), checks, func.name)
            for v, value in env.items():
                st.vals[scope.var_slots[v]] = value
            for slot, mem in memories.items():
                st.mems[slot] = mem
            compiled.body(st)
            finish_async_copies(st)
            finish_warpgroup(st)
            finish_mbarriers(st)
            finish_bulk_stores(st)


def _dims(dims: tuple[int, int, int], what: str, kernel: str) -> tuple[int, int, int]:
    out = tuple(int(d) for d in dims)
    if len(out) != 3 or any(d < 0 for d in out):
        raise LaunchError(f"kernel {kernel}: {what} must be three non-negative ints, got {dims}")
    return (out[0], out[1], out[2])


def _check_block(block: tuple[int, int, int], kernel: str) -> None:
    threads = block[0] * block[1] * block[2]
    if threads == 0 or threads > MAX_THREADS_PER_BLOCK or any(b > m for b, m in zip(block, MAX_BLOCK)):
        raise LaunchError(
            f"kernel {kernel}: block {block} is not a valid CUDA block (1..{MAX_THREADS_PER_BLOCK} "
            f"threads, at most {MAX_BLOCK} per dimension)"
        )


def _bind(func: PrimFunc, args: Mapping[str, np.ndarray | int]) -> tuple[dict[Var, object], dict[int, GlobalMemory]]:
    """Values of the scalar parameters and a GlobalMemory for every buffer parameter."""
    env: dict[Var, object] = {}
    ints: dict[Var, int] = {}
    for p in func.params:
        if isinstance(p, Var):
            if p.name not in args:
                raise TeccError(f"kernel {func.name}: no value for parameter {p.name}")
            value = args[p.name]
            if isinstance(value, np.ndarray):
                raise TeccError(f"kernel {func.name}: parameter {p.name} is a scalar, got an array")
            env[p] = nm.make_const(value, p.dtype)
            if p.dtype.is_int:
                ints[p] = int(value)
    memories: dict[int, GlobalMemory] = {}
    scope = compile_kernel(func).scope
    for p in func.params:
        if not isinstance(p, Buffer):
            continue
        array = args.get(p.name)
        if not isinstance(array, np.ndarray):
            raise TeccError(f"kernel {func.name}: parameter {p.name} needs a NumPy array, got {type(array).__name__}")
        if as_dtype(array.dtype) != p.dtype:
            raise DTypeError(f"kernel {func.name}: parameter {p.name} is {p.dtype}, the array is {array.dtype}")
        shape = tuple(evaluate_int(s, ints) for s in p.shape)
        strides = tuple(evaluate_int(s, ints) for s in p.effective_strides())
        flat, origin = flat_view(array, p.name)
        if span(shape, [abs(s) for s in strides]) > flat.size:
            raise ShapeError(
                f"kernel {func.name}: buffer {p.name} of shape {shape} and strides {strides} needs "
                f"{span(shape, strides)} elements, the array holds {flat.size}"
            )
        memories[scope.buffer_slot(p)] = GlobalMemory(p.name, p.dtype, flat, shape, strides, origin)
    return env, memories
