"""aten.as_strided lowered without division where the view's strides line up with its base's
(tecc/torch/lowering/strided.py), and what that gives a ResNet's head: the flatten of a
channels_last average pool is an `as_strided` that decompositions write, and its reader, the
classifier's `addmm`, must stay a contraction (a GEMM), not the generic row reduction that read
each weight tile 1000 rows wide (resnet50 on an H200: ~20 ms of a 25 ms call, docs/models.md).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import tecc as tc  # noqa: E402
from tecc.compiler.cost.analysis import analyze_kernel  # noqa: E402
from tecc.compiler.strategies import get  # noqa: E402
from tecc.ir.target import target  # noqa: E402
from tecc.passes.lower import lower  # noqa: E402
from torch_models import fresh_dynamo  # noqa: E402,F401  (tests/torch_models.py)


def compiled(fn):
    return torch.compile(fn, backend="tecc", options={"fallback": "error"})


# (base shape, base memory format, view size, view stride, storage offset)
VIEWS = [
    pytest.param((4, 6, 1, 1), "channels_last", (4, 6, 1, 1), (6, 1, 6, 6), 0, id="pooled-flatten"),
    pytest.param((3, 4, 5), "contiguous", (5, 4, 3), (1, 5, 20), 0, id="reversed-axes"),
    pytest.param((4, 5), "contiguous", (2, 3), (5, 1), 7, id="offset-window"),
    pytest.param((2, 3, 4, 5), "channels_last", (2, 4, 5, 3), (60, 15, 3, 1), 0, id="nhwc-order"),
    pytest.param((4, 5), "contiguous", (3, 4), (4, 1), 0, id="crosses-rows"),      # a carry: // and %
    pytest.param((2, 3, 4, 5), "channels_last", (2, 60), (60, 1), 0, id="nhwc-flatten"),
    pytest.param((6,), "contiguous", (3, 4), (0, 1), 1, id="repeated-rows"),
]


@pytest.mark.parametrize("shape,layout,size,stride,offset", VIEWS)
def test_as_strided_of_a_computed_base_matches_float64_eager(shape, layout, size, stride, offset):
    torch.manual_seed(3)
    x = torch.randn(*shape)
    if layout == "channels_last":
        x = x.to(memory_format=torch.channels_last)

    def fn(x):
        return torch.as_strided(x * 2 + 1, size, stride, offset) * 3

    got = compiled(fn)(x)
    want = fn(x.double())
    assert got.shape == want.shape
    np.testing.assert_allclose(got.double().numpy(), want.numpy(), rtol=1e-6, atol=1e-6)


def test_a_channels_last_resnet_head_matches_float64_eager():
    torch.manual_seed(4)
    head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 7)).eval()
    x = torch.randn(3, 16, 5, 5).to(memory_format=torch.channels_last)
    with torch.no_grad():
        got = compiled(head)(x)
        want = head.double()(x.double())
    np.testing.assert_allclose(got.double().numpy(), want.numpy(), rtol=1e-5, atol=1e-5)


def _head_program() -> list:
    """The tecc program of resnet50's head at its full size (bf16, batch 32, channels_last 2048
    x 7 x 7 -> 1000) from the ATen ops its traced graph holds (fake tensors)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from tecc.torch.graph import plan_graph
    from tecc.torch.lowering import Sizes

    aten = torch.ops.aten

    def fn(x, w, b):
        pooled = aten.mean.dim(x, [-1, -2], True)
        flat = aten.view.default(aten.as_strided.default(pooled, [32, 2048, 1, 1], [2048, 1, 2048, 2048]), [32, 2048])
        return aten.addmm.default(b, flat, aten.permute.default(w, [1, 0]))

    x = torch.empty(32, 2048, 7, 7, dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    w = torch.empty(1000, 2048, dtype=torch.bfloat16)
    b = torch.empty(1000, dtype=torch.bfloat16)
    gm = make_fx(fn, tracing_mode="fake")(x, w, b)
    plan = plan_graph(gm, "head", Sizes(), set())
    assert not plan.fallbacks
    (seg,) = plan.segments
    return seg.args


def test_the_resnet50_classifier_after_a_channels_last_flatten_is_a_gemm():
    from tecc.compiler.planner import plan_program

    result = plan_program(_head_program(), "sm_90")
    chosen = {kp.kernel: kp.chosen for kp in result.kernels}
    addmm = next(c for name, c in chosen.items() if name.startswith("addmm"))
    assert addmm.strategy.name in ("gemm_wgmma", "gemm_tensor_core"), addmm.label
    assert addmm.cost.total < 20e-6, addmm.label


# ---- the staged row reduction prices the box it stages ---------------------------------------------
def _broadcast_weight_rows():
    """out[i, j] = Σ_k W[j, k]² · v[i]: the main read W skips the outer output axis i."""
    W = tc.placeholder((1000, 256), "float32", name="W")
    v = tc.placeholder((32,), "float32", name="v")
    k = tc.reduce_axis(256, name="k")
    out = tc.compute((32, 1000), lambda i, j: tc.sum(W[j, k] * W[j, k] * v[i], axis=k), name="out")
    return [W, v, out]


def _staged_points(program):
    info = analyze_kernel(lower(program).kernels[0])
    space = get("reduction").space(info, target("sm_90"))
    return [p for p in space if p["mapping"] == "row_staged"]


def test_rows_staged_only_where_consecutive_outputs_read_consecutive_rows():
    x = tc.placeholder((512, 256), "float32", name="x")
    c = tc.reduce_axis(256, name="c")
    rows = tc.compute((512,), lambda r: tc.sum(x[r, c] * x[r, c], axis=c), name="rows")
    assert _staged_points([x, rows])
    # the weight broadcast over i: a block's 32 outputs span W's rows j..j+31 wrapping to 0..
    # (the box 1000 rows), not the 32 rows the point prices
    assert not _staged_points(_broadcast_weight_rows())
    x3 = tc.placeholder((4, 8, 64), "float32", name="x3")
    c3 = tc.reduce_axis(64, name="c3")
    swapped = tc.compute((8, 4), lambda a, b: tc.sum(x3[b, a, c3], axis=c3), name="swapped")
    assert not _staged_points([x3, swapped])
    nested = tc.compute((4, 8), lambda a, b: tc.sum(x3[a, b, c3], axis=c3), name="nested")
    assert _staged_points([x3, nested])
    # a row shared by the 16 outputs of an inner axis (A[i, k] for C[i, j] = Σ_k A[i, k] B[j, k], A
    # the larger read): every block stages whole groups of 16
    A = tc.placeholder((64, 128), "float32", name="A")
    k = tc.reduce_axis(128, name="k")
    B = tc.placeholder((16, 128), "float32", name="B")
    shared = tc.compute((64, 16), lambda i, j: tc.sum(A[i, k] * B[j, k], axis=k), name="shared")
    assert {p["threads"] for p in _staged_points([A, B, shared])} == {32, 64, 128, 256, 512}
    B48 = tc.placeholder((48, 128), "float32", name="B48")
    odd = tc.compute((64, 48), lambda i, j: tc.sum(A[i, k] * B48[j, k], axis=k), name="odd")
    assert not _staged_points([A, B48, odd])   # 48 outputs per row: a block of 32 straddles two rows


def test_the_broadcast_weight_rows_match_float64_numpy_in_the_emulator():
    program = _broadcast_weight_rows()
    f = tc.build(program, target="sim")
    rng = np.random.default_rng(7)
    W = rng.standard_normal((1000, 256)).astype(np.float32)
    v = rng.standard_normal(32).astype(np.float32)
    out = np.full((32, 1000), np.nan, np.float32)
    f(W, v, out)
    want = np.outer(v.astype(np.float64), (W.astype(np.float64) ** 2).sum(axis=1))
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-4)


@pytest.mark.gpu
def test_the_resnet50_head_on_the_gpu_matches_float64_and_takes_under_a_millisecond():
    """resnet50's head at its size (bf16, batch 32, channels_last 2048 x 7 x 7 -> 1000) on CUDA:
    within bf16 noise of float64, and no longer the ~20 ms staged-row classifier (a call, host
    path included, well under 1 ms; eager's is tens of microseconds)."""
    torch.manual_seed(5)
    head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2048, 1000)).cuda().eval()
    x = torch.randn(32, 2048, 7, 7, device="cuda").relu()
    with torch.no_grad():
        want = head.double()(x.double())
        fast = head.to(torch.bfloat16)
        run = compiled(fast)
        xb = x.to(torch.bfloat16).to(memory_format=torch.channels_last)
        for _ in range(3):
            y = run(xb)
        times = []
        for _ in range(20):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            y = run(xb)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
    error = ((y.double() - want).abs().max() / want.abs().max()).item()
    assert error <= 3e-2, error
    assert sorted(times)[len(times) // 2] < 1.0, times
