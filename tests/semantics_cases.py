"""The numeric semantics of docs/semantics.md as a table of small ops, each with inputs full of
edge values and a NumPy reference that spells the semantics out.

tests/test_semantics.py runs every case in the emulator against its reference;
tests/test_semantics_gpu.py runs the same kernels on the GPU and in the emulator and holds them
to each other bit for bit (integers) and value for value with NaN equal to NaN (floats).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable

import ml_dtypes
import numpy as np

import tecc as tc
from tecc.compiler.plan import Plan, Step

FLOATS = ("float32", "float64", "float16", "bfloat16")
N = 4096  # elements of the elementwise cases: several blocks, a partial last one


def np_dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


@dataclass
class Case:
    """An op (`args()` is its build signature: inputs, then outputs), its inputs from a seed, and
    the outputs its reference computes from the inputs."""

    name: str
    args: Callable[[], list[tc.Tensor]]
    inputs: Callable[[np.random.Generator], list[np.ndarray]]
    reference: Callable[..., list[np.ndarray]]
    plan: Plan | None = None
    exact_ints: bool = True
    notes: str = field(default="")

    def build(self, target: str) -> tc.Kernel:
        if self.plan is None:
            return tc.build(self.args(), target, name=self.name)
        return tc.build(self.args(), target, name=self.name, plan=self.plan)

    def outputs(self) -> list[np.ndarray]:
        """Poisoned output arrays (NaN, or a sentinel integer) so an unwritten element shows."""
        outs = []
        for t in self.args():
            if t.is_placeholder:
                continue
            shape = tuple(int(s) for s in t.shape)
            d = np_dtype(t.dtype.name)
            outs.append(np.full(shape, np.nan if t.dtype.is_float else -0x5EED, d))
        return outs


def _elementwise(name: str, dtypes: tuple[str, ...], out_dtypes: tuple[str, ...],
                 bodies: tuple[Callable[..., tc.Expr], ...], shape: tuple[int, ...] = (N,)) -> Callable[[], list[tc.Tensor]]:
    """Inputs X0, X1, ... of `dtypes`, outputs Y0, Y1, ... = bodies[k](X0[i], X1[i], ...)."""
    def args() -> list[tc.Tensor]:
        xs = [tc.placeholder(shape, d, name=f"X{k}") for k, d in enumerate(dtypes)]
        ys = [tc.compute(shape, lambda *i, body=body: body(*(x[i] if i else x[()] for x in xs)), name=f"Y{k}")
              for k, body in enumerate(bodies)]
        assert all(y.dtype.name == d for y, d in zip(ys, out_dtypes)), (name, [y.dtype for y in ys])
        return xs + ys
    return args


# ---- integers -------------------------------------------------------------------------------
def int_edges(d: str) -> np.ndarray:
    info = np.iinfo(d)
    return np.array([0, 1, -1, 2, -2, 7, -7, info.min, info.max, info.min + 1, info.max - 1], d)


def _ints(rng: np.random.Generator, d: str, n: int = N) -> np.ndarray:
    """Edge values, then uniform over the whole range, then small values (divisors of interest)."""
    info = np.iinfo(d)
    x = rng.integers(info.min, info.max, size=n, dtype=d, endpoint=True)
    x[n // 2:] = rng.integers(-9, 10, size=n - n // 2)
    edges = int_edges(d)
    x[:len(edges)] = edges
    return x


def floor_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """tecc's integer `//`: floor division, 0 for a zero divisor, INT_MIN // -1 wraps to INT_MIN."""
    safe = np.where(b == 0, 1, b)
    with np.errstate(over="ignore"):
        q = np.floor_divide(a, safe)
    q = np.where(a == np.iinfo(a.dtype).min, np.where(b == -1, a, q), q)
    return np.where(b == 0, 0, q).astype(a.dtype)


