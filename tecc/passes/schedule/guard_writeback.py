"""guard_writeback_only: a register tile's split guards stay on its write-back, off the hot loop.

A split that does not divide its extent (a non-divisible or symbolic M / N) guards every leaf
under the loop, so the accumulation into a thread's register tile reads

    for k:  for i, j:  if row(i) < M: C_local[i, j] = C_local[i, j] + A_s[k, i] * B_s[k, j]

and every FFMA of the unrolled tile carries a predicate (0.24 of cuBLAS for the same kernel that
runs at 0.92 with a constant M). The guard protects nothing there: out-of-range rows of the tile
are registers that the write-back never stores. This primitive removes such guards where that
is provably so.

The argument. Call a conjunct P of a guard a *lane predicate* of the per-thread buffer L when,
at an access `L[v_0, .., v_n]` whose indices are distinct loop variables, P depends only on those
variables and on values fixed for the whole life of L (loops around L's allocation, kernel
parameters): P is then a property of the element, P(e). If every statement that reads or writes
L carries P(its index) among its enclosing guards, the elements with ¬P(e) ("dead lanes") are
never touched. Dropping P from a statement S that
  - writes only L, and reads L only at the index it writes (so a live element never reads a dead one),
  - reads every other buffer provably inside its bounds without P (islpy, the remaining guards
    and loop ranges as context), and
  - reads no global memory (a shared or local tile copied with zero fill is what S may read)
makes S also compute dead lanes; the live lanes compute exactly what they did, and the
statements that keep P (the write-back to global memory) never read a dead lane. L is local, so
no other thread can observe it. The init `C_local[..] = 0` and the accumulation lose their
guard together, so no dead lane is read before it is written (the emulator's uninitialized
check holds).

Preconditions (ScheduleError otherwise): `stage` names a local buffer (a write cache "C.local")
of the kernel. Where nothing can be dropped (every split divides) the kernel is unchanged.
"""

from __future__ import annotations

from ...ir import poly
from ...ir.errors import ScheduleError
from ...ir.expr import (
    Binary,
    BufferLoad,
    Expr,
    Var,
    free_vars,
    logical_and,
    substitute,
    walk,
)
from ...ir.stmt import (
    Allocate,
    Buffer,
    BufferStore,
    For,
    IfThenElse,
    LetStmt,
    PrimFunc,
    Stmt,
)
from .loops import iter_with_path, loops_on_path, rewrite_guards


def conjuncts(cond: Expr) -> list[Expr]:
    """The terms of a conjunction `a & b & ..` (a bool `&` tree), in order."""
    if isinstance(cond, Binary) and cond.op == "&" and cond.dtype.is_bool:
        return conjuncts(cond.a) + conjuncts(cond.b)
    return [cond]


def _conditions(path: tuple[Stmt, ...], leaf: Stmt) -> list[Expr]:
    """The guard conjuncts that enclose `leaf` (else branches add nothing: not needed here)."""
    out: list[Expr] = []
    chain = path + (leaf,)
    for parent, child in zip(chain, chain[1:]):
        if isinstance(parent, IfThenElse) and child is parent.then_case:
            out += conjuncts(parent.cond)
    return out


def _accesses(s: BufferStore, buf: Buffer) -> list[tuple[Expr, ...]]:
    out = [s.indices] if s.buffer is buf else []
    for e in list(s.indices) + [s.value]:
        out += [n.indices for n in walk(e) if isinstance(n, BufferLoad) and n.buffer is buf]
    return out


