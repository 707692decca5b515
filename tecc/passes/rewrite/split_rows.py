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
from ...ir.expr import (
    BufferLoad,
    Const,
    Expr,
    Reduce,
    Var,
    binary,
    cast,
    const_int,
    free_vars,
    load_cg,
    reduce_identity,
    select,
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
    LetStmt,
    Module,
    PrimFunc,
    Stmt,
    seq,
)
from ...ir.tensor import ComputeOp, Tensor
from ...ir.visitor import ExprMutator
from .last_block import COMBINE_FORMS, MAX_GRID_Y, LastBlockHandshake
from ..lower import (
    COMBINE,
    buffer_for,
    exprs_of,
    global_buffers,
    Inliner,
    scalar_vars,
    choose_inlined,
    collect_program,
    signature,
)
from ..names import identifier
from ..schedule.cross_thread import WARP, allreduce
from .reduction_stage import reduction_stage

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


def unflatten(flat: Expr, shape: Sequence[Expr]) -> tuple[Expr, ...]:
    """The row-major index of element `flat` of `shape` (the first index is not reduced modulo
    its extent: `flat` is in range)."""
    idx: list[Expr] = []
    rest = flat
    for n, extent in enumerate(reversed(shape)):
        idx.append(rest if n == len(shape) - 1 else rest % extent)
        rest = rest // extent
    return tuple(reversed(idx))


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
    stage, red = row_reduction(args)
    prog = choose_inlined(collect_program(args))
    op = stage.op
    assert isinstance(op, ComputeOp)
    sig = signature(prog)
    buffers, scalars, unique = sig.buffers, sig.scalars, sig.unique
    inliner = Inliner(prog.inlined, buffers)
    out = buffers[stage]
    views = flat_views(args, buffers)
    flat = bool(views)
    extents = [ax.extent for ax in red.axes]
    n_rows = size_product(stage.shape)
    if not vector_allowed(n_rows, extents, vector, flat):
        raise ScheduleError(f"split_rows: vector={vector} needs the innermost reduced extent ({extents[-1]}) to be a "
                            "constant multiple of it, a single row reduced over one axis, or rows read through a "
                            "flat view (contiguous inputs indexed [rows.., reduced axes..])")

    def finish(acc: Expr, row_idx: tuple[Expr, ...]) -> Expr:
        """The stage's body at the row with its Reduce replaced by the combined accumulator."""

        class _Finish(ExprMutator):
            def visit_Reduce(self, r: Reduce) -> Expr:  # noqa: N805
                return cast(acc, r.dtype)

        return inliner.visit(_Finish().visit(substitute(op.body, dict(zip(op.axes, row_idx)))))

    T, S, V, U = threads, splits, vector, unroll
    one_pass = S > 1 and combine == "last_block"
    tile = T * V * U
    N = size_product(extents)
    n_const = const_int(N)
    last = const_int(extents[-1]) if extents else None
    combiner = COMBINE[red.combiner]
    acc_dtype = red.acc_dtype
    zero = Const(0, dt.int32)

    # the chunk: L = rounds·T·V·U elements, rounds = ceil(N / (S·T·V·U)), so S chunks cover a row
    rounds: Expr = (Const(-(-n_const // (S * tile)), dt.int32) if n_const is not None
                    else (N + (S * tile - 1)) // (S * tile))
    chunk_vectors = rounds * (T * U)
    # every row starts on a vector boundary (V divides N): chunks start and end on one too
    aligned = V == 1 or (n_const is not None and n_const % V == 0) or (last is not None and last % V == 0)
    # every chunk is whole: S·L = N
    exact = aligned and n_const is not None and n_const == S * const_int(rounds) * tile  # type: ignore[operator]

    # ---- kernel 1: S blocks per row, each reducing its chunk, combined over the block
    b, tx = Var(unique("row" if one_pass else "b"), dt.int32), Var(unique("tx"), dt.int32)
    if one_pass:
        # rows along blockIdx.x, the S blocks of a row along blockIdx.y: the row and s are block
        # indices, which ptxas re-reads where it needs them (S2R) instead of keeping b // S live
        # through the rounds for the handshake and the combine (at the 32-register cap of 8
        # blocks per SM, the 1-D grid spilled one register in some plans)
        s_var = Var(unique("s"), dt.int32)
        row_flat: Expr = b
        s: Expr = s_var
    else:
        row_flat = b // S if S > 1 else b
        s = b % S if S > 1 else zero
    row_idx = unflatten(row_flat, stage.shape)
    # positions: the flat element of a viewed input (rows one after another), else the column
    base: Expr = row_flat * N if flat else zero
    position = Var(unique("p"), dt.int32)   # stands for the position in `template`

    class _ToView(ExprMutator):
        def visit_BufferLoad(self, e: BufferLoad) -> Expr:  # noqa: N805
            view = views.get(e.buffer)
            return view[position] if view is not None else self.generic_visit(e)

    template = _ToView().visit(inliner.visit(red.source))

    def source_at(pos: Expr, vector_lane: tuple[Expr, Var] | None = None) -> Expr:
        """The reduction's source at position `pos` of the block's row; `vector_lane` = (q, v)
        when pos = q·V + v, so the reduced axes are unflattened with the lane visible."""
        if vector_lane is not None and not flat and V > 1 and len(extents) > 1:
            q, v = vector_lane
            per_row = Const(last // V, dt.int32)  # type: ignore[operator]
            col_idx = unflatten(q // per_row, extents[:-1]) + ((q % per_row) * V + v,)
        else:
            col_idx = unflatten(pos - base if flat else pos, extents)
        mapping = {**dict(zip(op.axes, row_idx)), **dict(zip(red.axes, col_idx)), position: pos}
        return cast(substitute(template, mapping), acc_dtype)

    acc = Buffer(unique(f"{stage.name}_acc"), acc_dtype, (V,), "local", tensor=f"{stage.name}.acc")

    identity = reduce_identity(red.combiner, acc_dtype)

    def guarded(value: Expr, guard: Expr | None) -> Expr:
        # a select, not a branch: the load is predicated, so the U loads of a guarded round are
        # issued together like those of an unguarded one (C's `?:`: never read where excluded)
        return value if guard is None else select(guard, value, identity)

    def vector_update(first: Expr, guard: Expr | None = None) -> Stmt:
        """acc[v] ⊕= the V elements from vector number `first` (position first·V), where `guard`."""
        v = Var(unique("v"), dt.int32)
        if V == 1:
            return BufferStore(acc, (zero,), binary(combiner, acc[zero], guarded(source_at(first), guard)))
        value = guarded(source_at(first * V + v, (first, v)), guard)
        return For(v, 0, V, "vectorize", BufferStore(acc, (v,), binary(combiner, acc[v], value)))

    def element_update(pos: Expr, guard: Expr) -> Stmt:
        return BufferStore(acc, (zero,), binary(combiner, acc[zero], guarded(source_at(pos), guard)))

    k, u, w = (Var(unique(n), dt.int32) for n in ("k", "u", "u"))
    init = _lanes(Var(unique("v"), dt.int32), V, acc, reduce_identity(red.combiner, acc_dtype))
    lets: list[tuple[Var, Expr]] = []

    def let(label: str, value: Expr) -> Expr:
        var = Var(unique(label), dt.int32)
        lets.append((var, value))
        return var

    chunk = rounds * tile
    if exact:
        # every chunk whole and aligned: rounds · U unconditional vector loads per thread, the
        # chunk's first vector written so that nothing divides at run time
        first_vector = (row_flat * (n_const // V) if flat else zero) + s * chunk_vectors  # type: ignore[operator]
        loop: list[Stmt] = [For(k, 0, rounds, "serial", For(u, 0, U, "unroll",
                                                            vector_update(first_vector + (k * U + u) * T + tx)),
                                annotations=ONE_ROUND)]
    else:
        # the chunk [lo, lo + n) of the row (n = 0 past its end); `head` elements before the first
        # vector boundary (0 when rows start on one), then whole vectors, then fewer than V
        lo = let("lo", base + s * chunk)
        n = let("n", binary("max", binary("min", chunk, N - s * chunk), zero))
        head = let("head", binary("min", (V - lo % V) % V, n)) if not aligned else zero
        vectors = let("vectors", binary("max", n - head, zero) // V if not aligned else n // V)
        whole = let("whole", vectors // (T * U))
        first_vector = let("first", (lo + head) // V)
        # the chunk's ends outside whole vectors (fewer than V elements each) first, so that
        # their loads overlap the rounds'; whole rounds of T·U vectors unguarded, then one
        # guarded round for the rest
        loop = []
        if not aligned:
            # the tail starts `after` the head and the whole vectors; not at (first + vectors)·V,
            # which is wrong when the chunk ends before its first vector boundary (head capped at
            # n, no vectors: (lo + n) // V rounds down into the head or the chunk before)
            after = head + vectors * V
            loop += [element_update(lo + tx, tx < head), element_update(lo + after + tx, tx < n - after)]
        rest = (whole * U + w) * T + tx
        loop += [For(k, 0, whole, "serial", For(u, 0, U, "unroll", vector_update(first_vector + (k * U + u) * T + tx)),
                     annotations=ONE_ROUND),
                 For(w, 0, U, "unroll", vector_update(first_vector + rest, rest < vectors))]
    stmts: list[Stmt] = [init, *loop]
    if V > 1:
        j = Var(unique("j"), dt.int32)
        stmts.append(For(j, 0, V - 1, "unroll", BufferStore(acc, (zero,), binary(combiner, acc[zero], acc[j + 1]))))
    stmts.append(allreduce(acc, combiner, tx, T, unique(f"{stage.name}_block")))
    temps: tuple[Buffer, ...] = ()
    partial: Buffer | None = None
    if S == 1:
        stmts.append(IfThenElse(tx == 0, BufferStore(out, row_idx, finish(acc[zero], row_idx))))
    else:
        partial = Buffer(unique(f"{stage.name}_partial"), acc_dtype, (n_rows, Const(S, dt.int32)), "global",
                         tensor=f"{stage.name}.partial")
        temps = (partial,)
        stmts.append(IfThenElse(tx == 0, BufferStore(partial, (row_flat, s), acc[zero])))
    body1: Stmt = seq(*stmts)
    if partial is not None and one_pass:
        # the last of the row's S blocks to store its partial combines the row (last_block.py)
        handshake = LastBlockHandshake(unique, stage.name, n_rows)
        temps = (partial, handshake.arrivals)
        i = Var(unique("i"), dt.int32)
        p = i * T + tx                                 # thread tx folds partials tx, tx + T, ...
        # a select, not a branch, as in the rounds: the ceil(S / T) loads of this tail (the
        # kernel's last critical path) are issued together; read at L2 (load_cg), not through
        # the non-coherent path: other blocks of this kernel wrote them
        gathered = guarded(load_cg(partial[row_flat, p]), p < S if S % T else None)
        gather = BufferStore(acc, (zero,), binary(combiner, acc[zero], gathered))
        combine_row = seq(
            BufferStore(acc, (zero,), identity),
            For(i, 0, -(-S // T), "unroll", gather),
            allreduce(acc, combiner, tx, T, unique(f"{stage.name}_combine_block")),
            IfThenElse(tx == 0, BufferStore(out, row_idx, finish(acc[zero], row_idx))),
        )
        # thread 0 stored the block's one partial itself, so no barrier is needed before its
        # fence (program order; last_block.py)
        body1 = handshake.body(body1, combine_row, leader=tx == 0, group=row_flat, splits=S, publish_barrier=False)
    for var, value in reversed(lets):
        body1 = LetStmt(var, value, body1)
    body1 = For(tx, 0, T, "threadIdx.x", Allocate(acc, body1))
    if one_pass:
        body1 = For(b, 0, n_rows, "blockIdx.x", For(s_var, 0, S, "blockIdx.y", body1))
    else:
        body1 = For(b, 0, n_rows * S, "blockIdx.x", body1)
    role1 = "rows" if S == 1 else ("split" if one_pass else "partial")
    kernels: list[tuple[str, Stmt]] = [(role1, body1)]

    # ---- kernel 2 (S > 1, combine="kernel"): one block per row combines its S partials
    if partial is not None and not one_pass:
        T2 = min(COMBINE_THREADS, -(-S // WARP) * WARP)
        steps = -(-S // T2)
        row2, tx2, i = (Var(unique(n), dt.int32) for n in ("row", "tx", "i"))
        acc2 = Buffer(unique(f"{stage.name}_total"), acc_dtype, (1,), "local", tensor=f"{stage.name}.total")
        p = i * T2 + tx2
        step: Stmt = BufferStore(acc2, (zero,), binary(combiner, acc2[zero], partial[row2, p]))
        if S % T2:
            step = IfThenElse(p < S, step)
        out_idx = unflatten(row2, stage.shape)
        body2: Stmt = seq(
            BufferStore(acc2, (zero,), reduce_identity(red.combiner, acc_dtype)),
            For(i, 0, steps, "unroll", step),
            allreduce(acc2, combiner, tx2, T2, unique(f"{stage.name}_combine_block")),
            IfThenElse(tx2 == 0, BufferStore(out, out_idx, finish(acc2[zero], out_idx))),
        )
        body2 = For(row2, 0, n_rows, "blockIdx.x", For(tx2, 0, T2, "threadIdx.x", Allocate(acc2, body2)))
        kernels.append(("combine", body2))

    funcs: list[PrimFunc] = []
    calls: list[KernelCall] = []
    for role, body in kernels:
        used = global_buffers(body)
        body_vars = scalar_vars(exprs_of(body) + [e for x in used for e in x.shape + (x.strides or ())])
        # a viewed input is passed under its own name: the host hands kernel 1 the same pointer
        arrays = [views.get(buffers[a], buffers[a]) for a in prog.args]
        params = (tuple(x for x in arrays if x in used) + tuple(t for t in temps if t in used)
                  + tuple(x for x in scalars if x in body_vars))
        kname = unique(f"{stage.name}_{role}_kernel")
        attrs: tuple[tuple[str, object], ...] = (("split_rows", stage.name),)
        if role != "combine" and SM_THREADS // T > 1:
            attrs += (("min_blocks_per_sm", min(SM_THREADS // T, SM_BLOCKS)),)
        if role == "split":
            attrs += (("combine", "last_block"),)
        funcs.append(PrimFunc(kname, params, body, attrs))
        calls.append(KernelCall(kname, params))
    mname = identifier(name or stage.name)
    module_params = tuple(buffers[a] for a in prog.args) + tuple(scalars)
    return Module(mname, module_params, tuple(funcs), tuple(calls), temps)


def _lanes(v: Var, V: int, acc: Buffer, value: Expr) -> Stmt:
    """acc[v] = value for every lane (acc[0] when V == 1)."""
    if V == 1:
        return BufferStore(acc, (Const(0, dt.int32),), value)
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
