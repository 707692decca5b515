"""The wgmma path on a real sm_90 GPU (skipped elsewhere): the planner's choice for sm_90 and
explicit tensorize(intrinsic="wgmma") points, against torch in float64 under
tests/test_tensorize_gpu.py's bound ((K + 1)·2⁻²³·Σ|a·b|: the tensor core truncates its
float32 sums, plus one rounding of a 16-bit output); outputs start as NaN, inputs are fresh
random values. Time the design point with `python benchmarks/gemm.py --dtype float16`."""

from __future__ import annotations

from typing import Any

import pytest
from test_tensorize_gpu import _run

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                                 reason="needs an sm_90 GPU")]

WGMMA = ("gemm_wgmma",)


def wgmma_plan(block: tuple[int, int], stages: int) -> dict[str, Any]:
    return {"strategy": "manual", "reason": "test", "steps": [
        {"primitive": "tensorize", "args": {"stage": "C", "intrinsic": "wgmma", "block": list(block),
                                            "warps": [4 * block[0] // 64, 1], "k_tile": 64, "stages": stages}}]}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("m,n,k", [(1000, 1000, 1000), (4096, 4096, 4096)])
def test_the_planner_puts_sm_90_gemms_on_wgmma(m: int, n: int, k: int, dtype: str) -> None:
    f = _run(m, n, k, dtype, strategies=WGMMA)
    assert f.arch.endswith("a"), f.arch  # compiled for sm_90a


@pytest.mark.parametrize("a_t,b_t", [(True, False), (False, True), (True, True)])
def test_transposed_operands_on_wgmma(a_t: bool, b_t: bool) -> None:
    _run(1000, 1000, 1000, "float16", a_t=a_t, b_t=b_t, strategies=WGMMA)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_batched_wgmma(dtype: str) -> None:
    _run(512, 512, 512, dtype, batch=32, plan=wgmma_plan((128, 128), 4))


def test_odd_k_symbolic_m_and_a_fused_epilogue_on_wgmma() -> None:
    _run(1000, 1000, 1023, "bfloat16", plan=wgmma_plan((64, 128), 3))
    _run(77, 512, 256, "float16", symbolic=True, plan=wgmma_plan((64, 64), 2))
    _run(1024, 1024, 1024, "float16", out="float16", relu_bias=True, plan=wgmma_plan((128, 256), 4))


@pytest.mark.parametrize("block,stages", [((64, 64), 2), ((64, 128), 3), ((64, 256), 4), ((128, 64), 5),
                                          ((128, 128), 4), ((128, 256), 3), ((128, 256), 4)])
def test_explicit_wgmma_points(block: tuple[int, int], stages: int) -> None:
    _run(1000, 1000, 1000, "bfloat16", b_t=stages % 2 == 1, plan=wgmma_plan(block, stages))
