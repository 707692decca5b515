"""TF32: float32 contractions on tensor cores (mma.m16n8k8 tf32), only when the build allows it.

Every kernel runs in the emulator against NumPy in float64. The bound: `cvt.rna.tf32.f32` keeps
10 mantissa bits with round to nearest, so each input is within u = 2⁻¹¹ of itself (relative)
and each product of rounded inputs within (1 + u)² - 1 of the exact one; the mma multiplies
those exactly and sums in float32, within (K + 1)·2⁻²³ of the exact sum of what it adds (2⁻²³,
not 2⁻²⁴: the hardware aligns and truncates, tests/test_tensorize_gpu.py), so

    |C - A·B| <= ((1 + u)² - 1 + (K + 1)·2⁻²³·(1 + u)²) · (|A|·|B|)

elementwise. Against float64 NumPy of the tf32-rounded inputs the tensorized kernel is within
the float32 part alone, which shows the inputs were rounded (not truncated, not kept). Inputs are
fresh random values, outputs start as NaN.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import tecc as tc
from tecc.compiler import build_cache
from tecc.compiler.cost.analysis import analyze_kernel
from tecc.compiler.planner import candidates_for, plan_program
from tecc.ir.stmt import MatrixLoad, MatrixMultiply, iter_stmts
from tecc.passes.lower import lower
from tecc.runtime.sim.banks import count_bank_conflicts
from tecc.runtime.sim.matrix import round_to_tf32
from tensor_core_steps import schedule_tensor_core

TF32 = "mma.m16n8k8.f32.tf32"
U = 2.0**-11
TENSOR_CORE = ("gemm_tensor_core", "gemm_tensor_core_tf32", "gemm_wgmma", "gemm_wgmma_tf32")


def tf32_bound(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    k = a.shape[-1]
    grow = (1 + U) ** 2
    return (grow - 1 + (k + 1) * 2.0**-23 * grow) * (np.abs(a) @ np.abs(b))


def contraction(m: Any, n: int, k: int, *, a_t: bool = False, b_t: bool = False, batch: int = 0,
                bias_relu: bool = False) -> list[tc.Tensor]:
    """C[b, i, j] = Σ_k A·B (float32), A stored [k, i] when a_t, B stored [j, k] when b_t;
    with bias_relu the epilogue max(C + bias[j], 0)."""
    lead = (batch,) if batch else ()
    A = tc.placeholder(lead + ((k, m) if a_t else (m, k)), "float32", "A")
    B = tc.placeholder(lead + ((n, k) if b_t else (k, n)), "float32", "B")
    bias = tc.placeholder((n,), "float32", "bias")
    r = tc.reduce_axis(k, "r")

    def body(*ix: Any) -> Any:
        *bs, i, j = ix
        a = A[(*bs, r, i)] if a_t else A[(*bs, i, r)]
        b = B[(*bs, j, r)] if b_t else B[(*bs, r, j)]
        acc = tc.sum(a * b, axis=r)
        return tc.maximum(acc + bias[j], tc.const(0.0, "float32")) if bias_relu else acc

    C = tc.compute(lead + (m, n), body, name="C")
    return [A, B] + ([bias] if bias_relu else []) + [C]


def plan(block: tuple[int, int] = (64, 64), warps: tuple[int, int] = (2, 2), k_tile: int = 16,
         stages: int = 3) -> dict[str, Any]:
    return {"strategy": "manual", "reason": "test", "steps": [
        {"primitive": "tensorize", "args": {"stage": "C", "intrinsic": TF32, "block": list(block),
                                            "warps": list(warps), "k_tile": k_tile, "stages": stages}}]}


def run(m: int, n: int, k: int, *, a_t: bool = False, b_t: bool = False, batch: int = 0, bias_relu: bool = False,
        symbolic: bool = False, seed: int = 0, **build: Any) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray]:
    """Build (target "sim"), run on fresh inputs; returns the kernel, the output and the float64
    operands as (.., M, K) and (.., K, N) plus the bias (zeros without one)."""
    tensors = contraction(tc.var("M") if symbolic else m, n, k, a_t=a_t, b_t=b_t, batch=batch, bias_relu=bias_relu)
    f = tc.build(tensors, target="sim", sizes={"M": m} if symbolic else None, **build)
    g = np.random.default_rng(seed)
    lead = (batch,) if batch else ()
    # full 23-bit mantissas, so rounding to tf32 changes almost every input
    a = g.standard_normal(lead + ((k, m) if a_t else (m, k))).astype(np.float32)
    b = g.standard_normal(lead + ((n, k) if b_t else (k, n))).astype(np.float32)
    bias = g.uniform(-2, 2, (n,)).astype(np.float32)
    out = np.full(lead + (m, n), np.nan, np.float32)
    f(*([a, b, bias] if bias_relu else [a, b]), out)
    a64 = np.swapaxes(a, -1, -2).astype(np.float64) if a_t else a.astype(np.float64)
    b64 = np.swapaxes(b, -1, -2).astype(np.float64) if b_t else b.astype(np.float64)
    return f, out, a64, b64


def check(got: np.ndarray, want: np.ndarray, bound: np.ndarray, what: str) -> None:
    err = np.where(np.isnan(got), np.inf, np.abs(got.astype(np.float64) - want) - bound)
    if (err > 0).any():
        i = np.unravel_index(int(np.argmax(err)), err.shape)
        raise AssertionError(f"{what}: {(err > 0).sum()} of {err.size} elements off; worst at {tuple(map(int, i))}: "
                             f"got {got[i]!r}, want {want[i]!r} (bound {bound[i]:.3g})")


def check_tf32(got: np.ndarray, a: np.ndarray, b: np.ndarray, what: str) -> None:
    """Within the TF32 bound of the exact product, and within the float32 accumulation bound of
    the product of the rounded inputs (so the inputs were rounded as cvt.rna does)."""
    check(got, a @ b, tf32_bound(a, b), f"{what} vs float64")
    ra, rb = round_to_tf32(a.astype(np.float32)).astype(np.float64), round_to_tf32(b.astype(np.float32)).astype(np.float64)
    check(got, ra @ rb, (a.shape[-1] + 1) * 2.0**-24 * (np.abs(ra) @ np.abs(rb)), f"{what} vs tf32-rounded inputs")


def float32_info(m: int, n: int, k: int) -> Any:
    return analyze_kernel(lower(contraction(m, n, k)).kernels[0])


# ---- the option -----------------------------------------------------------------------------------

def test_tf32_off_by_default_never_plans_tensor_cores_for_float32() -> None:
    info = float32_info(1024, 1024, 1024)
    for arch in ("sm_80", "sm_90"):
        cands, declined = candidates_for(info, tc.target(arch))
        assert not any(c.strategy.name in TENSOR_CORE for c in cands)
        assert any(name == "gemm_tensor_core_tf32" and "allow_tf32=True" in why for name, why in declined)
    f, out, a, b = run(72, 40, 24, arch="sm_80")
    assert f.plan.strategy not in TENSOR_CORE, f.plan.reason
    assert not any(isinstance(s, MatrixMultiply) for k in f.module.kernels for s in iter_stmts(k.body))
    check(out, a @ b, 25 * 2.0**-24 * (np.abs(a) @ np.abs(b)), "float32 SIMT")  # no tf32 rounding


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_allow_tf32_lets_the_planner_rank_tf32_against_the_simt_gemms(arch: str) -> None:
    info = float32_info(4096, 4096, 4096)
    cands, _ = candidates_for(info, tc.target(arch).replace(allow_tf32=True))
    best = {}
    for c in cands:
        if c.ok:
            best[c.strategy.name] = min(best.get(c.strategy.name, np.inf), c.cost.total)
    assert "gemm_tensor_core_tf32" in best and ("gemm" in best or "gemm_pipelined" in best), best
    # the tf32 peak is half the 16-bit one; the same point predicts slower than it would for halves
    assert best["gemm_tensor_core_tf32"] < min(best.get("gemm", np.inf), best.get("gemm_pipelined", np.inf))
    result = plan_program(contraction(4096, 4096, 4096), tc.target(arch).replace(allow_tf32=True))
    # sm_90 takes the tf32 wgmma (tests/test_tf32_wgmma.py), sm_80 mma.sync
    want = "gemm_wgmma_tf32" if arch == "sm_90" else "gemm_tensor_core_tf32"
    assert result.plan.strategy == want, result.plan.reason
    assert "TF32 allowed" in result.target.summary()


def test_auto_plan_with_allow_tf32_runs_on_tensor_cores_and_explain_says_why() -> None:
    f, out, a, b = run(72, 40, 24, seed=1, arch="sm_80", allow_tf32=True)
    assert f.plan.strategy == "gemm_tensor_core_tf32", f.plan.reason
    rows = {s.row.name for k in f.module.kernels for s in iter_stmts(k.body) if isinstance(s, MatrixMultiply)}
    assert rows == {TF32}
    check_tf32(out, a, b, "auto tf32 72x40x24")
    text = f.explain()
    assert "TF32 allowed" in text and "rounded to tf32" in text and "allow_tf32=True" in text


def test_tune_does_not_take_allow_tf32_yet() -> None:
    with pytest.raises(tc.TeccError, match="allow_tf32"):
        tc.build(contraction(64, 64, 64), target="sim", tune=True, allow_tf32=True)


def test_the_build_cache_tells_allow_tf32_apart(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TECC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TECC_BUILD_CACHE", "1")
    target = repr(tc.target("sm_80"))
    keys = {build_cache.build_key("ir", name="C", sizes=None, target=target, allow_tf32=x) for x in (False, True)}
    assert len(keys) == 2
    tensors = contraction(72, 40, 24)
    first = tc.build(tensors, target="sim", arch="sm_80")
    tf32 = tc.build(tensors, target="sim", arch="sm_80", allow_tf32=True)
    again = tc.build(tensors, target="sim", arch="sm_80")
    assert tf32.plan.strategy == "gemm_tensor_core_tf32", tf32.plan.reason
    assert first.plan.strategy == again.plan.strategy != "gemm_tensor_core_tf32"
    assert len(list((tmp_path / build_cache.SUBDIR).rglob("*.json"))) == 2


# ---- explicit plans ---------------------------------------------------------------------------------

@pytest.mark.parametrize("a_t,b_t", [(False, False), (True, False), (False, True), (True, True)])
def test_every_operand_orientation_matches_numpy_without_bank_conflicts(a_t: bool, b_t: bool) -> None:
    m, n, k = 80, 72, 40
    with count_bank_conflicts() as banks:
        f, out, a, b = run(m, n, k, a_t=a_t, b_t=b_t, seed=3, plan=plan())
    check_tf32(out, a, b, f"tf32 A{'ᵀ' if a_t else ''} B{'ᵀ' if b_t else ''}")
    body = f.module.kernels[0].body
    loads = {(x.row.name, x.src.name) for x in iter_stmts(body) if isinstance(x, MatrixLoad)}
    # ldmatrix.x4 of b16 pairs for k-contiguous tiles, 32-bit loads for k-major ones
    assert loads == ({("ldmatrix.x4", "A_shared")} if not a_t else set()) | ({("ldmatrix.x4", "B_shared")} if b_t else set())
    for buf in ("A_shared", "B_shared"):
        assert banks.requests[buf] > 0 and banks.conflicts(buf) == 0, dict(banks.wavefronts)


@pytest.mark.parametrize("a_t,b_t", [(True, True), (False, False)])
def test_wider_tiles_are_conflict_free_too(a_t: bool, b_t: bool) -> None:
    """Rows of 128 floats ([k][128]) and of 32 floats (k_tile 32): Swizzle(2, 3, 4), Swizzle(3, 2, 3)."""
    m, n, k = 128, 128, 64
    with count_bank_conflicts() as banks:
        _, out, a, b = run(m, n, k, a_t=a_t, b_t=b_t, seed=5, plan=plan((128, 128), (2, 2), 32, 2))
    check_tf32(out, a, b, f"tf32 128x128 a_t={a_t} b_t={b_t}")
    for buf in ("A_shared", "B_shared"):
        assert banks.requests[buf] > 0 and banks.conflicts(buf) == 0, dict(banks.wavefronts)


@pytest.mark.parametrize("m,n,k", [(72, 40, 24), (33, 17, 7), (40, 24, 8), (16, 8, 1), (48, 56, 36)])
def test_sizes_that_are_no_multiple_of_any_tile(m: int, n: int, k: int) -> None:
    """K = 7 and 1: element loads for the k-contiguous operand; 36: 16-byte copies, a partial k tile."""
    _, out, a, b = run(m, n, k, seed=m + n + k, plan=plan())
    check_tf32(out, a, b, f"tf32 {m}x{n}x{k}")


def test_batched_contraction() -> None:
    f, out, a, b = run(40, 24, 24, batch=3, seed=7, plan=plan(stages=2))
    assert any(lp.kind == "blockIdx.z" for lp in iter_stmts(f.module.kernels[0].body) if hasattr(lp, "kind"))
    check_tf32(out, a, b, "tf32 batched")


def test_symbolic_rows() -> None:
    _, out, a, b = run(50, 32, 16, symbolic=True, seed=9, plan=plan())
    check_tf32(out, a, b, "tf32 symbolic M")


def test_symbolic_k_loads_elements_and_guards_the_prologue() -> None:
    K = tc.var("K")
    m, n, k = 40, 48, 37
    A, B = tc.placeholder((m, K), "float32", "A"), tc.placeholder((K, n), "float32", "B")
    r = tc.reduce_axis(K, "r")
    C = tc.compute((m, n), lambda i, j: tc.sum(A[i, r] * B[r, j], axis=r), name="C")
    f = tc.build([A, B, C], target="sim", plan=plan(stages=3), sizes={"K": k})
    g = np.random.default_rng(21)
    a, b = g.standard_normal((m, k)).astype(np.float32), g.standard_normal((k, n)).astype(np.float32)
    out = np.full((m, n), np.nan, np.float32)
    f(a, b, out)
    check_tf32(out, a.astype(np.float64), b.astype(np.float64), "tf32 symbolic K")


def test_fused_bias_and_relu_epilogue() -> None:
    tensors = contraction(48, 40, 32, bias_relu=True)
    f = tc.build(tensors, target="sim", plan=plan())
    g = np.random.default_rng(13)
    a = g.standard_normal((48, 32)).astype(np.float32)
    b = g.standard_normal((32, 40)).astype(np.float32)
    bias = g.uniform(-2, 2, (40,)).astype(np.float32)
    out = np.full((48, 40), np.nan, np.float32)
    f(a, b, bias, out)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    exact = a64 @ b64 + bias
    # relu is 1-Lipschitz; the bias add rounds once in float32
    bound = tf32_bound(a64, b64) + 2.0**-24 * (np.abs(exact) + tf32_bound(a64, b64))
    check(out, np.maximum(exact, 0.0), bound, "tf32 with bias and relu")


def test_tf32_is_only_taken_by_name_and_only_for_float32() -> None:
    with pytest.raises(tc.ScheduleError, match="allow_tf32=True"):
        tc.Schedule(contraction(64, 64, 64)).tensorize("C", intrinsic="auto")
    A = tc.placeholder((64, 64), "float16", "A")
    B = tc.placeholder((64, 64), "float16", "B")
    r = tc.reduce_axis(64, "r")
    C = tc.compute((64, 64), lambda i, j: tc.sum(tc.cast(A[i, r], "float32") * tc.cast(B[r, j], "float32"), axis=r),
                   name="C")
    with pytest.raises(tc.ScheduleError, match="mma.m16n8k16.f32.f16"):
        tc.Schedule([A, B, C]).tensorize("C", intrinsic=TF32)
    with pytest.raises(tc.ScheduleError, match="at least 32"):  # a k-major float32 tile of 16 rows
        schedule_tensor_core(tc.Schedule(contraction(64, 64, 64, a_t=True)), "C", intrinsic=TF32, block=(16, 64), warps=(1, 2),
                                                                 k_tile=16, stages=2)


# ---- NVRTC ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_the_4096_cubed_tf32_plan_compiles_without_spills(arch: str) -> None:
    f = tc.build(contraction(4096, 4096, 4096), target="cuda", arch=arch, allow_tf32=True)
    if arch == "sm_90":  # Hopper: the tf32 wgmma (tests/test_tf32_wgmma.py)
        assert f.plan.strategy == "gemm_wgmma_tf32", f.plan.reason
        assert "cvt.rna.tf32.f32" in f.source and "k8.f32.tf32.tf32" in f.source
    else:
        assert f.plan.strategy == "gemm_tensor_core_tf32", f.plan.reason
        assert "cvt.rna.tf32.f32" in f.source and "m16n8k8.row.col.f32.tf32.tf32.f32" in f.source
    for name, res in f.resources.items():
        assert res.spill_stores == 0 and res.spill_loads == 0, (name, res)
        assert res.registers <= 255, (name, res)


# ---- implicit GEMMs (convolutions) ------------------------------------------------------------------

def run_conv_case(case: str, stage_plan: dict[str, Any], what: str, **build: Any) -> Any:
    """Build tests/test_conv.py's convolution `case` in float32 with `stage_plan` (a tensorize plan
    for the stage Y) for the emulator, run it on fresh inputs with the output poisoned, check it
    against float64 within the tf32 bound of its K, and return the kernel."""
    from test_conv import CASES, Conv

    conv = Conv(**{**CASES[case].__dict__, "dtype": "float32", "tensors": []})
    stage_plan["steps"][0]["args"]["stage"] = "Y"
    f = tc.build(conv.program(), target="sim", plan=stage_plan, **build)
    g = np.random.default_rng(17)
    sh = conv.shapes()
    x = g.standard_normal(sh["X"]).astype(np.float32)
    w = g.standard_normal(sh["Wt"]).astype(np.float32)
    y = np.full(sh["Y"], np.nan, np.float32)
    f(x, w, y)
    exact, size = conv.reference(x, w)
    grow = (1 + U) ** 2
    check(y, exact, (grow - 1 + (conv.k + 1) * 2.0**-23 * grow) * size, what)
    return f

@pytest.mark.parametrize("case", ["nhwc_3x3_pad1", "nchw_3x3_pad1", "nhwc_c3", "nhwc_groups2", "nhwc_f12"])
def test_float32_convolutions_take_tf32_when_named(case: str) -> None:
    """The implicit GEMM of a float32 convolution (tests/test_conv.py's cases): 16-byte copies of
    4 floats where the channels allow, guarded element loads where they do not (C = 3)."""
    f = run_conv_case(case, plan(), f"tf32 {case}")
    rows = {s.row.name for k in f.module.kernels for s in iter_stmts(k.body) if isinstance(s, MatrixMultiply)}
    assert rows == {TF32}


def test_auto_plans_a_float32_convolution_on_tf32_only_when_allowed() -> None:
    from test_conv import Conv

    conv = Conv(4, (14, 14), 64, 64, (3, 3), pad=1, dtype="float32")
    info = analyze_kernel(lower(conv.program()).kernels[0])
    off, _ = candidates_for(info, tc.target("sm_80"))
    on, _ = candidates_for(info, tc.target("sm_80").replace(allow_tf32=True))
    assert not any(c.strategy.name in TENSOR_CORE for c in off)
    best = min((c for c in on if c.ok), key=lambda c: c.cost.total)
    assert best.strategy.name == "gemm_tensor_core_tf32", best.label


def test_the_cli_plans_with_tf32_only_when_asked(capsys: pytest.CaptureFixture[str]) -> None:
    from pathlib import Path

    from tecc.cli import main

    matmul = Path(__file__).resolve().parent.parent / "examples" / "matmul.py"  # a float32 matmul
    assert main(["explain", str(matmul), "--arch", "sm_80"]) == 0
    off = capsys.readouterr().out
    assert main(["explain", str(matmul), "--arch", "sm_80", "--allow-tf32"]) == 0
    on = capsys.readouterr().out
    assert "chosen: gemm_tensor_core_tf32" not in off and "TF32 allowed" not in off
    assert "chosen: gemm_tensor_core_tf32" in on and "TF32 allowed" in on


def test_ldmatrix_moves_float32_only_as_b16_pairs_without_trans() -> None:
    from tecc.ir import dtype as dt
    from tecc.ir.expr import Const
    from tecc.ir.stmt import Buffer, FragmentRef

    smem = Buffer("S", dt.float32, (Const(32, dt.int32), Const(8, dt.int32)), "shared")
    frag = Buffer("a_frag", dt.float32, (Const(4, dt.int32),), "fragment", fragment=(TF32, "a"))
    zero = Const(0, dt.int32)
    load = MatrixLoad("ldmatrix.x4", FragmentRef(frag, zero), smem, (zero, zero))
    assert load.pairs  # four registers, one float each: the whole A fragment
    with pytest.raises(tc.TeccError, match="32-bit ones as 16-bit pairs"):
        MatrixLoad("ldmatrix.x4.trans", FragmentRef(frag, zero), smem, (zero, zero))
    with pytest.raises(tc.TeccError, match="outside"):
        MatrixLoad("ldmatrix.x4", FragmentRef(frag, Const(2, dt.int32)), smem, (zero, zero))
