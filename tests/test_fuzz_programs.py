"""The differential fuzzer: random programs from the whole front end, built by tecc and run in
the emulator, against an independent NumPy interpretation (tests/program_gen.py).

Each example draws a program (nested and sibling reductions, reductions broadcast along other
axes, `where`, casts, float32/float64/int32/int64, sizes 0, 1, odd or symbolic) and builds it
four ways: with plan="auto" (TECC_STRICT_PLANS=1: a strategy that takes the program and then
fails is a bug, not a fallback), with the generic plan, with a random legal plan of the planner
(per kernel a random strategy whose guard holds and a random point of its space that the cost
model's hard constraints accept), and as a `Schedule` with random schedule primitives (those a
primitive refuses with ScheduleError are skipped; what is accepted must compute the right
answer). Every output is compared element by element with the interpretation, within a
tolerance derived from the dtype and the reduction lengths.

Profiles: the test suite runs TECC_FUZZ_EXAMPLES examples with the planner (default 25) and
three times as many in the cheaper tests (derandomized under the `ci` profile of
tests/conftest.py, so CI replays the same programs; ~27 s on 2 cores); `make fuzz` runs the long
profile (FUZZ_EXAMPLES=2000, fresh random draws). A failure it finds becomes a named regression
test in tests/test_fuzz_regressions.py.

What it found so far: the programs of the hardening issue (tests/test_build_fallback.py), a
column statistic broadcast along the rows of a square matrix that row fusion took for a row
statistic (tests/test_fuzz_regressions.py), and row fusion's cost dividing by the zero loads of an
empty row once every graph-level point was priced (tests/test_fusion_rows.py). The last test
prices and realizes a random point of every graph-level strategy that takes the program.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, note, settings
from hypothesis import strategies as st

import tecc as tc
from tecc.compiler.cost.analysis import analyze_kernel
from tecc.compiler.cost.model import predict
from tecc.compiler.plan import Plan
from tecc.compiler.planner import resolve_target
from tecc.compiler.schedule import Schedule
from tecc.compiler.strategies.registry import strategies
from tecc.ir.errors import ScheduleError
from tecc.passes.lower import lower

import program_gen as pg

EXAMPLES = int(os.environ.get("TECC_FUZZ_EXAMPLES", "25"))
HEALTH = [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large]
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=HEALTH)
# the builds without the planner's search are ~20x cheaper: three times the examples
FUZZ_CHEAP = settings(max_examples=3 * EXAMPLES, deadline=None, suppress_health_check=HEALTH)


def concrete_sizes(prog: pg.Program) -> dict[str, int]:
    return {n: prog.sizes[n] for n in prog.symbolic}


def run_and_compare(prog: pg.Program, f: Any, how: str) -> None:
    """Run `f` on fresh inputs and compare every output with the interpretation."""
    rng = np.random.default_rng(prog.sizes["R"] * 1009 + prog.sizes["C"])
    inputs = pg.make_inputs(prog, rng)
    try:
        want = pg.interpret(prog, inputs)
    except pg.Unrepresentable as exc:
        note(str(exc))
        assume(False)
        return
    outputs = []
    for s in prog.stages:
        if s.output:
            shape = pg.output_shape(prog, s)
            poison = np.nan if prog.is_float else np.iinfo(prog.dtype).max - 7
            outputs.append((s, np.full(shape, poison, pg.numpy_dtype(prog.dtype))))
    f(*inputs.values(), *(o for _, o in outputs))
    for s, got in outputs:
        pg.compare(prog, s, got, want[s.name], lambda: f"{how}\n{prog.describe()}\n{f.plan}")


@FUZZ
@given(prog=pg.programs(huge=True))
def test_random_programs_match_numpy_with_the_planners_choice(prog: pg.Program) -> None:
    note(prog.describe())
    args, _ = pg.to_tecc(prog)
    sizes = concrete_sizes(prog) or None
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TECC_STRICT_PLANS", "1")
        f = tc.build(args, target="sim", sizes=sizes)
    assert not f.fallbacks, f.fallbacks
    run_and_compare(prog, f, "plan=auto")


@FUZZ_CHEAP
@given(prog=pg.programs())
def test_random_programs_match_numpy_with_the_generic_plan(prog: pg.Program) -> None:
    note(prog.describe())
    args, _ = pg.to_tecc(prog)
    f = tc.build(args, target="sim", plan=tc.default_plan())
    run_and_compare(prog, f, "plan=generic")


def apply_random_primitives(sch: Schedule, stages: list[str], data: st.DataObject) -> None:
    """Random schedule primitives on random stages; refused ones (ScheduleError) are skipped."""
    for _ in range(data.draw(st.integers(1, 6), label="steps")):
        stage = data.draw(st.sampled_from(stages), label="stage")
        try:
            loops = sch.get_loops(stage)
        except ScheduleError:
            continue                       # inlined into its consumer: no loops of its own
        if not loops:
            continue
        prim = data.draw(st.sampled_from(["split", "split", "reorder", "fuse", "bind", "bind", "unroll"]),
                         label="primitive")
        try:
            if prim == "split":
                sch.split(data.draw(st.sampled_from(loops), label="loop"), data.draw(st.integers(1, 9), label="factor"))
            elif prim == "reorder" and len(loops) >= 2:
                picked = data.draw(st.lists(st.sampled_from(loops), min_size=2, max_size=4, unique=True))
                sch.reorder(*data.draw(st.permutations(picked)))
            elif prim == "fuse" and len(loops) >= 2:
                k = data.draw(st.integers(0, len(loops) - 2))
                sch.fuse(loops[k], loops[k + 1])
            elif prim == "bind":
                axis = data.draw(st.sampled_from(["blockIdx.x", "blockIdx.y", "threadIdx.x", "threadIdx.y"]))
                sch.bind(data.draw(st.sampled_from(loops), label="loop"), axis)
            elif prim == "unroll":
                sch.unroll(data.draw(st.sampled_from(loops), label="loop"))
        except ScheduleError:
            pass


@FUZZ_CHEAP
@given(prog=pg.programs(), data=st.data())
def test_random_programs_match_numpy_with_random_schedules(prog: pg.Program, data: st.DataObject) -> None:
    note(prog.describe())
    args, _ = pg.to_tecc(prog)
    sch = Schedule(args)
    apply_random_primitives(sch, [s.name for s in prog.stages], data)
    note(str(sch.plan))
    f = tc.build(sch, target="sim")
    run_and_compare(prog, f, "random schedule")


def apply_random_planner_points(args: list[tc.Tensor], sizes: dict[str, int], data: st.DataObject) -> Schedule:
    """Per kernel, a random strategy whose guard takes it and a random point of its space within
    the hard constraints, applied as the planner applies its choice (a refused one is undone)."""
    target = resolve_target("sm_90")
    sch = Schedule(args)
    for kernel in lower(args).kernels:
        info = analyze_kernel(kernel, sizes)
        usable = [s for s in strategies() if s.guard(info, target) is None]
        strategy = data.draw(st.sampled_from(usable), label=f"{kernel.name} strategy")
        if strategy.uses_default_schedule:
            continue
        points = list(strategy.space(info, target))
        if not points:
            continue                       # nothing to choose (a zero-size kernel)
        for _ in range(4):
            point = points[data.draw(st.integers(0, len(points) - 1), label="point")]
            if predict(strategy.workload(info, point, target), target).ok:
                break
        else:
            continue
        note(f"{kernel.name}: {strategy.describe(point)}")
        before = list(sch.plan.steps)
        try:
            strategy.apply(sch, info, point)
        except ScheduleError as exc:
            note(f"  refused: {exc}")
            sch = Schedule(args, plan=Plan(tuple(before)))
    return sch


@FUZZ_CHEAP
@given(prog=pg.programs(), data=st.data())
def test_random_programs_match_numpy_with_random_planner_points(prog: pg.Program, data: st.DataObject) -> None:
    note(prog.describe())
    args, _ = pg.to_tecc(prog)
    sch = apply_random_planner_points(args, concrete_sizes(prog), data)
    note(str(sch.plan))
    f = tc.build(sch, target="sim")
    run_and_compare(prog, f, "random planner points")


@FUZZ_CHEAP
@given(prog=pg.programs(huge=True), data=st.data())
def test_random_programs_match_numpy_at_every_graph_level_strategys_random_point(prog: pg.Program,
                                                                               data: st.DataObject) -> None:
    """Every graph-level strategy whose guard takes the program, at a random point of its space:
    priced (its workload through the cost model, its reason: a Python error there is a strategy
    bug the planner would raise) and realized as the planner realizes it; what the rewrite's step
    accepts must compute the right answer."""
    from tecc.compiler.program import Program
    from tecc.compiler.strategies.registry import graph_strategies

    note(prog.describe())
    args, _ = pg.to_tecc(prog)
    program = Program.of(args, target=resolve_target("sm_90"), sizes=concrete_sizes(prog))
    for strategy in graph_strategies():
        if strategy.guard(program) is not None:
            continue
        points = list(strategy.space(program))
        point = points[data.draw(st.integers(0, len(points) - 1), label=f"{strategy.name} point")]
        cost = predict(strategy.workload(program, point), program.target)
        assert cost.total > 0 and (cost.ok or cost.rejected), cost
        assert strategy.reason(program, point)
        sch = Schedule(args, lowered=program.module)
        try:
            strategy.apply(sch, program, point)
        except ScheduleError as exc:
            note(f"{strategy.describe(point)} refused: {exc}")
            continue
        note(str(sch.plan))
        run_and_compare(prog, tc.build(sch, target="sim"), f"graph-level {strategy.describe(point)}")
