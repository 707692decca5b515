"""Tensor-core contractions whose operands have run-time strides (`placeholder(..., strides="any")`).

tensorize lays such an operand out as a slice of a wider row-major array would be (innermost
stride 1, the others multiples of 16 bytes) and builds one kernel with two main loops over the
same shared ring: 16-byte cp.async copies where the launch's strides pass that test, element
loads (any strides: transposed views, odd row strides, negative strides) where they do not
(tensorize.py `_Emitter.dispatch`, implicit_gemm.py `stride_condition`). In the emulator against
NumPy float64 under tests/test_tensorize.py's bound (exact products, float32 sums, one rounding
of the output); outputs start as NaN, inputs are fresh random values. Which loop ran is read
from the shared tile's accesses: 16-byte copies, or 2-byte element stores.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from test_tensorize import check, np_dtype

import tecc as tc
from tecc.codegen import compile_cuda, emit_source
from tecc.compiler.cost.analysis import analyze_kernel
from tecc.compiler.strategies.gemm_tensor_core import gemm_view
from tecc.ir import dtype as dt
from tecc.ir.intrinsics import IntrinsicError
from tecc.ir.expr import Var
from tecc.ir.stmt import AsyncCopy, Buffer, IfThenElse, iter_stmts
from tecc.passes.lower import lower
from tecc.runtime.sim.banks import count_bank_conflicts

# K = 136: several k tiles on both paths (5 of 32 for mma.sync, 3 of 64 for wgmma's 3-stage ring),
# so the element loop refills stages inside the k loop, not only in the prologue
M, N, K = 64, 48, 136


def strided_contraction(m: int, n: int, k: int, dtype: str, *, a_any: bool = True, b_any: bool = False,
                        batch: int = 0, b_t: bool = False) -> list[tc.Tensor]:
    """C[b.., i, j] = Σ_k A[b.., i, k] · B[b.., k, j] (B stored [j, k] when b_t) in float32,
    stored as float32."""
    lead = (batch,) if batch else ()
    A = tc.placeholder(lead + (m, k), dtype, "A", strides="any" if a_any else None)
    B = tc.placeholder(lead + ((n, k) if b_t else (k, n)), dtype, "B", strides="any" if b_any else None)
    r = tc.reduce_axis(k, "r")

    def body(*ix: Any) -> Any:
        *bs, i, j = ix
        b = B[(*bs, j, r)] if b_t else B[(*bs, r, j)]
        return tc.sum(tc.cast(A[(*bs, i, r)], "float32") * tc.cast(b, "float32"), axis=r)

    return [A, B, tc.compute(lead + (m, n), body, name="C")]


def mma_plan() -> dict[str, Any]:
    return {"strategy": "manual", "reason": "test", "steps": [
        {"primitive": "tensorize", "args": {"stage": "C", "intrinsic": "auto", "block": [64, 64], "warps": [2, 2],
                                            "k_tile": 32, "stages": 2}}]}


def wgmma_plan() -> dict[str, Any]:
    return {"strategy": "manual", "reason": "test", "steps": [
        {"primitive": "tensorize", "args": {"stage": "C", "intrinsic": "wgmma", "block": [64, 64], "warps": [4, 1],
                                            "k_tile": 64, "stages": 3}}]}


def mma_pipelined_plan() -> dict[str, Any]:
    """The mma.sync plan with its fragments pipelined across the k-tile boundary (both main
    loops of the launch test take that shape)."""
    plan = mma_plan()
    plan["steps"][0]["args"]["fragment_pipeline"] = True
    return plan


PATHS = {"mma.sync": ("sm_80", mma_plan), "mma.sync pipelined": ("sm_80", mma_pipelined_plan),
         "wgmma": ("sm_90", wgmma_plan)}


def values(g: np.random.Generator, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    return (g.uniform(0.5, 1.5, shape) * g.choice([-1, 1], shape)).astype(np_dtype(dtype))


def views(g: np.random.Generator, shape: tuple[int, int], dtype: str) -> dict[str, tuple[np.ndarray, bool]]:
    """Views of `shape` (rows, cols) with the strides a user may pass, and whether the copy
    loop's launch test passes for them (unit innermost stride, the rows 16-byte multiples)."""
    rows, cols = shape
    wide = values(g, (rows, cols + 24), dtype)        # rows of cols + 24 elements: 16-byte multiples
    odd = values(g, (rows, cols + 3), dtype)
    return {
        "slice": (wide[:, :cols], True),
        "rows reversed": (wide[::-1, :cols], True),          # a negative row stride, still 16-byte aligned
        "transposed": (np.ascontiguousarray(values(g, (cols, rows), dtype)).T, False),
        "odd row stride": (odd[:, :cols], False),
        "columns reversed": (wide[:, ::-1][:, :cols], False),  # innermost stride -1
    }


