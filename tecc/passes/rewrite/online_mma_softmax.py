"""The online softmax of the tensor-core attention (online_contraction_mma): the running statistics
of each query row, the rescale, and P relaid from the scores' C fragments to P·V's A fragments.
What the kernel does that a GEMM does not; everything else is its operands and loops.

The running max m₂ and sum l per row (FlashAttention-2, Dao 2023): a lane holds rows g and g + 8
of its warp's m16 tile (g = lane // 4) at columns 2t, 2t+1 of each n8 tile; the row max is the
lane's max, then two shfl_xor (1, 2) over the 4 lanes of the quad. l stays a per-lane partial
sum (every lane of the quad rescales by the same α = exp2(m₂_old - m₂_new)) and is summed over
the quad once, at the end (`row_sums`). A max that is still -inf is used as 0, so exp2(-inf - 0)
= 0 and no NaN appears.

P = exp2(t - m₂) (`exp2_approx`: ex2.approx.ftz.f32, one MUFU.EX2, relative error about 2^-22,
far below the rounding of P to 16 bits that follows; subnormal weights flush to 0), rounded to
V's dtype, is stored straight into the A fragment of the second mma: the m16n8 C layout of n8
tiles 2k and 2k + 1 is exactly the m16n8k16 A layout of k16 step k (A element e < 4 is C element
e of tile 2k, A element 4 + e is C element e of tile 2k + 1; mma_tiles.check_relayout checks it
against the table when the kernel is built), so P never touches shared memory. In the Hopper form
the wgmma accumulator's elements 8k .. 8k + 7 are the register A of k16 step k
(check_wgmma_relayout). Then O = O·α before O += P·V.

Precision: P is rounded to V's 16-bit dtype before P·V (relative 2^-11 for float16, 2^-8 for
bfloat16, so O is off by at most that times max |v|, as in FlashAttention); the sum l is of the
unrounded P.
"""

from __future__ import annotations

import math

from ...ir import dtype as dt
from ...ir.expr import Const, Expr, Var, binary, call, cast, compare, select, warp_shuffle
from ...ir.stmt import BufferStore, Stmt, seq
from .online_mma_dropout import DroppedWeights
from .online_mma_scores import MINUS_INF

LN2 = math.log(2.0)


