"""plan="auto" falls back only for tecc's own errors: a graph-level point or a per-kernel point that
the primitives refuse (ScheduleError) gives way to the next alternative of the planner's ranking,
and a plan that fails to build (a TeccError) gives way to the generic schedule, with the plan's
reason and `explain()` saying why; a Python error inside a strategy is a bug and is raised. Also
the programs of the hardening issue that once failed to build, each as a named regression test."""

from __future__ import annotations

import numpy as np
import pytest

import tecc as tc
from tecc.compiler.plan import Plan, Step
from tecc.compiler.strategies import row_fused
from tecc.ir.errors import ScheduleError


def softmax_program(rows: int = 6, cols: int = 40) -> tuple[list[tc.Tensor], object]:
    X = tc.placeholder((rows, cols), "float32", name="X")
    k = tc.reduce_axis(cols, name="k")
    m = tc.compute((rows,), lambda i: tc.max(X[i, k], axis=k), name="m")
    e = tc.compute((rows, cols), lambda i, j: tc.exp(X[i, j] - m[i]), name="e")
    k2 = tc.reduce_axis(cols, name="k2")
    s = tc.compute((rows,), lambda i: tc.sum(e[i, k2], axis=k2), name="s")
    Y = tc.compute((rows, cols), lambda i, j: e[i, j] / s[i], name="Y")

    def ref(x: np.ndarray) -> np.ndarray:
        z = np.exp(x - x.max(axis=1, keepdims=True))
        return z / z.sum(axis=1, keepdims=True)
    return [X, Y], ref


def run_softmax(f: tc.Kernel, rows: int = 6, cols: int = 40) -> None:
    x = np.random.default_rng(0).standard_normal((rows, cols)).astype("float32")
    y = np.full_like(x, np.nan)
    f(x, y)
    z = np.exp(x - x.max(axis=1, keepdims=True))
    np.testing.assert_allclose(y, z / z.sum(axis=1, keepdims=True), rtol=1e-5, atol=1e-6)


