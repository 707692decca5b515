"""tensorize's wgmma path and the gemm_wgmma strategy: half-precision contractions on Hopper's
warpgroup tensor cores, in the emulator (which executes wgmma through the same descriptors and
accumulator maps as codegen, and reports a refill of a stage an in-flight wgmma still reads),
against NumPy float64 under tests/test_tensorize.py's bound: exact products, float32 sums, so
within (K + 1)·2⁻²⁴·Σ|a·b|, plus one rounding per 16-bit output or epilogue operation. Inputs
are fresh random values, outputs start as NaN. NVRTC checks compile the kernels for sm_90a.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
from test_tensorize import check, contraction, run

import tecc as tc
from tecc.codegen import dynamic_shared_bytes
from tecc.compiler.cost.analysis import analyze_kernel
from tecc.compiler.pipeline import wgmma_serialized
from tecc.compiler.planner import candidates_for
from tecc.ir.errors import RaceError, ScheduleError
from tecc.ir.stmt import AsyncCopy, MatrixLoad, MatrixMultiply, WarpgroupMatrixMultiply, iter_stmts
from tecc.passes.lower import lower
from tecc.runtime.sim import simulate_kernel
from nvrtc_checks import needs_nvrtc, nvrtc_available
from tensor_core_steps import schedule_tensor_core, tensorized


def wgmma_plan(block: tuple[int, int] = (64, 64), stages: int = 3, intrinsic: str = "wgmma") -> dict[str, Any]:
    return {"strategy": "manual", "reason": "test", "steps": [
        {"primitive": "tensorize", "args": {"stage": "C", "intrinsic": intrinsic, "block": list(block),
                                            "warps": [4 * block[0] // 64, 1], "k_tile": 64, "stages": stages}}]}


def wgmma_count(f: Any) -> int:
    return sum(isinstance(s, WarpgroupMatrixMultiply) for s in iter_stmts(f.module.kernels[0].body))





# ---- the kernel in the emulator ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("a_t,b_t", [(False, False), (True, False), (False, True), (True, True)])
def test_every_operand_orientation_matches_numpy(dtype: str, a_t: bool, b_t: bool) -> None:
    """A as [i, k] (K-major) or [k, i] (MN-major, wgmma's transposed A), B as [k, j] (MN-major)
    or [j, k] (K-major); sizes no multiple of any tile, three k tiles through a 3-stage ring."""
    m, n, k = 72, 136, 168
    tensors, how = contraction(m, n, k, dtype, a_t=a_t, b_t=b_t)
    f, arrays = run(tensors, how, m, n, k, seed=3, plan=wgmma_plan((64, 128), 3))
    body = list(iter_stmts(f.module.kernels[0].body))
    assert any(isinstance(s, WarpgroupMatrixMultiply) for s in body)
    assert not any(isinstance(s, (MatrixLoad, MatrixMultiply)) for s in body)  # no ldmatrix, no mma.sync
    check(arrays, how, f"wgmma {dtype} a_t={a_t} b_t={b_t} {m}x{n}x{k}")


@pytest.mark.parametrize("m,n,k,block", [(72, 136, 40, (64, 64)), (130, 72, 8, (128, 64)), (64, 64, 15, (64, 64)),
                                         (33, 200, 130, (128, 256))])
def test_sizes_that_are_no_multiple_of_any_tile(m: int, n: int, k: int, block: tuple[int, int]) -> None:
    """Edges in M, N and K are zero-filled by the copies' predicates and guarded in the epilogue;
    K < 16 (one partial k16 step), odd K (element loads of the k-contiguous A through registers,
    ordinary stores the proxy fence publishes to wgmma), K = 130 (4-byte copies)."""
    tensors, how = contraction(m, n, k, "float16")
    f, arrays = run(tensors, how, m, n, k, seed=m + k, plan=wgmma_plan(block, 3))
    check(arrays, how, f"wgmma {m}x{n}x{k} block {block}")
    copied = {s.src.name for s in iter_stmts(f.module.kernels[0].body) if isinstance(s, AsyncCopy)}
    assert copied == ({"B"} if k % 2 else {"A", "B"})


@pytest.mark.parametrize("stages", [2, 3, 4, 5])
def test_every_ring_depth_is_race_free(stages: int) -> None:
    """Seven k tiles through rings of 2..5 stages (2: wait_group 0; deeper: one wgmma group in
    flight, the ring loading S - 2 tiles ahead); the emulator checks every refill."""
    m, n, k = 64, 64, 420
    tensors, how = contraction(m, n, k, "bfloat16", b_t=stages % 2 == 0)
    f, arrays = run(tensors, how, m, n, k, seed=stages, plan=wgmma_plan((64, 64), stages))
    check(arrays, how, f"{stages} stages")
    assert f"wait_group({1 if stages >= 3 else 0})" in str(f.module.kernels[0])


def test_a_ring_that_refills_a_stage_an_inflight_wgmma_reads_is_reported() -> None:
    """Loading S - 1 tiles ahead (as the mma.sync ring does) while one wgmma group stays in flight
    refills the stage the previous tile's wgmmas may still read: the emulator says so."""
    m, n, k = 64, 64, 256
    tensors, _ = contraction(m, n, k, "float16")
    kernel = lower(tensors).kernels[0]
    g = np.random.default_rng(0)
    a = g.standard_normal((m, k)).astype(np.float16)
    b = g.standard_normal((k, n)).astype(np.float16)
    c = np.full((m, n), np.nan, np.float32)
    unsafe = tensorized(kernel, "C", "wgmma", (64, 64), (4, 1), 64, 3, lookahead=2)
    with pytest.raises(RaceError, match="wgmma operand race"):
        simulate_kernel(unsafe, {"A": a, "B": b, "C": c}, (1, 1, 1), (128, 1, 1))
    safe = tensorized(kernel, "C", "wgmma", (64, 64), (4, 1), 64, 3)
    simulate_kernel(safe, {"A": a, "B": b, "C": c}, (1, 1, 1), (128, 1, 1))
    bound = (k + 1) * 2.0**-24 * (np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64)))
    assert (np.abs(c - a.astype(np.float64) @ b.astype(np.float64)) <= bound).all()


