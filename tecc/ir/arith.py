"""Building scalar expressions: dtype promotion, weak Python scalars, and light constant folding.

The node classes are in expr_nodes.py; these functions are how every operator and pass makes new
nodes, so promotion (docs/dtypes.md) and the few folds that keep generated code readable
(integer constants, x+0, x*1, x*0 for integers, bool and/or with a constant) happen in one place.
Float expressions are never folded algebraically (x*0 is not 0 for NaN or inf).
"""

from __future__ import annotations

from typing import Any, Callable

from . import dtype as dt
from .dtype import DType
from .errors import DTypeError, TeccError
from .expr_nodes import (APPROX_INTRINSICS, FLOAT_INTRINSICS, INTRINSICS, WARP_INTRINSICS, Binary, Builders, Call,
                         Cast, Compare, Const, Expr, ExprLike, Select, index_expr, install_builders)


def as_expr(value: ExprLike, like: DType | None = None) -> Expr:
    """Turn a Python scalar into a Const (taking the dtype `like` when given, weakly)."""
    if isinstance(value, Expr):
        return value
    if like is not None:
        return Const(value, dt.scalar_dtype_against(value, like))
    return Const(value, dt.default_scalar_dtype(value))


def _operands(a: ExprLike, b: ExprLike, op: str) -> tuple[Expr, Expr]:
    if not isinstance(a, Expr) and not isinstance(b, Expr):
        a, b = as_expr(a), as_expr(b)
    elif not isinstance(a, Expr):
        a = as_expr(a, b.dtype)  # type: ignore[union-attr]
    elif not isinstance(b, Expr):
        b = as_expr(b, a.dtype)
    assert isinstance(a, Expr) and isinstance(b, Expr)
    if a.dtype != b.dtype:
        target = dt.promote(a.dtype, b.dtype)
        a, b = cast(a, target), cast(b, target)
    return a, b


_FOLD: dict[str, Callable[[Any, Any], Any]] = {
    "+": lambda x, y: x + y,
    "-": lambda x, y: x - y,
    "*": lambda x, y: x * y,
    "min": min,
    "max": max,
}


