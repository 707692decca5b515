"""gemm_pipelined on a real GPU (skipped without one): non-divisible and symbolic sizes, A·Bᵀ
and batched matmul give torch's float64 result to float32 rounding, each built from its plan."""

from __future__ import annotations

from typing import Any

import pytest

import tecc as tc
from tecc.compiler.planner import plan_program

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _check(args: list[tc.Tensor], inputs: list[Any], ref: Any, sizes: dict[str, int] | None = None,
           only: list[str] | None = None) -> None:
    res = plan_program(args, only=only, sizes=sizes)
    kern = tc.build(args, plan=res.plan)
    out = torch.full(ref.shape, float("nan"), device="cuda")
    kern(*inputs, out)
    torch.cuda.synchronize()
    err = float((out.double() - ref).abs().max() / ref.abs().max())
    label = "; ".join(kp.chosen.label for kp in res.kernels)
    assert err < 1e-5, (label, err)


@pytest.mark.parametrize("m,n,k", [(1000, 1000, 1000), (127, 4096, 1023), (8192, 64, 512), (130, 70, 37)])
def test_non_divisible_gemm_on_gpu(m: int, n: int, k: int) -> None:
    A = tc.placeholder((m, k), "float32", name="A")
    B = tc.placeholder((k, n), "float32", name="B")
    r = tc.reduce_axis(k, name="k")
    C = tc.compute((m, n), lambda i, j: tc.sum(A[i, r] * B[r, j], axis=r), name="C")
    a, b = torch.randn(m, k, device="cuda"), torch.randn(k, n, device="cuda")
    _check([A, B, C], [a, b], a.double() @ b.double(), only=["gemm_pipelined"])


@pytest.mark.parametrize("m", [1000, 77])
def test_symbolic_m_gemm_on_gpu(m: int) -> None:
    M = tc.var("M")
    A = tc.placeholder((M, 512), "float32", name="A")
    B = tc.placeholder((512, 256), "float32", name="B")
    r = tc.reduce_axis(512, name="k")
    C = tc.compute((M, 256), lambda i, j: tc.sum(A[i, r] * B[r, j], axis=r), name="C")
    a, b = torch.randn(m, 512, device="cuda"), torch.randn(512, 256, device="cuda")
    _check([A, B, C], [a, b], a.double() @ b.double(), sizes={"M": m}, only=["gemm_pipelined"])


def test_a_times_b_transposed_on_gpu() -> None:
    A = tc.placeholder((300, 256), "float32", name="A")
    B = tc.placeholder((200, 256), "float32", name="B")
    r = tc.reduce_axis(256, name="k")
    C = tc.compute((300, 200), lambda i, j: tc.sum(A[i, r] * B[j, r], axis=r), name="C")
    a, b = torch.randn(300, 256, device="cuda"), torch.randn(200, 256, device="cuda")
    _check([A, B, C], [a, b], a.double() @ b.double().T, only=["gemm_pipelined"])


def test_batched_gemm_on_gpu() -> None:
    A = tc.placeholder((5, 100, 72), "float32", name="A")
    B = tc.placeholder((5, 72, 130), "float32", name="B")
    r = tc.reduce_axis(72, name="k")
    C = tc.compute((5, 100, 130), lambda b, i, j: tc.sum(A[b, i, r] * B[b, r, j], axis=r), name="C")
    a, b = torch.randn(5, 100, 72, device="cuda"), torch.randn(5, 72, 130, device="cuda")
    _check([A, B, C], [a, b], a.double() @ b.double())


@pytest.mark.parametrize("m,n,k,point", [
    (1000, 1000, 1000, {"bm": 128, "bn": 128, "bk": 16, "split": 4}),
    (127, 4096, 1023, {"bm": 128, "bn": 128, "bk": 16, "split": 8}),
    (8192, 64, 8192, {"bm": 128, "bn": 64, "bk": 16, "split": 8}),
    (1024, 1024, 1024, {"bm": 64, "bn": 128, "bk": 8, "split": 4}),
])
def test_split_k_gemm_on_gpu(m: int, n: int, k: int, point: dict[str, int]) -> None:
    from tecc.compiler.cost.analysis import analyze_kernel
    from tecc.compiler.schedule import Schedule
    from tecc.compiler.strategies import get
    from tecc.passes.lower import lower

    A = tc.placeholder((m, k), "float32", name="A")
    B = tc.placeholder((k, n), "float32", name="B")
    r = tc.reduce_axis(k, name="k")
    C = tc.compute((m, n), lambda i, j: tc.sum(A[i, r] * B[r, j], axis=r), name="C")
    sch = Schedule([A, B, C])
    get("gemm_pipelined").apply(sch, analyze_kernel(lower([A, B, C]).kernels[0]), point)
    kern = tc.build([A, B, C], plan=sch.plan)
    a, b = torch.randn(m, k, device="cuda"), torch.randn(k, n, device="cuda")
    out = torch.full((m, n), float("nan"), device="cuda")
    kern(a, b, out)
    torch.cuda.synchronize()
    ref = a.double() @ b.double()
    err = float((out.double() - ref).abs().max() / ref.abs().max())
    assert err < 1e-5, (point, err)


@pytest.mark.parametrize("m,n,k", [(1000, 1000, 1000), (512, 256, 4096)])
def test_epilogue_fused_gemm_on_gpu(m: int, n: int, k: int) -> None:
    """relu(A·B + bias[j]) in one kernel (the planner's choice, split-K at 512×256 keeps the
    epilogue in the combine kernel) matches torch's float64 result."""
    A = tc.placeholder((m, k), "float32", name="A")
    B = tc.placeholder((k, n), "float32", name="B")
    bias = tc.placeholder((n,), "float32", name="bias")
    r = tc.reduce_axis(k, name="k")
    C = tc.compute((m, n), lambda i, j: tc.sum(A[i, r] * B[r, j], axis=r), name="C")
    D = tc.compute((m, n), lambda i, j: tc.maximum(C[i, j] + bias[j], 0.0), name="D")
    a, b, c = torch.randn(m, k, device="cuda"), torch.randn(k, n, device="cuda"), torch.randn(n, device="cuda")
    res = plan_program([A, B, bias, D])
    kern = tc.build([A, B, bias, D], plan=res.plan)
    assert all(t.name.endswith("_rf") for t in kern.module.temps), kern.module  # no temporary C
    out = torch.full((m, n), float("nan"), device="cuda")
    kern(a, b, c, out)
    torch.cuda.synchronize()
    ref = torch.relu(a.double() @ b.double() + c.double())
    err = float((out.double() - ref).abs().max() / ref.abs().max())
    assert err < 1e-5, ("; ".join(kp.chosen.label for kp in res.kernels), err)
