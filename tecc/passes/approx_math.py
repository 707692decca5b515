"""approx_math: sin and cos whose value is rounded to a 16-bit float at once become the cheap
intrinsics `sin_approx` / `cos_approx` (tecc/ir/approx.py: relative error <= 2^-21.9 plus 1.5e-10
absolute, ~19 issued instructions against the precise sinf's ~27 on sm_90), so an issue-bound bf16
kernel such as `bf16(sin(1.5 * float(x) + float(b)))` has room to reach DRAM speed.

    float16/bfloat16(sin(x))  ->  float16/bfloat16(sin_approx(x))     x float32 (cos alike)
    sin(x)                    ->  sin_approx(x)                       x float16/bfloat16: computed
                                                                      in float32, rounded back
Left alone: a float32 (or float64) sin whose value is used as it is, e.g. stored to a float32
output, which keeps sinf's 1-2 ulp; a sin bound to a variable first (`LetStmt`) even when every
use rounds it; every call when the build asks for precise math (TECC_PRECISE_MATH=1).

A GELU whose float32 value is rounded to a 16-bit float at once becomes one cheap call
(tecc/ir/approx_gelu.py: relative error <= 2^-17 and <= 2^-21 + 2^-22.6 |t|, 12 FP32 + 1 MUFU and
5 FP32 + 2 MUFU instructions against ~40 through erff / tanhf):

    f16/bf16(0.5 * v * (1 + erf(v * 1/sqrt2)))                     ->  f16/bf16(gelu_erf_approx(v))
    f16/bf16(0.5 * v * (1 + tanh(sqrt(2/pi) * (v + 0.044715 v^3))))  ->  f16/bf16(gelu_tanh_approx(v))

`gelu_form` recognizes them as written by hand: the outer product in any order and grouping
(its constants multiplying to 1/2, one other factor v, one factor 1 + erf|tanh(w)), and w any
sum of products of v and constants that is the polynomial of the form (constants to 2^-20).
v is any float32 expression that is not itself a product (a product's factors would mix with the
outer ones): the GEMM's `acc + bias[j]`, a load, a sum.

`approximated` is the one predicate, and `approximate_expr` the one rewrite, that both this pass
and the cost model's instruction count (tecc.compiler.cost.analysis, which runs on the IR before
this pass) use, so the planner prices the calls the way they will be emitted.
"""

from __future__ import annotations

import math

from ..ir import dtype as dt
from ..ir.dtype import DType
from ..ir.expr import Binary, Call, Cast, Const, Expr, call
from ..ir.stmt import Module
from ..ir.visitor import ExprMutator, StmtMutator

# The precise intrinsic -> its cheap form (APPROX_INTRINSICS in tecc/ir/expr.py).
APPROXIMATION = {"sin": "sin_approx", "cos": "cos_approx"}
SIXTEEN_BIT_FLOATS = (dt.float16, dt.bfloat16)


def approximated(e: Expr, rounded_to: DType | None = None) -> bool:
    """Whether `e` is a call this pass replaces by its cheap form: a sin/cos of a 16-bit float
    (its value is rounded to that type), or a float32 one whose value is converted to a 16-bit
    float right away (`rounded_to`: the dtype of the Cast that reads `e`, None when none does)."""
    if not isinstance(e, Call) or e.name not in APPROXIMATION:
        return False
    if e.dtype in SIXTEEN_BIT_FLOATS:
        return True
    return e.dtype == dt.float32 and rounded_to in SIXTEEN_BIT_FLOATS


# the forms' polynomials in v of the erf / tanh argument (degree -> coefficient)
GELU_FORMS = {
    "gelu_erf_approx": ("erf", {1: math.sqrt(0.5)}),
    "gelu_tanh_approx": ("tanh", {1: math.sqrt(2.0 / math.pi), 3: 0.044715 * math.sqrt(2.0 / math.pi)}),
}
GELU_TOLERANCE = 2.0 ** -20   # relative, on every constant (a float32 literal is within 2^-24)


def _factors(e: Expr) -> list[Expr]:
    """The factors of a float product tree (`e` itself when it is not one)."""
    if isinstance(e, Binary) and e.op == "*" and e.dtype == dt.float32:
        return _factors(e.a) + _factors(e.b)
    return [e]


