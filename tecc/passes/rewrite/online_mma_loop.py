"""The key loop of the tensor-core attention (online_contraction_mma): the K/V ring, and the forms
of the loop around it.

The ring. The block's key tiles [first, n) (the mask's bound, key_tiles.key_tile_bound; a chunk of
them under split-KV) stream through a ring of S cp.async stages, one commit group per tile: the
fill (ring.py's `ring_fill`) puts Q and the first S - 1 tiles in flight, and iteration kt is
ring.py's `ring_step` -- wait for tile kt, publish (the Hopper form's proxy fence: wgmma reads
through the async proxy), barrier, refill tile kt + S - 1, commit -- then the tile's compute:
the scores, their elementwise stage, the softmax, O·α, O += P·V. mma.sync computes synchronously
and its ring has 2 stages; the Hopper form waits for its wgmmas in their iteration, with 2 or 3
stages.

The forms:
- plain: one loop over [first, n), each tile's elementwise stage choosing between the guarded
  and the whole form (online_mma_scores.py);
- peeled (`peel_guarded`): the whole tiles, then the guarded ones, in two loops over the same kt,
  so the ring's stages and prefetches are those of the one loop;
- overlapped (the Hopper form's `overlap`, `overlapped_loop`): S(kt + 1) and its softmax while
  P(kt)·V is in flight, over a 3-stage ring (FlashAttention-3's intra-warpgroup pipelining); its
  head is the same ring_step, one tile ahead of the scores it computes, the refill unguarded;
- persistent (`persistent` = P, `persistent_body`): P blocks loop over the (query block, head)
  work items (tile_kernel.persistent_trips, as the GEMM's persistent grid), the next item's Q
  and first tile loaded under this item's epilogue.
"""

from __future__ import annotations

from typing import Sequence

from ...ir import dtype as dt
from ...ir.expr import Const, Expr, Var, binary, compare, size_product, substitute
from ...ir.stmt import (
    AsyncCommit,
    AsyncProxyFence,
    AsyncWait,
    Barrier,
    For,
    IfThenElse,
    LetStmt,
    Stmt,
    WarpgroupCommit,
    WarpgroupFence,
    WarpgroupWait,
    seq,
)
from ..schedule.ring import ring_fill, ring_step
from ..schedule.tile_kernel import ceil_div, persistent_trips
from ..substitute import substitute_stmt
from .launch_order import work_item
from .online_mma_split_kv import SplitKV


