"""The cheap sin/cos for results rounded to a 16-bit float (tecc/passes/approx_math.py,
tecc/ir/approx.py): when the rewrite happens, what the emitter prints, what the emulator and the
GPU compute, how accurate the approximation is, and how the cost model prices it."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import tecc as tc
from tecc.compiler.cost.analysis import CONVERSION_COST, INSTRUCTION_COST, analyze_kernel
from tecc.compiler.schedule import Schedule
from tecc.ir import approx
from tecc.ir.errors import DTypeError
from tecc.ir.evaluate import evaluate
from tecc.ir.expr import Call, Expr, Var, call, walk
from tecc.ir.serialize import VarTable, expr_from_json, expr_to_json
from tecc.ir.stmt import Module
from tecc.ir.visitor import ExprMutator, StmtMutator, StmtVisitor
from tecc.passes.approx_math import approx_math, approximate_expr
from tecc.passes.lower import lower
from tecc.runtime.sim.numerics import FLOAT_FUNCS

FUNCS = {"sin": (tc.sin, np.sin), "cos": (tc.cos, np.cos)}


def sin_affine(rows: int, cols: int, dtype: str, fn: str = "sin") -> list[tc.Tensor]:
    """Y[r, j] = dtype(sin(1.5 * float(X[r, j]) + float(b[j]))), benchmarks/memory_bound.py's op."""
    X = tc.placeholder((rows, cols), dtype, name="X")
    b = tc.placeholder((cols,), dtype, name="b")
    f = FUNCS[fn][0]
    Y = tc.compute((rows, cols), lambda r, j: tc.cast(f(1.5 * tc.cast(X[r, j], "float32") + tc.cast(b[j], "float32")),
                                                       dtype), name="Y")
    return [X, b, Y]


def calls_in(module: Module) -> list[str]:
    """The names of the Calls in every kernel's statements, in order."""
    return [n.name for k in module.kernels for n in walk_stmt_exprs(k.body) if isinstance(n, Call)]


def walk_stmt_exprs(body: object) -> list[Expr]:
    found: list[Expr] = []

    class Collect(StmtVisitor):
        def visit_expr(self, e: Expr) -> None:
            found.extend(walk(e))

    Collect().visit(body)  # type: ignore[arg-type]
    return found


# ---- when the rewrite happens ---------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("fn", ["sin", "cos"])
def test_a_float32_sin_or_cos_cast_to_a_16bit_float_becomes_the_cheap_form(dtype, fn):
    module = approx_math(lower(sin_affine(8, 16, dtype, fn)))
    assert calls_in(module) == [f"{fn}_approx"], str(module)
    assert f"{dtype}({fn}_approx(1.5 * float32(X[" in str(module), str(module)


def test_sin_of_a_16bit_value_becomes_the_cheap_form():
    X = tc.placeholder((8, 16), "bfloat16", name="X")
    Y = tc.compute((8, 16), lambda i, j: tc.sin(X[i, j]) * 2.0, name="Y")
    module = approx_math(lower([X, Y]))
    (node,) = [n for n in walk_stmt_exprs(module.kernels[0].body) if isinstance(n, Call)]
    assert node.name == "sin_approx" and node.dtype == tc.bfloat16, str(module)


@pytest.mark.parametrize("make", [
    lambda x: tc.sin(x),                                   # a float32 output: sinf's precision kept
    lambda x: tc.cast(tc.sin(x) + 1.0, "bfloat16"),        # rounded, but only after more float32 math
    lambda x: tc.cast(tc.sin(tc.cast(x, "float64")), "bfloat16"),  # float64 sin
], ids=["float32-output", "float32-math-in-between", "float64"])
def test_sin_is_left_precise_unless_rounded_to_16_bits_at_once(make):
    X = tc.placeholder((8, 16), "float32", name="X")
    Y = tc.compute((8, 16), lambda i, j: make(X[i, j]), name="Y")
    lowered = lower([X, Y])
    assert approx_math(lowered) is lowered


