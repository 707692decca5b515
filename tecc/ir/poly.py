"""Polyhedral analyses with islpy.

Expressions are translated to isl's Presburger syntax when they are quasi-affine (sums, products
by constants, floor division and modulo by positive constants, min/max); anything else makes an
analysis answer "unknown" rather than guess. Size variables become isl parameters (assumed >= 0),
iteration variables become set dimensions bounded by their ranges.

islpy >= 2026.2 dropped the implicit BasicSet -> Set conversions; every conversion here is explicit.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterable, Sequence

import islpy as isl

from .expr import Binary, Cast, Compare, Const, Expr, IterVar, Not, Var, free_vars


class _Names:
    """Stable isl names for tecc variables (tecc names may repeat; isl names may not)."""

    def __init__(self) -> None:
        self.by_var: dict[Var, str] = {}

    def __call__(self, v: Var) -> str:
        name = self.by_var.get(v)
        if name is None:
            name = f"{v.name}_{len(self.by_var)}"
            self.by_var[v] = name
        return name


def affine_text(e: Expr, names: _Names) -> str | None:
    """`e` in isl syntax, or None when it is not quasi-affine."""
    if isinstance(e, Const):
        return str(int(e.value)) if e.dtype.is_int else None
    if isinstance(e, Var):
        return names(e) if e.dtype.is_int else None
    if isinstance(e, Cast):
        return affine_text(e.a, names) if (e.dtype.is_int and e.a.dtype.is_int) else None
    if isinstance(e, Binary) and e.dtype.is_int:
        a, b = affine_text(e.a, names), affine_text(e.b, names)
        if a is None or b is None:
            return None
        if e.op in ("+", "-"):
            return f"({a} {e.op} {b})"
        if e.op == "*":
            if isinstance(e.a, Const) or isinstance(e.b, Const):
                return f"({a} * {b})"
            return None
        if e.op in ("min", "max"):
            return f"{e.op}({a}, {b})"
        if e.op in ("//", "%") and isinstance(e.b, Const) and int(e.b.value) > 0:
            return f"floor({a} / {b})" if e.op == "//" else f"({a} mod {b})"
    return None


_CMP = {"<": "<", "<=": "<=", ">": ">", ">=": ">=", "==": "="}
_NEGATED = {"<": ">=", "<=": ">", ">": "<=", ">=": "<"}


def condition_text(e: Expr, names: _Names) -> str | None:
    """A bool expression as an isl constraint, or None when it is not a Presburger formula."""
    if isinstance(e, Const) and e.dtype.is_bool:
        return "true" if e.value else "false"
    if isinstance(e, Compare) and e.op in _CMP:
        a, b = affine_text(e.a, names), affine_text(e.b, names)
        if a is None or b is None:
            return None
        return f"{a} {_CMP[e.op]} {b}"
    if isinstance(e, Not) and isinstance(e.a, Compare) and e.a.op in _NEGATED:
        return condition_text(Compare(_NEGATED[e.a.op], e.a.a, e.a.b), names)
    if isinstance(e, Binary) and e.dtype.is_bool and e.op in ("&", "|"):
        a, b = condition_text(e.a, names), condition_text(e.b, names)
        if a is None or b is None:
            return None
        return f"(({a}) {'and' if e.op == '&' else 'or'} ({b}))"
    return None


@dataclass(frozen=True)
class Violation:
    """A point of the iteration domain where an index leaves its bounds."""

    point: dict[str, int]

    def __str__(self) -> str:
        where = ", ".join(f"{k}={v}" for k, v in self.point.items())
        return f"at {where}" if where else "for every point"


def _domain(iter_vars: Iterable[IterVar], conditions: Sequence[Expr], names: _Names,
            extra: Sequence[str]) -> tuple[str, list[str], list[str]] | None:
    """The isl text of a domain, its set dimensions and its parameters; None if not affine."""
    constraints: list[str] = []
    dims: list[str] = []
    for v in iter_vars:
        lo, ext = affine_text(v.lo, names), affine_text(v.extent, names)
        if lo is None or ext is None:
            return None
        n = names(v)
        dims.append(n)
        constraints.append(f"{lo} <= {n} < {lo} + {ext}")
    for c in conditions:
        t = condition_text(c, names)
        if t is None:
            return None
        constraints.append(t)
    constraints.extend(extra)
    params = [n for n in names.by_var.values() if n not in dims]
    for var, n in names.by_var.items():
        if n in params and var.kind == "size":
            constraints.append(f"{n} >= 0")
    return " and ".join(constraints) or "true", dims, params


def find_out_of_bounds(index: Expr, extent: Expr, conditions: Sequence[Expr] = ()) -> Violation | None:
    """A point where `index` falls outside [0, extent), given that every iteration variable in it
    ranges over its domain and `conditions` hold; None when no such point exists or when the
    question is not affine (then nothing can be proved either way)."""
    names = _Names()
    idx, ext = affine_text(index, names), affine_text(extent, names)
    if idx is None or ext is None:
        return None
    cond_vars: set[Var] = set()
    for c in conditions:
        cond_vars |= free_vars(c)
    iter_vars = sorted({v for v in free_vars(index) | cond_vars if isinstance(v, IterVar)},
                       key=lambda v: names(v))
    # make the extents' own variables known before the domain is written
    for v in iter_vars:
        for e in (v.lo, v.extent):
            for fv in free_vars(e):
                names(fv)
    dom = _domain(iter_vars, conditions, names, [f"({idx} < 0 or {idx} >= {ext})"])
    if dom is None:
        return None
    text, dims, params = dom
    if any(isinstance(v, IterVar) and names(v) not in dims for v in names.by_var):
        return None  # an iteration variable of an extent is itself unbounded here: unknown
    sample = _sample_point(f"[{', '.join(params)}] -> {{ [{', '.join(dims)}] : {text} }}")
    if sample is None:
        return None
    inverse = {n: v.name for v, n in names.by_var.items()}
    return Violation({inverse.get(isl_name, isl_name): value for isl_name, value in sample})


@functools.lru_cache(maxsize=8192)
def _sample_point(src: str) -> tuple[tuple[str, int], ...] | None:
    """A point of the isl set `src` as (isl name, value) pairs, parameters first, or None when it
    is empty. Kept per text: a model's layers ask the same bounds questions in the same words
    (their compute axes have the same names), and isl answers a text the same way every time."""
    bad = isl.Set(src)
    if bad.is_empty():
        return None
    pt = bad.sample_point()
    point: list[tuple[str, int]] = []
    space = pt.get_space()
    for kind in (isl.dim_type.param, isl.dim_type.set):
        for pos in range(space.dim(kind)):
            isl_name = space.get_dim_name(kind, pos) or f"d{pos}"
            point.append((isl_name, int(pt.get_coordinate_val(kind, pos).to_python())))
    return tuple(point)


# ---- the statement model of a kernel body: domains, accesses, schedules, dependences ----------
#
# Used by the schedule primitives (tecc.passes.schedule) to decide legality and to size caches.
# A *statement* is a leaf of the loop IR (a BufferStore or an Evaluate); its *instances* are the
# points of its iteration domain (the values of its enclosing loop variables where its guards
# hold). Its schedule is the classic 2d+1 vector [p0, v0, p1, v1, ..., pd]: loop values
# interleaved with the textual position of the statement (or loop) inside each loop body, so the
# lexicographic order of schedule vectors is the sequential execution order.
#
# Anything not quasi-affine is over-approximated (an unknown index may touch any element, an
# unknown bound or guard is dropped), so dependences are a superset of the real ones: a legality
# check may refuse a legal schedule but never accepts an illegal one.


@dataclass(frozen=True)
class LoopDim:
    """One loop around a statement: its variable, range and kind (a For's fields)."""

    var: Var
    min: Expr
    extent: Expr
    kind: str


@dataclass(frozen=True)
class PolyStmt:
    """A leaf statement with everything the analyses need about it."""

    name: str                        # isl tuple name: S0, S1, ...
    node: object                     # the BufferStore / Evaluate it stands for
    loops: tuple[LoopDim, ...]       # enclosing loops, outermost first
    positions: tuple[int, ...]       # textual position in each loop body, len(loops) + 1
    conditions: tuple[Expr, ...]     # enclosing guards (an else branch contributes Not(cond))
    writes: tuple[tuple[object, tuple[Expr, ...]], ...]   # (Buffer, indices)
    reads: tuple[tuple[object, tuple[Expr, ...]], ...]
    prefixes: tuple[tuple[object, tuple[str, ...]], ...]  # per buffer: privatization prefix (isl text)

    def prefix(self, buffer: object) -> tuple[str, ...]:
        for b, p in self.prefixes:
            if b is buffer:
                return p
        return ()


def _loads_in(e: Expr) -> list[tuple[object, tuple[Expr, ...]]]:
    from .expr import BufferLoad, walk

    return [(n.buffer, n.indices) for n in walk(e) if isinstance(n, BufferLoad)]


def collect_statements(body: object) -> list[PolyStmt]:
    """The leaf statements of a kernel body, in execution (textual) order."""
    from .stmt import (
        Allocate,
        Barrier,
        BufferStore,
        Evaluate,
        For,
        IfThenElse,
        LetStmt,
        Seq,
    )

    out: list[PolyStmt] = []
    alloc_loops: dict[int, tuple[object, tuple[LoopDim, ...]]] = {}

    def prefixes(buffers: list[object], loops: tuple[LoopDim, ...]) -> tuple[tuple[object, tuple[str, ...]], ...]:
        # Shared memory is one copy per block, local memory one per thread; an Allocate inside a
        # serial loop is a fresh buffer per iteration. The prefix makes those copies distinct
        # elements, so privatized buffers carry no false dependences.
        res: list[tuple[object, tuple[str, ...]]] = []
        for b in buffers:
            scope = getattr(b, "scope", "global")
            if scope == "global" or any(x is b for x, _ in res):
                continue
            kinds = ["blockIdx.x", "blockIdx.y", "blockIdx.z"]
            if scope == "local":
                kinds += ["threadIdx.x", "threadIdx.y", "threadIdx.z"]
            parts: list[object] = []
            for k in kinds:
                bound = [lp.var for lp in loops if lp.kind == k]
                parts.append(bound[-1] if bound else 0)
            hit = alloc_loops.get(id(b))
            if hit is not None:
                parts += [lp.var for lp in hit[1] if lp.kind in ("serial", "unroll", "vectorize")]
            res.append((b, tuple(p if isinstance(p, int) else ("@", p) for p in parts)))  # type: ignore[misc]
        return tuple(res)

    def leaf(s: object, loops: tuple[LoopDim, ...], pos: list[int], conds: tuple[Expr, ...]) -> None:
        writes: list[tuple[object, tuple[Expr, ...]]] = []
        reads: list[tuple[object, tuple[Expr, ...]]] = []
        if isinstance(s, BufferStore):
            writes.append((s.buffer, s.indices))
            reads += _loads_in(s.value)
            for i in s.indices:
                reads += _loads_in(i)
        elif isinstance(s, Evaluate):
            reads += _loads_in(s.value)
        for c in conds:
            reads += _loads_in(c)
        for lp in loops:
            reads += _loads_in(lp.min) + _loads_in(lp.extent)
        bufs = [b for b, _ in writes + reads]
        out.append(PolyStmt(f"S{len(out)}", s, loops, tuple(pos), conds, tuple(writes), tuple(reads),
                            prefixes(bufs, loops)))

    def walk(s: object, loops: tuple[LoopDim, ...], pos: list[int], counter: list[int],
             conds: tuple[Expr, ...]) -> None:
        if isinstance(s, Seq):
            for x in s.stmts:
                walk(x, loops, pos, counter, conds)
        elif isinstance(s, For):
            here = pos + [counter[0]]
            counter[0] += 1
            walk(s.body, loops + (LoopDim(s.var, s.min, s.extent, s.kind),), here, [0], conds)
        elif isinstance(s, Allocate):
            alloc_loops[id(s.buffer)] = (s.buffer, loops)
            walk(s.body, loops, pos, counter, conds)
        elif isinstance(s, IfThenElse):
            walk(s.then_case, loops, pos, counter, conds + (s.cond,))
            if s.else_case is not None:
                walk(s.else_case, loops, pos, counter, conds + (Not(s.cond),))
        elif isinstance(s, LetStmt):
            # the let variable becomes an unknown parameter (over-approximation)
            walk(s.body, loops, pos, counter, conds)
        elif isinstance(s, Barrier):
            counter[0] += 1
        else:
            leaf(s, loops, pos + [counter[0]], conds)
            counter[0] += 1

    walk(body, (), [], [0], ())
    return out


class StmtSpace:
    """isl text of statements (shared names, so every piece lives in one parameter space)."""

    def __init__(self, stmts: Sequence[PolyStmt]) -> None:
        self.stmts = list(stmts)
        self.names = _Names()
        self.buffer_names: dict[int, str] = {}
        self.depth = max((len(s.loops) for s in stmts), default=0)
        self.loop_vars = {lp.var for s in stmts for lp in s.loops}
        self._domains: "isl.UnionSet | None" = None
        # the domains' text, written first: it names the loop variables and the parameters of
        # the conditions in statement order, the same names whatever is asked of the space next
        self._domain_pieces: list[str] = []
        for s in self.stmts:
            cons = self.constraints(s)
            where = " and ".join(cons) if cons else "true"
            self._domain_pieces.append(f"{s.name}[{', '.join(self.dims(s))}] : {where}")

    def buffer(self, b: object) -> str:
        n = self.buffer_names.get(id(b))
        if n is None:
            n = f"{getattr(b, 'name', 'buf')}_b{len(self.buffer_names)}"
            self.buffer_names[id(b)] = n
        return n

    def dims(self, s: PolyStmt) -> list[str]:
        return [self.names(lp.var) for lp in s.loops]

    def constraints(self, s: PolyStmt) -> list[str]:
        out: list[str] = []
        for lp in s.loops:
            lo, ext = affine_text(lp.min, self.names), affine_text(lp.extent, self.names)
            n = self.names(lp.var)
            if lo is not None:
                out.append(f"{n} >= {lo}")
                if ext is not None:
                    out.append(f"{n} < {lo} + {ext}")
        for c in s.conditions:
            t = condition_text(c, self.names) if not isinstance(c, Not) else None
            if isinstance(c, Not):
                inner = condition_text(c.a, self.names)
                t = f"not ({inner})" if inner is not None else None
            if t is not None:
                out.append(f"({t})")
        return out

    def _params(self) -> list[str]:
        return [n for v, n in self.names.by_var.items() if v not in self.loop_vars]

    def _piece(self, s: PolyStmt, target: str, target_cons: list[str]) -> str:
        """`s`'s map to `target` without the parameter list and without `s`'s domain:
        `S[dims] -> target : target constraints` (`union` intersects it with the domain)."""
        where = " and ".join(target_cons) if target_cons else "true"
        return f"{s.name}[{', '.join(self.dims(s))}] -> {target} : {where}"

    def domains(self) -> "isl.UnionSet":
        """Every statement's instances (its loops' ranges and its conditions; size parameters
        >= 0), parsed once per space."""
        if self._domains is None:
            pieces = self._domain_pieces
            params = self._params()
            sizes = [n for v, n in self.names.by_var.items() if n in params and v.kind == "size"]
            where = " and ".join(f"{n} >= 0" for n in sizes) if sizes else "true"
            self._domains = isl.UnionSet(f"[{', '.join(params)}] -> {{ {'; '.join(pieces)} }}").intersect_params(
                isl.Set(f"[{', '.join(params)}] -> {{ : {where} }}"))
        return self._domains

    def union(self, pieces: Iterable[str]) -> "isl.UnionMap":
        """The union of maps given as pieces (access_piece, schedule_piece), parsed as ONE isl
        text (a parameter a piece does not name is unconstrained in it either way), restricted
        to the statements' domains: the same map as each piece parsed with its statement's
        domain constraints, at a fraction of the parse (isl parses a map's domain constraints
        in the space of its domain and range: ~3x slower for a 10-loop statement's
        46-entry schedule than the map alone and the domains parsed once)."""
        body = "; ".join(list(pieces))  # the pieces first: they name the parameters
        return isl.UnionMap(f"[{', '.join(self._params())}] -> {{ {body} }}").intersect_domain(self.domains())

    def access(self, s: PolyStmt, buffer: object, indices: Sequence[Expr]) -> "isl.UnionMap":
        return self.union([self.access_piece(s, buffer, indices)])

    def access_piece(self, s: PolyStmt, buffer: object, indices: Sequence[Expr]) -> str:
        """`s`'s access to `buffer` at `indices` (statement instance -> element) as a piece."""
        pre = []
        for p in s.prefix(buffer):
            pre.append(str(p) if isinstance(p, int) else self.names(p[1]))  # type: ignore[arg-type]
        outs: list[str] = []
        cons: list[str] = []
        for k, ix in enumerate(indices):
            o = f"o{k}_"
            outs.append(o)
            t = affine_text(ix, self.names)
            if t is not None:
                cons.append(f"{o} = {t}")
        target = f"{self.buffer(buffer)}[{', '.join(pre + outs)}]"
        return self._piece(s, target, cons)

    def schedule(self, s: PolyStmt, entries: Sequence[object] | None = None) -> "isl.UnionMap":
        """The schedule map of `s`; `entries` (ints and loop Vars) replaces the 2d+1 default."""
        return self.union([self.schedule_piece(s, entries)])

    def schedule_piece(self, s: PolyStmt, entries: Sequence[object] | None = None, width: int | None = None) -> str:
        """`schedule(s, entries)` as a piece (`width` entries, zero-padded: 2 · depth + 3 unless given)."""
        if entries is None:
            entries = []
            for k, lp in enumerate(s.loops):
                entries += [s.positions[k], lp.var]
            entries.append(s.positions[len(s.loops)])
        if width is None:
            width = 2 * self.depth + 3
        items = [str(e) if isinstance(e, int) else self.names(e) for e in entries]  # type: ignore[arg-type]
        items += ["0"] * (width - len(items))
        return self._piece(s, f"[{', '.join(items)}]", [])


@dataclass
class Dependences:
    """Dependences of a kernel body: pairs of instances (source → sink) that touch the same
    element, at least one writing, the source first in the current schedule (both directions
    when built with `dependences(..., ordered=False)`)."""

    space: StmtSpace
    schedule: "isl.UnionMap"
    relation: "isl.UnionMap"

    def without_self(self, stmt_names: Iterable[str]) -> "isl.UnionMap":
        """The dependences minus those of each named statement on itself (reduction updates)."""
        rel = self.relation
        names = set(stmt_names)
        for s in self.space.stmts:
            if s.name in names:
                n = len(s.loops)
                a = ", ".join(f"a{k}" for k in range(n))
                b = ", ".join(f"b{k}" for k in range(n))
                rel = rel.subtract(isl.UnionMap(f"{{ {s.name}[{a}] -> {s.name}[{b}] }}"))
        return rel


def dependences(body: object, ordered: bool = True) -> Dependences:
    """The dependences of a kernel body under its current (sequential) schedule.

    ordered=False: every pair of instances that touch the same element, at least one writing,
    in both directions (not only source first): what `carried_at` needs, since whether a loop
    carries a pair does not depend on which of the two runs first -- without the schedule's
    lexicographic order, the most expensive isl operation here."""
    stmts = collect_statements(body)
    space = StmtSpace(stmts)
    writes = space.union(space.access_piece(s, b, ix) for s in stmts for b, ix in s.writes)
    # every dependence pairs an access with a write of the same buffer (buffers are told apart
    # by identity, as `StmtSpace.buffer` names them): reads of a buffer the body never writes
    # (the kernel's inputs) pair with nothing, so their maps are left out
    written = {id(b) for s in stmts for b, _ in s.writes}
    reads = space.union(space.access_piece(s, b, ix) for s in stmts for b, ix in s.reads if id(b) in written)
    sched = space.union(space.schedule_piece(s) for s in stmts)
    same = writes.apply_range(reads.reverse())          # write → read of the same element
    same = same.union(reads.apply_range(writes.reverse()))   # read → write
    same = same.union(writes.apply_range(writes.reverse()))  # write → write
    if not ordered:
        return Dependences(space, sched, same)
    order = sched.lex_lt_union_map(sched)
    return Dependences(space, sched, same.intersect(order))


def respects(relation: "isl.UnionMap", schedule: "isl.UnionMap") -> bool:
    """True when every dependence source still runs before its sink under `schedule`."""
    if relation.is_empty():
        return True
    return bool(relation.is_subset(schedule.lex_lt_union_map(schedule)))


def keeps_order(relation: "isl.UnionMap", both: "isl.UnionMap", width: int, new_width: int | None = None) -> bool:
    """True when every pair of `relation` that runs in one order under the old schedule runs in
    the same order under the new one. `both` maps every statement instance to its old schedule
    (`width` entries) followed by its new one (`new_width` entries, `width` unless given; an
    entry that is the same constant in every statement may be left out of either: its
    difference is always zero, which never decides an order); `relation` may hold its pairs in
    both directions (`dependences(..., ordered=False)`), which makes this the same question as
    `respects(ordered relation, new)`: a pair (x, y) with old(x) <lex old(y) keeps its order when
    new(x) <lex new(y), and whether a <lex b depends only on b - a (its first nonzero entry is
    positive). So the question is asked of the differences of the pairs' schedule vectors, in
    one space, without the lexicographic-order map of every pair of statements (`respects`'s
    `lex_lt_union_map`, the most expensive isl step of a legality check)."""
    if relation.is_empty():
        return True
    timed = relation.apply_domain(both).apply_range(both)
    if timed.is_empty():
        return True
    if new_width is None:
        new_width = width
    # one space (every statement's schedule has width + new_width entries): a Set, asked entry by entry
    # through isl's API (fixing an entry, bounding it) rather than through parsed probe sets
    deltas = isl.Set.from_union_set(timed.deltas())
    dim = isl.dim_type.set
    zero, one, minus_one = (isl.Val.int_from_si(deltas.get_ctx(), v) for v in (0, 1, -1))
    same_so_far = deltas  # differences whose old entries before k are all zero
    for k in range(width):
        # the old schedule's first different entry is k and the source runs first ...
        first = same_so_far.lower_bound_val(dim, k, one)
        if not first.is_empty():
            # ... and the new schedule runs the pair at the same time or the sink first
            tied = first
            for j in range(width, width + new_width):
                if not tied.upper_bound_val(dim, j, minus_one).is_empty():
                    return False
                tied = tied.fix_val(dim, j, zero)
                if tied.is_empty():
                    break
            if not tied.is_empty():
                return False
        same_so_far = same_so_far.fix_val(dim, k, zero)
        if same_so_far.is_empty():
            break
    return True


def carried_at(relation: "isl.UnionMap", schedule: "isl.UnionMap", level: int) -> bool:
    """True when some dependence has equal schedule entries before `level` and different ones at
    `level` (the loop whose variable is entry `level` carries it: running that loop's iterations
    in parallel would break the dependence)."""
    if relation.is_empty():
        return False
    timed = relation.apply_domain(schedule).apply_range(schedule)
    if timed.is_empty():
        return False
    width = timed.get_map_list().get_at(0).dim(isl.dim_type.in_)
    a = ", ".join(f"a{k}" for k in range(width))
    b = ", ".join(f"b{k}" for k in range(width))
    eq = [f"a{k} = b{k}" for k in range(level)] + [f"a{level} != b{level}"]
    probe = isl.UnionMap(f"{{ [{a}] -> [{b}] : {' and '.join(eq)} }}")
    return not timed.intersect(probe).is_empty()


def expr_bounds(e: Expr, loops: Sequence[LoopDim], conditions: Sequence[Expr] = ()) -> tuple[int | None, int | None]:
    """The least and greatest value of the affine expression `e` over the domain of `loops`
    (restricted by `conditions`), over every value of the size parameters; None where unbounded
    or not affine."""
    names = _Names()
    t = affine_text(e, names)
    if t is None:
        return (None, None)
    fake = PolyStmt("D", None, tuple(loops), tuple(0 for _ in range(len(loops) + 1)), tuple(conditions), (), (), ())
    space = StmtSpace([fake])
    space.names = names
    dims = space.dims(fake)
    cons = space.constraints(fake) + [f"t_ = {t}"]
    for v, n in list(names.by_var.items()):
        if n not in dims and v.kind == "size":
            cons.append(f"{n} >= 0")
    params = [n for v, n in names.by_var.items() if n not in dims]
    s = isl.Set(f"[{', '.join(params)}] -> {{ [{', '.join(dims + ['t_'])}] : {' and '.join(cons)} }}")
    if s.is_empty():
        return (None, None)
    s = s.project_out(isl.dim_type.set, 0, len(dims))
    lo, hi = s.dim_min_val(0), s.dim_max_val(0)
    return (int(lo.to_python()) if lo.is_int() else None, int(hi.to_python()) if hi.is_int() else None)


def proves(cond: Expr, loops: Sequence[LoopDim], context: Sequence[Expr] = ()) -> bool:
    """True when `cond` holds at every point of the domain of `loops` under `context`, for every
    value of the size parameters. False means "not proved"."""
    names = _Names()
    neg = condition_text(cond, names)
    if neg is None:
        return False
    fake = PolyStmt("D", None, tuple(loops), tuple(0 for _ in range(len(loops) + 1)), tuple(context), (), (), ())
    space = StmtSpace([fake])
    space.names = names
    dims = space.dims(fake)
    cons = space.constraints(fake) + [f"not ({neg})"]
    for v, n in list(names.by_var.items()):
        if n not in dims and v.kind == "size":
            cons.append(f"{n} >= 0")
    params = [n for v, n in names.by_var.items() if n not in dims]
    return bool(isl.Set(f"[{', '.join(params)}] -> {{ [{', '.join(dims)}] : {' and '.join(cons)} }}").is_empty())


def affine_coefficients(e: Expr, variables: Sequence[Var]) -> tuple[int, ...] | None:
    """The integer coefficients c_k of `e` = Σ c_k · variables[k] + rest, where `rest` (which is
    `e` with every variable set to 0) is free of them, when `e` is quasi-affine and no floor,
    modulo, min or max involves one of `variables`; None otherwise (isl decides: the affine form
    of the text has a single piece and no division touching those dimensions)."""
    names = _Names()
    dims = [names(v) for v in variables]
    t = affine_text(e, names)
    if t is None:
        return None
    params = [n for n in names.by_var.values() if n not in dims]
    piece = isl.PwAff(f"[{', '.join(params)}] -> {{ [{', '.join(dims)}] -> [({t})] }}")
    if piece.n_piece() != 1:
        return None
    affs: list[isl.Aff] = []
    piece.foreach_piece(lambda _set, aff: affs.append(aff))
    (aff,) = affs
    for k in range(aff.dim(isl.dim_type.div)):
        div = aff.get_div(k)
        if any(not div.get_coefficient_val(isl.dim_type.in_, n).is_zero() for n in range(len(dims))) \
                and not aff.get_coefficient_val(isl.dim_type.div, k).is_zero():
            return None
    out: list[int] = []
    for n in range(len(dims)):
        c = aff.get_coefficient_val(isl.dim_type.in_, n)
        if not c.is_int():
            return None
        out.append(int(c.to_python()))
    return tuple(out)


def _strict_constraints(loops: Sequence[LoopDim], conditions: Sequence[Expr], names: _Names) -> list[str] | None:
    """The loop ranges and `conditions` as isl constraints; None when any is not Presburger
    (unlike `StmtSpace.constraints`, nothing is dropped: the callers below need the exact set,
    an over-approximation would make `covered` unsound)."""
    out: list[str] = []
    for lp in loops:
        lo, ext = affine_text(lp.min, names), affine_text(lp.extent, names)
        if lo is None or ext is None:
            return None
        n = names(lp.var)
        out.append(f"{lo} <= {n} < {lo} + {ext}")
    for c in conditions:
        if isinstance(c, Not):
            inner = condition_text(c.a, names)
            t = None if inner is None else f"not ({inner})"
        else:
            t = condition_text(c, names)
        if t is None:
            return None
        out.append(f"({t})")
    return out


def _strict_set(loops: Sequence[LoopDim], conditions: Sequence[Expr], names: _Names,
                params: Sequence[str] | None = None) -> "isl.Set | None":
    cons = _strict_constraints(loops, conditions, names)
    if cons is None:
        return None
    dims = [names(lp.var) for lp in loops]
    if params is None:
        params = [n for v, n in names.by_var.items() if n not in dims]
    for v, n in names.by_var.items():
        if n in params and v.kind == "size":
            cons.append(f"{n} >= 0")
    return isl.Set(f"[{', '.join(params)}] -> {{ [{', '.join(dims)}] : {' and '.join(cons) or 'true'} }}")


def is_empty(loops: Sequence[LoopDim], conditions: Sequence[Expr]) -> bool:
    """True when no point of the domain of `loops` satisfies every condition, for every value of
    the size parameters. False means "not proved" (or not Presburger)."""
    s = _strict_set(loops, conditions, _Names())
    return s is not None and bool(s.is_empty())


def covered(loops: Sequence[LoopDim], conditions: Sequence[Expr], inner: Sequence[LoopDim],
            inner_conditions: Sequence[Expr]) -> bool:
    """True when for every point of `loops` under `conditions` there is a point of the further
    loops `inner` at which `inner_conditions` hold (∀x ∃y), for every value of the size
    parameters. False means "not proved" (or not Presburger)."""
    names = _Names()
    for lp in list(loops) + list(inner):
        names(lp.var)
    outer_set = _strict_set(loops, conditions, names)
    both = _strict_set(list(loops) + list(inner), list(conditions) + list(inner_conditions), names)
    if outer_set is None or both is None:
        return False
    dims = {names(lp.var) for lp in list(loops) + list(inner)}
    params = [n for n in names.by_var.values() if n not in dims]
    # both sets in one parameter space (the same names in the same order)
    outer_set = _strict_set(loops, conditions, names, params)
    both = _strict_set(list(loops) + list(inner), list(conditions) + list(inner_conditions), names, params)
    assert outer_set is not None and both is not None
    shadow = both.project_out(isl.dim_type.set, len(loops), len(inner))
    return bool(outer_set.is_subset(shadow))
