"""Which online chains run on tensor cores: the chain of online_contraction (a row max m, a row sum
l of exp(s - m), O = g(Σ_j exp(s - m)·v, m, l)) whose two contractions fit the m16n8k16 rows of the
intrinsic table (and the wgmma rows in the Hopper form):

    s(r, j) = f(Σ_d Q[.., i, d] · K[.., j, d], r, j)     Q, K float16 or bfloat16, d a constant:
                                                         16, 32, 64, 96 or 128 (and 256 in the
                                                         Hopper form)
    v(r, j, c) = V[.., j, c]                             V float16 or bfloat16, c likewise

where the leading indices (`..`) are any expressions of the leading row axes (grouped heads
K[b, h // G, ..] are index expressions), and f is any elementwise expression of the contraction
(a scale, `where` masks, a bias, a boolean mask tensor). `tensor_core_chain` returns the chain's
tensor-core form or raises ScheduleError naming the condition that fails (the SIMT kernel of
online_contraction serves the chain then); the kernel is online_contraction_mma's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from ...ir import dtype as dt
from ...ir.errors import ScheduleError
from ...ir.evaluate import evaluate_int
from ...ir.expr import (Binary, Cast, Const, Expr, Reduce, TensorRead, Var, const_int, free_vars, size_product,
                        substitute, walk)
from ...ir.poly import affine_coefficients
from ...ir.tensor import PlaceholderOp, Tensor
from ..schedule.tensorize import INTRINSICS
from .key_tiles import key_tile_bound, skipping_description, unmasked_tile_bound
from .launch_order import launch_order
from .mma_tiles import LOG2E
from .online_contraction import OnlineChain, online_chain

MAX_HEAD_DIM = 128   # mma.sync: the partial output, 4·C/8 floats per lane, and Q's fragments, D/2 registers
HOPPER_HEAD_DIMS = (16, 32, 64, 96, 128, 256)   # the wgmma form: Q stays in shared memory, 64-row tiles per warpgroup


@dataclass(frozen=True)
class TensorCoreChain:
    """An online chain whose two contractions run on tensor cores (module docstring)."""

    chain: OnlineChain
    scores: Reduce        # Σ_d Q·K inside chain.score
    depth: int            # D
    q: TensorRead         # Q[.., i, d]
    k: TensorRead         # K[.., j, d]
    v: TensorRead         # V[.., j, c]
    qk_intrinsic: str
    pv_intrinsic: str


def _half_read(e: Expr) -> TensorRead | None:
    if isinstance(e, Cast) and e.dtype == dt.float32:
        e = e.a
    if isinstance(e, TensorRead) and e.tensor.is_placeholder and e.dtype in (dt.float16, dt.bfloat16):
        return e
    return None


def _shape_dim(where: str, name: str, extent: Expr) -> int:
    n = const_int(extent)
    if n is None:
        raise ScheduleError(f"{where}: the contracted extent of {name} ({extent}) is symbolic; the tensor-core "
                            "form needs a constant (its fragments live in registers)")
    if n not in HOPPER_HEAD_DIMS:
        raise ScheduleError(f"{where}: the contracted extent of {name} is {n}; the tensor-core form needs one of "
                            f"{', '.join(map(str, HOPPER_HEAD_DIMS))} (mma.sync: up to {MAX_HEAD_DIM}; 256 on wgmma, sm_90 "
                            "only)")
    return n


def mma_sync_head_dims(tcc: "TensorCoreChain") -> str | None:
    """Why the mma.sync form cannot take the chain's head dims, or None: it keeps Q's fragments
    (D/2 registers) and the partial output (C/2 floats) per lane, which spill past 128; its
    tiles are swizzled by a power-of-two row width (row_swizzle), or padded (96:
    mma_tiles.TileStaging.shared)."""
    columns = const_int(tcc.chain.columns)
    for what, n in (("scores", tcc.depth), ("output", columns)):
        if n is None or n > MAX_HEAD_DIM or (n & (n - 1) and n != 96):
            return (f"online_contraction_mma: the {what}' head dim is {n}; the mma.sync form takes a power of two from "
                    f"16 to {MAX_HEAD_DIM}, or 96 (256 runs on wgmma, sm_90)")
    return None


CHUNK_BYTES = 16   # one cp.async: the tiles are copied as 16-byte pieces of rows


def _leading(where: str, read: TensorRead, chain: OnlineChain, tail: tuple[Var, Var], width: int) -> None:
    """`read` must give tiles of whole rows, `tail` = (row, col) its row and column variables:
    the plain [.., row, col] of a contiguous tensor whose last extent is `width`, with leading
    indices of the leading row axes, or a view that 16-byte copies can read (_strided_rows)."""
    idx, t = read.indices, read.tensor
    if len(idx) >= 2 and idx[-2] is tail[0] and idx[-1] is tail[1] and not _strides_given(t):
        allowed = set(chain.row[:-1])
        for e in idx[:-2]:
            if any(isinstance(v, Var) and v.kind != "size" and v not in allowed for v in free_vars(e)):
                raise ScheduleError(f"{where}: a leading index {e} of {t.name} depends on more than the "
                                    "leading row axes (the block's heads)")
        if const_int(t.shape[-1]) == width:
            return
    _strided_rows(where, read, chain, tail)


def _strides_given(t: Tensor) -> bool:
    return isinstance(t.op, PlaceholderOp) and t.op.strides is not None


def _strided_rows(where: str, read: TensorRead, chain: OnlineChain, tail: tuple[Var, Var]) -> None:
    """A view read as tiles of rows (Q, K and V as slices of one fused projection,
    `qkv[b·S + i, h·D + d + 2·C]`, rows 3·C apart): every index free of all but the leading row
    axes, `row`, `col` and sizes; `col` only in the innermost index, with coefficient 1, whose
    stride is 1 (the 8 columns one 16-byte copy reads are consecutive in memory); every other
    dimension's stride a multiple of 16 bytes, and the innermost index's other terms (its
    coefficients of `row` and of the leading axes, its constant) multiples of 16 bytes too, so
    every row starts 16-byte aligned (the buffers' bases are: runtime/marshal.py)."""
    row, col = tail
    t, idx = read.tensor, read.indices
    name = f"{t.name}[{', '.join(map(str, idx))}]"
    allowed = set(chain.row[:-1]) | {row, col}
    for e in idx:
        if any(v.kind != "size" and v not in allowed for v in free_vars(e)):
            raise ScheduleError(f"{where}: {name} has an index {e} that depends on more than the block's heads, the "
                                f"row {row} and the column {col}; the tensor-core form copies tiles of rows")
    chunk = CHUNK_BYTES // (read.dtype.bits // 8)
    strides = element_strides(t)
    if const_int(strides[-1]) != 1:
        raise ScheduleError(f"{where}: {t.name}'s innermost stride is {strides[-1]}, not 1; the tiles are copied as "
                            "16-byte pieces of contiguous rows (pass a tensor whose last dimension is contiguous)")
    for e, s in zip(idx[:-1], strides[:-1]):
        if any(v is col for v in free_vars(e)):
            raise ScheduleError(f"{where}: {name} reads the column {col} in an outer dimension; the tensor-core form "
                                "needs it in the innermost index (a row's columns consecutive in memory)")
        if not _multiple(s, chunk):
            raise ScheduleError(f"{where}: {t.name} has a stride {s} that is not a multiple of {chunk} elements (16 "
                                "bytes): its rows would not start 16-byte aligned for cp.async")
    _innermost(where, name, idx[-1], col, chunk)


def _innermost(where: str, name: str, last: Expr, col: Var, chunk: int) -> None:
    """The innermost index must be col + (multiples of `chunk` elements)."""
    terms = [col] + sorted((v for v in free_vars(last) if v is not col), key=lambda v: v.name)
    coefficients = affine_coefficients(last, terms)
    if coefficients is None:
        raise ScheduleError(f"{where}: {name}'s innermost index {last} is not affine in {col} and the block's axes; "
                            "the tensor-core form copies tiles of rows")
    rest = evaluate_int(last, {v: 0 for v in terms})
    if coefficients[0] != 1:
        raise ScheduleError(f"{where}: {name} reads the column {col} with step {coefficients[0]}; the tensor-core "
                            "form needs consecutive columns (step 1)")
    off = [f"{c}·{v}" for v, c in zip(terms[1:], coefficients[1:]) if c % chunk] + ([str(rest)] if rest % chunk else [])
    if off:
        raise ScheduleError(f"{where}: {name}'s innermost index {last} moves by {', '.join(off)}, not a multiple of "
                            f"{chunk} elements (16 bytes): its rows would not start 16-byte aligned for cp.async")


def element_strides(t: Tensor) -> tuple[Expr, ...]:
    """An input's strides in elements: its given ones, else row-major from its shape."""
    op = t.op
    if isinstance(op, PlaceholderOp) and op.strides is not None:
        return tuple(s if isinstance(s, Expr) else Const(int(s), dt.int32) for s in op.strides)
    return tuple(size_product(t.shape[k + 1:]) for k in range(len(t.shape)))


def _multiple(e: Expr, n: int) -> bool:
    """Whether `e` (a stride: a product of constants and sizes) is a multiple of n for every size."""
    c = const_int(e)
    if c is not None:
        return c % n == 0
    if isinstance(e, Cast):
        return _multiple(e.a, n)
    if isinstance(e, Binary) and e.op == "*":
        for x, y in ((e.a, e.b), (e.b, e.a)):
            k = const_int(x)
            if _multiple(x, n) or (k is not None and _multiple(y, n // math.gcd(k, n))):
                return True
    return n == 1


def tensor_core_chain(chain: OnlineChain) -> TensorCoreChain:
    """The chain's tensor-core form, or ScheduleError saying which condition fails."""
    where = "online_contraction_mma"
    reduces = list({id(n): n for n in walk(chain.score) if isinstance(n, Reduce)}.values())
    if len(reduces) != 1:
        raise ScheduleError(f"{where}: the scores hold {len(reduces)} contractions; the tensor-core form needs one "
                            "(s = f(Σ_d q·k))")
    (red,) = reduces
    assert isinstance(red, Reduce)
    if red.combiner != "sum" or len(red.axes) != 1 or const_int(red.axes[0].lo) != 0:
        raise ScheduleError(f"{where}: the scores' reduction is not one sum over an axis from 0")
    if red.acc_dtype != dt.float32:
        raise ScheduleError(f"{where}: the scores accumulate in {red.acc_dtype}; mma accumulates in float32")
    axis = red.axes[0]
    src = red.source
    if isinstance(src, Cast) and src.dtype == dt.float32:
        src = src.a
    if not (isinstance(src, Binary) and src.op == "*"):
        raise ScheduleError(f"{where}: the scores' summand {src} is not a product of two reads")
    reads = [_half_read(src.a), _half_read(src.b)]
    if any(r is None for r in reads):
        raise ScheduleError(f"{where}: the scores multiply {src.a} and {src.b}; the tensor-core form needs two "
                            "float16/bfloat16 input reads (float32 operands stay SIMT)")
    a, b = reads
    assert a is not None and b is not None
    query = chain.row[-1]
    q, k = (a, b) if any(v is query for x in a.indices for v in free_vars(x)) else (b, a)
    depth = _shape_dim(where, "the scores", axis.extent)
    _leading(where, q, chain, (query, axis), depth)
    _leading(where, k, chain, (chain.key, axis), depth)
    if q.dtype != k.dtype:
        raise ScheduleError(f"{where}: Q is {q.dtype} and K is {k.dtype}; mma needs one dtype")
    v = _half_read(chain.value)
    if v is None:
        raise ScheduleError(f"{where}: the contracted value {chain.value} is not a float16/bfloat16 input read")
    columns = _shape_dim(where, "the output", chain.columns)
    _leading(where, v, chain, (chain.key, chain.column), columns)
    for stat, what in ((chain.m, "max"), (chain.l, "sum")):
        acc = stat.op.body.acc_dtype  # type: ignore[union-attr]
        if acc != dt.float32:
            raise ScheduleError(f"{where}: the row {what} {stat.name} accumulates in {acc}; the kernel keeps float32")
    if chain.contraction.acc_dtype != dt.float32:
        raise ScheduleError(f"{where}: {chain.output.name} accumulates in {chain.contraction.acc_dtype}; mma "
                            "accumulates in float32")
    return TensorCoreChain(chain, red, depth, q, k, v, INTRINSICS[q.dtype.name], INTRINSICS[v.dtype.name])


def describe_skipping(args: Sequence[Tensor], rows: int, tile: int) -> str:
    """skipping_description of the chain `args` for blocks of `rows` query rows (`query_block`
    is the block index in the bound)."""
    chain = online_chain(args)
    tcc = tensor_core_chain(chain)
    block = Var("query_block", dt.int32)
    unmasked = None if reads_inputs(tcc) else unmasked_tile_bound(chain, block, rows, tile)
    bound = key_tile_bound(chain, block, rows, tile)
    order = launch_order(chain, (tcc.k, tcc.v), block, rows, bound)[2]
    return skipping_description(chain, bound, unmasked) + (f"; {order}" if order else "")


def reads_inputs(tcc: TensorCoreChain) -> bool:
    """Whether the scores read inputs besides the contraction's (a bias, a mask tensor)."""
    return any(isinstance(n, TensorRead) for n in walk(tcc.chain.score) if not _inside(n, tcc.scores))


def positive_scale(value: Expr, scores: Reduce) -> float | None:
    """log2(e)·c when `value` is `scores · c` (either order, c > 0 a constant) or `scores` itself
    (c = 1), so that max(value) = c·max(scores); None otherwise."""
    if value is scores:
        return LOG2E
    if isinstance(value, Binary) and value.op == "*":
        for x, y in ((value.a, value.b), (value.b, value.a)):
            if x is scores and isinstance(y, Const) and y.dtype.is_float and float(y.value) > 0:
                return float(y.value) * LOG2E
    return None


def _inside(node: Expr, container: Expr) -> bool:
    return any(n is node for n in walk(container))


__all__ = ["HOPPER_HEAD_DIMS", "MAX_HEAD_DIM", "TensorCoreChain", "describe_skipping", "element_strides",
           "mma_sync_head_dims",
           "positive_scale", "reads_inputs", "tensor_core_chain"]
