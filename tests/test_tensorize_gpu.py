"""Tensorized half-precision contractions on a real GPU (skipped without one), against torch in
float64: every element within (K + 1)·2⁻²³·Σ|a·b| (float32 accumulation of exact products; the
hardware's mma aligns and truncates rather than rounding to nearest — Fasi, Higham, Mikaitis,
Pranesh, "Numerical behavior of NVIDIA tensor cores", PeerJ CS 2021 — so the unit is 2⁻²³, not
the emulator's 2⁻²⁴), plus one rounding of the result for a 16-bit output. Plans come from the planner ("auto") or
name a tensorize point; the output starts as NaN."""

from __future__ import annotations

from typing import Any

import pytest

import tecc as tc
from gpu_checks import check_on_gpu

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TORCH = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
EPS = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 0.0}
# the planner's tensor-core paths: mma.sync everywhere, wgmma on sm_90 (tests/test_wgmma_gpu.py)
TENSOR_CORE = ("gemm_tensor_core", "gemm_wgmma")


def _contraction(m: Any, n: int, k: int, dtype: str, a_t: bool = False, b_t: bool = False, batch: int = 0,
                 out: str = "float32", relu_bias: bool = False) -> list[tc.Tensor]:
    lead = (batch,) if batch else ()
    A = tc.placeholder(lead + ((k, m) if a_t else (m, k)), dtype, "A")
    B = tc.placeholder(lead + ((n, k) if b_t else (k, n)), dtype, "B")
    bias = tc.placeholder((n,), out, "bias")
    r = tc.reduce_axis(k, "r")

    def body(*ix: Any) -> Any:
        *bs, i, j = ix
        a = A[(*bs, r, i)] if a_t else A[(*bs, i, r)]
        b = B[(*bs, j, r)] if b_t else B[(*bs, r, j)]
        acc = tc.cast(tc.sum(tc.cast(a, "float32") * tc.cast(b, "float32"), axis=r), out)
        return tc.maximum(acc + bias[j], tc.const(0.0, out)) if relu_bias else acc

    C = tc.compute(lead + (m, n), body, name="C")
    return [A, B] + ([bias] if relu_bias else []) + [C]


def _run(m: int, n: int, k: int, dtype: str, *, a_t: bool = False, b_t: bool = False, batch: int = 0,
         out: str = "float32", relu_bias: bool = False, symbolic: bool = False, plan: Any = "auto",
         strategies: tuple[str, ...] = TENSOR_CORE) -> Any:
    tensors = _contraction(tc.var("M") if symbolic else m, n, k, dtype, a_t, b_t, batch, out, relu_bias)
    f = tc.build(tensors, plan=plan, sizes={"M": m} if symbolic else None)
    if plan == "auto":
        assert f.plan.strategy in strategies, f.plan.reason
    lead = (batch,) if batch else ()
    g = torch.Generator(device="cuda").manual_seed(m * 7 + n * 3 + k)
    a = torch.randn(lead + ((k, m) if a_t else (m, k)), device="cuda", generator=g).to(TORCH[dtype])
    b = torch.randn(lead + ((n, k) if b_t else (k, n)), device="cuda", generator=g).to(TORCH[dtype])
    a64 = a.double().transpose(-1, -2) if a_t else a.double()
    b64 = b.double().transpose(-1, -2) if b_t else b.double()
    exact = a64 @ b64
    bound = (k + 1) * 2.0**-23 * (a64.abs() @ b64.abs())
    args = [a, b]
    want = exact
    eps = EPS[out]
    if relu_bias:
        bias = (torch.rand(n, device="cuda", generator=g) * 8 - 4).to(TORCH[out])
        args.append(bias)
        want = torch.clamp(exact + bias.double(), min=0.0)
        bound = bound + eps * (exact.abs() + bound) + eps * (exact.abs() + bias.double().abs() + bound)
    else:
        bound = bound + eps * (exact.abs() + bound)
    c = torch.full(lead + (m, n), float("nan"), device="cuda", dtype=TORCH[out])
    f(*args, c)
    torch.cuda.synchronize()
    check_on_gpu(c, want, bound, f.plan.reason)
    return f



@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
# K = 1023: A by element loads; K = 1002 / 1004: 4- and 8-byte cp.async for A
@pytest.mark.parametrize("m,n,k", [(1000, 1000, 1000), (127, 4096, 1023), (512, 512, 40), (4096, 4096, 4096),
                                   (1000, 1000, 1002), (1000, 1000, 1004)])
def test_tensorized_gemm_on_gpu(m: int, n: int, k: int, dtype: str) -> None:
    _run(m, n, k, dtype)


@pytest.mark.parametrize("a_t,b_t", [(True, False), (False, True), (True, True)])
def test_transposed_operands_on_gpu(a_t: bool, b_t: bool) -> None:
    _run(1000, 1000, 1000, "float16", a_t=a_t, b_t=b_t)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_batched_tensorized_gemm_on_gpu(dtype: str) -> None:
    _run(512, 512, 512, dtype, batch=32)


@pytest.mark.parametrize("m", [1000, 77])
def test_symbolic_m_tensorized_gemm_on_gpu(m: int) -> None:
    _run(m, 512, 256, "float16", symbolic=True)


def test_fp16_output_with_bias_and_relu_on_gpu() -> None:
    _run(1024, 1024, 1024, "float16", out="float16", relu_bias=True)


@pytest.mark.parametrize("block,warps,k_tile,stages", [((64, 64), (2, 2), 32, 2), ((128, 128), (2, 2), 32, 3),
                                                       ((128, 256), (2, 4), 32, 2), ((64, 64), (2, 2), 64, 3),
                                                       ((256, 64), (4, 1), 32, 2), ((128, 64), (2, 2), 32, 4),
                                                       # dynamic shared memory: 72, 96 and 192 KiB rings
                                                       ((128, 256), (2, 4), 32, 3), ((128, 128), (2, 2), 64, 3),
                                                       ((256, 128), (4, 2), 64, 4)])
def test_explicit_tensorize_points_on_gpu(block: tuple[int, int], warps: tuple[int, int], k_tile: int,
                                          stages: int) -> None:
    plan = {"strategy": "manual", "reason": "test", "steps": [
        {"primitive": "tensorize", "args": {"stage": "C", "intrinsic": "auto", "block": list(block),
                                            "warps": list(warps), "k_tile": k_tile, "stages": stages}}]}
    _run(1000, 1000, 1000, "bfloat16", b_t=True, plan=plan)


@pytest.mark.parametrize("block,warps,k_tile,stages", [((128, 128), (2, 2), 32, 4), ((128, 128), (2, 2), 32, 2),
                                                       ((64, 128), (2, 2), 32, 4), ((128, 256), (2, 4), 32, 3),
                                                       ((64, 64), (2, 2), 64, 3)])
@pytest.mark.parametrize("m,n,k", [(1000, 1000, 1000), (512, 512, 40), (4096, 4096, 4096), (1000, 1000, 1023)])
def test_pipelined_mainloop_points_on_gpu(block: tuple[int, int], warps: tuple[int, int], k_tile: int, stages: int,
                                          m: int, n: int, k: int) -> None:
    """fragment_pipeline: K of fewer tiles than stages (40), odd K (A by element loads), 4096^3."""
    plan = {"strategy": "manual", "reason": "test", "steps": [
        {"primitive": "tensorize", "args": {"stage": "C", "intrinsic": "auto", "block": list(block),
                                            "warps": list(warps), "k_tile": k_tile, "stages": stages,
                                            "fragment_pipeline": True}}]}
    _run(m, n, k, "float16", out="float16", plan=plan)
