"""Few long rows and full reductions as a two-stage grid reduction (tecc.passes.rewrite.split_rows, chosen
by strategies/split_rows.py): S blocks per row over contiguous chunks, the partials combined by a
second kernel, matching float64 NumPy in the emulator (with its race and bounds checks on)."""

import ml_dtypes
import numpy as np
import pytest

import tecc as tc
from tecc.compiler import options as knobs
from tecc.compiler.plan import Plan, Step
from tecc.compiler.schedule import Schedule
from tecc.compiler.strategies.split_rows import choose_splits, propose
from tecc.ir.errors import ScheduleError
from tecc.ir.target import target
from tecc.passes.rewrite.split_rows import split_rows

REDUCE = {"sum": tc.sum, "max": tc.max, "min": tc.min, "prod": tc.prod}
NP = {"sum": np.sum, "max": np.max, "min": np.min, "prod": np.prod}
IDENTITY = {"sum": 0.0, "prod": 1.0, "max": -np.inf, "min": np.inf}
NP_DTYPE = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def row_reduce(R, C, dtype="float32", combiner="sum", mean=False):
    """Y[r] = ⊕_c X[r, c] (accumulated in float32), optionally scaled by 1/C, cast back to dtype."""
    X = tc.placeholder((R, C), dtype, name="X")
    c = tc.reduce_axis(C, name="c")

    def body(r):
        acc = REDUCE[combiner](tc.cast(X[r, c], "float32"), axis=c)
        if mean:
            acc = acc * (1.0 / max(C, 1))
        return tc.cast(acc, dtype)

    return [X, tc.compute((R,), body, name="Y")]


def full_reduce(shape, dtype="float32", combiner="sum"):
    """Y = ⊕ over every element of X: a 0-d output."""
    X = tc.placeholder(shape, dtype, name="X")
    axes = [tc.reduce_axis(n, name=f"k{d}") for d, n in enumerate(shape)]
    Y = tc.compute((), lambda: tc.cast(REDUCE[combiner](tc.cast(X[tuple(axes)], "float32"), axis=axes), dtype),
                   name="Y")
    return [X, Y]


def plan(threads=64, splits=4, vector=1, unroll=2):
    return Plan((Step("split_rows", {"threads": threads, "splits": splits, "vector": vector, "unroll": unroll}),))


def _inputs(args, combiner, seed):
    rng = np.random.default_rng(seed)
    out = []
    for t in args:
        if t.is_placeholder:
            x = rng.standard_normal(tuple(int(s) for s in t.shape))
            if combiner == "prod":
                x = 1.0 + 0.01 * x  # a product of thousands of factors stays finite
            out.append(x.astype(NP_DTYPE[t.dtype.name]))
    return out


def _run(args, the_plan, x, out_shape):
    k = tc.build(args, target="sim", plan=the_plan)
    y = np.zeros(out_shape, x.dtype)
    k(x, y)
    return k, y


def _check(y, want, dtype, what, k):
    y64 = np.asarray(y, np.float64)
    # float32 accumulation in another order than NumPy's; one rounding to the output dtype
    tol = {"float32": 1e-5, "float16": 2 ** -10, "bfloat16": 2 ** -8}[dtype]
    scale = max(1.0, float(np.abs(want).max(initial=0.0)))
    bad = np.abs(y64 - want) > tol * scale + 1e-5
    worst = np.unravel_index(np.argmax(np.abs(y64 - want)), np.shape(want)) if np.size(want) else ()
    assert not bad.any(), f"{what}: plan {k.plan}, worst at {worst}: {y64[worst]} vs {np.asarray(want)[worst]}"


