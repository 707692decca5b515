"""Batched GEMMs whose epilogue reads operands that lack the batch axis (or other output axes):
`C[b, i, j] = Σ_k A[b, i, k] · W[b, k, j] + bias[j]` (torch.baddbmm), a per-row `bias[i]`, a
per-batch `scale[b]`, a per-batch-and-column `bias[b, j]`. Such a read is a broadcast operand of
the store, not a GEMM operand: the GEMM strategies take the stage (fp32 SIMT gemm_pipelined,
fp16/bf16 mma.sync and wgmma, TF32 when allowed) instead of leaving it to a generic reduction.

Every kernel runs in the emulator against NumPy in float64 on fresh random inputs with the
output poisoned (NaN), within the bound of tests/test_tensorize.py: exact or float32 products,
float32 sums within (K + 1)·2⁻²⁴·Σ|a·b|, plus one float32 rounding of the epilogue (and TF32's
rounding of each operand to 10 mantissa bits, 2⁻¹¹ relative, when the build allows TF32)."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest
from test_tensorize import np_dtype

import tecc as tc
from tecc.compiler.cost.analysis import analyze_kernel
from tecc.compiler.cost.model import predict
from tecc.compiler.planner import plan_program
from tecc.compiler.schedule import Schedule
from tecc.compiler.strategies import get
from tecc.ir.target import target as make_target
from tecc.passes.lower import lower

Reference = Callable[[np.ndarray, np.ndarray], np.ndarray]

# epilogue kind -> (operand shape from (batch, M, N), the expression, NumPy's broadcast of it)
EPILOGUES: dict[str, tuple[Callable[[Any, int, int], tuple[Any, ...]], Callable[..., Any], Reference]] = {
    "bias[j]": (lambda bt, m, n: (n,), lambda acc, e, b, i, j: acc + e[j], lambda x, e: x + e),
    "bias[i]": (lambda bt, m, n: (m,), lambda acc, e, b, i, j: acc + e[i], lambda x, e: x + e[:, None]),
    "scale[b]": (lambda bt, m, n: (bt,), lambda acc, e, b, i, j: acc * e[b], lambda x, e: x * e[:, None, None]),
    "bias[b,j]": (lambda bt, m, n: (bt, n), lambda acc, e, b, i, j: acc + e[b, j], lambda x, e: x + e[:, None, :]),
}


def batched(batch: Any, m: int, n: int, k: int, dtype: str, kind: str) -> list[tc.Tensor]:
    """C[b, i, j] = epilogue(Σ_k A[b, i, k] · W[b, k, j], E) in float32, E a float32 broadcast operand."""
    shape_of, expression, _ = EPILOGUES[kind]
    A = tc.placeholder((batch, m, k), dtype, name="A")
    W = tc.placeholder((batch, k, n), dtype, name="W")
    E = tc.placeholder(shape_of(batch, m, n), "float32", name="E")
    r = tc.reduce_axis(k, name="k")

    def body(b: Any, i: Any, j: Any) -> Any:
        acc = tc.sum(tc.cast(A[b, i, r], "float32") * tc.cast(W[b, r, j], "float32"), axis=r)
        return expression(acc, E, b, i, j)

    return [A, W, E, tc.compute((batch, m, n), body, name="C")]


def run_and_check(f: Any, batch: int, m: int, n: int, k: int, dtype: str, kind: str, seed: int,
                  tf32: bool = False) -> None:
    g = np.random.default_rng(seed)
    a = g.standard_normal((batch, m, k)).astype(np_dtype(dtype))
    w = g.standard_normal((batch, k, n)).astype(np_dtype(dtype))
    e = g.uniform(0.5, 2.0, EPILOGUES[kind][0](batch, m, n)).astype(np.float32)
    c = np.full((batch, m, n), np.nan, np.float32)
    f(a, w, e, c)
    a64, w64, e64 = a.astype(np.float64), w.astype(np.float64), e.astype(np.float64)
    exact = a64 @ w64
    size = np.abs(a64) @ np.abs(w64)
    bound = ((k + 1) * 2.0**-24 + (2 * 2.0**-11 if tf32 else 0.0)) * size
    reference = EPILOGUES[kind][2]
    want = reference(exact, e64)
    # the float32 epilogue: one rounding of its result, and the error of the sum scaled by it
    bound = np.abs(reference(bound, np.abs(e64)) - reference(np.zeros_like(bound), np.abs(e64))) \
        if kind == "scale[b]" else bound
    bound = bound + 2.0**-24 * (np.abs(want) + bound)
    err = np.where(np.isnan(c), np.inf, np.abs(c - want) - bound)
    if (err > 0).any():
        worst = np.unravel_index(int(np.argmax(err)), err.shape)
        raise AssertionError(f"{dtype} {kind} {batch}x{m}x{n}x{k} plan {f.plan.strategy}: {(err > 0).sum()} of "
                             f"{err.size} off; worst at {tuple(map(int, worst))}: got {c[worst]!r}, "
                             f"want {want[worst]!r} (bound {bound[worst]:.3g})")


def strategy_schedule(tensors: list[tc.Tensor], name: str, point: dict[str, Any],
                      sizes: dict[str, int] | None = None) -> Schedule:
    info = analyze_kernel(lower(tensors).kernels[0], sizes)
    assert get(name).guard(info, make_target("sm_90")) is None, get(name).guard(info, make_target("sm_90"))
    sch = Schedule(tensors)
    get(name).apply(sch, info, point)
    return sch


# ---- fp32: gemm_pipelined ---------------------------------------------------------------------------

@pytest.mark.parametrize("kind", sorted(EPILOGUES))
@pytest.mark.parametrize("shape,point", [
    ((3, 70, 130, 37), {"bm": 64, "bn": 64, "bk": 8}),       # no size a multiple of a tile, odd K
    ((2, 128, 96, 48), {"bm": 128, "bn": 32, "bk": 16}),
])
def test_gemm_pipelined_takes_a_batched_gemm_with_broadcast_epilogue_operands(
        kind: str, shape: tuple[int, int, int, int], point: dict[str, int]) -> None:
    batch, m, n, k = shape
    tensors = batched(batch, m, n, k, "float32", kind)
    sch = strategy_schedule(tensors, "gemm_pipelined", point)
    assert "blockIdx.z" in str(sch.mod)
    run_and_check(tc.build(sch, target="sim"), batch, m, n, k, "float32", kind, seed=m + n)


def test_gemm_pipelined_with_a_symbolic_batch_and_a_column_bias() -> None:
    tensors = batched(tc.var("B"), 70, 72, 40, "float32", "bias[j]")
    f = tc.build(strategy_schedule(tensors, "gemm_pipelined", {"bm": 64, "bn": 64, "bk": 8}, {"B": 4}), target="sim")
    for batch in (1, 5):
        run_and_check(f, batch, 70, 72, 40, "float32", "bias[j]", seed=batch)


def test_a_batch_axis_inside_a_gemm_operand_is_still_refused() -> None:
    """The broadcast exemption is the epilogue's: an operand A[i, b, k] is no batch of GEMMs."""
    A = tc.placeholder((64, 3, 32), "float32", name="A")
    W = tc.placeholder((3, 32, 64), "float32", name="W")
    r = tc.reduce_axis(32, name="k")
    C = tc.compute((3, 64, 64), lambda b, i, j: tc.sum(A[i, b, r] * W[b, r, j], axis=r), name="C")
    info = analyze_kernel(lower([A, W, C]).kernels[0])
    reason = get("gemm_pipelined").guard(info, make_target("sm_90"))
    assert reason is not None and "leading dimension of A, B and the output" in reason


