"""Elementwise ATen ops as tensor expressions: a table, one row per op.

Each row says which arguments are the operands (promoted together with torch's own rules,
`torch._prims_common.elementwise_dtypes`, per the op's type-promotion kind) and what the op
computes on scalars of the *computation* dtype: float32 for float16/bfloat16 operands (torch's
"opmath"), the promoted dtype otherwise. The result is cast to the node's dtype once, at the end,
so each op rounds where eager rounds (a chain of bfloat16 ops rounds after every op, as eager
does; tecc's row fusion and inlining do not change a single value).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND as Kind
from torch._prims_common import elementwise_dtypes

from ...ir import dtype as dt
from ...ir import ops as te
from ...ir.dtype import DType
from ...ir.expr import Expr, call
from ...ir.tensor import Tensor
from .context import LoweringContext, Unsupported, aten, as_value, broadcast_read, constant, prims, tecc_dtype

F = Callable[..., Expr]


@dataclass(frozen=True)
class Pointwise:
    """An elementwise op: `fn(*operands, **params)` on expressions of the computation dtype.

    operands: positions (ints) or keyword names of the arguments promoted together; params:
    the other arguments `fn` takes, by keyword, with their defaults."""

    fn: F
    kind: Kind = Kind.DEFAULT
    operands: tuple[int | str, ...] = (0, 1)
    params: dict[str, tuple[int | str, Any]] = field(default_factory=dict)


def _truthy(x: Expr) -> Expr:
    return te.cast(x, "bool")


def _div_trunc(a: Expr, b: Expr) -> Expr:
    if a.dtype.is_float:
        q = a / b
        return te.where(q < 0, te.ceil(q), te.floor(q))
    q = a // b  # floors; move toward zero where the signs differ and the division is inexact
    return te.where(((a % b) != 0) & ((a < 0) != (b < 0)), q + 1, q)


def _trunc(x: Expr) -> Expr:
    return te.where(x < 0, te.ceil(x), te.floor(x)) if x.dtype.is_float else x


def _scaled(b: Expr, alpha: Any) -> Expr:
    if alpha is None or (not isinstance(alpha, Expr) and alpha == 1):
        return b
    return b * as_value(alpha, b.dtype)


def _add(a: Expr, b: Expr, alpha: Any = 1) -> Expr:
    if a.dtype.is_bool:
        return a | (b & as_value(alpha, a.dtype))
    return a + _scaled(b, alpha)


def _sub(a: Expr, b: Expr, alpha: Any = 1) -> Expr:
    if a.dtype.is_bool:
        raise Unsupported("subtraction of bool tensors (torch refuses it too)")
    return a - _scaled(b, alpha)


def _mul(a: Expr, b: Expr) -> Expr:
    return a & b if a.dtype.is_bool else a * b


def _pow(a: Expr, b: Expr) -> Expr:
    if not a.dtype.is_float:
        raise Unsupported("integer pow (tecc's pow is floating)")
    return te.pow(a, b)


def _pow_scalar(a: Expr, exponent: Any) -> Expr:
    """torch's special cases of a scalar exponent (ATen's pow_tensor_scalar kernel), then pow."""
    if isinstance(exponent, (int, float)) and not isinstance(exponent, bool):
        if exponent == 1:
            return a
        if exponent == 2:
            return a * a
        if exponent == 3:
            return a * a * a
        if a.dtype.is_float:
            if exponent == 0.5:
                return te.sqrt(a)
            if exponent == -0.5:
                return te.rsqrt(a)
            if exponent == -1:
                return constant(1, a.dtype) / a
            if exponent == -2:
                return constant(1, a.dtype) / (a * a)
    if not a.dtype.is_float:
        raise Unsupported("integer pow (tecc's pow is floating)")
    return te.pow(a, as_value(exponent, a.dtype))


def _round_decimals(x: Expr, decimals: int = 0) -> Expr:
    """ATen's round(x, decimals): rint(x·10^d) / 10^d, or rint(x / 10^-d) · 10^-d for d < 0."""
    if not x.dtype.is_float:
        return x
    if decimals >= 0:
        scale = constant(10.0 ** decimals, x.dtype)
        return call("round", x * scale) / scale
    scale = constant(10.0 ** -decimals, x.dtype)
    return call("round", x / scale) * scale


def _remainder(a: Expr, b: Expr) -> Expr:
    """Python's modulo (the divisor's sign): tecc's `%` (NumPy's remainder for floats)."""
    return a % b


