"""gemm_view: a float32 contraction rewritten over its GEMM view, for the SIMT GEMM schedules.

The SIMT GEMM schedules (`gemm`, `gemm_pipelined`: split, reorder, bind, cache_read into shared
tiles, double_buffer) work on three loops i, j, k and two operands read as A[i, k], B[k, j].
A convolution has more axes (n, p, q | f | c, r, s) and reads its activations through a
gather (`X[n, p·σ + r·δ - π, q·σ + s·δ - π, c]` under a `where`), whose k-tile is no box of X:
`cache_read` cannot size it. Rather than teach every primitive about gathers, two steps bracket
the ordinary GEMM schedule:

1. `flatten_contraction(func, stage)` finds the GEMM view (`implicit_gemm.match_contraction`:
   batch, row, column and reduction groups, each in its operand's memory order) and rewrites the
   stage over loops (b,) m, n, k, with the operands read from *view buffers* `A_view[(b,) m, k]`,
   `B_view[(b,) k, n]` and the result stored to `C_view[(b,) m, n]`. A view buffer is a global
   buffer that no kernel parameter backs: an index map onto the real tensor. Its definition —
   the operand's indices and `where` predicate with every axis replaced by its unflattened
   expression (`implicit_gemm.unflatten`: `c = k % C`, `s = k // C % S`, ...) — is kept in
   the kernel's attrs under VIEWS. The view's shape is (M, K): the bounds checks the schedule
   primitives add for it (`m < M`, `k < K`, the zero fill of partial tiles) are the implicit
   GEMM's edge predicates.
2. The GEMM schedule applies unchanged: every access is affine in (b, m, n, k), so `cache_read`
   stages a BM × BK tile of A_view in shared memory — an im2col tile, built in shared memory
   only — with its usual cooperative, zero-filled, double-buffered copy.
3. `gather_views(module, kernel)` replaces every read of a view by its definition
   (`select(pred, X[indices], 0)`, the indices in the copy's own index expressions) and every
   store to C_view by the store to the real output, in the kernel and in the combine kernel a
   split-K `rfactor` made of it (which stores C_view), and drops the attr. No view buffer
   survives into codegen. A read in a `vectorize` copy loop of at most VECTOR lanes, at view
   index `start + lane` with `start` a multiple of VECTOR, is gathered as one chunk where the
   view proves it contiguous (`_chunk`): the first element's indices with `lane` added along
   the operand's contiguous dimension, under the first element's predicate (the emitter then
   makes it one 16-byte load).

Plain GEMMs never come here (the planner serves them with the strategies unchanged); a
contraction whose groups are single axes would give the same kernel up to the view names.
Preconditions (ScheduleError otherwise): `match_contraction`'s, with float32 operands; the stage
is as lowered (this is the first primitive applied to its kernel); sizes are constant.
"""

from __future__ import annotations

from ...ir import dtype as dt
from ...ir.errors import ScheduleError
from ...ir.expr import BufferLoad, Const, Expr, Var, as_expr, const_int, free_vars, select, substitute
from ...ir.stmt import Allocate, Buffer, BufferStore, For, KernelCall, KernelParam, Module, PrimFunc, Stmt, seq
from ...ir.visitor import ExprMutator, StmtMutator
from ..simplify import linear_form
from .implicit_gemm import Axis, Contraction, Operand, contiguous_copy, match_contraction, operand_layout, unflatten
from .loops import all_names, fresh_name
from .rfactor import kernel_params

VIEWS = "gemm_views"  # PrimFunc attr: (view buffer, real buffer, placeholders, indices, predicate, chunk) each
VECTOR = 4  # elements per float4 chunk


def _size(axes: tuple[Axis, ...], where: str) -> int:
    n = 1
    for v, e in axes:
        k = const_int(e)
        if k is None:
            raise ScheduleError(f"{where}: axis {v.name} has a symbolic extent; the GEMM view needs constant sizes")
        n *= k
    return n


