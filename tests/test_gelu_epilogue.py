"""gelu(X·Wᵀ + b) fused into the wgmma GEMM: the cheap GELUs (tecc/ir/approx_gelu.py) against
float64 under their stated bounds; the approx_math rewrite that finds a GELU written by hand;
whole fused GEMMs in the emulator (fresh random inputs, outputs poisoned with NaN, float64
reference) with the staged TMA epilogue of the persistent grid; and, with NVRTC, the kernels of
benchmarks/epilogue.py's shapes on sm_90a: no spills, the cheap call, the bias reads unguarded
where the tiles divide the output, and what explain() says of the plan and the math."""

from __future__ import annotations

import math
from typing import Any, Callable

import ml_dtypes
import numpy as np
import pytest
from nvrtc_checks import needs_nvrtc
from test_tma_store import store_plan

import tecc as tc
from tecc.ir import approx_gelu
from tecc.ir.expr import Call, Cast, walk
from tecc.ir.stmt import BufferStore, IfThenElse, iter_stmts
from tecc.passes.approx_math import approximate_expr, gelu_form
from tecc.runtime.sim.numerics import FLOAT_FUNCS

ERFC = np.vectorize(math.erfc)
SQRT_HALF = math.sqrt(0.5)
TANH_SCALE = math.sqrt(2.0 / math.pi)
NUMPY = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
UNIT_ROUNDOFF = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}


def gelu64(x: np.ndarray, form: str) -> np.ndarray:
    """The GELU in float64: x Phi(x) through erfc (no cancellation), or the tanh form as
    x / (1 + e^(-2u)) (the same function, without 1 + tanh's cancellation)."""
    x = np.asarray(x, np.float64)
    if form == "erf":
        return x * 0.5 * ERFC(-x * SQRT_HALF)
    u = TANH_SCALE * (x + 0.044715 * x ** 3)
    with np.errstate(over="ignore"):
        return x / (1.0 + np.exp(-2.0 * u))


def gelu_expr(v: Any, form: str) -> Any:
    if form == "erf":
        return 0.5 * v * (1.0 + tc.erf(v * SQRT_HALF))
    return 0.5 * v * (1.0 + tc.tanh(TANH_SCALE * (v + 0.044715 * v * v * v)))


def sweep() -> np.ndarray:
    """Every 64th float32 in [-16, 16] (|x| >= 2^-20), and some tiny and special values."""
    bits = np.arange(np.float32(2.0 ** -20).view(np.uint32), np.float32(16.0).view(np.uint32), 64, dtype=np.uint32)
    pos = bits.view(np.float32)
    return np.concatenate([pos, -pos, np.float32([0.0, -0.0, 1e-30, -1e-30, 1e-40, -1e-40])])


# ---- the cheap GELUs in NumPy (what the emulator runs, step for step as the CUDA helpers) -------------

def test_gelu_erf_approx_is_within_its_bound_of_x_phi_x() -> None:
    x = sweep()
    got = FLOAT_FUNCS["gelu_erf_approx"](x).astype(np.float64)
    want = gelu64(x, "erf")
    bound = approx_gelu.ERF_RELATIVE * np.abs(want) + approx_gelu.ERF_ABSOLUTE_PER_X * np.abs(x.astype(np.float64))
    excess = np.abs(got - want) - bound
    i = int(np.argmax(excess))
    assert excess[i] <= 0, f"gelu_erf_approx({x[i]!r}) = {got[i]!r}, want {want[i]!r} (bound {bound[i]:.3g})"
    # the relative part alone holds down to the fitted range's end
    inside = x >= approx_gelu.ERF_NEGATIVE_END
    rel = np.abs(got - want)[inside] / np.maximum(np.abs(want[inside]), 1e-300)
    assert rel.max() <= approx_gelu.ERF_RELATIVE


def test_gelu_tanh_approx_is_within_its_bound_of_the_tanh_form() -> None:
    x = sweep()
    got = FLOAT_FUNCS["gelu_tanh_approx"](x).astype(np.float64)
    want = gelu64(x, "tanh")
    xd = x.astype(np.float64)
    t = xd * (approx_gelu.TANH_A + approx_gelu.TANH_B * xd * xd)
    bound = np.vectorize(approx_gelu.tanh_relative)(t) * np.abs(want) + 2.0 ** -122   # flushed results
    excess = np.abs(got - want) - bound
    i = int(np.argmax(excess))
    assert excess[i] <= 0, f"gelu_tanh_approx({x[i]!r}) = {got[i]!r}, want {want[i]!r} (bound {bound[i]:.3g})"
    near = np.abs(x) <= 5
    assert (np.abs(got - want)[near] <= 2.0 ** -17.8 * np.abs(want[near]) + 1e-300).all()