def test_a_shared_sin_node_is_made_cheap_only_where_it_is_rounded():
    x = Var("x", tc.float32, "value")
    s = tc.sin(x)  # hash-consed: one node, used twice
    e = tc.cast(tc.cast(s, "bfloat16"), "float32") + s * 2.0
    out = approximate_expr(e)
    names = sorted(n.name for n in walk(out) if isinstance(n, Call))
    assert names == ["sin", "sin_approx"], str(out)


def test_precise_math_knob_keeps_sinf(monkeypatch, tmp_path: Path):
    args = sin_affine(8, 16, "bfloat16")
    cheap = tc.build(args, "sim", plan=tc.default_plan(), dump_ir=tmp_path / "cheap")
    assert "sin_approx" in calls_in(cheap.module) and "tecc_sin_approx(" in cheap.source
    (dump,) = (tmp_path / "cheap").glob("*_approx_math.txt")
    assert "sin_approx(" in dump.read_text() and "# precise = False" in dump.read_text()
    monkeypatch.setenv("TECC_PRECISE_MATH", "1")
    precise = tc.build(args, "sim", plan=tc.default_plan())
    assert calls_in(precise.module) == ["sin"]
    assert "tecc_sin_approx" not in precise.source and "sinf(" in precise.source


# ---- the intrinsics in the IR ----------------------------------------------------------------
def test_approx_intrinsics_have_dtype_rules_print_serialize_and_evaluate():
    x = Var("x", tc.float32, "value")
    e = call("cos_approx", x)
    assert e.dtype == tc.float32 and str(e) == "cos_approx(x)"
    assert call("sin_approx", Var("h", tc.float16, "value")).dtype == tc.float16
    with pytest.raises(DTypeError, match="float32, float16 or bfloat16"):
        call("sin_approx", Var("d", tc.float64, "value"))
    with pytest.raises(DTypeError):
        tc.sin(Var("i", tc.int32, "value"))  # tc.sin itself is unchanged
    back = expr_from_json(expr_to_json(e), VarTable())
    assert isinstance(back, Call) and back.name == "cos_approx" and back.dtype == tc.float32
    assert evaluate(e, {x: 0.5}) == pytest.approx(np.cos(0.5), abs=1e-9)


# ---- CUDA -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_emitted_cuda_defines_each_helper_once_and_compiles(dtype):
    X = tc.placeholder((64, 40), dtype, name="X")
    S = tc.compute((64, 40), lambda i, j: tc.cast(tc.sin(tc.cast(X[i, j], "float32")), dtype), name="S")
    C = tc.compute((64, 40), lambda i, j: tc.cos(X[i, j]) + tc.sin(X[i, j]), name="C")
    f = tc.build([X, S, C], "cuda", arch="sm_90")  # NVRTC needs no GPU
    for helper in ("tecc_sin_poly", "tecc_sin_approx", "tecc_cos_approx"):
        assert f.source.count(f"__device__ __forceinline__ float {helper}(float") == 1, f.source
    assert f.source.index("tecc_sin_poly(float") < f.source.index("tecc_sin_approx(float") < f.source.index(
        "__global__")
    to_half, to_float = (("__float2bfloat16_rn", "__bfloat162float") if dtype == "bfloat16"
                         else ("__float2half_rn", "__half2float"))
    assert f"{to_half}(tecc_sin_approx({to_float}(" in f.source  # a 16-bit sin: computed in float
    assert "sin.approx" not in f.ptx and f.resources  # no MUFU, and ptxas accepted it
    plain = tc.build(sin_affine(8, 16, "float32"), "cuda", arch="sm_90")
    assert "tecc_" not in plain.source and "sinf(" in plain.source


# ---- the emulator: kernels against float64 NumPy -----------------------------------------------
def ulp(values: np.ndarray, dtype: str) -> np.ndarray:
    """The spacing of `dtype` (bfloat16: 8 significant bits, float16: 11) at each |value|."""
    bits, tiny = (8, -133) if dtype == "bfloat16" else (11, -24)
    v = np.abs(values.astype(np.float64))
    exponent = np.floor(np.log2(np.where(v > 0, v, 1.0)))
    return 2.0 ** np.maximum(exponent - (bits - 1), tiny)


