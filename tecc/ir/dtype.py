"""Scalar data types and the promotion rules of tensor expressions.

Promotion (written out in docs/dtypes.md):
- bool < int32 < int64 < {float8_e4m3, float8_e5m2} < {float16, bfloat16} < float32 < float64
  ("kind" then width).
- Two dtypes of one kind promote to the wider; float16 with bfloat16 gives float32
  (neither holds the other: float16 has the mantissa, bfloat16 the exponent range), and
  float8_e4m3 with float8_e5m2 gives float16 (which holds every value of both exactly).
- The fp8 dtypes are storage types for tensor-core contractions (like float16 they compute in
  float32): float8_e4m3 is CUDA's `__nv_fp8_e4m3` and ml_dtypes' `float8_e4m3fn` (4 exponent
  bits, 3 mantissa bits, no infinity, NaN = 0x7f / 0xff, largest finite 448), float8_e5m2 is
  `__nv_fp8_e5m2` / `float8_e5m2` (IEEE-like, largest finite 57344). Conversions to them round
  to nearest even and saturate to the largest finite value (PTX `cvt.rn.satfinite`); NaN stays NaN.
- An integer with a float gives the float (like PyTorch; NumPy would widen int32+float16 to
  float64, which no GPU kernel wants).
- A Python scalar takes the dtype of the tensor expression it meets ("weak" scalars, as NumPy's
  NEP 50): `x_f16 * 2.0` stays float16; a Python float meeting an integer expression gives float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

import numpy as np

from .errors import DTypeError


@dataclass(frozen=True)
class DType:
    """One scalar type: its name, kind ('bool' | 'int' | 'float'), width in bits and C spelling."""

    name: str
    kind: str
    bits: int
    c_name: str
    rank: int  # position in the promotion order above

    @property
    def is_float(self) -> bool:
        return self.kind == "float"

    @property
    def is_int(self) -> bool:
        return self.kind == "int"

    @property
    def is_bool(self) -> bool:
        return self.kind == "bool"

    @property
    def bytes(self) -> int:
        return max(1, self.bits // 8)

    @property
    def numpy(self) -> "np.dtype[Any]":
        """The host (NumPy) dtype; bfloat16 and the fp8 dtypes come from ml-dtypes."""
        if self.name in ML_DTYPES_NAMES:
            import ml_dtypes

            host: "np.dtype[Any]" = np.dtype(getattr(ml_dtypes, ML_DTYPES_NAMES[self.name]))
            return host
        return np.dtype(self.name if self.name != "bool" else np.bool_)

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"tecc.{self.name}"


bool_ = DType("bool", "bool", 8, "bool", 0)
int32 = DType("int32", "int", 32, "int", 1)
int64 = DType("int64", "int", 64, "long long", 2)
float8_e4m3 = DType("float8_e4m3", "float", 8, "__nv_fp8_e4m3", 3)
float8_e5m2 = DType("float8_e5m2", "float", 8, "__nv_fp8_e5m2", 3)
float16 = DType("float16", "float", 16, "__half", 3)
bfloat16 = DType("bfloat16", "float", 16, "__nv_bfloat16", 3)
float32 = DType("float32", "float", 32, "float", 4)
float64 = DType("float64", "float", 64, "double", 5)

ALL_DTYPES: dict[str, DType] = {
    d.name: d for d in (bool_, int32, int64, float8_e4m3, float8_e5m2, float16, bfloat16, float32, float64)
}
FP8_DTYPES = (float8_e4m3, float8_e5m2)
# tecc dtype name -> the ml_dtypes type of its host arrays
ML_DTYPES_NAMES = {"bfloat16": "bfloat16", "float8_e4m3": "float8_e4m3fn", "float8_e5m2": "float8_e5m2"}
_ALIASES = {"float": float32, "half": float16, "bf16": bfloat16, "fp16": float16, "fp32": float32,
            "fp64": float64, "double": float64, "int": int32, "bool_": bool_,
            # ml_dtypes' and torch's names of the fp8 types (torch.float8_e4m3fn)
            "float8_e4m3fn": float8_e4m3, "fp8_e4m3": float8_e4m3, "e4m3": float8_e4m3,
            "fp8_e5m2": float8_e5m2, "e5m2": float8_e5m2}

DTypeLike = Union[DType, str, type, np.dtype]


def as_dtype(value: DTypeLike) -> DType:
    """Turn a name ('float32'), a NumPy dtype or a DType into a DType; unknown ones raise DTypeError."""
    if isinstance(value, DType):
        return value
    if isinstance(value, str):
        if value in ALL_DTYPES:
            return ALL_DTYPES[value]
        if value in _ALIASES:
            return _ALIASES[value]
        raise DTypeError(
            f"unknown dtype {value!r}; tecc supports {', '.join(ALL_DTYPES)}"
        )
    if value is bool:
        return bool_
    if value is int:
        return int64
    if value is float:
        return float64
    try:
        np_dtype = np.dtype(value)
    except TypeError as exc:
        raise DTypeError(f"cannot interpret {value!r} as a dtype") from exc
    if np_dtype.name == "bfloat16":
        return bfloat16
    if np_dtype.name in ("float8_e4m3fn", "float8_e5m2"):
        return _ALIASES.get(np_dtype.name) or ALL_DTYPES[np_dtype.name]
    if np_dtype == np.bool_:
        return bool_
    if np_dtype.name in ALL_DTYPES:
        return ALL_DTYPES[np_dtype.name]
    raise DTypeError(f"NumPy dtype {np_dtype} has no tecc equivalent; use one of {', '.join(ALL_DTYPES)}")


def promote(a: DType, b: DType) -> DType:
    """The dtype of a binary operation on two tensor expressions of dtypes `a` and `b`."""
    if a == b:
        return a
    if {a, b} == {float16, bfloat16}:
        return float32
    if {a, b} == {float8_e4m3, float8_e5m2}:
        return float16
    if a in FP8_DTYPES and b in (float16, bfloat16):
        return b
    if b in FP8_DTYPES and a in (float16, bfloat16):
        return a
    return a if a.rank > b.rank else b


def scalar_dtype_against(value: object, other: DType) -> DType:
    """The dtype a Python scalar takes next to an expression of dtype `other` (weak scalars)."""
    if isinstance(value, bool):
        return other
    if isinstance(value, (int, np.integer)):
        return other
    if isinstance(value, (float, np.floating)):
        return other if other.is_float else float32
    raise DTypeError(f"cannot use {type(value).__name__} {value!r} in a tensor expression")


def default_scalar_dtype(value: object) -> DType:
    """The dtype of a Python scalar that stands alone (no tensor to take a dtype from)."""
    if isinstance(value, (bool, np.bool_)):
        return bool_
    if isinstance(value, (int, np.integer)):
        return int32 if -(2**31) <= int(value) < 2**31 else int64
    if isinstance(value, (float, np.floating)):
        return float32
    raise DTypeError(f"cannot use {type(value).__name__} {value!r} in a tensor expression")


def int_range(d: DType) -> tuple[int, int]:
    """The smallest and largest value of the integer dtype `d` (two's complement)."""
    half = 2 ** (d.bits - 1)
    return -half, half - 1


def wrap_int(value: int, d: DType) -> int:
    """`value` reduced to the integer dtype `d` modulo 2^bits (two's complement), as integer
    arithmetic and narrowing casts wrap on every target."""
    lo, hi = int_range(d)
    if lo <= value <= hi:
        return value
    return int((value - lo) % 2**d.bits + lo)


def check_constant_fits(value: object, d: DType) -> None:
    """DTypeError unless the Python number `value` can be a constant of dtype `d` without
    changing its meaning: integers inside the dtype's range, floats that stay finite (rounding
    to the nearest representable value is fine, overflowing to infinity is not)."""
    if d.is_int and isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        lo, hi = int_range(d)
        if not lo <= int(value) <= hi:
            wider = " or make it int64 (tc.const(value, 'int64'), tc.cast(expr, 'int64'))" if d.bits < 64 else ""
            raise DTypeError(
                f"the constant {int(value)} does not fit {d} (range {lo} .. {hi}); tecc will not wrap a "
                f"Python constant silently: use a value in range{wider}"
            )
    if d.is_float and isinstance(value, (float, int, np.floating, np.integer)) and not isinstance(value, bool):
        f = float(value)
        if np.isfinite(f):
            with np.errstate(over="ignore"):
                rounded = d.numpy.type(f)
            if not np.isfinite(rounded):
                raise DTypeError(
                    f"the constant {value!r} overflows {d} (largest finite {largest_finite(d)!r}); "
                    f"use a wider dtype (tc.const(value, 'float32'), tc.cast(expr, 'float32')) or write "
                    f"float('inf') if infinity is meant"
                )


def largest_finite(d: DType) -> float:
    """The largest finite value of the float dtype `d`."""
    if d.name in ML_DTYPES_NAMES:
        import ml_dtypes

        return float(ml_dtypes.finfo(d.numpy).max)  # type: ignore[no-untyped-call]
    return float(np.finfo(d.numpy).max)
