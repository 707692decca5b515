"""split: one loop into several nested ones, the outer ones stepping over tiles of the inner.

Preconditions (ScheduleError otherwise): the loop exists and is not bound to a thread or block
axis yet (split first, then bind); every factor is a positive integer except at most one `None`,
which is inferred as ceildiv(extent, product of the others); without a `None` the product must
cover a constant extent.

`split(i, [None, 64])` gives `i_o` (ceildiv(n, 64) iterations) and `i_i` (64), with
`i = i_o*64 + i_i`. Three factors give `i_o, i_m, i_i`; more give `i_0, i_1, ...`. When the
product of the factors is not provably a multiple of the extent (islpy, so symbolic sizes are
handled), every leaf statement under the loop gets the guard `i_o*64 + i_i < n`. Guards go on
the leaves, never around loops, so the nest stays perfect for `reorder`/`fuse` and a barrier is
never put under a thread-dependent condition.
"""

from __future__ import annotations

from typing import Sequence

from ...ir import poly
from ...ir.errors import ScheduleError
from ...ir.expr import Const, Expr, Var, const_int, logical_and
from ...ir.stmt import Barrier, BufferStore, Evaluate, For, IfThenElse, PrimFunc, Stmt
from ...ir.visitor import StmtMutator
from ..substitute import substitute_stmt
from .loops import (
    all_names,
    find_loop,
    fresh_name,
    iter_with_path,
    loops_on_path,
    replace_stmt,
)


def _suffixes(n: int) -> list[str]:
    if n == 2:
        return ["o", "i"]
    if n == 3:
        return ["o", "m", "i"]
    return [str(k) for k in range(n)]


class _GuardLeaves(StmtMutator):
    """Wraps every leaf statement in `if cond` (merging with a leaf guard already there)."""

    def __init__(self, cond: Expr) -> None:
        self.cond = cond

    def visit_BufferStore(self, s: BufferStore) -> Stmt:
        return IfThenElse(self.cond, s)

    def visit_Evaluate(self, s: Evaluate) -> Stmt:
        return IfThenElse(self.cond, s)

    def visit_IfThenElse(self, s: IfThenElse) -> Stmt:
        simple = s.else_case is None and not any(isinstance(x, (For, Barrier)) for x, _ in iter_with_path(s.then_case))
        if simple:
            return IfThenElse(logical_and(self.cond, s.cond), s.then_case)
        return self.generic_visit(s)


def guard_leaves(s: Stmt, cond: Expr) -> Stmt:
    return _GuardLeaves(cond).visit(s)


def split(func: PrimFunc, loop: str, factors: Sequence[int | None]) -> PrimFunc:
    """Split loop `loop` of `func` by `factors` (outermost first; one may be None)."""
    node, path = find_loop(func, loop)
    if node.kind not in ("serial", "unroll", "vectorize"):
        raise ScheduleError(f"split of {loop}: the loop is already bound to {node.kind}; split it before binding")
    if len(factors) < 2:
        raise ScheduleError(f"split of {loop}: needs at least two factors, got {list(factors)}")
    if sum(f is None for f in factors) > 1:
        raise ScheduleError(f"split of {loop}: at most one factor may be None (inferred), got {list(factors)}")
    for f in factors:
        if f is not None and (isinstance(f, bool) or not isinstance(f, int) or f <= 0):
            raise ScheduleError(f"split of {loop}: every factor must be a positive integer, got {f!r}")
    known = 1
    for f in factors:
        if f is not None:
            known *= f
    extent = node.extent
    ext_c = const_int(extent)
    if None not in factors and (ext_c is None or known < ext_c):
        raise ScheduleError(
            f"split of {loop}: the factors {list(factors)} cover {known} iterations but the loop has {extent}; "
            "make one factor None to infer it"
        )
    d = node.var.dtype
    sizes: list[Expr] = []
    for f in factors:
        sizes.append(Const(f, d) if f is not None else (extent + (known - 1)) // known)
    taken = all_names(func)
    new_vars = [Var(fresh_name(taken, f"{loop}_{sfx}"), d) for sfx in _suffixes(len(factors))]
    # i = min + sum(v_k * product of the sizes inside it)
    offset: Expr = Const(0, d)
    stride: Expr = Const(1, d)
    for v, size in zip(reversed(new_vars), reversed(sizes)):
        offset = v * stride + offset if const_int(offset) != 0 else v * stride
        stride = stride * size
    body = substitute_stmt(node.body, {node.var: node.min + offset})
    outer = [poly.LoopDim(lp.var, lp.min, lp.extent, lp.kind) for lp in loops_on_path(path)]
    inner = [poly.LoopDim(v, Const(0, d), s, "serial") for v, s in zip(new_vars, sizes)]
    cond = offset < extent
    if not poly.proves(cond, outer + inner):
        body = guard_leaves(body, cond)
    for v, size in zip(reversed(new_vars), reversed(sizes)):
        body = For(v, Const(0, d), size, "serial", body)
    return func.with_body(replace_stmt(func.body, node, body))
