"""What the tensor-core kernels of the online contraction share (the forward, online_contraction_mma,
and the backward, online_backward_mma): tiles staged in shared memory by cp.async, fragment and
register buffers, unrolled loops, the pair of m16n8k16 mma that one ldmatrix.x4 of B feeds, the
C-to-A fragment identity that keeps P in registers, and exp as exp2 with log2(e) folded in.

Each piece is a small function (or a method of the `TileStaging` mixin, for the kernel's unique
names, threads and buffers), so that a kernel reads as staging, contractions, the elementwise
stage and the epilogue, and can take composable schedule primitives in their place.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from ...ir import dtype as dt
from ...ir.errors import ScheduleError
from ...ir.expr import Binary, Cast, Const, Expr, Select, TensorRead, Var, binary, cast, compare, const_int, select, substitute
from ...ir.intrinsics import lookup
from ...ir.stmt import AsyncCopy, Buffer, For, FragmentRef, IfThenElse, MatrixMultiply, Stmt, seq
from ...ir.tensor import Tensor
from ..schedule.tensorize import CHUNK, row_swizzle

LOG2E = 1.0 / math.log(2.0)


class TileStaging:
    """Helpers of a tensor-core kernel builder, which sets `unique` (fresh names), `threads`,
    `tx` (the thread index) and `buffers` (the program's tensors' global buffers)."""

    unique: Callable[[str], str]
    threads: int
    tx: Var
    buffers: dict[Tensor, Buffer]

    def frag(self, label: str, intrinsic: str, role: str, size: int) -> Buffer:
        """A per-lane fragment buffer of `size` elements of an intrinsic's operand `role`."""
        op = lookup(intrinsic).operand(role)
        return Buffer(self.unique(label), op.dtype, (Const(size, dt.int32),), "fragment", fragment=(intrinsic, role))

    def local(self, label: str, size: int, dtype: dt.DType = dt.float32) -> Buffer:
        return Buffer(self.unique(label), dtype, (Const(size, dt.int32),), "local")

    def shared(self, label: str, read: TensorRead, stages: int, rows: int, width: int) -> Buffer:
        """The mma.sync form's tile [stages][rows][width], XOR-swizzled (row_swizzle) when the width is
        a power of two; otherwise (d = 96) rows padded by 16 bytes: a row of 96 halves is 48 words,
        which puts every other row of an ldmatrix on the same banks, and 52 words apart the 8 rows
        one ldmatrix reads start at banks 20·r mod 32, eight different 4-bank groups."""
        if width & (width - 1) == 0:
            shape = tuple(Const(n, dt.int32) for n in (stages, rows, width))
            return Buffer(self.unique(label), read.dtype, shape, "shared", tensor=f"{read.tensor.name}.shared",
                          layout=row_swizzle(width))
        shape = tuple(Const(n, dt.int32) for n in (stages, rows, width + CHUNK))
        return Buffer(self.unique(label), read.dtype, shape, "shared", tensor=f"{read.tensor.name}.shared")

    def unrolled(self, label: str, extent: int, body: Callable[[Var], Stmt], kind: str = "unroll") -> Stmt:
        """A loop of `extent` (unrolled unless `kind` says "serial": a loop whose variable indexes
        no register array, kept rolled so that the compiler does not hoist one shared-memory
        address per unrolled copy out of the enclosing loop, where each would hold a register)."""
        v = Var(self.unique(label), dt.int32)
        rolled = (("pragma_unroll", 1),) if kind == "serial" else ()
        return For(v, Const(0, dt.int32), Const(extent, dt.int32), kind, body(v), rolled)

    def copy_tile(self, dst: Buffer, stage: Expr, read: TensorRead, at: dict[Var, Expr], row0: Expr, extent: Expr,
                  rows: int, width: int) -> Stmt:
        """cp.async of rows [row0, row0 + rows) x [0, width) of the read tensor into dst[stage],
        16 bytes per copy, zero past `extent`. A 4-dimensional dst (the Hopper form) is
        [stages][width / W][rows][W]: blocks of W-element swizzled rows."""
        per_row = width // CHUNK
        chunks = rows * per_row
        count = -(-chunks // self.threads)
        src = self.buffers[read.tensor]
        lead = tuple(substitute(e, at) for e in read.indices[:-2])

        def copy(u: Var) -> Stmt:
            chunk = self.tx + self.threads * u
            r, col = chunk // per_row, (chunk % per_row) * CHUNK
            if len(dst.shape) == 4:
                w = const_int(dst.shape[3])
                assert w is not None
                at_dst: tuple[Expr, ...] = (stage, col // w, r, col % w)
            else:
                at_dst = (stage, r, col)
            st: Stmt = AsyncCopy(dst, at_dst, src, lead + (row0 + r, col), 16,
                                 compare("<", row0 + r, extent), "cg")
            if chunks % self.threads:
                st = IfThenElse(compare("<", chunk, chunks), st)
            return st
        return self.unrolled(f"copy_{read.tensor.name}", count, copy)


def two_n8_tiles(intrinsic: str, acc: Buffer, offset: Any, a: FragmentRef, b: Buffer) -> Stmt:
    """acc[offset..] += a · b for the two n8 tiles one ldmatrix.x4 of B loaded (b[0:4], b[4:8]):
    the accumulators of the second tile follow the first's 4 elements."""
    return seq(
        MatrixMultiply(intrinsic, FragmentRef(acc, offset), a, FragmentRef(b, 0), FragmentRef(acc, offset)),
        MatrixMultiply(intrinsic, FragmentRef(acc, offset + 4), a, FragmentRef(b, 4), FragmentRef(acc, offset + 4)))


def check_relayout(qk: str, pv: str, where: str = "online_contraction_mma") -> None:
    """The C fragment of n8 tiles 2k, 2k + 1 of `qk` is the A fragment of k16 step k of `pv`, so a
    tile of weights computed in C fragments feeds the next mma from registers."""
    c_map = lookup(qk).operand("c").layout
    a_map = lookup(pv).operand("a").layout
    for lane in range(32):
        for e in range(8):
            r, col = c_map(lane, e % 4)
            if a_map(lane, e) != (r, col + 8 * (e // 4)):
                raise ScheduleError(f"{where}: the C fragment of {qk} is not the A fragment of {pv} "
                                    f"(lane {lane}, element {e}); P would need a shuffle")


def fold_log2e(e: Expr) -> Expr:
    """log2(e) · e in float32, with the factor folded into a constant scale (through `where`s,
    sums and differences) so that the common `Σ·scale` costs one multiplication."""
    return cast(_fold(e), dt.float32)


def _fold(e: Expr) -> Expr:
    if isinstance(e, Select):
        return select(e.cond, fold_log2e(e.a), fold_log2e(e.b))
    if isinstance(e, Const) and e.dtype.is_float:
        return Const(float(e.value) * LOG2E, dt.float32)
    if isinstance(e, Cast) and e.dtype == dt.float32 and e.a.dtype.is_float:
        return fold_log2e(e.a) if e.a.dtype == dt.float32 else binary("*", e, Const(LOG2E, dt.float32))
    if isinstance(e, Binary) and e.op == "*" and e.dtype == dt.float32:
        for x, y in ((e.a, e.b), (e.b, e.a)):
            if isinstance(y, Const):
                return binary("*", x, Const(float(y.value) * LOG2E, dt.float32))
    if isinstance(e, Binary) and e.op in ("+", "-") and e.dtype == dt.float32:
        return binary(e.op, fold_log2e(e.a), fold_log2e(e.b))
    return binary("*", cast(e, dt.float32), Const(LOG2E, dt.float32))


__all__ = ["LOG2E", "TileStaging", "check_relayout", "fold_log2e", "two_n8_tiles"]
