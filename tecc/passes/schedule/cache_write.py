"""cache_write: compute a stage's output tile in a per-thread local buffer, written back after.

For a reduction stage the lowered accumulator already is that buffer: each thread accumulates in
`C_acc` and stores it to C after the reduction loop; `reorder` expands it to the thread's whole
tile when the reduction loop moves outside the tile loops. cache_write("C", "local") makes it the
named cache stage `C.local` (buffer `C_local`), dropping the unit dimensions that only index
element 0, so later primitives and the reader see the register tile by name.

For a stage without a reduction, each store `C[idx] = v` becomes `C_local[0] = v; C[idx] =
C_local[0]` (a one-element register stage, useful as an anchor for later primitives).

Preconditions: the stage is computed by this kernel; scope is "local" (a shared-memory output
stage would need a block-wide write-back, not supported yet).
"""

from __future__ import annotations

from ...ir.errors import ScheduleError
from ...ir.expr import BufferLoad, Const, const_int, walk
from ...ir.stmt import Allocate, Buffer, BufferStore, PrimFunc, Stmt, seq
from ...ir.visitor import StmtMutator
from .loops import (
    all_names,
    fresh_name,
    iter_with_path,
    rebuffer,
    replace_stmt,
    stage_leaves,
)


def _unit_zero_dims(func: PrimFunc, buf: Buffer) -> list[int]:
    """Dimensions of `buf` of extent 1 that every access indexes with the constant 0."""
    dims = [d for d, n in enumerate(buf.shape) if const_int(n) == 1]
    for s, _ in iter_with_path(func.body):
        idx_lists = []
        if isinstance(s, BufferStore):
            if s.buffer is buf:
                idx_lists.append(s.indices)
            exprs = list(s.indices) + [s.value]
        else:
            exprs = []
            for f in ("cond", "value", "min", "extent"):
                if hasattr(s, f):
                    exprs.append(getattr(s, f))
        for e in exprs:
            idx_lists += [n.indices for n in walk(e) if isinstance(n, BufferLoad) and n.buffer is buf]
        for idx in idx_lists:
            dims = [d for d in dims if const_int(idx[d]) == 0]
    if len(dims) == len(buf.shape):
        dims = dims[1:]  # keep one dimension
    return dims


def cache_write(func: PrimFunc, stage: str, scope: str = "local") -> PrimFunc:
    what = f"cache_write({stage!r}, {scope!r})"
    if scope != "local":
        raise ScheduleError(f"{what}: only 'local' (per-thread register) write caches are supported")
    if not stage_leaves(func, stage):
        raise ScheduleError(f"{what}: kernel {func.name} does not compute {stage}")
    taken = all_names(func)
    acc = next((s for s, _ in iter_with_path(func.body)
                if isinstance(s, Allocate) and s.buffer.tensor == f"{stage}.acc"), None)
    if acc is not None:
        old = acc.buffer
        drop = _unit_zero_dims(func, old)
        keep = [d for d in range(old.ndim) if d not in drop]
        new = Buffer(fresh_name(taken, f"{stage}_local"), old.dtype, tuple(old.shape[d] for d in keep), "local",
                     None, f"{stage}.local")
        body = rebuffer(acc.body, old, new, lambda idx: tuple(idx[d] for d in keep))
        return func.with_body(replace_stmt(func.body, acc, Allocate(new, body)))

    class _Stage(StmtMutator):
        def visit_BufferStore(self, s: BufferStore) -> Stmt:
            if s.buffer.tensor != stage or s.buffer.scope != "global":
                return s
            buf = Buffer(fresh_name(taken, f"{stage}_local"), s.buffer.dtype, (1,), "local", None, f"{stage}.local")
            zero = Const(0, "int32")
            return Allocate(buf, seq(BufferStore(buf, (zero,), s.value), BufferStore(s.buffer, s.indices, buf[zero])))

    return func.with_body(_Stage().visit(func.body))