def flatten_contraction(func: PrimFunc, stage: str) -> PrimFunc:
    where = f"flatten_contraction({stage})"
    con: Contraction = match_contraction(func, stage, (dt.float32,), where)
    if any(k == VIEWS for k, _ in func.attrs):
        raise ScheduleError(f"{where}: the kernel is flattened already")
    taken = all_names(func)
    i32 = dt.int32

    def var(name: str) -> Var:
        return Var(fresh_name(taken, name), i32)

    b, m, n, k = var("b"), var("m"), var("n"), var("k")
    sizes = {"b": _size(con.batch, where), "m": _size(con.rows, where), "n": _size(con.cols, where),
             "k": _size(con.ks, where)}
    lead: tuple[Var, ...] = (b,) if con.batch else ()
    lead_shape: tuple[int, ...] = (sizes["b"],) if con.batch else ()
    # the definitions use placeholders of their own (the loops b, m, n, k are split away later)
    pb, pr, pc, pk = var("view_b"), var("view_row"), var("view_col"), var("view_k")
    p_lead: tuple[Var, ...] = (pb,) if con.batch else ()

    def values(bv: Var, rv: Var | None, cv: Var | None, kv: Var | None) -> dict[Var, Expr]:
        out: dict[Var, Expr] = {}
        if con.batch:
            out.update(unflatten(con.batch, bv))
        if rv is not None:
            out.update(unflatten(con.rows, rv))
        if cv is not None:
            out.update(unflatten(con.cols, cv))
        if kv is not None:
            out.update(unflatten(con.ks, kv))
        return out

    views = []
    loads: dict[str, BufferLoad] = {}
    for op, outer, dims in ((con.a, pr, ("m", "k")), (con.b, pc, ("k", "n"))):
        shape = lead_shape + tuple(sizes[d] for d in dims)
        view = Buffer(fresh_name(taken, f"{op.buffer.name}_view"), op.buffer.dtype,
                      tuple(Const(x, i32) for x in shape), "global", None, f"{op.buffer.tensor or op.buffer.name}.view")
        placeholders = p_lead + ((outer, pk) if dims[0] == "m" else (pk, outer))
        mapping = values(pb, pr if op.role == "A" else None, pc if op.role == "B" else None, pk)
        indices, pred = op.at(mapping)
        group = con.ks if op.role == "A" else con.cols
        views.append((view, op.buffer, placeholders, indices, pred, _chunk(where, op, group)))
        loop_vars = lead + ((m, k) if dims[0] == "m" else (k, n))
        loads[op.role] = BufferLoad(view, loop_vars)
    out = con.store.buffer
    c_view = Buffer(fresh_name(taken, f"{out.name}_view"), out.dtype,
                    tuple(Const(x, i32) for x in lead_shape + (sizes["m"], sizes["n"])), "global", None,
                    out.tensor or out.name)
    views.append((c_view, out, p_lead + (pr, pc), tuple(substitute(ix, values(pb, pr, pc, None))
                                                         for ix in con.store.indices), None, None))
    acc = con.acc
    zero = Const(0, i32)
    update = BufferStore(acc, (zero,), BufferLoad(acc, (zero,)) + loads["A"] * loads["B"])
    body: Stmt = For(k, zero, Const(sizes["k"], i32), "serial", update)
    epilogue = substitute(con.store.value, values(b, m, n, None))
    init = BufferStore(acc, (zero,), as_expr(0.0, acc.dtype))
    nest: Stmt = Allocate(acc, seq(init, body, BufferStore(c_view, lead + (m, n), epilogue)))
    nest = For(n, zero, Const(sizes["n"], i32), "serial", nest)
    nest = For(m, zero, Const(sizes["m"], i32), "serial", nest)
    if con.batch:
        nest = For(b, zero, Const(sizes["b"], i32), "serial", nest)
    return PrimFunc(func.name, func.params, nest, func.attrs + ((VIEWS, tuple(views)),))


ViewTable = dict[Buffer, tuple[Buffer, tuple[Var, ...], tuple[Expr, ...], "Expr | None", "tuple[int, int] | None"]]


def _at(views: ViewTable, buf: Buffer, indices: tuple[Expr, ...],
        lanes: dict[Var, int]) -> tuple[Buffer, tuple[Expr, ...], Expr | None]:
    real, placeholders, defs, pred, chunk = views[buf]
    mapping = dict(zip(placeholders, indices))
    lane = _chunk_lane(indices[-1], chunk, lanes) if chunk is not None else None
    if lane is not None:
        # the chunk's first element's indices, the lane added along the chunked dimension
        assert chunk is not None
        mapping[placeholders[-1]] = substitute(indices[-1], {lane: Const(0, lane.dtype)})
    out = [substitute(d, mapping) for d in defs]
    if lane is not None:
        assert chunk is not None
        out[chunk[0]] = out[chunk[0]] + lane
    return real, tuple(out), (substitute(pred, mapping) if pred is not None else None)


def _chunk_lane(index: Expr, chunk: tuple[int, int], lanes: dict[Var, int]) -> Var | None:
    """The vectorize loop variable `index` walks as start + lane, when the loop is no wider than
    the chunk and every other term of `index` is a multiple of the chunk (the start is aligned)."""
    terms, const = linear_form(index)
    width = chunk[1]
    found = [v for v in terms if isinstance(v, Var) and v in lanes]
    if len(found) != 1 or terms[found[0]] != 1 or lanes[found[0]] > width or const % width:
        return None
    if any(k % width for t, k in terms.items() if t is not found[0]):
        return None
    return found[0]


