"""The elementwise stage of the tensor-core attention's scores (online_contraction_mma), and the
masks: which key tiles are visited, which are guarded.

Each accumulator element of S, at (row, col) of the C fragment's layout map, becomes
t = log2(e) · f(acc, row, key) (when the kept f is `acc · c`, c > 0, the fragment keeps the raw
acc or -inf instead and the max is scaled once per row: each weight is then one FFMA and one ex2,
online_mma_softmax.py), so exp(s - m) = exp2(t - m₂) with m₂ = max t is one subtraction and one
`exp2_approx`. Keys past the end are -inf. Elements that read tensors (a bias, a mask) are
guarded by row and key bounds.

Key tiles a mask makes fully -inf are not visited (`masked_tiles`: key_tiles.key_tile_bound),
and tiles every row of the block keeps whole skip the per-element guard (`elementwise_stage`:
key_tiles.unmasked_tile_bound): bounds derived from the affine conditions of the `where`s and
proved with isl. On the partial tiles each affine condition c·key + a·row + rest <= 0 is one
integer limit per m16 tile compared against the element's compile-time offsets, and the key-extent
test is left out where isl proves the visited keys inside (`limited_guard`: the guard's registers
decide whether the d = 128 Hopper kernel fits 2 blocks per SM; docs/attention.md "What a guarded
tile costs").
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from ...ir import dtype as dt
from ...ir.expr import Const, Expr, Var, cast, compare, const_int, select, substitute
from ...ir.stmt import BufferStore, IfThenElse, LetStmt, Stmt, seq
from ...ir.visitor import SubexpressionReplacer
from ..schedule.tile_kernel import ceil_div
from .key_tiles import (
    affine_form,
    kept,
    kept_conditions,
    key_tile_bound,
    skipping_description,
    tiles_inside_keys,
    unmasked_tile_bound,
)
from .mma_tiles import fold_log2e
from .online_mma_chain import positive_scale, reads_inputs
from .online_mma_operands import Operands

MINUS_INF = Const(-math.inf, dt.float32)


def combination(parts: Sequence[tuple[int, Any]]) -> Expr:
    """Σ k·x, written with subtractions for negative k and without the zero terms."""
    zero = Const(0, dt.int32)
    out: Expr | None = None
    for k, x in parts:
        if k == 0 or const_int(x) == 0:
            continue
        term = x if abs(k) == 1 else Const(abs(k), dt.int32) * x
        out = (term if k > 0 else zero - term) if out is None else (out + term if k > 0 else out - term)
    return zero if out is None else out


def lane_plus_element(c_map: Any) -> bool:
    """Whether the C fragment's position of (lane, e) is the lane's position (e = 0) plus the
    element's (lane 0's offset of e), so an element's offset in its m16 tile is a constant."""
    for lane in range(32):
        for e in range(4):
            (r, col), (r0, c0), (re, ce), (rz, cz) = c_map(lane, e), c_map(lane, 0), c_map(0, e), c_map(0, 0)
            if (r, col) != (r0 + re - rz, c0 + ce - cz):
                return False
    return True


