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

tf32 (float32 operands, intrinsic "wgmma.tf32" or a `wgmma.m64nNk8.f32.tf32` row; the opt-in
that mma.sync's tf32 row asks for too). The ISA gives tf32 no transpose immediates: a shared
operand must be K-major. BK = 32 floats (the same 128-byte rows), k steps of 8 (32 bytes, as
k16 of halves), K-major tiles [S][rows][32] in the 128B swizzle of 4-byte elements,
Swizzle(3, 2, 3) (MatrixDescriptor(element_bytes=4).layout), 16-byte cp.async copies of 4 floats.
Call X the wgmma's A (64 rows per warpgroup) and Y its B (N = the block's other side):

   A [i, k], B [j, k]   X = A, Y = B, both through descriptors;
   A [k, i], B [j, k]   X = A from registers, Y = B;
   A [i, k], B [k, j]   Cᵀ = Bᵀ·Aᵀ: X = B from registers, Y = A; the warpgroups split the
                        block's columns (BN = 64 · warpgroups, warps (4 · BN/64, 1)) and the
                        wgmma's N is BM; the epilogue stores accumulator (r, c) at C[c, r];
   A [k, i], B [k, j]   refused (no K-major operand for Y): the mma.sync tf32 row serves it.

An X from registers keeps its tile k-outermost in shared memory, [S][BK/P][P][outer] with
tensorize.tf32_swizzle (its 4 k rows x 8 consecutive floats per load are conflict-free); per k
tile each thread loads its fragments (4 per k8 step, the row's operand-'a' map) into one of two
register sets, and the wgmma converts them with cvt.rna as it takes them (the row's conversion).
The registers of a register A are read until the wgmma completes, so with one group in flight
the loop runs two k tiles per trip, the second guarded, each with its own set: the set written
at tile kt was last read by tile kt - 2, complete since wait_group 1 at tile kt - 1. A shared
operand is read as stored: the tensor core ignores the 13 low mantissa bits (truncation; the
emulator does the same).
"""

from __future__ import annotations

from dataclasses import replace

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
from .implicit_gemm import WGMMA_OPERANDS
from .tensorize import (
    INTRINSICS,
    Contraction,
    Operand,
    Tiling,
    _Emitter,
    _int,
    _shape,
    match_contraction,
    tf32_swizzle,
)

K_TILE = 64            # halves in one 128-byte swizzled row
TF32_K_TILE = 32       # floats in one
BLOCK_N = (64, 128, 192, 256)
SWIZZLE_128B = Swizzle(3, 3, 3)
ROW_BYTES = 128
ATOM_BYTES = 1024      # 8 rows of 128 bytes: the swizzle's period, the descriptor's alignment
INPUT_TYPES = {"float16": "f16", "bfloat16": "bf16"}
FP8_INPUT_TYPES = {"float8_e4m3": "e4m3", "float8_e5m2": "e5m2"}
FP8_K_TILE = 128       # fp8 elements in one
# float32 operands run on wgmma only rounded to tf32, which a plan must name (as mma.sync's tf32
# row): intrinsic "wgmma.tf32" or a tf32 row; plain "wgmma" refuses them
TF32_WGMMA = "wgmma.tf32"


def wgmma_intrinsic(dtype: str, bn: int, b_dtype: str = "") -> str:
    """The intrinsic-table row of an m64nBNk16 wgmma with f32 accumulators for `dtype` operands
    (m64nBNk8 tf32 for float32, m64nBNk32 for fp8, where B may be the other fp8 type `b_dtype`)."""
    if dtype == "float32":
        return f"wgmma.m64n{bn}k8.f32.tf32"
    if dtype in FP8_INPUT_TYPES:
        a, b = FP8_INPUT_TYPES[dtype], FP8_INPUT_TYPES[b_dtype or dtype]
        return f"wgmma.m64n{bn}k32.f32.{a}" + ("" if a == b else f".{b}")
    return f"wgmma.m64n{bn}k16.f32.{INPUT_TYPES[dtype]}"


def swaps_operands(c: Contraction) -> bool:
    """Whether the tf32 kernel computes Cᵀ = Bᵀ·Aᵀ (module docstring, "tf32"): B is N-major, which
    tf32's shared operand B cannot be, and A is K-major, which it can."""
    return c.a.k_last and not c.b.k_last


def check_warpgroup_tiling(stage: str, t: Tiling, tf32: bool = False, swap: bool = False,
                           element_bytes: int = 0) -> None:
    """`tf32`: float32 operands (k tiles of 32 floats); `swap`: the warpgroups split the block's
    columns and the wgmma's N is its rows (Cᵀ = Bᵀ·Aᵀ); `element_bytes` 1: fp8 operands (k tiles
    of 128), 0: 4 for tf32, else 2."""
    where = f"tensorize({stage}, wgmma)"
    size = element_bytes or (4 if tf32 else 2)
    k_tile = ROW_BYTES // size
    if t.bk != k_tile:
        raise ScheduleError(f"{where}: k_tile must be {k_tile} (one 128-byte swizzled row of "
                            f"{ {1: 'fp8 elements', 2: 'halves', 4: 'floats'}[size] }), got {t.bk}")
    split, split_name, across, across_name = ((t.bn, "columns", t.bm, "rows") if swap
                                              else (t.bm, "rows", t.bn, "columns"))
    if split % 64 or not 1 <= split // 64 <= 4:
        raise ScheduleError(f"{where}: block {split_name} must be 64, 128, 192 or 256 (one m64 warpgroup per 64 "
                            f"{split_name}), got {split}")
    if (t.warps_m, t.warps_n) != (4 * (split // 64), 1):
        raise ScheduleError(f"{where}: warps must be ({4 * (split // 64)}, 1) for block {split_name} {split}: one "
                            f"warpgroup of 4 warps per 64 {split_name}, each over all {across} {across_name}; "
                            f"got {t.warps_m}x{t.warps_n}")
    if across not in BLOCK_N:
        raise ScheduleError(f"{where}: block {across_name} must be one of {BLOCK_N} (the N of an m64nNk wgmma, whole "
                            f"64-wide swizzle blocks), got {across}")
    if t.stages < 2 or t.stages > 8:
        raise ScheduleError(f"{where}: stages must be 2..8 (cp.async.wait_group takes 0..7), got {t.stages}")
    for rows in (t.bm, t.bn):
        if (rows * t.bk * size) % (16 * t.threads):
            raise ScheduleError(f"{where}: a {rows}x{t.bk} tile is not a whole number of 16-byte copies per thread "
                                f"for {t.threads} threads")


PRODUCERS = ("threads", "tma")


def checked_wgmma(func: PrimFunc, stage: str, intrinsic: str, tiling: Tiling) -> tuple[Contraction, str]:
    """The contraction `func` computes for `stage` and the wgmma row it takes, or a
    ScheduleError naming what does not fit. `intrinsic`: "wgmma" (the row for the operands'
    dtype and BN) or that row's name."""
    c = match_contraction(func, stage, WGMMA_OPERANDS, run_time_strides=True)  # run-time strides: _Emitter.dispatch
    dtype = c.a.buffer.dtype.name
    tf32 = dtype == "float32"
    fp8 = dtype in FP8_INPUT_TYPES
    if fp8 or (tf32 and not c.a.k_last and not c.b.k_last):
        c = k_major_views(c, both=fp8)
    if fp8 and not (c.a.k_last and c.b.k_last):
        raise ScheduleError(
            f"tensorize({stage}, wgmma): fp8 wgmma reads its shared operands K-major only (no transpose for "
            f".e4m3/.e5m2), and {' and '.join(op.buffer.name for op in (c.a, c.b) if not op.k_last)} is stored "
            "with k outermost; store both operands k-contiguous (A [i, k], B [j, k]: C = A·Bᵀ, as "
            "torch._scaled_mm takes them)")
    if tf32:
        if intrinsic != TF32_WGMMA and not intrinsic.endswith(".tf32"):
            raise ScheduleError(
                f"tensorize({stage}): float32 operands run on tensor cores only rounded to tf32 (10 mantissa bits), "
                f"which a plan must ask for by name: intrinsic={TF32_WGMMA!r} (got {intrinsic!r}); plan='auto' does "
                "so only with build(..., allow_tf32=True)")
        if not c.a.k_last and not c.b.k_last:
            raise ScheduleError(
                f"tensorize({stage}, wgmma): tf32 wgmma reads its shared operand K-major only, and both A "
                f"({c.a.buffer.name}) and B ({c.b.buffer.name}) are stored with k outermost; use the mma.sync "
                "tf32 row ('mma.m16n8k8.f32.tf32'), or store one operand k-contiguous")
    elif dtype not in INTRINSICS and not fp8:
        raise ScheduleError(f"tensorize({stage}, wgmma): operands are {dtype}; wgmma takes float16, bfloat16, "
                            f"float8_e4m3 or float8_e5m2 (float32 as tf32: intrinsic={TF32_WGMMA!r})")
    swap = tf32 and swaps_operands(c)
    check_warpgroup_tiling(stage, tiling, tf32, swap, c.a.buffer.dtype.bytes)
    want = wgmma_intrinsic(dtype, tiling.bm if swap else tiling.bn, c.b.buffer.dtype.name)
    if intrinsic in ("wgmma", TF32_WGMMA):
        intrinsic = want
    if intrinsic != want:
        raise ScheduleError(f"tensorize({stage}): intrinsic {intrinsic!r} does not fit {dtype} operands and block "
                            f"columns {tiling.bn}; use {want!r} (or 'wgmma')")
    return c, intrinsic


def k_major_views(c: Contraction, both: bool) -> Contraction:
    """fp8 and tf32 wgmma read shared operands K-major only (fp8 both, tf32 one of them). An
    operand with run-time strides matched MN-major (B[k, j] with strides="any") whose transposed
    view is K-major (B = w.t(), w (N, K) contiguous: `Operand.transposed`) is taken in that
    orientation: its copies are then tested for the transposed view's strides, and every other
    view takes the element loop, which stores it K-major too. `both`: every such operand (fp8),
    else the first one, B first (tf32, where one K-major operand suffices)."""
    for role in ("B", "A"):
        op = c.b if role == "B" else c.a
        alt = op.transposed
        if op.k_last or alt is None or not alt.k_last:
            continue
        c = replace(c, b=alt) if role == "B" else replace(c, a=alt)
        if not both:
            break
    return c


def tensorize_wgmma_threads(func: PrimFunc, c: Contraction, intrinsic: str, tiling: Tiling,
                            lookahead: int | None = None) -> PrimFunc:
    """The warpgroup kernel whose every thread issues cp.async into the ring (module
    docstring), for the contraction and row `checked_wgmma` gave. `lookahead` overrides the
    tiles loaded ahead (S - 1 - P); only tests pass one, to show that a ring refilling a stage an
    in-flight wgmma reads is reported by the emulator."""
    return _WarpgroupEmitter(func, c, intrinsic, tiling, lookahead).kernel()


class _WarpgroupEmitter(_Emitter):
    def __init__(self, func: PrimFunc, c: Contraction, intrinsic: str, t: Tiling, lookahead: int | None) -> None:
        row = lookup(intrinsic)
        self.tf32 = row.k_major_only                    # tf32 or fp8: K-major shared operands only
        self.k_step = row.shape[2]                      # 16 halves, 8 floats, 32 fp8: 32 bytes each
        self.k_tile = ROW_BYTES // c.a.buffer.dtype.bytes
        # X: wgmma's A (64 rows per warpgroup), Y: its B (the block's other side, wgmma N);
        # Cᵀ = Bᵀ·Aᵀ swaps them (module docstring, "tf32")
        self.swap = self.tf32 and swaps_operands(c)
        x = c.b if self.swap else c.a
        # a tf32 X stored with k outermost cannot be a shared operand: wgmma takes it from
        # registers, loaded from its shared tile (two sets: one is read by the group in flight)
        self.x_registers = self.tf32 and not x.k_last
        self.groups = (t.bn if self.swap else t.bm) // 64   # consumer warpgroups
        # P: wgmma groups left in flight per k tile; D: tiles loaded ahead (module docstring)
        self.pending = 1 if t.stages >= 3 else 0
        self.lookahead = t.stages - 1 - self.pending if lookahead is None else lookahead
        super().__init__(func, c, intrinsic, t)
        self.warpgroup = self.tx // WARPGROUP_SIZE

    @property
    def x(self) -> Operand:
        """wgmma's A operand in the main loop being built (`dispatch` may store an operand in
        the other orientation: a transposed view)."""
        return self.c.b if self.swap else self.c.a

    @property
    def y(self) -> Operand:
        return self.c.a if self.swap else self.c.b

    def transposes(self) -> bool:
        """wgmma transposes 16-bit operands from shared memory (the descriptor's major-ness and
        the instruction's transpose bit), so a transposed view of one gets its own copy loop; tf32
        and fp8 read shared operands K-major only (module docstring)."""
        return not self.tf32

    def extent(self, op: Operand) -> int:
        """The block's rows (A) or columns (B): the operand's tile's outer extent."""
        return self.t.bm if op.role == "A" else self.t.bn

    def fragment_buffers(self) -> tuple[Buffer, ...]:
        row = lookup(self.row)
        d = row.operand("d")
        self.frag_c = Buffer("acc", d.dtype, _shape(d.elements), "fragment", fragment=(self.row, "d"))
        self.c_map = d.layout
        if not self.x_registers:
            return (self.frag_c,)
        a = row.operand("a")
        self.x_elements = a.elements * (self.t.bk // self.k_step)   # one k tile's A fragments
        self.frag_x = Buffer("x_frag", a.dtype, _shape(2 * self.x_elements), "fragment", fragment=(self.row, "a"))
        return self.frag_c, self.frag_x

    def form(self) -> str:
        """The tf32 form, for the summary: '' (both operands through descriptors), the
        transposed product and/or which operand comes from registers."""
        if not self.tf32:
            return ""
        return (" C^T = B^T.A^T," if self.swap else "") + (
            f" {self.x.buffer.name} from registers" if self.x_registers else "")

    def summary(self) -> str:
        t = self.t
        return (f"{self.row} block {t.bm}x{t.bn} warpgroups {self.groups} k_tile {t.bk} stages {t.stages}{self.form()} "
                f"(wgmma groups in flight {self.pending}, tiles ahead {self.lookahead}){self.dispatch_summary()}")

    # step 2: staging in the descriptors' 128-byte swizzle ---------------------------------------
    def shared_buffer(self, op: Operand) -> Buffer:
        outer = self.extent(op)
        if self.x_registers and op is self.x:
            # [S][BK / P][P][outer], P k rows per swizzle period: the register loads read 4 k rows
            # at 8 consecutive floats, conflict-free (tensorize.tf32_swizzle, k-major)
            layout = tf32_swizzle(outer, False)
            per = layout.period // outer
            return Buffer(f"{op.buffer.name}_shared", op.buffer.dtype, _shape(self.t.stages, self.t.bk // per, per, outer),
                          "shared", tensor=f"{op.buffer.tensor}.shared", layout=layout)
        if op.k_last:
            descriptor = self.operand_descriptor(op)
            return Buffer(f"{op.buffer.name}_shared", op.buffer.dtype, _shape(self.t.stages, outer, self.k_tile),
                          "shared", tensor=f"{op.buffer.tensor}.shared", layout=descriptor.layout)
        return Buffer(f"{op.buffer.name}_shared", op.buffer.dtype, _shape(self.t.stages, outer // 64, self.t.bk, 64),
                      "shared", tensor=f"{op.buffer.tensor}.shared", layout=SWIZZLE_128B)

    def shared_index(self, op: Operand, stage: Expr, r: Expr, col: Expr) -> tuple[Expr, ...]:
        """A K-major tile is [S][outer][64], an MN-major one [S][outer / 64][BK][64] (BK = 64):
        both rows of 128 bytes under the same 128B swizzle of the element offset, the same size.
        A tile stored in the other orientation than its buffer's (a transposed view's main loop,
        `dispatch`) is written at its own canonical layout's element offset, seen through the
        buffer's shape, so `operand_start` and the descriptor of its own orientation read it."""
        if self.x_registers and op is self.x:
            per = tf32_swizzle(self.extent(op), False).period // self.extent(op)
            return stage, r // per, r % per, col
        if op.k_last != self.laid_out[op.role].k_last:
            assert self.t.bk == self.k_tile
            if op.k_last:   # (outer r, k col) at r·64 + col in the [S][outer / 64][BK][64] buffer
                return stage, r // self.t.bk, r % self.t.bk, col
            # (k r, outer col) at (col // 64)·(BK·64) + r·64 + col % 64 in the [S][outer][64] buffer
            return stage, (col // 64) * self.t.bk + r, col % 64
        if op.k_last:
            return stage, r, col
        return stage, col // 64, r, col % 64  # (k, mn) -> its 64-column block, row k

    def operand_descriptor(self, op: Operand) -> MatrixDescriptor:
        size = op.buffer.dtype.bytes
        if op.k_last:  # LBO is unused by swizzled K-major layouts; SBO: 8 rows of 128 bytes
            return MatrixDescriptor("K", "128B", leading_bytes=16, stride_bytes=ATOM_BYTES, element_bytes=size)
        return MatrixDescriptor("MN", "128B", leading_bytes=self.t.bk * ROW_BYTES, stride_bytes=ATOM_BYTES)

    def operand_start(self, op: Operand, stage: Expr, row0: Expr, k_step: Expr) -> Expr:
        """Element offset of the m64 (X) or N (Y) by k tile at rows row0.. and k step k_step."""
        outer = self.extent(op)
        if op.k_last:
            return stage * (outer * self.k_tile) + row0 * self.k_tile + k_step * self.k_step
        return stage * (outer * self.t.bk) + (row0 // 64) * (self.t.bk * 64) + k_step * (16 * 64)

    # step 3: the ring around asynchronous wgmmas ------------------------------------------------
    def pipeline(self) -> Stmt:
        t = self.t
        ahead_tiles = self.lookahead
        elements = lookup(self.row).operand("d").elements
        zero = self.unrolled("zero", elements, lambda z: BufferStore(self.frag_c, (z,), Const(0.0, dt.float32)))
        prologue = self.ring_prologue(ahead_tiles)
        if self.x_registers:
            # two iterations per trip, each with its own set of X registers: the group left in
            # flight reads the other set (the register operand's registers are read until the
            # wgmma completes: PTX ISA, wgmma.mma_async)
            pair = Var("k_pair")
            second = 2 * pair + 1
            loop = For(pair, _int(0), (self.k_tiles + 1) // 2, "serial", seq(
                self.iteration(2 * pair, 0),
                IfThenElse(second < self.k_tiles, self.iteration(second, 1))))
        else:
            loop = For(self.kt, _int(0), self.k_tiles, "serial", self.iteration(self.kt, 0))
        return seq(zero, *prologue, loop, WarpgroupWait(0, (self.frag_c,)), AsyncWait(0), self.epilogue())

    def iteration(self, kt: Expr, registers: int) -> Stmt:
        """k tile kt of the ring (module docstring, step 3); `registers`: the X register set."""
        t = self.t
        ahead = kt + self.lookahead
        issue, finish = self.load_stage(ahead % t.stages, ahead)
        stage = kt % t.stages
        return seq(
            AsyncWait(max(self.lookahead - 1, 0)),  # tile kt has landed
            AsyncProxyFence(),   # cp.async and element stores are generic-proxy writes; wgmma reads via the async proxy
            Barrier(),           # every thread's tile kt is visible; every warpgroup waited for tile kt - 1 - P
            IfThenElse(ahead < self.k_tiles, issue),
            AsyncCommit(),
            self.load_x(stage, registers) if self.x_registers else None,
            WarpgroupFence(),    # orders the accumulator (and X) registers before the wgmmas
            self.compute_set(stage, registers),
            WarpgroupCommit(),
            WarpgroupWait(self.pending),
            IfThenElse(ahead < self.k_tiles, finish) if finish is not None else None,
        )

    # steps 4-5: wgmma straight from shared memory -----------------------------------------------
    def load_x(self, stage: Expr, registers: int) -> Stmt:
        """The k tile's X fragments (tf32, k outermost in shared) into register set `registers`:
        element e of k step s at the row's operand-'a' map, rows 64 · warpgroup + ..."""
        a = lookup(self.row).operand("a")
        thread = self.tx % WARPGROUP_SIZE

        def element(q: Var) -> Stmt:
            step, e = q // a.elements, q % a.elements
            r, col = a.layout(thread, e)
            outer = self.warpgroup * 64 + r
            k = step * self.k_step + col
            value = self.shared[self.x.role][self.shared_index(self.x, stage, k, outer)]
            return BufferStore(self.frag_x, (registers * self.x_elements + q,), value)
        return self.unrolled("x_frag", self.x_elements, element)

    def compute(self, stage: Expr) -> Stmt:
        return self.compute_set(stage, 0)

    def compute_set(self, stage: Expr, registers: int) -> Stmt:
        row0 = self.warpgroup * 64
        elements = lookup(self.row).operand("a").elements

        def k_step(s: Var) -> Stmt:
            y = SharedMatrix(self.shared[self.y.role], self.operand_start(self.y, stage, _int(0), s),
                             self.operand_descriptor(self.y))
            x: SharedMatrix | FragmentRef
            if self.x_registers:
                x = FragmentRef(self.frag_x, registers * self.x_elements + s * elements)
            else:
                x = SharedMatrix(self.shared[self.x.role], self.operand_start(self.x, stage, row0, s),
                                 self.operand_descriptor(self.x))
            return WarpgroupMatrixMultiply(self.row, FragmentRef(self.frag_c, _int(0)), x, y, as_expr(True))
        return self.unrolled("k_step", self.t.bk // self.k_step, k_step)

    # step 6: the epilogue from the D fragment map -----------------------------------------------
    def epilogue(self) -> Stmt:
        thread = self.tx % WARPGROUP_SIZE
        elements = int(lookup(self.row).operand("d").elements)
        # Cᵀ's adjacent accumulator columns are adjacent rows of C: no pairs in the swapped form
        paired = not self.swap and self.pairs_columns(WARPGROUP_SIZE, elements)

        def element(e: Expr) -> Stmt:
            r, col = self.c_map(thread, e)     # (row, column) in the block: warpgroup g has rows 64g..
            row = self.warpgroup * 64 + r
            if self.swap:  # the accumulator holds Cᵀ: its rows are C's columns
                return self.output(col, row, self.frag_c[e])
            if paired:
                return self.output_pair(row, col, e)
            return self.output(row, col, self.frag_c[e])
        if paired:
            return self.finish_output(self.unrolled("out_e", elements // 2, lambda p: element(p * 2)))
        return self.finish_output(self.unrolled("out_e", elements, element))


__all__ = ["BLOCK_N", "K_TILE", "TF32_K_TILE", "TF32_WGMMA", "swaps_operands", "PRODUCERS", "check_warpgroup_tiling", "checked_wgmma", "tensorize_wgmma_threads",
           "wgmma_intrinsic"]
