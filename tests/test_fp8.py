"""fp8 (float8_e4m3, float8_e5m2): the dtypes, their conversions, and fp8 contractions on Hopper's
wgmma (wgmma.m64nNk32 .e4m3 / .e5m2) in the emulator and through NVRTC for sm_90a.

Conversions to fp8 round to nearest even and saturate (PTX `cvt.rn.satfinite`, what cuda_fp8.h's
`__nv_fp8_e4m3(float)` does): checked against the nearest of all finite fp8 values, ties to the
even code, magnitudes beyond the largest finite value giving it.

Bound of a contraction. fp8 inputs are exact in float64, their products too; the tensor core sums
in float32 (2⁻²³ per addition on the GPU, aligning and truncating: tests/test_tensorize_gpu.py), so

    |C - A·Bᵀ| <= (K + 1)·2⁻²³·(|A|·|B|ᵀ)

elementwise against float64 NumPy of the fp8 inputs (plus half an ulp of the output dtype when it
is 16-bit). Inputs are fresh random values, outputs start as NaN.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest
from test_tf32 import check
from test_wgmma import needs_nvrtc

import tecc as tc
from tecc.ir import dtype as dt
from tecc.ir.errors import DTypeError, ScheduleError
from tecc.ir.intrinsics import lookup
from tecc.runtime.sim import numerics as nm

FP8 = ("float8_e4m3", "float8_e5m2")
OUT_EPS = {"float32": 0.0, "bfloat16": 2.0**-8, "float16": 2.0**-11}


# ---- the dtypes -----------------------------------------------------------------------------------

def test_fp8_dtype_names_and_host_types() -> None:
    assert dt.as_dtype("float8_e4m3") is dt.float8_e4m3 and dt.as_dtype("float8_e4m3fn") is dt.float8_e4m3
    assert dt.as_dtype(np.dtype(ml_dtypes.float8_e4m3fn)) is dt.float8_e4m3
    assert dt.as_dtype(np.dtype(ml_dtypes.float8_e5m2)) is dt.float8_e5m2
    assert dt.float8_e4m3.numpy == np.dtype(ml_dtypes.float8_e4m3fn) and dt.float8_e4m3.bytes == 1
    assert dt.float8_e4m3.c_name == "__nv_fp8_e4m3" and dt.float8_e5m2.c_name == "__nv_fp8_e5m2"
    assert dt.largest_finite(dt.float8_e4m3) == 448.0 and dt.largest_finite(dt.float8_e5m2) == 57344.0
    assert dt.promote(dt.float8_e4m3, dt.float8_e5m2) is dt.float16   # float16 holds both exactly
    assert dt.promote(dt.float8_e4m3, dt.bfloat16) is dt.bfloat16
    assert dt.promote(dt.float8_e5m2, dt.float32) is dt.float32
    with pytest.raises(DTypeError, match="overflows float8_e4m3"):
        dt.check_constant_fits(1000.0, dt.float8_e4m3)
    from tecc.runtime.arrays import attribute_dtype
    assert attribute_dtype("torch.float8_e4m3fn") is dt.float8_e4m3
    assert attribute_dtype("torch.float8_e5m2") is dt.float8_e5m2


def _nearest_even_saturating(x: np.ndarray, npd: np.dtype) -> np.ndarray:
    """The reference: the nearest finite fp8 value, ties to the even code, saturating."""
    codes = np.arange(256, dtype=np.uint8).view(npd)
    values = codes.astype(np.float64)
    keep = np.isfinite(values)
    vals, code_ids = values[keep], np.arange(256)[keep]
    out = np.empty(x.shape, np.float64)
    for i, v in enumerate(x):
        if np.isnan(v):
            out[i] = np.nan
            continue
        v = float(np.clip(v, vals.min(), vals.max()))
        dist = np.abs(vals - v)
        best = np.flatnonzero(dist == dist.min())
        even = [b for b in best if code_ids[b] % 2 == 0]
        out[i] = vals[(even or list(best))[0]]
    return out


@pytest.mark.parametrize("name", FP8)
def test_fp8_conversion_rounds_once_to_nearest_even_and_saturates(name: str) -> None:
    d = dt.as_dtype(name)
    g = np.random.default_rng(1)
    big = dt.largest_finite(d)
    x = np.concatenate([g.standard_normal(400) * 4, g.uniform(-2 * big, 2 * big, 100), g.standard_normal(100) * 2**-8,
                        [np.inf, -np.inf, np.nan, big * 1.04, 1 + 2.0**-4 + 2.0**-30, 0.0, -0.0]])
    got = nm.to_dtype(x.astype(np.float64), d).astype(np.float64)
    want = _nearest_even_saturating(x, d.numpy)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert np.array_equal(got[~np.isnan(got)], want[~np.isnan(want)])
    got32 = nm.to_dtype(x.astype(np.float32), d).astype(np.float64)  # float32 sources: the same one rounding
    want32 = _nearest_even_saturating(x.astype(np.float32).astype(np.float64), d.numpy)
    assert np.array_equal(got32[~np.isnan(got32)], want32[~np.isnan(want32)])


@pytest.mark.parametrize("name", FP8)
def test_fp8_elementwise_cast_round_trip_in_the_emulator(name: str) -> None:
    n = 300
    X = tc.placeholder((n,), "float32", "X")
    Y = tc.compute((n,), lambda i: tc.cast(X[i], name), name="Y")
    Z = tc.compute((n,), lambda i: tc.cast(Y[i], "float32") * 2.0, name="Z")
    f = tc.build([X, Y, Z], target="sim")
    x = (np.random.default_rng(2).standard_normal(n) * 300).astype(np.float32)
    x[:3] = [np.inf, np.nan, 1e6]
    y = np.zeros(n, dt.as_dtype(name).numpy)
    z = np.full(n, np.nan, np.float32)
    f(x, y, z)
    want = _nearest_even_saturating(x.astype(np.float64), dt.as_dtype(name).numpy)
    assert np.array_equal(y.astype(np.float64), want, equal_nan=True)
    assert np.array_equal(z.astype(np.float64), 2 * want, equal_nan=True)


@needs_nvrtc
def test_fp8_casts_compile_with_cuda_fp8_h() -> None:
    from tecc.codegen import compile_cuda, emit_source

    X = tc.placeholder((64,), "float32", "X")
    Y = tc.compute((64,), lambda i: tc.cast(X[i], "float8_e4m3"), name="Y")
    Z = tc.compute((64,), lambda i: tc.cast(tc.cast(Y[i], "float8_e5m2"), "bfloat16"), name="Z")
    src = emit_source(list(tc.build([X, Y, Z], target="sim").module.kernels))
    assert "#include <cuda_fp8.h>" in src and "__nv_fp8_e4m3(" in src
    compile_cuda(src, arch="sm_90", name="fp8_casts")


# ---- the wgmma rows ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["wgmma.m64n128k32.f32.e4m3", "wgmma.m64n64k32.f32.e5m2",
                                  "wgmma.m64n256k32.f32.e4m3.e5m2"])
def test_fp8_rows_register_a_covers_the_tile_once(name: str) -> None:
    row = lookup(name)
    assert row.shape[2] == 32 and row.k_major_only
    a = row.operand("a")
    assert (a.rows, a.cols, a.elements, a.elements_per_register, a.registers) == (64, 32, 16, 4, 4)
    t, e = np.meshgrid(np.arange(128), np.arange(16), indexing="ij")
    r, c = a.layout(t, e)
    assert np.unique(r * 32 + c).size == 64 * 32
    # each register holds 4 consecutive k of one row (the bytes of a .b32, lowest first)
    assert (c[:, 0::4] % 4 == 0).all() and (np.diff(c.reshape(128, 4, 4), axis=2) == 1).all()
    assert (np.diff(r.reshape(128, 4, 4), axis=2) == 0).all()
    assert row.operand_type("b") == name.split(".")[-1]


# ---- contractions in the emulator -------------------------------------------------------------------

def fp8_contraction(m: Any, n: int, k: int, dtype: str, out: str = "float32", batch: int = 0,
                    b_k_last: bool = True) -> list[tc.Tensor]:
    lead = (batch,) if batch else ()
    A = tc.placeholder(lead + (m, k), dtype, "A")
    B = tc.placeholder(lead + ((n, k) if b_k_last else (k, n)), dtype, "B")
    r = tc.reduce_axis(k, "r")

    def body(*ix: Any) -> Any:
        *bs, i, j = ix
        b = B[(*bs, j, r)] if b_k_last else B[(*bs, r, j)]
        acc = tc.sum(tc.cast(A[(*bs, i, r)], "float32") * tc.cast(b, "float32"), axis=r)
        return acc if out == "float32" else tc.cast(acc, out)
    return [A, B, tc.compute(lead + (m, n), body, name="C")]


def wgmma_plan(block: tuple[int, int] = (64, 64), stages: int = 3) -> dict[str, Any]:
    return {"strategy": "manual", "reason": "test", "steps": [{"primitive": "tensorize", "args": {
        "stage": "C", "intrinsic": "wgmma", "block": list(block), "warps": [4 * (block[0] // 64), 1],
        "k_tile": 128, "stages": stages}}]}


def run_fp8(m: int, n: int, k: int, dtype: str, out: str = "float32", batch: int = 0, symbolic: bool = False,
            seed: int = 0, **build: Any) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray]:
    tensors = fp8_contraction(tc.var("M") if symbolic else m, n, k, dtype, out, batch)
    f = tc.build(tensors, target="sim", arch="sm_90", sizes={"M": m} if symbolic else None, **build)
    g = np.random.default_rng(seed)
    lead = (batch,) if batch else ()
    npd = dt.as_dtype(dtype).numpy
    a = (g.standard_normal(lead + (m, k)) * 3).astype(npd)
    b = (g.standard_normal(lead + (n, k)) * 3).astype(npd)
    c = np.full(lead + (m, n), np.nan, dt.as_dtype(out).numpy)
    f(a, b, c)
    return f, c, a.astype(np.float64), np.swapaxes(b.astype(np.float64), -1, -2)


def check_fp8(got: np.ndarray, a: np.ndarray, b: np.ndarray, out: str, what: str,
              hardware: np.ndarray | None = None) -> None:
    """`got` against the float64 A·B within the float32 accumulation bound, plus `hardware` (the
    GPU's own accumulation error bound, `hardware_accumulation`) where given."""
    k = a.shape[-1]
    exact = a @ b
    acc = (k + 1) * 2.0**-23 * (np.abs(a) @ np.abs(b)) + (0.0 if hardware is None else hardware)
    check(got.astype(np.float64), exact, acc + OUT_EPS[out] * (np.abs(exact) + acc), what)


# The tensor core's fp8 wgmma does not keep a full float32 accumulator: on an H200 its results
# differ from float32 accumulation by up to ~2e-3 relative (0.4% of the elements of a 4096³
# product; DeepSeek-V3's report gives ~14 significant bits for the fp8 GEMM accumulation of
# H800s). The emulator accumulates in float32; the GPU tests add, per k32 instruction, 2⁻¹³ of
# the larger of what it adds up -- the running sum and the step's products, which are aligned to
# the largest of them before the sum is cut to ~14 bits: 2⁻¹³ · Σ_s (|Σ_{k < 32 s} a·b| +
# Σ_{step s} |a|·|b|). (The running sum alone fell short by up to 7% on a few elements of
# K = 512 products whose sum cancels: measured on the H200, tests/test_fp8_gpu.py batched.)
HW_FP8_ACC_EPS = 2.0**-13
FP8_K_STEP = 32


def hardware_accumulation(a: Any, b: Any) -> Any:
    """2⁻¹³ · Σ over k32 steps of (|the running sum| + Σ_step |a|·|b|) for float64 operands
    a [.., m, k], b [.., k, n] (NumPy arrays or torch tensors: the same arithmetic)."""
    k = a.shape[-1]
    run = a[..., :, :0] @ b[..., :0, :]
    total = abs(run)
    for k0 in range(0, k, FP8_K_STEP):
        a_step, b_step = a[..., :, k0:k0 + FP8_K_STEP], b[..., k0:k0 + FP8_K_STEP, :]
        run = run + a_step @ b_step
        total = total + abs(run) + abs(a_step) @ abs(b_step)
    return HW_FP8_ACC_EPS * total


@pytest.mark.parametrize("dtype,out", [("float8_e4m3", "float32"), ("float8_e5m2", "bfloat16")])
def test_fp8_wgmma_edges_in_the_emulator(dtype: str, out: str) -> None:
    f, c, a, b = run_fp8(130, 72, 200, dtype, out, plan=wgmma_plan())
    assert f"k32.f32.{dtype[-4:]}" in dict(f.module.kernels[0].attrs)["tensorize"]
    check_fp8(c, a, b, out, f"{dtype} -> {out}")


def test_fp8_wgmma_batched_symbolic_two_warpgroups() -> None:
    f, c, a, b = run_fp8(70, 64, 256, "float8_e4m3", batch=2, symbolic=True, plan=wgmma_plan((128, 64), 2))
    check_fp8(c, a, b, "float32", "batched symbolic M")


def test_fp8_auto_plans_gemm_wgmma_fp8_on_sm_90_only() -> None:
    f, c, a, b = run_fp8(64, 64, 128, "float8_e4m3")
    assert f.plan.strategy == "gemm_wgmma_fp8", f.plan.reason
    check_fp8(c, a, b, "float32", "plan auto")
    f = tc.build(fp8_contraction(64, 64, 128, "float8_e4m3"), target="sim", arch="sm_80")
    assert f.plan.strategy != "gemm_wgmma_fp8"


def test_fp8_refusals_name_the_dtype_and_the_fix() -> None:
    with pytest.raises(ScheduleError, match="K-major only"):
        tc.build(fp8_contraction(64, 64, 128, "float8_e4m3", b_k_last=False), target="sim", arch="sm_90",
                 plan=wgmma_plan())
    mma = {"strategy": "manual", "reason": "test", "steps": [{"primitive": "tensorize", "args": {
        "stage": "C", "intrinsic": "auto", "block": [64, 64], "warps": [2, 2], "k_tile": 32, "stages": 3}}]}
    with pytest.raises(ScheduleError, match="float8_e4m3; fp8 contractions run only on Hopper's wgmma"):
        tc.build(fp8_contraction(64, 64, 128, "float8_e4m3"), target="sim", arch="sm_90", plan=mma)


# ---- NVRTC + ptxas at the benchmark sizes ------------------------------------------------------------

@needs_nvrtc
@pytest.mark.parametrize("dtype,size,out", [("float8_e4m3", 4096, "float32"), ("float8_e4m3", 8192, "bfloat16"),
                                             ("float8_e5m2", 8192, "float32")])
def test_fp8_wgmma_compiles_for_sm_90a_without_spills(dtype: str, size: int, out: str) -> None:
    from tecc.codegen import compile_cuda, emit_source

    f = tc.build(fp8_contraction(size, size, size, dtype, out), target="sim", arch="sm_90")
    assert f.plan.strategy == "gemm_wgmma_fp8", f.plan.reason
    src = emit_source(list(f.module.kernels))
    assert f"k32.f32.{dtype[-4:]}.{dtype[-4:]}" in src
    compiled = compile_cuda(src, arch="sm_90", name="fp8_gemm")
    assert compiled.arch == "sm_90a"
    for res in compiled.resources.values():
        assert res.spill_stores == 0 and res.spill_loads == 0 and res.registers <= 168, res
    assert "C7515" not in compiled.log and "C7520" not in compiled.log, compiled.log


# ---- the register-A layout, pinned in a hand-built kernel -------------------------------------------

@pytest.mark.parametrize("n,ab,b_swizzle,k_steps", [(64, "e4m3", "128B", 1), (128, "e5m2", "128B", 2),
                                                    (32, "e4m3", "64B", 2), (256, "e5m2", "none", 1)])
def test_fp8_wgmma_with_a_from_registers_matches_numpy(n: int, ab: str, b_swizzle: str, k_steps: int) -> None:
    """A loaded into each thread's 16 fragment elements through the row's operand-'a' map, B
    through a K-major descriptor: a wrong map (or descriptor of 1-byte elements) gives a wrong D."""
    from hopper_kernels import register_a_kernel

    from tecc.runtime.sim import simulate_kernel

    func = register_a_kernel(n, ab, b_swizzle, "K", k_steps)
    npd = dt.as_dtype({"e4m3": "float8_e4m3", "e5m2": "float8_e5m2"}[ab]).numpy
    g = np.random.default_rng()
    k = 32 * k_steps
    a = (g.standard_normal((64, k)) * 3).astype(npd)
    b = (g.standard_normal((n, k)) * 3).astype(npd)
    d = np.full((64, n), np.nan, np.float32)
    simulate_kernel(func, {"A": a, "B": b, "D": d}, (1, 1, 1), (128, 1, 1))
    a64, b64 = a.astype(np.float64), b.astype(np.float64).T
    check(d.astype(np.float64), a64 @ b64, (k + 1) * 2.0**-24 * (np.abs(a64) @ np.abs(b64)), func.name)


@needs_nvrtc
def test_fp8_register_a_form_compiles() -> None:
    from hopper_kernels import register_a_kernel

    from tecc.codegen import compile_cuda, emit_source

    src = emit_source([register_a_kernel(128, "e4m3", "128B", "K", 2)])
    assert "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3" in src
    compiled = compile_cuda(src, arch="sm_90", name="fp8_register_a")
    assert compiled.arch == "sm_90a"


def test_fp8_wgmma_tma_ring_persistent_in_the_emulator() -> None:
    plan = {"strategy": "manual", "reason": "test", "steps": [{"primitive": "tensorize", "args": {
        "stage": "C", "intrinsic": "wgmma", "block": [128, 64], "warps": [8, 1], "k_tile": 128, "stages": 3,
        "producer": "tma", "persistent": 3, "epilogue": "tma"}}]}
    f, c, a, b = run_fp8(130, 72, 272, "float8_e5m2", "bfloat16", plan=plan)
    assert "TMA producer" in dict(f.module.kernels[0].attrs)["tensorize"]
    check_fp8(c, a, b, "bfloat16", "TMA ring, persistent, TMA-store epilogue")


def test_fp8_mixed_e4m3_e5m2_with_a_scale_epilogue() -> None:
    """C = bfloat16(Σ A·B · (s0 · s1)), A e4m3 and B e5m2 (the mixed row), torch._scaled_mm's
    per-tensor scales fused in the epilogue: float32 product of the scales and by the sum (2⁻²⁴
    each), then bfloat16 (2⁻⁸ relative)."""
    m, n, k = 130, 72, 256
    A = tc.placeholder((m, k), "float8_e4m3", "A")
    B = tc.placeholder((n, k), "float8_e5m2", "B")
    S = tc.placeholder((2,), "float32", "S")
    r = tc.reduce_axis(k, "r")
    C = tc.compute((m, n), lambda i, j: tc.cast(tc.sum(tc.cast(A[i, r], "float32") * tc.cast(B[j, r], "float32"),
                                                       axis=r) * (S[0] * S[1]), "bfloat16"), name="C")
    f = tc.build([A, B, S, C], target="sim", arch="sm_90")
    assert f.plan.strategy == "gemm_wgmma_fp8", f.plan.reason
    assert "k32.f32.e4m3.e5m2" in dict(f.module.kernels[0].attrs)["tensorize"]
    g = np.random.default_rng()
    a = (g.standard_normal((m, k)) * 3).astype(dt.float8_e4m3.numpy)
    b = (g.standard_normal((n, k)) * 3).astype(dt.float8_e5m2.numpy)
    s = g.uniform(0.01, 2, 2).astype(np.float32)
    c = np.full((m, n), np.nan, dt.bfloat16.numpy)
    f(a, b, s, c)
    a64, b64 = a.astype(np.float64), b.astype(np.float64).T
    scale = float(s[0]) * float(s[1])
    exact = a64 @ b64 * scale
    acc = (k + 1) * 2.0**-23 * (np.abs(a64) @ np.abs(b64)) * scale
    check(c.astype(np.float64), exact, acc + (2 * 2.0**-24 + 2.0**-8) * (np.abs(exact) + acc) * 1.01, "mixed, scaled")


def test_fp8_row_reductions_accumulate_in_float32() -> None:
    """max and sum over fp8 rows (SIMT, cross-thread shuffles of the float32 accumulator):
    exact against NumPy (max picks an input; the inputs are e5m2 values with 2⁻⁶ <= |x| < 8 or 0,
    multiples of 2⁻⁸, so any float32 sum of 1000 of them, below 2¹³, is exact), and the CUDA compiles."""
    X = tc.placeholder((64, 1000), "float8_e5m2", "X")
    r, r2 = tc.reduce_axis(1000, "r"), tc.reduce_axis(1000, "r2")
    Y = tc.compute((64,), lambda i: tc.max(X[i, r], axis=r), name="Y")
    Z = tc.compute((64,), lambda i: tc.sum(tc.cast(X[i, r2], "float32"), axis=r2), name="Z")
    f = tc.build([X, Y, Z], target="sim")
    x64 = np.random.default_rng().standard_normal((64, 1000))
    x64[np.abs(x64) < 2.0**-6] = 0.0
    x = np.clip(x64, -7, 7).astype(dt.float8_e5m2.numpy)
    y = np.full(64, np.nan, dt.float8_e5m2.numpy)
    z = np.full(64, np.nan, np.float32)
    f(x, y, z)
    assert np.array_equal(y.astype(np.float64), x.astype(np.float64).max(1))
    assert np.array_equal(z.astype(np.float64), x.astype(np.float64).sum(1))
    if needs_nvrtc.args[0]:
        return
    from tecc.codegen import compile_cuda, emit_source

    compile_cuda(emit_source(list(f.module.kernels)), arch="sm_90", name="fp8_rows")


def test_a_device_view_without_a_numpy_fp8_dtype_takes_the_producers_dtype() -> None:
    """cuda.core may raise for DLPack's fp8 codes where it names no NumPy dtype; a torch fp8
    tensor's own dtype name then says it (a stand-in view here: no GPU needed)."""
    from tecc.runtime import arrays

    def view(producer_dtype: str) -> Any:
        class View:
            shape, strides = (2, 3), None

            @property
            def dtype(self) -> Any:
                raise TypeError("Unsupported dtype. dtype code: 10")

        View.exporting_obj = type("Tensor", (), {"dtype": producer_dtype})
        return View()

    assert arrays.view_info(view("torch.float8_e4m3fn")) == arrays.ArrayInfo((2, 3), (3, 1), dt.float8_e4m3)
    assert arrays.view_info(view("torch.float8_e5m2")).dtype is dt.float8_e5m2
    with pytest.raises(DTypeError, match="no tecc equivalent"):
        arrays.view_info(view("torch.float8_e4m3fnuz"))
    assert arrays.dtype_from_dlpack(10, 8) is dt.float8_e4m3 and arrays.dtype_from_dlpack(12, 8) is dt.float8_e5m2


def test_fp8_planner_declines_with_the_reason_and_falls_back_exactly() -> None:
    """B stored [k, j] on sm_90 and any layout on sm_80: gemm_wgmma_fp8 declines saying why, and
    the plan taken (SIMT, in float32) is still exact for these small sums."""
    from tecc.compiler.cost.analysis import analyze_kernel
    from tecc.compiler.planner import candidates_for
    from tecc.passes.lower import lower

    for arch, k_last, why in (("sm_90", False, "K-major only"), ("sm_80", True, "sm_90 only")):
        tensors = fp8_contraction(70, 40, 96, "float8_e4m3", b_k_last=k_last)
        cands, declined = candidates_for(analyze_kernel(lower(tensors).kernels[0]), tc.target(arch))
        assert not any(c.strategy.name == "gemm_wgmma_fp8" for c in cands)
        assert any(name == "gemm_wgmma_fp8" and why in reason for name, reason in declined), declined
        f = tc.build(tensors, target="sim", arch=arch)
        g = np.random.default_rng()
        a = g.standard_normal((70, 96)).astype(dt.float8_e4m3.numpy)
        b = g.standard_normal((40, 96) if k_last else (96, 40)).astype(dt.float8_e4m3.numpy)
        c = np.full((70, 40), np.nan, np.float32)
        f(a, b, c)
        b64 = b.astype(np.float64).T if k_last else b.astype(np.float64)
        check_fp8(c, a.astype(np.float64), b64, "float32", f"{arch} fallback {f.plan.strategy}")
