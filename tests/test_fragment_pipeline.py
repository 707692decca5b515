"""The pipelined mma.sync mainloop (pipeline_fragments): two fragment sets, the next k step's
ldmatrix before this step's mma, the ring's wait and barrier before the last k step of a tile.

Every kernel runs in the emulator, which executes cp.async, ldmatrix and mma per the PTX ISA and
reports a read of a ring stage before its wait, a refill of a stage some warp still reads, and an
uninitialized read; results are compared with NumPy in float64 under the bounds of
tests/test_tensorize.py (half operands) and tests/test_tf32.py (tf32).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import tecc as tc
from tecc.codegen import compile_cuda, emit_source
from tecc.ir.stmt import AsyncCopy, AsyncWait, Barrier, For, MatrixLoad, MatrixMultiply, iter_stmts
from test_tensorize import check, contraction, run

import test_tf32
from tensor_core_steps import schedule_tensor_core


def pipelined_plan(block: tuple[int, int] = (64, 64), warps: tuple[int, int] = (2, 2), k_tile: int = 32,
                   stages: int = 3, intrinsic: str = "auto") -> dict[str, Any]:
    return {"strategy": "manual", "reason": "test", "steps": [
        {"primitive": "tensorize", "args": {"stage": "C", "intrinsic": intrinsic, "block": list(block),
                                            "warps": list(warps), "k_tile": k_tile, "stages": stages,
                                            "fragment_pipeline": True}}]}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("a_t,b_t", [(False, False), (True, False), (False, True), (True, True)])
def test_every_operand_orientation_matches_numpy(dtype: str, a_t: bool, b_t: bool) -> None:
    m, n, k = 64, 64, 160   # 5 k tiles through a 3-stage ring: every stage is refilled
    tensors, how = contraction(m, n, k, dtype, a_t=a_t, b_t=b_t)
    _, arrays = run(tensors, how, m, n, k, seed=3, plan=pipelined_plan())
    check(arrays, how, f"pipelined {dtype} a_t={a_t} b_t={b_t}")


@pytest.mark.parametrize("stages,k_tile,block,warps", [(2, 32, (64, 64), (2, 2)), (4, 32, (64, 128), (2, 2)),
                                                       (3, 64, (128, 64), (4, 2)), (4, 64, (64, 64), (1, 4))])
def test_every_ring_depth_and_tile_is_race_free(stages: int, k_tile: int, block: tuple[int, int],
                                                warps: tuple[int, int]) -> None:
    m, n, k = 96, 80, 424  # 7-14 k tiles, the last one partial
    tensors, how = contraction(m, n, k, "float16", b_t=True)
    _, arrays = run(tensors, how, m, n, k, seed=stages, plan=pipelined_plan(block, warps, k_tile, stages))
    check(arrays, how, f"pipelined stages {stages} k_tile {k_tile} block {block} warps {warps}")


@pytest.mark.parametrize("m,n,k,stages", [(33, 17, 9, 3), (16, 8, 1, 4), (72, 40, 24, 2), (48, 56, 40, 4),
                                          (40, 24, 96, 3), (40, 24, 128, 4)])
def test_fewer_k_tiles_than_stages_and_k_below_16(m: int, n: int, k: int, stages: int) -> None:
    """K < 16, K not a multiple of the tile, and K of exactly S - 1 or S tiles: the next tile's
    fragment loads must not read a stage no copy wrote (the emulator's uninitialized read)."""
    tensors, how = contraction(m, n, k, "float16")
    _, arrays = run(tensors, how, m, n, k, seed=m + k, plan=pipelined_plan(stages=stages))
    check(arrays, how, f"pipelined {m}x{n}x{k} stages {stages}")


def test_element_loaded_operands_are_fetched_early_and_stored_after_the_barrier() -> None:
    """Odd K: A's tile elements go through registers (fetched at the top of a tile, stored to the
    freed stage after the barrier), B's through cp.async, in a 4-stage ring of 7 tiles."""
    m, n, k = 64, 64, 201
    tensors, how = contraction(m, n, k, "bfloat16")
    f, arrays = run(tensors, how, m, n, k, seed=9, plan=pipelined_plan(stages=4))
    check(arrays, how, "pipelined odd K")
    assert {s.src.name for s in iter_stmts(f.module.kernels[0].body) if isinstance(s, AsyncCopy)} == {"B"}


def test_symbolic_k_guards_the_prologue_and_the_next_tiles_loads() -> None:
    K = tc.var("K")
    A, B = tc.placeholder((48, K), "float16", "A"), tc.placeholder((K, 40), "float16", "B")
    r = tc.reduce_axis(K, "r")
    C = tc.compute((48, 40), lambda i, j: tc.sum(tc.cast(A[i, r], "float32") * tc.cast(B[r, j], "float32"), axis=r),
                   name="C")
    how = {"a_t": False, "b_t": False, "dtype": "float16", "out": "float32", "epilogue": False}
    for k in (5, 100):
        _, arrays = run([A, B, C], how, 48, 40, k, seed=k, plan=pipelined_plan(stages=3))
        check(arrays, how, f"pipelined K = {k}")


def test_batched_with_a_fused_bias_relu_and_a_staged_output() -> None:
    b, m, n, k = 2, 72, 48, 96
    tensors, how = contraction(m, n, k, "float16", out="float16", batch=b,
                               epilogue=lambda acc, bias: tc.maximum(acc + bias, tc.const(0.0, "float16")))
    plan = pipelined_plan()
    plan["steps"][0]["args"]["staged_output"] = True
    f, arrays = run(tensors, how, m, n, k, batch=b, seed=11, plan=plan)
    check(arrays, how, "pipelined batched bias + relu, staged output", epilogue=lambda x, bias: np.maximum(x + bias, 0))
    assert f.module.kernels[0].body.kind == "blockIdx.z"  # type: ignore[attr-defined]


@pytest.mark.parametrize("a_t,b_t", [(False, False), (True, True)])
def test_tf32_shares_the_pipelined_loop(a_t: bool, b_t: bool) -> None:
    """The m16n8k8 form: ldmatrix of b16 pairs (k-contiguous tiles) or 32-bit loads (k-major ones)."""
    p = pipelined_plan(k_tile=16, intrinsic=test_tf32.TF32)
    _, out, a, b = test_tf32.run(40, 72, 88, a_t=a_t, b_t=b_t, seed=5, plan=p)
    test_tf32.check_tf32(out, a, b, f"tf32 pipelined a_t={a_t} b_t={b_t}")


def test_the_loop_has_its_wait_and_barrier_before_the_last_k_step() -> None:
    """The k-tile loop's body: the k steps but the last (each: fragment loads of the next step,
    then this step's mma), then the ring's wait and barrier, the refill, the next tile's first
    fragments, the last step's mma; plan, dump summary and explain() name the form."""
    tensors, _ = contraction(256, 256, 256, "float16")
    sch = tc.Schedule(tensors)
    schedule_tensor_core(sch, "C", block=(128, 128), warps=(2, 2), k_tile=64, stages=3, fragment_pipeline=True)
    assert [s.primitive for s in sch.plan.steps][-2:] == ["pipeline", "pipeline_fragments"]
    func = sch.mod.kernels[0]
    assert "fragment_pipeline" in dict(func.attrs)["tensorize"]
    (loop,) = [s for s in iter_stmts(func.body) if isinstance(s, For) and s.var.name == "k_tile"]
    order = [getattr(s, "dispatch_name", type(s).__name__) for s in iter_stmts(loop.body)  # AsyncWait: an instruction
             if isinstance(s, (AsyncWait, Barrier, AsyncCopy, MatrixLoad, MatrixMultiply))]
    # collapse runs: the 3 inner steps (unrolled loops appear once each) then the last step
    runs = [name for i, name in enumerate(order) if i == 0 or order[i - 1] != name]
    assert runs == ["MatrixLoad", "MatrixMultiply", "AsyncWait", "Barrier", "AsyncCopy", "MatrixLoad",
                    "MatrixMultiply"], runs
    plain = tc.Schedule(tensors)
    schedule_tensor_core(plain, "C", block=(128, 128), warps=(2, 2), k_tile=64, stages=3)
    assert "pipeline_fragments" not in [s.primitive for s in plain.plan.steps]


@pytest.mark.parametrize("pipelined", [False, True])
@pytest.mark.parametrize("m,n,batch,group_m", [(300, 200, 0, 2), (130, 520, 2, 2), (200, 70, 0, 8)])
def test_the_grouped_block_order_covers_every_tile_once(pipelined: bool, m: int, n: int, batch: int,
                                                        group_m: int) -> None:
    """group_m: one blockIdx.x over the tiles in groups of group_m row tiles (the last group
    shorter, or the only one); every output element is written (the output starts as NaN)."""
    k = 72
    tensors, how = contraction(m, n, k, "float16", batch=batch)
    plan = pipelined_plan()
    plan["steps"][0]["args"]["group_m"] = group_m
    if not pipelined:
        del plan["steps"][0]["args"]["fragment_pipeline"]
    f, arrays = run(tensors, how, m, n, k, batch=batch, seed=m + n, plan=plan)
    check(arrays, how, f"grouped order {group_m}, pipelined {pipelined}")
    grid = [s for s in iter_stmts(f.module.kernels[0].body) if isinstance(s, For) and s.kind.startswith("blockIdx")]
    assert [s.kind for s in grid] == (["blockIdx.z"] if batch else []) + ["blockIdx.x"]
    assert f"group_m {group_m}" in dict(f.module.kernels[0].attrs)["tensorize"]


def test_refusals_name_the_condition() -> None:
    tensors, _ = contraction(64, 64, 64, "float16")
    with pytest.raises(tc.ScheduleError, match="even number"):
        schedule_tensor_core(tc.Schedule(tensors), "C", k_tile=16, fragment_pipeline=True)
    with pytest.raises(tc.ScheduleError, match="pipeline_fragments is a form of the mma.sync mainloop"):
        schedule_tensor_core(tc.Schedule(tensors), "C", intrinsic="wgmma", block=(128, 128), warps=(8, 1), k_tile=64, stages=3,
                                       fragment_pipeline=True)
    with pytest.raises(tc.ScheduleError, match="tile_order orders the blocks of the mma.sync kernel"):
        schedule_tensor_core(tc.Schedule(tensors), "C", intrinsic="wgmma", block=(128, 128), warps=(8, 1), k_tile=64, stages=3,
                                       group_m=8)
    with pytest.raises(tc.ScheduleError, match="group_m"):
        schedule_tensor_core(tc.Schedule(tensors), "C", group_m=-1)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_the_4096_cubed_best_point_compiles_without_spills(arch: str) -> None:
    """Block 128x128, 2x2 warps of 64x64, k-tile 32, 4 stages: 128 accumulators and two sets of
    32 fragment registers fit in 255 (ptxas: 248 on sm_80, 250 on sm_90)."""
    from tecc.compiler.strategies.gemm_tensor_core import tile_registers

    tensors, _ = contraction(4096, 4096, 4096, "float16", out="float16")
    sch = tc.Schedule(tensors)
    schedule_tensor_core(sch, "C", block=(128, 128), warps=(2, 2), k_tile=32, stages=4, fragment_pipeline=True)
    func = sch.mod.kernels[0]
    compiled = compile_cuda(emit_source([func]), arch=arch, name=func.name)
    res = compiled.resources[func.name]
    assert (res.spill_stores, res.spill_loads, res.stack_bytes) == (0, 0, 0), f"{arch}: {res}"
    assert res.registers <= sum(tile_registers(128, 128, 2, 2, 32, pipelined=True).values()) <= 255
    assert compiled.ptx.count("cp.async.wait_group 2") == 1 and "cp.async.wait_group 3" in compiled.ptx


def test_the_strategy_offers_both_forms_and_prices_the_refill_the_pipeline_hides(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With `offer_pipelined` every point of gemm_tensor_core comes plain and pipelined (by
    default only plain: the pipelined form measured slower at the points the planner takes); the
    pipelined one counts two fragment sets and a shorter stall per k tile, and at 250 ptxas
    registers (rounded to 256 allocated) two blocks of 4 warps still fit per SM."""
    from tecc.compiler.cost.occupancy import occupancy
    from tecc.compiler.strategies.gemm_tensor_core import GemmTensorCore, sm_chain, tile_registers
    from tecc.ir.target import target as target_of

    tensors, _ = contraction(4096, 4096, 4096, "float16", out="float16")
    target = target_of("sm_90")
    assert not any(c.point.get("fragment_pipeline") for c in candidates_for(tensors, target))
    monkeypatch.setattr(GemmTensorCore, "offer_pipelined", True)
    kp = candidates_for(tensors, target)
    forms: dict[tuple[Any, ...], dict[bool, Any]] = {}
    for c in kp:
        key = tuple(sorted((k, v) for k, v in c.point.items() if k != "fragment_pipeline"))
        forms.setdefault(key, {})[bool(c.point.get("fragment_pipeline"))] = c
    assert forms and all(set(f) == {False, True} for f in forms.values())
    best = {"bm": 128, "bn": 128, "warps_m": 2, "warps_n": 2, "bk": 32, "stages": 4}
    pair = forms[tuple(sorted(best.items()))]
    plain, pipelined = pair[False], pair[True]
    assert pipelined.workload.register_count == sum(tile_registers(128, 128, 2, 2, 32, pipelined=True).values())
    assert pipelined.workload.registers["fragments"] == 2 * plain.workload.registers["fragments"]
    assert pipelined.cost.ok and pipelined.cost.occupancy.blocks_per_sm == 2, pipelined.cost.rejected
    assert pipelined.cost.total < plain.cost.total
    rate = 1e15
    chains = [sm_chain(target, rate, dict(best, fragment_pipeline=p), 1024, 128, 250) for p in (False, True)]
    assert chains[1][2] < chains[0][2]   # the tensor pipe idles less
    assert occupancy(target, 128, 256, 64 * 1024).blocks_per_sm == 2
    assert occupancy(target, 128, 264, 0).blocks_per_sm == 0
    assert GemmTensorCore().describe(dict(best, fragment_pipeline=True)).endswith("fragments pipelined)")


def candidates_for(tensors: list[tc.Tensor], target: Any) -> list[Any]:
    """gemm_tensor_core's candidates for the one kernel of `tensors` (every point, priced)."""
    from tecc.compiler.planner import plan_program

    (kp,) = plan_program(tensors, target.arch, keep=10_000).kernels
    return [c for c in kp.ranked + kp.rejected if c.strategy.name == "gemm_tensor_core"]


@pytest.mark.parametrize("case", ["nhwc_3x3_pad1", "nchw_odd_everything", "nhwc_c3", "bn_residual"])
def test_implicit_gemm_convolutions_take_the_pipelined_loop(case: str) -> None:
    """Gathered tiles (div/mod of the reduction index), guarded element loads (C = 3, NCHW) and a
    fused residual epilogue through the pipelined mainloop, against NumPy (tests/test_conv.py)."""
    from test_conv import CASES, tensorize_plan

    plan = tensorize_plan(stages=3)
    plan["steps"][0]["args"]["fragment_pipeline"] = True
    f, _ = CASES[case].run(plan=plan)
    assert "fragment_pipeline" in dict(f.module.kernels[-1].attrs).get("tensorize", ""), case
