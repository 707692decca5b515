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
    Cast,
    Const,
    Expr,
    Reduce,
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
from ...ir.tensor import Tensor
from ...ir.visitor import ExprMutator, SubexpressionReplacer
from ..lower import COMBINE, Inliner, exprs_of, kernel_params, same_shape, signature, unflatten
from ..names import identifier
from ..simplify import same_index
from .online_stats import (
    centered_sum,
    max_sum_exp_pair,
    online_max_sum,
    welford_moments,
    welford_pair,
)
from .row_algebra import delta_sum, group_invariants, invariant_divisions, split_invariant
from .row_chunks import ColumnWalk
from .row_columns import MAX_COLUMN_BLOCKS_PER_SM, ColumnPartials, row_loop
from .row_group import RowGroup, row_group
from .row_passes import (Pass, RowInliner, finish_reduction, first_pass, peak_row_words, reads_only, row_passes,
                         row_spans, shared_column_values, statistic_copies)
from .row_prefetch import PREFETCH_INTO, StagedRows
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
# shared memory per SM (sm_80: 164 KiB, sm_90: 228 KiB; the CUDA C++ Programming Guide's
# "Technical Specifications"): a kernel asks for no more resident blocks than the smaller holds
SM_SHARED_BYTES = 164 * 1024
ZERO = Const(0, dt.int32)


