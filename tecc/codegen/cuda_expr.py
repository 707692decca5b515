"""Scalar expressions of the loop-nest IR as CUDA C text.

The rules, each one the contract the SIMT emulator (tecc/runtime/sim) implements too:

- **Precedence.** Every rendering returns its text with its C precedence, and a parent wraps a
  child in parentheses only when C would otherwise parse it differently (plus around `&&` inside
  `||` and bitwise operators inside logical ones, where compilers warn). Select is always
  written `(c ? a : b)`; C's `?:` evaluates only the chosen side, which the IR relies on.
- **Half math.** float16 and bfloat16 values are stored as `__half` / `__nv_bfloat16` (the fp8
  ones as `__nv_fp8_e4m3` / `__nv_fp8_e5m2`, converted by cuda_fp8.h's saturating constructors); every
  arithmetic node and intrinsic on them is computed in float and rounded back to the half type
  (`__float2half_rn(__half2float(a) + __half2float(b))`). This is what the emulator does, so
  results agree bit for bit, and it avoids the double rounding of mixing native half ops with
  float ones.
- **Floor division.** Integer `//` and `%` floor (Python semantics). When the ranges analysis
  proves both operands non-negative C's truncating `/` and `%` agree and are emitted as they
  are; otherwise a floor formula built on them is. A divisor not proven positive is guarded:
  `x // 0` and `x % 0` are 0 (docs/semantics.md), never C's undefined behaviour.
- **Float to int** is `__float2int_rz` and its siblings (PTX `cvt.rzi`: truncate, saturate,
  NaN as the hardware gives it, docs/semantics.md), not a C cast, whose out-of-range and NaN
  results C leaves undefined.
- **Float max / min** propagate NaN through the `tecc_max` / `tecc_min` helpers (NumPy's
  maximum / minimum); `fmax` / `fmin` are C's `fmaxf` / `fminf`, which drop a NaN operand.
- **Constants round-trip exactly**: floats print as the shortest decimal that reads back to the
  same float32/float64 (`0.1f`), infinities and NaN through `__int_as_float` bit patterns (NVRTC
  has no math_constants.h), int64 with `LL`.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from tecc.ir import approx
from tecc.ir import dtype as dt
from tecc.ir.dtype import DType
from tecc.ir.errors import CompileError
from tecc.ir.expr import (
    APPROX_INTRINSICS,
    MEMORY_INTRINSICS,
    OPAQUE_INTRINSICS,
    WARP_INTRINSICS,
    Binary,
    BufferLoad,
    Call,
    Cast,
    Compare,
    Const,
    Expr,
    Not,
    Select,
    Var,
    buffers_read,
    cast,
    const_int,
)
from tecc.ir.philox import RandomUniform
from tecc.ir.index_checks import RECORD_SYMBOL, RECORD_WORDS, IndexCheck
from tecc.ir.stmt import Buffer

from . import philox
from .gelu_helpers import gelu_helpers
from .ranges import RangeEnv

# C precedence levels, higher binds tighter (C11 6.5).
ATOM, POSTFIX, UNARY, MUL, ADD, REL, EQ, BAND, BXOR, BOR, LAND, LOR, COND = (
    17, 16, 15, 13, 12, 10, 9, 8, 7, 6, 5, 4, 3)

Text = tuple[str, int]  # C source and its precedence

HALF_TYPES = (dt.float16, dt.bfloat16) + dt.FP8_DTYPES

# Half type -> (float -> half, half -> float, double -> half, int -> half, long long -> half).
_HALF_CONVERT = {
    dt.float16: ("__float2half_rn", "__half2float", "__double2half", "__int2half_rn", "__ll2half_rn"),
    dt.bfloat16: ("__float2bfloat16_rn", "__bfloat162float", "__double2bfloat16", "__int2bfloat16_rn",
                  "__ll2bfloat16_rn"),
    # cuda_fp8.h's constructors: nearest even, saturating (cvt.rn.satfinite); from double in one
    # rounding, from integers through float (exact below 2^24; larger ones saturate anyway)
    dt.float8_e4m3: ("__nv_fp8_e4m3", "static_cast<float>", "__nv_fp8_e4m3", "__nv_fp8_e4m3", "__nv_fp8_e4m3"),
    dt.float8_e5m2: ("__nv_fp8_e5m2", "static_cast<float>", "__nv_fp8_e5m2", "__nv_fp8_e5m2", "__nv_fp8_e5m2"),
}

_INFIX_PREC = {"+": ADD, "-": ADD, "*": MUL, "/": MUL, "%": MUL, "&": BAND, "^": BXOR, "|": BOR,
               "&&": LAND, "||": LOR, "<": REL, "<=": REL, ">": REL, ">=": REL, "==": EQ, "!=": EQ}
_LOGIC_OPS = ("&", "^", "|", "&&", "||")

# Math intrinsics as data: name -> (float32 spelling, float64 spelling). "{x}" marks the argument
# where the intrinsic is a formula rather than one call; `round` is half-to-even like np.round.
_INTRINSIC_C = {
    "exp": ("expf", "exp"), "log": ("logf", "log"), "sqrt": ("sqrtf", "sqrt"),
    "rsqrt": ("rsqrtf", "1.0 / sqrt({x})"), "sin": ("sinf", "sin"), "cos": ("cosf", "cos"),
    "tanh": ("tanhf", "tanh"), "erf": ("erff", "erf"), "exp2": ("exp2f", "exp2"),
    "log2": ("log2f", "log2"), "floor": ("floorf", "floor"), "ceil": ("ceilf", "ceil"),
    "round": ("rintf", "rint"), "abs": ("fabsf", "fabs"), "isnan": ("isnan", "isnan"),
    "isinf": ("isinf", "isinf"),
    "sigmoid": ("1.0f / (1.0f + expf(-{x}))", "1.0 / (1.0 + exp(-{x}))"),
    # float32 only (no float64 form); device helpers that `device_helpers` defines
    "sin_approx": ("tecc_sin_approx", ""), "cos_approx": ("tecc_cos_approx", ""),
    "exp2_approx": ("tecc_exp2_approx", ""),
    "gelu_erf_approx": ("tecc_gelu_erf_approx", ""), "gelu_tanh_approx": ("tecc_gelu_tanh_approx", ""),
}
# float -> int conversions: PTX cvt.rzi (truncate, saturate to the integer range; NaN gives 0 from
# float32 to int32, the range's minimum otherwise, measured on an H200 -- docs/semantics.md).
# A C cast compiles to the same instruction, but C leaves out-of-range and NaN undefined.
_FLOAT_TO_INT = {
    (dt.float32, dt.int32): "__float2int_rz", (dt.float32, dt.int64): "__float2ll_rz",
    (dt.float64, dt.int32): "__double2int_rz", (dt.float64, dt.int64): "__double2ll_rz",
}
# Float operators printed as calls of device helpers (FLOAT_OP_HELPERS below, overloaded for
# float and double): min / max that propagate NaN, floor division and modulo as NumPy's.
FLOAT_OP_HELPER = {"min": "tecc_min", "max": "tecc_max", "//": "tecc_floordiv", "%": "tecc_mod"}
_SHUFFLE_C = {"shfl_xor": "__shfl_xor_sync", "shfl_down": "__shfl_down_sync", "shfl_idx": "__shfl_sync"}
FULL_WARP_MASK = "0xffffffffu"


def c_type(d: DType) -> str:
    """The C spelling of a tecc dtype (`int`, `long long`, `__half`, ...)."""
    return d.c_name


def wrap(text: Text, min_prec: int) -> str:
    """`text` parenthesized when its precedence is below `min_prec`."""
    code, prec = text
    return code if prec >= min_prec else f"({code})"


def float_literal(value: float, d: DType) -> Text:
    """An exact C literal for a float32 (or half, read as float) or float64 value."""
    single = d != dt.float64
    if math.isnan(value):
        return ("__int_as_float(0x7fc00000)", POSTFIX) if single else (
            "__longlong_as_double(0x7ff8000000000000LL)", POSTFIX)
    if math.isinf(value):
        code = "__int_as_float(0x7f800000)" if single else "__longlong_as_double(0x7ff0000000000000LL)"
        return (code, POSTFIX) if value > 0 else (f"-{code}", UNARY)
    if single:
        # The value the kernel computes with: rounded once from the IR's double to the dtype.
        # NumPy prints the shortest decimal that reads back to that float32 (Steele-White).
        rounded = d.numpy.type(value) if d in HALF_TYPES else np.float32(value)
        if np.isinf(np.float32(rounded)):
            return float_literal(float(np.float32(rounded)), d)
        text = str(np.float32(rounded))
    else:
        text = repr(float(value))
    if "." not in text and "e" not in text:
        text += ".0"
    if single:
        text += "f"
    return (text, UNARY) if text.startswith("-") else (text, ATOM)


def int_literal(value: int, d: DType) -> Text:
    """A C integer literal of the dtype's width; the most negative values are written as
    differences because `-2147483648` is the negation of a too-large positive literal in C."""
    suffix = "LL" if d == dt.int64 else ""
    if value == -(2 ** (d.bits - 1)):
        return f"(-{2 ** (d.bits - 1) - 1}{suffix} - 1)", ATOM
    text = f"{value}{suffix}"
    return (text, UNARY) if value < 0 else (text, ATOM)


class ExprEmitter:
    """Turns expressions into C text for one kernel.

    `var_name` and `buffer_name` give the C names the kernel emitter chose; `wide` is the set of
    global buffers indexed in 64-bit arithmetic; `ranges` holds what is known about the variables
    in scope; `overrides` maps expression nodes (by identity) to ready text, which the vectorizer
    uses to read one lane of a vector register instead of memory."""

    def __init__(self, var_name: Callable[[Var], str], buffer_name: Callable[[Buffer], str],
                 wide: set[Buffer], ranges: RangeEnv) -> None:
        self.var_name = var_name
        self.buffer_name = buffer_name
        self.wide = wide
        self.ranges = ranges
        self.overrides: dict[int, str] = {}
        # the site number of a data-dependent index check in the module's error record
        # (tecc/ir/index_checks.py); the kernel emitter sets it
        self.check_code: Callable[[IndexCheck], int] = lambda e: -1
        # offset()'s answers by the identity of its arguments, which the entry keeps alive (an
        # unrolled tile reads the same elements through many statements)
        self._offsets: dict[tuple[Any, ...], tuple[Any, ...]] = {}

    # ---- entry points ---------------------------------------------------------------------
    def code(self, e: Expr) -> str:
        """`e` as a complete C expression of its own C type."""
        return self.emit(e)[0]

    def emit(self, e: Expr) -> Text:
        """`e` in its own C type; half values are `__half` / `__nv_bfloat16`."""
        hit = self.overrides.get(id(e))
        if hit is not None:
            return hit, ATOM
        method = getattr(self, "_" + type(e).__name__, None)
        if method is None:
            raise CompileError(
                f"the CUDA emitter cannot emit {type(e).__name__} ({e}); tensor-expression nodes "
                "(Reduce, TensorRead) must be lowered to the loop-nest IR first")
        text: Text = method(e)
        return text

    def as_float(self, e: Expr) -> Text:
        """A half-typed `e` as the float that holds its (already rounded) value exactly;
        any other `e` as it is. Half math reads its operands through this."""
        if e.dtype not in HALF_TYPES:
            return self.emit(e)
        if isinstance(e, Const) and id(e) not in self.overrides:
            return float_literal(float(e.value), e.dtype)
        return f"{_HALF_CONVERT[e.dtype][1]}({self.code(e)})", POSTFIX

    def to_half(self, d: DType, float_value: Text) -> Text:
        """Round a float to the half type `d` (round to nearest even)."""
        return f"{_HALF_CONVERT[d][0]}({float_value[0]})", POSTFIX

    # ---- leaves ---------------------------------------------------------------------------
    def _Const(self, e: Const) -> Text:
        if e.dtype.is_bool:
            return ("true" if e.value else "false"), ATOM
        if e.dtype.is_int:
            return int_literal(int(e.value), e.dtype)
        if e.dtype in HALF_TYPES:
            literal = float_literal(float(e.value), e.dtype)[0]
            return f"{_HALF_CONVERT[e.dtype][0]}({literal})", POSTFIX
        return float_literal(float(e.value), e.dtype)

    def _Var(self, e: Var) -> Text:
        return self.var_name(e), ATOM

    def _BufferLoad(self, e: BufferLoad) -> Text:
        return self.buffer_ref(e.buffer, e.indices), POSTFIX

    def buffer_ref(self, buffer: Buffer, indices: tuple[Expr, ...]) -> str:
        """`name[offset]`, the multi-dimensional index flattened with the buffer's strides."""
        return f"{self.buffer_name(buffer)}[{self.code(self.offset(buffer, indices))}]"

    def offset(self, buffer: Buffer, indices: tuple[Expr, ...], strides: tuple[Expr, ...] | None = None,
               through_layout: bool = True) -> Expr:
        """The flat element offset of `buffer[indices]` as an IR expression, in int64 when the
        buffer is indexed in 64-bit arithmetic (the casts print as implicit promotions).
        `strides`: the buffer's strides as a branch knows them (a launch-tested copy's unit
        stride as the constant 1, matrix.async_copy), else its own. `through_layout=False`:
        the logical offset of a swizzled buffer, before its layout."""
        key = (id(buffer), tuple(map(id, indices)), None if strides is None else tuple(map(id, strides)),
               through_layout)
        hit = self._offsets.get(key)
        if hit is None:
            hit = self._offsets[key] = (buffer, indices, strides, self._offset(buffer, indices, strides, through_layout))
        return hit[-1]  # type: ignore[no-any-return]

    def _offset(self, buffer: Buffer, indices: tuple[Expr, ...], strides: tuple[Expr, ...] | None,
                through_layout: bool) -> Expr:
        index_type = dt.int64 if buffer in self.wide else None
        total: Expr | None = None
        whole: Expr | None = None  # terms that move a swizzled offset by whole periods
        layout = buffer.layout if through_layout else None
        for index, stride in zip(indices, strides if strides is not None else buffer.effective_strides()):
            if index_type is not None or (index.dtype != dt.int64 and _reads_memory(index)):
                # a data-dependent index is multiplied in 64 bits: its value is only known to be in
                # range where its IndexCheck held (docs/codegen.md, "Data-dependent indices")
                index, stride = cast(index, dt.int64), cast(stride, dt.int64)
            term = index * stride
            step = const_int(stride)
            if layout is not None and step is not None and layout.moves_whole_periods(step):
                whole = term if whole is None else whole + term
            else:
                total = term if total is None else total + term
        if layout is not None:  # a swizzled shared buffer: logical -> physical offset
            # apply(x + whole) == apply(x) + whole (Swizzle.moves_whole_periods): the ring's stage
            # stays outside the XOR, so the swizzle of the rest is invariant in the k loop and
            # nvcc computes it once instead of every k-tile
            swizzled = layout.apply(total) if total is not None else Const(0, dt.int32)
            return swizzled if whole is None else whole + swizzled
        return total if total is not None else Const(0, dt.int32)

    # ---- operators ------------------------------------------------------------------------
    @staticmethod
    def _implicit_widening(a: Expr, b: Expr) -> tuple[Expr, Expr]:
        """Operands of an int64 operation with the int32 -> int64 casts that C's usual arithmetic
        conversions perform anyway left out: one long long operand widens the other, so
        `i * 64LL + j` reads as written. When both are such casts the left one stays."""
        def widening(x: Expr) -> bool:
            return isinstance(x, Cast) and x.dtype == dt.int64 and x.a.dtype == dt.int32

        if widening(b):
            b = b.a  # type: ignore[attr-defined]
        elif widening(a):
            a = a.a  # type: ignore[attr-defined]
        return a, b

    def _Binary(self, e: Binary) -> Text:
        a, b = e.a, e.b
        if e.dtype == dt.int64 and e.op not in ("min", "max", "fmin", "fmax"):  # overloads want one type
            a, b = self._implicit_widening(a, b)
        if e.dtype in HALF_TYPES:
            return self.to_half(e.dtype, self._float_binary(e))
        if e.dtype.is_int and e.op in ("//", "%"):
            return self._floor_div_mod(e.op, a, b)
        if e.op in ("min", "max", "fmin", "fmax", "pow", "//", "%"):
            return self._call_binary(e.op, e.dtype, self.emit(a)[0], self.emit(b)[0])
        op = e.op
        if e.dtype.is_bool:
            op = {"&": "&&", "|": "||", "^": "!="}.get(op, op)
        right = self.emit(b)
        if self._reassociates(e, b):
            return f"{wrap(self.emit(a), _INFIX_PREC[op])} {op} {right[0]}", _INFIX_PREC[op]
        return self._infix(op, self.emit(a), right)

    @staticmethod
    def _reassociates(e: Binary, right: Expr) -> bool:
        """Integer `a + (b + c)`, `a + (b - c)` and `a * (b * c)` print without parentheses:
        wrapping integer arithmetic is associative, so C's left-to-right grouping computes the
        same value (only when `right` has the parent's dtype, so no widening moves). For `*`
        every operand on the left spine of `right` must be a product too: `a * (b / c * d)`
        printed bare would read `(a * b) / c * d`, and integer division does not reassociate."""
        if not e.dtype.is_int or not isinstance(right, Binary) or right.dtype != e.dtype:
            return False
        if e.op == "+":
            return right.op in ("+", "-")
        if e.op != "*" or right.op != "*":
            return False
        spine: Expr = right
        while isinstance(spine, Binary) and spine.dtype == e.dtype and spine.op in ("*", "//", "%"):
            if spine.op != "*":
                return False
            spine = spine.a
        return True

    def _float_binary(self, e: Binary) -> Text:
        """A half-typed Binary computed in float, before the rounding back to half."""
        a, b = self.as_float(e.a), self.as_float(e.b)
        if e.op in ("min", "max", "fmin", "fmax", "pow", "//", "%"):
            return self._call_binary(e.op, dt.float32, a[0], b[0])
        return self._infix(e.op, a, b)

    @staticmethod
    def _call_binary(op: str, d: DType, a: str, b: str) -> Text:
        if d.is_int:
            return f"{op}({a}, {b})", POSTFIX
        if op in FLOAT_OP_HELPER:  # device helpers, overloaded for float and double
            return f"{FLOAT_OP_HELPER[op]}({a}, {b})", POSTFIX
        single = d != dt.float64
        name = {"fmin": "fmin", "fmax": "fmax", "pow": "pow"}[op] + ("f" if single else "")
        return f"{name}({a}, {b})", POSTFIX

    @staticmethod
    def _infix(op: str, a: Text, b: Text) -> Text:
        prec = _INFIX_PREC[op]
        if op in _LOGIC_OPS:
            # Comparisons and arithmetic stay bare inside logical/bitwise operators; another
            # logical/bitwise operator gets parentheses for the reader (and -Wparentheses),
            # except the same operator chaining on the left: a && b && c.
            bare = BAND + 1
            left = a[0] if a[1] >= bare or a[1] == prec else f"({a[0]})"
            return f"{left} {op} {wrap(b, bare)}", prec
        # Left-associative: the right operand needs parentheses at equal precedence.
        return f"{wrap(a, prec)} {op} {wrap(b, prec + 1)}", prec

    def _floor_div_mod(self, op: str, a: Expr, b: Expr) -> Text:
        text = self._floor_div_mod_nonzero(op, a, b)
        if self.ranges.is_positive(b):
            return text
        # x // 0 and x % 0 are 0 (NumPy's value); C leaves division by zero undefined. The test
        # costs a compare and a select next to the ~20 instructions of a division.
        return f"({wrap(self.emit(b), EQ)} == 0 ? 0 : {wrap(text, COND)})", ATOM

    def _floor_div_mod_nonzero(self, op: str, a: Expr, b: Expr) -> Text:
        """Floor `a // b` or `a % b` for a divisor that is not 0 (INT_MIN // -1 gives INT_MIN
        and INT_MIN % -1 gives 0 on the GPU, as they do in NumPy)."""
        num, den = wrap(self.emit(a), MUL), wrap(self.emit(b), MUL + 1)
        if self.ranges.is_nonnegative(a) and self.ranges.is_nonnegative(b):
            return f"{num} {'/' if op == '//' else '%'} {den}", MUL
        if self.ranges.is_nonnegative(b):
            # Divisor > 0: truncation rounds a negative quotient up by one exactly when the
            # remainder is negative.
            if op == "//":
                return f"{num} / {den} - ({num} % {den} < 0)", ADD
            return f"({num} % {den} + {den}) % {den}", MUL
        # Any signs: floor differs from truncation when the remainder is non-zero and its sign
        # differs from the divisor's (C99 6.5.5: the remainder takes the dividend's sign).
        fix = f"{num} % {den} != 0 && ({num} % {den} < 0) != ({den} < 0)"
        if op == "//":
            return f"{num} / {den} - ({fix})", ADD
        return f"{num} % {den} + ({fix} ? {den} : 0)", ADD

    def _Compare(self, e: Compare) -> Text:
        a, b = e.a, e.b
        if a.dtype == dt.int64:
            a, b = self._implicit_widening(a, b)
        if e.a.dtype in HALF_TYPES:
            return self._infix(e.op, self.as_float(a), self.as_float(b))
        return self._infix(e.op, self.emit(a), self.emit(b))

    def _Not(self, e: Not) -> Text:
        sign = "!" if e.dtype.is_bool else "~"
        return f"{sign}{wrap(self.emit(e.a), UNARY)}", UNARY

    def _Select(self, e: Select) -> Text:
        cond = wrap(self.emit(e.cond), LOR)
        return f"({cond} ? {self.code(e.a)} : {wrap(self.emit(e.b), COND)})", ATOM

    # ---- conversions ----------------------------------------------------------------------
    def _Cast(self, e: Cast) -> Text:
        to, src = e.dtype, e.a.dtype
        if to in HALF_TYPES:
            convert = _HALF_CONVERT[to]
            if src == dt.float32:
                return f"{convert[0]}({self.code(e.a)})", POSTFIX
            if src == dt.float64:
                return f"{convert[2]}({self.code(e.a)})", POSTFIX
            if src in HALF_TYPES:  # float16 <-> bfloat16: exact to float, one rounding
                return self.to_half(to, self.as_float(e.a))
            if src == dt.int64:
                return f"{convert[4]}({self.code(e.a)})", POSTFIX
            # int32 and bool (promoted to int) convert with one correct rounding.
            return f"{convert[3]}({self.code(e.a)})", POSTFIX
        if src in HALF_TYPES:
            value = self.as_float(e.a)
            if to == dt.float32:
                return value
            if to.is_int:
                return f"{_FLOAT_TO_INT[(dt.float32, to)]}({value[0]})", POSTFIX
            return f"static_cast<{c_type(to)}>({value[0]})", POSTFIX
        if src.is_float and to.is_int:
            return f"{_FLOAT_TO_INT[(src, to)]}({self.code(e.a)})", POSTFIX
        return f"static_cast<{c_type(to)}>({self.code(e.a)})", POSTFIX

    def _RandomUniform(self, e: RandomUniform) -> Text:
        """`tecc_rand_uniform(seed, offset, n)` (codegen/philox.py); an int32 operand widened to
        int64 is passed as it is, the parameter's `long long` widens it."""
        def operand(x: Expr) -> str:
            if isinstance(x, Cast) and x.a.dtype == dt.int32:
                x = x.a
            return self.code(x)

        return philox.rand_uniform_call(operand(e.seed), operand(e.offset), operand(e.index)), POSTFIX

    # ---- intrinsics -----------------------------------------------------------------------
    def _IndexCheck(self, e: IndexCheck) -> Text:
        """`tecc_index_ok(value, extent, site)`: one unsigned compare inline, the error record
        written by a call that is not inlined (device_helpers: INDEX_CHECK_HELPERS)."""
        code = self.check_code(e)
        if code < 0:
            raise CompileError(f"the index check {e} of {e.tensor} has no site in the module's error record")
        return f"tecc_index_ok({self.code(e.value)}, {self.code(e.extent)}, {code})", POSTFIX

    def _Call(self, e: Call) -> Text:
        if e.name in WARP_INTRINSICS:
            return self._shuffle(e)
        if e.name in MEMORY_INTRINSICS:
            return self._memory(e)
        if e.name in OPAQUE_INTRINSICS:
            return f"tecc_opaque({self.code(e.args[0])})", POSTFIX
        x = e.args[0]
        if x.dtype.is_int:
            if e.name != "abs":
                raise CompileError(f"the CUDA emitter has no integer form of {e.name} in {e}")
            return f"{'llabs' if x.dtype == dt.int64 else 'abs'}({self.code(x)})", POSTFIX
        single, double = _INTRINSIC_C[e.name]
        if e.name in APPROX_INTRINSICS and x.dtype == dt.float64:
            raise CompileError(f"{e.name} has no float64 form ({e}); it is for float32 and 16-bit floats")
        if x.dtype in HALF_TYPES:
            value = self._apply(single, self.as_float(x))
            if e.dtype.is_bool:  # isnan / isinf
                return value
            return self.to_half(x.dtype, value)
        return self._apply(single if x.dtype == dt.float32 else double, self.emit(x))

    @staticmethod
    def _apply(spelling: str, arg: Text) -> Text:
        if "{x}" in spelling:
            # The formula negates its argument: keep `-(-1.0f)` from reading as `--1.0f`.
            negated = "-{x}" in spelling
            inner = f"({arg[0]})" if negated and arg[1] <= UNARY else arg[0]
            return spelling.replace("{x}", inner), MUL
        return f"{spelling}({arg[0]})", POSTFIX

    def _shuffle(self, e: Call) -> Text:
        """Warp shuffles over all 32 lanes (mask 0xffffffff, width 32; see WARP_INTRINSICS).
        CUDA overloads them for int, long long, float, double, __half and __nv_bfloat16; a bool
        travels as an int, an fp8 value as the float that holds it exactly."""
        value, lane = e.args
        name = _SHUFFLE_C[e.name]
        if value.dtype.is_bool:
            return f"{name}({FULL_WARP_MASK}, static_cast<int>({self.code(value)}), {self.code(lane)}) != 0", EQ
        if value.dtype in dt.FP8_DTYPES:  # no fp8 overload: travels as the float holding it exactly
            moved = f"{name}({FULL_WARP_MASK}, {self.as_float(value)[0]}, {self.code(lane)})"
            return self.to_half(value.dtype, (moved, POSTFIX))
        return f"{name}({FULL_WARP_MASK}, {self.code(value)}, {self.code(lane)})", POSTFIX

    def _memory(self, e: Call) -> Text:
        """MEMORY_INTRINSICS: `__threadfence()` (PTX `fence.sc.gpu` / `membar.gl`),
        `atomicAdd(&element, v)` (`atom.global.add`), `__ldcg(&element)` (`ld.global.cg`)."""
        if e.name == "thread_fence":
            return "__threadfence()", POSTFIX
        element = e.args[0]
        assert isinstance(element, BufferLoad)  # Call checked it
        address = f"&{self.buffer_ref(element.buffer, element.indices)}"
        if e.name == "atomic_add_pair":
            return f"tecc_red_add_pair({address}, {self.code(e.args[1])}, {self.code(e.args[2])})", POSTFIX
        if e.name == "atomic_add":
            if element.dtype == dt.int64:  # CUDA's 64-bit integer atomicAdd is unsigned: the same bits
                added = (f"atomicAdd(reinterpret_cast<unsigned long long*>({address}), "
                         f"static_cast<unsigned long long>({self.code(e.args[1])}))")
                return f"static_cast<long long>({added})", POSTFIX
            return f"atomicAdd({address}, {self.code(e.args[1])})", POSTFIX
        return f"__ldcg({address})", POSTFIX


