"""Softmax, log-softmax, layer norm and RMS norm over few long rows as two kernels of S blocks per row
(tecc.passes.rewrite.split_row_group, chosen by strategies/split_row_group.py): partial statistics per chunk
(a sum; max and sum of exp; Welford moments), then a kernel that combines them and writes its chunk
of the outputs. Checked in the emulator (race, partial-warp and bounds checks on) against float64
NumPy on fresh random inputs; the proposal is checked at large shapes without running anything."""

import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import tecc as tc
from tecc.compiler import options as knobs
from tecc.compiler.plan import Plan, Step
from tecc.compiler.schedule import Schedule
from tecc.compiler.strategies.row_fused import propose as propose_row_fused
from tecc.compiler.strategies.split_row_group import propose
from tecc.ir.errors import ScheduleError
from tecc.ir.expr import BufferLoad, walk
from tecc.ir.stmt import BufferStore, iter_stmts
from tecc.ir.target import target
from tecc.passes.rewrite.split_row_group import split_row_group

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import norms  # noqa: E402

NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
OPS = {
    "softmax": (norms.softmax, norms.np_softmax),
    "log_softmax": (lambda R, C, dtype="float32": norms.softmax(R, C, dtype, log=True),
                    lambda x: norms.np_softmax(x, log=True)),
    "layer_norm": (norms.layer_norm, norms.np_layer_norm),
    "rms_norm": (norms.rms_norm, norms.np_rms_norm),
}
KIND = {"softmax": "max_sum_exp", "log_softmax": "max_sum_exp", "layer_norm": "welford", "rms_norm": "reduction"}
# layer norm's rows are far from zero (100 + N(0, 1)): a variance from E[x²] - E[x]² would cancel
OFFSET = {"layer_norm": 100.0}


def _inputs(args, op, dtype, seed, shapes=None):
    """Fresh random inputs: the row input N(OFFSET, 1), the per-column ones N(0, 1)."""
    rng = np.random.default_rng(seed)
    out = []
    for t in args:
        if t.is_placeholder:
            shape = shapes[len(out)] if shapes else tuple(int(s) for s in t.shape)
            x = rng.standard_normal(shape) + (OFFSET.get(op, 0.0) if len(shape) >= 2 else 0.0)
            out.append(x.astype(NP_DTYPES[dtype]))
    return out


def plan(threads=64, splits=3, vector=4, unroll=2, **extra):
    return Plan((Step("split_row_group", {"threads": threads, "splits": splits, "vector": vector, "unroll": unroll,
                                          **extra}),))


def _check(got, want, dtype, what):
    got = np.asarray(got, np.float64)
    # fp32: μ of rows around 100 is known to a few ulps (6e-6 each) over σ ~ 1; bf16: one
    # rounding of the output (2^-8 relative) plus the bf16 input's own
    rel, floor = (1e-4, 2e-4) if dtype == "float32" else (2 ** -7, 2 ** -8)
    if got.size:
        worst = np.unravel_index(np.argmax(np.abs(got - want)), want.shape)
        np.testing.assert_allclose(got, want, rtol=rel, atol=floor * float(np.max(np.abs(want), initial=0.0)),
                                   err_msg=f"{what}; worst at {worst}: {got[worst]} vs {want[worst]}")


def _run(op, R, C, dtype, the_plan, seed):
    build, ref = OPS[op]
    args = build(R, C, dtype)
    k = tc.build(args, target="sim", plan=the_plan)
    ins = _inputs(args, op, dtype, seed)
    y = np.zeros((R, C), NP_DTYPES[dtype])
    k(*ins, y)
    if R:
        _check(y, ref(*ins), dtype, f"{op} {dtype} {R}x{C}, plan {k.plan}")
    return k


