"""Tensor-core contractions whose operands have run-time strides (`placeholder(..., strides="any")`).

tensorize lays such an operand out as a slice of a wider row-major array would be (innermost
stride 1, the others multiples of 16 bytes) and builds one kernel with two main loops over the
same shared ring: 16-byte cp.async copies where the launch's strides pass that test, 16-byte
copies of a transposed view (unit stride on the other dimension: w.t()) stored in the other
orientation in the same tile (`Operand.transposed`), element loads (any strides: odd row
strides, negative strides) where neither holds (tile_staging.py `TileStaging.dispatch`,
implicit_gemm.py `stride_condition`). In the emulator against NumPy float64 under
tests/test_tensorize.py's bound (exact products, float32 sums, one rounding of the output);
outputs start as NaN, inputs are fresh random values. Which loop ran is read from the shared
tile's accesses: 16-byte copies, or 2-byte element stores; which copy loop, from the emulator's
check at every launch-tested copy that the stride it runs along is 1 (a copy loop reached with
the other view's strides is a TeccError, `test_the_emulator_reports_a_copy_that_skipped_the_launch_test`).
"""

from __future__ import annotations

import itertools
import re
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
from tecc.ir.evaluate import evaluate_int
from tecc.ir.expr import Var, free_vars
from tecc.ir.stmt import AsyncCopy, Buffer, IfThenElse, iter_stmts
from tecc.passes.lower import lower
from tecc.runtime.sim.banks import count_bank_conflicts
from nvrtc_checks import needs_nvrtc
from tensor_core_steps import schedule_tensor_core

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
    """Views of `shape` (rows, cols) with the strides a user may pass, and whether one of the
    copy loops' launch tests passes for them: unit innermost stride and the rows 16-byte
    multiples (a slice), or unit row stride and 16-byte-multiple columns (a transposed view)."""
    rows, cols = shape
    wide = values(g, (rows, cols + 24), dtype)        # rows of cols + 24 elements: 16-byte multiples
    odd = values(g, (rows, cols + 3), dtype)
    return {
        "slice": (wide[:, :cols], True),
        "rows reversed": (wide[::-1, :cols], True),          # a negative row stride, still 16-byte aligned
        "transposed": (np.ascontiguousarray(values(g, (cols, rows), dtype)).T, True),
        "transposed slice": (values(g, (cols + 8, rows), dtype)[4:4 + cols].T, True),  # columns of a wider array
        "odd row stride": (odd[:, :cols], False),
        "columns reversed": (wide[:, ::-1][:, :cols], False),  # innermost stride -1
        "transposed, odd stride": (values(g, (cols, rows + 3), dtype)[:, :rows].T, False),
    }


def element_stored(banks: Any, buffer: str) -> bool:
    """Whether the shared tile `buffer` was filled by element stores (accesses of one element,
    1 to 4 bytes) rather than 16-byte copies (ldmatrix reads are 16-byte accesses too)."""
    return bool(banks.widths[buffer] & {1, 2, 4})


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_every_view_of_a_strided_operand_matches_numpy(path: str, dtype: str) -> None:
    """One kernel serves every view: a slice of a wider array (and its rows reversed) runs the
    cp.async loop, a transposed view (and a transposed slice) the transposed-view cp.async loop,
    an odd row stride and a reversed innermost dimension the element loop; all match NumPy, and
    the copies write the tile without bank conflicts."""
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
        if fast:
            assert banks.conflicts("A_shared") == 0, f"{path} {what}: {banks.conflicts('A_shared')} bank conflicts"


