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

`approximated` is the one predicate, and `approximate_expr` the one rewrite, that both this pass
and the cost model's instruction count (tecc.compiler.cost.analysis, which runs on the IR before
this pass) use, so the planner prices the calls the way they will be emitted.
"""

from __future__ import annotations

from ..ir import dtype as dt
from ..ir.dtype import DType
from ..ir.expr import Call, Cast, Expr, call
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


class _Approximate(ExprMutator):
    """Replaces every call `approximated` accepts; the rest of the tree as it is."""

    def visit_Cast(self, e: Cast) -> Expr:
        inner = e.a
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


__all__ = ["APPROXIMATION", "approx_math", "approximate_expr", "approximated"]