class ScoreStage(Operands):
    """f(S) per accumulator element, the masks' bounds and guards (module docstring)."""

    def masked_tiles(self) -> None:
        """`bound`: the key tiles the mask keeps for the block (key_tiles.key_tile_bound, an
        expression of the query block and the heads), or None (every tile)."""
        self.bound = key_tile_bound(self.chain, self.bx, self.BM, self.BN)

    def score_forms(self) -> None:
        """`raw_scale`: s = Σ·c (c > 0) under the masks and no tensor read: the fragments keep the
        raw Σ (or -inf), the max is taken on it and scaled once per row, and each weight is
        exp2(Σ·c·log2 e - m₂), one FFMA; the tiles kept whole then need no elementwise work at
        all. `score` is the elementwise value per element (the raw Σ under the masks then)."""
        chain, tcc = self.chain, self.tcc
        self.has_reads = reads_inputs(tcc)
        self.kept_value = kept(chain.score)[1]
        self.raw_scale = None if self.has_reads else positive_scale(self.kept_value, tcc.scores)
        self.score = chain.score
        if self.raw_scale is not None:
            self.score = SubexpressionReplacer({self.kept_value: tcc.scores}).visit(chain.score)

    def elementwise_stage(self) -> Stmt:
        """The stage of key tile kt: guarded on the partial tiles, nothing or the unguarded value
        on the tiles every row of the block keeps whole (below the diagonal). Sets `guarded` and
        `whole` (the two forms, for the peeled loop), `unmasked` (the whole tiles' count, or None)
        and `skipping` (what the plan says)."""
        chain = self.chain
        self.score_forms()
        self.guarded = self.element(self.score, True)
        unmasked = None if self.has_reads or self.t.guard_every_tile else unmasked_tile_bound(
            chain, self.bx, self.BM, self.BN)
        self.skipping = skipping_description(chain, self.bound, unmasked)
        self.whole: Stmt = seq()   # the elementwise stage of a whole tile (the peeled loop's)
        self.unmasked = None if unmasked is None else substitute(unmasked, self.head_at)
        if self.unmasked is None:
            return self.guarded
        if self.raw_scale is not None:  # the raw Σ is the value: nothing to do on whole tiles
            return IfThenElse(compare(">=", self.kt, self.unmasked), self.guarded)
        self.whole = self.element(self.kept_value, False)
        return IfThenElse(compare("<", self.kt, self.unmasked), self.whole, self.guarded)

    def element(self, score: Expr, guarded: bool) -> Stmt:
        """`score` at each accumulator element of tile kt into s_frag, in log2 units unless raw;
        `guarded`: -inf past the keys (and, for a read of a bias or mask, past the rows)."""
        chain, tcc, s_frag = self.chain, self.tcc, self.s_frag
        if guarded and not self.has_reads:
            limited = self.limited_guard(score, self.raw_scale is None)
            if limited is not None:
                return limited

        def one(mt: Var, nt: Var, e: Var) -> Stmt:
            r, col = self.c_map(self.lane, e)
            row = self.warp_row0(mt) + r
            key = self.kt * self.BN + nt * 8 + col
            at = {**self.head_at, chain.row[-1]: row, chain.key: key}
            here = self.SF * mt + 4 * nt + e
            s = substitute(SubexpressionReplacer({tcc.scores: s_frag[here]}).visit(score), at)
            stmts, value = self.lower.value(fold_log2e(s) if self.raw_scale is None else s)
            store = seq(*stmts, BufferStore(s_frag, (here,), cast(value, dt.float32)))
            if not guarded:
                return store
            key_ok = compare("<", key, chain.keys)
            if self.has_reads:  # a bias or mask read: only inside the rows and keys
                return IfThenElse(compare("<", row, chain.rows[-1]) & key_ok, store,
                                  BufferStore(s_frag, (here,), MINUS_INF))
            return seq(*stmts, BufferStore(s_frag, (here,), select(key_ok, cast(value, dt.float32), MINUS_INF)))
        return self.unrolled("s_m", self.MT, lambda mt: self.unrolled("s_tile", self.BN // 8, lambda nt: self.unrolled(
            "s_e", 4, lambda e: one(mt, nt, e))))

    def limited_guard(self, score: Expr, fold: bool) -> Stmt | None:
        """The guarded tile's elementwise stage with each affine condition of the mask (key_tiles.
        affine_form: c·key + a·row + rest ≤ 0) compared against ONE integer per m16 tile and
        condition, so that its register cost is that integer, not the element's row and key.

        An accumulator element sits at row R0 + rc and key K0 + kc, with R0 = the m16 tile's first
        row + the lane's row, K0 = kt·BN + the lane's column, and (rc, kc) = (8·(e // 2), 8·n +
        e % 2), constants once the element loops are unrolled (the C fragment is the lane's
        position plus the element's: checked against the table). So the condition is

            c·kc + a·rc ≤ limit,   limit = -(c·K0 + a·R0 + rest)    (one int per m16 tile)

        The key-extent test key < Sk is one more such condition, left out when isl proves every
        key of the visited tiles is inside (key_tiles.tiles_inside_keys: Sk a multiple of the
        tile, or the mask's last kept key inside). Conditions that are not affine in the row and
        key are evaluated per element as before. `fold`: log2(e) folded into the kept value (no
        raw-Σ scale). None when the fragment is not lane + element (the per-element form then)."""
        chain, BN, c_map = self.chain, self.BN, self.c_map
        if not lane_plus_element(c_map):
            return None
        value = kept(score)[1]
        flat = kept_conditions(score)
        tiles = ceil_div(chain.keys, BN) if self.bound is None else self.bound[0]
        if not tiles_inside_keys(chain, self.bx, self.BM, BN, tiles):
            flat.append(compare("<", chain.key, chain.keys))
        query, key = chain.row[-1], chain.key
        forms = [affine_form(c, query, key) for c in flat]

        def per_tile(mt: Var) -> Stmt:
            r_lane, c_lane = c_map(self.lane, 0)
            row0, key0 = self.warp_row0(mt) + r_lane, self.kt * BN + c_lane
            limits: list[tuple[Var, Expr]] = []
            for form in forms:
                if form is not None:
                    a, c, rest = form
                    limit = Var(self.unique("key_limit"), dt.int32)
                    limits.append((limit, combination([(-a, row0), (-c, key0), (-1, substitute(rest, self.head_at))])))

            def one(nt: Var, e: Var) -> Stmt:
                r, col = c_map(self.lane, e)
                (re, ce), (rz, cz) = c_map(0, e), c_map(0, 0)
                kc, rc = nt * 8 + (ce - cz), re - rz
                at = {**self.head_at, query: self.warp_row0(mt) + r, key: self.kt * BN + nt * 8 + col}
                here = self.SF * mt + 4 * nt + e
                ok: Expr | None = None
                used = iter(limits)
                for cond, form in zip(flat, forms):
                    if form is None:
                        test = substitute(cond, at)
                    else:
                        a, c, _ = form
                        test = compare("<=", combination([(c, kc), (a, rc)]), next(used)[0])
                    ok = test if ok is None else ok & test
                v = substitute(SubexpressionReplacer({self.tcc.scores: self.s_frag[here]}).visit(value), at)
                stmts, val = self.lower.value(fold_log2e(v) if fold else v)
                kept_value = cast(val, dt.float32)
                return seq(*stmts, BufferStore(self.s_frag, (here,), kept_value if ok is None else
                                               select(ok, kept_value, MINUS_INF)))
            body: Stmt = self.unrolled("s_tile", BN // 8, lambda nt: self.unrolled("s_e", 4, lambda e: one(nt, e)))
            for limit, at_tile in reversed(limits):
                body = LetStmt(limit, at_tile, body)
            return body
        return self.unrolled("s_m", self.MT, per_tile)


__all__ = ["MINUS_INF", "ScoreStage", "combination", "lane_plus_element"]
