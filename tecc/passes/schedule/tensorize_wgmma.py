"""tensorize on Hopper: a contraction stage rebuilt as a warpgroup (wgmma.mma_async) kernel.

The same matching, block tiling, staging and fused epilogue as tensorize.py (this module's
kernel is a subclass of its kernel); the fragment loads and mma.sync of steps 4-5 are replaced
by wgmmas that read A and B straight from shared memory through matrix descriptors
(tecc/ir/descriptor.py), and the rings (ring.py) keep stages behind the asynchronous wgmma.
With `pipeline(..., producer="tma")` the tiles come by TMA into an mbarrier ring, and with
`warp_specialize` from a producer warpgroup (tma.py).

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
from typing import Callable

from ...ir import dtype as dt
from ...ir.descriptor import MatrixDescriptor
from ...ir.errors import ScheduleError
from ...ir.expr import Const, Expr, Var, as_expr
from ...ir.intrinsics import WARPGROUP_SIZE, lookup
from ...ir.layout import Swizzle
from ...ir.stmt import (
    AsyncProxyFence,
    BarrierRef,
    Buffer,
    BufferStore,
    FragmentRef,
    PrimFunc,
    SharedMatrix,
    Stmt,
    TensorCopy,
    TensorMap,
    WarpgroupCommit,
    WarpgroupFence,
    WarpgroupMatrixMultiply,
    WarpgroupWait,
    seq,
)
from .implicit_gemm import WGMMA_OPERANDS, Contraction, Operand, match_contraction
from .tensorize import INTRINSICS, MmaKernel
from .tile_kernel import BlockTile, TileSchedule, int32, int32_shape
from .tile_staging import tf32_swizzle
from .tma import operand_dims

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



def check_warpgroup_tiling(stage: str, t: BlockTile, tf32: bool = False, swap: bool = False,
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
    for rows in (t.bm, t.bn):
        if (rows * t.bk * size) % (16 * t.threads):
            raise ScheduleError(f"{where}: a {rows}x{t.bk} tile is not a whole number of 16-byte copies per thread "
                                f"for {t.threads} threads")



def checked_wgmma(func: PrimFunc, stage: str, intrinsic: str, tiling: BlockTile) -> tuple[Contraction, str]:
    """The contraction `func` computes for `stage` and the wgmma row it takes, or a
    ScheduleError naming what does not fit. `intrinsic`: "wgmma" (the row for the operands'
    dtype and BN) or that row's name."""
    c = match_contraction(func, stage, WGMMA_OPERANDS, run_time_strides=True)  # run-time strides: TileStaging.dispatch
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



