"""The backward's key-block-major kernel on mma.sync (online_backward_mma's docstring, 2.), written
as separate pieces: staging (`_copy_keys`, `_copy_rows`: TileStaging's cp.async tiles), the
contractions (`_contractions`, `_key_side`, `_row_side`), the recomputed probabilities and
weights (`_elementwise`) and the epilogue (`_epilogue`); what the backward's kernels share (the
pre-pass, the conversion, P and the weights of one element, the guard) is
online_backward_kernels'. Its Hopper form (online_backward_wgmma) is a subclass.
"""

from __future__ import annotations

from typing import Callable

from ...ir import dtype as dt
from ...ir.errors import ScheduleError
from ...ir.expr import (
    Const,
    Expr,
    TensorRead,
    Var,
    atomic_add,
    binary,
    cast,
    compare,
    const_int,
    size_product,
    substitute,
)
from ...ir.stmt import (
    Allocate,
    AsyncWait,
    Barrier,
    Buffer,
    BufferStore,
    Evaluate,
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
from ..schedule.tile_staging import row_swizzle
from .key_tiles import kept_conditions, query_block_start
from .mma_tiles import check_relayout, two_n8_tiles
from .online_backward import BackwardChain
from .online_backward_dropout import key_major_keeps
from .online_backward_kernels import (
    STAGES,
    WHERE,
    BackwardKernels,
    Tiles,
    by_tile,
    tile_key,
    unflatten,
)
from .online_contraction import MAX_GRID_Y


class KeyMajor(BackwardKernels):
    """The key-block-major kernel (online_backward_mma's docstring, 2.): the key-side outputs in registers, the
    tile outputs to global memory, the row-side ones by float32 atomics when `atomics`."""

    # the depth of the query blocks' cp.async ring (the step's `stages`: 2..4, `stages - 1` blocks
    # in flight beyond the one computed)
    stages = STAGES

    def __init__(self, chain: BackwardChain, key_tile: int, rows: int, dq_columns: int, atomics: bool,
                 name: str | None) -> None:
        super().__init__(chain, 2 * key_tile, atomics, name)
        self.BN, self.BM, self.NQ = key_tile, rows, dq_columns
        u = self.unique
        self.kb, self.by = Var(u("key_block"), dt.int32), Var(u("head"), dt.int32)
        self.it = Var(u("step"), dt.int32)

    # ---- the main kernel --------------------------------------------------------------------------

    def main_kernel(self) -> PrimFunc:
        chain, BN, BM = self.chain, self.BN, self.BM
        zero = Const(0, dt.int32)
        n_heads = size_product(chain.lead_extents)
        self._stage_buffers()
        count, first = self._query_blocks()
        if not self.longest_first and (const_int(n_heads) or 0) > MAX_GRID_Y:
            raise ScheduleError(f"{WHERE}: {const_int(n_heads)} heads exceed the grid's y extent {MAX_GRID_Y}")
        groups = 1
        for g in chain.group_extents:
            groups *= g
        n_steps = Const(groups, dt.int32) * count

        def at_step(step: Expr) -> tuple[dict[Var, Expr], Expr]:
            """The group variables and the first query row of iteration `step` (0 <= step <
            n_steps: with one group the step is the query block's offset, no division)."""
            if groups == 1:
                return {}, (first + step) * BM
            g_flat, qb = step // count, first + step % count
            ext = tuple(Const(n, dt.int32) for n in chain.group_extents)
            return dict(zip(chain.groups, unflatten(g_flat, ext))), qb * BM

        def bound(step: Expr, body: Callable[[dict[Var, Expr], Expr], Stmt]) -> Stmt:
            """`body` of iteration `step`'s group variables and first query row, each computed
            once (LetStmt) rather than in every copy's address."""
            values, q0 = at_step(step)
            names = {g: Var(self.unique(f"{g.name}_next"), dt.int32) for g in values}
            q0_var = Var(self.unique("query0_next"), dt.int32)
            out = body(dict(names), q0_var)
            out = LetStmt(q0_var, q0, out)
            for g, value in reversed(list(values.items())):
                out = LetStmt(names[g], value, out)
            return out

        ahead = self.stages - 1   # query blocks in flight beyond the one computed
        here, q0 = at_step(self.it)
        stage = self.it % self.stages
        self.q0 = Var(self.unique("query0"), dt.int32)
        refill = bound(self.it + ahead, lambda nxt, q0_next: self._copy_rows((self.it + ahead) % self.stages, nxt,
                                                                               q0_next))
        head = ring_step(ahead, self._publish(), self.it + ahead, n_steps, refill)
        # the wait, the publish and the barrier; then the refill and its commit (after the
        # contractions' first wait where the last step's key-side wgmmas are left in flight:
        # the refilled stage is the one they read)
        top, refill_commit = head[:-2], head[-2:]
        step_body = seq(
            *top,
            *([] if self.overlap else refill_commit),
            self._contractions(stage),
            *(refill_commit if self.overlap else []),
            self._elementwise(stage),
            self._key_side(stage),
            self._row_side(),
        )
        for g, value in reversed(list(here.items())):
            step_body = LetStmt(g, value, step_body)
        step_body = LetStmt(self.q0, q0, step_body)

        def fill(s: int) -> Stmt:
            """The ring's fill: query block s of the key block into stage s (block 0 at the first
            query block the mask keeps, as the loop's first step reads it)."""
            if s == 0:
                return IfThenElse(compare("<", zero, n_steps), self._copy_rows(zero, at_step(zero)[0], first * BM))
            at = Const(s, dt.int32)
            return IfThenElse(compare("<", at, n_steps), bound(at, lambda g, q: self._copy_rows(at, g, q)))

        body = seq(
            self._init(),
            self._copy_keys(),
            *ring_fill(ahead, fill),
            For(self.it, zero, n_steps, "serial", step_body),
            self._drain(n_steps),
            AsyncWait(0),
            self._epilogue(),
        )
        for v, value in reversed(list(zip(chain.lead, unflatten(self.by, chain.lead_extents)))):
            body = LetStmt(v, value, body)
        for buf in reversed(self._allocations()):
            body = Allocate(buf, body)
        body = For(self.tx, zero, Const(self.threads, dt.int32), "threadIdx.x", body)
        key_blocks = (chain.keys + (BN - 1)) // BN
        if self.longest_first and chain.lead:
            # the heads along x, launched first: every head's first key block (the most query
            # blocks under the mask), then every head's second, ... -- the longest blocks first,
            # so the last wave is not one long block on an otherwise idle GPU
            body = For(self.by, zero, n_heads, "blockIdx.x", For(self.kb, zero, key_blocks, "blockIdx.y", body))
        else:
            body = For(self.kb, zero, key_blocks, "blockIdx.x", body)
            if chain.lead:
                body = For(self.by, zero, n_heads, "blockIdx.y", body)
        return self._func(self.unique(f"{self._label()}_backward_mma_kernel"), body, self.describe())

    # the key-side contractions of a step left in flight into the next (the Hopper form's)
    overlap = False

    def _drain(self, n_steps: Expr) -> Stmt:
        """What completes the loop's last in-flight work before the epilogue (nothing here; the
        loop ran `n_steps` steps)."""
        return seq()

    def describe(self) -> str:
        chain = self.chain
        outs = ", ".join(f"{o.tensor.name} ({o.kind} side)" if o.kind != "tile" else f"{o.tensor.name} (tile)"
                         for o in chain.outputs)
        return (f"{self.intrinsic}: blocks of {self.BN} keys ({self.warps} warps of 16), query blocks of {self.BM} "
                f"through a {self.stages}-stage cp.async ring; {outs}; {self.skipping}; {self.whole}")

    def _query_blocks(self) -> tuple[Expr, Expr]:
        """(query blocks this key block visits, the first), from the mask (isl, key_tiles)."""
        chain = self.chain
        blocks = (chain.rows[-1] + (self.BM - 1)) // self.BM
        self.skipping = "every query block visited"
        self.longest_first = False   # key blocks of unequal work launched longest first (main_kernel)
        if chain.of_kind("tile") or not self.weights_vanish:
            return blocks, Const(0, dt.int32)
        found = query_block_start(kept_conditions(chain.score), chain.query, chain.key, self.kb, self.BN, self.BM,
                                  chain.rows[-1], chain.keys)
        if found is None:
            return blocks, Const(0, dt.int32)
        first = binary("min", found[0], blocks)
        self.skipping = found[1]
        self.longest_first = const_int(first) is None   # a first query block that varies with the key block
        return blocks - first, first

    def _stage_buffers(self) -> None:
        """Shared tiles: the key operands once, the row operands and row statistics per query block
        (a ring), the row-side weights' [BN][BM] tile; fragments and accumulators."""
        chain, BN, BM = self.chain, self.BN, self.BM
        self.key_tiles: Tiles = {}
        self.row_tiles: Tiles = {}

        def whole(read: TensorRead, width: int, what: str) -> int:
            n = const_int(read.tensor.shape[-1])
            if n != width or width % 16 or width > 128:
                raise ScheduleError(f"{WHERE}: {what} reads {read.tensor.name} over {width} of its {read.tensor.shape[-1]} "
                                    "columns; the tiles are whole rows of 16..128 columns")
            if read.dtype != self.dtype:
                raise ScheduleError(f"{WHERE}: {read.tensor.name} is {read.dtype}, the other operands {self.dtype}")
            return n

        def tile(table: dict, read: TensorRead, stages: int, rows: int, width: int, label: str) -> None:
            if tile_key(read) not in table:
                table[tile_key(read)] = (self._tile_buffer(label, read, stages, rows, width), read)
        for c in chain.contractions:
            tile(self.key_tiles, c.key_operand, 1, BN, whole(c.key_operand, c.depth, str(c.node)), "key_tile")
            tile(self.row_tiles, c.row_operand, self.stages, BM, whole(c.row_operand, c.depth, str(c.node)), "row_tile")
        for o in chain.outputs:
            if o.operand is None:
                continue
            width = whole(o.operand, o.columns, o.tensor.name)
            if o.kind == "key":
                tile(self.row_tiles, o.operand, self.stages, BM, width, "row_tile")
            else:
                tile(self.key_tiles, o.operand, 1, BN, width, "key_tile")
        self.staged_reads(self.stages, BM)
        self.weights_tile = self._weights_buffer() if self.row_side else None
        self._fragments()

    def _tile_buffer(self, label: str, read: TensorRead, stages: int, rows: int, width: int) -> Buffer:
        """A staged operand tile [stages][rows][width] (XOR-swizzled for ldmatrix)."""
        return self.shared(label, read, stages, rows, width)

    def _weights_buffer(self) -> Buffer:
        """The row-side weights' tile [1][BN keys][BM queries], read by ldmatrix.trans as A."""
        return Buffer(self.unique("weights_tile"), self.dtype,
                      (Const(1, dt.int32), Const(self.BN, dt.int32), Const(self.BM, dt.int32)), "shared",
                      tensor="dS.shared", layout=row_swizzle(self.BM))

    def _weights_index(self, rr: Expr, cc: Expr, nt: Expr) -> tuple[Expr, ...]:
        """Where the element at the warp's key row rr, query column cc of n8 tile nt goes in it."""
        return Const(0, dt.int32), self.warp * 16 + rr, nt * 8 + cc

    def _fragments(self) -> None:
        chain, BM, intr = self.chain, self.BM, self.intrinsic
        self.a_frag, self.b_frag = self.frag("a_frag", intr, "a", 8), self.frag("b_frag", intr, "b", 8)
        self.c_frags = {id(c.node): self.frag("tile_frag", intr, "c", BM // 2) for c in chain.contractions}
        self.w_frags = {id(o.tensor): self.frag("weight_frag", intr, "a", BM // 2) for o in chain.of_kind("key")}
        self.accs = {id(o.tensor): self.frag("acc_frag", intr, "c", o.columns // 2) for o in chain.of_kind("key")}
        self.dq_frag = self.frag("row_frag", intr, "c", self.NQ // 2) if self.row_side else None
        check_relayout(intr, intr, WHERE)

    def _publish(self) -> list[Stmt]:
        """What makes the ring's copies readable by the contractions before the barrier of the
        loop head (ring.ring_step: the query block's tiles landed for every thread, every warp
        done with the last iteration's, whose stage is refilled next)."""
        return []

    def _allocations(self) -> list[Buffer]:
        out = [b for b, _ in self.key_tiles.values()] + [b for b, _ in self.row_tiles.values()]
        out += [b for b, _ in self.stat_tiles.values()]
        out += [self.weights_tile] if self.weights_tile is not None else []
        out += [self.a_frag, self.b_frag, *self.c_frags.values(), *self.w_frags.values(), *self.accs.values()]
        out += [self.dq_frag] if self.dq_frag is not None else []
        return out + list(self.lower.allocs)

    def _init(self) -> Stmt:
        return seq(*(self.unrolled("acc_zero", int(const_int(acc.shape[0]) or 0),
                                   lambda e, acc=acc: BufferStore(acc, (e,), Const(0.0, dt.float32)))
                     for acc in self.accs.values()))

    def _copy_keys(self) -> Stmt:
        chain = self.chain
        zero_groups = {g: Const(0, dt.int32) for g in chain.groups}
        return seq(*(self.copy_tile(buf, Const(0, dt.int32), read, zero_groups, self.kb * self.BN, chain.keys, self.BN,
                                    self.tile_width(buf))
                     for buf, read in self.key_tiles.values()))

    def _copy_rows(self, stage: Expr, groups: dict[Var, Expr], q0: Expr) -> Stmt:
        """The row operands and row statistics of the query block at `q0` for `groups` -> `stage`."""
        chain = self.chain
        copies = [self.copy_tile(buf, stage, read, groups, q0, chain.rows[-1], self.BM, self.tile_width(buf))
                  for buf, read in self.row_tiles.values()]
        for buf, read in self.stat_tiles.values():
            copies.append(self.unrolled("stat_copy", -(-self.BM // self.threads), lambda u, buf=buf, read=read:
                                        self.stat_copy(buf, read, stage, groups, q0, u)))
        return seq(*copies)

    # ---- the tile's contractions, elementwise stage and mma ------------------------------------------

    def _contractions(self, stage: Expr) -> Stmt:
        """Each row-key contraction Σ_x B[key, x]·A[query, x] into C fragments: 16 keys (the warp's)
        x BM queries; A = the key tile's rows (plain ldmatrix), B = the row tile ([n][k])."""
        out: list[Stmt] = []
        for c in self.chain.contractions:
            frag = self.c_frags[id(c.node)]
            key_tile = self.key_tiles[tile_key(c.key_operand)][0]
            row_tile = self.row_tiles[tile_key(c.row_operand)][0]

            def step(kd: Var, frag: Buffer = frag, key_tile: Buffer = key_tile, row_tile: Buffer = row_tile) -> Stmt:
                def pair(nq: Var) -> Stmt:
                    return seq(load_b_fragments(FragmentRef(self.b_frag, 0), row_tile, stage, nq * 16, kd * 16, self.lane,
                                                True),
                               two_n8_tiles(self.intrinsic, frag, 8 * nq, FragmentRef(self.a_frag, 0), self.b_frag))
                return seq(load_a_fragment(FragmentRef(self.a_frag, 0), key_tile, Const(0, dt.int32), self.warp * 16,
                                           kd * 16, self.lane, True),
                           self.unrolled("query_pair", self.BM // 16, pair))
            out.append(seq(self.unrolled("tile_zero", self.BM // 2,
                                         lambda e, frag=frag: BufferStore(frag, (e,), Const(0.0, dt.float32))),
                           self.unrolled("depth_step", c.depth // 16, step, self.rolled)))
        return seq(*out)

    def _element(self, nt: Var, e: Expr, stage: Expr) -> tuple[dict[Expr, Expr], Expr, Expr, Expr, Expr]:
        """(replacements, query, key, in range, fragment index) of accumulator element e of n8 tile nt."""
        chain = self.chain
        rr, cc = self.c_map(self.lane, e)
        here = 4 * nt + e
        query = self.q0 + nt * 8 + cc
        key = self.kb * self.BN + self.warp * 16 + rr
        ok = compare("<", key, chain.keys) & compare("<", query, chain.rows[-1])
        repl: dict[Expr, Expr] = {c.node: self.c_frags[id(c.node)][here] for c in chain.contractions}
        for buf, read in self.stat_tiles.values():
            repl[read] = buf[stage, nt * 8 + cc]
        return repl, query, key, ok, here

    def _elementwise(self, stage: Expr, parts: str = "all") -> Stmt:
        """Per accumulator element: P = exp(s - lse) in place of the score's fragment, then every
        output's weight: key side into its A fragment, row side into the shared tile, tile outputs
        to global memory; 0 past the keys or the queries. `parts` "probs": P alone (before the
        other contractions are waited for), "weights": the weights alone (P already in place)."""
        chain = self.chain
        score_frag = self.c_frags[id(self.score_node())]
        whole = self.whole_tiles(self.q0, self.kb * self.BN, self.BM, self.BN)
        inside = self.inside_tiles(self.q0, self.kb * self.BN, self.BM, self.BN, whole)
        kept = {c: Const(True, dt.bool_) for c in kept_conditions(chain.score)}

        def one(nt: Var, e: Expr, guarded: bool | str, keep: dict[Expr, Expr] | None = None) -> Stmt:
            repl, query, key, ok, here = self._element(nt, e, stage)
            repl.update(keep or {})
            # a whole tile (isl): inside the extents, every mask condition true; MASKED: inside
            repl, wrepl, ok = self.element_mode(guarded, repl, ok, kept)
            at = {chain.query: query, chain.key: key}
            stmts: list[Stmt] = [self._guarded(score_frag, (here,), self.probability(repl, at), ok)]
            if parts == "probs":
                return seq(*stmts)
            if parts == "weights":
                stmts = []
            for o in chain.outputs:
                if o.kind == "row" and not self.row_side:
                    continue
                w = self.weight(o, wrepl, score_frag[here], at)
                if o.kind == "key":
                    stmts.append(self._guarded(self.w_frags[id(o.tensor)], (here,), w, ok))
                elif o.kind == "row":
                    rr, cc = self.c_map(self.lane, e)
                    assert self.weights_tile is not None
                    stmts.append(self._guarded(self.weights_tile, self._weights_index(rr, cc, nt), w, ok))
                else:
                    idx = tuple(substitute(i, at) for i in o.index)
                    value = substitute(o.epilogue, {**dict(zip(o.axes, idx)), o.acc: w})
                    st, val = self.lower.value(value)
                    stmts.append(IfThenElse(ok, seq(*st, BufferStore(self.buffers[o.tensor], idx, cast(val, o.tensor.dtype)))))
            return seq(*stmts)

        if parts == "probs":   # no dropout draws: they weigh the outputs, not P
            return by_tile(lambda guarded: self.unrolled("tile_n", self.BM // 8, lambda nt: self.unrolled(
                "tile_e", 4, lambda e: one(nt, e, guarded))), whole, inside)
        return self.elementwise_tiles(one, self.BM // 8, whole, lambda form, nt: key_major_keeps(
            form, self.lane, self.q0 + nt * 8, self.kb * self.BN + self.warp * 16, self.unique, self.lower.value,
            chain.query, chain.key), inside)

    def _key_side(self, stage: Expr) -> Stmt:
        """acc[16 keys x C] += wᵀ·X for each key-side output: A = w from registers (k16 step kk of
        the queries), B = X's row tile [query][column] (ldmatrix.trans)."""
        out: list[Stmt] = []
        for o in self.chain.of_kind("key"):
            assert o.operand is not None
            tile = self.row_tiles[tile_key(o.operand)][0]
            acc, w = self.accs[id(o.tensor)], self.w_frags[id(o.tensor)]

            def step(kk: Var, tile: Buffer = tile, acc: Buffer = acc, w: Buffer = w, columns: int = o.columns) -> Stmt:
                def pair(dn: Var) -> Stmt:
                    return seq(load_b_fragments(FragmentRef(self.b_frag, 0), tile, stage, dn * 16, kk * 16, self.lane,
                                                False),
                               two_n8_tiles(self.intrinsic, acc, 8 * dn, FragmentRef(w, 8 * kk), self.b_frag))
                return self.unrolled("column_pair", columns // 16, pair)
            out.append(self.unrolled("query_step", self.BM // 16, step))
        return seq(*out)

    def _row_side(self) -> Stmt:
        """out[BM x C] += w·Y for each row-side output, w from the shared [key][query] tile
        (ldmatrix.trans gives its A fragments), Y = the key tile [key][column]; units of 16 rows x
        NQ columns over the warps; float32 atomics into the output's accumulator."""
        outs = self.row_side
        if not outs:
            return seq()
        assert self.weights_tile is not None and self.dq_frag is not None
        chain, BM, NQ, W = self.chain, self.BM, self.NQ, self.warps
        zero = Const(0, dt.int32)
        out: list[Stmt] = [Barrier()]
        for o in outs:
            assert o.operand is not None
            if o.columns % NQ:
                raise ScheduleError(f"{WHERE}: {o.tensor.name} has {o.columns} columns, not a multiple of dq_columns={NQ}")
            tile = self.key_tiles[tile_key(o.operand)][0]
            acc = self.accumulators[id(o.tensor)]
            units = (BM // 16) * (o.columns // NQ)

            def unit_body(u: Var, tile: Buffer = tile, acc: Buffer = acc, units: int = units) -> Stmt:
                unit = self.warp + W * u
                mt, nc = unit % (BM // 16), unit // (BM // 16)
                dq = self.dq_frag
                assert dq is not None and self.weights_tile is not None
                ws = self.weights_tile

                def step(kk: Var) -> Stmt:
                    def pair(dn: Var) -> Stmt:
                        return seq(load_b_fragments(FragmentRef(self.b_frag, 0), tile, zero, nc * NQ + dn * 16, kk * 16,
                                                    self.lane, False),
                                   two_n8_tiles(self.intrinsic, dq, 8 * dn, FragmentRef(self.a_frag, 0), self.b_frag))
                    return seq(load_a_fragment(FragmentRef(self.a_frag, 0), ws, zero, mt * 16, kk * 16, self.lane, False),
                               self.unrolled("dq_pair", NQ // 16, pair))

                def add(nt: Var) -> Stmt:
                    def one(e: Var) -> Stmt:
                        rr, cc = self.c_map(self.lane, e)
                        query = self.q0 + mt * 16 + rr
                        at = tuple(substitute(x, {chain.query: query}) for x in chain.row_at)
                        return IfThenElse(compare("<", query, chain.rows[-1]), Evaluate(
                            atomic_add(acc[at + (nc * NQ + nt * 8 + cc,)], dq[4 * nt + e])))
                    return self.unrolled("dq_e", 4, one)
                body = seq(self.unrolled("dq_zero", NQ // 2, lambda e: BufferStore(dq, (e,), Const(0.0, dt.float32))),
                           self.unrolled("key_step", self.BN // 16, step, self.rolled),
                           self.unrolled("dq_n", NQ // 8, add))
                return body if units % W == 0 else IfThenElse(compare("<", unit, units), body)
            out.append(self.unrolled("dq_unit", -(-units // W), unit_body))
        return seq(*out)

    def _epilogue(self) -> Stmt:
        """The key-side outputs: element (key, column) of each accumulator through the output's
        epilogue (its cast), keys past the end not stored."""
        chain = self.chain
        return self.fragment_outputs(chain.of_kind("key"), chain.key, self.kb * self.BN, chain.keys,
                                     [b for b, _ in [*self.row_tiles.values(), *self.key_tiles.values()]])


__all__ = ["KeyMajor"]
