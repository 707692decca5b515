"""2-d pooling as reductions over a window: max_pool2d_with_indices (and its backward),
avg_pool2d, _adaptive_avg_pool2d.

A window is one reduction axis per spatial dimension (kh, kw); positions outside the input
(padding, ceil_mode's last window) are guarded with `where`, so they read nothing and take the
combiner's identity. The max pool's index output follows ATen's CPU kernel: the first position
of the maximum, or the last NaN when the window holds one (ATen replaces its running max on
`val > max || isnan(val)`). Its backward gathers, for each input position, the gradients of the
windows that picked it (a window range, no scatter).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from ...ir import dtype as dt
from ...ir import ops as te
from ...ir.expr import Expr
from ...ir.tensor import Tensor, reduce_axis
from .context import LoweringContext, Unsupported, constant, static_int


def _pair(value: Any, default: Sequence[int] | None = None) -> tuple[int, int]:
    if value is None or (isinstance(value, (list, tuple)) and len(value) == 0):
        if default is None:
            raise Unsupported("a pooling parameter is missing")
        return tuple(default)  # type: ignore[return-value]
    if isinstance(value, int):
        return value, value
    values = [static_int(v) for v in value]
    if any(v is None for v in values):
        raise Unsupported("a symbolic pooling parameter")
    return (values[0], values[0]) if len(values) == 1 else (values[0], values[1])  # type: ignore[return-value]


def _input(x: Any) -> Tensor:
    if not isinstance(x, Tensor) or x.ndim not in (3, 4):
        raise Unsupported("pooling of other than a 3- or 4-dimensional tensor")
    return x


class _Window:
    """The window of output position (oh, ow) at offsets (kh, kw)."""

    def __init__(self, x: Tensor, kernel: tuple[int, int], stride: tuple[int, int], padding: tuple[int, int],
                 dilation: tuple[int, int] = (1, 1)) -> None:
        self.x, self.kernel, self.stride, self.padding, self.dilation = x, kernel, stride, padding, dilation
        self.height, self.width = x.shape[-2], x.shape[-1]

    def position(self, oh: Expr, ow: Expr, kh: Expr, kw: Expr) -> tuple[Expr, Expr]:
        h = oh * self.stride[0] - self.padding[0] + kh * self.dilation[0]
        w = ow * self.stride[1] - self.padding[1] + kw * self.dilation[1]
        return h, w

    def inside(self, h: Expr, w: Expr) -> Expr:
        return (h >= 0) & (h < self.height) & (w >= 0) & (w < self.width)

    def read(self, lead: Sequence[Expr], h: Expr, w: Expr) -> Expr:
        return self.x[tuple(lead) + (h, w)]


def lower_max_pool2d_with_indices(ctx: LoweringContext, x: Any, kernel_size: Any, stride: Any = (),
                                  padding: Any = 0, dilation: Any = 1, ceil_mode: bool = False) -> tuple[Tensor, Tensor]:
    x = _input(x)
    kernel = _pair(kernel_size)
    win = _Window(x, kernel, _pair(stride, kernel), _pair(padding), _pair(dilation))
    shape = ctx.out_shape(0)
    dtype = x.dtype
    if not dtype.is_float:
        raise Unsupported(f"max pooling of {dtype}")
    ninf = constant(-math.inf, dtype)

    def value(*idx: Expr) -> Expr:
        kh, kw = reduce_axis(kernel[0], "kh"), reduce_axis(kernel[1], "kw")
        h, w = win.position(idx[-2], idx[-1], kh, kw)
        return te.max(te.where(win.inside(h, w), win.read(idx[:-2], h, w), ninf), [kh, kw])

    values = ctx.compute(shape, value, "_values")
    wide = constant(2**62, dt.int64)

    def index(*idx: Expr) -> Expr:
        m = values[idx]
        kh, kw = reduce_axis(kernel[0], "kh"), reduce_axis(kernel[1], "kw")
        h, w = win.position(idx[-2], idx[-1], kh, kw)
        flat = te.cast(h, dt.int64) * win.width + te.cast(w, dt.int64)
        v = win.read(idx[:-2], h, w)
        first_max = te.min(te.where(win.inside(h, w) & (v == m), flat, wide), [kh, kw])
        kh2, kw2 = reduce_axis(kernel[0], "kh2"), reduce_axis(kernel[1], "kw2")
        h2, w2 = win.position(idx[-2], idx[-1], kh2, kw2)
        flat2 = te.cast(h2, dt.int64) * win.width + te.cast(w2, dt.int64)
        last_nan = te.max(te.where(win.inside(h2, w2) & te.isnan(win.read(idx[:-2], h2, w2)), flat2,
                                   constant(-1, dt.int64)), [kh2, kw2])
        return te.where(te.isnan(m), last_nan, first_max)

    indices = ctx.compute(shape, index, "_indices")
    return values, indices


def lower_max_pool2d_with_indices_backward(ctx: LoweringContext, grad: Any, x: Any, kernel_size: Any, stride: Any,
                                           padding: Any, dilation: Any, ceil_mode: bool, indices: Any) -> Tensor:
    """dx[h, w] = Σ over the windows containing (h, w) whose index picked it of their gradient."""
    x = _input(x)
    if not isinstance(grad, Tensor) or not isinstance(indices, Tensor):
        raise Unsupported("a max-pool backward of non-tensors")
    kernel, strides = _pair(kernel_size), _pair(stride, _pair(kernel_size))
    pads, dil = _pair(padding), _pair(dilation)
    out_h, out_w = grad.shape[-2], grad.shape[-1]
    # output rows oh whose window covers h: oh·s - p + kh·d = h for some kh < K
    span = [(kernel[i] - 1) * dil[i] // strides[i] + 1 for i in range(2)]
    dtype = ctx.out_dtype()
    acc = dt.float32 if dtype in (dt.float16, dt.bfloat16) else dtype

    def body(*idx: Expr) -> Expr:
        h, w = idx[-2], idx[-1]
        a, b = reduce_axis(span[0], "a"), reduce_axis(span[1], "b")
        oh = (h + pads[0]) // strides[0] - a
        ow = (w + pads[1]) // strides[1] - b
        valid = (oh >= 0) & (oh < out_h) & (ow >= 0) & (ow < out_w)
        lead = tuple(idx[:-2])
        picked = indices[lead + (oh, ow)] == te.cast(h, dt.int64) * x.shape[-1] + te.cast(w, dt.int64)
        g = te.cast(grad[lead + (oh, ow)], acc)
        return te.cast(te.sum(te.where(valid, te.where(picked, g, constant(0, acc)), constant(0, acc)), [a, b]),
                       dtype)

    return ctx.compute(ctx.out_shape(), body)


def lower_avg_pool2d(ctx: LoweringContext, x: Any, kernel_size: Any, stride: Any = (), padding: Any = 0,
                     ceil_mode: bool = False, count_include_pad: bool = True, divisor_override: Any = None) -> Tensor:
    x = _input(x)
    kernel = _pair(kernel_size)
    win = _Window(x, kernel, _pair(stride, kernel), _pair(padding))
    dtype = ctx.out_dtype()
    acc = dt.float32 if dtype in (dt.float16, dt.bfloat16) else dtype
    if not dtype.is_float:
        raise Unsupported(f"average pooling of {dtype}")

    def body(*idx: Expr) -> Expr:
        kh, kw = reduce_axis(kernel[0], "kh"), reduce_axis(kernel[1], "kw")
        oh, ow = idx[-2], idx[-1]
        h, w = win.position(oh, ow, kh, kw)
        total = te.sum(te.where(win.inside(h, w), te.cast(win.read(idx[:-2], h, w), acc), constant(0, acc)), [kh, kw])
        if divisor_override:
            return te.cast(total / constant(divisor_override, acc), dtype)
        h0, w0 = oh * win.stride[0] - win.padding[0], ow * win.stride[1] - win.padding[1]
        h1 = te.minimum(h0 + kernel[0], win.height + win.padding[0])
        w1 = te.minimum(w0 + kernel[1], win.width + win.padding[1])
        if count_include_pad:
            count: Expr = (h1 - h0) * (w1 - w0)
        else:
            hs, ws = te.maximum(h0, 0), te.maximum(w0, 0)
            he, we = te.minimum(h1, win.height), te.minimum(w1, win.width)
            count = (he - hs) * (we - ws)
        return te.cast(total / te.cast(count, acc), dtype)

    return ctx.compute(ctx.out_shape(), body)


def lower_adaptive_avg_pool2d(ctx: LoweringContext, x: Any, output_size: Any) -> Tensor:
    """Window i of n over a length L: [floor(i·L / n), ceil((i + 1)·L / n)) (ATen's bounds)."""
    x = _input(x)
    out = _pair(output_size)
    sizes = [static_int(x.shape[-2]), static_int(x.shape[-1])]
    if any(s is None for s in sizes):
        raise Unsupported("adaptive pooling over a symbolic size")
    longest = [max(_end(i, s, n) - _start(i, s, n) for i in range(n)) for s, n in zip(sizes, out)]  # type: ignore[arg-type]
    dtype = ctx.out_dtype()
    acc = dt.float32 if dtype in (dt.float16, dt.bfloat16) else dtype

    def body(*idx: Expr) -> Expr:
        ka, kb = reduce_axis(longest[0], "ka"), reduce_axis(longest[1], "kb")
        starts = [(idx[-2 + d] * sizes[d]) // out[d] for d in range(2)]  # type: ignore[operator]
        ends = [((idx[-2 + d] + 1) * sizes[d] + out[d] - 1) // out[d] for d in range(2)]  # type: ignore[operator]
        h, w = starts[0] + ka, starts[1] + kb
        inside = (h < ends[0]) & (w < ends[1])
        total = te.sum(te.where(inside, te.cast(x[tuple(idx[:-2]) + (h, w)], acc), constant(0, acc)), [ka, kb])
        count = (ends[0] - starts[0]) * (ends[1] - starts[1])
        return te.cast(total / te.cast(count, acc), dtype)

    return ctx.compute(ctx.out_shape(), body)


def _start(i: int, size: int, n: int) -> int:
    return (i * size) // n


def _end(i: int, size: int, n: int) -> int:
    return -((-(i + 1) * size) // n)
