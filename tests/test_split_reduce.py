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


@pytest.mark.parametrize("args, split", [(column(300, 70), True), (column(4096, 64), True),
                                         (middle_mean(3, 130, 5), True), (column(1, 33), False),
                                         (middle_mean(4, 1, 3), False)])
def test_the_planner_weighs_the_split_against_one_thread_per_output(args, split):
    """plan="auto" takes the split reduction where a thread's serial loop over the reduced axis
    is long (the cost model's chain term), and one thread per output where there is nothing to
    split (a reduced extent of 1: the split's block reduction and barriers only add)."""
    result = plan_program(args, "sm_90")
    assert (result.plan.strategy == "column_reduction") == split, result.plan
    assert "column_reduction" in result.plan.reason, result.plan.reason   # the weighing is said either way


def test_zero_size_reductions_give_the_identity_or_nothing():
    _, y = _run(column(0, 7), np.zeros((0, 7), np.float32))
    assert (y == 0).all()
    _, y = _run(column(5, 0), np.zeros((5, 0), np.float32))
    assert y.shape == (0,)


def test_bf16_columns_accumulate_in_float32():
    x = np.random.default_rng(3).standard_normal((600, 40)).astype(ml_dtypes.bfloat16)
    k, y = _run(column(600, 40, "bfloat16"), x)
    assert "float32" in str(k.module).split("Y_acc:")[1].split("[")[0]
    want = x.astype(np.float64).sum(0)
    # one bf16 rounding of the float32 sum: half an ulp of 2^-8 relative
    np.testing.assert_allclose(y.astype(np.float64), want, rtol=2 ** -8, atol=1e-2)


def test_split_over_blocks_adds_a_combining_kernel_and_a_temporary():
    mod = split_reduce(column(1000, 70), 32, 4, 5)
    assert len(mod.kernels) == 2 and len(mod.temps) == 1
    assert mod.temps[0].shape[0].value == 5
    assert len(split_reduce(column(1000, 70), 32, 4, 1).kernels) == 1


def test_row_reductions_and_contractions_are_not_split_reductions():
    X = tc.placeholder((8, 16), "float32", name="X")
    c = tc.reduce_axis(16, name="c")
    rows = [X, tc.compute((8,), lambda r: tc.sum(X[r, c], axis=c), name="Y")]
    assert propose(rows) is None
    A, B = tc.placeholder((8, 16), "float32", name="A"), tc.placeholder((16, 4), "float32", name="B")
    k = tc.reduce_axis(16, name="k")
    assert propose([A, B, tc.compute((8, 4), lambda i, j: tc.sum(A[i, k] * B[k, j], axis=k), name="C")]) is None
    with pytest.raises(ScheduleError, match="threads"):
        split_reduce(column(8, 8), 48, 8, 1)


def test_splits_fill_two_waves_but_keep_partials_small():
    assert choose_splits(1024, 16384) == 64          # 32 column blocks x 64 = 2048 blocks
    assert choose_splits(65536, 1024) <= 2           # enough outputs already
    assert choose_splits(1024, 100) == 1             # too short to split
    assert 16384 % (choose_splits(4096, 16384) * 8) == 0


@pytest.mark.parametrize("outputs_per_thread", [2, 4, 8])
@pytest.mark.parametrize("build,shape,splits", [
    (column, (100, 48), 1), (column, (64, 520), 2), (middle_mean, (3, 40, 16), 2), (middle_mean, (2, 17, 8), 1)])
def test_adjacent_outputs_per_thread_read_one_vector_and_match_numpy(build, shape, splits, outputs_per_thread):
    args = build(*shape, dtype="bfloat16")
    step = {"threads_x": 32, "threads_y": 8, "splits": splits, "unroll": 2, "outputs_per_thread": outputs_per_thread}
    k = tc.build(args, target="sim", plan=tc.Plan((tc.compiler.plan.Step("split_reduce", step),)))
    container = {2: "unsigned int", 4: "uint2", 8: "uint4"}[outputs_per_thread]
    assert f"reinterpret_cast<const {container}*>(&X[" in k.source, k.source
    x = np.random.default_rng(sum(shape)).standard_normal(shape).astype(ml_dtypes.bfloat16)
    y = np.zeros(tuple(int(s) for s in args[-1].shape), ml_dtypes.bfloat16)
    k(x, y)
    x64 = x.astype(np.float64)
    want = x64.sum(0) if build is column else x64.mean(1)
    # one bf16 rounding of the float32 total: half an ulp
    np.testing.assert_allclose(y.astype(np.float64), want, rtol=2 ** -8, atol=2 ** -8 * np.abs(want).max(),
                               err_msg=f"{build.__name__} {shape}, {outputs_per_thread} outputs per thread")


def test_outputs_per_thread_must_divide_the_last_extent():
    with pytest.raises(ScheduleError, match="outputs_per_thread"):
        split_reduce(column(8, 12, "bfloat16"), outputs_per_thread=8)


def test_bf16_column_sums_take_adjacent_outputs_when_the_grid_still_fills():
    from tecc.compiler.strategies.column_reduction import choose_outputs_per_thread

    assert choose_outputs_per_thread(8192, 8192, 16384, 2) == 4   # 64-way x, 64 splits: two waves
    assert choose_outputs_per_thread(1024, 1024, 16384, 2) == 1   # too few outputs to fill the GPU
    assert choose_outputs_per_thread(8192, 8192, 16384, 4) == 1   # float32 already reads 128 B per warp
