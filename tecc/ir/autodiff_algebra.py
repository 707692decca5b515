"""Algebra the reverse mode uses to shape the backward program (tecc.ir.autodiff).

**Shift invariance.** Softmax, log-softmax, log-sum-exp and attention subtract a row maximum m
only to keep `exp` in range: the output does not change when m changes, so no gradient flows
through m, and a backward built without that fact computes m's adjoint (a reduction that is
zero up to rounding), the count of the elements tied at the maximum, and a masked scatter onto
them. `shift_invariant(stage, program, output)` proves the fact by structure: it evaluates the
program abstractly with m replaced by m + δ (δ one number per row of m) and asks whether the
output is unchanged. Each value of the program takes one of three forms in δ:

    INVARIANT        v
    SHIFT(a)         v + a·δ          (m itself is SHIFT(1); x - m is SHIFT(-1))
    SCALE(k)         v · exp(k·δ)     (exp(x - m) is SCALE(-1))

with the rules: + and - add SHIFTs and keep a common SCALE; * and / add and subtract SCALE
exponents and scale a SHIFT by a constant; exp turns SHIFT(a) into SCALE(a), log turns SCALE(k)
into SHIFT(k) (exp2 and log2 with ln 2); a sum or max over the columns keeps a SCALE (exp(k·δ)
does not depend on the column, and is positive), a max or min keeps a SHIFT; casts between
float types, comparisons of equal forms and selects of equal branches keep forms. Anything else
(sin of a SHIFT, a SHIFT times a variable, a read of m at another row) is unknown, and unknown
is not invariant. `δ` is per row: every read of a value that depends on m must index m's row
axes by the reader's own leading axes (a reduction over the rows mixes the rows' δ, and is
allowed only of invariant values, e.g. a mean of per-row losses).

**Saved values.** `replace_reads(tensors, mapping)` rebuilds a tensor DAG with reads of some
tensors replaced by reads of others (the forward's saved statistics replacing their
recomputation in the backward program).
"""

from __future__ import annotations

import math
from typing import Sequence, Union

from .expr import Binary, Call, Cast, Compare, Const, Expr, Reduce, Select, TensorRead, walk
from .tensor import ComputeOp, Tensor
from .visitor import ExprMutator

# A form: ("inv",), ("shift", a) or ("scale", k); None is unknown.
Form = Union[tuple[str], tuple[str, float]]
INVARIANT: Form = ("inv",)


def _shift(a: float) -> Form:
    return INVARIANT if a == 0 else ("shift", a)


def _scale(k: float) -> Form:
    return INVARIANT if k == 0 else ("scale", k)


def _amount(f: Form) -> float:
    return float(f[1]) if len(f) == 2 else 0.0


def shift_invariant(stage: Tensor, order: Sequence[Tensor], output: Tensor) -> bool:
    """Whether `output` is unchanged when `stage` (a per-row statistic) is shifted by any δ per
    row, every other input held fixed (module docstring). `order`: the program's tensors,
    producers first."""
    rank = len(stage.shape)
    forms: dict[int, Form] = {id(stage): ("shift", 1.0)}
    for t in order:
        if id(t) in forms or not isinstance(t.op, ComputeOp):
            continue
        op = t.op
        if not any(isinstance(n, TensorRead) and id(n.tensor) in forms for n in walk(op.body)):
            continue
        row = tuple(op.axes[:rank])
        if len(row) < rank or any(a.extent is not n for a, n in zip(row, stage.shape)):
            row = ()
        form = _FormOf(forms, row, rank).form(op.body)
        if form is None:
            return False
        forms[id(t)] = form
    return forms.get(id(output), INVARIANT) == INVARIANT


