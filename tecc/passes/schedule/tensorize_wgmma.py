"""tensorize on Hopper: a contraction stage rebuilt as a warpgroup (wgmma.mma_async) kernel.

The same matching, block tiling, cp.async ring and fused epilogue as tensorize.py (this module's
emitter is a subclass of its emitter); the fragment loads and mma.sync of steps 4-5 are
replaced by wgmmas that read A and B straight from shared memory through matrix descriptors
(tecc/ir/descriptor.py), and the ring is reordered around the asynchronous wgmma.

1. tiling      as tensorize.py, with `warps` = (4 · BM/64, 1): BM/64 warpgroups of 128 threads
               (1 or 2 in the strategy's space), warpgroup g computes rows 64g .. 64g + 63 of the
               block tile and all BN columns with one m64nBNk16 accumulator (BN/2 f32 registers
               per thread, laid out by the wgmma row's map). Every thread also issues its share
               of the cp.async copies, as before.
2. staging     BK = 64 halves = 128 bytes, the row of the 128-byte swizzle. A K-major operand
               (A[i, k], B[j, k]) is stored [S][rows][64]: row r of the tile at r · 64 with
               tecc's Swizzle(3, 3, 3), which is exactly the canonical K-major 128B layout
               ((8, m), (8, 2k)) : ((64, SBO = 512), (1, 8)) under the hardware's XOR of address
               bits [4, 7) with [7, 10). An MN-major operand (A[k, i], B[k, j]: wgmma's transpose
               bit) is stored [S][cols / 64][BK][64]: 64-column blocks of BK rows of 128 bytes,
               the canonical MN-major 128B layout with SBO = 1024 bytes between 8-row k groups
               and LBO = BK · 128 bytes between 64-column blocks. Every stage of every buffer
               starts at a multiple of 1024 bytes (codegen aligns the buffers), so the swizzle
               of the address is the swizzle of the element offset.
3. pipeline    wgmma reads shared memory asynchronously, after its issue and until its group is
               waited for, so a stage is free only once the wgmmas that read it completed in
               every warpgroup. With at most P = 1 wgmma group left in flight (wait_group 1; P = 0
               for a 2-stage ring) the ring loads D = S - 1 - P tiles ahead; iteration kt:

                   cp.async.wait_group D - 1      tile kt has landed (one group per tile)
                   fence.proxy.async              the copies' generic-proxy writes, and any
                                                  element stores, become visible to wgmma
                   __syncthreads                  ... of every thread; and every warpgroup has
                                                  passed iteration kt - 1's wait_group P, so
                                                  the wgmmas of tile kt - 1 - P are complete
                   refill stage (kt + D) % S = (kt - 1 - P) % S with tile kt + D; commit
                   wgmma.fence; BK / 16 wgmmas on stage kt % S; wgmma.commit_group
                   wgmma.wait_group P             tile kt - P's wgmmas complete (this warpgroup)
                   element loads (odd K) stored into stage (kt + D) % S

               The stage being refilled is never one an in-flight wgmma reads (the emulator
               reports that race: tests build the ring one tile further ahead to show it).
               After the loop: wait_group 0 (pinning the accumulators), cp.async.wait_group 0.
4. epilogue    each thread's accumulator elements at (row, col) from the wgmma D fragment's
               layout map (row + 64 · warpgroup), guarded, fused as tensorize.py's epilogue
               (column pairs in one store; optionally staged through shared memory).
"""

from __future__ import annotations

from ...ir import dtype as dt
from ...ir.descriptor import MatrixDescriptor
from ...ir.errors import ScheduleError
from ...ir.expr import Const, Expr, Var, as_expr, const_int
from ...ir.intrinsics import WARPGROUP_SIZE, lookup
from ...ir.layout import Swizzle
from ...ir.stmt import (
    AsyncCommit,
    AsyncProxyFence,
    AsyncWait,
    Barrier,
    Buffer,
    BufferStore,
    For,
    FragmentRef,
    IfThenElse,
    PrimFunc,
    SharedMatrix,
    Stmt,
    WarpgroupCommit,
    WarpgroupFence,
    WarpgroupMatrixMultiply,
    WarpgroupWait,
    seq,
)
from .tensorize import INTRINSICS, Contraction, Operand, Tiling, _Emitter, _int, _shape, match_contraction

K_TILE = 64            # halves in one 128-byte swizzled row
BLOCK_N = (64, 128, 192, 256)
SWIZZLE_128B = Swizzle(3, 3, 3)
ROW_BYTES = 128
ATOM_BYTES = 1024      # 8 rows of 128 bytes: the swizzle's period, the descriptor's alignment
INPUT_TYPES = {"float16": "f16", "bfloat16": "bf16"}


def wgmma_intrinsic(dtype: str, bn: int) -> str:
    """The intrinsic-table row of an m64nBNk16 wgmma with f32 accumulators for `dtype` operands."""
    return f"wgmma.m64n{bn}k16.f32.{INPUT_TYPES[dtype]}"


