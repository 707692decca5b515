"""The backward's row-side outputs (dQ) by a query-major kernel instead of float32 atomics: the
transpose of online_backward_mma's key-block-major kernel. One block per (BM query rows, query
head), warp w owning rows 16w .. 16w + 15; the row operands (Q, dO) and row statistics (lse, Δ)
are staged once, then for every key block of BN keys the mask keeps (key_tiles.key_tile_bound,
the forward's isl-proven bound):

    wait; barrier; the next key block's K, V -> the other stage of a 2-stage cp.async ring
    S = Q·Kᵀ, dP = dO·Vᵀ       each row-key contraction into C fragments (16 queries x BN keys)
    P = exp(s - lse) in place; each row-side output's w (dS·scale) rounded into its A fragment
    dQ += dS·K                 A from registers (the C-to-A identity), B = the key tile (ldmatrix.trans)

and dQ through its epilogue (the cast) straight to global memory: no accumulator, no conversion,
the same result every run. It recomputes the two row-key contractions the key-block-major kernel
already did, so a tile costs 7 contractions instead of 5 over the two kernels; the strategy's
workload prices both ways (strategies/online_backward.py).
"""

from __future__ import annotations

from types import SimpleNamespace

from ...ir import dtype as dt
from ...ir.errors import ScheduleError
from ...ir.expr import Const, Expr, TensorRead, Var, binary, compare, const_int, size_product
from ...ir.stmt import (
    Allocate,
    AsyncWait,
    Buffer,
    BufferStore,
    For,
    FragmentRef,
    IfThenElse,
    LetStmt,
    PrimFunc,
    Stmt,
    seq,
)
from ..schedule.ring import ring_fill, ring_step
from ..schedule.tensorize import load_a_fragment, load_b_fragments
from .key_tiles import kept_conditions, key_tile_bound
from .mma_tiles import check_relayout, two_n8_tiles
from .online_backward_dropout import query_major_keeps
from .online_backward import BackwardChain
from .online_backward_kernels import STAGES, WHERE, BackwardKernels, Tiles, tile_key, unflatten, vanishes
from .online_contraction import MAX_GRID_Y


