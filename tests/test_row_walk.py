"""The walk of a row kept in registers (fuse_rows' whole_steps) and the build's fallback where
ptxas spills it (pipeline.first_without_spills).

With whole_steps only the last step of a thread's unrolled walk tests the row's end
(`k < K_full || col < C`): the steps below are straight-line code, so ptxas issues the row's
loads together. The planner takes it for rows that fill the registers (row_fused.fills_registers:
the cross-entropy over 50,304 logits), and the build falls back to the plan that tests every step
where the straight-line code spills (and, for the row-walking kernels of a normalization's
backward, the other way round). Checked in the emulator against float64 NumPy (outputs
poisoned), on the CUDA C, and with NVRTC (no GPU needed)."""

from __future__ import annotations

import secrets
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import tecc as tc
from tecc.compiler import pipeline
from tecc.compiler.plan import Plan, Step
from tecc.compiler.strategies.row_fused import fills_registers, propose

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import norms  # noqa: E402
import row_backward as rb  # noqa: E402

NP = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
TOL = {"float32": 2e-5, "bfloat16": 2e-2}


def _plan(**args):
    return Plan((Step("fuse_rows", args),), "row_fused", "")


def _close(got, want, dtype, what):
    scale = max(np.abs(want).max(), 1e-30)
    err = np.abs(got.astype(np.float64) - want).max() / scale
    assert np.isfinite(got.astype(np.float64)).all(), f"{what}: NaN/inf in the output (unwritten?)"
    assert err <= TOL[dtype], f"{what}: off by {err:.2e} of the largest value"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("vocab,threads,vector", [(1003, 128, 1), (2051, 64, 1), (1000, 64, 4)])
def test_the_straight_walk_gives_the_loss_and_gradient_of_every_step(dtype, vocab, threads, vector):
    """Cross-entropy's loss and dX as one row kernel, each thread's last step past the row's end
    in some threads only: the same results with and without whole_steps, both against float64."""
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    args = rb.cross_entropy_forward_backward(5, vocab, dtype)
    x = (rng.standard_normal((5, vocab)) * 2).astype(NP[dtype])
    t = rng.integers(0, vocab, 5).astype(np.int32)
    dloss = rng.standard_normal(5).astype(np.float32)
    x64 = x.astype(np.float64)
    for whole in (False, True):
        step = {"threads": threads, "cache": "registers", "vector": vector, "float_rows": dtype == "bfloat16"}
        if whole:
            step["whole_steps"] = True
        k = tc.build(args, target="sim", plan=_plan(**step))
        loss, dx = np.full(5, np.nan, np.float32), np.full((5, vocab), np.nan, NP[dtype])
        k(x, t, dloss, loss, dx)
        what = f"{dtype} {vocab} {step} (seed {seed})"
        _close(loss, rb.np_cross_entropy(x64, t)[0], "float32", f"loss {what}")
        _close(dx, rb.np_cross_entropy_backward(x64, t, dloss.astype(np.float64))[0], dtype, f"dX {what}")


@pytest.mark.parametrize("op", ["softmax", "layer_norm"])
def test_the_straight_walk_of_a_forward_row_matches_numpy(op):
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    args = list(norms.softmax(7, 999, "float32")) if op == "softmax" else list(norms.layer_norm(7, 999, "float32"))
    ins = [rng.standard_normal(tuple(int(d) for d in t.shape)).astype(np.float32) for t in args[:-1]]
    want = norms.np_softmax(ins[0]) if op == "softmax" else norms.np_layer_norm(*ins)
    k = tc.build(args, target="sim", plan=_plan(threads=128, cache="registers", whole_steps=True))
    out = np.full((7, 999), np.nan, np.float32)
    k(*ins, out)
    _close(out, want, "float32", f"{op} with whole_steps (seed {seed})")