def guard_writeback_only(func: PrimFunc, stage: str) -> PrimFunc:
    """Drop the lane predicates of local buffer `stage` from the statements that only update it."""
    what = f"guard_writeback_only({stage!r})"
    alloc = next((s for s, _ in iter_with_path(func.body) if isinstance(s, Allocate)
                  and (s.buffer.tensor == stage or s.buffer.name == stage)), None)
    if alloc is None:
        raise ScheduleError(f"{what}: kernel {func.name} allocates no buffer for stage {stage!r}")
    buf = alloc.buffer
    if buf.scope != "local":
        raise ScheduleError(f"{what}: {buf.name} is in {buf.scope} memory; only a per-thread (local) tile "
                            "has lanes that no other thread can observe")
    _, alloc_path = next((s, p) for s, p in iter_with_path(func.body) if s is alloc)
    fixed: set[Var] = {lp.var for lp in loops_on_path(alloc_path)}
    fixed |= {s.var for s in alloc_path if isinstance(s, LetStmt)}
    fixed |= {p for p in func.params if isinstance(p, Var)}
    lane = [Var(f"lane{d}") for d in range(buf.ndim)]

    def lane_predicates(indices: tuple[Expr, ...], conds: list[Expr]) -> set[Expr] | None:
        """The conjuncts of `conds` that are predicates of the element `indices` names (interned
        expressions over `lane`), or None when the indices are not distinct loop variables."""
        if not all(isinstance(i, Var) for i in indices) or len(set(indices)) != len(indices):
            return None
        to_lane = {v: lane[d] for d, v in enumerate(indices) if isinstance(v, Var)}
        out: set[Expr] = set()
        for c in conds:
            p = substitute(c, to_lane)
            if free_vars(p) <= fixed | set(lane):
                out.add(p)
        return out

    # the lane predicates that every access of `buf` carries
    leaves = [(s, p) for s, p in iter_with_path(alloc.body, alloc_path + (alloc,)) if isinstance(s, BufferStore)]
    common: set[Expr] | None = None
    for s, path in leaves:
        for idx in _accesses(s, buf):
            preds = lane_predicates(idx, _conditions(path, s))
            common = (preds or set()) if common is None else common & (preds or set())
    for s, _ in iter_with_path(alloc.body):
        if not isinstance(s, BufferStore):
            exprs = [getattr(s, f) for f in ("cond", "value", "min", "extent") if hasattr(s, f)]
            if any(isinstance(n, BufferLoad) and n.buffer is buf for e in exprs for n in walk(e)):
                common = set()  # read outside a store (a loop bound, a condition): keep everything
    if not common:
        return func

    drop: dict[int, Expr] = {}  # id(IfThenElse) -> its new condition
    for s, path in leaves:
        parent = path[-1] if path else None
        if s.buffer is not buf or not isinstance(parent, IfThenElse) or parent.then_case is not s:
            continue
        if parent.else_case is not None:
            continue
        idxs = set(_accesses(s, buf))
        if len(idxs) != 1:
            continue
        to_lane = {v: lane[d] for d, v in enumerate(s.indices) if isinstance(v, Var)}
        keep = [c for c in conjuncts(parent.cond) if substitute(c, to_lane) not in common]
        if len(keep) == len(conjuncts(parent.cond)):
            continue
        if not _reads_safe(s, buf, path, keep):
            continue
        drop[id(parent)] = logical_and(*keep)

    if not drop:
        return func

    return rewrite_guards(func, drop)


def _reads_safe(s: BufferStore, buf: Buffer, path: tuple[Stmt, ...], keep: list[Expr]) -> bool:
    """Every read of `s` other than `buf` is of on-chip memory and provably in bounds under the
    guards that remain (`keep`) and the enclosing loops."""
    loops = [poly.LoopDim(lp.var, lp.min, lp.extent, lp.kind) for lp in loops_on_path(path)
             if isinstance(lp, For)]
    context = _conditions(path[:-1], path[-1]) + keep
    for e in list(s.indices) + [s.value]:
        for n in walk(e):
            if not isinstance(n, BufferLoad) or n.buffer is buf:
                continue
            if n.buffer.scope == "global":
                return False
            for i, extent in zip(n.indices, n.buffer.shape):
                if not (poly.proves(i >= 0, loops, context) and poly.proves(i < extent, loops, context)):
                    return False
    return True
