"""TF32 float32 contractions on a real GPU (skipped without one), against torch in float64.

Every element within ((1 + u)² - 1 + (K + 1)·2⁻²³·(1 + u)²)·Σ|a·b| with u = 2⁻¹¹: each input
rounded to tf32 by cvt.rna (10 mantissa bits, relative error <= u), products of the rounded
inputs exact, float32 accumulation in the mma that aligns and truncates (2⁻²³ per addition:
tests/test_tensorize_gpu.py). torch's own TF32 is left off, so the reference is exact float64.
Builds use `allow_tf32=True` (plan="auto") or name the tf32 intrinsic; the output starts as NaN.

On sm_90 plan="auto" takes the tf32 wgmma (gemm_wgmma_tf32) where the operands allow it: its
shared operands are read as stored, the tensor core ignoring the 13 low mantissa bits
(truncation), so those kernels are checked with u = 2⁻¹⁰ (tests/test_tf32_wgmma.py).
"""

from __future__ import annotations

from typing import Any

import pytest

import tecc as tc
from gpu_checks import check_on_gpu
from test_tf32 import TF32, U, contraction
from test_tf32_wgmma import tf32_wgmma_plan

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

def _sm90() -> bool:
    return torch.cuda.get_device_capability() == (9, 0)


def _auto_strategy(k_outermost: bool) -> str:
    """What plan="auto" takes on this GPU (both operands k-outermost stay on mma.sync)."""
    return "gemm_wgmma_tf32" if _sm90() and not k_outermost else "gemm_tensor_core_tf32"


def _run(m: int, n: int, k: int, *, a_t: bool = False, b_t: bool = False, batch: int = 0,
         relu_bias: bool = False, symbolic: bool = False, plan: Any = "auto") -> Any:
    torch.backends.cuda.matmul.allow_tf32 = False  # the float64 reference must not round
    tensors = contraction(tc.var("M") if symbolic else m, n, k, a_t=a_t, b_t=b_t, batch=batch, bias_relu=relu_bias)
    f = tc.build(tensors, plan=plan, sizes={"M": m} if symbolic else None, allow_tf32=True)
    if plan == "auto":
        assert f.plan.strategy in ("gemm_tensor_core_tf32", "gemm_wgmma_tf32"), f.plan.reason
        if min(m, n) >= 512:
            assert f.plan.strategy == _auto_strategy(a_t and not b_t), f.plan.reason
    wgmma = f.plan.strategy == "gemm_wgmma_tf32" or "wgmma" in str(plan)
    u = 2.0**-10 if wgmma else U   # shared tf32 wgmma operands are truncated (module docstring)
    lead = (batch,) if batch else ()
    g = torch.Generator(device="cuda").manual_seed(m * 7 + n * 3 + k)
    a = torch.randn(lead + ((k, m) if a_t else (m, k)), device="cuda", generator=g)
    b = torch.randn(lead + ((n, k) if b_t else (k, n)), device="cuda", generator=g)
    a64 = a.double().transpose(-1, -2) if a_t else a.double()
    b64 = b.double().transpose(-1, -2) if b_t else b.double()
    exact = a64 @ b64
    grow = (1 + u) ** 2
    bound = (grow - 1 + (k + 1) * 2.0**-23 * grow) * (a64.abs() @ b64.abs())
    args = [a, b]
    want = exact
    if relu_bias:
        bias = torch.rand(n, device="cuda", generator=g) * 8 - 4
        args.append(bias)
        want = torch.clamp(exact + bias.double(), min=0.0)
        bound = bound + 2.0**-24 * (exact.abs() + bias.double().abs() + bound)  # the float32 bias add
    c = torch.full(lead + (m, n), float("nan"), device="cuda")
    f(*args, c)
    torch.cuda.synchronize()
    check_on_gpu(c, want, bound, f.plan.reason)
    return f


# K = 1023: A by element loads; 1002: 8-byte cp.async for A
@pytest.mark.parametrize("m,n,k", [(1000, 1000, 1000), (4096, 4096, 4096), (127, 4096, 1023), (1000, 1000, 1002)])
def test_tf32_gemm_on_gpu(m: int, n: int, k: int) -> None:
    _run(m, n, k)


@pytest.mark.parametrize("a_t,b_t", [(True, False), (False, True), (True, True)])
def test_tf32_transposed_operands_on_gpu(a_t: bool, b_t: bool) -> None:
    _run(1000, 1000, 1000, a_t=a_t, b_t=b_t)


def test_tf32_batched_symbolic_and_epilogue_on_gpu() -> None:
    _run(512, 512, 512, batch=8)
    _run(1000, 512, 256, symbolic=True)
    _run(1024, 1024, 1024, relu_bias=True)


@pytest.mark.parametrize("block,warps,k_tile,stages", [((128, 128), (2, 2), 16, 4), ((128, 256), (2, 4), 16, 4),
                                                       ((64, 64), (2, 2), 32, 4), ((128, 128), (2, 4), 32, 3)])
