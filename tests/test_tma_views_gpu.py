"""The TMA ring over merged views (tests/test_tma_views.py) on a real sm_90 GPU (skipped elsewhere):
tensor maps whose dimensions merge runs of the array's (x.view(B*T, C) of a contiguous
[B, T, C] read as one [B·T, C] map) encoded by the driver and run, against torch in float64
under tests/test_tensorize_gpu.py's bound ((K + 1)·2⁻²³·Σ|a·b|, plus one rounding of a 16-bit
output); outputs start as NaN, inputs are fresh random values. Time GPT-2's GEMMs with
`python benchmarks/gemm_model.py`."""

from __future__ import annotations

from typing import Any, Callable

import pytest
from test_tma_views import linear, linear_3d, tma_plan, weight_gradient

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                                 reason="needs an sm_90 GPU")]

import tecc as tc  # noqa: E402

TORCH = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
EPS = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 0.0}


def run_on_gpu(case: Any, plan: Any, k: int, seed: int) -> Any:
    tensors, reference = case
    f = tc.build(tensors, plan=plan)
    g = torch.Generator(device="cuda").manual_seed(seed)
    inputs = [torch.randn(tuple(int(str(d)) for d in t.shape), device="cuda", generator=g).to(TORCH[t.dtype.name])
              for t in tensors[:-1]]
    out_t = tensors[-1]
    out = torch.full(tuple(int(str(d)) for d in out_t.shape), float("nan"), device="cuda", dtype=TORCH[out_t.dtype.name])
    f(*inputs, out)
    torch.cuda.synchronize()
    wide = [x.double() for x in inputs]
    exact = reference(*wide)
    bound = (k + 1) * 2.0**-23 * reference(*[x.abs() for x in wide])
    bound = bound + EPS[out_t.dtype.name] * (exact.abs() + bound)
    err = (out.double() - exact).abs() - bound
    assert not torch.isnan(out).any() and (err <= 0).all(), (f.plan.reason, float(err.max()))
    return f


def _t(x: Any) -> Any:
    return x.transpose(-1, -2)


def _linear(B: int, T: int, K: int, N: int, dtype: str) -> Any:
    tensors, _ = linear(B, T, K, N, dtype, dtype)
    return tensors, lambda x, w: x.reshape(B * T, K) @ _t(w)


def _linear_3d(B: int, T: int, K: int, N: int, dtype: str) -> Any:
    tensors, _ = linear_3d(B, T, K, N, dtype, dtype)
    return tensors, lambda x, w: x @ _t(w)


def _weight_gradient(B: int, T: int, C: int, N: int, dtype: str) -> Any:
    tensors, _ = weight_gradient(B, T, C, N, dtype, "float32")
    return tensors, lambda x, dy: _t(x.reshape(B * T, C)) @ dy.reshape(B * T, N)


@pytest.mark.parametrize("make,k,plan", [
    (lambda: _linear(8, 1024, 768, 2304, "bfloat16"), 768, tma_plan((128, 256), 3, "tma", 132)),   # GPT-2 qkv
    (lambda: _linear(3, 100, 72, 40, "float16"), 72, tma_plan((128, 64), 3, "tma")),                # M, N, K edges
    (lambda: _linear_3d(3, 100, 136, 264, "bfloat16"), 136, tma_plan((64, 128), 2, "tma", 4)),       # 3-D output
    (lambda: _weight_gradient(8, 1024, 768, 3072, "bfloat16"), 8192, tma_plan((128, 256), 4, "registers", 132)),
    (lambda: _weight_gradient(3, 100, 72, 40, "float16"), 300, tma_plan((64, 64), 2)),
])
def test_merged_view_tma_gemms_on_gpu(make: Callable[[], Any], k: int, plan: Any) -> None:
    f = run_on_gpu(make(), plan, k, seed=k)
    assert any(m.merge for kernel in f.host.kernels for m in kernel.tensor_maps)


def test_the_planned_qkv_gemm_takes_the_tma_ring_and_computes_it() -> None:
    f = run_on_gpu(_linear(8, 1024, 768, 2304, "bfloat16"), "auto", 768, seed=1)
    assert "TMA" in f.plan.reason, f.plan.reason