@pytest.mark.parametrize("combiner", ["sum", "max", "min", "prod"])
@pytest.mark.parametrize("shape,step", [
    ((3, 1000), dict(vector=4, unroll=2, splits=4)),          # a guarded last chunk, float4 loads
    ((2, 3 * 512 + 7), dict(vector=1, unroll=4, splits=5)),   # C odd: scalar loads, chunk tail guard
    ((3, 3 * 512 + 7), dict(vector=4, unroll=2, splits=4)),   # C odd: flat view, heads and tails
    ((4, 2048), dict(vector=4, unroll=2, splits=4)),          # S·T·V·U divides C: no guard at all
    ((1, 1003), dict(vector=4, unroll=1, splits=3)),          # one row: vectors + a leftover of 3
    ((5, 40), dict(vector=2, unroll=1, splits=8)),            # more splits than chunks with data
])
def test_split_rows_match_float64_numpy(shape, step, combiner):
    args = row_reduce(*shape, combiner=combiner)
    (x,) = _inputs(args, combiner, seed=sum(shape))
    k, y = _run(args, plan(**step), x, (shape[0],))
    assert len(k.module.kernels) == 2 and len(k.module.temps) == 1
    _check(y, NP[combiner](x.astype(np.float64), axis=1), "float32", f"{combiner} {shape} {step}", k)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_rows_accumulate_in_float32_and_read_16_bytes(dtype):
    args = row_reduce(3, 1200, dtype, mean=True)
    (x,) = _inputs(args, "sum", seed=5)
    k, y = _run(args, plan(threads=32, splits=3, vector=8, unroll=2), x, (3,))
    assert k.module.temps[0].dtype.name == "float32"                 # the partials
    assert "float32" in str(k.module).split("Y_acc:")[1].split("[")[0]
    assert "reinterpret_cast<const uint4*>(&X[" in k.source
    _check(y, x.astype(np.float64).mean(1), dtype, f"{dtype} mean", k)


@pytest.mark.parametrize("shape,step", [
    ((3, 1025), dict(threads=32, splits=3, vector=4, unroll=2)),   # last chunk: 1 element, 1-3 before a boundary
    ((4, 4097), dict(threads=256, splits=2, vector=4, unroll=2)),
    ((3, 1026), dict(threads=32, splits=3, vector=8, unroll=1)),   # 2 elements, up to 7 before a boundary
    ((3, 1543), dict(threads=32, splits=5, vector=4, unroll=2)),   # chunks past the row's end at unaligned starts
])
def test_a_chunk_shorter_than_its_head_is_read_once(shape, step):
    # a chunk that ends before its first vector boundary (n < head) has no vectors and no tail: the
    # tail once started at ((lo + n) // V)·V, inside the head or the chunk before, and added those
    # elements again (or read past the buffer's end); in bf16 outputs the error hid in the rounding
    args = row_reduce(*shape)
    (x,) = _inputs(args, "sum", seed=shape[1])
    k, y = _run(args, plan(**step), x, (shape[0],))
    _check(y, x.astype(np.float64).sum(1), "float32", f"{shape} {step}", k)


def test_a_mean_applies_its_scale_and_cast_in_the_combine_kernel():
    args = row_reduce(2, 777, mean=True)
    (x,) = _inputs(args, "sum", seed=11)
    k, y = _run(args, plan(splits=3), x, (2,))
    combine = k.module.kernels[1]
    assert "0.001287" in str(combine) and "0.001287" not in str(k.module.kernels[0])
    _check(y, x.astype(np.float64).mean(1), "float32", "mean", k)


def test_symbolic_rows_and_columns():
    R, C = tc.var("R"), tc.var("C")
    args = row_reduce(R, C)
    k = tc.build(args, target="sim", plan=plan(splits=3, vector=1, unroll=2))
    for r, c in [(3, 701), (2, 64), (1, 0), (0, 5)]:
        x = np.random.default_rng(r * 100 + c).standard_normal((r, c)).astype(np.float32)
        y = np.full((r,), 7.0, np.float32)
        k(x, y)
        want = x.astype(np.float64).sum(1)
        _check(y, want, "float32", f"symbolic {r} x {c}", k)


