"""Reductions (sum, mean, amax, amin, prod, any, all, var_mean, var) as tensor expressions.

A reduction over `dims` is one compute of the node's shape with a `tc.sum / max / min / prod`
over one reduction axis per reduced dimension (two adjacent ones before the last: one axis over both,
`reduce_compute`). Accumulation follows eager: float16/bfloat16
sources sum in float32 and round once at the end (tecc's Reduce accumulates 16-bit sources in
float32, docs/semantics.md); integer and bool sums are int64, as torch's. NaN propagates
through max/min (torch.amax), as tecc's `max` does.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from ...ir import dtype as dt
from ...ir import ops as te
from ...ir.dtype import DType
from ...ir.expr import Expr, ExprLike, ReduceAxis, as_expr, const_int
from ...ir.tensor import Tensor, reduce_axis
from .context import LoweringContext, Unsupported, constant

Combine = Callable[[Expr, Sequence[ReduceAxis]], Expr]


def reduced_dims(x: Tensor, dims: Any) -> list[int]:
    """`dims` (None, an int or a list; [] means all for the ops that take it) normalized."""
    if dims is None:
        return list(range(x.ndim))
    if isinstance(dims, int):
        dims = [dims]
    dims = list(dims)
    if not dims:
        return list(range(x.ndim))
    if x.ndim == 0:
        return []
    return sorted({d % x.ndim for d in dims})


def element_count(x: Tensor, dims: Sequence[int]) -> ExprLike:
    """How many elements a reduction over `dims` combines (a size expression)."""
    count: ExprLike = 1
    for d in dims:
        count = count * x.shape[d]
    return count


def reduce_compute(ctx: LoweringContext, x: Tensor, dims: Sequence[int], keepdim: bool,
                   fn: Callable[[Callable[[], Expr], Sequence[ReduceAxis], Sequence[Expr]], Expr],
                   shape: Sequence[ExprLike], suffix: str = "") -> Tensor:
    """A compute of `shape` whose element is `fn(read, axes, idx)`: `read()` is x at the output
    index with the reduced dimensions replaced by reduction axes (`axes`).

    Two adjacent reduced dimensions of constant extents before the last one (a bias's or a layer
    norm weight's gradient, summed over batch and tokens: dims [0, 1] of [B, T, C]) are one
    reduction axis r of B·T read as x[r // T, r % T, c]: a reduction over one axis, which the
    column reduction's split (compiler/strategies/column_reduction.py) takes."""
    flat = _flat_pair(x, dims)
    if flat is not None:
        r = reduce_axis(flat[0] * flat[1], f"r{dims[0]}")
        axes: list[ReduceAxis] = [r]
        by_dim: dict[int, Expr] = {dims[0]: r // flat[1], dims[1]: r % flat[1]}
    else:
        axes = [reduce_axis(x.shape[d], f"r{d}") for d in dims]
        by_dim = dict(zip(dims, axes))

    trailing = list(dims) == list(range(x.ndim - len(dims), x.ndim))
    as_view = bool(keepdim and dims and trailing) and not ctx.laid_out(shape)

    def body(*idx: Expr) -> Expr:
        # idx: the output index; with keepdim it holds the size-1 dimensions, except in the
        # reduction that `as_view` reads through a view (no size-1 dimensions)
        full: list[Expr] = []
        kept: list[Expr] = []
        position = 0
        for d in range(x.ndim):
            if d in by_dim:
                full.append(by_dim[d])
                if keepdim:
                    kept.append(as_expr(0))
                    if not as_view:
                        position += 1
            else:
                full.append(idx[position])
                kept.append(idx[position])
                position += 1
        return fn(lambda: x[tuple(full)], axes, kept if as_view else idx)

    if not as_view:
        return ctx.compute(shape, body, suffix)
    # keepdim over the trailing dimensions (a row statistic): the reduction over the remaining
    # dimensions, read through a view that puts back the size-1 dimensions (inlined into its
    # readers), so that a reader of the statistic reads it at its own row (r), not at (r, 0):
    # the form row fusion and the region search match. A column statistic (leading dimensions
    # reduced) keeps its shape: its own stage, which the column reduction's split takes.
    reduced = ctx.compute([s for d, s in enumerate(shape) if d not in by_dim], body, suffix)
    return ctx.compute(shape, lambda *idx: reduced[tuple(i for d, i in enumerate(idx) if d not in by_dim)],
                       suffix + "_keepdim")


def _flat_pair(x: Tensor, dims: Sequence[int]) -> tuple[int, int] | None:
    """The two constant extents of `dims` when they are two adjacent dimensions before x's last."""
    if len(dims) != 2 or dims[1] != dims[0] + 1 or dims[1] >= x.ndim - 1:
        return None
    extents = [const_int(as_expr(x.shape[d])) for d in dims]
    if any(e is None or e <= 0 for e in extents):
        return None
    return extents[0], extents[1]  # type: ignore[return-value]


def _simple(ctx: LoweringContext, x: Any, dims: Any, keepdim: bool, combiner: str,
            source_dtype: DType | None = None) -> Tensor:
    if not isinstance(x, Tensor):
        raise Unsupported("a reduction of a non-tensor")
    out = ctx.out_dtype()
    d = reduced_dims(x, dims)
    src = source_dtype or out

    def fn(read: Callable[[], Expr], axes: Sequence[ReduceAxis], idx: Sequence[Expr]) -> Expr:
        value = te.cast(read(), src)
        if not axes:
            return te.cast(value, out)
        if src.is_bool:
            value = te.cast(value, "int32")
        return te.cast(_combine(combiner, value, axes), out)

    return reduce_compute(ctx, x, d, keepdim, fn, ctx.out_shape())


def _combine(combiner: str, value: Expr, axes: Sequence[ReduceAxis]) -> Expr:
    return {"sum": te.sum, "max": te.max, "min": te.min, "prod": te.prod}[combiner](value, list(axes))


def lower_sum(ctx: LoweringContext, x: Any, dims: Any = None, keepdim: bool = False, *, dtype: Any = None) -> Tensor:
    return _simple(ctx, x, dims, keepdim, "sum")


def lower_sum_all(ctx: LoweringContext, x: Any, *, dtype: Any = None) -> Tensor:
    return _simple(ctx, x, None, False, "sum")


def lower_prod(ctx: LoweringContext, x: Any, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> Tensor:
    return _simple(ctx, x, dim, keepdim, "prod")


def lower_prod_all(ctx: LoweringContext, x: Any, *, dtype: Any = None) -> Tensor:
    return _simple(ctx, x, None, False, "prod")


def lower_amax(ctx: LoweringContext, x: Any, dims: Any = (), keepdim: bool = False) -> Tensor:
    return _extreme(ctx, x, dims, keepdim, "max")


def lower_amin(ctx: LoweringContext, x: Any, dims: Any = (), keepdim: bool = False) -> Tensor:
    return _extreme(ctx, x, dims, keepdim, "min")


def _extreme(ctx: LoweringContext, x: Any, dims: Any, keepdim: bool, combiner: str) -> Tensor:
    if isinstance(x, Tensor) and x.dtype.is_bool:
        return _simple(ctx, x, dims, keepdim, combiner, dt.int32)
    return _simple(ctx, x, dims, keepdim, combiner, x.dtype if isinstance(x, Tensor) else None)


def lower_any(ctx: LoweringContext, x: Any, dims: Any = None, keepdim: bool = False) -> Tensor:
    return _truth(ctx, x, dims, keepdim, "max")


def lower_all(ctx: LoweringContext, x: Any, dims: Any = None, keepdim: bool = False) -> Tensor:
    return _truth(ctx, x, dims, keepdim, "min")


def _truth(ctx: LoweringContext, x: Any, dims: Any, keepdim: bool, combiner: str) -> Tensor:
    if not isinstance(x, Tensor):
        raise Unsupported("a reduction of a non-tensor")

    def fn(read: Callable[[], Expr], axes: Sequence[ReduceAxis], idx: Sequence[Expr]) -> Expr:
        flag = te.cast(te.cast(read(), "bool"), "int32")
        if not axes:
            return te.cast(flag, "bool")
        return te.cast(_combine(combiner, flag, axes), "bool")

    return reduce_compute(ctx, x, reduced_dims(x, dims), keepdim, fn, ctx.out_shape())


def _opmath(d: DType) -> DType:
    return dt.float32 if d in (dt.float16, dt.bfloat16) else d


def lower_mean(ctx: LoweringContext, x: Any, dims: Any = None, keepdim: bool = False, *, dtype: Any = None) -> Tensor:
    if not isinstance(x, Tensor):
        raise Unsupported("a mean of a non-tensor")
    out = ctx.out_dtype()
    if not out.is_float:
        raise Unsupported(f"mean to {out}")
    d = reduced_dims(x, dims)
    acc = _opmath(out)
    count = element_count(x, d)

    def fn(read: Callable[[], Expr], axes: Sequence[ReduceAxis], idx: Sequence[Expr]) -> Expr:
        value = te.cast(read(), acc)
        total = te.sum(value, list(axes)) if axes else value
        return te.cast(total / te.cast(count, acc) if axes else total, out)

    return reduce_compute(ctx, x, d, keepdim, fn, ctx.out_shape())


def lower_mean_all(ctx: LoweringContext, x: Any, *, dtype: Any = None) -> Tensor:
    return lower_mean(ctx, x, None, False)


def _moments(ctx: LoweringContext, x: Any, dims: Any, correction: Any, keepdim: bool,
             position: int | None) -> tuple[Tensor, Tensor, Tensor]:
    """(variance, mean, the float32 mean the variance reads) of x over dims, two passes: the
    mean, then the mean of squared deviations from it, divided by max(n - correction, 0)."""
    if not isinstance(x, Tensor):
        raise Unsupported("a variance of a non-tensor")
    out = ctx.out_dtype(position)
    if not out.is_float:
        raise Unsupported(f"variance of {out}")
    d = reduced_dims(x, dims)
    acc = _opmath(out)
    count = element_count(x, d)
    correction = 1 if correction is None else correction
    shape = ctx.out_shape(position)
    kept = reduce_compute(ctx, x, d, True, lambda read, axes, idx: (
        te.sum(te.cast(read(), acc), list(axes)) / te.cast(count, acc) if axes else te.cast(read(), acc)),
        [1 if i in d else x.shape[i] for i in range(x.ndim)], "_mean")

    def variance(read: Callable[[], Expr], axes: Sequence[ReduceAxis], idx: Sequence[Expr]) -> Expr:
        full = list(_kept_index(d, keepdim, idx, x.ndim))
        dev = te.cast(read(), acc) - kept[tuple(full)]
        if not axes:
            total = dev * dev
        else:
            total = te.sum(dev * dev, list(axes))
        denominator = te.maximum(te.cast(count, acc) - as_float(correction, acc), constant(0, acc))
        return te.cast(total / denominator, out)

    var = reduce_compute(ctx, x, d, keepdim, variance, shape)
    mean = ctx.compute(shape, lambda *idx: te.cast(kept[tuple(_kept_index(d, keepdim, idx, x.ndim))], out), "_out")
    return var, mean, kept


def _kept_index(dims: Sequence[int], keepdim: bool, idx: Sequence[Expr], ndim: int) -> list[ExprLike]:
    """The index into a keepdim-shaped statistic from an output index (keepdim or not)."""
    full: list[ExprLike] = []
    position = 0
    for i in range(ndim):
        if i in dims:
            full.append(0)
            if keepdim:
                position += 1
        else:
            full.append(idx[position])
            position += 1
    return full


def as_float(value: Any, d: DType) -> Expr:
    if isinstance(value, Expr):
        return te.cast(value, d)
    return constant(value, d)


def lower_var_mean(ctx: LoweringContext, x: Any, dims: Any = None, *, correction: Any = None,
                   keepdim: bool = False) -> tuple[Tensor, Tensor]:
    var, mean, _ = _moments(ctx, x, dims, correction, keepdim, 0)
    return var, mean


def lower_var(ctx: LoweringContext, x: Any, dims: Any = None, *, correction: Any = None,
              keepdim: bool = False) -> Tensor:
    var, _, _ = _moments(ctx, x, dims, correction, keepdim, None)
    return var


def lower_max_all(ctx: LoweringContext, x: Any) -> Tensor:
    return _extreme(ctx, x, None, False, "max")


def lower_min_all(ctx: LoweringContext, x: Any) -> Tensor:
    return _extreme(ctx, x, None, False, "min")


def lower_argmax(ctx: LoweringContext, x: Any, dim: Any = None, keepdim: bool = False) -> Tensor:
    return _arg_extreme(ctx, x, dim, keepdim, "max")


def lower_argmin(ctx: LoweringContext, x: Any, dim: Any = None, keepdim: bool = False) -> Tensor:
    return _arg_extreme(ctx, x, dim, keepdim, "min")


def _arg_extreme(ctx: LoweringContext, x: Any, dim: Any, keepdim: bool, combiner: str) -> Tensor:
    """The first index of the maximum (minimum) along `dim` (of the flattened tensor for None);
    a NaN counts as the extremum, as in torch.argmax: the first NaN's index."""
    if not isinstance(x, Tensor) or x.dtype.is_bool:
        raise Unsupported("argmax / argmin of a non-tensor or bool")
    dims = reduced_dims(x, dim)
    flat = dim is None
    extreme = reduce_compute(ctx, x, dims, True, lambda read, axes, idx: _combine(combiner, read(), axes) if axes
                             else read(), [1 if i in dims else x.shape[i] for i in range(x.ndim)], "_value")
    never = constant(2**62, dt.int64)

    def index(read: Callable[[], Expr], axes: Sequence[ReduceAxis], idx: Sequence[Expr]) -> Expr:
        if not axes:
            return constant(0, dt.int64)
        m = extreme[tuple(_kept_index(dims, keepdim and not flat, idx, x.ndim))]
        v = read()
        position: Any = 0
        for d, a in zip(dims, axes):
            position = position * x.shape[d] + te.cast(a, dt.int64) if not isinstance(position, int) \
                else te.cast(a, dt.int64)
        hit = (v == m) | (te.isnan(v) & te.isnan(m)) if x.dtype.is_float else v == m
        return te.min(te.where(hit, position, never), list(axes))

    return reduce_compute(ctx, x, dims, keepdim and not flat, index, ctx.out_shape())
