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


# ---- several reduced axes read as one (merged_axes) -------------------------------------------------

def _nhwc_pool(N, H, W, C, dtype="bfloat16"):
    """A global average pool of relu(x·a) over (h, w) of an NHWC input: the conv net's head."""
    X = tc.placeholder((N, H, W, C), dtype, name="X")
    a = tc.placeholder((C,), "float32", name="a")
    rh, rw = tc.reduce_axis(H, name="rh"), tc.reduce_axis(W, name="rw")
    Y = tc.compute((N, C), lambda n, c: tc.cast(
        tc.sum(tc.maximum(tc.cast(X[n, rh, rw, c], "float32") * a[c], 0.0), axis=[rh, rw]) * (1.0 / (H * W)), dtype),
        name="Y")
    return [X, a, Y]


@pytest.mark.parametrize("splits", [1, 3])
def test_a_reduction_over_two_axes_is_split_as_one_and_matches_float64(splits):
    import ml_dtypes

    from tecc.compiler.plan import Plan, Step

    N, H, W, C = 2, 5, 7, 32
    rng = np.random.default_rng(8)
    x = rng.standard_normal((N, H, W, C)).astype(ml_dtypes.bfloat16)
    a = rng.standard_normal(C).astype(np.float32)
    plan = Plan((Step("split_reduce", {"threads_x": 32, "threads_y": 4, "splits": splits, "unroll": 2}),))
    k = tc.build(_nhwc_pool(N, H, W, C), target="sim", plan=plan)
    y = np.full((N, C), np.nan, ml_dtypes.bfloat16)
    k(x, a, y)
    want = np.maximum(np.asarray(x, np.float64) * a, 0.0).mean(axis=(1, 2))
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=2 ** -8, atol=1e-6)


def test_the_planner_splits_a_global_average_pool_over_its_rows():
    """32 x 64 outputs over 56 x 56 rows: one thread per output leaves the GPU idle (434 us
    predicted); as one reduced axis of 3136 rows column_reduction spreads it over blocks."""
    from tecc.compiler.planner import plan_program

    res = plan_program(_nhwc_pool(32, 56, 56, 64), "sm_90")
    assert res.plan.strategy == "column_reduction", res.plan.strategy
    assert res.group is not None and res.group.chosen is not None
    assert res.group.chosen.cost.total * 1e6 < 20.0 < res.kernels[0].chosen.cost.total * 1e6
