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
from ...ir.expr import (
    Binary,
    BufferLoad,
    Cast,
    Const,
    Expr,
    Select,
    TensorRead,
    Var,
    binary,
    cast,
    compare,
    const_int,
    free_vars,
    select,
    substitute,
    walk,
)
from ...ir.descriptor import MatrixDescriptor
from ...ir.intrinsics import WARPGROUP_SIZE, lookup
from ...ir.stmt import (
    AsyncCopy,
    Buffer,
    BufferStore,
    For,
    FragmentRef,
    MatrixMultiply,
    Seq,
    SharedMatrix,
    Stmt,
    WarpgroupCommit,
    WarpgroupFence,
    WarpgroupMatrixMultiply,
    WarpgroupWait,
    seq,
)
from ...ir.tensor import Tensor
from ..schedule.tensorize import INTRINSICS
from ..schedule.thread_partition import tile_copy
from ..schedule.tile_staging import CHUNK, row_swizzle

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

    def element_loop(self, label: str, extent: int, body: Callable[[Var], Stmt]) -> Stmt:
        """An unrolled loop over a fragment's elements (`unrolled`), its 16-bit fragment stores
        in pairs where they can be (`paired_stores`)."""
        return paired_stores(self.unrolled(label, extent, body), self.unique)

    def blocked(self, label: str, read: TensorRead, stages: int, rows: int, width: int) -> Buffer:
        """The Hopper form's shared tile [stages][width / W][rows][W] of `read`: W = block_width(width)
        halves a row (2·W bytes, the swizzle's row), the descriptors' swizzle as the buffer's layout."""
        w = block_width(width)
        shape = tuple(Const(n, dt.int32) for n in (stages, width // w, rows, w))
        return Buffer(self.unique(label), read.dtype, shape, "shared", tensor=f"{read.tensor.name}.shared",
                      layout=descriptor(w, "K").layout)

    def operand(self, buf: Buffer, stage: Expr, row0: Expr, step: Expr, mn_major: bool = False) -> SharedMatrix:
        """The wgmma operand of the blocked tile `buf` (blocked()) at k16 step `step`: K-major
        (Q, K: rows are the tile's rows, k along its width) from row `row0`; for V (the P·V B
        operand, k = the tile's rows = keys, n = its width) MN-major."""
        _, blocks, rows, w = (const_int(x) for x in buf.shape)
        assert blocks is not None and rows is not None and w is not None
        base = stage * (blocks * rows * w)
        if mn_major:
            return SharedMatrix(buf, base + step * (16 * w), descriptor(w, "MN", rows))
        k = step * 16
        return SharedMatrix(buf, base + (k // w) * (rows * w) + row0 * w + k % w, descriptor(w, "K"))

    def wgmma_k_major(self, label: str, intrinsic: str, acc: Buffer, a: Buffer, a_row0: Expr, b: Buffer,
                      b_stage: Expr, steps: int) -> Stmt:
        """acc = A·Bᵀ over `steps` k16 steps of wgmma (scale-d false on the first: acc is
        overwritten): A the blocked tile `a` (stage 0) from row `a_row0`, B the blocked tile `b` of
        stage `b_stage`, both K-major (the rows of `b` are the n)."""
        zero = Const(0, dt.int32)
        return self.unrolled(label, steps, lambda kd: WarpgroupMatrixMultiply(
            intrinsic, FragmentRef(acc, zero), self.operand(a, zero, a_row0, kd), self.operand(b, b_stage, zero, kd),
            compare("!=", kd, zero)))

    def wgmma_register_a(self, label: str, intrinsic: str, acc: Buffer, a: Buffer, b: Buffer, b_stage: Expr,
                         steps: int, accumulate: Expr | None = None) -> Stmt:
        """acc += A·B over `steps` k16 steps of wgmma: A from registers (elements 8·k .. 8·k + 7 of
        the fragment `a` at step k: the C-to-A identity, check_wgmma_relayout), B the blocked tile
        `b` of stage `b_stage` MN-major (its rows are the k)."""
        zero = Const(0, dt.int32)
        return self.unrolled(label, steps, lambda kk: WarpgroupMatrixMultiply(
            intrinsic, FragmentRef(acc, zero), FragmentRef(a, 8 * kk),
            self.operand(b, b_stage, zero, kk, mn_major=True),
            Const(True, dt.bool_) if accumulate is None else (accumulate | compare("!=", kk, zero))))

    @staticmethod
    def wgmma_group(steps: list[Stmt], results: tuple[Buffer, ...]) -> Stmt:
        """One wgmma group waited for at once: the fence (the accumulators' and register
        operands' writes before the wgmmas read them), the steps, the commit, the wait that pins
        `results`."""
        return seq(WarpgroupFence(), *steps, WarpgroupCommit(), WarpgroupWait(0, results))

    @staticmethod
    def tile_width(buf: Buffer) -> int:
        """The columns of a staged tile: [stages][rows][width], or the Hopper form's blocked
        [stages][width / W][rows][W]."""
        dims = [const_int(x) or 0 for x in buf.shape]
        return dims[1] * dims[3] if len(dims) == 4 else dims[-1]

    @staticmethod
    def tile_index(buf: Buffer, stage: Expr, r: Expr, col: Expr) -> tuple[Expr, ...]:
        """Where row r, column col of stage `stage` lies in a staged tile: [stage][r][col], or in
        the Hopper form's blocked [stages][width / W][rows][W] at [stage][col / W][r][col % W]."""
        if len(buf.shape) == 4:
            w = const_int(buf.shape[3])
            assert w is not None
            return stage, col // w, r, col % w
        return stage, r, col

    def copy_tile(self, dst: Buffer, stage: Expr, read: TensorRead, at: dict[Var, Expr], row0: Expr, extent: Expr,
                  rows: int, width: int, axes: tuple[Var, Var] | None = None) -> Stmt:
        """cp.async of rows [row0, row0 + rows) x [0, width) of the read tensor into dst[stage],
        16 bytes per copy, zero past `extent`. A 4-dimensional dst (the Hopper form) is
        [stages][width / W][rows][W]: blocks of W-element swizzled rows. The read is [.., row,
        col] with leading indices in `at`'s variables, or, given its (row, col) variables `axes`,
        any view whose row and column they are (online_mma_chain._strided_rows: a slice of a
        fused projection), read at `at`, row0 + r and the column."""
        src = self.buffers[read.tensor]
        idx = read.indices
        if axes is None or (idx[-2] is axes[0] and idx[-1] is axes[1]):
            lead = tuple(substitute(e, at) for e in idx[:-2])

            def source(r: Expr, col: Expr) -> tuple[Expr, ...]:
                return lead + (row0 + r, col)
        else:
            row, column = axes

            def source(r: Expr, col: Expr) -> tuple[Expr, ...]:
                return tuple(substitute(e, {**at, row: row0 + r, column: col}) for e in idx)

        def copy(r: Expr, col: Expr) -> Stmt:
            return AsyncCopy(dst, self.tile_index(dst, stage, r, col), src, source(r, col), 16,
                             compare("<", row0 + r, extent), "cg")
        return tile_copy(self.unrolled, f"copy_{read.tensor.name}", self.tx, self.threads, rows, width, CHUNK, copy)


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


def block_width(width: int) -> int:
    """The halves per swizzled row of the Hopper form's blocked tiles: 64 (the 128B swizzle) when
    they divide the width, else 32 (64B: d = 96 is three blocks of 32) or 16 (32B)."""
    return next(w for w in (64, 32, 16) if width % w == 0)


def descriptor(w: int, major: str, rows: int = 0) -> MatrixDescriptor:
    """The descriptor of a blocked tile (TileStaging.blocked) with rows of w halves (16, 32 or 64:
    the 32B, 64B or 128B swizzle): K-major, 8-row groups 8·2w bytes apart (SBO; LBO unused);
    MN-major (V, `rows` keys per column block), k groups of 8 rows SBO = 8·2w bytes apart and
    column blocks LBO = rows·2w bytes apart."""
    mode = {16: "32B", 32: "64B", 64: "128B"}[w]
    if major == "K":
        return MatrixDescriptor("K", mode, leading_bytes=16, stride_bytes=16 * w)
    return MatrixDescriptor("MN", mode, leading_bytes=rows * 2 * w, stride_bytes=16 * w)


def check_wgmma_relayout(qk: str, pv: str, where: str = "online_contraction_mma") -> None:
    """The wgmma accumulator is the m16n8 C pattern per warp and n8 block (so the mma kernel's
    element code serves it), and its elements 8k .. 8k + 7 are the register A of k16 step k."""
    d_map = lookup(qk).operand("d").layout
    c_map = lookup(INTRINSICS["float16"]).operand("c").layout
    a_map = lookup(pv).operand("a").layout
    for thread in range(WARPGROUP_SIZE):
        for e in range(16):
            r, col = c_map(thread % 32, e % 4)
            if d_map(thread, e) != (16 * (thread // 32) + r, 8 * (e // 4) + col):
                raise ScheduleError(f"{where}: the accumulator of {qk} is not the m16n8 C pattern per "
                                    f"warp (thread {thread}, element {e})")
        for e in range(8):
            if a_map(thread, e) != d_map(thread, e):
                raise ScheduleError(f"{where}: the accumulator of {qk} is not the register A of {pv} "
                                    f"(thread {thread}, element {e}); P would need a shuffle")


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


__all__ = ["LOG2E", "TileStaging", "block_width", "check_relayout", "check_wgmma_relayout", "descriptor", "fold_log2e",
           "two_n8_tiles"]


def _stores(s: Stmt) -> list[Stmt]:
    return [x for part in s.stmts for x in _stores(part)] if isinstance(s, Seq) else [s]


def paired_stores(loop: Stmt, unique: Callable[[str], str]) -> Stmt:
    """An unrolled loop `for e < 2n: a[base_a + e] = ...; b[base_b + e] = ...` over fragment
    elements, split into one loop per store (each buffer stored once, and each iteration reads
    the loop's own buffers only at its element, so the order across stores is free), each store
    of float32 values converted to a 16-bit fragment as n pairs of a 2-lane vector loop: one
    paired conversion into the 32-bit register an mma operand reads (codegen: vectorize). Any
    other loop is returned unchanged."""
    if not isinstance(loop, For) or loop.kind != "unroll" or const_int(loop.min) != 0:
        return loop
    extent, e = const_int(loop.extent), loop.var
    stores = _stores(loop.body)
    if not extent or extent % 2 or not all(isinstance(x, BufferStore) and len(x.indices) == 1 for x in stores):
        return loop

    def base(index: Expr) -> Expr | None:
        if index is e:
            return Const(0, dt.int32)
        if isinstance(index, Binary) and index.op == "+" and index.b is e and e not in free_vars(index.a):
            return index.a
        return None
    written = {id(x.buffer): x.indices[0] for x in stores if isinstance(x, BufferStore)}
    if len(written) != len(stores):   # a buffer stored twice: its stores' order across iterations stays
        return loop
    for x in stores:
        assert isinstance(x, BufferStore)
        if base(x.indices[0]) is None:
            return loop
        for n in walk(x.value):   # the loop's buffers read only at the element's own index
            if isinstance(n, BufferLoad) and id(n.buffer) in written and n.indices != (written[id(n.buffer)],):
                return loop
    def pairable(x: BufferStore) -> bool:   # a conversion stored to a 16-bit register fragment
        return x.buffer.scope == "fragment" and x.buffer.dtype.bytes == 2 and isinstance(x.value, Cast)

    if not any(isinstance(x, BufferStore) and pairable(x) for x in stores):
        return loop
    loops: list[Stmt] = []
    for x in stores:
        assert isinstance(x, BufferStore)
        if pairable(x):
            h, lane = Var(unique("pair"), dt.int32), Var(unique("pair_v"), dt.int32)
            at = {e: h * 2 + lane}
            inner = For(lane, Const(0, dt.int32), Const(2, dt.int32), "vectorize",
                        BufferStore(x.buffer, tuple(substitute(i, at) for i in x.indices), substitute(x.value, at)))
            loops.append(For(h, Const(0, dt.int32), Const(extent // 2, dt.int32), "unroll", inner))
        else:
            fresh = Var(unique(e.name), dt.int32)
            loops.append(For(fresh, loop.min, loop.extent, "unroll",
                             BufferStore(x.buffer, tuple(substitute(i, {e: fresh}) for i in x.indices),
                                         substitute(x.value, {e: fresh})), loop.annotations))
    return seq(*loops)