def min_blocks_per_sm(threads: int, row_words: int, kernel_registers: int = ROW_KERNEL_REGISTERS) -> int:
    """The most resident blocks of `threads` threads per SM whose register cap still holds a
    cached row of `row_words` 32-bit registers per thread plus the kernel's own registers."""
    best = 1
    for n in range(1, SM_THREADS // threads + 1):
        if SM_REGISTERS // (threads * n) >= row_words + kernel_registers:
            best = n
    return best


class _CacheRow(ExprMutator):
    """Loads `X[row.., col]` of a cached input (or of a view of the rows, at its own index of
    the row: `keys`) become the register `x_row[k]`. A 16-bit input
    cached in float32 (fuse_rows' `float_rows`) is read as `x_row[k]` wherever it is converted
    to float32, and rounded back (exactly) where its own type is read; a float32 value rounded
    to the type it was loaded from and widened again is itself (the round trip is exact)."""

    def __init__(self, caches: dict[Buffer, Buffer], keys: dict[Buffer, tuple[Expr, ...]], k: Expr) -> None:
        super().__init__()
        self.caches, self.keys, self.k = caches, keys, k
        self.widened = {id(reg): src.dtype for src, reg in caches.items() if reg.dtype != src.dtype}

    def visit_BufferLoad(self, e: BufferLoad) -> Expr:
        cache, key = self.caches.get(e.buffer), self.keys.get(e.buffer)
        if cache is not None and key is not None and len(e.indices) == len(key) \
                and all(map(same_index, e.indices, key)):
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
              column_sums: str = "local", prefetch: bool = False, float_rows: bool = False,
              whole_steps: bool = False, prefetch_into: str = "registers", occupancy: bool = True) -> Module:
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
    prefetch: with row_blocks, load the block's next row while this row is computed (the loads
    in flight through the reductions' barriers: what one resident block per SM needs to keep
    DRAM busy); prefetch_into: into a second set of registers ("registers"), or staged in shared
    memory by cp.async ("shared", row_prefetch.py: no registers, and the loads issued as the row
    is taken, where ptxas may hold register loads back until the row's last use of its own).
    float_rows: with cache="registers", a 16-bit input's row registers hold it converted to
    float32 once (at the load, or as the prefetched row is taken), not at each pass that reads
    it: one register per element either way (ptxas keeps one cached 16-bit element per 32-bit
    register), one conversion instead of one per pass.
    whole_steps: with cache="registers" and a row that is no multiple of T·V, only the last
    step of a thread's walk tests the row's end (`k < K_full || col < C`): the steps below fold
    to straight-line code (the cross-entropy over 50,304 bf16 logits then issues its row's loads
    together instead of one after another, and 2880 -> 2736 instructions per row); without it
    every step is a branch (the compiler does not know tx < T).
    The kernel asks for `min_blocks_per_sm` resident blocks (see SM_THREADS above); with
    `occupancy=False` it asks for none, and ptxas gives it the registers it needs (the fallback
    of a group that reads many rows, whose own registers the request's estimate leaves out)."""
    group = row_group(args)
    _check_point(group, threads, cache, vector, unroll, rows_per_block, row_blocks, prefetch)
    if prefetch_into not in PREFETCH_INTO or (prefetch_into == "shared" and not prefetch):
        raise ScheduleError(f"fuse_rows: prefetch_into={prefetch_into!r} needs prefetch=True and one of {PREFETCH_INTO}")
    rows = _RowKernel(group, threads, cache, vector, rows_per_block, unroll, row_blocks, whole_steps)
    rows.occupancy = occupancy
    rows.cache_row(prefetch, float_rows, prefetch_into)
    rows.row_registers()
    rows.row_passes(rows.passes())
    if group.column_reductions:
        rows.column_sums(column_sums)
    return _module(rows, rows.kernel(), name)


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


class _RowKernel:
    """The row kernel of a group (module docstring) in the parts a reader sees: the block's row
    and the thread's columns (here), the row's registers, the passes over the row in program
    order, the column sums, and the grid around them (`kernel`). The parts append to `stmts`
    (the row's statements) and `allocs` (its local buffers), and record what the module's
    attributes need: `touched` (the row arrays each pass reads or writes), `merged` (passes
    folded into the one before, cache="online"), `welford` (of which mean/variance pairs)."""

    def __init__(self, group: RowGroup, threads: int, cache: str, vector: int, rows_per_block: int, unroll: int,
                 row_blocks: int, whole_steps: bool = False) -> None:
        self.group, self.cache, self.row_blocks = group, cache, row_blocks
        self.T, self.V, self.W = T, V, W = threads, vector, rows_per_block
        C = group.columns
        c_const = const_int(C)
        self.prog = prog = group.program
        self.sig = sig = signature(prog)
        self.buffers, self.unique = buffers, unique = sig.buffers, sig.unique

        # the block's row: blockIdx.x over the flattened rows (W rows per block: row b·W + ty), unflattened
        # row-major; with row_blocks S, block b walks the rows step·S + b
        self.b, self.tx, self.ty = b, tx, ty = [Var(unique(n), dt.int32) for n in ("row", "tx", "ty")]
        self.step = step = Var(unique("row_step"), dt.int32) if row_blocks else None
        flat_row: Expr = b * W + ty if W > 1 else b
        if step is not None:
            flat_row = step * row_blocks + b
        self.flat_row = flat_row
        self.row_idx = unflatten(flat_row, group.rows)
        self.n_rows = size_product(group.rows)

        # the column walk: col = k*T + tx, k < K (a re-read row: the chunked walk of row_chunks.py,
        # whose passes are written in the column variable `col`)
        self.k, self.v = k, v = Var(unique("k"), dt.int32), Var(unique("v"), dt.int32)
        self.chunks: ColumnWalk | None = None
        if cache == "registers":
            self.col: Expr = (k * T + tx) * V + v if V > 1 else k * T + tx
        else:
            self.col = Var(unique("col"), dt.int32)
            self.chunks = ColumnWalk(C, T, V, unroll, tx, self.col, lambda label: Var(unique(label), dt.int32),
                                     lambda load, n: Buffer(unique(f"{load.buffer.name}_chunk"), load.buffer.dtype,
                                                            (n,), "local", tensor=f"{load.buffer.tensor}.chunk"))
        self.slot = k * V + v if V > 1 else k
        self.K: Expr = Const(-(-(c_const or 0) // (T * V)), dt.int32)
        self.needs_guard = c_const is not None and c_const % (T * V) != 0
        self.whole_steps = whole_steps  # only the last step tests the row's end (guard)
        self.occupancy = True  # ask for min_blocks_per_sm resident blocks (fuse_rows' `occupancy`)
        self.varying = {k, v, tx}  # what a row-invariant value is free of (row_algebra.py)

        self.base_inliner = Inliner(prog.inlined, buffers)
        self.values: dict[Tensor, Buffer] = {}   # every row value's register (row_registers)
        self.inliner = RowInliner(self.base_inliner, self.values, self.row_idx)
        self.caches: dict[Buffer, Buffer] = {}   # a cached input's row registers (cache_row)
        self.prefetched: list[tuple[Buffer, Expr]] = []  # (the next row's registers, the row's load)
        self.staged: StagedRows | None = None      # the next row in shared memory (row_prefetch.py)
        self.shared: dict[Expr, Buffer] = {}     # values a later pass reads again (passes)
        self.hoisted: dict[Expr, Buffer] = {}    # divisions by row values, once per row
        self.accs: dict[int, Expr] = {}          # every Reduce's all-reduced accumulator
        self.done: set[Tensor] = set()           # the row values computed so far
        self.partials: ColumnPartials | None = None
        self.stmts: list[Stmt] = []
        self.allocs: list[Buffer] = []
        self.touched: list[set[int]] = []
        self.merged: set[int] = set()
        self.welford = 0

    # ---- the thread's columns
    def column_loop(self, body: Stmt, vectorized: bool = False) -> Stmt:
        """The registers form's walk: k < K, every step unrolled (the row's registers are indexed by k)."""
        k, V = self.k, self.V
        C = self.group.columns
        if V > 1:
            # C is a multiple of V: a vector is wholly inside the row or wholly past it
            body = For(self.v, 0, V, "vectorize" if vectorized else "unroll", body)
            if self.needs_guard:
                body = IfThenElse(self.guard((k * self.T + self.tx) * V < C), body)
            return For(k, 0, self.K, "unroll", body)
        if self.needs_guard:
            body = IfThenElse(self.guard(self.col < C), body)
        return For(k, 0, self.K, "unroll", body)

    def guard(self, inside: Expr) -> Expr:
        """The test of a step of the walk: `inside` (its columns are in the row), after
        `k < K_full` (the steps whose T·V columns all lie inside the row) with whole_steps. Only
        the last step can pass the row's end, but the compiler does not know tx < T, so the column
        test alone keeps a branch and its predicate bookkeeping around every unrolled step; with
        `k < K_full` first, the steps below K_full fold to straight-line code whose loads ptxas
        issues together."""
        if not self.whole_steps:
            return inside
        c_const = const_int(self.group.columns)
        assert c_const is not None
        return (self.k < c_const // (self.T * self.V)) | inside

    def over_columns(self, exprs: list[Expr], element: Callable[[Callable[[Expr], Expr], Expr], Stmt],
                     vectorized: bool = False) -> Stmt:
        """The walk over the thread's columns running `element(value, column)` at each: `value`
        maps a pass expression to its value at the column (chunk registers for a re-read row)."""
        if self.chunks is None:
            return self.column_loop(element(lambda e: e, self.col), vectorized)
        return self.chunks.loop(exprs, self.row_idx, lambda ch: ch.each(element(ch.value, ch.column), vectorized))

    def new_local(self, label: str, dtype: dt.DType, n: int) -> Buffer:
        buf = Buffer(self.unique(label), dtype, (n,), "local", tensor=label)
        self.allocs.append(buf)
        return buf

    # ---- the row's registers
    def cache_row(self, prefetch: bool, float_rows: bool, into: str = "registers") -> None:
        """cache="registers": every input read at [row.., col] loaded once into K·V registers
        (16-bit ones widened to float32 with `float_rows`); with `prefetch`, taken from the
        registers the previous step loaded, and the next row's loads issued (prefetch_next_row),
        or `into` "shared": taken from the shared stage the previous step copied into, and the
        next row's copies issued (row_prefetch.py). Sets `cacher`, which turns the passes' loads
        of the row into its registers."""
        group, unique, slot = self.group, self.unique, self.slot
        row_shape = group.rows + (group.columns,)
        keys = self.row_reads()
        cached = list(keys)
        plain = all(same_shape(t.shape, row_shape) for t in cached)
        if prefetch and into == "shared" and self.cache == "registers" and cached and plain:
            self.stage_rows(cached, float_rows)
            return
        for t in cached if self.cache == "registers" else []:
            src = self.buffers[t]
            widen = float_rows and src.dtype in (dt.float16, dt.bfloat16)
            reg = Buffer(unique(f"{src.name}_row"), dt.float32 if widen else src.dtype, (self.K * self.V,), "local",
                         tensor=f"{t.name}.local")
            self.caches[src] = reg
            self.allocs.append(reg)
            load = src[keys[t]]
            if not prefetch:
                self.stmts.append(self.column_loop(BufferStore(reg, (slot,), cast(load, reg.dtype)), vectorized=True))
                continue
            # this row was loaded by the previous step (or before the loop) into `next`
            nxt = Buffer(unique(f"{src.name}_next"), src.dtype, (self.K * self.V,), "local", tensor=f"{t.name}.next")
            self.prefetched.append((nxt, load))
            self.stmts.append(self.column_loop(BufferStore(reg, (slot,), cast(nxt[slot], reg.dtype))))
        if self.prefetched:
            self.prefetch_next_row()
        self.cacher = _CacheRow(self.caches, {self.buffers[t]: keys[t] for t in cached}, self.slot)

    def row_reads(self) -> dict[Tensor, tuple[Expr, ...]]:
        """The row inputs (RowGroup.row_inputs) and the index of the row's element at `col` in
        each: [row.., col] for an input of the row's shape; for a view of the rows, the index the
        passes read it at, where they read it at one index whose last is the column and whose
        others do not move with it (else it is not cached: its reads stay loads)."""
        group = self.group
        row_shape = group.rows + (group.columns,)
        col_vars = free_vars(self.col)
        passes = None
        out: dict[Tensor, tuple[Expr, ...]] = {}
        for t in group.row_inputs:
            if same_shape(t.shape, row_shape):
                out[t] = self.row_idx + (self.col,)
                continue
            if passes is None:
                # (the statistics' registers are not made yet: placeholders stand for them here)
                stand_in = {u: Buffer(u.name, u.dtype, (Const(1, dt.int32),), "local")
                            for u in group.reductions + group.row_values}
                inliner = RowInliner(self.base_inliner, stand_in, self.row_idx)
                passes = row_passes(group, inliner, self.row_idx, self.col)
            src = self.buffers[t]
            reads = [n.indices for _, expr, _ in passes for n in walk(expr)
                     if isinstance(n, BufferLoad) and n.buffer is src]
            if not reads:
                continue
            first = reads[0]
            if not same_index(first[-1], self.col) or any(free_vars(i) & col_vars for i in first[:-1]):
                continue
            if all(len(r) == len(first) and all(map(same_index, r, first)) for r in reads[1:]):
                out[t] = tuple(first)
        return out

    def stage_rows(self, cached: list[Tensor], float_rows: bool) -> None:
        """prefetch_into="shared": this row taken from the shared stages after the wait for its
        copies, then the next row's copies issued and committed (row_prefetch.py)."""
        assert self.step is not None
        C = self.group.columns
        guard = (lambda first: self.guard(first < C)) if self.needs_guard else None
        k_const = const_int(self.K)
        assert k_const is not None
        self.staged = staged = StagedRows(self.T, self.V, k_const, self.tx, self.k, self.step, self.row_idx, guard,
                                          self.unique)
        takes: list[Stmt] = []
        for t in cached:
            src = self.buffers[t]
            widen = float_rows and src.dtype in (dt.float16, dt.bfloat16)
            reg = Buffer(self.unique(f"{src.name}_row"), dt.float32 if widen else src.dtype, (self.K * self.V,),
                         "local", tensor=f"{t.name}.local")
            self.caches[src] = reg
            self.allocs.append(reg)
            takes.append(self.column_loop(staged.take(staged.stage(src, t.name), reg, self.slot, self.col),
                                          vectorized=True))
        self.stmts.extend([staged.wait(), *takes,
                           IfThenElse(self.flat_row + self.row_blocks < self.n_rows, staged.issue(self.step + 1)),
                           staged.commit()])
        key = self.row_idx + (self.col,)
        self.cacher = _CacheRow(self.caches, {self.buffers[t]: key for t in cached}, self.slot)

    def prefetch_next_row(self) -> None:
        """The next row's loads, in flight while this row is computed."""
        step = self.step
        assert step is not None
        self.stmts.append(IfThenElse(self.flat_row + self.row_blocks < self.n_rows, seq(*(
            self.column_loop(BufferStore(nxt, (self.slot,), substitute(load, {step: step + 1})), vectorized=True)
            for nxt, load in self.prefetched))))

    def row_registers(self) -> None:
        """One register of every thread for the row value of every reduction stage, then of every
        row value (an elementwise output of the row shape)."""
        for t in self.group.reductions + self.group.row_values:
            self.values[t] = Buffer(self.unique(f"{t.name}_val"), t.dtype, (1,), "local", tensor=f"{t.name}.local")
            self.allocs.append(self.values[t])

    def finish(self, t: Tensor | None) -> list[Stmt]:
        """Reduction stage t's row value (and its store), then every row value whose statistics
        are now all known (t None: those that read none)."""
        row_idx, inliner, values = self.row_idx, self.inliner, self.values
        out = [] if t is None else finish_reduction(t, row_idx, self.accs, inliner, values[t], self.buffers, self.tx)
        if t is not None:
            self.done.add(t)
        for u in self.group.row_values:
            if u not in self.done and reads_only(u, values, self.done, inliner, row_idx):
                self.done.add(u)
                out.extend(finish_reduction(u, row_idx, self.accs, inliner, values[u], self.buffers, self.tx))
        return out

    # ---- the passes over the row
    def passes(self) -> list[Pass]:
        """The per-column expression of every pass, in program order: one per Reduce of a
        reduction stage (its source at column `col`), one per elementwise output (its value at
        `col`), reading the cached row; with the row in registers, products' row-invariant
        factors grouped, once per row (row_algebra.py), and the values a later pass computes
        again given registers (`shared`)."""
        passes = [(t, self.cacher.visit(expr), r) for t, expr, r in row_passes(self.group, self.inliner, self.row_idx,
                                                                               self.col)]
        if self.cache != "registers":
            return passes
        passes = [(t, group_invariants(expr, self.varying), r) for t, expr, r in passes]
        self.shared = shared_column_values(passes, self.k, lambda e: Buffer(
            self.unique("t_row"), e.dtype, (self.K * self.V,), "local", tensor="row.shared"))
        self.allocs.extend(self.shared.values())
        return passes

    def row_passes(self, passes: list[Pass]) -> None:
        """The row values that read no statistic, then every pass in program order: two
        reductions computed in one pass where online_stats.py recognises them (cache="online"),
        else each reduction's accumulation and all-reduce, and each output's stores."""
        self.stmts.extend(self.finish(None))
        copies = statistic_copies(self.group, self.values, self.inliner, self.row_idx) if self.cache == "online" else {}
        for i, (t, expr, r) in enumerate(passes):
            if i in self.merged:
                self.touched.append(set())
                continue
            pair = None
            if self.cache == "online":
                assert self.chunks is not None and isinstance(self.col, Var)
                pair = max_sum_exp_pair(passes, i, self.values, copies) or welford_pair(passes, i, self.col)
            if pair is not None:
                self.online_pair(passes, i, pair)
                continue
            keep, expr = self.kept_values(passes, i)
            if r is not None:
                self.reduction(t, expr, r, keep, last_of_stage=i + 1 == len(passes) or passes[i + 1][0] is not t)
            else:
                out = self.buffers[t]
                self.stmts.append(self.over_columns([expr], lambda value, column: BufferStore(
                    out, self.row_idx + (column,), value(expr)), vectorized=True))

    def kept_values(self, passes: list[Pass], i: int) -> tuple[list[Stmt], Expr]:
        """Pass i's expression reading the registers of the values an earlier pass kept, and the
        stores keeping those it computes first for a later pass; with the row in registers, a
        division by row values computed once per row (row_algebra.py)."""
        shared, slot = self.shared, self.slot
        mine = {e: buf for e, buf in shared.items() if first_pass(passes, e) == i}
        used = SubexpressionReplacer({e: buf[slot] for e, buf in shared.items() if e not in mine})
        kept = [(buf, used.visit(e)) for e, buf in mine.items()]
        expr = passes[i][1]
        expr = SubexpressionReplacer({e: buf[slot] for e, buf in shared.items()}).visit(expr) if mine else used.visit(expr)
        self.touched.append({id(n.buffer) for _, value in kept for n in walk(value) if isinstance(n, BufferLoad)}
                            | {id(n.buffer) for n in walk(expr) if isinstance(n, BufferLoad)}
                            | {id(buf) for buf in mine.values()})
        if self.cache == "registers":
            expr = self.hoist_divisions(expr)
        return [BufferStore(buf, (slot,), value) for buf, value in kept], expr

    def hoist_divisions(self, e: Expr) -> Expr:
        """`e` with its divisions free of the column read from registers set once per row."""
        found = invariant_divisions(e, self.varying)
        for d in found:
            if d not in self.hoisted:
                self.hoisted[d] = self.new_local("row_quotient", d.dtype, 1)
                self.stmts.append(BufferStore(self.hoisted[d], (ZERO,), d))
        return SubexpressionReplacer({d: self.hoisted[d][ZERO] for d in found}).visit(e) if found else e

    # ---- reductions
    def reduction(self, t: Tensor, expr: Expr, r: Reduce, keep: list[Stmt], last_of_stage: bool) -> None:
        """Reduce `r` of stage `t`: the thread's columns accumulated (storing the `keep` values as
        they are computed), all-reduced over the block; the stage's row value after its last."""
        cache, stmts = self.cache, self.stmts
        closed = delta_sum(expr, self.col, self.group.columns, self.varying, r.acc_dtype) \
            if r.combiner == "sum" and not keep else None
        if closed is not None:  # a one-hot row: no walk (row_algebra.py)
            self.accs[id(r)] = cast(closed, r.dtype)
            if last_of_stage:
                stmts.extend(self.finish(t))
            return
        acc = Buffer(self.unique(f"{t.name}_acc"), r.acc_dtype, (1,), "local", tensor=f"{t.name}.acc")
        self.allocs.append(acc)
        stmts.append(BufferStore(acc, (ZERO,), reduce_identity(r.combiner, r.acc_dtype)))
        combine = COMBINE[r.combiner]
        factor = None  # Σ V·I = I·Σ V for a row-invariant I (row_algebra.py)
        if cache == "registers" and r.combiner == "sum" and expr.dtype == acc.dtype:
            expr, factor = split_invariant(expr, self.varying)
        stmts.append(self.over_columns([expr], lambda value, _column: seq(
            *keep, BufferStore(acc, (ZERO,), binary(combine, acc[ZERO], cast(value(expr), acc.dtype))))))
        stmts.append(allreduce(acc, COMBINE[r.combiner], self.tx, self.T, self.unique(f"{t.name}_block"),
                               shuffle_stage=self.row_blocks > 0))
        self.accs[id(r)] = cast(acc[ZERO] if factor is None else acc[ZERO] * factor, r.dtype)
        if last_of_stage:
            stmts.extend(self.finish(t))

    def online_pair(self, passes: list[Pass], i: int, pair: tuple[Tensor, Reduce, Expr]) -> None:
        """Pass i's reduction and the next one in ONE pass over the row (online_stats.py): a
        running max with its rescaled sum of exp, or Welford / Chan moments."""
        t, expr, r = passes[i]
        t2, r2, other = pair
        chunks, unique, stmts, accs = self.chunks, self.unique, self.stmts, self.accs
        assert r is not None and chunks is not None
        acc = Buffer(unique(f"{t.name}_acc"), r.acc_dtype, (1,), "local", tensor=f"{t.name}.acc")
        acc2 = Buffer(unique(f"{t2.name}_acc"), r2.acc_dtype, (1,), "local", tensor=f"{t2.name}.acc")
        self.allocs.extend([acc, acc2])
        if r.combiner == "max":
            stmts.extend(online_max_sum(cast(expr, r.acc_dtype), other, chunks, self.row_idx, acc, acc2,
                                        self.new_local, self.tx, self.T, t.name,
                                        (unique(f"{t.name}_block"), unique(f"{t2.name}_block"))))
            accs[id(r)] = cast(acc[ZERO], r.dtype)
            accs[id(r2)] = cast(acc2[ZERO], r2.dtype)
            stmts.extend(self.finish(t))
        else:
            moments = (self.new_local(f"{t.name}_count", r.acc_dtype, 1),
                       self.new_local(f"{t.name}_mean", r.acc_dtype, 1),
                       self.new_local(f"{t.name}_m2", r.acc_dtype, 1))
            stmts.extend(welford_moments(expr, chunks, self.row_idx, moments, self.new_local, self.tx, self.T, t.name,
                                         unique(f"{t.name}_block")))
            stmts.append(BufferStore(acc, (ZERO,), moments[0][ZERO] * moments[1][ZERO]))  # S = n·mean
            accs[id(r)] = cast(acc[ZERO], r.dtype)
            stmts.extend(self.finish(t))
            # μ (pass i+1's) may read t's row value, set just above
            stmts.append(BufferStore(acc2, (ZERO,), centered_sum(moments, other)))
            accs[id(r2)] = cast(acc2[ZERO], r2.dtype)
            self.welford += 1
        self.merged.add(i + 1)
        self.touched.append(set())
        if i + 2 == len(passes) or passes[i + 2][0] is not t2:
            stmts.extend(self.finish(t2))

    # ---- column sums (row_columns.py)
    def column_sums(self, scope: str) -> None:
        """This row's values at the thread's columns, added into the column reductions' partial
        sums (kept in `scope`)."""
        self.partials = partials = ColumnPartials(self.group, self.row_blocks, self.K * self.V, self.buffers,
                                                  self.unique, scope, self.T, self.tx)
        update = partials.update(self.column_loop, self.row_idx, self.col, self.slot,
                                 lambda e: group_invariants(self.cacher.visit(self.inliner.visit(e)), self.varying))
        self.touched.append({id(n.buffer) for e in exprs_of(update) for n in walk(e) if isinstance(n, BufferLoad)})
        self.stmts.append(update)

    # ---- the grid
    def kernel(self) -> Stmt:
        """The row's statements with their local buffers, under the grid: one row per block, W
        rows per block (one warp each, the last block's missing rows guarded), or S blocks
        walking the rows (walk_rows)."""
        b, tx, T, W = self.b, self.tx, self.T, self.W
        body: Stmt = seq(*self.stmts)
        for buf in reversed(self.allocs + (self.chunks.buffers if self.chunks is not None else [])):
            body = Allocate(buf, body)
        if self.step is not None:
            return self.walk_rows(body)
        if W > 1:
            n_const = const_int(self.n_rows)
            if n_const is None or n_const % W:
                body = IfThenElse(self.flat_row < self.n_rows, body)  # whole warps: a warp is one row
            return For(b, 0, (self.n_rows + (W - 1)) // W, "blockIdx.x",
                       For(self.ty, 0, W, "threadIdx.y", For(tx, 0, T, "threadIdx.x", body)))
        return For(b, 0, self.n_rows, "blockIdx.x", For(tx, 0, T, "threadIdx.x", body))

    def walk_rows(self, body: Stmt) -> Stmt:
        """row_blocks: the block's rows one after another; the first row's loads (prefetch) before
        them, the column sums' accumulators around them and their partial stores after."""
        step, b, n_rows, slot, partials = self.step, self.b, self.n_rows, self.slot, self.partials
        assert step is not None
        body = row_loop(step, self.row_blocks, self.flat_row, n_rows, body, barrier=self.T > WARP)
        first = [self.column_loop(BufferStore(nxt, (slot,), substitute(load, {step: ZERO})), True)
                 for nxt, load in self.prefetched]
        body = seq(IfThenElse(b < n_rows, seq(*first)), body) if first else body
        for nxt, _ in reversed(self.prefetched):
            body = Allocate(nxt, body)
        if self.staged is not None:  # the first row's copies, then the stages around the rows
            body = seq(IfThenElse(b < n_rows, self.staged.issue(ZERO)), self.staged.commit(), body)
            for stage, _ in reversed(self.staged.inputs):
                body = Allocate(stage, body)
        if partials is not None:
            body = partials.wrap(seq(partials.init(self.column_loop, slot), body,
                                     partials.store(self.column_loop, b, self.col, slot)))
        return For(b, 0, self.row_blocks, "blockIdx.x", For(self.tx, 0, self.T, "threadIdx.x", body))

    # ---- what the module records
    def attrs(self) -> tuple[tuple[str, object], ...]:
        """The row kernel's attributes: the stages it fuses, the one-pass pairs, the resident
        blocks it asks for (row in registers), the row blocks."""
        attrs: tuple[tuple[str, object], ...] = (("fused_rows", tuple(t.name for t in self.prog.stages)),)
        if self.merged:  # reductions computed together with the one before them (cache="online")
            attrs += (("online_pairs", len(self.merged)),)
        if self.welford:  # of which mean/variance pairs (Welford / Chan moments)
            attrs += (("welford_pairs", self.welford),)
        if self.chunks is not None:  # the passes that read the row from global memory
            attrs += (("row_reads", self.chunks.reads),)
        if self.cache == "registers" and self.occupancy:
            blocks = self.resident_blocks()
            if blocks > 1:
                attrs += (("min_blocks_per_sm", blocks),)
        if self.step is not None:
            attrs += (("row_blocks", self.row_blocks),)
        return attrs

    def resident_blocks(self) -> int:
        """The blocks per SM whose register cap holds the row arrays at their peak beside the
        kernel's own registers (min_blocks_per_sm)."""
        k_const = const_int(self.K)
        assert k_const is not None
        words, partials = k_const * self.V, self.partials
        # one register per cached element of up to 32 bits: ptxas does not pack two 16-bit
        # elements of a register array into one register (bf16 rows of 16 spilled at 32); a
        # 64-bit element takes two (int64 targets of a loss summed over 8192 rows spilled at 42)
        arrays = list(self.caches.values()) + list(self.shared.values())
        words *= max([1] + [b.dtype.bits // 32 for b in self.caches.values()])
        row_words = peak_row_words(row_spans(self.touched, arrays, list(self.caches.values())), words)
        if partials is not None and partials.scope == "local":  # the column sums live through every row
            row_words += len(partials.accs) * words
        row_words += len(self.prefetched) * words
        blocks = min_blocks_per_sm(self.T * self.W, row_words,
                                   COLUMN_KERNEL_REGISTERS if partials is not None else ROW_KERNEL_REGISTERS)
        if partials is not None:  # the blocks the plan keeps resident, no more (row_columns.py)
            blocks = min(blocks, MAX_COLUMN_BLOCKS_PER_SM)
        smem = self.staged.smem_bytes() if self.staged is not None else 0
        if partials is not None and partials.scope == "shared":
            smem += len(partials.accs) * words * self.T * 4
        if smem:  # no more blocks than the shared memory of an SM holds (the smaller of sm_80 / sm_90)
            blocks = max(1, min(blocks, SM_SHARED_BYTES // smem))
        return blocks


def _module(rows: _RowKernel, body: Stmt, name: str | None) -> Module:
    """The module launching the row kernel `body` and, with column reductions, the kernel that
    combines their partial sums: each kernel's parameters and attributes, the module's signature."""
    prog, sig, partials = rows.prog, rows.sig, rows.partials
    last = prog.stages[-1].name
    kname = sig.unique(f"{last}_rows_kernel")
    arrays = [sig.buffers[a] for a in prog.args]
    temps = tuple(partials.partials) if partials is not None else ()
    kernels = [PrimFunc(kname, kernel_params(body, arrays, temps, sig.scalars), body, rows.attrs())]
    if partials is not None:  # the column reductions' partial rows, folded
        combine = partials.combine_kernel(rows.base_inliner)
        kernels.append(PrimFunc(sig.unique(f"{last}_columns_kernel"), kernel_params(combine, arrays, temps, sig.scalars),
                                combine, partials.attrs))
    mname = identifier(name or next(a.name for a in reversed(prog.args) if not a.is_placeholder))
    return Module(mname, tuple(arrays) + tuple(sig.scalars), tuple(kernels),
                  tuple(KernelCall(k.name, k.params) for k in kernels), temps)


__all__ = ["CACHES", "COLUMN_KERNEL_REGISTERS", "VECTORS", "RowGroup", "fuse_rows", "min_blocks_per_sm", "peak_row_words",
           "row_group"]
