"""Convolution and its backward as tensor expressions: sums over the input channels and the filter
taps with the zero padding as `where(in bounds, x[...], 0)` (docs/conv.md), the form the
implicit-GEMM strategies take on tensor cores.

    out[n, f, o]   = bias[f] + Σ_{c, t} x[n, g·Cg + c, o·stride - pad + t·dilation] · w[f, c, t]
    grad_x[n, i, h] = Σ_{f in i's group, t} dout[n, f, (h + pad - t·dilation) / stride] · w[f, i - g·Cg, t]
    grad_w[f, c, t] = Σ_{n, o} dout[n, f, o] · x[n, g·Cg + c, o·stride - pad + t·dilation]
    grad_b[f]       = Σ_{n, o} dout[n, f, o]

(o, h, t: one index per spatial dimension, 1 to 3 of them; g = f // Fg, the group of output
channel f; Cg, Fg: the input and output channels per group.) Each is a contraction: rows, columns
and the reduction read by index structure (implicit_gemm.match_contraction). The input gradient
of a strided convolution reads dout at (h + pad - t·dilation) / stride only where that divides:
a guard with a remainder, which no implicit GEMM takes (planned per kernel as a reduction); at
stride 1 it is affine and an implicit GEMM like the others.

16-bit operands are multiplied and summed in float32 and rounded once, with the bias added
before the rounding (cuDNN's order). The layout of every stage is the one eager gives its result
(channels_last included: LoweringContext.compute), so a channels_last convolution reads its
input and writes its output as NHWC.
"""

from __future__ import annotations

from typing import Any, Sequence

from ...ir import dtype as dt
from ...ir import ops as te
from ...ir.dtype import DType
from ...ir.expr import Expr, ExprLike
from ...ir.tensor import Tensor, compute, reduce_axis
from .context import LoweringContext, Unsupported, constant, static_int


def _ints(value: Any, count: int, what: str) -> list[int]:
    values = [value] * count if isinstance(value, int) else list(value)
    if len(values) == 1 and count > 1:
        values = values * count
    out = [static_int(v) for v in values]
    if len(out) != count or any(v is None for v in out):
        raise Unsupported(f"a convolution's {what} that is not {count} constant(s): {value!r}")
    return out  # type: ignore[return-value]


def _acc(d: DType) -> DType:
    return dt.float32 if d in (dt.float16, dt.bfloat16) else d


