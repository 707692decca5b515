"""double_buffer: software-pipeline the shared-memory copies of a k-tile loop through registers.

`double_buffer(func, loop)` takes a loop whose body starts with the cooperative copies that
`stage_read` placed there (global → shared, one per shared cache) and rewrites

    for ko:                              R = load(tile 0); S = R          (prologue)
      barrier                            for ko:
      S = load(tile ko)          into      if ko + 1 < end: R = load(tile ko + 1)
      barrier                              barrier
      compute(S)                           compute(S)
                                           barrier
                                           if ko + 1 < end: S = R

R is a per-thread register tile (`A_shared_reg`, local) holding this thread's share of the next
tile. The global loads of tile ko + 1 are issued before the compute of tile ko and consumed only
after it, so their latency (~500-800 cycles from DRAM/L2) hides behind the tile's FFMAs instead of
stalling the block at the barrier; shared memory stays single-buffered (one extra barrier per
tile instead of twice the shared memory). The copy's step loops are unrolled (R must live in
registers); a `vectorize` lane loop stays one and becomes a 16-byte load into four registers.
Barriers are placed again by `insert_barriers` (a barrier before the loop, before the compute
and before the stores).

Preconditions: `loop` is serial, is not bound, and its body holds at least one copy into a
shared buffer; a copy is a nest of serial / unroll / vectorize loops of constant extent around
one store (optionally under a guard that does not use `loop`) whose value does not read shared
memory; the rest of the body does not write those shared buffers.
"""

from __future__ import annotations

from ...ir.errors import ScheduleError
from ...ir.expr import (
    BufferLoad,
    Const,
    Expr,
    Var,
    const_int,
    free_vars,
    substitute,
    walk,
)
from ...ir.stmt import (
    Allocate,
    Barrier,
    Buffer,
    BufferStore,
    For,
    IfThenElse,
    PrimFunc,
    Seq,
    Stmt,
    seq,
)
from ..simplify import simplify_func
from .barriers import insert_barriers
from .loops import all_names, find_loop, fresh_name, replace_stmt


def _copy_parts(s: Stmt) -> tuple[list[For], IfThenElse | None, BufferStore] | None:
    """(loops, guard, store) when `s` is a copy into a shared buffer, else None."""
    loops: list[For] = []
    guard: IfThenElse | None = None
    while True:
        if isinstance(s, For) and s.kind in ("serial", "unroll", "vectorize") and const_int(s.extent) is not None:
            loops.append(s)
            s = s.body
        elif isinstance(s, IfThenElse) and s.else_case is None and guard is None:
            guard = s
            s = s.then_case
        else:
            break
    if not isinstance(s, BufferStore) or s.buffer.scope != "shared":
        return None
    if any(isinstance(n, BufferLoad) and n.buffer.scope == "shared" for n in walk(s.value)):
        return None
    return loops, guard, s


def _nest(loops: list[For], guard: IfThenElse | None, leaf: Stmt, vars_: dict[Var, Var]) -> Stmt:
    """`leaf` under a fresh copy of `loops` (step loops unrolled) and `guard`, in their order."""
    out = leaf
    if guard is not None:
        out = IfThenElse(substitute(guard.cond, vars_), out)  # type: ignore[arg-type]
    for lp in reversed(loops):
        kind = "vectorize" if lp.kind == "vectorize" else "unroll"
        out = For(vars_[lp.var], lp.min, lp.extent, kind, out)  # type: ignore[arg-type]
    return out


def double_buffer(func: PrimFunc, loop: str) -> PrimFunc:
    what = f"double_buffer at {loop}"
    node, _ = find_loop(func, loop)
    if node.kind not in ("serial", "unroll"):
        raise ScheduleError(f"{what}: the loop is {node.kind}; only a serial loop can be pipelined")
    body = list(node.body.stmts) if isinstance(node.body, Seq) else [node.body]
    body = [s for s in body if not isinstance(s, Barrier)]
    copies = [(s, _copy_parts(s)) for s in body]
    found = [(s, p) for s, p in copies if p is not None]
    if not found:
        raise ScheduleError(f"{what}: the loop body has no copy into shared memory at its top level; "
                            "stage a tensor with cache_read + compute_at at this loop first")
    rest = [s for s, p in copies if p is None]
    targets = {p[2].buffer for _, p in found}
    for s in rest:
        for n, _ in _walk_stmts(s):
            if isinstance(n, BufferStore) and n.buffer in targets:
                raise ScheduleError(f"{what}: the loop body writes {n.buffer.name} outside its copy")
    taken = all_names(func)
    ko = node.var
    has_next = ko + 1 < node.min + node.extent
    first: dict[Var, Expr] = {ko: node.min}
    following: dict[Var, Expr] = {ko: ko + 1}
    registers: list[Buffer] = []
    prologue: list[Stmt] = []
    loads: list[Stmt] = []
    stores: list[Stmt] = []
    for _, (loops, guard, store) in found:  # type: ignore[misc]
        if guard is not None and ko in free_vars(guard.cond):
            raise ScheduleError(f"{what}: the copy of {store.buffer.name} is guarded by {loop}")
        shape = tuple(int(const_int(lp.extent)) for lp in loops) or (1,)  # type: ignore[arg-type]
        reg = Buffer(fresh_name(taken, f"{store.buffer.name}_reg"), store.buffer.dtype, shape, "local", None,
                     f"{store.buffer.tensor}.reg")
        registers.append(reg)
        for phase, shift in (("first", first), ("next", following)):
            vars_ = {lp.var: Var(fresh_name(taken, f"{lp.var.name}_{phase}"), lp.var.dtype) for lp in loops}
            at = tuple(vars_[lp.var] for lp in loops) or (Const(0, "int32"),)
            value = substitute(substitute(store.value, shift), vars_)
            load = _nest(loops, guard, BufferStore(reg, at, value), vars_)  # type: ignore[arg-type]
            (prologue if phase == "first" else loads).append(load)
            svars = {lp.var: Var(fresh_name(taken, f"{lp.var.name}_{phase}_st"), lp.var.dtype) for lp in loops}
            sat = tuple(svars[lp.var] for lp in loops) or (Const(0, "int32"),)
            put = BufferStore(store.buffer, tuple(substitute(i, svars) for i in store.indices), reg[sat])
            (prologue if phase == "first" else stores).append(_nest(loops, guard, put, svars))
    # prologue: all loads first, then all stores (the loads of both operands in flight together)
    n = len(found)
    prologue = prologue[0::2] + prologue[1::2]
    pipelined = seq(IfThenElse(has_next, seq(*loads)), *rest, IfThenElse(has_next, seq(*stores)))
    new_loop: Stmt = seq(*prologue, For(node.var, node.min, node.extent, node.kind, pipelined, node.annotations))
    for reg in reversed(registers):
        new_loop = Allocate(reg, new_loop)
    assert n == len(registers)
    out = func.with_body(replace_stmt(func.body, node, new_loop))
    return simplify_func(insert_barriers(out))


def _walk_stmts(s: Stmt):  # type: ignore[no-untyped-def]
    from .loops import iter_with_path
    return iter_with_path(s)


__all__ = ["double_buffer"]