# ---- fp16 / bf16 / tf32: tensor cores ---------------------------------------------------------------

def tensorize_plan(intrinsic: str, block: tuple[int, int], warps: tuple[int, int], k_tile: int,
                   stages: int, **extra: Any) -> dict[str, Any]:
    args = {"stage": "C", "intrinsic": intrinsic, "block": list(block), "warps": list(warps), "k_tile": k_tile,
            "stages": stages} | extra
    return {"strategy": "manual", "reason": "test", "steps": [{"primitive": "tensorize", "args": args}]}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("kind", ["bias[j]", "bias[i]", "scale[b]"])
def test_mma_sync_takes_a_batched_gemm_with_broadcast_epilogue_operands(dtype: str, kind: str) -> None:
    batch, m, n, k = 3, 72, 40, 56
    tensors = batched(batch, m, n, k, dtype, kind)
    f = tc.build(tensors, target="sim", arch="sm_80", plan=tensorize_plan("auto", (64, 64), (2, 2), 32, 2))
    run_and_check(f, batch, m, n, k, dtype, kind, seed=7)


@pytest.mark.parametrize("dtype,kind,extra", [
    ("float16", "bias[j]", {}),
    ("bfloat16", "bias[b,j]", {"producer": "tma"}),
    ("float16", "scale[b]", {"producer": "tma", "epilogue": "tma", "persistent": 3}),
])
def test_wgmma_takes_a_batched_gemm_with_broadcast_epilogue_operands(dtype: str, kind: str,
                                                                    extra: dict[str, Any]) -> None:
    batch, m, n, k = 3, 72, 136, 80
    tensors = batched(batch, m, n, k, dtype, kind)
    f = tc.build(tensors, target="sim", arch="sm_90", plan=tensorize_plan("wgmma", (64, 128), (4, 1), 64, 3, **extra))
    run_and_check(f, batch, m, n, k, dtype, kind, seed=11)


