"""Scalar expressions: the node classes shared by tensor expressions and the loop-nest IR.

Part of tecc.ir.expr (which re-exports every name here, with the builders of arith.py and the
walks over expressions); this module is the nodes' reference manual.

Nodes are immutable and hash-consed: building the same expression twice gives the very same
object, so structural equality is identity (`a is b`), hashing is free, and common-subexpression
elimination is a dictionary lookup. Variables (`Var`) are the one exception: two variables are the
same only if they are the same object, whatever their names.

`==` and `!=` on expressions build comparison nodes (so `tc.where(x == 0, ...)` works); such a node
is truthy when its two sides are the same expression, which keeps `expr in list` and dict lookups
meaningful. Any other use of an expression as a Python bool raises.

Integer `//` and `%` are *floor* division and modulo (Python and NumPy semantics; the remainder has
the divisor's sign). `/` is only defined on floats. docs/semantics.md has the numeric semantics
every target implements; in short:
- integer `+ - *`, negation, `abs` and integer narrowing casts wrap (two's complement);
- integer `x // 0` and `x % 0` are 0 (NumPy's result), `INT_MIN // -1` is INT_MIN (wraps);
- float `max`/`min` propagate NaN (NumPy's maximum/minimum); `fmax`/`fmin` drop it (fmaxf/fminf);
- float -> int casts truncate toward zero and saturate; NaN gives 0 (PTX `cvt.rzi`).
"""

from __future__ import annotations

import math
import threading
import weakref
from typing import Any, Callable, NamedTuple, Union

from . import dtype as dt
from .dtype import DType
from .errors import DTypeError, ShapeError, TeccError
from .printing import to_text

ExprLike = Union["Expr", int, float, bool]


class Builders(NamedTuple):
    """The functions the operators of `Expr` build nodes with (tecc.ir.arith: dtype promotion and
    constant folding). arith.py needs the node classes and the operators need arith, so arith
    installs itself here when it is imported (tecc.ir.expr imports it), instead of this module
    importing arith."""

    binary: Callable[[str, ExprLike, ExprLike], "Expr"]
    compare: Callable[[str, ExprLike, ExprLike], "Expr"]
    call: Callable[..., "Expr"]


_builders: Builders | None = None


def install_builders(builders: Builders) -> None:
    """Make `builders` the functions the operators of Expr use (arith.py calls this once)."""
    global _builders
    _builders = builders


def _build() -> Builders:
    if _builders is None:
        raise TeccError("expression operators need tecc.ir.arith, which tecc.ir.expr imports; import tecc.ir")
    return _builders

_INTERN: "weakref.WeakValueDictionary[tuple[Any, ...], Expr]" = weakref.WeakValueDictionary()
_INTERN_LOCK = threading.Lock()
# the table's own dict of weak references (WeakValueDictionary.get is a Python method around it;
# the table is never iterated, so no removal is pending)
_INTERN_REFS: dict[tuple[Any, ...], Any] = getattr(_INTERN, "data")


def _interned(key: tuple[Any, ...]) -> "Expr | None":
    ref = _INTERN_REFS.get(key)
    return ref() if ref is not None else None


def _key_part(value: object) -> object:
    """The part of an intern key that stands for one constructor argument: an expression by its
    identity (a bare int: every int argument is tagged), a value by its value."""
    if isinstance(value, Expr):
        return id(value)
    if isinstance(value, tuple):
        return ("t",) + tuple(_key_part(v) for v in value)
    if isinstance(value, bool):
        return ("b", value)
    if isinstance(value, int):
        return ("i", value)
    if isinstance(value, float):
        return ("f", repr(value))
    if isinstance(value, (str, DType)) or value is None:
        return value
    return ("o", id(value))  # tensors, buffers: identity objects


# the operators of Expr (below), each a method built from the builders' binary / compare
_Operator = Callable[["Expr", ExprLike], "Expr"]


def _binary(op: str) -> tuple[_Operator, _Operator]:
    """Expr's method for `op` and its reflected form (`o op self`)."""
    def forward(self: "Expr", o: ExprLike) -> "Expr":
        return _build().binary(op, self, o)

    def reflected(self: "Expr", o: ExprLike) -> "Expr":
        return _build().binary(op, o, self)

    return forward, reflected