def floor_mod(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """tecc's integer `%`: the remainder takes the divisor's sign, 0 for a zero divisor."""
    safe = np.where(b == 0, 1, b)
    return np.where(b == 0, 0, np.remainder(a, safe)).astype(a.dtype)


def wrap(values: list[int], d: str) -> np.ndarray:
    """Python integers reduced modulo 2^bits into `d` (two's complement)."""
    bits = np.iinfo(d).bits
    return np.array([((v + 2 ** (bits - 1)) % 2**bits) - 2 ** (bits - 1) for v in values], d)


def int_arith_case(d: str) -> Case:
    bodies = (lambda a, b: a + b, lambda a, b: a - b, lambda a, b: a * b, lambda a, b: -a, lambda a, b: abs(a),
              lambda a, b: a // b, lambda a, b: a % b, lambda a, b: (a & b) ^ ~b)

    def reference(a: np.ndarray, b: np.ndarray) -> list[np.ndarray]:
        A, B = [int(v) for v in a], [int(v) for v in b]
        return [wrap([x + y for x, y in zip(A, B)], d), wrap([x - y for x, y in zip(A, B)], d),
                wrap([x * y for x, y in zip(A, B)], d), wrap([-x for x in A], d), wrap([abs(x) for x in A], d),
                floor_div(a, b), floor_mod(a, b), (a & b) ^ ~b]

    def inputs(rng: np.random.Generator) -> list[np.ndarray]:
        a, b = _ints(rng, d), _ints(rng, d)
        # every edge value against every edge value, zero and -1 divisors included
        edges = int_edges(d)
        k = len(edges)
        a[N - k * k:] = np.repeat(edges, k)
        b[N - k * k:] = np.tile(edges, k)
        return [a, b]

    return Case(f"int_arith_{d}", _elementwise("int", (d, d), (d,) * len(bodies), bodies), inputs, reference)


def uniform_int_case() -> Case:
    """Integer arithmetic and float -> int casts on values every thread shares (0-d inputs: the
    emulator holds them as Python scalars, which must wrap and saturate as the GPU's registers do)."""
    def args() -> list[tc.Tensor]:
        a = tc.placeholder((), "int32", name="a")
        b = tc.placeholder((), "int32", name="b")
        c = tc.placeholder((), "int64", name="c")
        f = tc.placeholder((2,), "bfloat16", name="f")
        y = tc.compute((64,), lambda i: a[()] * b[()] + i, name="Y")
        z = tc.compute((64,), lambda i: (a[()] + b[()]) // (i - 3), name="Z")
        w = tc.compute((64,), lambda i: tc.cast(c[()] * (i + 1), "int32"), name="W")
        v = tc.compute((64,), lambda i: tc.cast(f[0], "int32") + tc.cast(f[1], "int32") + i, name="V")
        u = tc.compute((1,), lambda i: tc.cast(c[()] * 2**20 + 1, "float32"), name="U")  # uniform: no i
        return [a, b, c, f, y, z, w, v, u]

    def inputs(rng: np.random.Generator) -> list[np.ndarray]:
        return [np.array(2**30 + int(rng.integers(0, 1000)), np.int32), np.array(2**30 + 7, np.int32),
                np.array(2**40 + 2**16, np.int64), np.array([3e9, np.nan], ml_dtypes.bfloat16)]

    def reference(a: np.ndarray, b: np.ndarray, c: np.ndarray, f: np.ndarray) -> list[np.ndarray]:
        A, B, C = int(a), int(b), int(c)
        F = [int(v) for v in cvt_rzi(f, "int32")]
        i = np.arange(64)
        s = wrap([A + B] * 64, "int32")
        return [wrap([A * B + k for k in range(64)], "int32"), floor_div(s, (i - 3).astype(np.int32)),
                wrap([C * (k + 1) for k in range(64)], "int32"), wrap([F[0] + F[1] + k for k in range(64)], "int32"),
                np.array([C * 2**20 + 1], np.int64).astype(np.float32)]  # NumPy's int64 -> float32 rounds once

    return Case("uniform_int", args, inputs, reference)


def narrowing_case() -> Case:
    bodies = (lambda a: tc.cast(a, "int32"), lambda a: tc.cast(tc.cast(a, "int32"), "int64"))

    def reference(a: np.ndarray) -> list[np.ndarray]:
        low = wrap([int(v) for v in a], "int32")
        return [low, low.astype(np.int64)]

    return Case("narrow_int64_to_int32", _elementwise("narrow", ("int64",), ("int32", "int64"), bodies),
                lambda rng: [_ints(rng, "int64")], reference)


# ---- float -> int ---------------------------------------------------------------------------
def float_to_int_edges(d: str) -> np.ndarray:
    v = [np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 0.5, -0.5, 0.9999, -0.9999, 1.5, -2.5,
         2.0**31, -(2.0**31), 2.0**31 - 128, -(2.0**31) + 128, 2.0**31 + 2**20, -(2.0**31) - 2**20,
         2.0**63, -(2.0**63), 2.0**62, -(2.0**62), 1e30, -1e30, 65504.0, -65504.0, 3e38, -3e38]
    with np.errstate(over="ignore"):
        return np.array(v, np.float64).astype(np_dtype(d))


def cvt_rzi(x: np.ndarray, to: str) -> np.ndarray:
    """cvt.rzi.s32/.s64 as the GPU executes it (measured on an H200): truncate toward zero,
    saturate; NaN -> 0 from a float of 32 bits or fewer to int32, the minimum otherwise."""
    info = np.iinfo(to)
    out = []
    for v in x.astype(np.float64):
        if math.isnan(v):
            out.append(0 if info.bits == 32 and x.dtype.itemsize <= 4 else info.min)
        elif v >= info.max:
            out.append(info.max)
        elif v <= info.min:
            out.append(info.min)
        else:
            out.append(int(v))  # int() truncates toward zero
    return np.array(out, to)


def float_to_int_case(d: str) -> Case:
    bodies = (lambda x: tc.cast(x, "int32"), lambda x: tc.cast(x, "int64"))

    def inputs(rng: np.random.Generator) -> list[np.ndarray]:
        # log-uniform magnitudes from 2^-4 to 2^70, either sign: fractions, the int32 and int64
        # edges, overflow (16-bit floats overflow to inf on the way in)
        with np.errstate(over="ignore"):
            x = (rng.choice([-1.0, 1.0], N) * 2.0 ** rng.uniform(-4, 70, N)).astype(np_dtype(d))
        edges = float_to_int_edges(d)
        x[:len(edges)] = edges
        return [x]

    return Case(f"float_to_int_{d}", _elementwise("f2i", (d,), ("int32", "int64"), bodies), inputs,
                lambda x: [cvt_rzi(x, "int32"), cvt_rzi(x, "int64")])


# ---- rounding to 16- and 32-bit floats -------------------------------------------------------------------
def bf16_round_exact(v: int | float) -> float:
    """The bfloat16 nearest to `v` (ties to even), by exact rational arithmetic."""
    if isinstance(v, float) and not math.isfinite(v):
        return v
    x = Fraction(v)
    if x == 0:
        return float(v)
    sign = -1 if x < 0 else 1
    m = abs(x)
    e = math.floor(math.log2(m))
    while Fraction(2) ** e > m:
        e -= 1
    while Fraction(2) ** (e + 1) <= m:
        e += 1
    e = max(e, -126)  # subnormals keep the spacing of the smallest normal binade
    ulp = Fraction(2) ** (e - 7)
    q, r = divmod(m, ulp)
    if r * 2 > ulp or (r * 2 == ulp and q % 2 == 1):
        q += 1
    out = float(q * ulp)
    if out >= 2.0**128 - 2.0**119:  # past the largest bfloat16 and its half ulp: overflow
        out = math.inf
    return sign * out


def to_bf16_case() -> Case:
    bodies = (lambda a, b, c: tc.cast(a, "bfloat16"), lambda a, b, c: tc.cast(b, "bfloat16"),
              lambda a, b, c: tc.cast(c, "bfloat16"), lambda a, b, c: tc.cast(c, "float16"),
              lambda a, b, c: tc.cast(a, "float32"), lambda a, b, c: tc.cast(b, "float32"))

    def inputs(rng: np.random.Generator) -> list[np.ndarray]:
        n = 512
        # values just past a halfway point of bfloat16 but below one of float32: 2^k + 2^(k-8) + 1
        k = rng.integers(9, 30, n)
        a = (2**k + 2 ** (k - 8) + rng.integers(1, 3, n)) * rng.choice([-1, 1], n)
        a[:4] = [2**24 + 2**16 + 1, -(2**24 + 2**16 + 1), 0, 7]
        k64 = rng.integers(40, 62, n)
        b = (2**k64 + 2 ** (k64 - 8) + 1).astype(np.int64) * rng.choice([-1, 1], n)
        b[0], b[1] = 2**62 + 2**54 + 1, np.iinfo(np.int64).min
        b[2] = 2**60 + 2**36 + 1  # to float32 through float64 would round twice, to 2^60
        c = rng.standard_normal(n) * 2.0 ** rng.integers(-130, 130, n)
        c[n // 2:] = rng.standard_normal(n - n // 2) * 2.0 ** rng.integers(-26, 17, n - n // 2)  # float16's range
        c[:3] = [1.0 + 2.0**-8 + 2.0**-40, np.nan, 3.5e38]
        return [a.astype(np.int32), b, c]

    def reference(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> list[np.ndarray]:
        bf = np.dtype(ml_dtypes.bfloat16)
        with np.errstate(over="ignore"):
            # float64 -> float16 and int -> float32 are correctly rounded by NumPy itself
            exact = [c.astype(np.float16), a.astype(np.float32), b.astype(np.float32)]
        return [np.array([bf16_round_exact(int(v)) for v in x], np.float64).astype(bf) for x in (a, b)] + [
            np.array([bf16_round_exact(float(v)) for v in c], np.float64).astype(np.float32).astype(bf)] + exact

    def args() -> list[tc.Tensor]:
        xs = [tc.placeholder((512,), d, name=f"X{k}") for k, d in enumerate(("int32", "int64", "float64"))]
        def element(body: Callable[..., tc.Expr]) -> Callable[[tc.Expr], tc.Expr]:
            return lambda i: body(*(x[i] for x in xs))

        ys = [tc.compute((512,), element(body), name=f"Y{k}") for k, body in enumerate(bodies)]
        return xs + ys

    return Case("round_once_to_16_and_32_bits", args, inputs, reference)


# ---- float max / min, // and % ----------------------------------------------------------------
def float_edges() -> list[float]:
    return [np.nan, 0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, 2.5, -2.5, 1e-3, 7.0, 0.5]


def _floats(rng: np.random.Generator, d: str, nan_share: float = 0.1) -> np.ndarray:
    x = rng.standard_normal(N) * 4
    x[rng.random(N) < nan_share] = np.nan
    edges = float_edges()
    k = len(edges)
    x[:k] = edges
    return x.astype(np_dtype(d))


def _pairs(rng: np.random.Generator, d: str) -> list[np.ndarray]:
    a, b = _floats(rng, d), _floats(rng, d)
    edges = np.array(float_edges(), np_dtype(d))
    k = len(edges)
    a[N - k * k:] = np.repeat(edges, k)
    b[N - k * k:] = np.tile(edges, k)
    return [a, b]


def _in_float32(f: Callable[..., np.ndarray], d: str) -> Callable[..., np.ndarray]:
    """A NumPy reference computed in float32 for 16-bit floats and rounded back (tecc's half math)."""
    def run(*xs: np.ndarray) -> np.ndarray:
        wide = [x.astype(np.float32) if d in ("float16", "bfloat16") else x for x in xs]
        with np.errstate(all="ignore"):
            return np.asarray(f(*wide)).astype(np_dtype(d))
    return run


def float_max_min_case(d: str) -> Case:
    bodies = (tc.maximum, tc.minimum, tc.fmax, tc.fmin, lambda a, b: a // b, lambda a, b: a % b)
    refs = (np.maximum, np.minimum, np.fmax, np.fmin, np.floor_divide, np.remainder)
    return Case(f"float_ops_{d}", _elementwise("fops", (d, d), (d,) * len(bodies), bodies), lambda rng: _pairs(rng, d),
                lambda a, b: [_in_float32(f, d)(a, b) for f in refs])


def int_max_min_case() -> Case:
    bodies = (tc.maximum, tc.minimum, tc.fmax, tc.fmin)
    refs = (np.maximum, np.minimum, np.maximum, np.minimum)
    return Case("int_max_min", _elementwise("imm", ("int32", "int32"), ("int32",) * 4, bodies),
                lambda rng: [_ints(rng, "int32"), _ints(rng, "int32")], lambda a, b: [f(a, b) for f in refs])


# ---- reductions -----------------------------------------------------------------------------
REDUCERS = {"max": tc.max, "min": tc.min, "nanmax": tc.nanmax, "nanmin": tc.nanmin}


def reduce_reference(kind: str, x: np.ndarray, axis: int) -> np.ndarray:
    """max / min propagate NaN (np.max); nanmax / nanmin skip it, and a row of only NaN gives the
    identity, -inf / +inf, as an empty row does (np.fmax.reduce from the identity)."""
    x32 = x.astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = {"max": lambda: np.max(x32, axis=axis), "min": lambda: np.min(x32, axis=axis),
               "nanmax": lambda: np.fmax.reduce(x32, axis=axis, initial=-np.inf),
               "nanmin": lambda: np.fmin.reduce(x32, axis=axis, initial=np.inf)}[kind]()
    return out.astype(x.dtype)


def _rows_with_nan(rng: np.random.Generator, shape: tuple[int, int], d: str, axis: int) -> np.ndarray:
    """Random rows (along `axis`): the first holds one NaN at its end, the second is all NaN,
    the third one NaN in the middle, the rest none."""
    x = rng.standard_normal(shape)
    v = x if axis == 1 else x.T
    n = v.shape[1]
    v[0, n - 1] = np.nan
    if v.shape[0] > 1:
        v[1, :] = np.nan
    if v.shape[0] > 2:
        v[2, n // 2] = np.nan
    return x.astype(np_dtype(d))


# Plans that take every path a max combines on: one thread per row (serial), a block per row
# with warp shuffles (fuse_rows, the planner's choice), a row split over blocks with a
# combining kernel (split_rows), a column split over threads and blocks, combined by the last
# block (split_reduce).
REDUCTION_PATHS = {
    "serial": (Plan(()), (5, 37), 1),
    "fuse_rows": (None, (6, 3000), 1),
    "split_rows": (Plan((Step("split_rows", {"threads": 64, "splits": 3, "vector": 1, "unroll": 2}),)), (3, 5000), 1),
    "split_reduce": (Plan((Step("split_reduce", {"threads_x": 32, "threads_y": 8, "splits": 3, "unroll": 2,
                                                 "combine": "last_block"}),)), (700, 40), 0),
}


def reduction_case(kind: str, d: str, path: str) -> Case:
    plan, shape, axis = REDUCTION_PATHS[path]
    R, C = shape

    def args() -> list[tc.Tensor]:
        X = tc.placeholder(shape, d, name="X")
        if axis == 1:
            c = tc.reduce_axis(C, name="c")
            Y = tc.compute((R,), lambda r: REDUCERS[kind](X[r, c], axis=c), name="Y")
        else:
            c = tc.reduce_axis(R, name="c")
            Y = tc.compute((C,), lambda j: REDUCERS[kind](X[c, j], axis=c), name="Y")
        return [X, Y]

    return Case(f"{kind}_{d}_{path}", args, lambda rng: [_rows_with_nan(rng, shape, d, axis)],
                lambda x: [reduce_reference(kind, x, axis)], plan=plan)


def all_cases() -> list[Case]:
    cases = [int_arith_case("int32"), int_arith_case("int64"), uniform_int_case(), narrowing_case(),
             to_bf16_case(), int_max_min_case()]
    cases += [float_to_int_case(d) for d in FLOATS]
    cases += [float_max_min_case(d) for d in FLOATS]
    cases += [reduction_case(kind, d, path) for path in REDUCTION_PATHS for kind in REDUCERS
              for d in ("float32", "bfloat16")]
    return cases


def same(got: np.ndarray, want: np.ndarray) -> tuple[bool, str]:
    """Integers bit for bit; floats value for value with NaN equal to NaN (a NaN's payload and
    the sign of a zero are not part of the semantics). The message shows the worst element."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return False, f"shape/dtype {got.shape} {got.dtype} != {want.shape} {want.dtype}"
    if got.dtype.kind in "iub":
        bad = got != want
    else:
        g, w = got.astype(np.float64), want.astype(np.float64)
        bad = ~((g == w) | (np.isnan(g) & np.isnan(w)))
    if not bad.any():
        return True, ""
    i = np.unravel_index(int(np.argmax(bad)), got.shape)
    return False, f"{int(bad.sum())} elements differ, first at {i}: got {got[i]!r}, want {want[i]!r}"