def element_stored(banks: Any, buffer: str) -> bool:
    """Whether the shared tile `buffer` was filled by element stores (accesses of one element,
    1 to 4 bytes) rather than 16-byte copies (ldmatrix reads are 16-byte accesses too)."""
    return bool(banks.widths[buffer] & {1, 2, 4})


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_every_view_of_a_strided_operand_matches_numpy(path: str, dtype: str) -> None:
    """One kernel serves every view: a slice of a wider array (and its rows reversed) runs the
    cp.async loop, a transposed view, an odd row stride and a reversed innermost dimension the
    element loop; all match NumPy."""
    arch, plan = PATHS[path]
    f = tc.build(strided_contraction(M, N, K, dtype), target="sim", arch=arch, plan=plan())
    g = np.random.default_rng(7)
    for what, (a, fast) in views(g, (M, K), dtype).items():
        b = values(g, (K, N), dtype)
        c = np.full((M, N), np.nan, np.float32)
        with count_bank_conflicts() as banks:
            f(a, b, c)
        how = {"a_t": False, "b_t": False, "dtype": dtype, "out": "float32", "epilogue": False}
        check({"A": a, "B": b, "C": c}, how, f"{path} {dtype} A {what} (strides {a.strides})")
        assert element_stored(banks, "A_shared") is not fast, f"{what}: expected the {'copy' if fast else 'element'} loop"
        assert not element_stored(banks, "B_shared")


@pytest.mark.parametrize("path", PATHS)
def test_both_operands_strided(path: str) -> None:
    """A and B with run-time strides: the launch test is the conjunction of both operands'; a
    slice of each takes the copies, one transposed operand sends both to element loads."""
    arch, plan = PATHS[path]
    f = tc.build(strided_contraction(M, N, K, "float16", b_any=True), target="sim", arch=arch, plan=plan())
    g = np.random.default_rng(11)
    b_slice = values(g, (K, N + 16), "float16")[:, :N]
    b_transposed = np.ascontiguousarray(values(g, (N, K), "float16")).T
    a_slice = values(g, (M, K + 8), "float16")[:, :K]
    for what, b, fast in (("B a slice", b_slice, True), ("B transposed", b_transposed, False)):
        c = np.full((M, N), np.nan, np.float32)
        with count_bank_conflicts() as banks:
            f(a_slice, b, c)
        how = {"a_t": False, "b_t": False, "dtype": "float16", "out": "float32", "epilogue": False}
        check({"A": a_slice, "B": b, "C": c}, how, f"{path} {what}")
        assert element_stored(banks, "A_shared") is not fast and element_stored(banks, "B_shared") is not fast, what


def test_a_batch_dimension_with_its_own_stride() -> None:
    """A batched contraction whose A is every other matrix of a wider batch, each a slice of
    wider rows (copies), and a batch of transposed matrices (element loads)."""
    batch = 2
    f = tc.build(strided_contraction(M, N, K, "float16", batch=batch), target="sim", arch="sm_80", plan=mma_plan())
    g = np.random.default_rng(5)
    every_other = values(g, (2 * batch, M, K + 8), "float16")[::2, :, :K]
    transposed = np.swapaxes(values(g, (batch, K, M), "float16"), 1, 2)
    for what, a, fast in (("every other, sliced", every_other, True), ("transposed", transposed, False)):
        b = values(g, (batch, K, N), "float16")
        c = np.full((batch, M, N), np.nan, np.float32)
        with count_bank_conflicts() as banks:
            f(a, b, c)
        how = {"a_t": False, "b_t": False, "dtype": "float16", "out": "float32", "epilogue": False}
        check({"A": a, "B": b, "C": c}, how, f"batched, A {what} (strides {a.strides})")
        assert element_stored(banks, "A_shared") is not fast, what


