"""Compile loop-IR statements into closures that run lane-parallel over a chunk of blocks.

The meaning of each statement under the emulator (see docs/emulator.md):
- Statements run once for all lanes at a time, under the active-lane mask; code outside every
  thread-bound loop runs in every thread, as the CUDA emitter's output does.
- `For` bound to threadIdx/blockIdx binds its variable to the lanes' coordinates; a loop whose
  extent is below the launch dimension masks the lanes past it (the emitter's guard).
- serial/unroll/vectorize loops with uniform bounds iterate in Python with a scalar variable;
  lane-dependent bounds iterate from the smallest start to the largest end under a mask.
- `IfThenElse` with a lane-dependent condition narrows the mask for each branch.
- `MatrixMultiply` / `MatrixLoad` run warp by warp through their intrinsic-table row (matrix.py);
  `AsyncCopy` copies land at the cp.async wait that covers them (async_copy.py).
- An `Instruction` (fences, commit / wait groups, mbarrier operations, bar.sync, setmaxnreg)
  runs the semantics its row has in instructions.py.
- The warpgroup statements (wgmma, its fences) run per warpgroup, their results landing at the
  wgmma.wait_group (warpgroup.py); mbarriers count phases and land bulk copies at the wait on
  their barrier (mbarrier.py).
- `Barrier` is a no-op for values (all lanes of a statement finish before the next starts, so
  `__syncthreads()` holds by construction) and closes a race-detection epoch.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ...ir.errors import DivergenceError, LaunchError, TeccError
from ...ir.expr import const_int
from ...ir.stmt import (
    THREAD_KINDS,
    Allocate,
    AsyncCopy,
    Barrier,
    BufferStore,
    BulkCopy,
    Evaluate,
    For,
    IfThenElse,
    Instruction,
    LetStmt,
    MatrixLoad,
    MatrixMultiply,
    Seq,
    Stmt,
    TensorCopy,
    TensorStore,
    WarpgroupMatrixMultiply,
)
from .async_copy import compile_async_copy
from .banks import vector_group
from .instructions import compile_instruction
from .mbarrier import barrier_events, compile_copy
from .roles import has_waits, run_roles
from .warpgroup import compile_wgmma
from .bulk_store import compile_tensor_store
from .expr_compiler import Scope, compile_expr, compile_indices
from .memory import LocalMemory, SharedMemory, row_major
from .memory_intrinsics import note_barrier, note_global_store
from .matrix import compile_matrix_load, compile_matrix_multiply
from .state import LaneState, restrict

Runner = Callable[[LaneState], None]


def compile_stmt(s: Stmt, scope: Scope) -> Runner:
    """The closure running `s`; see the module docstring."""
    if isinstance(s, Seq):
        return _compile_seq(s, scope)
    if isinstance(s, For):
        if s.is_thread or s.is_block:
            return _compile_bound_loop(s, scope)
        return _compile_serial_loop(s, scope)
    if isinstance(s, BufferStore):
        return _compile_store(s, scope)
    if isinstance(s, IfThenElse):
        return _compile_if(s, scope)
    if isinstance(s, LetStmt):
        return _compile_let(s, scope)
    if isinstance(s, Allocate):
        return _compile_allocate(s, scope)
    if isinstance(s, Barrier):
        return _run_barrier
    if isinstance(s, Evaluate):
        return _compile_evaluate(s, scope)
    if isinstance(s, MatrixMultiply):
        return compile_matrix_multiply(s, scope)
    if isinstance(s, MatrixLoad):
        return compile_matrix_load(s, scope)
    if isinstance(s, Instruction):
        return compile_instruction(s, scope)
    if isinstance(s, AsyncCopy):
        return compile_async_copy(s, scope)
    if isinstance(s, WarpgroupMatrixMultiply):
        return compile_wgmma(s, scope)
    if isinstance(s, (BulkCopy, TensorCopy)):
        return compile_copy(s, scope)
    if isinstance(s, TensorStore):
        return compile_tensor_store(s, scope)
    raise TeccError(f"kernel {scope.kernel}: the emulator has no rule for the statement {type(s).__name__}")


def _compile_seq(s: Seq, scope: Scope) -> Runner:
    runners = tuple(compile_stmt(x, scope) for x in s.stmts)

    def run(st: LaneState) -> None:
        for r in runners:
            r(st)

    return run


def _with_range(scope: Scope, s: For, rng: tuple[int, int] | None) -> tuple[int, Runner]:
    """Bind the loop variable (with its static range, if any) while compiling the body."""
    old = scope.ranges.get(s.var)
    slot = scope.bind_var(s.var, rng)
    body = compile_stmt(s.body, scope)
    if old is None:
        scope.ranges.pop(s.var, None)
    else:
        scope.ranges[s.var] = old
    return slot, body


def _compile_bound_loop(s: For, scope: Scope) -> Runner:
    axis = "xyz".index(s.kind[-1])
    is_thread = s.kind in THREAD_KINDS
    ext_const = const_int(s.extent)
    slot, body = _with_range(scope, s, (0, ext_const - 1) if ext_const else None)
    fext = compile_expr(s.extent, scope)
    npd = s.var.dtype.numpy
    kind, name = s.kind, s.var.name

    def run(st: LaneState) -> None:
        lay = st.layout
        coord = (lay.thread_idx if is_thread else lay.block_idx)[axis]
        launched = (lay.block if is_thread else lay.grid)[axis]
        extent = int(fext(st))
        if extent > launched:
            raise LaunchError(
                f"kernel {st.kernel}: loop {name} is bound to {kind} with extent {extent}, but the "
                f"launch has only {launched} along {kind[-1]}; launch it with {kind[-1]} >= {extent}"
            )
        saved_mask, saved_val = st.mask, st.vals[slot]
        if extent < launched:
            m = restrict(saved_mask, coord < extent)
            if m is not None and not m.any():
                return
            st.mask = m
        st.vals[slot] = coord if coord.dtype == npd else coord.astype(npd)
        try:
            body(st)
        finally:
            st.mask, st.vals[slot] = saved_mask, saved_val

    return run


def _compile_serial_loop(s: For, scope: Scope) -> Runner:
    lo_c, ext_c = const_int(s.min), const_int(s.extent)
    rng = (lo_c, lo_c + ext_c - 1) if lo_c is not None and ext_c is not None and ext_c > 0 else None
    slot, body = _with_range(scope, s, rng)
    fmin, fext = compile_expr(s.min, scope), compile_expr(s.extent, scope)
    if s.kind == "vectorize" and rng is not None:
        return _vector_loop(slot, body, int(lo_c), int(ext_c))  # type: ignore[arg-type]

    def run(st: LaneState) -> None:
        lo, n = fmin(st), fext(st)
        saved = st.vals[slot]
        try:
            if not isinstance(lo, np.ndarray) and not isinstance(n, np.ndarray):
                vals = st.vals
                for i in range(int(lo), int(lo) + int(n)):
                    vals[slot] = i
                    body(st)
            else:
                _run_divergent_loop(st, slot, body, lo, n)
        finally:
            st.vals[slot] = saved

    return run


def _vector_loop(slot: int, body: Runner, lo: int, n: int) -> Runner:
    """A `vectorize` loop with constant bounds: its iterations in order, and, while bank
    conflicts are counted, its shared accesses grouped into the wide accesses the emitter
    makes of them (banks.vector_group)."""

    def run(st: LaneState) -> None:
        saved = st.vals[slot]
        try:
            with vector_group(n) as group:
                for i in range(lo, lo + n):
                    if group is not None:
                        group.next_iteration()
                    st.vals[slot] = i
                    body(st)
        finally:
            st.vals[slot] = saved

    return run


def _run_divergent_loop(st: LaneState, slot: int, body: Runner, lo: Any, n: Any) -> None:
    """A loop whose bounds differ between lanes: every lane sees its own iterations in order,
    with the variable uniform and the lanes outside their range masked off."""
    lanes = st.layout.lanes
    lo = np.broadcast_to(lo, (lanes,))
    hi = lo + np.broadcast_to(n, (lanes,))
    saved_mask = st.mask
    active = np.ones(lanes, dtype=bool) if saved_mask is None else saved_mask
    if not active.any():
        return
    start, stop = int(lo[active].min()), int(hi[active].max())
    try:
        for i in range(start, stop):
            m = restrict(saved_mask, (lo <= i) & (i < hi))
            if m is not None and not m.any():
                continue
            st.mask = m
            st.vals[slot] = i
            body(st)
    finally:
        st.mask = saved_mask


def _compile_store(s: BufferStore, scope: Scope) -> Runner:
    slot = scope.buffer_slot(s.buffer)
    dims = scope.dims_to_check(s.buffer, s.indices)
    fidx = compile_indices(s.indices, scope)
    fval = compile_expr(s.value, scope)

    def run(st: LaneState) -> None:
        st.mems[slot].store(st, fidx(st), fval(st), dims)

    if scope.tracks_fences and s.buffer.scope == "global":
        def run_noted(st: LaneState) -> None:
            run(st)
            note_global_store(st)

        return run_noted
    return run


def _compile_if(s: IfThenElse, scope: Scope) -> Runner:
    fc = compile_expr(s.cond, scope)
    then_run = compile_stmt(s.then_case, scope)
    else_run = compile_stmt(s.else_case, scope) if s.else_case is not None else None
    as_roles = has_waits(s.then_case) and has_waits(s.else_case)  # warp specialization (roles.py)

    def run(st: LaneState) -> None:
        c = fc(st)
        if not isinstance(c, np.ndarray):
            if c:
                then_run(st)
            elif else_run is not None:
                else_run(st)
            return
        saved = st.mask
        if as_roles:
            assert else_run is not None
            parts = [(m, r) for m, r in ((restrict(saved, c), then_run), (restrict(saved, ~c), else_run))
                     if m is None or m.any()]
            if len(parts) == 2:
                share_async_states(st)
                run_roles(st, parts, lambda: barrier_events(st))
                return
        try:
            _run_masked(st, restrict(saved, c), then_run)
            if else_run is not None:
                st.mask = saved
                _run_masked(st, restrict(saved, ~c), else_run)
        finally:
            st.mask = saved

    return run


def share_async_states(st: LaneState) -> None:
    """Create the lazily made states of copies, wgmmas and barriers before roles copy `st`, so
    that every role shares them."""
    from .async_copy import _state as async_state
    from .mbarrier import _state as mbarrier_state
    from .warpgroup import _state as warpgroup_state

    async_state(st)
    mbarrier_state(st)
    warpgroup_state(st)


def _run_masked(st: LaneState, m: np.ndarray | None, body: Runner) -> None:
    if m is not None and not m.any():
        return
    st.mask = m
    body(st)


def _compile_let(s: LetStmt, scope: Scope) -> Runner:
    fval = compile_expr(s.value, scope)
    rng = scope.interval(s.value) if s.var.dtype.is_int else None
    old = scope.ranges.get(s.var)
    slot = scope.bind_var(s.var, rng)
    body = compile_stmt(s.body, scope)
    if old is None:
        scope.ranges.pop(s.var, None)
    else:
        scope.ranges[s.var] = old

    def run(st: LaneState) -> None:
        saved = st.vals[slot]
        st.vals[slot] = fval(st)
        try:
            body(st)
        finally:
            st.vals[slot] = saved

    return run


def _compile_allocate(s: Allocate, scope: Scope) -> Runner:
    buf = s.buffer
    shape = tuple(int(const_int(c) or 0) for c in buf.shape)  # Allocate checked they are constant
    strides = row_major(shape) if buf.strides is None else tuple(const_int(x) for x in buf.strides)
    if any(x is None for x in strides):
        raise TeccError(f"kernel {scope.kernel}: {buf.scope} buffer {buf.name} needs constant strides")
    slot = scope.bind_buffer(buf)
    body = compile_stmt(s.body, scope)
    name, dtype, layout = buf.name, buf.dtype, buf.layout
    shared = buf.scope == "shared"  # 'fragment' buffers are per-lane registers, like 'local' ones

    def run(st: LaneState) -> None:
        mem: SharedMemory | LocalMemory
        if shared:
            mem = SharedMemory(st, name, dtype, shape, strides, layout)  # type: ignore[arg-type]
        else:
            mem = LocalMemory(st, name, dtype, shape, strides)  # type: ignore[arg-type]
        saved = st.mems[slot]
        st.mems[slot] = mem
        if shared:
            st.live_shared.append(mem)
        try:
            body(st)
        finally:
            st.mems[slot] = saved
            if shared:
                st.live_shared.remove(mem)

    return run


def _run_barrier(st: LaneState) -> None:
    if st.checks and st.mask is not None:
        lay = st.layout
        per_block = st.mask.reshape(lay.blocks, lay.threads)
        partial = per_block.any(axis=1) & ~per_block.all(axis=1)
        if partial.any():
            b = int(np.argmax(partial))
            missing = b * lay.threads + int(np.argmin(per_block[b]))
            raise DivergenceError(
                f"__syncthreads() in kernel {st.kernel} is reached by only some threads of block "
                f"{lay.block_of(missing)} (thread {lay.thread_of(missing)} does not arrive); a barrier "
                "must not sit under a thread-dependent condition"
            )
    for mem in st.live_shared:
        mem.barrier(st)
    note_barrier(st)


def _compile_evaluate(s: Evaluate, scope: Scope) -> Runner:
    f = compile_expr(s.value, scope)

    def run(st: LaneState) -> None:
        f(st)  # for its effect (intrinsics); the value is dropped

    return run