def test_only_the_last_step_tests_the_rows_end():
    args = rb.cross_entropy_forward_backward(8192, 50304, "bfloat16")
    straight = tc.build(args, target="sim", plan=_plan(threads=512, cache="registers", vector=2, float_rows=True,
                                                        whole_steps=True)).source
    every = tc.build(args, target="sim", plan=_plan(threads=512, cache="registers", vector=2,
                                                     float_rows=True)).source
    # 50,304 = 49 whole steps of 512 x 2 columns and a last one that only some threads take
    assert "if (k < 49 || (k * 512 + tx) * 2 < 50304) {" in straight
    assert "if ((k * 512 + tx) * 2 < 50304) {" in every and "k < 49 ||" not in every


@pytest.mark.parametrize("dtype,vector", [("float32", None), ("bfloat16", 2)])
def test_a_row_that_fills_the_registers_walks_straight_with_4_byte_vectors(dtype, vector):
    """The cross-entropy over 50,304 logits as one program: 512 threads x 100 registers of row
    (fills_registers), one register per access, only the last step testing the row's end."""
    choice = propose(rb.cross_entropy_forward_backward(8192, 50304, dtype))
    assert choice is not None
    args = choice.plan.steps[0].args
    assert args["threads"] == 512 and args.get("vector") == vector and args["whole_steps"] is True, args
    assert fills_registers(50304, 512, vector or 1, 1)
    # the fallback where the straight walk spills: the point measured before (8-byte vectors, every step tested)
    (fallback,) = choice.fallbacks
    assert fallback.steps[0].args == {**{k: v for k, v in args.items() if k != "whole_steps"},
                                      "vector": 2 if dtype == "float32" else 4}
    # a row that leaves registers free, or one the threads divide, keeps the tested walk
    assert not propose(list(norms.softmax(8192, 1000, dtype))).plan.steps[0].args.get("whole_steps")
    assert not propose(list(norms.softmax(8192, 4096, dtype))).plan.steps[0].args.get("whole_steps")


def test_the_build_takes_the_first_plan_that_does_not_spill(monkeypatch):
    """first_without_spills compiles the plans in order and takes the first whose kernels do not
    spill; one plan is taken without compiling; all spilling gives the first."""
    args = list(norms.softmax(64, 1003, "float32"))
    plans = [_plan(threads=128, cache="registers", whole_steps=True), _plan(threads=128, cache="registers"),
             _plan(threads=256, cache="registers")]
    seen = []

    class Res:
        def __init__(self, spills):
            self.spill_stores = self.spill_loads = spills

    class Compiled:
        def __init__(self, spills):
            self.resources = {"Y_rows_kernel": Res(spills)}

    def fake(source, **_):
        seen.append(source)
        return Compiled(8 if len(seen) == 1 else 0), False

    monkeypatch.setattr(pipeline, "compile_cached", fake)
    assert pipeline.first_without_spills(args, plans, "sm_90", None) is plans[1]
    assert len(seen) == 2 and "k < 7 ||" in seen[0] and "k < 7 ||" not in seen[1]
    seen.clear()
    assert pipeline.first_without_spills(args, plans[:1], "sm_90", None) is plans[0] and not seen
    monkeypatch.setattr(pipeline, "compile_cached", lambda source, **_: (Compiled(4), False))
    assert pipeline.first_without_spills(args, plans, "sm_90", None) is plans[0]


# ---- NVRTC (no GPU needed) --------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_planned_kernels_over_50304_columns_compile_without_spills(arch, dtype):
    """Every row kernel over a row of 50,304 (the forwards of softmax, layer and RMS norm, the
    cross-entropy's forward and its one program) compiles without spills: the straight walk, or
    where it spilled (RMS norm's forward in bf16) the tested one the build fell back to."""
    programs = {"softmax": list(norms.softmax(8192, 50304, dtype)), "layer_norm": list(norms.layer_norm(8192, 50304, dtype)),
                "rms_norm": list(norms.rms_norm(8192, 50304, dtype)),
                "ce_forward": list(rb.cross_entropy_backward(8192, 50304, dtype).forward),
                "ce_one_program": rb.cross_entropy_forward_backward(8192, 50304, dtype)}
    for name, args in programs.items():
        k = tc.build(args, target="cuda", arch=arch)
        for kernel, res in k.resources.items():
            assert res.spill_stores == 0 and res.spill_loads == 0, f"{name} {kernel} {dtype} {arch}: {res}, {k.plan}"
