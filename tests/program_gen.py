"""Random tecc programs and an independent NumPy interpretation of each (the differential fuzzer,
tests/test_fuzz_programs.py).

A program lives on a grid of two axes, rows `r` (size R) and columns `c` (size C), either of
which may be 0, 1, odd or symbolic. Its inputs are X[r, c] (and, drawn, a row vector W[r], a
column vector V[c], an int32 matrix I[r, c] read through a cast). Each stage is a tensor over
some of the axes: (r, c), (r,), (c,) or a scalar of shape (1,), whose body is an expression tree:
reads of earlier tensors (a row vector read in a (r, c) body is a broadcast along c), sums /
products / maxima / minima over the axes the body does not have yet (nested: a reduction inside
a reduction's body, over the other axis), elementwise arithmetic, `where` on exact conditions,
casts, unary math. Stages that nobody reads are outputs; others are outputs by a coin flip.

The program is held as a small tree of plain Python nodes (below), turned into tecc tensors by
`to_tecc` and evaluated by `interpret` with NumPy in float64 (integers exactly in int64), never
through tecc's own evaluator. Next to each value the interpretation carries, per element, a
bound on its magnitude and a first-order bound on the rounding error a `dtype` kernel may
accumulate (every operation rounds once: eps·|result|, or the smallest normal number in
the subnormal range; a sum of L terms in any order adds
L·eps·Σ|term|; Lipschitz-1 functions pass their argument's error through), so the tolerance is
derived from the dtype and the reduction lengths, not guessed. Conditions of `where` read only
exact values (inputs, indices), so float rounding can never flip a branch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
from hypothesis import strategies as st

import tecc as tc

AXES = ("r", "c")
SHAPES = (("r", "c"), ("r",), ("c",), ())          # () is the scalar stage of shape (1,)
UNIT_ROUNDOFF = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8, "float32": 2.0 ** -24, "float64": 2.0 ** -53}
SMALLEST_NORMAL = {"float16": 2.0 ** -14, "bfloat16": 2.0 ** -126, "float32": 2.0 ** -126, "float64": 2.0 ** -1022}
HALF_LIMIT = 60000.0                                 # float16 values stay below its largest (65504)


def numpy_dtype(name: str) -> np.dtype:
    """The NumPy dtype of a tecc dtype name (bfloat16 through ml_dtypes)."""
    return tc.ir.dtype.as_dtype(name).numpy
INT_LIMIT = 2 ** 30                                  # generated int32 values stay below this


# ---- the program as data ---------------------------------------------------------------------

@dataclass(frozen=True)
class Read:
    tensor: str
    dims: tuple[str, ...]


@dataclass(frozen=True)
class Const:
    value: float


@dataclass(frozen=True)
class Index:
    axis: str                                        # the index variable of an axis, as a value


@dataclass(frozen=True)
class Binary:
    op: str                                          # + - * maximum minimum div (a / (|b| + 1))
    a: Any
    b: Any


@dataclass(frozen=True)
class Unary:
    op: str                                          # neg abs tanh sin sigmoid exp
    a: Any


@dataclass(frozen=True)
class Cond:
    kind: str                                        # "positive" (an input > 0), "lt" (r < c), "even_r", "even_c"
    read: Read | None = None


@dataclass(frozen=True)
class Where:
    cond: Cond
    a: Any
    b: Any


@dataclass(frozen=True)
class CastInt:
    read: Read                                       # the int32 input I read as the program's float dtype


@dataclass(frozen=True)
class Reduce:
    combiner: str                                    # sum prod max min
    axes: tuple[str, ...]
    body: Any


@dataclass
class Stage:
    name: str
    dims: tuple[str, ...]
    body: Any
    output: bool = False


@dataclass
class Program:
    dtype: str
    sizes: dict[str, int]                            # R, C
    symbolic: tuple[str, ...]                        # which of R, C are tc.var
    inputs: dict[str, tuple[tuple[str, ...], str]]   # name -> (dims, dtype)
    stages: list[Stage] = field(default_factory=list)

    @property
    def is_float(self) -> bool:
        return not self.dtype.startswith("int")

    def describe(self) -> str:
        lines = [f"dtype {self.dtype}, R={self.sizes['R']}, C={self.sizes['C']}, symbolic {list(self.symbolic)}"]
        lines += [f"input {n}{list(d)}: {t}" for n, (d, t) in self.inputs.items()]
        for s in self.stages:
            lines.append(f"{'output ' if s.output else ''}{s.name}{list(s.dims)} = {show(s.body)}")
        return "\n".join(lines)


def show(e: Any) -> str:
    if isinstance(e, Read):
        return f"{e.tensor}[{', '.join(e.dims) or '0'}]"
    if isinstance(e, Const):
        return repr(e.value)
    if isinstance(e, Index):
        return e.axis
    if isinstance(e, Binary):
        return f"{e.op}({show(e.a)}, {show(e.b)})"
    if isinstance(e, Unary):
        return f"{e.op}({show(e.a)})"
    if isinstance(e, Where):
        c = e.cond
        cond = f"{show(c.read)} > 0" if c.read is not None else {"lt": "r < c", "even_r": "r % 2 == 0",
                                                                    "even_c": "c % 2 == 0"}[c.kind]
        return f"where({cond}, {show(e.a)}, {show(e.b)})"
    if isinstance(e, CastInt):
        return f"cast({show(e.read)})"
    if isinstance(e, Reduce):
        return f"{e.combiner}_{''.join(e.axes)}({show(e.body)})"
    raise TypeError(e)


# ---- generation ------------------------------------------------------------------------------

def size_strategy() -> st.SearchStrategy[int]:
    return st.one_of(st.sampled_from([0, 1, 2, 3, 5, 7, 31, 32, 33]), st.integers(1, 40))


@st.composite
def programs(draw: st.DrawFn, max_stages: int = 4, huge: bool = False) -> Program:
    """A random Program. `huge` also draws rows of 2^18 and more (what split_rows takes; too
    slow for the generic schedule in the emulator, whose one thread per row loops serially)."""
    dtype = draw(st.sampled_from(["float32", "float32", "float32", "float64", "float16", "bfloat16", "int32", "int64"]),
                 label="dtype")
    sizes = {"R": draw(size_strategy(), label="R"), "C": draw(size_strategy(), label="C")}
    if draw(st.integers(0, 5), label="square?") == 0:
        sizes["C"] = sizes["R"]        # as many rows as columns: shapes alone cannot tell a row from a column
    elif draw(st.integers(0, 4), label="long axis?") == 0:
        # few long rows (or columns): what the split-over-blocks rewrites take
        long_axis = draw(st.sampled_from(["R", "C"]), label="long axis")
        longs = [1000, 2049, 4096, 6000] + ([262144, 300001] if huge else [])
        sizes[long_axis] = draw(st.sampled_from(longs), label="long size")
        sizes["C" if long_axis == "R" else "R"] = draw(st.integers(1, 4), label="short size")
    symbolic = tuple(n for n in ("R", "C") if draw(st.booleans(), label=f"{n} symbolic"))
    inputs: dict[str, tuple[tuple[str, ...], str]] = {"X": (("r", "c"), dtype)}
    if draw(st.booleans(), label="W"):
        inputs["W"] = (("r",), dtype)
    if draw(st.booleans(), label="V"):
        inputs["V"] = (("c",), dtype)
    if not dtype.startswith("int") and draw(st.booleans(), label="I"):
        inputs["I"] = (("r", "c"), "int32")
    prog = Program(dtype, sizes, symbolic, inputs)
    bounds: dict[str, float] = {n: (3.0 if t.startswith("int") else 1.0) for n, (_, t) in inputs.items()}
    gen = _Generator(draw, prog, bounds)
    # the stages' shapes: free, or a motif the graph-level rewrites look for (softmax / norm
    # chains along rows or columns, a global statistic used again)
    motif = draw(st.sampled_from(["free", "free", "row chain", "column chain", "global"]), label="motif")
    count = draw(st.integers(1, max_stages), label="stages")
    if motif == "free":
        shapes = [draw(st.sampled_from(SHAPES), label="stage dims") for _ in range(count)]
    elif motif == "global":
        shapes = [(), draw(st.sampled_from(SHAPES), label="then"), ()][:max(count, 2)]
    else:
        reduced: tuple[str, ...] = ("r",) if motif == "row chain" else ("c",)
        shapes = [reduced if n % 2 == 0 else ("r", "c") for n in range(max(count, 2))]
    for n, dims in enumerate(shapes):
        body, bound = gen.expr(set(dims), depth=3, want_reduce=len(dims) < 2)
        name = f"S{n}"
        prog.stages.append(Stage(name, dims, body, output=draw(st.booleans(), label="output")))
        bounds[name] = bound
    read = {r.tensor for s in prog.stages for r in reads(s.body)}
    for s in prog.stages:
        if s.name not in read:
            s.output = True
    used = read | {r.tensor for s in prog.stages for r in reads(s.body)}
    prog.inputs = {n: v for n, v in prog.inputs.items() if n in used or n == "X"}
    return prog


class _Generator:
    def __init__(self, draw: st.DrawFn, prog: Program, bounds: dict[str, float]) -> None:
        self.draw = draw
        self.prog = prog
        self.bounds = bounds

    def readable(self, env: set[str]) -> list[Read]:
        out = []
        for name, (dims, dtype) in self.prog.inputs.items():
            if name != "I" and set(dims) <= env:
                out.append(Read(name, dims))
        for s in self.prog.stages:
            if set(s.dims) <= env:
                out.append(Read(s.name, s.dims))
        return out

    def leaf(self, env: set[str]) -> tuple[Any, float]:
        draw = self.draw
        options = self.readable(env)
        kind = draw(st.sampled_from(["read", "read", "read", "const", "index", "cast"]), label="leaf")
        if kind == "const" or not options and kind != "cast" and kind != "index":
            value = draw(st.sampled_from([0.5, 2.0, -1.5, 3.0] if self.prog.is_float else [1, 2, -3]), label="const")
            return Const(value), abs(value)
        if kind == "index" and env:
            axis = draw(st.sampled_from(sorted(env)), label="index")
            return Index(axis), float(max(self.prog.sizes["R" if axis == "r" else "C"], 1))
        if kind == "cast" and "I" in self.prog.inputs and {"r", "c"} <= env:
            return CastInt(Read("I", ("r", "c"))), 3.0
        if not options:
            return Const(2.0 if self.prog.is_float else 2), 2.0
        latest = [r for r in options if r.tensor.startswith("S")][-1:]
        if latest and draw(st.booleans(), label="read the latest stage"):
            read = latest[0]
        else:
            read = draw(st.sampled_from(options), label="read")
        return read, self.bounds[read.tensor]

    def expr(self, env: set[str], depth: int, want_reduce: bool = False) -> tuple[Any, float]:
        draw = self.draw
        free = [a for a in AXES if a not in env]
        if free and (want_reduce or (depth > 0 and draw(st.integers(0, 3), label="reduce?") == 0)):
            axes = tuple(sorted(draw(st.sets(st.sampled_from(free), min_size=1), label="reduce axes")))
            combiners = ["sum", "sum", "max", "min"] + (["prod"] if self.prog.is_float else [])
            combiner = draw(st.sampled_from(combiners), label="combiner")
            inner_env = env | set(axes)
            exact = [r for r in self.readable(inner_env) if r.tensor in self.prog.inputs]
            if combiner == "prod" and exact:
                # a product of exact inputs (|x| <= 1): its error is L·eps·|result|
                return Reduce(combiner, axes, draw(st.sampled_from(exact), label="prod of")), 1.0
            if combiner == "prod":
                combiner = "sum"
            body, bound = self.expr(inner_env, depth - 1)
            length = float(np.prod([max(self.prog.sizes["R" if a == "r" else "C"], 1) for a in axes]))
            if combiner == "sum":
                if not self.prog.is_float and bound * length > INT_LIMIT:
                    combiner = "max"
                else:
                    bound *= length
            return Reduce(combiner, axes, body), bound
        if depth <= 0:
            return self.leaf(env)
        kind = draw(st.sampled_from(["binary", "binary", "unary", "where", "leaf"]), label="node")
        if kind == "leaf":
            return self.leaf(env)
        if kind == "unary":
            ops = ["neg", "abs"] + (["tanh", "sin", "sigmoid"] if self.prog.is_float else [])
            op = draw(st.sampled_from(ops), label="unary")
            a, bound = self.expr(env, depth - 1)
            if op == "exp":
                return Unary(op, a), float(np.exp(bound))
            return Unary(op, a), {"tanh": min(bound, 1.0), "sin": min(bound, 1.0), "sigmoid": 1.0}.get(op, bound)
        if kind == "where":
            conds: list[Any] = [f"even_{a}" for a in sorted(env)] + (["lt"] if len(env) == 2 else [])
            conds += [r for r in self.readable(env) if r.tensor in self.prog.inputs]
            if not conds:
                return self.leaf(env)
            pick = draw(st.sampled_from(conds), label="condition")
            cond = Cond(pick) if isinstance(pick, str) else Cond("positive", pick)
            a, ba = self.expr(env, depth - 1)
            b, bb = self.expr(env, depth - 1)
            return Where(cond, a, b), max(ba, bb)
        ops = ["+", "-", "*", "maximum", "minimum"] + (["div"] if self.prog.is_float else [])
        op = draw(st.sampled_from(ops), label="binary")
        a, ba = self.expr(env, depth - 1)
        b, bb = self.expr(env, depth - 1)
        bound = {"+": ba + bb, "-": ba + bb, "*": ba * bb, "div": ba}.get(op, max(ba, bb))
        if op == "*" and bound > (INT_LIMIT if not self.prog.is_float else 1e30):
            op, bound = "+", ba + bb
        if not self.prog.is_float and bound > INT_LIMIT:
            op, bound = "maximum", max(ba, bb)
        return Binary(op, a, b), bound


def reads(e: Any) -> list[Read]:
    if isinstance(e, Read):
        return [e]
    if isinstance(e, CastInt):
        return [e.read]
    if isinstance(e, (Binary, Where)):
        extra = reads(e.cond.read) if isinstance(e, Where) and e.cond.read is not None else []
        return reads(e.a) + reads(e.b) + extra
    if isinstance(e, Unary):
        return reads(e.a)
    if isinstance(e, Reduce):
        return reads(e.body)
    return []


# ---- to tecc ---------------------------------------------------------------------------------

def to_tecc(prog: Program) -> tuple[list[tc.Tensor], dict[str, tc.Tensor]]:
    """The program's tensors: the build signature (inputs, then outputs) and every tensor by name."""
    size = {n: (tc.var(n) if n in prog.symbolic else prog.sizes[n]) for n in ("R", "C")}
    extent = {"r": size["R"], "c": size["C"]}
    tensors: dict[str, tc.Tensor] = {}
    for name, (dims, dtype) in prog.inputs.items():
        tensors[name] = tc.placeholder(tuple(extent[d] for d in dims), dtype, name=name)
    counter = [0]

    def build(e: Any, env: dict[str, Any]) -> Any:
        if isinstance(e, Read):
            t = tensors[e.tensor]
            return t[tuple(env[d] for d in e.dims)] if e.dims else t[0]
        if isinstance(e, Const):
            return tc.const(e.value, prog.dtype)
        if isinstance(e, Index):
            return tc.cast(env[e.axis], prog.dtype)
        if isinstance(e, CastInt):
            return tc.cast(build(e.read, env), prog.dtype)
        if isinstance(e, Binary):
            a, b = build(e.a, env), build(e.b, env)
            if e.op == "+":
                return a + b
            if e.op == "-":
                return a - b
            if e.op == "*":
                return a * b
            if e.op == "maximum":
                return tc.maximum(a, b)
            if e.op == "minimum":
                return tc.minimum(a, b)
            return a / (tc.abs(b) + 1.0)
        if isinstance(e, Unary):
            a = build(e.a, env)
            return {"neg": lambda: -a, "abs": lambda: tc.abs(a), "tanh": lambda: tc.tanh(a),
                    "sin": lambda: tc.sin(a), "sigmoid": lambda: tc.sigmoid(a), "exp": lambda: tc.exp(a)}[e.op]()
        if isinstance(e, Where):
            c = e.cond
            if c.read is not None:
                cond = build(c.read, env) > 0
            elif c.kind == "lt":
                cond = env["r"] < env["c"]
            else:
                cond = env[c.kind[-1]] % 2 == 0
            return tc.where(cond, build(e.a, env), build(e.b, env))
        if isinstance(e, Reduce):
            inner = dict(env)
            axes = []
            for a in e.axes:
                counter[0] += 1
                ax = tc.reduce_axis(extent[a], name=f"k{a}{counter[0]}")
                inner[a] = ax
                axes.append(ax)
            return getattr(tc, e.combiner)(build(e.body, inner), axis=axes)
        raise TypeError(e)

    for s in prog.stages:
        shape = tuple(extent[d] for d in s.dims) or (1,)

        def body(*idx: Any, s: Stage = s) -> Any:
            env = dict(zip(s.dims, idx)) if s.dims else {}
            return build(s.body, env)
        tensors[s.name] = tc.compute(shape, body, name=s.name)
    args = [tensors[n] for n in prog.inputs] + [tensors[s.name] for s in prog.stages if s.output]
    return args, tensors