class _FormOf:
    """The form of an expression of one compute's body (module docstring)."""

    def __init__(self, forms: dict[int, Form], row: tuple[Expr, ...], rank: int) -> None:
        self.forms, self.row, self.rank = forms, row, rank

    def form(self, e: Expr) -> Form | None:
        if isinstance(e, TensorRead):
            found = self.forms.get(id(e.tensor))
            if found is None or found == INVARIANT:
                return INVARIANT
            # δ belongs to the row the read names: it must be the reader's own
            if not self.row or not all(a is b for a, b in zip(e.indices[:self.rank], self.row)):
                return None
            return found
        if not any(isinstance(n, TensorRead) and self.forms.get(id(n.tensor), INVARIANT) != INVARIANT
                   for n in walk(e)):
            return INVARIANT
        if isinstance(e, Binary):
            return self._binary(e)
        if isinstance(e, Call) and len(e.args) == 1:
            return self._call(e.name, self.form(e.args[0]))
        if isinstance(e, Cast):
            return self.form(e.a) if e.dtype.is_float and e.a.dtype.is_float else None
        if isinstance(e, Compare):
            a, b = self.form(e.a), self.form(e.b)
            return INVARIANT if a is not None and a == b and (a == INVARIANT or a[0] == "shift") else None
        if isinstance(e, Select):
            cond, a, b = self.form(e.cond), self.form(e.a), self.form(e.b)
            return a if cond == INVARIANT and a is not None and a == b else None
        if isinstance(e, Reduce):
            return self._reduce(e)
        return None

    def _binary(self, e: Binary) -> Form | None:
        a, b = self.form(e.a), self.form(e.b)
        if a is None or b is None:
            return None
        kinds = {a[0], b[0]}
        if e.op in ("+", "-"):
            sign = 1.0 if e.op == "+" else -1.0
            if kinds <= {"inv", "shift"}:
                return _shift(_amount(a) + sign * _amount(b))
            return a if a == b and a[0] == "scale" else None
        if e.op in ("*", "/"):
            if kinds <= {"inv", "scale"}:
                return _scale(_amount(a) + (1.0 if e.op == "*" else -1.0) * _amount(b))
            if a[0] == "shift" and isinstance(e.b, Const) and e.b.value != 0:
                c = float(e.b.value)
                return _shift(_amount(a) * (c if e.op == "*" else 1.0 / c))
            if b[0] == "shift" and e.op == "*" and isinstance(e.a, Const):
                return _shift(_amount(b) * float(e.a.value))
            return None
        if e.op in ("max", "min", "fmax", "fmin"):
            return a if a == b and a[0] != "scale" else None
        return None

    @staticmethod
    def _call(name: str, a: Form | None) -> Form | None:
        if a is None:
            return None
        if name == "exp" and a[0] != "scale":
            return _scale(_amount(a))
        if name == "exp2" and a[0] != "scale":
            return _scale(_amount(a) * math.log(2.0))
        if name == "log" and a[0] != "shift":
            return _shift(_amount(a))
        if name == "log2" and a[0] != "shift":
            return _shift(_amount(a) / math.log(2.0))
        return INVARIANT if a == INVARIANT else None

    def _reduce(self, e: Reduce) -> Form | None:
        if any(axis in self.row for axis in e.axes):
            return None
        source = self.form(e.source)
        if source is None:
            return None
        if e.combiner == "sum":
            return source if source[0] != "shift" else None
        if e.combiner in ("max", "min", "nanmax", "nanmin"):
            return source
        return None


def replace_reads(tensors: Sequence[Tensor], mapping: dict[int, Tensor]) -> list[Tensor]:
    """`tensors` rebuilt so that every read of a tensor whose id is in `mapping` reads its
    replacement instead, through every compute on the way (names and axes kept; a tensor that
    reads none of them is returned as it is)."""
    rebuilt: dict[int, Tensor] = dict(mapping)

    def visit(t: Tensor) -> Tensor:
        if id(t) in rebuilt:
            return rebuilt[id(t)]
        out = t
        if isinstance(t.op, ComputeOp):
            for read in {id(n.tensor): n.tensor for n in walk(t.op.body) if isinstance(n, TensorRead)}.values():
                visit(read)
            body = _Reads(rebuilt).visit(t.op.body)
            if body is not t.op.body:
                out = Tensor(ComputeOp(t.op.name, t.op.axes, body), t.shape, t.dtype)
        rebuilt[id(t)] = out
        return out

    return [visit(t) for t in tensors]


class _Reads(ExprMutator):
    def __init__(self, rebuilt: dict[int, Tensor]) -> None:
        super().__init__()
        self.rebuilt = rebuilt

    def visit_TensorRead(self, e: TensorRead) -> Expr:
        idx = tuple(self.visit(i) for i in e.indices)
        target = self.rebuilt.get(id(e.tensor), e.tensor)
        if target is e.tensor and all(a is b for a, b in zip(idx, e.indices)):
            return e
        return TensorRead(target, idx)


__all__ = ["INVARIANT", "replace_reads", "shift_invariant"]
