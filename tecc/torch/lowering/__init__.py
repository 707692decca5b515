"""The ATen → tensor-expression lowering table: one entry per ATen overload.

`LOWERINGS[op](ctx, *args, **kwargs)` returns the node's value (a tecc Tensor, or a tuple of
them); it raises `Unsupported` when tecc cannot compute this node, which then runs as ATen
inside the compiled graph (graph.py). `VIEW_OPS` are the ops whose result is a view of their
first argument: inside a program they are index expressions, and a view that leaves a program
(a graph output, an ATen op's argument) is made by torch on the materialized base.
`RANDOM_OPS` draw random numbers: a graph holding one gets a seed drawn per call (random.py).
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import torch

from . import attention, convolution, creation, indexing, matmul, pooling, random, reductions, strided, views
from .context import LoweringContext, RandomDraws, Sizes, Unsupported, aten, prims, tecc_dtype
from .pointwise import POINTWISE, lower_cast, lower_pointwise

Lowering = Callable[..., Any]


def _pointwise(op: Any) -> Lowering:
    def lower(ctx: LoweringContext, *args: Any, **kwargs: Any) -> Any:
        return lower_pointwise(ctx, op, args, kwargs)

    return lower


def _to_copy(ctx: LoweringContext, x: Any, **kwargs: Any) -> Any:
    device = kwargs.get("device")
    if device is not None and ctx.node is not None:
        source = ctx.node.args[0].meta.get("val") if isinstance(ctx.node.args[0], torch.fx.Node) else None
        if source is not None and torch.device(device) != source.device:
            raise Unsupported(f"a copy to another device ({device})")
    return lower_cast(ctx, x)


def _convert(ctx: LoweringContext, x: Any, dtype: Any) -> Any:
    return lower_cast(ctx, x)


def _table() -> dict[Any, Lowering]:
    table: dict[Any, Lowering] = {op: _pointwise(op) for op in POINTWISE}
    table.update({
        prims.convert_element_type.default: _convert,
        aten._to_copy.default: _to_copy,
        aten.clone.default: views.lower_clone,
        aten.alias.default: views.lower_alias,
        aten.lift_fresh_copy.default: views.lower_clone,
        aten.view.default: views.lower_view,
        aten._unsafe_view.default: views.lower_view,
        aten.reshape.default: views.lower_view,
        aten.squeeze.dims: views.lower_reshape_like,
        aten.squeeze.dim: views.lower_reshape_like,
        aten.squeeze.default: views.lower_reshape_like,
        aten.unsqueeze.default: views.lower_reshape_like,
        aten.permute.default: views.lower_permute,
        aten.t.default: views.lower_transpose,
        aten.transpose.int: views.lower_transpose,
        aten.expand.default: views.lower_expand,
        aten.slice.Tensor: views.lower_slice,
        aten.select.int: views.lower_select,
        aten.split_with_sizes.default: views.lower_split_with_sizes,
        aten.split.Tensor: views.lower_split,
        aten.cat.default: views.lower_cat,
        aten.flip.default: views.lower_flip,
        aten.repeat.default: views.lower_repeat,
        aten.diagonal.default: views.lower_diagonal,
        aten.copy.default: views.lower_copy,
        aten.slice_scatter.default: views.lower_slice_scatter,
        aten.select_scatter.default: views.lower_select_scatter,
        aten.constant_pad_nd.default: views.lower_constant_pad_nd,
        aten.full.default: creation.lower_full,
        aten.full_like.default: creation.lower_full_like,
        aten.scalar_tensor.default: creation.lower_scalar_tensor,
        aten.zeros.default: creation.lower_zeros,
        aten.zeros_like.default: creation.lower_zeros,
        aten.ones.default: creation.lower_ones,
        aten.ones_like.default: creation.lower_ones,
        aten.empty.memory_format: creation.lower_zeros,
        aten.empty_like.default: creation.lower_zeros,
        aten.empty_permuted.default: creation.lower_zeros,
        aten.new_zeros.default: creation.lower_zeros,
        aten.new_ones.default: creation.lower_ones,
        aten.arange.default: creation.lower_arange,
        aten.arange.start: creation.lower_arange_start,
        aten.arange.start_step: creation.lower_arange_start,
        prims.iota.default: creation.lower_iota,
        aten.sum.dim_IntList: reductions.lower_sum,
        aten.sum.default: reductions.lower_sum_all,
        aten.mean.dim: reductions.lower_mean,
        aten.mean.default: reductions.lower_mean_all,
        aten.amax.default: reductions.lower_amax,
        aten.max.default: reductions.lower_max_all,
        aten.min.default: reductions.lower_min_all,
        aten.argmax.default: reductions.lower_argmax,
        aten.argmin.default: reductions.lower_argmin,
        aten.amin.default: reductions.lower_amin,
        aten.prod.dim_int: reductions.lower_prod,
        aten.prod.default: reductions.lower_prod_all,
        aten.any.dim: reductions.lower_any,
        aten.any.dims: reductions.lower_any,
        aten.any.default: reductions.lower_any,
        aten.all.dim: reductions.lower_all,
        aten.all.dims: reductions.lower_all,
        aten.all.default: reductions.lower_all,
        aten.var_mean.correction: reductions.lower_var_mean,
        aten.var.correction: reductions.lower_var,
        aten.mm.default: matmul.lower_mm,
        aten.bmm.default: matmul.lower_bmm,
        aten.addmm.default: matmul.lower_addmm,
        aten.baddbmm.default: matmul.lower_baddbmm,
        aten.mv.default: matmul.lower_mv,
        aten.dot.default: matmul.lower_dot,
        aten.max_pool2d_with_indices.default: pooling.lower_max_pool2d_with_indices,
        aten.max_pool2d_with_indices_backward.default: pooling.lower_max_pool2d_with_indices_backward,
        aten.avg_pool2d.default: pooling.lower_avg_pool2d,
        aten._adaptive_avg_pool2d.default: pooling.lower_adaptive_avg_pool2d,
        aten._scaled_dot_product_flash_attention_for_cpu.default: attention.lower_flash_cpu,
        aten._scaled_dot_product_flash_attention.default: attention.lower_flash,
        aten._scaled_dot_product_efficient_attention.default: attention.lower_efficient,
        aten._scaled_dot_product_cudnn_attention.default: attention.lower_cudnn,
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default: attention.lower_flash_cpu_backward,
        aten._scaled_dot_product_flash_attention_backward.default: attention.lower_flash_backward,
        aten._scaled_dot_product_efficient_attention_backward.default: attention.lower_efficient_backward,
        aten._scaled_dot_product_cudnn_attention_backward.default: attention.lower_cudnn_backward,
        aten.as_strided.default: strided.lower_as_strided,
        aten.as_strided_scatter.default: strided.lower_as_strided_scatter,
        aten.convolution.default: convolution.lower_convolution,
        aten.convolution_backward.default: convolution.lower_convolution_backward,
        aten.embedding.default: indexing.lower_embedding,
        aten.embedding_dense_backward.default: indexing.lower_embedding_dense_backward,
        aten.gather.default: indexing.lower_gather,
        aten.scatter.value: indexing.lower_scatter,
        aten.scatter.src: indexing.lower_scatter,
        aten.scatter.reduce: indexing.lower_scatter_reduce,
        aten.scatter.value_reduce: indexing.lower_scatter_reduce,
        aten.scatter_add.default: indexing.lower_scatter_add,
        aten.index.Tensor: indexing.lower_index,
        aten._unsafe_index.Tensor: indexing.lower_index,
        aten.index_select.default: indexing.lower_index_select,
        aten.index_put.default: indexing.lower_index_put,
        aten._unsafe_index_put.default: indexing.lower_index_put,
        aten.rand.default: random.lower_rand,
        aten.rand_like.default: random.lower_rand_like,
        aten.randn.default: random.lower_randn,
        aten.randn_like.default: random.lower_randn_like,
        aten.bernoulli.p: random.lower_bernoulli_p,
        aten.bernoulli.default: random.lower_bernoulli,
    })
    return table


LOWERINGS: dict[Any, Lowering] = _table()

# ops whose result views their first argument (the values of split are views too)
VIEW_OPS: frozenset[Any] = frozenset({
    aten.alias.default, aten.view.default, aten._unsafe_view.default, aten.reshape.default,
    aten.squeeze.dims, aten.squeeze.dim, aten.squeeze.default, aten.unsqueeze.default,
    aten.permute.default, aten.t.default, aten.transpose.int, aten.expand.default, aten.slice.Tensor,
    aten.select.int, aten.split_with_sizes.default, aten.split.Tensor, aten.diagonal.default,
})

# ops that draw random numbers: a graph holding one gets a seed node (graph.py)
RANDOM_OPS: frozenset[Any] = frozenset({
    aten.rand.default, aten.rand_like.default, aten.randn.default, aten.randn_like.default, aten.bernoulli.p,
    aten.bernoulli.default,
})


def why_not(op: Any) -> str:
    """Why `op` has no lowering (for the fallback report)."""
    if isinstance(op, torch._ops.OpOverload) and op._schema.is_mutable:
        return "mutates its arguments (an in-place op runs as ATen)"
    return "has no tecc lowering yet"


def is_view(target: Any) -> bool:
    return target in VIEW_OPS


Filler = attention.Filler

__all__ = ["Filler", "LOWERINGS", "RANDOM_OPS", "VIEW_OPS", "LoweringContext", "RandomDraws", "Sizes", "Unsupported",
           "is_view", "operator", "tecc_dtype", "why_not"]
