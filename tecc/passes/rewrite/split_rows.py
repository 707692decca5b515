"""Split rows: a reduction over few long rows (or a whole tensor) as a two-stage grid reduction.

A row sum `Y[r] = Σ_c X[r, c]` over 8 rows of 16M elements, a full reduction `Y = Σ_{i,j} X[i, j]`
or a mean over the trailing axes of a batch of 4: one block (or warp) per row puts a handful of
blocks on a 132-SM GPU, far from DRAM bandwidth. `split_rows` gives every row S blocks, each
reducing one contiguous chunk of L = rounds·T·V·U elements of the row, and a second small kernel
combining the S partials of a row (`combine="kernel"`, the default; the one-kernel form is below):

    # kernel 1: S blocks per row (blockIdx.x = row·S + s), T threads each
    for b in blockIdx.x(rows·S): for tx in threadIdx.x(T):
      row, s = b // S, b % S
      let lo = row·N + s·L; n = max(min(L, N - s·L), 0)    # the chunk [lo, lo + n), flat positions
      let head = (V - lo % V) % V (capped at n); vectors = (n - head) // V; whole = vectors // (T·U)
      acc[v] = identity                                    (V accumulators, one per vector lane)
      acc[0] ⊕= where(tx < head, f(X[lo + tx]), identity)  # the chunk's unaligned ends, element
      acc[0] ⊕= where(tx < tail, f(X[end + tx]), identity) # by element (none if V divides N)
      for k in serial(whole):                              # #pragma unroll 1
        for u in unroll(U):                                # U independent 16-byte loads in flight
          for v in vectorize(V): acc[v] ⊕= f(X[(first + (k·U + u)·T + tx)·V + v])
      for u in unroll(U):                                  # the last, partial round
        for v in vectorize(V): acc[v] ⊕= where((whole·U + u)·T + tx < vectors, f(X[..]), identity)
      acc[0] = ⊕_v acc[v]; <allreduce acc over the block>  (cross_thread.py: shuffles + shared)
      if tx == 0: partial[row, s] = acc[0]                 (S == 1: Y[row] = finish(acc[0]), no kernel 2)
    # kernel 2: one block of T2 = min(256, S rounded up to a warp) threads per row
    for row in blockIdx.x(rows): for tx in threadIdx.x(T2):
      acc = ⊕_{i < ceil(S/T2)} partial[row, i·T2 + tx]; <allreduce>; if tx == 0: Y[row] = finish(acc)

`finish` is the stage's body with its Reduce replaced by the combined accumulator (a mean's 1/N, a
cast to bf16, ...). The partials are in the accumulation dtype (float32 for fp16/bf16 sources).

One kernel (`combine="last_block"`, S > 1): instead of kernel 2, the last of a row's S blocks to
store its partial combines the row, with the handshake of tecc/passes/rewrite/last_block.py (shared with
split_reduce; the argument that it is right is there and in split_reduce's docstring). A row's
S blocks are one group, counted on `arrivals[row]` (a zero_init int32 temporary of `rows`
counters, reset by the last block, so every launch finds it zero). The grid is 2-D, rows along
blockIdx.x and a row's S blocks along blockIdx.y (S ≤ 65535): the row is needed again after the
rounds, and a block index costs no register there, where b // S of the 1-D grid stayed live and
made ptxas spill at the 32-register cap of 8 blocks per SM (2 × (3M+7) at S = 769, sm_90):

    for row in blockIdx.x(rows): for s in blockIdx.y(S): for tx in threadIdx.x(T):
      <kernel 1 up to its block reduction, as above>
      if tx == 0: partial[row, s] = acc[0]
      if tx == 0:                                  # thread 0 stored the partial itself: no barrier
        thread_fence(); arrived[0] = atomic_add(arrivals[row], 1)
        if arrived[0] == S - 1: thread_fence()
      barrier()
      if arrived[0] == S - 1:                      # block-uniform
        acc[0] = ⊕_{i < ceil(S/T)} where(i·T + tx < S, load_cg(partial[row, i·T + tx]), identity)
        <allreduce acc over the block>; if tx == 0: Y[row] = finish(acc[0])
        if tx == 0: arrivals[row] = 0

The partials are read at L2 (`load_cg`, never the non-coherent `ld.global.nc`: this kernel wrote
them) with selects, so the ceil(S/T) loads of this last critical path are issued together.

Flat views: an input whose every load is `X[output axes.., reduced axes..]` and whose shape is the
output's shape followed by the reduced extents (contiguous, unstrided) holds the rows one after
another, so kernel 1 reads it through a 1-D view `X[rows·N]` (same name: the host passes the same
pointer) at flat positions. The reduced axes (one or several: a full reduction reduces all of
them) need no unflattening, and 16-byte vectors are aligned in flat space whatever N is: a row
that starts inside a vector has its first `head` and last `tail` elements (< V each) read one by
one, by the first threads of each block, before the rounds so that their latency overlaps. Other
uses of the reduced axes (a weight `W[c]`) get the column `position - row·N`, unflattened. Without
a view (a strided input, or one of 2^31 elements or more, whose offsets need 64-bit arithmetic),
positions are columns of the row, and V > 1 needs the innermost reduced extent to be a constant
multiple of V (several axes: unflattened per vector as `q // (B/V)`, `(q % (B/V))·V + v`, so the
offset of lane 0 stays visibly a multiple of V), or a single row reduced over one axis.

Guards are selects (`where`), not branches: a guarded load is predicated, so the U loads of the
last round are issued together like those of a whole round (a load under a branch waits for the
branch). When every chunk is whole and aligned (S·L = N, a constant V divides) the rounds are
unconditional, the chunk's first vector is `row·(N/V) + s·L/V` and nothing divides at run time.

Any combiner with an identity (sum, prod, max, min) and any dtype whose accumulator the
cross-thread reduction supports; symbolic N and rows; 0 rows launch nothing, 0-length rows give
the identity (through `finish`); chunks past the end of a row (an explicit plan with more splits
than the row has chunks) contribute the identity.

What is accepted (ScheduleError says why not): after elementwise producers are inlined, one
compute stage, an output, whose body holds one Reduce over one or more axes starting at 0, with
extents free of the output's axes.
"""