def test_symbolic_single_row_takes_vectors_and_reads_its_tail_by_element():
    N = tc.var("N")
    X = tc.placeholder((N,), "float32", name="X")
    n = tc.reduce_axis(N, name="n")
    args = [X, tc.compute((), lambda: tc.sum(X[n], axis=n), name="Y")]
    k = tc.build(args, target="sim", plan=plan(threads=32, splits=3, vector=4, unroll=2))
    assert "float4" in k.source
    for size in (1, 3, 255, 1001):
        x = np.random.default_rng(size).standard_normal(size).astype(np.float32)
        y = np.zeros((), np.float32)
        k(x, y)
        _check(y, x.astype(np.float64).sum(), "float32", f"N={size}", k)


@pytest.mark.parametrize("shape,vector", [((40, 64), 4), ((33, 17), 1), ((33, 17), 4), ((3, 5, 24), 8)])
@pytest.mark.parametrize("combiner", ["sum", "max"])
def test_full_reduction_to_a_scalar(shape, vector, combiner):
    args = full_reduce(shape, combiner=combiner)
    (x,) = _inputs(args, combiner, seed=len(shape))
    k, y = _run(args, plan(threads=32, splits=5, vector=vector, unroll=2), x, ())
    assert k.module.params[1].shape == ()
    _check(y, NP[combiner](x.astype(np.float64)), "float32", f"full {combiner} {shape}", k)


def test_rows_of_any_length_read_aligned_vectors_through_a_flat_view():
    # rows of 1001 start anywhere modulo 4: each chunk's unaligned ends are read element by element
    mod = split_rows(row_reduce(3, 1001), threads=32, splits=3, vector=4, unroll=2)
    (view,) = [p for p in mod.kernels[0].params if p.name == "X"]
    assert [str(e) for e in view.shape] == ["3003"] and "head" in str(mod.kernels[0])


def test_vectors_must_not_straddle_rows_of_a_strided_input():
    X = tc.placeholder((3, 1001), "float32", name="X", strides="any")
    c = tc.reduce_axis(1001, name="c")
    args = [X, tc.compute((3,), lambda r: tc.sum(X[r, c], axis=c), name="Y")]
    with pytest.raises(ScheduleError, match="vector=4"):
        split_rows(args, vector=4)
    assert len(split_rows(args, vector=1, splits=2).kernels) == 2
    with pytest.raises(ScheduleError, match="threads"):
        split_rows(row_reduce(3, 64), threads=48)


def test_one_split_is_one_kernel_of_one_block_per_row():
    args = row_reduce(3, 300, combiner="max")
    (x,) = _inputs(args, "max", seed=3)
    k, y = _run(args, plan(splits=1, vector=4), x, (3,))
    assert len(k.module.kernels) == 1 and not k.module.temps
    _check(y, x.astype(np.float64).max(1), "float32", "splits=1", k)


def test_every_full_chunk_runs_the_unguarded_loop_only():
    def guards(mod):
        return str(mod.kernels[0]).count("where(")

    # S·T·V·U = 2048 divides the row: no guarded round, no run-time division
    mod = split_rows(row_reduce(4, 2048), threads=64, splits=4, vector=4, unroll=2)
    assert guards(mod) == 0 and "let" not in str(mod.kernels[0])
    # else whole rounds unguarded, then one guarded round (and heads / tails for unaligned rows),
    # guarded by selects (predicated loads), not branches
    assert guards(split_rows(row_reduce(4, 2000), threads=64, splits=4, vector=4, unroll=2)) == 1
    assert guards(split_rows(row_reduce(4, 2001), threads=64, splits=4, vector=4, unroll=2)) == 3


@pytest.mark.parametrize("combiner", ["sum", "prod", "max", "min"])
def test_empty_rows_give_the_identity_and_no_rows_launch_nothing(combiner):
    _, y = _run(row_reduce(3, 0, combiner=combiner), plan(), np.zeros((3, 0), np.float32), (3,))
    assert (y == IDENTITY[combiner]).all(), y
    _, y = _run(row_reduce(0, 50, combiner=combiner), plan(), np.zeros((0, 50), np.float32), (0,))
    assert y.shape == (0,)


