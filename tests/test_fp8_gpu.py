"""fp8 contractions on a real GPU (skipped without one; sm_90 for wgmma), against float64.

Bound (tests/test_fp8.py): fp8 inputs and their products are exact; the tensor core sums in
float32, 2⁻²³ per addition, so |C - A·Bᵀ| <= (K + 1)·2⁻²³·(|A|·|B|ᵀ), plus half an ulp of a
16-bit output. Inputs are torch fp8 tensors (torch.float8_e4m3fn / float8_e5m2) of fresh random
values, the reference their float64 product; outputs start as NaN.
"""

from __future__ import annotations

import pytest

import tecc as tc
from test_fp8 import OUT_EPS, fp8_contraction, wgmma_plan

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                                 reason="needs an sm_90 GPU (wgmma)")]
TORCH_FP8 = {"float8_e4m3": "float8_e4m3fn", "float8_e5m2": "float8_e5m2"}


def _run(m: int, n: int, k: int, dtype: str, out: str = "float32", batch: int = 0, symbolic: bool = False,
         plan: object = "auto") -> None:
    tensors = fp8_contraction(tc.var("M") if symbolic else m, n, k, dtype, out, batch)
    f = tc.build(tensors, plan=plan, sizes={"M": m} if symbolic else None)
    if plan == "auto":
        assert f.plan.strategy == "gemm_wgmma_fp8", f.plan.reason
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
    acc = (k + 1) * 2.0**-23 * (a64.abs() @ b64.abs())
    bound = acc + OUT_EPS[out] * (exact.abs() + acc)
    got = c.double()
    err = torch.where(torch.isnan(got), torch.full_like(got, float("inf")), (got - exact).abs() - bound)
    bad = int((err > 0).sum())
    assert bad == 0, f"{f.plan.reason}: {bad} of {err.numel()} elements off (worst excess {float(err.max()):.3g})"


@pytest.mark.parametrize("dtype", ["float8_e4m3", "float8_e5m2"])
@pytest.mark.parametrize("m,n,k,out", [(4096, 4096, 4096, "bfloat16"), (1000, 1000, 1000, "float32"),
                                       (127, 4096, 1040, "float16")])
def test_fp8_gemm_on_gpu(m: int, n: int, k: int, out: str, dtype: str) -> None:
    _run(m, n, k, dtype, out)


def test_fp8_batched_symbolic_on_gpu() -> None:
    _run(300, 256, 512, "float8_e4m3", batch=3, symbolic=True)


@pytest.mark.parametrize("block,stages", [((64, 64), 2), ((128, 128), 4), ((128, 256), 3)])
def test_explicit_fp8_wgmma_points_on_gpu(block: tuple[int, int], stages: int) -> None:
    _run(1000, 1000, 1024, "float8_e4m3", plan=wgmma_plan(block, stages))
