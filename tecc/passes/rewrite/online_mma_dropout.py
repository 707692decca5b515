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

**Four elements per Philox call**, when the index is X(row) = Y(row)·E + key with E (the last
extent) a multiple of 4 (a constant, or tested once: the branch is uniform over the kernel, as
the shuffle needs). Then keys 8·nt + 4u .. + 3 of a row are one counter group, held by lanes
2u (keys + 0, + 1) and 2u + 1 (keys + 2, + 3) of a quad, for rows g and g + 8 each: lane 2u
draws the group of row g, lane 2u + 1 that of row g + 8 (indices base | w, w = 0 .. 3: one
call), each packs its four keep bits, and one `shfl_xor(bits, 1)` hands each lane the other
row's: the even lane keeps bits 0, 1 of both rows, the odd lane bits 2, 3. The C layout this
assumes (element e at (g + 8·(e // 2), 2t + e % 2)) is checked against the table.
"""

from __future__ import annotations

from typing import Any, Callable

from ...ir import dtype as dt
from ...ir.expr import (
    Binary,
    Cast,
    Const,
    Expr,
    Var,
    binary,
    cast,
    compare,
    const_int,
    free_vars,
    select,
    substitute,
    walk,
    warp_shuffle,
)
from ...ir.intrinsics import lookup
from ...ir.philox import RandomUniform
from ...ir.stmt import BufferStore, IfThenElse, LetStmt, Stmt, seq
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

    def dropout_summary(self) -> str:
        """What the plan says of the mask: how many elements share a Philox call."""
        if self.pair_form() is None:
            return "dropout: the keep mask regenerated from tc.rand per element (one Philox call each)"
        quad = self.quad_extent()
        if quad is None:
            return ("dropout: the keep mask regenerated from tc.rand, one Philox call per two keys of a row (per "
                    "element on rows whose index base is odd)")
        return (f"dropout: the keep mask regenerated from tc.rand, one Philox call per four keys (a lane pair, one "
                f"shuffle) when {quad} % 4 == 0, else per two keys of a row")

    def dropped_stores(self, mt: Expr, nt: Expr) -> Stmt:
        """dropped_tile, with one Philox call per four elements where the last extent of the
        rand tensor is a multiple of 4 (tested at run time when it is symbolic)."""
        form, quad = self.pair_form(), self.quad_extent()
        if form is None or quad is None:
            return self.dropped_tile(mt, nt)
        aligned = const_int(quad)
        if aligned is not None:
            return self.quad_tile(mt, nt) if aligned % 4 == 0 else self.dropped_tile(mt, nt)
        return IfThenElse(compare("==", binary("&", quad, Const(3, quad.dtype)), Const(0, quad.dtype)),
                          self.quad_tile(mt, nt), self.dropped_tile(mt, nt))

    def quad_extent(self) -> Expr | None:
        """E when the pair form's X(row) is Y(row)·E with E free of the rows (a size or a
        constant) and the C layout is m16n8's (module docstring), else None."""
        form = self.pair_form()
        if form is None or not m16n8_layout(self.c_map):
            return None
        x = form[1]
        x = x.a if isinstance(x, Cast) and x.a.dtype.is_int else x
        if not (isinstance(x, Binary) and x.op == "*"):
            return None
        extent = x.b.a if isinstance(x.b, Cast) else x.b
        if any(v.kind != "size" for v in free_vars(extent) if isinstance(v, Var)):
            return None
        return extent

    def quad_tile(self, mt: Expr, nt: Expr) -> Stmt:
        """The four P elements of n8 tile nt of m16 tile mt with one Philox call and one shuffle
        per lane (module docstring)."""
        form = self.pair_form()
        assert form is not None and self.chain.dropout is not None
        u, _ = form
        keep = self.chain.dropout.keep
        odd = compare("==", self.lane % 2, Const(1, dt.int32))
        r_first, c_first = self.c_map(self.lane, 0)
        # the lane's group: row g (even lane) or g + 8 (odd lane), keys 8·nt + 4·(t // 2) + w
        row = self.warp_row0(mt) + r_first + select(odd, Const(8, dt.int32), Const(0, dt.int32))
        key0 = self.kt * self.BN + nt * 8 + c_first - self.lane % 2 * 2
        at = {**self.head_at, self.chain.row[-1]: row, self.chain.key: key0}
        u0 = substitute(u, at)
        assert isinstance(u0, RandomUniform)
        bits: Expr = Const(0, dt.int32)
        for w in range(4):
            draw = RandomUniform(u0.seed, u0.offset, u0.index if w == 0 else
                                 binary("|", u0.index, Const(w, u0.index.dtype)))
            bit = cast(SubexpressionReplacer({u0: draw}).visit(substitute(keep, at)), dt.int32)
            bits = bit if w == 0 else bits | (bit * Const(1 << w, dt.int32))
        own = Var(self.unique("keep_bits"), dt.int32)
        other = Var(self.unique("keep_other"), dt.int32)
        first_row = select(odd, other, own)     # row g's bits: the even lane's draw
        second_row = select(odd, own, other)    # row g + 8's: the odd lane's
        masks = (select(odd, Const(4, dt.int32), Const(1, dt.int32)), select(odd, Const(8, dt.int32), Const(2, dt.int32)))
        zero = Const(0, dt.int32)
        stores = [self.store_p(mt, nt, Const(e, dt.int32), compare(
            "!=", binary("&", first_row if e < 2 else second_row, masks[e % 2]), zero)) for e in range(4)]
        lowered, bits = self.lower.value(bits)
        return seq(*lowered, LetStmt(own, bits, LetStmt(other, warp_shuffle("shfl_xor", own, 1), seq(*stores))))

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




def m16n8_layout(c_map: Callable[[Any, Any], tuple[Any, Any]]) -> bool:
    """Whether element e of lane l sits at (l // 4 + 8·(e // 2), 2·(l % 4) + e % 2): the m16n8 C
    layout the four-element form pairs lanes by."""
    return all(c_map(lane, e) == (lane // 4 + 8 * (e // 2), 2 * (lane % 4) + e % 2) for lane in range(32) for e in range(4))


__all__ = ["DroppedWeights", "m16n8_layout"]