def test_integer_sums():
    X = tc.placeholder((2, 999), "int32", name="X")
    c = tc.reduce_axis(999, name="c")
    args = [X, tc.compute((2,), lambda r: tc.sum(X[r, c], axis=c), name="Y")]
    x = np.random.default_rng(2).integers(-1000, 1000, (2, 999)).astype(np.int32)
    _, y = _run(args, plan(splits=3), x, (2,))
    assert (y == x.sum(1)).all()


def test_the_emulator_checks_races_and_bounds_here():
    # every test above ran with the emulator's shared-memory race, partial-warp shuffle/barrier
    # and out-of-bounds checks on (TECC_SIM_CHECKS unset)
    assert knobs.sim_checks()


def test_the_plan_replays_through_json_and_schedule():
    args = row_reduce(3, 1000)
    the_plan = plan(vector=4, splits=4)
    sch = Schedule(args, Plan.from_json(the_plan.to_json()))
    assert sch.plan.steps == the_plan.steps
    assert str(Schedule(args, the_plan).mod) == str(sch.mod)
    with pytest.raises(ScheduleError, match="first step"):
        Schedule(args, Plan(the_plan.steps * 2))


# ---- the proposal at large shapes (nothing runs)

H100 = target("sm_90")   # 132 SMs: two waves of 256-thread blocks are 2112 blocks


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows,columns", [(8, 1 << 24), (1, 1 << 26), (16, 1 << 20), (2, 3 * (1 << 20) + 7),
                                          (8, (1 << 22) + 3)])
def test_few_long_rows_are_split_for_about_two_waves(rows, columns, dtype):
    choice = propose(row_reduce(rows, columns, dtype), H100)
    assert choice is not None
    item = 4 if dtype == "float32" else 2
    assert choice.vector == 16 // item          # a flat view: 16-byte loads whatever the row length
    tile = 256 * choice.vector * choice.unroll
    blocks = rows * choice.splits
    # two waves of 8 blocks on 132 SMs, unless the chunks are down to their minimum
    assert 1056 <= blocks <= 2 * 2112 or choice.chunk == max(4096, tile), choice.reason
    assert choice.chunk >= 4096
    assert choice.split_cost.total < choice.row_cost.total
    assert choice.plan.strategy == "split_rows" and "Little's law" in choice.reason


def test_the_split_is_taken_where_the_rows_bytes_in_flight_cannot_cover_dram_latency():
    # 32 rows of 1M keep 32 x 1024 threads x 64 B = 2 MiB in flight: 3.8 TB/s by Little's law,
    # above what an H100 gives (0.9 x 3.35 TB/s), below an H200's (0.9 x 4.8 TB/s)
    h200 = H100.replace(dram_bandwidth=4.8e12, name="H200")
    assert propose(row_reduce(32, 1 << 20), H100) is None
    choice = propose(row_reduce(32, 1 << 20), h200)
    assert choice is not None and "3.81 TB/s by Little's law of the 4.32 TB/s" in choice.reason, choice
    assert propose(row_reduce(64, 1 << 20), h200) is None        # 4 MiB in flight: DRAM-bound already


def test_power_of_two_rows_get_full_chunks():
    assert choose_splits(8, 1 << 24, 2048, H100) == 256          # 2048 blocks, 65536 per chunk
    assert choose_splits(1, 1 << 26, 2048, H100) == 2048
    assert choose_splits(1, 8191, 2048, H100) == 1               # too short: one chunk of >= 4096 only


def test_a_large_full_reduction_is_split():
    choice = propose(full_reduce((8192, 8192)), H100)
    assert choice is not None and choice.splits == 2048 and choice.vector == 4
    assert propose(full_reduce((64, 64)), H100) is None           # too small to pay for a second kernel