def assert_within_one_ulp(out: np.ndarray, ref: np.ndarray, dtype: str, what: str) -> None:
    """`out` (16-bit) is the 16-bit rounding of the float64 `ref` or a neighbour of it."""
    rounded = ref.astype(np.float32).astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16)
    diff = np.abs(out.astype(np.float64) - rounded.astype(np.float64)) / ulp(rounded, dtype)
    worst = np.unravel_index(np.argmax(diff), diff.shape)
    assert diff.max() <= 1.0, (f"{what}: {diff.max():.2f} ulp at {worst}: got {out[worst]!r}, "
                               f"want {rounded[worst]!r} (float64 {ref[worst]!r})")
    assert np.mean(diff == 0) > 0.99, f"{what}: only {np.mean(diff == 0):.4f} correctly rounded"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("fn", ["sin", "cos"])
@pytest.mark.parametrize("shape", [(37, 100), (5, 1001)])
def test_sin_affine_in_the_emulator_matches_float64(dtype, fn, shape):
    rows, cols = shape
    f = tc.build(sin_affine(rows, cols, dtype, fn), "sim")  # plan="auto", like the benchmark
    assert f"{fn}_approx" in calls_in(f.module), f.plan
    rng = np.random.default_rng(7)
    x = rng.uniform(-40, 40, (rows, cols)).astype(dtype if dtype == "float16" else ml_dtypes.bfloat16)
    b = rng.uniform(-4, 4, cols).astype(x.dtype)
    y = np.full((rows, cols), np.nan, x.dtype)
    f(x, b, y)
    ref = FUNCS[fn][1](1.5 * x.astype(np.float64) + b.astype(np.float64))
    assert_within_one_ulp(y, ref, dtype, f"{fn} {dtype} {shape} plan {f.plan}")


# ---- the approximation itself: NumPy float32 implementation against float64 -------------------
def sweep_arguments(per_binade: int, rng: np.random.Generator) -> np.ndarray:
    """Float32 arguments: random ones in every binade from 2^-30 to 2^17 and beyond, the floats
    nearest k*pi/2 (zeros of sin and cos) with their neighbours, ±0, denormals, the range
    limit, huge values, inf and NaN."""
    parts = [rng.uniform(1, 2, per_binade) * 2.0 ** k for k in range(-30, 24)]
    k = np.arange(-2 * 41724, 2 * 41724 + 1, 7)
    near = (k * (np.pi / 2)).astype(np.float32)
    parts += [near, np.nextafter(near, np.float32(np.inf)), np.nextafter(near, np.float32(-np.inf))]
    parts.append(np.array([0.0, 1e-45, 1e-40, 1.1754942e-38, approx.FAST_RANGE, 131072.02, 1e6, 1e10, 1e30,
                           3.4028235e38, np.inf, np.nan, np.pi, np.pi / 2, 3 * np.pi / 2]))
    x = np.concatenate(parts).astype(np.float32)
    return np.concatenate([x, -x])


