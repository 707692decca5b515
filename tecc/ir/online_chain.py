"""The online-softmax chain of a tensor-expression DAG, found by its algebra (never by name).

For every row r (any number of row axes) and a "key" axis j of extent N:

    m[r]    = max_j s(r, j)                              a stage whose body is that Reduce
    l[r]    = Σ_j exp(s(r, j) - m[r])                    the same s, the same extent N
    O[r, c] = g(Σ_j exp(s(r, j) - m[r]) · v(r, j, c), m[r], l[r], ..)

s is any expression of (r, j) (a contraction Σ_d Q·K times a scale, a plain read, a mask
`where(cond, s, -inf)`, a bias; grouped heads are index expressions), v is free of m and l.
O's contraction may also weigh v by P = exp(s - m) / l, and either weight may be dropped by a
mask drawn from tc.rand (`where(rand < p, 0, P / (1 - p))`, tecc.ir.online_dropout): the parts
then hold the canonical contraction Σ_j exp(s - m)·v, the output reads it times the dropout's
scale (and divided by l), and `dropout` holds the keep condition the kernels apply to the terms.
`find_chain` returns the chain's parts in canonical variables with every compute stage except the
two statistics inlined, or raises ScheduleError naming the condition that fails. Two users:
the forward rewrite (tecc.passes.rewrite.online_contraction: one kernel with a running max,
docs/attention.md) and the gradient (tecc.ir.autodiff_online: the FlashAttention-2 form of the
backward, docs/training.md). Both need the same facts, so the search is written once, here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from . import dtype as dt
from .errors import ScheduleError
from .expr import Binary, Call, Cast, Const, Expr, Reduce, TensorRead, Var, cast, const_int, substitute, walk
from .online_dropout import Dropout, dropped_weight, scale_const
from .tensor import ComputeOp, Tensor
from .visitor import ExprMutator, SubexpressionReplacer


@dataclass
class ChainParts:
    """A recognised chain, in canonical variables: `row` (m's axes), `key` (j) and `column` (c).
    `m_value` / `l_value` stand for the statistics' row values inside the expressions."""

    rows: tuple[Expr, ...]
    keys: Expr
    row: tuple[Var, ...]
    key: Var
    column: Var
    m: Tensor
    l: Tensor
    m_value: Var
    l_value: Var
    score: Expr                 # s(row, key), reads of inputs as TensorRead
    weight: Expr                # exp(s - m_value): the summand of l
    contraction: Reduce         # the output's Σ_j weight·v (its axis, acc type)
    value: Expr                 # v(row, key, column)
    output: Tensor              # the output of shape rows + (C,)
    output_body: Expr           # g, with the contraction as a Reduce node and column free
    columns: Expr
    row_outputs: tuple[tuple[Tensor, Expr], ...]  # outputs of shape rows (m, l, log-sum-exp ..; row_index)
    dropout: Dropout | None     # the contraction's weights dropped: Σ_j keep·weight·v (tecc.ir.online_dropout)


class ExpandStages(ExprMutator):
    """Inlines every compute stage except the statistics, whose reads at the row become their
    value variables; reads of placeholders stay TensorReads."""

    def __init__(self, stats: dict[Tensor, Var], row: tuple[Var, ...], outputs: set[int]) -> None:
        super().__init__()
        self.stats, self.row, self.outputs = stats, row, outputs

    def visit_TensorRead(self, e: TensorRead) -> Expr:  # noqa: N802
        idx = tuple(self.visit(i) for i in e.indices)
        t = e.tensor
        if t in self.stats:
            if len(idx) != len(self.row) or any(a is not b for a, b in zip(idx, self.row)):
                raise ScheduleError(
                    f"online_contraction: {t.name} is read at [{', '.join(map(str, idx))}], not at the row "
                    f"[{', '.join(map(str, self.row))}]; a row statistic must be read at its own row")
            return self.stats[t]
        if t.is_placeholder:
            return e if same_indices(idx, e.indices) else t[idx]
        if id(t) in self.outputs:
            raise ScheduleError(
                f"online_contraction: {t.name} is an output and is read by another stage; the one-pass "
                "kernel does not materialize intermediate stages (the scores included)")
        op = t.op
        assert isinstance(op, ComputeOp)
        return self.visit(substitute(op.body, dict(zip(op.axes, idx))))


def one_axis_reduce(t: Tensor, combiner: str) -> Reduce | None:
    """The body of `t` when it is a `combiner` reduction over one axis from 0, else None."""
    op = t.op
    if not isinstance(op, ComputeOp) or not isinstance(op.body, Reduce):
        return None
    r = op.body
    if r.combiner != combiner or len(r.axes) != 1 or const_int(r.axes[0].lo) != 0:
        return None
    return r


def same_indices(a: Sequence[Expr], b: Sequence[Expr]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def unit_tail(shape: Sequence[Expr], rows: Sequence[Expr]) -> bool:
    """Whether `shape` is `rows` followed by axes of extent 1 (a row output kept with a trailing
    unit axis, as cudnn's log-sum-exp [B, H, L, 1])."""
    n = len(rows)
    return len(shape) > n and same_indices(shape[:n], rows) and all(const_int(e) == 1 for e in shape[n:])


def row_index(t: Tensor, at: tuple[Expr, ...]) -> tuple[Expr, ...]:
    """The index of row output `t` at the row `at`: `at`, then 0 for each trailing unit axis."""
    return at + tuple(Const(0, dt.int32) for _ in t.shape[len(at):])


def find_chain(order: Sequence[Tensor], outputs: set[int]) -> ChainParts:
    """The chain among the compute stages `order` (producers first) whose outputs are the tensors
    with ids `outputs` (module docstring), or ScheduleError naming the failing condition."""
    maxima = [t for t in order if one_axis_reduce(t, "max") is not None]
    if not maxima:
        raise ScheduleError("online_contraction: no stage is a max over one axis (m = max_j s); "
                            "without the running max a sum of exp cannot be rescaled")
    why: list[str] = []
    for m in maxima:
        try:
            return _chain_of(order, m, outputs)
        except ScheduleError as exc:
            why.append(str(exc))
    raise ScheduleError(why[0] if len(why) == 1 else "; ".join(why))


def _chain_of(order: Sequence[Tensor], m: Tensor, outputs: set[int]) -> ChainParts:
    m_red = one_axis_reduce(m, "max")
    assert m_red is not None and isinstance(m.op, ComputeOp)
    if not m_red.acc_dtype.is_float:
        raise ScheduleError(f"online_contraction: {m.name} is a max of {m_red.acc_dtype}; exp needs a float")
    keys = m_red.axes[0].extent
    row = tuple(Var(f"r{i}", dt.int32) for i in range(len(m.shape)))
    key = Var("j", dt.int32)
    column = Var("c", dt.int32)
    m_value = Var(f"{m.name}_value", m.dtype, "value")
    rows = m.shape

    def expand(t: Tensor, stats: dict[Tensor, Var], body: Expr, idx: tuple[Expr, ...]) -> Expr:
        op = t.op
        assert isinstance(op, ComputeOp)
        return ExpandStages(stats, row, outputs).visit(substitute(body, dict(zip(op.axes, idx))))

    score = expand(m, {m: m_value}, substitute(m_red.source, {m_red.axes[0]: key}), row)
    if any(n is m_value for n in walk(score)):
        raise ScheduleError(f"online_contraction: the maximized value of {m.name} reads {m.name} itself")
    weight: Expr | None = None
    l: Tensor | None = None
    for t in order:
        r = one_axis_reduce(t, "sum")
        if r is None or t is m or not same_indices(t.shape, rows) or r.axes[0].extent is not keys:
            continue
        summand = expand(t, {m: m_value}, substitute(r.source, {r.axes[0]: key}), row)
        if (isinstance(summand, Call) and summand.name == "exp" and isinstance(summand.args[0], Binary)
                and summand.args[0].op == "-" and summand.args[0].a is score and summand.args[0].b is m_value):
            l, weight = t, summand
            break
    if l is None or weight is None:
        raise ScheduleError(
            f"online_contraction: no stage of shape [{', '.join(map(str, rows))}] sums exp(s - {m.name}) over the "
            f"axis of {m.name} with the s that {m.name} maximizes (a sum of exp without the max, or of exp(s - c) "
            "for another c, has no rescaling)")
    l_value = Var(f"{l.name}_value", l.dtype, "value")
    stats = {m: m_value, l: l_value}

    main: tuple[Tensor, Expr, Reduce, Expr, Expr, Dropout | None] | None = None
    row_outputs: list[tuple[Tensor, Expr]] = []
    for t in order:
        if id(t) not in outputs:
            continue
        op = t.op
        assert isinstance(op, ComputeOp)
        if t is m or t is l:
            row_outputs.append((t, m_value if t is m else l_value))
            continue
        if same_indices(t.shape, rows) or unit_tail(t.shape, rows):
            body = expand(t, stats, op.body, row_index(t, row))
            reduces = any(isinstance(n, Reduce) for n in walk(body))
            if reduces and same_indices(t.shape, rows):
                raise ScheduleError(f"online_contraction: row output {t.name} has a reduction of its own")
            if not reduces:   # a row output ([B, H, L, 1] too: cudnn's log-sum-exp)
                row_outputs.append((t, body))
                continue
        if len(t.shape) != len(rows) + 1 or not same_indices(t.shape[:-1], rows):
            raise ScheduleError(
                f"online_contraction: output {t.name} has shape [{', '.join(map(str, t.shape))}], neither the row "
                f"shape of {m.name} nor that plus one column axis")
        if main is not None:
            raise ScheduleError(f"online_contraction: two contraction outputs ({main[0].name}, {t.name}); one is "
                                "supported")
        body = expand(t, stats, op.body, row + (column,))
        found = _contraction_of(body, keys, key, weight, l_value, (m_value, l_value))
        if found is None:
            raise ScheduleError(
                f"online_contraction: output {t.name} does not contract exp(s - {m.name}) against a value over the "
                f"axis of {m.name} (Σ_j exp(s - {m.name})·v[.., j, c], or Σ_j P·v with P = exp(s - {m.name}) / "
                f"{l.name}, either under a dropout mask where(rand < p, 0, ·/(1 - p))); a contraction over another "
                "axis or of another summand is not rescaled by the running max")
        r, v, body, dropout = found
        if any(n is m_value or n is l_value for n in walk(v)) or any(isinstance(n, Reduce) for n in walk(v)):
            raise ScheduleError(f"online_contraction: the contracted value of {t.name} reads a statistic or holds a "
                                "reduction; only plain values rescale")
        if not r.acc_dtype.is_float:
            raise ScheduleError(f"online_contraction: {t.name} accumulates in {r.acc_dtype}; a float is needed")
        others = [n for n in walk(body) if isinstance(n, Reduce) and n is not r
                  and not any(n is q for q in walk(r))]
        if others:
            raise ScheduleError(f"online_contraction: output {t.name} has another reduction besides its contraction")
        main = (t, body, r, v, t.shape[-1], dropout)
    if main is None:
        raise ScheduleError(f"online_contraction: no output contracts exp(s - {m.name}) over the axis of {m.name}")
    t, body, r, v, columns, dropout = main
    return ChainParts(tuple(rows), keys, row, key, column, m, l, m_value, l_value, score, weight, r, v, t, body,
                      columns, tuple(row_outputs), dropout)


def _contraction_of(body: Expr, keys: Expr, key: Var, weight: Expr, l_value: Var, stats: tuple[Var, ...]
                    ) -> tuple[Reduce, Expr, Expr, Dropout | None] | None:
    """(the Reduce, v, the output body, the dropout) of the first Σ_j weight·v (either operand
    order, the weight cast or not) over the key extent in `body`. A weight under a dropout mask
    or divided by l (tecc.ir.online_dropout) is put in the canonical form: the Reduce becomes
    Σ_j weight·v (the mask left to the kernels: `dropout.keep`) and the body reads it times the
    dropout's scale, divided by l where the weight was."""
    for n in walk(body):
        if not (isinstance(n, Reduce) and n.combiner == "sum" and len(n.axes) == 1
                and n.axes[0].extent is keys and const_int(n.axes[0].lo) == 0):
            continue
        src = substitute(n.source, {n.axes[0]: key})
        if not (isinstance(src, Binary) and src.op == "*"):
            continue
        for p, v in ((src.a, src.b), (src.b, src.a)):
            if p is weight or (isinstance(p, Cast) and p.a is weight):
                return n, v, body, None
        for first, (p, v) in enumerate(((src.a, src.b), (src.b, src.a))):
            if any(x is weight for x in walk(v)):
                continue
            found = dropped_weight(p, weight, l_value, "online_contraction", stats)
            if found is None:
                continue
            w = weight if found.dtype == weight.dtype else cast(weight, found.dtype)
            canonical = Reduce("sum", substitute(w * v if first == 0 else v * w, {key: n.axes[0]}), n.axes)
            total: Expr = canonical
            if found.dropout is not None:
                total = total * scale_const(found.dropout, total.dtype)
            if found.normalized:
                total = total / (l_value if l_value.dtype == total.dtype else cast(l_value, total.dtype))
            return canonical, v, SubexpressionReplacer({n: total}).visit(body), found.dropout
    return None


__all__ = ["ChainParts", "ExpandStages", "find_chain", "one_axis_reduce", "same_indices"]
