"""Index simplification: a small rule table driven by constant bounds of integer expressions.

The rules that matter for generated code are those that undo split/fuse arithmetic:
  (a*c + b) // c  →  a        and   (a*c + b) % c  →  b      when 0 <= b < c
  x // c          →  0        and   x % c          →  x      when 0 <= x < c
  (a*c1) // c2    →  a*(c1/c2)                               when c2 divides c1
  (a*c1) % c2     →  0                                       when c2 divides c1
  (a*c + b) // c  →  a + b // c  and   (a*c + b) % c  →  b % c   for any b (floor semantics)
  (x // c)*c + x % c  →  x                                   for any x (floor semantics; linear_form)
Bounds come from loop ranges (constant extents), thread/block indices and `if` guards are not
used: the rules only need non-negativity and an upper bound below the divisor.

Integer sums are also put in a canonical linear form (`linear_form` / `from_linear`): terms are
collected per atom, cancelled, and rebuilt in order of first appearance with the constant last,
so `(io*64 + ty*4 + ii) - io*64` becomes `ty*4 + ii` (what schedule primitives produce when they
re-base an index into a cache tile). This is a rule table, not sympy: it runs on every index of
every kernel after every primitive, where sympy's cost (milliseconds per expression) would
dominate the build.
"""

from __future__ import annotations

from typing import Optional, Sequence

from ..ir.expr import Binary, Cast, Const, Expr, Var, binary, const_int
from ..ir.stmt import For, LetStmt, Module, PrimFunc, Stmt
from ..ir.visitor import ExprMutator, StmtMutator

Bound = tuple[Optional[int], Optional[int]]  # inclusive [lo, hi]; None = unbounded


