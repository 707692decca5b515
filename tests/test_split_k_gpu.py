"""split_k on a real GPU (skipped without one): the tensor-core kernels with each output tile's k
tiles divided among blocks and the float32 partials summed in split order by the last block to
arrive (tecc/passes/schedule/split_k.py), against torch in float64 under
tests/test_tensorize_gpu.py's bound; outputs start as NaN, inputs are fresh random values. The
hand-over (fence, atomic count, L2 reads of the partials) is what only the GPU can check, and so
is determinism: the last block differs from launch to launch, the bits must not. Time the shapes
with `python benchmarks/gemm_small.py`."""

from __future__ import annotations

from typing import Any

import pytest
from tensor_core_steps import schedule_tensor_core
from test_tensorize_gpu import TORCH, _contraction, _run

import tecc as tc
from tecc.compiler.schedule import Schedule

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                            reason="needs an sm_90 GPU (wgmma)")

WGMMA_COPY = dict(intrinsic="wgmma", block=(128, 128), warps=(8, 1), k_tile=64, stages=4)
WGMMA_TMA = dict(intrinsic="wgmma", block=(128, 256), warps=(8, 1), k_tile=64, stages=3, producer="tma")
MMA = dict(intrinsic="auto", block=(128, 128), warps=(4, 2), k_tile=32, stages=4)


def split_plan(m: Any, n: int, k: int, dtype: str, splits: int, steps: dict[str, Any], **shape: Any) -> Any:
    tensors = _contraction(m, n, k, dtype, **shape)
    return schedule_tensor_core(Schedule(tensors), splits=splits, **steps).plan


WGMMA_CASES = [
    ("wgmma cp.async ring", WGMMA_COPY, 4, 1000, 1000, 1000),
    ("wgmma cp.async ring, odd K (element loads)", WGMMA_COPY, 2, 1000, 1000, 1023),
    ("wgmma TMA ring, one block per part", WGMMA_TMA, 4, 1024, 1024, 8192),
    ("wgmma TMA ring, persistent, TMA-store epilogue", dict(WGMMA_TMA, persistent=132, epilogue="tma"), 4,
     1024, 1024, 8192),
    # 9 k tiles in 2 parts of 5: the last part's fifth TMA box lies wholly past K (zero-filled);
    # N = 704: B's rows of 1408 bytes are a multiple of 16 (TMA's stride alignment; 700 is refused
    # by the primitive), and 704 = 5.5 column tiles keeps a partial one
    ("wgmma TMA ring, a box past K", dict(WGMMA_TMA, block=(64, 128), warps=(4, 1)), 2, 520, 704, 520),
    ("wgmma TMA ring, one consumer warpgroup, persistent", dict(WGMMA_TMA, block=(64, 128), warps=(4, 1),
                                                                persistent=132), 3, 777, 1000, 3000),
]


def case_out(steps: dict[str, Any], dtype: str) -> str:
    return dtype if steps.get("epilogue") == "tma" else "float32"


@hopper
@pytest.mark.parametrize("what,steps,splits,m,n,k", WGMMA_CASES)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_split_wgmma_on_gpu(what: str, steps: dict[str, Any], splits: int, m: int, n: int, k: int,
                            dtype: str) -> None:
    out = case_out(steps, dtype)
    _run(m, n, k, dtype, out=out, plan=split_plan(m, n, k, dtype, splits, steps, out=out))


def test_split_mma_sync_on_gpu() -> None:
    _run(1000, 1000, 1000, "float16", plan=split_plan(1000, 1000, 1000, "float16", 4, MMA))
    _run(127, 4096, 1023, "bfloat16", plan=split_plan(127, 4096, 1023, "bfloat16", 2, MMA))


BATCHED_STEPS = [WGMMA_COPY, dict(WGMMA_TMA, persistent=132, epilogue="tma")]


def symbolic_rows_out(steps: dict[str, Any]) -> str:
    """The output dtype of the symbolic-rows case: float32, but float16 with the TMA-store
    epilogue, whose 128 x 256 float32 staging tile (128 KiB) beside the 3-stage ring (144 KiB)
    is over the 227 KiB a block may have (tests/test_split_k.py checks every plan here fits)."""
    return "float16" if steps.get("epilogue") == "tma" else "float32"


def batched_plans(steps: dict[str, Any]) -> list[tuple[dict[str, Any], Any]]:
    """The plans of test_batched_split_with_bias_relu_and_symbolic_rows_on_gpu: (the contraction's
    shape arguments, plan)."""
    batched = dict(m=256, n=512, k=4096, dtype="float16", batch=6, out="float16", relu_bias=True)
    rows = dict(m=tc.var("M"), n=512, k=2048, dtype="float16", out=symbolic_rows_out(steps))
    return [(shape, split_plan(shape["m"], shape["n"], shape["k"], shape["dtype"], splits, steps,
                               **{x: shape[x] for x in shape if x not in ("m", "n", "k", "dtype")}))
            for shape, splits in ((batched, 4), (rows, 2))]


@hopper
@pytest.mark.parametrize("steps", BATCHED_STEPS)
def test_batched_split_with_bias_relu_and_symbolic_rows_on_gpu(steps: dict[str, Any]) -> None:
    (batched, plan), (rows, symbolic_plan) = batched_plans(steps)
    _run(256, 512, 4096, "float16", batch=6, out="float16", relu_bias=True, plan=plan)
    for m in (1000, 77, 3000):   # the partials and counters grow, and keep their zero prefix
        _run(m, 512, 2048, "float16", symbolic=True, out=rows["out"], plan=symbolic_plan)


@pytest.mark.parametrize("steps", [MMA] + ([WGMMA_COPY, dict(WGMMA_TMA, persistent=132, epilogue="tma")]
                                           if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
                                           else []))
def test_split_k_results_are_bit_identical_launch_to_launch(steps: dict[str, Any]) -> None:
    """Which block of a tile arrives last changes from launch to launch; the sum's order (split
    0, 1, ..., S - 1) does not, so neither do the bits."""
    m, n, k = 1024, 1024, 8192
    f = tc.build(_contraction(m, n, k, "float16", out="float16"),
                 plan=split_plan(m, n, k, "float16", 4, steps, out="float16"))
    g = torch.Generator(device="cuda").manual_seed(5)
    a = torch.randn(m, k, device="cuda", generator=g).to(TORCH["float16"])
    b = torch.randn(k, n, device="cuda", generator=g).to(TORCH["float16"])
    first = torch.full((m, n), float("nan"), device="cuda", dtype=torch.float16)
    f(a, b, first)
    again = torch.empty_like(first)
    for _ in range(20):
        again.fill_(float("nan"))
        f(a, b, again)
        torch.cuda.synchronize()
        assert torch.equal(first.view(torch.int16), again.view(torch.int16))


@hopper
def test_the_planners_split_at_1024_1024_8192_on_gpu() -> None:
    f = _run(1024, 1024, 8192, "float16", out="float16", strategies=("gemm_wgmma",))
    assert "split_k" in [s.primitive for s in f.plan.steps], f.plan.reason
    # the register epilogue (timed 37.1 us against the TMA-store one's 42.7: gemm_split.py)
    assert "epilogue" not in [s.primitive for s in f.plan.steps], f.plan.reason