def check_approximation(x: np.ndarray, y: np.ndarray, fn: str, what: str) -> None:
    """The bound of tecc/ir/approx.py where it applies, and the edge cases everywhere."""
    with np.errstate(invalid="ignore"):
        ref = FUNCS[fn][1](x.astype(np.float64))
    err = np.abs(y.astype(np.float64) - ref)
    fast = np.abs(x) <= approx.FAST_RANGE
    excess = np.where(fast, err - (approx.RELATIVE_ERROR * np.abs(ref) + approx.ABSOLUTE_ERROR), -1.0)
    i = int(np.nanargmax(excess))
    assert excess[i] <= 0, f"{what}: {fn}({x[i]!r}) = {y[i]!r}, float64 {ref[i]!r}: error {err[i]:.3g} over the bound"
    beyond = ~fast & np.isfinite(x)
    assert np.all(err[beyond] <= 2.0 ** -21 * np.abs(ref[beyond]) + 1e-30), f"{what}: precise path beyond the range"
    assert np.all(np.isnan(y[~np.isfinite(x)])), f"{what}: sin/cos of inf or NaN must be NaN"
    zero_or_denormal = np.abs(x) < 1.1754944e-38
    if fn == "sin":  # sin(d) = d exactly, sign of zero kept
        assert np.array_equal(y[zero_or_denormal], x[zero_or_denormal]), what
        assert np.array_equal(np.signbit(y[zero_or_denormal]), np.signbit(x[zero_or_denormal])), what
    else:
        assert np.all(y[zero_or_denormal] == 1.0), what


@pytest.mark.parametrize("fn", ["sin", "cos"])
def test_numpy_approximation_is_within_its_bound_on_a_float32_sweep(fn):
    x = sweep_arguments(20_000, np.random.default_rng(1))
    y = FLOAT_FUNCS[f"{fn}_approx"](x)
    assert y.dtype == np.float32
    check_approximation(x, y, fn, "NumPy sweep")


@pytest.mark.parametrize("fn", ["sin", "cos"])
@pytest.mark.parametrize("low", [1.0, 2.0 ** 16], ids=["[1,2)", "[2^16,2^17)"])
def test_numpy_approximation_over_every_third_float_of_a_binade(fn, low):
    """[1, 2): the polynomial's whole range; [2^16, 2^17): the largest multiples of pi removed."""
    start = np.array([low], np.float32).view(np.uint32)[0]
    bits = np.arange(start, start + 2 ** 23, 3, dtype=np.uint32)
    x = bits.view(np.float32)
    y = FLOAT_FUNCS[f"{fn}_approx"](x)
    check_approximation(x, y, fn, f"binade from {low}")
    for dtype in ("bfloat16", "float16"):  # the use it is made for: rounding to 16 bits
        if dtype == "float16" and low > 60000:
            continue  # beyond float16's range
        out = y.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16)
        assert_within_one_ulp(out, FUNCS[fn][1](x.astype(np.float64)), dtype, f"{fn} {dtype} rounding")


def test_half_typed_sin_approx_in_the_emulator_rounds_through_float32():
    f = FLOAT_FUNCS["sin_approx"]
    from tecc.runtime.sim.numerics import intrinsic

    h = np.array([0.5, -3.0, 1000.0], np.float16)
    got = intrinsic("sin_approx", tc.float16)(h)
    assert got.dtype == np.float16 and np.array_equal(got, f(h.astype(np.float32)).astype(np.float16))


# ---- the cost model --------------------------------------------------------------------------
def test_cost_analysis_counts_the_cheap_form_where_the_pass_will_write_it(monkeypatch):
    def arith(dtype: str, fn: str = "sin") -> float:
        info = analyze_kernel(lower(sin_affine(64, 64, dtype, fn)).kernels[0])
        assert info.arith_instructions_per_iteration is not None
        return info.arith_instructions_per_iteration

    # sin + the fma's two FP ops (1.5 * x + b); bf16 adds the two loads' widening and the store's narrowing
    assert arith("float32") == pytest.approx(INSTRUCTION_COST["sin"] + 2)
    assert arith("bfloat16") == pytest.approx(INSTRUCTION_COST["sin_approx"] + 2 + 3 * CONVERSION_COST)
    assert arith("float16", "cos") == pytest.approx(INSTRUCTION_COST["cos_approx"] + 2 + 3 * CONVERSION_COST)
    assert INSTRUCTION_COST["sin_approx"] < INSTRUCTION_COST["sin"] / 1.4
    monkeypatch.setenv("TECC_PRECISE_MATH", "1")
    assert arith("bfloat16") == pytest.approx(INSTRUCTION_COST["sin"] + 2 + 3 * CONVERSION_COST)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cost_analysis_and_pass_agree(dtype, monkeypatch):
    """What the planner counts before the pass equals the count of the pass's own output."""
    lowered = lower(sin_affine(64, 64, dtype))
    planned = analyze_kernel(lowered.kernels[0]).arith_instructions_per_iteration
    rewritten = approx_math(lowered)
    monkeypatch.setenv("TECC_PRECISE_MATH", "1")  # count the rewritten IR as it is
    assert analyze_kernel(rewritten.kernels[0]).arith_instructions_per_iteration == planned


