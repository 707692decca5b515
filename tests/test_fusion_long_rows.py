"""Rows too long for registers (fuse_rows cache="online" / "none"): layer norm's mean and variance
in ONE pass (Welford / Chan moments), softmax's max and sum in one pass, both walking the row in
chunks of 16-byte vector loads with a guarded tail; checked in the emulator against float64 NumPy.

Long rows are slow to emulate, so the long-row form is forced on modest rows by an explicit plan."""

import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import tecc as tc
from tecc.compiler.plan import Plan, Step
from tecc.compiler.strategies.row_fused import choose_long_row, propose
from tecc.ir.errors import ScheduleError
from tecc.ir.expr import BufferLoad, walk
from tecc.ir.stmt import BufferStore, For, iter_stmts
from tecc.passes.rewrite.fuse_rows import fuse_rows

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import norms  # noqa: E402

NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
# offset of the rows' values: far from 0, so E[x²] - E[x]² would cancel (bf16: 100 keeps an ulp of 0.5)
OFFSET = {"float32": 1000.0, "bfloat16": 100.0}


def _inputs(args, dtype, seed, offset=None):
    """Fresh random inputs: the row input around `offset` (default OFFSET[dtype]), the rest N(0, 1)."""
    rng = np.random.default_rng(seed)
    out = []
    for t in args:
        if not t.is_placeholder:
            continue
        shape = tuple(int(s) for s in t.shape)
        x = rng.standard_normal(shape)
        if len(shape) == 2:
            x = x + (OFFSET[dtype] if offset is None else offset)
        out.append(x.astype(NP_DTYPES[dtype]))
    return out


def _plan(**step):
    return Plan((Step("fuse_rows", step),))


def _run(args, plan, ins, shapes=None):
    k = tc.build(args, target="sim", plan=plan)
    outs = [np.zeros(shapes or tuple(int(s) for s in t.shape), NP_DTYPES.get(t.dtype.name, np.float32))
            for t in args if not t.is_placeholder]
    k(*ins, *outs)
    return k, outs


def _check(got, want, dtype, what):
    got = np.asarray(got, np.float64)
    # fp32: the error of μ at |x| ~ 1000 (an ulp is 6e-5) over σ ~ 1 (layer norm measured 2e-4 of
    # outputs up to 8; softmax 4e-7 relative); bf16: one rounding of the output (2^-8 relative)
    rel, floor = (1e-4, 2e-4) if dtype == "float32" else (2 ** -7, 2 ** -8)
    rtol, atol = rel, floor * float(np.max(np.abs(want), initial=0.0))
    if got.size:
        worst = np.unravel_index(np.argmax(np.abs(got - want)), want.shape)
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=f"{what}; worst at {worst}")


def _global_load_sites(kernel, name):
    return sum(1 for s in iter_stmts(kernel.body) if isinstance(s, BufferStore) for n in walk(s.value)
               if isinstance(n, BufferLoad) and n.buffer.scope == "global" and n.buffer.name == name)


