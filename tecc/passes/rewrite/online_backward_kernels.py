"""What the backward's tensor-core kernels share (online_backward_mma: the key-block-major kernel,
online_backward_dq: the query-major dQ kernel): the program's buffers and the float32
temporaries, the pre-pass that computes the row statistics (Δ) and zeroes the row-side
accumulators, the conversion of those accumulators, the probabilities and weights of one tile
element, the row statistics staged per block of query rows, and the guard on partial tiles.
"""

from __future__ import annotations

from functools import cached_property
from typing import Callable, Mapping

from ...ir import dtype as dt
from ...ir.errors import ScheduleError
from ...ir.expr import (
    Binary,
    BufferLoad,
    Call,
    Cast,
    Const,
    Expr,
    Reduce,
    Select,
    TensorRead,
    Var,
    binary,
    call,
    cast,
    compare,
    const_int,
    logical_and,
    select,
    size_product,
    substitute,
    walk,
)
from ...ir.intrinsics import lookup
from ...ir.online_chain import same_indices
from ...ir.stmt import Allocate, AsyncCopy, Barrier, Buffer, BufferStore, For, IfThenElse, PrimFunc, Stmt, seq
from ...ir.tensor import ComputeOp
from ...ir.visitor import SubexpressionReplacer
from ..lower import kernel_params, signature
from ..schedule.cross_thread import warp_allreduce
from ..schedule.tensorize import INTRINSICS
from ..schedule.thread_partition import tile_copy
from .key_tiles import kept_conditions, whole_tile
from .mma_tiles import LOG2E, TileStaging, fold_log2e
from .online_backward import BackwardChain, GradOutput
from .online_backward_dropout import KeepForm, keep_form, m16n8, uniform_branch
from .online_contraction import ExpressionLowering, head_indices

WHERE = "online_backward_mma"
STAGES = 2
# a tile inside the extents whose elements only the mask decides (BackwardKernels.element_mode)
MASKED = "masked"


def tile_key(read: TensorRead) -> tuple[int, tuple[int, ...]]:
    """Two reads share a staged tile when they read the same tensor at the same leading indices."""
    return id(read.tensor), tuple(id(i) for i in read.indices[:-2])


# the staged tiles of a kernel: tile_key -> (the shared buffer, the read it stages)
Tiles = dict[tuple[int, tuple[int, ...]], tuple[Buffer, TensorRead]]


def unflatten(flat: Expr, extents: tuple[Expr, ...]) -> tuple[Expr, ...]:
    """Row-major indices of `flat` over `extents` (the first index takes what is left)."""
    return head_indices(flat, extents) if extents else ()


