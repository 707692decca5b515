"""Properties: random small problems through the memory-bound rewrites match float64 NumPy.

split_rows, split_row_group, fuse_rows and split_reduce each build their kernels by hand, and
their bugs live in the index arithmetic: chunk starts and lengths, a chunk's unaligned head and
tail, vector lanes, the guarded last round, the partial last block, the last block's counters
(split_rows once counted a chunk shorter than its unaligned head twice; bf16 rounding hid it).
The emulator runs the lowered IR exactly, with its bounds, race, partial-warp and
uninitialized-read checks on, so every example here is cheap and complete:

* a random op: shapes that are 0, 1, primes, or at and one element (one vector) around
  multiples of the vector width, of threads·vector·unroll and of splits·threads·vector·unroll;
  float32, bfloat16 or float16; a random combiner where the pass takes any; constant or
  symbolic sizes; for reductions also a float32 result from 16-bit inputs, a second operand
  along the reduced axes (a weight: its index is unflattened from the position) and, for
  split_rows, a strided input (no flat view: positions are columns);
* a random explicit plan that the pass's docstring says is valid (a ScheduleError is a
  refusal: the example is rejected and the reason recorded as a hypothesis event);
* built for target="sim" and called twice on fresh random inputs (a symbolic kernel on two
  different sizes: the last block's counters must come back to zero, temporaries regrow), each
  output pre-filled with NaN so an element nobody wrote fails;
* compared with float64 NumPy on the same (rounded) inputs.

A few cases are pinned with @example (run first in every profile): the known double count, and
forms the random draws reach rarely (several whole rounds, more partials than threads, ...).

Tolerances are bounds, not fits:

* sum: float32 accumulators. Any summation in which each term takes part in at most h
  additions errs by at most γ_h·Σ|x| with γ_h = h·u/(1 - h·u), u = 2^-24 (Higham, Accuracy and
  Stability of Numerical Algorithms, 2nd ed., §4.2); h is bounded from the plan (a term's
  product with its weight, a thread's serial chain, its vector lanes, the block and split
  combines: `chain` below). Then a mean's scale (2 roundings) and one rounding to the output
  dtype (half an ulp, relative; half the smallest subnormal, absolute). The terms are
  ±[0.5, 1.5] with random signs, so one term counted twice or missed moves a sum by ≥ 0.5 (a
  weighted one by ≥ 0.25): more than γ_h·Σ|x| at the sizes drawn (≤ ~0.03) and, since |Σ| ~
  √N, usually more than half an ulp of a bf16 result (2^-8·|Σ| ≈ 0.2 at N = 2500); with a
  float32 result only the accumulation bound is left, so every dtype and vector width is
  checked tightly.
* prod: every multiplication rounds once, relatively: (2N + h)·u plus the output rounding;
  factors 1 ± [0.02, 0.05], so a factor counted twice or missed moves the product by ≥ 1.5%.
* max / min: exact (the result is one of the inputs, which every output dtype here holds), so
  the tolerance is 0 (a weighted term is one float32 product: its rounding and the output's);
  rows (columns) are offset by 3 each, so reading a neighbour's element shows.
* norms (softmax, log-softmax, layer norm, RMS norm): the tolerances of
  tests/test_split_row_group.py and tests/test_fusion_long_rows.py (float32: 1e-4 relative with
  a floor of 2e-4 of the largest output; 16-bit: two half-ulps of the output, float16 by the same
  rule as bfloat16), plus, for layer norm, the conditioning of x - μ on a row whose values
  nearly agree (`layer_norm_conditioning`). A column counted twice moves a norm by ~1/C, which
  these see only on short rows; the row reductions in the same two properties (row sum with a
  float32 result, row max) walk the row the same way and see it at every length.

CI runs the derandomized profile (conftest.py) with the example counts below (about 25 s in
all); HYPOTHESIS_PROFILE=explore runs the explore profile's count for every property.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from hypothesis import HealthCheck, event, example, given, reject, settings
from hypothesis import strategies as st

import tecc as tc
from tecc.compiler import options as knobs
from tecc.compiler.plan import Plan, Step
from tecc.ir.errors import ScheduleError

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import norms  # noqa: E402

DTYPES = ("float32", "bfloat16", "float16")
NP_DTYPE = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
WIDEST = {"float32": 4, "bfloat16": 8, "float16": 8}           # elements of a 16-byte vector
U32 = 2.0 ** -24                                               # float32 unit roundoff
HALF_ULP = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}  # one rounding, relative
HALF_SUBNORMAL = {"float32": 2.0 ** -150, "bfloat16": 2.0 ** -134, "float16": 2.0 ** -25}  # ... absolute, below normals
REDUCE = {"sum": tc.sum, "max": tc.max, "min": tc.min, "prod": tc.prod}
NP_REDUCE: dict[str, Callable[..., Any]] = {"sum": np.sum, "max": np.max, "min": np.min, "prod": np.prod}
IDENTITY = {"sum": 0.0, "prod": 1.0, "max": -np.inf, "min": np.inf}
COMBINERS = ("sum", "sum", "prod", "max", "min")               # sums twice as often: the bug class that hides
MAX_LENGTH = 2500                                              # a reduction's length (per output)
SMALL = (1, 2, 3, 5, 7, 13, 31, 97, 257, 1021, 0)              # tiny, primes, none
THREADS = [32, 64, 96, 128, 256, 1024]                        # 96: three warps in the block stage
SYMBOLIC = st.sampled_from([False, True, False])               # a symbolic row takes vector 1: fewer of them


def examples(ci: int) -> int:
    """The example count: `ci` (what keeps the file near 25 s under the CI profile), or the
    explore profile's (HYPOTHESIS_PROFILE=explore)."""
    return settings().max_examples if os.environ.get("HYPOTHESIS_PROFILE") == "explore" else ci