# (rows, columns, threads, splits, vector, unroll, output_splits): chunk tails (the last chunk
# partial), chunks covering the row exactly (no guard), an odd row with V = 1, a row shorter than
# one chunk (two of three blocks see nothing), no rows, one split, more output blocks than
# statistics blocks, more partials than a warp has lanes (two per lane, the second guarded)
LAYOUTS = [(3, 1000, 64, 3, 8, 2, None), (2, 2048, 64, 4, 8, 1, None), (3, 77, 32, 2, 1, 3, None),
           (2, 24, 64, 3, 8, 2, None), (0, 64, 32, 2, 4, 2, None), (2, 296, 32, 1, 8, 2, None),
           (3, 1000, 32, 2, 8, 2, 5), (2, 3000, 32, 40, 1, 1, 7)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_split_row_groups_match_float64_numpy(op, dtype, layout):
    R, C, threads, splits, vector, unroll, output_splits = layout
    if dtype == "float32" and vector == 8:
        vector = 4  # 16 bytes
    extra = {} if output_splits is None else {"output_splits": output_splits}
    k = _run(op, R, C, dtype, plan(threads, splits, vector, unroll, **extra), seed=R * 1000 + C + len(op))
    stats, _ = k.module.kernels
    assert dict(stats.attrs)["statistics"] == KIND[op]
    assert [str(e) for e in k.module.temps[0].shape] == [str(R), str(splits)]
    assert all(t.dtype.name == "float32" for t in k.module.temps)  # the partials, whatever the input


def test_the_row_is_read_once_per_kernel_and_kernel_2_runs_its_blocks_backwards():
    # S·L = C (4 chunks of 4096 = one round of 256 threads x 4 loads of 4): no guarded tail
    mod = split_row_group(norms.layer_norm(4, 16384), threads=256, splits=4, vector=4, unroll=4)
    stats, rows = mod.kernels
    for kernel in (stats, rows):
        sites = sum(1 for s in iter_stmts(kernel.body) if isinstance(s, BufferStore) for n in walk(s.value)
                    if isinstance(n, BufferLoad) and n.buffer.name == "X")
        assert sites == 1, kernel
    assert [t.name for t in mod.temps] == ["mu_count_partial", "mu_mean_partial", "mu_m2_partial"]
    assert "let flat: int32 = 15 - b" in str(rows)
    # kernel 2's warps combine the partials by shuffles alone
    assert "barrier()" not in str(rows) and "@shared" not in str(rows) and "barrier()" in str(stats)


def test_statistics_outputs_are_written_once_by_the_first_block_of_the_row():
    R, C = 3, 1000
    X = tc.placeholder((R, C), "float32", name="X")
    c, c2 = tc.reduce_axis(C, name="c"), tc.reduce_axis(C, name="c2")
    mu = tc.compute((R,), lambda r: tc.sum(X[r, c], axis=c) * (1.0 / C), name="mu")
    var = tc.compute((R,), lambda r: tc.sum((X[r, c2] - mu[r]) * (X[r, c2] - mu[r]), axis=c2) * (1.0 / C),
                     name="var")
    Y = tc.compute((R, C), lambda r, j: (X[r, j] - mu[r]) * tc.rsqrt(var[r] + 1e-5), name="Y")
    x = (1000 + np.random.default_rng(4).standard_normal((R, C))).astype(np.float32)
    x64 = x.astype(np.float64)
    for args in ([X, mu, var, Y], [X, mu, var]):  # the second has no elementwise output: kernel 2 only combines
        k = tc.build(args, target="sim", plan=plan(threads=64, splits=4, vector=4, unroll=2))
        assert "(tx == 0) & (s_1 == 0)" in str(k.module.kernels[1]) or "tx == 0 && s_1 == 0" in k.source
        outs = [np.full((R,), 7.0, np.float32), np.full((R,), 7.0, np.float32)]
        if len(args) == 4:
            outs.append(np.zeros((R, C), np.float32))
        k(x, *outs)
        np.testing.assert_allclose(outs[0], x64.mean(-1), rtol=1e-6)
        np.testing.assert_allclose(outs[1], x64.var(-1), rtol=1e-4, err_msg="Welford variance of 1000 + N(0, 1)")
        if len(args) == 4:
            want = (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + 1e-5)
            _check(outs[2], want, "float32", "standardize")


def test_a_single_max_reduction_and_rows_of_a_3d_tensor():
    X = tc.placeholder((2, 3, 500), "float32", name="X")
    c = tc.reduce_axis(500, name="c")
    m = tc.compute((2, 3), lambda a, b: tc.max(tc.abs(X[a, b, c]), axis=c), name="m")
    Y = tc.compute((2, 3, 500), lambda a, b, j: X[a, b, j] / m[a, b], name="Y")
    x = np.random.default_rng(9).standard_normal((2, 3, 500)).astype(np.float32)
    k = tc.build([X, Y], target="sim", plan=plan(threads=32, splits=3, vector=4, unroll=2))
    y = np.zeros_like(x)
    k(x, y)
    x64 = x.astype(np.float64)
    _check(y, x64 / np.abs(x64).max(-1, keepdims=True), "float32", "x / max|x| over (2, 3, 500)")


@pytest.mark.parametrize("op", list(OPS))
def test_symbolic_rows_and_columns(op):
    build, ref = OPS[op]
    R, C = tc.var("R"), tc.var("C")
    args = build(R, C, "float32")
    k = tc.build(args, target="sim", plan=plan(threads=32, splits=3, vector=1, unroll=4))
    for rows, cols in [(3, 1000), (2, 5), (0, 9), (2, 0)]:
        n_in = sum(1 for t in args if t.is_placeholder)
        ins = _inputs(args, op, "float32", seed=rows * 100 + cols, shapes=[(rows, cols)] + [(cols,)] * (n_in - 1))
        y = np.zeros((rows, cols), np.float32)
        k(*ins, y)
        if rows and cols:
            _check(y, ref(*ins), "float32", f"{op} symbolic at {rows}x{cols}")
    with pytest.raises(ScheduleError, match="vector=4"):
        split_row_group(args, vector=4)


def test_the_emulator_checks_races_and_bounds_here():
    # every test above ran with the emulator's shared-memory race, partial-warp shuffle/barrier
    # and out-of-bounds checks on (TECC_SIM_CHECKS unset)
    assert knobs.sim_checks()


def test_the_plan_replays_through_json_and_schedule():
    args = norms.softmax(3, 1000)
    for the_plan in (plan(vector=4, splits=4), plan(vector=4, splits=4, output_splits=2)):
        sch = Schedule(args, Plan.from_json(the_plan.to_json()))
        assert sch.plan.steps == the_plan.steps
        assert str(Schedule(args, the_plan).mod) == str(sch.mod)
    # output_splits equal to splits is the default and is not recorded
    assert "output_splits" not in Schedule(args, plan(splits=4, output_splits=4)).plan.steps[0].args
    with pytest.raises(ScheduleError, match="first step"):
        Schedule(args, Plan(plan().steps * 2))


def test_what_is_not_one_pass_of_partial_statistics_is_refused():
    X = tc.placeholder((2, 64), "float32", name="X")
    c, c2 = tc.reduce_axis(64, name="c"), tc.reduce_axis(64, name="c2")
    s = tc.compute((2,), lambda r: tc.sum(X[r, c], axis=c), name="s")
    q = tc.compute((2,), lambda r: tc.sum((X[r, c2] - s[r]) * (X[r, c2] + s[r]), axis=c2), name="q")
    with pytest.raises(ScheduleError, match="no one-pass partial statistics"):
        split_row_group([X, s, q])
    # a layer norm over bf16 without a cast to float32: h is not in the accumulator type
    Xb = tc.placeholder((2, 64), "bfloat16", name="X")
    mu = tc.compute((2,), lambda r: tc.sum(Xb[r, c], axis=c) * (1.0 / 64), name="mu")
    var = tc.compute((2,), lambda r: tc.sum((Xb[r, c2] - mu[r]) * (Xb[r, c2] - mu[r]), axis=c2), name="var")
    with pytest.raises(ScheduleError, match="no one-pass partial statistics"):
        split_row_group([Xb, mu, var])
    with pytest.raises(ScheduleError, match="threads"):
        split_row_group(norms.softmax(2, 64), threads=48)
    with pytest.raises(ScheduleError, match="multiple of it"):
        split_row_group(norms.softmax(2, 1002), vector=4)


# ---- the proposal at large shapes (nothing runs)

H100 = target("sm_90")   # 132 SMs; the one-block-per-row kernel of a long fp32 row holds 2 blocks of 1024 per SM


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("op", ["softmax", "layer_norm", "rms_norm", "log_softmax"])
@pytest.mark.parametrize("rows,columns", [(16, 262144), (16, 131072), (64, 131072), (131, 131072)])
def test_few_long_rows_are_split(op, dtype, rows, columns):
    args = OPS[op][0](rows, columns, dtype)
    choice = propose(args, H100)
    assert choice is not None and choice.statistics == KIND[op]
    item = 4 if dtype == "float32" else 2
    assert (choice.threads, choice.vector, choice.unroll) == (256, 16 // item, 4)
    assert choice.splits >= 8 and choice.chunk >= 4096 and choice.chunk * choice.splits == columns
    assert choice.plan.strategy == "split_row_group"
    assert f"fill {rows} of the {choice.slots} block slots" in choice.reason
    assert "re-reads its row" in choice.reason and "read twice" in choice.reason


def test_the_decisions_for_rows_of_131072():
    got = {(r, dtype): propose(norms.softmax(r, 131072, dtype), H100) for r in (16, 64, 256, 1024)
           for dtype in ("float32", "bfloat16")}
    assert {k: (c.splits if c else None) for k, c in got.items()} == {
        (16, "float32"): 32, (64, "float32"): 32, (256, "float32"): None, (1024, "float32"): None,
        (16, "bfloat16"): 16, (64, "bfloat16"): 16, (256, "bfloat16"): None, (1024, "bfloat16"): None}
    # from one row per SM on, the row kernel's plan stays (the split measured slower at 256 rows)
    assert propose_row_fused(norms.softmax(1024, 131072), H100).cache == "online"


@pytest.mark.parametrize("rows,columns", [(16384, 8192), (16384, 1024), (64, 16384), (8, 65536), (1024, 131072),
                                          (132, 131072), (256, 131072)])
@pytest.mark.parametrize("op", ["softmax", "layer_norm", "rms_norm"])
def test_rows_that_fill_the_gpu_or_fit_registers_keep_todays_plan(op, rows, columns):
    assert propose(OPS[op][0](rows, columns), H100) is None


def test_auto_build_takes_the_split_and_explains_it():
    k = tc.build(norms.layer_norm(64, 131072), target="sim", arch="sm_90")
    assert k.plan.strategy == "split_row_group"
    assert [f.name for f in k.module.kernels] == ["Y_statistics_kernel", "Y_rows_kernel"]
    assert "32 blocks of 256 threads per row" in k.explain() and "Welford" in k.explain()
    fused = tc.build(norms.layer_norm(16384, 8192), target="sim", arch="sm_90")
    assert fused.plan.strategy == "row_fused" and fused.plan.steps[0].args["cache"] == "registers"
    assert tc.build(norms.layer_norm(1024, 131072), target="sim", arch="sm_90").plan.strategy == "row_fused"
    # a row sum is split_rows' (one reduction, no elementwise output)
    assert tc.build(norms.row_reduce(8, 1 << 24), target="sim", arch="sm_90").plan.strategy == "split_rows"


def test_symbolic_sizes_are_split_only_when_given_and_then_walk_single_columns():
    R, C = tc.var("R"), tc.var("C")
    args = norms.softmax(R, C)
    assert propose(args, H100) is None
    choice = propose(args, H100, sizes={"R": 64, "C": 131072})
    assert choice is not None and choice.vector == 1   # a symbolic row's alignment is unknown
    assert propose(args, H100, sizes={"R": 64, "C": 5000}) is None   # too short for two chunks


def test_both_kernels_load_16_bytes_at_a_time():
    pytest.importorskip("cuda.core")
    for op in ("softmax", "layer_norm", "rms_norm"):
        for dtype in ("float32", "bfloat16"):
            args = OPS[op][0](64, 131072, dtype)
            k = tc.build(args, target="cuda", arch="sm_90", plan=propose(args, H100).plan)
            stats, rows = k.ptx.split(".entry Y_rows_kernel")
            for name, ptx in (("statistics", stats), ("rows", rows)):
                assert "ld.global.nc.v4" in ptx, f"{op} {dtype} {name}: no 16-byte loads of X"
            assert "st.global.v4" in rows, f"{op} {dtype}: no 16-byte stores of Y"
            assert ".local" not in k.ptx, f"{op} {dtype}: the chunk registers went to local memory"


# ---- on a GPU

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("op", ["softmax", "layer_norm", "rms_norm"])
@pytest.mark.parametrize("rows,columns", [(16, 262144), (64, 131072)])
def test_split_row_groups_on_the_gpu_match_float64(op, dtype, rows, columns):
    build, ref = OPS[op]
    args = build(rows, columns, dtype)
    k = tc.build(args, target="cuda", plan="auto")
    assert k.plan.strategy == "split_row_group", k.plan
    ins = _inputs(args, op, dtype, seed=rows + columns)
    y = np.zeros((rows, columns), NP_DTYPES[dtype])
    k(*ins, y)
    _check(y, ref(*ins), dtype, f"{op} {dtype} {rows}x{columns} on the GPU, plan {k.plan}")
