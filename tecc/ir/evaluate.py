"""Evaluate scalar expressions over known variable values (host side: launch dimensions,
temporary shapes, argument checks). Integer `//` and `%` floor, as everywhere in tecc."""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Union

Scalar = Union[int, float, bool]

from .dtype import int64, wrap_int
from .errors import TeccError
from .expr import Binary, Call, Cast, Compare, Const, Expr, Not, Select, Var
from .philox import RandomUniform, uniform_from_index

_BIN: dict[str, Callable[[Any, Any], Any]] = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "/": lambda a, b: a / b,
    "//": lambda a, b: a // b,
    "%": lambda a, b: a % b,
    "min": min,
    "max": max,
    "pow": lambda a, b: a**b,
    "&": lambda a, b: a & b,
    "|": lambda a, b: a | b,
    "^": lambda a, b: a ^ b,
}
_CMP: dict[str, Callable[[Any, Any], bool]] = {"<": lambda a, b: a < b, "<=": lambda a, b: a <= b, ">": lambda a, b: a > b,
        ">=": lambda a, b: a >= b, "==": lambda a, b: a == b, "!=": lambda a, b: a != b}

_HOST_MATH = {"sin_approx": "sin", "cos_approx": "cos", "exp2_approx": "exp2"}  # the intrinsic -> its `math` function
# the cheap GELUs (approx_gelu.py) -> the functions they approximate
_HOST_GELU: dict[str, Callable[[float], float]] = {
    "gelu_erf_approx": lambda x: 0.5 * x * math.erfc(-x / math.sqrt(2.0)),
    "gelu_tanh_approx": lambda x: 0.5 * x * (1.0 + math.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3))),
}


def evaluate(e: Expr, env: Mapping[Var, int | float | bool]) -> int | float | bool:
    """The value of `e` when each variable takes its value in `env`."""
    if isinstance(e, Const):
        return e.value
    if isinstance(e, Var):
        if e not in env:
            raise TeccError(f"no value for variable {e.name} while evaluating an expression")
        return env[e]
    if isinstance(e, Binary):
        a, b = evaluate(e.a, env), evaluate(e.b, env)
        if e.op in ("//", "%") and b == 0:
            raise TeccError(f"division by zero evaluating {e}")
        out: Scalar = _BIN[e.op](a, b)
        return out
    if isinstance(e, Compare):
        return _CMP[e.op](evaluate(e.a, env), evaluate(e.b, env))
    if isinstance(e, Not):
        v = evaluate(e.a, env)
        return (not v) if e.dtype.is_bool else ~int(v)
    if isinstance(e, Cast):
        v = evaluate(e.a, env)
        if e.dtype.is_bool:
            return bool(v)
        return int(v) if e.dtype.is_int else float(v)
    if isinstance(e, Select):
        return evaluate(e.a, env) if evaluate(e.cond, env) else evaluate(e.b, env)
    if isinstance(e, Call) and e.name in _HOST_GELU:
        # The cheap GELUs are evaluated precisely here, as the sin/cos below.
        return _HOST_GELU[e.name](float(evaluate(e.args[0], env)))
    if isinstance(e, Call) and hasattr(math, _HOST_MATH.get(e.name, e.name)):
        # The cheap sin/cos are evaluated precisely here: they are within their bound of it.
        fn: Callable[..., Scalar] = getattr(math, _HOST_MATH.get(e.name, e.name))
        return fn(*(evaluate(a, env) for a in e.args))
    if isinstance(e, RandomUniform):
        seed, offset, index = (wrap_int(evaluate_int(x, env), int64) for x in (e.seed, e.offset, e.index))
        return float(uniform_from_index(seed, offset, index))
    raise TeccError(f"cannot evaluate {type(e).__name__} {e} on the host")


def evaluate_int(e: Expr, env: Mapping[Var, int | float | bool]) -> int:
    v = evaluate(e, env)
    return int(v)