def check_warpgroup_tiling(stage: str, t: Tiling) -> None:
    where = f"tensorize({stage}, wgmma)"
    if t.bk != K_TILE:
        raise ScheduleError(f"{where}: k_tile must be {K_TILE} (one 128-byte swizzled row of halves), got {t.bk}")
    if t.bm % 64 or not 1 <= t.bm // 64 <= 4:
        raise ScheduleError(f"{where}: block rows must be 64, 128, 192 or 256 (one m64 warpgroup per 64 rows), "
                            f"got {t.bm}")
    if (t.warps_m, t.warps_n) != (4 * (t.bm // 64), 1):
        raise ScheduleError(f"{where}: warps must be ({4 * (t.bm // 64)}, 1) for block rows {t.bm}: one warpgroup of "
                            f"4 warps per 64 rows, each over all {t.bn} columns; got {t.warps_m}x{t.warps_n}")
    if t.bn not in BLOCK_N:
        raise ScheduleError(f"{where}: block columns must be one of {BLOCK_N} (an m64nNk16 wgmma whose B tile is "
                            f"whole 64-column swizzle blocks), got {t.bn}")
    if t.stages < 2 or t.stages > 8:
        raise ScheduleError(f"{where}: stages must be 2..8 (cp.async.wait_group takes 0..7), got {t.stages}")
    for rows in (t.bm, t.bn):
        if (rows * t.bk) % (8 * t.threads):
            raise ScheduleError(f"{where}: a {rows}x{t.bk} tile is not a whole number of 16-byte copies per thread "
                                f"for {t.threads} threads")


PRODUCERS = ("threads", "tma")


def checked_wgmma(func: PrimFunc, stage: str, intrinsic: str, tiling: Tiling) -> tuple[Contraction, str]:
    """The contraction `func` computes for `stage` and the wgmma row it takes, or a
    ScheduleError naming what does not fit. `intrinsic`: "wgmma" (the row for the operands'
    dtype and BN) or that row's name."""
    c = match_contraction(func, stage)
    check_warpgroup_tiling(stage, tiling)
    dtype = c.a.buffer.dtype.name
    if dtype not in INTRINSICS:
        raise ScheduleError(f"tensorize({stage}, wgmma): operands are {dtype}; wgmma takes float16 or bfloat16")
    want = wgmma_intrinsic(dtype, tiling.bn)
    if intrinsic == "wgmma":
        intrinsic = want
    if intrinsic != want:
        raise ScheduleError(f"tensorize({stage}): intrinsic {intrinsic!r} does not fit {dtype} operands and block "
                            f"columns {tiling.bn}; use {want!r} (or 'wgmma')")
    return c, intrinsic


def tensorize_wgmma_threads(func: PrimFunc, c: Contraction, intrinsic: str, tiling: Tiling,
                            lookahead: int | None = None) -> PrimFunc:
    """The warpgroup kernel whose every thread issues cp.async into the ring (module
    docstring), for the contraction and row `checked_wgmma` gave. `lookahead` overrides the
    tiles loaded ahead (S - 1 - P); only tests pass one, to show that a ring refilling a stage an
    in-flight wgmma reads is reported by the emulator."""
    return _WarpgroupEmitter(func, c, intrinsic, tiling, lookahead).kernel()


class _WarpgroupEmitter(_Emitter):
    def __init__(self, func: PrimFunc, c: Contraction, intrinsic: str, t: Tiling, lookahead: int | None) -> None:
        # P: wgmma groups left in flight per k tile; D: tiles loaded ahead (module docstring)
        self.pending = 1 if t.stages >= 3 else 0
        self.lookahead = t.stages - 1 - self.pending if lookahead is None else lookahead
        super().__init__(func, c, intrinsic, t)
        self.warpgroup = self.tx // WARPGROUP_SIZE
        self.descriptor = {op.role: self.operand_descriptor(op) for op in (c.a, c.b)}

    def fragment_buffers(self) -> tuple[Buffer, ...]:
        d = lookup(self.row).operand("d")
        self.frag_c = Buffer("acc", d.dtype, _shape(d.elements), "fragment", fragment=(self.row, "d"))
        self.c_map = d.layout
        return (self.frag_c,)

    def summary(self) -> str:
        t = self.t
        return (f"{self.row} block {t.bm}x{t.bn} warpgroups {t.bm // 64} k_tile {t.bk} stages {t.stages} "
                f"(wgmma groups in flight {self.pending}, tiles ahead {self.lookahead})")

    # step 2: staging in the descriptors' 128-byte swizzle ---------------------------------------
    def shared_buffer(self, op: Operand) -> Buffer:
        outer = self.t.bm if op.role == "A" else self.t.bn
        shape = ((self.t.stages, outer, K_TILE) if op.k_last
                 else (self.t.stages, outer // 64, self.t.bk, 64))
        return Buffer(f"{op.buffer.name}_shared", op.buffer.dtype, _shape(*shape), "shared",
                      tensor=f"{op.buffer.tensor}.shared", layout=SWIZZLE_128B)

    def shared_index(self, op: Operand, stage: Expr, r: Expr, col: Expr) -> tuple[Expr, ...]:
        if op.k_last:
            return stage, r, col
        return stage, col // 64, r, col % 64  # (k, mn) -> its 64-column block, row k

    def operand_descriptor(self, op: Operand) -> MatrixDescriptor:
        if op.k_last:  # LBO is unused by swizzled K-major layouts; SBO: 8 rows of 128 bytes
            return MatrixDescriptor("K", "128B", leading_bytes=16, stride_bytes=ATOM_BYTES)
        return MatrixDescriptor("MN", "128B", leading_bytes=self.t.bk * ROW_BYTES, stride_bytes=ATOM_BYTES)

    def operand_start(self, op: Operand, stage: Expr, row0: Expr, k_step: Expr) -> Expr:
        """Element offset of the m64 (A) or n BN (B) by k16 tile at rows row0.. and k 16·k_step.."""
        outer = self.t.bm if op.role == "A" else self.t.bn
        if op.k_last:
            return stage * (outer * K_TILE) + row0 * K_TILE + k_step * 16
        return stage * (outer * self.t.bk) + (row0 // 64) * (self.t.bk * 64) + k_step * (16 * 64)

    # step 3: the ring around asynchronous wgmmas ------------------------------------------------
    def pipeline(self) -> Stmt:
        t = self.t
        ahead_tiles = self.lookahead
        elements = lookup(self.row).operand("d").elements
        zero = self.unrolled("zero", elements, lambda z: BufferStore(self.frag_c, (z,), Const(0.0, dt.float32)))
        known = const_int(self.k_tiles)
        prologue: list[Stmt] = []
        for s in range(ahead_tiles):
            issue, finish = self.load_stage(Const(s, dt.int32), Const(s, dt.int32))
            load = seq(issue, finish)
            if known is None:
                prologue.append(IfThenElse(Const(s, dt.int32) < self.k_tiles, load))
            elif s < known:
                prologue.append(load)
            prologue.append(AsyncCommit())  # one group per tile, even past the last
        ahead = self.kt + ahead_tiles
        issue, finish = self.load_stage(ahead % t.stages, ahead)
        loop = For(self.kt, _int(0), self.k_tiles, "serial", seq(
            AsyncWait(max(ahead_tiles - 1, 0)),  # tile kt has landed
            AsyncProxyFence(),   # cp.async and element stores are generic-proxy writes; wgmma reads via the async proxy
            Barrier(),           # every thread's tile kt is visible; every warpgroup waited for tile kt - 1 - P
            IfThenElse(ahead < self.k_tiles, issue),
            AsyncCommit(),
            WarpgroupFence(),    # orders the accumulator registers (zeroed, or the last wgmmas') before the wgmmas
            self.compute(self.kt % t.stages),
            WarpgroupCommit(),
            WarpgroupWait(self.pending),
            IfThenElse(ahead < self.k_tiles, finish) if finish is not None else None,
        ))
        return seq(zero, *prologue, loop, WarpgroupWait(0, (self.frag_c,)), AsyncWait(0), self.epilogue())

    # steps 4-5: wgmma straight from shared memory -----------------------------------------------
    def compute(self, stage: Expr) -> Stmt:
        a, b = self.c.a, self.c.b
        row0 = self.warpgroup * 64

        def k_step(s: Var) -> Stmt:
            return WarpgroupMatrixMultiply(
                self.row, FragmentRef(self.frag_c, _int(0)),
                SharedMatrix(self.shared["A"], self.operand_start(a, stage, row0, s), self.descriptor["A"]),
                SharedMatrix(self.shared["B"], self.operand_start(b, stage, _int(0), s), self.descriptor["B"]),
                as_expr(True))
        return self.unrolled("k_step", self.t.bk // 16, k_step)

    # step 6: the epilogue from the D fragment map -----------------------------------------------
    def epilogue(self) -> Stmt:
        thread = self.tx % WARPGROUP_SIZE
        elements = int(lookup(self.row).operand("d").elements)
        paired = self.pairs_columns(WARPGROUP_SIZE, elements)

        def element(e: Expr) -> Stmt:
            r, col = self.c_map(thread, e)     # (row, column) in the block: warpgroup g has rows 64g..
            row = self.warpgroup * 64 + r
            if paired:
                return self.output_pair(row, col, e)
            return self.output(row, col, self.frag_c[e])
        if paired:
            return self.finish_output(self.unrolled("out_e", elements // 2, lambda p: element(p * 2)))
        return self.finish_output(self.unrolled("out_e", elements, element))


__all__ = ["BLOCK_N", "K_TILE", "PRODUCERS", "check_warpgroup_tiling", "checked_wgmma", "tensorize_wgmma_threads",
           "wgmma_intrinsic"]
