"""reorder: permute loops that are nested in one another, distributing loops where needed.

`reorder(io, jo, ko, ii, ji, ki)` permutes the listed loops among the positions they occupy on
one root-to-leaf path (loops of that path that are not listed keep their places).

Preconditions (ScheduleError otherwise): every loop exists, appears once, and all lie on one
path (each is inside the previous or contains it); a loop's range does not use the variable of a
loop it would move outside; and the new order keeps every dependence (islpy), except that the
update of an associative, commutative reduction may run its instances in any order.

Imperfect nests. Lowering gives a reduction the form
    for i: for j: { acc = 0; for k: acc = acc + ...; C[i, j] = acc }
so moving `k` outside `j` needs the statements around it to leave `j` first. reorder does
that by *loop distribution*: `for j: {S1; for k: ...; S2}` becomes
    for j_init: S1;  for j: for k: ...;  for j_post: S2
with every buffer allocated inside `j` (the accumulator) expanded by j's extent, so each `j`
keeps its own element (`acc[j]`). Distribution is legal when no dependence runs from a later
statement of the body to an earlier one of a later iteration (checked with islpy), and needs a
constant extent for the loop when it expands a buffer (split it first). Only the loops that
must cross such statements are distributed, so the accumulator grows exactly by the tile that
moves inside the reduction loop (e.g. the 4x4 register tile of a GEMM).
"""

from __future__ import annotations

from typing import Sequence

from ...ir import poly
from ...ir.errors import ScheduleError
from ...ir.expr import Const, Var, const_int, free_vars
from ...ir.stmt import Allocate, Buffer, BufferStore, For, PrimFunc, Seq, Stmt, seq
from ..substitute import substitute_stmt
from .legality import check_schedule, default_entries
from .loops import (
    all_names,
    find_loop,
    fresh_name,
    leaves,
    loops_on_path,
    rebuffer,
    replace_stmt,
    with_body,
)


def _chain(func: PrimFunc, names: set[str]) -> list[For]:
    """The loops named in `names`, which lie on one path, outermost first."""
    deepest: tuple[For, tuple[Stmt, ...]] | None = None
    for n in names:
        node, path = find_loop(func, n)
        if deepest is None or len(path) > len(deepest[1]):
            deepest = (node, path)
    assert deepest is not None
    return [lp for lp in loops_on_path(deepest[1]) + [deepest[0]] if lp.var.name in names]


def _gaps(chain: list[For]) -> list[int]:
    """Indices k where chain[k]'s body is not directly chain[k + 1] (an imperfect level)."""
    return [k for k in range(len(chain) - 1) if chain[k].body is not chain[k + 1]]


def _permute_segment(func: PrimFunc, seg: list[str], desired: list[str], what: str) -> PrimFunc:
    """Reorder a perfect nest whose loops are `seg` (outermost first) into `desired`."""
    if seg == desired:
        return func
    loops = [find_loop(func, n)[0] for n in seg]
    seg_vars = {lp.var for lp in loops}
    by_name = {lp.var.name: lp for lp in loops}
    for pos, n in enumerate(desired):
        lp = by_name[n]
        outer_now = {by_name[m].var for m in desired[:pos]}
        uses = (free_vars(lp.min) | free_vars(lp.extent)) & seg_vars
        if uses - outer_now:
            names = ", ".join(sorted(v.name for v in uses - outer_now))
            raise ScheduleError(f"{what}: the range of loop {n} uses {names}, which would no longer enclose it")
    swap = {by_name[a].var: by_name[b].var for a, b in zip(seg, desired)}

    def entries(s: poly.PolyStmt) -> list[object]:
        return [swap.get(e, e) if isinstance(e, Var) else e for e in default_entries(s)]

    check_schedule(func, what, entries, reductions_commute=True)
    body = loops[-1].body
    for n in reversed(desired):
        body = with_body(by_name[n], body)
    return func.with_body(replace_stmt(func.body, loops[0], body))


def _split_body(loop: For, child: For) -> tuple[list[Buffer], list[Stmt], list[Stmt]]:
    """The allocations around `child` inside `loop`, and the statements before and after it."""
    allocs: list[Buffer] = []
    pre: list[Stmt] = []
    post: list[Stmt] = []
    s: Stmt = loop.body
    while s is not child:
        if isinstance(s, Allocate):
            allocs.append(s.buffer)
            s = s.body
        elif isinstance(s, Seq):
            hit = [k for k, x in enumerate(s.stmts) if child in [y for y in _spine(x)]]
            if len(hit) != 1:
                break
            k = hit[0]
            pre += list(s.stmts[:k])
            post = list(s.stmts[k + 1:]) + post
            s = s.stmts[k]
        else:
            raise ScheduleError(
                f"reorder: loop {child.var.name} sits under a {type(s).__name__} inside loop {loop.var.name}; "
                "only allocations and statement sequences can be distributed"
            )
    return allocs, pre, post


def _spine(s: Stmt) -> list[Stmt]:
    """`s` and the statements reached from it through Allocate / Seq wrappers."""
    out = [s]
    while isinstance(s, Allocate):
        s = s.body
        out.append(s)
    if isinstance(s, Seq):
        for x in s.stmts:
            out += _spine(x)
    return out


