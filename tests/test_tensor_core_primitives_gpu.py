"""Every prefix of a tensor-core plan on a real GPU (skipped elsewhere): the kernels the
primitives leave between tensorize and the last step -- element-loaded plain tiles, one buffer,
the TMA ring before warp specialization -- are never planned, but each is a kernel that must
run and match torch in float64 under tests/test_tensorize_gpu.py's bound; the last prefix is the
planned kernel. tests/test_tensor_core_primitives.py runs the same prefixes in the emulator."""

from __future__ import annotations

from typing import Any

import pytest
from test_tensorize_gpu import _contraction, _run

import tecc as tc
from tecc.compiler.plan import Plan
from tensor_core_steps import schedule_tensor_core

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def hopper() -> bool:
    return torch.cuda.get_device_capability()[0] == 9


FORMS: dict[str, tuple[tuple[int, int, int, str, str], dict[str, Any], bool]] = {
    "mma.sync f16, 4 stages": ((1000, 1000, 1000, "float16", "float32"),
                               dict(block=(128, 128), warps=(2, 2), k_tile=32, stages=4), False),
    "mma.sync bf16, fragments pipelined, staged epilogue": (
        (1024, 1024, 1000, "bfloat16", "bfloat16"),
        dict(block=(128, 128), warps=(2, 2), k_tile=32, stages=4, fragment_pipeline=True, staged_output=True), False),
    "wgmma cp.async ring": ((1000, 1000, 1000, "float16", "float32"),
                            dict(intrinsic="wgmma", block=(128, 256), warps=(8, 1), k_tile=64, stages=4), True),
    "wgmma TMA ring, warp-specialized, persistent, TMA-store epilogue": (
        (1024, 1024, 1024, "float16", "float16"),
        dict(intrinsic="wgmma", block=(128, 256), warps=(8, 1), k_tile=64, stages=3, producer="tma", persistent=-1,
             epilogue="tma"), True),
}


@pytest.mark.parametrize("form", FORMS)
def test_every_prefix_of_the_plan_matches_torch_on_gpu(form: str) -> None:
    (m, n, k, dtype, out), schedule, needs_hopper = FORMS[form]
    if needs_hopper and not hopper():
        pytest.skip("needs an sm_90 GPU")
    schedule = dict(schedule)
    if schedule.get("persistent") == -1:
        schedule["persistent"] = torch.cuda.get_device_properties(0).multi_processor_count
    tensors = _contraction(m, n, k, dtype, False, False, 0, out, False)
    steps = schedule_tensor_core(tc.Schedule(tensors), "C", **schedule).plan.steps
    for count in range(1, len(steps) + 1):
        _run(m, n, k, dtype, out=out, plan=Plan(tuple(steps[:count]), "manual", f"{form}: {count} steps"))