def binary(op: str, a: ExprLike, b: ExprLike) -> Expr:
    """Build `a op b` with dtype promotion; folds integer constants and the identities x+0, x*1."""
    x, y = _operands(a, b, op)
    d = x.dtype
    if op in ("fmin", "fmax") and not d.is_float:
        op = op[1:]  # the NaN-dropping forms differ from min / max only where a NaN can occur
    if op in ("+", "-", "*", "//", "%", "min", "max") and d.is_bool:
        raise DTypeError(f"operator {op} is not defined on bool ({x} {op} {y}); cast to an integer first")
    if op == "/" and not d.is_float:
        raise DTypeError(
            f"'/' needs floating operands, got {d} in ({x} / {y}); use // for integer division or tc.cast"
        )
    if op == "pow" and not d.is_float:
        raise DTypeError(f"pow needs floating operands, got {d} in pow({x}, {y})")
    if op in ("&", "|", "^") and d.is_float:
        raise DTypeError(f"operator {op} needs bool or integer operands, got {d} in ({x} {op} {y})")
    if d.is_int:
        if isinstance(x, Const) and isinstance(y, Const):
            # Folds compute what the kernel would: wrapping, and 0 for a zero divisor.
            if op in _FOLD:
                return Const(dt.wrap_int(_FOLD[op](x.value, y.value), d), d)
            if op in ("//", "%"):
                if y.value == 0:
                    return Const(0, d)
                p, q = int(x.value), int(y.value)
                return Const(dt.wrap_int(p // q if op == "//" else p % q, d), d)
        if op == "+" and isinstance(y, Const) and y.value == 0:
            return x
        if op == "+" and isinstance(x, Const) and x.value == 0:
            return y
        if op == "-" and isinstance(y, Const) and y.value == 0:
            return x
        if op == "*" and isinstance(y, Const) and y.value == 1:
            return x
        if op == "*" and isinstance(x, Const) and x.value == 1:
            return y
        if op == "*" and ((isinstance(y, Const) and y.value == 0) or (isinstance(x, Const) and x.value == 0)):
            return Const(0, d)
        if op in ("//",) and isinstance(y, Const) and y.value == 1:
            return x
        if op == "%" and isinstance(y, Const) and y.value == 1:
            return Const(0, d)
    if d.is_bool and op in ("&", "|") and (isinstance(x, Const) or isinstance(y, Const)):
        c, other = (x, y) if isinstance(x, Const) else (y, x)
        assert isinstance(c, Const)
        if op == "&":
            return other if c.value else Const(False, d)
        return Const(True, d) if c.value else other
    return Binary(op, x, y)


def compare(op: str, a: ExprLike, b: ExprLike) -> Expr:
    """Build the comparison `a op b` (dtype bool) with dtype promotion."""
    x, y = _operands(a, b, op)
    if isinstance(x, Const) and isinstance(y, Const):
        fold = {"<": x.value < y.value, "<=": x.value <= y.value, ">": x.value > y.value,
                ">=": x.value >= y.value, "==": x.value == y.value, "!=": x.value != y.value}
        return Const(fold[op], dt.bool_)
    return Compare(op, x, y)


def cast(value: ExprLike, dtype: dt.DTypeLike) -> Expr:
    """`value` converted to `dtype`; no node when it already has that dtype."""
    d = dt.as_dtype(dtype)
    e = as_expr(value, d) if not isinstance(value, Expr) else value
    if e.dtype == d:
        return e
    if isinstance(e, Const) and d.is_int and not e.dtype.is_float:
        return Const(dt.wrap_int(int(e.value), d), d)  # narrowing wraps, as at run time
    if isinstance(e, Const) and d.is_bool and not e.dtype.is_float:
        return Const(e.value, d)
    narrow = (dt.float16, dt.bfloat16) + dt.FP8_DTYPES
    if isinstance(e, Const) and d.is_float and d not in narrow and _fits(float(e.value), d):
        return Const(float(e.value), d)
    return Cast(d, e)


def _fits(value: float, d: DType) -> bool:
    """Whether a float constant stays finite in `d` (else the cast stays a node: at run time it
    gives infinity, which no Const may hold by accident)."""
    try:
        dt.check_constant_fits(value, d)
    except DTypeError:
        return False
    return True


def call(name: str, *args: ExprLike) -> Expr:
    """Apply the math intrinsic `name` (see INTRINSICS, and APPROX_INTRINSICS for passes)."""
    if name in APPROX_INTRINSICS:
        x = as_expr(args[0]) if not isinstance(args[0], Expr) else args[0]
        if x.dtype not in (dt.float32, dt.float16, dt.bfloat16):
            raise DTypeError(f"{name} needs a float32, float16 or bfloat16 argument, got {x.dtype} in {name}({x})")
        return Call(name, (x,), x.dtype)
    if name not in INTRINSICS:
        raise DTypeError(f"unknown intrinsic {name!r}; tecc has {', '.join(INTRINSICS)}")
    xs = [as_expr(a) if not isinstance(a, Expr) else a for a in args]
    x = xs[0]
    if name in ("isnan", "isinf"):
        if not x.dtype.is_float:
            raise DTypeError(f"{name} needs a floating argument, got {x.dtype} in {name}({x})")
        return Call(name, tuple(xs), dt.bool_)
    if name in FLOAT_INTRINSICS and not x.dtype.is_float:
        raise DTypeError(
            f"{name} needs a floating argument, got {x.dtype} in {name}({x}); cast it with tc.cast(x, 'float32')"
        )
    if name == "abs" and x.dtype.is_bool:
        raise DTypeError(f"abs is not defined on bool ({x})")
    return Call(name, tuple(xs), x.dtype)


def warp_shuffle(kind: str, value: Expr, arg: ExprLike) -> Expr:
    """A warp shuffle (see WARP_INTRINSICS): `kind` is shfl_xor | shfl_down | shfl_idx."""
    if kind not in WARP_INTRINSICS:
        raise TeccError(f"unknown warp intrinsic {kind!r}; one of {WARP_INTRINSICS}")
    return Call(kind, (value, index_expr(arg) if not isinstance(arg, Expr) else arg), value.dtype)


def atomic_add(element: Expr, value: ExprLike) -> Expr:
    """`atomicAdd(&element, value)` on a global element (int32, int64, float32 or float64: the
    element's dtype, which `value` must have), giving its value before the add (see
    MEMORY_INTRINSICS; `element` is a BufferLoad, Call checks it)."""
    return Call("atomic_add", (element, as_expr(value, element.dtype)), element.dtype)


def atomic_add_pair(element: Expr, first: Expr, second: Expr) -> Expr:
    """`red.global.add.v2.f32` of (first, second) into float32 `element` and the next element of
    its innermost dimension (see MEMORY_INTRINSICS: sm_90 and newer, 8-byte aligned); int32 0."""
    return Call("atomic_add_pair", (element, first, second), dt.int32)


def load_cg(element: Expr) -> Expr:
    """`__ldcg(&element)`: a global element read at L2 (see MEMORY_INTRINSICS)."""
    return Call("load_cg", (element,), element.dtype)


def opaque(x: Expr) -> Expr:
    """`x` computed again where it stands (see OPAQUE_INTRINSICS): an int32 the CUDA compiler
    may not hoist what is derived from it above."""
    return Call("opaque", (x,), dt.int32)


def thread_fence() -> Expr:
    """`__threadfence()` (see MEMORY_INTRINSICS), for an Evaluate statement."""
    return Call("thread_fence", (), dt.int32)


def select(cond: ExprLike, a: ExprLike, b: ExprLike) -> Expr:
    """`where(cond, a, b)`: `a` where cond holds, else `b` (dtypes promoted)."""
    c = as_expr(cond)
    if not c.dtype.is_bool:
        raise DTypeError(f"the condition of where() must be a bool expression, got {c.dtype} in {c}")
    x, y = _operands(a, b, "where")
    if isinstance(c, Const):
        return x if c.value else y
    return Select(c, x, y)


def logical_and(*conds: Expr) -> Expr:
    """The conjunction of bool expressions (True when there are none)."""
    out: Expr = Const(True, dt.bool_)
    for c in conds:
        out = binary("&", out, c)
    return out


# The operators of Expr (a + b, a < b, abs(a)) build through these functions.
install_builders(Builders(binary=binary, compare=compare, call=call))