def lengths(quanta: list[int], low: int = 0, cap: int = MAX_LENGTH, multiple: int = 1) -> st.SearchStrategy[int]:
    """Multiples of `multiple` in [low, cap]: mostly one `multiple` below, at or above 1-3 times
    one of `quanta` (vector width, threads·vector·unroll, ...: where the walk changes form),
    else tiny ones and primes, or any."""
    near = [q * m + d for q in sorted(set(quanta), reverse=True) for m in (1, 2, 3) for d in (-multiple, 0, multiple)
            if low <= q * m + d <= cap and (q * m + d) % multiple == 0]
    small = [n * multiple for n in SMALL if low <= n * multiple <= cap]
    anything = st.integers(-(-low // multiple), cap // multiple).map(lambda n: n * multiple)
    choices = [st.sampled_from(near)] * 3 if near else []
    return st.one_of(*choices, *([st.sampled_from(small)] if small else []), anything)


def fresh(rng: np.random.Generator, shape: tuple[int, ...], dtype: str, combiner: str,
          offset_axis: int | None = None) -> np.ndarray:
    """Non-zero inputs for a `combiner` reduction (module docstring): ±[0.5, 1.5] for sums,
    1 ± [0.02, 0.05] for products, N(0, 1) + 3·(index along `offset_axis`, if any) for max / min."""
    sign = rng.choice([-1.0, 1.0], size=shape)
    if combiner == "sum":
        x = sign * rng.uniform(0.5, 1.5, shape)
    elif combiner == "prod":
        x = 1.0 + sign * rng.uniform(0.02, 0.05, shape)
    else:
        x = rng.standard_normal(shape)
        if offset_axis is not None:
            offsets = 3.0 * np.arange(shape[offset_axis], dtype=np.float64)
            x = x + np.expand_dims(offsets, tuple(a for a in range(x.ndim) if a != offset_axis % x.ndim))
    return x.astype(NP_DTYPE[dtype])


def weights(rng: np.random.Generator, shape: tuple[int, ...], dtype: str, combiner: str) -> np.ndarray:
    """A second operand of the terms: like `fresh` for sums and products (a term counted twice
    or missed still shows), positive [0.5, 1.5] for max / min (keeps the order of the rows'
    offsets)."""
    if combiner in ("max", "min"):
        return rng.uniform(0.5, 1.5, shape).astype(NP_DTYPE[dtype])
    return fresh(rng, shape, dtype, combiner)


def padded_view(x: np.ndarray, pad: float) -> np.ndarray:
    """`x` as a view whose rows are 3 elements apart (strided: a kernel that ignored the
    strides would read the padding, `pad`)."""
    base = np.full(x.shape[:-1] + (x.shape[-1] + 3,), pad, x.dtype)
    base[..., :x.shape[-1]] = x
    return base[..., :x.shape[-1]]


def reduction_reference(terms64: np.ndarray, combiner: str, out_dtype: str, chain: int, scale: float = 1.0,
                        exact_terms: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(want, tolerance) of ⊕ over the last axis of `terms64` (float64), then × scale, for
    float32 accumulators in which each term takes part in at most `chain` operations (module
    docstring). `exact_terms`: every term is exact in float32 (else a product of two inputs,
    rounded once: max / min are then off by that rounding and the output's)."""
    n = terms64.shape[-1]
    want = NP_REDUCE[combiner](terms64, axis=-1, initial=IDENTITY[combiner]) * scale
    rounding = HALF_ULP[out_dtype] + 4 * U32        # the output cast; a mean's scale constant and product
    tiny = HALF_SUBNORMAL[out_dtype]                # a float16 product can land below the normal range
    gamma = chain * U32 / (1 - chain * U32)
    if combiner == "sum":
        tol = rounding * np.abs(want) + gamma * np.abs(terms64).sum(axis=-1) * scale + tiny
    elif combiner == "prod":  # every multiplication rounds (≤ 2 per term with a weight)
        tol = (rounding + (2 * n + chain) * U32 * 1.01) * np.abs(want) + tiny
    elif exact_terms:
        tol = np.zeros_like(want)
    else:
        tol = (HALF_ULP[out_dtype] + U32) * np.abs(want) + tiny
    return want, tol


def assert_close(got: np.ndarray, want: np.ndarray, tol: Any, what: str) -> None:
    """Every element within `tol` (equal infinities pass; NaN, an unwritten output, fails); the
    message names the op and plan (`what`), the count off and the worst element."""
    got64, want64 = np.asarray(got, np.float64), np.asarray(want, np.float64)
    tol = np.broadcast_to(np.asarray(tol, np.float64), want64.shape)
    with np.errstate(invalid="ignore"):
        err = np.abs(got64 - want64)
        ok = (got64 == want64) | (err <= tol)
    if ok.all():
        return
    excess = np.where(ok, -np.inf, np.nan_to_num(err - tol, nan=np.inf))
    k = np.unravel_index(int(np.argmax(excess)), want64.shape) if want64.ndim else ()
    raise AssertionError(f"{what}: {int((~ok).sum())} of {ok.size} element(s) off; worst at {k}: got {got64[k]!r}, "
                         f"want {want64[k]!r}, tolerance {tol[k]:.3g}")


def build(args: list[Any], step: str, plan_args: dict[str, Any]) -> Any:
    """The kernel of `args` under the one-step plan, for the emulator; a refusal rejects the example."""
    assert knobs.sim_checks(), "the properties rely on the emulator's checks (TECC_SIM_CHECKS)"
    try:
        return tc.build(args, target="sim", plan=Plan((Step(step, plan_args),)))
    except ScheduleError as e:
        event(f"{step} refused: {str(e)[:80]}")
        reject()


# ---- split_rows: row reductions over trailing axes, full (0-d) reductions ----------------------

@dataclass
class Reduction:
    """Y[rows..] = ⊕ over the trailing axes of X[rows.., reduced..], the terms times a second
    input W when `weight` is "reduced" (W[reduced..]) or "full" (W of X's shape, read at the
    same element: a row-wise dot product), a mean when `mean`, X strided when `strided`;
    `calls` holds the (rows, reduced) shape of each call."""

    dtype: str
    out_dtype: str
    combiner: str
    mean: bool
    weight: str
    strided: bool
    symbolic: bool
    calls: list[tuple[tuple[int, ...], tuple[int, ...]]]

    @property
    def weighted(self) -> bool:
        return bool(self.weight)

    def tensors(self) -> list[Any]:
        rows0, reduced0 = self.calls[0]
        rows = [tc.var(f"R{d}") if self.symbolic else n for d, n in enumerate(rows0)]
        reduced = [tc.var(f"N{d}") if self.symbolic else n for d, n in enumerate(reduced0)]
        X = tc.placeholder(tuple(rows) + tuple(reduced), self.dtype, name="X",
                           **({"strides": "any"} if self.strided else {}))
        leading = 0 if self.weight == "reduced" else len(rows)      # W's row axes: none, or X's
        W = tc.placeholder(tuple(rows[:leading]) + tuple(reduced), self.dtype, name="W")
        axes = [tc.reduce_axis(n, name=f"k{d}") for d, n in enumerate(reduced)]
        count = int(np.prod(reduced0))

        def body(*r: Any) -> Any:
            term = tc.cast(X[tuple(r) + tuple(axes)], "float32")
            if self.weighted:
                term = term * tc.cast(W[tuple(r[:leading]) + tuple(axes)], "float32")
            acc = REDUCE[self.combiner](term, axis=axes)
            if self.mean:
                acc = acc * (1.0 / count)
            return tc.cast(acc, self.out_dtype)

        Y = tc.compute(tuple(rows), body, name="Y")
        return [X, W, Y] if self.weighted else [X, Y]


@st.composite
def split_rows_cases(draw: Callable[..., Any]) -> tuple[Reduction, dict[str, Any]]:
    dtype = draw(st.sampled_from(DTYPES), label="dtype")
    symbolic = draw(SYMBOLIC, label="symbolic")
    strided = draw(st.sampled_from([False, False, True]), label="strided")
    threads = draw(st.sampled_from(THREADS), label="threads")
    # a strided input of symbolic shape cannot prove a vector stays in its row: vector 1
    vector = 1 if strided and symbolic else draw(st.sampled_from([v for v in (1, 2, 4, 8) if v <= WIDEST[dtype]]),
                                                 label="vector")
    unroll = draw(st.integers(1, 4), label="unroll")
    tile = threads * vector * unroll
    # mostly S·T·V·U within the lengths drawn (whole, partial and empty chunks, several rounds);
    # more splits than a warp (several gathered partials per lane; past 256, two per thread of
    # the combine kernel) on 32-thread blocks
    splits = draw(st.one_of(st.integers(1, max(2, min(6, MAX_LENGTH // tile))),
                            st.sampled_from([31, 32, 33, 70, 257] if threads == 32 else [8])), label="splits")
    combine = draw(st.sampled_from(["kernel", "last_block"]), label="combine")
    plan = {"threads": threads, "splits": splits, "vector": vector, "unroll": unroll, "combine": combine}
    row_rank = draw(st.sampled_from([0, 1, 1, 2]), label="row rank")   # 0: a full reduction
    rows_of = st.lists(st.sampled_from([2, 3, 1, 5, 0]), min_size=row_rank, max_size=row_rank).map(tuple)
    reduced_rank = draw(st.sampled_from([1, 1, 2]), label="reduced rank")
    rows = draw(rows_of, label="rows")
    # without a flat view (strided), vectors need the innermost reduced extent a multiple of
    # V, except for one row reduced over one axis (its unaligned tail is read by element)
    one_row = int(np.prod(rows)) == 1 and reduced_rank == 1
    multiple = vector if strided and not one_row else 1
    total = lengths([vector, threads * vector, tile, splits * tile], multiple=multiple)

    def reduced_of(n: int) -> tuple[int, ...]:
        if reduced_rank == 1:
            return (n,)
        outer = draw(st.sampled_from([d for d in (1, 2, 3, 5) if n % (d * multiple) == 0]), label="outer extent")
        return (outer, n // outer)

    combiner = draw(st.sampled_from(COMBINERS), label="combiner")
    out_dtype = draw(st.sampled_from([dtype, "float32"]), label="out dtype")
    weight = draw(st.sampled_from(["", "reduced", "", "full"]), label="weight")
    calls = [(rows, reduced_of(draw(total, label="length")))]
    if symbolic:  # the second call at other sizes: counters and temporaries regrow or shrink
        calls.append((draw(rows_of, label="rows 2"), reduced_of(draw(total, label="length 2"))))
    else:
        calls.append(calls[0])
    mean = (combiner == "sum" and not symbolic and int(np.prod(calls[0][1])) > 0
            and draw(st.booleans(), label="mean"))
    return Reduction(dtype, out_dtype, combiner, mean, weight, strided, symbolic, calls), plan


def split_rows_chain(n: int, plan: dict[str, Any]) -> int:
    """Operations a term takes part in: its product with a weight, a thread's chain over its
    chunk (rounds·U per vector lane, plus the head and tail element), the V lanes, the block's
    all-reduce (5 shuffles, ≤ 32 warps), the combine (≤ S partials, another all-reduce)."""
    T, S, V, U = plan["threads"], plan["splits"], plan["vector"], plan["unroll"]
    return 1 + -(-n // (S * T * V)) + U + 2 + V + 5 + T // 32 + S + 5 + 8


def split_rows_example(red: Reduction, threads: int, splits: int, vector: int, unroll: int, combine: str) -> Any:
    plan = {"threads": threads, "splits": splits, "vector": vector, "unroll": unroll, "combine": combine}
    return example(case=(red, plan), seed=0)


# pinned cases, run first in every profile: a bf16 chunk shorter than its unaligned head (the
# double count, here with a float32 result), a row-wise dot product in three whole aligned
# rounds per chunk (no guard), a strided input reduced over two axes (vectors unflattened per
# row), more partials than threads at two sizes, a full reduction over three axes
@split_rows_example(Reduction("bfloat16", "float32", "sum", False, "", False, False, [((3,), (1026,))] * 2),
                    32, 3, 8, 1, "last_block")
@split_rows_example(Reduction("float32", "float32", "sum", False, "full", False, False, [((2,), (768,))] * 2),
                    32, 2, 4, 1, "kernel")
@split_rows_example(Reduction("float16", "float16", "prod", False, "reduced", True, False, [((2,), (3, 40))] * 2),
                    32, 3, 8, 2, "last_block")
@split_rows_example(Reduction("float32", "float32", "max", False, "", False, True,
                              [((5,), (1001,)), ((2,), (4099,))]), 32, 70, 4, 2, "last_block")
@split_rows_example(Reduction("bfloat16", "float32", "sum", True, "", False, False, [((), (3, 5, 24))] * 2),
                    64, 5, 8, 2, "last_block")
@settings(max_examples=examples(350), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=split_rows_cases(), seed=st.integers(0, 2 ** 16))
def test_split_rows_of_random_reductions_match_float64(case: tuple[Reduction, dict[str, Any]], seed: int) -> None:
    red, plan = case
    k = build(red.tensors(), "split_rows", plan)
    rng = np.random.default_rng(seed)
    for n, (rows, reduced) in enumerate(red.calls):
        count, flat_rows = int(np.prod(reduced)), int(np.prod(rows))
        # max / min: the rows offset by 3 each (a full reduction has one row)
        x = fresh(rng, (flat_rows, count), red.dtype, red.combiner, offset_axis=0).reshape(rows + reduced)
        terms = x.astype(np.float64).reshape(flat_rows, count)
        ins = [padded_view(x, -1000.0 if red.combiner == "min" else 1000.0) if red.strided else x]
        if red.weighted:
            w = weights(rng, reduced if red.weight == "reduced" else rows + reduced, red.dtype, red.combiner)
            terms = terms * w.astype(np.float64).reshape(-1 if red.weight == "reduced" else (flat_rows, count))
            ins.append(w)
        want, tol = reduction_reference(terms, red.combiner, red.out_dtype, split_rows_chain(count, plan),
                                        1.0 / count if red.mean else 1.0, exact_terms=not red.weighted)
        y = np.full(rows, np.nan, NP_DTYPE[red.out_dtype])
        k(*ins, y)
        form = "".join(f" {f}" for f, on in (("mean", red.mean), (f"{red.weight}-weighted", red.weighted),
                                              ("strided", red.strided)) if on)
        assert_close(y.reshape(flat_rows), want, tol,
                     f"split_rows {red.combiner}{form} of X{list(rows + reduced)} {red.dtype} -> {red.out_dtype} "
                     f"(symbolic={red.symbolic}), call {n + 1}, plan {k.plan}")


# ---- split_reduce: column reductions and middle-axis means -------------------------------------

@dataclass
class SplitReduction:
    """Y[j] = ⊕_i X[i, j] ("column") or Y[a, c] = mean_b X[a, b, c] ("middle"), the terms
    times a second input when `weight` is "reduced" (W[i], W[b]) or "full" (W of X's shape at
    the same element); `calls` holds the input shape of each call."""

    kind: str
    dtype: str
    out_dtype: str
    combiner: str
    weight: str
    symbolic: bool
    calls: list[tuple[int, ...]]

    @property
    def axis(self) -> int:
        return 0 if self.kind == "column" else 1

    @property
    def weighted(self) -> bool:
        return bool(self.weight)

    def tensors(self) -> list[Any]:
        shape: list[Any] = list(self.calls[0])
        if self.symbolic:  # a middle mean's last extent stays constant: outputs_per_thread > 1 needs it
            shape[:2] = [tc.var("R"), tc.var("C")] if self.kind == "column" else [tc.var("A"), tc.var("B")]
        X = tc.placeholder(tuple(shape), self.dtype, name="X")
        N = shape[self.axis]
        W = tc.placeholder((N,) if self.weight == "reduced" else tuple(shape), self.dtype, name="W")
        i = tc.reduce_axis(N, name="i")

        def term(*idx: Any) -> Any:
            value = tc.cast(X[idx], "float32")
            if not self.weighted:
                return value
            return value * tc.cast(W[i] if self.weight == "reduced" else W[idx], "float32")

        if self.kind == "column":
            Y = tc.compute((shape[1],), lambda j: tc.cast(REDUCE[self.combiner](term(i, j), axis=i), self.out_dtype),
                           name="Y")
        else:
            scale = 1.0 / tc.cast(N, "float32") if self.symbolic else 1.0 / max(N, 1)
            Y = tc.compute((shape[0], shape[2]), lambda a, c: tc.cast(tc.sum(term(a, i, c), axis=i) * scale,
                                                                      self.out_dtype), name="Y")
        return [X, W, Y] if self.weighted else [X, Y]


@st.composite
def split_reduce_cases(draw: Callable[..., Any]) -> tuple[SplitReduction, dict[str, Any]]:
    dtype = draw(st.sampled_from(DTYPES), label="dtype")
    threads_x = draw(st.sampled_from([32, 32, 64, 96]), label="threads_x")
    threads_y = draw(st.sampled_from([t for t in (1, 2, 3, 4, 8, 16, 32) if threads_x * t <= 1024]), label="threads_y")
    splits = draw(st.one_of(st.integers(1, 6), st.sampled_from([16, 33])), label="splits")
    unroll = draw(st.integers(1, 4), label="unroll")
    vector = draw(st.sampled_from([1, 1, 2, 4, 8]), label="outputs_per_thread")
    combine = draw(st.sampled_from(["kernel", "last_block"]), label="combine")
    plan = {"threads_x": threads_x, "threads_y": threads_y, "splits": splits, "unroll": unroll,
            "outputs_per_thread": vector, "combine": combine}
    kind = draw(st.sampled_from(["column", "middle"]), label="kind")
    symbolic = draw(SYMBOLIC, label="symbolic")
    reduced = lengths([threads_y, splits * threads_y], cap=600)
    outputs = lengths([vector, threads_x * vector], cap=300, multiple=vector)
    calls: list[tuple[int, ...]] = []
    if kind == "column":
        combiner = draw(st.sampled_from(COMBINERS), label="combiner")
        # V > 1 needs a constant last extent: a symbolic column count takes one output per thread
        if symbolic and vector > 1:
            plan["outputs_per_thread"] = vector = 1
            outputs = lengths([1, threads_x], cap=300)
        for _ in range(2 if symbolic else 1):
            calls.append((draw(reduced, label="rows"), draw(outputs, label="columns")))
    else:
        combiner = "sum"
        last = draw(outputs, label="last extent")
        for _ in range(2 if symbolic else 1):
            # a symbolic mean scales by 1 / B: B = 0 would be 0 · inf
            b = draw(lengths([threads_y, splits * threads_y], low=1, cap=600) if symbolic else reduced,
                     label="reduced extent")
            calls.append((draw(st.sampled_from([1, 2, 3, 0] if not symbolic else [1, 2, 3]), label="outer"), b, last))
    if len(calls) == 1:
        calls.append(calls[0])
    out_dtype = draw(st.sampled_from([dtype, "float32"]), label="out dtype")
    weight = draw(st.sampled_from(["", "reduced", "", "full"]), label="weight")
    return SplitReduction(kind, dtype, out_dtype, combiner, weight, symbolic, calls), plan


def split_reduce_example(red: SplitReduction, threads_y: int, splits: int, unroll: int, outputs_per_thread: int,
                         combine: str) -> Any:
    plan = {"threads_x": 32, "threads_y": threads_y, "splits": splits, "unroll": unroll,
            "outputs_per_thread": outputs_per_thread, "combine": combine}
    return example(case=(red, plan), seed=0)


# pinned: a bf16 column sum with a float32 result, two outputs per thread, a partial column
# block and splits not dividing the rows; a float16 middle mean, four outputs per thread, at
# two reduced lengths
@split_reduce_example(SplitReduction("column", "bfloat16", "float32", "sum", "", False, [(300, 70)] * 2),
                      4, 5, 2, 2, "last_block")
@split_reduce_example(SplitReduction("middle", "float16", "float16", "sum", "reduced", True,
                                     [(3, 133, 48), (2, 7, 48)]), 16, 4, 4, 4, "kernel")
@settings(max_examples=examples(250), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=split_reduce_cases(), seed=st.integers(0, 2 ** 16))
def test_split_reduce_of_random_column_and_middle_reductions_match_float64(
        case: tuple[SplitReduction, dict[str, Any]], seed: int) -> None:
    red, plan = case
    k = build(red.tensors(), "split_reduce", plan)
    rng = np.random.default_rng(seed)
    for n, shape in enumerate(red.calls):
        count = shape[red.axis]
        x = fresh(rng, shape, red.dtype, red.combiner, offset_axis=-1)   # max / min: columns offset by 3
        terms = np.moveaxis(x.astype(np.float64), red.axis, -1)
        ins = [x]
        if red.weighted:
            w = weights(rng, (count,) if red.weight == "reduced" else shape, red.dtype, red.combiner)
            terms = terms * (w.astype(np.float64) if red.weight == "reduced"
                             else np.moveaxis(w.astype(np.float64), red.axis, -1))
            ins.append(w)
        chain = 1 + -(-count // (plan["splits"] * plan["threads_y"])) + plan["threads_y"] + plan["splits"] + 8
        scale = 1.0 / max(count, 1) if red.kind == "middle" else 1.0
        want, tol = reduction_reference(terms, red.combiner, red.out_dtype, chain, scale, exact_terms=not red.weighted)
        y = np.full(want.shape, np.nan, NP_DTYPE[red.out_dtype])
        k(*ins, y)
        assert_close(y, want, tol, f"split_reduce {red.kind} {red.combiner} {red.weight or 'unweighted'} of "
                                   f"X{list(shape)} {red.dtype} -> {red.out_dtype} (symbolic={red.symbolic}), "
                                   f"call {n + 1}, plan {k.plan}")


# ---- row groups: split_row_group and fuse_rows on examples/norms.py ----------------------------

ROW_OPS: dict[str, tuple[Callable[..., list[Any]], Callable[..., np.ndarray]]] = {
    "softmax": (norms.softmax, norms.np_softmax),
    "log_softmax": (lambda R, C, dtype: norms.softmax(R, C, dtype, log=True),
                    lambda x: norms.np_softmax(x, log=True)),
    "layer_norm": (norms.layer_norm, norms.np_layer_norm),
    "rms_norm": (norms.rms_norm, norms.np_rms_norm),
}
# row reductions (norms.row_reduce, the result in `out_dtype`): the group whose reduction stage
# is the output (written by one thread of the row's first block). They walk the row as the norms
# do, and with a float32 result from 16-bit rows they are what shows a column counted twice at
# every vector width: a norm moves by ~1/C then, which a 16-bit output's rounding hides
ROW_REDUCTIONS = {"row_sum": "sum", "row_max": "max"}


def row_reduction(R: Any, C: Any, dtype: str, combiner: str, out_dtype: str) -> list[Any]:
    """norms.row_reduce with its result in `out_dtype`."""
    X = tc.placeholder((R, C), dtype, name="X")
    c = tc.reduce_axis(C, name="c")
    Y = tc.compute((R,), lambda r: tc.cast(REDUCE[combiner](tc.cast(X[r, c], "float32"), axis=c), out_dtype),
                   name="Y")
    return [X, Y]


# the row input N(OFFSET, SPREAD²): layer norm's rows far from zero (non-zero mean; a variance by
# E[x²] - E[x]² would lose digits), softmax's spread wide enough that the max matters
OFFSET = {"softmax": 0.0, "log_softmax": 0.0, "layer_norm": 20.0, "rms_norm": 0.5}
SPREAD = {"softmax": 2.0, "log_softmax": 2.0, "layer_norm": 1.0, "rms_norm": 1.0}
ROW_TOLERANCE = {"float32": (1e-4, 2e-4), "bfloat16": (2.0 ** -7, 2.0 ** -8), "float16": (2.0 ** -10, 2.0 ** -11)}


@dataclass
class RowGroup:
    """One of ROW_OPS or ROW_REDUCTIONS over rows × columns, and the (rows, columns) of each
    call; `out_dtype` is a row reduction's result type (a norm's is its input's)."""

    op: str
    dtype: str
    out_dtype: str
    symbolic: bool
    calls: list[tuple[int, int]]

    def tensors(self) -> list[Any]:
        R, C = (tc.var("R"), tc.var("C")) if self.symbolic else self.calls[0]
        if self.op in ROW_REDUCTIONS:
            return row_reduction(R, C, self.dtype, ROW_REDUCTIONS[self.op], self.out_dtype)
        return ROW_OPS[self.op][0](R, C, self.dtype)


def row_group_calls(draw: Callable[..., Any], symbolic: bool, columns: st.SearchStrategy[int],
                    rows: list[int]) -> list[tuple[int, int]]:
    first = (draw(st.sampled_from(rows), label="rows"), draw(columns, label="columns"))
    if not symbolic:
        return [first, first]
    return [first, (draw(st.sampled_from(rows), label="rows 2"), draw(columns, label="columns 2"))]


def run_row_group(group: RowGroup, step: str, plan: dict[str, Any], seed: int) -> None:
    """Build `group` under the one-step plan and check its calls on fresh inputs: the row input
    N(OFFSET, SPREAD²) (a row reduction's as `fresh`), the per-column weights N(0, 1)."""
    args = group.tensors()
    k = build(args, step, plan)
    per_column = sum(1 for t in args if t.is_placeholder) - 1      # layer norm's g and b, RMS norm's g
    rng = np.random.default_rng(seed)
    rtol, floor = ROW_TOLERANCE[group.dtype]
    for n, (R, C) in enumerate(group.calls):
        what = (f"{step} {group.op} {group.dtype} -> {group.out_dtype} {R}x{C} (symbolic={group.symbolic}), "
                f"call {n + 1}, plan {k.plan}")
        # a thread's columns, the block's all-reduce (≤ 32 warps), the S partials' fold
        chain = -(-C // plan["threads"]) + plan["threads"] // 32 + plan.get("splits", 1) + 24
        if group.op in ROW_REDUCTIONS:
            combiner = ROW_REDUCTIONS[group.op]
            x = fresh(rng, (R, C), group.dtype, combiner, offset_axis=0)
            want, tol = reduction_reference(x.astype(np.float64), combiner, group.out_dtype, chain)
            y = np.full(R, np.nan, NP_DTYPE[group.out_dtype])
            k(x, y)
            assert_close(y, want, tol, what)
            continue
        ins = [(OFFSET[group.op] + SPREAD[group.op] * rng.standard_normal((R, C))).astype(NP_DTYPE[group.dtype])]
        ins += [rng.standard_normal(C).astype(NP_DTYPE[group.dtype]) for _ in range(per_column)]
        y = np.full((R, C), np.nan, NP_DTYPE[group.dtype])
        k(*ins, y)
        want = ROW_OPS[group.op][1](*ins)
        tol = rtol * np.abs(want) + floor * float(np.max(np.abs(want), initial=0.0))
        if group.op == "layer_norm":
            x, g, b = ins
            tol = tol + layer_norm_conditioning(x, g, b, want, chain)
        assert_close(y, want, tol, what)


def layer_norm_conditioning(x: np.ndarray, g: np.ndarray, b: np.ndarray, want: np.ndarray, chain: int
                            ) -> np.ndarray:
    """What float32 rounding of μ does to a layer norm: μ is off by up to δ = chain·u·max|x| (a
    sum of the row, divided by C), which moves x - μ by δ and the variance by about 2δ·|x - μ|,
    so an output by (|g| + |y - b|)·δ / sqrt(var + eps). Negligible on rows of σ ~ 1, it is
    the whole error on a row whose values nearly agree (2 columns of 20 + N(0, 1), 0.006 apart:
    6e-4 relative, in every form of the kernel and in NumPy's own float32 two-pass formula)."""
    x64 = x.astype(np.float64)
    delta = chain * U32 * np.abs(x64).max(axis=-1, keepdims=True, initial=0.0)
    sigma = np.sqrt(x64.var(axis=-1, keepdims=True) + norms.EPS)   # rows of C ≥ 1 here
    return (np.abs(g.astype(np.float64)) + np.abs(want - b.astype(np.float64))) * delta / sigma


GROUP_OPS = sorted(ROW_OPS) + ["row_sum", "row_max", "row_sum"]


@st.composite
def split_row_group_cases(draw: Callable[..., Any]) -> tuple[RowGroup, dict[str, Any]]:
    op = draw(st.sampled_from(GROUP_OPS), label="op")
    dtype = draw(st.sampled_from(DTYPES), label="dtype")
    symbolic = draw(SYMBOLIC, label="symbolic")
    threads = draw(st.sampled_from(THREADS[:4]), label="threads")
    # a symbolic row's alignment cannot be proved: one column at a time
    vector = 1 if symbolic else draw(st.sampled_from([v for v in (1, 2, 4, 8) if v <= WIDEST[dtype]]), label="vector")
    unroll = draw(st.integers(1, 4), label="unroll")
    # more partials than a warp's lanes (kernel 2 folds two per lane) on 32-thread blocks
    splits = draw(st.one_of(st.integers(1, 5), st.just(33) if threads == 32 else st.just(6)), label="splits")
    plan = {"threads": threads, "splits": splits, "vector": vector, "unroll": unroll}
    if draw(st.booleans(), label="other output splits"):
        plan["output_splits"] = draw(st.integers(1, 6), label="output_splits")
    tile = threads * vector * unroll
    columns = lengths([threads * vector, tile, splits * tile], low=1, cap=1500, multiple=vector)
    calls = row_group_calls(draw, symbolic, columns, [1, 2, 3, 0])
    out_dtype = draw(st.sampled_from([dtype, "float32"]), label="out dtype") if op in ROW_REDUCTIONS else dtype
    return RowGroup(op, dtype, out_dtype, symbolic, calls), plan


# pinned: layer norm with a guarded last chunk; a bf16 row sum (float32 result) over more
# partials than a warp's lanes, with other output splits
@example(case=(RowGroup("layer_norm", "float32", "float32", False, [(3, 1000)] * 2),
               {"threads": 64, "splits": 3, "vector": 4, "unroll": 2}), seed=0)
@example(case=(RowGroup("row_sum", "bfloat16", "float32", False, [(2, 3000)] * 2),
               {"threads": 32, "splits": 40, "vector": 8, "unroll": 1, "output_splits": 7}), seed=0)
@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=split_row_group_cases(), seed=st.integers(0, 2 ** 16))
def test_split_row_group_of_random_norms_match_float64(case: tuple[RowGroup, dict[str, Any]], seed: int) -> None:
    group, plan = case
    run_row_group(group, "split_row_group", plan, seed)


@st.composite
def fuse_rows_cases(draw: Callable[..., Any]) -> tuple[RowGroup, dict[str, Any]]:
    op = draw(st.sampled_from(GROUP_OPS), label="op")
    dtype = draw(st.sampled_from(DTYPES), label="dtype")
    symbolic = draw(SYMBOLIC, label="symbolic")
    # a symbolic row is re-read (no registers) one column at a time
    cache = draw(st.sampled_from(["online", "none"] if symbolic else ["registers", "online", "none"]), label="cache")
    threads = draw(st.sampled_from(THREADS), label="threads")
    vector = 1 if symbolic else draw(st.sampled_from([v for v in (1, 2, 4, 8) if v <= WIDEST[dtype]]), label="vector")
    unroll = 1 if cache == "registers" else draw(st.integers(1, 4), label="unroll")
    # several rows per block: one warp each, the last block partial
    rows_per_block = draw(st.sampled_from([1, 2, 3, 4, 8]), label="rows_per_block") if threads == 32 else 1
    plan = {"threads": threads, "cache": cache, "vector": vector, "unroll": unroll, "rows_per_block": rows_per_block}
    tile = threads * vector * unroll
    columns = lengths([threads * vector, tile], low=1, cap=1500 if cache != "registers" else 600, multiple=vector)
    rows = [1, 2, 3, 0, 5] if rows_per_block == 1 else [1, rows_per_block - 1, rows_per_block + 1, 2 * rows_per_block]
    calls = row_group_calls(draw, symbolic, columns, rows)
    out_dtype = draw(st.sampled_from([dtype, "float32"]), label="out dtype") if op in ROW_REDUCTIONS else dtype
    return RowGroup(op, dtype, out_dtype, symbolic, calls), plan


# pinned: bf16 softmax, two rows per block (a partial last block), 16-byte chunks; a bf16 row
# sum (float32 result) kept in registers
@example(case=(RowGroup("softmax", "bfloat16", "bfloat16", False, [(5, 296)] * 2),
               {"threads": 32, "cache": "online", "vector": 8, "unroll": 2, "rows_per_block": 2}), seed=0)
@example(case=(RowGroup("row_sum", "bfloat16", "float32", False, [(3, 1000)] * 2),
               {"threads": 64, "cache": "registers", "vector": 8, "unroll": 1, "rows_per_block": 1}), seed=0)
@settings(max_examples=examples(250), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=fuse_rows_cases(), seed=st.integers(0, 2 ** 16))
def test_fuse_rows_of_random_norms_match_float64(case: tuple[RowGroup, dict[str, Any]], seed: int) -> None:
    group, plan = case
    run_row_group(group, "fuse_rows", plan, seed)