def _fmod(a: Expr, b: Expr) -> Expr:
    """C's fmod (the dividend's sign), from the exact floor modulo: r, or r - b where r is
    non-zero and its sign differs from a's."""
    r = a % b
    zero = constant(0, a.dtype)
    return te.where((r != zero) & ((r < zero) != (a < zero)), r - b, r)


def _log1p(x: Expr) -> Expr:
    """log(1 + x) to full precision for small x (Goldberg's form: u = 1 + x rounded, then
    log(u) · x / (u - 1), which cancels the rounding of u; x itself where u == 1)."""
    one = constant(1, x.dtype)
    u = one + x
    inf = constant(math.inf, x.dtype)
    return te.where(u == one, x, te.where(u == inf, u, te.log(u) * (x / (u - one))))


def _expm1(x: Expr) -> Expr:
    """exp(x) - 1 to full precision for small x (Kahan's form: u = exp(x), (u - 1) · x / log u;
    x where u == 1, -1 where u - 1 == -1, u - 1 where u is infinite)."""
    one = constant(1, x.dtype)
    u = te.exp(x)
    um1 = u - one
    exact = te.where(um1 == -one, -one, um1 * (x / te.log(u)))
    return te.where(u == one, x, te.where(call("isinf", u), um1, exact))


def _clamp(x: Expr, lo: Any = None, hi: Any = None) -> Expr:
    if x.dtype.is_bool:
        raise Unsupported("clamp of bool")
    out = x
    if lo is not None:
        out = te.maximum(out, as_value(lo, x.dtype))
    if hi is not None:
        out = te.minimum(out, as_value(hi, x.dtype))
    return out


def _maximum(a: Expr, b: Expr) -> Expr:
    return a | b if a.dtype.is_bool else te.maximum(a, b)


def _minimum(a: Expr, b: Expr) -> Expr:
    return a & b if a.dtype.is_bool else te.minimum(a, b)


def _sign(x: Expr) -> Expr:
    if x.dtype.is_bool:
        return x
    one, zero = constant(1, x.dtype), constant(0, x.dtype)
    return te.where(x > 0, one, te.where(x < 0, -one, zero))  # NaN gives 0, as torch.sign


