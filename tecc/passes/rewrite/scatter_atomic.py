"""Scatter with atomics: a masked sum whose matches are data-dependent, as atomic additions.

A scatter (`tc.scatter_add`, tecc/ir/scatter.py) lowers like any reduction, one output element
per iteration of the spatial loops, each summing its matches over the whole domain:

    for v in range(V): for j in range(D):                      # the output's loops
      acc = 0
      for i in range(N):                                       # the summed domain axes
        acc = acc + where(index_ok(idx[i], V) && idx[i] == v, dY[i, j], 0)
      dW[v, j] = acc                                           # or finish(base[v, j] + acc)

Deterministic, but it reads every domain point once per output row. When the sum has that form
-- each output axis either used freely (`j`: an axis the domain shares) or *matched*: it occurs
only in one equation `e == v` of the condition, `e` free of the matched axes, so each domain point
matches exactly one output element -- the same tensor is

    kernel init:   for v, j: out[v, j] = base[v, j]  (or 0)
    kernel adds:   for i, j: if index_ok(idx[i], V): atomic_add(out[idx[i], j], dY[i, j])
    kernel finish: for v, j: Y[v, j] = finish(out[v, j])       (only when finish is more than a copy)

every domain point read once and added where it belongs (Σ_i where(e(i) == v, x(i), 0) =
Σ_{i : e(i) = v} x(i)). This is algebra on the loop IR, not a pattern of scatter_add: a compute
the user wrote in that form is realized the same way. `out` is the output itself when the
accumulator has its dtype, else a temporary of the accumulator's dtype (float32 for a float16 /
bfloat16 output, rounded once by the finish kernel). The index checks of the condition guard the
atomic; a matched axis without one (a user's masked sum) gets a plain range guard instead, so an
index out of range adds nothing, as in the masked sum.

The order of the atomic additions is the hardware's: float sums are not reproducible run to run
(docs/semantics.md, "Atomics"). Builds with `deterministic=True` never take this rewrite.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...ir import dtype as dt
from ...ir.errors import ScheduleError
from ...ir.expr import (
    ATOMIC_DTYPES,
    Binary,
    BufferLoad,
    Cast,
    Compare,
    Const,
    Expr,
    Select,
    Var,
    atomic_add,
    compare,
    free_vars,
    logical_and,
    substitute,
    walk,
)
from ...ir.index_checks import IndexCheck
from ...ir.stmt import Allocate, Buffer, BufferStore, Evaluate, For, IfThenElse, KernelCall, Module, PrimFunc, Seq, Stmt, seq
from ...ir.visitor import SubexpressionReplacer
from ..names import fresh_name


@dataclass(frozen=True)
class ScatterMatch:
    """A lowered kernel that is a scatter (module docstring): its parts, in its own variables."""

    kernel: str
    stage: str
    out: Buffer
    spatial: tuple[For, ...]            # the output's loops, outermost first
    summed: tuple[For, ...]             # the reduction loops (domain axes not in the output)
    matched: tuple[int, ...]            # output dimensions given by an equation
    targets: tuple[Expr, ...]           # per output dimension: where a domain point adds
    guards: tuple[Expr, ...]            # index checks / range guards of the matched positions
    value: Expr                         # what a domain point adds (the accumulator's dtype)
    base: Expr | None                   # what the output starts from (None: zero)
    finish: Expr                        # the stored value, in terms of `total` (below)
    total: Var                          # stands for base + sum in `finish`
    acc_dtype: dt.DType

    @property
    def free(self) -> tuple[For, ...]:
        """The output loops that are domain axes too (not matched), in order."""
        return tuple(lp for d, lp in enumerate(self.spatial) if d not in self.matched)


def match_scatter(func: PrimFunc) -> ScatterMatch | None:
    """The scatter form of a lowered, unscheduled kernel, or None (module docstring)."""
    spatial: list[For] = []
    s: Stmt = func.body
    while isinstance(s, For) and s.kind == "serial" and _starts_at_zero(s):
        spatial.append(s)
        s = s.body
    if not spatial or not isinstance(s, Allocate) or s.buffer.scope != "local" or not isinstance(s.body, Seq):
        return None
    acc = s.buffer
    parts = s.body.stmts
    if len(parts) != 3:
        return None
    init, nest, store = parts
    if not (isinstance(init, BufferStore) and init.buffer is acc and _is_zero(init.value)):
        return None
    summed: list[For] = []
    while isinstance(nest, For) and nest.kind == "serial" and _starts_at_zero(nest):
        summed.append(nest)
        nest = nest.body
    if not summed or not isinstance(nest, BufferStore) or nest.buffer is not acc:
        return None
    update = nest.value
    acc_load = BufferLoad(acc, (Const(0, dt.int32),))
    if not (isinstance(update, Binary) and update.op == "+" and update.a is acc_load):
        return None
    if not (isinstance(store, BufferStore) and store.buffer.scope == "global"
            and tuple(store.indices) == tuple(lp.var for lp in spatial)):
        return None
    if acc.dtype not in ATOMIC_DTYPES:
        return None
    addend = update.b
    if not isinstance(addend, Select) or not _is_zero(addend.b):
        return None
    found = _split_condition(addend.cond, spatial, store.buffer.tensor)
    if found is None:
        return None
    matched, targets, guards = found
    value = addend.a
    matched_vars = {spatial[d].var for d in matched}
    summed_vars = {lp.var for lp in summed}
    if free_vars(value) & matched_vars or any(free_vars(g) & matched_vars for g in guards):
        return None
    finish = _finish(store.value, acc_load, summed_vars)
    if finish is None:
        return None
    total, base, stored = finish
    return ScatterMatch(func.name, store.buffer.tensor, store.buffer, tuple(spatial), tuple(summed), matched,
                        targets, guards, value, base, stored, total, acc.dtype)


def _starts_at_zero(lp: For) -> bool:
    return isinstance(lp.min, Const) and int(lp.min.value) == 0


def _is_zero(e: Expr) -> bool:
    return isinstance(e, Const) and e.value == 0


def _conjuncts(e: Expr) -> list[Expr]:
    if isinstance(e, Binary) and e.op == "&" and e.dtype.is_bool:
        return _conjuncts(e.a) + _conjuncts(e.b)
    return [e]


def _matched_var(e: Expr) -> Expr:
    """`v` for `v` or an integer widening `int64(v)` of it."""
    return e.a if isinstance(e, Cast) and e.dtype.is_int and e.a.dtype.is_int else e


def _split_condition(cond: Expr, spatial: list[For], stage: str
                     ) -> tuple[tuple[int, ...], tuple[Expr, ...], tuple[Expr, ...]] | None:
    """(matched dimensions, target per dimension, guards) of a scatter's condition, or None
    when a conjunct is neither an index check nor `e == v` for an output axis v."""
    axis_of = {lp.var: d for d, lp in enumerate(spatial)}
    targets: list[Expr] = [lp.var for lp in spatial]
    matched: list[int] = []
    checks: list[Expr] = []
    checked_dims: set[int] = set()
    for term in _conjuncts(cond):
        if isinstance(term, IndexCheck):
            checks.append(term)
            if term.tensor == stage:
                checked_dims.add(term.dim)
            continue
        if not (isinstance(term, Compare) and term.op == "=="):
            return None
        for e, v in ((term.a, _matched_var(term.b)), (term.b, _matched_var(term.a))):
            if isinstance(v, Var) and v in axis_of and v not in free_vars(e):
                d = axis_of[v]
                if d in matched:
                    return None
                matched.append(d)
                targets[d] = e
                break
        else:
            return None
    if not matched:
        return None  # no equation: a plain reduction, better served by the reduction strategies
    matched_vars = {spatial[d].var for d in matched}
    if any(free_vars(targets[d]) & matched_vars for d in matched):
        return None
    guards = list(checks)
    for d in sorted(matched):
        if d not in checked_dims:  # a masked sum the user wrote: out-of-range positions add nothing
            e = targets[d]
            guards += [compare(">=", e, Const(0, e.dtype)), compare("<", e, spatial[d].extent)]
    return tuple(sorted(matched)), tuple(targets), tuple(guards)


def _finish(stored: Expr, acc_load: Expr, loop_vars: set[Var]) -> tuple[Var, Expr | None, Expr] | None:
    """(total, base, finish): the stored value is `finish` with `total` standing for `base + acc`
    (or `acc`), where `base` (what the output starts from) depends on neither the accumulator nor
    the summed loops. None when the store uses the accumulator otherwise."""
    uses = [n for n in walk(stored) if n is acc_load]
    if len(uses) != 1:
        return None
    total = Var("total", acc_load.dtype, "value")
    inner: Expr | None = None
    base: Expr | None = None
    for n in walk(stored):
        if n is acc_load:
            inner = n
            break
        if isinstance(n, Binary) and n.op == "+" and (n.a is acc_load or n.b is acc_load):
            other = n.b if n.a is acc_load else n.a
            if acc_load in walk_set(other) or free_vars(other) & loop_vars:
                return None
            inner, base = n, other
            break
    assert inner is not None
    finish = SubexpressionReplacer({inner: total}).visit(stored)
    if acc_load in walk_set(finish):
        return None
    return total, base, finish


def walk_set(e: Expr) -> set[Expr]:
    return set(walk(e))


def scatter_atomic_module(module: Module, kernel: str) -> tuple[Module, tuple[str, ...]]:
    """`module` with the scatter kernel `kernel` replaced by its atomic form (module docstring),
    and the names of the kernels that replace it, in launch order. ScheduleError when the kernel
    is not a scatter."""
    func = module.kernel(kernel)
    m = match_scatter(func)
    if m is None:
        raise ScheduleError(f"scatter_atomic: kernel {kernel} is not a scatter (a masked sum whose output axes "
                            "are matched by equations `e == v` or shared with the domain), or was scheduled already")
    taken = {k.name for k in module.kernels} | {p.name for p in module.params} | {t.name for t in module.temps}
    temps = list(module.temps)
    if m.finish is m.total and m.acc_dtype == m.out.dtype:
        target = m.out
    else:
        target = Buffer(fresh_name(f"{m.out.name}_acc", taken, "_"), m.acc_dtype, m.out.shape, "global", None,
                        f"{m.stage}.acc")
        temps.append(target)
    kernels: list[PrimFunc] = []
    # 1. what the output starts from
    loops = [lp.var for lp in m.spatial]
    start = m.base if m.base is not None else Const(0, m.acc_dtype)
    kernels.append(_over(fresh_name(f"{m.stage}_init", taken, "_"), m.spatial, BufferStore(target, tuple(loops), start)))
    # 2. one atomic addition per domain point: the summed loops outside, the free output loops inside
    add: Stmt = Evaluate(atomic_add(BufferLoad(target, m.targets), m.value))
    if m.guards:
        add = IfThenElse(logical_and(*m.guards), add, None)
    body = add
    for lp in reversed(m.summed + m.free):
        body = For(lp.var, lp.min, lp.extent, "serial", body)
    kernels.append(_kernel(kernel, body, module))
    # 3. the finish (a cast to the output's dtype, ...), reading the temporary
    if target is not m.out:
        value = substitute(m.finish, {m.total: BufferLoad(target, tuple(loops))})
        kernels.append(_over(fresh_name(f"{m.stage}_finish", taken, "_"), m.spatial, BufferStore(m.out, tuple(loops), value)))
    kernels = [_kernel(k.name, k.body, module, tuple(temps)) for k in kernels]
    new_kernels: list[PrimFunc] = []
    calls: list[KernelCall] = []
    for k in module.kernels:
        if k.name != kernel:
            new_kernels.append(k)
            continue
        new_kernels += kernels
    for c in module.calls:
        if c.kernel != kernel:
            calls.append(c)
            continue
        calls += [KernelCall(k.name, k.params) for k in kernels]
    names = tuple(k.name for k in kernels)
    return Module(module.name, module.params, tuple(new_kernels), tuple(calls), tuple(temps)), names


def _over(name: str, spatial: tuple[For, ...], body: Stmt) -> PrimFunc:
    """A kernel running `body` over the output's loops (fresh variables of the same names)."""
    fresh = {lp.var: Var(lp.var.name, lp.var.dtype, "index") for lp in spatial}
    from ..substitute import substitute_stmt

    s = substitute_stmt(body, fresh)
    for lp in reversed(spatial):
        s = For(fresh[lp.var], lp.min, lp.extent, "serial", s)  # type: ignore[arg-type]
    return PrimFunc(name, (), s)


def _kernel(name: str, body: Stmt, module: Module, temps: tuple[Buffer, ...] | None = None) -> PrimFunc:
    """A kernel with the parameters its body uses: the module's buffers (signature order, then
    temporaries) and size variables, as lowering orders them."""
    from ..lower import global_buffers, exprs_of, scalar_vars

    used = global_buffers(body)
    buffers = [p for p in module.params if isinstance(p, Buffer) and p in used]
    buffers += [t for t in (temps if temps is not None else module.temps) if t in used]
    sizes = scalar_vars(exprs_of(body) + [s for b in used for s in b.shape + (b.strides or ())])
    order = [p for p in module.params if isinstance(p, Var)]
    params = tuple(buffers) + tuple(v for v in order if v in sizes)
    return PrimFunc(name, params, body)


__all__ = ["ScatterMatch", "match_scatter", "scatter_atomic_module"]
