"""The tensor-core attention kernel's tiling and operands (online_contraction_mma): what its options
decided (`OnlineTiling`), the kernel's names and buffers, the staging of Q, K and V in shared
memory, and its two contractions. The base of the kernel's layers:

  Operands        online_mma_operands.py  names, buffers, staging (cp.async tiles), S = Q·Kᵀ, O += P·V
  ScoreStage      online_mma_scores.py    f(S) per accumulator element in log2 units; masks: the guard
                                          on partial key tiles, none on the tiles isl proves whole
  RunningSoftmax  online_mma_softmax.py   the running max and sum per row, the rescale α, P relaid
                                          from the C fragments of S to the A fragments of P·V
  OnlineEpilogue  online_mma_epilogue.py  g(O, m, l) and the row outputs from the fragments
  SplitKV         online_mma_split_kv.py  split-KV: partial (O, m, l) per key chunk, the combine kernel
  KeyLoop         online_mma_loop.py      the key loop: the K/V ring (ring.py's cp.async step), the
                                          guarded tiles peeled, the overlapped Hopper loop, the
                                          persistent grid

Each layer reads the tiling (`self.t`), the chain (`self.tcc`, online_mma_chain.py) and the
buffers made here; online_contraction_mma.py assembles the kernel from them.

Staging. Q [BM][D] is copied once; K and V tiles [BN][D], [BN][C] of consecutive keys stream
through a ring (16-byte cp.async zero-filling keys past the end, `thread_partition.tile_copy`).
The mma.sync form's tiles are [stage][rows][width] in the XOR swizzle of ldmatrix
(tile_staging.row_swizzle), padded by 16 bytes at d = 96; the Hopper form's are blocked
[stage][width / W][rows][W] in the swizzle of the wgmma descriptors (mma_tiles.descriptor), Q
and K read K-major, V MN-major.

Contractions. mma.sync: Q's A fragments (ldmatrix.x4) stay in registers for the key loop; a warp
owns `warp_rows` (16 or 32) query rows, one or two m16 tiles that share every K and V fragment it
loads; S = Q Kᵀ is m16n8k16 into float32 C fragments (K is [n][k] in shared: plain ldmatrix gives
the B fragments), O += P V takes V's B fragments by ldmatrix.x4.trans. wgmma: a warpgroup per 64
query rows; S = Q·Kᵀ is D/16 wgmma.m64n{BN}k16 (scale-d false on the first), O += P·V is BN/16
wgmma.m64n{C}k16 with P the register A.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...ir import dtype as dt
from ...ir.expr import Const, Expr, Var, const_int
from ...ir.intrinsics import WARPGROUP_SIZE, lookup
from ...ir.stmt import AsyncWait, Barrier, Buffer, BufferStore, FragmentRef, Stmt, seq
from ..lower import signature
from ..schedule.tensorize import load_a_fragment, load_b_fragments
from ..schedule.tensorize_wgmma import wgmma_intrinsic
from .mma_tiles import TileStaging, two_n8_tiles
from .online_contraction import ExpressionLowering, head_indices
from .online_mma_chain import TensorCoreChain

STAGES = 2
OVERLAP_STAGES = 3   # the overlapped Hopper form reads tiles kt (V) and kt + 1 (K) while kt + 2 loads


@dataclass(frozen=True)
class OnlineTiling:
    """What online_contraction_mma's options decided (its docstring has each one's meaning)."""

    rows: int                       # BM query rows per block
    key_tile: int                   # BN keys per tile
    warp_rows: int = 16             # query rows per warp (mma.sync: 16 or 32; wgmma: a warpgroup per 64)
    wgmma: bool = False             # the Hopper form
    stages: int = STAGES            # the K/V ring's depth
    overlap: bool = False           # S(kt + 1) and its softmax while P(kt)·V is in flight (KeyLoop.overlapped_loop)
    persistent: int = 0             # > 0: that many blocks loop over the work items (KeyLoop.persistent_body)
    splits: int = 1                 # > 1: split-KV over that many key chunks (grid z) and a combine kernel
    plain_order: bool = False       # the plain grid's launch order
    query_major: bool = False       # blocks launched query block major over all heads (launch_order.block_grid)
    guard_every_tile: bool = False  # every visited tile guarded (timing the guard)
    peel_guarded: bool = False      # the guarded tiles in a loop of their own after the whole ones
    blocks_per_sm: int = 0          # > 0: __launch_bounds__' minimum resident blocks


class Operands(TileStaging):
    """The kernel's names, buffers, staging and contractions (module docstring)."""

    def __init__(self, tcc: TensorCoreChain, tiling: OnlineTiling, name: str | None) -> None:
        t = self.t = tiling
        self.wg, self.overlap, self.stages = t.wgmma, t.overlap, t.stages
        self.tcc, self.chain = tcc, tcc.chain
        self.BM, self.BN = t.rows, t.key_tile
        self.WR, self.MT = t.warp_rows, t.warp_rows // 16   # rows and m16 tiles per warp
        self.warps = t.rows // t.warp_rows
        self.threads = 32 * self.warps
        self.D = tcc.depth
        C = const_int(tcc.chain.columns)
        assert C is not None
        self.C: int = C
        self.name = name
        sig = signature(tcc.chain.program)
        self.sig = sig
        self.buffers, self.unique = sig.buffers, sig.unique
        u = self.unique
        self.bx, self.by = Var(u("query_block"), dt.int32), Var(u("head"), dt.int32)
        self.tx, self.kt = Var(u("thread"), dt.int32), Var(u("key_tile"), dt.int32)
        self.pb = Var(u("persistent_block"), dt.int32)
        self.bz = Var(u("key_chunk"), dt.int32)
        self.lane, self.warp = self.tx % 32, self.tx // 32
        self.lower = ExpressionLowering(self.buffers, u)
        self.head_at = dict(zip(self.chain.row[:-1], head_indices(self.by, self.chain.rows[:-1])))
        self.c_map = lookup(tcc.qk_intrinsic).operand("c").layout
        # per m16 tile mt of the warp: fragments at mt · (one tile's size), statistics at 2·mt + r
        self.QF, self.SF = 8 * (self.D // 16), 4 * (self.BN // 8)
        self.PF, self.OF = 8 * (self.BN // 16), 4 * (self.C // 8)
        if self.wg:
            self.warpgroup = self.tx // WARPGROUP_SIZE
            self.qk_wgmma = wgmma_intrinsic(tcc.q.dtype.name, self.BN)
            self.pv_wgmma = wgmma_intrinsic(tcc.v.dtype.name, self.C)

    def warp_row0(self, mt: Expr) -> Expr:
        """The first query row of the warp's m16 tile `mt`."""
        return self.bx * self.BM + self.warp * self.WR + mt * 16

    def operand_buffers(self) -> None:
        """The running statistics' registers, the fragments and the shared tiles: S and O are the
        scores' and P·V's accumulators, P the A operand of P·V; the mma.sync form also holds Q's
        A fragments and one K and one V B fragment (an ldmatrix.x4 each), the Hopper form reads
        those three from shared memory."""
        tcc, BM, BN, D, C, MT = self.tcc, self.BM, self.BN, self.D, self.C, self.MT
        self.m_run, self.l_run = self.local("m_run", 2 * MT), self.local("l_run", 2 * MT)
        self.m_use, self.alpha = self.local("m_use", 2 * MT), self.local("alpha", 2 * MT)
        self.tile_max, self.l_sum = self.local("tile_max", 2 * MT), self.local("l_sum", 2 * MT)
        if self.wg:
            self.s_frag = self.frag("s_frag", self.qk_wgmma, "d", self.SF)
            self.p_frag = self.frag("p_frag", self.pv_wgmma, "a", self.PF)
            self.o_frag = self.frag("o_frag", self.pv_wgmma, "d", self.OF)
            self.q_sh = self.blocked("q_shared", tcc.q, 1, BM, D)
            self.k_sh = self.blocked("k_shared", tcc.k, self.stages, BN, D)
            self.v_sh = self.blocked("v_shared", tcc.v, self.stages, BN, C)
        else:
            self.q_frag = self.frag("q_frag", tcc.qk_intrinsic, "a", self.QF * MT)
            self.k_frag = self.frag("k_frag", tcc.qk_intrinsic, "b", 8)
            self.v_frag = self.frag("v_frag", tcc.pv_intrinsic, "b", 8)
            self.s_frag = self.frag("s_frag", tcc.qk_intrinsic, "c", self.SF * MT)
            self.p_frag = self.frag("p_frag", tcc.pv_intrinsic, "a", self.PF * MT)
            self.o_frag = self.frag("o_frag", tcc.pv_intrinsic, "c", self.OF * MT)
            self.q_sh = self.shared("q_shared", tcc.q, 1, BM, D)
            self.k_sh = self.shared("k_shared", tcc.k, STAGES, BN, D)
            self.v_sh = self.shared("v_shared", tcc.v, STAGES, BN, C)

    # ---- staging -----------------------------------------------------------------------------------

    def copy_q(self) -> Stmt:
        """Q's [BM][D] tile of the block (rows past the queries zero-filled)."""
        chain, tcc = self.chain, self.tcc
        return self.copy_tile(self.q_sh, Const(0, dt.int32), tcc.q, self.head_at, self.bx * self.BM,
                              chain.rows[-1], self.BM, self.D, (chain.row[-1], tcc.scores.axes[0]))

    def load_kv(self, stage: Expr, tile: Expr) -> Stmt:
        """Key tile `tile`'s K and V rows into ring stage `stage` (keys past the end zero-filled)."""
        chain, tcc, BN = self.chain, self.tcc, self.BN
        j0 = tile * BN
        return seq(self.copy_tile(self.k_sh, stage, tcc.k, self.head_at, j0, chain.keys, BN, self.D,
                                  (chain.key, tcc.scores.axes[0])),
                   self.copy_tile(self.v_sh, stage, tcc.v, self.head_at, j0, chain.keys, BN, self.C,
                                  (chain.key, chain.column)))

    def q_fragments(self) -> Stmt:
        """mma.sync: Q's tile (and the ring's first tile) landed for every thread, then its A
        fragments, which stay in registers for the whole key loop."""
        zero, MT = Const(0, dt.int32), self.MT
        return seq(
            AsyncWait(0),
            Barrier(),
            self.unrolled("q_tile", MT, lambda mt: self.unrolled("q_step", self.D // 16, lambda kd: load_a_fragment(
                FragmentRef(self.q_frag, self.QF * mt + 8 * kd), self.q_sh, zero, self.warp * self.WR + mt * 16,
                kd * 16, self.lane, True))))

    # ---- the two contractions -----------------------------------------------------------------------

    def scores(self, stage: Expr) -> Stmt:
        """S = Q·K(stage)ᵀ into s_frag: the wgmmas waited for, or the mma.sync tiles (one K
        fragment load serves the warp's MT m16 tiles)."""
        if self.wg:
            return self.wgmma_group([self.wgmma_scores(stage)], (self.s_frag,))

        def qk_step(kd: Var) -> Stmt:
            return self.unrolled("key_pair", self.BN // 16, lambda kn: self.b_pair(
                "qk_tile", self.tcc.qk_intrinsic, (self.s_frag, self.SF), (self.q_frag, self.QF), kd,
                (self.k_frag, self.k_sh, True), stage, kn))
        return seq(self.unrolled("s_zero", self.SF * self.MT, lambda e: BufferStore(self.s_frag, (e,),
                                                                                   Const(0.0, dt.float32))),
                   self.unrolled("qk_step", self.D // 16, qk_step))

    def wgmma_scores(self, stage: Expr) -> Stmt:
        """The Hopper form's D/16 wgmmas of S = Q·K(stage)ᵀ: Q the warpgroup's 64 rows."""
        return self.wgmma_k_major("qk_step", self.qk_wgmma, self.s_frag, self.q_sh, self.warpgroup * 64, self.k_sh,
                                  stage, self.D // 16)

    def wgmma_values(self, stage: Expr) -> Stmt:
        """The Hopper form's BN/16 wgmmas of O += P·V(stage): P from registers, V MN-major."""
        return self.wgmma_register_a("pv_step", self.pv_wgmma, self.o_frag, self.p_frag, self.v_sh, stage,
                                     self.BN // 16)

    def values(self, stage: Expr) -> Stmt:
        """O += P·V(stage) on mma.sync: one V fragment load (ldmatrix.trans) serves the warp's MT
        m16 tiles."""
        def pv_step(kk: Var) -> Stmt:
            return self.unrolled("column_pair", self.C // 16, lambda dn: self.b_pair(
                "pv_tile", self.tcc.pv_intrinsic, (self.o_frag, self.OF), (self.p_frag, self.PF), kk,
                (self.v_frag, self.v_sh, False), stage, dn))
        return self.unrolled("pv_step", self.BN // 16, pv_step)

    def b_pair(self, label: str, intrinsic: str, acc: tuple[Buffer, int], a: tuple[Buffer, int], step: Expr,
               b: tuple[Buffer, Buffer, bool], stage: Expr, pair: Expr) -> Stmt:
        """One ldmatrix.x4 of B -- n16 pair `pair` at k16 step `step` of the staged tile b = (the
        fragment, the tile, whether it is [n][k]: plain ldmatrix, else .trans) -- feeding the two n8
        mmas of each of the warp's MT m16 tiles: acc[size·mt + 8·pair ..] += a[size·mt + 8·step ..]·B
        for acc = (buffer, its size per m16 tile) and a likewise."""
        (acc_buf, acc_size), (a_buf, a_size), (b_frag, tile, k_major) = acc, a, b

        def mma(mt: Var) -> Stmt:
            return two_n8_tiles(intrinsic, acc_buf, acc_size * mt + 8 * pair,
                                FragmentRef(a_buf, a_size * mt + 8 * step), b_frag)
        return seq(load_b_fragments(FragmentRef(b_frag, Const(0, dt.int32)), tile, stage, pair * 16, step * 16,
                                    self.lane, k_major),
                   self.unrolled(label, self.MT, mma))


__all__ = ["OVERLAP_STAGES", "STAGES", "Operands", "OnlineTiling"]
