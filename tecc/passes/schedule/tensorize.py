"""tensorize: the inner tile of a contraction mapped onto a row of the intrinsic table (mma.sync).

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
are affine in the loop axes, contiguous or with run-time strides (`strides="any"`: tile_staging.py,
"run-time strides"). The spatial axes group into batch (indexing both operands), rows (only A)
and columns (only B, the operand the output's innermost axis indexes); M, N, K are the groups'
extent products. A plain matrix product is the case of single-axis groups (`A[b.., i, k]`,
`B[b.., k, j]`, either orientation); a convolution (`X[n, p·stride + r·dil - pad, q·stride +
s·dil - pad, c]` under a padding `where`, NCHW, 1x1, grouped, 1-3 spatial dimensions) is the
general case: an implicit GEMM, the tile loads gathering X's elements by div/mod of the row and
reduction indices (docs/conv.md). The axes are grouped, not the loop nest flattened first: the
grouping is a view the emitter unflattens where it addresses an operand
(`TileStaging.element`, `implicit_gemm.unflatten`) or the output (epilogue.py), so no
loop-fusion primitive has to rewrite indices, and one matcher serves GEMMs and convolutions.
Anything else is a ScheduleError naming the condition.

Accumulation semantics: the mma multiplies the half operands exactly and accumulates in float32
(the lowered loop's accumulator dtype), rounding once per k16 step. The plain half form lowers to
`float32(A * B)`, a product rounded to half before it is widened; the tensor core does not round
the product, so the tensorized kernel is at least as accurate (products exact, fp32 sums); the
epilogue then rounds once to the output dtype.

The mapping onto the row (`block`, `warps`, `k_tile` of the tensorize primitive):

1. tiling      blocks over (batch → blockIdx.z, row tiles → blockIdx.y, column tiles →
               blockIdx.x), grids by ceil-division (symbolic sizes work); one threadIdx.x loop of
               32·WM_COUNT·WN_COUNT threads, warp = tx // 32 at (warp // WN_COUNT, warp % WN_COUNT);
               each warp owns (BM/WM_COUNT) × (BN/WN_COUNT) = TM × TN mma tiles of 16 × 8, their
               accumulators one fragment buffer of TM·TN·4 floats per lane (tile_kernel.py).
4. fragments   per k16 step: ldmatrix.x4 for a 16 × 16 A tile (`.trans` when A is i-contiguous,
               stored [k][i]), ldmatrix.x4 for two 16 × 8 B tiles (`.trans` when B is
               j-contiguous, stored [k][j]; plain when B is k-contiguous, stored [j][k]).
5. mma         TM × TN mma.sync per k16 step into the accumulators.

Steps 2 (staging: tile_staging.py), 3 (the k-tile loop: ring.py) and 6 (the epilogue:
epilogue.py) are what the other primitives choose; tensorize alone leaves the simplest kernel
that runs: operands copied element by element into plain shared tiles, one buffer, the
registers epilogue.

float32 operands (TF32, only with intrinsic "mma.m16n8k8.f32.tf32" named: "auto" refuses them,
since rounding float32 inputs to tf32 is an opt-in, `build(..., allow_tf32=True)`) take the same
steps with 4-byte elements: 16-byte copies of 4 floats, tiles shaped [S][rows/P][P][width] with
`tf32_swizzle` (P rows per swizzle period, so a row block's offset stays outside the XOR), and
in steps 4-5 (`fragment_loads_elementwise`) ldmatrix.x4 of b16 pairs for k-contiguous tiles and
conflict-free 32-bit shared loads through the row's layout maps for k-major ones, k steps of 8,
and mma.m16n8k8 tf32, whose asm block rounds each A/B register with cvt.rna.tf32.f32
(docs/tensor-cores.md, "TF32").

On Hopper (intrinsic "wgmma"), tensorize_wgmma.py's kernel subclasses this one: the same
matching, tiling, staging and epilogue, with steps 4-5 replaced by wgmmas that read
128B-swizzled shared tiles through descriptors.
"""

from __future__ import annotations

from typing import Any, Callable

from ...ir import dtype as dt
from ...ir.errors import ScheduleError
from ...ir.expr import Const, Expr, Var
from ...ir.intrinsics import lookup
from ...ir.stmt import (
    Buffer,
    BufferStore,
    FragmentRef,
    MatrixLoad,
    MatrixMultiply,
    PrimFunc,
    Stmt,
    seq,
)
from .implicit_gemm import TENSOR_CORE_OPERANDS, Contraction, Operand, match_contraction
from .ring import Pipeline
from .tile_kernel import BlockTile, int32_shape, plus
from .tile_staging import check_staged_tiles

INTRINSICS = {"float16": "mma.m16n8k16.f32.f16", "bfloat16": "mma.m16n8k16.f32.bf16"}
# float32 operands run on tensor cores only rounded to tf32, which a plan must name: "auto" never
# picks it (docs/tensor-cores.md, "TF32"); the planner does when the build has allow_tf32=True.
TF32 = "mma.m16n8k8.f32.tf32"
OPERAND_DTYPES = {**{row: dtype for dtype, row in INTRINSICS.items()}, TF32: "float32"}


