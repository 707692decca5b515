"""cache_read at a loop: stage the part of a tensor that a loop nest reads in shared or local memory.

`stage_read(func, tensor, scope, loop)` is what `Schedule.cache_read` + `compute_at` perform:
1. The *region* of `tensor` read under `loop` is the image of the reading statements' iteration
   domains under their access relations (islpy). It is parametrized by the loops outside `loop`
   (and for shared memory the thread loops count as inside: the tile is the block's, not one
   thread's). Its bounding box relative to the tile origin gives the cache's constant shape (the
   largest over all tiles); a box that is not bounded by a constant raises ScheduleError (split
   the loops so the tile is constant).
2. Every read of `tensor` under `loop` becomes a read of the cache at index - origin.
3. At the top of the loop body a copy fills the cache. Elements of the box outside the tensor
   (partial tiles at a non-divisible or symbolic edge) are filled with zero; the bound checks
   are emitted only where islpy cannot prove them. For shared memory the copy is cooperative:
   the box is flattened, and the block's threads (linear thread id, fastest along the last
   dimension so consecutive threads read consecutive addresses) each copy every T-th element.
4. `insert_barriers` then adds the barriers before and after the copy.
The cache's rows may be padded (`pad` elements: `storage_align`) and stored through an XOR
`layout` (tecc.ir.layout.Swizzle: `storage_swizzle`) of the padded offsets, written into the
indices of every access to the cache, the copy's included (`swizzled_index`).

Preconditions: `tensor` is read under `loop` and not written there; for shared memory the
block's thread loops are bound already (the copy is spread over them); the tile's indices are
affine in the loop variables.
"""

from __future__ import annotations

from typing import Callable

from ...ir import poly
from ...ir.errors import ScheduleError
from ...ir.layout import Swizzle
from ...ir.expr import (
    BufferLoad,
    Const,
    Expr,
    Var,
    as_expr,
    const_int,
    logical_and,
    select,
    substitute,
    walk,
)
from ...ir.stmt import (
    THREAD_KINDS,
    Allocate,
    Buffer,
    BufferStore,
    For,
    IfThenElse,
    PrimFunc,
    Stmt,
    launch_dims,
    seq,
)
from ..simplify import simplify_func
from .barriers import insert_barriers
from .thread_partition import chunk_coordinates
from .loops import (
    all_names,
    find_loop,
    fresh_name,
    iter_with_path,
    loops_on_path,
    rebuffer,
    replace_stmt,
)


def _reads_memory(e: Expr) -> bool:
    """Whether an index reads a buffer (data-dependent: not affine, any element of its axis)."""
    return any(isinstance(n, BufferLoad) for n in walk(e))


def find_buffer(func: PrimFunc, tensor: str) -> Buffer:
    for p in func.params:
        if isinstance(p, Buffer) and (p.tensor == tensor or p.name == tensor):
            return p
    for s, _ in iter_with_path(func.body):
        if isinstance(s, Allocate) and (s.buffer.tensor == tensor or s.buffer.name == tensor):
            return s.buffer
    # a view buffer (gemm_view.py): read by the kernel, backed by no parameter until gather_views
    for s, _ in iter_with_path(func.body):
        if isinstance(s, BufferStore):
            for e in walk(s.value):
                if isinstance(e, BufferLoad) and e.buffer.scope == "global" and e.buffer.tensor == tensor:
                    return e.buffer
    raise ScheduleError(f"kernel {func.name} has no buffer for tensor {tensor!r}")


def _dims(loops: list[For]) -> list[poly.LoopDim]:
    return [poly.LoopDim(lp.var, lp.min, lp.extent, lp.kind) for lp in loops]


