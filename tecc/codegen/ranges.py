"""Integer interval analysis for the CUDA emitter.

The emitter asks two questions of integer expressions, and both are answered with intervals:
- Is this operand of `//` or `%` provably non-negative? Then C's truncating `/` and `%` agree
  with tecc's floor semantics and the emitter writes the plain operator.
- Is this offset provably a multiple of the vector width? Then a contiguous vectorized access
  may become one float4/float2 access (see `divisible_by`).

An interval is `(lo, hi)` with `None` for an unknown bound. The facts come from the IR itself:
constants, loop variables (`For(var, min, extent)` spans `[min, min + extent - 1]`), `LetStmt`
bindings, and size variables (kind 'size', a tensor dimension, so >= 0). Stride variables may be
negative (reversed views), and values loaded from memory are unknown.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from tecc.ir.expr import OPAQUE_INTRINSICS, Binary, BufferLoad, Call, Cast, Const, Expr, Select, Var

Bound = Optional[int]
Interval = tuple[Bound, Bound]
UNKNOWN: Interval = (None, None)


def _add(a: Bound, b: Bound) -> Bound:
    return None if a is None or b is None else a + b


def _mul_interval(x: Interval, y: Interval) -> Interval:
    """Product of two intervals; an unknown bound on either side leaves the result open
    unless both operands are known non-negative (then the low bound is the product of lows)."""
    if None not in x and None not in y:
        corners = [x[0] * y[0], x[0] * y[1], x[1] * y[0], x[1] * y[1]]  # type: ignore[operator]
        return min(corners), max(corners)
    if x[0] is not None and y[0] is not None and x[0] >= 0 and y[0] >= 0:
        hi = None if x[1] is None or y[1] is None else x[1] * y[1]
        return x[0] * y[0], hi
    return UNKNOWN


@dataclass
class RangeEnv:
    """What is known about the variables in scope while the emitter walks a kernel.

    The emitter pushes a variable's interval when it enters the loop or let that binds it and
    pops it when it leaves; `interval(e)` is then a sound over-approximation of `e`'s value."""

    known: dict[Var, Interval] = field(default_factory=dict)

    def bind(self, var: Var, interval: Interval) -> Optional[Interval]:
        """Record `var`'s interval; returns the previous one so the caller can restore it."""
        previous = self.known.get(var)
        self.known[var] = interval
        return previous

    def restore(self, var: Var, previous: Optional[Interval]) -> None:
        if previous is None:
            self.known.pop(var, None)
        else:
            self.known[var] = previous

    def loop_interval(self, lo: Expr, extent: Expr) -> Interval:
        """The values a loop variable takes over `[lo, lo + extent)`."""
        lo_iv, ext_iv = self.interval(lo), self.interval(extent)
        return lo_iv[0], _add(_add(lo_iv[1], ext_iv[1]), -1)

    def interval(self, e: Expr) -> Interval:
        """A sound interval for the integer expression `e` (UNKNOWN when nothing is known)."""
        if not e.dtype.is_int:
            return UNKNOWN
        if isinstance(e, Const):
            return int(e.value), int(e.value)
        if isinstance(e, Var):
            if e in self.known:
                return self.known[e]
            return (0, None) if e.kind == "size" else UNKNOWN
        if isinstance(e, Cast):
            return self.interval(e.a) if e.a.dtype.is_int else UNKNOWN
        if isinstance(e, Select):
            a, b = self.interval(e.a), self.interval(e.b)
            lo = None if a[0] is None or b[0] is None else min(a[0], b[0])
            hi = None if a[1] is None or b[1] is None else max(a[1], b[1])
            return lo, hi
        if isinstance(e, Binary):
            return self._binary(e)
        if isinstance(e, BufferLoad):
            return UNKNOWN
        if isinstance(e, Call) and e.name in OPAQUE_INTRINSICS:   # x's value, computed again
            return self.interval(e.args[0])
        return UNKNOWN

    def _binary(self, e: Binary) -> Interval:
        x, y = self.interval(e.a), self.interval(e.b)
        if e.op == "+":
            return _add(x[0], y[0]), _add(x[1], y[1])
        if e.op == "-":
            neg_y = (None if y[1] is None else -y[1], None if y[0] is None else -y[0])
            return _add(x[0], neg_y[0]), _add(x[1], neg_y[1])
        if e.op == "*":
            return _mul_interval(x, y)
        if e.op == "//":
            return self._floordiv(x, y)
        if e.op == "%":
            # Floor modulo by a positive divisor lies in [0, divisor - 1], whatever the dividend.
            if y[0] is not None and y[0] > 0:
                hi = None if y[1] is None else y[1] - 1
                if x[0] is not None and x[0] >= 0 and x[1] is not None:
                    hi = x[1] if hi is None else min(hi, x[1])
                return 0, hi
            return UNKNOWN
        if e.op in ("min", "max"):
            pick = min if e.op == "min" else max
            lo = None if x[0] is None or y[0] is None else pick(x[0], y[0])
            hi = None if x[1] is None or y[1] is None else pick(x[1], y[1])
            if e.op == "max" and lo is None:
                lo = x[0] if x[0] is not None else y[0]
            if e.op == "min" and hi is None:
                hi = x[1] if x[1] is not None else y[1]
            return lo, hi
        if e.op == "&" and (self.nonnegative_interval(x) or self.nonnegative_interval(y)):
            his = [iv[1] for iv in (x, y) if self.nonnegative_interval(iv)]
            return 0, min(h for h in his if h is not None) if any(h is not None for h in his) else None
        if e.op in ("|", "^") and self.nonnegative_interval(x) and self.nonnegative_interval(y):
            return 0, None
        return UNKNOWN

    @staticmethod
    def _floordiv(x: Interval, y: Interval) -> Interval:
        if y[0] is None or y[0] <= 0:
            return UNKNOWN
        # A positive divisor: floor(x / y) is monotone in x; the extremes use the divisor's
        # smallest value when x may be large and its largest when x is negative.
        lo: Bound = None
        hi: Bound = None
        if x[0] is not None:
            lo = x[0] // y[0] if x[0] < 0 else (0 if y[1] is None else x[0] // y[1])
        if x[1] is not None:
            hi = x[1] // y[0] if x[1] >= 0 else (x[1] // y[1] if y[1] is not None else -1)
        return lo, hi

    @staticmethod
    def nonnegative_interval(iv: Interval) -> bool:
        return iv[0] is not None and iv[0] >= 0

    def is_nonnegative(self, e: Expr) -> bool:
        """True when `e >= 0` holds for every value of the variables in scope."""
        return self.nonnegative_interval(self.interval(e))

    def is_positive(self, e: Expr) -> bool:
        """True when `e >= 1` holds for every value of the variables in scope."""
        lo = self.interval(e)[0]
        return lo is not None and lo >= 1


