"""as_strided and as_strided_scatter: views that address their base's memory (what decompositions
write for a flatten or an unflatten of a channels_last tensor, and the backward's gradient copy).

tecc's values are logical tensors, not memory, so these are written through the base's layout
in eager, which the FX node's metadata gives (its sizes and strides): element i of the view is
the element of memory `offset + Σ i_d · stride_d`, and that memory position is the base's
logical element whose coordinates decompose it by the base's strides. So the result is eager's
whatever layout tecc stores the base in. The base must be dense (its strides a permutation of a
row-major layout: every memory position one element) with storage offset 0; sizes and strides
must be constants. Neither op is a view inside tecc's programs: each is a compute (an index
expression, inlined into its readers like one), and materialized when it leaves a program.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ...ir import ops as te
from ...ir.expr import Expr
from ...ir.tensor import Tensor
from .context import LoweringContext, Unsupported, static_int


class _Memory:
    """The base's eager layout: its logical coordinates from a memory position."""

    def __init__(self, ctx: LoweringContext, position: int = 0) -> None:
        node = ctx.node
        assert node is not None
        arg = node.args[position]
        val = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
        if not isinstance(val, torch.Tensor):
            raise Unsupported("as_strided of a value with no tensor metadata")
        sizes = [static_int(ctx.sizes.expr(s)) for s in val.shape]
        strides = [static_int(ctx.sizes.expr(s)) for s in val.stride()]
        if any(v is None for v in sizes + strides) or static_int(ctx.sizes.expr(val.storage_offset())) != 0:
            raise Unsupported("as_strided of a base with symbolic sizes or strides, or a storage offset")
        self.sizes: list[int] = sizes  # type: ignore[assignment]
        self.strides: list[int] = strides  # type: ignore[assignment]
        expected = 1
        for d in sorted((d for d in range(len(sizes)) if self.sizes[d] != 1), key=lambda d: self.strides[d]):
            if self.strides[d] != expected:
                raise Unsupported("as_strided of a base that is not dense in memory")
            expected *= self.sizes[d]
        self.numel = expected

    def coordinates(self, flat: Expr) -> tuple[Expr, ...]:
        return tuple(te.cast(0, flat.dtype) if size == 1 else (flat // stride) % size
                     for size, stride in zip(self.sizes, self.strides))

    def digits(self, sizes: Sequence[int], strides: Sequence[int],
               start: int) -> list[tuple[int, list[tuple[int, int]]]] | None:
        """The base coordinates of view element i as sums of the view's indices, without a
        division: per base dimension (its size not 1), the constant from `start` and (view dim,
        factor) terms, when every view stride is a whole multiple of one base dimension's stride
        and the terms of each base dimension stay below its size. The memory position
        start + Σ i_d · stride_d then has exactly these digits in the base's mixed radix (a dense
        base writes each position one way), so they are the coordinates `coordinates` computes
        with // and %. None when the view crosses a digit (a carry): the general form."""
        dims = sorted((b for b in range(len(self.sizes)) if self.sizes[b] != 1), key=lambda b: -self.strides[b])
        found: dict[int, tuple[int, list[tuple[int, int]]]] = {}
        rest = start
        for b in dims:
            found[b] = (rest // self.strides[b], [])
            rest %= self.strides[b]
        if rest:
            return None
        for d, (size, stride) in enumerate(zip(sizes, strides)):
            if size == 1:
                continue
            digit = next((b for b in dims if stride >= self.strides[b]), None)
            if digit is None or stride % self.strides[digit]:
                return None
            found[digit][1].append((d, stride // self.strides[digit]))
        for b, (const, terms) in found.items():
            if const + sum((sizes[d] - 1) * factor for d, factor in terms) >= self.sizes[b]:
                return None
        return [found.get(b, (0, [])) if self.sizes[b] != 1 else (0, []) for b in range(len(self.sizes))]


def _geometry(size: Any, stride: Any, offset: Any) -> tuple[list[int], list[int], int]:
    sizes = [static_int(s) for s in size]
    strides = [static_int(s) for s in stride]
    start = static_int(offset) if offset is not None else 0
    if any(v is None for v in sizes + strides) or start is None:
        raise Unsupported("as_strided with symbolic sizes, strides or offset")
    return sizes, strides, start  # type: ignore[return-value]


def _flat(idx: Sequence[Expr], strides: Sequence[int], start: int) -> Expr:
    flat: Expr = te.cast(start, "int64")
    for i, s in zip(idx, strides):
        flat = flat + te.cast(i, "int64") * s
    return flat


def lower_as_strided(ctx: LoweringContext, x: Any, size: Any, stride: Any, storage_offset: Any = None) -> Tensor:
    if not isinstance(x, Tensor):
        raise Unsupported("as_strided of a non-tensor")
    memory = _Memory(ctx)
    sizes, strides, start = _geometry(size, stride, storage_offset)
    digits = memory.digits(sizes, strides, start)
    if digits is not None:  # affine in the view's indices: a reader's analysis sees a plain read
        return ctx.compute(ctx.out_shape(), lambda *i: x[tuple(_digit(i, const, terms) for const, terms in digits)])
    return ctx.compute(ctx.out_shape(), lambda *i: x[memory.coordinates(_flat(i, strides, start))])


def _digit(idx: Sequence[Expr], const: int, terms: Sequence[tuple[int, int]]) -> Any:
    value: Any = const
    for d, factor in terms:
        term = idx[d] if factor == 1 else idx[d] * factor
        value = term if isinstance(value, int) and value == 0 else value + term
    return value


def lower_as_strided_scatter(ctx: LoweringContext, x: Any, src: Any, size: Any, stride: Any,
                             storage_offset: Any = None) -> Tensor:
    """x with the view as_strided(x, size, stride, offset) replaced by src: each element of x
    finds the view element at its memory position, when the view covers it (the view must not
    overlap itself: then the position decomposes by the view's strides, largest first)."""
    if not isinstance(x, Tensor) or not isinstance(src, Tensor):
        raise Unsupported("as_strided_scatter of non-tensors")
    memory = _Memory(ctx)
    sizes, strides, start = _geometry(size, stride, storage_offset)
    order = sorted((d for d in range(len(sizes)) if sizes[d] != 1), key=lambda d: strides[d], reverse=True)
    reach = 1
    for d in reversed(order):
        if strides[d] < reach:
            raise Unsupported("as_strided_scatter of a view that overlaps itself")
        reach = strides[d] * sizes[d]

    def body(*p: Expr) -> Expr:
        flat: Expr = te.cast(0, "int64")
        for coordinate, s in zip(p, memory.strides):
            flat = flat + te.cast(coordinate, "int64") * s
        rest = flat - start
        view: list[Expr] = [te.cast(0, "int64")] * len(sizes)
        covered = rest >= 0
        for d in order:
            view[d] = rest // strides[d]
            covered = covered & (view[d] < sizes[d])
            rest = rest - view[d] * strides[d]
        covered = covered & (rest == 0)
        clamped = tuple(te.minimum(te.maximum(v, 0), max(sizes[d] - 1, 0)) for d, v in enumerate(view))
        return te.where(covered, te.cast(src[clamped], x.dtype), x[p])

    return ctx.compute(ctx.out_shape(), body)


__all__ = ["lower_as_strided", "lower_as_strided_scatter"]