def _compare(op: str) -> _Operator:
    def compare(self: "Expr", o: ExprLike) -> "Expr":
        return _build().compare(op, self, o)

    return compare


class Expr:
    """Base of every scalar expression. `dtype` is the scalar type it evaluates to."""

    __slots__ = ("dtype", "__weakref__", "_kids", "_vars", "_bufs")
    _fields: tuple[str, ...] = ()
    dtype: DType
    _kids: tuple["Expr", ...]    # `children`, found once (a node never changes)
    _vars: frozenset["Var"]      # its free variables (tecc.ir.expr.free_vars), found once
    _bufs: frozenset[Any]        # the buffers it reads (tecc.ir.expr.buffers_read), found once

    def __new__(cls, *args: Any) -> "Expr":
        key = (cls, *map(_key_part, args))
        hit = _interned(key)
        if hit is not None:
            return hit
        node = object.__new__(cls)
        node._init(*args)
        with _INTERN_LOCK:   # two threads building the same node get one (the planner's compile checks run in threads)
            hit = _INTERN.get(key)
            if hit is not None:
                return hit
            _INTERN[key] = node
        return node

    def _init(self, *args: Any) -> None:  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), tuple(getattr(self, f) for f in self._fields))

    def __setattr__(self, name: str, value: Any) -> None:
        if hasattr(self, name):
            raise AttributeError(f"{type(self).__name__} is immutable")
        object.__setattr__(self, name, value)

    @property
    def children(self) -> tuple["Expr", ...]:
        """The expressions among the node's fields, in order (the walks' and visitors' edges);
        found once per node: a hash-consed subexpression is walked many times."""
        try:
            return self._kids
        except AttributeError:
            kids = self._children()
            object.__setattr__(self, "_kids", kids)
            return kids

    def _children(self) -> tuple["Expr", ...]:
        out: list[Expr] = []
        for f in self._fields:
            v = getattr(self, f)
            if isinstance(v, Expr):
                out.append(v)
            elif isinstance(v, tuple):
                out.extend(x for x in v if isinstance(x, Expr))
        return tuple(out)

    # ---- printing -------------------------------------------------------------------------
    def __str__(self) -> str:
        return to_text(self)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self} : {self.dtype}>"

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)

    # ---- Python operators -----------------------------------------------------------------
    __add__, __radd__ = _binary("+")
    __sub__, __rsub__ = _binary("-")
    __mul__, __rmul__ = _binary("*")
    __truediv__, __rtruediv__ = _binary("/")
    __floordiv__, __rfloordiv__ = _binary("//")
    __mod__, __rmod__ = _binary("%")
    __pow__, __rpow__ = _binary("pow")
    __and__, __rand__ = _binary("&")
    __or__, __ror__ = _binary("|")
    __xor__, __rxor__ = _binary("^")
    __lt__, __le__, __gt__, __ge__ = (_compare(op) for op in ("<", "<=", ">", ">="))

    def __neg__(self) -> "Expr":
        if self.dtype.is_bool:
            raise DTypeError(f"cannot negate the bool expression {self}; use ~ for logical not")
        if not isinstance(self, Const):
            return _build().binary("-", Const(0, self.dtype), self)
        if self.dtype.is_int:
            return Const(dt.wrap_int(-int(self.value), self.dtype), self.dtype)  # -INT_MIN wraps
        return Const(-self.value, self.dtype)

    def __pos__(self) -> "Expr":
        return self

    def __abs__(self) -> "Expr":
        return _build().call("abs", self)

    def __eq__(self, o: object) -> "Expr":  # type: ignore[override]
        if not isinstance(o, (Expr, int, float, bool)):
            return NotImplemented
        return _build().compare("==", self, o)

    def __ne__(self, o: object) -> "Expr":  # type: ignore[override]
        if not isinstance(o, (Expr, int, float, bool)):
            return NotImplemented
        return _build().compare("!=", self, o)

    __hash__ = object.__hash__

    def __invert__(self) -> "Expr":
        if not (self.dtype.is_bool or self.dtype.is_int):
            raise DTypeError(f"~ needs a bool or integer expression, got {self.dtype} in {self}")
        return Not(self)

    def __bool__(self) -> bool:
        raise TeccError(
            f"the symbolic expression {self} has no Python truth value; "
            "use tc.where(cond, a, b) for a choice inside a kernel"
        )

    def __index__(self) -> int:
        if isinstance(self, Const) and self.dtype.is_int:
            return int(self.value)
        raise TeccError(f"the symbolic expression {self} is not a Python integer")

    def __int__(self) -> int:
        return self.__index__()


