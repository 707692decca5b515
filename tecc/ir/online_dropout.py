"""Dropout on the weights of an online-softmax contraction, found by structure (never by name).

The chain of tecc.ir.online_chain contracts the weights w = exp(s - m) against a value:
O = g(Σ_j w·v, m, l). Attention with dropout writes the contraction's weight as dropout of the
probabilities P = w / l (or of w itself, divided by l afterwards):

    O[r, c] = Σ_j where(rand[r, j] < p, 0, P[r, j] / (1 - p)) · v(r, j, c)
            = Σ_j keep(r, j)·w·v / l · 1/(1 - p)          keep = !(rand < p)

`dropped_weight` reads the weight side of the contraction's product and, when it is w under
such factors, returns them: the keep condition (a conjunction of the `where`s' conditions,
negated where the zero is the taken branch), the constant scale (the product of the constant
factors and divisors: 1/(1 - p)), whether w was divided by l, and the dtype the weight was cast
to. Accepted factors, in any nesting and order: `where(cond, 0, x)`, `where(cond, x, 0)`,
`x · mask` with mask = `where(cond, 0, c)`, `where(cond, c, 0)` or `cast(cond, float)`,
`x / c` and `x · c` (c a float constant), `x / l` (once), and float casts.

A condition must be a predicate of (r, j) drawn from `tc.rand` (a RandomUniform node inside it)
that reads no tensor outside the random node's seed and offset, no reduction, and neither row
statistic: the kernels regenerate it from (seed, offset, the element's linear index) at any
(r, j) of a tile (padding rows and keys included, where a tensor read could fall outside its
buffer), and the backward regenerates the same mask. Anything else raises ScheduleError naming
the condition that fails.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import dtype as dt
from .dtype import DType
from .errors import ScheduleError
from .expr import Binary, Cast, Const, Expr, Reduce, Select, TensorRead, Var, walk
from .philox import RandomUniform


@dataclass(frozen=True)
class Dropout:
    """The mask of the contraction's weights: kept where `keep` (a bool of the row and key
    variables) holds, each kept weight times `scale`."""

    keep: Expr
    scale: float


@dataclass(frozen=True)
class DroppedWeight:
    """What `dropped_weight` found around the weight w."""

    dropout: Dropout | None
    normalized: bool          # w / l
    dtype: DType              # the weight side's dtype (w cast to it)


def _float_const(e: Expr) -> float | None:
    if isinstance(e, Cast) and e.dtype.is_float:
        e = e.a
    if isinstance(e, Const) and (e.dtype.is_float or e.dtype.is_int) and not e.dtype.is_bool:
        return float(e.value)
    return None


def _is_zero(e: Expr) -> bool:
    return _float_const(e) == 0.0


def _reads(e: Expr, node: Expr) -> bool:
    return any(n is node for n in walk(e))


def check_mask_condition(cond: Expr, where: str, stats: tuple[Var, ...]) -> None:
    """ScheduleError unless `cond` is a predicate drawn from tc.rand that the kernels can
    regenerate at any element (module docstring)."""
    randoms = [n for n in walk(cond) if isinstance(n, RandomUniform)]
    if not randoms:
        raise ScheduleError(f"{where}: the weights are masked by {cond}, which draws no tc.rand; a mask on the "
                            "probabilities is recognised as dropout only when drawn from tc.rand (a mask on the "
                            "scores is a where(cond, s, -inf))")
    if any(_reads(cond, s) for s in stats):
        raise ScheduleError(f"{where}: the dropout condition {cond} reads a row statistic; it must be a predicate of "
                            "the row and key only")
    if any(isinstance(n, Reduce) for n in walk(cond)):
        raise ScheduleError(f"{where}: the dropout condition {cond} holds a reduction")
    inside = {id(n) for r in randoms for n in walk(r)}
    outside = [n for n in walk(cond) if isinstance(n, TensorRead) and id(n) not in inside]
    if outside:
        raise ScheduleError(f"{where}: the dropout condition {cond} reads {outside[0].tensor.name} besides tc.rand; "
                            "the kernels regenerate the mask at padding rows and keys too, where a read could leave "
                            "its buffer")


def dropped_weight(x: Expr, weight: Expr, l_value: Var, where: str, stats: tuple[Var, ...]) -> DroppedWeight | None:
    """The dropout, normalization and cast around `weight` in the weight side `x` of the
    contraction's product (module docstring), or None when x is not w under such factors;
    ScheduleError when a mask's condition is not one the kernels can regenerate."""
    keeps: list[Expr] = []
    scale = [1.0]
    normalized = [0]

    def keep_mask(e: Expr) -> tuple[Expr, float] | None:
        if isinstance(e, Cast) and e.dtype.is_float and e.a.dtype.is_bool:
            return e.a, 1.0
        if isinstance(e, Cast) and e.dtype.is_float and e.a.dtype.is_float:
            return keep_mask(e.a)
        if isinstance(e, Select):
            if _is_zero(e.a) and _float_const(e.b) is not None:
                return ~e.cond, float(_float_const(e.b))  # type: ignore[arg-type]
            if _is_zero(e.b) and _float_const(e.a) is not None:
                return e.cond, float(_float_const(e.a))  # type: ignore[arg-type]
        return None

    def walk_weight(e: Expr) -> bool:
        if e is weight:
            return True
        if isinstance(e, Cast) and e.dtype.is_float and e.a.dtype.is_float:
            return walk_weight(e.a)
        if isinstance(e, Binary) and e.op == "/":
            if e.b is l_value and normalized[0] == 0:
                normalized[0] = 1
                return walk_weight(e.a)
            c = _float_const(e.b)
            if c is not None and c != 0.0:
                scale[0] /= c
                return walk_weight(e.a)
            return False
        if isinstance(e, Binary) and e.op == "*":
            for a, b in ((e.a, e.b), (e.b, e.a)):
                if _reads(a, weight):
                    continue
                c = _float_const(a)
                if c is not None:
                    scale[0] *= c
                    return walk_weight(b)
                mask = keep_mask(a)
                if mask is not None:
                    check_mask_condition(mask[0], where, stats)
                    keeps.append(mask[0])
                    scale[0] *= mask[1]
                    return walk_weight(b)
            return False
        if isinstance(e, Select):
            for zero, other, keep in ((e.a, e.b, ~e.cond), (e.b, e.a, e.cond)):
                if _is_zero(zero) and _reads(other, weight) and not _reads(e.cond, weight):
                    check_mask_condition(e.cond, where, stats)
                    keeps.append(keep)
                    return walk_weight(other)
        return False

    if not walk_weight(x):
        return None
    if not keeps and scale[0] != 1.0:
        return None   # a constant factor alone: not dropout (the output expression may scale instead)
    keep: Expr | None = None
    for k in keeps:
        keep = k if keep is None else keep & k
    drop = None if keep is None else Dropout(keep, scale[0])
    return DroppedWeight(drop, bool(normalized[0]), x.dtype)


def scale_const(d: Dropout, dtype: DType) -> Expr:
    """The dropout's scale as a constant of `dtype`."""
    return Const(d.scale, dtype if dtype.is_float else dt.float32)


__all__ = ["DroppedWeight", "Dropout", "check_mask_condition", "dropped_weight", "scale_const"]