def test_element_loaded_stages_without_the_proxy_fence_are_reported() -> None:
    """Odd K: A's tile reaches shared memory by ordinary stores, which wgmma (the async proxy)
    sees only after fence.proxy.async; the kernel without its fences is an unfenced read."""
    from tecc.ir.stmt import AsyncProxyFence, Seq, Stmt
    from tecc.ir.visitor import StmtMutator

    class DropProxyFences(StmtMutator):
        def visit_Seq(self, s: Seq) -> Stmt:
            kept = tuple(self.visit(x) for x in s.stmts if not isinstance(x, AsyncProxyFence))
            return Seq(kept)

    m, n, k = 64, 64, 135
    tensors, _ = contraction(m, n, k, "float16")
    func = tensorized(lower(tensors).kernels[0], "C", "wgmma", (64, 64), (4, 1), 64, 3)
    g = np.random.default_rng(1)
    args = {"A": g.standard_normal((m, k)).astype(np.float16), "B": g.standard_normal((k, n)).astype(np.float16),
            "C": np.full((m, n), np.nan, np.float32)}
    simulate_kernel(func, args, (1, 1, 1), (128, 1, 1))
    with pytest.raises(RaceError, match="fence.proxy.async"):
        simulate_kernel(DropProxyFences().visit_func(func), args, (1, 1, 1), (128, 1, 1))


def test_batched_contraction_on_two_warpgroups() -> None:
    bt, m, n, k = 3, 100, 72, 96
    tensors, how = contraction(m, n, k, "bfloat16", batch=bt, a_t=True)
    f, arrays = run(tensors, how, m, n, k, batch=bt, seed=5, plan=wgmma_plan((128, 64), 4))
    assert f.module.kernels[0].body.kind == "blockIdx.z"  # type: ignore[attr-defined]
    check(arrays, how, "batched wgmma")


def test_symbolic_rows() -> None:
    M = tc.var("M")
    tensors, how = contraction(M, 64, 80, "float16", b_t=True)
    for m in (50, 129):
        f, arrays = run(tensors, how, m, 64, 80, seed=m, sizes={"M": 512}, plan=wgmma_plan((64, 64), 3))
        check(arrays, how, f"wgmma M = {m}")
        assert wgmma_count(f) == 1


