"""Row-invariant factors of a row kernel's per-column expressions (fuse_rows).

A pass of a row kernel evaluates its expression once per column of the thread. A factor free
of the column (a row statistic in its register, a value read at the row, a constant) costs a
multiply per column wherever the product's association puts it among the column's factors,
and tc.grad writes products as the chain rule hands them over: layer norm's dvar source is
`dY·g·(x − μ)·(−0.5)·r·r·r`, four multiplies by row constants per column, then the sum.

- `group_invariants(e, varying)`: every product of `e` with two or more row-invariant factors
  becomes (its column factors, in their order)·(its invariant factors, in their order): the
  invariant product is one subexpression, computed once per row. A product's factors are its
  maximal column-dependent `*` subtrees' leaves; an invariant subtree is one factor, so a
  product whose invariants are already one subtree (`(dvar·(1/C))·(x − μ)`) is left as it is.
- `split_invariant(e, varying)`: a sum's source `V·I` with I invariant: (V, I), so the sum
  accumulates V and multiplies its total by I once (Σ_c V·I = I·Σ_c V).
- `invariant_divisions(e, varying)`: the divisions of `e` free of the column, which fuse_rows
  computes once per row into a register: a float division has a slow-path branch (FCHK, a
  call) that keeps ptxas from hoisting it out of a guarded column, so cross-entropy's
  `dloss / s` was divided once per vector of every thread (~6% of that kernel's instructions).
  Not below a Select's branches (a Select may guard a read that is out of bounds elsewhere).

- `delta_sum(e, col, columns, varying, acc_dtype)`: a sum over the row of a source that depends on
  the column only through one test `col == E` with E free of the column (a one-hot row: cross-
  entropy's backward sums the scatter of -1 at the target) is that source at the hit plus the
  other columns' value: Σ_c S = [0 ≤ E < C]·S_true + (C − [0 ≤ E < C])·S_false, once per row, no
  walk over the row. The columns' common value S_false (0·dloss there) is kept, so a NaN or an
  infinity in it still poisons the sum as the walk's 0·inf would.

Only the association of multiplications changes (a few ulps, as any reordering of a float
product); divisions, sums and casts are left alone, and so is a product with a single invariant
factor (nothing to save: the forward normalizations' `d·r·g` keeps its form and its bits).
"""

from __future__ import annotations

from typing import Collection

from ...ir.arith import cast, compare, logical_and, select
from ...ir.expr import Binary, Cast, Compare, Expr, Select, Var, binary, free_vars, walk
from ...ir.expr_visitor import SubexpressionReplacer
from ...ir.visitor import ExprMutator
from ...ir import dtype as dt


def _varies(e: Expr, varying: Collection[Var]) -> bool:
    return any(v in varying for v in free_vars(e))


def _factors(e: Expr, varying: Collection[Var]) -> list[Expr]:
    """The factors of a product: descends `*` nodes that depend on the column, in order."""
    if isinstance(e, Binary) and e.op == "*" and e.dtype.is_float and _varies(e, varying):
        return _factors(e.a, varying) + _factors(e.b, varying)
    return [e]


def _product(factors: list[Expr]) -> Expr:
    out = factors[0]
    for f in factors[1:]:
        out = binary("*", out, f)
    return out


def _regrouped(e: Expr, varying: Collection[Var]) -> tuple[list[Expr], list[Expr]] | None:
    """(column factors, invariant factors) of product `e`, or None when it is no product that
    mixes them."""
    if not (isinstance(e, Binary) and e.op == "*" and e.dtype.is_float and _varies(e, varying)):
        return None
    factors = _factors(e, varying)
    column = [f for f in factors if _varies(f, varying)]
    invariant = [f for f in factors if not _varies(f, varying)]
    if not column or not invariant or any(f.dtype != e.dtype for f in factors):
        return None
    return column, invariant


class _Group(ExprMutator):
    def __init__(self, varying: Collection[Var]) -> None:
        super().__init__()
        self.varying = varying

    def visit_Binary(self, e: Binary) -> Expr:
        parts = _regrouped(e, self.varying)
        if parts is None or len(parts[1]) < 2:
            return self.generic_visit(e)
        column, invariant = parts
        return binary("*", _product([self.visit(f) for f in column]), _product([self.visit(f) for f in invariant]))


def group_invariants(e: Expr, varying: Collection[Var]) -> Expr:
    """`e` with each product's row-invariant factors grouped into one subexpression (module
    docstring); `varying`: the variables of the column (k, v, threadIdx, a column variable)."""
    return _Group(varying).visit(e)


def split_invariant(e: Expr, varying: Collection[Var]) -> tuple[Expr, Expr | None]:
    """(V, I) for a sum's source `e` = V·I with I free of the column, or (e, None)."""
    parts = _regrouped(e, varying)
    if parts is None:
        return e, None
    column, invariant = parts
    return _product(column), _product(invariant)


def invariant_divisions(e: Expr, varying: Collection[Var]) -> list[Expr]:
    """The outermost float divisions of `e` free of the column, each once, in the order met
    (module docstring)."""
    out: list[Expr] = []
    seen: set[int] = set()

    def visit(n: Expr) -> None:
        if id(n) in seen:
            return
        seen.add(id(n))
        if isinstance(n, Binary) and n.op == "/" and n.dtype.is_float and not _varies(n, varying):
            out.append(n)
            return
        if isinstance(n, Select):
            visit(n.cond)
            return
        for c in n.children:
            visit(c)

    visit(e)
    return out


def _hit(cond: Expr, col: Expr, column_vars: Collection[Var]) -> Expr | None:
    """E when `cond` is `col == E` or `E == col` (either side maybe cast), with E free of the column."""
    if not (isinstance(cond, Compare) and cond.op == "=="):
        return None
    for mine, other in ((cond.a, cond.b), (cond.b, cond.a)):
        bare = mine.a if isinstance(mine, Cast) and mine.dtype.is_int else mine
        if bare is col and other.dtype.is_int and not _varies(other, column_vars):
            return other
    return None


def delta_sum(e: Expr, col: Expr, columns: Expr, varying: Collection[Var], acc_dtype: dt.DType) -> Expr | None:
    """Σ over the row's C = `columns` columns of the source `e` in closed form, accumulated in
    `acc_dtype`, when `e` depends on the column `col` only through one `col == E` test (module
    docstring); else None."""
    column_vars = set(varying) | set(free_vars(col))
    if not _varies(e, column_vars):
        return None
    tests = {id(n): n for n in walk(e) if isinstance(n, Select) and _hit(n.cond, col, column_vars) is not None}
    if len({id(n.cond) for n in tests.values()}) != 1:
        return None
    cond = next(iter(tests.values())).cond
    hit = _hit(cond, col, column_vars)
    assert hit is not None
    on = SubexpressionReplacer({n: n.a for n in tests.values()}).visit(e)
    off = SubexpressionReplacer({n: n.b for n in tests.values()}).visit(e)
    if _varies(on, column_vars) or _varies(off, column_vars):
        return None
    inside = logical_and(compare(">=", hit, 0), compare("<", hit, cast(columns, hit.dtype)))
    on, off = cast(on, acc_dtype), cast(off, acc_dtype)
    n = cast(columns, acc_dtype)
    return select(inside, on + (n - 1) * off, n * off)


__all__ = ["delta_sum", "group_invariants", "invariant_divisions", "split_invariant"]