@pytest.mark.parametrize("path", PATHS)
def test_both_operands_strided(path: str) -> None:
    """A and B with run-time strides: one main loop per combination of the operands' copy
    forms (slice or transposed view each: four), each under the conjunction of both
    operands' tests; an operand that passes neither sends both to element loads."""
    arch, plan = PATHS[path]
    f = tc.build(strided_contraction(M, N, K, "float16", b_any=True), target="sim", arch=arch, plan=plan())
    assert "every combination a main loop" in f.explain()
    g = np.random.default_rng(11)
    a_views = {"slice": values(g, (M, K + 8), "float16")[:, :K],
               "transposed": np.ascontiguousarray(values(g, (K, M), "float16")).T,
               "odd row stride": values(g, (M, K + 1), "float16")[:, :K]}
    b_views = {"slice": values(g, (K, N + 16), "float16")[:, :N],
               "transposed": np.ascontiguousarray(values(g, (N, K), "float16")).T}
    for (a_what, a), (b_what, b) in itertools.product(a_views.items(), b_views.items()):
        fast = a_what != "odd row stride"
        c = np.full((M, N), np.nan, np.float32)
        with count_bank_conflicts() as banks:
            f(a, b, c)
        how = {"a_t": False, "b_t": False, "dtype": "float16", "out": "float32", "epilogue": False}
        what = f"{path} A {a_what}, B {b_what}"
        check({"A": a, "B": b, "C": c}, how, what)
        assert element_stored(banks, "A_shared") is not fast and element_stored(banks, "B_shared") is not fast, what


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_linear_layer_weight_passed_transposed(path: str, dtype: str) -> None:
    """x @ w.t() (every torch Linear): B = w.t() with w (N, K) contiguous, declared (K, N) with
    run-time strides, so its strides are (1, K): the transposed-view copy loop (B stored
    k-contiguous, read with plain ldmatrix / a K-major descriptor); w itself passed as a (K, N)
    slice takes the matched copy loop. A is contiguous."""
    arch, plan = PATHS[path]
    f = tc.build(strided_contraction(M, N, K, dtype, a_any=False, b_any=True), target="sim", arch=arch, plan=plan())
    assert "B_stride0 == 1 && B_stride1 % 8 == 0" in f.explain()
    g = np.random.default_rng(13)
    a = values(g, (M, K), dtype)
    for what, b in (("w.t()", np.ascontiguousarray(values(g, (N, K), dtype)).T),
                    ("w.t() of a batch of weights", values(g, (3, N, K), dtype)[1].T),
                    ("a (K, N) slice", values(g, (K, N + 8), dtype)[:, :N])):
        c = np.full((M, N), np.nan, np.float32)
        with count_bank_conflicts() as banks:
            f(a, b, c)
        how = {"a_t": False, "b_t": False, "dtype": dtype, "out": "float32", "epilogue": False}
        check({"A": a, "B": b, "C": c}, how, f"{path} {dtype} B {what} (strides {b.strides})")
        assert not element_stored(banks, "B_shared"), what
        assert banks.conflicts("B_shared") == 0, f"{what}: {banks.conflicts('B_shared')} bank conflicts"


def test_a_batch_dimension_with_its_own_stride() -> None:
    """A batched contraction whose A is every other matrix of a wider batch, each a slice of
    wider rows (copies), a batch of transposed matrices (the transposed-view copies: the unit
    stride on the row dimension, the batch stride a 16-byte multiple), and a batch whose
    matrices are transposed views with an odd batch stride (element loads)."""
    batch = 2
    f = tc.build(strided_contraction(M, N, K, "float16", batch=batch), target="sim", arch="sm_80", plan=mma_plan())
    g = np.random.default_rng(5)
    every_other = values(g, (2 * batch, M, K + 8), "float16")[::2, :, :K]
    transposed = np.swapaxes(values(g, (batch, K, M), "float16"), 1, 2)
    odd_batch = np.lib.stride_tricks.as_strided(values(g, (batch * (K * M + 1),), "float16"), (batch, M, K),
                                                (2 * (K * M + 1), 2, 2 * M))
    for what, a, fast in (("every other, sliced", every_other, True), ("transposed", transposed, True),
                          ("transposed, odd batch stride", odd_batch, False)):
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
    assert "transposed-view cp.async copies of A when the unit stride is the other dimension's" in text, text
    assert ("A_stride0 % 8 == 0 && A_stride1 == 1, transposed-view cp.async copies when "
            "A_stride0 == 1 && A_stride1 % 8 == 0, else element loads") in text, text