# (rows, columns, threads, vector, unroll, rows_per_block): a tail of partial vectors, a row a
# whole number of chunks (no tail), V = 1 with an odd row, a row shorter than the block (most
# threads see no column), no rows, one warp per row with a partial last block
LAYOUTS = [(3, 1000, 64, 4, 2, 1), (2, 2048, 128, 4, 4, 1), (3, 77, 32, 1, 3, 1), (2, 24, 128, 4, 4, 1),
           (0, 64, 32, 4, 2, 1), (5, 296, 32, 8, 2, 2)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_long_row_layer_norm_reads_twice_and_matches_float64(dtype, layout):
    R, C, threads, vector, unroll, rows_per_block = layout
    if dtype == "float32" and vector == 8:
        vector = 4
    args = norms.layer_norm(R, C, dtype)
    plan = _plan(threads=threads, cache="online", vector=vector, unroll=unroll, rows_per_block=rows_per_block)
    ins = _inputs(args, dtype, seed=R * 1000 + C)
    k, (y,) = _run(args, plan, ins)
    (kernel,) = k.module.kernels
    attrs = dict(kernel.attrs)
    assert attrs["welford_pairs"] == 1 and attrs["online_pairs"] == 1, attrs
    if R:
        _check(y, norms.np_layer_norm(*ins), dtype, f"layer norm {dtype} {layout}")


def test_welford_keeps_the_variance_that_the_naive_formula_loses():
    # rows of 1000 + N(0, 1) in float32: E[x²] ~ 1e6, whose rounding (~0.06 per step) is the
    # size of the variance; the one-pass moments are centred, so nothing large cancels
    R, C = 2, 4096
    X = tc.placeholder((R, C), "float32", name="X")
    c, c2 = tc.reduce_axis(C, name="c"), tc.reduce_axis(C, name="c2")
    mu = tc.compute((R,), lambda r: tc.sum(X[r, c], axis=c) * (1.0 / C), name="mu")
    var = tc.compute((R,), lambda r: tc.sum((X[r, c2] - mu[r]) * (X[r, c2] - mu[r]), axis=c2) * (1.0 / C),
                     name="var")
    x = (1000 + np.random.default_rng(7).standard_normal((R, C))).astype(np.float32)
    want = x.astype(np.float64).var(-1)
    k, (m, v) = _run([X, mu, var], _plan(threads=128, cache="online", vector=4, unroll=4), [x])
    assert dict(k.module.kernels[0].attrs)["welford_pairs"] == 1
    np.testing.assert_allclose(m, x.astype(np.float64).mean(-1), rtol=1e-6)
    np.testing.assert_allclose(v, want, rtol=1e-4, err_msg="Welford variance of 1000 + N(0, 1)")
    # the same kernel shape with E[x²] - E[x]² (two plain sums, no Welford pair)
    sq = tc.compute((R,), lambda r: tc.sum(X[r, c2] * X[r, c2], axis=c2) * (1.0 / C), name="sq")
    k2, (m2, s2) = _run([X, mu, sq], _plan(threads=128, cache="online", vector=4, unroll=4), [x])
    assert "welford_pairs" not in dict(k2.module.kernels[0].attrs)
    naive = s2.astype(np.float32) - m2.astype(np.float32) ** 2
    assert np.max(np.abs(naive - want) / want) > 1e-2, "the data should defeat E[x²] - E[x]²"


def test_long_row_layer_norm_reads_its_row_twice():
    args = norms.layer_norm(4, 4096)
    welford = fuse_rows(args, 256, "online", vector=4, unroll=4).kernels[0]
    three = fuse_rows(args, 256, "none", vector=4, unroll=4).kernels[0]
    assert _global_load_sites(welford, "X") == 2, welford  # moments pass, output pass
    assert _global_load_sites(three, "X") == 3
    assert sum(1 for s in iter_stmts(welford.body) if isinstance(s, For) and s.kind == "serial") == 2
    assert "shfl_xor" in str(welford) and "mu_block[2," in str(welford)  # the (n, mean, M2) combine


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_long_row_online_softmax_with_vectors_matches_float64(dtype, log, layout):
    R, C, threads, vector, unroll, rows_per_block = layout
    if dtype == "float32" and vector == 8:
        vector = 4
    args = norms.softmax(R, C, dtype, log=log)
    plan = _plan(threads=threads, cache="online", vector=vector, unroll=unroll, rows_per_block=rows_per_block)
    ins = _inputs(args, dtype, seed=C + log, offset=0.0)
    k, (y,) = _run(args, plan, ins)
    assert dict(k.module.kernels[0].attrs)["online_pairs"] == 1
    if R:
        _check(y, norms.np_softmax(ins[0], log=log), dtype, f"softmax log={log} {dtype} {layout}")


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm", "softmax"])
def test_the_rereading_form_with_vectors_matches_float64(op):
    build, ref = {"rms_norm": (norms.rms_norm, norms.np_rms_norm), "layer_norm": (norms.layer_norm, norms.np_layer_norm),
                  "softmax": (norms.softmax, norms.np_softmax)}[op]
    args = build(3, 1000, "float32")
    ins = _inputs(args, "float32", seed=11, offset=0.0)
    k, (y,) = _run(args, _plan(threads=64, cache="none", vector=4, unroll=3), ins)
    assert "online_pairs" not in dict(k.module.kernels[0].attrs)
    _check(y, ref(*ins), "float32", f"{op} cache=none")


@pytest.mark.parametrize("op", ["layer_norm", "softmax"])
def test_symbolic_rows_and_columns_take_the_chunked_walk(op):
    build, ref = {"layer_norm": (norms.layer_norm, norms.np_layer_norm), "softmax": (norms.softmax, norms.np_softmax)}[op]
    R, C = tc.var("R"), tc.var("C")
    args = build(R, C, "float32")
    choice = propose(args)
    assert choice.cache == "online" and choice.plan.steps[0].args.get("unroll", 1) > 1, choice.plan
    k = tc.build(args, target="sim", plan=choice.plan)
    assert dict(k.module.kernels[0].attrs)["online_pairs"] == 1
    for rows, cols in [(3, 1000), (2, 5), (0, 9)]:
        ins = _sized(args, rows, cols, offset=1000.0 if op == "layer_norm" else 0.0)
        y = np.zeros((rows, cols), np.float32)
        k(*ins, y)
        if rows:
            _check(y, ref(*ins), "float32", f"{op} symbolic at {rows}x{cols}")


def _sized(args, rows, cols, offset):
    rng = np.random.default_rng(rows * 100 + cols)
    out = []
    for t in args:
        if t.is_placeholder:
            shape = (rows, cols) if len(t.shape) == 2 else (cols,)
            out.append((rng.standard_normal(shape) + (offset if len(shape) == 2 else 0.0)).astype(np.float32))
    return out


def test_empty_rows_give_zero_moments_not_nan():
    # S = Σ x and Q = Σ (x - S/C)² over rows of C = 0 columns (a symbolic C set to 0): both are
    # the empty sum, 0, although μ = 0·(1/0) is NaN; every thread has (n, mean, M2) = (0, 0, 0)
    R, C = tc.var("R"), tc.var("C")
    X = tc.placeholder((R, C), "float32", name="X")
    c, c2 = tc.reduce_axis(C, name="c"), tc.reduce_axis(C, name="c2")
    s = tc.compute((R,), lambda r: tc.sum(X[r, c], axis=c), name="s")
    q = tc.compute((R,), lambda r: tc.sum((X[r, c2] - s[r] * (1.0 / C)) * (X[r, c2] - s[r] * (1.0 / C)), axis=c2),
                   name="q")
    k = tc.build([X, s, q], target="sim", plan=_plan(threads=64, cache="online", unroll=4))
    assert dict(k.module.kernels[0].attrs)["welford_pairs"] == 1
    sv, qv = np.full(3, 7.0, np.float32), np.full(3, 7.0, np.float32)
    k(np.zeros((3, 0), np.float32), sv, qv)
    assert np.all(sv == 0) and np.all(qv == 0), (sv, qv)
    x = (5 + np.random.default_rng(3).standard_normal((3, 40))).astype(np.float32)
    k(x, sv, qv)
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(sv, x64.sum(-1), rtol=1e-6)
    np.testing.assert_allclose(qv, ((x64 - x64.mean(-1, keepdims=True)) ** 2).sum(-1), rtol=1e-4)


def test_rows_of_no_columns_give_the_identity_in_the_chunked_walk():
    y = np.zeros(3, np.float32)
    k = tc.build(norms.row_reduce(3, 0, "float32", "max"), target="sim",
                 plan=_plan(threads=64, cache="none", vector=4, unroll=2))
    k(np.zeros((3, 0), np.float32), y)
    assert np.all(y == -np.inf)
    k = tc.build(norms.softmax(3, 0), target="sim", plan=_plan(threads=64, cache="online", vector=4, unroll=2))
    k(np.zeros((3, 0), np.float32), np.zeros((3, 0), np.float32))


def test_chan_allreduce_refuses_what_it_cannot_do():
    from tecc.ir import dtype as dt
    from tecc.ir.stmt import Buffer
    from tecc.passes.schedule.cross_thread import chan_allreduce

    moments = tuple(Buffer(n, dt.float32, (1,), "local") for n in ("n", "mean", "m2"))
    with pytest.raises(ScheduleError, match="multiple of 32"):
        chan_allreduce(moments, tc.var("tx"), 48, "red")
    with pytest.raises(ScheduleError, match="one float type"):
        chan_allreduce(moments[:2] + (Buffer("m2", dt.int32, (1,), "local"),), tc.var("tx"), 64, "red")
    one_warp = str(chan_allreduce(moments, tc.var("tx"), 32, "red"))
    assert one_warp.count("shfl_xor") == 15 and "barrier()" not in one_warp  # 5 steps × 3 values


def test_a_sum_of_squares_about_something_else_is_not_a_welford_pair():
    # RMS norm: Σ x² has no preceding Σ x; a product of two different deviations is not a square
    assert "welford_pairs" not in dict(fuse_rows(norms.rms_norm(2, 64), 32, "online").kernels[0].attrs)
    X = tc.placeholder((2, 64), "float32", name="X")
    c, c2 = tc.reduce_axis(64, name="c"), tc.reduce_axis(64, name="c2")
    s = tc.compute((2,), lambda r: tc.sum(X[r, c], axis=c), name="s")
    q = tc.compute((2,), lambda r: tc.sum((X[r, c2] - s[r]) * (X[r, c2] + s[r]), axis=c2), name="q")
    assert "welford_pairs" not in dict(fuse_rows([X, s, q], 32, "online").kernels[0].attrs)


def test_vectors_need_a_row_length_they_divide_and_unroll_a_rereading_form():
    with pytest.raises(ScheduleError, match="multiple of it"):
        fuse_rows(norms.softmax(2, 1002), 64, "online", vector=4)
    with pytest.raises(ScheduleError, match="unroll"):
        fuse_rows(norms.softmax(2, 1000), 64, "registers", unroll=2)


def test_the_strategy_picks_welford_and_16_byte_chunks_for_long_rows():
    for dtype, vector in [("float32", 4), ("bfloat16", 8)]:
        for build in (norms.layer_norm, norms.softmax):
            choice = propose(build(64, 131072, dtype))
            step = choice.plan.steps[0].args
            assert (choice.cache, step["vector"], step["threads"]) == ("online", vector, 1024), choice.plan
            assert step["unroll"] == choose_long_row(131072, 2 if dtype == "bfloat16" else 4)[1]
            assert choice.fused_bytes_per_row < choice.unfused_bytes_per_row
    # rows that fit registers keep their measured plans (8192 float32 columns: 512 threads x 16)
    assert propose(norms.layer_norm(64, 8192)).plan.steps[0].args == {"threads": 512, "cache": "registers",
                                                                       "vector": 4}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_long_row_kernels_load_16_bytes_at_a_time(dtype):
    from tecc.codegen import compile_cuda

    for build in (norms.layer_norm, norms.softmax):
        args = build(64, 131072, dtype)
        k = tc.build(args, target="sim", plan=propose(args).plan)
        ptx = compile_cuda(k.source, arch="sm_90").ptx
        assert "ld.global.nc.v4" in ptx, f"{build.__name__} {dtype}: no 16-byte loads"
        assert ".local" not in ptx, f"{build.__name__} {dtype}: the chunk registers went to local memory"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("op", ["layer_norm", "softmax"])
def test_long_rows_on_the_gpu_match_float64(op, dtype):
    build, ref = {"layer_norm": (norms.layer_norm, norms.np_layer_norm), "softmax": (norms.softmax, norms.np_softmax)}[op]
    R, C = 64, 131072
    args = build(R, C, dtype)
    # the one-block-per-row kernel itself: plan="auto" splits 64 rows over S blocks per row
    # (split_row_group, tests/test_split_row_group.py), so row_fused's plan is asked for by hand
    k = tc.build(args, target="cuda", plan=propose(args).plan)
    steps = k.plan.steps
    assert steps[0].primitive == "fuse_rows" and steps[0].args["cache"] == "online", k.plan
    ins = _inputs(args, dtype, seed=5, offset=OFFSET[dtype] if op == "layer_norm" else 0.0)
    y = np.zeros((R, C), NP_DTYPES[dtype])
    k(*ins, y)
    _check(y, ref(*ins), dtype, f"{op} {dtype} {R}x{C} on the GPU, plan {k.plan}")
