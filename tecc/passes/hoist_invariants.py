"""Loop-invariant costly expressions computed once before their loop.

A serial or unrolled loop whose body computes, at every iteration, a float division or a math
intrinsic (sqrt, exp, ...) of values that do not change in the loop gets that value once, in a
`LetStmt` before the loop. What brings them: an elementwise producer inlined into a reduction
over a window (resnet50's max pool reads its input through the stem's batch norm, whose
1 / sqrt(var[c] + eps) of the channel was computed for each of the 9 window elements; ptxas does
not merge IEEE square roots and divisions of different iterations).

A subexpression is taken out of `for v` where it is
- costly: holds a float division or `pow`, or a math intrinsic (FLOAT_INTRINSICS);
- pure: only arithmetic, comparisons, casts, selects, math intrinsics and loads (no memory or
  warp intrinsic, no random number);
- invariant: none of its variables is bound inside the loop (v, inner loops, lets);
- safe to evaluate before the loop, also where the loop body would not have (a side of a
  where(), a guard, a loop that runs no iteration): every load reads a global buffer that
  nothing in the kernel writes, at indices the enclosing loops' constant ranges keep inside the
  buffer's constant shape (simplify.Bounds); nor an atomic, nor a load past the L1 (load_cg)
  takes it. Float arithmetic does not trap.

The largest such subexpressions are taken, outermost loop first (an expression invariant in
two nested loops goes before the outer one). Kernels without such loops are returned as they
are (the same module object).
"""

from __future__ import annotations

from ..ir import dtype as dt
from ..ir.expr import (
    FLOAT_INTRINSICS, INTRINSICS, MEMORY_INTRINSICS, Binary, BufferLoad, Call, Cast, Compare, Const, Expr, Not, Select,
    Var, const_int, free_vars, walk,
)
from ..ir.stmt import BufferStore, For, LetStmt, Module, PrimFunc, Stmt, iter_stmts
from ..ir.visitor import StmtMutator, SubexpressionReplacer
from .lower import exprs_of
from .simplify import Bounds

_PURE = (Binary, Compare, Not, Cast, Select, Const, Var, BufferLoad)


def costly(e: Expr) -> bool:
    """Whether `e` holds a float division or `pow`, or a math intrinsic: what is worth computing
    once where it is invariant (here, and a GEMM tail's column values: schedule/epilogue.py)."""
    return any((isinstance(x, Call) and x.name in FLOAT_INTRINSICS)
               or (isinstance(x, Binary) and x.op in ("/", "pow") and x.dtype.is_float) for x in walk(e))


def _pure(e: Expr) -> bool:
    return all(isinstance(x, _PURE) or (isinstance(x, Call) and x.name in INTRINSICS) for x in walk(e))


def _bound_inside(loop: For) -> set[Var]:
    """The variables the loop binds: its own, its inner loops', its lets'."""
    out = {loop.var}
    for s in iter_stmts(loop.body):
        if isinstance(s, (For, LetStmt)):
            out.add(s.var)
    return out


class _Hoist(StmtMutator):
    def __init__(self, func: PrimFunc) -> None:
        self.bounds = Bounds()
        self.written = {id(s.buffer) for s in iter_stmts(func.body) if isinstance(s, BufferStore)}
        # a buffer an atomic updates, or that is read past the L1 (load_cg: other blocks write it)
        self.written |= {id(x.args[0].buffer) for e in exprs_of(func.body) for x in walk(e)
                         if isinstance(x, Call) and x.name in MEMORY_INTRINSICS and x.args
                         and isinstance(x.args[0], BufferLoad)}
        self.taken = 0
        self.names = {s.var.name for s in iter_stmts(func.body) if isinstance(s, (For, LetStmt))}

    def in_bounds(self, load: BufferLoad) -> bool:
        buf = load.buffer
        if buf.scope != "global" or id(buf) in self.written or len(load.indices) != len(buf.shape):
            return False
        for index, extent in zip(load.indices, buf.shape):
            n = const_int(extent)
            lo, hi = self.bounds.of(index)
            if n is None or lo is None or hi is None or lo < 0 or hi >= n:
                return False
        return True

    def movable(self, e: Expr, inside: set[Var]) -> bool:
        # (the variables first: a node's own, no walk of its subtree)
        return (not free_vars(e) & inside and costly(e) and _pure(e)
                and all(self.in_bounds(x) for x in walk(e) if isinstance(x, BufferLoad)))

    def candidates(self, loop: For) -> list[Expr]:
        inside = _bound_inside(loop)
        found: list[Expr] = []
        seen: set[int] = set()
        stack = list(reversed(exprs_of(loop.body)))
        while stack:
            e = stack.pop()
            if id(e) in seen:
                continue
            seen.add(id(e))
            if e.dtype != dt.bool_ and self.movable(e, inside):
                found.append(e)
                continue
            stack.extend(reversed(e.children))
        return found

    def visit_LetStmt(self, s: LetStmt) -> Stmt:
        if s.var.dtype.is_int:
            self.bounds.var_bounds[s.var] = self.bounds.of(s.value)
        return self.generic_visit(s)

    def visit_For(self, s: For) -> Stmt:
        found = self.candidates(s) if s.kind in ("serial", "unroll") else []
        lo, ext = const_int(s.min), const_int(s.extent)
        if lo is not None and ext is not None:
            self.bounds.var_bounds[s.var] = (lo, lo + ext - 1)
        loop = s
        if found:
            lets: list[tuple[Var, Expr]] = []
            for e in found:
                name = f"{s.var.name}_invariant{self.taken}"
                while name in self.names:
                    self.taken += 1
                    name = f"{s.var.name}_invariant{self.taken}"
                self.names.add(name)
                self.taken += 1
                lets.append((Var(name, e.dtype, "value"), e))
            replaced = _Replace({e: v for v, e in lets}).visit(s.body)
            loop = For(s.var, s.min, s.extent, s.kind, replaced, s.annotations)
        body = self.visit(loop.body)
        out: Stmt = loop if body is loop.body else For(loop.var, loop.min, loop.extent, loop.kind, body,
                                                        loop.annotations)
        if found:
            for v, e in reversed(lets):
                out = LetStmt(v, e, out)
        return out


class _Replace(StmtMutator):
    def __init__(self, mapping: dict[Expr, Expr]) -> None:
        self.expr_mutator = SubexpressionReplacer(mapping)


def hoist_func(func: PrimFunc) -> PrimFunc:
    return _Hoist(func).visit_func(func)


def hoist_invariants(module: Module) -> Module:
    """Every kernel with its loops' costly invariant expressions before the loops (module
    docstring); the same module where none has any."""
    kernels = [hoist_func(k) for k in module.kernels]
    if all(a is b for a, b in zip(kernels, module.kernels)):
        return module
    return module.with_kernels(kernels)


__all__ = ["costly", "hoist_func", "hoist_invariants"]
