"""rfactor: a reduction loop made parallel, its partial results combined by a second kernel (split-K).

A stage `C[i, j] = f(Σ_k e)` lowered as

    for i: for j:
      allocate acc
      acc[0] = identity
      for k_o:                       # the loop to factor, e.g. from split(k, [None, chunk])
        for k_i: [if guard:] acc[0] = acc[0] ⊕ e
      C[i, j] = f(acc[0])

becomes two kernels and one temporary `C_rf[k_o, i, j]` (global, the accumulator's dtype):

    kernel C_kernel  (same name: loop handles stay valid)
      for k_o: for i: for j:
        allocate acc; acc[0] = identity
        for k_i: [if guard:] acc[0] = acc[0] ⊕ e
        C_rf[k_o, i, j] = acc[0]
    kernel C_kernel_combine
      for i: for j:
        allocate acc; acc[0] = identity
        for r in range(extent of k_o): acc[0] = acc[0] ⊕ C_rf[r, i, j]
        C[i, j] = f(acc[0])          # the epilogue stays with the final value

`k_o` becomes the leading spatial axis of the partial stage (stage name "C.rf"), so a GEMM
template binds it to blockIdx.z like a batch axis: more blocks without smaller tiles when the
output has too few tiles for the SMs (TVM's `rfactor`; split-K in CUTLASS's terms). The
combination order is fixed (r = 0, 1, ...), so the result is deterministic run to run (it
differs from the unsplit sum by float rounding only).

Preconditions (ScheduleError otherwise): the kernel is still serial (rfactor before binding); the
loop is a direct child of the sequence `init; loop; store` under the accumulator's Allocate,
under a perfect nest of serial loops; every statement under the loop is an update
`acc[0] = acc[0] ⊕ x` of that accumulator (⊕ one of +, *, max, min), possibly guarded; the store
writes a global buffer at exactly the nest's loop variables, and reads the accumulator only
there; the loop's extent does not depend on the nest's variables.
"""

from __future__ import annotations

from ...ir.errors import ScheduleError
from ...ir.expr import (
    Binary,
    BufferLoad,
    Const,
    Var,
    binary,
    free_vars,
    reduce_identity,
    walk,
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
    Seq,
    Stmt,
    seq,
)
from .loops import find_loop, iter_with_path, rebuffer

_COMBINERS = {"+": "sum", "*": "prod", "max": "max", "min": "min", "fmax": "nanmax", "fmin": "nanmin"}


def _update_combiner(s: Stmt, acc: Buffer) -> str | None:
    """The combiner of `acc[0] = acc[0] ⊕ x` (guarded or not), None if `s` is not one."""
    while isinstance(s, IfThenElse) and s.else_case is None:
        s = s.then_case
    if not isinstance(s, BufferStore) or s.buffer is not acc:
        return None
    v = s.value
    if not isinstance(v, Binary) or v.op not in _COMBINERS:
        return None
    first = v.a
    if not (isinstance(first, BufferLoad) and first.buffer is acc):
        return None
    if any(isinstance(n, BufferLoad) and n.buffer is acc for n in walk(v.b)):
        return None
    return v.op


def kernel_params(module: Module, body: Stmt, extra: list[Buffer]) -> tuple[Buffer | Var, ...]:
    """A kernel's parameters: the module's buffers and temporaries it uses, then its size variables."""
    from ..lower import exprs_of, global_buffers, scalar_vars

    used = global_buffers(body)
    buffers = [p for p in module.params if isinstance(p, Buffer) and p in used]
    buffers += [t for t in list(module.temps) + extra if t in used and t not in buffers]
    scalars = scalar_vars(exprs_of(body) + [x for b in used for x in b.shape + (b.strides or ())])
    module_scalars = [p for p in module.params if isinstance(p, Var)]
    return tuple(buffers) + tuple(v for v in module_scalars if v in scalars)


