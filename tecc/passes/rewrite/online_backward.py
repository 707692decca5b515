"""The backward of the online contraction, found by its structure: the program that tc.grad
writes for an online-softmax chain (tecc.ir.autodiff_online, the FlashAttention-2 form), or any
program of the same algebra, as tiles of (query rows × keys) that never leave registers.

What is recognised. A stage P[r, j] = exp(s(r, j) - L[r]) (the probabilities recomputed from a
row statistic L: the saved log-sum-exp), s holding a contraction Σ_d Q[.., i, d]·K[.., j, d], and
outputs that are each, once every stage but the row statistics (Δ) is inlined, one of

    key side   T[kv.., j, o] = g(Σ_{groups, i} w(R, j) · X[.., i, o])   dK (X = Q), dV (X = dO)
    row side   T[r.., o]     = g(Σ_j w(r, j) · Y[.., j, o])             dQ (Y = K)
    tile       T[r.., j]     = g(w(r, j))                                an additive bias's gradient

where w is any elementwise expression of the tile's row-key contractions (the score's Σ_d Q·K,
dP's Σ_c dO·V: each Σ_x A[.., i, x]·B[.., j, x] of two 16-bit inputs), of the row statistics
read at the row (Δ, lse), of masks and of inputs, and R the forward row of the key-side
output's block and loop variables (with grouped heads, R = (b, kv·G + g, i): the G query heads
of a K/V head). The row and key of each output are found by unifying the score's contraction
(a pattern in the canonical row and key) with the contractions in its w (`unify`), so nothing
depends on names or on the order in which tc.grad built the program.

Everything is rewritten into the kernel's variables: the block's leading index (`lead`: the
key-side outputs' leading axes, the K/V head), the `groups` loops (the query heads sharing it),
the `query` row and the `key`. `backward_chain` returns that, or ScheduleError naming the
condition that fails; the kernels are tecc.passes.rewrite.online_backward_mma's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ...ir import dtype as dt
from ...ir.errors import ScheduleError
from ...ir.expr import (
    Binary,
    Call,
    Cast,
    Const,
    Expr,
    IterVar,
    Reduce,
    Select,
    TensorRead,
    Var,
    compare,
    const_int,
    free_vars,
    substitute,
    walk,
)
from ...ir.online_chain import same_indices
from ...ir.poly import LoopDim, proves
from ...ir.tensor import ComputeOp, Tensor
from ...ir.visitor import ExprMutator
from ..lower import Program, collect_program

WHERE = "online_backward"
HALF = (dt.float16, dt.bfloat16)


@dataclass(frozen=True)
class Contraction:
    """A row-key contraction of the tile, Σ_x A[.., query, x]·B[.., key, x], in kernel variables."""

    node: Reduce
    row_operand: TensorRead     # A: staged per query block
    key_operand: TensorRead     # B: staged once per block
    depth: int                  # the extent of x


@dataclass(frozen=True)
class GradOutput:
    """One output of the backward program (module docstring), in kernel variables."""

    tensor: Tensor
    kind: str                   # "key", "row" or "tile"
    weight: Expr                # w at (row_at, key)
    operand: TensorRead | None  # key side: X[.., query, column]; row side: Y[.., key, column]
    columns: int                # the extent of o (1 for a tile output)
    axes: tuple[Var, ...]       # T's own axes
    epilogue: Expr              # T's element at its `axes` from `acc` (its contraction's value, or w)
    acc: Var
    index: tuple[Expr, ...]     # T's axes in kernel variables: (lead.., key, column), row_at + (column,),
                                # row_at + (key,)


@dataclass
class BackwardChain:
    program: Program
    rows: tuple[Expr, ...]              # the forward's rows: leading axes, then the queries
    keys: Expr
    lead: tuple[Var, ...]               # the block's leading index (blockIdx.y, flattened)
    lead_extents: tuple[Expr, ...]
    groups: tuple[Var, ...]             # loops over the query heads of one block's K/V
    group_extents: tuple[int, ...]
    query: Var
    key: Var
    column: Var
    row_at: tuple[Expr, ...]            # the forward row of (lead, groups, query)
    probs: Expr                         # P at (row_at, key)
    score: Expr                         # s at (row_at, key)
    contractions: tuple[Contraction, ...]
    outputs: tuple[GradOutput, ...]
    statistics: tuple[Tensor, ...]      # the row statistics the weights read (computed first)

    def of_kind(self, kind: str) -> list[GradOutput]:
        return [o for o in self.outputs if o.kind == kind]


class _Inline(ExprMutator):
    """Inlines every compute stage except `keep` (the row statistics)."""

    def __init__(self, keep: set[int]) -> None:
        super().__init__()
        self.keep = keep

    def visit_TensorRead(self, e: TensorRead) -> Expr:  # noqa: N802
        idx = tuple(self.visit(i) for i in e.indices)
        t = e.tensor
        if t.is_placeholder or id(t) in self.keep:
            return e if same_indices(idx, e.indices) else t[idx]
        op = t.op
        assert isinstance(op, ComputeOp)
        return self.visit(substitute(op.body, dict(zip(op.axes, idx))))


def unify(pattern: Expr, concrete: Expr, holes: set[Var], binding: dict[Var, Expr]) -> bool:
    """Whether `concrete` is `pattern` with each hole replaced by one expression (bound in
    `binding`, which this extends). Hash-consed nodes: equal fields mean an equal node."""
    if isinstance(pattern, Var) and pattern in holes:
        seen = binding.get(pattern)
        if seen is None:
            binding[pattern] = concrete
            return True
        return seen is concrete
    if pattern is concrete:
        return True
    if type(pattern) is not type(concrete) or isinstance(pattern, (Var, Const)):
        return False
    for field in pattern._fields:
        a, b = getattr(pattern, field), getattr(concrete, field)
        if isinstance(a, Expr) and isinstance(b, Expr):
            if not unify(a, b, holes, binding):
                return False
        elif isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b):
            for x, y in zip(a, b):
                if isinstance(x, Expr) and isinstance(y, Expr):
                    if not unify(x, y, holes, binding):
                        return False
                elif x is not y and x != y:
                    return False
        elif a is not b and a != b:
            return False
    return True


def _strip_casts(e: Expr) -> Expr:
    while isinstance(e, Cast) and e.dtype.is_float and e.a.dtype.is_float:
        e = e.a
    return e


def _half_read(e: Expr) -> TensorRead | None:
    e = _strip_casts(e)
    if isinstance(e, TensorRead) and e.tensor.is_placeholder and e.dtype in HALF:
        return e
    return None


def _probabilities(prog: Program) -> tuple[Tensor, Expr, Expr]:
    """(P, s, L) for the first stage whose body is exp(s - L) with L free of its last axis (the
    key) and s holding a contraction that reads the key."""
    for t in prog.order:
        op = t.op
        assert isinstance(op, ComputeOp)
        body = op.body
        if not (isinstance(body, Call) and body.name == "exp" and isinstance(body.args[0], Binary)
                and body.args[0].op == "-" and len(t.shape) >= 2):
            continue
        s, lse = body.args[0].a, body.args[0].b
        key = op.axes[-1]
        if any(v is key for v in free_vars(lse)) or not any(v is key for v in free_vars(s)):
            continue
        if any(isinstance(n, Reduce) for n in walk(s)):
            return t, s, lse
    raise ScheduleError(f"{WHERE}: no stage is exp(s(r, j) - L[r]) with s a contraction over the key j (the "
                        "probabilities recomputed from a saved log-sum-exp): not the backward of an online contraction")


def _factor(source: Expr, column: Var) -> tuple[Expr, TensorRead, Expr | None] | None:
    """(w, X, guard) for a contraction summand `w·X` or `select(guard, w·X, 0)`: X a 16-bit input
    read (a cast allowed) whose last index is `column`, w free of it."""
    guard = None
    if isinstance(source, Select) and isinstance(source.b, Const) and float(source.b.value) == 0.0:
        guard, source = source.cond, source.a
    if not (isinstance(source, Binary) and source.op == "*"):
        return None
    for x, w in ((source.a, source.b), (source.b, source.a)):
        read = _half_read(x)
        if read is not None and read.indices[-1] is column and not any(v is column for v in free_vars(w)):
            return w, read, guard
    return None


def backward_chain(args: Sequence[Tensor]) -> BackwardChain:
    """The backward program `args` in kernel variables (module docstring), or ScheduleError."""
    prog = collect_program(args)
    probs_t, _, _ = _probabilities(prog)
    assert isinstance(probs_t.op, ComputeOp)
    rows, keys = tuple(probs_t.shape[:-1]), probs_t.shape[-1]
    outputs = [a for a in args if not a.is_placeholder]
    stats = [t for t in prog.order if same_indices(t.shape, rows) and t not in outputs
             and isinstance(t.op, ComputeOp) and any(isinstance(n, Reduce) for n in walk(t.op.body))]
    keep = {id(t) for t in stats}
    row = tuple(Var(f"r{n}", dt.int32) for n in range(len(rows)))
    key = Var("key", dt.int32)
    holes = set(row) | {key}
    probs = _Inline(keep).visit(substitute(probs_t.op.body, dict(zip(probs_t.op.axes, row + (key,)))))
    pattern = _score_contraction(probs)

    found = [_classify(t, keep, pattern, holes, row, key, rows, keys) for t in outputs]
    shape = _Shape.of(found, row, key, rows)
    outs = tuple(shape.output(f) for f in found)
    probs_k = shape.at(probs, key)
    contractions = _contractions([o.weight for o in outs] + [probs_k], shape, rows, keys)
    for t in stats:
        _check_statistic(t, rows)
    score = shape.at(_score_of(probs), key)
    return BackwardChain(prog, rows, keys, shape.lead, shape.lead_extents, shape.groups, shape.group_extents,
                         shape.query, key, shape.column, shape.row_at, probs_k, score, contractions, outs,
                         tuple(stats))


def _score_of(probs: Expr) -> Expr:
    assert isinstance(probs, Call) and isinstance(probs.args[0], Binary)
    return probs.args[0].a


def _score_contraction(probs: Expr) -> Reduce:
    reduces = list({id(n): n for n in walk(_score_of(probs)) if isinstance(n, Reduce)}.values())
    if len(reduces) != 1:
        raise ScheduleError(f"{WHERE}: the recomputed scores hold {len(reduces)} contractions; one Σ_d Q·K is needed")
    (red,) = reduces
    assert isinstance(red, Reduce)
    return red


@dataclass(frozen=True)
class _Found:
    """An output before it is put in kernel variables: its own axes, reductions and binding."""

    tensor: Tensor
    kind: str
    weight: Expr
    operand: TensorRead | None
    epilogue: Expr
    acc: Var
    binding: dict[Var, Expr]     # canonical row and key -> expressions of the output's axes
    reduce_axes: tuple[Var, ...]


def _classify(t: Tensor, keep: set[int], pattern: Reduce, holes: set[Var], row: tuple[Var, ...], key: Var,
              rows: tuple[Expr, ...], keys: Expr) -> _Found:
    op = t.op
    assert isinstance(op, ComputeOp)
    body = _Inline(keep).visit(op.body)
    top = _strip_casts(body)
    acc = Var(f"{t.name}_acc", dt.float32, "value")
    column = op.axes[-1]
    reduce_axes: tuple[Var, ...] = ()
    operand = None
    if isinstance(top, Reduce) and top.combiner == "sum":
        factored = _factor(top.source, column)
        if factored is None:
            raise ScheduleError(f"{WHERE}: output {t.name} sums {top.source}, not w·X with X a float16/bfloat16 input "
                                f"read at its column {column.name}")
        weight, operand, guard = factored
        if guard is not None:
            weight = Select(guard, weight, Const(0.0, weight.dtype))
        reduce_axes = tuple(top.axes)
        epilogue = _replace(body, top, acc)
    else:
        weight, epilogue = top, _replace(body, top, acc)
    binding: dict[Var, Expr] = {}
    if not any(isinstance(n, Reduce) and unify(pattern, n, holes, binding) for n in walk(weight)):
        raise ScheduleError(f"{WHERE}: output {t.name} does not read the recomputed scores' contraction {pattern} at "
                            "any row and key")
    axes = tuple(op.axes)
    kind = _side(t, binding, row, key, axes, reduce_axes, operand, rows, keys)
    return _Found(t, kind, weight, operand, epilogue, acc, binding, reduce_axes)


def _replace(body: Expr, node: Expr, value: Expr) -> Expr:
    class _One(ExprMutator):
        def visit(self, e: Expr) -> Expr:
            return value if e is node else super().visit(e)
    return _One().visit(body)


def _side(t: Tensor, binding: dict[Var, Expr], row: tuple[Var, ...], key: Var, axes: tuple[Var, ...],
          reduce_axes: tuple[Var, ...], operand: TensorRead | None, rows: tuple[Expr, ...], keys: Expr) -> str:
    """"key", "row" or "tile": where the output's axes sit in the binding (module docstring)."""
    r = tuple(binding[v] for v in row)
    j = binding[key]
    name = t.name
    if operand is None:
        if same_indices(r + (j,), axes) and same_indices(t.shape, rows + (keys,)):
            return "tile"
        raise ScheduleError(f"{WHERE}: output {name} has no contraction and is not indexed by the (row, key) of the "
                            "scores (a bias's gradient summed over heads or rows is not a tile output)")
    if same_indices(r, axes[:-1]) and len(reduce_axes) == 1 and j is reduce_axes[0]:
        if operand.indices[-2] is not j:
            raise ScheduleError(f"{WHERE}: output {name} contracts over the keys against {operand}, which is not read "
                                "at the key")
        return "row"
    if j is axes[-2] and r and any(r[-1] is a for a in reduce_axes):
        if operand.indices[-2] is not r[-1]:
            raise ScheduleError(f"{WHERE}: output {name} sums over the query rows against {operand}, which is not read "
                                "at the query")
        return "key"
    raise ScheduleError(f"{WHERE}: output {name} is neither a sum over the keys at its own row (dQ), nor a sum over "
                        "the query rows at its own key (dK, dV), nor a tile of the scores (dBias)")