def test_tf32_takes_a_batched_gemm_with_a_column_bias_when_allowed() -> None:
    batch, m, n, k = 2, 70, 72, 40
    f = tc.build(batched(batch, m, n, k, "float32", "bias[j]"), target="sim", arch="sm_90", allow_tf32=True)
    assert f.plan.strategy.startswith("gemm_") and f.plan.strategy.endswith("_tf32"), f.plan.strategy
    run_and_check(f, batch, m, n, k, "float32", "bias[j]", seed=3, tf32=True)


# ---- the planner ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", sorted(EPILOGUES))
def test_the_planner_puts_a_bias_batched_fp32_gemm_on_gemm_pipelined(kind: str) -> None:
    """8 x 512³ with a broadcast epilogue operand: gemm_pipelined, priced as the GEMM without it
    plus the operand's bytes once (DRAM reads the broadcast operand once for the whole batch)."""
    res = plan_program(batched(8, 512, 512, 512, "float32", kind), "sm_90")
    chosen = res.kernels[0].chosen
    assert chosen.strategy.name == "gemm_pipelined", chosen.strategy.name
    A = tc.placeholder((8, 512, 512), "float32", name="A")
    W = tc.placeholder((8, 512, 512), "float32", name="W")
    r = tc.reduce_axis(512, name="k")
    plain = plan_program([A, W, tc.compute((8, 512, 512), lambda b, i, j: tc.sum(A[b, i, r] * W[b, r, j], axis=r),
                                           name="C")], "sm_90").kernels[0].chosen
    operand = {"bias[j]": 512, "bias[i]": 512, "scale[b]": 8, "bias[b,j]": 8 * 512}[kind] * 4
    assert chosen.workload.dram_bytes == pytest.approx(plain.workload.dram_bytes + operand, rel=1e-6)
    assert chosen.cost.total == pytest.approx(plain.cost.total, rel=0.02)


@pytest.mark.parametrize("dtype,arch,strategy", [("float16", "sm_90", "gemm_wgmma"),
                                                 ("bfloat16", "sm_90", "gemm_wgmma"),
                                                 ("float16", "sm_80", "gemm_tensor_core")])
def test_the_planner_puts_a_bias_batched_half_gemm_on_tensor_cores(dtype: str, arch: str, strategy: str) -> None:
    res = plan_program(batched(8, 512, 512, 512, dtype, "bias[j]"), arch)
    assert res.kernels[0].chosen.strategy.name == strategy, res.kernels[0].chosen.strategy.name


def test_a_16_bit_epilogue_operand_keeps_a_float32_gemm_on_the_simt_strategies() -> None:
    """Only the GEMM operands' element size decides between the float32 and the 16-bit strategies:
    a float16 `bias[j]` read by the store of a float32 matmul is an epilogue operand."""
    m, n, k = 70, 130, 37
    A = tc.placeholder((m, k), "float32", name="A")
    W = tc.placeholder((k, n), "float32", name="W")
    bias = tc.placeholder((n,), "float16", name="bias")
    r = tc.reduce_axis(k, name="k")
    C = tc.compute((m, n), lambda i, j: tc.sum(A[i, r] * W[r, j], axis=r) + tc.cast(bias[j], "float32"), name="C")
    tensors = [A, W, bias, C]
    info = analyze_kernel(lower(tensors).kernels[0])
    for name in ("gemm", "gemm_pipelined"):
        assert get(name).guard(info, make_target("sm_90")) is None, (name, get(name).guard(info, make_target("sm_90")))
    sch = strategy_schedule(tensors, "gemm_pipelined", {"bm": 64, "bn": 64, "bk": 8})
    g = np.random.default_rng(2)
    a, w = g.standard_normal((m, k)).astype(np.float32), g.standard_normal((k, n)).astype(np.float32)
    b = g.standard_normal(n).astype(np.float16)
    c = np.full((m, n), np.nan, np.float32)
    tc.build(sch, target="sim")(a, w, b, c)
    want = a.astype(np.float64) @ w + b.astype(np.float64)
    bound = (k + 2) * 2.0**-24 * (np.abs(a.astype(np.float64)) @ np.abs(w) + np.abs(b.astype(np.float64)))
    assert (np.abs(c - want) <= bound).all(), np.unravel_index(np.argmax(np.abs(c - want) - bound), want.shape)