class QueryMajor(BackwardKernels):
    """The query-major kernel of the row-side outputs (module docstring)."""

    def __init__(self, chain: BackwardChain, rows: int, key_tile: int, name: str | None,
                 like: BackwardKernels | None = None) -> None:
        super().__init__(chain, 2 * rows, False, name, like)
        self.BM, self.BN = rows, key_tile
        u = self.unique
        self.qb, self.by = Var(u("query_block"), dt.int32), Var(u("head"), dt.int32)
        self.kt = Var(u("key_step"), dt.int32)
        self.outputs = chain.of_kind("row")
        self.skipping = "every key block visited"
        self.whole = ""

    def kernel(self) -> PrimFunc:
        chain, BM, BN = self.chain, self.BM, self.BN
        zero = Const(0, dt.int32)
        heads = tuple(chain.lead_extents) + tuple(Const(g, dt.int32) for g in chain.group_extents)
        n_heads = size_product(heads)
        if (const_int(n_heads) or 0) > MAX_GRID_Y:
            raise ScheduleError(f"{WHERE}: {const_int(n_heads)} heads exceed the grid's y extent {MAX_GRID_Y}")
        self._buffers()
        self.q0 = Var(self.unique("query0"), dt.int32)
        n_keys = self._key_blocks()
        stage = self.kt % STAGES
        ahead = STAGES - 1   # key blocks in flight beyond the one computed
        step = seq(
            *ring_step(ahead, self._publish(), self.kt + ahead, n_keys, self._copy_keys((self.kt + ahead) % STAGES,
                                                                                        self.kt + ahead)),
            self._contractions(stage),
            self._elementwise(stage),
            self._row_side(stage),
        )
        body: Stmt = seq(
            *(self.unrolled("acc_zero", o.columns // 2, lambda e, acc=self.accs[id(o.tensor)]:
                            BufferStore(acc, (e,), Const(0.0, dt.float32))) for o in self.outputs),
            self._copy_rows(),
            *ring_fill(ahead, lambda s: IfThenElse(compare("<", Const(s, dt.int32), n_keys),
                                                   self._copy_keys(Const(s, dt.int32), Const(s, dt.int32)))),
            For(self.kt, zero, n_keys, "serial", step),
            AsyncWait(0),
            self._epilogue(),
        )
        body = LetStmt(self.q0, self.qb * BM, body)
        names = tuple(chain.lead) + tuple(chain.groups)
        for v, value in reversed(list(zip(names, unflatten(self.by, heads)))):
            body = LetStmt(v, value, body)
        for buf in reversed(self._allocations()):
            body = Allocate(buf, body)
        body = For(self.tx, zero, Const(self.threads, dt.int32), "threadIdx.x", body)
        body = For(self.qb, zero, (chain.rows[-1] + (BM - 1)) // BM, "blockIdx.x", body)
        if names:
            body = For(self.by, zero, n_heads, "blockIdx.y", body)
        what = (f"{self.form()}: blocks of {BM} query rows, key blocks of {BN} through a "
                f"{STAGES}-stage cp.async ring; {', '.join(o.tensor.name for o in self.outputs)} in registers; "
                f"{self.skipping}; {self.whole}")
        return self._func(self.unique(f"{self._label()}_backward_rows_kernel"), body, what)

    def form(self) -> str:
        return f"{self.intrinsic} ({self.warps} warps of 16 rows)"

    def _key_blocks(self) -> Expr:
        """The key blocks this query block visits: all, or the forward's isl-proven bound when
        every output's weight vanishes where P does."""
        chain = self.chain
        blocks = (chain.keys + (self.BN - 1)) // self.BN
        if not all(vanishes(o.weight, chain.probs) for o in self.outputs):
            return blocks
        view = SimpleNamespace(row=(chain.query,), key=chain.key, score=chain.score, rows=chain.rows, keys=chain.keys)
        found = key_tile_bound(view, self.qb, self.BM, self.BN)  # type: ignore[arg-type]
        if found is None:
            return blocks
        self.skipping = found[1]
        return binary("min", found[0], blocks)

    def _buffers(self) -> None:
        chain, BM, BN = self.chain, self.BM, self.BN
        self.row_tiles: Tiles = {}
        self.key_tiles: Tiles = {}
        for c in chain.contractions:
            self._tile(self.row_tiles, c.row_operand, 1, BM, "row_tile")
            self._tile(self.key_tiles, c.key_operand, STAGES, BN, "key_tile")
        for o in self.outputs:
            assert o.operand is not None
            self._tile(self.key_tiles, o.operand, STAGES, BN, "key_tile")
        self.staged_reads(1, BM)
        self._fragments()

    def _fragments(self) -> None:
        BN, intr = self.BN, self.intrinsic
        self.a_frag, self.b_frag = self.frag("a_frag", intr, "a", 8), self.frag("b_frag", intr, "b", 8)
        self.c_frags = {id(c.node): self.frag("tile_frag", intr, "c", BN // 2) for c in self.chain.contractions}
        self.w_frags = {id(o.tensor): self.frag("weight_frag", intr, "a", BN // 2) for o in self.outputs}
        self.accs = {id(o.tensor): self.frag("acc_frag", intr, "c", o.columns // 2) for o in self.outputs}
        check_relayout(intr, intr, WHERE)

    def _tile_buffer(self, label: str, read: TensorRead, stages: int, rows: int, width: int) -> Buffer:
        return self.shared(label, read, stages, rows, width)

    def _publish(self) -> list[Stmt]:
        """What makes the ring's copies readable by the contractions before the barrier."""
        return []

    def _tile(self, table: Tiles, read: TensorRead,
              stages: int, rows: int, label: str) -> None:
        width = const_int(read.tensor.shape[-1])
        if width is None or width % 16 or width > 128 or read.dtype != self.dtype:
            raise ScheduleError(f"{WHERE}: {read.tensor.name} is not a {self.dtype} tile of 16..128 whole columns")
        if tile_key(read) not in table:
            table[tile_key(read)] = (self._tile_buffer(label, read, stages, rows, width), read)

    def _allocations(self) -> list[Buffer]:
        out = [b for b, _ in self.row_tiles.values()] + [b for b, _ in self.key_tiles.values()]
        out += [b for b, _ in self.stat_tiles.values()]
        out += [self.a_frag, self.b_frag, *self.c_frags.values(), *self.w_frags.values(), *self.accs.values()]
        return out + list(self.lower.allocs)

    def _copy_rows(self) -> Stmt:
        chain, zero = self.chain, Const(0, dt.int32)
        copies = [self.copy_tile(buf, zero, read, {}, self.q0, chain.rows[-1], self.BM, self.tile_width(buf))
                  for buf, read in self.row_tiles.values()]
        for buf, read in self.stat_tiles.values():
            copies.append(self.unrolled("stat_copy", -(-self.BM // self.threads), lambda u, buf=buf, read=read:
                                        self.stat_copy(buf, read, zero, {}, self.q0, u)))
        return seq(*copies)

    def _copy_keys(self, stage: Expr, block: Expr) -> Stmt:
        chain = self.chain
        return seq(*(self.copy_tile(buf, stage, read, {}, block * self.BN, chain.keys, self.BN, self.tile_width(buf))
                     for buf, read in self.key_tiles.values()))

    def _contractions(self, stage: Expr) -> Stmt:
        """Σ_x A[query, x]·B[key, x] into C fragments of 16 queries (the warp's) x BN keys: A = the
        row tile (plain ldmatrix), B = the key tile ([n][k])."""
        out: list[Stmt] = []
        zero = Const(0, dt.int32)
        for c in self.chain.contractions:
            frag = self.c_frags[id(c.node)]
            row_tile = self.row_tiles[tile_key(c.row_operand)][0]
            key_tile = self.key_tiles[tile_key(c.key_operand)][0]

            def step(kd: Var, frag: Buffer = frag, row_tile: Buffer = row_tile, key_tile: Buffer = key_tile) -> Stmt:
                def pair(nk: Var) -> Stmt:
                    return seq(load_b_fragments(FragmentRef(self.b_frag, zero), key_tile, stage, nk * 16, kd * 16,
                                                self.lane, True),
                               two_n8_tiles(self.intrinsic, frag, 8 * nk, FragmentRef(self.a_frag, zero), self.b_frag))
                return seq(load_a_fragment(FragmentRef(self.a_frag, zero), row_tile, zero, self.warp * 16, kd * 16,
                                           self.lane, True),
                           self.unrolled("key_pair", self.BN // 16, pair))
            out.append(seq(self.unrolled("tile_zero", self.BN // 2,
                                         lambda e, frag=frag: BufferStore(frag, (e,), Const(0.0, dt.float32))),
                           self.unrolled("depth_step", c.depth // 16, step, self.rolled)))
        return seq(*out)

    def _elementwise(self, stage: Expr) -> Stmt:
        """P in place of the score's fragment, then each row-side output's weight into its A
        fragment (0 past the keys or the queries; no guard on whole tiles)."""
        chain = self.chain
        score_frag = self.c_frags[id(self.score_node())]
        whole = self.whole_tiles(self.q0, self.kt * self.BN, self.BM, self.BN)
        inside = self.inside_tiles(self.q0, self.kt * self.BN, self.BM, self.BN, whole)
        kept = {c: Const(True, dt.bool_) for c in kept_conditions(chain.score)}

        def one(nt: Var, e: Expr, guarded: bool | str, keep: dict[Expr, Expr] | None = None) -> Stmt:
            rr, cc = self.c_map(self.lane, e)
            here = 4 * nt + e
            query = self.q0 + self.warp * 16 + rr
            key = self.kt * self.BN + nt * 8 + cc
            ok: Expr = compare("<", key, chain.keys) & compare("<", query, chain.rows[-1])
            repl: dict[Expr, Expr] = {c.node: self.c_frags[id(c.node)][here] for c in chain.contractions}
            for buf, read in self.stat_tiles.values():
                repl[read] = buf[Const(0, dt.int32), self.warp * 16 + rr]
            repl.update(keep or {})
            repl, wrepl, ok = self.element_mode(guarded, repl, ok, kept)
            at = {chain.query: query, chain.key: key}
            stmts: list[Stmt] = [self._guarded(score_frag, (here,), self.probability(repl, at), ok)]
            for o in self.outputs:
                w = self.weight(o, wrepl, score_frag[here], at)
                stmts.append(self._guarded(self.w_frags[id(o.tensor)], (here,), w, ok))
            return seq(*stmts)

        return self.elementwise_tiles(one, self.BN // 8, whole, lambda form, nt: query_major_keeps(
            form, self.lane, self.q0 + self.warp * 16, self.kt * self.BN + nt * 8, self.unique, self.lower.value,
            chain.query, chain.key), inside)

    def _row_side(self, stage: Expr) -> Stmt:
        """acc[16 queries x C] += w·Y: A = w from registers (k16 step kk of the keys), B = Y's key
        tile [key][column] (ldmatrix.trans)."""
        out: list[Stmt] = []
        for o in self.outputs:
            assert o.operand is not None
            tile = self.key_tiles[tile_key(o.operand)][0]
            acc, w = self.accs[id(o.tensor)], self.w_frags[id(o.tensor)]

            def step(kk: Var, tile: Buffer = tile, acc: Buffer = acc, w: Buffer = w, columns: int = o.columns) -> Stmt:
                def pair(dn: Var) -> Stmt:
                    return seq(load_b_fragments(FragmentRef(self.b_frag, Const(0, dt.int32)), tile, stage, dn * 16,
                                                kk * 16, self.lane, False),
                               two_n8_tiles(self.intrinsic, acc, 8 * dn, FragmentRef(w, 8 * kk), self.b_frag))
                return self.unrolled("column_pair", columns // 16, pair)
            out.append(self.unrolled("key_step", self.BN // 16, step))
        return seq(*out)

    def _epilogue(self) -> Stmt:
        """Each row-side output's element (query, column) through its epilogue, rows past the end
        not stored."""
        return self.fragment_outputs(self.outputs, self.chain.query, self.q0, self.chain.rows[-1],
                                     [b for b, _ in [*self.key_tiles.values(), *self.row_tiles.values()]])


__all__ = ["QueryMajor"]
