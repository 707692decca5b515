"""Contractions (mm, bmm, addmm, baddbmm, mv, dot) as `tc.sum(A[.., i, k] * B[.., k, j], axis=k)`.

float16/bfloat16 operands are cast to float32 inside the sum and the result rounded once (what
cuBLAS and ATen's CPU kernels do, and the form tecc's tensor-core strategies recognise); addmm's
bias is added in float32 before that one rounding.
"""

from __future__ import annotations

from typing import Any

from ...ir import dtype as dt
from ...ir import ops as te
from ...ir.dtype import DType
from ...ir.expr import Expr
from ...ir.tensor import Tensor, reduce_axis
from .context import LoweringContext, Unsupported, as_value, broadcast_read


def _accumulator(d: DType) -> DType:
    if d.is_bool:
        raise Unsupported("a matrix product of bool tensors")
    return dt.float32 if d in (dt.float16, dt.bfloat16) else d


def _operand(x: Expr, acc: DType) -> Expr:
    return te.cast(x, acc)


def _contract(ctx: LoweringContext, a: Any, b: Any, bias: Any = None, beta: Any = 1, alpha: Any = 1) -> Tensor:
    """out[.., i, j] = beta·bias + alpha·Σ_k a[.., i, k]·b[.., k, j] (a batch dimension or none;
    a 1-d a or b is a vector)."""
    if not isinstance(a, Tensor) or not isinstance(b, Tensor):
        raise Unsupported("a matrix product of non-tensors")
    out = ctx.out_dtype()
    acc = _accumulator(out)
    shape = ctx.out_shape()
    k_extent = a.shape[-1]
    k = reduce_axis(k_extent, "k")

    def body(*idx: Expr) -> Expr:
        if a.ndim == 1 and b.ndim == 1:      # dot
            av, bv = a[k], b[k]
        elif b.ndim == 1:                     # mv
            av, bv = a[idx[0], k], b[k]
        elif a.ndim == 3:                     # bmm
            av, bv = a[idx[0], idx[1], k], b[idx[0], k, idx[2]]
        else:                                 # mm
            av, bv = a[idx[0], k], b[k, idx[1]]
        total = te.sum(_operand(av, acc) * _operand(bv, acc), k)
        if not _is_one(alpha):
            total = total * as_value(alpha, acc)
        if bias is not None and not _is_zero(beta):
            term = te.cast(broadcast_read(bias, idx, shape), acc) if isinstance(bias, Tensor) else as_value(bias, acc)
            if not _is_one(beta):
                term = term * as_value(beta, acc)
            total = term + total
        return te.cast(total, out)

    return ctx.compute(shape, body)


def _is_one(x: Any) -> bool:
    return not isinstance(x, Expr) and x == 1


def _is_zero(x: Any) -> bool:
    return not isinstance(x, Expr) and x == 0


def lower_mm(ctx: LoweringContext, a: Any, b: Any) -> Tensor:
    return _contract(ctx, a, b)


def lower_bmm(ctx: LoweringContext, a: Any, b: Any) -> Tensor:
    return _contract(ctx, a, b)


def lower_addmm(ctx: LoweringContext, bias: Any, a: Any, b: Any, *, beta: Any = 1, alpha: Any = 1) -> Tensor:
    return _contract(ctx, a, b, bias, beta, alpha)


def lower_baddbmm(ctx: LoweringContext, bias: Any, a: Any, b: Any, *, beta: Any = 1, alpha: Any = 1) -> Tensor:
    return _contract(ctx, a, b, bias, beta, alpha)


def lower_mv(ctx: LoweringContext, a: Any, v: Any) -> Tensor:
    return _contract(ctx, a, v)


def lower_dot(ctx: LoweringContext, a: Any, b: Any) -> Tensor:
    return _contract(ctx, a, b)