class RunningSoftmax(DroppedWeights):
    """The running statistics, the rescale and P (module docstring)."""

    def statistics_init(self) -> Stmt:
        """m₂ = -inf, l = 0 per row; O = 0."""
        MT = self.MT
        return seq(
            self.unrolled("row", 2 * MT, lambda r: seq(BufferStore(self.m_run, (r,), MINUS_INF),
                                                      BufferStore(self.l_run, (r,), Const(0.0, dt.float32)))),
            self.unrolled("o_zero", self.OF * MT, lambda e: BufferStore(self.o_frag, (e,), Const(0.0, dt.float32))))

    def row_stats(self, r: Var) -> Stmt:
        """Row r = 2·mt + (0: row g, 1: row g + 8) of tile kt: the new max over the quad, α, the
        sum rescaled."""
        tile_max, m_run, raw_scale = self.tile_max, self.m_run, self.raw_scale

        def fold(nt: Var) -> Stmt:
            # fmax (one FMNMX) rather than the NaN-propagating max: a NaN score still makes
            # its p, hence l and the outputs, NaN, as the program's max would
            here = self.SF * (r // 2) + 4 * nt + 2 * (r % 2)
            return seq(*(BufferStore(tile_max, (r,), binary("fmax", tile_max[r], self.s_frag[here + i]))
                         for i in (0, 1)))
        scaled = () if raw_scale is None else (
            BufferStore(tile_max, (r,), binary("fmax", m_run[r], tile_max[r] * Const(raw_scale, dt.float32))),)
        return seq(
            BufferStore(tile_max, (r,), m_run[r] if raw_scale is None else MINUS_INF),
            self.unrolled("max_n", self.BN // 8, fold),
            BufferStore(tile_max, (r,), binary("fmax", tile_max[r], warp_shuffle("shfl_xor", tile_max[r], 1))),
            BufferStore(tile_max, (r,), binary("fmax", tile_max[r], warp_shuffle("shfl_xor", tile_max[r], 2))),
            *scaled,
            BufferStore(self.m_use, (r,), select(compare("==", tile_max[r], MINUS_INF), Const(0.0, dt.float32),
                                                 tile_max[r])),
            BufferStore(self.alpha, (r,), call("exp2_approx", m_run[r] - self.m_use[r])),
            BufferStore(m_run, (r,), tile_max[r]),
            BufferStore(self.l_run, (r,), self.l_run[r] * self.alpha[r]),
        )

    def weights(self, mt: Var, nt: Var) -> Stmt:
        """P = exp2(t - m₂) of n8 tile nt of m16 tile mt in place of t, added to the row sums, and
        (but in the overlapped form, `convert`) rounded into P's A fragment."""
        s_frag, raw_scale = self.s_frag, self.raw_scale

        def one(e: Var) -> Stmt:
            here, r = self.SF * mt + 4 * nt + e, 2 * mt + e // 2
            t = s_frag[here] if raw_scale is None else s_frag[here] * Const(raw_scale, dt.float32)
            p = call("exp2_approx", t - self.m_use[r])
            return seq(BufferStore(s_frag, (here,), p),
                       BufferStore(self.l_run, (r,), self.l_run[r] + s_frag[here]),
                       # C tile nt element e is A element 4·nt + e of k16 step nt // 2 (the relayout);
                       # the overlapped form converts after the P·V in flight has read the old P;
                       # with dropout the four are stored after the loop, a Philox call per pair
                       None if self.overlap or self.chain.dropout is not None else self.store_p(mt, nt, e))
        if self.chain.dropout is not None and not self.overlap:
            return seq(self.unrolled("p_e", 4, one), self.dropped_stores(mt, nt))
        return self.unrolled("p_e", 4, one)

    def rescale(self, mt: Var, nt: Var) -> Stmt:
        """O·α on n8 tile nt of m16 tile mt of the output."""
        o_frag, at = self.o_frag, self.OF * mt + 4 * nt
        return self.unrolled("o_e", 4, lambda e: BufferStore(o_frag, (at + e,),
                                                             o_frag[at + e] * self.alpha[2 * mt + e // 2]))

    def softmax(self) -> Stmt:
        """The statistics and the weights of tile kt (its elementwise stage done)."""
        MT = self.MT
        return seq(self.unrolled("row_stat", 2 * MT, self.row_stats),
                   self.unrolled("p_m", MT, lambda mt: self.unrolled("p_tile", self.BN // 8,
                                                                     lambda nt: self.weights(mt, nt))))

    def rescale_output(self) -> Stmt:
        return self.unrolled("o_m", self.MT, lambda mt: self.unrolled("o_tile", self.C // 8,
                                                                      lambda nt: self.rescale(mt, nt)))

    def convert(self) -> Stmt:
        """The overlapped form's P (left in s_frag by `weights`) rounded into its A fragment, then O·α."""
        if self.chain.dropout is not None:
            return seq(self.unrolled("p_cast", self.BN // 8, lambda nt: self.dropped_stores(Const(0, dt.int32), nt)),
                       self.rescale_output())
        p_dtype = self.p_dtype()
        return seq(self.unrolled("p_cast", self.PF, lambda e: BufferStore(self.p_frag, (e,),
                                                                          cast(self.s_frag[e], p_dtype))),
                   self.rescale_output())

    def row_sums(self) -> Stmt:
        """The end of the key loop: each row's l summed over the quad into l_sum."""
        l_sum, l_run = self.l_sum, self.l_run
        return self.unrolled("quad_sum", 2 * self.MT, lambda r: seq(
            BufferStore(l_sum, (r,), l_run[r] + warp_shuffle("shfl_xor", l_run[r], 1)),
            BufferStore(l_sum, (r,), l_sum[r] + warp_shuffle("shfl_xor", l_sum[r], 2))))

    def final_statistics(self, r: Expr) -> dict[Expr, Expr]:
        """The program's m and l of row r: m = m₂·ln 2 (m₂ is in log2 units), l the quad's sum."""
        chain = self.chain
        return {chain.m_value: cast(self.m_run[r] * LN2, chain.m.dtype),
                chain.l_value: cast(self.l_sum[r], chain.l.dtype)}


__all__ = ["LN2", "RunningSoftmax"]