class Const(Expr):
    """A literal of a scalar dtype. Floats are stored as Python floats, ints as Python ints."""

    __slots__ = ("value",)
    _fields = ("value", "dtype")
    value: Union[int, float, bool]

    def __new__(cls, value: Union[int, float, bool], dtype: DType) -> "Const":
        if type(dtype) is DType:   # a constant built before: its key, without the checks it passed then
            kind = type(value)
            if kind is int and dtype.is_int:
                hit = _interned((cls, ("i", value), dtype))
            elif kind is float and dtype.is_float:
                hit = _interned((cls, ("f", repr(value)), dtype))
            else:
                hit = None
            if hit is not None:
                return hit  # type: ignore[return-value]
        dtype = dt.as_dtype(dtype)
        if dtype.is_bool:
            value = bool(value)
        elif dtype.is_int:
            if isinstance(value, float) and not float(value).is_integer():
                raise DTypeError(f"the constant {value!r} is not an integer but was given dtype {dtype}; "
                                 f"tc.cast(x, '{dtype}') converts a float expression (truncating)")
            value = int(value)
            dt.check_constant_fits(value, dtype)
        else:
            dt.check_constant_fits(value, dtype)
            value = float(value)
        return super().__new__(cls, value, dtype)  # type: ignore[return-value]

    def _init(self, value: Union[int, float, bool], dtype: DType) -> None:
        object.__setattr__(self, "value", value)
        object.__setattr__(self, "dtype", dtype)


class Var(Expr):
    """A named scalar variable: a symbolic size (`tc.var("M")`), a loop index, or a stride.

    Variables compare by identity: two `Var("i")` are different variables. `kind` says which role
    the variable plays: 'size' (a symbolic dimension, a kernel parameter), 'index' (a compute
    axis or loop variable), 'stride' (a buffer stride, a kernel parameter)."""

    __slots__ = ("name", "kind")
    _fields = ("name", "dtype", "kind")
    name: str
    kind: str

    def __new__(cls, name: str, dtype: DType = dt.int32, kind: str = "index") -> "Var":
        node = object.__new__(cls)
        node._init(name, dtype, kind)
        return node

    def _init(self, name: str, dtype: DType = dt.int32, kind: str = "index") -> None:
        dtype = dt.as_dtype(dtype)
        if not isinstance(name, str) or not name.isidentifier():
            raise TeccError(f"variable name {name!r} must be a Python identifier")
        if kind in ("size", "stride", "index") and not dtype.is_int:
            raise DTypeError(f"variable {name} of kind {kind} must have an integer dtype, got {dtype}")
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "kind", kind)

    def __reduce__(self) -> tuple[Any, ...]:
        raise TypeError("Var objects are identities; serialize whole programs with tecc.ir.serialize")


class IterVar(Var):
    """A variable ranging over [lo, lo + extent): an axis of a compute (kind 'index') or a
    reduction axis (kind 'reduce', only valid inside the reduction that names it in `axis=`)."""

    __slots__ = ("lo", "extent")
    lo: Expr
    extent: Expr

    def __new__(cls, name: str, lo: Expr, extent: Expr, dtype: DType = dt.int32, kind: str = "index") -> "IterVar":
        node = object.__new__(cls)
        Var._init(node, name, dtype, kind)
        object.__setattr__(node, "lo", lo)
        object.__setattr__(node, "extent", extent)
        return node


class ReduceAxis(IterVar):
    """A reduction axis, made by `tc.reduce_axis`."""

    __slots__ = ()

    def __new__(cls, name: str, lo: Expr, extent: Expr, dtype: DType = dt.int32) -> "ReduceAxis":
        return IterVar.__new__(cls, name, lo, extent, dtype, "reduce")  # type: ignore[return-value]


