"""TMA loads of GEMM operands that are views merging dimensions of a contiguous tensor: a model's
x.view(B*T, C) @ w.t() reads the [B, T, C] intermediate as X[i // T, i % T, k], which
match_contraction splits into two row axes; its weight gradient sums over X[r // T, r % T, c] and
dy[r // T, r % T, j] (two reduction axes). The tensor map merges the dimensions (TensorMap.merge,
tma.tma_dims), so the TMA rung serves them: in the emulator against float64 NumPy (fresh random
inputs, outputs NaN first, tests/test_tensorize.py's bound), with rows and reductions that are no
multiple of the box (B = 3, T = 20 or 100) and boxes that cross the T boundary; merges that are no
flat axis in memory (strides that do not chain, a dimension longer than the view takes, a
transposed merge) are refused with the reason; the plan for sm_90 takes the TMA rung at GPT-2's
sizes; the CUDA compiles for sm_90a (NVRTC, no GPU); the tensor-map encoding merges and checks."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest
from nvrtc_checks import needs_nvrtc
from tensor_core_steps import tensorized
from test_tensorize import EPS, np_dtype

import tecc as tc
from tecc.compiler.cost.analysis import analyze_kernel
from tecc.compiler.planner import plan_program
from tecc.compiler.strategies.gemm_wgmma import GemmWgmma, tma_refusal_for
from tecc.ir import dtype as dt
from tecc.ir.errors import ScheduleError, ShapeError
from tecc.ir.intrinsics import IntrinsicError
from tecc.ir.stmt import Buffer, TensorCopy, TensorMap, TensorStore, iter_stmts
from tecc.passes.lower import lower
from tecc.runtime.host import HostProgram
from tecc.runtime.tensor_map import TensorMapSpec, encode_arguments

F32 = "float32"
Case = tuple[list[tc.Tensor], Callable[..., np.ndarray]]


def tma_plan(block: tuple[int, int] = (64, 64), stages: int = 3, epilogue: str = "registers",
             persistent: int = 0) -> dict[str, Any]:
    args: dict[str, Any] = {"stage": "C", "intrinsic": "wgmma", "block": list(block), "warps": [4 * block[0] // 64, 1],
                            "k_tile": 64, "stages": stages, "producer": "tma"}
    if epilogue != "registers":
        args["epilogue"] = epilogue
    if persistent:
        args["persistent"] = persistent
    return {"strategy": "manual", "reason": "test", "steps": [{"primitive": "tensorize", "args": args}]}


def _sum(a: Any, b: Any, r: Any, out: str) -> Any:
    return tc.cast(tc.sum(tc.cast(a, F32) * tc.cast(b, F32), axis=r), out)


def linear(B: int, T: int, K: int, N: int, dtype: str, out: str, strides: tuple[int, ...] | None = None,
           rows: int = 0) -> Case:
    """C = x.view(B*T, K) @ w.t(): x [B, rows or T, K] (optionally with fixed strides) read as
    X[i // T, i % T, k]."""
    x = tc.placeholder((B, rows or T, K), dtype, "X", strides=strides)
    w = tc.placeholder((N, K), dtype, "W")
    r = tc.reduce_axis(K, "r")
    c = tc.compute((B * T, N), lambda i, j: _sum(x[i // T, i % T, r], w[j, r], r, out), name="C")
    return [x, w, c], lambda x, w: x[:, :T].reshape(B * T, K) @ w.T


def linear_3d(B: int, T: int, K: int, N: int, dtype: str, out: str) -> Case:
    """C[b, t, j] = Σ_k X[b, t, k] · W[j, k]: two row axes in the operand and the output."""
    x, w = tc.placeholder((B, T, K), dtype, "X"), tc.placeholder((N, K), dtype, "W")
    r = tc.reduce_axis(K, "r")
    c = tc.compute((B, T, N), lambda b, t, j: _sum(x[b, t, r], w[j, r], r, out), name="C")
    return [x, w, c], lambda x, w: x @ w.T


def weight_gradient(B: int, T: int, C: int, N: int, dtype: str, out: str) -> Case:
    """dW = x.view(B*T, C).t() @ dy.view(B*T, N): the reduction merged in both operands."""
    x, dy = tc.placeholder((B, T, C), dtype, "X"), tc.placeholder((B, T, N), dtype, "DY")
    r = tc.reduce_axis(B * T, "r")
    g = tc.compute((C, N), lambda c, j: _sum(x[r // T, r % T, c], dy[r // T, r % T, j], r, out), name="C")
    return [x, dy, g], lambda x, dy: x.reshape(B * T, C).T @ dy.reshape(B * T, N)


def batched_view(H: int, B: int, T: int, K: int, N: int, dtype: str, out: str) -> Case:
    """C[h] = q[h].view(B*T, K) @ w[h].t(): a batch axis beside the merged rows."""
    q, w = tc.placeholder((H, B, T, K), dtype, "Q"), tc.placeholder((H, N, K), dtype, "W")
    r = tc.reduce_axis(K, "r")
    c = tc.compute((H, B * T, N), lambda h, i, j: _sum(q[h, i // T, i % T, r], w[h, j, r], r, out), name="C")
    return [q, w, c], lambda q, w: q.reshape(H, B * T, K) @ np.swapaxes(w, -1, -2)


def run_and_check(case: Case, plan: Any, seed: int, what: str) -> Any:
    """Build `case` for the emulator under `plan`, run it on fresh random inputs into a NaN-poisoned
    output, and compare with float64 NumPy: float32 sums of exact products, one rounding of the
    output."""
    tensors, reference = case
    f = tc.build(tensors, target="sim", arch="sm_90", plan=plan)
    g = np.random.default_rng(seed)
    inputs = []
    for t in tensors[:-1]:
        shape = tuple(int(str(s)) for s in t.shape)
        inputs.append((g.uniform(0.5, 1.5, shape) * g.choice([-1, 1], shape)).astype(np_dtype(t.dtype.name)))
    out_t = tensors[-1]
    out = np.full(tuple(int(str(s)) for s in out_t.shape), np.nan, dtype=np_dtype(out_t.dtype.name))
    f(*inputs, out)
    wide = [x.astype(np.float64) for x in inputs]
    exact = reference(*wide)
    size = reference(*[np.abs(x) for x in wide])
    k = max(int(str(d)) for t in tensors[:-1] for d in t.shape)   # at least the reduction's extent
    bound = (k + 1) * 2.0**-24 * size
    bound = bound + EPS[out_t.dtype.name] * (np.abs(exact) + bound)
    got = out.astype(np.float64)
    err = np.where(np.isnan(got), np.inf, np.abs(got - exact) - bound)
    assert (err <= 0).all(), f"{what}: {(err > 0).sum()} of {err.size} elements off (worst {err.max():.3g})"
    return f


def maps_of(module: Any) -> dict[str, TensorMap]:
    (kernel,) = [k for k in module.kernels if k.name.startswith("C")]
    return {s.map.buffer.name: s.map for s in iter_stmts(kernel.body) if isinstance(s, (TensorCopy, TensorStore))}


# ---- the emulator --------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,B,T,block,epilogue,persistent", [
    ("bfloat16", 2, 48, (64, 64), "registers", 0),    # the second box of rows crosses the T boundary at 48
    ("float16", 3, 100, (128, 64), "tma", 0),         # M = 300: the last row tile partial; TMA-store epilogue
    ("bfloat16", 3, 20, (64, 64), "tma", 3),          # M = 60 < one box; persistent grid
])
def test_a_merged_view_operand_on_the_tma_ring_matches_numpy(dtype: str, B: int, T: int, block: tuple[int, int],
                                                             epilogue: str, persistent: int) -> None:
    # K = 72: two k tiles, the second partial (zero fill); N = 40: one partial column tile
    f = run_and_check(linear(B, T, 72, 40, dtype, dtype), tma_plan(block, 3, epilogue, persistent), B * T,
                      f"x.view({B * T}, 72) @ w.t() on the TMA ring")
    maps = maps_of(f.module)
    assert maps["X"].merge == (2, 1) and maps["X"].box == (block[0], 64), maps["X"]
    assert maps["W"].merge == ()
    # the GEMM's output is [B·T, N], written at the flat row i_group·T + i_in: one dimension
    assert ("C" in maps) == (epilogue == "tma") and (epilogue != "tma" or maps["C"].merge == ())


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_two_row_axes_of_a_three_dimensional_operand_and_output_merge(dtype: str) -> None:
    f = run_and_check(linear_3d(3, 20, 72, 40, dtype, dtype), tma_plan((64, 64), 2, "tma"), 11,
                      "C[b, t, j] = X[b, t, :] · W[j, :] on the TMA ring")
    maps = maps_of(f.module)
    assert maps["X"].merge == (2, 1) and maps["C"].merge == (2, 1) and maps["C"].box == (64, 64)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_weight_gradient_merges_the_reduction_of_both_operands(dtype: str) -> None:
    # K = B·T = 60: one partial k tile over the T boundary; both operands MN-major (k outermost)
    f = run_and_check(weight_gradient(3, 20, 72, 40, dtype, F32), tma_plan((64, 64), 2), 13,
                      "x.view(60, 72).t() @ dy.view(60, 40) on the TMA ring")
    maps = maps_of(f.module)
    assert maps["X"].merge == (2, 1) and maps["DY"].merge == (2, 1)
    assert maps["X"].box == (64, 64) and maps["DY"].box == (64, 64)


def test_a_batch_axis_beside_merged_rows() -> None:
    f = run_and_check(batched_view(2, 3, 20, 64, 40, "bfloat16", "bfloat16"), tma_plan((64, 64), 2), 17,
                      "batched q[h].view(60, 64) @ w[h].t() on the TMA ring")
    maps = maps_of(f.module)
    assert maps["Q"].merge == (1, 2, 1) and maps["Q"].box == (1, 64, 64) and maps["W"].merge == ()


def test_a_1x1_convolutions_rows_are_one_merged_axis() -> None:
    """Y[n, p, q, f] = Σ_c X[n, p, q, c] · W[c, f] (NHWC, 1x1): rows n, p, q over chaining
    dimensions, a [N·H·W, C] map; the output [N, H, W, F] likewise for the TMA store."""
    x, w = tc.placeholder((2, 5, 7, 64), "float16", "X"), tc.placeholder((64, 40), "float16", "W")
    r = tc.reduce_axis(64, "r")
    y = tc.compute((2, 5, 7, 40), lambda n, p, q, f: _sum(x[n, p, q, r], w[r, f], r, "float16"), name="C")
    f = run_and_check(([x, w, y], lambda x, w: x @ w), tma_plan((64, 64), 2, "tma"), 23, "1x1 convolution")
    maps = maps_of(f.module)
    assert maps["X"].merge == (3, 1) and maps["C"].merge == (3, 1) and maps["W"].merge == ()


# ---- refusals ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("make,reason", [
    # a slice of a wider [B, 2T, K] tensor: rows b·2T·K + t·K, no flat axis
    (lambda: linear(2, 48, 64, 40, "bfloat16", "bfloat16", strides=(2 * 48 * 64, 64, 1)),
     r"dimensions 0 and 1 do not chain in memory: stride 6144 is not 48 x 64"),
    # a row-major [B, 64, K] read as X[i // 48, i % 48, k] (the view takes 48 of its 64 rows)
    (lambda: linear(2, 48, 64, 40, "bfloat16", "bfloat16", rows=64),
     r"dimension 1 has 64 elements, not the 48 its axes take"),
])
def test_a_merge_that_is_no_flat_axis_keeps_cp_async_with_its_reason(make: Callable[[], Case], reason: str) -> None:
    tensors, _ = make()
    kernel = lower(tensors).kernels[0]
    with pytest.raises(ScheduleError, match=f"TMA cannot load the operands: operand A .X.: its {reason}.*cp.async"):
        tensorized(kernel, "C", "wgmma", (64, 64), (4, 1), 64, 3, producer="tma")
    info = analyze_kernel(kernel)
    assert "strided or transposed merge" in (tma_refusal_for(info) or "")
    assert all(p["load"] == "cp.async" for p in GemmWgmma().space(info, tc.target("sm_90")))


def test_the_strided_view_computes_on_the_cp_async_ring() -> None:
    """The refused view's plan for sm_90 (the cp.async ring) in the emulator, on the first 48 rows
    of each batch of a [2, 96, 64] array (the strides the placeholder fixes)."""
    tensors, reference = linear(2, 48, 64, 40, "bfloat16", "bfloat16", strides=(2 * 48 * 64, 64, 1))
    plan = plan_program(tensors, "sm_90", only=["gemm_wgmma"]).plan
    assert "gemm_wgmma" in plan.strategy and "cp.async ring" in plan.reason, plan.reason
    f = tc.build(tensors, target="sim", arch="sm_90", plan=plan)
    g = np.random.default_rng(19)
    store = (g.uniform(0.5, 1.5, (2, 96, 64)) * g.choice([-1, 1], (2, 96, 64))).astype(np_dtype("bfloat16"))
    w = (g.uniform(0.5, 1.5, (40, 64)) * g.choice([-1, 1], (40, 64))).astype(np_dtype("bfloat16"))
    out = np.full((96, 40), np.nan, dtype=np_dtype("bfloat16"))
    f(store[:, :48], w, out)
    x64, w64 = store[:, :48].astype(np.float64), w.astype(np.float64)
    exact, size = reference(x64, w64), reference(np.abs(x64), np.abs(w64))
    bound = 65 * 2.0**-24 * size
    bound = bound + EPS["bfloat16"] * (np.abs(exact) + bound)
    got = out.astype(np.float64)
    assert (np.where(np.isnan(got), np.inf, np.abs(got - exact)) <= bound).all()


def test_an_operand_wider_than_the_reduction_keeps_cp_async() -> None:
    """C = A[:, :72] @ B[:72]: the last k tile's boxes would read A's and B's elements past k = 72
    (no zero fill there), so TMA is refused; the plan for sm_90 computes the sum over 72."""
    a, b = tc.placeholder((64, 96), "float16", "A"), tc.placeholder((96, 64), "float16", "B")
    r = tc.reduce_axis(72, "r")
    c = tc.compute((64, 64), lambda i, j: _sum(a[i, r], b[r, j], r, F32), name="C")
    kernel = lower([a, b, c]).kernels[0]
    with pytest.raises(ScheduleError, match="operand A .A.: its k dimension has 96 elements, the reduction 72"):
        tensorized(kernel, "C", "wgmma", (64, 64), (4, 1), 64, 3, producer="tma")
    info = analyze_kernel(kernel)
    assert "k dimension has 96 elements" in (tma_refusal_for(info) or "")
    plan = plan_program([a, b, c], "sm_90", only=["gemm_wgmma"]).plan
    run_and_check(([a, b, c], lambda a, b: a[:, :72] @ b[:72]), plan, 29, "A[:, :72] @ B[:72]")


def test_a_transposed_merge_is_refused_as_not_consecutive() -> None:
    """O[i // T, k // D, i % T, k % D] (attention's output through transpose + view): the rows'
    dimensions 0 and 2 are not consecutive."""
    o, w = tc.placeholder((2, 2, 16, 32), "bfloat16", "O"), tc.placeholder((40, 64), "bfloat16", "W")
    r = tc.reduce_axis(64, "r")
    c = tc.compute((32, 40), lambda i, j: _sum(o[i // 16, r // 32, i % 16, r % 32], w[j, r], r, "bfloat16"), name="C")
    kernel = lower([o, w, c]).kernels[0]
    with pytest.raises(ScheduleError, match=r"operand A .O.: its outer axes are not read in order by consecutive"):
        tensorized(kernel, "C", "wgmma", (64, 64), (4, 1), 64, 3, producer="tma")


# ---- the plan for sm_90 --------------------------------------------------------------------------------

def _chosen(tensors: list[tc.Tensor], only: list[str] | None = None) -> Any:
    result = plan_program(tensors, "sm_90", only=only)
    (kp,) = [kp for kp in result.kernels if kp.kernel.startswith("C")]
    return kp.chosen


@pytest.mark.parametrize("make", [
    lambda: linear(8, 1024, 768, 2304, "bfloat16", "bfloat16"),            # GPT-2's qkv GEMM
    lambda: weight_gradient(8, 1024, 768, 3072, "bfloat16", "bfloat16"),  # the fc layer's weight gradient
])
def test_gpt2_sized_merged_views_plan_on_the_tma_ring(make: Callable[[], Case]) -> None:
    chosen = _chosen(make()[0])
    assert chosen.strategy.name == "gemm_wgmma" and chosen.point["load"] == "tma", chosen.label


@pytest.mark.parametrize("case", ["merged rows", "view of a view", "weight gradient"])
def test_the_view_contractions_of_a_computed_tensor_plan_on_the_tma_ring(case: str) -> None:
    """tests/test_view_contractions.py's programs (the viewed tensor computed in the program, as
    in a traced model) at GPT-2's sizes; its transposed merge (attention's output) keeps cp.async."""
    from test_view_contractions import CASES

    chosen = _chosen(CASES[case](True)[0])
    assert chosen.strategy.name == "gemm_wgmma" and chosen.point["load"] == "tma", chosen.label
    chosen = _chosen(CASES["transposed merge"](True)[0])
    assert chosen.point.get("load") != "tma", chosen.label


def test_a_gpt2_sized_strided_view_keeps_cp_async_and_says_why() -> None:
    chosen = _chosen(linear(8, 1024, 768, 2304, "bfloat16", "bfloat16", strides=(2 * 1024 * 768, 768, 1))[0],
                     ["gemm_wgmma"])
    assert chosen.strategy.name == "gemm_wgmma" and chosen.point["load"] == "cp.async", chosen.label
    assert any("TMA rung is not offered" in n and "strided or transposed merge" in n
               for n in chosen.workload.notes), chosen.workload.notes


# ---- CUDA (NVRTC, no GPU) ------------------------------------------------------------------------------

@needs_nvrtc
@pytest.mark.parametrize("make,plan,merges", [
    # the qkv GEMM: X [8, 1024, 768] as a [8192, 768] map, the TMA-store epilogue
    (lambda: linear(8, 1024, 768, 2304, "bfloat16", "bfloat16"), tma_plan((128, 256), 3, "tma", 132),
     {"X": (2, 1), "W": (), "C": ()}),
    # the fc layer's weight gradient: both operands' reduction [8, 1024] merged, MN-major boxes
    (lambda: weight_gradient(8, 1024, 768, 3072, "bfloat16", F32), tma_plan((128, 256), 4, "registers", 132),
     {"X": (2, 1), "DY": (2, 1)}),
])
def test_gpt2_sized_tma_kernels_over_merged_views_compile_for_sm_90a(make: Callable[[], Case], plan: Any,
                                                                      merges: dict[str, tuple[int, ...]]) -> None:
    tensors, _ = make()
    f = tc.build(tensors, target="cuda", arch="sm_90", plan=plan)
    (r,) = f.resources.values()
    assert f.arch == "sm_90a" and (r.spill_stores, r.spill_loads, r.stack_bytes) == (0, 0, 0), r
    src = f.source
    assert "const __grid_constant__ TeccTensorMap X_tmap" in src
    # the [8, 1024, C] operands are 2-D maps
    assert "cp.async.bulk.tensor.3d" not in src and src.count("cp.async.bulk.tensor.2d.shared::cluster") >= 2
    (kernel,) = f.host.kernels
    assert {m.param: m.merge for m in kernel.tensor_maps} == merges


# ---- the tensor map ------------------------------------------------------------------------------------

def test_a_merged_tensor_map_checks_its_runs() -> None:
    x = Buffer("X", dt.bfloat16, (8, 1024, 768))
    m = TensorMap(x, (128, 64), "128B", (2, 1))
    assert m.rank == 2 and m.spans == (2, 1) and "merge 2+1" in str(m)
    with pytest.raises(IntrinsicError, match="does not cover the 3 dimensions"):
        TensorMap(x, (128, 64), "128B", (1, 1))
    with pytest.raises(IntrinsicError, match="one box size per dimension"):
        TensorMap(x, (1, 128, 64), "128B", (2, 1))
    strided = Buffer("S", dt.bfloat16, (8, 1024, 768), strides=(2 * 1024 * 768, 768, 1))
    with pytest.raises(IntrinsicError, match="merges dimensions 0 and 1.*do not chain"):
        TensorMap(strided, (128, 64), "128B", (2, 1))


def test_encoding_a_merged_map_multiplies_the_run_and_checks_its_strides() -> None:
    spec = TensorMapSpec("X", dt.bfloat16, (128, 64), "128B", (2, 1))
    args = encode_arguments(spec, 0x10000, (8, 1024, 768), (1024 * 768, 768, 1))
    assert args.rank == 2 and args.dims == (768, 8192) and args.strides == (1536,) and args.box == (64, 128)
    with pytest.raises(ShapeError, match=r"merges dimensions 0 and 1 .sizes 8, 1024., whose strides 1572864, 768 "
                                         r"elements do not chain"):
        encode_arguments(spec, 0x10000, (8, 1024, 768), (2 * 1024 * 768, 768, 1))
    assert TensorMapSpec.from_json(spec.to_json()) == spec
    plain = TensorMapSpec("W", dt.bfloat16, (128, 64), "128B")
    assert "merge" not in plain.to_json() and TensorMapSpec.from_json(plain.to_json()) == plain


def test_a_saved_artifact_with_a_merged_map_is_format_version_4(tmp_path: Any) -> None:
    import json

    tensors, _ = linear(2, 48, 64, 40, "bfloat16", "bfloat16")
    f = tc.build(tensors, target="sim", arch="sm_90", plan=tma_plan())
    host = HostProgram.from_module(f.module)
    from tecc.runtime.artifact import manifest_version

    assert manifest_version(host) == 4
    (kernel,) = HostProgram.from_json(json.loads(json.dumps(host.to_json()))).kernels
    assert [m.merge for m in kernel.tensor_maps] == [(2, 1), ()]
    # the saved loop IR (what a loaded artifact's emulator runs) keeps the merge too
    from tecc.ir.loop_json import module_from_json, module_to_json

    module = module_from_json(module_to_json(f.module))
    assert [m.merge for m in maps_of(module).values()] == [(2, 1), ()]
