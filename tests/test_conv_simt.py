"""float32 and depthwise convolutions on the SIMT strategies (docs/conv.md, "float32 and depthwise").

float32 convolutions are implicit GEMMs on the SGEMM schedule (`gemm_implicit`: the stage
flattened over view buffers, gemm_pipelined's tiles, the views gathered back into predicated
reads); depthwise convolutions (a window sum over shifted reads of one operand) are stencils
(`stencil_tile`: an output tile per block, the input halo staged in shared memory). Each kernel
runs in the emulator against float64 NumPy: a float32 sum of K products is within
(K + 1)·2⁻²⁴·Σ|x·w| of the exact one (Higham's bound, any summation order); outputs start as NaN.
The plans of the ResNet-50 float32 layers and of the depthwise layers are checked for the
strategy and compiled with NVRTC for sm_90 (no spills).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import tecc as tc
from tecc.codegen import compile_cuda, emit_source
from tecc.compiler.cost.analysis import analyze_kernel
from tecc.compiler.planner import plan_program, resolve_target
from tecc.compiler.strategies.registry import get
from test_conv import EPS, F32, Conv, np_dtype

# ResNet-50's layers at batch 32 (N, H, W, C, F, R, stride), as in benchmarks/conv.py
RESNET = [
    (32, 56, 56, 64, 64, 3, 1), (32, 28, 28, 128, 128, 3, 1), (32, 14, 14, 256, 256, 3, 1), (32, 7, 7, 512, 512, 3, 1),
    (32, 56, 56, 64, 256, 1, 1), (32, 56, 56, 256, 64, 1, 1), (32, 28, 28, 512, 128, 1, 1),
    (32, 14, 14, 1024, 256, 1, 1), (32, 7, 7, 2048, 512, 1, 1), (32, 56, 56, 128, 128, 3, 2),
]
DEPTHWISE = [(32, 56, 56, 64, 3, 1), (32, 28, 28, 256, 3, 1), (32, 14, 14, 512, 3, 1)]  # (N, H, W, C, R, stride)


def forced_plan(tensors: list[tc.Tensor], strategy: str, point: dict[str, Any]) -> Any:
    """The plan of `strategy` at `point` (small problems the planner would rather give to a
    one-thread-per-output schedule: the emulator checks the kernel the big layers get)."""
    sch = tc.Schedule(tensors)
    info = analyze_kernel(sch.mod.kernels[0])
    why = get(strategy).guard(info, resolve_target("sm_90"))
    assert why is None, f"{strategy} declines: {why}"
    get(strategy).apply(sch, info, point)
    return sch.plan


def resnet_conv(layer: tuple[int, ...], dtype: str = "float32") -> Conv:
    n, h, w, c, f, r, stride = layer
    return Conv(n, (h, w), c, f, (r, r), stride=stride, pad=r // 2, dtype=dtype)


# ---- float32: gemm_implicit ----------------------------------------------------------------------

FP32_CASES = [
    Conv(2, (6, 6), 8, 32, (3, 3), pad=1, dtype="float32"),
    Conv(2, (6, 6), 8, 32, (3, 3), pad=1, dtype="float32", layout="NCHW"),
    Conv(2, (7, 7), 3, 32, (3, 3), pad=1, stride=2, dtype="float32"),
    Conv(2, (6, 6), 8, 32, (3, 3), pad=2, dil=2, dtype="float32", epilogue="bn_residual"),
    Conv(2, (5, 5), 12, 40, (1, 1), dtype="float32", epilogue="bias_relu"),
    Conv(2, (6, 6), 16, 64, (3, 3), pad=1, groups=2, dtype="float32", epilogue="bn_relu"),
    Conv(2, (7, 7), 6, 36, (3, 3), pad=1, stride=2, dtype="float32", layout="NCHW"),
    Conv(2, (20,), 8, 32, (3,), pad=1, dtype="float32"),
]


@pytest.mark.parametrize("conv", FP32_CASES, ids=["nhwc_3x3", "nchw_3x3", "c3_stride2", "dilation2_bn_residual",
                                                 "1x1_bias_relu", "groups2_bn_relu", "nchw_stride2_odd", "conv1d"])
def test_float32_conv_as_implicit_gemm_matches_numpy(conv: Conv) -> None:
    """Gathered, predicated view tiles (padding, stride, dilation, C = 3, groups, NCHW, edges of
    M, N and K that no tile divides) give the float32 convolution within the float32 bound."""
    plan = forced_plan(conv.program(), "gemm_implicit", {"bm": 32, "bn": 64, "bk": 8})
    assert [s.primitive for s in plan.steps][0] == "flatten_contraction"
    assert plan.steps[-1].primitive == "gather_views"
    conv.run(plan=plan)


def test_float32_conv_larger_tiles_and_float4_gathers_match_numpy() -> None:
    """128 x 64 tiles, k-tile 16 (two k-tiles per tap at C = 32) and float4 chunks of X (C % 4 == 0)."""
    conv = Conv(2, (8, 8), 32, 64, (3, 3), pad=1, dtype="float32", epilogue="bias_relu")
    plan = forced_plan(conv.program(), "gemm_implicit", {"bm": 128, "bn": 64, "bk": 16})
    f, _ = conv.run(plan=plan)
    assert "float4*>(&X[" in f.source, "the activation tile should be gathered in 16-byte chunks"


@pytest.mark.parametrize("conv,point", [
    (Conv(2, (6, 6), 8, 32, (3, 3), pad=1, dtype="float32", epilogue="bn_residual"), {"bm": 32, "bn": 64, "bk": 8, "split": 3}),
    (Conv(2, (6, 6), 8, 36, (3, 3), pad=1, dtype="float32", layout="NCHW", epilogue="bias_relu"),
     {"bm": 32, "bn": 64, "bk": 8, "split": 2}),
], ids=["nhwc_split3_bn_residual", "nchw_split2_bias_relu"])
def test_float32_conv_split_k_matches_numpy(conv: Conv, point: dict[str, int]) -> None:
    """Split-K: partials of the flattened k loop on blockIdx.z and a combine kernel whose C_view
    store gather_views turns into the store to Y (with the epilogue after the sum)."""
    plan = forced_plan(conv.program(), "gemm_implicit", point)
    f, _ = conv.run(plan=plan)
    assert [k.name for k in f.module.kernels] == ["Y_kernel", "Y_kernel_combine"]


@pytest.mark.parametrize("layer", RESNET, ids=[f"{l[1]}x{l[2]}x{l[3]}->{l[4]}_r{l[5]}_s{l[6]}" for l in RESNET])
def test_resnet_float32_layers_plan_gemm_implicit_and_compile_without_spills(layer: tuple[int, ...]) -> None:
    """The planner gives every ResNet-50 float32 layer the implicit GEMM, and ptxas (sm_90) keeps it
    in registers."""
    tensors = resnet_conv(layer).program()
    res = plan_program(tensors, "sm_90")
    assert res.plan.strategy == "gemm_implicit", res.plan.reason
    f = tc.build(tensors, plan=res.plan, arch="sm_90")  # the combine kernel, if any, too
    for name, r in f.resources.items():
        assert (r.spill_stores, r.spill_loads, r.stack_bytes) == (0, 0, 0), f"{layer} {name}: {r}"
        assert r.registers <= 255


def test_float16_convs_stay_on_tensor_cores_and_plain_gemms_on_gemm_pipelined() -> None:
    res = plan_program(resnet_conv(RESNET[0], "float16").program(), "sm_90")
    assert res.plan.strategy in ("gemm_tensor_core", "gemm_wgmma"), res.plan.reason
    A, B = tc.placeholder((1024, 1024), "float32", "A"), tc.placeholder((1024, 1024), "float32", "B")
    k = tc.reduce_axis(1024, "k")
    C = tc.compute((1024, 1024), lambda i, j: tc.sum(A[i, k] * B[k, j], axis=[k]), name="C")
    res = plan_program([A, B, C], "sm_90")
    assert res.plan.strategy == "gemm_pipelined", res.plan.reason
    declined = dict(res.kernels[0].declined)
    assert "plain" in declined["gemm_implicit"]


def test_flatten_contraction_refuses_half_operands_and_gather_needs_views() -> None:
    conv = Conv(2, (6, 6), 8, 32, (3, 3), pad=1, dtype="float16")
    with pytest.raises(tc.ScheduleError, match="float32"):
        tc.Schedule(conv.program()).flatten_contraction("Y")
    with pytest.raises(tc.ScheduleError, match="flatten_contraction first"):
        tc.Schedule(Conv(2, (6, 6), 8, 32, (3, 3), pad=1, dtype="float32").program()).gather_views("Y")


# ---- depthwise: stencil_tile -----------------------------------------------------------------------

def depthwise(n: int, h: int, c: int, r: int, stride: int, dtype: str, layout: str = "NHWC") -> list[tc.Tensor]:
    """Y[n, p, q, c] = Σ_{r, s} X[n, p·σ + r - π, q·σ + s - π, c] · W[r, s, c] (NCHW: X[n, c, ..],
    W[c, r, s], Y[n, c, p, q]), zero padding π = r // 2 by where()."""
    pad = r // 2
    o = (h + 2 * pad - r) // stride + 1
    X = tc.placeholder((n, h, h, c) if layout == "NHWC" else (n, c, h, h), dtype, "X")
    W = tc.placeholder((r, r, c) if layout == "NHWC" else (c, r, r), dtype, "W")
    rr, ss = tc.reduce_axis(r, "r"), tc.reduce_axis(r, "s")

    def body(b: Any, i: Any, j: Any, k: Any) -> Any:
        ch, p, q = (k, i, j) if layout == "NHWC" else (i, j, k)
        hh, ww = p * stride + rr - pad, q * stride + ss - pad
        x = X[b, hh, ww, ch] if layout == "NHWC" else X[b, ch, hh, ww]
        x = tc.where((hh >= 0) & (hh < h) & (ww >= 0) & (ww < h), x, tc.const(0, dtype))
        w = W[rr, ss, ch] if layout == "NHWC" else W[ch, rr, ss]
        return tc.cast(tc.sum(tc.cast(x, "float32") * tc.cast(w, "float32"), axis=[rr, ss]), dtype)

    shape = (n, o, o, c) if layout == "NHWC" else (n, c, o, o)
    return [X, W, tc.compute(shape, body, name="Y")]