def test_a_python_error_inside_a_strategy_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug in a strategy (here its workload divides by zero) is raised, not turned into a
    slower plan."""
    args, _ = softmax_program()
    assert tc.build(args, target="sim").plan.strategy.startswith("row_fused")

    def broken(self: object, program: object, point: object) -> None:
        raise ZeroDivisionError("float division by zero")
    monkeypatch.setattr(row_fused.RowFused, "workload", broken)
    with pytest.raises(ZeroDivisionError):
        tc.build(args, target="sim")


def test_a_graph_point_the_primitives_refuse_gives_way_to_the_per_kernel_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    args, _ = softmax_program()

    def refused(self: object, sch: object, program: object, point: object) -> None:
        raise ScheduleError("fuse_rows: refused for the test")
    monkeypatch.setattr(row_fused.RowFused, "apply", refused)
    f = tc.build(args, target="sim")
    assert f.plan.strategy != "row_fused" and not f.fallbacks, f.plan
    assert "graph-level points refused: row_fused(" in f.plan.reason and "refused for the test" in f.plan.reason
    assert "refused for the test" in f.explain()
    run_softmax(f)


def test_a_planner_error_of_tecc_falls_back_to_the_generic_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    import tecc.compiler.planner as planner

    monkeypatch.delenv("TECC_STRICT_PLANS", raising=False)
    X = tc.placeholder((5, 7), "float32", name="X")
    Y = tc.compute((5, 7), lambda i, j: X[i, j] * 2.0, name="Y")

    def broken(*a: object, **k: object) -> None:
        raise ScheduleError("split: refused for the test")
    monkeypatch.setattr(planner, "plan_program", broken)
    f = tc.build([X, Y], target="sim")
    assert f.plan.strategy == "naive"
    assert f.fallbacks == [("planner", "ScheduleError: split: refused for the test")]
    assert "fell back: planner failed (ScheduleError" in f.plan.reason
    assert "candidate planner took the program but failed" in f.explain()
    x = np.arange(35, dtype="float32").reshape(5, 7)
    y = np.zeros_like(x)
    f(x, y)
    np.testing.assert_array_equal(y, x * 2)


def test_a_planner_error_of_python_is_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    import tecc.compiler.planner as planner

    X = tc.placeholder((5, 7), "float32", name="X")
    Y = tc.compute((5, 7), lambda i, j: X[i, j] * 2.0, name="Y")

    def broken(*a: object, **k: object) -> None:
        raise KeyError("..")
    monkeypatch.setattr(planner, "plan_program", broken)
    with pytest.raises(KeyError):
        tc.build([X, Y], target="sim")


def _bogus_planner(monkeypatch: pytest.MonkeyPatch, steps: tuple[Step, ...]) -> None:
    """The planner returns a plan whose steps the primitives refuse when the build replays them."""
    import tecc.compiler.planner as planner

    real = planner.plan_program

    def bogus(*a: object, **k: object) -> object:
        result = real(*a, **k)
        result.plan = Plan(steps, "row_fused", "bogus")
        result.schedule = None
        return result
    monkeypatch.setattr(planner, "plan_program", bogus)


def test_strict_plans_raise_instead_of_falling_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TECC_STRICT_PLANS", raising=False)
    args, _ = softmax_program()
    _bogus_planner(monkeypatch, (Step("split", {"loop": "no_such_kernel/i", "factors": [None, 4]}),))
    assert tc.build(args, target="sim").fallbacks      # without TECC_STRICT_PLANS: the generic schedule
    monkeypatch.setenv("TECC_STRICT_PLANS", "1")
    with pytest.raises(tc.TeccError):
        tc.build(args, target="sim")


def test_a_given_plan_that_fails_is_not_replaced() -> None:
    args, _ = softmax_program()
    bogus = Plan((Step("split", {"loop": "no_such_kernel/i", "factors": [None, 4]}),))
    with pytest.raises(tc.TeccError):
        tc.build(args, target="sim", plan=bogus)


def test_failed_candidates_leave_no_dumps(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("TECC_STRICT_PLANS", raising=False)
    args, _ = softmax_program()
    _bogus_planner(monkeypatch, (Step("split", {"loop": "Y_kernel/i", "factors": [None, 2]}),
                                 Step("split", {"loop": "no_such_kernel/i", "factors": [None, 4]})))
    f = tc.build(args, target="sim", dump_ir=tmp_path)
    names = sorted(p.name for p in tmp_path.iterdir())
    numbers = [int(n.split("_", 1)[0]) for n in names]
    assert numbers == list(range(len(names))), names   # one run's numbering, no leftovers
    assert f.fallbacks
    run_softmax(f)


# ---- the programs of the hardening issue (point 1), built with plan="auto" --------------------

@pytest.mark.parametrize("rows, cols", [(8, 16), (3, 5), (64, 1000), (1, 1)])
def test_regression_global_mean_reused_in_variance_builds(rows: int, cols: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """mean[0] over both axes, then var = Σ_r Σ_c (A[r,c] − mean[0])² / (R·C): the cost model
    divided by zero for the scalar kernel (no loads in flight)."""
    monkeypatch.setenv("TECC_STRICT_PLANS", "1")
    A = tc.placeholder((rows, cols), "float32", name="A")
    r, c = tc.reduce_axis(rows, name="r"), tc.reduce_axis(cols, name="c")
    mean = tc.compute((1,), lambda i: tc.sum(tc.sum(A[r, c], axis=c), axis=r) / (rows * cols), name="mean")
    r2, c2 = tc.reduce_axis(rows, name="r2"), tc.reduce_axis(cols, name="c2")
    var = tc.compute((1,), lambda i: tc.sum((A[r2, c2] - mean[0]) * (A[r2, c2] - mean[0]), axis=[r2, c2])
                     / (rows * cols), name="var")
    f = tc.build([A, mean, var], target="sim")
    a = np.random.default_rng(1).random((rows, cols)).astype("float32")
    m, v = np.zeros(1, "float32"), np.zeros(1, "float32")
    f(a, m, v)
    np.testing.assert_allclose(m, [a.astype("float64").mean()], rtol=1e-5)
    np.testing.assert_allclose(v, [a.astype("float64").var()], rtol=1e-4, atol=1e-7)


def test_regression_column_sum_broadcast_along_rows_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    """B[i,j] = A[i,j] / colsum[j]: lowering compared two shapes with `!=`, which built a symbolic
    comparison and asked it for a truth value."""
    monkeypatch.setenv("TECC_STRICT_PLANS", "1")
    A = tc.placeholder((8, 16), "float32", name="A")
    r = tc.reduce_axis(8, name="r")
    colsum = tc.compute((16,), lambda j: tc.sum(A[r, j], axis=r), name="colsum")
    B = tc.compute((8, 16), lambda i, j: A[i, j] / colsum[j], name="B")
    f = tc.build([A, B], target="sim")
    a = np.random.default_rng(2).random((8, 16)).astype("float32") + 0.5
    b = np.zeros_like(a)
    f(a, b)
    np.testing.assert_allclose(b, a / a.sum(axis=0), rtol=1e-5)


IDENTITY = {"sum": 0.0, "prod": 1.0, "max": -np.inf, "min": np.inf}


@pytest.mark.parametrize("combiner", ["sum", "prod", "max", "min"])
@pytest.mark.parametrize("dtype", ["float32", "int32"])
def test_regression_reduction_over_an_empty_axis_writes_the_identity(combiner: str, dtype: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """reduce_axis(0) over an input of shape (4, 0): the row-fusion cost divided by zero. The
    output is the combiner's identity (docs/dtypes.md: sum 0, prod 1, max -inf / the dtype's
    lowest integer, min +inf / its highest)."""
    monkeypatch.setenv("TECC_STRICT_PLANS", "1")
    A = tc.placeholder((4, 0), dtype, name="A")
    k = tc.reduce_axis(0, name="k")
    B = tc.compute((4,), lambda i: getattr(tc, combiner)(A[i, k], axis=k), name="B")
    f = tc.build([A, B], target="sim")
    out = np.full(4, 7, dtype)
    f(np.zeros((4, 0), dtype), out)
    want = IDENTITY[combiner]
    if dtype == "int32" and combiner in ("max", "min"):
        info = np.iinfo(np.int32)
        want = info.min if combiner == "max" else info.max
    np.testing.assert_array_equal(out, np.full(4, want, dtype))