def test_the_gemm_view_marks_the_operands_whose_copies_are_tested_at_launch() -> None:
    info = analyze_kernel(lower(strided_contraction(M, N, K, "float16")).kernels[0])
    view = gemm_view(info)
    assert not isinstance(view, str)
    assert view.launch_tested == (True, False) and view.copies == (8, 8) and view.transposed_copies == (8, 0)
    # K = 42: copies of 2 elements along k (K % 8 != 0); the row stride must be even at launch
    f = tc.build(strided_contraction(M, N, 42, "float16"), target="sim", arch="sm_80", plan=mma_plan())
    assert "A_stride0 % 2 == 0 && A_stride1 == 1" in f.explain()
    g = np.random.default_rng(3)
    for a in (values(g, (M, 50), "float16")[:, :42], values(g, (M, 43), "float16")[:, :42],
              np.ascontiguousarray(values(g, (42, M), "float16")).T):
        b, c = values(g, (42, N), "float16"), np.full((M, N), np.nan, np.float32)
        f(a, b, c)
        how = {"a_t": False, "b_t": False, "dtype": "float16", "out": "float32", "epilogue": False}
        check({"A": a, "B": b, "C": c}, how, f"K = 42, A strides {a.strides}")


@pytest.mark.parametrize("path", PATHS)
def test_an_odd_k(path: str) -> None:
    """K = 41: no copy is provable along k even for a slice (the element loop, its elements
    held in registers across the compute as for any odd K), but a transposed view of A copies
    along its M = 64 rows: the kernel is that copy loop under its test, else the element
    loop. B (strided too) is passed as a (K, N) slice, its copy loop; B = w.t() with an odd K
    would have an odd column stride and no copies along k, and send both operands to the
    element loop (one loop per combination of copy forms, then one element loop)."""
    arch, plan = PATHS[path]
    k = 41
    f = tc.build(strided_contraction(M, N, k, "float16", b_any=True), target="sim", arch=arch, plan=plan())
    body = list(iter_stmts(f.module.kernels[0].body))
    copies_a = [s for s in body if isinstance(s, AsyncCopy) and s.src.name == "A"]
    assert copies_a and all(s.unit_stride_at_launch and s.along == 0 for s in copies_a)
    # B's copies run along its N columns only (a (K, N) slice); no transposed view has copies along k
    assert all(s.along == -1 for s in body if isinstance(s, AsyncCopy) and s.src.name == "B")
    g = np.random.default_rng(4)
    b_t = values(g, (k, N + 8), "float16")[:, :N]
    for what, a, fast in (("slice", values(g, (M, 64), "float16")[:, :k], False),
                          ("transposed", np.ascontiguousarray(values(g, (k, M), "float16")).T, True)):
        c = np.full((M, N), np.nan, np.float32)
        with count_bank_conflicts() as banks:
            f(a, b_t, c)
        check({"A": a, "B": b_t, "C": c}, {"a_t": False, "b_t": False, "dtype": "float16", "out": "float32",
                                           "epilogue": False}, f"{path} K = 41, A {what}")
        assert element_stored(banks, "A_shared") is not fast, what
        assert element_stored(banks, "B_shared") is not fast, what


def test_the_loop_ir_round_trip_keeps_the_launch_tested_copies() -> None:
    """An artifact's .ir (loop_json) keeps the copies' mark, so `load(path).sim(...)` runs the
    same two loops."""
    from tecc.ir import loop_json

    f = tc.build(strided_contraction(M, N, K, "float16"), target="sim", arch="sm_80", plan=mma_plan())
    again = loop_json.module_from_json(loop_json.module_to_json(f.module))
    marks = [[(s.unit_stride_at_launch, s.along) for s in iter_stmts(m.kernels[0].body) if isinstance(s, AsyncCopy)]
             for m in (f.module, again)]
    assert marks[0] == marks[1] and (True, -1) in marks[0] and (True, 0) in marks[0] and (False, -1) in marks[0]