def test_explicit_tf32_points_on_gpu(block: tuple[int, int], warps: tuple[int, int], k_tile: int, stages: int) -> None:
    plan = {"strategy": "manual", "reason": "test", "steps": [
        {"primitive": "tensorize", "args": {"stage": "C", "intrinsic": TF32, "block": list(block),
                                            "warps": list(warps), "k_tile": k_tile, "stages": stages}}]}
    _run(1000, 1000, 1000, b_t=True, plan=plan)
    _run(1000, 1000, 1000, a_t=True, plan=plan)


def test_tf32_off_keeps_float32_exact_on_gpu() -> None:
    """Without allow_tf32 the float32 product is within the float32 bound, far below TF32's."""
    m = n = k = 1024
    f = tc.build(contraction(m, n, k))
    assert f.plan.strategy not in ("gemm_tensor_core_tf32",), f.plan.reason
    a, b = torch.randn(m, k, device="cuda"), torch.randn(k, n, device="cuda")
    c = torch.full((m, n), float("nan"), device="cuda")
    f(a, b, c)
    torch.cuda.synchronize()
    exact = a.double() @ b.double()
    bound = (k + 1) * 2.0**-24 * (a.double().abs() @ b.double().abs())
    assert bool(((c.double() - exact).abs() <= bound).all()), f.plan.reason


# ---- Hopper: the tf32 wgmma (tests/test_tf32_wgmma.py) -------------------------------------------------

needs_sm90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                                reason="needs an sm_90 GPU (wgmma)")


@needs_sm90
@pytest.mark.parametrize("a_t,b_t", [(False, False), (False, True), (True, True)])
@pytest.mark.parametrize("m,n,k", [(4096, 4096, 4096), (1000, 1000, 1002)])
def test_tf32_wgmma_auto_plans_on_gpu(m: int, n: int, k: int, a_t: bool, b_t: bool) -> None:
    """plan="auto" on an H100/H200: the tf32 wgmma in every orientation it serves (Cᵀ = Bᵀ·Aᵀ for
    the plain product, register A for an m-contiguous A)."""
    f = _run(m, n, k, a_t=a_t, b_t=b_t)
    assert f.plan.strategy == "gemm_wgmma_tf32", f.plan.reason


@needs_sm90
@pytest.mark.parametrize("a_t,b_t", [(False, False), (False, True), (True, True)])
@pytest.mark.parametrize("m,n,k", [(127, 520, 1023), (1000, 70, 9), (333, 1000, 1001)])
def test_tf32_wgmma_edges_on_gpu(m: int, n: int, k: int, a_t: bool, b_t: bool) -> None:
    """Edges in M, N and K (odd K: element loads; K < one k tile) on the 128 x 128 point."""
    _run(m, n, k, a_t=a_t, b_t=b_t, plan=tf32_wgmma_plan((128, 128), 4, 2))


@needs_sm90
@pytest.mark.parametrize("block,groups,stages,a_t,b_t", [
    ((128, 128), 2, 4, False, False), ((256, 128), 2, 4, False, False), ((128, 64), 1, 4, False, False),
    ((128, 256), 2, 4, False, True), ((64, 128), 1, 3, False, True), ((128, 128), 2, 4, True, True),
    ((64, 64), 1, 2, False, False)])
def test_explicit_tf32_wgmma_points_on_gpu(block: tuple[int, int], groups: int, stages: int, a_t: bool,
                                           b_t: bool) -> None:
    _run(1000, 1000, 1000, a_t=a_t, b_t=b_t, plan=tf32_wgmma_plan(block, stages, groups))


@needs_sm90
@pytest.mark.parametrize("block,a_t,b_t", [((256, 128), False, False), ((128, 128), False, False),
                                           ((128, 256), False, True), ((128, 128), True, True)])
def test_tf32_wgmma_tma_ring_on_gpu(block: tuple[int, int], a_t: bool, b_t: bool) -> None:
    """The warp-specialized TMA ring with two consumer warpgroups (tensor maps encoded at launch)."""
    plan = tf32_wgmma_plan(block, 4, 2, producer="tma")
    _run(1000, 1000, 1000, a_t=a_t, b_t=b_t, plan=plan)
    _run(4096, 4096, 4096, a_t=a_t, b_t=b_t, plan=plan)
    _run(332, 520, 1000, a_t=a_t, b_t=b_t, plan=plan)   # rows a multiple of 16 bytes (TMA strides)


@needs_sm90
def test_tf32_wgmma_batched_symbolic_and_epilogue_on_gpu() -> None:
    _run(512, 512, 512, batch=8, plan=tf32_wgmma_plan((128, 128), 4, 2))
    _run(1000, 512, 256, symbolic=True, plan=tf32_wgmma_plan((128, 128), 4, 2))
    _run(1024, 1024, 1024, relu_bias=True, plan=tf32_wgmma_plan((256, 128), 4, 2))