def depthwise_reference(x: np.ndarray, w: np.ndarray, stride: int, layout: str) -> tuple[np.ndarray, np.ndarray]:
    """(exact, Σ|x·w|) in float64."""
    x, w = x.astype(np.float64), w.astype(np.float64)
    if layout != "NHWC":
        x, w = np.moveaxis(x, 1, -1), np.moveaxis(w, 0, -1)
    r, pad = w.shape[0], w.shape[0] // 2
    n, h, _, c = x.shape
    o = (h + 2 * pad - r) // stride + 1
    xp = np.pad(x, ((0, 0), (pad, pad + stride), (pad, pad + stride), (0, 0)))
    y, size = np.zeros((n, o, o, c)), np.zeros((n, o, o, c))
    for i in range(r):
        for j in range(r):
            win = xp[:, i:i + stride * (o - 1) + 1:stride, j:j + stride * (o - 1) + 1:stride, :]
            y += win * w[i, j]
            size += np.abs(win * w[i, j])
    if layout != "NHWC":
        y, size = np.moveaxis(y, -1, 1), np.moveaxis(size, -1, 1)
    return y, size


@pytest.mark.parametrize("n,h,c,stride,dtype,layout,point", [
    (2, 10, 64, 1, "float32", "NHWC", {"tx": 32, "ty": 4, "tp": 2}),
    (2, 9, 48, 2, "float32", "NHWC", {"tx": 16, "ty": 4, "tp": 4}),
    (1, 7, 20, 1, "float32", "NHWC", {"tx": 16, "ty": 8, "tp": 1}),
    (2, 10, 40, 1, "float16", "NHWC", {"tx": 32, "ty": 2, "tp": 4}),
    (2, 11, 6, 1, "float32", "NCHW", {"tx": 16, "ty": 4, "tp": 1}),
    (1, 12, 4, 2, "float16", "NCHW", {"tx": 16, "ty": 8, "tp": 1}),
    (2, 9, 24, 2, "float16", "NHWC", {"tx": 16, "ty": 4, "tp": 2}),
    (1, 7, 12, 1, "float16", "NHWC", {"tx": 16, "ty": 4, "tp": 2}),
], ids=["nhwc", "nhwc_stride2", "nhwc_edges", "nhwc_half", "nchw", "nchw_half_stride2", "nhwc_half_stride2_c24",
        "nhwc_half_c12"])