# ---- device helpers ---------------------------------------------------------------------------
def _f(value: float) -> str:
    return float_literal(value, dt.float32)[0]


def _trig_helper(name: str, precise: str, cosine: bool) -> str:
    """`tecc_sin_approx` / `tecc_cos_approx`: the steps of tecc/ir/approx.py, constants from there.
    The fast result is computed for every x and replaced by the precise one past the range (one
    branch around the slow path: one instruction per call fewer than returning early, in SASS)."""
    magic = _f(approx.ROUND_MAGIC)
    if cosine:
        reduce = (f"  const float t = fmaf(x, {_f(approx.INV_PI)}, -0.5f) + {magic};"
                  "  // 1.5 * 2^23 + rint(x / pi - 1/2)\n"
                  f"  const float m = (t - {magic}) + 0.5f;  // x = m * pi + r\n")
        flip = "(__float_as_uint(t) << 31) ^ 0x80000000u);  // cos x = sin((-1)^(n+1) r)"
    else:
        reduce = (f"  const float t = fmaf(x, {_f(approx.INV_PI)}, {magic});  // 1.5 * 2^23 + rint(x / pi)\n"
                  f"  const float m = t - {magic};  // x = m * pi + r\n")
        flip = "(__float_as_uint(t) << 31));  // sin x = sin((-1)^n r)"
    return (f"__device__ __forceinline__ float {name}(float x) {{\n"
            + reduce
            + f"  float r = fmaf(m, {_f(-approx.PI_HI)}, x);  // exact (but for cos, |x| < 1)\n"
            f"  r = fmaf(m, {_f(-approx.PI_LO)}, r);\n"
            f"  r = __uint_as_float(__float_as_uint(r) ^ {flip}\n"
            f"  float y = tecc_sin_poly(r);\n"
            f"  if (fabsf(x) > {_f(approx.FAST_RANGE)}) y = {precise}(x);  // and inf; NaN stays NaN\n"
            f"  return y;\n"
            f"}}\n")


