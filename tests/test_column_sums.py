"""Sums over two adjacent leading dimensions (a bias's or a layer norm weight's gradient: dims
[0, 1] of [B, T, C]) lower to one reduction axis over B·T (tecc/torch/lowering/reductions.py),
which the column reduction's split takes; in the emulator against float64 eager, and the sm_90
plan of such a sum inside a larger program is the column reduction (a region of its own)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import tecc  # noqa: E402,F401
from tecc.compiler.planner import plan_program  # noqa: E402
from tecc.torch.graph import plan_graph  # noqa: E402
from tecc.torch.lowering import Sizes  # noqa: E402


@pytest.mark.parametrize("dims,keepdim", [((0, 1), False), ((0, 1), True), ((1, 2), False), ((0, 2), False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sums_over_two_dimensions_match_eager(dims, keepdim, dtype):
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(3)
    x = (torch.rand(3, 37, 5, 24, generator=g) * 2 - 1).to(dtype)
    y = torch.rand(3, 37, 5, 24, generator=g).to(dtype)

    def fn(x, y):
        return (x * y).sum(dims, keepdim=keepdim), (x + 1).mean(dims)

    got = torch.compile(fn, backend="tecc", options={"fallback": "error"})(x, y)
    want = fn(x.double(), y.double())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in zip(got, want):
        assert a.shape == b.shape
        torch.testing.assert_close(a.double(), b, rtol=tol, atol=tol * 8)


def test_a_bias_gradient_inside_a_program_is_a_column_reduction_on_sm_90():
    from torch.fx.experimental.proxy_tensor import make_fx

    def fn(g, x):  # a linear layer's bias gradient next to a pointwise use of the same gradient
        return g.sum((0, 1)), (g * x).sum((0, 1)), g * 2

    gm = make_fx(fn, tracing_mode="fake")(torch.empty(8, 1024, 768), torch.empty(8, 1024, 768))
    plan = plan_graph(gm, "bias_grad", Sizes(), set())
    (seg,) = plan.segments
    result = plan_program(seg.args, "sm_90")
    assert result.parts, result.plan.reason
    strategies = [p.plan.strategy for p in result.parts]
    assert strategies.count("column_reduction") == 2, result.plan.reason
    assert result.predicted_seconds < 100e-6, result.plan.reason