def test_depthwise_stencil_tile_matches_numpy(n: int, h: int, c: int, stride: int, dtype: str, layout: str,
                                              point: dict[str, int]) -> None:
    tensors = depthwise(n, h, c, 3, stride, dtype, layout)
    plan = forced_plan(tensors, "stencil_tile", point)
    assert any(s.primitive == "cache_read" and s.args["tensor"] == "X" for s in plan.steps)
    f = tc.build(tensors, target="sim", plan=plan)
    g = np.random.default_rng(1)
    x = g.uniform(-1, 1, tensors[0].shape).astype(np_dtype(dtype))
    w = g.uniform(-1, 1, tensors[1].shape).astype(np_dtype(dtype))
    y = np.full(tensors[2].shape, np.nan, dtype=np_dtype(dtype))
    f(x, w, y)
    want, size = depthwise_reference(x, w, stride, layout)
    bound = 10 * F32 * size
    bound = bound + EPS[dtype] * (np.abs(want) + bound)
    err = np.where(np.isnan(y), np.inf, np.abs(y.astype(np.float64) - want) - bound)
    worst = np.unravel_index(int(np.argmax(err)), err.shape)
    assert (err <= 0).all(), (f"depthwise {layout} {dtype} stride {stride}: {(err > 0).sum()} elements off; worst "
                              f"at {worst}: got {y[worst]!r}, want {want[worst]!r}")