def test_planner_sees_bf16_sin_as_dram_bound_on_an_h200():
    import dataclasses

    from tecc.compiler.explain import explain
    from tecc.compiler.planner import plan_program
    from tecc.ir.target import target

    h200 = dataclasses.replace(target("sm_90"), dram_bandwidth=4.8e12)
    result = plan_program(sin_affine(16384, 4096, "bfloat16"), h200)
    assert result.kernels[0].chosen.cost.bound == "dram", explain(result)


# ---- on the GPU ------------------------------------------------------------------------------
def _approx_kernel(n: int, target: str):  # type: ignore[no-untyped-def]
    """S = sin_approx(X), C = cos_approx(X) with float32 outputs: the intrinsics called directly
    through the IR (the pass itself never writes them for a float32 result)."""
    X = tc.placeholder((n,), "float32", name="X")
    S = tc.compute((n,), lambda i: tc.sin(X[i]), name="S")
    C = tc.compute((n,), lambda i: tc.cos(X[i]), name="C")

    class Cheap(ExprMutator):
        def visit_Call(self, e: Call):  # type: ignore[no-untyped-def]
            return call(f"{e.name}_approx", *(self.visit(a) for a in e.args))

    class InStatements(StmtMutator):
        expr_mutator = Cheap()

    sch = Schedule([X, S, C])
    sch.mod = sch.mod.with_kernels([InStatements().visit_func(k) for k in sch.mod.kernels])
    return tc.build(sch, target)


@pytest.mark.gpu
def test_gpu_helper_is_within_the_bound_and_agrees_with_the_emulator():
    x = sweep_arguments(4096, np.random.default_rng(3))
    gpu = _approx_kernel(len(x), "cuda")
    assert "tecc_sin_approx" in gpu.source and "tecc_cos_approx" in gpu.source
    s, c = np.full_like(x, np.nan), np.full_like(x, np.nan)
    gpu(x, s, c)
    for fn, y in (("sin", s), ("cos", c)):
        check_approximation(x, y, fn, "GPU")
        fast = np.abs(x) <= approx.FAST_RANGE
        emulated = FLOAT_FUNCS[f"{fn}_approx"](x)
        ulps = np.abs(y[fast].astype(np.float64) - emulated[fast]) / np.spacing(np.abs(emulated[fast]))
        assert ulps.max() <= 1, f"{fn}: GPU and emulator differ by {ulps.max()} float32 ulp"


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1024, 4096), (37, 999)])
def test_gpu_sin_affine_bf16_matches_float64(shape):
    rows, cols = shape
    f = tc.build(sin_affine(rows, cols, "bfloat16"), "cuda")
    assert "tecc_sin_approx(" in f.source
    rng = np.random.default_rng(11)
    x = rng.uniform(-40, 40, (rows, cols)).astype(ml_dtypes.bfloat16)
    b = rng.uniform(-4, 4, cols).astype(ml_dtypes.bfloat16)
    y, sim = np.full((rows, cols), np.nan, x.dtype), np.full((rows, cols), np.nan, x.dtype)
    f(x, b, y)
    ref = np.sin(1.5 * x.astype(np.float64) + b.astype(np.float64))
    assert_within_one_ulp(y, ref, "bfloat16", f"GPU sin_affine {shape} plan {f.plan}")
    f.sim(x, b, sim)
    assert np.mean(y == sim) > 0.999, "GPU and emulator bf16 results should agree almost everywhere"
