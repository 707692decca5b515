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

from dataclasses import dataclass
from typing import Sequence

from ...ir import dtype as dt
from ...ir.errors import ScheduleError
from ...ir.expr import Binary, Cast, Const, Expr, Reduce, TensorRead, Var, const_int, free_vars, walk
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


def _leading(where: str, read: TensorRead, chain: OnlineChain, tail: tuple[Expr, Expr]) -> None:
    """`read` must be indexed by expressions of the leading row axes, then exactly `tail`."""
    idx = read.indices
    if len(idx) < 2 or idx[-2] is not tail[0] or idx[-1] is not tail[1]:
        raise ScheduleError(f"{where}: {read.tensor.name} is read at [{', '.join(map(str, idx))}]; the tensor-core "
                            f"form needs [.., {tail[0]}, {tail[1]}] (a tile of whole rows)")
    allowed = set(chain.row[:-1])
    for e in idx[:-2]:
        if any(isinstance(v, Var) and v.kind != "size" and v not in allowed for v in free_vars(e)):
            raise ScheduleError(f"{where}: a leading index {e} of {read.tensor.name} depends on more than the "
                                "leading row axes (the block's heads)")


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
    q, k = (a, b) if any(x is query for x in a.indices) else (b, a)
    _leading(where, q, chain, (query, axis))
    _leading(where, k, chain, (chain.key, axis))
    if q.dtype != k.dtype:
        raise ScheduleError(f"{where}: Q is {q.dtype} and K is {k.dtype}; mma needs one dtype")
    depth = _shape_dim(where, "the scores", axis.extent)
    for t in (q.tensor, k.tensor):
        if const_int(t.shape[-1]) != depth:
            raise ScheduleError(f"{where}: {t.name}'s last extent {t.shape[-1]} is not the contracted {depth}")
    v = _half_read(chain.value)
    if v is None:
        raise ScheduleError(f"{where}: the contracted value {chain.value} is not a float16/bfloat16 input read")
    _leading(where, v, chain, (chain.key, chain.column))
    columns = _shape_dim(where, "the output", chain.columns)
    if const_int(v.tensor.shape[-1]) != columns:
        raise ScheduleError(f"{where}: {v.tensor.name}'s last extent is not the output's {columns} columns")
    for stat, what in ((chain.m, "max"), (chain.l, "sum")):
        acc = stat.op.body.acc_dtype  # type: ignore[union-attr]
        if acc != dt.float32:
            raise ScheduleError(f"{where}: the row {what} {stat.name} accumulates in {acc}; the kernel keeps float32")
    if chain.contraction.acc_dtype != dt.float32:
        raise ScheduleError(f"{where}: {chain.output.name} accumulates in {chain.contraction.acc_dtype}; mma "
                            "accumulates in float32")
    for t in (q.tensor, k.tensor, v.tensor):
        if isinstance(t.op, PlaceholderOp) and t.op.strides is not None:
            raise ScheduleError(f"{where}: {t.name} has strides; the tiles are copied as 16-byte pieces of contiguous "
                                "rows (pass a contiguous tensor)")
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


__all__ = ["HOPPER_HEAD_DIMS", "MAX_HEAD_DIM", "TensorCoreChain", "describe_skipping", "mma_sync_head_dims",
           "positive_scale", "reads_inputs", "tensor_core_chain"]