def _init_operands(node: Expr, op: str, a: Expr, b: Expr, result: DType) -> None:
    """Set the fields of a two-operand node; the operands must already share a dtype."""
    if a.dtype != b.dtype:
        raise DTypeError(f"operands of {op} must share a dtype after promotion, got {a.dtype} and {b.dtype}")
    object.__setattr__(node, "op", op)
    object.__setattr__(node, "a", a)
    object.__setattr__(node, "b", b)
    object.__setattr__(node, "dtype", result)


class Binary(Expr):
    """`a op b` for op in + - * / // % min max fmin fmax pow & | ^ (& | ^ are logical on bools,
    bitwise on ints).

    Integer + - * wrap; integer `//` and `%` floor, and give 0 for a zero divisor. Float `min` /
    `max` are NaN when either operand is NaN (NumPy's minimum/maximum); `fmin` / `fmax` (floats
    only) return the other operand when one is NaN (C's fminf/fmaxf, NumPy's fmin/fmax)."""

    __slots__ = ("op", "a", "b")
    _fields = ("op", "a", "b")
    op: str
    a: Expr
    b: Expr

    def _init(self, op: str, a: Expr, b: Expr) -> None:
        _init_operands(self, op, a, b, a.dtype)


class Compare(Expr):
    """`a op b` for op in < <= > >= == !=, of dtype bool."""

    __slots__ = ("op", "a", "b")
    _fields = ("op", "a", "b")
    op: str
    a: Expr
    b: Expr

    def _init(self, op: str, a: Expr, b: Expr) -> None:
        _init_operands(self, op, a, b, dt.bool_)

    def __bool__(self) -> bool:
        # Structural equality, so that containers and dict lookups of expressions work.
        if self.op == "==":
            return self.a is self.b
        if self.op == "!=":
            return self.a is not self.b
        return Expr.__bool__(self)


class Not(Expr):
    """Logical not of a bool, bitwise not of an integer."""

    __slots__ = ("a",)
    _fields = ("a",)
    a: Expr

    def _init(self, a: Expr) -> None:
        object.__setattr__(self, "a", a)
        object.__setattr__(self, "dtype", a.dtype)


class Cast(Expr):
    """Convert `a` to `dtype`. float→int truncates toward zero and saturates to the integer
    range, NaN giving 0 (PTX `cvt.rzi`); int→narrower int wraps; anything→bool is `!= 0` (NaN is
    true); to a float rounds to nearest even, once."""

    __slots__ = ("a",)
    _fields = ("dtype", "a")
    a: Expr

    def _init(self, dtype: DType, a: Expr) -> None:
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "a", a)


class Select(Expr):
    """`cond ? a : b`. Only the chosen side is evaluated (C's `?:`), so a Select may guard a
    load that would be out of bounds where `cond` is false (padding)."""

    __slots__ = ("cond", "a", "b")
    _fields = ("cond", "a", "b")
    cond: Expr
    a: Expr
    b: Expr

    def _init(self, cond: Expr, a: Expr, b: Expr) -> None:
        if not cond.dtype.is_bool:
            raise DTypeError(f"the condition of where() must be bool, got {cond.dtype} in {cond}")
        if a.dtype != b.dtype:
            raise DTypeError(f"both branches of where() must share a dtype, got {a.dtype} and {b.dtype}")
        object.__setattr__(self, "cond", cond)
        object.__setattr__(self, "a", a)
        object.__setattr__(self, "b", b)
        object.__setattr__(self, "dtype", a.dtype)


# Math intrinsics: name -> (which dtypes are accepted). float16/bfloat16 inputs are computed in
# float32 and rounded back (what CUDA's half math does, and what the emulator does).
FLOAT_INTRINSICS = ("exp", "log", "sqrt", "rsqrt", "sin", "cos", "tanh", "erf", "sigmoid",
                    "exp2", "log2", "floor", "ceil", "round", "isnan", "isinf")
INTRINSICS = FLOAT_INTRINSICS + ("abs",)