@pytest.mark.parametrize("dtype,c,width", [("float16", 64, 8), ("float32", 64, 4), ("float16", 12, 4)])
def test_depthwise_halo_copies_16_byte_chunks_of_channels(dtype: str, c: int, width: int) -> None:
    """The halo copy moves 16 bytes per access along the channels (8 halves, 4 floats) where the
    lane tile and C are multiples of the chunk, else 4 elements; the halves run in the emulator
    against NumPy in test_depthwise_stencil_tile_matches_numpy."""
    tensors = depthwise(2, 10, c, 3, 1, dtype)
    plan = forced_plan(tensors, "stencil_tile", {"tx": 16, "ty": 4, "tp": 2})
    assert [s.args["width"] for s in plan.steps if s.primitive == "vector_copy"] == [width]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("layer", DEPTHWISE, ids=[f"{l[1]}x{l[2]}x{l[3]}" for l in DEPTHWISE])
def test_depthwise_layers_plan_stencil_tile_and_compile_without_spills(layer: tuple[int, ...], dtype: str) -> None:
    n, h, _, c, r, stride = layer
    res = plan_program(depthwise(n, h, c, r, stride, dtype), "sm_90")
    assert res.plan.strategy == "stencil_tile", res.plan.reason
    declined = dict(res.kernels[0].declined)
    assert "stencil" in declined["gemm_tensor_core" if dtype == "float16" else "gemm_implicit"]
    func = res.schedule.mod.kernels[0]
    r_ = compile_cuda(emit_source([func]), arch="sm_90", name=func.name).resources[func.name]
    assert (r_.spill_stores, r_.spill_loads, r_.stack_bytes) == (0, 0, 0), r_


def test_stencil_tile_declines_contractions() -> None:
    """A dense convolution sums over c, which indexes X alone in its dimension: not a stencil."""
    sch = tc.Schedule(Conv(2, (6, 6), 8, 32, (3, 3), pad=1, dtype="float32").program())
    why = get("stencil_tile").guard(analyze_kernel(sch.mod.kernels[0]), resolve_target("sm_90"))
    assert why is not None and "stencil" in why


# ---- on a GPU ----------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("layer", [RESNET[0], RESNET[4]], ids=["resnet_3x3_56", "resnet_1x1_56_64_256"])
def test_resnet_float32_layers_on_the_gpu(layer: tuple[int, ...]) -> None:
    f, _ = resnet_conv(layer).run(target="cuda")
    assert f.plan.strategy == "gemm_implicit", f.plan.reason


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_depthwise_layer_on_the_gpu(dtype: str) -> None:
    n, h, _, c, r, stride = DEPTHWISE[0]
    tensors = depthwise(n, h, c, r, stride, dtype)
    f = tc.build(tensors, target="cuda")
    assert f.plan.strategy == "stencil_tile", f.plan.reason
    g = np.random.default_rng(2)
    x = g.uniform(-1, 1, tensors[0].shape).astype(np_dtype(dtype))
    w = g.uniform(-1, 1, tensors[1].shape).astype(np_dtype(dtype))
    y = np.full(tensors[2].shape, np.nan, dtype=np_dtype(dtype))
    f(x, w, y)
    want, size = depthwise_reference(x, w, stride, "NHWC")
    bound = 10 * F32 * size
    bound = bound + EPS[dtype] * (np.abs(want) + bound)
    err = np.where(np.isnan(y), np.inf, np.abs(y.astype(np.float64) - want) - bound)
    assert (err <= 0).all(), f"{(err > 0).sum()} of {err.size} elements off, worst {float(err.max()):.3g} over the bound"
