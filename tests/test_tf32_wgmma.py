"""TF32 on Hopper's wgmma (wgmma.m64nNk8 .tf32), in the emulator and through NVRTC for sm_90a.

The ISA takes tf32 shared operands K-major only, so the kernel's form follows the operands'
orientation (tensorize_wgmma.py, "tf32"): both k-contiguous -> both through descriptors; A
k-contiguous and B n-contiguous (the plain C = A·B) -> Cᵀ = Bᵀ·Aᵀ with the B tile loaded into
registers as the wgmma's A; A m-contiguous and B k-contiguous -> A from registers. Both with k
outermost are refused (gemm_tensor_core_tf32 serves them).

Bounds. A shared operand is read as stored, the tensor core ignoring the 13 low mantissa bits
(truncation, relative error < 2⁻¹⁰); a register operand is rounded by cvt.rna (< 2⁻¹¹). With u =
2⁻¹⁰ for both, products of the rounded inputs exact and float32 sums (2⁻²³ per addition on the
GPU: tests/test_tf32.py),

    |C - A·B| <= ((1 + u)² - 1 + (K + 1)·2⁻²³·(1 + u)²) · (|A|·|B|)

elementwise. Against float64 NumPy of the inputs as the emulator rounds them (truncated shared
operands, rna-rounded register ones) the kernel is within the float32 part alone, (K + 1)·2⁻²⁴,
which pins which operand took which path and every fragment layout. Inputs are fresh random
values with full mantissas, outputs start as NaN.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from test_tf32 import check, contraction, run, run_conv_case
from test_wgmma import needs_nvrtc

import tecc as tc
from tecc.compiler.cost.analysis import analyze_kernel
from tecc.compiler.pipeline import wgmma_serialized
from tecc.compiler.planner import candidates_for
from tecc.ir.descriptor import MatrixDescriptor
from tecc.ir.errors import ScheduleError
from tecc.ir.intrinsics import lookup
from tecc.ir.layout import Swizzle
from tecc.ir.stmt import FragmentRef, SharedMatrix, WarpgroupMatrixMultiply, iter_stmts
from tecc.passes.lower import lower
from tecc.runtime.sim.banks import count_bank_conflicts
from tecc.runtime.sim.matrix import round_to_tf32, truncate_to_tf32
from tensor_core_steps import tensorized

U = 2.0**-10


def tf32_wgmma_plan(block: tuple[int, int] = (64, 64), stages: int = 3, groups: int = 1,
                    intrinsic: str = "wgmma.tf32", producer: str = "threads") -> dict[str, Any]:
    args: dict[str, Any] = {"stage": "C", "intrinsic": intrinsic, "block": list(block), "warps": [4 * groups, 1],
                            "k_tile": 32, "stages": stages}
    if producer != "threads":
        args["producer"] = producer
    return {"strategy": "manual", "reason": "test", "steps": [{"primitive": "tensorize", "args": args}]}


def wgmmas(f: Any) -> list[WarpgroupMatrixMultiply]:
    return [s for s in iter_stmts(f.module.kernels[0].body) if isinstance(s, WarpgroupMatrixMultiply)]


def check_tf32_wgmma(f: Any, got: np.ndarray, a: np.ndarray, b: np.ndarray, what: str,
                     bias: np.ndarray | None = None) -> None:
    """Within the TF32 bound of the exact product, and within the float32 part of it of the
    product of the inputs as the form reads them (module docstring)."""
    k = a.shape[-1]
    epilogue = (lambda x: np.maximum(x + bias, 0.0)) if bias is not None else (lambda x: x)
    extra = (lambda x: 2.0**-24 * (np.abs(x) + np.abs(bias))) if bias is not None else (lambda x: 0.0)
    grow = (1 + U) ** 2
    exact = a @ b
    check(got, epilogue(exact), (grow - 1 + (k + 1) * 2.0**-23 * grow) * (np.abs(a) @ np.abs(b)) + extra(exact),
          f"{what} vs float64")
    (s,) = {type(w.a) for w in wgmmas(f)}
    register = s is FragmentRef
    swapped = "C^T = B^T.A^T" in dict(f.module.kernels[0].attrs)["tensorize"]
    # the wgmma's A is B when swapped; the register operand is rounded, shared ones truncated
    a_reg, b_reg = (False, register) if swapped else (register, False)
    ra = (round_to_tf32 if a_reg else truncate_to_tf32)(a.astype(np.float32)).astype(np.float64)
    rb = (round_to_tf32 if b_reg else truncate_to_tf32)(b.astype(np.float32)).astype(np.float64)
    rounded = ra @ rb
    check(got, epilogue(rounded), (k + 1) * 2.0**-24 * (np.abs(ra) @ np.abs(rb)) + extra(rounded),
          f"{what} vs the inputs as read")


def run_bias(m: int, n: int, k: int, **kw: Any) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """run() with the bias + relu epilogue; also returns the bias (run's seed draws it third)."""
    f, out, a, b = run(m, n, k, bias_relu=True, **kw)
    g = np.random.default_rng(kw.get("seed", 0))
    lead = (kw["batch"],) if kw.get("batch") else ()
    g.standard_normal(lead + ((k, m) if kw.get("a_t") else (m, k)))
    g.standard_normal(lead + ((n, k) if kw.get("b_t") else (k, n)))
    bias = g.uniform(-2, 2, (n,)).astype(np.float32).astype(np.float64)
    return f, out, a, b, bias


# ---- the table, descriptors and the emulator ------------------------------------------------------

def test_the_tf32_register_a_map_covers_the_m64_k8_tile_once_per_element() -> None:
    row = lookup("wgmma.m64n128k8.f32.tf32")
    a = row.operand("a")
    assert (row.shape, a.elements, a.registers, a.convert) == ((64, 128, 8), 4, 4, "cvt.rna.tf32.f32")
    seen = {a.layout(t, e) for t in range(128) for e in range(4)}
    assert seen == {(r, c) for r in range(64) for c in range(8)}
    # warp w holds rows 16w..16w+15; lane 5 (g = 1, t = 1) of warp 2: (33, 1), (41, 1), (33, 5), (41, 5)
    assert [a.layout(69, e) for e in range(4)] == [(33, 1), (41, 1), (33, 5), (41, 5)]
    assert row.operand("d").elements == 64 and row.ptx.endswith("m64n128k8.f32.tf32.tf32")


def test_a_4_byte_k_major_descriptor_is_the_128b_swizzle_of_32_float_rows() -> None:
    d = MatrixDescriptor("K", "128B", 16, 1024, element_bytes=4)
    assert d.layout == Swizzle(3, 2, 3) and d.core_elements == 4 and d.row_elements == 32
    # the 16-byte chunk c of row r (r < 8) lands at chunk c ^ r of the row (byte bits [4,7) ^ [7,10))
    for r in range(8):
        for c in range(8):
            assert d.offset(0, r, 4 * c + 1) == 32 * r + 4 * (c ^ r) + 1
    assert d.offset(0, 9, 0) == 256 + 32 + 4 * 1   # row 9: the second 8-row atom (SBO), row 1 of it


@pytest.mark.parametrize("a_t,b_t", [(False, True), (False, False), (True, True)])
def test_every_servable_orientation_matches_numpy(a_t: bool, b_t: bool) -> None:
    """Sizes no multiple of any tile; three k tiles and more through a 3-stage ring; the X
    fragments loaded from shared memory without bank conflicts."""
    m, n, k = 100, 72, 104
    with count_bank_conflicts() as banks:
        f, out, a, b = run(m, n, k, a_t=a_t, b_t=b_t, seed=3, arch="sm_90", plan=tf32_wgmma_plan())
    check_tf32_wgmma(f, out, a, b, f"tf32 wgmma a_t={a_t} b_t={b_t}")
    (kind,) = {type(w.a) for w in wgmmas(f)}
    assert kind is (SharedMatrix if (not a_t and b_t) else FragmentRef)
    assert all(w.row.name == "wgmma.m64n64k8.f32.tf32" for w in wgmmas(f))
    register = {"A_shared": a_t, "B_shared": not a_t and not b_t}
    for buf, loaded in register.items():
        if loaded:
            assert banks.requests[buf] > 0 and banks.conflicts(buf) == 0, dict(banks.wavefronts)


def test_both_operands_k_outermost_are_refused_by_name() -> None:
    kernel = lower(contraction(128, 128, 128, a_t=True)).kernels[0]
    with pytest.raises(ScheduleError, match="K-major only.*mma.m16n8k8.f32.tf32"):
        tensorized(kernel, "C", "wgmma.tf32", (64, 64), (4, 1), 32, 3)


def test_float32_needs_the_tf32_intrinsic_named_and_the_cp_async_ring() -> None:
    kernel = lower(contraction(128, 128, 128)).kernels[0]
    with pytest.raises(ScheduleError, match="wgmma.tf32"):
        tensorized(kernel, "C", "wgmma", (64, 64), (4, 1), 32, 3)
    with pytest.raises(ScheduleError, match="k_tile must be 32"):
        tensorized(kernel, "C", "wgmma.tf32", (64, 64), (4, 1), 64, 3)
    # swapped: the warpgroups split the columns, so 128 columns need warps (8, 1)
    with pytest.raises(ScheduleError, match=r"warps must be \(8, 1\) for block columns 128"):
        tensorized(kernel, "C", "wgmma.tf32", (64, 128), (4, 1), 32, 3)


@pytest.mark.parametrize("m,n,k,block,groups,a_t,b_t", [
    (131, 77, 45, (64, 64), 1, False, False),     # odd K: element loads; edges in M, N, K
    (70, 200, 70, (128, 128), 2, False, False),   # two warpgroups over the columns, K % 4 = 2: 8-byte copies
    (130, 90, 37, (128, 64), 2, True, True),      # two warpgroups over rows, A from registers
    (65, 130, 9, (64, 256), 1, False, True),      # K < one k tile; an m64n256 wgmma
])
def test_sizes_that_are_no_multiple_of_any_tile(m: int, n: int, k: int, block: tuple[int, int], groups: int,
                                                a_t: bool, b_t: bool) -> None:
    f, out, a, b = run(m, n, k, a_t=a_t, b_t=b_t, seed=m + k, arch="sm_90",
                       plan=tf32_wgmma_plan(block, 3, groups))
    check_tf32_wgmma(f, out, a, b, f"tf32 wgmma {m}x{n}x{k} block {block}")


@pytest.mark.parametrize("stages", [2, 4])
def test_batched_and_ring_depths(stages: int) -> None:
    """Batch on blockIdx.z; 2 stages (wait_group 0) and 4; an odd number of k tiles, so the
    register form's two-iteration loop ends on its guarded second half."""
    f, out, a, b = run(70, 66, 160, batch=3, seed=stages, arch="sm_90", plan=tf32_wgmma_plan((64, 64), stages))
    assert f.module.kernels[0].body.kind == "blockIdx.z"  # type: ignore[attr-defined]
    check_tf32_wgmma(f, out, a, b, f"batched tf32 wgmma, {stages} stages")


def test_symbolic_rows_with_a_fused_bias_and_relu() -> None:
    for m in (50, 129):
        f, out, a, b, bias = run_bias(m, 64, 72, symbolic=True, seed=m, arch="sm_90",
                                      plan=tf32_wgmma_plan((64, 64), 3))
        check_tf32_wgmma(f, out, a, b, f"tf32 wgmma M = {m}, bias + relu", bias=bias)


@pytest.mark.parametrize("case", ["nhwc_3x3_pad1", "nchw_3x3_pad1", "nhwc_c3", "nhwc_groups2"])
def test_float32_convolutions_on_the_tf32_wgmma(case: str) -> None:
    """Implicit GEMMs (tests/test_conv.py's cases) through the same matcher: NHWC puts the
    filter's [k][f] tile in registers (Cᵀ form), NCHW the activations' [k][pixel] tile; the
    padding where(), C = 3 (guarded element loads) and groups as on the fp16 path."""
    f = run_conv_case(case, tf32_wgmma_plan((64, 64), 3), f"tf32 wgmma {case}", arch="sm_90")
    assert wgmmas(f) and all(w.row.input_type == "tf32" for w in wgmmas(f))


# ---- the warp-specialized TMA ring ----------------------------------------------------------------------

@pytest.mark.parametrize("a_t,b_t", [(False, True), (False, False), (True, True)])
def test_the_tma_ring_in_every_servable_orientation(a_t: bool, b_t: bool) -> None:
    """The producer warpgroup's TMA boxes (128B swizzle of 4-byte elements: K-major tiles as one
    box of (rows, 32), a register-loaded X as boxes of (32 k, 32 floats)), edges zero-filled by the
    tensor map, two consumer warpgroups, a ring that wraps."""
    m, n, k = 132, 120, 200   # every row a multiple of 16 bytes (a tensor map's stride), in each orientation
    f, out, a, b = run(m, n, k, a_t=a_t, b_t=b_t, seed=13, arch="sm_90",
                       plan=tf32_wgmma_plan((128, 128), 3, 2, producer="tma"))
    assert "TMA producer warpgroup" in dict(f.module.kernels[0].attrs)["tensorize"]
    check_tf32_wgmma(f, out, a, b, f"tf32 wgmma TMA a_t={a_t} b_t={b_t}")


def test_the_tma_ring_batched_with_an_epilogue() -> None:
    f, out, a, b, bias = run_bias(70, 64, 100, batch=2, seed=4, arch="sm_90",
                                  plan=tf32_wgmma_plan((64, 64), 2, 1, producer="tma"))
    check_tf32_wgmma(f, out, a, b, "batched tf32 wgmma TMA, bias + relu", bias=bias)


# ---- the strategy ------------------------------------------------------------------------------------

def _info(a_t: bool = False, b_t: bool = False, size: int = 4096) -> Any:
    return analyze_kernel(lower(contraction(size, size, size, a_t=a_t, b_t=b_t)).kernels[0])


@pytest.mark.parametrize("a_t,b_t", [(False, False), (False, True), (True, True)])
def test_sm_90_with_tf32_allowed_plans_tf32_wgmma_and_sm_80_keeps_mma_sync(a_t: bool, b_t: bool) -> None:
    info = _info(a_t, b_t)
    h200 = tc.target("sm_90").replace(name="H200", dram_bandwidth=4.8e12, allow_tf32=True)
    cands, _ = candidates_for(info, h200)
    best = min((c for c in cands if c.ok), key=lambda c: (c.cost.total, -c.strategy.priority))
    assert best.strategy.name == "gemm_wgmma_tf32", best.label
    assert "wgmma.m64n" in best.label and "k8" in " ".join(best.workload.notes)
    cands, declined = candidates_for(info, tc.target("sm_80").replace(allow_tf32=True))
    best = min((c for c in cands if c.ok), key=lambda c: c.cost.total)
    assert best.strategy.name == "gemm_tensor_core_tf32"
    assert any(name == "gemm_wgmma_tf32" and "no wgmma" in why for name, why in declined)
    # without the opt-in, neither TF32 strategy is offered
    _, declined = candidates_for(info, tc.target("sm_90"))
    assert any(name == "gemm_wgmma_tf32" and "allow_tf32=True" in why for name, why in declined)


def test_tf32_wgmma_is_priced_at_the_tf32_peak_half_the_16_bit_one() -> None:
    """The same point costs twice the tensor time of the fp16 wgmma's (its rate is the table's
    dense TF32 peak, half the fp16 one), and both-k-outermost operands are declined by reason."""
    target = tc.target("sm_90").replace(allow_tf32=True)
    cands, _ = candidates_for(_info(b_t=True), target)
    tf32 = next(c for c in cands if c.strategy.name == "gemm_wgmma_tf32")
    assert tf32.workload.tensor_rate == pytest.approx(target.tensor_flops["tf32"] * 0.8)
    assert target.tensor_flops["tf32"] == pytest.approx(target.tensor_flops["float16"] / 2, rel=1e-3)
    _, declined = candidates_for(_info(a_t=True), target)
    assert any(name == "gemm_wgmma_tf32" and "K-major only" in why for name, why in declined)


def test_auto_plan_explains_the_tf32_wgmma_strategy() -> None:
    """build(plan="auto", allow_tf32=True) for sm_90 (built for the emulator, not run: 1024³)."""
    f = tc.build(contraction(1024, 1024, 1024), target="sim", arch="sm_90", allow_tf32=True)
    assert f.plan.strategy == "gemm_wgmma_tf32", f.plan.reason
    text = f.explain()
    assert "gemm_wgmma_tf32" in text and "wgmma.m64n" in text and "Cᵀ = Bᵀ·Aᵀ" in text, text


# ---- CUDA and ptxas ------------------------------------------------------------------------------------

@needs_nvrtc
@pytest.mark.parametrize("a_t,b_t,block,groups,stages", [
    (False, False, (128, 128), 2, 4), (False, False, (256, 128), 2, 3), (False, True, (128, 256), 2, 4),
    (True, True, (128, 128), 2, 4)])
def test_the_4096_kernels_compile_for_sm_90a_without_spills_or_serialization(
        a_t: bool, b_t: bool, block: tuple[int, int], groups: int, stages: int) -> None:
    f = tc.build(contraction(4096, 4096, 4096, a_t=a_t, b_t=b_t), target="cuda", arch="sm_90",
                 plan=tf32_wgmma_plan(block, stages, groups))
    (r,) = f.resources.values()
    assert f.arch == "sm_90a"
    assert (r.spill_stores, r.spill_loads, r.stack_bytes) == (0, 0, 0), r
    assert r.registers <= 255, r
    assert wgmma_serialized(f.compile_log) is None, f.compile_log        # no C7515
    src = f.source
    assert "wgmma.mma_async.sync.aligned.m64n" in src and "k8.f32.tf32.tf32" in src
    assert ", scale_d, 1, 1;" in src                                     # no transpose immediates
    if not b_t or a_t:
        assert "cvt.rna.tf32.f32 ta0" in src                             # the register operand


@needs_nvrtc
@pytest.mark.parametrize("a_t,b_t,block", [(False, False, (256, 128)), (False, True, (128, 256)),
                                           (True, True, (128, 128))])
def test_the_4096_tma_kernels_compile_for_sm_90a_without_spills_or_serialization(
        a_t: bool, b_t: bool, block: tuple[int, int]) -> None:
    f = tc.build(contraction(4096, 4096, 4096, a_t=a_t, b_t=b_t), target="cuda", arch="sm_90",
                 plan=tf32_wgmma_plan(block, 4, 2, producer="tma"))
    (r,) = f.resources.values()
    assert (r.spill_stores, r.spill_loads, r.stack_bytes) == (0, 0, 0), r
    assert r.registers == 168, r          # __launch_bounds__(384) with setmaxnreg: the cap
    assert wgmma_serialized(f.compile_log) is None, f.compile_log
    assert "setmaxnreg' ignored" not in f.compile_log, f.compile_log