from __future__ import annotations

from typing import Sequence

from ...ir import dtype as dt
from ...ir.errors import ScheduleError
from ...ir.expr import (BufferLoad, Const, Expr, Reduce, Var, binary, cast, const_int, free_vars, load_cg,
                       reduce_identity, select, size_product, substitute, walk)
from ...ir.stmt import Allocate, Buffer, BufferStore, For, IfThenElse, KernelCall, LetStmt, Module, PrimFunc, Stmt, seq
from ...ir.tensor import ComputeOp, Tensor
from ...ir.visitor import ExprMutator
from .last_block import COMBINE_FORMS, MAX_GRID_Y, LastBlockHandshake
from ..lower import COMBINE, Inliner, buffer_for, choose_inlined, collect_program, kernel_params, unflatten
from ..names import identifier
from ..schedule.cross_thread import WARP, allreduce
from .reduction_stage import LoweredReduction, reduction_stage

VECTORS = (1, 2, 4, 8)
# Kernel 1 keeps its round loop rolled (`#pragma unroll 1`: U loads in flight per thread are the
# design, UNROLL_BYTES in strategies/split_rows.py) and asks for full occupancy
# (`__launch_bounds__(T, 2048 / T)`, at most 32 blocks: sm_80/sm_90 hold 2048 threads, 32 blocks
# and 64 K registers per SM, so ptxas keeps it at 32 registers). Without both, nvcc unrolled the
# constant-trip round loop of 16-bit rows into 40-46 registers (one point spilled): 5-6 blocks per
# SM instead of 8, and 87-94% of copy bandwidth where the rolled loop at 8 blocks reached 94-102%.
SM_THREADS = 2048
SM_BLOCKS = 32
ONE_ROUND = (("pragma_unroll", 1),)
COMBINE_THREADS = 256        # kernel 2: at most this many threads per row (S ≤ 2112: ≤ 9 loads each)
ZERO = Const(0, dt.int32)