def stage_read(func: PrimFunc, tensor: str, scope: str, loop: str, pad: int = 0, vector: int = 1,
               transpose: bool = False, layout: Swizzle | None = None) -> PrimFunc:
    what = f"cache_read of {tensor} into {scope} at {loop}"
    if layout is not None and scope != "shared":
        raise ScheduleError(f"{what}: a swizzled layout is for a shared cache, not a {scope} one")
    if scope not in ("shared", "local"):
        raise ScheduleError(f"{what}: scope must be 'shared' or 'local'")
    buf = find_buffer(func, tensor)
    node, path = find_loop(func, loop)
    if scope == "shared" and not any(isinstance(x, For) and (x.is_thread or x.is_block)
                                     for x, _ in iter_with_path(func.body)):
        # an unbound kernel gets the default one-thread-per-element schedule later, which would
        # put the copy's barriers under its thread-dependent bounds check
        raise ScheduleError(f"{what}: shared memory is per block, but no loop of {func.name} is bound to a "
                            "block or thread yet; bind the kernel's loops first")
    outer_loops = loops_on_path(path) + [node]
    for s, _ in iter_with_path(node.body):
        if isinstance(s, BufferStore) and s.buffer is buf:
            raise ScheduleError(f"{what}: the loop writes {tensor}; only a tensor the loop only reads can be cached")
    stmts = [s for s in poly.collect_statements(func.body) if any(lp.var is node.var for lp in s.loops)]
    reads = [(s, idx) for s in stmts for b, idx in s.reads if b is buf]
    if not reads:
        raise ScheduleError(f"{what}: nothing under loop {loop} reads {tensor}")
    outer_vars = {lp.var for lp in outer_loops if not (scope == "shared" and lp.is_thread)}
    # tile origin: each index with the loops inside the tile at their first iteration
    origin: list[Expr] | None = None
    lo = [None] * buf.ndim  # type: list[int | None]
    hi = [None] * buf.ndim  # type: list[int | None]
    for s, idx in reads:
        inner = {lp.var: lp.min for lp in s.loops if lp.var not in outer_vars}
        here = [substitute(i, inner) for i in idx]
        if origin is None:
            origin = here
        for d, i in enumerate(idx):
            if _reads_memory(i):
                # a data-dependent index (a gather) may be any element of its dimension: the tile
                # holds the whole axis (the index is checked where it is read, index_checks.IndexCheck)
                extent = const_int(buf.shape[d])
                if extent is None:
                    raise ScheduleError(f"{what}: dimension {d} of {tensor} is read at a data-dependent index "
                                        f"({i}) and has no constant extent; the tile would be the whole axis")
                origin[d] = Const(0, i.dtype)
                lo[d], hi[d] = 0, extent - 1
                continue
            a, b = poly.expr_bounds(i - origin[d], s.loops, s.conditions)
            if a is None or b is None:
                raise ScheduleError(
                    f"{what}: the region read along dimension {d} ({i}) is not bounded by a constant tile "
                    "(or not affine); split the loops so each tile has a constant size"
                )
            lo[d] = a if lo[d] is None else min(lo[d], a)  # type: ignore[type-var]
            hi[d] = b if hi[d] is None else max(hi[d], b)  # type: ignore[type-var]
    assert origin is not None
    origin = [o + lo[d] if lo[d] else o for d, o in enumerate(origin)]  # type: ignore[operator]
    # (a gathered dimension's origin is 0 and its lo 0: the whole axis)
    shape = [int(h) - int(l) + 1 for h, l in zip(hi, lo)]  # type: ignore[arg-type]
    if transpose and (len(shape) < 2 or any(e != 1 for e in shape[:-2])):
        raise ScheduleError(f"{what}: only a two-dimensional tile (leading dimensions of extent 1, such as "
                            f"a batch index, allowed) can be stored transposed; the tile is {shape}")
    # a transposed tile is stored [column][row] (its last two dimensions swapped): a thread
    # tile's column of A is then contiguous (16-byte shared loads) while the copy still reads
    # global memory along its rows
    order = list(range(len(shape) - 2)) + [len(shape) - 1, len(shape) - 2] if transpose else list(range(len(shape)))
    stored = [shape[d] for d in order]
    alloc_shape = stored[:-1] + [stored[-1] + pad]
    taken = all_names(func)
    cache = Buffer(fresh_name(taken, f"{buf.name}_{scope}"), buf.dtype, tuple(alloc_shape), scope, None,
                   f"{tensor}.{scope}")
    body = rebuffer(_drop_padding_tests(node.body, buf), buf, cache,
                    lambda idx: tuple([i - o for i, o in zip(idx, origin)][d] for d in order))

    if vector > 1 and (scope != "shared" or shape[-1] % vector):
        raise ScheduleError(f"{what}: a vector copy of width {vector} needs a shared cache whose last "
                            f"dimension ({shape[-1]}) is a multiple of the width")
    copy = _copy(func, buf, cache, shape, origin, outer_loops, scope, taken, max(vector, 1), order)
    if layout is not None:
        swizzle = swizzled_index(layout, alloc_shape, what)
        body, copy = rebuffer(body, cache, cache, swizzle), rebuffer(copy, cache, cache, swizzle)
    if scope == "local":
        new_loop = For(node.var, node.min, node.extent, node.kind, Allocate(cache, seq(copy, body)), node.annotations)
        out = func.with_body(replace_stmt(func.body, node, new_loop))
    else:
        new_loop = For(node.var, node.min, node.extent, node.kind, seq(copy, body), node.annotations)
        out = func.with_body(replace_stmt(func.body, node, new_loop))
        threads = [lp for lp in outer_loops if lp.is_thread]
        if threads:
            top, _ = find_loop(out, threads[0].var.name)
            out = out.with_body(replace_stmt(out.body, top, Allocate(cache, top)))
        else:
            nl, _ = find_loop(out, node.var.name)
            out = out.with_body(replace_stmt(out.body, nl, For(nl.var, nl.min, nl.extent, nl.kind,
                                                                Allocate(cache, nl.body), nl.annotations)))
        out = insert_barriers(out)
    return simplify_func(out)