class _Shape:
    """The kernel's variables (module docstring) and each output in them."""

    def __init__(self, lead: tuple[Var, ...], lead_extents: tuple[Expr, ...], groups: tuple[Var, ...],
                 group_extents: tuple[int, ...], query: Var, row_at: tuple[Expr, ...], row: tuple[Var, ...],
                 key: Var) -> None:
        self.lead, self.lead_extents, self.groups, self.group_extents = lead, lead_extents, groups, group_extents
        self.query, self.row_at, self.row, self.key = query, row_at, row, key
        self.column = Var("column", dt.int32)

    @staticmethod
    def of(found: Sequence[_Found], row: tuple[Var, ...], key: Var, rows: tuple[Expr, ...]) -> "_Shape":
        """From the first key-side output (its leading axes, group and query reductions), else the
        forward rows themselves (one block per head, no groups)."""
        query = Var("query", dt.int32)
        ref = next((f for f in found if f.kind == "key"), None)
        if ref is None:
            lead = tuple(Var(f"lead{n}", dt.int32) for n in range(len(rows) - 1))
            return _Shape(lead, rows[:-1], (), (), query, lead + (query,), row, key)
        op = ref.tensor.op
        assert isinstance(op, ComputeOp)
        r = tuple(ref.binding[v] for v in row)
        q_axis = r[-1]
        groups_of = [a for a in ref.reduce_axes if a is not q_axis]
        extents = []
        for g in groups_of:
            n = const_int(g.extent) if isinstance(g, IterVar) else None
            if n is None or (isinstance(g, IterVar) and const_int(g.lo) != 0):
                raise ScheduleError(f"{WHERE}: output {ref.tensor.name} sums over {g.name}, whose range is not a constant "
                                    "from 0 (the query heads of one K/V head)")
            extents.append(n)
        lead = tuple(Var(f"lead{n}", dt.int32) for n in range(len(op.axes) - 2))
        groups = tuple(Var(f"group{n}", dt.int32) for n in range(len(groups_of)))
        rename: dict[Var, Expr] = {**dict(zip(op.axes[:-2], lead)), **dict(zip(groups_of, groups)), q_axis: query}
        row_at = tuple(substitute(e, rename) for e in r)
        return _Shape(lead, tuple(ref.tensor.shape[:-2]), groups, tuple(extents), query, row_at, row, key)

    def at(self, e: Expr, key: Var) -> Expr:
        """A canonical (row, key) expression at the kernel's row and key."""
        return substitute(e, {**dict(zip(self.row, self.row_at)), key: self.key})

    def output(self, f: _Found) -> GradOutput:
        op = f.tensor.op
        assert isinstance(op, ComputeOp)
        axes = tuple(op.axes)
        r = tuple(f.binding[v] for v in self.row)
        j = f.binding[self.key]
        if f.kind == "key":
            q_axis = r[-1]
            groups_of = [a for a in f.reduce_axes if a is not q_axis]
            if len(groups_of) != len(self.groups) or len(axes) - 2 != len(self.lead):
                raise ScheduleError(f"{WHERE}: the key-side outputs sum over different query heads")
            rename: dict[Var, Expr] = {**dict(zip(axes[:-2], self.lead)), **dict(zip(groups_of, self.groups)),
                                       q_axis: self.query, axes[-2]: self.key, axes[-1]: self.column}
            if not same_indices(tuple(substitute(e, rename) for e in r), self.row_at):
                raise ScheduleError(f"{WHERE}: output {f.tensor.name} reaches the forward rows differently from the other "
                                    "key-side outputs (another grouping of the query heads)")
            index: tuple[Expr, ...] = self.lead + (self.key, self.column)
        else:
            rename = dict(zip(axes[:len(r)], self.row_at))
            if f.kind == "row":
                assert isinstance(j, Var)
                rename[j] = self.key
                rename[axes[-1]] = self.column
                index = self.row_at + (self.column,)
            else:
                rename[axes[-1]] = self.key
                index = self.row_at + (self.key,)
        weight = substitute(f.weight, rename)
        operand = substitute(f.operand, rename) if f.operand is not None else None
        assert operand is None or isinstance(operand, TensorRead)
        columns = 1 if f.operand is None else const_int(f.tensor.shape[-1])
        if columns is None:
            raise ScheduleError(f"{WHERE}: output {f.tensor.name}'s last extent {f.tensor.shape[-1]} is symbolic; the "
                                "tensor-core form needs a constant")
        return GradOutput(f.tensor, f.kind, weight, operand, columns, axes, f.epilogue, f.acc, index)