# Cheap forms of sin and cos (loop IR only: the `approx_math` pass writes them, users cannot):
#   sin_approx(x), cos_approx(x) -- sin / cos with relative error <= 2^-21.9 plus absolute
#       1.5e-10 for |x| <= 2^17 (Cody-Waite reduction by pi and an odd polynomial, ~19 issued
#       instructions instead of sinf's ~27), the precise sinf / cosf beyond; see approx.py for
#       the algorithm and the bound. Arguments float32, float16 or bfloat16 (a 16-bit one is
#       computed in float32 and rounded back, like every intrinsic); float64 is refused.
# Meant for values that are rounded to a 16-bit float right away, where that error is far
# below half an ulp; a float32 result that is kept needs the precise sin.
#   exp2_approx(x) -- 2^x by PTX `ex2.approx.ftz.f32` (one MUFU.EX2): relative error about
#       2^-22 (PTX ISA, "ex2"), a subnormal argument or result flushed to zero; float32 only
#       in effect (16-bit arguments are computed in float32). exp2f instead spends three more
#       instructions per call on the subnormal range. Written by rewrites that sum or round
#       the result (the softmax weights of the tensor-core attention kernel).
#   gelu_erf_approx(x), gelu_tanh_approx(x) -- the whole GELU, x Phi(x) and torch's tanh form,
#       with relative error <= 2^-17 (plus 2^-29 |x| below x = -6.01) and <= 2^-21 + 2^-22.6 |t|
#       (t = the exponent, |t| <= 24 for |x| <= 5); 12 and 5 FP32 instructions plus 1 and 2 MUFU
#       instead of ~40 through erff / tanhf (approx_gelu.py). Written by the approx_math pass where
#       the GELU's float32 value is rounded to a 16-bit float at once; float32 arguments only.
APPROX_INTRINSICS = ("sin_approx", "cos_approx", "exp2_approx", "gelu_erf_approx", "gelu_tanh_approx")

# Warp intrinsics (loop IR only), with CUDA's semantics over the 32 lanes of a warp, all lanes
# active (mask 0xffffffff) and width 32:
#   shfl_xor(value, lane_mask) -- the value of lane (lane ^ lane_mask)        (__shfl_xor_sync)
#   shfl_down(value, delta)    -- the value of lane + delta, or own value if that is >= 32 (__shfl_down_sync)
#   shfl_idx(value, src_lane)  -- the value of lane src_lane                   (__shfl_sync)
# The lane of a thread is its linear thread index within the block modulo 32.
WARP_INTRINSICS = ("shfl_xor", "shfl_down", "shfl_idx")

# Memory intrinsics (loop IR only), for blocks of one kernel that hand data to each other
# (split_reduce's last block combines the partials the other blocks stored):
#   atomic_add(buf[i], value) -- adds `value` to element buf[i] of a global buffer (of a dtype
#       in ATOMIC_DTYPES, below) as one indivisible step and returns the element's value before
#       it (atomicAdd, relaxed, device scope). The BufferLoad names the element (its address), it is no read
#       of its own. Concurrent atomics on one element take effect in some order; the emulator's
#       is lane order (docs/emulator.md). A float atomic accumulates (a scatter's sum, the
#       attention backward's dQ) and announces nothing, so the emulator's publication check (a
#       store fenced before an atomic) applies to integer atomics only.
#   atomic_add_pair(buf[.., c], v0, v1) -- v0 added to float32 element buf[.., c] and v1 to
#       buf[.., c + 1] (the next element of the innermost dimension, which must exist and be
#       contiguous), each as atomic_add but as one 8-byte vector reduction (`red.global.add.v2.f32`,
#       sm_90 and newer: no value back, half the instructions and L2 requests of two atomics);
#       the pair's first element must be 8-byte aligned (c even, the row's start 8-byte aligned).
#       Its value is an int32 0; it stands in an Evaluate statement.
#   load_cg(buf[i])  -- the element of a global buffer read at L2 (__ldcg, ld.global.cg), never
#       through L1 or the non-coherent read-only path: it sees what another block of the same
#       kernel stored and published (a store, thread_fence, then an atomic this block observed).
#   thread_fence()   -- __threadfence(): this thread's global stores before it are visible to
#       every thread of the device before any of its memory accesses after it. Its value is an
#       int32 0; it stands in an Evaluate statement.
MEMORY_INTRINSICS = ("atomic_add", "atomic_add_pair", "load_cg", "thread_fence")
# the memory intrinsics that add into their first argument's element (its buffer is written)
ATOMIC_INTRINSICS = ("atomic_add", "atomic_add_pair")
# An optimization barrier (loop IR only):
#   opaque(x)        -- the int32 value x, computed again where it stands: the CUDA compiler
#       (nvcc and ptxas) may not hoist what is derived from it above this point, nor keep it in
#       a register from an earlier computation (an inline asm volatile `mov`). Meant for a
#       thread index that a late phase of a kernel derives many addresses from, which ptxas
#       would otherwise compute once at the kernel's start and keep live through every phase
#       (split_k.py: the TMA-store epilogue's staging addresses beside the split-K sum). The
#       emulator takes it as x.
OPAQUE_INTRINSICS = ("opaque",)
# The element types atomic_add takes: int32 and int64 wrap (two's complement, as every integer
# add); float32 and float64 round each addition to nearest even, in an order the hardware picks
# (atomicAdd on float / double: `red.global.add.f32/.f64`), so a float sum of concurrent atomics
# is not reproducible run to run (docs/semantics.md, "Atomics").
ATOMIC_DTYPES = (dt.int32, dt.int64, dt.float32, dt.float64)