# ---- fragment loads (shared by every mma.sync kernel) -------------------------------------------

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



# ---- the mapping: which row, and whether the tile fits it ----------------------------------------

def check_mma_tiling(where: str, t: BlockTile, element_bytes: int = 2) -> None:
    """Refuse a block tile the mma.sync kernel cannot be built for, with operands of `element_bytes`."""
    if t.bk % 16 or t.bk < 16:
        raise ScheduleError(f"{where}: k_tile must be a multiple of 16 (the mma's k), got {t.bk}")
    if t.warps_m < 1 or t.warps_n < 1 or t.threads > 1024:
        raise ScheduleError(f"{where}: warps {t.warps_m}x{t.warps_n} must be positive and at most 32 in all")
    if t.bm % (16 * t.warps_m) or t.bn % (16 * t.warps_n):
        raise ScheduleError(f"{where}: block {t.bm}x{t.bn} over warps {t.warps_m}x{t.warps_n} must give warp tiles "
                            "that are multiples of 16 x 16 (ldmatrix.x4 loads two 16x8 B tiles)")
    check_staged_tiles(where, t, element_bytes)


def checked_mma(func: PrimFunc, stage: str, intrinsic: str, t: BlockTile) -> tuple[Contraction, str]:
    """The contraction `func` computes for `stage` and the mma row it takes (`intrinsic` "auto" or
    an mma row of the table), or a ScheduleError naming what does not fit `t`'s tile."""
    where = f"tensorize({stage})"
    # float32 only with the tf32 intrinsic (below); operands with run-time strides: tile_staging.dispatch
    c = match_contraction(func, stage, TENSOR_CORE_OPERANDS, run_time_strides=True)
    dtype = c.a.buffer.dtype.name
    check_mma_tiling(where, t, c.a.buffer.dtype.bytes)
    if dtype == "float32":
        if intrinsic != TF32:
            raise ScheduleError(
                f"{where}: float32 operands run on tensor cores only rounded to tf32 (10 mantissa bits), "
                f"which a plan must ask for by name: intrinsic={TF32!r} (got {intrinsic!r}); plan='auto' does so "
                "only with build(..., allow_tf32=True)")
        for op in (c.a, c.b):
            outer = t.bm if op.role == "A" else t.bn
            if not op.k_last and outer < 32:
                raise ScheduleError(f"{where}: a float32 {op.role} tile stored k-major needs at least 32 "
                                    f"{'rows' if op.role == 'A' else 'columns'} per block (tf32_swizzle), got {outer}")
        return c, TF32
    want = INTRINSICS.get(dtype)
    if intrinsic == "auto":
        intrinsic = want or ""
    if intrinsic != want:
        raise ScheduleError(f"{where}: intrinsic {intrinsic!r} does not take {dtype} operands; "
                            f"use {want!r} (or 'auto')")
    return c, intrinsic


# ---- the kernel ---------------------------------------------------------------------------------