class WgmmaKernel(MmaKernel):
    """The warpgroup kernel of a TileSchedule (module docstring; the layers: tile_kernel.py)."""

    def __init__(self, schedule: TileSchedule) -> None:
        c, t = schedule.contraction, schedule
        row = lookup(schedule.row)
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
        self.consumers = self.groups
        # P: wgmma groups left in flight per k tile; D: tiles loaded ahead (module docstring)
        self.pending = 1 if t.stages >= 3 else 0
        self.lookahead = t.stages - 1 - self.pending if t.lookahead is None else t.lookahead
        self.tma = t.producer == "tma"
        self.mn_box = ROW_BYTES // c.a.buffer.dtype.bytes   # columns of an MN-major box: one 128-byte row
        super().__init__(schedule)
        self.warpgroup = self.tx // WARPGROUP_SIZE
        if self.tma:
            dims = {op.role: operand_dims(c, op) for op in (c.a, c.b)}
            self.map_dims = {role: d for role, d in dims.items() if not isinstance(d, str)}
            assert len(self.map_dims) == 2, dims   # tma_refusal (tensor_core.check) allowed them
            self.maps = {op.role: self.tensor_map(op) for op in (c.a, c.b)}

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
        self.frag_c = Buffer("acc", d.dtype, int32_shape(d.elements), "fragment", fragment=(self.row, "d"))
        self.c_map = d.layout
        if not self.x_registers:
            return (self.frag_c,)
        a = row.operand("a")
        self.x_elements = a.elements * (self.t.bk // self.k_step)   # one k tile's A fragments
        self.frag_x = Buffer("x_frag", a.dtype, int32_shape(2 * self.x_elements), "fragment", fragment=(self.row, "a"))
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
        if t.warp_specialized:
            grid = (f", persistent over {t.persistent} blocks in groups of {t.group_m} row tiles"
                    if t.persistent else "")
            if self.store_staged:
                epilogue = ", epilogue through shared memory + TMA store"
            elif self.store_threads:
                epilogue = ", epilogue through shared memory + the threads' stores"
            elif self.store_refusal is not None:
                epilogue = f", epilogue from registers (no TMA store: {self.store_refusal})"
            else:
                epilogue = ""
            return (f"{self.row} block {t.bm}x{t.bn} consumer warpgroups {self.consumers} + TMA producer warpgroup "
                    f"k_tile {t.bk} stages {t.stages}{self.form()} (mbarrier ring, wgmma groups in flight 1{grid}"
                    f"{epilogue}){self.split_summary()}")
        head = f"{self.row} block {t.bm}x{t.bn} warpgroups {self.groups} k_tile {t.bk}"
        if t.stages == 1:
            return (f"{head} unpipelined{self.form()}{self.staging_summary()}{self.dispatch_summary()}"
                    f"{self.split_summary()}")
        ring = "TMA + mbarrier ring, not warp-specialized, " if self.tma else ""
        return (f"{head} stages {t.stages}{self.form()} ({ring}wgmma groups in flight {self.pending}, tiles ahead "
                f"{self.lookahead}){self.staging_summary()}{self.dispatch_summary()}{self.split_summary()}")

    # step 2: staging in the descriptors' 128-byte swizzle ---------------------------------------

    def shared_buffer(self, op: Operand) -> Buffer:
        outer = self.extent(op)
        if self.x_registers and op is self.x and self.tma:
            # a tf32 X from registers, k outermost: [S][outer / 32][BK][32], the boxes the tensor map
            # writes in its 128B swizzle (4-byte elements: Swizzle(3, 2, 3)); the fragment loads read
            # it through the same layout
            width = ROW_BYTES // op.buffer.dtype.bytes
            layout = self.operand_descriptor(op).layout if op.k_last else \
                MatrixDescriptor("K", "128B", 16, 1024, op.buffer.dtype.bytes).layout
            return Buffer(f"{op.buffer.name}_shared", op.buffer.dtype,
                          int32_shape(self.t.stages, self.extent(op) // width, self.t.bk, width), "shared",
                          tensor=f"{op.buffer.tensor}.shared", layout=layout)
        if self.x_registers and op is self.x:
            # [S][BK / P][P][outer], P k rows per swizzle period: the register loads read 4 k rows
            # at 8 consecutive floats, conflict-free (tensorize.tf32_swizzle, k-major)
            layout = tf32_swizzle(outer, False)
            per = layout.period // outer
            return Buffer(f"{op.buffer.name}_shared", op.buffer.dtype, int32_shape(self.t.stages, self.t.bk // per, per, outer),
                          "shared", tensor=f"{op.buffer.tensor}.shared", layout=layout)
        if op.k_last:
            descriptor = self.operand_descriptor(op)
            return Buffer(f"{op.buffer.name}_shared", op.buffer.dtype, int32_shape(self.t.stages, outer, self.k_tile),
                          "shared", tensor=f"{op.buffer.tensor}.shared", layout=descriptor.layout)
        return Buffer(f"{op.buffer.name}_shared", op.buffer.dtype, int32_shape(self.t.stages, outer // 64, self.t.bk, 64),
                      "shared", tensor=f"{op.buffer.tensor}.shared", layout=SWIZZLE_128B)

    def shared_index(self, op: Operand, stage: Expr, r: Expr, col: Expr) -> tuple[Expr, ...]:
        """A K-major tile is [S][outer][64], an MN-major one [S][outer / 64][BK][64] (BK = 64):
        both rows of 128 bytes under the same 128B swizzle of the element offset, the same size.
        A tile stored in the other orientation than its buffer's (a transposed view's main loop,
        `dispatch`) is written at its own canonical layout's element offset, seen through the
        buffer's shape, so `operand_start` and the descriptor of its own orientation read it."""
        if self.x_registers and op is self.x and self.tma:
            width = ROW_BYTES // op.buffer.dtype.bytes
            return stage, col // width, r, col % width
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


    # step 2 with TMA: tensor maps and box copies (tma.py) ---------------------------------------
    def tensor_map(self, op: Operand) -> TensorMap:
        """One dimension per batch axis (a box of 1), the rows or columns (the tile's, or an
        MN-major block's 64) and k (the k tile), each over the buffer dimensions it merges."""
        outer = self.t.bm if op.role == "A" else self.t.bn
        dims = self.map_dims[op.role]
        box = tuple(self.k_tile if d.axis == "k" else (outer if op.k_last else self.mn_box) if d.axis == "outer"
                    else 1 for d in dims)
        merge = tuple(d.span for d in dims) if any(d.span > 1 for d in dims) else ()
        return TensorMap(op.buffer, box, "128B", merge)

    def tma_maps(self) -> list[TensorMap]:
        """The operands' tensor maps and, with the TMA-store epilogue, the output's."""
        if not self.tma:
            return []
        return [self.maps["A"], self.maps["B"], *([self.out_map] if self.store_staged else [])]

    def tile_copies(self, op: Operand, stage: Expr, k_tile: Expr, bar: BarrierRef) -> list[Stmt]:
        """The TMA box copies of the operand's tile of k tile `k_tile` into ring stage `stage`,
        completing on `bar`: one (rows, 64) box of a K-major tile, rows/64 boxes of (64, 64) of an
        MN-major one (one per 64-column block)."""
        c, t = self.c, self.t
        outer0 = self.by * t.bm if op.role == "A" else self.bx * t.bn
        outer = t.bm if op.role == "A" else t.bn
        dst = self.shared[op.role]
        zero = int32(0)
        copies: list[Stmt] = []
        for block in range(1 if op.k_last else outer // self.mn_box):
            coords = []
            for d in self.map_dims[op.role]:   # a merged dimension's coordinate is its flat index
                if d.axis == "k":
                    coords.append(self.k_index(k_tile) * self.k_tile)
                elif d.axis == "outer":
                    coords.append(outer0 + self.mn_box * block)
                else:
                    assert isinstance(d.axis, Var)
                    coords.append(self.batch_index[d.axis.name])
            indices = (stage, zero, zero) if op.k_last else (stage, int32(block), zero, zero)
            copies.append(TensorCopy(dst, indices, self.maps[op.role], tuple(coords), bar))
        return copies

    def ring_bytes(self) -> int:
        """Bytes of one ring stage: the boxes of both operands' tiles."""
        t = self.t
        return (self.maps["A"].bytes * (1 if self.c.a.k_last else t.bm // self.mn_box)
                + self.maps["B"].bytes * (1 if self.c.b.k_last else t.bn // self.mn_box))

    # step 3: what the rings need of the wgmma (ring.py) ---------------------------------------------
    def ahead(self) -> int:
        return self.lookahead

    def in_flight(self) -> int:
        return self.pending

    def register_sets(self) -> int:
        return 2 if self.x_registers else 1

    def publish(self) -> list[Stmt]:
        # cp.async and element stores are generic-proxy writes; wgmma reads via the async proxy
        return [AsyncProxyFence()]

    def drain(self) -> Stmt | None:
        return WarpgroupWait(0, (self.frag_c,))

    def compute_tile(self, stage: Expr, registers: int, pending: int) -> Stmt:
        return seq(
            self.load_x(stage, registers) if self.x_registers else None,
            WarpgroupFence(),    # orders the accumulator (and X) registers before the wgmmas
            self.compute_set(stage, registers),
            WarpgroupCommit(),
            WarpgroupWait(pending))

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
            y = SharedMatrix(self.shared[self.y.role], self.operand_start(self.y, stage, int32(0), s),
                             self.operand_descriptor(self.y))
            x: SharedMatrix | FragmentRef
            if self.x_registers:
                x = FragmentRef(self.frag_x, registers * self.x_elements + s * elements)
            else:
                x = SharedMatrix(self.shared[self.x.role], self.operand_start(self.x, stage, row0, s),
                                 self.operand_descriptor(self.x))
            return WarpgroupMatrixMultiply(self.row, FragmentRef(self.frag_c, int32(0)), x, y, as_expr(True))
        return self.unrolled("k_step", self.t.bk // self.k_step, k_step)

    # step 6: the epilogue from the D fragment map -----------------------------------------------

    # step 6: the accumulators by the D fragment map: warpgroup g has rows 64g.. (epilogue.py) -----
    def accumulator_lane(self) -> Expr:
        return self.tx % WARPGROUP_SIZE

    def accumulator_lanes(self) -> int:
        return WARPGROUP_SIZE

    def accumulator_tiles(self) -> int | None:
        return None

    def tile_elements(self) -> int:
        return int(lookup(self.row).operand("d").elements)

    def accumulator_position(self, tile: Expr | None, r: Expr, col: Expr) -> tuple[Expr, Expr]:
        return self.warpgroup * 64 + r, col

    def column_groups(self) -> tuple[int, int, Callable[[Expr, Expr], tuple[Expr | None, Expr]]] | None:
        # D's elements 4j .. 4j + 3 are columns 8j + 2·(lane % 4) and the next, at rows r and
        # r + 8: pairs 2j and 2j + 1 share their columns
        elements = self.tile_elements()
        if elements % 4 or any(self.c_map(lane, 4 * j)[1] != self.c_map(lane, 4 * j + 2)[1]
                               for lane in range(WARPGROUP_SIZE) for j in range(elements // 4)):
            return None
        return elements // 4, 2, lambda g, w: (None, (g * 2 + w) * 2)

    def column_sharing(self) -> int:
        # D's columns follow lane % 4 alone: the 8 lanes of a warp 4 apart hold the same ones
        elements = self.tile_elements()
        if any(self.c_map(lane, e)[1] != self.c_map(lane % 4, e)[1]
               for lane in range(WARPGROUP_SIZE) for e in range(0, elements, 2)):
            return 1
        return 8

    def transposed_output(self) -> bool:
        return self.swap


__all__ = ["BLOCK_N", "K_TILE", "TF32_K_TILE", "TF32_WGMMA", "WgmmaKernel", "check_warpgroup_tiling", "checked_wgmma",
           "k_major_views", "swaps_operands", "wgmma_intrinsic"]