def _min_max_helpers(name: str, less: str) -> str:
    # float: PTX max.NaN / min.NaN (sm_80+), one instruction where the comparison form takes three;
    # the bf16 softmax's row max lost 7-10% of its bandwidth to the three (H200, 2026-11-25).
    # double has no .NaN form.
    ptx = "max" if less == ">" else "min"
    return (
        f"__device__ __forceinline__ float {name}(float a, float b) {{\n"
        f"#if __CUDA_ARCH__ >= 800\n"
        f"  float r; asm(\"{ptx}.NaN.f32 %0, %1, %2;\" : \"=f\"(r) : \"f\"(a), \"f\"(b)); return r;\n"
        f"#else\n"
        f"  return (a {less} b || a != a) ? a : b;\n"
        f"#endif\n"
        f"}}\n"
        f"__device__ __forceinline__ double {name}(double a, double b) {{ return (a {less} b || a != a) ? a : b; }}\n")


def _floor_div_helpers() -> str:
    """NumPy's float floor division and modulo (npy_divmod): from the exact fmod, so the
    quotient is the floor of the exact a / b rounded, and the remainder has b's sign."""
    out = ""
    for t, f, zero in (("float", "f", "0.0f"), ("double", "", "0.0")):
        out += (
            f"__device__ __forceinline__ {t} tecc_floordiv({t} a, {t} b) {{\n"
            f"  if (b == 0) return a / b;  // inf or NaN, as NumPy\n"
            f"  const {t} mod = fmod{f}(a, b);\n"
            f"  {t} div = (a - mod) / b;  // very nearly an integer\n"
            f"  if (mod != 0 && (b < 0) != (mod < 0)) div -= 1;\n"
            f"  if (div == 0) return copysign{f}({zero}, a / b);\n"
            f"  {t} floordiv = floor{f}(div);\n"
            f"  if (div - floordiv > 0.5{f}) floordiv += 1;\n"
            f"  return floordiv;\n"
            f"}}\n"
            f"__device__ __forceinline__ {t} tecc_mod({t} a, {t} b) {{\n"
            f"  const {t} mod = fmod{f}(a, b);  // NaN for b == 0\n"
            f"  if (b == 0) return mod;\n"
            f"  if (mod == 0) return copysign{f}({zero}, b);\n"
            f"  return (b < 0) != (mod < 0) ? mod + b : mod;\n"
            f"}}\n")
    return out