def _polynomial(e: Expr, v: Expr) -> dict[int, float] | None:
    """`e` as a polynomial in `v` (degree -> coefficient), or None when it is not one built of
    +, -, * and constants."""
    if e is v:
        return {1: 1.0}
    if isinstance(e, Const) and e.dtype.is_float:
        return {0: float(e.value)}
    if isinstance(e, Binary) and e.op == "/" and isinstance(e.b, Const) and float(e.b.value) != 0.0:
        a = _polynomial(e.a, v)
        return None if a is None else {d: c / float(e.b.value) for d, c in a.items()}
    if not isinstance(e, Binary) or e.dtype != dt.float32 or e.op not in ("+", "-", "*"):
        return None
    a, b = _polynomial(e.a, v), _polynomial(e.b, v)
    if a is None or b is None:
        return None
    out: dict[int, float] = {}
    if e.op == "*":
        for da, ca in a.items():
            for db, cb in b.items():
                out[da + db] = out.get(da + db, 0.0) + ca * cb
    else:
        sign = 1.0 if e.op == "+" else -1.0
        out = dict(a)
        for d, c in b.items():
            out[d] = out.get(d, 0.0) + sign * c
    return {d: c for d, c in out.items() if c != 0.0}


def _close(got: dict[int, float], want: dict[int, float]) -> bool:
    return got.keys() == want.keys() and all(abs(got[d] - c) <= GELU_TOLERANCE * abs(c) for d, c in want.items())


def gelu_form(e: Expr) -> tuple[str, Expr] | None:
    """(the cheap intrinsic, v) when `e` is one of the float32 GELUs of the module docstring."""
    if e.dtype != dt.float32:
        return None
    factors = _factors(e)
    scale = math.prod(float(f.value) for f in factors if isinstance(f, Const))
    others = [f for f in factors if not isinstance(f, Const)]
    if len(others) != 2 or abs(scale - 0.5) > GELU_TOLERANCE * 0.5:
        return None
    for v, bracket in (others, others[::-1]):
        if not (isinstance(bracket, Binary) and bracket.op == "+"):
            continue
        one, inner = (bracket.a, bracket.b) if isinstance(bracket.a, Const) else (bracket.b, bracket.a)
        if not (isinstance(one, Const) and float(one.value) == 1.0 and isinstance(inner, Call)):
            continue
        for name, (function, coefficients) in GELU_FORMS.items():
            if inner.name != function:
                continue
            poly = _polynomial(inner.args[0], v)
            if poly is not None and _close(poly, coefficients):
                return name, v
    return None


class _Approximate(ExprMutator):
    """Replaces every call `approximated` accepts; the rest of the tree as it is."""

    def visit_Cast(self, e: Cast) -> Expr:
        inner = e.a
        gelu = gelu_form(inner) if e.dtype in SIXTEEN_BIT_FLOATS else None
        if gelu is not None:
            return Cast(e.dtype, call(gelu[0], self.visit(gelu[1])))
        if isinstance(inner, Call) and approximated(inner, e.dtype):
            # Rebuilt here, not through self.visit(inner): the same (hash-consed) sin node may also
            # be used elsewhere unrounded, and that use must stay precise.
            arg = self.visit(inner.args[0])
            return Cast(e.dtype, call(APPROXIMATION[inner.name], arg))
        return self.generic_visit(e)

    def visit_Call(self, e: Call) -> Expr:
        out = self.generic_visit(e)
        if isinstance(out, Call) and approximated(out):
            return call(APPROXIMATION[out.name], *out.args)
        return out


class _InStatements(StmtMutator):
    def __init__(self) -> None:
        self.expr_mutator = _Approximate()


def approximate_expr(e: Expr) -> Expr:
    """`e` with every sin/cos that `approximated` accepts replaced by its cheap form."""
    return _Approximate().visit(e)


def approx_math(module: Module, precise: bool = False) -> Module:
    """The pass: rewrite every kernel (nothing when `precise`)."""
    if precise:
        return module
    kernels = [_InStatements().visit_func(k) for k in module.kernels]
    if all(new is old for new, old in zip(kernels, module.kernels)):
        return module
    return module.with_kernels(kernels)


__all__ = ["APPROXIMATION", "GELU_FORMS", "approx_math", "approximate_expr", "approximated", "gelu_form"]