class KeyLoop(SplitKV):
    """The key tiles of the block, the ring and the loop's forms (module docstring)."""

    def key_range(self) -> None:
        """`first_tile` and `n_tiles`: the block's key tiles [first_tile, n_tiles), all of them or
        the mask's bound (`masked_tiles`), and under split-KV this block's chunk of them."""
        self.n_tiles: Expr = (ceil_div(self.chain.keys, self.BN) if self.bound is None
                              else substitute(self.bound[0], self.head_at))
        self.first_tile: Expr = Const(0, dt.int32)
        if self.t.splits > 1:   # split-KV: this block's chunk of the key tiles, within the proven range
            self.first_tile = self.bz * self.chunk_tiles()
            self.n_tiles = binary("min", self.n_tiles, self.first_tile + self.chunk_tiles())

    def ring_prologue(self) -> Stmt:
        """Q and the ring's first tiles, one commit group each (Q with the first): S - 1 tiles,
        but one in the overlapped form (its loop's prologue issues the second)."""
        first, S = self.first_tile, self.stages
        fill = 1 if self.overlap else S - 1
        return seq(self.copy_q(), *ring_fill(fill, lambda s: IfThenElse(
            compare("<", first + s, self.n_tiles), self.load_kv((first + s) % S, first + s))))

    # ---- the plain and the peeled loop --------------------------------------------------------------

    def plain_loop(self, scores: Stmt, elementwise: Stmt) -> Stmt:
        """The key loop (module docstring), peeled in two when asked and some tiles are whole."""
        stage = self.kt % self.stages
        if self.wg:   # P and the stage are free before the next iteration once the wgmmas are waited for
            values = self.wgmma_group([self.wgmma_values(stage)], (self.o_frag,))
        else:
            values = self.values(stage)
        first, n_tiles = self.first_tile, self.n_tiles
        if self.t.peel_guarded and self.unmasked is not None:
            # the whole tiles, then the guarded ones: kt runs on, so the ring's stages and the
            # prefetch of the next tile are those of the one loop
            split = binary("max", first, binary("min", self.unmasked, n_tiles))
            return seq(self.key_loop(first, split, scores, self.whole, values),
                       self.key_loop(split, n_tiles, scores, self.guarded, values))
        return self.key_loop(first, n_tiles, scores, elementwise, values)

    def key_loop(self, lo: Expr, hi: Expr, scores: Stmt, elementwise: Stmt, values: Stmt) -> Stmt:
        """Tiles [lo, hi) of the ring (ring_step), each computed: S, f(S), the softmax, O·α, O += P·V.
        The Hopper form's tile kt (and Q) has landed once S - 2 later groups at most are in
        flight; the copies are generic-proxy writes, which wgmma (the async proxy) sees after the
        fence; then every thread's copies, and every warpgroup's wgmmas of tile kt - 1, are
        complete, so its stage (that of tile kt + S - 1) may be refilled."""
        zero = Const(0, dt.int32)
        lookahead = self.stages - 1
        ahead = self.kt + lookahead   # the tile this iteration starts loading
        publish = [AsyncProxyFence()] if self.wg else []
        return For(self.kt, lo, binary("max", hi - lo, zero), "serial", seq(
            *ring_step(lookahead, publish, ahead, self.n_tiles, self.load_kv(ahead % self.stages, ahead)),
            scores,
            elementwise,
            self.softmax(),
            self.rescale_output(),
            values,
        ))

    # ---- the overlapped Hopper loop -----------------------------------------------------------------

    def overlapped_loop(self, prologue: Stmt, elementwise: Stmt) -> tuple[Stmt, Stmt]:
        """The Hopper form with S(kt + 1) = Q·K(kt + 1)ᵀ in flight during P(kt)·V and the softmax
        of tile kt + 1 during P(kt)·V (FlashAttention-3's intra-warpgroup pipelining), over a
        3-stage ring: (the loop, the prologue). The softmax (`elementwise`, the statistics and
        float32 weights of tile kt) leaves the weights in s_frag; `convert` rounds them into
        p_frag and rescales O. Iteration kt:

            cp.async.wait_group 0; fence.proxy.async; barrier   tile kt + 1 landed; tile kt - 1's stage free
            tile kt + 2 -> stage (kt + 2) % 3; commit
            wgmma.fence; S = Q·K(kt + 1)ᵀ; commit                (group A)
            O += P·V(kt); commit                                  (group B: P from registers)
            wait_group 1 (A done); [kt + 1 < n] softmax(kt + 1) in s_frag   (B in flight: O, P untouched)
            wait_group 0 (B done); [kt + 1 < n] P = s_frag rounded; O·α

        The copies and S(kt + 1) are issued even past the block's last tile (keys past the end are
        zero-filled, the scores unused): with the wgmma under a condition that the softmax's
        `kt + 1 < n` does not provably match, ptxas serializes the wgmmas (C7514).
        """
        zero, one = Const(0, dt.int32), Const(1, dt.int32)
        S, n_tiles, s_frag = self.stages, self.n_tiles, self.s_frag
        softmax, convert = seq(elementwise, self.softmax()), self.convert()

        def scores(stage: Expr) -> Stmt:
            return seq(self.wgmma_scores(stage), WarpgroupCommit())
        nxt = self.kt + 1
        has_next = compare("<", nxt, n_tiles)
        pv = seq(self.wgmma_values(self.kt % S), WarpgroupCommit())
        first = seq(
            AsyncWait(1),           # Q and tile 0 (tile 1 may be in flight)
            AsyncProxyFence(),
            Barrier(),
            WarpgroupFence(),
            scores(zero),
            WarpgroupWait(0, (s_frag,)),
            substitute_stmt(softmax, {self.kt: zero}),
            substitute_stmt(convert, {self.kt: zero}))
        start = seq(
            prologue,  # Q and tile 0: one group
            self.load_kv(one, one),
            AsyncCommit(),
            IfThenElse(compare("<", zero, n_tiles), first))
        ahead = self.kt + 2
        loop = For(self.kt, zero, n_tiles, "serial", seq(
            # the ring one tile ahead of the tile whose scores this iteration computes (kt + 1)
            *ring_step(1, [AsyncProxyFence()], ahead, n_tiles, self.load_kv(ahead % S, ahead), guarded=False),
            WarpgroupFence(),
            scores(nxt % S),
            pv,
            WarpgroupWait(1, (s_frag,)),
            IfThenElse(has_next, substitute_stmt(softmax, {self.kt: nxt})),
            WarpgroupWait(0, (self.o_frag,)),
            IfThenElse(has_next, substitute_stmt(convert, {self.kt: nxt})),
        ))
        return loop, start

    # ---- the persistent grid ------------------------------------------------------------------------

    def work_items(self) -> Expr:
        return ceil_div(self.chain.rows[-1], self.BM) * size_product(self.chain.rows[:-1])

    def persistent_body(self, q_copy: Stmt, init: Stmt, loop: Stmt, finish: Sequence[Stmt],
                        order: tuple[int, bool, str]) -> Stmt:
        """The persistent form (the Hopper form's `persistent` = P blocks): block p runs the work
        items p, p + P, .. (launch_order.work_item: query block major, the longest first), each
        item the plain block's key loop and epilogue; the next item's Q tile and first K/V tile
        (q_copy, one commit group) are issued before this item's epilogue, after a barrier that
        orders every warpgroup's last wgmmas (which read Q and the ring) before the copies
        overwrite them, so the loads run under the epilogue's normalization and stores.

            [p < W] copy Q, K/V tile 0 of item p; commit
            for it < ceil((W - p) / P):  item = p + it·P  (query_block, head from it)
              init; key loop; wait_group 0; barrier
              [item + P < W] copy Q, K/V tile 0 of item + P; commit
              epilogue
            wait_group 0
        """
        zero = Const(0, dt.int32)
        P = Const(self.t.persistent, dt.int32)
        W = self.work_items()
        item, it = Var(self.unique("work_item"), dt.int32), Var(self.unique("work"), dt.int32)

        def at(linear: Expr) -> dict[Var, Expr]:
            qb, head = work_item(self.chain, self.BM, order, linear, self.t.plain_order)
            return {self.bx: qb, self.by: head} if self.chain.rows[:-1] else {self.bx: qb}

        body: Stmt = seq(init, loop, AsyncWait(0), Barrier(),
                         IfThenElse(compare("<", item + P, W), substitute_stmt(q_copy, at(item + P))),
                         *finish)
        here = at(item)
        if self.chain.rows[:-1]:
            body = LetStmt(self.by, here[self.by], body)
        body = LetStmt(item, self.pb + it * P, LetStmt(self.bx, here[self.bx], body))
        items = For(it, zero, persistent_trips(W, self.pb, self.t.persistent), "serial", body)
        return seq(IfThenElse(compare("<", self.pb, W), substitute_stmt(q_copy, at(self.pb))), items, AsyncWait(0))


__all__ = ["KeyLoop"]
