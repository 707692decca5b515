"""unguard_reduction_tail: the k-tail guard off the FFMAs of a register tile, where the shared tiles are zero past K.

When the k-tile (or split-K part) does not divide K, `split` guards every leaf under the k loop,
so the accumulation of a GEMM's register tile reads

    for k_o:
      S_A[..] = where(fill_A, A[..], 0);  S_B[..] = where(fill_B, B[..], 0)     (the copies)
      for k_i, i, j:
        if k_o*BK + k_i < K:  C_local[i, j] = C_local[i, j] + S_A[k_i, i] * S_B[k_i, j]

and every FFMA of the unrolled tile carries the predicate (1000³ at k-tile 16: 0.22 of cuBLAS,
against 0.34 at k-tile 8, which divides). The guard is redundant: past K, both tiles hold the
zeros of their copy's fill, so the extra steps add 0·0.

The argument, for one conjunct g of the statement's guard, the statement
`L[x] = L[x] + S1[r1] * S2[r2]` (L local, read only at x; S1, S2 shared) and the remaining guards R:
  1. S1 and S2 are read inside their bounds under R alone (islpy);
  2. for each of S1, S2, its one writer W (`S[w] = where(fill, load, 0.0)`, the copy) runs before
     the statement in the same iteration of every loop they share that is not a thread loop
     (the block's tile step), and nothing else writes S;
  3. coverage: wherever R ∧ ¬g holds, some thread's iteration of W writes the element read
     (∀ statement point ∃ copy point with w = r; W's thread and own loop variables renamed, since
     the copy is cooperative);
  4. zero: no iteration of W that writes that element has `fill` true (islpy: the set of
     statement points with R ∧ ¬g and copy points with w = r and `fill` is empty).
Then under ¬g both factors are +0.0, the product is +0.0, and `L[x] + 0.0 == L[x]` for every float
except -0.0, which a sum that starts at +0.0 never reaches under round-to-nearest (x + (-x) is
+0.0; -0.0 + -0.0 needs a -0.0 already): the statement is a no-op where g is false, so it may run
there. The result is bit-identical, and every element read was written (the emulator's
uninitialized-read check holds).

Run it after `compute_at` of the shared caches and before `double_buffer`, while each copy is
one statement (afterwards the tile is also written from the prefetch registers, and 2. does not
hold; nothing is dropped then). A conjunct that is not proved stays; a kernel where nothing is
proved is unchanged. Preconditions (ScheduleError otherwise): `stage` names a local buffer.
"""

from __future__ import annotations

import math

from ...ir import poly
from ...ir.errors import ScheduleError
from ...ir.expr import (
    Binary,
    BufferLoad,
    Cast,
    Compare,
    Const,
    Expr,
    Not,
    Select,
    Var,
    logical_and,
    substitute,
    walk,
)
from ...ir.stmt import (
    Allocate,
    Buffer,
    BufferStore,
    For,
    IfThenElse,
    PrimFunc,
    Seq,
    Stmt,
)
from .guard_writeback import conjuncts
from .loops import iter_with_path, loops_on_path, rewrite_guards


def _strip(e: Expr) -> Expr:
    while isinstance(e, Cast):
        e = e.a
    return e


def _factors(s: BufferStore, acc: Buffer) -> tuple[BufferLoad, BufferLoad] | None:
    """(S1[r1], S2[r2]) when `s` is `acc[x] = acc[x] + S1[r1] * S2[r2]` with S1, S2 shared."""
    v = s.value
    if not (isinstance(v, Binary) and v.op == "+"):
        return None
    for mine, other in ((v.a, v.b), (v.b, v.a)):
        mine, other = _strip(mine), _strip(other)
        if not (isinstance(mine, BufferLoad) and mine.buffer is acc and mine.indices == s.indices):
            continue
        if not (isinstance(other, Binary) and other.op == "*"):
            return None
        x, y = _strip(other.a), _strip(other.b)
        if all(isinstance(t, BufferLoad) and t.buffer.scope == "shared" for t in (x, y)):
            return x, y  # type: ignore[return-value]
    return None


def _guards(path: tuple[Stmt, ...], leaf: Stmt) -> list[Expr]:
    """The conditions that enclose `leaf` (an else branch contributes the negation)."""
    out: list[Expr] = []
    chain = path + (leaf,)
    for parent, child in zip(chain, chain[1:]):
        if isinstance(parent, IfThenElse):
            if child is parent.then_case:
                out += conjuncts(parent.cond)
            else:
                out.append(Not(parent.cond))
    return out


def _dims(loops: list[For]) -> list[poly.LoopDim]:
    return [poly.LoopDim(lp.var, lp.min, lp.extent, lp.kind) for lp in loops]