def distribute(func: PrimFunc, loop_name: str, child_name: str) -> PrimFunc:
    """Distribute loop `loop_name` over the statements around its descendant `child_name`."""
    loop, _ = find_loop(func, loop_name)
    child, _ = find_loop(func, child_name)
    allocs, pre, post = _split_body(loop, child)
    ext = const_int(loop.extent)
    if allocs and ext is None:
        raise ScheduleError(
            f"reorder: moving loops out of {loop_name} expands {', '.join(b.name for b in allocs)} by its extent "
            f"{loop.extent}, which is not constant; split {loop_name} by a constant factor first"
        )
    pre_leaves = {id(x) for x in leaves(seq(*pre))} if pre else set()
    post_leaves = {id(x) for x in leaves(seq(*post))} if post else set()

    def entries(s: poly.PolyStmt) -> list[object]:
        out = default_entries(s)
        for d, lp in enumerate(s.loops):
            if lp.var is loop.var:
                g = 0 if id(s.node) in pre_leaves else 2 if id(s.node) in post_leaves else 1
                return out[:2 * d + 1] + [g] + out[2 * d + 1:]
        return out

    check_schedule(func, f"reorder: distributing loop {loop_name}", entries, reductions_commute=False)
    taken = all_names(func)
    expanded = {b: Buffer(b.name, b.dtype, (Const(ext, b.shape[0].dtype),) + b.shape, b.scope, None, b.tensor)
                for b in allocs}

    def part(stmts: list[Stmt], var: Var) -> Stmt:
        body = seq(*stmts)
        if var is not loop.var:
            body = substitute_stmt(body, {loop.var: var})
        for old, new in expanded.items():
            body = rebuffer(body, old, new, lambda idx, v=var: (v - loop.min,) + idx)
        return For(var, loop.min, loop.extent, loop.kind, body, loop.annotations)

    parts: list[Stmt] = []
    if pre:
        init = all(isinstance(x, BufferStore) and isinstance(x.value, Const) for x in leaves(seq(*pre)))
        suffix = "init" if init else "pre"
        parts.append(part(pre, Var(fresh_name(taken, f"{loop_name}_{suffix}"), loop.var.dtype)))
    parts.append(part([child], loop.var))
    if post:
        parts.append(part(post, Var(fresh_name(taken, f"{loop_name}_post"), loop.var.dtype)))
    out: Stmt = seq(*parts)
    for b in reversed(allocs):
        out = Allocate(expanded[b], out)
    return func.with_body(replace_stmt(func.body, loop, out))


def reorder(func: PrimFunc, names: Sequence[str]) -> PrimFunc:
    """Permute the loops `names` of `func` into the given order (see the module docstring)."""
    names = list(names)
    what = f"reorder({', '.join(names)})"
    if len(set(names)) != len(names):
        raise ScheduleError(f"{what}: a loop is listed twice")
    found = [find_loop(func, n) for n in names]
    by_depth = sorted(found, key=lambda fp: len(fp[1]))
    for (a, _), (b, bpath) in zip(by_depth, by_depth[1:]):
        if not any(x is a for x in bpath):
            raise ScheduleError(
                f"{what}: loops {a.var.name} and {b.var.name} are not nested one inside the other; "
                "reorder permutes loops of one nest"
            )
    top, bottom = by_depth[0], by_depth[-1]
    path_loops = loops_on_path(bottom[1]) + [bottom[0]]
    start = next(k for k, lp in enumerate(path_loops) if lp is top[0])
    chain_names = [lp.var.name for lp in path_loops[start:]]
    listed = set(names)
    slots = [k for k, n in enumerate(chain_names) if n in listed]
    target = list(chain_names)
    for k, n in zip(slots, names):
        target[k] = n
    if target == chain_names:
        return func
    rank = {n: k for k, n in enumerate(target)}
    members = set(chain_names)
    for _ in range(4 * len(chain_names) + 4):
        chain = _chain(func, members)
        gaps = _gaps(chain)
        work = None
        for g in reversed(gaps):
            above = [lp.var.name for lp in chain[:g + 1]]
            below = [lp.var.name for lp in chain[g + 1:]]
            first_below = min(rank[n] for n in below)
            cross = [n for n in above if rank[n] > first_below]
            if cross:
                work = (g, above, cross)
                break
        if work is None:
            break
        g, above, cross = work
        prev = max([x for x in gaps if x < g], default=-1)
        seg = above[prev + 1:]
        if set(cross) - set(seg):
            far = ", ".join(sorted(set(cross) - set(seg)))
            raise ScheduleError(f"{what}: loop(s) {far} would have to cross two levels of statements; reorder in steps")
        stay = sorted((n for n in seg if n not in cross), key=rank.__getitem__)
        moving = sorted(cross, key=rank.__getitem__)
        func = _permute_segment(func, seg, stay + moving, what)
        func = distribute(func, moving[-1], chain[g + 1].var.name)
    chain = _chain(func, members)
    bounds = [-1] + _gaps(chain) + [len(chain) - 1]
    for a, b in zip(bounds, bounds[1:]):
        seg = [lp.var.name for lp in chain[a + 1:b + 1]]
        func = _permute_segment(func, seg, sorted(seg, key=rank.__getitem__), what)
    return func


__all__ = ["reorder", "distribute"]