def _contractions(values: Sequence[Expr], shape: _Shape, rows: tuple[Expr, ...], keys: Expr
                  ) -> tuple[Contraction, ...]:
    """Every contraction in the weights, each a row-key contraction of two 16-bit inputs."""
    found: dict[int, Contraction] = {}
    for value in values:
        for n in walk(value):
            if not isinstance(n, Reduce) or id(n) in found:
                continue
            found[id(n)] = _row_key(n, shape)
    if not found:
        raise ScheduleError(f"{WHERE}: the weights hold no contraction")
    return tuple(found.values())


def _row_key(n: Reduce, shape: _Shape) -> Contraction:
    if n.combiner != "sum" or len(n.axes) != 1 or const_int(n.axes[0].lo) != 0:
        raise ScheduleError(f"{WHERE}: {n} is not one sum over an axis from 0")
    if n.acc_dtype != dt.float32:
        raise ScheduleError(f"{WHERE}: {n} accumulates in {n.acc_dtype}; mma accumulates in float32")
    x = n.axes[0]
    src = _strip_casts(n.source) if isinstance(n.source, Cast) else n.source
    if not (isinstance(src, Binary) and src.op == "*"):
        raise ScheduleError(f"{WHERE}: the summand of {n} is not a product of two reads")
    a, b = _half_read(src.a), _half_read(src.b)
    if a is None or b is None:
        raise ScheduleError(f"{WHERE}: {n} multiplies {src.a} and {src.b}; the tensor-core form needs two "
                            "float16/bfloat16 input reads (float32 operands stay on the generic kernels)")
    reads = {}
    for r in (a, b):
        if len(r.indices) < 2 or r.indices[-1] is not x:
            raise ScheduleError(f"{WHERE}: {r} is not read at [.., row, {x.name}] (a tile of whole rows)")
        if r.indices[-2] is shape.query:
            reads["row"] = r
        elif r.indices[-2] is shape.key:
            reads["key"] = r
    if set(reads) != {"row", "key"}:
        raise ScheduleError(f"{WHERE}: {n} is not Σ_x A[.., query, x]·B[.., key, x] (one read at the query row, "
                            "one at the key)")
    if a.dtype != b.dtype:
        raise ScheduleError(f"{WHERE}: {n} multiplies {a.dtype} by {b.dtype}; mma needs one dtype")
    depth = const_int(x.extent)
    if depth is None or depth not in (16, 32, 64, 128):
        raise ScheduleError(f"{WHERE}: {n} contracts over {x.extent}; the tensor-core form takes 16, 32, 64 or 128")
    key_read = reads["key"]
    _check_block_invariant(key_read, shape)
    return Contraction(n, reads["row"], key_read, depth)