@pytest.mark.parametrize("form", ["erf", "tanh"])
def test_the_cheap_gelus_keep_infinities_and_nan_as_documented(form: str) -> None:
    got = FLOAT_FUNCS[f"gelu_{form}_approx"](np.float32([np.inf, -np.inf, np.nan]))
    assert got[0] == np.inf and np.isnan(got[2])
    assert (got[1] == -np.inf) if form == "erf" else np.isnan(got[1])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("form", ["erf", "tanh"])
def test_rounded_to_16_bits_the_cheap_gelu_is_the_correct_rounding_or_its_neighbour(form: str, dtype: str) -> None:
    """Within |x| <= 8 (the erf form: from x = -6.01, where its relative bound holds) every 16-bit
    result is the correctly rounded GELU or the next value; they differ only where the exact value
    lies within the approximation's error of a rounding boundary (a handful in a thousand)."""
    npd = NUMPY[dtype]
    low = approx_gelu.ERF_NEGATIVE_END if form == "erf" else -8.0
    x = np.linspace(low, 8, 200001).astype(np.float32)
    got = FLOAT_FUNCS[f"gelu_{form}_approx"](x).astype(npd)
    want = gelu64(x, form).astype(npd)
    # 16-bit floats of one sign are ordered as their bit patterns: a neighbour is one step away
    # (the sign of a zero aside)
    steps = np.abs(got.view(np.uint16).astype(np.int32) - want.view(np.uint16).astype(np.int32))
    steps = np.where(got.astype(np.float64) == want.astype(np.float64), 0, steps)
    i = int(np.argmax(steps))
    assert steps[i] <= 1, f"x = {x[i]!r}: got {got[i]!r}, want {want[i]!r}"
    assert (steps == 0).mean() > 0.995


# ---- the rewrite that finds a GELU --------------------------------------------------------------------

def _v() -> tuple[Any, Any]:
    X = tc.placeholder((4, 8), "float16", name="X")
    b = tc.placeholder((8,), "float16", name="b")
    return X, b


@pytest.mark.parametrize("written", [
    lambda v: 0.5 * v * (1.0 + tc.erf(v * SQRT_HALF)),
    lambda v: v * (tc.erf(v / math.sqrt(2.0)) + 1.0) * 0.5,
    lambda v: (1.0 + tc.erf(SQRT_HALF * v)) * (v * 0.5),
])
def test_the_erf_gelu_is_found_however_its_product_is_written(written: Callable[[Any], Any]) -> None:
    X, b = _v()
    v = tc.cast(X[1, 2], "float32") + tc.cast(b[2], "float32")
    e = written(v)
    form = gelu_form(e)
    assert form is not None and form[0] == "gelu_erf_approx" and form[1] is v
    rewritten = approximate_expr(tc.cast(e, "bfloat16"))
    assert isinstance(rewritten, Cast) and isinstance(rewritten.a, Call) and rewritten.a.name == "gelu_erf_approx"


@pytest.mark.parametrize("written", [
    lambda v: 0.5 * v * (1.0 + tc.tanh(TANH_SCALE * (v + 0.044715 * v * v * v))),
    lambda v: v * 0.5 * (tc.tanh(TANH_SCALE * v + TANH_SCALE * 0.044715 * (v * v) * v) + 1.0),
])
def test_the_tanh_gelu_is_found_with_its_cubic_expanded_or_not(written: Callable[[Any], Any]) -> None:
    X, b = _v()
    v = tc.cast(X[0, 1], "float32") - tc.cast(b[1], "float32")
    form = gelu_form(written(v))
    assert form is not None and form[0] == "gelu_tanh_approx" and form[1] is v


@pytest.mark.parametrize("written", [
    lambda v: 0.5 * v * (1.0 + tc.erf(v * 0.7071)),                  # another function: 1e-5 off
    lambda v: v * (1.0 + tc.erf(v * SQRT_HALF)),                     # no 1/2
    lambda v: 0.5 * v * (1.0 + tc.tanh(TANH_SCALE * (v + 0.05 * v * v * v))),
    lambda v: 0.5 * v * (2.0 + tc.erf(v * SQRT_HALF)),
])
def test_near_misses_are_left_precise(written: Callable[[Any], Any]) -> None:
    X, b = _v()
    v = tc.cast(X[0, 1], "float32") + tc.cast(b[1], "float32")
    assert gelu_form(written(v)) is None
    assert not any(isinstance(n, Call) and n.name.startswith("gelu_")
                   for n in walk(approximate_expr(tc.cast(written(v), "float16"))))


