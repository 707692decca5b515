"""The planner: a valid plan for every example op (checked against NumPy in the emulator),
the reasons it records, explain(), and how long planning takes."""

import runpy
import time
from pathlib import Path

import numpy as np
import pytest

import tecc as tc
from tecc.compiler.check import run_and_compare
from tecc.compiler.cost.analysis import analyze_kernel
from tecc.compiler.explain import explain
from tecc.compiler.plan import Plan
from tecc.compiler import build
from tecc.compiler.planner import candidates_for, plan_program
from tecc.compiler.schedule import Schedule
from tecc.ir.target import target
from tecc.passes.lower import lower

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _ops():
    for f in sorted(EXAMPLES.glob("*.py")):
        for op in runpy.run_path(str(f)).get("OPS", []):
            yield pytest.param(op, id=op.name)


@pytest.mark.parametrize("op", list(_ops()))
def test_the_planned_kernel_matches_numpy_in_the_emulator(op):
    result = plan_program(list(op.args), "sm_90", sizes=op.sizes)
    kernel = build(list(op.args), "sim", plan=result.plan)
    check = run_and_compare(op, kernel, use_sim=True, seed=1)
    assert check.ok, f"{check}\n{result.plan}"
    # the plan is JSON and replays to the same kernel
    again = build(list(op.args), "sim", plan=Plan.from_json(result.plan.to_json()))
    assert str(again.module) == str(kernel.module)
    assert result.plan.reason and result.plan.strategy


def _matmul(m, n, k):
    A = tc.placeholder((m, k), "float32", name="A")
    B = tc.placeholder((k, n), "float32", name="B")
    r = tc.reduce_axis(k, name="k")
    C = tc.compute((m, n), lambda i, j: tc.sum(A[i, r] * B[r, j], axis=r), name="C")
    return [A, B, C]


@pytest.mark.parametrize("op", list(_ops()))
def test_an_auto_build_compiles_the_planners_schedule_which_is_what_its_plan_replays_to(op, tmp_path):
    auto = build(list(op.args), "sim", sizes=op.sizes)
    replayed = build(list(op.args), "sim", plan=Plan.from_json(auto.plan.to_json()))
    assert auto.source == replayed.source, auto.plan
    assert str(auto.module) == str(replayed.module)
    # with dumps on, the plan is replayed primitive by primitive so that each step has its file
    dumped = build(list(op.args), "sim", sizes=op.sizes, dump_ir=tmp_path)
    assert dumped.source == auto.source
    assert (tmp_path / "00_lower.txt").exists()


def test_gemm_is_planned_with_tiling_and_explained():
    result = plan_program(_matmul(2048, 2048, 2048), "sm_90")
    assert result.plan.strategy in ("gemm", "gemm_pipelined")
    assert any(s.primitive == "cache_read" for s in result.plan.steps)
    text = explain(result)
    assert "chosen: gemm" in text and "runners-up" in text
    assert "smem" in text and "> 48 KiB without opt-in" in text          # a rejected point and why
    assert "registers/thread" in text and "block(s)/SM" in text


def test_planning_a_gemm_takes_well_under_a_second():
    args = _matmul(2048, 2048, 2048)
    plan_program(args, "sm_90")                                           # warm imports
    # CPU time of this process (its threads included), not wall time: other processes on a loaded
    # machine (CI runs on two cores) stretch the wall clock, not the work. Recorded in
    # docs/cost-model.md; the search is the planner's own time, the rest is the schedule
    # primitives that build runs anyway
    start = time.process_time()
    result = plan_program(args, "sm_90")
    total = time.process_time() - start
    assert total < 1.0, (total, result.search_seconds)


def _sample(cands, n):
    step = max(1, len(cands) // n)
    return cands[::step][:n]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["gemm", "reduction", "elementwise"])
