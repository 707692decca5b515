"""Tensors made from nothing: full, full_like, scalar_tensor, zeros/ones/empty, arange, iota.

Each is a compute whose element is a constant, or an affine function of the index for arange
and iota; read by another op it is inlined as that constant or index expression. `empty` is
written as zeros (its contents are unspecified, and zeros are a valid choice).
"""

from __future__ import annotations

from typing import Any

from ...ir import dtype as dt
from ...ir import ops as te
from ...ir.expr import Expr
from ...ir.tensor import Tensor
from .context import LoweringContext, Unsupported, as_value


def _check_device(kwargs: dict[str, Any]) -> None:
    layout = kwargs.get("layout")
    if layout is not None and str(layout) != "torch.strided":
        raise Unsupported(f"layout {layout}")


def lower_full(ctx: LoweringContext, size: Any, fill: Any, **kwargs: Any) -> Tensor:
    _check_device(kwargs)
    d = ctx.out_dtype()
    return ctx.compute(ctx.out_shape(), lambda *idx: as_value(fill, d))


def lower_full_like(ctx: LoweringContext, x: Any, fill: Any, **kwargs: Any) -> Tensor:
    return lower_full(ctx, None, fill, **kwargs)


def lower_scalar_tensor(ctx: LoweringContext, value: Any, **kwargs: Any) -> Tensor:
    return lower_full(ctx, (), value, **kwargs)


def lower_zeros(ctx: LoweringContext, *args: Any, **kwargs: Any) -> Tensor:
    return lower_full(ctx, None, 0, **{k: v for k, v in kwargs.items() if k == "layout"})


def lower_ones(ctx: LoweringContext, *args: Any, **kwargs: Any) -> Tensor:
    return lower_full(ctx, None, 1, **{k: v for k, v in kwargs.items() if k == "layout"})


def _ramp(ctx: LoweringContext, start: Any, step: Any) -> Tensor:
    """out[i] = start + i·step, computed in float64 (int64 for integer results), as ATen's arange
    does, then converted once."""
    out = ctx.out_dtype()
    wide = dt.int64 if out.is_int else dt.float64
    if out.is_bool:
        raise Unsupported("a bool range")

    def body(i: Expr) -> Expr:
        return te.cast(as_value(start, wide) + te.cast(i, wide) * as_value(step, wide), out)

    return ctx.compute(ctx.out_shape(), body)


def lower_arange(ctx: LoweringContext, end: Any, **kwargs: Any) -> Tensor:
    _check_device(kwargs)
    return _ramp(ctx, 0, 1)


def lower_arange_start(ctx: LoweringContext, start: Any, end: Any, step: Any = 1, **kwargs: Any) -> Tensor:
    _check_device(kwargs)
    return _ramp(ctx, start, step)


def lower_iota(ctx: LoweringContext, length: Any, *, start: Any, step: Any, **kwargs: Any) -> Tensor:
    return _ramp(ctx, start, step)