def test_a_float32_gelu_that_is_kept_is_left_precise() -> None:
    X, b = _v()
    v = tc.cast(X[0, 1], "float32") + tc.cast(b[1], "float32")
    e = gelu_expr(v, "erf")
    assert approximate_expr(e) is e
    assert approximate_expr(tc.cast(e, "float64")) is not None
    assert not any(isinstance(n, Call) and n.name.startswith("gelu_") for n in walk(approximate_expr(tc.cast(e, "float64"))))


# ---- the fused GEMM in the emulator --------------------------------------------------------------------

def linear(m: int, n: int, k: int, dtype: str, form: str) -> list[tc.Tensor]:
    """[A, B, bias, C]: C = gelu(A·Bᵀ + bias) rounded once to `dtype` (tests/test_tensorize.py's names)."""
    r = tc.reduce_axis(k, name="r")
    A = tc.placeholder((m, k), dtype, name="A")
    B = tc.placeholder((n, k), dtype, name="B")
    bias = tc.placeholder((n,), dtype, name="bias")
    S = tc.compute((m, n), lambda i, j: tc.sum(tc.cast(A[i, r], "float32") * tc.cast(B[j, r], "float32"), axis=r),
                   name="S")
    C = tc.compute((m, n), lambda i, j: tc.cast(gelu_expr(S[i, j] + tc.cast(bias[j], "float32"), form), dtype),
                   name="C")
    return [A, B, bias, C]


def run_fused(f: Any, m: int, n: int, k: int, dtype: str, seed: int) -> tuple[np.ndarray, ...]:
    g = np.random.default_rng(seed)
    npd = NUMPY[dtype]
    a = (g.standard_normal((m, k)) * k ** -0.25).astype(npd)
    b = (g.standard_normal((n, k)) * k ** -0.25).astype(npd)
    bias = g.uniform(-3, 3, n).astype(npd)
    out = np.full((m, n), np.nan, npd)
    f(a, b, bias, out)
    return a, b, bias, out


