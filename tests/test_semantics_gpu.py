"""docs/semantics.md on the GPU: every case of tests/semantics_cases.py built for CUDA, run on
the device and in the emulator on the same fresh inputs, and held to each other (integers bit
for bit, floats value for value with NaN equal to NaN) and to the NumPy reference. This is what
makes the emulator a faithful oracle for the values the GPU computes at the edges: integer
overflow, division by zero, float -> int of NaN and out-of-range values, NaN in max / min."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from semantics_cases import all_cases, same  # tests/ is on sys.path

pytestmark = pytest.mark.gpu

CASES = {c.name: c for c in all_cases()}


@pytest.mark.parametrize("name", sorted(CASES))
def test_gpu_and_emulator_agree_at_the_edges(name: str) -> None:
    case = CASES[name]
    inputs = case.inputs(np.random.default_rng(zlib.crc32(name.encode()) + 1))
    kernel = case.build("cuda")
    on_gpu, in_sim = case.outputs(), case.outputs()
    kernel(*inputs, *on_gpu)
    kernel.sim(*inputs, *in_sim)
    for k, (gpu, sim, want) in enumerate(zip(on_gpu, in_sim, case.reference(*inputs))):
        ok, why = same(gpu, sim)
        assert ok, f"{name}, output {k}: GPU vs emulator: {why}\nplan {kernel.plan}"
        ok, why = same(gpu, want)
        assert ok, f"{name}, output {k}: GPU vs NumPy reference: {why}\nplan {kernel.plan}"