def divisible_by(e: Expr, factor: int, aligned_vars: frozenset[Var] = frozenset()) -> bool:
    """True when the integer expression `e` is provably a multiple of `factor`.

    Used to prove a vector access aligned: constants are checked, products are multiples when
    either factor is, sums and differences when both terms are. `aligned_vars` are variables
    known to be multiples of `factor` (none by default)."""
    if factor == 1:
        return True
    if isinstance(e, Const) and e.dtype.is_int:
        return int(e.value) % factor == 0
    if isinstance(e, Var):
        return e in aligned_vars
    if isinstance(e, Cast) and e.a.dtype.is_int:
        return divisible_by(e.a, factor, aligned_vars)
    if isinstance(e, Binary):
        if e.op == "*":
            if isinstance(e.b, Const) and e.b.dtype.is_int and int(e.b.value) % factor == 0:
                return True
            if isinstance(e.a, Const) and e.a.dtype.is_int and int(e.a.value) % factor == 0:
                return True
            return divisible_by(e.a, factor, aligned_vars) or divisible_by(e.b, factor, aligned_vars)
        if e.op in ("+", "-"):
            return divisible_by(e.a, factor, aligned_vars) and divisible_by(e.b, factor, aligned_vars)
        if e.op == "%" and isinstance(e.b, Const) and e.b.dtype.is_int and int(e.b.value) % factor == 0:
            # a - (a // c)·c: both terms multiples of factor (an implicit GEMM's k % C, C % 4 == 0)
            return divisible_by(e.a, factor, aligned_vars)
    return False