# Helper name -> its definitions (float and double overloads), printed once per translation unit
# when a kernel uses it (`device_helpers`).
FLOAT_OP_HELPERS = {
    "tecc_max": "// max of floats: NaN when either operand is NaN, as NumPy's maximum (fmaxf, which\n"
                "// tc.fmax and nanmax use, drops a NaN operand).\n" + _min_max_helpers("tecc_max", ">"),
    "tecc_min": "// min of floats: NaN when either operand is NaN, as NumPy's minimum (fminf drops it).\n"
                + _min_max_helpers("tecc_min", "<"),
    "tecc_floordiv": "// Float // and % as NumPy computes them (npy_divmod).\n" + _floor_div_helpers(),
}
FLOAT_OP_HELPERS["tecc_mod"] = FLOAT_OP_HELPERS["tecc_floordiv"]


# The error record of data-dependent index checks and the check itself (tecc/ir/index_checks.py
# fixes the record's layout; docs/runtime.md, "Data-dependent indices"). The check is inline and
# costs one unsigned 64-bit compare and a predicated branch; what a failure does is a call that is
# not inlined, so the fast path stays short: the first failure of a launch sequence wins the
# atomicCAS on word 0 and fills the rest (the host reads the record only after the launches).
INDEX_CHECK_HELPERS = (
    "// Data-dependent index checks: the first index found outside its tensor (docs/runtime.md).\n"
    f"__device__ long long {RECORD_SYMBOL}[{RECORD_WORDS}];  // site + 1 (0: none), value, extent, block, thread\n"
    "__device__ __noinline__ void tecc_index_failed(long long value, long long extent, int site) {\n"
    f"  unsigned long long* record = reinterpret_cast<unsigned long long*>({RECORD_SYMBOL});\n"
    "  if (atomicCAS(record, 0ull, static_cast<unsigned long long>(site) + 1ull) == 0ull) {\n"
    f"    {RECORD_SYMBOL}[1] = value;\n"
    f"    {RECORD_SYMBOL}[2] = extent;\n"
    f"    {RECORD_SYMBOL}[3] = (static_cast<long long>(blockIdx.z) * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;\n"
    f"    {RECORD_SYMBOL}[4] = (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;\n"
    "  }\n"
    "}\n"
    "__device__ __forceinline__ bool tecc_index_ok(long long value, long long extent, int site) {\n"
    "  // unsigned: a negative value is out of range too (no wrap)\n"
    "  if (static_cast<unsigned long long>(value) < static_cast<unsigned long long>(extent)) return true;\n"
    "  tecc_index_failed(value, extent, site);\n"
    "  return false;\n"
    "}\n")


