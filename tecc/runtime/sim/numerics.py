"""Scalar semantics of the loop IR on NumPy values, dtype by dtype, as the GPU computes them.

A *value* in the emulator is either a uniform scalar (the same for every lane: a Python int or
bool for integers and bools, a NumPy scalar of the node's dtype for floats) or a 1-D array with
one entry per lane. Every function here accepts either and keeps the node's dtype:

- float32 stays float32 (NumPy never widens float32 with a float32 scalar), so accumulations
  round like the GPU's (up to FMA contraction, which the GPU may apply and NumPy does not).
- float16 and bfloat16 are storage types: arithmetic and intrinsics run in float32 and round
  back to the storage type after every node, which is what the CUDA emitter prints
  (`__float2half(__half2float(a) op __half2float(b))`) and what `cuda_fp16.h` operators do.
  float8_e4m3 / float8_e5m2 alike; rounding to them is nearest even *and saturating* (PTX
  `cvt.rn.satfinite`, what `__nv_fp8_e4m3(float)` does: beyond the largest finite value,
  infinities included, gives that value; NaN stays NaN), from any source in one rounding.
- Integers wrap (two's complement), uniform Python ints too (`wrap_uniform`); `//` and `%` floor,
  and give 0 for a zero divisor.
- Float `min` / `max` propagate NaN (np.minimum / np.maximum), `fmin` / `fmax` drop it.
- Casts float -> int truncate toward zero and saturate; NaN gives what the GPU gives (0 from a 32-bit
  float to int32, the integer minimum otherwise); int -> narrower
  int wraps; to bool tests `!= 0`; int and float64 -> bfloat16 round once (ml_dtypes rounds
  through float32, twice).
docs/semantics.md is the reference; tests/test_semantics.py holds both targets to it.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from ...ir import approx, approx_gelu
from ...ir import dtype as dt
from ...ir.dtype import DType
from ...ir.errors import TeccError

Value = Any  # a uniform scalar or an np.ndarray of shape (lanes,)

# Storage types whose arithmetic CUDA does in float32 (see the module docstring).
HALF_TYPES = (dt.float16, dt.bfloat16) + dt.FP8_DTYPES
_FP8_NUMPY_NAMES = ("float8_e4m3fn", "float8_e5m2")


def numpy_dtype(d: DType) -> np.dtype:
    return d.numpy


def poison(d: DType) -> Any:
    """The value that fills never-written memory: NaN for floats, a loud sentinel for ints,
    so a read of memory nothing wrote shows in the result even with checks off."""
    if d.is_float:
        return np.nan
    if d.is_bool:
        return True
    return -0x5EED5EED if d.bits >= 32 else -1


def make_const(value: int | float | bool, d: DType) -> Value:
    """A constant as the emulator holds it: Python ints/bools, NumPy scalars for floats."""
    if d.is_float:
        return numpy_dtype(d).type(value)
    if d.is_bool:
        return bool(value)
    return int(value)


def to_dtype(v: Value, d: DType) -> Value:
    """`v` converted to `d` as the emitted CUDA converts (docs/semantics.md, "Casts")."""
    npd = numpy_dtype(d)
    if isinstance(v, np.ndarray):
        if v.dtype == npd:
            return v
        if d.is_bool:
            return v != 0
        if d.is_int and (v.dtype.kind == "f" or v.dtype.name in ("bfloat16",) + _FP8_NUMPY_NAMES):
            return _float_to_int(v, d)  # ml_dtypes' kind is "V"
        if d in dt.FP8_DTYPES:
            return to_fp8(v, npd)
        if d == dt.bfloat16 and (v.dtype.kind in "iu" or v.dtype == np.float64):
            return _to_bfloat16(v)
        return v.astype(npd)  # int -> narrower int wraps (NumPy casts modulo 2^bits)
    if d.is_bool:
        return bool(v != 0)
    if d.is_int:
        if isinstance(v, (bool, int, np.integer, np.bool_)):
            return dt.wrap_int(int(v), d)
        return int(_float_to_int(np.asarray([v]), d)[0])  # a float (ml_dtypes' are no np.floating)
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
        # as an int64 array: NumPy converts a Python int through float64, rounding twice
        return to_dtype(np.array([int(v)], np.int64), d)[0]
    if d == dt.bfloat16 and isinstance(v, np.float64):
        return _to_bfloat16(np.asarray([v]))[0]
    if d in dt.FP8_DTYPES:
        return to_fp8(np.asarray([v]), npd)[0]
    return npd.type(v)


def _float_to_int(v: np.ndarray, d: DType) -> np.ndarray:
    """float -> int as PTX `cvt.rzi.s32` / `.s64` (what `__float2int_rz` and friends are):
    truncate toward zero, saturate to the integer range. NaN is what the hardware gives, measured
    on an H200 (sm_90): 0 from float32 (and float16 / bfloat16, converted through float32) to
    int32, the integer minimum (INT_MIN, INT64_MIN) from float64 and to int64."""
    lo, hi = dt.int_range(d)
    with np.errstate(invalid="ignore"):
        t = np.trunc(v.astype(np.float64))
        above = t >= 2.0 ** (d.bits - 1)
        below = t < -(2.0 ** (d.bits - 1))
        inside = np.where(above | below | np.isnan(t), 0.0, t).astype(d.numpy)
    nan = 0 if d.bits == 32 and v.dtype.itemsize <= 4 else lo
    out = np.where(above, hi, np.where(below, lo, inside))
    return np.where(np.isnan(t), nan, out).astype(d.numpy)


def _to_bfloat16(v: np.ndarray) -> np.ndarray:
    """Integers or float64 rounded once to bfloat16 (nearest even), as `__int2bfloat16_rn`,
    `__ll2bfloat16_rn` and `__double2bfloat16` do on the GPU. ml_dtypes goes through float32,
    rounding twice (2^24 + 2^16 + 1 would become 2^24, not 2^24 + 2^17). Rounding to float32 *to
    odd* first keeps the one rounding exact: float32 has 16 bits more than bfloat16."""
    import ml_dtypes

    if v.dtype.kind in "iu":
        out = _to_bfloat16(v.astype(np.float64))
        huge = np.flatnonzero(np.abs(v.astype(np.float64)) >= 2.0**53)  # maybe not exact in float64
        for i in huge:
            n = int(v[i])
            shift = max(abs(n).bit_length() - 10, 0)  # to odd on 10 bits: bfloat16's 8 and two more
            kept = abs(n) >> shift
            sticky = (abs(n) & ((1 << shift) - 1)) != 0
            out[i] = ml_dtypes.bfloat16((1 if n > 0 else -1) * float((kept | sticky) << shift))
        return out
    with np.errstate(over="ignore", invalid="ignore"):
        f = v.astype(np.float32)
        back = f.astype(np.float64)
        inexact = (back != v) & ~np.isnan(v)
        toward_zero = np.where(inexact & (np.abs(back) > np.abs(v)), np.nextafter(f, np.float32(0)), f)
        bits = toward_zero.view(np.uint32) | inexact.astype(np.uint32)  # the sticky bit
        return bits.view(np.float32).astype(ml_dtypes.bfloat16)


def to_fp8(v: np.ndarray, npd: np.dtype) -> np.ndarray:
    """Any real values rounded once to an fp8 type (`npd`: ml_dtypes' float8_e4m3fn or
    float8_e5m2) as PTX `cvt.rn.satfinite` does: nearest even, magnitudes beyond the largest
    finite value (infinities too) saturate to it, NaN stays NaN. ml_dtypes rounds float64
    through float32 (twice) and gives NaN on overflow, so: clip, then round to float32 *to
    odd* (float32 keeps 20 bits more than fp8's 4: the later rounding is then exact)."""
    import ml_dtypes

    big = float(ml_dtypes.finfo(npd).max)  # type: ignore[no-untyped-call]
    with np.errstate(over="ignore", invalid="ignore"):
        x = np.clip(np.asarray(v).astype(np.float64), -big, big)
        f = x.astype(np.float32)
        back = f.astype(np.float64)
        inexact = (back != x) & ~np.isnan(x)
        toward_zero = np.where(inexact & (np.abs(back) > np.abs(x)), np.nextafter(f, np.float32(0)), f)
        bits = toward_zero.view(np.uint32) | inexact.astype(np.uint32)
        out: np.ndarray = bits.view(np.float32).astype(npd)
    return out


def _as_float32(v: Value) -> Value:
    if isinstance(v, np.ndarray):
        return v.astype(np.float32)
    return np.float32(v)


_erf64 = np.vectorize(math.erf, otypes=[np.float64])


def _erf(x: Value) -> Value:
    # NumPy has no erf; evaluate exactly in float64 and round to the argument's type.
    out = _erf64(x)
    return out.astype(x.dtype) if isinstance(x, np.ndarray) else type(x)(out)


def _sigmoid(x: Value) -> Value:
    one = x.dtype.type(1) if isinstance(x, np.ndarray) else type(x)(1)
    return one / (one + np.exp(-x))


def _fma32(a: Any, b: Any, c: Any) -> Any:
    """float32 fma(a, b, c): the product of two float32 values is exact in float64, the sum is
    rounded to float64 and then to float32 (this double rounding can differ from the GPU's one
    rounding by an ulp, in rare halfway cases)."""
    return (np.float64(a) * np.float64(b) + np.float64(c)).astype(np.float32)


def _trig_approx(x: Value, cosine: bool) -> Value:
    """sin_approx / cos_approx (tecc/ir/approx.py) on float32, step for step as the CUDA helper
    computes them; the precise np.sin / np.cos beyond approx.FAST_RANGE, for inf and NaN."""
    x32 = np.asarray(x, dtype=np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        if cosine:
            u = _fma32(x32, approx.INV_PI, -0.5)
            n = np.rint(u) + np.float32(0.0)          # + 0 turns rint's -0 into the GPU's +0
            m = (n + np.float32(0.5)).astype(np.float32)
            flip = np.fmod(n, 2) == 0
        else:
            n = (np.rint(np.float64(x32) * approx.INV_PI) + 0.0).astype(np.float32)
            m = n
            flip = np.fmod(n, 2) != 0
        r = _fma32(m, -approx.PI_HI, x32)
        r = _fma32(m, -approx.PI_LO, r)
        r = np.where(flip, -r, r)
        r2 = (r * r).astype(np.float32)
        q = np.full_like(r2, approx.SIN_POLY[-1])
        for coefficient in (*approx.SIN_POLY[-2::-1], 1.0):
            q = _fma32(q, r2, coefficient)
        fast = (r * q).astype(np.float32)
        precise = (np.cos if cosine else np.sin)(x32)
        out = np.where(np.abs(x32) <= np.float32(approx.FAST_RANGE), fast, precise).astype(np.float32)
    return out if isinstance(x, np.ndarray) else np.float32(out)


def _exp2_ftz(x: Value) -> Value:
    """exp2_approx (ex2.approx.ftz.f32): 2^x in float32 with subnormal arguments and results
    flushed to zero (the emulator computes 2^x exactly rounded; the instruction's ~2^-22
    relative error is inside every bound its users state)."""
    x32 = np.asarray(x, np.float32)
    tiny = np.float32(np.finfo(np.float32).tiny)
    with np.errstate(over="ignore", under="ignore"):
        y = np.exp2(np.where(np.abs(x32) < tiny, np.float32(0), x32)).astype(np.float32)
    out = np.where(np.abs(y) < tiny, np.float32(0), y).astype(np.float32)
    return out if isinstance(x, np.ndarray) else np.float32(out)


def _gelu_tanh_approx(x: Value) -> Value:
    """gelu_tanh_approx (tecc/ir/approx_gelu.py) on float32, step for step as the CUDA helper:
    x / (1 + 2^t), t = x (TANH_A + TANH_B x^2); 2^t and the reciprocal correctly rounded here
    (ex2.approx / rcp.approx's own 2^-22 / 1 ulp are inside the stated bound), results below
    float32's normal range flushed to zero (the .ftz forms)."""
    x32 = np.asarray(x, np.float32)
    tiny = np.float32(np.finfo(np.float32).tiny)
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        s = (x32 * x32).astype(np.float32)
        t = (x32 * _fma32(s, np.float32(approx_gelu.TANH_B), np.float32(approx_gelu.TANH_A))).astype(np.float32)
        e = np.exp2(t).astype(np.float32)
        r = (np.float32(1) / (np.float32(1) + e)).astype(np.float32)
        r = np.where(r < tiny, np.float32(0), r).astype(np.float32)
        out = (x32 * r).astype(np.float32)
    return out if isinstance(x, np.ndarray) else np.float32(out)


def _gelu_erf_approx(x: Value) -> Value:
    """gelu_erf_approx (tecc/ir/approx_gelu.py) on float32, step for step as the CUDA helper:
    h = 2^q(u), u = min(fma(|x|, ERF_SCALE, -1), 1); x h for x < 0, x (1 - h) otherwise."""
    x32 = np.asarray(x, np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        u = _fma32(np.abs(x32), np.float32(approx_gelu.ERF_SCALE), -1.0)
        u = np.where(np.isnan(u), np.float32(1), np.minimum(u, np.float32(1))).astype(np.float32)  # fminf
        q = np.full_like(u, approx_gelu.ERF_POLY[-1])
        for coefficient in approx_gelu.ERF_POLY[-2::-1]:
            q = _fma32(q, u, coefficient)
        h = np.exp2(q).astype(np.float32)
        factor = np.where(x32 < 0, h, (np.float32(1) - h).astype(np.float32)).astype(np.float32)
        out = (x32 * factor).astype(np.float32)
    return out if isinstance(x, np.ndarray) else np.float32(out)


# Intrinsic name -> NumPy function evaluated in float32 (or the argument's own float type).
FLOAT_FUNCS: dict[str, Callable[[Value], Value]] = {
    "exp": np.exp,
    "log": np.log,
    "sqrt": np.sqrt,
    "rsqrt": lambda x: 1 / np.sqrt(x),
    "sin": np.sin,
    "cos": np.cos,
    "tanh": np.tanh,
    "erf": _erf,
    "sigmoid": _sigmoid,
    "exp2": np.exp2,
    "log2": np.log2,
    "floor": np.floor,
    "ceil": np.ceil,
    "round": np.rint,  # rintf: halves to even, what the CUDA emitter prints
    "abs": np.abs,
    "sin_approx": lambda x: _trig_approx(x, cosine=False),
    "cos_approx": lambda x: _trig_approx(x, cosine=True),
    "exp2_approx": lambda x: _exp2_ftz(x),
    "gelu_erf_approx": _gelu_erf_approx,
    "gelu_tanh_approx": _gelu_tanh_approx,
}


def _floordiv(a: Value, b: Value) -> Value:
    """Floor division; 0 for a zero divisor and INT_MIN // -1 == INT_MIN, as NumPy's arrays and
    the guarded CUDA the emitter prints (uniform results are wrapped by the caller)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        with np.errstate(divide="ignore", over="ignore"):
            return np.floor_divide(a, b)
    if b == 0:
        return 0
    return a // b


def _mod(a: Value, b: Value) -> Value:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        with np.errstate(divide="ignore", over="ignore"):
            return np.remainder(a, b)
    if b == 0:
        return 0
    return a % b


def _quiet(f: Callable[[Value, Value], Value], a: Value, b: Value) -> Value:
    with np.errstate(divide="ignore", invalid="ignore"):
        return f(a, b)


def _minimum(a: Value, b: Value) -> Value:
    return np.minimum(a, b) if isinstance(a, np.ndarray) or isinstance(b, np.ndarray) else min(a, b)


def _maximum(a: Value, b: Value) -> Value:
    return np.maximum(a, b) if isinstance(a, np.ndarray) or isinstance(b, np.ndarray) else max(a, b)


# Binary operators on values of one dtype. Float min/max propagate NaN (np.minimum/np.maximum);
# fmin/fmax (C's fminf/fmaxf) return the other operand when one is NaN.
INT_BINARY: dict[str, Callable[[Value, Value], Value]] = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "//": _floordiv,
    "%": _mod,
    "min": _minimum,
    "max": _maximum,
    "&": lambda a, b: a & b,
    "|": lambda a, b: a | b,
    "^": lambda a, b: a ^ b,
}
FLOAT_BINARY: dict[str, Callable[[Value, Value], Value]] = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "/": lambda a, b: a / b,
    "min": np.minimum,
    "max": np.maximum,
    "fmin": np.fmin,
    "fmax": np.fmax,
    "pow": np.power,
    "//": lambda a, b: _quiet(np.floor_divide, a, b),  # npy_divmod, as the CUDA helper
    "%": lambda a, b: _quiet(np.remainder, a, b),
}
COMPARE: dict[str, Callable[[Value, Value], Value]] = {
    "<": lambda a, b: a < b,
    "<=": lambda a, b: a <= b,
    ">": lambda a, b: a > b,
    ">=": lambda a, b: a >= b,
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
}


def binary_op(op: str, d: DType) -> Callable[[Value, Value], Value]:
    """The function computing `a op b` for operands of dtype `d`, rounding half types per node."""
    if d.is_float:
        if op not in FLOAT_BINARY:
            raise TeccError(f"operator {op} is not defined on {d}")
        f = FLOAT_BINARY[op]
        if d in HALF_TYPES:
            npd = numpy_dtype(d)
            return lambda a, b: to_half(f(_as_float32(a), _as_float32(b)), npd)
        return f
    if d.is_bool:
        bool_ops = {"&": lambda a, b: a & b, "|": lambda a, b: a | b, "^": lambda a, b: a ^ b}
        if op not in bool_ops:
            raise TeccError(f"operator {op} is not defined on bool")
        return bool_ops[op]
    if op not in INT_BINARY:
        raise TeccError(f"operator {op} is not defined on {d}")
    return INT_BINARY[op]


def wrap_uniform(op: Callable[[Value, Value], Value], d: DType) -> Callable[[Value, Value], Value]:
    """`op` on an integer dtype whose uniform results (Python ints, which never overflow) are
    reduced modulo 2^bits like the per-lane NumPy arrays are."""
    lo, hi = dt.int_range(d)

    def wrapped(a: Value, b: Value) -> Value:
        r = op(a, b)
        if r.__class__ is int and not lo <= r <= hi:
            return dt.wrap_int(r, d)
        return r

    return wrapped


def compare_op(op: str, d: DType) -> Callable[[Value, Value], Value]:
    # Comparing 16-bit storage values directly is exact; no float32 round trip is needed.
    return COMPARE[op]


def intrinsic(name: str, d: DType) -> Callable[[Value], Value]:
    """A math intrinsic on an argument of dtype `d` (result dtype `d`, or bool for isnan/isinf)."""
    if name == "isnan":
        return lambda x: np.isnan(x)
    if name == "isinf":
        return lambda x: np.isinf(x)
    if name == "abs" and not d.is_float:  # abs(INT_MIN) wraps to INT_MIN, as NumPy's and the GPU's
        return lambda x: np.abs(x) if isinstance(x, np.ndarray) else dt.wrap_int(abs(x), d)
    if name not in FLOAT_FUNCS:
        raise TeccError(f"the emulator has no rule for the intrinsic {name!r}")
    f = FLOAT_FUNCS[name]
    if d in HALF_TYPES:
        npd = numpy_dtype(d)
        return lambda x: to_half(f(_as_float32(x)), npd)
    return f


def to_half(v: Value, npd: np.dtype) -> Value:
    """Round a float32 value to a 16-bit storage type (round to nearest even, like
    __float2half_rn and __float2bfloat16_rn) or an fp8 one (saturating, `to_fp8`)."""
    if npd.name in _FP8_NUMPY_NAMES:
        return to_fp8(v, npd) if isinstance(v, np.ndarray) else to_fp8(np.asarray([v]), npd)[0]
    return v.astype(npd) if isinstance(v, np.ndarray) else npd.type(v)
