"""Split row groups: softmax, layer norm, RMS norm over few long rows as two kernels of S blocks per row.

`fuse_rows` computes a row group (fuse_rows.py: reductions over the row, then elementwise outputs
of the row) with one block per row. A row too long for registers is read twice there (statistics,
then outputs: cache="online" / "none"), which is fine when the rows fill the GPU; 64 rows of
131072 are 64 blocks on a 132-SM GPU, and one 1024-thread block per SM cannot keep enough bytes
in flight (57% of copy bandwidth for fp32 softmax on an H200). Row sums have split_rows.py for
this; `split_row_group` is its counterpart for a group whose statistics are computable in one
pass of *partial statistics* that combine associatively:

* one reduction (RMS norm's Σ x², a row sum; any combiner of + * max min): the partial is the
  chunk's ⊕, combined by ⊕;
* max a, then Σ exp(h - max) (softmax, log-softmax; online_stats.max_sum_exp_pair): the partial
  is the chunk's (m, s = Σ exp(h - m)), combined by rescaling both sums to the larger max
  (Milakov & Gimelshein 2018);
* Σ h, then Σ (h - μ)² (layer norm; online_stats.welford_pair): the partial is the chunk's
  moments (n, mean, M2), combined by Chan's update (Chan, Golub & LeVeque 1979).

Two kernels, each of S (resp. S') blocks of T threads per row, every block on a contiguous chunk
of L = ceil(C / (S·T·V·U))·T·V·U columns (whole rounds of the walk):

    # kernel 1 (statistics)
    for b in blockIdx.x(rows·S): for tx in threadIdx.x(T):
      let row = b // S; s = b % S; n = max(min(L, C - s·L), 0)   # the chunk [s·L, s·L + n)
      <the chunk's walk (row_chunks.py with start s·L): U loads of V columns (16 bytes where
       the row allows) in flight per thread, a guarded tail> computing the thread's partial statistics, all-reduced over the block
       (cross_thread.py: allreduce, or chan_allreduce for the moments)
      if tx == 0: partial_k[row, s] = the block's statistic k          (float32 for 16-bit rows)
    # kernel 2 (outputs)
    for b in blockIdx.x(rows·S'): for tx in threadIdx.x(T):
      let flat = rows·S' - 1 - b; row = flat // S'; s' = flat % S'
      every warp folds the S partials of its row (lane l: l, l + 32, ...; same rules) and
      all-reduces them by shuffles: every thread holds the row's statistics, the reduction
      stages' row values (as in fuse_rows)
      <the chunk [s'·L', s'·L' + n') of every elementwise output>       (the row's second read)
      if s' == 0 and tx == 0: the reduction stages that are outputs

So the row is read twice, as by fuse_rows' long-row form, but by rows·S blocks. Kernel 2 walks
the blocks in reverse order: its first blocks re-read the chunks kernel 1 read last, which are
the likeliest still in L2 when the input is larger than L2 (an LRU-like cache keeps the most
recently read lines). S ≤ a few hundred: each lane of kernel 2 folds ceil(S / 32) partials, and
every warp does so for itself, so kernel 2 has no shared memory and no barrier.

Accepted (ScheduleError says why not): a row group (fuse_rows.row_group) whose reduction passes
are exactly one of the three forms above; any number of elementwise outputs (each walks the
chunk once), none included (kernel 2 then only combines). A symbolic row length takes V = 1
(alignment unprovable), like fuse_rows; V > 1 needs a constant C that is a multiple of V.
Chunks past the end of a row (an explicit plan with more splits than the row has rounds, or
C = 0) give the identity partials ((-inf, 0), (0, 0, 0)) that the combines keep NaN-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from ...ir import dtype as dt
from ...ir.dtype import DType
from ...ir.errors import ScheduleError
from ...ir.expr import Const, Expr, Var, binary, cast, const_int, reduce_identity, size_product
from ...ir.stmt import Allocate, Buffer, BufferStore, For, IfThenElse, KernelCall, LetStmt, Module, PrimFunc, Stmt, seq
from ...ir.tensor import Tensor
from .fuse_rows import VECTORS
from .row_group import RowGroup, row_group
from .row_passes import Pass, RowInliner, finish_reduction, row_passes
from ..lower import COMBINE, Inliner, kernel_params, signature, unflatten
from ..names import identifier
from .online_stats import (
    allreduce_max_sum,
    centered_sum,
    max_sum_exp_pair,
    merge_max_sum,
    online_max_sum,
    welford_moments,
    welford_pair,
)
from .row_chunks import ColumnWalk
from ..schedule.cross_thread import WARP, allreduce, chan_allreduce, chan_merge

KINDS = ("reduction", "max_sum_exp", "welford")
ZERO = Const(0, dt.int32)


@dataclass
class Statistics:
    """What kernel 1 computes per chunk: `kind` (one of KINDS), the reduction passes it covers
    (one or two (stage, per-column expression, Reduce)), and for a pair the recognizer's third
    value (h of exp(h - max), or μ of Σ (h - μ)²)."""

    kind: str
    passes: tuple[Pass, ...]
    other: Expr | None = None

    @property
    def count(self) -> int:
        """Partial statistics per chunk: ⊕; (max, Σ exp); (n, mean, M2)."""
        return {"reduction": 1, "max_sum_exp": 2, "welford": 3}[self.kind]


def one_pass_statistics(passes: Sequence[Pass], values: dict[Tensor, Buffer], col: Var) -> Statistics:
    """The statistics of the row group's `passes` (fuse_rows.row_passes) if one pass of partial
    statistics computes them (module docstring), else ScheduleError saying why."""
    reductions = [p for p in passes if p[2] is not None]
    if len(reductions) == 1:
        r = reductions[0][2]
        assert r is not None
        if r.combiner not in COMBINE:
            raise ScheduleError(f"split_row_group: combiner {r.combiner!r} has no cross-thread form")
        return Statistics("reduction", (reductions[0],))
    if len(reductions) == 2:
        pair = max_sum_exp_pair(reductions, 0, values)
        if pair is not None:
            return Statistics("max_sum_exp", tuple(reductions), pair[2])
        pair = welford_pair(reductions, 0, col)
        if pair is not None:
            return Statistics("welford", tuple(reductions), pair[2])
    names = ", ".join(p[0].name for p in reductions)
    raise ScheduleError(f"split_row_group: the reductions ({names}) are not one reduction, a max and a sum of "
                        "exp(· - max), or a sum and a sum of squared deviations: no one-pass partial statistics")


def row_statistics(args: Sequence[Tensor]) -> Statistics:
    """The one-pass partial statistics of the row group `args`, or ScheduleError saying why it
    is not a row group or has none (what the strategy asks before proposing the split)."""
    group = row_group(args)
    _plain_group(group)
    sig = signature(group.program)
    row_idx = unflatten(Var("row", dt.int32), group.rows)
    col = Var("col", dt.int32)
    values = {t: Buffer(f"{t.name}_val", t.dtype, (1,), "local") for t in group.reductions}
    inliner = RowInliner(Inliner(group.program.inlined, sig.buffers), values, row_idx)
    return one_pass_statistics(row_passes(group, inliner, row_idx, col), values, col)


def _plain_group(group: RowGroup) -> None:
    """Row values and column reductions (row_group.py) have no place in the split kernels."""
    extra = group.row_values + group.column_reductions
    if extra:
        raise ScheduleError(f"split_row_group: {', '.join(t.name for t in extra)} are per-row values or column "
                            "reductions, which the split kernels do not compute; fuse_rows does")


def chunk_columns(columns: Expr, splits: int, tile: int) -> tuple[Expr, bool]:
    """(L, exact): the chunk of each of `splits` blocks of a row of `columns`, whole rounds of
    `tile` = T·V·U columns, and whether the chunks cover the row exactly (S·L = C)."""
    c = const_int(columns)
    if c is not None:
        rounds = -(-c // (splits * tile))
        return Const(rounds * tile, dt.int32), rounds * tile * splits == c
    return (columns + (splits * tile - 1)) // (splits * tile) * tile, False


def split_row_group(args: Sequence[Tensor], threads: int = 256, splits: int = 1, vector: int = 1, unroll: int = 1,
                    output_splits: int | None = None, name: str | None = None) -> Module:
    """The two-kernel module computing the row group `args` with `splits` blocks of `threads`
    threads per row for the partial statistics and `output_splits` (default: splits) blocks
    per row for the outputs, each thread walking its chunk with `unroll` loads of `vector`
    columns in flight (see the module docstring)."""
    S, S2 = splits, splits if output_splits is None else output_splits
    _check_point(threads, S, S2, vector, unroll)
    group = row_group(args)
    _plain_group(group)
    C = group.columns
    c_const = const_int(C)
    if vector > 1 and (c_const is None or c_const % vector):
        raise ScheduleError(f"split_row_group: vector={vector} needs a constant row length that is a multiple of "
                            f"it, got {C}")
    split = _GroupSplit(group, threads, vector, unroll)
    statistics, partials = split.statistics_kernel(S)
    rows = split.rows_kernel(S, S2, partials)
    prog, sig = group.program, split.sig
    arrays = [sig.buffers[a] for a in prog.args]
    names = tuple(t.name for t in prog.stages)
    funcs: list[PrimFunc] = []
    for role, body in (("statistics", statistics), ("rows", rows)):
        attrs: tuple[tuple[str, object], ...] = (("split_row_group", names), ("statistics", split.stats.kind))
        params = kernel_params(body, arrays, partials, sig.scalars)
        funcs.append(PrimFunc(sig.unique(f"{prog.stages[-1].name}_{role}_kernel"), params, body, attrs))
    mname = identifier(name or next(a.name for a in reversed(prog.args) if not a.is_placeholder))
    calls = tuple(KernelCall(f.name, f.params) for f in funcs)
    return Module(mname, tuple(arrays) + tuple(sig.scalars), tuple(funcs), calls, partials)


def _check_point(threads: int, S: int, S2: int, vector: int, unroll: int) -> None:
    """ScheduleError unless split_row_group's parameters are in range."""
    if threads % WARP or not 0 < threads <= 1024:
        raise ScheduleError(f"split_row_group: threads={threads}: a multiple of 32 up to 1024")
    if S < 1 or S2 < 1 or unroll < 1:
        raise ScheduleError(f"split_row_group: splits ({S}), output_splits ({S2}) and unroll ({unroll}) must be "
                            "at least 1")
    if vector not in VECTORS:
        raise ScheduleError(f"split_row_group: vector must be one of {VECTORS}, got {vector}")


