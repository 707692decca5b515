"""The default schedule: one thread per output element.

The leading nest of spatial loops of each kernel (the loops over the output's axes that lowering
made) is fused into one linear index, split into blocks of `threads` threads bound to blockIdx.x /
threadIdx.x, and guarded for the partial last block. Reductions stay serial in each thread. A
1-D grid covers any size CUDA allows (2^31 - 1 blocks in x); a zero-size output gives a grid of
0 blocks, which the runtime does not launch.

This is the always-valid schedule; the planner replaces it with better ones where it can.
"""

from __future__ import annotations

from ..ir import dtype as dt
from ..ir.errors import ScheduleError
from ..ir.expr import Const, Expr, Var, const_int, size_product
from ..ir.stmt import For, IfThenElse, LetStmt, Module, PrimFunc, Stmt
from .substitute import substitute_stmt

DEFAULT_THREADS = 256


def _spatial_nest(body: Stmt) -> tuple[list[For], Stmt]:
    loops: list[For] = []
    s = body
    while isinstance(s, For) and s.kind == "serial" and const_int(s.min) == 0:
        loops.append(s)
        s = s.body
    return loops, s


def schedule_one_thread_per_element(func: PrimFunc, threads: int = DEFAULT_THREADS) -> PrimFunc:
    """Bind the spatial nest of `func` to a 1-D grid of `threads`-thread blocks."""
    if threads <= 0 or threads > 1024 or threads % 32:
        raise ScheduleError(f"default schedule of {func.name}: threads must be a multiple of 32 in [32, 1024], got {threads}")
    loops, inner = _spatial_nest(func.body)
    extents = [lp.extent for lp in loops]
    total = size_product(extents)
    static_total = const_int(total)
    wide = any(e.dtype == dt.int64 for e in extents) or (static_total is not None and static_total >= 2**31)
    idx_t = dt.int64 if wide else dt.int32
    if static_total is not None and static_total < threads:
        threads = max(32, -(-static_total // 32) * 32)
    bx = Var("bx", idx_t)
    tx = Var("tx", idx_t)
    flat_var = Var("idx", idx_t)
    flat = bx * threads + tx
    total_i = total if total.dtype == idx_t else _cast_index(total, idx_t)
    mapping: dict[Var, Expr] = {}
    rest: Expr = flat_var
    for lp in reversed(loops):
        ext = lp.extent if lp.extent.dtype == idx_t else _cast_index(lp.extent, idx_t)
        value = rest % ext if lp is not loops[0] else rest
        mapping[lp.var] = value if value.dtype == lp.var.dtype else _cast_index(value, lp.var.dtype)
        rest = rest // ext
    body = substitute_stmt(inner, mapping)
    if static_total is None or static_total % threads != 0:
        body = IfThenElse(flat_var < total_i, body)
    body = LetStmt(flat_var, flat, body)
    nblocks = (total_i + (threads - 1)) // threads
    out = For(bx, Const(0, idx_t), nblocks, "blockIdx.x", For(tx, Const(0, idx_t), Const(threads, idx_t), "threadIdx.x", body))
    return func.with_body(out)


def _cast_index(e: Expr, d: dt.DType) -> Expr:
    from ..ir.expr import cast

    return cast(e, d)


def default_schedule(module: Module, threads: int = DEFAULT_THREADS) -> Module:
    """Apply the one-thread-per-element schedule to every kernel of `module` that is not yet bound."""
    out = []
    for k in module.kernels:
        bound = any(isinstance(s, For) and (s.is_thread or s.is_block) for s in _walk(k.body))
        out.append(k if bound else schedule_one_thread_per_element(k, threads))
    return module.with_kernels(out)


def _walk(s: Stmt) -> list[Stmt]:
    from ..ir.stmt import iter_stmts

    return list(iter_stmts(s))


__all__ = ["default_schedule", "schedule_one_thread_per_element", "DEFAULT_THREADS"]
