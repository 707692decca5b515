"""The epilogue of the tensor-core attention (online_contraction_mma): after the key loop, l summed
over the quad, m = m₂ · ln 2, and the output O[row, col] = g(acc, m, l) (the program's own
expression, the cast included) from the accumulator fragment's elements, at (row, col) of its
layout map, and the row outputs (the log-sum-exp) by lane t = 0 of each quad, guarded by row <
the query extent. Elements 2h and 2h + 1 of the C fragment are one row's two adjacent columns
(epilogue.paired_columns, the GEMM epilogue's check): one guarded 2-element store per row, a
4-byte store of 16-bit outputs. Split-KV stores the partial (O, m₂, l) instead
(online_mma_split_kv.py).
"""

from __future__ import annotations

from ...ir import dtype as dt
from ...ir.errors import ScheduleError
from ...ir.expr import Const, Var, cast, compare, substitute
from ...ir.online_chain import row_index
from ...ir.intrinsics import lookup
from ...ir.stmt import BufferStore, For, IfThenElse, Stmt, seq
from ...ir.visitor import SubexpressionReplacer
from ..schedule.epilogue import paired_columns
from .online_mma_softmax import RunningSoftmax


def check_pairs(qk: str) -> None:
    """The epilogue stores elements 2h and 2h + 1 of the C fragment of `qk` as one 2-element
    vector: they must be one row's columns c and c + 1, c even (the m16n8 C layout)."""
    if not paired_columns(lookup(qk).operand("c").layout, 32, 4):
        raise ScheduleError(f"online_contraction_mma: elements 2h, 2h + 1 of the C fragment of {qk} are not two "
                            "adjacent columns of one row; the epilogue's paired stores need them")


class OnlineEpilogue(RunningSoftmax):
    """The program's outputs from the fragments and the final statistics (module docstring)."""

    def output_tile(self, mt: Var, nt: Var) -> Stmt:
        """n8 tile nt of m16 tile mt of O: per half h, one row's two columns in one store."""
        chain, head_at = self.chain, self.head_at
        out = self.buffers[chain.output]

        def pair(h: Var) -> Stmt:
            v = Var(self.unique("out_e"), dt.int32)
            r, col = self.c_map(self.lane, 2 * h)
            row = self.warp_row0(mt) + r
            column = nt * 8 + col + v
            body = SubexpressionReplacer({**self.final_statistics(2 * mt + h),
                                          chain.contraction: cast(self.o_frag[self.OF * mt + 4 * nt + 2 * h + v],
                                                                  chain.contraction.dtype)}
                                         ).visit(chain.output_body)
            at = {**head_at, chain.row[-1]: row, chain.column: column}
            st, val = self.lower.value(substitute(body, at))
            idx = tuple(head_at[u] for u in chain.row[:-1]) + (row, column)
            return IfThenElse(compare("<", row, chain.rows[-1]), For(
                v, Const(0, dt.int32), Const(2, dt.int32), "vectorize" if not st else "unroll",
                seq(*st, BufferStore(out, idx, cast(val, chain.output.dtype)))))
        return self.unrolled("out_h", 2, pair)

    def row_output(self, r: Var) -> Stmt:
        """Row r = 2·mt + (0: row g, 1: row g + 8)'s outputs of the row (lse, m, l), by lane 0 of the quad."""
        chain, head_at = self.chain, self.head_at
        row = self.warp_row0(r // 2) + self.lane // 4 + 8 * (r % 2)
        at = {**head_at, chain.row[-1]: row}
        stmts: list[Stmt] = []
        for t, value in chain.row_outputs:
            st, val = self.lower.value(substitute(SubexpressionReplacer(self.final_statistics(r)).visit(value), at))
            idx = row_index(t, tuple(head_at[v] for v in chain.row[:-1]) + (row,))
            stmts.append(seq(*st, BufferStore(self.buffers[t], idx, cast(val, t.dtype))))
        return IfThenElse(compare("==", self.lane % 4, Const(0, dt.int32)) & compare("<", row, chain.rows[-1]),
                          seq(*stmts))

    def epilogue(self) -> list[Stmt]:
        """The statements after the key loop: the quad sums, then the outputs."""
        check_pairs(self.tcc.qk_intrinsic)
        finish = [self.row_sums(), self.unrolled("out_m", self.MT, lambda mt: self.unrolled(
            "out_tile", self.C // 8, lambda nt: self.output_tile(mt, nt)))]
        if self.chain.row_outputs:
            finish.append(self.unrolled("row_out", 2 * self.MT, self.row_output))
        return finish


__all__ = ["OnlineEpilogue", "check_pairs"]
