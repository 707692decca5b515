"""The functions of the tensor-expression language: reductions, math, where, cast."""

from __future__ import annotations

from typing import Sequence

from .dtype import DTypeLike, as_dtype
from .errors import DTypeError, ShapeError
from .expr import Const, Expr, ExprLike, Reduce, ReduceAxis, as_expr, binary, call, select
from .expr import cast as _cast


def _reduce(combiner: str, expr: ExprLike, axis: ReduceAxis | Sequence[ReduceAxis]) -> Expr:
    axes = (axis,) if isinstance(axis, ReduceAxis) else tuple(axis)
    if not axes:
        raise ShapeError(f"{combiner}(): give at least one reduction axis with axis=")
    for a in axes:
        if not isinstance(a, ReduceAxis):
            raise ShapeError(
                f"{combiner}(): axis= takes axes made by tc.reduce_axis, got {a!r}; a compute's own axes "
                "cannot be reduced over"
            )
    if len(set(axes)) != len(axes):
        raise ShapeError(f"{combiner}(): axis {', '.join(a.name for a in axes)} lists an axis twice")
    src = as_expr(expr)
    if src.dtype.is_bool:
        raise DTypeError(f"{combiner}() of a bool expression ({src}); cast it to an integer or float first")
    if isinstance(src, Reduce) and set(src.axes) & set(axes):
        raise ShapeError(f"{combiner}(): axis is already reduced by the inner {src.combiner}()")
    return Reduce(combiner, src, axes)


def sum(expr: ExprLike, axis: ReduceAxis | Sequence[ReduceAxis]) -> Expr:  # noqa: A001 - the language's name
    """Σ of `expr` over the reduction axes (identity 0)."""
    return _reduce("sum", expr, axis)


def prod(expr: ExprLike, axis: ReduceAxis | Sequence[ReduceAxis]) -> Expr:
    """Π of `expr` over the reduction axes (identity 1)."""
    return _reduce("prod", expr, axis)


def max(expr: ExprLike, axis: ReduceAxis | Sequence[ReduceAxis]) -> Expr:  # noqa: A001
    """Maximum of `expr` over the reduction axes (identity -inf, or the dtype's lowest integer).
    NaN if any element is NaN, as `np.max`; `nanmax` skips NaN."""
    return _reduce("max", expr, axis)


def min(expr: ExprLike, axis: ReduceAxis | Sequence[ReduceAxis]) -> Expr:  # noqa: A001
    """Minimum of `expr` over the reduction axes (identity +inf, or the dtype's highest integer).
    NaN if any element is NaN, as `np.min`; `nanmin` skips NaN."""
    return _reduce("min", expr, axis)


def nanmax(expr: ExprLike, axis: ReduceAxis | Sequence[ReduceAxis]) -> Expr:
    """Maximum of `expr` over the reduction axes, NaN elements skipped (as `np.nanmax`). A row
    of only NaN gives the identity -inf, as an empty one does (NumPy gives NaN and warns).
    On integer sources it is `max`."""
    return _reduce("nanmax" if as_expr(expr).dtype.is_float else "max", expr, axis)


def nanmin(expr: ExprLike, axis: ReduceAxis | Sequence[ReduceAxis]) -> Expr:
    """Minimum of `expr` over the reduction axes, NaN elements skipped (as `np.nanmin`); a row of
    only NaN gives +inf. On integer sources it is `min`."""
    return _reduce("nanmin" if as_expr(expr).dtype.is_float else "min", expr, axis)


def exp(x: ExprLike) -> Expr:
    return call("exp", x)


def exp2(x: ExprLike) -> Expr:
    return call("exp2", x)


def log(x: ExprLike) -> Expr:
    return call("log", x)


def log2(x: ExprLike) -> Expr:
    return call("log2", x)


def sqrt(x: ExprLike) -> Expr:
    return call("sqrt", x)


def rsqrt(x: ExprLike) -> Expr:
    """1 / sqrt(x)."""
    return call("rsqrt", x)


def sin(x: ExprLike) -> Expr:
    return call("sin", x)


def cos(x: ExprLike) -> Expr:
    return call("cos", x)


def tanh(x: ExprLike) -> Expr:
    return call("tanh", x)


def erf(x: ExprLike) -> Expr:
    return call("erf", x)


def sigmoid(x: ExprLike) -> Expr:
    """1 / (1 + exp(-x))."""
    return call("sigmoid", x)


def abs(x: ExprLike) -> Expr:  # noqa: A001
    return call("abs", x)


def floor(x: ExprLike) -> Expr:
    return call("floor", x)


def ceil(x: ExprLike) -> Expr:
    return call("ceil", x)


def isnan(x: ExprLike) -> Expr:
    return call("isnan", x)


def maximum(a: ExprLike, b: ExprLike) -> Expr:
    """Elementwise larger of two values; NaN when either is NaN (as `np.maximum`)."""
    return binary("max", a, b)


def minimum(a: ExprLike, b: ExprLike) -> Expr:
    """Elementwise smaller of two values; NaN when either is NaN (as `np.minimum`)."""
    return binary("min", a, b)


def fmax(a: ExprLike, b: ExprLike) -> Expr:
    """Elementwise larger of two values, a NaN operand ignored (as `np.fmax` and CUDA's `fmaxf`):
    NaN only when both are NaN."""
    return binary("fmax", a, b)


def fmin(a: ExprLike, b: ExprLike) -> Expr:
    """Elementwise smaller of two values, a NaN operand ignored (as `np.fmin` and CUDA's `fminf`)."""
    return binary("fmin", a, b)


def pow(a: ExprLike, b: ExprLike) -> Expr:  # noqa: A001
    return binary("pow", a, b)


def where(cond: ExprLike, a: ExprLike, b: ExprLike) -> Expr:
    """`a` where `cond` holds, else `b`; only the chosen side is evaluated."""
    return select(cond, a, b)


def cast(x: ExprLike, dtype: DTypeLike) -> Expr:
    """`x` converted to `dtype` (float to int truncates toward zero)."""
    return _cast(x, dtype)


def const(value: int | float | bool, dtype: DTypeLike) -> Expr:
    """A constant of an explicit dtype. The value must fit: an integer in the dtype's range, a
    finite float that stays finite (DTypeError otherwise; `cast` converts expressions)."""
    if isinstance(value, Expr):
        return _cast(value, dtype)
    d = as_dtype(dtype)
    if d.is_int and isinstance(value, float) and not value.is_integer():
        raise DTypeError(f"tc.const({value!r}, '{d}'): {value!r} is not an integer, so it is no {d} constant; "
                         f"give an integer, or convert an expression with tc.cast(x, '{d}') (truncating)")
    return Const(value, d)