def test_a_copy_from_a_run_time_innermost_stride_must_say_it_was_tested() -> None:
    src = Buffer("X", dt.float16, (64, 64), "global", strides=(Var("s0", kind="stride"), Var("s1", kind="stride")))
    dst = Buffer("X_shared", dt.float16, (64, 64), "shared")
    with pytest.raises(IntrinsicError, match="test it at launch and mark the copy unit_stride_at_launch"):
        AsyncCopy(dst, (0, 0), src, (0, 0), 16)
    AsyncCopy(dst, (0, 0), src, (0, 0), 16, unit_stride_at_launch=True)
    fixed = Buffer("Y", dt.float16, (64, 64), "global", strides=(1, 64))
    with pytest.raises(IntrinsicError, match="the copied elements must be contiguous"):
        AsyncCopy(dst, (0, 0), fixed, (0, 0), 16, unit_stride_at_launch=True)
    # a transposed view's copy runs along its first dimension, whose stride the kernel tested
    with pytest.raises(IntrinsicError, match="needs that dimension's run-time stride tested to be 1 at launch"):
        AsyncCopy(dst, (0, 0), src, (0, 0), 16, along=0)
    AsyncCopy(dst, (0, 0), src, (0, 0), 16, unit_stride_at_launch=True, along=0)
    with pytest.raises(IntrinsicError, match="stride along dimension 0 is 64"):
        AsyncCopy(dst, (0, 0), Buffer("Z", dt.float16, (64, 64), "global", strides=(64, 1)), (0, 0), 16,
                  unit_stride_at_launch=True, along=0)



@needs_nvrtc
@pytest.mark.parametrize("strided", ["A", "B = w.t()"])
@pytest.mark.parametrize("arch,intrinsic,block,warps,k_tile,stages", [
    ("sm_80", "auto", (128, 128), (2, 2), 32, 4),
    ("sm_80", "auto", (128, 256), (2, 4), 32, 3),
    ("sm_90", "wgmma", (128, 256), (8, 1), 64, 4),
])
def test_the_dispatching_kernel_compiles_without_spills(arch: str, intrinsic: str, block: tuple[int, int],
                                                        warps: tuple[int, int], k_tile: int, stages: int,
                                                        strided: str) -> None:
    """The three main loops in one kernel (the slice's copies, the transposed view's, element
    loads): ptxas spills nothing and keeps the copy loop's register count within 255; the PTX
    holds the 16-byte copies, the element loads and both ldmatrix forms (mma.sync)."""
    b_side = strided != "A"
    sch = tc.Schedule(strided_contraction(4096, 4096, 4096, "float16", a_any=not b_side, b_any=b_side))
    schedule_tensor_core(sch, "C", intrinsic=intrinsic, block=block, warps=warps, k_tile=k_tile, stages=stages)
    func = sch.mod.kernels[0]
    x = "B" if b_side else "A"
    conds = [str(s.cond) for s in iter_stmts(func.body) if isinstance(s, IfThenElse)]
    assert any(f"{x}_stride1 == 1" in c for c in conds) and any(f"{x}_stride0 == 1" in c for c in conds)
    compiled = compile_cuda(emit_source([func]), arch="sm_90a" if intrinsic == "wgmma" else arch, name=func.name)
    res = compiled.resources[func.name]
    assert (res.spill_stores, res.spill_loads, res.stack_bytes) == (0, 0, 0), f"{arch}: {res}"
    assert res.registers <= 255
    assert "cp.async.cg.shared.global" in compiled.ptx and "ld.global.u16" in compiled.ptx
    if intrinsic != "wgmma":
        assert "ldmatrix.sync.aligned.m8n8.x4.trans" in compiled.ptx and "ldmatrix.sync.aligned.m8n8.x4.shared" in \
            compiled.ptx


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
    from tecc.passes.schedule.tile_staging import TileStaging

    monkeypatch.setenv("TECC_NO_CACHE", "1")
    monkeypatch.setattr(TileStaging, "dispatch", lambda self: self.pipeline())
    f = tc.build(strided_contraction(M, N, K, "float16"), target="sim", arch="sm_80", plan=mma_plan())
    g = np.random.default_rng(9)
    a = np.ascontiguousarray(values(g, (K, M), "float16")).T
    with pytest.raises(TeccError, match="assumes a unit innermost stride, tested at launch, but A's is"):
        f(a, values(g, (K, N), "float16"), np.full((M, N), np.nan, np.float32))