class _Locals:
    """Register buffers of one kernel, made with fresh names and allocated around its body."""

    def __init__(self, unique: Callable[[str], str], buffers: Sequence[Buffer] = ()) -> None:
        self.unique = unique
        self.buffers = list(buffers)

    def __call__(self, label: str, dtype: DType, k: int) -> Buffer:
        buf = Buffer(self.unique(label), dtype, (k,), "local", tensor=label)
        self.buffers.append(buf)
        return buf


class _GroupSplit:
    """The row group lowered for its two kernels: the program's signature, the let-bound `row`
    both kernels' blocks work on (flattened; `row_idx` unflattened row-major), the passes over
    the row's columns and their one-pass statistics."""

    def __init__(self, group: RowGroup, threads: int, vector: int, unroll: int) -> None:
        self.group = group
        prog = group.program
        self.sig = sig = signature(prog)
        self.unique = unique = sig.unique
        self.T, self.V, self.U = threads, vector, unroll
        self.tile = threads * vector * unroll
        self.row = Var(unique("row"), dt.int32)
        self.row_idx = unflatten(self.row, group.rows)
        self.n_rows = size_product(group.rows)
        col = Var(unique("col"), dt.int32)
        self.values = {t: Buffer(unique(f"{t.name}_val"), t.dtype, (1,), "local", tensor=f"{t.name}.local")
                       for t in group.reductions}
        self.inliner = RowInliner(Inliner(prog.inlined, sig.buffers), self.values, self.row_idx)
        self.passes = row_passes(group, self.inliner, self.row_idx, col)
        self.col = col
        self.stats = one_pass_statistics(self.passes, self.values, col)
        r = self.stats.passes[0][2]
        assert r is not None
        self.first, self.red = self.stats.passes[0][0], r
        self.acc_dtype = r.acc_dtype
        self.tx = Var(unique("tx"), dt.int32)

    def chunk_walk(self, splits: int, block: Var) -> tuple[ColumnWalk, Var, list[tuple[Var, Expr]]]:
        """The chunk walk of a block `block` of a row split `splits` ways, its split index and
        the lets that define the chunk's columns."""
        unique, C = self.unique, self.group.columns
        s = Var(unique("s"), dt.int32)
        L, exact = chunk_columns(C, splits, self.tile)
        lets: list[tuple[Var, Expr]] = [(s, block % splits if splits > 1 else ZERO)]
        n: Expr = L
        if not exact:
            n = Var(unique("n"), dt.int32)
            lets.append((n, binary("max", binary("min", L, C - s * L), ZERO)))
        columns = ColumnWalk(n, self.T, self.V, self.U, self.tx, self.col, lambda label: Var(unique(label), dt.int32),
                             lambda load, k: Buffer(unique(f"{load.buffer.name}_chunk"), load.buffer.dtype, (k,),
                                                    "local", tensor=f"{load.buffer.tensor}.chunk"),
                             start=s * L)
        return columns, s, lets

    # ---- kernel 1: each block's partial statistics
    def statistics_kernel(self, S: int) -> tuple[Stmt, tuple[Buffer, ...]]:
        """Kernel 1's loop nest and the partials it stores: per statistic, rows × S values."""
        unique, row, tx = self.unique, self.row, self.tx
        b1 = Var(unique("b"), dt.int32)
        walk1, s1, lets1 = self.chunk_walk(S, b1)
        local1 = _Locals(unique)
        stmts1, block_stats, labels = self.block_statistics(walk1, local1)
        partials = tuple(Buffer(unique(f"{label}_partial"), self.acc_dtype, (self.n_rows, Const(S, dt.int32)),
                                "global", tensor=f"{label}.partial") for label in labels)
        stmts1.append(IfThenElse(tx == 0, seq(*(BufferStore(p, (row, s1), v) for p, v in zip(partials, block_stats)))))
        allocs1 = local1.buffers + walk1.buffers
        body = _kernel_body(stmts1, allocs1, [(row, b1 // S if S > 1 else b1)] + lets1, b1, self.n_rows * S, tx,
                            self.T)
        return body, partials

    def block_statistics(self, walk: ColumnWalk, local: _Locals) -> tuple[list[Stmt], list[Expr], list[str]]:
        """The statements computing the block's statistics over its chunk, all-reduced over the
        block; the statistics' values and their labels (which name the partials)."""
        unique, row_idx, tx, T, acc_dtype, r = self.unique, self.row_idx, self.tx, self.T, self.acc_dtype, self.red
        t1, expr1 = self.first, self.stats.passes[0][1]
        if self.stats.kind == "reduction":
            acc = local(f"{t1.name}_acc", acc_dtype, 1)
            op = COMBINE[r.combiner]
            stmts = [BufferStore(acc, (ZERO,), reduce_identity(r.combiner, acc_dtype)),
                     walk.loop([expr1], row_idx, lambda ch: ch.each(
                         BufferStore(acc, (ZERO,), binary(op, acc[ZERO], cast(ch.value(expr1), acc_dtype))))),
                     allreduce(acc, op, tx, T, unique(f"{t1.name}_block"))]
            return stmts, [acc[ZERO]], [t1.name]
        if self.stats.kind == "max_sum_exp":
            t2 = self.stats.passes[1][0]
            assert self.stats.other is not None
            m_acc, s_acc = local(f"{t1.name}_acc", acc_dtype, 1), local(f"{t2.name}_acc", acc_dtype, 1)
            stmts = online_max_sum(cast(expr1, acc_dtype), self.stats.other, walk, row_idx, m_acc, s_acc, local, tx,
                                   T, t1.name, (unique(f"{t1.name}_block"), unique(f"{t2.name}_block")))
            return list(stmts), [m_acc[ZERO], s_acc[ZERO]], [t1.name, t2.name]
        moments = (local(f"{t1.name}_count", acc_dtype, 1), local(f"{t1.name}_mean", acc_dtype, 1),
                   local(f"{t1.name}_m2", acc_dtype, 1))
        stmts = welford_moments(expr1, walk, row_idx, moments, local, tx, T, t1.name, unique(f"{t1.name}_block"))
        return (list(stmts), [m[ZERO] for m in moments],
                [f"{t1.name}_count", f"{t1.name}_mean", f"{t1.name}_m2"])

    # ---- kernel 2: every block combines its row's partials, then writes its chunk of the outputs
    def rows_kernel(self, S: int, S2: int, partials: tuple[Buffer, ...]) -> Stmt:
        """Kernel 2's loop nest: blocks in reverse order (module docstring), each folding its
        row's partials into the row's statistics, then writing its chunk of every output."""
        unique, row, row_idx, tx, buffers = self.unique, self.row, self.row_idx, self.tx, self.sig.buffers
        b2 = Var(unique("b"), dt.int32)
        flat = Var(unique("flat"), dt.int32)
        walk2, s2, lets2 = self.chunk_walk(S2, flat)
        local2 = _Locals(unique, self.values.values())
        # every warp folds all S partials of its row (lane l: partials l, l + 32, ...) and
        # all-reduces them with shuffles alone: no shared stage, no barrier, and every warp gets the
        # same bits (the same partials in the same order); a warp's second load of a partial line
        # hits L1
        i = Var(unique("i"), dt.int32)
        p = i * WARP + tx % WARP

        def over_partials(step: Stmt) -> Stmt:
            """`step` (reading partial p of the row) for the partials p = lane, lane + 32, ... < S."""
            return For(i, 0, -(-S // WARP), "unroll", IfThenElse(p < S, step) if S % WARP else step)

        at = [q[row, p] for q in partials]
        stmts2 = self.combined_statistics(at, over_partials, local2, writer=(tx == 0) & (s2 == 0))

        def output(out: Buffer, expr: Expr) -> Stmt:
            """The block's chunk of the elementwise output `out` (one vector store per unit)."""
            return walk2.loop([expr], row_idx, lambda ch: ch.each(
                BufferStore(out, row_idx + (ch.column,), ch.value(expr)), vectorized=True))

        stmts2 += [output(buffers[t], expr) for t, expr, red in self.passes if red is None]
        allocs2 = local2.buffers + walk2.buffers
        lets = [(flat, self.n_rows * S2 - 1 - b2), (row, flat // S2 if S2 > 1 else flat)] + lets2
        return _kernel_body(stmts2, allocs2, lets, b2, self.n_rows * S2, tx, self.T)

    def combined_statistics(self, at: list[Expr], over_partials: Callable[[Stmt], Stmt], local: _Locals,
                            writer: Expr) -> list[Stmt]:
        """The statements folding the row's partials (`at`: partial p of each statistic) into its
        statistics, all-reduced over the warp, then the reduction stages' row values (and, by
        `writer`, the stages that are outputs)."""
        unique, tx, acc_dtype, t1, r, stats = self.unique, self.tx, self.acc_dtype, self.first, self.red, self.stats
        stmts: list[Stmt] = []
        accs: dict[int, Expr] = {}

        def finish(t: Tensor) -> None:
            stmts.extend(finish_reduction(t, self.row_idx, accs, self.inliner, self.values[t], self.sig.buffers, tx,
                                          writer))

        if stats.kind == "reduction":
            acc = local(f"{t1.name}_total", acc_dtype, 1)
            op = COMBINE[r.combiner]
            stmts += [BufferStore(acc, (ZERO,), reduce_identity(r.combiner, acc_dtype)),
                      over_partials(BufferStore(acc, (ZERO,), binary(op, acc[ZERO], at[0]))),
                      allreduce(acc, op, tx, WARP, unique(f"{t1.name}_combine"))]
            accs[id(r)] = cast(acc[ZERO], r.dtype)
            finish(t1)
            return stmts
        t2, r2 = stats.passes[1][0], stats.passes[1][2]
        assert r2 is not None
        if stats.kind == "max_sum_exp":
            m_acc, s_acc = local(f"{t1.name}_total", acc_dtype, 1), local(f"{t2.name}_total", acc_dtype, 1)
            m_new, m_own = local(f"{t1.name}_new", acc_dtype, 1), local(f"{t1.name}_own", acc_dtype, 1)
            stmts += [BufferStore(m_acc, (ZERO,), reduce_identity("max", acc_dtype)),
                      BufferStore(s_acc, (ZERO,), reduce_identity("sum", acc_dtype)),
                      over_partials(merge_max_sum(m_acc, s_acc, m_new, at[0], at[1], unique(f"{t1.name}_partial"))),
                      *allreduce_max_sum(m_acc, s_acc, m_own, tx, WARP, (unique(f"{t1.name}_combine"),
                                                                         unique(f"{t2.name}_combine")))]
            accs[id(r)] = cast(m_acc[ZERO], r.dtype)
            finish(t1)
            accs[id(r2)] = cast(s_acc[ZERO], r2.dtype)
            finish(t2)
            return stmts
        assert stats.other is not None
        totals = (local(f"{t1.name}_total_count", acc_dtype, 1), local(f"{t1.name}_total_mean", acc_dtype, 1),
                  local(f"{t1.name}_total_m2", acc_dtype, 1))
        own = (totals[0][ZERO], totals[1][ZERO], totals[2][ZERO])
        s_sum, q_sum = local(f"{t1.name}_acc", acc_dtype, 1), local(f"{t2.name}_acc", acc_dtype, 1)
        stmts += [*(BufferStore(m, (ZERO,), Const(0.0, acc_dtype)) for m in totals),
                  over_partials(chan_merge(totals, own, (at[0], at[1], at[2]), f"{t1.name}_partial")),
                  chan_allreduce(totals, tx, WARP, unique(f"{t1.name}_combine")),
                  BufferStore(s_sum, (ZERO,), totals[0][ZERO] * totals[1][ZERO])]     # S = n·mean
        accs[id(r)] = cast(s_sum[ZERO], r.dtype)
        finish(t1)
        # μ may read the first stage's row value, set just above
        stmts.append(BufferStore(q_sum, (ZERO,), centered_sum(totals, stats.other)))
        accs[id(r2)] = cast(q_sum[ZERO], r2.dtype)
        finish(t2)
        return stmts


def _kernel_body(stmts: list[Stmt], allocs: list[Buffer], lets: list[tuple[Var, Expr]], block: Var, blocks: Expr,
                 tx: Var, threads: int) -> Stmt:
    """`stmts` with their local buffers allocated, inside the lets, inside the block and thread
    loops."""
    body = seq(*stmts)
    for buf in reversed(allocs):
        body = Allocate(buf, body)
    for var, value in reversed(lets):
        body = LetStmt(var, value, body)
    return For(block, 0, blocks, "blockIdx.x", For(tx, 0, threads, "threadIdx.x", body))


__all__ = ["KINDS", "Statistics", "chunk_columns", "one_pass_statistics", "row_statistics", "split_row_group"]