def _check_block_invariant(read: TensorRead, shape: _Shape) -> None:
    """A key operand is staged once per block: its leading indices must not change with the
    groups (isl: lead(groups) = lead(0) for every group)."""
    lead = read.indices[:-2]
    if not shape.groups:
        if any(v in (shape.query,) for e in lead for v in free_vars(e)):
            raise ScheduleError(f"{WHERE}: {read} is read at leading indices that change with the query")
        return
    zero = {g: Const(0, dt.int32) for g in shape.groups}
    loops = [LoopDim(g, Const(0, dt.int32), Const(n, dt.int32), "serial") for g, n in zip(shape.groups, shape.group_extents)]
    loops += [LoopDim(v, Const(0, dt.int32), n, "serial") for v, n in zip(shape.lead, shape.lead_extents)]
    for e in lead:
        if any(v is shape.query for v in free_vars(e)):
            raise ScheduleError(f"{WHERE}: {read} is read at leading indices that change with the query")
        if any(v in shape.groups for v in free_vars(e)) and not proves(compare("==", e, substitute(e, zero)), loops):
            raise ScheduleError(f"{WHERE}: {read}'s leading index {e} changes with the query heads of one block "
                                "(isl could not prove it constant over them)")


def _check_statistic(t: Tensor, rows: tuple[Expr, ...]) -> None:
    """A row statistic (Δ) is one sum over an axis of constant extent, computed by the pre-pass."""
    op = t.op
    assert isinstance(op, ComputeOp)
    reduces = [n for n in walk(op.body) if isinstance(n, Reduce)]
    if len(reduces) != 1 or len(reduces[0].axes) != 1 or reduces[0].combiner != "sum":
        raise ScheduleError(f"{WHERE}: the row statistic {t.name} is not one sum over one axis")
    inner = [n for n in walk(reduces[0].source) if isinstance(n, TensorRead) and not n.tensor.is_placeholder]
    if inner:
        raise ScheduleError(f"{WHERE}: the row statistic {t.name} reads the stage {inner[0].tensor.name}; the pre-pass "
                            "reads inputs only")


__all__ = ["BackwardChain", "Contraction", "GradOutput", "backward_chain", "unify"]