@pytest.mark.parametrize("rows,columns", [(16384, 1024), (4096, 4096), (1024, 32768), (512, 65536), (8, 4096),
                                          (64, 1 << 20)])
def test_rows_that_fill_the_gpu_or_short_rows_keep_todays_plan(rows, columns):
    # 64 rows of 1M: row_fused's chunked walk (1024 threads x 64 bytes in flight per row) is
    # DRAM-bound already (4.25 vs 4.07-4.21 TB/s split, H200, benchmarks/split_rows.py)
    assert propose(row_reduce(rows, columns), H100) is None


def test_symbolic_sizes_are_split_only_when_given():
    R, C = tc.var("R"), tc.var("C")
    assert propose(row_reduce(R, C), H100) is None
    choice = propose(row_reduce(R, C), H100, sizes={"R": 4, "C": 1 << 24})
    assert choice is not None and choice.vector == 4                  # a flat view aligns any row


def test_other_programs_are_not_split_rows():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    import norms

    assert propose(norms.softmax(4, 1 << 22), H100) is None          # elementwise row outputs: row_fused's
    X = tc.placeholder((1 << 20, 8), "float32", name="X")
    i = tc.reduce_axis(1 << 20, name="i")
    assert propose([X, tc.compute((8,), lambda j: tc.sum(X[i, j], axis=i), name="Y")], H100) is None  # a column sum


def test_auto_build_takes_the_split_and_explains_it():
    k = tc.build(row_reduce(8, 1 << 24), target="sim", arch="sm_90")
    assert k.plan.strategy == "split_rows"
    assert [f.name for f in k.module.kernels] == ["Y_partial_kernel", "Y_combine_kernel"]
    assert "256 blocks of 256 threads per row" in k.explain() and "Little's law" in k.explain()
    assert tc.build(row_reduce(4096, 1024), target="sim", arch="sm_90").plan.strategy == "row_fused"


def test_stage_one_reads_with_ld_global_nc_v4():
    pytest.importorskip("cuda.core")
    for args, step in [(row_reduce(8, 1 << 20), plan(threads=256, splits=16, vector=4, unroll=2)),
                       (row_reduce(8, 1 << 20, "bfloat16"), plan(threads=256, splits=16, vector=8, unroll=2)),
                       (full_reduce((512, 1024)), plan(threads=256, splits=64, vector=4, unroll=2))]:
        k = tc.build(args, target="cuda", arch="sm_90", plan=step)
        partial = k.ptx.split(".entry Y_combine_kernel")[0]
        assert "ld.global.nc.v4" in partial, partial[-3000:]


# ---- on a GPU

@pytest.mark.gpu
@pytest.mark.parametrize("case", ["float32", "bfloat16", "full"])
def test_auto_plans_on_the_gpu_match_float64_numpy(case):
    rows, columns = 8, (1 << 22) + 3
    args = full_reduce((4096, 4099)) if case == "full" else row_reduce(rows, columns, case)
    k = tc.build(args)
    assert k.plan.strategy == "split_rows", k.plan
    x = np.random.default_rng(0).standard_normal(tuple(int(s) for s in args[0].shape)).astype(
        NP_DTYPE[args[0].dtype.name])
    y = np.zeros(tuple(int(s) for s in args[1].shape), x.dtype)
    k(x, y)
    x64 = x.astype(np.float64)
    want = x64.sum() if case == "full" else x64.sum(1)
    # float32 accumulation over millions of elements: relative to the sum of magnitudes
    scale = np.abs(x64).sum() if case == "full" else np.abs(x64).sum(1)
    tol = 1e-6 if case != "bfloat16" else 2 ** -8
    err = np.abs(np.asarray(y, np.float64) - want)
    assert (err <= tol * scale + 2 ** -8 * np.abs(want)).all(), f"{case}: {y} vs {want}, plan {k.plan}"