def prepass_vector(chain: BackwardChain) -> tuple[int, int]:
    """(elements per load, lanes per row) of the pre-pass: 16 bytes of the narrowest-read row per
    load where the summed extents divide by it (8 of a 16-bit row, 4 of a float32 one), and as many
    lanes per row as one load each covers (a power of two up to the warp): d = 64 in bfloat16 is 8
    lanes of 8 elements, four rows per warp. 1 element and 32 lanes where no width divides."""
    extents: list[int] = []
    width = 8
    for stat in chain.statistics:
        red = next((n for n in walk(stat.op.body) if isinstance(n, Reduce)), None)
        extent = const_int(red.axes[0].extent) if red is not None else None
        if extent is None:
            return 1, 32
        extents.append(extent)
        for n in walk(red.source):
            if isinstance(n, TensorRead):
                width = min(width, max(16 // n.tensor.dtype.bytes, 1))
    while width > 1 and any(e % width for e in extents):
        width //= 2
    lanes = 32
    while lanes > 1 and extents and any(lanes * width > e for e in extents):
        lanes //= 2
    return width, lanes


def _at_the_row(indices: tuple[Expr, ...], row_at: tuple[Expr, ...]) -> bool:
    """Whether a read at `indices` is a row statistic: the row's own index expressions in order
    (the same objects), with or without constant indices beside them."""
    return same_indices(indices, row_at) or same_indices([e for e in indices if not isinstance(e, Const)], row_at)


class BackwardKernels(TileStaging):
    """A builder of the backward's kernels: `atomics` gives the row-side outputs (dQ) float32
    accumulators, added to by the key-block-major kernel and converted at the end; without it a
    query-major kernel computes them."""

    accs: dict[int, Buffer]   # the kernel's output accumulators by id(output tensor): set by the kernel's _fragments
    # whether tiles isl proves whole run an unguarded copy of the elementwise stage (the step's
    # `whole_tiles`): fewer instructions per element, more registers (both copies are in the loop)
    unguarded_tiles = True

    def __init__(self, chain: BackwardChain, threads: int, atomics: bool, name: str | None,
                 like: "BackwardKernels | None" = None) -> None:
        """`like`: another kernel of the same module, whose names, buffers and temporaries (the
        row statistics) this one shares."""
        self.chain = chain
        self.threads, self.warps = threads, threads // 32
        self.rolled = "serial"   # the k loops whose variable indexes no fragment (TileStaging.unrolled)
        self.name = name
        self.temps: list[Buffer] = []
        sig = signature(chain.program) if like is None else like.sig
        self.sig, self.unique = sig, sig.unique
        self.buffers = dict(sig.buffers) if like is None else like.buffers
        u = self.unique
        self.tx = Var(u("thread"), dt.int32)
        self.lane, self.warp = self.tx % 32, self.tx // 32
        dtype = chain.contractions[0].row_operand.dtype
        self.dtype = dtype
        self.intrinsic = INTRINSICS[dtype.name]
        self.c_map = lookup(self.intrinsic).operand("c").layout
        if like is None:
            for t in chain.statistics:   # the row statistics: float32 temporaries, written by the pre-pass
                self.buffers[t] = self._temp(t.name, t.dtype, t.shape)
        else:
            self.temps = like.temps
        self.row_side = chain.of_kind("row") if atomics else []
        self.accumulators = {id(o.tensor): self._temp(f"{o.tensor.name}_accumulator", dt.float32, o.tensor.shape)
                             for o in self.row_side}
        self.lower = ExpressionLowering(self.buffers, u)

    def _temp(self, label: str, dtype: dt.DType, shape: tuple[Expr, ...]) -> Buffer:
        buf = Buffer(self.unique(label), dtype, tuple(shape), "global", tensor=label)
        self.temps.append(buf)
        return buf

    # ---- the pre-pass: row statistics, accumulators zeroed ----------------------------------------

    def prepass_kernel(self) -> PrimFunc | None:
        """One group of `lanes` lanes per forward row (`prepass_vector`): each lane reads `width`
        consecutive elements of the row per step (one 16-byte load of a 16-bit row), the group's
        partial sums meet by shuffles, and its first lane writes the statistic; the row-side
        accumulators are zeroed by the same group."""
        chain = self.chain
        if not chain.statistics and not self.accumulators:
            return None
        u = self.unique
        zero = Const(0, dt.int32)
        rows = chain.rows
        warps = 4
        width, lanes = prepass_vector(chain)
        per_block = warps * (32 // lanes)
        bx, t = Var(u("row_block"), dt.int32), Var(u("thread"), dt.int32)
        lane, flat = t % lanes, bx * per_block + t // lanes
        total = size_product(rows)
        inside = compare("<", flat, total)
        at = unflatten(flat, tuple(rows))
        lower = ExpressionLowering(self.buffers, u)
        partial = Buffer(u("partial"), dt.float32, (Const(width, dt.int32),), "local")
        body: list[Stmt] = []
        for stat in chain.statistics:
            op = stat.op
            assert isinstance(op, ComputeOp)
            red = next(n for n in walk(op.body) if isinstance(n, Reduce))
            axis = red.axes[0]
            extent = const_int(axis.extent)
            if extent is None:
                raise ScheduleError(f"{WHERE}: the row statistic {stat.name} sums over a symbolic extent")
            k, v = Var(u("k"), dt.int32), Var(u("v"), dt.int32)
            col = k * (lanes * width) + lane * width + v
            src = substitute(red.source, {**dict(zip(op.axes, at)), axis: col})
            st, val = lower.value(src)
            add: Stmt = seq(*st, BufferStore(partial, (v,), partial[v] + cast(val, dt.float32)))
            if extent % (lanes * width):
                add = IfThenElse(compare("<", col, extent), add)
            vector = For(v, zero, Const(width, dt.int32), "unroll" if st or width == 1 else "vectorize", add)
            total_sum: Expr = partial[zero]
            for i in range(1, width):
                total_sum = total_sum + partial[Const(i, dt.int32)]
            # the shuffles outside the row guard: every lane of the warp takes part (a warp's last
            # rows may lie past the end)
            shuffles = warp_allreduce(partial, "+", lanes)
            # the reduction replaced before the row is substituted: substituting first would build a
            # new Reduce that the replacer does not find, and lane 0 would sum the row again alone
            value = substitute(SubexpressionReplacer({red: cast(partial[zero], red.dtype)}).visit(op.body),
                               dict(zip(op.axes, at)))
            st2, val2 = lower.value(value)
            body += [For(v, zero, Const(width, dt.int32), "unroll", BufferStore(partial, (v,), Const(0.0, dt.float32))),
                     IfThenElse(inside, For(k, zero, Const(-(-extent // (lanes * width)), dt.int32), "unroll", vector)),
                     BufferStore(partial, (zero,), total_sum), shuffles,
                     IfThenElse(logical_and(inside, compare("==", lane, zero)),
                                seq(*st2, BufferStore(self.buffers[stat], at, cast(val2, stat.dtype))))]
        for o in self.row_side:   # 16-byte stores of zeros where the columns come in fours
            acc = self.accumulators[id(o.tensor)]
            k, v = Var(u("k"), dt.int32), Var(u("v"), dt.int32)
            four = 4 if o.columns % 4 == 0 else 1
            col = k * (lanes * four) + lane * four + v
            zero_it: Stmt = BufferStore(acc, at + (col,), Const(0.0, dt.float32))
            if o.columns % (lanes * four):
                zero_it = IfThenElse(compare("<", col, o.columns), zero_it)
            steps = Const(-(-o.columns // (lanes * four)), dt.int32)
            body.append(IfThenElse(inside, For(k, zero, steps, "unroll",
                                               For(v, zero, Const(four, dt.int32), "vectorize", zero_it))))
        stmt: Stmt = seq(*body)
        for buf in reversed([partial, *lower.allocs]):
            stmt = Allocate(buf, stmt)
        stmt = For(bx, zero, (total + (per_block - 1)) // per_block, "blockIdx.x",
                   For(t, zero, Const(32 * warps, dt.int32), "threadIdx.x", stmt))
        return self._func(u(f"{self._label()}_backward_prepass_kernel"), stmt,
                          f"the row statistics ({lanes} lanes per row, {width} elements per load) and the "
                          "row-side accumulators zeroed")

    # ---- the conversion of the row-side accumulators -------------------------------------------------

    def convert_kernel(self) -> PrimFunc | None:
        """One thread per `width` consecutive elements of a row-side output's rows (4 where every
        output's last extent is a constant multiple of 4: one 16-byte load of the float32
        accumulators, one vector store of the output), else one per element."""
        outs = self.row_side
        if not outs:
            return None
        u = self.unique
        zero = Const(0, dt.int32)
        threads = 256
        lasts = [const_int(o.tensor.shape[-1]) for o in outs]
        width = 4 if all(n is not None and n % 4 == 0 for n in lasts) else 1
        bx, t = Var(u("convert_block"), dt.int32), Var(u("thread"), dt.int32)
        flat = (bx * threads + t) * width
        lower = ExpressionLowering(self.buffers, u)
        body: list[Stmt] = []
        widest = outs[0].tensor.shape
        for o in outs:
            at = unflatten(flat, tuple(o.tensor.shape))
            v = Var(u("v"), dt.int32)
            lane = at[:-1] + (at[-1] + v,) if width > 1 else at
            acc = self.accumulators[id(o.tensor)]
            value = substitute(o.epilogue, {**dict(zip(o.axes, lane)), o.acc: acc[lane]})
            st, val = lower.value(value)
            store: Stmt = seq(*st, BufferStore(self.buffers[o.tensor], lane, cast(val, o.tensor.dtype)))
            if width > 1:
                store = For(v, zero, Const(width, dt.int32), "unroll" if st else "vectorize", store)
            body.append(IfThenElse(compare("<", flat, size_product(o.tensor.shape)), store))
        total = size_product(widest)
        for o in outs[1:]:
            total = binary("max", total, size_product(o.tensor.shape))
        stmt: Stmt = seq(*body)
        for buf in reversed(lower.allocs):
            stmt = Allocate(buf, stmt)
        per_block = threads * width
        stmt = For(bx, zero, (total + (per_block - 1)) // per_block, "blockIdx.x",
                   For(t, zero, Const(threads, dt.int32), "threadIdx.x", stmt))
        return self._func(u(f"{self._label()}_backward_convert_kernel"), stmt,
                          f"the row-side outputs from their float32 accumulators ({width} per thread)")

    def _label(self) -> str:
        return self.chain.outputs[0].tensor.name

    # ---- one tile element: the probabilities and the weights --------------------------------------

    def staged_reads(self, stages: int, rows: int) -> None:
        """The row statistics the weights read at the row (lse, Δ): shared [stages][rows] buffers,
        filled per block of query rows (`stat_copy`). A statistic is a read whose indices are the
        row's, in order, with constant indices anywhere beside them: cuDNN's log-sum-exp is
        [B, H, S, 1], read at [b, h, i, 0] (unstaged, every element of the tile read it from
        global memory and the tile lost its whole-tile forms: 214 µs against 63 µs at GPT-2's
        shape, stop 36)."""
        chain = self.chain
        self.stat_tiles: dict[int, tuple[Buffer, TensorRead]] = {}
        for value in [chain.probs] + [o.weight for o in chain.outputs]:
            for n in walk(value):
                if isinstance(n, TensorRead) and _at_the_row(n.indices, chain.row_at) and id(n) not in self.stat_tiles:
                    buf = Buffer(self.unique(f"{n.tensor.name}_rows"), n.dtype,
                                 (Const(stages, dt.int32), Const(rows, dt.int32)), "shared", tensor=f"{n.tensor.name}.shared")
                    self.stat_tiles[id(n)] = (buf, n)

    def stat_copy(self, buf: Buffer, read: TensorRead, stage: Expr, groups: dict[Var, Expr], q0: Expr, u: Var) -> Stmt:
        """Element r of the row statistic's BM rows (4-byte cp.async, zero past the queries)."""
        r = self.tx + self.threads * u
        q = q0 + r
        idx = tuple(substitute(e, {**groups, self.chain.query: q}) for e in read.indices)
        copy: Stmt = AsyncCopy(buf, (stage, r), self.buffers[read.tensor], idx, 4, compare("<", q, self.chain.rows[-1]),
                               "ca")
        return copy if self.BM % self.threads == 0 else IfThenElse(compare("<", r, Const(self.BM, dt.int32)), copy)

    def score_node(self) -> Reduce:
        """The contraction P reads (the scores), which no weight may read outside P (P replaces
        it in place in its fragment)."""
        chain = self.chain
        probs = chain.probs
        assert isinstance(probs, Call) and isinstance(probs.args[0], Binary)
        nodes = [c.node for c in chain.contractions if any(n is c.node for n in walk(probs))]
        if len(nodes) != 1:
            raise ScheduleError(f"{WHERE}: P reads {len(nodes)} contractions; one (the scores) is needed")
        for o in chain.outputs:
            rest = SubexpressionReplacer({probs: Const(0.0, probs.dtype)}).visit(o.weight)
            if any(n is nodes[0] for n in walk(rest)):
                raise ScheduleError(f"{WHERE}: {o.tensor.name}'s weight reads the scores outside P")
        return nodes[0]

    def probability(self, repl: dict[Expr, Expr], at: dict[Var, Expr]) -> Expr:
        """P = exp(s - lse) at the element as exp2(s·log2 e - lse·log2 e) (ex2.approx.ftz), the
        contractions and staged statistics replaced by `repl`."""
        probs = self.chain.probs
        assert isinstance(probs, Call) and isinstance(probs.args[0], Binary)
        s, lse = probs.args[0].a, probs.args[0].b
        s_val = substitute(SubexpressionReplacer(repl).visit(s), at)
        l_val = substitute(SubexpressionReplacer(repl).visit(lse), at)
        return call("exp2_approx", fold_log2e(s_val) - cast(l_val, dt.float32) * Const(LOG2E, dt.float32))

    def weight(self, o: GradOutput, repl: dict[Expr, Expr], p_value: Expr, at: dict[Var, Expr]) -> Expr:
        """Output o's weight at the element, P (already computed) as `p_value`."""
        return substitute(SubexpressionReplacer({**repl, self.chain.probs: p_value}).visit(o.weight), at)

    def whole_tiles(self, q0: Expr, k0: Expr, rows: int, keys: int) -> Expr | None:
        """When the tile of queries [q0, q0 + rows) x keys [k0, k0 + keys) needs no guard
        (key_tiles.whole_tile, proved by isl), or None (a bias or mask tensor read per element
        keeps the guard everywhere); `self.whole` says which."""
        chain = self.chain
        if not self.unguarded_tiles:
            self.whole = "every tile guarded (whole_tiles=False: one copy of the elementwise stage)"
            return None
        staged = {id(read) for _, read in self.stat_tiles.values()}
        # the operands of the row-key contractions are the tensor cores' (staged tiles), not reads per element
        contracted = {n for c in chain.contractions for n in walk(c.node) if isinstance(n, TensorRead)}
        for value in [chain.probs, *(o.weight for o in chain.outputs)]:
            if any(isinstance(n, TensorRead) and id(n) not in staged and n not in contracted for n in walk(value)):
                self.whole = "every tile guarded (the weights read a tensor per element)"
                return None
        qv, kv, first, block = (Var(self.unique(n), dt.int32) for n in ("query0", "key0", "query_block", "key_block"))
        found = whole_tile(kept_conditions(chain.score), chain.query, chain.key, qv, kv, rows, keys,
                           chain.rows[-1], chain.keys, first, block)
        if found is None:
            self.whole = "every tile guarded (isl proves no tile whole)"
            return None
        self.whole = "tiles inside the extents and the mask (isl) without the per-element guard"
        return substitute(found, {qv: q0, kv: k0})

    @cached_property
    def weights_vanish(self) -> bool:
        """Whether every output's weight is 0 wherever P is (`vanishes`): then a tile where every
        P is 0 adds nothing, and a mask that P applies need not be applied again to the weights."""
        return all(vanishes(o.weight, self.chain.probs) for o in self.chain.outputs)

    def inside_tiles(self, q0: Expr, k0: Expr, rows: int, keys: int, whole: Expr | None) -> Expr | None:
        """When the tile of queries [q0, q0 + rows) x keys [k0, k0 + keys) lies inside the extents
        (the masked tiles on the diagonal of a causal mask, at sizes that are multiples of the
        tile): the elementwise stage then keeps the mask's conditions but drops the per-element
        range guard (`element_mode`, MASKED). None when no tile is whole (`whole`: then the
        weights read tensors per element, or tiles are all guarded by choice) or the score has no
        mask (a tile inside the extents is then whole)."""
        chain = self.chain
        if whole is None or not kept_conditions(chain.score):
            return None
        self.whole += "; tiles inside the extents under the mask without the range guard"
        return compare("<=", k0 + keys, chain.keys) & compare("<=", q0 + rows, chain.rows[-1])

    def element_mode(self, guarded: bool | str, repl: dict[Expr, Expr], ok: Expr,
                     kept: Mapping[Expr, Expr]) -> tuple[dict[Expr, Expr], dict[Expr, Expr], Expr]:
        """(P's replacements, the weights', the element's guard) for a tile `guarded` (True: every
        element tested against the extents, the mask in the expressions), whole (False: neither)
        or MASKED (inside the extents: no range guard; the mask stays in P, which is then exactly
        0 where it is false, so the weights that vanish with P drop it too)."""
        true = Const(True, dt.bool_)
        if guarded is False:
            both = {**repl, **kept}
            return both, both, true
        if guarded == MASKED:
            return repl, ({**repl, **kept} if self.weights_vanish else repl), true
        return repl, repl, ok

    def fragment_outputs(self, outs: list[GradOutput], axis: Var, first: Expr, extent: Expr,
                         free_tiles: list[Buffer] | None = None) -> Stmt:
        """Each output's accumulator (`self.accs`: C fragments of 16 rows per warp) through the
        output's epilogue (its cast) to global memory: element e of n8 tile nt at row first + the
        warp's 16 + the fragment's row of `axis` (the keys or the queries), column nt·8 + the
        fragment's column; rows at or past `extent` not stored. Through shared memory where
        `free_tiles` (staged tiles the loop no longer reads) hold them (`staged_outputs`)."""
        staged = self.staged_outputs(outs, axis, first, extent, free_tiles or [])
        if staged is not None:
            return staged
        chain = self.chain
        out: list[Stmt] = []
        for o in outs:
            acc = self.accs[id(o.tensor)]

            def one(nt: Var, e: Var, o: GradOutput = o, acc: Buffer = acc) -> Stmt:
                rr, cc = self.c_map(self.lane, e)
                row = first + self.warp * 16 + rr
                idx = tuple(substitute(i, {axis: row, chain.column: nt * 8 + cc}) for i in o.index)
                st, val = self.lower.value(substitute(o.epilogue, {**dict(zip(o.axes, idx)), o.acc: acc[4 * nt + e]}))
                return IfThenElse(compare("<", row, extent),
                                  seq(*st, BufferStore(self.buffers[o.tensor], idx, cast(val, o.tensor.dtype))))
            out.append(self.unrolled("out_n", o.columns // 8, lambda nt, one=one: self.unrolled(
                "out_e", 4, lambda e: one(nt, e))))
        return seq(*out)

    def staged_outputs(self, outs: list[GradOutput], axis: Var, first: Expr, extent: Expr,
                       free_tiles: list[Buffer]) -> Stmt | None:
        """The outputs through shared memory: each accumulator's elements converted in pairs into a
        stage of a free tile ([stages][rows][width], or the Hopper form's [stages][width / W][rows]
        [W]) of the output's dtype and width with room for the rows, a barrier, then 16-byte
        chunks of whole rows to global memory, rows past `extent` not stored: a thread's dozens of
        2-byte stores, eight rows apart, become a few 16-byte ones of whole lines. None (the
        fragments stored directly) where the slots do not hold every output, or an output's
        epilogue reads memory (it is evaluated for every row here, in range or not)."""
        chain = self.chain
        rows = self.warps * 16
        slots = [(buf, s) for buf in free_tiles for s in range(const_int(buf.shape[0]) or 0)]
        chosen: list[tuple[GradOutput, Buffer, int]] = []
        for o in outs:
            dtype = o.tensor.dtype
            if dtype.bytes != 2 or any(isinstance(n, TensorRead) for n in walk(o.epilogue)):
                return None
            for k, (buf, s) in enumerate(slots):
                if buf.dtype == dtype and self.tile_width(buf) == o.columns and (const_int(buf.shape[-2]) or 0) >= rows:
                    chosen.append((o, buf, s))
                    del slots[k]
                    break
            else:
                return None

        def index(o: GradOutput, row: Expr, col: Expr) -> tuple[Expr, ...]:
            return tuple(substitute(i, {axis: row, chain.column: col}) for i in o.index)

        writes: list[Stmt] = []
        copies: list[Stmt] = []
        for o, buf, s in chosen:
            acc = self.accs[id(o.tensor)]

            def pair(nt: Var, h: Var, o: GradOutput = o, acc: Buffer = acc, buf: Buffer = buf, s: int = s) -> Stmt:
                """Elements 2h, 2h + 1 of n8 tile nt: two adjacent columns of one row (the C
                pattern), one 4-byte store (in one W block: the pair starts at an even column)."""
                v = Var(self.unique("out_pair"), dt.int32)
                e = h * 2 + v
                rr, cc = self.c_map(self.lane, e)
                r0, c0 = self.c_map(self.lane, h * 2)
                *lead, last = self.tile_index(buf, Const(s, dt.int32), self.warp * 16 + r0, nt * 8 + c0)
                st, val = self.lower.value(substitute(o.epilogue, {
                    **dict(zip(o.axes, index(o, first + self.warp * 16 + rr, nt * 8 + cc))), o.acc: acc[4 * nt + e]}))
                return For(v, Const(0, dt.int32), Const(2, dt.int32), "vectorize",
                           seq(*st, BufferStore(buf, (*lead, last + v), cast(val, o.tensor.dtype))))

            def n8(nt: Var, pair: Callable[[Var, Var], Stmt] = pair) -> Stmt:
                return self.unrolled("out_h", 2, lambda h: pair(nt, h))
            writes.append(self.unrolled("out_n", o.columns // 8, n8))

            def copy(r: Expr, col: Expr, o: GradOutput = o, buf: Buffer = buf, s: int = s) -> Stmt:
                v = Var(self.unique("out_v"), dt.int32)
                # the chunk's 8 columns lie in one block of W (col a multiple of 8): v moves the last index
                *lead, last = self.tile_index(buf, Const(s, dt.int32), r, col)
                return IfThenElse(compare("<", first + r, extent), For(v, Const(0, dt.int32), Const(8, dt.int32), "vectorize",
                                  BufferStore(self.buffers[o.tensor], index(o, first + r, col + v), buf[(*lead, last + v)])))
            copies.append(tile_copy(self.unrolled, f"out_{o.tensor.name}", self.tx, self.threads, rows, o.columns, 8, copy))
        return seq(Barrier(), *writes, Barrier(), *copies)

    def elementwise_tiles(self, one: Callable[..., Stmt], n8_tiles: int, whole: Expr | None,
                          keeps_at: Callable[[KeepForm, Var], tuple[Callable[[Stmt], Stmt], list[Expr]]],
                          inside: Expr | None = None) -> Stmt:
        """The elementwise stage over a warp's `n8_tiles` n8 tiles of 4 fragment elements each,
        `one(nt, e, guarded, keep=None)` per element: unguarded where `whole` (the tile's test)
        holds, MASKED where `inside` does, else guarded. With the chain's dropout on m16n8
        fragments, the keep bits of an n8 tile come from one Philox call per four elements
        (`keeps_at(form, nt)`: its wrap and the four bits) behind a uniform branch, the
        per-element draws in the other."""
        form = keep_form(self.chain) if m16n8(self.c_map) else None

        def tile(guarded: bool | str, shared: bool = False) -> Stmt:
            def n8(nt: Var) -> Stmt:
                if not shared:
                    return self.element_loop("tile_e", 4, lambda e: one(nt, e, guarded))
                assert form is not None
                wrap, keeps = keeps_at(form, nt)
                return wrap(seq(*(one(nt, Const(e, dt.int32), guarded, {form.cond: keeps[e]}) for e in range(4))))
            return self.unrolled("tile_n", n8_tiles, n8)

        def both(guarded: bool | str) -> Stmt:
            return tile(guarded) if form is None else uniform_branch(form, tile(guarded, True), tile(guarded))
        return by_tile(both, whole, inside)

    def _guarded(self, buf: Buffer, idx: tuple[Expr, ...], value: Expr, ok: Expr) -> Stmt:
        """buf[idx] = value where `ok`, else 0; a value that reads global memory (a bias, a mask)
        is evaluated only where `ok` (its reads are in bounds there)."""
        st, val = self.lower.value(value)
        if st or any(isinstance(n, BufferLoad) and n.buffer.scope == "global" for n in walk(val)):
            return IfThenElse(ok, seq(*st, BufferStore(buf, idx, cast(val, buf.dtype))),
                              BufferStore(buf, idx, Const(0.0, buf.dtype)))
        # the conversion outermost (of the guarded float), so that two elements convert as a pair
        # (TileStaging.element_loop)
        return BufferStore(buf, idx, cast(select(ok, val, Const(0.0, val.dtype)), buf.dtype))

    def _func(self, name: str, body: Stmt, what: str) -> PrimFunc:
        chain = self.chain
        params = kernel_params(body, [self.buffers[a] for a in chain.program.args], self.temps, self.sig.scalars)
        attrs: tuple[tuple[str, object], ...] = (("online_backward", tuple(o.tensor.name for o in chain.outputs)),
                                                 ("tensorize", what))
        return PrimFunc(name, params, body, attrs)


def by_tile(stage: Callable[[bool | str], Stmt], whole: Expr | None, inside: Expr | None) -> Stmt:
    """`stage(False)` where `whole` holds, `stage(MASKED)` where `inside` does, else
    `stage(True)` (BackwardKernels.element_mode)."""
    guarded = stage(True)
    if inside is not None:
        guarded = IfThenElse(inside, stage(MASKED), guarded)
    return guarded if whole is None else IfThenElse(whole, stage(False), guarded)


def vanishes(w: Expr, p: Expr) -> bool:
    """Whether `w` is 0 wherever `p` is (a product with p, a `where` whose branches vanish or are
    0, a cast of one): then a tile where every P is 0 adds nothing and is skipped."""
    if w is p:
        return True
    if isinstance(w, Const):
        return w.dtype.is_float and float(w.value) == 0.0
    if isinstance(w, Binary) and w.op == "*":
        return vanishes(w.a, p) or vanishes(w.b, p)
    if isinstance(w, Binary) and w.op == "/":
        return vanishes(w.a, p)
    if isinstance(w, (Call, TensorRead)):
        return False
    if isinstance(w, Cast):
        return vanishes(w.a, p)
    if isinstance(w, Select):
        return vanishes(w.a, p) and vanishes(w.b, p)
    return False



__all__ = ["BackwardKernels", "MASKED", "STAGES", "by_tile", "Tiles", "WHERE", "tile_key", "unflatten", "vanishes"]