class _Conv:
    """The geometry of one convolution (module docstring's names)."""

    def __init__(self, x: Any, weight: Any, stride: Any, padding: Any, dilation: Any, transposed: bool,
                 output_padding: Any, groups: int) -> None:
        if not isinstance(x, Tensor) or not isinstance(weight, Tensor):
            raise Unsupported("a convolution of non-tensors")
        if transposed:
            raise Unsupported("a transposed convolution")
        if x.ndim not in (3, 4, 5) or weight.ndim != x.ndim:
            raise Unsupported(f"a convolution of a {x.ndim}-dimensional input (tecc lowers 1-, 2- and 3-d ones "
                              "with a batch dimension)")
        if not x.dtype.is_float:
            raise Unsupported(f"a convolution of {x.dtype}")
        self.x, self.w = x, weight
        self.dims = x.ndim - 2
        self.stride = _ints(stride, self.dims, "stride")
        self.pad = _ints(padding, self.dims, "padding")
        self.dil = _ints(dilation, self.dims, "dilation")
        group_count = static_int(groups)
        if group_count is None:
            raise Unsupported("symbolic groups")
        self.groups = group_count
        self.in_per_group = weight.shape[1]
        filters = static_int(weight.shape[0])
        if self.groups > 1 and filters is None:
            raise Unsupported("a grouped convolution with a symbolic filter count")
        self.out_per_group = filters // self.groups if filters is not None else weight.shape[0]
        self.spatial = tuple(x.shape[2:])
        self.taps = tuple(weight.shape[2:])

    def channel(self, f: Expr, c: Expr) -> Expr:
        """The input channel of filter f's channel c."""
        return c if self.groups == 1 else (f // self.out_per_group) * self.in_per_group + c

    def position(self, o: Sequence[Expr], t: Sequence[Expr]) -> list[Expr]:
        return [o[d] * self.stride[d] - self.pad[d] + t[d] * self.dil[d] for d in range(self.dims)]

    def inside(self, pos: Sequence[Expr]) -> Expr | None:
        """Whether an input position is in bounds, where the padding can leave it (None: always)."""
        cond: Expr | None = None
        for d in range(self.dims):
            if self.pad[d] == 0:
                continue
            c = (pos[d] >= 0) & (pos[d] < self.spatial[d])
            cond = c if cond is None else cond & c
        return cond

    def read_x(self, n: Expr, channel: Expr, pos: Sequence[Expr]) -> Expr:
        value = self.x[(n, channel, *pos)]
        cond = self.inside(pos)
        return value if cond is None else te.where(cond, value, constant(0, self.x.dtype))


# a convolution's input of at least this many elements, with few channels, is read through a
# copy with its channels padded (`_padded_channels`): smaller, the copy costs more than it saves
PAD_CHANNELS_MIN_ELEMENTS = 1 << 20
# channel counts a padded copy takes: the cp.async sizes of 16-bit elements (4, 8, 16 bytes)
_CHANNEL_COPIES = (2, 4, 8)


def _padded_channels(ctx: LoweringContext, conv: _Conv) -> tuple[Tensor, Tensor] | None:
    """For a 16-bit convolution of few input channels (the stem's RGB: C = 3, whose rows of 6
    bytes no copy of the implicit GEMM takes, so every element of its gathered operand is a
    guarded load with its own index arithmetic), the input and the filters copied channels-last
    with their channels padded with zeros to the next copy size (3 -> 4: one 8-byte cp.async per
    tap and pixel; 6 -> 8; an odd count above 8 to a multiple of 4), which the contraction then
    sums over: the zeros add nothing. None where the rows take copies already (2, 4, 8 or an even
    count above 8 channels), where the convolution is grouped, or where the input is smaller than
    PAD_CHANNELS_MIN_ELEMENTS."""
    x, w = conv.x, conv.w
    channels = static_int(conv.in_per_group)
    if conv.groups != 1 or channels is None or channels in _CHANNEL_COPIES or (channels > 8 and channels % 2 == 0) \
            or x.dtype not in (dt.float16, dt.bfloat16) or w.dtype != x.dtype:
        return None
    elements = 1
    for n in x.shape:
        size = static_int(n)
        elements *= size if size is not None else PAD_CHANNELS_MIN_ELEMENTS
    if elements < PAD_CHANNELS_MIN_ELEMENTS:
        return None
    wide = next((n for n in _CHANNEL_COPIES if n >= channels), -(-channels // 4) * 4)
    zero = constant(0, x.dtype)
    xp = compute((x.shape[0], *conv.spatial, wide),
                 lambda *i: te.where(i[-1] < channels, x[(i[0], i[-1], *i[1:-1])], zero),
                 name=ctx.name("_channels"))
    wp = compute((w.shape[0], *conv.taps, wide),
                 lambda *i: te.where(i[-1] < channels, w[(i[0], i[-1], *i[1:-1])], zero),
                 name=ctx.name("_filters"))
    return xp, wp


def _product(a: Expr, b: Expr, acc: DType) -> Expr:
    return te.cast(a, acc) * te.cast(b, acc)


def lower_convolution(ctx: LoweringContext, x: Any, weight: Any, bias: Any, stride: Any, padding: Any,
                      dilation: Any, transposed: bool, output_padding: Any, groups: int) -> Tensor:
    conv = _Conv(x, weight, stride, padding, dilation, transposed, output_padding, groups)
    out = ctx.out_dtype()
    acc = _acc(out)
    padded = _padded_channels(ctx, conv)

    def body(*idx: Expr) -> Expr:  # (n, f, *o): compute takes the axes as *args
        n, f, o = idx[0], idx[1], idx[2:]
        t = [reduce_axis(conv.taps[d], f"r{d}") for d in range(conv.dims)]
        if padded is None:
            c = reduce_axis(conv.in_per_group, "c")
            xv = conv.read_x(n, conv.channel(f, c), conv.position(o, t))
            wv = conv.w[(f, c, *t)]
        else:
            xp, wp = padded
            c = reduce_axis(xp.shape[-1], "c")
            pos = conv.position(o, t)
            cond = conv.inside(pos)
            xv = xp[(n, *pos, c)] if cond is None else te.where(cond, xp[(n, *pos, c)], constant(0, xp.dtype))
            wv = wp[(f, *t, c)]
        total = te.sum(_product(xv, wv, acc), [c, *t])
        if isinstance(bias, Tensor):
            total = total + te.cast(bias[(f,)], acc)
        return te.cast(total, out)

    return ctx.compute(ctx.out_shape(), body)


def lower_convolution_backward(ctx: LoweringContext, grad: Any, x: Any, weight: Any, bias_sizes: Any, stride: Any,
                               padding: Any, dilation: Any, transposed: bool, output_padding: Any, groups: int,
                               output_mask: Sequence[bool]) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    conv = _Conv(x, weight, stride, padding, dilation, transposed, output_padding, groups)
    if not isinstance(grad, Tensor):
        raise Unsupported("a convolution backward of a non-tensor gradient")
    mask = list(output_mask)
    return (_grad_input(ctx, conv, grad) if mask[0] else None,
            _grad_weight(ctx, conv, grad) if mask[1] else None,
            _grad_bias(ctx, grad) if mask[2] else None)


def _grad_input(ctx: LoweringContext, conv: _Conv, grad: Tensor) -> Tensor:
    out = ctx.out_dtype(0)
    acc = _acc(out)
    outputs = tuple(grad.shape[2:])

    def body(*idx: Expr) -> Expr:
        n, i, h = idx[0], idx[1], idx[2:]
        fo = reduce_axis(conv.out_per_group, "fo")
        t = [reduce_axis(conv.taps[d], f"r{d}") for d in range(conv.dims)]
        f: Expr = fo if conv.groups == 1 else (i // conv.in_per_group) * conv.out_per_group + fo
        c = i if conv.groups == 1 else i % conv.in_per_group
        cond: Expr | None = None
        o: list[Expr] = []
        for d in range(conv.dims):
            shifted = h[d] + conv.pad[d] - t[d] * conv.dil[d]
            if conv.stride[d] == 1:
                o.append(shifted)
            else:
                o.append(shifted // conv.stride[d])
                divides = shifted % conv.stride[d] == 0
                cond = divides if cond is None else cond & divides
            c_in = (o[d] >= 0) & (o[d] < outputs[d])
            cond = c_in if cond is None else cond & c_in
        g = grad[(n, f, *o)]
        if cond is not None:
            g = te.where(cond, g, constant(0, grad.dtype))
        return te.cast(te.sum(_product(g, conv.w[(f, c, *t)], acc), [fo, *t]), out)

    return ctx.compute(ctx.out_shape(0), body, "_input")


def _grad_weight(ctx: LoweringContext, conv: _Conv, grad: Tensor) -> Tensor:
    out = ctx.out_dtype(1)
    acc = _acc(out)
    outputs = tuple(grad.shape[2:])

    def body(*idx: Expr) -> Expr:
        f, c, t = idx[0], idx[1], idx[2:]
        n = reduce_axis(grad.shape[0], "n")
        o = [reduce_axis(outputs[d], f"o{d}") for d in range(conv.dims)]
        xv = conv.read_x(n, conv.channel(f, c), conv.position(o, t))
        return te.cast(te.sum(_product(grad[(n, f, *o)], xv, acc), [n, *o]), out)

    return ctx.compute(ctx.out_shape(1), body, "_weight")


def _grad_bias(ctx: LoweringContext, grad: Tensor) -> Tensor:
    out = ctx.out_dtype(2)
    acc = _acc(out)

    def body(f: Expr) -> Expr:
        axes = [reduce_axis(grad.shape[d], f"a{d}") for d in range(grad.ndim) if d != 1]
        index: list[ExprLike] = list(axes)
        index.insert(1, f)
        return te.cast(te.sum(te.cast(grad[tuple(index)], acc), axes), out)

    return ctx.compute(ctx.out_shape(2), body, "_bias")


__all__ = ["lower_convolution", "lower_convolution_backward"]