def swizzled_index(layout: Swizzle, shape: list[int], what: str) -> Callable[[tuple[Expr, ...]], tuple[Expr, ...]]:
    """The index map that stores a cache of `shape` (rows of L = shape[-1] elements, a power of
    two) through `layout`, written into the indices: column c of row r goes to
    `((c // 2^base) ^ ((r // G) % 2^bits)) · 2^base + c % 2^base` with G = 2^(base + shift) / L,
    the element the Swizzle puts at flat offset r·L + c (r: the leading indices flattened; the
    chunk bits lie in c, the source bits in r). As index arithmetic the simplifier folds it where the loops' ranges decide it (the
    copy's lane stays a unit-stride term: 16-byte copies; a row group's term becomes the thread's
    own), where a layout applied to the flat offset would be re-derived per access."""
    row = shape[-1] if shape else 0
    if len(shape) < 2 or row & (row - 1) or (1 << (layout.base + layout.bits)) > row \
            or (1 << (layout.base + layout.shift)) < row:
        raise ScheduleError(f"{what}: {layout} needs a tile of rows whose length is a power of two holding its "
                            f"chunk bits, with the source bits in the row index; the tile is {shape}")
    chunk = 1 << layout.base
    group = (1 << (layout.base + layout.shift)) // row
    groups = 1 << layout.bits

    def index(idx: tuple[Expr, ...]) -> tuple[Expr, ...]:
        r = idx[-2]  # the row: the leading indices flattened (a box [1, 64, 1, 64] has 64 rows)
        stride = 1
        for d in range(len(idx) - 3, -1, -1):
            stride *= shape[d + 1]
            if shape[d] > 1:
                r = r + idx[d] * stride
        c = idx[-1]
        return idx[:-1] + (((c // chunk) ^ ((r // group) % groups)) * chunk + c % chunk,)

    return index


def _drop_padding_tests(s: Stmt, buf: Buffer) -> Stmt:
    """`where(cond, buf[idx], 0)` → `buf[idx]` where every conjunct of cond is a bounds test of
    idx against buf's shape (`idx[d] >= 0`, `idx[d] < n_d`): zero padding written as a `where`.
    The cache then serves the read with the test left out, because its copy zero-fills every
    element of the box outside the tensor (step 3): wherever cond is false, idx is out of bounds
    and the cache holds 0 there. A stencil's shared halo (strategies/stencil_tile.py) reads R·S
    times per output without the test."""
    from ...ir.expr import Binary, Compare, Select
    from ...ir.visitor import ExprMutator, StmtMutator

    def bounds_test(c: Expr, idx: tuple[Expr, ...]) -> bool:
        if not isinstance(c, Compare):
            return False
        for d, (i, n) in enumerate(zip(idx, buf.shape)):
            lo = (c.op == ">=" and c.a is i and const_int(c.b) == 0) or (c.op == "<=" and c.b is i and const_int(c.a) == 0)
            hi = (c.op == "<" and c.a is i and (c.b is n or (const_int(c.b) is not None and const_int(c.b) == const_int(n))))
            if lo or hi:
                return True
        return False

    def conjuncts(c: Expr) -> list[Expr]:
        if isinstance(c, Binary) and c.op == "&" and c.dtype.name == "bool":
            return conjuncts(c.a) + conjuncts(c.b)
        return [c]

    class _Loads(ExprMutator):
        def visit_Select(self, e: Select) -> Expr:
            a = self.visit(e.a)
            if (isinstance(a, BufferLoad) and a.buffer is buf and isinstance(e.b, Const) and float(e.b.value) == 0.0
                    and all(bounds_test(c, a.indices) for c in conjuncts(e.cond))):
                return a
            return self.generic_visit(e)

    class _Stmts(StmtMutator):
        pass

    m = _Stmts()
    m.expr_mutator = _Loads()
    return m.visit(s)


def _in_bounds(buf: Buffer, index: list[Expr], loops: list[poly.LoopDim]) -> Expr:
    conds: list[Expr] = []
    for i, n in zip(index, buf.shape):
        for c in (i >= 0, i < n):
            if not poly.proves(c, loops):
                conds.append(c)
    return logical_and(*conds)


def _copy(func: PrimFunc, buf: Buffer, cache: Buffer, shape: list[int], origin: list[Expr],
          outer_loops: list[For], scope: str, taken: set[str], vector: int = 1,
          order: list[int] | None = None) -> Stmt:
    d = origin[0].dtype if origin else Const(0, "int32").dtype
    zero = as_expr(0, buf.dtype)
    outer = [poly.LoopDim(lp.var, lp.min, lp.extent, lp.kind) for lp in outer_loops]
    if scope == "local":
        vars_ = [Var(fresh_name(taken, f"{cache.name}_ax{k}"), d) for k in range(len(shape))]
        dims = outer + [poly.LoopDim(v, Const(0, d), Const(e, d), "serial") for v, e in zip(vars_, shape)]
        src = [o + v for o, v in zip(origin, vars_)]
        cond = _in_bounds(buf, src, dims)
        stmt: Stmt = BufferStore(cache, tuple(vars_), select(cond, buf[tuple(src)], zero))
        for v, e in zip(reversed(vars_), reversed(shape)):
            stmt = For(v, Const(0, d), Const(e, d), "serial", stmt)
        return stmt
    # shared: spread the flattened box over the block's threads
    block = launch_dims(func).block
    enclosing = {lp.kind: lp for lp in outer_loops if lp.is_thread}
    axis_vars: list[tuple[Expr, int]] = []  # (thread index, count), slowest axis first
    wrappers: list[tuple[Var, int, str]] = []  # new thread loops around the copy
    for kind in reversed(THREAD_KINDS):  # z, y, x
        lp = enclosing.get(kind)
        if lp is not None:
            axis_vars.append((lp.var, int(const_int(lp.extent) or 1)))
        elif block["xyz".index(kind[-1])] > 1:
            n = block["xyz".index(kind[-1])]
            v = Var(fresh_name(taken, f"{cache.name}_t{kind[-1]}"), d)
            wrappers.append((v, n, kind))
            axis_vars.append((v, n))
    tid: Expr = Const(0, d)
    threads = 1
    for v, n in axis_vars:
        tid = tid * n + v if threads > 1 else v
        threads *= n
    # the box in chunks of `vector` consecutive elements of the last dimension: each thread copies
    # whole chunks (one 16-byte access for vector 4), consecutive threads consecutive chunks
    chunks = list(shape[:-1]) + [shape[-1] // vector]
    total = 1
    for e in chunks:
        total *= e
    steps = -(-total // threads)
    step_var = Var(fresh_name(taken, f"{cache.name}_c"), d)
    lane = Var(fresh_name(taken, f"{cache.name}_v"), d) if vector > 1 else None
    flat = step_var * threads + tid if steps > 1 else tid
    idx = chunk_coordinates(flat, chunks)
    if lane is not None:
        idx[-1] = idx[-1] * vector + lane
    dims = outer + [poly.LoopDim(v, Const(0, d), Const(n, d), "serial") for v, n in axis_vars
                    if not any(v is lp.var for lp in outer_loops)]
    if steps > 1:
        dims.append(poly.LoopDim(step_var, Const(0, d), Const(steps, d), "serial"))
    if lane is not None:
        dims.append(poly.LoopDim(lane, Const(0, d), Const(vector, d), "serial"))
    guard = flat < total if total % threads else None
    ctx = [guard] if guard is not None else []
    src = [o + i for o, i in zip(origin, idx)]
    conds: list[Expr] = []
    for axis, (i, n) in enumerate(zip(src, buf.shape)):
        chunk_start = _chunk_start(i, lane, vector, n, dims, ctx) if axis == len(src) - 1 else None
        if chunk_start is not None:
            i = chunk_start
        for c in (i >= 0, i < n):
            if not poly.proves(c, dims, ctx):
                conds.append(c)
    value = select(logical_and(*conds), buf[tuple(src)], zero)
    stmt = BufferStore(cache, tuple(idx[d] for d in (order or range(len(idx)))), value)
    if lane is not None:
        stmt = For(lane, Const(0, d), Const(vector, d), "vectorize", stmt)
    if guard is not None:
        stmt = IfThenElse(guard, stmt)
    if steps > 1:
        stmt = For(step_var, Const(0, d), Const(steps, d), "serial", stmt)
    for v, n, kind in reversed(wrappers):
        stmt = For(v, Const(0, d), Const(n, d), kind, stmt)
    return stmt


def _chunk_start(index: Expr, lane: Var | None, vector: int, extent: Expr, dims: list[poly.LoopDim],
                 context: list[Expr]) -> Expr | None:
    """The first element of a copy chunk, `index` at lane 0, when a bound check on it decides the
    whole chunk: the chunk starts at a multiple of `vector` and the extent is one (a constant),
    so `start + lane < n` ⇔ `start < n` for every lane. The check is then free of the lane and
    the chunk stays one 16-byte load (a partial edge tile of a 1000-wide matrix is still read
    as float4). None where that is not proved."""
    if lane is None or const_int(extent) is None or int(const_int(extent) or 0) % vector:
        return None
    start = substitute(index, {lane: Const(0, lane.dtype)})
    if not poly.proves(start % vector == 0, dims, context):
        return None
    return start
