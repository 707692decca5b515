"""Reductions over more than 2^31 elements on the GPU: the emitter's 64-bit offsets for buffers
that may hold 2^31 elements or more (codegen/cuda.py), through each memory-bound form that plan="auto"
picks for them — split_rows (few long rows), split_reduce (columns), split_row_group (softmax on
few long rows). Inputs of 4-8 GiB; the float64 reference is computed by torch on the GPU, row by
row. Skipped without a GPU (and without torch, which holds the big arrays on the device)."""

import pytest

import tecc as tc

pytestmark = pytest.mark.gpu

HUGE = 2**31


def _torch():
    return pytest.importorskip("torch")


def _rel(got, ref) -> float:
    return float(((got.double() - ref).abs() / (ref.abs() + 1.0)).max())


def test_row_sums_over_more_than_2_31_elements():
    torch = _torch()
    R, C = 2, HUGE // 2 + 3                      # 2^31 + 6 bf16 elements, 4 GiB
    X = tc.placeholder((R, C), "bfloat16", name="X")
    c = tc.reduce_axis(C, name="c")
    Y = tc.compute((R,), lambda r: tc.cast(tc.sum(tc.cast(X[r, c], "float32"), axis=c) * (1.0 / C), "bfloat16"),
                   name="Y")
    f = tc.build([X, Y])
    assert f.plan.strategy == "split_rows"
    x = torch.randn(R, C, device="cuda", dtype=torch.bfloat16) + 0.5
    y = torch.full((R,), float("nan"), device="cuda", dtype=torch.bfloat16)
    f(x, y)
    torch.cuda.synchronize()
    ref = torch.stack([x[r].double().mean() for r in range(R)])
    assert _rel(y, ref) < 1e-2


def test_column_sums_over_more_than_2_31_elements():
    torch = _torch()
    R, C = HUGE // 1024 + 1, 1024                # 2^31 + 1024 bf16 elements
    X = tc.placeholder((R, C), "bfloat16", name="X")
    i = tc.reduce_axis(R, name="i")
    Y = tc.compute((C,), lambda j: tc.cast(tc.sum(tc.cast(X[i, j], "float32"), axis=i) * (1.0 / R), "bfloat16"),
                   name="Y")
    f = tc.build([X, Y])
    assert f.plan.strategy == "column_reduction"
    x = torch.randn(R, C, device="cuda", dtype=torch.bfloat16) + 0.5
    y = torch.full((C,), float("nan"), device="cuda", dtype=torch.bfloat16)
    f(x, y)
    torch.cuda.synchronize()
    ref = torch.zeros(C, device="cuda", dtype=torch.float64)
    step = 1 << 20
    for r0 in range(0, R, step):
        ref += x[r0:r0 + step].double().sum(0)
    assert _rel(y, ref / R) < 1e-2


def test_softmax_over_more_than_2_31_elements():
    torch = _torch()
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    import norms

    R, C = 4, HUGE // 4 + 1                      # 2^31 + 4 float32 elements, 8 GiB in and out
    args = norms.softmax(R, C, "float32")
    f = tc.build(args)
    assert f.plan.strategy == "split_row_group"
    x = torch.randn(R, C, device="cuda", dtype=torch.float32)
    y = torch.full_like(x, float("nan"))
    f(x, y)
    torch.cuda.synchronize()
    for r in range(R):
        ref = torch.softmax(x[r].double(), -1)
        assert _rel(y[r], ref) < 1e-5, r