class Call(Expr):
    """A pure math intrinsic applied to scalars, e.g. `exp(x)`; see INTRINSICS.

    Intrinsics with side effects or thread semantics (warp shuffles, MEMORY_INTRINSICS) also
    appear as Calls in the loop IR; their meaning is next to WARP_INTRINSICS and
    MEMORY_INTRINSICS above."""

    __slots__ = ("name", "args")
    _fields: tuple[str, ...] = ("name", "args", "dtype")
    name: str
    args: tuple[Expr, ...]

    def _init(self, name: str, args: tuple[Expr, ...], dtype: DType) -> None:
        if name in MEMORY_INTRINSICS:
            _check_memory_intrinsic(name, tuple(args), dtype)
        if name in OPAQUE_INTRINSICS and (len(args) != 1 or args[0].dtype != dt.int32 or dtype != dt.int32):
            raise TeccError(f"{name}(x) takes one int32 value and is int32, got {len(args)} argument(s), {dtype}")
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "args", tuple(args))
        object.__setattr__(self, "dtype", dtype)

    def with_args(self, args: tuple[Expr, ...]) -> "Call":
        """The same intrinsic applied to `args` (what a mutator rebuilds)."""
        return Call(self.name, tuple(args), self.dtype)


def _check_memory_intrinsic(name: str, args: tuple[Expr, ...], dtype: DType) -> None:
    """The arity, operands and result dtype MEMORY_INTRINSICS documents, or TeccError."""
    if name == "thread_fence":
        if args or dtype != dt.int32:
            raise TeccError(f"thread_fence() takes no arguments and is int32, got {len(args)} argument(s), {dtype}")
        return
    want = {"atomic_add": 2, "atomic_add_pair": 3}.get(name, 1)
    target = args[0] if args else None
    if len(args) != want or not isinstance(target, BufferLoad) or getattr(target.buffer, "scope", None) != "global":
        raise TeccError(f"{name} takes {want} argument(s), the first a global buffer element (a BufferLoad)")
    if name == "load_cg" and dtype != target.dtype:
        raise DTypeError(f"load_cg of {target} is {target.dtype}, not {dtype}")
    if name == "atomic_add_pair" and not (target.dtype == args[1].dtype == args[2].dtype == dt.float32
                                          and dtype == dt.int32):
        raise DTypeError(f"atomic_add_pair adds two float32 values to float32 elements and is int32; got "
                         f"{target.dtype} element {target}, {args[1].dtype} and {args[2].dtype} values, {dtype}")
    if name == "atomic_add" and not (target.dtype == args[1].dtype == dtype and dtype in ATOMIC_DTYPES):
        raise DTypeError(f"atomic_add needs an element, value and result of one dtype among "
                         f"{', '.join(d.name for d in ATOMIC_DTYPES)}; got {target.dtype} element {target}, "
                         f"{args[1].dtype} value, {dtype} result")


# nanmax / nanmin skip NaN elements (a row of only NaN gives the identity, like an empty one);
# max / min give NaN when any element is NaN. They differ only on float sources.
REDUCERS = ("sum", "prod", "max", "min", "nanmax", "nanmin")