def test_fp16_output_with_a_fused_bias_and_relu() -> None:
    m, n, k = 72, 80, 72
    tensors, how = contraction(m, n, k, "float16", out="float16",
                               epilogue=lambda acc, bias: tc.maximum(acc + bias, tc.const(0.0, "float16")))
    _, arrays = run(tensors, how, m, n, k, seed=7, plan=wgmma_plan((64, 128), 3))
    check(arrays, how, "wgmma bias + relu", epilogue=lambda x, bias: np.maximum(x + bias, 0.0))


def test_bfloat16_output_cast() -> None:
    m, n, k = 64, 64, 64
    tensors, how = contraction(m, n, k, "bfloat16", out="bfloat16")
    _, arrays = run(tensors, how, m, n, k, seed=8, plan=wgmma_plan((64, 64), 2))
    check(arrays, how, "wgmma bf16 output")


def test_refusals_name_the_condition() -> None:
    tensors, _ = contraction(128, 128, 128, "float16")
    kernel = lower(tensors).kernels[0]
    bad = [
        (((64, 64), (4, 1), 32, 3), "k_tile must be 64"),
        (((96, 64), (4, 1), 64, 3), "block rows"),
        (((128, 64), (4, 1), 64, 3), r"warps must be \(8, 1\)"),
        (((64, 96), (4, 1), 64, 3), "block columns"),
        (((64, 64), (4, 1), 64, 9), "stages must be 2..8"),
    ]
    for (block, warps, k_tile, stages), message in bad:
        with pytest.raises(ScheduleError, match=message):
            tensorized(kernel, "C", "wgmma", block, warps, k_tile, stages)
    with pytest.raises(ScheduleError, match="wgmma.m64n64k16.f32.f16"):
        tensorized(kernel, "C", "wgmma.m64n128k16.f32.f16", (64, 64), (4, 1), 64, 3)
    with pytest.raises(ScheduleError, match="wgmma.m64n64k16.f32.f16"):
        tensorized(kernel, "C", "wgmma.m64n64k16.f32.bf16", (64, 64), (4, 1), 64, 3)


# ---- the strategy -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_sm_90_plans_wgmma_for_a_4096_cube_and_sm_80_keeps_mma_sync(dtype: str) -> None:
    tensors, _ = contraction(4096, 4096, 4096, dtype, out=dtype)
    info = analyze_kernel(lower(tensors).kernels[0])
    # the H100 table, and an H200 (the same SMs and clock, 4.8 TB/s of HBM3e, 141 GB)
    h200 = tc.target("sm_90").replace(name="H200", dram_bandwidth=4.8e12)
    chosen = {}
    for target in (h200, tc.target("sm_90")):
        cands, _ = candidates_for(info, target)
        best = min((c for c in cands if c.ok), key=lambda c: (c.cost.total, -c.strategy.priority))
        assert best.strategy.name == "gemm_wgmma", (target.name, best.label)
        assert "wgmma.m64n" in best.label
        chosen[target.name] = best.label
        # both rungs are offered for a plain GEMM
        for rung in ("rung: wgmma + cp.async ring, 128B swizzle", "rung: wgmma + TMA + mbarrier ring, warp-specialized"):
            assert any(rung in c.label for c in cands if c.ok), rung
    # where the tensor pipe, not L2, bounds the time, the TMA ring's shorter chain ranks it first
    # (on the H100 table both rungs tie on the L2 term and the stable order keeps cp.async)
    assert "rung: wgmma + TMA + mbarrier ring" in chosen["H200"], chosen
    wgmma = [c for c in cands if c.strategy.name == "gemm_wgmma" and c.ok]
    mma = [c for c in cands if c.strategy.name == "gemm_tensor_core" and c.ok]
    # the same traffic, a faster tensor pipe and no ldmatrix: never predicted slower
    assert min(c.cost.terms["tensor"] for c in wgmma) < min(c.cost.terms["tensor"] for c in mma)
    assert min(c.cost.total for c in wgmma) <= min(c.cost.total for c in mma)
    for arch in ("sm_80", "sm_89"):
        cands, declined = candidates_for(info, tc.target(arch))
        assert all(c.strategy.name != "gemm_wgmma" for c in cands)
        assert any(name == "gemm_wgmma" and "no wgmma" in why for name, why in declined)