def check_fused(a: np.ndarray, b: np.ndarray, bias: np.ndarray, out: np.ndarray, form: str, dtype: str,
                what: str) -> None:
    """|got - gelu(v)| within: the float32 sum's error (K + 1)·2^-24·Σ|a·b| times GELU's largest
    slope (1.13), the cheap GELU's error, and one rounding to the output dtype."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    k = a.shape[1]
    v = a64 @ b64.T + bias.astype(np.float64)
    want = gelu64(v, form)
    sum_error = (k + 1) * 2.0 ** -24 * (np.abs(a64) @ np.abs(b64).T) * 1.13
    bound = (sum_error + 2.0 ** -16 * np.abs(want) + 2.0 ** -29 * np.abs(v)
             + UNIT_ROUNDOFF[dtype] * (np.abs(want) + sum_error) + 2.0 ** -24)
    got = out.astype(np.float64)
    err = np.where(np.isnan(got), np.inf, np.abs(got - want) - bound)
    if (err > 0).any():
        i = np.unravel_index(int(np.argmax(err)), err.shape)
        raise AssertionError(f"{what}: {(err > 0).sum()} of {err.size} elements off; worst at {tuple(map(int, i))}: "
                             f"got {got[i]!r}, want {want[i]!r} (bound {bound[i]:.3g})")


def staging_guards(f: Any) -> int:
    """Guarded stores into the staging tile (the per-element `row < M && column < N`)."""
    return sum(1 for s in iter_stmts(f.module.kernels[0].body)
               if isinstance(s, IfThenElse) and isinstance(s.then_case, BufferStore)
               and s.then_case.buffer.scope == "shared")


@pytest.mark.parametrize("form,dtype,m,n,k,blocks", [
    ("erf", "float16", 256, 128, 128, 3),      # tiles divide M and N: no guard, bias reads batched
    ("tanh", "bfloat16", 256, 128, 192, 3),
    ("erf", "bfloat16", 136, 72, 136, 2),      # partial tiles: the guard keeps the bias read in bounds
    ("tanh", "float16", 136, 72, 72, 2),
])
def test_a_fused_gelu_gemm_in_the_persistent_tma_kernel_matches_float64(form: str, dtype: str, m: int, n: int,
                                                                        k: int, blocks: int) -> None:
    f = tc.build(linear(m, n, k, dtype, form), target="sim", plan=store_plan((128, 64), 3, blocks))
    a, b, bias, out = run_fused(f, m, n, k, dtype, seed=m + n + k)
    check_fused(a, b, bias, out, form, dtype, f"fused gelu ({form}) {dtype} {m}x{n}x{k}")
    assert f"tecc_gelu_{form}_approx(" in f.source
    divides = m % 128 == 0 and n % 64 == 0
    assert (staging_guards(f) == 0) == divides


def test_precise_math_keeps_erff_in_the_epilogue_and_stays_correct(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TECC_PRECISE_MATH", "1")
    m, n, k = 128, 64, 64
    f = tc.build(linear(m, n, k, "float16", "erf"), target="sim", plan=store_plan((128, 64), 2, 1))
    assert "erff(" in f.source and "tecc_gelu" not in f.source
    a, b, bias, out = run_fused(f, m, n, k, "float16", seed=5)
    check_fused(a, b, bias, out, "erf", "float16", "precise fused gelu")


# ---- the kernels of benchmarks/epilogue.py on sm_90a (NVRTC, no GPU) -------------------------------------

SHAPES = [(8192, 3072, 768, "float16"), (8192, 768, 3072, "bfloat16"), (4096, 11008, 4096, "bfloat16")]


@needs_nvrtc
@pytest.mark.parametrize("m,n,k,dtype", SHAPES)
@pytest.mark.parametrize("form", ["erf", "tanh"])
def test_the_benchmark_shapes_plan_the_tma_kernel_and_compile_without_spills(m: int, n: int, k: int, dtype: str,
                                                                             form: str) -> None:
    f = tc.build(linear(m, n, k, dtype, form), target="cuda", arch="sm_90")
    assert f.arch == "sm_90a"
    (res,) = f.resources.values()
    assert res.spill_stores == 0 and res.spill_loads == 0, res
    chosen = f.planning.kernels[0].chosen
    assert chosen.strategy.name == "gemm_wgmma" and chosen.point.get("load") == "tma", chosen.label
    assert chosen.point.get("epilogue") == "tma" and chosen.point.get("persistent"), chosen.label
    assert f"tecc_gelu_{form}_approx(" in f.source and "erff(" not in f.source and "tanhf(" not in f.source
    assert staging_guards(f) == 0
    text = f.explain()
    assert f"computed by gelu_{form}_approx" in text
    assert "fused epilogue:" in text and "cycles per 128x256 tile" in text
    # the planner's reason to fuse, in the plan's words: the epilogue on the consumers against the
    # output's DRAM round trip of a separate kernel
    assert "(fusion pays)" in text, text


@needs_nvrtc
def test_a_plain_gemm_keeps_its_guard_and_prices_no_epilogue() -> None:
    r = tc.reduce_axis(768, name="r")
    A = tc.placeholder((8192, 768), "float16", name="A")
    B = tc.placeholder((3072, 768), "float16", name="B")
    C = tc.compute((8192, 3072), lambda i, j: tc.cast(tc.sum(tc.cast(A[i, r], "float32") * tc.cast(B[j, r], "float32"),
                                                             axis=r), "float16"), name="C")
    f = tc.build([A, B, C], target="cuda", arch="sm_90")
    assert staging_guards(f) == 1
    assert "fused epilogue:" not in f.explain() and "math:" not in f.explain()
    assert f.planning.kernels[0].info.epilogue_instructions == 0 and f.planning.kernels[0].info.epilogue_mufu == 0


def test_the_epilogue_is_priced_per_tile_and_the_cheap_gelu_below_the_precise_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner's facts of the epilogue: the cheap erf GELU is 13 instructions + 1 MUFU
    beside the bias's add and conversion; erff's (precise math) 24 + 1; the chain of the chosen
    point carries bm·bn·max(E/128, U/16) cycles per tile more than the plain GEMM's."""
    from tecc.compiler.cost.analysis import analyze_kernel
    from tecc.compiler.strategies.gemm_epilogue_cost import epilogue_math_cycles
    from tecc.passes.lower import lower

    cheap = analyze_kernel(lower(linear(8192, 3072, 768, "float16", "erf")).kernels[0])
    monkeypatch.setenv("TECC_PRECISE_MATH", "1")
    precise = analyze_kernel(lower(linear(8192, 3072, 768, "float16", "erf")).kernels[0])
    assert cheap.epilogue_mufu == 1 and precise.epilogue_mufu == 1
    assert cheap.epilogue_instructions < precise.epilogue_instructions
    assert epilogue_math_cycles(cheap, 128, 256) == 128 * 256 * max(cheap.epilogue_instructions / 128, 1 / 16)
    assert epilogue_math_cycles(cheap, 128, 256) < epilogue_math_cycles(precise, 128, 256)
