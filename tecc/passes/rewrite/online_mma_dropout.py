"""Dropout in the tensor-core attention (online_contraction_mma): P's A fragment from the weights
with the chain's dropout mask applied, the mask regenerated from tc.rand (never stored).

Element e of n8 tile nt of m16 tile mt of the scores' C fragment sits at row warp_row0(mt) + r
and key kt·BN + 8·nt + col, (r, col) the layout map of (lane, e); its weight p (in s_frag, the
row sum l has taken it) goes into A element 4·nt + e of P as `keep ? p : 0`, keep the chain's
condition (tecc.ir.online_dropout) at that row and key. The condition holds tc.rand's
`RandomUniform(seed, offset, n)` with n the element's linear index in the rand tensor's shape.

**Two elements per Philox call.** Elements 2h and 2h + 1 are one row's keys c and c + 1 with c
even (the C layout: epilogue.paired_columns). When the condition draws one RandomUniform whose
index is n = X(row) + key (the key the rand tensor's last axis), the pair's indices are n0 and
n0 + 1, one Philox counter group n0 >> 2 whenever n0 is even, i.e. X(row) even (an even last
extent makes every row so). Then the second element's index is written `n0 | 1`: the same
value, and the counter offset + ((n0 | 1) >> 2) is offset + (n0 >> 2) to the compiler (the low
bit does not reach the shift), so the two inlined Philox calls are one computation and NVVM
keeps one (the PTX of the 64 x 64 kernel: half the mul.hi of the per-element form). A row with
X odd (an odd last extent) takes the per-element form in the other branch of a test of X's low
bit. Other conditions (several draws, another index form) take the per-element form.
"""

from __future__ import annotations

from ...ir import dtype as dt
from ...ir.expr import Binary, Cast, Const, Expr, Var, binary, cast, compare, free_vars, select, substitute, walk
from ...ir.intrinsics import lookup
from ...ir.philox import RandomUniform
from ...ir.stmt import BufferStore, IfThenElse, Stmt, seq
from ...ir.visitor import SubexpressionReplacer
from ..schedule.epilogue import paired_columns
from .online_mma_scores import ScoreStage


class DroppedWeights(ScoreStage):
    """P's A fragment from s_frag, masked by the chain's dropout (module docstring)."""

    def p_dtype(self) -> dt.DType:
        return lookup(self.tcc.pv_intrinsic).operand("a").dtype

    def store_p(self, mt: Expr, nt: Expr, e: Expr, keep: Expr | None = None) -> Stmt:
        """A element 4·nt + e of m16 tile mt: the weight in s_frag rounded to P's dtype, zero where
        the dropout drops it (`keep`, in kernel variables; by default the chain's condition at
        the element's row and key)."""
        value: Expr = self.s_frag[self.SF * mt + 4 * nt + e]
        stmts: list[Stmt] = []
        dropout = self.chain.dropout
        if dropout is not None:
            if keep is None:
                keep = substitute(dropout.keep, self.element_at(mt, nt, e))
            stmts, kept = self.lower.value(keep)
            value = select(kept, value, Const(0.0, dt.float32))
        return seq(*stmts, BufferStore(self.p_frag, (self.PF * mt + 4 * nt + e,), cast(value, self.p_dtype())))

    def element_at(self, mt: Expr, nt: Expr, e: Expr) -> dict[Var, Expr]:
        """The chain's row and key variables at element e of n8 tile nt of m16 tile mt."""
        r, col = self.c_map(self.lane, e)
        return {**self.head_at, self.chain.row[-1]: self.warp_row0(mt) + r,
                self.chain.key: self.kt * self.BN + nt * 8 + col}

    def dropped_tile(self, mt: Expr, nt: Expr) -> Stmt:
        """The four P elements of n8 tile nt of m16 tile mt, one Philox call per pair where the
        condition allows (module docstring)."""
        form = self.pair_form()
        if form is None:
            return self.unrolled("p_store", 4, lambda e: self.store_p(mt, nt, e))
        u, x = form
        chain = self.chain
        assert chain.dropout is not None

        def pair(h: Var) -> Stmt:
            first, second = self.element_at(mt, nt, 2 * h), self.element_at(mt, nt, 2 * h + 1)
            u0, u1 = substitute(u, first), substitute(u, second)
            assert isinstance(u0, RandomUniform)
            shared = RandomUniform(u0.seed, u0.offset, binary("|", u0.index, Const(1, u0.index.dtype)))
            keep1 = substitute(chain.dropout.keep, second)   # type: ignore[union-attr]
            x0 = substitute(x, first)
            even = compare("==", binary("&", x0, Const(1, x0.dtype)), Const(0, x0.dtype))
            return IfThenElse(even,
                              seq(self.store_p(mt, nt, 2 * h),
                                  self.store_p(mt, nt, 2 * h + 1, SubexpressionReplacer({u1: shared}).visit(keep1))),
                              seq(self.store_p(mt, nt, 2 * h), self.store_p(mt, nt, 2 * h + 1, keep1)))
        return self.unrolled("p_pair", 2, pair)

    def pair_form(self) -> tuple[RandomUniform, Expr] | None:
        """(the condition's one RandomUniform, X) when its index is X(row) + key in canonical
        variables (a cast to int64 around either allowed) and the C fragment pairs adjacent
        keys; None otherwise (the per-element form)."""
        dropout, key = self.chain.dropout, self.chain.key
        if dropout is None or not paired_columns(self.c_map, 32, 4):
            return None
        found = list({id(n): n for n in walk(dropout.keep) if isinstance(n, RandomUniform)}.values())
        if len(found) != 1:
            return None
        (u,) = found
        assert isinstance(u, RandomUniform)
        if any(v is key for e in (u.seed, u.offset) for v in free_vars(e)):
            return None
        n = u.index.a if isinstance(u.index, Cast) and u.index.a.dtype.is_int else u.index
        if not (isinstance(n, Binary) and n.op == "+"):
            return None
        k = n.b.a if isinstance(n.b, Cast) else n.b
        if k is not key or any(v is key for v in free_vars(n.a)):
            return None
        return u, n.a


__all__ = ["DroppedWeights"]