def row_reduction(args: Sequence[Tensor]) -> tuple[Tensor, Reduce]:
    """The one reduction stage of the program `args` and its Reduce, or ScheduleError: any number
    of reduced axes (all of them: a 0-d output, a full reduction), whose extents are free of the
    output's axes."""
    t, r = reduction_stage(args, "split_rows")
    op = t.op
    assert isinstance(op, ComputeOp)
    if any(free_vars(ax.extent) & set(op.axes) for ax in r.axes):
        raise ScheduleError(f"split_rows: {t.name}'s reduction extent depends on the output's axes")
    return t, r


def vector_allowed(rows: Expr, extents: Sequence[Expr], vector: int, flat: bool) -> bool:
    """Whether loads of `vector` consecutive elements can be aligned vector loads (module
    docstring): always through flat views (`flat`), where each chunk's unaligned ends are read
    element by element; else the innermost reduced extent must be a constant multiple of it, or
    a single row be reduced over one axis (its last N % V elements are then read one by one)."""
    if vector == 1 or flat:
        return True
    last = const_int(extents[-1]) if extents else None
    if last is not None and last % vector == 0:
        return True
    return const_int(rows) == 1 and len(extents) == 1


def _same_extent(a: Expr, b: Expr) -> bool:
    return a is b or (const_int(a) is not None and const_int(a) == const_int(b))


def flat_views(args: Sequence[Tensor], buffers: dict[Tensor, Buffer] | None = None) -> dict[Buffer, Buffer]:
    """The inputs kernel 1 reads through a flat view `X[rows·N]`: contiguous (unstrided) inputs
    of shape rows + reduced extents, every load of which is `X[output axes.., reduced axes..]`
    (a row is then N consecutive elements, rows one after another), and whose element count is
    below 2^31 (the flat position is int32 arithmetic; a larger buffer keeps its own shape, whose
    offsets the emitter computes in 64 bits)."""
    stage, red = row_reduction(args)
    prog = choose_inlined(collect_program(args))
    op = stage.op
    assert isinstance(op, ComputeOp)
    if buffers is None:
        buffers = {t: buffer_for(t, t.name) for t in prog.args}
    extents = [ax.extent for ax in red.axes]
    canonical = tuple(op.axes) + tuple(red.axes)
    shape = tuple(stage.shape) + tuple(extents)
    loads = [n for n in walk(Inliner(prog.inlined, buffers).visit(op.body)) if isinstance(n, BufferLoad)]
    axes = set(red.axes)
    flat_length = size_product(shape)
    views: dict[Buffer, Buffer] = {}
    for buf in {id(n.buffer): n.buffer for n in loads if any(free_vars(i) & axes for i in n.indices)}.values():
        mine = [n for n in loads if n.buffer is buf]
        if (buf.strides is not None or len(buf.shape) != len(shape)
                or not all(_same_extent(d, e) for d, e in zip(buf.shape, shape))
                or not all(len(n.indices) == len(canonical) and all(i is a for i, a in zip(n.indices, canonical))
                           for n in mine)
                or any(e.dtype != dt.int32 or any(v.dtype != dt.int32 for v in free_vars(e)) for e in buf.shape)):
            continue
        count = const_int(flat_length)
        if count is not None and count >= 2**31:
            continue
        views[buf] = Buffer(buf.name, buf.dtype, (flat_length,), "global", None, buf.tensor)
    return views


