"""Random numbers: rand, rand_like, randn, randn_like, bernoulli (and dropout, which torch's
decomposition writes as `rand_like(x) > p`).

Each draws `tc.rand(shape, seed, offset)` (Philox4x32-10, docs/training.md "Random numbers"):
`seed` is an int64 tensor that the compiled graph draws from torch's default generator of the
graph's device at the start of every call (`aten.randint`, the graph's seed node, graph.py), and
`offset` separates the nodes of one graph (context.RandomDraws). So every call draws new numbers,
`torch.manual_seed` makes a run reproducible, and a CUDA-graph replay draws new ones too: the
seed's `randint` is captured like any CUDA random op, and torch advances its generator's Philox
offset at each replay. The numbers are not torch's (a different generator); their distribution
is. A dropout's backward reads the mask its forward saved (AOTAutograd saves `rand_like(x) > p`
for the backward), so forward and backward agree.

Uniforms in 16-bit dtypes are drawn in float32 and rounded, keeping [0, 1): a value that rounds
to 1 becomes the largest value below 1. Normals use Box-Muller on two uniforms:
`sqrt(-2 log(1 - u1)) · cos(2π u2)`.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from ...ir import dtype as dt
from ...ir import ops as te
from ...ir.dtype import DType
from ...ir.expr import Const, Expr, ExprLike
from ...ir.tensor import Tensor
from .context import LoweringContext, Unsupported, constant


def _below_one(d: DType) -> float:
    """The largest value of `d` below 1."""
    bits = {"float16": 11, "bfloat16": 8, "float32": 24, "float64": 53}[d.name]
    return 1.0 - 2.0 ** -bits


def _float_result(ctx: LoweringContext, kwargs: dict[str, Any]) -> DType:
    if kwargs.get("generator") is not None:
        raise Unsupported("a random op with its own torch.Generator (tecc draws from the default one)")
    d = ctx.out_dtype()
    if not d.is_float:
        raise Unsupported(f"random values of dtype {d}")
    return d


def _uniform_of(u: Expr, d: DType) -> Expr:
    if d == dt.float32:
        return u
    v = te.cast(u, d)
    return te.where(v >= constant(1, d), constant(_below_one(d), d), v) if d.bits < 32 else v


def _uniform(ctx: LoweringContext, shape: Sequence[ExprLike], d: DType) -> Tensor:
    u = ctx.uniform(shape)
    return ctx.compute(shape, lambda *i: _uniform_of(u[i], d))


def lower_rand(ctx: LoweringContext, size: Any, **kwargs: Any) -> Tensor:
    return _uniform(ctx, ctx.out_shape(), _float_result(ctx, kwargs))


def lower_rand_like(ctx: LoweringContext, x: Any, **kwargs: Any) -> Tensor:
    return _uniform(ctx, ctx.out_shape(), _float_result(ctx, kwargs))


def _normal(ctx: LoweringContext, shape: Sequence[ExprLike], d: DType) -> Tensor:
    u = ctx.uniform((2, *shape))
    two_pi = Const(2 * math.pi, dt.float32)

    def body(*i: Expr) -> Expr:
        radius = te.sqrt(Const(-2.0, dt.float32) * te.log(Const(1.0, dt.float32) - u[(0, *i)]))
        return te.cast(radius * te.cos(two_pi * u[(1, *i)]), d)

    return ctx.compute(shape, body)


def lower_randn(ctx: LoweringContext, size: Any, **kwargs: Any) -> Tensor:
    return _normal(ctx, ctx.out_shape(), _float_result(ctx, kwargs))


def lower_randn_like(ctx: LoweringContext, x: Any, **kwargs: Any) -> Tensor:
    return _normal(ctx, ctx.out_shape(), _float_result(ctx, kwargs))


def lower_bernoulli_p(ctx: LoweringContext, x: Any, p: Any, generator: Any = None) -> Tensor:
    """1 with probability p, in x's dtype."""
    if generator is not None:
        raise Unsupported("a random op with its own torch.Generator (tecc draws from the default one)")
    if not isinstance(p, (int, float)):
        raise Unsupported("bernoulli with a non-scalar probability")
    d = ctx.out_dtype()
    u = ctx.uniform(ctx.out_shape())
    return ctx.compute(ctx.out_shape(), lambda *i: te.cast(u[i] < Const(float(p), dt.float32), d))


def lower_bernoulli(ctx: LoweringContext, x: Any, generator: Any = None) -> Tensor:
    """1 with probability x (element by element), in x's dtype."""
    if generator is not None:
        raise Unsupported("a random op with its own torch.Generator (tecc draws from the default one)")
    if not isinstance(x, Tensor) or not x.dtype.is_float:
        raise Unsupported("bernoulli of a non-float tensor")
    d = ctx.out_dtype()
    u = ctx.uniform(ctx.out_shape())
    return ctx.compute(ctx.out_shape(), lambda *i: te.cast(u[i] < te.cast(x[i], dt.float32), d))


__all__ = ["lower_bernoulli", "lower_bernoulli_p", "lower_rand", "lower_rand_like", "lower_randn",
           "lower_randn_like"]