def _precedes(writer_path: tuple[Stmt, ...], writer: Stmt, path: tuple[Stmt, ...], leaf: Stmt) -> bool:
    """The writer comes first in the innermost statement sequence that holds both."""
    a, b = writer_path + (writer,), path + (leaf,)
    depth = 0
    while depth < min(len(a), len(b)) and a[depth] is b[depth]:
        depth += 1
    if depth == 0 or depth >= min(len(a), len(b)):
        return False
    parent = a[depth - 1]
    if not isinstance(parent, Seq):
        return False
    stmts = list(parent.stmts)
    return next(k for k, x in enumerate(stmts) if x is a[depth]) < next(k for k, x in enumerate(stmts) if x is b[depth])


class _Tail:
    """The proof obligations 1-4 of the module docstring for one accumulation statement."""

    def __init__(self, func: PrimFunc) -> None:
        self.writers: dict[int, list[tuple[BufferStore, tuple[Stmt, ...]]]] = {}
        for s, p in iter_with_path(func.body):
            if isinstance(s, BufferStore):
                self.writers.setdefault(id(s.buffer), []).append((s, p))

    def zero_past(self, g: Expr, rest: list[Expr], read: BufferLoad, stmt: BufferStore,
                  path: tuple[Stmt, ...]) -> bool:
        """`read` is +0.0 wherever `rest` holds and `g` does not (obligations 1-4)."""
        loops = loops_on_path(path)
        dims = _dims(loops)
        for i, extent in zip(read.indices, read.buffer.shape):
            if not (poly.proves(i >= 0, dims, rest) and poly.proves(i < extent, dims, rest)):
                return False
        writers = self.writers.get(id(read.buffer), [])
        if len(writers) != 1:
            return False  # after double_buffer the tile is also stored from registers
        w, wpath = writers[0]
        value = w.value
        if not (isinstance(value, Select) and isinstance(value.b, Const) and float(value.b.value) == 0.0
                and math.copysign(1.0, float(value.b.value)) > 0):
            return False
        if not _precedes(wpath, w, path, stmt):
            return False
        shared = {id(lp) for lp in loops}
        renamed: dict[Var, Expr] = {}
        inner: list[For] = []
        for lp in loops_on_path(wpath):
            if id(lp) in shared and not lp.is_thread:
                continue  # the same tile step (block, k-tile) as the statement
            if lp.kind not in ("serial", "unroll", "vectorize") and not lp.is_thread:
                return False
            renamed[lp.var] = Var(f"{lp.var.name}_w", lp.var.dtype)
            inner.append(lp)
        inner_dims = [poly.LoopDim(renamed[lp.var], substitute(lp.min, renamed), substitute(lp.extent, renamed),  # type: ignore[arg-type]
                                   lp.kind) for lp in inner]
        wguards = [substitute(c, renamed) for c in _guards(wpath, w)]
        same = [Compare("==", substitute(wi, renamed), ri) for wi, ri in zip(w.indices, read.indices)]
        context = rest + [Not(g)] if isinstance(g, Compare) else None
        if context is None:
            return False
        if not poly.covered(dims, context, inner_dims, wguards + same):
            return False
        fill = conjuncts(substitute(value.cond, renamed))
        return poly.is_empty(dims + inner_dims, context + wguards + same + fill)


def unguard_reduction_tail(func: PrimFunc, stage: str) -> PrimFunc:
    """Drop the guard conjuncts of local buffer `stage`'s accumulations under which both shared
    factors are provably zero (the k tail of a zero-filled tile pair)."""
    what = f"unguard_reduction_tail({stage!r})"
    alloc = next((s for s, _ in iter_with_path(func.body) if isinstance(s, Allocate)
                  and (s.buffer.tensor == stage or s.buffer.name == stage)), None)
    if alloc is None:
        raise ScheduleError(f"{what}: kernel {func.name} allocates no buffer for stage {stage!r}")
    acc = alloc.buffer
    if acc.scope != "local":
        raise ScheduleError(f"{what}: {acc.name} is in {acc.scope} memory; only a per-thread (local) "
                            "accumulator is updated by one thread, so only there is a no-op step harmless")
    tail = _Tail(func)
    drop: dict[int, Expr] = {}  # id(IfThenElse) -> its new condition
    for s, path in iter_with_path(func.body):
        if not isinstance(s, BufferStore) or s.buffer is not acc or not path:
            continue
        parent = path[-1]
        if not isinstance(parent, IfThenElse) or parent.then_case is not s or parent.else_case is not None:
            continue
        factors = _factors(s, acc)
        if factors is None or any(isinstance(n, BufferLoad) and n.buffer is acc and n.indices != s.indices
                                  for n in walk(s.value)):
            continue
        outer = _guards(path[:-1], parent)
        keep = conjuncts(parent.cond)
        for g in list(keep):
            rest = outer + [c for c in keep if c is not g]
            if all(tail.zero_past(g, rest, f, s, path) for f in factors):
                keep = [c for c in keep if c is not g]
        if len(keep) < len(conjuncts(parent.cond)):
            drop[id(parent)] = logical_and(*keep)
    if not drop:
        return func

    return rewrite_guards(func, drop)


__all__ = ["unguard_reduction_tail"]