class MmaKernel(Pipeline):
    """The mma.sync kernel of a TileSchedule (module docstring; the layers: tile_kernel.py)."""

    def fragment_buffers(self) -> tuple[Buffer, ...]:
        """The per-lane fragment buffers (allocated around the kernel body); the accumulators
        are `frag_c`, laid out by `c_map`."""
        t, intrinsic = self.t, self.row
        frag = lookup(intrinsic)
        # elements per lane of one A (16 x k) and one B (k x 8) tile: 8 and 4 halves, 4 and 2 floats
        self.a_elements, self.b_elements = frag.operand("a").elements, frag.operand("b").elements
        sets = 2 if t.fragment_pipeline else 1   # fragment sets (fragment_offsets)
        self.frag_a = Buffer("a_frag", frag.operand("a").dtype, int32_shape(sets * self.a_elements * t.tm), "fragment",
                             fragment=(intrinsic, "a"))
        self.frag_b = Buffer("b_frag", frag.operand("b").dtype, int32_shape(sets * self.b_elements * t.tn), "fragment",
                             fragment=(intrinsic, "b"))
        self.frag_c = Buffer("acc", dt.float32, int32_shape(4 * t.tm * t.tn), "fragment",
                             fragment=(intrinsic, "c"))
        self.c_map = frag.operand("c").layout
        return self.frag_a, self.frag_b, self.frag_c

    def summary(self) -> str:
        """What the kernel is, for its `tensorize` attribute (shown in dumps and explain)."""
        t = self.t
        form = " fragment_pipeline" if t.fragment_pipeline else ""
        form += f" group_m {t.group_m}" if t.group_m else ""
        ring = f"stages {t.stages}" if t.stages > 1 else "unpipelined"
        return (f"{self.row} block {t.bm}x{t.bn} warps {t.warps_m}x{t.warps_n} k_tile {t.bk} {ring}{form}"
                f"{self.staging_summary()}{self.dispatch_summary()}{self.split_summary()}")

    def transposes(self) -> bool:
        """Whether this kernel builds main loops for transposed views (`copy_forms`): 16-bit
        tiles of [S][rows][width], read by ldmatrix with or without .trans. tf32 has no .trans
        (its k-major fragments are 32-bit loads through a layout of its own), so a transposed
        view of a float32 operand takes the element loop."""
        return self.row in INTRINSICS.values()

    # the accumulators: TM x TN fragment tiles of 16 x 8 per warp (epilogue.py)
    def accumulator_lane(self) -> Expr:
        return self.lane

    def accumulator_lanes(self) -> int:
        return 32

    def accumulator_tiles(self) -> int | None:
        return self.t.tm * self.t.tn

    def tile_elements(self) -> int:
        return 4

    def column_groups(self) -> tuple[int, int, Callable[[Expr, Expr], tuple[Expr | None, Expr]]] | None:
        # tile q = mi * TN + ni holds columns ni * 8 + c_map's column; its two pairs (elements 0,
        # 1 and 2, 3) share them a row 8 apart: group ni holds pairs (mi, p) of the TM tiles
        t = self.t
        if any(self.c_map(lane, 0)[1] != self.c_map(lane, 2)[1] for lane in range(32)):
            return None
        return t.tn, 2 * t.tm, lambda g, w: (w // 2 * t.tn + g, w % 2 * 2)

    def accumulator_position(self, tile: Expr | None, r: Expr, col: Expr) -> tuple[Expr, Expr]:
        t = self.t
        assert tile is not None
        mi, ni = tile // t.tn, tile % t.tn
        return (self.warp_m * (t.bm // t.warps_m) + mi * 16 + r,
                self.warp_n * (t.bn // t.warps_n) + ni * 8 + col)

    def compute_tile(self, stage: Expr, registers: int, pending: int) -> Stmt:
        return self.compute(stage)

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
                return MatrixMultiply(self.row, acc, FragmentRef(self.frag_a, plus(self.a_elements * mi, a0)),
                                      FragmentRef(self.frag_b, plus(self.b_elements * ni, b0)), acc)
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
            return self.matrix_load(c.a, load_a_fragment(FragmentRef(self.frag_a, plus(8 * mi, a0)), self.shared["A"],
                                                         stage, self.warp_m * wm + mi * 16, k0, self.lane, c.a.k_last))

        def load_b(nj: Var) -> Stmt:
            return self.matrix_load(c.b, load_b_fragments(FragmentRef(self.frag_b, plus(8 * nj, b0)), self.shared["B"],
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
                return MatrixLoad("ldmatrix.x4", FragmentRef(self.frag_a, plus(self.a_elements * mi, a0)), self.shared["A"],
                                  (stage, block, r8, kk * kdim + 4 * (j // 2)))
            return seq(*(BufferStore(self.frag_a, (plus(mi * self.a_elements + e, a0),),
                                     element(c.a, e, self.warp_m, wm, mi, 16))
                         for e in range(self.a_elements)))

        def load_b(ni: Var) -> Stmt:
            return seq(*(BufferStore(self.frag_b, (plus(ni * self.b_elements + e, b0),),
                                     element(c.b, e, self.warp_n, wn, ni, 8))
                         for e in range(self.b_elements)))

        def load_b_pair(nj: Var) -> Stmt:
            # x4 of 4-float rows of the [n][k] tile, matrices (n 0:8, k 0:4), (n 0:8, k 4:8),
            # (n 8:16, k 0:4), (n 8:16, k 4:8): b0, b1 of two n8 tiles
            per = self.period_rows(c.b)
            assert per == 8
            block = self.warp_n * (wn // 8) + nj * 2 + j // 2
            return MatrixLoad("ldmatrix.x4", FragmentRef(self.frag_b, plus(2 * self.b_elements * nj, b0)), self.shared["B"],
                              (stage, block, r8, kk * kdim + 4 * (j % 2)))

        loads_b = (self.unrolled("frag_n", t.tn // 2, load_b_pair) if c.b.k_last
                   else self.unrolled("frag_n", t.tn, load_b))
        return seq(self.unrolled("frag_m", t.tm, load_a), loads_b)

    def matrix_load(self, op: Operand, load: MatrixLoad) -> MatrixLoad:
        """An ldmatrix of `op`'s tile whose row starts are given in the tile's orientation, at
        the buffer's indices (`shared_index`)."""
        if op.k_last == self.laid_out[op.role].k_last:
            return load
        stage, r, col = load.src_indices
        return MatrixLoad(load.intrinsic, load.dst, load.src, self.shared_index(op, stage, r, col))


__all__ = ["INTRINSICS", "MmaKernel", "OPERAND_DTYPES", "TF32", "check_mma_tiling", "checked_mma", "load_a_fragment",
           "load_b_fragments"]