def split_rows(args: Sequence[Tensor], threads: int = 256, splits: int = 1, vector: int = 1, unroll: int = 1,
               name: str | None = None, combine: str = "kernel") -> Module:
    """The module computing the one-reduction program `args` with every row (output element)
    reduced by `splits` blocks of `threads` threads over contiguous chunks, `unroll` loads of
    `vector` elements in flight per thread, and, when splits > 1, the S partials of a row
    combined by a second kernel (`combine="kernel"`) or, in the same kernel, by the last of
    the row's blocks to finish (`combine="last_block"`, with a zero_init counter per row); see
    the module docstring. The default is the two-kernel form, so plans recorded before the
    one-kernel form existed replay unchanged."""
    _check_point(threads, splits, vector, unroll, combine)
    low = LoweredReduction.of(args, *row_reduction(args))
    views = flat_views(args, low.sig.buffers)
    extents = [ax.extent for ax in low.red.axes]
    if not vector_allowed(size_product(low.stage.shape), extents, vector, bool(views)):
        raise ScheduleError(f"split_rows: vector={vector} needs the innermost reduced extent ({extents[-1]}) to be a "
                            "constant multiple of it, a single row reduced over one axis, or rows read through a "
                            "flat view (contiguous inputs indexed [rows.., reduced axes..])")
    one_pass = splits > 1 and combine == "last_block"
    chunks = _ChunkKernel(low, views, threads, splits, vector, unroll, one_pass)
    kernels = [("rows" if splits == 1 else ("split" if one_pass else "partial"), chunks.kernel())]
    if chunks.partial is not None and not one_pass:
        kernels.append(("combine", _combine_kernel(low, chunks.partial, splits)))
    return _module(low, views, kernels, chunks.temps, threads, name)


def _check_point(threads: int, splits: int, vector: int, unroll: int, combine: str) -> None:
    """ScheduleError unless split_rows' parameters are in range and fit each other."""
    if threads % WARP or not 0 < threads <= 1024:
        raise ScheduleError(f"split_rows: threads={threads}: a multiple of 32 up to 1024")
    if splits < 1 or unroll < 1:
        raise ScheduleError(f"split_rows: splits ({splits}) and unroll ({unroll}) must be at least 1")
    if vector not in VECTORS:
        raise ScheduleError(f"split_rows: vector must be one of {VECTORS}, got {vector}")
    if combine not in COMBINE_FORMS:
        raise ScheduleError(f"split_rows: combine={combine!r}; one of {', '.join(COMBINE_FORMS)}")
    if combine == "last_block" and splits > MAX_GRID_Y:
        raise ScheduleError(f"split_rows: splits ({splits}) over CUDA's gridDim.y limit of {MAX_GRID_Y} "
                            "(the one-pass form lays a row's blocks along y); use combine=\"kernel\"")