class Reduce(Expr):
    """`combiner` (sum | prod | max | min | nanmax | nanmin) of `source` over the reduction axes `axes`.

    The result has the source's dtype; the accumulator is float32 for float16/bfloat16 sources
    (and the source's dtype otherwise), so long half-precision sums do not lose their low bits.
    An empty reduction gives the combiner's identity: 0, 1, -inf / lowest, +inf / highest."""

    __slots__ = ("combiner", "source", "axes", "acc_dtype")
    _fields = ("combiner", "source", "axes")
    combiner: str
    source: Expr
    axes: tuple[ReduceAxis, ...]
    acc_dtype: DType

    def _init(self, combiner: str, source: Expr, axes: tuple[ReduceAxis, ...]) -> None:
        object.__setattr__(self, "combiner", combiner)
        object.__setattr__(self, "source", source)
        object.__setattr__(self, "axes", tuple(axes))
        object.__setattr__(self, "dtype", source.dtype)
        acc = dt.float32 if source.dtype in (dt.float16, dt.bfloat16) + dt.FP8_DTYPES else source.dtype
        object.__setattr__(self, "acc_dtype", acc)


def reduce_identity(combiner: str, dtype: DType) -> "Const":
    """The identity of a combiner in `dtype` (what an empty reduction returns)."""
    if combiner == "sum":
        return Const(0, dtype)
    if combiner == "prod":
        return Const(1, dtype)
    is_max = combiner in ("max", "nanmax")
    if dtype.is_float:
        return Const(-math.inf if is_max else math.inf, dtype)
    if dtype.is_bool:
        return Const(not is_max, dtype)
    bits = dtype.bits - 1
    return Const(-(2**bits) if is_max else 2**bits - 1, dtype)


class TensorRead(Expr):
    """`tensor[indices]` in a tensor expression (before lowering). Built by `Tensor.__getitem__`,
    which checks arity, index dtypes and bounds."""

    __slots__ = ("tensor", "indices")
    _fields = ("tensor", "indices")
    tensor: Any
    indices: tuple[Expr, ...]

    def _init(self, tensor: Any, indices: tuple[Expr, ...]) -> None:
        object.__setattr__(self, "tensor", tensor)
        object.__setattr__(self, "indices", tuple(indices))
        object.__setattr__(self, "dtype", tensor.dtype)


class BufferLoad(Expr):
    """`buffer[indices]` in the loop-nest IR: a read of one element of a global, shared or
    local buffer (see `tecc.ir.stmt.Buffer`). Indices are in elements, one per dimension."""

    __slots__ = ("buffer", "indices")
    _fields = ("buffer", "indices")
    buffer: Any
    indices: tuple[Expr, ...]

    def _init(self, buffer: Any, indices: tuple[Expr, ...]) -> None:
        if len(indices) != len(buffer.shape):
            raise TeccError(
                f"buffer {buffer.name} has {len(buffer.shape)} dimensions but was indexed with {len(indices)}"
            )
        for ix in indices:
            if not ix.dtype.is_int:
                raise DTypeError(f"index {ix} of buffer {buffer.name} is {ix.dtype}, not an integer")
        object.__setattr__(self, "buffer", buffer)
        object.__setattr__(self, "indices", tuple(indices))
        object.__setattr__(self, "dtype", buffer.dtype)


def const_int(e: ExprLike) -> int | None:
    """The value of an integer constant, or None when `e` is not one."""
    if isinstance(e, bool):
        return None
    if isinstance(e, int):
        return e
    if isinstance(e, Const) and e.dtype.is_int:
        return int(e.value)
    return None


def index_expr(value: ExprLike) -> Expr:
    """An integer index or extent as an expression; floats and bools are refused."""
    if isinstance(value, Expr):
        if not value.dtype.is_int:
            raise DTypeError(f"an index or extent must be an integer expression, got {value.dtype} in {value}")
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise DTypeError(f"an index or extent must be an integer, got {type(value).__name__} {value!r}")
    if not -(2**63) <= value < 2**63:
        raise ShapeError(f"the index or extent {value} does not fit int64 (|value| < 2**63), the widest "
                         "index type of a kernel; use a smaller size")
    return Const(value, dt.int32 if -(2**31) <= value < 2**31 else dt.int64)
