"""fuse: two directly nested loops into one over the product of their ranges.

Preconditions (ScheduleError otherwise): `inner` is the whole body of `outer` (adjacent and
perfectly nested), both are serial, and the inner range does not use the outer variable.
The fused loop `outer_inner_f` runs extent(outer) * extent(inner) iterations with
outer = f // extent(inner) and inner = f % extent(inner). Fusion never changes the order of
iterations, so it is always legal for dependences. With a symbolic inner extent the indices are
no longer affine (division by a symbol) and later analyses treat them as unknown.
"""

from __future__ import annotations

from ...ir.errors import ScheduleError
from ...ir.expr import Const, Var, free_vars
from ...ir.stmt import For, PrimFunc
from ..substitute import substitute_stmt
from .loops import all_names, find_loop, fresh_name, replace_stmt


def fuse(func: PrimFunc, outer: str, inner: str) -> PrimFunc:
    what = f"fuse({outer}, {inner})"
    o, _ = find_loop(func, outer)
    i, _ = find_loop(func, inner)
    if o.body is not i:
        raise ScheduleError(f"{what}: {inner} is not the whole body of {outer}; fuse needs adjacent, perfectly "
                            "nested loops (outer first)")
    for lp in (o, i):
        if lp.kind != "serial":
            raise ScheduleError(f"{what}: loop {lp.var.name} is {lp.kind}; fuse before binding or unrolling")
    if o.var in free_vars(i.min) | free_vars(i.extent):
        raise ScheduleError(f"{what}: the range of {inner} depends on {outer}")
    d = o.var.dtype
    fused = Var(fresh_name(all_names(func), f"{outer}_{inner}_f"), d)
    mapping = {o.var: o.min + fused // i.extent, i.var: i.min + fused % i.extent}
    body = substitute_stmt(i.body, mapping)
    new = For(fused, Const(0, d), o.extent * i.extent, "serial", body)
    return func.with_body(replace_stmt(func.body, o, new))