@pytest.mark.parametrize("arch,strategy", [("sm_80", "gemm_tensor_core"), ("sm_90", "gemm_wgmma")])
def test_the_planner_keeps_a_strided_contraction_on_tensor_cores(arch: str, strategy: str) -> None:
    """plan='auto' prices the copy loop (what a slice gets) and explain names the launch test."""
    f = tc.build(strided_contraction(256, 256, 256, "float16"), target="sim", arch=arch)
    text = f.explain()
    assert f.plan.steps[0].primitive == "tensorize", text
    assert f"chosen: {strategy}(" in text, text
    assert "run-time strides of A: cp.async copies (priced) when" in text, text
    assert "A_stride0 % 8 == 0 && A_stride1 == 1, else element loads" in text, text


def test_the_gemm_view_marks_the_operands_whose_copies_are_tested_at_launch() -> None:
    info = analyze_kernel(lower(strided_contraction(M, N, K, "float16")).kernels[0])
    view = gemm_view(info)
    assert not isinstance(view, str)
    assert view.launch_tested == (True, False) and view.copies == (8, 8)
    # K = 42: copies of 2 elements along k (K % 8 != 0); the row stride must be even at launch
    f = tc.build(strided_contraction(M, N, 42, "float16"), target="sim", arch="sm_80", plan=mma_plan())
    assert "A_stride0 % 2 == 0 && A_stride1 == 1" in f.explain()
    g = np.random.default_rng(3)
    for a in (values(g, (M, 50), "float16")[:, :42], values(g, (M, 43), "float16")[:, :42]):
        b, c = values(g, (42, N), "float16"), np.full((M, N), np.nan, np.float32)
        f(a, b, c)
        how = {"a_t": False, "b_t": False, "dtype": "float16", "out": "float32", "epilogue": False}
        check({"A": a, "B": b, "C": c}, how, f"K = 42, A strides {a.strides}")


def test_an_odd_k_needs_no_launch_test() -> None:
    """K = 41: no copy is provable along k even for a slice, so the kernel is the element loop
    alone, without a branch."""
    f = tc.build(strided_contraction(M, N, 41, "float16"), target="sim", arch="sm_80", plan=mma_plan())
    body = list(iter_stmts(f.module.kernels[0].body))
    assert not any(isinstance(s, AsyncCopy) and s.src.name == "A" for s in body)
    assert not any(isinstance(s, AsyncCopy) and s.unit_stride_at_launch for s in body)
    g = np.random.default_rng(4)
    a, b = values(g, (M, 64), "float16")[:, :41], values(g, (41, N), "float16")
    c = np.full((M, N), np.nan, np.float32)
    f(a, b, c)
    check({"A": a, "B": b, "C": c}, {"a_t": False, "b_t": False, "dtype": "float16", "out": "float32",
                                     "epilogue": False}, "K = 41")


def test_the_loop_ir_round_trip_keeps_the_launch_tested_copies() -> None:
    """An artifact's .ir (loop_json) keeps the copies' mark, so `load(path).sim(...)` runs the
    same two loops."""
    from tecc.ir import loop_json

    f = tc.build(strided_contraction(M, N, K, "float16"), target="sim", arch="sm_80", plan=mma_plan())
    again = loop_json.module_from_json(loop_json.module_to_json(f.module))
    marks = [[s.unit_stride_at_launch for s in iter_stmts(m.kernels[0].body) if isinstance(s, AsyncCopy)]
             for m in (f.module, again)]
    assert marks[0] == marks[1] and any(marks[0]) and not all(marks[0])


def test_a_copy_from_a_run_time_innermost_stride_must_say_it_was_tested() -> None:
    src = Buffer("X", dt.float16, (64, 64), "global", strides=(Var("s0", kind="stride"), Var("s1", kind="stride")))
    dst = Buffer("X_shared", dt.float16, (64, 64), "shared")
    with pytest.raises(IntrinsicError, match="test it at launch and mark the copy unit_stride_at_launch"):
        AsyncCopy(dst, (0, 0), src, (0, 0), 16)
    AsyncCopy(dst, (0, 0), src, (0, 0), 16, unit_stride_at_launch=True)
    fixed = Buffer("Y", dt.float16, (64, 64), "global", strides=(1, 64))
    with pytest.raises(IntrinsicError, match="the copied elements must be contiguous"):
        AsyncCopy(dst, (0, 0), fixed, (0, 0), 16, unit_stride_at_launch=True)