def test_the_emulator_reports_a_transposed_copy_that_skipped_its_launch_test(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel with the transposed view's copy loop alone runs a slice of A through copies
    along its rows: the emulator names the stride of the dimension the copies run along."""
    from dataclasses import replace

    from tecc.ir.errors import TeccError
    from tecc.passes.schedule.tile_staging import TileStaging

    def transposed_only(self: Any) -> Any:
        assert self.c.a.transposed is not None
        self.c = replace(self.c, a=self.c.a.transposed)
        return self.pipeline()
    monkeypatch.setenv("TECC_NO_CACHE", "1")
    monkeypatch.setattr(TileStaging, "dispatch", transposed_only)
    f = tc.build(strided_contraction(M, N, K, "float16"), target="sim", arch="sm_80", plan=mma_plan())
    g = np.random.default_rng(10)
    with pytest.raises(TeccError, match="assumes a unit stride along dimension 0, tested at launch, but A's is"):
        f(values(g, (M, K + 8), "float16")[:, :K], values(g, (K, N), "float16"), np.full((M, N), np.nan, np.float32))


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


@pytest.mark.parametrize("precision", ["fp8 wgmma", "tf32 wgmma"])
def test_a_k_major_view_is_the_fast_one_where_the_row_reads_k_major(precision: str) -> None:
    """fp8 wgmma reads both shared operands K-major, tf32 wgmma at least one, so B[k, j] with
    run-time strides is taken in its transposed orientation (implicit_gemm.transposed_operand):
    B = w.t() (w (N, K) contiguous: K-major) runs the copies, every other view of B -- its
    contiguous (K, N) form included -- the element loop, which stores it K-major too. (tf32 on
    mma.sync keeps B as matched: it reads k-major tiles through 32-bit loads, and a transposed
    view takes its element loop: test_tf32_and_fp8_operands_with_run_time_strides.)"""
    import ml_dtypes

    dtype, arch, intrinsic, warps, k_tile, rounding = PRECISIONS[precision]
    k = 264
    plan = {"strategy": "manual", "reason": "test", "steps": [
        {"primitive": "tensorize", "args": {"stage": "C", "intrinsic": intrinsic, "block": [64, 64], "warps": warps,
                                            "k_tile": k_tile, "stages": 3}}]}
    if dtype == "float32":   # A stored [k, i] too: tf32 wgmma needs one K-major operand
        A = tc.placeholder((k, M), dtype, "A")
        B = tc.placeholder((k, N), dtype, "B", strides="any")
        r = tc.reduce_axis(k, "r")
        args = [A, B, tc.compute((M, N), lambda i, j: tc.sum(tc.cast(A[r, i], "float32") * tc.cast(B[r, j], "float32"),
                                                             axis=r), name="C")]
    else:
        args = strided_contraction(M, N, k, dtype, a_any=False, b_any=True)
    f = tc.build(args, target="sim", arch=arch, plan=plan)
    assert "B_stride0 == 1 && B_stride1 %" in f.explain(), f.explain()
    npd = np.float32 if dtype == "float32" else ml_dtypes.float8_e4m3fn
    g = np.random.default_rng(23)

    def rand(shape: tuple[int, ...]) -> np.ndarray:
        return (g.uniform(0.5, 1.5, shape) * g.choice([-1, 1], shape)).astype(npd)
    a = rand((k, M)) if dtype == "float32" else rand((M, k))
    a64 = a.astype(np.float64).T if dtype == "float32" else a.astype(np.float64)
    for what, b, fast in (("w.t()", np.ascontiguousarray(rand((N, k))).T, True),
                          ("contiguous (K, N)", rand((k, N)), False)):
        c = np.full((M, N), np.nan, np.float32)
        with count_bank_conflicts() as banks:
            f(a, b, c)
        b64 = b.astype(np.float64)
        want, size = a64 @ b64, np.abs(a64) @ np.abs(b64)
        err = np.where(np.isnan(c), np.inf, np.abs(c - want) - (rounding + (k + 1) * 2.0**-24) * size)
        assert (err <= 0).all(), f"{precision} B {what}: worst {float(err.max())} over the bound"
        assert element_stored(banks, "B_shared") is not fast, f"{precision} B {what}"


def test_the_planner_takes_fp8_with_a_strided_b_declared_k_outermost() -> None:
    """gemm_wgmma_fp8 refuses a contiguous B[k, j] (fp8 wgmma reads K-major only), but takes one
    declared strides="any": tensorize runs its K-major view (w.t()) through copies, and the
    note says so."""
    f = tc.build(strided_contraction(128, 128, 256, "float8_e4m3", a_any=False, b_any=True), target="sim", arch="sm_90")
    text = f.explain()
    assert "chosen: gemm_wgmma_fp8(" in text, text
    assert "run-time strides of B (declared k-outermost): the K-major view's cp.async copies" in text, text
    assert "B_stride0 == 1 && B_stride1 % 16 == 0, else element loads" in text, text
    contiguous = tc.build(strided_contraction(128, 128, 256, "float8_e4m3", a_any=False), target="sim", arch="sm_90")
    assert "gemm_wgmma_fp8" not in contiguous.explain().split("chosen:")[1].splitlines()[0]


# The tile configurations the planner picks at 4096³ (benchmarks/gemm.py --strided)
LARGE_TILES = {"mma.sync": ("sm_80", dict(intrinsic="auto", block=(128, 128), warps=(2, 2), k_tile=32, stages=4)),
               "wgmma": ("sm_90", dict(intrinsic="wgmma", block=(128, 256), warps=(8, 1), k_tile=64, stages=4))}


def large_tile_kernel(path: str, n: int, **kw: Any) -> Any:
    arch, args = LARGE_TILES[path]
    sch = tc.Schedule(strided_contraction(n, n, n, "float16", **kw))
    return schedule_tensor_core(sch, "C", **args)


@pytest.mark.parametrize("side", ["A", "B"])
@pytest.mark.parametrize("path", LARGE_TILES)
def test_launch_tested_copies_address_without_the_tested_stride(path: str, side: str) -> None:
    """Inside a copy loop taken under the launch test, the unit stride it tested is the
    constant 1: each copy's source address multiplies by the other (row) stride only -- the
    slice's loop by X_stride0, the transposed view's by X_stride1 -- never by the tested one."""
    sch = large_tile_kernel(path, 512, a_any=side == "A", b_any=side == "B")
    func = sch.mod.kernels[0]
    copies = [s for s in iter_stmts(func.body) if isinstance(s, AsyncCopy) and s.src.name == side]
    assert copies and all(s.unit_stride_at_launch for s in copies)
    src = emit_source([func])
    addresses = set(re.findall(r'"l"\(&' + side + r"\[([^\]]*)\]\)", src))
    used = {tuple(f"{side}_stride{d}" in a for d in (0, 1)) for a in addresses}
    # one stride each: the slice loop's row stride (dim 0), the transposed view's (dim 1)
    assert used == {(True, False), (False, True)}, sorted(addresses)


def warp_copy_footprint(func: Any, buffer: str, along: int, strides: tuple[int, ...]) -> list[tuple[int, bool]]:
    """Per cp.async statement of `buffer` running along `along`: (128-byte lines, whether every
    32-byte sector is whole) that warp 0's first copy reads, with every other variable 0 and
    the buffer's strides given in elements."""
    out = []
    for s in iter_stmts(func.body):
        if not (isinstance(s, AsyncCopy) and s.src.name == buffer and s.along == along):
            continue
        names = {v.name: v for e in s.src_indices for v in free_vars(e)}
        covered: dict[int, int] = {}
        for lane in range(32):
            env = {v: 0 for v in names.values()}
            env.update({v: strides[int(n[-1])] for n, v in names.items() if n.startswith(f"{buffer}_stride")})
            env[names["thread"]] = lane
            start = sum(evaluate_int(e, env) * st for e, st in zip(s.src_indices, strides)) * 2
            for byte in range(start, start + s.bytes):
                covered[byte // 32] = covered.get(byte // 32, 0) + 1
        out.append((len({sector // 4 for sector in covered}), all(c == 32 for c in covered.values())))
    return out


@pytest.mark.parametrize("path", LARGE_TILES)
def test_transposed_view_copies_like_a_compile_time_transposed_operand(path: str) -> None:
    """B = w.t() (B (K, N) with run-time strides, passed as the transpose of a contiguous
    (N, K) w) is copied with the chunking of the kernel built for B stored (N, K) at compile
    time: each warp instruction reads whole 32-byte sectors of the same number of 128-byte
    lines; A = x.t() reads whole sectors of at most 4 lines (2 rows of its 256-byte tile rows)."""
    n = 512
    runtime = large_tile_kernel(path, n, a_any=False, b_any=True).mod.kernels[0]
    fixed = large_tile_kernel(path, n, a_any=False, b_t=True).mod.kernels[0]
    got = warp_copy_footprint(runtime, "B", 0, (1, n))
    want = warp_copy_footprint(fixed, "B", -1, (n, 1))
    assert got and want and all(whole for _, whole in got + want)
    assert {lines for lines, _ in got} == {lines for lines, _ in want}, (got, want)
    a_view = large_tile_kernel(path, n).mod.kernels[0]
    a_got = warp_copy_footprint(a_view, "A", 0, (1, n))
    assert a_got and all(whole and lines <= 4 for lines, whole in a_got), a_got


@pytest.mark.parametrize("side", ["A", "B"])
@pytest.mark.parametrize("path", LARGE_TILES)
def test_transposed_views_at_the_planners_tiles_match_numpy_without_conflicts(path: str, side: str) -> None:
    """At the 4096³ tiles (two blocks each way), a transposed view of A and B = w.t() take the
    transposed-view copy loop (16-byte copies only), match NumPy float64, and neither the copies
    nor the fragment reads conflict on banks; so does the slice of a wider array."""
    arch, args = LARGE_TILES[path]
    m = n = 256
    k = 128
    f = tc.build(_large_schedule(m, n, k, side, args), target="sim", arch=arch)
    g = np.random.default_rng(11)
    rows, cols = (m, k) if side == "A" else (k, n)
    for what in ("transposed", "slice"):
        x = values(g, (cols, rows), "float16").T if what == "transposed" else values(g, (rows, cols + 8), "float16")[:, :cols]
        a, b = (x, values(g, (k, n), "float16")) if side == "A" else (values(g, (m, k), "float16"), x)
        c = np.full((m, n), np.nan, np.float32)
        with count_bank_conflicts() as banks:
            f(a, b, c)
        how = {"a_t": False, "b_t": False, "dtype": "float16", "out": "float32", "epilogue": False}
        check({"A": a, "B": b, "C": c}, how, f"{path} {side} {what} (strides {x.strides})")
        for buf in ("A_shared", "B_shared"):
            assert not element_stored(banks, buf), f"{path} {side} {what}: {buf} took element loads"
            assert banks.conflicts(buf) == 0, f"{path} {side} {what}: {banks.conflicts(buf)} conflicts on {buf}"


def _large_schedule(m: int, n: int, k: int, side: str, args: dict[str, Any]) -> Any:
    sch = tc.Schedule(strided_contraction(m, n, k, "float16", a_any=side == "A", b_any=side == "B"))
    return schedule_tensor_core(sch, "C", **args)
