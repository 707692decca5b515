"""Column and middle-axis reductions (tecc.passes.rewrite.split_reduce, chosen by
strategies/column_reduction.py): the reduced axis split over threads and blocks, combined in
shared memory and then by a second kernel or by the last block to finish, matching float64
NumPy in the emulator. The one-pass form has its own file, test_split_reduce_last_block.py."""

import ml_dtypes
import numpy as np
import pytest

import tecc as tc
from tecc.compiler.planner import plan_program, plan_strategy
from tecc.compiler.strategies.column_reduction import choose_splits, propose
from tecc.ir.errors import ScheduleError
from tecc.passes.rewrite.split_reduce import split_reduce


def column(R, C, dtype="float32", combiner="sum"):
    X = tc.placeholder((R, C), dtype, name="X")
    i = tc.reduce_axis(R, name="i")
    red = {"sum": tc.sum, "max": tc.max, "min": tc.min}[combiner]
    Y = tc.compute((C,), lambda j: tc.cast(red(tc.cast(X[i, j], "float32"), axis=i), dtype), name="Y")
    return [X, Y]


def middle_mean(A, B, C, dtype="float32"):
    X = tc.placeholder((A, B, C), dtype, name="X")
    b = tc.reduce_axis(B, name="b")
    Y = tc.compute((A, C), lambda a, c: tc.cast(tc.sum(tc.cast(X[a, b, c], "float32"), axis=b) * (1.0 / max(B, 1)),
                                                dtype), name="Y")
    return [X, Y]


NP = {"sum": lambda x, ax: x.sum(ax), "max": lambda x, ax: x.max(ax), "min": lambda x, ax: x.min(ax)}


def _run(args, x):
    """Build with column_reduction's own plan (the rewrite under test, whatever the planner would
    weigh it against), run in the emulator."""
    result = plan_strategy(args, "column_reduction", "sm_90")
    assert result is not None, "column_reduction declined"
    k = tc.build(args, target="sim", plan=result.plan)
    y = np.zeros(tuple(int(s) for s in args[-1].shape), x.dtype)
    k(x, y)
    return k, y


@pytest.mark.parametrize("combiner", ["sum", "max", "min"])
@pytest.mark.parametrize("shape", [(300, 70), (4096, 64), (1, 33), (257, 1)])
def test_column_reduction_matches_numpy(shape, combiner):
    x = np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32)
    k, y = _run(column(*shape, combiner=combiner), x)
    assert k.plan.strategy == "column_reduction", k.plan
    want = NP[combiner](x.astype(np.float64), 0)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-4, err_msg=f"{combiner} {shape}, plan {k.plan}")


@pytest.mark.parametrize("shape", [(3, 130, 5), (2, 9, 40), (4, 1, 3)])
def test_middle_axis_mean_matches_numpy(shape):
    x = np.random.default_rng(7).standard_normal(shape).astype(np.float32)
    k, y = _run(middle_mean(*shape), x)
    assert k.plan.strategy == "column_reduction", k.plan
    np.testing.assert_allclose(y, x.astype(np.float64).mean(1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("args", [column(300, 70), column(4096, 64), middle_mean(3, 130, 5), column(1, 33),
                                  middle_mean(4, 1, 3)])
def test_the_planner_weighs_the_split_against_one_thread_per_output(args):
    """plan="auto" takes the split reduction, weighed against one thread per output (whose serial
    loop over the reduced axis the model charges on the chain term): clearly cheaper where the
    loop is long, within the planner's tie (GRAPH_TIE) where there is nothing to split (a reduced
    extent of 1); the reason gives both predictions."""
    from tecc.compiler.planner import GRAPH_TIE

    result = plan_program(args, "sm_90")
    assert result.plan.strategy == "column_reduction", result.plan
    assert "for the per-kernel plans of 1 kernel(s)" in result.plan.reason, result.plan.reason
    group = result.group
    assert group is not None and group.chosen is not None
    assert group.chosen.cost.total <= group.per_kernel_seconds * (1 + GRAPH_TIE)


@pytest.mark.parametrize("rows,cols", [(4096, 768), (1000, 67)])
def test_a_column_sum_reading_a_per_row_value_is_a_column_reduction(rows: int, cols: int) -> None:
    """A layer norm's weight gradient, Σ_r dy[r, c]·(x[r, c] - mean[r])·rstd[r]: mean and rstd
    are read along the reduced axis only (one address for a warp's consecutive outputs), which
    the coalescing check refused ("mean's last index is 0"), leaving one thread per output. Now
    planned as column_reduction on sm_90 and computed in the emulator against float64."""
    dy = tc.placeholder((rows, cols), "float32", name="dy")
    x = tc.placeholder((rows, cols), "float32", name="x")
    mean = tc.placeholder((rows, 1), "float32", name="mean")
    rstd = tc.placeholder((rows,), "float32", name="rstd")
    r = tc.reduce_axis(rows, name="r")
    dw = tc.compute((cols,), lambda c: tc.sum(dy[r, c] * (x[r, c] - mean[r, 0]) * rstd[r], axis=r), name="dw")
    f = tc.build([dy, x, mean, rstd, dw], target="sim", arch="sm_90")
    assert f.plan.strategy == "column_reduction", f.plan.reason
    rng = np.random.default_rng(rows + cols)
    a, b = rng.standard_normal((rows, cols)).astype("float32"), rng.standard_normal((rows, cols)).astype("float32")
    m, s = rng.standard_normal((rows, 1)).astype("float32"), rng.uniform(0.5, 2, rows).astype("float32")
    out = np.full(cols, np.nan, "float32")
    f(a, b, m, s, out)
    want = (a.astype(np.float64) * (b - m).astype(np.float64) * s[:, None]).sum(axis=0)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-3 * np.sqrt(rows))