def _nvrtc() -> bool:
    try:
        from tecc.codegen import nvrtc_version

        nvrtc_version()
        return True
    except Exception:  # noqa: BLE001 - no NVRTC here: the compile tests are skipped
        return False


@pytest.mark.skipif(not _nvrtc(), reason="NVRTC is not available")
@pytest.mark.parametrize("arch,intrinsic,block,warps,k_tile,stages", [
    ("sm_80", "auto", (128, 128), (2, 2), 32, 4),
    ("sm_80", "auto", (128, 256), (2, 4), 32, 3),
    ("sm_90", "wgmma", (128, 256), (8, 1), 64, 4),
])
def test_the_two_loop_kernel_compiles_without_spills(arch: str, intrinsic: str, block: tuple[int, int],
                                                     warps: tuple[int, int], k_tile: int, stages: int) -> None:
    """Both main loops in one kernel: ptxas spills nothing and keeps the copy loop's register
    count within 255; the PTX holds the 16-byte copies and the element loads."""
    sch = tc.Schedule(strided_contraction(4096, 4096, 4096, "float16"))
    sch.tensorize("C", intrinsic=intrinsic, block=block, warps=warps, k_tile=k_tile, stages=stages)
    func = sch.mod.kernels[0]
    assert any(isinstance(s, IfThenElse) and "A_stride1 == 1" in str(s.cond) for s in iter_stmts(func.body))
    compiled = compile_cuda(emit_source([func]), arch="sm_90a" if intrinsic == "wgmma" else arch, name=func.name)
    res = compiled.resources[func.name]
    assert (res.spill_stores, res.spill_loads, res.stack_bytes) == (0, 0, 0), f"{arch}: {res}"
    assert res.registers <= 255
    assert "cp.async.cg.shared.global" in compiled.ptx and "ld.global.u16" in compiled.ptx


# float32 operands rounded to tf32 (cvt.rna: 2⁻¹¹ relative per operand) and fp8 (exact products)
PRECISIONS = {
    "tf32 mma.sync": ("float32", "sm_80", "mma.m16n8k8.f32.tf32", [2, 2], 16, 2 * 2.0**-11),
    "tf32 wgmma": ("float32", "sm_90", "wgmma.tf32", [4, 1], 32, 2 * 2.0**-11),
    "fp8 wgmma": ("float8_e4m3", "sm_90", "wgmma", [4, 1], 128, 0.0),
}


@pytest.mark.parametrize("precision", PRECISIONS)
def test_tf32_and_fp8_operands_with_run_time_strides(precision: str) -> None:
    """The other tensor-core precisions take the same two loops (B stored [j, k]: fp8 and tf32
    wgmma read K-major operands); K = 264 gives the 128-wide fp8 k tile three tiles too."""
    import ml_dtypes

    dtype, arch, intrinsic, warps, k_tile, rounding = PRECISIONS[precision]
    k = 264
    plan = {"strategy": "manual", "reason": "test", "steps": [
        {"primitive": "tensorize", "args": {"stage": "C", "intrinsic": intrinsic, "block": [64, 64], "warps": warps,
                                            "k_tile": k_tile, "stages": 3}}]}
    f = tc.build(strided_contraction(M, N, k, dtype, b_t=True), target="sim", arch=arch, plan=plan)
    npd = np.float32 if dtype == "float32" else ml_dtypes.float8_e4m3fn
    g = np.random.default_rng(21)

    def rand(shape: tuple[int, ...]) -> np.ndarray:
        return (g.uniform(0.5, 1.5, shape) * g.choice([-1, 1], shape)).astype(npd)
    for what, a, fast in (("slice", rand((M, k + 16))[:, :k], True),
                          ("transposed", np.ascontiguousarray(rand((k, M))).T, False)):
        b, c = rand((N, k)), np.full((M, N), np.nan, np.float32)
        with count_bank_conflicts() as banks:
            f(a, b, c)
        a64, b64 = a.astype(np.float64), b.astype(np.float64).T
        want, size = a64 @ b64, np.abs(a64) @ np.abs(b64)
        bound = (rounding + (k + 1) * 2.0**-24) * size
        err = np.where(np.isnan(c), np.inf, np.abs(c - want) - bound)
        assert (err <= 0).all(), f"{precision} A {what}: worst {float(err.max())} over the bound"
        assert element_stored(banks, "A_shared") is not fast, what


