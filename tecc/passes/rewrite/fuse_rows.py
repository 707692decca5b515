"""Row fusion: every stage of a reduce→elementwise graph that shares the row, in ONE kernel.

The normalization family (softmax, log-softmax, layer norm, RMS norm) and plain row reductions
are graphs whose stages all iterate over the same rows: reductions `m[r] = ⊕_c f(X[r, c], ..)`
over one axis of extent C, and elementwise outputs `Y[r, j] = g(X[r, j], m[r], ..)` of shape
rows + (C,). Lowered stage by stage they are one kernel each, and X is read from global memory
once per stage (three times for softmax), with the row statistics round-tripping through global
temporaries. `fuse_rows` instead builds one kernel for the whole group:

    for b in blockIdx.x(rows):                 # one thread block per row
      for tx in threadIdx.x(T):
        x_row[k] = X[b, k*T + tx]   (k < K)    # cache="registers": the row is read ONCE, kept in
                                               # K = ceil(C/T) registers per thread
        m_acc = -inf; for k: m_acc = max(m_acc, x_row[k])      # per-thread partial
        <allreduce m_acc over the block>                       # shuffles + shared (cross_thread.py)
        s_acc = 0;    for k: s_acc += exp(x_row[k] - m_acc)
        <allreduce s_acc>
        for k: Y[b, k*T + tx] = exp(x_row[k] - m_acc) / s_acc

Consecutive threads take consecutive columns (`k*T + tx`), so every warp-wide load or store is
one contiguous 128-byte line (coalesced); the K loads of a thread are independent and unrolled,
which keeps enough bytes in flight to reach DRAM bandwidth. Row statistics stay in registers
(every thread holds the all-reduced value), intermediate reductions never touch global memory.
With cache="none" (a symbolic or too-long row) every pass reads its operands from global
memory again, walking the row in chunks of U 16-byte vectors per thread with a guarded tail
(row_chunks.py); cache="online" also folds a max / sum-of-exp pair and a sum / sum-of-squared-
deviations pair into one pass each (online_stats.py: running max, Welford / Chan moments), so
softmax and layer norm read a long row twice.

What a group is (`row_group` says why a program is not one): after elementwise producers are
inlined (lower.choose_inlined), every remaining stage is either a reduction stage of shape R (the
row shape, one or more dimensions), whose body holds Reduce nodes over one axis of extent C each
(the same C for all), or an elementwise output of shape R + (C,); reads of a reduction stage
index it by the row itself. Nothing here looks at names: log-softmax, layer norm and RMS norm
are the same rewrite. Whether to apply it is the planner's decision (strategies/row_fused.py).
"""

from __future__ import annotations

from typing import Callable, Sequence

from ...ir import dtype as dt
from ...ir.errors import ScheduleError
from ...ir.expr import (
    BufferLoad,
    Call,
    Cast,
    Const,
    Expr,
    Reduce,
    TensorRead,
    Var,
    binary,
    cast,
    const_int,
    free_vars,
    reduce_identity,
    substitute,
    walk,
    size_product,
)
from ...ir.stmt import (
    Allocate,
    Buffer,
    BufferStore,
    For,
    IfThenElse,
    KernelCall,
    Module,
    PrimFunc,
    Stmt,
    seq,
)
from ...ir.tensor import ComputeOp, Tensor
from ...ir.visitor import ExprMutator, SubexpressionReplacer
from ..lower import (
    COMBINE,
    Program,
    exprs_of,
    global_buffers,
    Inliner,
    scalar_vars,
    choose_inlined,
    collect_program,
    signature,
)
from ..names import identifier
from .online_stats import (
    centered_sum,
    max_sum_exp_pair,
    online_max_sum,
    welford_moments,
    welford_pair,
)
from .row_algebra import group_invariants, invariant_divisions, split_invariant
from .row_chunks import ColumnWalk
from .row_columns import MAX_COLUMN_BLOCKS_PER_SM, ColumnPartials, row_loop
from .row_group import RowGroup, row_group
from ..schedule.cross_thread import WARP, allreduce