def _reads_memory(e: Expr) -> bool:
    """Whether an index reads a buffer (a data-dependent index)."""
    return bool(buffers_read(e))


def device_helpers(intrinsics: set[str]) -> list[str]:
    """The `__device__` functions a translation unit calling `intrinsics` (Call names, plus
    the FLOAT_OP_HELPER names of float operators and philox.RAND_HELPER for tc.rand) needs, each once, in dependency order."""
    helpers: list[str] = []
    if "index_ok" in intrinsics:
        helpers.append(INDEX_CHECK_HELPERS)
    for name, text in FLOAT_OP_HELPERS.items():
        if name in intrinsics and text not in helpers:
            helpers.append(text)
    if philox.RAND_HELPER in intrinsics:
        helpers.append(philox.DEVICE_HELPERS)
    if "opaque" in intrinsics:
        helpers.append(
            "// opaque (tecc/ir/expr.py): x computed again here; nothing derived from it is hoisted above.\n"
            "__device__ __forceinline__ int tecc_opaque(int x) {\n"
            "  int y;\n"
            "  asm volatile(\"mov.b32 %0, %1;\" : \"=r\"(y) : \"r\"(x));\n"
            "  return y;\n"
            "}\n")
    if "atomic_add_pair" in intrinsics:
        helpers.append(
            "// atomic_add_pair (tecc/ir/expr.py): two float32 additions in one 8-byte reduction (sm_90).\n"
            "__device__ __forceinline__ int tecc_red_add_pair(float* p, float a, float b) {\n"
            "  asm volatile(\"red.global.add.v2.f32 [%0], {%1, %2};\" :: \"l\"(p), \"f\"(a), \"f\"(b) : \"memory\");\n"
            "  return 0;\n"
            "}\n")
    if "exp2_approx" in intrinsics:
        helpers.append(
            "// exp2_approx (tecc/ir/expr.py): one MUFU.EX2, subnormals flushed to zero.\n"
            "__device__ __forceinline__ float tecc_exp2_approx(float x) {\n"
            "  float y;\n"
            "  asm(\"ex2.approx.ftz.f32 %0, %1;\" : \"=f\"(y) : \"f\"(x));\n"
            "  return y;\n"
            "}\n")
    helpers += gelu_helpers(intrinsics, _f)
    if not intrinsics & {"sin_approx", "cos_approx"}:
        return helpers
    s1, s2, s3, s4 = (_f(c) for c in approx.SIN_POLY)
    helpers += [
        "// sin_approx / cos_approx (tecc/ir/approx.py): for values rounded to a 16-bit float at once.\n"
        "// Relative error <= 2^-21.9 plus 1.5e-10 absolute for |x| <= 2^17, the precise sinf/cosf beyond.\n"
        "__device__ __forceinline__ float tecc_sin_poly(float r) {  // sin(r) for |r| <= pi/2 + 0.02\n"
        "  const float r2 = r * r;\n"
        f"  float q = fmaf(r2, {s4}, {s3});\n"
        f"  q = fmaf(q, r2, {s2});\n"
        f"  q = fmaf(q, r2, {s1});\n"
        "  q = fmaf(q, r2, 1.0f);\n"
        "  return r * q;  // r * (...), not fma(r^3, ., r): sin(-0) stays -0\n"
        "}\n"]
    if "sin_approx" in intrinsics:
        helpers.append(_trig_helper("tecc_sin_approx", "sinf", cosine=False))
    if "cos_approx" in intrinsics:
        helpers.append(_trig_helper("tecc_cos_approx", "cosf", cosine=True))
    return helpers