class Bounds:
    """Constant bounds of integer expressions under known variable ranges."""

    def __init__(self) -> None:
        self.var_bounds: dict[Var, Bound] = {}

    def of(self, e: Expr) -> Bound:
        c = const_int(e)
        if c is not None:
            return (c, c)
        if isinstance(e, Var):
            if e in self.var_bounds:
                return self.var_bounds[e]
            return (0, None) if e.kind in ("size",) else (None, None)
        if isinstance(e, Cast) and e.dtype.is_int and e.a.dtype.is_int:
            return self.of(e.a)
        if isinstance(e, Binary) and e.dtype.is_int:
            (al, ah), (bl, bh) = self.of(e.a), self.of(e.b)
            if e.op == "+":
                return (_add(al, bl), _add(ah, bh))
            if e.op == "-":
                return (_sub(al, bh), _sub(ah, bl))
            if e.op == "*" and al is not None and bl is not None and al >= 0 and bl >= 0:
                return (al * bl, None if ah is None or bh is None else ah * bh)
            if e.op == "//" and bl is not None and bl > 0 and bl == bh and al is not None and al >= 0:
                return (al // bl, None if ah is None else ah // bl)
            if e.op == "%" and bl is not None and bl > 0 and bl == bh:
                if al is not None and al >= 0 and ah is not None and ah < bl:
                    return (al, ah)
                return (0, bl - 1)
            if e.op == "min":
                return (_min(al, bl), _min_hi(ah, bh))
            if e.op == "max":
                return (_max_lo(al, bl), _max(ah, bh))
        return (None, None)

    def nonneg(self, e: Expr) -> bool:
        lo, _ = self.of(e)
        return lo is not None and lo >= 0


def _add(a: Optional[int], b: Optional[int]) -> Optional[int]:
    return None if a is None or b is None else a + b


def _sub(a: Optional[int], b: Optional[int]) -> Optional[int]:
    return None if a is None or b is None else a - b


def _min(a: Optional[int], b: Optional[int]) -> Optional[int]:
    return None if a is None or b is None else min(a, b)


def _min_hi(a: Optional[int], b: Optional[int]) -> Optional[int]:
    if a is None:
        return b
    if b is None:
        return a
    return min(a, b)


def _max_lo(a: Optional[int], b: Optional[int]) -> Optional[int]:
    if a is None:
        return b
    if b is None:
        return a
    return max(a, b)


def _max(a: Optional[int], b: Optional[int]) -> Optional[int]:
    return None if a is None or b is None else max(a, b)


def _terms(e: Expr) -> list[Expr]:
    """The summands of a chain of integer additions."""
    if isinstance(e, Binary) and e.op == "+" and e.dtype.is_int:
        return _terms(e.a) + _terms(e.b)
    return [e]


def _multiple_of(e: Expr, c: int) -> Optional[Expr]:
    """e / c when e is syntactically a multiple of the constant c, else None."""
    k = const_int(e)
    if k is not None:
        return Const(k // c, e.dtype) if k % c == 0 else None
    if isinstance(e, Binary) and e.op == "*":
        kb = const_int(e.b)
        if kb is not None and kb % c == 0:
            return binary("*", e.a, Const(kb // c, e.dtype))
        ka = const_int(e.a)
        if ka is not None and ka % c == 0:
            return binary("*", Const(ka // c, e.dtype), e.b)
    return None


def _sum(terms: list[Expr], like: Expr) -> Expr:
    if not terms:
        return Const(0, like.dtype)
    out = terms[0]
    for t in terms[1:]:
        out = binary("+", out, t)
    return out


def merged_dims(indices: Sequence[Expr], dims: Sequence[int]) -> tuple[tuple[Expr, ...], list[int]]:
    """A row-major buffer of extents `dims` read as B[.., x // n, x % n, ..] with n its next
    dimension's extent (a view merging two dimensions of a tensor computed in the program) as the
    same read of the buffer with those two dimensions merged, B'[.., x, ..]: the same addresses,
    affine in x. (An extent not known as a constant: pass a negative one, which no constant
    matches.)"""
    out, ext = list(indices), list(dims)
    d = 0
    while d + 1 < len(out):
        a, b = out[d], out[d + 1]
        if (isinstance(a, Binary) and a.op == "//" and isinstance(b, Binary) and b.op == "%"
                and str(a.a) == str(b.a) and const_int(a.b) == const_int(b.b) == ext[d + 1]):
            out[d:d + 2] = [b.a]
            ext[d:d + 2] = [ext[d] * ext[d + 1]]
            d = max(d - 1, 0)
            continue
        d += 1
    return tuple(out), ext


def linear_form(e: Expr) -> tuple[dict[Expr, int], int]:
    """`e` as sum(coefficient * atom) + constant, where atoms are the integer subexpressions that
    are not sums, differences or products by a constant. Dict order is first appearance."""
    terms: dict[Expr, int] = {}
    const = 0
    stack: list[tuple[Expr, int]] = [(e, 1)]
    while stack:
        x, k = stack.pop()
        c = const_int(x)
        if c is not None:
            const += k * c
            continue
        if isinstance(x, Binary) and x.dtype.is_int:
            if x.op == "+":
                stack += [(x.b, k), (x.a, k)]
                continue
            if x.op == "-":
                stack += [(x.b, -k), (x.a, k)]
                continue
            if x.op == "*":
                cb, ca = const_int(x.b), const_int(x.a)
                if cb is not None:
                    stack.append((x.a, k * cb))
                    continue
                if ca is not None:
                    stack.append((x.b, k * ca))
                    continue
        terms[x] = terms.get(x, 0) + k
    out = {t: k for t, k in terms.items() if k != 0}
    merged = _merge_divmod(out)
    if merged is None:
        return out, const
    pair, x, scale = merged
    inner, inner_const = linear_form(x)
    folded: dict[Expr, int] = {}
    for t, k in out.items():  # x's terms where the pair's first one was: first appearance kept
        if any(t is p for p in pair):
            for u, n in inner.items():
                folded[u] = folded.get(u, 0) + scale * n
            inner = {}
        else:
            folded[t] = folded.get(t, 0) + k
    return {t: k for t, k in folded.items() if k != 0}, const + scale * inner_const


def _merge_divmod(terms: dict[Expr, int]) -> tuple[tuple[Expr, Expr], Expr, int] | None:
    """One pair of atoms k·c·(x // c) + k·(x % c) of a linear form, which is k·x for every
    integer x (floor semantics: x == (x // c)·c + x % c), as ((the two atoms), x, k); None when
    there is no such pair. A view that merges two dimensions of a view that split them composes
    to this form."""
    quotients = {(str(t.a), const_int(t.b)): t for t in terms
                 if isinstance(t, Binary) and t.op == "//" and t.dtype.is_int and const_int(t.b)}
    for t, k in terms.items():
        if not (isinstance(t, Binary) and t.op == "%" and t.dtype.is_int):
            continue
        c = const_int(t.b)
        q = quotients.get((str(t.a), c))
        if c is None or c <= 0 or q is None or terms[q] != k * c:
            continue
        return (t, q), t.a, k
    return None


def from_linear(terms: dict[Expr, int], const: int, like: Expr) -> Expr:
    """The expression of a linear form: positive terms first in their order, then negative ones
    subtracted, then the constant."""
    d = like.dtype
    out: Optional[Expr] = None
    for t, k in terms.items():
        if k > 0:
            piece = t if k == 1 else binary("*", t, Const(k, d))
            out = piece if out is None else binary("+", out, piece)
    for t, k in terms.items():
        if k < 0:
            piece = t if k == -1 else binary("*", t, Const(-k, d))
            out = binary("-", Const(0, d) if out is None else out, piece)
    if out is None:
        return Const(const, d)
    if const > 0:
        out = binary("+", out, Const(const, d))
    elif const < 0:
        out = binary("-", out, Const(-const, d))
    return out


class Simplifier(ExprMutator):
    def __init__(self, bounds: Bounds) -> None:
        super().__init__()
        self.bounds = bounds

    def visit_Binary(self, e: Binary) -> Expr:
        a, b = self.visit(e.a), self.visit(e.b)
        c = const_int(b)
        if e.dtype.is_int and e.op in ("//", "%") and c is not None and c > 0:
            out = self._divmod(e.op, a, c)
            if out is not None:
                return out
        node = e if (a is e.a and b is e.b) else binary(e.op, a, b)
        if isinstance(node, Binary) and node.dtype.is_int and node.op in ("+", "-"):
            terms, const = linear_form(node)
            node = from_linear(terms, const, node)
        return node

    def _divmod(self, op: str, a: Expr, c: int) -> Optional[Expr]:
        lo, hi = self.bounds.of(a)
        if lo is not None and lo >= 0 and hi is not None and hi < c:
            return Const(0, a.dtype) if op == "//" else a
        quotient: list[Expr] = []
        rest: list[Expr] = []
        for t in _terms(a):
            q = _multiple_of(t, c)
            if q is not None:
                quotient.append(q)
            else:
                rest.append(t)
        if not quotient:
            return None
        r = _sum(rest, a)
        rlo, rhi = self.bounds.of(r)
        if rlo is not None and rlo >= 0 and rhi is not None and rhi < c:
            return _sum(quotient, a) if op == "//" else r
        if not rest:
            return _sum(quotient, a) if op == "//" else Const(0, a.dtype)
        # floor division: (q*c + r) // c == q + r // c and (q*c + r) % c == r % c for every r
        if op == "//":
            return binary("+", _sum(quotient, a), binary("//", r, Const(c, a.dtype)))
        return binary("%", r, Const(c, a.dtype))


class _SimplifyStmts(StmtMutator):
    def __init__(self) -> None:
        self.bounds = Bounds()
        self.expr_mutator = Simplifier(self.bounds)

    def visit_For(self, s: For) -> Stmt:
        lo, ext = const_int(s.min), const_int(s.extent)
        if lo is not None and ext is not None:
            self.bounds.var_bounds[s.var] = (lo, lo + ext - 1)
        elif lo is not None:
            self.bounds.var_bounds[s.var] = (lo, None)
        self.expr_mutator = Simplifier(self.bounds)  # bounds changed: memo is stale
        return self.generic_visit(s)

    def visit_LetStmt(self, s: LetStmt) -> Stmt:
        self.bounds.var_bounds[s.var] = self.bounds.of(self.visit_expr(s.value))
        self.expr_mutator = Simplifier(self.bounds)
        return self.generic_visit(s)


def same_index(a: Expr, b: Expr) -> bool:
    """Whether two index expressions are equal for every value of their variables by the rules
    that need no bounds (linear form, `(x // c)*c + x % c -> x`): a row read through a reshape
    of [B, T, C] to [B·T, C] is `X[r // T * T + r % T, c]`, which is `X[r, c]`."""
    if a is b:
        return True
    if not (a.dtype.is_int and b.dtype.is_int):
        return False
    simplifier = Simplifier(Bounds())
    return simplifier.visit(a) is simplifier.visit(b)


def simplify_func(func: PrimFunc) -> PrimFunc:
    return _SimplifyStmts().visit_func(func)


def simplify(module: Module) -> Module:
    """Simplify the index arithmetic of every kernel."""
    return module.with_kernels([simplify_func(k) for k in module.kernels])