def test_the_emulator_reports_a_copy_that_skipped_the_launch_test(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel with the copy loop alone (the test dropped) runs a transposed A through 16-byte
    copies: the emulator names the untested stride instead of computing garbage."""
    from tecc.ir.errors import TeccError
    from tecc.passes.schedule.tensorize import _Emitter

    monkeypatch.setenv("TECC_NO_CACHE", "1")
    monkeypatch.setattr(_Emitter, "dispatch", lambda self: self.pipeline())
    f = tc.build(strided_contraction(M, N, K, "float16"), target="sim", arch="sm_80", plan=mma_plan())
    g = np.random.default_rng(9)
    a = np.ascontiguousarray(values(g, (K, M), "float16")).T
    with pytest.raises(TeccError, match="assumes a unit innermost stride, tested at launch, but A's is"):
        f(a, values(g, (K, N), "float16"), np.full((M, N), np.nan, np.float32))


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_a_convolution_over_a_strided_nhwc_view(arch: str) -> None:
    """The machinery is the implicit GEMM's, not a GEMM special case: a 3x3 convolution (padding
    under where()) whose activations have run-time strides gathers through them, with 16-byte
    copies along C for a channel slice and element loads for an NCHW tensor seen as NHWC."""
    n, h, w, cin, cout, r = 2, 8, 8, 16, 32, 3
    X = tc.placeholder((n, h, w, cin), "float16", name="X", strides="any")
    Wt = tc.placeholder((r, r, cin, cout), "float16", name="Wt")
    rr, ss, cc = tc.reduce_axis(r, "rr"), tc.reduce_axis(r, "ss"), tc.reduce_axis(cin, "cc")

    def body(b: Any, p: Any, q: Any, f: Any) -> Any:
        y, x = p + rr - 1, q + ss - 1
        inside = (y >= 0) & (y < h) & (x >= 0) & (x < w)
        pixel = tc.where(inside, X[b, y, x, cc], tc.const(0.0, "float16"))
        return tc.sum(tc.cast(pixel, "float32") * tc.cast(Wt[rr, ss, cc, f], "float32"), axis=[rr, ss, cc])

    f = tc.build([X, Wt, tc.compute((n, h, w, cout), body, name="Y")], target="sim", arch=arch)
    assert f.plan.steps[0].primitive == "tensorize", f.explain()
    g = np.random.default_rng(2)
    weights = values(g, (r, r, cin, cout), "float16")
    channel_slice = values(g, (n, h, w, cin + 8), "float16")[..., :cin]
    nchw = np.ascontiguousarray(values(g, (n, cin, h, w), "float16")).transpose(0, 2, 3, 1)
    for what, x, fast in (("channel slice", channel_slice, True), ("NCHW seen as NHWC", nchw, False)):
        y = np.full((n, h, w, cout), np.nan, np.float32)
        with count_bank_conflicts() as banks:
            f(x, weights, y)
        padded = np.pad(x.astype(np.float64), ((0, 0), (1, 1), (1, 1), (0, 0)))
        want, size = np.zeros(y.shape), np.zeros(y.shape)
        for i in range(r):
            for j in range(r):
                tap = padded[:, i:i + h, j:j + w, :]
                want += tap @ weights[i, j].astype(np.float64)
                size += np.abs(tap) @ np.abs(weights[i, j].astype(np.float64))
        bound = (r * r * cin + 1) * 2.0**-24 * size
        err = np.where(np.isnan(y), np.inf, np.abs(y - want) - bound)
        assert (err <= 0).all(), f"{arch} {what}: worst {float(err.max())} over the bound"
        assert element_stored(banks, "X_shared") is not fast, what
