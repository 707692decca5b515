"""tensorize: a contraction stage rebuilt as a tiled tensor-core kernel (mma.sync, ldmatrix, cp.async).

What it matches (by index structure, never by name): a contraction that is a GEMM once its axes
are grouped -- tecc/passes/schedule/implicit_gemm.py finds it and says how each operand element
is found in memory. The stage must still be the kernel lowering made for it (tensorize is its
first primitive):

    for s..:                                    # spatial loops
      acc[0] = 0
      for r..: acc[0] = acc[0] + term           # one or more reduction loops
      C[s..] = epilogue(acc[0])

where `term` is `float32(A[..] * B[..])` (the plain half form `tc.sum(A[i, k] * B[k, j])`) or
`float32(A[..]) * float32(B[..])`, each multiplicand optionally `where(cond, read, 0)`; A and B
are float16 or bfloat16 (the same dtype, the one of the intrinsic) global buffers whose indices
are affine in the loop axes, contiguous or with run-time strides (`strides="any"`: the kernel
then tests the strides at launch and branches between a copy main loop for slices, one for
transposed views -- the tile in the other orientation in the same buffer, the other ldmatrix --
and an element-load main loop, `_Emitter.dispatch`). The spatial axes group into batch (indexing both
operands), rows (only A) and columns (only B, the operand the output's innermost axis indexes);
M, N, K are the groups' extent products. A plain matrix product is the case of single-axis
groups (`A[b.., i, k]`, `B[b.., k, j]`, either orientation); a convolution
(`X[n, p·stride + r·dil - pad, q·stride + s·dil - pad, c]` under a padding `where`, NCHW, 1x1,
grouped, 1-3 spatial dimensions) is the general case: an implicit GEMM, the tile loads gathering
X's elements by div/mod of the row and reduction indices (docs/conv.md). The axes are grouped,
not the loop nest flattened first: the grouping is a view the emitter unflattens where it
addresses an operand (`_Emitter.element`, `implicit_gemm.unflatten`) or the output (step 6), so
no loop-fusion primitive has to rewrite indices, and one matcher serves GEMMs and convolutions.
Anything else is a ScheduleError naming the condition.

Accumulation semantics: the mma multiplies the half operands exactly and accumulates in float32
(the lowered loop's accumulator dtype), rounding once per k16 step. The plain half form lowers to
`float32(A * B)`, a product rounded to half before it is widened; the tensor core does not round
the product, so the tensorized kernel is at least as accurate (products exact, fp32 sums); the
epilogue then rounds once to the output dtype.

What it emits, step by step (each step is one function below):

1. tiling      blocks over (batch → blockIdx.z, row tiles → blockIdx.y, column tiles →
               blockIdx.x), grids by ceil-division (symbolic sizes work); one threadIdx.x loop of
               32·WM_COUNT·WN_COUNT threads, warp = tx // 32 at (warp // WN_COUNT, warp % WN_COUNT);
               each warp owns (BM/WM_COUNT) × (BN/WN_COUNT) = TM × TN mma tiles of 16 × 8, their
               accumulators one fragment buffer of TM·TN·4 floats per lane.
2. staging     each operand's tile is kept in shared memory in its memory orientation (along the
               group it is contiguous in), in a ring of S stages: A as [S][BM][BK] (k-contiguous)
               or [S][BK][BM] (row-contiguous), B as [S][BK][BN] or [S][BN][BK]. A row of W halves
               gets the XOR swizzle that puts the 8 rows one ldmatrix matrix reads in 8 different
               16-byte bank groups (`row_swizzle`). Element (outer, k) of an operand is at the
               operand's own indices with every axis replaced by its unflattened expression,
               predicated by the M/N/K edges and its where() condition. A tile is filled with
               16-byte cp.async copies when implicit_gemm.contiguous_copy proves 8 consecutive
               indices contiguous, aligned and uniformly in or out of range (a plain matrix whose
               contiguous extent is a constant multiple of 8, NHWC activations with C % 8 == 0);
               the predicate zero-fills chunks outside. Runs that are multiples of 4 or 2 only
               get 8- or 4-byte copies (cp.async.ca). Otherwise (odd K, a symbolic contiguous
               extent, C = 3, NCHW activations) the tile's elements are loaded guarded
               (select(in range, x, 0)) into registers when the refill is issued and stored to
               shared after the compute.
3. pipeline    S - 1 stages are loaded before the k loop, one commit group each; iteration kt
               waits until at most S - 2 groups are in flight (stage kt has landed), barriers
               (every thread's copies are visible, and every warp is done with stage kt - 1),
               then refills stage (kt + S - 1) % S = (kt - 1) % S, commits (a group even when
               empty, so "S - 2 most recent" always means the stages after kt), and computes
               stage kt. One barrier per k tile; the emulator proves the ring race-free.
               The pipelined mainloop (Tiling.fragment_pipeline, `pipelined_loop`): two
               fragment sets, k step s in set s % 2 (an even number of steps per tile); while
               the mma of step s run, the ldmatrix of step s + 1 fill the other set; the ring's
               wait (S - 2) and barrier come before the last step, whose next fragments are
               step 0 of tile kt + 1, and tile kt + S is issued right after that barrier into
               stage kt % S (every warp has read all of it by then), so the prologue fills all
               S stages. Element loads are fetched at the top of a tile and stored after the
               barrier. docs/tensor-cores.md draws the loop.
4. fragments   per k16 step: ldmatrix.x4 for a 16 × 16 A tile (`.trans` when A is i-contiguous,
               stored [k][i]), ldmatrix.x4 for two 16 × 8 B tiles (`.trans` when B is
               j-contiguous, stored [k][j]; plain when B is k-contiguous, stored [j][k]).
5. mma         TM × TN mma.sync per k16 step into the accumulators.
6. epilogue    each lane's accumulator elements at (row, col) from the C fragment's layout map,
               guarded by row < M and col < N, the row and column unflattened into their axes,
               stored as the stage's own store with acc[0]
               replaced by the element: bias, activations, residuals, scales and the cast to the
               output dtype fuse as written. Elements 2j, 2j + 1 (adjacent columns) are stored
               together by a vectorize loop where the innermost column extent is even
               (`output_pair`); with Tiling.staged_output the values go to a padded shared tile
               that the block then copies to the output in 16-byte chunks (`finish_output`).

float32 operands (TF32, only with intrinsic "mma.m16n8k8.f32.tf32" named: "auto" refuses them,
since rounding float32 inputs to tf32 is an opt-in, `build(..., allow_tf32=True)`) take the same
steps with 4-byte elements: 16-byte copies of 4 floats, tiles shaped [S][rows/P][P][width] with
`tf32_swizzle` (P rows per swizzle period, so a row block's offset stays outside the XOR), and
in steps 4-5 (`compute_elementwise`) ldmatrix.x4 of b16 pairs for k-contiguous tiles and
conflict-free 32-bit shared loads through the row's layout maps for k-major ones, k steps of 8, and mma.m16n8k8 tf32, whose asm block
rounds each A/B register with cvt.rna.tf32.f32 (docs/tensor-cores.md, "TF32").

On Hopper (intrinsic "wgmma"), tensorize_wgmma.py subclasses this emitter: the same matching,
tiling, ring and epilogue, with steps 4-5 replaced by wgmmas that read 128B-swizzled shared
tiles through descriptors, and the ring kept one stage behind the wgmma group in flight.

Next refactor (not done here): steps 2-3 are a `pipeline(loop, stages)` primitive on loop IR
(staged loads of a k-tile loop → a ring of cp.async groups) and a `swizzle(cache)` primitive;
this file would then keep the matching, the fragment loads, the mma and the epilogue.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from ...ir import dtype as dt
from ...ir.arith import binary
from ...ir.errors import ScheduleError
from ...ir.expr import BufferLoad, Const, Expr, Var, const_int, select, size_product, substitute
from ...ir.intrinsics import lookup
from ...ir.layout import Swizzle
from ...ir.stmt import (
    Allocate,
    AsyncCommit,
    AsyncCopy,
    AsyncWait,
    Barrier,
    Buffer,
    BufferStore,
    For,
    FragmentRef,
    IfThenElse,
    LetStmt,
    MatrixLoad,
    MatrixMultiply,
    PrimFunc,
    Stmt,
    seq,
)
from ...ir.visitor import ExprMutator
from .implicit_gemm import TENSOR_CORE_OPERANDS, Contraction, Operand, match_contraction, unflatten

INTRINSICS = {"float16": "mma.m16n8k16.f32.f16", "bfloat16": "mma.m16n8k16.f32.bf16"}
# float32 operands run on tensor cores only rounded to tf32, which a plan must name: "auto" never
# picks it (docs/tensor-cores.md, "TF32"); the planner does when the build has allow_tf32=True.
TF32 = "mma.m16n8k8.f32.tf32"
OPERAND_DTYPES = {**{row: dtype for dtype, row in INTRINSICS.items()}, TF32: "float32"}
CHUNK = 8  # halves per 16-byte cp.async copy and per ldmatrix row
# element loads per round of dispatch's element-load loop (`load_tile`): a serial loop of rounds
# of this many unrolled loads, so ptxas keeps few loaded elements and addresses live at once
# (all of a 128x32 tile's 32 per thread at once took the kernel to 255 registers on sm_80, from
# 222 with the copy loop alone; rounds of 4, 8 or 16 kept 222; on sm_90, 8 kept 168, 16 170)
DIRECT_LOADS = 8
COPY_BYTES = 16


# ---- fragment loads (shared by every tensor-core kernel) ---------------------------------------

def load_a_fragment(dst: FragmentRef, tile: Buffer, stage: Expr, m0: Expr, k0: Expr, lane: Expr,
                    k_last: bool) -> MatrixLoad:
    """ldmatrix.x4 of the 16 x 16 A tile at rows m0.., k k0.. of ring stage `stage` of `tile` into
    the A fragment `dst`. The four 8 x 8 matrices in register order are (m 0:8, k 0:8),
    (m 8:16, k 0:8), (m 0:8, k 8:16), (m 8:16, k 8:16); lane = 8j + r supplies row r of matrix j.
    `k_last`: the tile is stored [m][k] (plain); otherwise [k][m] (`.trans`)."""
    r, j = lane % 8, lane // 8
    if k_last:
        return MatrixLoad("ldmatrix.x4", dst, tile, (stage, m0 + r + 8 * (j % 2), k0 + 8 * (j // 2)))
    return MatrixLoad("ldmatrix.x4.trans", dst, tile, (stage, k0 + r + 8 * (j // 2), m0 + 8 * (j % 2)))


def load_b_fragments(dst: FragmentRef, tile: Buffer, stage: Expr, n0: Expr, k0: Expr, lane: Expr,
                     k_last: bool) -> MatrixLoad:
    """ldmatrix.x4 of two 16 x 8 B tiles (columns n0..n0+16, k k0..k0+16) of ring stage `stage`
    of `tile` into 8 elements of B fragments at `dst` (the first n8 tile, then the second). The
    matrices are (k 0:8, n 0:8), (k 8:16, n 0:8), (k 0:8, n 8:16), (k 8:16, n 8:16). `k_last`:
    the tile is stored [n][k] and plain ldmatrix gives the "col" B fragment; otherwise [k][n]
    (`.trans`)."""
    r, j = lane % 8, lane // 8
    if k_last:
        return MatrixLoad("ldmatrix.x4", dst, tile, (stage, n0 + r + 8 * (j // 2), k0 + 8 * (j % 2)))
    return MatrixLoad("ldmatrix.x4.trans", dst, tile, (stage, k0 + r + 8 * (j % 2), n0 + 8 * (j // 2)))


# ---- the kernel ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Tiling:
    bm: int
    bn: int
    warps_m: int
    warps_n: int
    bk: int
    stages: int
    staged_output: bool = False   # the epilogue writes the block's outputs through shared memory (step 6)
    # two fragment sets, the next k step's loads issued before this one's mma, the ring's wait and
    # barrier before the last k step of a tile (step 3, "the pipelined mainloop")
    fragment_pipeline: bool = False
    # > 0: one blockIdx.x over the output tiles, numbered in the grouped order of `grouped_tile`
    # (group_m row tiles side by side sweep the column tiles together: L2 reuse); 0: blockIdx.y
    # over row tiles, blockIdx.x over column tiles
    group_m: int = 0

    @property
    def threads(self) -> int:
        return 32 * self.warps_m * self.warps_n

    @property
    def tm(self) -> int:
        return self.bm // self.warps_m // 16

    @property
    def tn(self) -> int:
        return self.bn // self.warps_n // 8


def check_tiling(stage: str, t: Tiling, element_bytes: int = 2) -> None:
    """Refuse a tiling the emitter cannot build for operands of `element_bytes`."""
    where = f"tensorize({stage})"
    chunk = COPY_BYTES // element_bytes
    if t.stages < 2 or t.stages > 8:
        raise ScheduleError(f"{where}: stages must be 2..8 (cp.async.wait_group takes 0..7), got {t.stages}")
    if t.bk % 16 or t.bk < 16:
        raise ScheduleError(f"{where}: k_tile must be a multiple of 16 (the mma's k), got {t.bk}")
    if t.group_m < 0:
        raise ScheduleError(f"{where}: group_m must be 0 (row-major block order) or the row tiles per group, "
                            f"got {t.group_m}")
    if t.warps_m < 1 or t.warps_n < 1 or t.threads > 1024:
        raise ScheduleError(f"{where}: warps {t.warps_m}x{t.warps_n} must be positive and at most 32 in all")
    if t.bm % (16 * t.warps_m) or t.bn % (16 * t.warps_n):
        raise ScheduleError(f"{where}: block {t.bm}x{t.bn} over warps {t.warps_m}x{t.warps_n} must give warp tiles "
                            "that are multiples of 16 x 16 (ldmatrix.x4 loads two 16x8 B tiles)")
    steps = t.bk // (8 if element_bytes == 4 else 16)   # mma k steps per tile (tf32: k8)
    if t.fragment_pipeline and steps % 2:
        raise ScheduleError(f"{where}: fragment_pipeline alternates two fragment sets over the k steps of a tile, "
                            f"so it needs an even number of them; k_tile {t.bk} has {steps}: use a k_tile of twice "
                            "the mma's k or fragment_pipeline=False")
    for rows, width in ((t.bm, t.bk), (t.bk, t.bm), (t.bk, t.bn), (t.bn, t.bk)):
        if (rows * width) % (chunk * t.threads) or width % chunk or _power_of_two(width) is None:
            raise ScheduleError(f"{where}: a {rows}x{width} tile is not a whole number of 16-byte copies per thread "
                                f"for {t.threads} threads (block dimensions and k_tile powers of two >= 16)")


def _power_of_two(n: int) -> int | None:
    return n.bit_length() - 1 if n > 0 and n & (n - 1) == 0 else None


def row_swizzle(width: int) -> Swizzle:
    """The XOR swizzle of a tile with rows of `width` halves: the 16-byte chunk index (base 3)
    XORed with row % 8 (3 bits, shift log2(width) - 3, so the XOR source is the row number), so
    the 8 consecutive rows an ldmatrix matrix reads at one chunk hit 8 different 16-byte bank
    groups. Rows of 32 halves (64 B) pair up in a 128-byte line: there the chunk (2 bits) is
    XORed with (row // 2) % 4, as in tests/test_matrix_gemm.py."""
    w = _power_of_two(width)
    assert w is not None and w >= 4
    bits = min(3, w - 3)
    return Swizzle(bits, 3, max(3, w - 3))


def tf32_swizzle(width: int, k_last: bool) -> Swizzle:
    """The XOR swizzle of a float32 tile with rows of `width` floats for the tf32 fragment loads
    (32-bit shared loads, one element per lane, step 4 of the module docstring).

    k-contiguous ([outer][k], k_last): the 32 lanes of an A or B fragment load read 8 rows (g =
    lane // 4) at 4 consecutive floats (t = lane % 4) of one 16-byte chunk; the chunk index (base
    2: 4 floats) XORed with row % 8 puts the 8 rows in 8 different chunks of the 32 banks. Rows
    of 16 floats (64 B) pair up in a 128-byte line, so there the 2 chunk bits are XORed with
    (row // 2) % 4 (bank = 16·(row % 2) + 4·chunk + t: 32 banks), as row_swizzle does for halves.

    outer-contiguous ([k][outer]): the lanes read 4 rows (k = t) at 8 consecutive floats (g) of
    one 8-aligned 32-byte group; the group index (base 3) XORed with row % 4 (2 bits) puts the 4
    rows in 4 different 8-bank groups. Rows must be at least 32 floats (the XOR source lies
    above the group bits). Both keep 16-byte chunks whole for the cp.async copies."""
    w = _power_of_two(width)
    assert w is not None
    if k_last:
        assert w >= 3
        return Swizzle(min(3, w - 2), 2, max(3, w - 2))
    assert w >= 5
    return Swizzle(2, 3, w - 3)


def tensorize_mma(func: PrimFunc, stage: str, intrinsic: str, tiling: Tiling) -> PrimFunc:
    """`func` (the lowered kernel of `stage`) as an mma.sync tensor-core kernel (module docstring).
    `intrinsic` "auto" or an mma row of the table. (The primitive users call, `tensorize` in
    tensor_core.py, sends "wgmma" to the Hopper kernels.)"""
    # float32 only with the tf32 intrinsic (below); operands with run-time strides: `_Emitter.dispatch`
    c = match_contraction(func, stage, TENSOR_CORE_OPERANDS, run_time_strides=True)
    dtype = c.a.buffer.dtype.name
    check_tiling(stage, tiling, c.a.buffer.dtype.bytes)
    if dtype == "float32":
        if intrinsic != TF32:
            raise ScheduleError(
                f"tensorize({stage}): float32 operands run on tensor cores only rounded to tf32 (10 mantissa bits), "
                f"which a plan must ask for by name: intrinsic={TF32!r} (got {intrinsic!r}); plan='auto' does so "
                "only with build(..., allow_tf32=True)")
        for op in (c.a, c.b):
            outer = tiling.bm if op.role == "A" else tiling.bn
            if not op.k_last and outer < 32:
                raise ScheduleError(f"tensorize({stage}): a float32 {op.role} tile stored k-major needs at least 32 "
                                    f"{'rows' if op.role == 'A' else 'columns'} per block (tf32_swizzle), got {outer}")
        return _Emitter(func, c, intrinsic, tiling).kernel()
    want = INTRINSICS.get(dtype)
    if intrinsic == "auto":
        intrinsic = want or ""
    if intrinsic != want:
        raise ScheduleError(f"tensorize({stage}): intrinsic {intrinsic!r} does not take {dtype} operands; "
                            f"use {want!r} (or 'auto')")
    return _Emitter(func, c, intrinsic, tiling).kernel()


def _int(value: int) -> Expr:
    return Const(value, dt.int32)


def _shape(*dims: int) -> tuple[Expr, ...]:
    return tuple(_int(d) for d in dims)


def _ceil_div(a: Expr, b: int) -> Expr:
    return (a + (b - 1)) // b


def _plus(index: Expr, offset: Expr | int) -> Expr:
    """index + offset, left as it is for the constant offset 0 (the first fragment set)."""
    if isinstance(offset, int) and offset == 0:
        return index
    return index + offset


def grouped_tile(local: Expr, rows: Expr, cols: Expr, group_m: int) -> tuple[Expr, Expr]:
    """(row tile, column tile) of tile number `local` of a rows x cols grid in the grouped order:
    group_m row tiles side by side sweep the column tiles together (column by column, the rows of
    the group fastest), then the next group (the last one may be shorter), so the blocks running
    at one time share A's row panels and B's column panels in L2 (the order of CUTLASS's and
    Triton's grouped GEMM tile schedulers)."""
    group = group_m * cols
    first_row = (local // group) * group_m
    height = binary("min", rows - first_row, _int(group_m))
    inner = local % group
    return first_row + inner % height, inner // height


def _unrolled(name: str, extent: int, body: Callable[[Var], Stmt]) -> Stmt:
    v = Var(name)
    return For(v, _int(0), _int(extent), "unroll", body(v))


class _ReplaceAccumulator(ExprMutator):
    def __init__(self, acc: Buffer, value: Expr) -> None:
        super().__init__()
        self.acc, self.value = acc, value

    def visit_BufferLoad(self, e: BufferLoad) -> Expr:
        if e.buffer is self.acc:
            return self.value
        return self.generic_visit(e)


class _Emitter:
    def __init__(self, func: PrimFunc, c: Contraction, intrinsic: str, t: Tiling) -> None:
        self.func, self.c, self.row, self.t = func, c, intrinsic, t
        # names that meet a parameter's are made distinct by unique_names before codegen
        self.bz, self.by, self.bx = Var("block_batch"), Var("block_row"), Var("block_col")
        self.tx, self.kt = Var("thread"), Var("k_tile")
        self.lane, warp = self.tx % 32, self.tx // 32
        self.warp_m, self.warp_n = warp // t.warps_n, warp % t.warps_n
        self.k_tiles = _ceil_div(c.kext, t.bk)
        self.fragments = self.fragment_buffers()
        # batch indices of this block (several batch axes share blockIdx.z, unflattened)
        self.batch_index: dict[str, Expr] = {}
        rest: Expr = self.bz
        for n, (bv, ext) in enumerate(reversed(c.batch)):
            last = n == len(c.batch) - 1
            self.batch_index[bv.name] = rest if last else rest % ext
            rest = rest // ext
        self.shared = {op.role: self.shared_buffer(op) for op in (c.a, c.b)}
        # the orientation each shared tile is laid out for (the operand as matched); a main loop
        # for transposed views stores the other orientation in the same buffer (`shared_index`)
        self.laid_out = {op.role: op for op in (c.a, c.b)}
        # operands loaded element by element in the main loop being built (`dispatch`): those
        # whose copies need a launch condition, in the main loop for when it fails
        self.element_roles: set[str] = set()
        # registers of the element loads of an operand without 16-byte copies
        self.staged = {op.role: Buffer(f"{op.buffer.name}_staged", op.buffer.dtype,
                                       _shape(self.tile_shape(op)[0] * self.tile_shape(op)[1] // t.threads), "local")
                       for op in (c.a, c.b) if not op.copy}
        self.names: dict[str, int] = {}
        self.out_tile = self.output_tile() if t.staged_output else None

    def fragment_buffers(self) -> tuple[Buffer, ...]:
        """The per-lane fragment buffers (allocated around the kernel body); the accumulators
        are `frag_c`, laid out by `c_map`."""
        t, intrinsic = self.t, self.row
        frag = lookup(intrinsic)
        # elements per lane of one A (16 x k) and one B (k x 8) tile: 8 and 4 halves, 4 and 2 floats
        self.a_elements, self.b_elements = frag.operand("a").elements, frag.operand("b").elements
        sets = 2 if t.fragment_pipeline else 1   # fragment sets (fragment_offsets)
        self.frag_a = Buffer("a_frag", frag.operand("a").dtype, _shape(sets * self.a_elements * t.tm), "fragment",
                             fragment=(intrinsic, "a"))
        self.frag_b = Buffer("b_frag", frag.operand("b").dtype, _shape(sets * self.b_elements * t.tn), "fragment",
                             fragment=(intrinsic, "b"))
        self.frag_c = Buffer("acc", dt.float32, _shape(4 * t.tm * t.tn), "fragment",
                             fragment=(intrinsic, "c"))
        self.c_map = frag.operand("c").layout
        return self.frag_a, self.frag_b, self.frag_c

    def unrolled(self, name: str, extent: int, body: Callable[[Var], Stmt]) -> Stmt:
        """An unrolled loop whose variable is named uniquely in the kernel (primitives address
        loops by name): the second `copy_a` loop is `copy_a1`."""
        n = self.names.get(name, 0)
        self.names[name] = n + 1
        return _unrolled(name if n == 0 else f"{name}{n}", extent, body)

    # step 1: tiling ------------------------------------------------------------------------------
    def kernel(self) -> PrimFunc:
        c, t = self.c, self.t
        allocs = self.dispatch()
        out_tile = () if self.out_tile is None else (self.out_tile,)
        for buf in (self.shared["A"], self.shared["B"], *out_tile, *self.staged.values(), *self.fragments):
            allocs = Allocate(buf, allocs)
        if t.group_m:
            # one blockIdx.x over every output tile, bound to (block_row, block_col) in the grouped order
            rows, cols = _ceil_div(c.m, t.bm), _ceil_div(c.n, t.bn)
            tile = Var("block_tile")
            row, col = grouped_tile(tile, rows, cols, t.group_m)
            body: Stmt = For(self.tx, _int(0), _int(t.threads), "threadIdx.x",
                             LetStmt(self.by, row, LetStmt(self.bx, col, allocs)))
            body = For(tile, _int(0), rows * cols, "blockIdx.x", body)
        else:
            body = For(self.tx, _int(0), _int(t.threads), "threadIdx.x", allocs)
            body = For(self.bx, _int(0), _ceil_div(c.n, t.bn), "blockIdx.x", body)
            body = For(self.by, _int(0), _ceil_div(c.m, t.bm), "blockIdx.y", body)
        if c.batch:
            body = For(self.bz, _int(0), size_product([ext for _, ext in c.batch]), "blockIdx.z", body)
        return PrimFunc(self.func.name, self.func.params, body, self.func.attrs + (("tensorize", self.summary()),))

    def summary(self) -> str:
        """What the kernel is, for its `tensorize` attribute (shown in dumps and explain)."""
        t = self.t
        form = " fragment_pipeline" if t.fragment_pipeline else ""
        form += f" group_m {t.group_m}" if t.group_m else ""
        return (f"{self.row} block {t.bm}x{t.bn} warps {t.warps_m}x{t.warps_n} k_tile {t.bk} stages {t.stages}{form}"
                f"{self.dispatch_summary()}")

    def launch_condition(self) -> Expr | None:
        """The condition on run-time strides under which every operand's copies as matched are
        correct (implicit_gemm.stride_condition), or None when they always are."""
        conds = [op.assumes for op in (self.c.a, self.c.b) if op.copy and op.assumes is not None]
        if not conds:
            return None
        return conds[0] & conds[1] if len(conds) == 2 else conds[0]

    def transposes(self) -> bool:
        """Whether this emitter builds main loops for transposed views (`copy_forms`): 16-bit
        tiles of [S][rows][width], read by ldmatrix with or without .trans. tf32 has no .trans
        (its k-major fragments are 32-bit loads through a layout of its own), so a transposed
        view of a float32 operand takes the element loop."""
        return self.row in INTRINSICS.values()

    def copy_forms(self) -> list[tuple[str, list[tuple[Operand, Expr]]]]:
        """Per operand with run-time strides that has copies under some launch condition, its
        copy forms: (the operand in the orientation the loop stores it, the condition), the
        matched orientation first (a slice of a wider row-major array: unit innermost stride),
        then the transposed one (`Operand.transposed`: unit stride on another dimension, e.g.
        w.t())."""
        out: list[tuple[str, list[tuple[Operand, Expr]]]] = []
        for op in (self.c.a, self.c.b):
            forms: list[tuple[Operand, Expr]] = []
            if op.copy and op.assumes is not None:
                forms.append((op, op.assumes))
            alt = op.transposed
            if alt is not None and alt.assumes is not None and self.transposes():
                forms.append((alt, alt.assumes))
            if forms:
                out.append((op.role, forms))
        return out

    def dispatch_summary(self) -> str:
        """The launch-time choice between the main loops, for the summary ('' when there is none)."""
        forms = self.copy_forms()
        if not forms:
            return ""
        parts = []
        for role, choices in forms:
            name = self.laid_out[role].buffer.name
            said = []
            for op, cond in choices:
                kind = "cp.async copies" if op is self.laid_out[role] else "transposed-view cp.async copies"
                said.append(f"{kind} when {cond}")
            parts.append(f"{name}: {', '.join(said)}")
        both = ", every combination a main loop" if len(forms) == 2 else ""
        return (f"; run-time strides of {'; '.join(parts)}{both}, else element loads "
                "(a uniform branch at launch)")

    def dispatch(self) -> Stmt:
        """The kernel's main loop (`pipeline`, through the epilogue). An operand with run-time
        strides has copies only under a launch condition (implicit_gemm.stride_condition): unit
        innermost stride, the others multiples of the copy -- a slice of a wider row-major
        array --, or (`Operand.transposed`) unit stride on another dimension -- a transposed
        view, whose copies run along the rows and whose tile is stored in the other orientation
        in the same shared buffer (`shared_index`) and read with the other ldmatrix (.trans or
        not). The kernel holds one main loop per combination of the operands' copy forms (1, 2,
        or 4 with two strided operands), then one that loads those operands element by element
        (always correct, any strides), and branches on the conditions, first true wins. They
        read kernel parameters only, so every thread takes the same side: no divergence, one test
        per launch. ptxas allocates registers for the largest of the loops; the element loop's
        loads go straight to shared memory (`load_tile`), so that is the copy loops' count."""
        forms = self.copy_forms()
        if not forms:
            return self.pipeline()
        combos: list[list[tuple[Operand, Expr]]] = [[]]
        for _, choices in forms:
            combos = [done + [choice] for done in combos for choice in choices]
        loops: list[tuple[Expr, Stmt]] = []
        matched = self.c
        for n, combo in enumerate(combos):
            c = matched
            cond: Expr | None = None
            for op, test in combo:
                c = replace(c, a=op) if op.role == "A" else replace(c, b=op)
                cond = test if cond is None else cond & test
            assert cond is not None
            if n:
                self.kt = Var(self.kt.name, self.kt.dtype)   # each loop binds a variable of its own
            self.c = c
            try:
                loops.append((cond, self.pipeline()))
            finally:
                self.c = matched
        self.element_roles = {op.role for op in (matched.a, matched.b) if op.assumes is not None}
        self.kt = Var(self.kt.name, self.kt.dtype)
        try:
            body = self.pipeline()
        finally:
            self.element_roles = set()
        for cond, loop in reversed(loops):
            body = IfThenElse(cond, loop, body)
        return body

    # step 2: staging + layout ---------------------------------------------------------------------
    def tile_shape(self, op: Operand) -> tuple[int, int]:
        """(rows, width) of the operand's tile in its global orientation."""
        outer = self.t.bm if op.role == "A" else self.t.bn
        return (outer, self.t.bk) if op.k_last else (self.t.bk, outer)

    def shared_buffer(self, op: Operand) -> Buffer:
        rows, width = self.tile_shape(op)
        if self.row == TF32:
            # [S][rows / P][P][width], P rows per swizzle period: the stride of the second axis is
            # a whole period, so codegen keeps a row block's offset outside the XOR (like the
            # stage's) and the fragment loads' swizzled addresses are invariant in the k loop
            layout = tf32_swizzle(width, op.k_last)
            per = layout.period // width
            shape = _shape(self.t.stages, rows // per, per, width)
        else:
            layout, shape = row_swizzle(width), _shape(self.t.stages, rows, width)
        return Buffer(f"{op.buffer.name}_shared", op.buffer.dtype, shape, "shared",
                      tensor=f"{op.buffer.tensor}.shared", layout=layout)

    def period_rows(self, op: Operand) -> int | None:
        """P of a [S][rows / P][P][width] tile (tf32), None for [S][rows][width]."""
        buf = self.shared[op.role]
        return const_int(buf.shape[2]) if len(buf.shape) == 4 else None

    def shared_index(self, op: Operand, stage: Expr, r: Expr, col: Expr) -> tuple[Expr, ...]:
        """The shared-buffer indices of element (r, col) of the operand's tile (its global
        orientation) in ring stage `stage`.

        A tile stored in the other orientation than its buffer is laid out for (a transposed
        view's main loop, `dispatch`): a R' x W' tile in the buffer of a W' x R' one, seen through
        the buffer's [W'][R'] rows as a flat offset. Its 8-element (16-byte) chunks go column-chunk
        major, the 8 rows r..r+7 of one column chunk c (what an ldmatrix phase reads) one 128-byte
        line -- line c·(R' / 8) + r // 8 --, row r in slot (r % 8) ^ (c % (8 / p))·p of it, p the
        rows a phase of 8 copies covers (the copies go row-major, 16 bytes each, as for a tile in
        the buffer's own orientation: `load_tile`; p = 8 / min(8, chunks per row)): the 8 copies
        of a phase (p rows by 8 / p consecutive chunks) land in 8 different slots, and so do an
        ldmatrix phase's 8 rows. The buffer's row_swizzle XORs the slot with bits of the line
        number; the offset is given pre-swizzled (the swizzle is an involution that keeps the
        line), so the slot above is the physical one. A chunk stays 16 contiguous bytes."""
        per = self.period_rows(op)
        if per is not None:
            return stage, r // per, r % per, col
        if op.k_last != self.laid_out[op.role].k_last:
            rows, own_width = self.tile_shape(op)
            width = self.tile_shape(self.laid_out[op.role])[1]
            line_elements = 8 * CHUNK
            p = 8 // min(8, own_width // CHUNK)
            chunk = col // CHUNK
            slot = (r % 8) ^ ((chunk % (8 // p)) * p)
            flat = (chunk * (rows // 8) + r // 8) * line_elements + slot * CHUNK + col % CHUNK
            layout = self.shared[op.role].layout
            if layout is not None:
                flat = layout.apply(flat)
            return stage, flat // width, flat % width
        return stage, r, col

    def matrix_load(self, op: Operand, load: MatrixLoad) -> MatrixLoad:
        """An ldmatrix of `op`'s tile whose row starts are given in the tile's orientation, at
        the buffer's indices (`shared_index`)."""
        if op.k_last == self.laid_out[op.role].k_last:
            return load
        stage, r, col = load.src_indices
        return MatrixLoad(load.intrinsic, load.dst, load.src, self.shared_index(op, stage, r, col))

    def asynchronous(self, op: Operand) -> bool:
        """Whether the main loop being built copies the operand with cp.async (`dispatch`)."""
        return op.copy > 0 and op.role not in self.element_roles

    def element(self, op: Operand, outer: Expr, k: Expr) -> tuple[tuple[Expr, ...], Expr | None]:
        """The operand's global indices of GEMM element (outer, k) -- the row (A) or column (B) and
        the reduction index, unflattened into the loop axes (implicit_gemm.Operand.at) -- and its
        where() predicate (None: none)."""
        c = self.c
        values: dict[Var, Expr] = {v: self.batch_index[v.name] for v, _ in c.batch}
        values.update(unflatten(c.rows if op.role == "A" else c.cols, outer))
        values.update(unflatten(c.ks, k))
        return op.at(values)

    def load_tile(self, op: Operand, stage: Expr, k0: Expr) -> tuple[Stmt, Stmt | None]:
        """The operand's tile for k tile k0 into ring stage `stage`, zero past the edges: (issue,
        finish). cp.async copies are all issue; element loads are issued into registers and
        finished (stored to shared) after the compute, so their latency overlaps it too."""
        c, t = self.c, self.t
        rows, width = self.tile_shape(op)
        outer0 = self.by * t.bm if op.role == "A" else self.bx * t.bn
        outer_ext = c.m if op.role == "A" else c.n
        row0, row_ext, col0, col_ext = ((outer0, outer_ext, k0, c.kext) if op.k_last
                                        else (k0, c.kext, outer0, outer_ext))
        dst = self.shared[op.role]

        def address(r: Expr, col: Expr) -> tuple[tuple[Expr, ...], Expr]:
            # tile element (r, col) in the tile's orientation: in range of the GEMM and of the
            # operand's where() condition (padding)
            inside = (row0 + r < row_ext) & (col0 + col < col_ext)
            outer, k = (row0 + r, col0 + col) if op.k_last else (col0 + col, row0 + r)
            indices, pad = self.element(op, outer, k)
            return indices, inside if pad is None else inside & pad
        size = op.copy if self.asynchronous(op) else 0
        if size:
            per_row = width // size
            nbytes = size * op.buffer.dtype.bytes

            def copy(u: Var) -> Stmt:
                chunk = self.tx + t.threads * u
                r, col = chunk // per_row, (chunk % per_row) * size
                indices, inside = address(r, col)
                # an operand with run-time strides is copied only in dispatch's main loop that
                # runs when its strides were tested (a unit stride along the copy among them)
                return AsyncCopy(dst, self.shared_index(op, stage, r, col), op.buffer, indices, nbytes, inside,
                                 "cg" if nbytes == 16 else "ca", op.assumes is not None, op.along)
            return self.unrolled(f"copy_{op.role.lower()}", rows * width // size // t.threads, copy), None
        count = rows * width // t.threads
        if op.role in self.element_roles:
            # dispatch's loop for strides the launch test refused: each element is loaded and
            # stored to its ring stage at once, where the element loads' registers would be
            # stored (after the compute: the stage is free then, and on Hopper the next k tile's
            # proxy fence publishes the stores to wgmma before any wgmma reads the buffer), in
            # rounds of DIRECT_LOADS, so no register holds one across the compute and ptxas's
            # allocation for the kernel stays the copy loop's; the loads' latency is exposed
            # per round instead
            group = min(count, DIRECT_LOADS)
            while count % group:
                group //= 2

            def rounds(g: Var) -> Stmt:
                def direct(u: Var) -> Stmt:
                    e = self.tx + t.threads * (g * group + u)
                    indices, inside = address(e // width, e % width)
                    value = select(inside, op.buffer[indices], Const(0.0, op.buffer.dtype))
                    return BufferStore(dst, self.shared_index(op, stage, e // width, e % width), value)
                return self.unrolled(f"load_{op.role.lower()}", group, direct)
            n = self.names.get("load_round", 0)
            self.names["load_round"] = n + 1
            g = Var("load_round" if n == 0 else f"load_round{n}")
            return seq(), For(g, _int(0), _int(count // group), "serial", rounds(g))
        staged = self.staged[op.role]

        def fetch(u: Var) -> Stmt:
            e = self.tx + t.threads * u
            indices, inside = address(e // width, e % width)
            value = select(inside, op.buffer[indices], Const(0.0, op.buffer.dtype))
            return BufferStore(staged, (u,), value)

        def store(u: Var) -> Stmt:
            e = self.tx + t.threads * u
            return BufferStore(dst, self.shared_index(op, stage, e // width, e % width), staged[u])
        return (self.unrolled(f"fetch_{op.role.lower()}", count, fetch),
                self.unrolled(f"store_{op.role.lower()}", count, store))

    def load_stage(self, stage: Expr, k_tile: Expr) -> tuple[Stmt, Stmt | None]:
        k0 = k_tile * self.t.bk
        (issue_a, finish_a), (issue_b, finish_b) = (self.load_tile(self.c.a, stage, k0),
                                                    self.load_tile(self.c.b, stage, k0))
        finish = seq(finish_a, finish_b) if finish_a is not None or finish_b is not None else None
        return seq(issue_a, issue_b), finish

    # step 3: the pipeline ring ---------------------------------------------------------------------
    def ring_prologue(self, tiles: int) -> list[Stmt]:
        """The ring's fill before the k loop: tiles 0 .. `tiles` - 1 into stages of the same
        number, one commit group per tile even when K has fewer (a tile past a known K is not
        loaded; with a symbolic K each load is guarded), so the loop's wait counts stay uniform."""
        known = const_int(self.k_tiles)
        prologue: list[Stmt] = []
        for s in range(tiles):
            issue, finish = self.load_stage(Const(s, dt.int32), Const(s, dt.int32))
            load = seq(issue, finish)
            if known is None:
                prologue.append(IfThenElse(Const(s, dt.int32) < self.k_tiles, load))
            elif s < known:
                prologue.append(load)
            prologue.append(AsyncCommit())
        return prologue

    def pipeline(self) -> Stmt:
        t = self.t
        if t.fragment_pipeline:
            return self.pipelined_loop()
        zero = self.unrolled("zero", 4 * t.tm * t.tn, lambda z: BufferStore(self.frag_c, (z,), Const(0.0, dt.float32)))
        prologue = self.ring_prologue(t.stages - 1)
        ahead = self.kt + (t.stages - 1)
        issue, finish = self.load_stage(ahead % t.stages, ahead)
        loop = For(self.kt, _int(0), self.k_tiles, "serial", seq(
            AsyncWait(t.stages - 2),   # stage kt has landed (at most S - 2 later groups in flight)
            Barrier(),                 # ... for every thread, and every warp is done with stage kt - 1
            IfThenElse(ahead < self.k_tiles, issue),
            AsyncCommit(),             # possibly empty, so the group count per iteration is fixed
            self.compute(self.kt % t.stages),
            # element loads land in stage kt - 1 (free since the barrier) after the compute
            IfThenElse(ahead < self.k_tiles, finish) if finish is not None else None,
        ))
        return seq(zero, *prologue, loop, AsyncWait(0), self.epilogue())

    def pipelined_loop(self) -> Stmt:
        """Step 3 with the fragments pipelined across the k-tile boundary (Tiling.fragment_pipeline;
        module docstring, "the pipelined mainloop"). Two fragment sets alternate over the k steps
        (an even number per tile, so step s of every tile uses set s % 2): while the mma of step
        s run, the ldmatrix of step s + 1 fill the other set. The last step's next fragments are
        step 0 of tile kt + 1, so the ring's wait and barrier come before the last step's loads
        (covered by the mma of the step before and the last step's own), and tile kt + S is
        issued into stage kt % S right after that barrier: every warp has read its last
        fragments of tile kt by then. The prologue thus fills all S stages (tiles 0..S-1), and
        before the last step of tile kt the S + kt groups committed leave at most S - 2 in
        flight once tile kt + 1 has landed."""
        t = self.t
        zero = self.unrolled("zero", 4 * t.tm * t.tn, lambda z: BufferStore(self.frag_c, (z,), Const(0.0, dt.float32)))
        prologue = self.ring_prologue(t.stages)
        steps = self.k_steps()
        first = seq(AsyncWait(t.stages - 1), Barrier(),   # tile 0 has landed, for every thread
                    self.fragment_loads(Const(0, dt.int32), Const(0, dt.int32), 0))
        ahead = self.kt + t.stages
        stage = self.kt % t.stages
        # cp.async copies are issued after the barrier; element loads are fetched into registers
        # at the top of the tile and stored to the freed stage after the barrier, so their
        # latency overlaps the first steps' mma
        copies: list[Stmt] = []
        fetches: list[Stmt] = []
        stores: list[Stmt] = []
        for op in (self.c.a, self.c.b):
            first_part, store = self.load_tile(op, stage, ahead * t.bk)
            if store is None:
                copies.append(first_part)
            else:
                fetches.append(first_part)
                stores.append(store)
        refill = seq(*copies) if copies else None
        fetch = seq(*fetches) if fetches else None
        store_fetched = seq(*stores) if stores else None

        def step(kk: Var) -> Stmt:
            return seq(self.fragment_loads(stage, kk + 1, (kk + 1) % 2), self.mmas(kk % 2))
        fetched = IfThenElse(ahead < self.k_tiles, fetch) if fetch is not None else None
        inner = self.unrolled("k_step", steps - 1, step) if steps > 1 else None
        # the next tile's step 0 reads stage (kt + 1) % S, which no copy has written when K has
        # fewer than S tiles (an uninitialized read): load it only for a next tile then, and
        # always when K has S tiles or more (the last tile then reads a stale stage, unused)
        following = self.fragment_loads((self.kt + 1) % t.stages, Const(0, dt.int32), 0)
        known = const_int(self.k_tiles)
        if known is None or known < t.stages:
            following = IfThenElse(self.kt + 1 < self.k_tiles, following)
        last = seq(
            AsyncWait(t.stages - 2),   # tile kt + 1 has landed (at most S - 2 later groups in flight)
            Barrier(),                 # ... for every thread, and every warp is done with stage kt
            IfThenElse(ahead < self.k_tiles, refill) if refill is not None else None,
            AsyncCommit(),             # possibly empty, so the group count per tile is fixed
            IfThenElse(ahead < self.k_tiles, store_fetched) if store_fetched is not None else None,
            following,
            self.mmas((steps - 1) % 2),
        )
        loop = For(self.kt, _int(0), self.k_tiles, "serial", seq(fetched, inner, last))
        return seq(zero, *prologue, first, loop, AsyncWait(0), self.epilogue())

    # steps 4 and 5: fragment loads and mma ------------------------------------------------------------
    def k_steps(self) -> int:
        """mma k steps per k tile (k16, or k8 for tf32)."""
        return self.t.bk // lookup(self.row).shape[2]

    def compute(self, stage: Expr) -> Stmt:
        """One k tile of ring stage `stage`: per k step its fragment loads, then its mma (the
        single fragment set; the pipelined form is `pipelined_loop`)."""
        return self.unrolled("k_step", self.k_steps(),
                             lambda kk: seq(self.fragment_loads(stage, kk, 0), self.mmas(0)))

    def fragment_offsets(self, buffer: Expr | int) -> tuple[Expr | int, Expr | int]:
        """The first A and B fragment element of fragment set `buffer` (0 or 1; the pipelined
        mainloop keeps two sets of TM A and TN B fragments)."""
        if isinstance(buffer, int) and buffer == 0:
            return 0, 0
        return buffer * (self.a_elements * self.t.tm), buffer * (self.b_elements * self.t.tn)

    def mmas(self, buffer: Expr | int) -> Stmt:
        """Step 5: the TM x TN mma of one k step from fragment set `buffer`."""
        t = self.t
        a0, b0 = self.fragment_offsets(buffer)

        def mma(mi: Var) -> Stmt:
            def one(ni: Var) -> Stmt:
                acc = FragmentRef(self.frag_c, (mi * t.tn + ni) * 4)
                return MatrixMultiply(self.row, acc, FragmentRef(self.frag_a, _plus(self.a_elements * mi, a0)),
                                      FragmentRef(self.frag_b, _plus(self.b_elements * ni, b0)), acc)
            return self.unrolled("mma_n", t.tn, one)
        return self.unrolled("mma_m", t.tm, mma)

    def fragment_loads(self, stage: Expr, kk: Expr, buffer: Expr | int) -> Stmt:
        """Step 4: the A and B fragments of k step `kk` of ring stage `stage` into fragment set
        `buffer`."""
        if self.row == TF32:
            return self.fragment_loads_elementwise(stage, kk, buffer)
        t, c = self.t, self.c
        wm, wn = t.bm // t.warps_m, t.bn // t.warps_n
        k0 = kk * 16
        a0, b0 = self.fragment_offsets(buffer)

        def load_a(mi: Var) -> Stmt:
            return self.matrix_load(c.a, load_a_fragment(FragmentRef(self.frag_a, _plus(8 * mi, a0)), self.shared["A"],
                                                         stage, self.warp_m * wm + mi * 16, k0, self.lane, c.a.k_last))

        def load_b(nj: Var) -> Stmt:
            return self.matrix_load(c.b, load_b_fragments(FragmentRef(self.frag_b, _plus(8 * nj, b0)), self.shared["B"],
                                                          stage, self.warp_n * wn + nj * 16, k0, self.lane, c.b.k_last))

        return seq(self.unrolled("frag_m", t.tm, load_a), self.unrolled("frag_n", t.tn // 2, load_b))

    def fragment_loads_elementwise(self, stage: Expr, kk: Expr, buffer: Expr | int) -> Stmt:
        """Step 4 for tf32 (float32 tiles): a k-contiguous tile ([m][k] A, [n][k] B) is read
        with ldmatrix.x4 moving 32-bit elements as b16 pairs (MatrixLoad's docstring: each lane
        gets float (lane % 4) of row (lane // 4) of each matrix, exactly the m16n8k8 tf32 A
        fragment of four 8 x 4 matrices, or b0, b1 of two n8 B tiles); a k-major tile, where
        .trans would split floats across lanes, with one conflict-free 32-bit shared load per
        fragment element at the (row, col) of the row's layout maps (tf32_swizzle serves both).
        The mma converts A and B to tf32 (`cvt.rna.tf32.f32`, the row's operand conversion) as
        it reads them; ptxas keeps one conversion per loaded register."""
        t, c = self.t, self.c
        wm, wn = t.bm // t.warps_m, t.bn // t.warps_n
        row = lookup(self.row)
        kdim = row.shape[2]
        a0, b0 = self.fragment_offsets(buffer)

        def element(op: Operand, e: int, warp: Expr, warp_size: int, step: Var, step_size: int) -> Expr:
            """Fragment element e of the operand from its shared tile: the map's (outer, k) is
            the warp's base warp·warp_size + step·step_size (outer) and kk·kdim (k) plus the
            map's lane-independent part plus the lane's part. The tile's row splits into its
            period block (whole periods: outside the XOR) and the lane's row inside the block,
            which needs the bases to be multiples of P and the lane's part below P (checked on the
            map for every lane), so no division is emitted."""
            role = op.role.lower()
            layout = row.operand(role).layout
            per = self.period_rows(op)
            assert per is not None and warp_size % per == 0 and step_size % per == 0 and kdim % per == 0

            def outer_k(lane: Any, el: Any) -> tuple[Any, Any]:
                at = layout(lane, el)
                return (at[0], at[1]) if role == "a" else (at[1], at[0])
            base_outer, base_k = outer_k(0, e)
            row_of = 0 if op.k_last else 1   # which of (outer, k) is the tile's row
            for lane in range(32):           # separable, the lane's row part inside one block
                whole, part = outer_k(lane, e), outer_k(lane, 0)
                assert whole == (part[0] + base_outer, part[1] + base_k) and 0 <= part[row_of] < per
            lane_outer, lane_k = outer_k(self.lane, 0)
            if op.k_last:
                assert base_outer % per == 0
                block = warp * (warp_size // per) + step * (step_size // per) + base_outer // per
                return self.shared[op.role][stage, block, lane_outer, kk * kdim + base_k + lane_k]
            assert base_k % per == 0
            block = kk * (kdim // per) + base_k // per
            return self.shared[op.role][stage, block, lane_k, warp * warp_size + step * step_size + base_outer + lane_outer]

        r8, j = self.lane % 8, self.lane // 8   # an ldmatrix.x4: lane supplies row r8 of matrix j

        def load_a(mi: Var) -> Stmt:
            if c.a.k_last:
                # x4 of 4-float rows, matrices (m 0:8, k 0:4), (m 8:16, k 0:4), (m 0:8, k 4:8),
                # (m 8:16, k 4:8): registers a0..a3 of the m16n8k8 tf32 A fragment
                per = self.period_rows(c.a)
                assert per == 8
                block = self.warp_m * (wm // 8) + mi * 2 + j % 2
                return MatrixLoad("ldmatrix.x4", FragmentRef(self.frag_a, _plus(self.a_elements * mi, a0)), self.shared["A"],
                                  (stage, block, r8, kk * kdim + 4 * (j // 2)))
            return seq(*(BufferStore(self.frag_a, (_plus(mi * self.a_elements + e, a0),),
                                     element(c.a, e, self.warp_m, wm, mi, 16))
                         for e in range(self.a_elements)))

        def load_b(ni: Var) -> Stmt:
            return seq(*(BufferStore(self.frag_b, (_plus(ni * self.b_elements + e, b0),),
                                     element(c.b, e, self.warp_n, wn, ni, 8))
                         for e in range(self.b_elements)))

        def load_b_pair(nj: Var) -> Stmt:
            # x4 of 4-float rows of the [n][k] tile, matrices (n 0:8, k 0:4), (n 0:8, k 4:8),
            # (n 8:16, k 0:4), (n 8:16, k 4:8): b0, b1 of two n8 tiles
            per = self.period_rows(c.b)
            assert per == 8
            block = self.warp_n * (wn // 8) + nj * 2 + j // 2
            return MatrixLoad("ldmatrix.x4", FragmentRef(self.frag_b, _plus(2 * self.b_elements * nj, b0)), self.shared["B"],
                              (stage, block, r8, kk * kdim + 4 * (j % 2)))

        loads_b = (self.unrolled("frag_n", t.tn // 2, load_b_pair) if c.b.k_last
                   else self.unrolled("frag_n", t.tn, load_b))
        return seq(self.unrolled("frag_m", t.tm, load_a), loads_b)

    # step 6: the epilogue ---------------------------------------------------------------------------
    def epilogue(self) -> Stmt:
        t = self.t
        wm, wn = t.bm // t.warps_m, t.bn // t.warps_n

        paired = self.pairs_columns(32, 4)

        def tile(q: Var) -> Stmt:
            mi, ni = q // t.tn, q % t.tn

            def element(e: Expr) -> Stmt:
                r, col = self.c_map(self.lane, e)
                row = self.warp_m * wm + mi * 16 + r
                column = self.warp_n * wn + ni * 8 + col
                if paired:
                    return self.output_pair(row, column, q * 4 + e)
                return self.output(row, column, self.frag_c[q * 4 + e])
            if paired:
                return self.unrolled("out_e", 2, lambda p: element(p * 2))
            return self.unrolled("out_e", 4, element)
        return self.finish_output(self.unrolled("out_tile", t.tm * t.tn, tile))

    def pairs_columns(self, lanes: int, elements: int) -> bool:
        """Whether the epilogue stores two adjacent columns per statement (`output_pair`): the
        accumulator layout keeps elements 2j, 2j + 1 of every lane at (row, col), (row, col + 1)
        with col even (mma.sync's C and wgmma's D fragments do: PTX ISA, "Matrix fragments"),
        and the innermost column axis has a constant even extent, so an even column and the
        next one unflatten to the same outer axes and are both in range or both out."""
        inner = const_int(self.c.cols[-1][1])
        if inner is None or inner % 2:
            return False
        for lane in range(lanes):
            for j in range(elements // 2):
                (r0, c0), (r1, c1) = self.c_map(lane, 2 * j), self.c_map(lane, 2 * j + 1)
                if r0 != r1 or c1 != c0 + 1 or c0 % 2:
                    return False
        return True

    def output(self, row_in_block: Expr, column_in_block: Expr, element: Expr) -> Stmt:
        """The stage's own store of output (row, column) -- the block's row_in_block,
        column_in_block --, guarded by row < M and column < N, with the accumulator replaced by
        `element`: the epilogue fuses as written. With a staged output the value goes to the
        block's output tile in shared memory instead (`finish_output` stores it)."""
        c = self.c
        store = c.store
        row, column = self.by * self.t.bm + row_in_block, self.bx * self.t.bn + column_in_block
        values: dict[Var, Expr] = {v: self.batch_index[v.name] for v, _ in c.batch}
        values.update(unflatten(c.rows, row))      # the row and column unflattened into their axes
        values.update(unflatten(c.cols, column))
        value = _ReplaceAccumulator(c.acc, element).visit(store.value)
        value = substitute(value, values)
        if self.out_tile is not None:
            target = BufferStore(self.out_tile, (row_in_block, column_in_block), value)
        else:
            target = BufferStore(store.buffer, tuple(substitute(ix, values) for ix in store.indices), value)
        return IfThenElse((row < c.m) & (column < c.n), target)

    # step 6 with a staged output: the block's outputs through shared memory -------------------------
    def output_tile(self) -> Buffer:
        """The block's BM x BN outputs in shared memory, rows padded by 16 bytes (consecutive
        rows start 4 banks apart, so a warp's paired stores of 8 rows x 4 lanes hit 32 banks),
        or a ScheduleError when the output cannot be copied out in 16-byte chunks."""
        c, t = self.c, self.t
        where = f"tensorize({c.store.buffer.tensor or c.store.buffer.name}, staged_output)"
        out = c.store.buffer
        chunk = 16 // out.dtype.bytes
        (j, extent), = c.cols if len(c.cols) == 1 else ((None, None),)
        n = const_int(extent) if extent is not None else None
        if j is None or n is None or n % chunk:
            raise ScheduleError(f"{where}: the output is copied out in 16-byte chunks along one column axis of a "
                                f"constant extent that is a multiple of {chunk}; the columns here are "
                                f"{', '.join(f'{v.name} ({e})' for v, e in c.cols)}: use staged_output=False")
        if out.strides is not None or not (isinstance(c.store.indices[-1], Var) and c.store.indices[-1] is j):
            raise ScheduleError(f"{where}: the output {out.name} must be contiguous along its column axis {j.name} "
                                "(its innermost index): use staged_output=False")
        if (t.bm * t.bn // chunk) % t.threads:
            raise ScheduleError(f"{where}: a {t.bm}x{t.bn} output tile is not a whole number of 16-byte chunks per "
                                f"thread for {t.threads} threads")
        return Buffer(f"{out.name}_out", out.dtype, _shape(t.bm, t.bn + chunk), "shared",
                      tensor=f"{out.tensor}.out")

    def finish_output(self, stores: Stmt) -> Stmt:
        """The epilogue's statements, then, with a staged output, a barrier and the copy of the
        block's tile to the output: thread tx copies 16-byte chunks tx, tx + threads, ... in row
        order (a warp stores whole 128-byte lines of consecutive rows), each guarded by its row
        and its column (N is a multiple of the chunk) and addressed through the output's own
        indices with the row unflattened and the column axis at column .. column + chunk - 1
        (a `vectorize` loop: one 16-byte store, one 16-byte shared load)."""
        if self.out_tile is None:
            return stores
        c, t = self.c, self.t
        store, tile = c.store, self.out_tile
        chunk = 16 // tile.dtype.bytes
        per_row = t.bn // chunk
        j = c.cols[0][0]

        def piece(i: Var) -> Stmt:
            index = self.tx + i * t.threads
            r, col = index // per_row, index % per_row * chunk
            row, column = self.by * t.bm + r, self.bx * t.bn + col
            lane = Var("out_copy_v" if i.name == "out_copy" else f"{i.name}_v")
            values: dict[Var, Expr] = {v: self.batch_index[v.name] for v, _ in c.batch}
            values.update(unflatten(c.rows, row))
            values[j] = column + lane
            indices = tuple(substitute(ix, values) for ix in store.indices)
            body = IfThenElse((row < c.m) & (column < c.n),
                              BufferStore(store.buffer, indices, BufferLoad(tile, (r, col + lane))))
            return For(lane, _int(0), _int(chunk), "vectorize", body)
        copy = self.unrolled("out_copy", t.bm * t.bn // chunk // t.threads, piece)
        return seq(stores, Barrier(), copy)

    def output_pair(self, row_in_block: Expr, column_in_block: Expr, first: Expr) -> Stmt:
        """Outputs (row, column) and (row, column + 1) from accumulator elements `first` and
        `first` + 1, column even (`pairs_columns`): a `vectorize` loop of 2 over the innermost
        column axis, so where the output is contiguous along it codegen stores both with one
        4-byte (half2) or 8-byte (float2) store instead of two scalar ones -- a warp's store then
        covers whole 32-byte sectors of 8 rows (16 bytes per row from each of two stores) rather
        than every other 2-byte element -- and reads a residual operand the same way. The guard
        is the even column's: column + 1 < N whenever column < N (N even)."""
        c = self.c
        store = c.store
        row, column = self.by * self.t.bm + row_in_block, self.bx * self.t.bn + column_in_block
        n = self.names.get("out_v", 0)
        self.names["out_v"] = n + 1
        lane = Var("out_v" if n == 0 else f"out_v{n}")
        values: dict[Var, Expr] = {v: self.batch_index[v.name] for v, _ in c.batch}
        values.update(unflatten(c.rows, row))
        values.update(unflatten(c.cols, column))
        inner = c.cols[-1][0]
        values[inner] = values[inner] + lane    # (column + v) % e = column % e + v: e and column even
        value = _ReplaceAccumulator(c.acc, self.frag_c[first + lane]).visit(store.value)
        value = substitute(value, values)
        if self.out_tile is not None:
            target = BufferStore(self.out_tile, (row_in_block, column_in_block + lane), value)
        else:
            target = BufferStore(store.buffer, tuple(substitute(ix, values) for ix in store.indices), value)
        body = IfThenElse((row < c.m) & (column < c.n), target)
        return For(lane, _int(0), _int(2), "vectorize", body)


__all__ = ["CHUNK", "INTRINSICS", "TF32", "Contraction", "Operand", "Tiling", "check_tiling", "grouped_tile",
           "load_a_fragment",
           "load_b_fragments", "match_contraction", "row_swizzle", "tensorize_mma", "tf32_swizzle"]
