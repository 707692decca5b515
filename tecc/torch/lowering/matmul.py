"""Contractions (mm, bmm, addmm, baddbmm, mv, dot) as `tc.sum(A[.., i, k] * B[.., k, j], axis=k)`.

float16/bfloat16 operands are cast to float32 inside the sum and the result rounded once (what
cuBLAS and ATen's CPU kernels do, and the form tecc's tensor-core strategies recognise); addmm's
bias is added in float32 before that one rounding.

A large 2-d operand whose rows in memory are not a multiple of 16 bytes (a vocabulary of 50,257
tokens: the loss head's logits and their gradient) is read through a copy in its own memory
order with those rows padded with zeros (`_realigned`): a tensor map needs 16-byte strides and
cp.async 16-byte rows, so unpadded, the GEMM falls back to scalar loads (transformers' GPT-2 head,
measured on an H200: 3.4-3.8 ms per backward GEMM, where one pass over the operand costs ~0.5).
Where the padded dimension is the contraction's k, the sum runs over the padded extent and the
other operand gets zero rows too. One copy serves every contraction of the program that reads
the same memory (the head's dX and dW both read the logits' gradient). A product whose own rows
are unaligned (the forward's logits) is stored as it is: the GEMM's epilogue stages its tile in
shared memory and copies it out in runs of a row (epilogue "threads" on sm_90, "staged" element
copies on the cp.async rings; tecc/passes/schedule/epilogue.py). (It was computed padded and
copied out: 1.03 + 0.77 ms for transformers' GPT-2 head on an H200.)
"""

from __future__ import annotations

from typing import Any

import torch

from ...ir import dtype as dt
from ...ir import ops as te
from ...ir.dtype import DType
from ...ir.expr import Expr
from ...ir.tensor import Tensor, compute, reduce_axis
from .context import LoweringContext, Unsupported, as_value, broadcast_read, static_int

# an operand of fewer elements is read as it is: a copy would cost more than its loads
REALIGN_MIN_ELEMENTS = 1 << 20
# rows of this many bytes are what a tensor map and cp.async take
ROW_ALIGNMENT = 16


def _accumulator(d: DType) -> DType:
    if d.is_bool:
        raise Unsupported("a matrix product of bool tensors")
    return dt.float32 if d in (dt.float16, dt.bfloat16) else d


def _operand(x: Expr, acc: DType) -> Expr:
    return te.cast(x, acc)


def _contract(ctx: LoweringContext, a: Any, b: Any, bias: Any = None, beta: Any = 1, alpha: Any = 1,
              operands: tuple[int, int] = (0, 1)) -> Tensor:
    """out[.., i, j] = beta·bias + alpha·Σ_k a[.., i, k]·b[.., k, j] (a batch dimension or none;
    a 1-d a or b is a vector); `operands`: the positions of a and b among the node's arguments."""
    if not isinstance(a, Tensor) or not isinstance(b, Tensor):
        raise Unsupported("a matrix product of non-tensors")
    out = ctx.out_dtype()
    acc = _accumulator(out)
    shape = ctx.out_shape()
    if a.ndim == 2 and b.ndim == 2:
        a, b = _aligned_operands(ctx, a, b, operands)
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
    return _contract(ctx, a, b, bias, beta, alpha, operands=(1, 2))


def lower_baddbmm(ctx: LoweringContext, bias: Any, a: Any, b: Any, *, beta: Any = 1, alpha: Any = 1) -> Tensor:
    return _contract(ctx, a, b, bias, beta, alpha)


def lower_mv(ctx: LoweringContext, a: Any, v: Any) -> Tensor:
    return _contract(ctx, a, v)


def lower_dot(ctx: LoweringContext, a: Any, b: Any) -> Tensor:
    return _contract(ctx, a, b)


