"""fp8 contractions on a real GPU (skipped without one; wgmma needs sm_90), against float64.

Bound (tests/test_fp8.py): fp8 inputs and their products are exact; float32 accumulation gives
|C - A·Bᵀ| <= (K + 1)·2⁻²³·(|A|·|B|ᵀ), plus half an ulp of a 16-bit output; the tensor core's fp8
accumulation keeps fewer bits than float32, so the GPU bound adds `hardware_accumulation`
(2⁻¹³ of the running sum plus the step's Σ|a|·|b| after each k32 step). Inputs are fresh random values, the reference their float64 product, outputs start
as NaN. Each case runs on NumPy arrays of ml_dtypes fp8 (host staging) and, where torch is
importable, on torch.float8_e4m3fn / float8_e5m2 CUDA tensors (the device path).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import tecc as tc
from tecc.ir import dtype as dt
from gpu_checks import check_on_gpu
from test_fp8 import OUT_EPS, check_fp8, fp8_contraction, hardware_accumulation, wgmma_plan

pytestmark = pytest.mark.gpu
TORCH_FP8 = {"float8_e4m3": "float8_e4m3fn", "float8_e5m2": "float8_e5m2"}


def _sm90() -> None:
    from tecc.runtime.cuda import current_device, device_arch

    if device_arch(current_device()) != "sm_90":
        pytest.skip("wgmma needs an sm_90 GPU")


def _build(m: int, n: int, k: int, dtype: str, out: str, batch: int, symbolic: bool, plan: Any) -> Any:
    tensors = fp8_contraction(tc.var("M") if symbolic else m, n, k, dtype, out, batch)
    f = tc.build(tensors, plan=plan, sizes={"M": m} if symbolic else None)
    if plan == "auto":
        assert f.plan.strategy == "gemm_wgmma_fp8", f.plan.reason
    return f


def _run_numpy(m: int, n: int, k: int, dtype: str, out: str = "float32", batch: int = 0, symbolic: bool = False,
               plan: Any = "auto") -> None:
    _sm90()
    f = _build(m, n, k, dtype, out, batch, symbolic, plan)
    lead = (batch,) if batch else ()
    g = np.random.default_rng()
    npd = dt.as_dtype(dtype).numpy
    a = (g.standard_normal(lead + (m, k)) * 3).astype(npd)
    b = (g.standard_normal(lead + (n, k)) * 3).astype(npd)
    c = np.full(lead + (m, n), np.nan, dt.as_dtype(out).numpy)
    f(a, b, c)
    a64, b64 = a.astype(np.float64), np.swapaxes(b.astype(np.float64), -1, -2)
    check_fp8(c, a64, b64, out, f.plan.reason, hardware=_hardware(a64, b64))


def _hardware(a64: np.ndarray, b64: np.ndarray) -> np.ndarray:
    """hardware_accumulation, on the GPU through torch when it is there (128 steps at K = 4096)."""
    try:
        import torch
    except ImportError:
        return np.asarray(hardware_accumulation(a64, b64))
    return hardware_accumulation(torch.from_numpy(a64).cuda(), torch.from_numpy(np.ascontiguousarray(b64)).cuda()).cpu().numpy()


def _run_torch(m: int, n: int, k: int, dtype: str, out: str = "float32", batch: int = 0, symbolic: bool = False,
               plan: Any = "auto") -> None:
    torch = pytest.importorskip("torch")
    _sm90()
    f = _build(m, n, k, dtype, out, batch, symbolic, plan)
    lead = (batch,) if batch else ()
    g = torch.Generator(device="cuda").manual_seed(m * 7 + n * 3 + k)
    tdt = getattr(torch, TORCH_FP8[dtype])
    a = (torch.randn(lead + (m, k), device="cuda", generator=g) * 3).to(tdt)
    b = (torch.randn(lead + (n, k), device="cuda", generator=g) * 3).to(tdt)
    c = torch.full(lead + (m, n), float("nan"), device="cuda", dtype=getattr(torch, out))
    f(a, b, c)
    torch.cuda.synchronize()
    a64, b64 = a.double(), b.double().transpose(-1, -2)
    exact = a64 @ b64
    acc = (k + 1) * 2.0**-23 * (a64.abs() @ b64.abs()) + hardware_accumulation(a64, b64)
    bound = acc + OUT_EPS[out] * (exact.abs() + acc)
    check_on_gpu(c, exact, bound, f.plan.reason)


RUNNERS = {"numpy": _run_numpy, "torch": _run_torch}


@pytest.mark.parametrize("host", ["numpy", "torch"])
@pytest.mark.parametrize("dtype", ["float8_e4m3", "float8_e5m2"])
@pytest.mark.parametrize("m,n,k,out", [(4096, 4096, 4096, "bfloat16"), (1000, 1000, 1000, "float32"),
                                       (127, 4096, 1040, "float16")])
def test_fp8_gemm_on_gpu(m: int, n: int, k: int, out: str, dtype: str, host: str) -> None:
    RUNNERS[host](m, n, k, dtype, out)


@pytest.mark.parametrize("host", ["numpy", "torch"])
def test_fp8_batched_symbolic_on_gpu(host: str) -> None:
    RUNNERS[host](300, 256, 512, "float8_e4m3", batch=3, symbolic=True)


@pytest.mark.parametrize("args", [
    {"block": (64, 64), "stages": 2}, {"block": (128, 128), "stages": 4},
    {"block": (128, 256), "stages": 3, "producer": "tma"},
    {"block": (128, 256), "stages": 3, "producer": "tma", "persistent": 132, "epilogue": "tma"}])
def test_explicit_fp8_wgmma_points_on_gpu(args: dict[str, Any]) -> None:
    plan = wgmma_plan(args["block"], args["stages"])
    plan["steps"][0]["args"].update({x: v for x, v in args.items() if x not in ("block", "stages")})
    _run_numpy(1000, 1000, 1024, "float8_e4m3", "bfloat16" if args.get("epilogue") else "float32", plan=plan)