class _ChunkKernel:
    """Kernel 1 (module docstring): S blocks of T threads per row, each reducing its chunk of L =
    rounds·T·V·U elements of the row into V accumulators per thread, combined over the block;
    then the block's total stored as the row's output (S == 1) or as its partial, which the
    last of the row's blocks combines in the one-pass form. `partial` and `temps` are the
    partials' temporary (None when S == 1) and every temporary the kernel uses."""

    def __init__(self, low: LoweredReduction, views: dict[Buffer, Buffer], threads: int, splits: int, vector: int,
                 unroll: int, one_pass: bool) -> None:
        self.low, self.views, self.one_pass = low, views, one_pass
        self.T, self.S, self.V, self.U = T, S, V, U = threads, splits, vector, unroll
        unique, red = low.sig.unique, low.red
        self.unique = unique
        self.flat = bool(views)
        self.extents = extents = [ax.extent for ax in red.axes]
        self.tile = tile = T * V * U
        self.N = N = size_product(extents)
        self.n_const = n_const = const_int(N)
        self.last = last = const_int(extents[-1]) if extents else None
        self.combiner = COMBINE[red.combiner]
        self.acc_dtype = red.acc_dtype
        self.n_rows = size_product(low.stage.shape)
        self.partial: Buffer | None = None
        self.temps: tuple[Buffer, ...] = ()

        # the chunk: L = rounds·T·V·U elements, rounds = ceil(N / (S·T·V·U)), so S chunks cover a row
        self.rounds: Expr = (Const(-(-n_const // (S * tile)), dt.int32) if n_const is not None
                             else (N + (S * tile - 1)) // (S * tile))
        # every row starts on a vector boundary (V divides N): chunks start and end on one too
        self.aligned = (V == 1 or (n_const is not None and n_const % V == 0)
                        or (last is not None and last % V == 0))
        # every chunk is whole: S·L = N
        self.exact = (self.aligned and n_const is not None
                      and n_const == S * const_int(self.rounds) * tile)  # type: ignore[operator]

        self.b, self.tx = Var(unique("row" if one_pass else "b"), dt.int32), Var(unique("tx"), dt.int32)
        if one_pass:
            # rows along blockIdx.x, the S blocks of a row along blockIdx.y: the row and s are block
            # indices, which ptxas re-reads where it needs them (S2R) instead of keeping b // S live
            # through the rounds for the handshake and the combine (at the 32-register cap of 8
            # blocks per SM, the 1-D grid spilled one register in some plans)
            self.s_var = Var(unique("s"), dt.int32)
            self.row_flat: Expr = self.b
            self.s: Expr = self.s_var
        else:
            self.row_flat = self.b // S if S > 1 else self.b
            self.s = self.b % S if S > 1 else ZERO
        self.row_idx = unflatten(self.row_flat, low.stage.shape)
        # positions: the flat element of a viewed input (rows one after another), else the column
        self.base: Expr = self.row_flat * N if self.flat else ZERO
        self.position = Var(unique("p"), dt.int32)   # stands for the position in `template`
        self.template = _ToView(views, self.position).visit(low.inliner.visit(red.source))
        self.acc = Buffer(unique(f"{low.stage.name}_acc"), self.acc_dtype, (V,), "local",
                          tensor=f"{low.stage.name}.acc")
        self.identity = reduce_identity(red.combiner, self.acc_dtype)
        self.lets: list[tuple[Var, Expr]] = []

    def kernel(self) -> Stmt:
        """The kernel's loop nest: the chunk's rounds, the block's total, its store (and, in the
        one-pass form, the handshake and the last block's combine) under the grid."""
        body = seq(*self.rounds_of_chunk(), *self.block_total())
        if self.partial is not None and self.one_pass:
            body = self.last_block_combines(body, self.partial)
        for var, value in reversed(self.lets):
            body = LetStmt(var, value, body)
        body = For(self.tx, 0, self.T, "threadIdx.x", Allocate(self.acc, body))
        if self.one_pass:
            return For(self.b, 0, self.n_rows, "blockIdx.x", For(self.s_var, 0, self.S, "blockIdx.y", body))
        return For(self.b, 0, self.n_rows * self.S, "blockIdx.x", body)

    # ---- the chunk's walk
    def source_at(self, pos: Expr, vector_lane: tuple[Expr, Var] | None = None) -> Expr:
        """The reduction's source at position `pos` of the block's row; `vector_lane` = (q, v)
        when pos = q·V + v, so the reduced axes are unflattened with the lane visible."""
        low, extents, V = self.low, self.extents, self.V
        if vector_lane is not None and not self.flat and V > 1 and len(extents) > 1:
            q, v = vector_lane
            per_row = Const(self.last // V, dt.int32)  # type: ignore[operator]
            col_idx = unflatten(q // per_row, extents[:-1]) + ((q % per_row) * V + v,)
        else:
            col_idx = unflatten(pos - self.base if self.flat else pos, extents)
        mapping = {**dict(zip(low.op.axes, self.row_idx)), **dict(zip(low.red.axes, col_idx)), self.position: pos}
        return cast(substitute(self.template, mapping), self.acc_dtype)

    def guarded(self, value: Expr, guard: Expr | None) -> Expr:
        # a select, not a branch: the load is predicated, so the U loads of a guarded round are
        # issued together like those of an unguarded one (C's `?:`: never read where excluded)
        return value if guard is None else select(guard, value, self.identity)

    def vector_update(self, first: Expr, guard: Expr | None = None) -> Stmt:
        """acc[v] ⊕= the V elements from vector number `first` (position first·V), where `guard`."""
        acc, combiner = self.acc, self.combiner
        v = Var(self.unique("v"), dt.int32)
        if self.V == 1:
            return BufferStore(acc, (ZERO,), binary(combiner, acc[ZERO], self.guarded(self.source_at(first), guard)))
        value = self.guarded(self.source_at(first * self.V + v, (first, v)), guard)
        return For(v, 0, self.V, "vectorize", BufferStore(acc, (v,), binary(combiner, acc[v], value)))

    def element_update(self, pos: Expr, guard: Expr) -> Stmt:
        acc = self.acc
        return BufferStore(acc, (ZERO,), binary(self.combiner, acc[ZERO], self.guarded(self.source_at(pos), guard)))

    def let(self, label: str, value: Expr) -> Expr:
        var = Var(self.unique(label), dt.int32)
        self.lets.append((var, value))
        return var

    def rounds_of_chunk(self) -> list[Stmt]:
        """The accumulators set to the identity, then the chunk's rounds of U vector loads per
        thread (and its unaligned ends, element by element)."""
        T, U, V, S, N = self.T, self.U, self.V, self.S, self.N
        unique, tx, s, rounds = self.unique, self.tx, self.s, self.rounds
        k, u, w = (Var(unique(n), dt.int32) for n in ("k", "u", "u"))
        init = _lanes(Var(unique("v"), dt.int32), V, self.acc, reduce_identity(self.low.red.combiner, self.acc_dtype))
        chunk = rounds * self.tile
        chunk_vectors = rounds * (T * U)
        if self.exact:
            # every chunk whole and aligned: rounds · U unconditional vector loads per thread, the
            # chunk's first vector written so that nothing divides at run time
            first_vector = ((self.row_flat * (self.n_const // V) if self.flat else ZERO)  # type: ignore[operator]
                            + s * chunk_vectors)
            return [init, For(k, 0, rounds, "serial",
                              For(u, 0, U, "unroll", self.vector_update(first_vector + (k * U + u) * T + tx)),
                              annotations=ONE_ROUND)]
        # the chunk [lo, lo + n) of the row (n = 0 past its end); `head` elements before the first
        # vector boundary (0 when rows start on one), then whole vectors, then fewer than V
        let, aligned = self.let, self.aligned
        lo = let("lo", self.base + s * chunk)
        n = let("n", binary("max", binary("min", chunk, N - s * chunk), ZERO))
        head = let("head", binary("min", (V - lo % V) % V, n)) if not aligned else ZERO
        vectors = let("vectors", binary("max", n - head, ZERO) // V if not aligned else n // V)
        whole = let("whole", vectors // (T * U))
        first_vector = let("first", (lo + head) // V)
        # the chunk's ends outside whole vectors (fewer than V elements each) first, so that
        # their loads overlap the rounds'; whole rounds of T·U vectors unguarded, then one
        # guarded round for the rest
        loop: list[Stmt] = [init]
        if not aligned:
            # the tail starts `after` the head and the whole vectors; not at (first + vectors)·V,
            # which is wrong when the chunk ends before its first vector boundary (head capped at
            # n, no vectors: (lo + n) // V rounds down into the head or the chunk before)
            after = head + vectors * V
            loop += [self.element_update(lo + tx, tx < head), self.element_update(lo + after + tx, tx < n - after)]
        rest = (whole * U + w) * T + tx
        loop += [For(k, 0, whole, "serial",
                     For(u, 0, U, "unroll", self.vector_update(first_vector + (k * U + u) * T + tx)),
                     annotations=ONE_ROUND),
                 For(w, 0, U, "unroll", self.vector_update(first_vector + rest, rest < vectors))]
        return loop

    # ---- the block's total and where it goes
    def block_total(self) -> list[Stmt]:
        """The V lanes folded, the block's allreduce, and thread 0's store: the row's output
        (S == 1) or the block's partial (then `partial` is set)."""
        low, acc, combiner, tx = self.low, self.acc, self.combiner, self.tx
        stmts: list[Stmt] = []
        if self.V > 1:
            j = Var(self.unique("j"), dt.int32)
            stmts.append(For(j, 0, self.V - 1, "unroll", BufferStore(acc, (ZERO,), binary(combiner, acc[ZERO], acc[j + 1]))))
        stmts.append(allreduce(acc, combiner, tx, self.T, self.unique(f"{low.stage.name}_block")))
        if self.S == 1:
            stmts.append(IfThenElse(tx == 0, BufferStore(low.out, self.row_idx, low.finish(acc[ZERO], self.row_idx))))
            return stmts
        self.partial = Buffer(self.unique(f"{low.stage.name}_partial"), self.acc_dtype,
                              (self.n_rows, Const(self.S, dt.int32)), "global", tensor=f"{low.stage.name}.partial")
        self.temps = (self.partial,)
        stmts.append(IfThenElse(tx == 0, BufferStore(self.partial, (self.row_flat, self.s), acc[ZERO])))
        return stmts

    def last_block_combines(self, publish: Stmt, partial: Buffer) -> Stmt:
        """`publish` (the block's partial stored), then the last of the row's S blocks to store
        its partial combines the row (last_block.py); adds the row counters to `temps`."""
        low, acc, combiner, tx, T, S = self.low, self.acc, self.combiner, self.tx, self.T, self.S
        handshake = LastBlockHandshake(self.unique, low.stage.name, self.n_rows)
        self.temps = (partial, handshake.arrivals)
        i = Var(self.unique("i"), dt.int32)
        p = i * T + tx                                 # thread tx folds partials tx, tx + T, ...
        # a select, not a branch, as in the rounds: the ceil(S / T) loads of this tail (the
        # kernel's last critical path) are issued together; read at L2 (load_cg), not through
        # the non-coherent path: other blocks of this kernel wrote them
        gathered = self.guarded(load_cg(partial[self.row_flat, p]), p < S if S % T else None)
        gather = BufferStore(acc, (ZERO,), binary(combiner, acc[ZERO], gathered))
        combine_row = seq(
            BufferStore(acc, (ZERO,), self.identity),
            For(i, 0, -(-S // T), "unroll", gather),
            allreduce(acc, combiner, tx, T, self.unique(f"{low.stage.name}_combine_block")),
            IfThenElse(tx == 0, BufferStore(low.out, self.row_idx, low.finish(acc[ZERO], self.row_idx))),
        )
        # thread 0 stored the block's one partial itself, so no barrier is needed before its
        # fence (program order; last_block.py)
        return handshake.body(publish, combine_row, leader=tx == 0, group=self.row_flat, splits=S,
                              publish_barrier=False)


class _ToView(ExprMutator):
    """Loads of a viewed input become loads of its flat view at `position`."""

    def __init__(self, views: dict[Buffer, Buffer], position: Var) -> None:
        super().__init__()
        self.views, self.position = views, position

    def visit_BufferLoad(self, e: BufferLoad) -> Expr:  # noqa: N802
        view = self.views.get(e.buffer)
        return view[self.position] if view is not None else self.generic_visit(e)


def _combine_kernel(low: LoweredReduction, partial: Buffer, S: int) -> Stmt:
    """Kernel 2 (S > 1, combine="kernel"): one block of T2 = min(256, S rounded up to a warp)
    threads per row folds the row's S partials and writes its output."""
    unique, stage, red = low.sig.unique, low.stage, low.red
    combiner = COMBINE[red.combiner]
    T2 = min(COMBINE_THREADS, -(-S // WARP) * WARP)
    steps = -(-S // T2)
    row2, tx2, i = (Var(unique(n), dt.int32) for n in ("row", "tx", "i"))
    acc2 = Buffer(unique(f"{stage.name}_total"), red.acc_dtype, (1,), "local", tensor=f"{stage.name}.total")
    p = i * T2 + tx2
    step: Stmt = BufferStore(acc2, (ZERO,), binary(combiner, acc2[ZERO], partial[row2, p]))
    if S % T2:
        step = IfThenElse(p < S, step)
    out_idx = unflatten(row2, stage.shape)
    body: Stmt = seq(
        BufferStore(acc2, (ZERO,), reduce_identity(red.combiner, red.acc_dtype)),
        For(i, 0, steps, "unroll", step),
        allreduce(acc2, combiner, tx2, T2, unique(f"{stage.name}_combine_block")),
        IfThenElse(tx2 == 0, BufferStore(low.out, out_idx, low.finish(acc2[ZERO], out_idx))),
    )
    return For(row2, 0, size_product(stage.shape), "blockIdx.x",
               For(tx2, 0, T2, "threadIdx.x", Allocate(acc2, body)))


def _module(low: LoweredReduction, views: dict[Buffer, Buffer], kernels: list[tuple[str, Stmt]],
            temps: tuple[Buffer, ...], threads: int, name: str | None) -> Module:
    """The module launching `kernels` ((role, body) in order): each kernel's parameters, its
    attributes (occupancy asked of the kernels that stream the rows), the module's signature."""
    unique, buffers, stage = low.sig.unique, low.sig.buffers, low.stage
    # a viewed input is passed under its own name: the host hands kernel 1 the same pointer
    arrays = [views.get(buffers[a], buffers[a]) for a in low.program.args]
    funcs: list[PrimFunc] = []
    for role, body in kernels:
        attrs: tuple[tuple[str, object], ...] = (("split_rows", stage.name),)
        if role != "combine" and SM_THREADS // threads > 1:
            attrs += (("min_blocks_per_sm", min(SM_THREADS // threads, SM_BLOCKS)),)
        if role == "split":
            attrs += (("combine", "last_block"),)
        params = kernel_params(body, arrays, temps, low.sig.scalars)
        funcs.append(PrimFunc(unique(f"{stage.name}_{role}_kernel"), params, body, attrs))
    module_params = tuple(buffers[a] for a in low.program.args) + tuple(low.sig.scalars)
    calls = tuple(KernelCall(f.name, f.params) for f in funcs)
    return Module(identifier(name or stage.name), module_params, tuple(funcs), calls, temps)


def _lanes(v: Var, V: int, acc: Buffer, value: Expr) -> Stmt:
    """acc[v] = value for every lane (acc[0] when V == 1)."""
    if V == 1:
        return BufferStore(acc, (ZERO,), value)
    return For(v, 0, V, "unroll", BufferStore(acc, (v,), value))


def noncontiguous_read(args: Sequence[Tensor]) -> str | None:
    """Why the reads of the one reduction of `args` would not walk memory contiguously along the
    flattened reduced axes, or None: every read that uses a reduced axis is unstrided, uses the
    reduced axes only in its trailing indices, and those are the last reduced axes, in order,
    each index exactly the axis (a row of X[r, c], all of X[i, j], a weight W[c])."""
    _, red = row_reduction(args)
    prog = choose_inlined(collect_program(args))
    buffers = {t: buffer_for(t, t.name) for t in prog.args}
    source = Inliner(prog.inlined, buffers).visit(red.source)
    axes = list(red.axes)
    for node in walk(source):
        if not isinstance(node, BufferLoad):
            continue
        uses = [bool(free_vars(i) & set(axes)) for i in node.indices]
        if not any(uses):
            continue
        if node.buffer.strides is not None:
            return f"{node.buffer.name} is strided"
        n = 0
        while n < len(uses) and uses[len(uses) - 1 - n]:
            n += 1
        if any(uses[:len(uses) - n]) or n > len(axes):
            return f"{node.buffer.name} uses a reduced axis outside its trailing indices (a column reduction)"
        trailing = node.indices[len(uses) - n:]
        if any(i is not ax for i, ax in zip(trailing, axes[len(axes) - n:])):
            return (f"{node.buffer.name}'s trailing indices [{', '.join(str(i) for i in trailing)}] are not the "
                    "last reduced axes in order")
    return None


__all__ = ["COMBINE_THREADS", "noncontiguous_read", "row_reduction", "split_rows", "vector_allowed"]