def _aligned_operands(ctx: LoweringContext, a: Tensor, b: Tensor, operands: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """`a` [M, K] and `b` [K, N] (the node's arguments at `operands`), each read through a padded
    copy where its rows in memory are not a multiple of ROW_ALIGNMENT bytes -- module docstring;
    with k padded, both operands are."""
    node = ctx.node
    assert node is not None
    args = [node.args[i] if i < len(node.args) else None for i in operands]
    layouts = [_memory(x, arg) if isinstance(arg, torch.fx.Node) else None for x, arg in zip((a, b), args)]
    if not any(lay is not None and not lay.aligned for lay in layouts):
        return a, b
    k = static_int(a.shape[1])
    # the logical dimension of k in each operand: a's last, b's first
    pad_k = any(lay is not None and not lay.aligned and lay.inner == kdim
                for lay, kdim in zip(layouts, (1, 0)))
    if pad_k and (k is None or any(lay is None for lay in layouts)):
        return a, b
    kp = _padded(k, a.dtype.bytes) if pad_k and k is not None else None
    made = []
    for x, lay, kdim in zip((a, b), layouts, (1, 0)):
        extend = {kdim: kp} if kp is not None else {}
        if lay is None or (lay.aligned and not extend):
            made.append(x)
        else:
            made.append(_realigned(ctx, x, lay, extend))
    return made[0], made[1]


class _Memory:
    """A 2-d operand's memory: its logical dimensions outermost first, its (logical) sizes, its
    rows' stride, whether those rows are ROW_ALIGNMENT-byte multiples, and the FX node whose
    storage it is a view of."""

    def __init__(self, order: tuple[int, int], sizes: tuple[int, int], row_stride: int, offset: int, itemsize: int,
                 base: torch.fx.Node) -> None:
        self.order = order
        self.sizes = sizes
        self.inner = order[1]
        self.row_stride = row_stride
        self.offset = offset
        self.aligned = (row_stride * itemsize) % ROW_ALIGNMENT == 0
        self.base = base


def _memory(x: Tensor, node: torch.fx.Node) -> _Memory | None:
    """The memory of operand `x` from its FX node's value's strides, or None when they are not
    static, the operand is small, or its inner dimension is not dense."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.ndim != 2:
        return None
    found = [*val.shape, *val.stride(), val.storage_offset()]
    if not all(type(n) is int for n in found):   # symbolic: read as it is (int() would specialize)
        return None
    values = [int(n) for n in found]
    sizes, strides, offset = values[:2], values[2:4], values[4]
    if node.op != "placeholder" and _storage(node) is node:
        # computed in the program, read there as the lowering computed it: row-major (eager may
        # lay it out otherwise -- a cast of a transposed weight keeps the transpose's strides --,
        # which only the copy made for the program's outside readers follows)
        strides, offset = [sizes[1], 1], 0
    if sizes[0] * sizes[1] < REALIGN_MIN_ELEMENTS or min(sizes) < 2:
        return None
    inner = 1 if strides[1] == 1 else 0 if strides[0] == 1 else None
    if inner is None:
        return None
    outer = 1 - inner
    return _Memory((outer, inner), (sizes[0], sizes[1]), strides[outer], offset, x.dtype.bytes, _storage(node))


def _storage(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose storage a chain of ATen views starting at `node` reads (its strides and
    offset are in that storage): two operands of one storage, offset, strides and sizes are the
    same memory. A copy (a clone, a contiguous transpose) is a storage of its own."""
    while getattr(node.target, "is_view", False) and node.args and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return node


def _padded(n: int, itemsize: int) -> int:
    per = ROW_ALIGNMENT // itemsize if ROW_ALIGNMENT % itemsize == 0 else 1
    return -(-n // per) * per


def _realigned(ctx: LoweringContext, x: Tensor, lay: _Memory, extend: dict[int, int]) -> Tensor:
    """`x` read through a zero-padded copy in its memory order: the inner dimension padded to
    ROW_ALIGNMENT bytes where its rows are not, and each logical dimension `d` of `extend` to
    `extend[d]` (the sum's k, the product's columns), the view returned in the logical order with
    those dimensions extended. The copy is made once per memory read (`LoweringContext.realigned`)."""
    outer, inner = lay.order
    extents = list(lay.sizes)
    padded = list(extents)
    if not lay.aligned:
        padded[inner] = _padded(extents[inner], x.dtype.bytes)
    for d, n in extend.items():
        padded[d] = max(padded[d], n)
    key = (lay.base, lay.offset, lay.row_stride, extents[outer], extents[inner], padded[outer], padded[inner],
           x.dtype.name)
    copy = ctx.realigned.get(key)
    if copy is None:
        def body(r: Expr, c: Expr) -> Expr:
            logical = [r, c] if outer == 0 else [c, r]
            return te.where((r < extents[outer]) & (c < extents[inner]), x[logical[0], logical[1]],
                            te.cast(0, x.dtype))
        copy = ctx.realigned[key] = ctx.compute((padded[outer], padded[inner]), body, suffix="_aligned")
    shape = tuple(padded[d] if d in extend else extents[d] for d in (0, 1))
    return compute(shape, lambda i, j: copy[i, j] if outer == 0 else copy[j, i], name=ctx.name("_aligned_view"))