def rfactor(module: Module, kernel: str, loop: str) -> Module:
    """The module with `loop` of `kernel` factored out (see the module docstring)."""
    func = module.kernel(kernel)
    node, path = find_loop(func, loop)
    where = f"rfactor({kernel}/{loop})"
    for s, _ in iter_with_path(func.body):
        if isinstance(s, For) and s.kind != "serial":
            raise ScheduleError(f"{where}: loop {s.var.name} is already {s.kind}; rfactor before binding or unrolling")
    # path: For* → Allocate(acc) → Seq(init, loop, store)
    if len(path) < 2 or not isinstance(path[-1], Seq) or not isinstance(path[-2], Allocate):
        raise ScheduleError(f"{where}: the loop must sit in `init; loop; store` under its accumulator's allocation")
    body_seq, alloc = path[-1], path[-2]
    nest = path[:-2]
    if not all(isinstance(x, For) for x in nest) or any(
            not isinstance(x.body, For) for x in nest[:-1]) or (nest and nest[-1].body is not alloc):
        raise ScheduleError(f"{where}: the accumulator must sit under a perfect nest of loops")
    acc = alloc.buffer
    stmts = body_seq.stmts
    if len(stmts) != 3 or stmts[1] is not node:
        raise ScheduleError(f"{where}: the accumulator's body must be `init; {loop}; store`, got {len(stmts)} statements")
    init, store = stmts[0], stmts[2]
    if not (isinstance(init, BufferStore) and init.buffer is acc and isinstance(init.value, Const)):
        raise ScheduleError(f"{where}: the first statement must set the accumulator to its identity")
    ops = set()
    for s, _ in iter_with_path(node.body):
        if isinstance(s, BufferStore):
            op = _update_combiner(s, acc)
            if op is None:
                raise ScheduleError(f"{where}: {s.buffer.name} is written under the loop; only updates "
                                    f"`{acc.name}[0] = {acc.name}[0] ⊕ x` can be factored")
            ops.add(op)
    if len(ops) != 1:
        raise ScheduleError(f"{where}: the loop holds no update of {acc.name}, or updates with different combiners")
    (op,) = ops
    identity = reduce_identity(_COMBINERS[op], acc.dtype)
    if float(init.value.value) != float(identity.value):  # type: ignore[attr-defined]
        raise ScheduleError(f"{where}: the accumulator starts at {init.value}, not the identity of {op}")
    spatial = [x.var for x in nest]
    if not isinstance(store, BufferStore) or store.buffer.scope != "global" or list(store.indices) != spatial:
        raise ScheduleError(f"{where}: the last statement must store the result at exactly the loops {spatial}")
    if free_vars(node.extent) & set(spatial) or free_vars(node.min) & set(spatial):
        raise ScheduleError(f"{where}: the extent of {loop} depends on the output's loops")
    out = store.buffer
    taken = {k.name for k in module.kernels} | {b.name for b in module.params if isinstance(b, Buffer)} | {
        t.name for t in module.temps}
    rf_name = f"{out.name}_rf"
    while rf_name in taken:
        rf_name += "_"
    extent = node.extent if isinstance(node.min, Const) and node.min.value == 0 else None
    if extent is None:
        raise ScheduleError(f"{where}: the loop must start at 0")
    rf = Buffer(rf_name, acc.dtype, (extent,) + tuple(out.shape), "global", None, f"{out.tensor}.rf")

    # the partial kernel: the factored loop outermost, one partial result per (k_o, i, j)
    zero = Const(0, spatial[0].dtype if spatial else node.var.dtype)
    # its accumulator belongs to the partial stage ("C.rf.acc"), so get_loops / cache_write of
    # "C.rf" see the reduction loops
    pacc = Buffer(acc.name, acc.dtype, acc.shape, acc.scope, acc.strides, f"{rf.tensor}.acc")
    partial_body: Stmt = rebuffer(seq(init, node.body, BufferStore(rf, (node.var,) + tuple(spatial), acc[zero])),
                                  acc, pacc, lambda idx: idx)
    partial_body = Allocate(pacc, partial_body)
    for x in reversed(nest):
        partial_body = For(x.var, x.min, x.extent, "serial", partial_body)
    partial_body = For(node.var, node.min, node.extent, "serial", partial_body)

    # the combining kernel: Σ over the partials, then the stage's own store (its epilogue)
    r = Var(f"{node.var.name}_r", node.var.dtype, "index")
    update = BufferStore(acc, (zero,), binary(op, acc[zero], BufferLoad(rf, (r,) + tuple(spatial))))
    combine_body: Stmt = Allocate(acc, seq(init, For(r, Const(0, r.dtype), extent, "serial", update), store))
    for x in reversed(nest):
        combine_body = For(x.var, x.min, x.extent, "serial", combine_body)

    combine_name = f"{kernel}_combine"
    while combine_name in taken:
        combine_name += "_"
    partial = PrimFunc(kernel, kernel_params(module, partial_body, [rf]), partial_body, func.attrs)
    combine = PrimFunc(combine_name, kernel_params(module, combine_body, [rf]), combine_body)
    kernels: list[PrimFunc] = []
    calls: list[KernelCall] = []
    for k in module.kernels:
        if k.name == kernel:
            kernels += [partial, combine]
        else:
            kernels.append(k)
    for c in module.calls:
        if c.kernel == kernel:
            calls += [KernelCall(partial.name, partial.params), KernelCall(combine.name, combine.params)]
        else:
            calls.append(c)
    return Module(module.name, module.params, tuple(kernels), tuple(calls), tuple(module.temps) + (rf,))


__all__ = ["kernel_params", "rfactor"]