def test_candidates_of_every_strategy_are_correct_in_the_emulator(strategy):
    if strategy == "gemm":
        args = _matmul(40, 72, 24)
        ref = lambda a, b: a @ b  # noqa: E731
    elif strategy == "reduction":
        x = tc.placeholder((70, 50), "float32", name="x")
        c = tc.reduce_axis(50, name="c")
        args = [x, tc.compute((70,), lambda r: tc.max(x[r, c], axis=c), name="m")]
        ref = lambda x: x.max(axis=-1)  # noqa: E731
    else:
        x = tc.placeholder((33, 64), "float32", name="x")
        a = tc.placeholder((64,), "float32", name="a")
        args = [x, a, tc.compute((33, 64), lambda i, j: x[i, j] * a[j] + 1.0, name="y")]
        ref = lambda x, a: x * a + 1.0  # noqa: E731
    info = analyze_kernel(lower(args).kernels[0])
    cands, _ = candidates_for(info, target("sm_90"), only=[strategy])
    valid = sorted((c for c in cands if c.cost.ok), key=lambda c: c.cost.total)
    spec = tc.OpSpec(strategy, args, ref)
    for cand in _sample(valid, 6):
        sch = Schedule(args)
        cand.strategy.apply(sch, info, cand.point)
        kernel = build(args, "sim", plan=Plan(sch.plan.steps, strategy))
        check = run_and_compare(spec, kernel, use_sim=True, seed=2)
        assert check.ok, f"{cand.label}: {check}"


def test_symbolic_sizes_are_assumed_and_said_so():
    M = tc.var("M")
    A = tc.placeholder((M, 64), "float32", name="A")
    B = tc.placeholder((64, 64), "float32", name="B")
    r = tc.reduce_axis(64, name="k")
    C = tc.compute((M, 64), lambda i, j: tc.sum(A[i, r] * B[r, j], axis=r), name="C")
    result = plan_program([A, B, C], "sm_90")
    assert "assumed sizes" in explain(result) and "M=1024" in explain(result)
    sized = plan_program([A, B, C], "sm_90", sizes={"M": 8})
    assert "assumed sizes" not in explain(sized)


def _sin_affine(R, C, dtype):
    X = tc.placeholder((R, C), dtype, name="X")
    b = tc.placeholder((C,), dtype, name="b")
    Y = tc.compute((R, C), lambda r, j: tc.cast(tc.sin(1.5 * tc.cast(X[r, j], "float32") + tc.cast(b[j], "float32")),
                                                dtype), name="Y")
    return [X, b, Y]


def test_elementwise_issue_term_prices_precise_sin_and_breaks_the_bf16_tie(monkeypatch):
    import dataclasses

    from tecc.ir.target import target as make_target
    # with the precise sinf (the cheap sin_approx makes it DRAM-bound: tests/test_approx_math.py)
    monkeypatch.setenv("TECC_PRECISE_MATH", "1")
    # an H200-like part (sm_90 at 4.8 TB/s): bf16 sin(a*x+b) is issue-bound there, so the
    # 64-thread grid-stride point no longer wins a DRAM-bound tie
    h200 = dataclasses.replace(make_target("sm_90"), dram_bandwidth=4.8e12)
    result = plan_program(_sin_affine(16384, 4096, "bfloat16"), h200)
    text = explain(result)
    assert "instructions/element" in text, text
    kp = result.kernels[0]
    assert kp.chosen.cost.bound == "issue", text
    assert kp.chosen.point["mode"] != "grid_stride" or kp.chosen.point["threads"] != 64, text


def test_every_strategy_module_loads():
    """A strategy file that fails to import is skipped by load_all (one broken file must not
    take planning down), so its error must fail here instead of going unnoticed."""
    from tecc.compiler.strategies import registry

    registry.load_all()
    assert registry.LOAD_ERRORS == {}, registry.LOAD_ERRORS


def test_a_kernel_past_every_register_bound_is_still_planned_naive():
    # a reduction whose body reads 100 tensors (what inlining makes of a model's gradient sums):
    # one thread per output is estimated past 255 registers; when no other strategy takes the
    # kernel the planner must still give the naive schedule (ptxas spills) rather than fail
    xs = [tc.placeholder((16, 8), "float32", name=f"x{n}") for n in range(100)]
    j = tc.reduce_axis(8, name="j")

    def body(i):
        total = xs[0][i, j]
        for x in xs[1:]:
            total = total + x[i, j]
        return tc.sum(total, axis=j)

    s = tc.compute((16,), body, name="s")
    result = plan_program([*xs, s], "sm_90", only=())  # naive alone: its estimate is 310 registers
    (kp,) = result.kernels
    assert kp.chosen.strategy.uses_default_schedule, kp.chosen.label
    assert not kp.chosen.cost.ok  # chosen although it breaks the register bound
    f = tc.build([*xs, s], target="sim")
    arrays = [np.random.default_rng(n).standard_normal((16, 8)).astype(np.float32) for n in range(100)]
    out = np.full(16, np.nan, np.float32)
    f.sim(*arrays, out)
    want = sum(a.astype(np.float64) for a in arrays).sum(1)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-4)