CACHES = ("registers", "online", "none")
VECTORS = (1, 2, 4, 8)
# Occupancy request (`__launch_bounds__(T, n)`): sm_80 and sm_90 hold 2048 threads and 64 K
# registers per SM (CUDA C++ Programming Guide, "Technical Specifications"), so full occupancy
# allows 32 registers per thread. One register over that (33: 40 after the 8-register allocation
# granularity) leaves ONE 1024-thread block per SM, which idles the SM through every barrier of
# the block's reductions (layer norm at 8192 columns ran at 61% of copy bandwidth that way). The
# request is made only when the cached row plus ROW_KERNEL_REGISTERS (addressing, accumulators,
# statistics: 24 measured by ptxas for softmax) fits under the cap, so ptxas need not spill.
SM_THREADS = 2048
SM_REGISTERS = 65536
ROW_KERNEL_REGISTERS = 24
# A group with column reductions (a normalization's backward) keeps more row values and
# addresses live beside its arrays: with 24, ptxas spilled layer norm's backward over bf16 rows
# of 768 and 1024 at 128 threads (56 registers, 24 bytes); 32 leaves it at 64 without spills.
COLUMN_KERNEL_REGISTERS = 32


def min_blocks_per_sm(threads: int, row_words: int, kernel_registers: int = ROW_KERNEL_REGISTERS) -> int:
    """The most resident blocks of `threads` threads per SM whose register cap still holds a
    cached row of `row_words` 32-bit registers per thread plus the kernel's own registers."""
    best = 1
    for n in range(1, SM_THREADS // threads + 1):
        if SM_REGISTERS // (threads * n) >= row_words + kernel_registers:
            best = n
    return best


def _same_shape(a: Sequence[Expr], b: Sequence[Expr]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


class RowInliner(Inliner):
    """Inlines elementwise producers; a read of a reduction stage of the group at the row being
    computed becomes the thread's register holding that row's value."""

    def __init__(self, base: Inliner, values: dict[Tensor, Buffer], row: tuple[Expr, ...]) -> None:
        super().__init__(base.inlined, base.buffers)
        self.values = values
        self.row = row

    def visit_TensorRead(self, e: TensorRead) -> Expr:
        if e.tensor in self.values:
            idx = tuple(self.visit(i) for i in e.indices)
            if not _same_shape(idx, self.row):
                raise ScheduleError(
                    f"fuse_rows: {e.tensor.name} is read at [{', '.join(str(i) for i in idx)}], not at the row "
                    "being computed; such a graph does not keep its row on chip")
            return self.values[e.tensor][Const(0, dt.int32)]
        return super().visit_TensorRead(e)


class _CacheRow(ExprMutator):
    """Loads `X[row.., col]` of a cached input become the register `x_row[k]`. A 16-bit input
    cached in float32 (fuse_rows' `float_rows`) is read as `x_row[k]` wherever it is converted
    to float32, and rounded back (exactly) where its own type is read; a float32 value rounded
    to the type it was loaded from and widened again is itself (the round trip is exact)."""

    def __init__(self, caches: dict[Buffer, Buffer], row: tuple[Expr, ...], col: Expr, k: Expr) -> None:
        super().__init__()
        self.caches, self.key, self.k = caches, row + (col,), k
        self.widened = {id(reg): src.dtype for src, reg in caches.items() if reg.dtype != src.dtype}

    def visit_BufferLoad(self, e: BufferLoad) -> Expr:
        cache = self.caches.get(e.buffer)
        if cache is not None and _same_shape(e.indices, self.key):
            return cast(cache[self.k], e.buffer.dtype)
        return self.generic_visit(e)

    def visit_Cast(self, e: Cast) -> Expr:
        a = self.visit(e.a)
        if a is e.a:
            return e
        if e.dtype == dt.float32:
            inner = a.a if isinstance(a, Cast) else None
            if isinstance(inner, BufferLoad) and self.widened.get(id(inner.buffer)) == a.dtype:
                return inner  # widen(round(x)) of a value loaded from that type: x
        return a if a.dtype == e.dtype else cast(a, e.dtype)


def fuse_rows(args: Sequence[Tensor], threads: int, cache: str = "registers", name: str | None = None,
              vector: int = 1, rows_per_block: int = 1, unroll: int = 1, row_blocks: int = 0,
              column_sums: str = "local", prefetch: bool = False, float_rows: bool = False) -> Module:
    """The module of ONE kernel computing the row group `args` (see the module docstring), and
    with column reductions (row_group.py) a second kernel that combines their partial sums.

    threads: block size T (a multiple of 32, at most 1024); cache: "registers" keeps the row's
    cached inputs in K = ceil(C/T) registers per thread (C must be a constant), "none" re-reads
    them once per pass, "online" is "none" with two reductions computed in ONE pass where
    online_stats.py recognises them: a max followed by a sum of exp(· - max) (running max,
    rescaled sum), a sum followed by a sum of squared deviations (Welford / Chan moments), so
    softmax and layer norm read their row twice.
    vector: V > 1 gives each thread V consecutive columns per step (`col = (k*T + tx)*V + v`), so
    the row's loads and the outputs' stores become one V-wide access (float4: LDG.128/STG.128);
    it needs a constant C that is a multiple of V; V = 8 is for 16-bit rows (16 bytes).
    unroll: with cache="none" / "online", each thread walks its columns in chunks of U vectors
    whose loads are all issued before they are used (row_chunks.py), with a guarded tail.
    rows_per_block: W > 1 puts W rows in one block, one warp per row (threads must be 32, the
    rows on threadIdx.y): each row's reductions are warp shuffles only, with no shared memory and
    no barrier, and the launch has W times fewer blocks (a 64-thread block per row of 1024 bf16
    costs more in block launch and retire than its 2 KiB take to read: the cost model's `blocks`
    term, CostParameters.block_cycles). A warp is one row, so the guard on the last block's
    missing rows is uniform over every warp that shuffles.
    row_blocks: S > 0 launches S blocks that each walk the rows blk, blk + S, ... in a loop
    (one row at a time, a barrier between rows); a group with column reductions needs it: each
    block sums its rows' column values in registers and the combine kernel folds the S partial
    rows (row_columns.py; cache="registers" and one row per block only). column_sums: where the
    column sums live, "local" (registers) or "shared" (shared memory, fewer registers).
    prefetch: with row_blocks, load the block's next row into a second set of registers while
    this row is computed (the loads in flight through the reductions' barriers: what one
    resident block per SM needs to keep DRAM busy).
    float_rows: with cache="registers", a 16-bit input's row registers hold it converted to
    float32 once (at the load, or as the prefetched row is taken), not at each pass that reads
    it: one register per element either way (ptxas keeps one cached 16-bit element per 32-bit
    register), one conversion instead of one per pass.
    The kernel asks for `min_blocks_per_sm` resident blocks (see SM_THREADS above)."""
    group = row_group(args)
    _check_point(group, threads, cache, vector, unroll, rows_per_block, row_blocks, prefetch)
    C = group.columns
    c_const = const_int(C)
    prog = group.program
    W = rows_per_block

    sig = signature(prog)
    buffers, scalars, unique = sig.buffers, sig.scalars, sig.unique

    # the block's row: blockIdx.x over the flattened rows (W rows per block: row b·W + ty), unflattened row-major;
    # with row_blocks S, block b walks the rows step·S + b
    b = Var(unique("row"), dt.int32)
    tx = Var(unique("tx"), dt.int32)
    ty = Var(unique("ty"), dt.int32)
    step = Var(unique("row_step"), dt.int32) if row_blocks else None
    flat_row: Expr = b * W + ty if W > 1 else b
    if step is not None:
        flat_row = step * row_blocks + b
    row_idx = unflatten_row(flat_row, group.rows)
    n_rows = size_product(group.rows)

    # the column walk: col = k*T + tx, k < K (a re-read row: the chunked walk of row_chunks.py,
    # whose passes are written in the column variable `col`)
    k = Var(unique("k"), dt.int32)
    v = Var(unique("v"), dt.int32)
    V = vector
    chunks: ColumnWalk | None = None
    if cache == "registers":
        col: Expr = (k * threads + tx) * V + v if V > 1 else k * threads + tx
    else:
        col = Var(unique("col"), dt.int32)
        chunks = ColumnWalk(C, threads, V, unroll, tx, col, lambda label: Var(unique(label), dt.int32),
                            lambda load, n: Buffer(unique(f"{load.buffer.name}_chunk"), load.buffer.dtype, (n,),
                                                   "local", tensor=f"{load.buffer.tensor}.chunk"))
    slot = k * V + v if V > 1 else k
    K: Expr = Const(-(-(c_const or 0) // (threads * V)), dt.int32)
    needs_guard = c_const is not None and c_const % (threads * V) != 0

    def column_loop(body: Stmt, vectorized: bool = False) -> Stmt:
        """The registers form's walk: k < K, every step unrolled (the row's registers are indexed by k)."""
        if V > 1:
            # C is a multiple of V: a vector is wholly inside the row or wholly past it
            body = For(v, 0, V, "vectorize" if vectorized else "unroll", body)
            if needs_guard:
                body = IfThenElse((k * threads + tx) * V < C, body)
            return For(k, 0, K, "unroll", body)
        if needs_guard:
            body = IfThenElse(col < C, body)
        return For(k, 0, K, "unroll", body)
        if needs_guard:
            body = IfThenElse(guard(col < C), body)
        return For(k, 0, K, "unroll", body)

    def over_columns(exprs: list[Expr], element: Callable[[Callable[[Expr], Expr], Expr], Stmt],
                     vectorized: bool = False) -> Stmt:
        """The walk over the thread's columns running `element(value, column)` at each: `value`
        maps a pass expression to its value at the column (chunk registers for a re-read row)."""
        if chunks is None:
            return column_loop(element(lambda e: e, col), vectorized)
        return chunks.loop(exprs, row_idx, lambda ch: ch.each(element(ch.value, ch.column), vectorized))

    zero = Const(0, dt.int32)
    base_inliner = Inliner(prog.inlined, buffers)
    values: dict[Tensor, Buffer] = {}
    inliner = RowInliner(base_inliner, values, row_idx)

    # inputs read at [row.., col]: cached in registers once
    caches: dict[Buffer, Buffer] = {}
    stmts: list[Stmt] = []
    allocs: list[Buffer] = []
    prefetched: list[tuple[Buffer, Expr]] = []  # (the next row's registers, the row's load)
    if cache == "registers":
        for t in prog.args:
            if t.is_placeholder and _same_shape(t.shape, group.rows + (C,)):
                src = buffers[t]
                widen = float_rows and src.dtype in (dt.float16, dt.bfloat16)
                reg = Buffer(unique(f"{src.name}_row"), dt.float32 if widen else src.dtype, (K * V,), "local",
                             tensor=f"{t.name}.local")
                caches[src] = reg
                allocs.append(reg)
                load = src[row_idx + (col,)]
                if not prefetch:
                    stmts.append(column_loop(BufferStore(reg, (slot,), cast(load, reg.dtype)), vectorized=True))
                    continue
                # this row was loaded by the previous step (or before the loop) into `next`
                nxt = Buffer(unique(f"{src.name}_next"), src.dtype, (K * V,), "local", tensor=f"{t.name}.next")
                prefetched.append((nxt, load))
                stmts.append(column_loop(BufferStore(reg, (slot,), cast(nxt[slot], reg.dtype))))
    if prefetched:  # the next row's loads are in flight while this row is computed
        assert step is not None
        stmts.append(IfThenElse(flat_row + row_blocks < n_rows, seq(*(
            column_loop(BufferStore(nxt, (slot,), substitute(load, {step: step + 1})), vectorized=True)
            for nxt, load in prefetched))))
    cacher = _CacheRow(caches, row_idx, col, slot)

    # every reduction stage's row value lives in one register of every thread
    for t in group.reductions:
        val = Buffer(unique(f"{t.name}_val"), t.dtype, (1,), "local", tensor=f"{t.name}.local")
        allocs.append(val)
        values[t] = val
    for t in group.row_values:  # elementwise outputs of the row shape: one value per row
        values[t] = Buffer(unique(f"{t.name}_val"), t.dtype, (1,), "local", tensor=f"{t.name}.local")
        allocs.append(values[t])
    done: set[Tensor] = set()
    accs: dict[int, Expr] = {}

    def finish(t: Tensor | None) -> list[Stmt]:
        """Reduction stage t's row value (and its store), then every row value whose statistics
        are now all known (t None: those that read none)."""
        out = [] if t is None else finish_reduction(t, row_idx, accs, inliner, values[t], buffers, tx)
        if t is not None:
            done.add(t)
        for u in group.row_values:
            if u not in done and _reads_only(u, values, done, inliner, row_idx):
                done.add(u)
                out.extend(finish_reduction(u, row_idx, accs, inliner, values[u], buffers, tx))
        return out

    # the per-column expression of every pass, in program order: one per Reduce of a reduction
    # stage (its source at column `col`), one per elementwise output (its value at `col`)
    passes = [(t, cacher.visit(expr), r) for t, expr, r in row_passes(group, inliner, row_idx, col)]
    # products' row-invariant factors grouped, once per row (row_algebra.py); a row in registers only
    varying = {k, v, tx}
    if cache == "registers":
        passes = [(t, group_invariants(expr, varying), r) for t, expr, r in passes]

    shared: dict[Expr, Buffer] = {}
    if cache == "registers":
        shared = _shared_column_values(passes, k, lambda e: Buffer(
            unique("t_row"), e.dtype, (K * V,), "local", tensor="row.shared"))
        allocs.extend(shared.values())

    def new_local(label: str, dtype: dt.DType, n: int) -> Buffer:
        buf = Buffer(unique(label), dtype, (n,), "local", tensor=label)
        allocs.append(buf)
        return buf

    hoisted: dict[Expr, Buffer] = {}

    def hoist_divisions(e: Expr) -> Expr:
        found = invariant_divisions(e, varying)
        for d in found:
            if d not in hoisted:
                hoisted[d] = new_local("row_quotient", d.dtype, 1)
                stmts.append(BufferStore(hoisted[d], (zero,), d))
        return SubexpressionReplacer({d: hoisted[d][zero] for d in found}).visit(e) if found else e

    stmts.extend(finish(None))
    touched: list[set[int]] = []  # the row arrays each pass reads or writes
    merged: set[int] = set()      # passes folded into the previous one (cache="online")
    welford = 0                   # of which sum / sum-of-squared-deviation pairs
    for i, (t, expr, r) in enumerate(passes):
        if i in merged:
            touched.append(set())
            continue
        pair = None
        if cache == "online":
            assert chunks is not None and isinstance(col, Var)
            pair = max_sum_exp_pair(passes, i, values) or welford_pair(passes, i, col)
        if pair is not None:
            # two reductions in one pass over the row (online_stats.py)
            t2, r2, other = pair
            assert r is not None and chunks is not None
            acc = Buffer(unique(f"{t.name}_acc"), r.acc_dtype, (1,), "local", tensor=f"{t.name}.acc")
            acc2 = Buffer(unique(f"{t2.name}_acc"), r2.acc_dtype, (1,), "local", tensor=f"{t2.name}.acc")
            allocs.extend([acc, acc2])
            if r.combiner == "max":
                stmts.extend(online_max_sum(cast(expr, r.acc_dtype), other, chunks, row_idx, acc, acc2, new_local,
                                            tx, threads, t.name, (unique(f"{t.name}_block"),
                                                                  unique(f"{t2.name}_block"))))
                accs[id(r)] = cast(acc[zero], r.dtype)
                accs[id(r2)] = cast(acc2[zero], r2.dtype)
                stmts.extend(finish(t))
            else:
                moments = (new_local(f"{t.name}_count", r.acc_dtype, 1), new_local(f"{t.name}_mean", r.acc_dtype, 1),
                           new_local(f"{t.name}_m2", r.acc_dtype, 1))
                stmts.extend(welford_moments(expr, chunks, row_idx, moments, new_local, tx, threads, t.name,
                                             unique(f"{t.name}_block")))
                stmts.append(BufferStore(acc, (zero,), moments[0][zero] * moments[1][zero]))  # S = n·mean
                accs[id(r)] = cast(acc[zero], r.dtype)
                stmts.extend(finish(t))
                # μ (pass i+1's) may read t's row value, set just above
                stmts.append(BufferStore(acc2, (zero,), centered_sum(moments, other)))
                accs[id(r2)] = cast(acc2[zero], r2.dtype)
                welford += 1
            merged.add(i + 1)
            touched.append(set())
            if i + 2 == len(passes) or passes[i + 2][0] is not t2:
                stmts.extend(finish(t2))
            continue
        op = t.op
        assert isinstance(op, ComputeOp)
        # a value computed here for a later pass is stored in its register as it is computed
        mine = {e: buf for e, buf in shared.items() if _first_pass(passes, e) == i}
        used = SubexpressionReplacer({e: buf[slot] for e, buf in shared.items() if e not in mine})
        keep = [BufferStore(buf, (slot,), used.visit(e)) for e, buf in mine.items()]
        expr = SubexpressionReplacer({e: buf[slot] for e, buf in shared.items()}).visit(expr) if mine else used.visit(expr)
        touched.append({id(n.buffer) for s in keep for n in walk(s.value) if isinstance(n, BufferLoad)}
                       | {id(n.buffer) for n in walk(expr) if isinstance(n, BufferLoad)}
                       | {id(buf) for buf in mine.values()})
        if cache == "registers":  # a division by row values: once per row (row_algebra.py)
            expr = hoist_divisions(expr)
        if r is not None:
            acc = Buffer(unique(f"{t.name}_acc"), r.acc_dtype, (1,), "local", tensor=f"{t.name}.acc")
            allocs.append(acc)
            stmts.append(BufferStore(acc, (zero,), reduce_identity(r.combiner, r.acc_dtype)))
            combine = COMBINE[r.combiner]
            factor = None  # Σ V·I = I·Σ V for a row-invariant I (row_algebra.py)
            if cache == "registers" and r.combiner == "sum" and expr.dtype == acc.dtype:
                expr, factor = split_invariant(expr, varying)
            stmts.append(over_columns([expr], lambda value, _column: seq(
                *keep, BufferStore(acc, (zero,), binary(combine, acc[zero], cast(value(expr), acc.dtype))))))
            stmts.append(allreduce(acc, COMBINE[r.combiner], tx, threads, unique(f"{t.name}_block"),
                                   shuffle_stage=row_blocks > 0))
            accs[id(r)] = cast(acc[zero] if factor is None else acc[zero] * factor, r.dtype)
            last_of_stage = i + 1 == len(passes) or passes[i + 1][0] is not t
            if last_of_stage:
                stmts.extend(finish(t))
        else:
            out = buffers[t]
            stmts.append(over_columns([expr], lambda value, column: BufferStore(out, row_idx + (column,), value(expr)),
                                      vectorized=True))
    partials: ColumnPartials | None = None
    if group.column_reductions:
        # this row's values at the thread's columns, added into the column reductions' partial sums
        partials = ColumnPartials(group, row_blocks, K * V, buffers, unique, column_sums, threads, tx)
        update = partials.update(column_loop, row_idx, col, slot,
                                 lambda e: group_invariants(cacher.visit(inliner.visit(e)), varying))
        touched.append({id(n.buffer) for e in exprs_of(update) for n in walk(e) if isinstance(n, BufferLoad)})
        stmts.append(update)
    if chunks is not None:
        allocs.extend(chunks.buffers)

    body: Stmt = seq(*stmts)
    for buf in reversed(allocs):
        body = Allocate(buf, body)
    if step is not None:
        # the block's rows one after another; the first row's loads, the column sums around them
        body = row_loop(step, row_blocks, flat_row, n_rows, body, barrier=threads > WARP)
        first = [column_loop(BufferStore(nxt, (slot,), substitute(load, {step: zero})), True) for nxt, load in prefetched]
        body = seq(IfThenElse(b < n_rows, seq(*first)), body) if first else body
        for nxt, _ in reversed(prefetched):
            body = Allocate(nxt, body)
        if partials is not None:
            body = partials.wrap(seq(partials.init(column_loop, slot), body, partials.store(column_loop, b, col, slot)))
        body = For(b, 0, row_blocks, "blockIdx.x", For(tx, 0, threads, "threadIdx.x", body))
    elif W > 1:
        n_const = const_int(n_rows)
        if n_const is None or n_const % W:
            body = IfThenElse(flat_row < n_rows, body)  # whole warps: a warp is one row
        body = For(b, 0, (n_rows + (W - 1)) // W, "blockIdx.x",
                   For(ty, 0, W, "threadIdx.y", For(tx, 0, threads, "threadIdx.x", body)))
    else:
        body = For(b, 0, n_rows, "blockIdx.x", For(tx, 0, threads, "threadIdx.x", body))

    kname = unique(f"{prog.stages[-1].name}_rows_kernel")
    mname = identifier(name or next(a.name for a in reversed(prog.args) if not a.is_placeholder))
    attrs: tuple[tuple[str, object], ...] = (("fused_rows", tuple(t.name for t in prog.stages)),)
    if merged:  # reductions computed together with the one before them (cache="online")
        attrs += (("online_pairs", len(merged)),)
    if welford:  # of which mean/variance pairs (Welford / Chan moments)
        attrs += (("welford_pairs", welford),)
    if cache == "registers":
        k_const = const_int(K)
        assert k_const is not None
        # one register per cached element, whatever its width: ptxas does not pack two 16-bit
        # elements of a register array into one register (bf16 rows of 16 spilled at 32)
        arrays = list(caches.values()) + list(shared.values())
        row_words = peak_row_words(_row_spans(touched, arrays, list(caches.values())), k_const * V)
        if partials is not None and column_sums == "local":  # the column sums live through every row
            row_words += len(partials.accs) * k_const * V
        row_words += len(prefetched) * k_const * V
        blocks = min_blocks_per_sm(threads * W, row_words,
                                   COLUMN_KERNEL_REGISTERS if partials is not None else ROW_KERNEL_REGISTERS)
        if partials is not None:  # the blocks the plan keeps resident, no more (row_columns.py)
            blocks = min(blocks, MAX_COLUMN_BLOCKS_PER_SM)
        if blocks > 1:
            attrs += (("min_blocks_per_sm", blocks),)
    if step is not None:
        attrs += (("row_blocks", row_blocks),)
    temps = tuple(partials.partials) if partials is not None else ()
    kernels = [_kernel(body, kname, attrs, prog, buffers, scalars, temps)]
    if partials is not None:  # the column reductions' partial rows, folded
        kernels.append(_kernel(partials.combine_kernel(base_inliner), unique(f"{prog.stages[-1].name}_columns_kernel"),
                               partials.attrs, prog, buffers, scalars, temps))
    module_params = tuple(buffers[a] for a in prog.args) + tuple(scalars)
    return Module(mname, module_params, tuple(kernels), tuple(KernelCall(k.name, k.params) for k in kernels), temps)


def _check_point(group: RowGroup, threads: int, cache: str, vector: int, unroll: int, W: int, row_blocks: int,
                 prefetch: bool) -> None:
    """ScheduleError unless fuse_rows' parameters fit each other and the group."""
    C = group.columns
    c_const = const_int(C)
    if cache not in CACHES:
        raise ScheduleError(f"fuse_rows: cache must be one of {CACHES}, got {cache!r}")
    if cache == "registers" and c_const is None:
        raise ScheduleError(f"fuse_rows: cache='registers' needs a constant row length, got {C}; use cache='none'")
    if vector not in VECTORS:
        raise ScheduleError(f"fuse_rows: vector must be one of {VECTORS}, got {vector}")
    if vector > 1 and (c_const is None or c_const % vector):
        raise ScheduleError(f"fuse_rows: vector={vector} needs a constant row length that is a multiple of it, got {C}")
    if unroll < 1 or (unroll > 1 and cache == "registers"):
        raise ScheduleError(f"fuse_rows: unroll={unroll} is the chunk of a re-read row (cache='none' or 'online'); "
                            "cache='registers' unrolls its whole row")
    if W < 1 or (W > 1 and threads != WARP) or threads * W > 1024:
        raise ScheduleError(f"fuse_rows: rows_per_block={W} needs one warp per row (threads=32) and at most 1024 "
                            f"threads per block, got threads={threads}")
    if row_blocks < 0 or (row_blocks and (W > 1 or cache != "registers")):
        raise ScheduleError(f"fuse_rows: row_blocks={row_blocks} walks rows one block at a time with the row in "
                            f"registers: it needs cache='registers' and rows_per_block=1, got cache={cache!r}, "
                            f"rows_per_block={W}")
    if prefetch and not row_blocks:
        raise ScheduleError("fuse_rows: prefetch loads a block's next row; it needs row_blocks")
    if group.column_reductions and not row_blocks:
        raise ScheduleError(f"fuse_rows: the column reductions {', '.join(t.name for t in group.column_reductions)} "
                            "are summed over blocks of rows: give row_blocks (blocks walking the rows), with "
                            "cache='registers'")


def unflatten_row(flat: Expr, rows: Sequence[Expr]) -> tuple[Expr, ...]:
    """The row index of the flattened row number `flat` over the row shape, row-major."""
    row: list[Expr] = []
    rest = flat
    for i, extent in enumerate(reversed(rows)):
        row.append(rest if i == len(rows) - 1 else rest % extent)
        rest = rest // extent
    return tuple(reversed(row))


def _kernel(body: Stmt, name: str, attrs: tuple[tuple[str, object], ...], prog: Program,
            buffers: dict[Tensor, Buffer], scalars: Sequence[Var], temps: tuple[Buffer, ...]) -> PrimFunc:
    """A kernel of the module: its parameters are the program's buffers, then the temporaries
    it uses, then the size variables."""
    used = global_buffers(body)
    body_vars = scalar_vars(exprs_of(body) + [s for u in used for s in u.shape + (u.strides or ())])
    params = (tuple(buffers[a] for a in prog.args if buffers[a] in used) + tuple(t for t in temps if t in used)
              + tuple(v for v in scalars if v in body_vars))
    return PrimFunc(name, params, body, attrs)


Pass = tuple[Tensor, Expr, "Reduce | None"]


def row_passes(group: RowGroup, inliner: ExprMutator, row_idx: tuple[Expr, ...], col: Expr) -> list[Pass]:
    """The per-column expression of every pass over the row `row_idx`, in program order: one per
    Reduce of a reduction stage (its source at column `col`, with that Reduce), one per
    elementwise output (its value at `col`, None). `inliner` (a RowInliner) turns reads of the
    group's reduction stages into the registers that hold their row values. Row values and
    column reductions have no pass of their own (fuse_rows computes them)."""
    passes: list[Pass] = []
    for t in group.stages:
        op = t.op
        assert isinstance(op, ComputeOp)
        if t in group.reductions:
            body = substitute(op.body, dict(zip(op.axes, row_idx)))
            seen: set[int] = set()
            for r in [n for n in walk(body) if isinstance(n, Reduce)]:
                if id(r) not in seen:
                    seen.add(id(r))
                    passes.append((t, inliner.visit(substitute(r.source, {r.axes[0]: col})), r))
        elif t in group.elementwise:
            body = substitute(op.body, dict(zip(op.axes, row_idx + (col,))))
            passes.append((t, inliner.visit(body), None))
    return passes


# Intrinsics worth a register to compute once: each is a libdevice call of tens of instructions
# (expf: ~10 with the range reduction, sinf/logf more), against one register per column.
EXPENSIVE = ("exp", "log", "sin", "cos", "tanh", "erf", "sigmoid", "exp2", "log2")


def _first_pass(passes: Sequence[tuple[Tensor, Expr, Reduce | None]], e: Expr) -> int:
    return next(i for i, (_, expr, _r) in enumerate(passes) if any(n is e for n in walk(expr)))


def _shared_column_values(passes: Sequence[tuple[Tensor, Expr, Reduce | None]], column: Var,
                          new_buffer: "Callable[[Expr], Buffer]") -> dict[Expr, Buffer]:
    """The expensive per-column values (EXPENSIVE intrinsics that depend on the column) that a
    reduction pass computes and a later pass computes again -- softmax's `exp(x - max)` in the sum
    pass and in the output pass -- each with a register array that keeps it (one per column of
    the thread, like the cached row) so the later pass reads it instead of recomputing it.
    Expressions are hash-consed, so "the same value" is identity of the node."""
    out: dict[Expr, Buffer] = {}
    for i, (_, expr, r) in enumerate(passes):
        if r is None:
            continue  # an output pass is the last to need its values
        later = {id(n) for _, e, _r in passes[i + 1:] for n in walk(e)}
        for n in walk(expr):
            if (isinstance(n, Call) and n.name in EXPENSIVE and id(n) in later and n not in out
                    and column in free_vars(n) and not any(n is m or _contains(m, n) for m in out)):
                out[n] = new_buffer(n)
    return out


def _contains(outer: Expr, inner: Expr) -> bool:
    return any(n is inner for n in walk(outer))


def _row_spans(touched: Sequence[set[int]], arrays: Sequence[Buffer],
               loaded: Sequence[Buffer]) -> list[tuple[float, float]]:
    """The passes (first, last) over which each row array is live, from `touched[i]` (ids of the
    arrays pass i reads or writes): a cached input (`loaded`) from the load pass (-1) on, a kept
    value from just after the pass that computes it (that pass turns each element of its
    operands into one element of it: `t_row[j] = exp(x_row[j] - m)`, so an operand whose last
    use is that pass hands its registers over one by one)."""
    spans: list[tuple[float, float]] = []
    for buf in arrays:
        at = [i for i, ids in enumerate(touched) if id(buf) in ids]
        first = -1.0 if any(buf is b for b in loaded) else min(at, default=-1) + 0.5
        spans.append((first, float(max(at, default=-1))))
    return spans


def peak_row_words(spans: Sequence[tuple[float, float]], words: int) -> int:
    """Registers per thread the row arrays (`words` each) hold at once: softmax's exp(x - max)
    array takes over the registers of the input row it is computed from, so the peak is the
    most arrays live in one pass, not their sum."""
    last = max((hi for _, hi in spans), default=0.0)
    points = [q / 2 for q in range(-2, int(2 * last) + 2)]  # every pass and every gap between two
    return max((words * sum(1 for lo, hi in spans if lo <= p <= hi) for p in points), default=0)


def _reads_only(t: Tensor, values: dict[Tensor, Buffer], known: set[Tensor], inliner: ExprMutator,
                row_idx: tuple[Expr, ...]) -> bool:
    """Whether row value `t` reads, of the group's row values and statistics, only `known` ones."""
    op = t.op
    assert isinstance(op, ComputeOp)
    loaded = {id(n.buffer) for n in walk(inliner.visit(substitute(op.body, dict(zip(op.axes, row_idx)))))
              if isinstance(n, BufferLoad)}
    return all(u in known for u, buf in values.items() if id(buf) in loaded)


def finish_reduction(t: Tensor, row_idx: tuple[Expr, ...], accs: dict[int, Expr], inliner: ExprMutator,
                      val: Buffer, buffers: dict[Tensor, Buffer], tx: Var, writer: Expr | None = None) -> list[Stmt]:
    """The row value of reduction stage `t` from its all-reduced accumulators, and its store
    (by thread 0, or where `writer` holds) when the stage is an output."""
    op = t.op
    assert isinstance(op, ComputeOp)
    body = substitute(op.body, dict(zip(op.axes, row_idx)))

    class _Finish(ExprMutator):
        def visit_Reduce(self, r: Reduce) -> Expr:  # noqa: N805
            return accs[id(r)]

    zero = Const(0, dt.int32)
    out: list[Stmt] = [BufferStore(val, (zero,), inliner.visit(_Finish().visit(body)))]
    if t in buffers:  # an output: thread 0 of the block writes the row's value
        out.append(IfThenElse(tx == 0 if writer is None else writer, BufferStore(buffers[t], row_idx, val[zero])))
    return out


__all__ = ["CACHES", "COLUMN_KERNEL_REGISTERS", "VECTORS", "Pass", "RowGroup", "fuse_rows", "min_blocks_per_sm", "peak_row_words", "row_group",
           "row_passes"]