class _GatherLoads(ExprMutator):
    def __init__(self, views: ViewTable, lanes: dict[Var, int]) -> None:
        super().__init__()
        self.views = views
        self.lanes = lanes

    def visit_BufferLoad(self, e: BufferLoad) -> Expr:
        idx = tuple(self.visit(i) for i in e.indices)
        if e.buffer not in self.views:
            return e if all(x is y for x, y in zip(idx, e.indices)) else BufferLoad(e.buffer, idx)
        real, indices, pred = _at(self.views, e.buffer, idx, self.lanes)
        load = BufferLoad(real, indices)
        return load if pred is None else select(pred, load, as_expr(0, real.dtype))


def _chunk(where: str, op: Operand, group: tuple[Axis, ...]) -> tuple[int, int] | None:
    """(dimension, VECTOR) when VECTOR consecutive elements of the view along its last index are
    VECTOR consecutive, aligned elements of one dimension of the real buffer, uniformly in or out
    of the `where` predicate (implicit_gemm.contiguous_copy on the group's innermost axis alone,
    which indexes that dimension with coefficient 1): a chunk whose first view index is a multiple
    of VECTOR is then that first element's indices + lane. None: element by element."""
    inner, ext = group[-1]
    extent = const_int(ext)
    spatial = _free_vars_of(op)
    lay = operand_layout(where, op.load, op.guard, spatial, [])
    if extent is None:
        return None
    run = contiguous_copy(lay, [(inner.name, extent)])
    if not run or run % VECTOR:
        return None
    dims = [d for d, ix in enumerate(op.load.indices) if inner in free_vars(ix)]
    if len(dims) != 1:
        return None
    terms, _ = linear_form(op.load.indices[dims[0]])
    if terms.get(inner) != 1 or dims[0] != len(op.load.indices) - 1:
        return None
    return dims[0], VECTOR


def _free_vars_of(op: Operand) -> list[Var]:
    out: set[Var] = set()
    for ix in op.load.indices:
        out |= free_vars(ix)
    if op.guard is not None:
        out |= free_vars(op.guard)
    return sorted(out, key=lambda v: v.name)


class _Gather(StmtMutator):
    def __init__(self, views: ViewTable) -> None:
        self.views = views
        self.lanes: dict[Var, int] = {}

    def visit_expr(self, e: Expr) -> Expr:
        return _GatherLoads(self.views, self.lanes).visit(e)

    def visit_For(self, s: For) -> Stmt:
        extent = const_int(s.extent)
        if s.kind == "vectorize" and extent is not None:
            self.lanes[s.var] = extent
        out = self.generic_visit(s)
        self.lanes.pop(s.var, None)
        return out

    def visit_BufferStore(self, s: BufferStore) -> Stmt:
        s2 = self.generic_visit(s)
        assert isinstance(s2, BufferStore)
        if s2.buffer in self.views:
            real, indices, _ = _at(self.views, s2.buffer, tuple(s2.indices), {})
            return BufferStore(real, indices, s2.value)
        return s2


def gather_views(module: Module, kernel: str) -> Module:
    """`module` with the views that `kernel` defines (its VIEWS attr) replaced in every kernel
    that uses them: `kernel` itself and, after a split-K `rfactor`, its combine kernel, which
    stores C_view. A kernel whose body now reads or writes tensors that are not among its
    parameters (rfactor derived the parameters from the flattened body) gets them, in the
    module's order, and so does its call."""
    from ..lower import global_buffers

    func = module.kernel(kernel)
    views = dict(func.attrs).get(VIEWS)
    if views is None:
        raise ScheduleError(f"gather_views({kernel}): the kernel has no GEMM views (flatten_contraction first)")
    table = {view: (real, ph, ix, pred, chunk) for view, real, ph, ix, pred, chunk in views}
    kernels: list[PrimFunc] = []
    renamed: dict[str, tuple[KernelParam, ...]] = {}
    for k in module.kernels:
        body = _Gather(table).visit(k.body)
        attrs = tuple((a, v) for a, v in k.attrs if a != VIEWS)
        if body is k.body and attrs == k.attrs:
            kernels.append(k)
            continue
        used = set(global_buffers(body))
        params = k.params
        if not used <= {p for p in k.params if isinstance(p, Buffer)} | set(module.temps):
            params = kernel_params(module, body, [])
            renamed[k.name] = params
        kernels.append(PrimFunc(k.name, params, body, attrs))
    calls = tuple(KernelCall(c.kernel, renamed[c.kernel]) if c.kernel in renamed else c for c in module.calls)
    return Module(module.name, module.params, tuple(kernels), calls, module.temps)


__all__ = ["VIEWS", "flatten_contraction", "gather_views"]