def test_the_space_fits_the_opt_in_shared_memory_and_names_the_design_point() -> None:
    from tecc.compiler.strategies.gemm_wgmma import GemmWgmma, shared_bytes

    tensors, _ = contraction(4096, 4096, 4096, "float16")
    info = analyze_kernel(lower(tensors).kernels[0])
    sm90 = tc.target("sm_90")
    points = list(GemmWgmma().space(info, sm90))
    rungs = [{x: p[x] for x in ("bm", "bn", "stages", "load")} for p in points]   # TMA points: also epilogue, grid
    for load in ("cp.async", "tma"):
        assert {"bm": 128, "bn": 256, "stages": 4, "load": load} in rungs
        assert {"bm": 128, "bn": 256, "stages": 5, "load": load} not in rungs  # 241 KiB: over the 227 KiB opt-in
    assert {(p["bm"], p["bn"]) for p in points} == {(bm, bn) for bm in (64, 128) for bn in (64, 128, 192, 256)}
    assert all(p["load"] == "tma" for p in points if p["bn"] == 192), "192-wide tiles on the TMA ring only"
    assert all(shared_bytes(p, 4) <= sm90.smem_per_block_optin for p in points)


@pytest.mark.parametrize("out", ["float32", "float16"])
def test_the_planners_shared_memory_count_is_the_kernels(out: str) -> None:
    """gemm_wgmma.shared_bytes (what the space holds to the opt-in limit and occupancy reads) is
    the dynamic shared memory of the point's kernel, byte for byte: with descriptors every
    shared buffer starts on 1024 bytes, so the TMA ring's two mbarrier arrays take a slot each
    (counted as 2 x 8 x stages bytes, 2 KiB short, before)."""
    from tecc.compiler.strategies.gemm_tensor_core import staged_output_bytes
    from tecc.compiler.strategies.gemm_wgmma import GemmWgmma, shared_bytes

    tensors, _ = contraction(1024, 512, 2048, "float16", out=out)
    info = analyze_kernel(lower(tensors).kernels[0])
    points = [dict(bm=128, bn=256, stages=3, load="tma", split=2, epilogue="tma", persistent=132),
              dict(bm=128, bn=128, stages=4, load="tma", epilogue="tma", persistent=0),
              dict(bm=64, bn=128, stages=5, load="tma", epilogue="registers", persistent=132, split=4),
              dict(bm=128, bn=128, stages=3, load="cp.async", split=2),
              dict(bm=128, bn=64, stages=4, load="cp.async", staged_output=True)]
    for point in points:
        sch = tc.Schedule(tensors)
        GemmWgmma().apply(sch, info, point)
        itemsize = info.write.itemsize
        assert shared_bytes(point, itemsize) + staged_output_bytes(point, itemsize) == \
            dynamic_shared_bytes(sch.mod.kernels[0]), point


def test_auto_plan_builds_and_explains_the_wgmma_rung() -> None:
    """build(plan="auto") for sm_90 takes gemm_wgmma, compiles it for sm_90a (compile-checked)
    and explain names the intrinsic and the rung."""
    if not nvrtc_available():
        pytest.skip("NVRTC is not available")
    tensors, _ = contraction(4096, 4096, 4096, "float16", out="float16")
    f = tc.build(tensors, target="cuda", arch="sm_90")
    assert f.plan.strategy == "gemm_wgmma", f.plan.reason
    assert f.arch == "sm_90a"
    (r,) = f.resources.values()
    assert (r.spill_stores, r.spill_loads, r.stack_bytes) == (0, 0, 0), r
    chosen = f.planning.kernels[0].chosen
    assert r.registers <= chosen.workload.register_count, (r.registers, chosen.workload.registers)
    assert wgmma_serialized(f.compile_log) is None, f.compile_log
    text = f.explain()
    rung = ("wgmma + TMA + mbarrier ring, warp-specialized" if chosen.point.get("load") == "tma"
            else "wgmma + cp.async ring, 128B swizzle")
    assert "wgmma.m64n256k16" in text and rung in text


# ---- codegen and NVRTC ------------------------------------------------------------------------------