# ---- the NumPy interpretation ----------------------------------------------------------------

class Unrepresentable(Exception):
    """The program leaves the fuzzer's domain: an intermediate NaN or an integer overflow (their
    semantics are specified and tested elsewhere); the example is discarded."""


@dataclass
class Value:
    """Per element (broadcast over (R, C), size-1 where an axis is absent): the exact value, a bound
    on its magnitude, and a bound on the error a kernel in the program's dtype may have."""

    value: np.ndarray
    mag: np.ndarray
    err: np.ndarray


def make_inputs(prog: Program, rng: np.random.Generator) -> dict[str, np.ndarray]:
    out = {}
    for name, (dims, dtype) in prog.inputs.items():
        shape = tuple(prog.sizes["R" if d == "r" else "C"] for d in dims)
        if dtype.startswith("int"):
            out[name] = rng.integers(-3, 4, shape).astype(dtype)
        else:
            out[name] = rng.uniform(-1.0, 1.0, shape).astype(numpy_dtype(dtype))
    return out


def interpret(prog: Program, arrays: dict[str, np.ndarray]) -> dict[str, Value]:
    """Every stage's Value, computed from `arrays` (the inputs) without tecc."""
    R, C = prog.sizes["R"], prog.sizes["C"]
    is_float = prog.is_float
    eps = UNIT_ROUNDOFF.get(prog.dtype, 0.0)
    # a result in the subnormal range is off by up to the smallest normal number (gradual underflow)
    tiny = SMALLEST_NORMAL[prog.dtype] if is_float else 0.0
    work = np.float64 if is_float else np.int64
    stored: dict[str, Value] = {}

    def grid(a: np.ndarray, dims: tuple[str, ...]) -> np.ndarray:
        """An array over `dims` as an (R|1, C|1) array."""
        if dims == ("r", "c"):
            return a
        if dims == ("r",):
            return a.reshape(R, 1)
        if dims == ("c",):
            return a.reshape(1, C)
        return a.reshape(1, 1)

    def exact(v: np.ndarray) -> Value:
        v = v.astype(work)
        return Value(v, np.abs(v).astype(np.float64), np.zeros(v.shape))

    def rounded(v: np.ndarray, mag: np.ndarray, err: np.ndarray, ops: float = 1.0) -> Value:
        return Value(v, mag, err + ops * (eps * mag + tiny))

    for name, a in arrays.items():
        stored[name] = exact(grid(a, prog.inputs[name][0]))

    def ev(e: Any) -> Value:
        v = evaluate(e)
        if is_float and np.isnan(v.value).any():
            raise Unrepresentable(f"NaN in {show(e)} (NaN semantics are not what this fuzzer checks)")
        if prog.dtype == "float16" and v.value.size and np.nanmax(np.where(np.isinf(v.value), 0, np.abs(v.value))) > HALF_LIMIT:
            raise Unrepresentable(f"{show(e)} overflows float16")
        if not is_float and v.value.size:
            info = np.iinfo(prog.dtype)
            if v.value.min() < info.min or v.value.max() > info.max:
                raise Unrepresentable(f"{show(e)} overflows {prog.dtype}")
        return v

    def evaluate(e: Any) -> Value:
        if isinstance(e, Read):
            return stored[e.tensor]
        if isinstance(e, Const):
            return exact(np.array([[e.value]]))
        if isinstance(e, Index):
            v = exact(np.arange(R).reshape(R, 1) if e.axis == "r" else np.arange(C).reshape(1, C))
            return rounded(v.value, v.mag, v.err)      # an index past the mantissa rounds when cast
        if isinstance(e, CastInt):
            return exact(stored["I"].value)
        if isinstance(e, Unary):
            a = ev(e.a)
            if e.op == "neg":
                return Value(-a.value, a.mag, a.err)
            if e.op == "abs":
                return Value(np.abs(a.value), a.mag, a.err)
            f = {"tanh": np.tanh, "sin": np.sin, "sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x)), "exp": np.exp}[e.op]
            v = f(a.value)
            lipschitz = np.exp(a.mag) if e.op == "exp" else 1.0
            return rounded(v, np.abs(v) + 1.0, lipschitz * a.err, ops=4.0)  # math functions: a few ulp
        if isinstance(e, Binary):
            a, b = ev(e.a), ev(e.b)
            if e.op in ("+", "-"):
                v = a.value + b.value if e.op == "+" else a.value - b.value
                return rounded(v, a.mag + b.mag, a.err + b.err)
            if e.op == "*":
                return rounded(a.value * b.value, a.mag * b.mag, a.mag * b.err + b.mag * a.err)
            if e.op in ("maximum", "minimum"):
                v = np.maximum(a.value, b.value) if e.op == "maximum" else np.minimum(a.value, b.value)
                return Value(v, np.maximum(a.mag, b.mag), np.maximum(a.err, b.err))
            v = a.value / (np.abs(b.value) + 1.0)
            return rounded(v, a.mag, a.err + a.mag * b.err, ops=3.0)
        if isinstance(e, Where):
            c = e.cond
            rr, cc = np.arange(R).reshape(R, 1), np.arange(C).reshape(1, C)
            if c.read is not None:
                cond = stored[c.read.tensor].value > 0
            elif c.kind == "lt":
                cond = rr < cc
            else:
                cond = (rr if c.kind == "even_r" else cc) % 2 == 0
            a, b = ev(e.a), ev(e.b)
            return Value(np.where(cond, a.value, b.value), np.maximum(a.mag, b.mag), np.maximum(a.err, b.err))
        if isinstance(e, Reduce):
            body = ev(e.body)
            axes = tuple(AXES.index(a) for a in e.axes)
            value = np.broadcast_to(body.value, np.broadcast_shapes(body.value.shape, _extent(e.axes, R, C)))
            mag = np.broadcast_to(body.mag, value.shape)
            err = np.broadcast_to(body.err, value.shape)
            length = float(np.prod([value.shape[a] for a in axes]))
            if e.combiner == "sum":
                s = np.sum(value, axis=axes, keepdims=True)
                m = np.sum(mag, axis=axes, keepdims=True)
                return Value(s, m, np.sum(err, axis=axes, keepdims=True) + length * (eps * m + tiny))
            if e.combiner == "prod":
                p = np.prod(value, axis=axes, keepdims=True)
                m = np.prod(mag, axis=axes, keepdims=True)
                return Value(p, m, length * (eps * m + tiny))
            identity = identity_of(e.combiner, prog.dtype)
            f = np.max if e.combiner == "max" else np.min
            v = f(value, axis=axes, keepdims=True, initial=identity)
            return Value(v, np.max(mag, axis=axes, keepdims=True, initial=abs(float(identity)) if length == 0 else 0.0),
                         np.max(err, axis=axes, keepdims=True, initial=0.0))
        raise TypeError(e)

    for s in prog.stages:
        with np.errstate(all="ignore"):    # ±inf of empty max/min reductions flow on (NaN is caught above)
            out = ev(s.body)
        shape = (R if "r" in s.dims else 1, C if "c" in s.dims else 1)
        v = Value(np.broadcast_to(out.value, shape), np.broadcast_to(out.mag, shape), np.broadcast_to(out.err, shape))
        if not is_float:
            v.value = v.value.astype(prog.dtype).astype(np.int64)   # what the stored tensor holds
        stored[s.name] = v
    return stored


def _extent(axes: tuple[str, ...], R: int, C: int) -> tuple[int, int]:
    return (R if "r" in axes else 1, C if "c" in axes else 1)


def identity_of(combiner: str, dtype: str) -> Any:
    """tecc's value of an empty reduction (docs/dtypes.md)."""
    if combiner == "sum":
        return 0
    if combiner == "prod":
        return 1
    if dtype.startswith("int"):
        info = np.iinfo(dtype)
        return info.min if combiner == "max" else info.max
    return -np.inf if combiner == "max" else np.inf


def output_shape(prog: Program, stage: Stage) -> tuple[int, ...]:
    return tuple(prog.sizes["R" if d == "r" else "C"] for d in stage.dims) or (1,)


def compare(prog: Program, stage: Stage, got: np.ndarray, want: Value, what: Callable[[], str]) -> None:
    """Assert `got` (the kernel's output) is within the derived tolerance of the interpretation."""
    ref = np.asarray(want.value).reshape(got.shape)
    if not prog.is_float:
        bad = got.astype(np.int64) != ref
        tol = np.zeros(got.shape)
    else:
        err = np.asarray(want.err).reshape(got.shape)
        tol = np.nan_to_num(4.0 * err, nan=np.inf) + 1e-300
        g = got.astype(np.float64)
        finite = np.isfinite(ref)
        with np.errstate(invalid="ignore"):
            bad = np.where(finite, ~(np.abs(g - ref) <= tol), ~((g == ref) | (np.isnan(g) & np.isnan(ref))))
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise AssertionError(
            f"stage {stage.name}: {int(bad.sum())} of {bad.size} elements differ; first at {idx}: "
            f"got {got[idx]!r}, want {ref[idx]!r} (tolerance {tol[idx]:.3g})\n{what()}")