def _ordered(op: str) -> F:
    def compare(a: Expr, b: Expr) -> Expr:
        if a.dtype.is_bool and op not in ("==", "!="):
            a, b = te.cast(a, "int32"), te.cast(b, "int32")
        return {"<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b, "==": a == b, "!=": a != b}[op]

    return compare


def _float_only(name: str, fn: F) -> F:
    def apply(x: Expr) -> Expr:
        if not x.dtype.is_float:
            raise Unsupported(f"{name} of {x.dtype}")
        return fn(x)

    return apply


def _relu(x: Expr) -> Expr:
    if x.dtype.is_bool:
        raise Unsupported("relu of bool")
    return te.maximum(x, constant(0, x.dtype))


def _bitwise_not(x: Expr) -> Expr:
    return ~x


def _two(op: str) -> F:
    def apply(a: Expr, b: Expr) -> Expr:
        if a.dtype.is_float:
            raise Unsupported(f"bitwise {op} of {a.dtype}")
        return {"&": a & b, "|": a | b, "^": a ^ b}[op]

    return apply


def _logical(op: str) -> F:
    def apply(a: Expr, b: Expr) -> Expr:
        x, y = _truthy(a), _truthy(b)
        return {"&": x & y, "|": x | y, "^": x ^ y}[op]

    return apply


_UNARY_FLOAT = {
    "exp": te.exp, "log": te.log, "erf": te.erf, "rsqrt": te.rsqrt, "sqrt": te.sqrt, "sin": te.sin,
    "cos": te.cos, "tanh": te.tanh, "sigmoid": te.sigmoid, "log2": te.log2, "exp2": te.exp2,
}


def _table() -> dict[Any, Pointwise]:
    one = (0,)
    alpha = {"alpha": ("alpha", 1)}
    rows: dict[Any, Pointwise] = {
        aten.add.Tensor: Pointwise(_add, params=alpha), aten.add.Scalar: Pointwise(_add, params=alpha),
        aten.sub.Tensor: Pointwise(_sub, params=alpha), aten.sub.Scalar: Pointwise(_sub, params=alpha),
        aten.mul.Tensor: Pointwise(_mul), aten.mul.Scalar: Pointwise(_mul),
        aten.div.Tensor: Pointwise(lambda a, b: a / b, Kind.INT_TO_FLOAT),
        aten.div.Scalar: Pointwise(lambda a, b: a / b, Kind.INT_TO_FLOAT),
        aten.neg.default: Pointwise(lambda a: -a, operands=one),
        aten.abs.default: Pointwise(lambda a: te.abs(a), Kind.COMPLEX_TO_FLOAT, one),
        aten.reciprocal.default: Pointwise(lambda a: constant(1, a.dtype) / a, Kind.INT_TO_FLOAT, one),
        aten.relu.default: Pointwise(_relu, operands=one),
        aten.sign.default: Pointwise(_sign, operands=one),
        aten.sgn.default: Pointwise(_sign, operands=one),
        aten.floor.default: Pointwise(lambda a: te.floor(a) if a.dtype.is_float else a, operands=one),
        aten.ceil.default: Pointwise(lambda a: te.ceil(a) if a.dtype.is_float else a, operands=one),
        aten.round.default: Pointwise(lambda a: call("round", a) if a.dtype.is_float else a, operands=one),
        aten.trunc.default: Pointwise(_trunc, operands=one),
        aten.remainder.Tensor: Pointwise(_remainder), aten.remainder.Scalar: Pointwise(_remainder),
        aten.fmod.Tensor: Pointwise(_fmod), aten.fmod.Scalar: Pointwise(_fmod),
        aten.log1p.default: Pointwise(_float_only("log1p", _log1p), Kind.INT_TO_FLOAT, one),
        aten.expm1.default: Pointwise(_float_only("expm1", _expm1), Kind.INT_TO_FLOAT, one),
        aten.round.decimals: Pointwise(_round_decimals, operands=one, params={"decimals": ("decimals", 0)}),
        aten.isnan.default: Pointwise(lambda a: te.isnan(a) if a.dtype.is_float else constant(False, dt.bool_),
                                      Kind.ALWAYS_BOOL, one),
        aten.maximum.default: Pointwise(_maximum), aten.minimum.default: Pointwise(_minimum),
        aten.fmax.default: Pointwise(te.fmax), aten.fmin.default: Pointwise(te.fmin),
        aten.clamp.default: Pointwise(_clamp, operands=(0, 1, 2)),
        aten.clamp.Tensor: Pointwise(_clamp, operands=(0, 1, 2)),
        aten.clamp_min.default: Pointwise(lambda x, lo: _clamp(x, lo), operands=(0, 1)),
        aten.clamp_max.default: Pointwise(lambda x, hi: _clamp(x, None, hi), operands=(0, 1)),
        aten.pow.Tensor_Tensor: Pointwise(_pow, Kind.BOOL_TO_LONG),
        aten.pow.Scalar: Pointwise(_pow, Kind.BOOL_TO_LONG),
        aten.pow.Tensor_Scalar: Pointwise(_pow_scalar, Kind.BOOL_TO_LONG, one, {"exponent": (1, None)}),
        aten.div.Tensor_mode: Pointwise(lambda a, b, rounding_mode=None: _divide(a, b, rounding_mode), Kind.DEFAULT,
                                        params={"rounding_mode": ("rounding_mode", None)}),
        aten.bitwise_not.default: Pointwise(_bitwise_not, operands=one),
        aten.logical_not.default: Pointwise(lambda a: ~_truthy(a), Kind.ALWAYS_BOOL, one),
        aten.where.self: Pointwise(lambda a, b: a, Kind.NO_OPMATH, (1, 2)),  # the condition is handled apart
    }
    if hasattr(prims, "fma"):  # torch 2.11's decompositions wrote prims.fma; 2.13 has none
        rows[prims.fma.default] = Pointwise(lambda a, b, c: a * b + c, operands=(0, 1, 2))
    for name, fn in _UNARY_FLOAT.items():
        rows[getattr(aten, name).default] = Pointwise(_float_only(name, fn), Kind.INT_TO_FLOAT, one)
    for name, op in (("lt", "<"), ("le", "<="), ("gt", ">"), ("ge", ">="), ("eq", "=="), ("ne", "!=")):
        packet = getattr(aten, name)
        rows[packet.Tensor] = rows[packet.Scalar] = Pointwise(_ordered(op), Kind.ALWAYS_BOOL)
    for name, op in (("bitwise_and", "&"), ("bitwise_or", "|"), ("bitwise_xor", "^")):
        packet = getattr(aten, name)
        rows[packet.Tensor] = rows[packet.Scalar] = Pointwise(_two(op))
    for name, op in (("logical_and", "&"), ("logical_or", "|"), ("logical_xor", "^")):
        rows[getattr(aten, name).default] = Pointwise(_logical(op), Kind.ALWAYS_BOOL)
    return rows


def _divide(a: Expr, b: Expr, mode: str | None) -> Expr:
    if mode is None:
        if not a.dtype.is_float:
            raise Unsupported("true division needs a float computation dtype")
        return a / b
    if mode == "floor":
        return a // b  # tecc's floor division is Python's (NumPy's npy_divmod for floats), as torch's
    if mode == "trunc":
        return _div_trunc(a, b)
    raise Unsupported(f"rounding_mode {mode!r}")


POINTWISE: dict[Any, Pointwise] = _table()


def _meta_like(x: Any) -> Any:
    """What elementwise_dtypes needs of an operand: a meta tensor of its dtype and rank class
    (0-dimensional tensors promote below dimensioned ones), or the Python scalar itself."""
    if isinstance(x, Tensor):
        return torch.empty((1,) if x.ndim else (), dtype=_torch_dtype(x.dtype), device="meta")
    if isinstance(x, Expr):  # a symbolic size or scalar: a Python number of its kind
        return 1.0 if x.dtype.is_float else (True if x.dtype.is_bool else 1)
    return x


def _torch_dtype(d: DType) -> torch.dtype:
    from .context import torch_dtype_of

    return torch_dtype_of(d)


def promoted(operands: Sequence[Any], kind: Kind) -> tuple[DType, DType]:
    """(computation dtype, result dtype) of operands under torch's rules for `kind`."""
    present = [_meta_like(x) for x in operands if x is not None]
    comp, result = elementwise_dtypes(*present, type_promotion_kind=kind)
    return tecc_dtype(comp), tecc_dtype(result)


def _argument(args: Sequence[Any], kwargs: dict[str, Any], where: int | str, default: Any = None) -> Any:
    if isinstance(where, int):
        return args[where] if where < len(args) else default
    return kwargs.get(where, default)


def _positional_name(op: Any, index: int) -> str | None:
    try:
        return str(op._schema.arguments[index].name)
    except (AttributeError, IndexError):
        return None


def lower_pointwise(ctx: LoweringContext, op: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Tensor:
    """The node `op(*args, **kwargs)` as one compute of the node's shape and dtype."""
    row = POINTWISE[op]
    operands = []
    for where in row.operands:
        value = _argument(args, kwargs, where)
        if value is None and isinstance(where, int):
            name = _positional_name(op, where)
            value = kwargs.get(name) if name else None
        operands.append(value)
    params = {}
    for key, (where, default) in row.params.items():
        value = _argument(args, kwargs, where, default)
        if isinstance(where, int) and where >= len(args):
            name = _positional_name(op, where)
            value = kwargs.get(name, default) if name else default
        params[key] = value
    comp, result = promoted(operands, row.kind)
    out_dtype = ctx.out_dtype()
    shape = ctx.out_shape()
    cond = args[0] if op is aten.where.self else None
    for x in operands + ([cond] if cond is not None else []):
        if x is not None and not isinstance(x, (Tensor, Expr, bool, int, float)):
            raise Unsupported(f"operand {x!r} of {type(x).__name__}")

    def body(*idx: Expr) -> Expr:
        xs: list[Any] = []
        for x in operands:
            if x is None:
                xs.append(None)
            elif isinstance(x, Tensor):
                xs.append(te.cast(broadcast_read(x, idx, shape), comp))
            else:
                xs.append(as_value(x, comp))
        if cond is not None:
            c = broadcast_read(cond, idx, shape) if isinstance(cond, Tensor) else as_value(cond, dt.bool_)
            value = te.where(te.cast(c, "bool"), xs[0], xs[1])
        else:
            value = row.fn(*xs, **params)
        return te.cast(value, out_dtype)

    del result  # the node's own dtype (out_dtype) is what eager returns; `result` agrees with it
    return ctx.compute(shape, body)


def lower_cast(ctx: LoweringContext, x: Any) -> Tensor:
    """convert_element_type / _to_copy / clone: every element converted to the node's dtype."""
    if not isinstance(x, Tensor):
        raise Unsupported("a cast of a non-tensor")
    shape, d = ctx.out_shape(), ctx.out_dtype()
    return ctx.compute(shape, lambda *idx: te.cast(broadcast_read(x, idx, shape), d))