def test_generated_cuda_has_the_ring_fences_and_descriptors() -> None:
    """Structure of the CUDA of the design point: 128 x 256 on 2 warpgroups, 4 stages (193 KiB of
    dynamic shared memory, its start rounded up to 1024 bytes in the kernel), one proxy fence and
    one barrier per k tile, wgmma.wait_group 1 in the loop and 0 before the epilogue."""
    tensors, _ = contraction(4096, 4096, 4096, "float16", out="float16")
    sch = tc.Schedule(tensors)
    schedule_tensor_core(sch, "C", intrinsic="wgmma", block=(128, 256), warps=(8, 1), k_tile=64, stages=4)
    func = sch.mod.kernels[0]
    source = tc.build(sch, target="sim").source
    assert dynamic_shared_bytes(func) == 4 * (128 + 256) * 64 * 2 + 1024
    assert "needs the architecture-specific target" in source
    assert "__launch_bounds__(256)" in source
    assert "& 1023u" in source  # the dynamic allocation's start rounded up to 1024 bytes
    for text, count in (("wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16", 1), ("fence.proxy.async.shared::cta", 1),
                        ("wgmma.fence.sync.aligned", 1), ("wgmma.commit_group.sync.aligned", 1),
                        ("wgmma.wait_group.sync.aligned 1", 1), ("wgmma.wait_group.sync.aligned 0", 1),
                        ("cp.async.wait_group 1", 1), ("__syncthreads()", 1), ("ldmatrix", 0), ("mma.sync", 0)):
        assert source.count(text) == count, (text, source.count(text))
    # the k16 steps' wgmma is one unrolled statement; A K-major (no transpose), B MN-major (transposed)
    assert re.search(r"scale_d, 1, 1, 0, 1;", source)


@needs_nvrtc
@pytest.mark.parametrize("dtype,a_t,b_t,block,stages", [
    ("float16", False, False, (128, 256), 4), ("bfloat16", True, True, (128, 128), 4),
    ("float16", False, True, (64, 256), 3), ("bfloat16", True, False, (64, 128), 5), ("float16", False, False, (64, 64), 2)])
def test_configurations_compile_for_sm_90a_without_spills(dtype: str, a_t: bool, b_t: bool, block: tuple[int, int],
                                                          stages: int) -> None:
    from tecc.compiler.strategies.gemm_wgmma import wgmma_registers

    tensors, _ = contraction(4096, 4096, 4096, dtype, out=dtype, a_t=a_t, b_t=b_t)
    sch = tc.Schedule(tensors)
    schedule_tensor_core(sch, "C", intrinsic="wgmma", block=block, warps=(4 * block[0] // 64, 1), k_tile=64, stages=stages)
    f = tc.build(sch, target="cuda", arch="sm_90")
    (r,) = f.resources.values()
    assert f.arch == "sm_90a"
    assert (r.spill_stores, r.spill_loads, r.stack_bytes) == (0, 0, 0), r
    assert r.registers <= sum(wgmma_registers(*block).values()), r.registers
    assert wgmma_serialized(f.compile_log) is None, f.compile_log
    assert f"wgmma.mma_async.sync.aligned.m64n{block[1]}k16" in f.ptx


@needs_nvrtc
def test_a_wgmma_kernel_built_for_ampere_is_a_clear_compile_error() -> None:
    from tecc.ir.errors import CompileError

    tensors, _ = contraction(128, 128, 128, "float16")
    sch = tc.Schedule(tensors)
    schedule_tensor_core(sch, "C", intrinsic="wgmma", block=(64, 64), warps=(4, 1), k_tile=64, stages=3)
    with pytest.raises(CompileError, match="only sm_90a has"):
        tc.build(sch, target="cuda", arch="sm_80")


def test_a_serialized_wgmma_warning_is_recognized() -> None:
    log = ("ptxas info    : Compiling entry function 'C_kernel' for 'sm_90a'\n"
           "ptxas /tmp/x.ptx, line 9; warning : Potential Performance Loss: wgmma.mma_async instructions are "
           "serialized due to the presence of Extern calls in the function 'C_kernel'.\n")
    assert wgmma_serialized(log) is not None and "serialized" in wgmma_serialized(log)  # type: ignore[operator]
    assert wgmma_serialized("ptxas info    : Used 166 registers, used 1 barriers") is None