# ---- a batch of small GEMMs --------------------------------------------------------------------------
# 3 x 1000 x 130 x 257 (0.2 GFLOP): gemm_pipelined's 8 x 8 register tiles give it 190 warps in all;
# its points run 1-2 blocks of 2-4 warps per SM, below the 8-16 warps the tile loop's efficiency
# was fitted on (docs/cost-model.md, "Short k loops"), and the batch leaves no room for split-K.
# The generic reduction (a thread per output) is priced by its L2 requests at twice DRAM's
# bandwidth, ~42 us on an H200 (4.9 TB/s from its memory clock and bus width, which is what the
# live device's Target reads). Measured on the H200 (benchmarks/common_ops.py --only small_gemm,
# 2026-11-26): the reduction the planner took there 69.7 us, gemm_pipelined 128 x 32 22.2 us (the
# model said 46.7, issue-bound at a tile-loop efficiency of 0.11). With a warp that has a
# scheduler to itself priced at CostParameters.tile_loop_alone, gemm_pipelined is the pick on both
# tables.
SMALL = (3, 1000, 130, 257)
H200 = make_target("sm_90").replace(name="H200", dram_bandwidth=2.0 * 3.201e9 * 6144 / 8)


@pytest.mark.parametrize("tgt", [make_target("sm_90"), H200], ids=["sm_90", "H200"])
def test_a_batch_of_small_bias_gemms_goes_to_gemm_pipelined_not_the_reduction(tgt: Any) -> None:
    res = plan_program(batched(*SMALL, "float32", "bias[j]"), tgt)
    kp = res.kernels[0]
    assert kp.chosen.strategy.name == "gemm_pipelined", kp.chosen.label
    best = {name: min(c.cost.total for c in kp.ranked if c.strategy.name == name) for name in ("gemm_pipelined", "reduction")}
    assert best["gemm_pipelined"] < 0.8 * best["reduction"], best   # no longer a tie (measured: 3x apart)
    # the measured point, 128 x 32 (2 warps per SM), is within 5% of the pick: lone warps per
    # scheduler are priced alike whatever the block shape
    gemm = get("gemm_pipelined")
    measured = predict(gemm.workload(kp.info, {"bm": 128, "bn": 32, "bk": 16}, tgt), tgt).total
    assert measured <= 1.05 * kp.chosen.cost.total, (measured, kp.chosen.label)


def test_the_tile_loop_efficiency_of_lone_warps_leaves_4_warps_and_more_as_fitted() -> None:
    """With fewer warps than schedulers a warp that has a scheduler to itself is priced at
    tile_loop_alone (never above one warp per scheduler); from 4 warps on the fitted exponential
    is unchanged, and the efficiency never falls as warps are added."""
    import math

    from tecc.compiler.cost.model import DEFAULT_PARAMETERS as P
    from tecc.compiler.cost.model import tile_loop_efficiency
    fill = 272 / (272 + P.tile_loop_fill_k)
    assert tile_loop_efficiency(2, 272) == pytest.approx(0.5 * P.tile_loop_alone * fill)
    assert tile_loop_efficiency(2, 272) > 1.4 * (1 - math.exp(-2 / P.tile_loop_warps)) * fill
    for w in (4, 5, 8, 12, 16, 32):
        assert tile_loop_efficiency(w, 272) == pytest.approx((1 - math.exp(-w / P.tile_loop_warps)) * fill)
    effs = [tile_loop_efficiency(w, 272) for w in range(1, 33)]
    assert all(a <= b for a, b in zip(effs, effs[1:])), effs


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,shape", [("float32", (8, 512, 512, 512)), ("bfloat16", (8, 1024, 1024, 512))])
def test_a_bias_batched_gemm_on_the_gpu_matches_numpy(dtype: str, shape: tuple[int, int, int, int]) -> None:
    batch, m, n, k = shape
    f = tc.build(batched(batch, m, n, k, dtype, "bias[j]"), target="cuda")
    assert f.plan.strategy.startswith("gemm_"), f.plan.strategy
    run_and_check(f, batch, m, n, k, dtype, "bias[j]", seed=5)


@pytest.mark.gpu
def test_a_batch_of_small_bias_gemms_on_the_gpu_matches_numpy_with_either_plan() -> None:
    """The planner's pick for the live device (gemm_pipelined, see above) and the point timed
    against the reduction (128 x 32)."""
    batch, m, n, k = SMALL
    tensors = batched(batch, m, n, k, "float32", "bias[j]")
    f = tc.build(tensors, target="cuda")
    assert f.plan.strategy == "gemm_pipelined", f.plan.reason
    run_and_check(f, batch, m, n, k, "float32", "bias[j]", seed=5)
    pinned = tc.build(strategy_schedule(tensors, "gemm_pipelined", {"bm": 128, "bn": 32, "bk": 16}), target="cuda")
    run_and_check(pinned, batch, m, n, k, "float32", "bias[j]", seed=6)
