"""Row fusion (tecc.passes.rewrite.fuse_rows): a reduce→elementwise graph sharing the row is ONE kernel
that reads its row once, and matches float64 NumPy in the emulator."""

import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import tecc as tc
from tecc.compiler.strategies.row_fused import choose_point, propose
from tecc.ir.errors import ScheduleError
from tecc.ir.expr import BufferLoad, walk
from tecc.ir.stmt import BufferStore, iter_stmts
from tecc.passes.rewrite.fuse_rows import fuse_rows, row_group

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import norms  # noqa: E402

OPS = {
    "softmax": (norms.softmax, norms.np_softmax),
    "log_softmax": (lambda R, C, d: norms.softmax(R, C, d, log=True), lambda x: norms.np_softmax(x, log=True)),
    "layer_norm": (norms.layer_norm, norms.np_layer_norm),
    "rms_norm": (norms.rms_norm, norms.np_rms_norm),
}


def _run(args, plan, ins):
    k = tc.build(args, target="sim", plan=plan)
    outs = [np.zeros(tuple(int(s) for s in t.shape), t.dtype.name if t.dtype.name != "bfloat16" else np.float32)
            for t in args if not t.is_placeholder]
    k(*ins, *outs)
    return k, outs


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("shape", [(3, 31), (2, 1000), (1, 1), (0, 40), (2, 257)])
def test_fused_norms_match_float64_numpy(op, shape):
    build, ref = OPS[op]
    R, C = shape
    args = build(R, C, "float32")
    choice = propose(args)
    assert choice is not None and len(choice.plan.steps) == 1
    rng = np.random.default_rng(R * 1000 + C)
    ins = [rng.standard_normal(tuple(int(s) for s in t.shape)).astype(np.float32) for t in args if t.is_placeholder]
    k, outs = _run(args, choice.plan, ins)
    assert len(k.module.kernels) == 1, f"{op}: expected one kernel, plan {choice.plan}"
    if R == 0:
        return
    want = ref(*ins)
    worst = np.unravel_index(np.argmax(np.abs(outs[0] - want)), want.shape)
    np.testing.assert_allclose(outs[0], want, rtol=2e-5, atol=2e-6,
                               err_msg=f"{op} {shape}, plan {choice.plan}, worst at {worst}")


def test_fused_softmax_reads_the_row_once():
    args = norms.softmax(4, 1000)
    mod = fuse_rows(args, 128, "registers")
    (kernel,) = mod.kernels
    loads = [n for s in iter_stmts(kernel.body) if isinstance(s, BufferStore) for n in walk(s.value)
             if isinstance(n, BufferLoad) and n.buffer.scope == "global"]
    assert len(loads) == 1 and loads[0].buffer.name == "X"
    assert "shfl_xor" in str(kernel) and "barrier()" in str(kernel)


@pytest.mark.parametrize("threads,cache", [(32, "registers"), (64, "none"), (1024, "registers"), (256, "none")])
def test_fused_softmax_every_block_size_and_cache(threads, cache):
    args = norms.softmax(3, 300)
    rng = np.random.default_rng(threads)
    x = rng.standard_normal((3, 300)).astype(np.float32)
    plan = tc.Plan((tc.compiler.plan.Step("fuse_rows", {"threads": threads, "cache": cache}),))
    _, (y,) = _run(args, plan, [x])
    np.testing.assert_allclose(y, norms.np_softmax(x), rtol=2e-5, atol=1e-7)


def test_symbolic_rows_and_columns_use_the_rereading_form():
    R, C = tc.var("R"), tc.var("C")
    args = norms.softmax(R, C)
    choice = propose(args)
    assert choice.cache == "online"  # max and sum of exp(x - max) in one pass: the row is read twice
    with pytest.raises(ScheduleError, match="constant row length"):
        fuse_rows(args, 128, "registers")
    x = np.random.default_rng(1).standard_normal((5, 77)).astype(np.float32)
    y = np.zeros_like(x)
    tc.build(args, target="sim", plan=choice.plan)(x, y)
    np.testing.assert_allclose(y, norms.np_softmax(x), rtol=2e-5, atol=1e-7)


def test_rows_of_a_3d_tensor_are_flattened_into_blocks():
    X = tc.placeholder((2, 3, 50), "float32", name="X")
    c = tc.reduce_axis(50, name="c")
    m = tc.compute((2, 3), lambda a, b: tc.max(X[a, b, c], axis=c), name="m")
    Y = tc.compute((2, 3, 50), lambda a, b, j: X[a, b, j] - m[a, b], name="Y")
    x = np.random.default_rng(2).standard_normal((2, 3, 50)).astype(np.float32)
    choice = propose([X, Y])
    _, (y,) = _run([X, Y], choice.plan, [x])
    np.testing.assert_allclose(y, x - x.max(-1, keepdims=True), rtol=1e-6)


def test_bf16_inputs_accumulate_in_float32():
    args = norms.rms_norm(3, 200, "bfloat16")
    src = str(fuse_rows(args, 64, "registers"))
    assert "ms_acc: float32[1]" in src
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((3, 200)) + 3.0).astype(ml_dtypes.bfloat16)
    g = rng.standard_normal(200).astype(ml_dtypes.bfloat16)
    k = tc.build(args, target="sim", plan=propose(args).plan)
    assert len(k.module.kernels) == 1
    y = np.full((3, 200), np.nan, dtype=ml_dtypes.bfloat16)
    k(x, g, y)
    ref = norms.np_rms_norm(x.astype(np.float64), g.astype(np.float64))
    assert np.abs(y.astype(np.float64) - ref).max() / np.abs(ref).max() < 1e-2


def test_a_graph_that_reads_another_row_is_not_a_row_group():
    X = tc.placeholder((4, 8), "float32", name="X")
    c = tc.reduce_axis(8, name="c")
    m = tc.compute((4,), lambda r: tc.sum(X[r, c], axis=c), name="m")
    Y = tc.compute((4, 8), lambda r, j: X[r, j] - m[(r + 1) % 4], name="Y")
    with pytest.raises(ScheduleError, match="not at the row"):
        fuse_rows([X, Y], 32, "registers")
    Z = tc.compute((4, 4), lambda r, j: X[r, j], name="Z")
    assert propose([X, Z]) is None  # no reduction: not a row group
    with pytest.raises(ScheduleError, match="no reduction"):
        row_group([X, Z])


def test_plan_replays_to_the_same_ir():
    args = norms.layer_norm(4, 96)
    plan = propose(args).plan
    a = tc.Schedule(args, plan=plan)
    b = tc.Schedule(args, plan=tc.Plan.from_json(plan.to_json()))
    assert str(a.mod) == str(b.mod)
    with pytest.raises(ScheduleError, match="first step"):
        s = tc.Schedule(args)
        s.split(s.get_loops("Y")[0], 2)
        s.fuse_rows(64)


def test_choose_point_keeps_the_row_in_registers_up_to_the_limit():
    assert choose_point(1024, 1) == (128, "registers")
    assert choose_point(8192, 1) == (512, "registers")
    assert choose_point(65536 * 2, 1) == (1024, "none")
    assert choose_point(None, 1) == (256, "none")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("shape", [(3, 1024), (2, 1000), (2, 1002), (0, 64), (2, 4096)])
def test_half_rows_use_16_byte_vectors_and_match_numpy(dtype, shape):
    import ml_dtypes

    R, C = shape
    args = norms.layer_norm(R, C, dtype)
    choice = propose(args)
    assert choice.vector == (8 if C % 8 == 0 else 2), choice.plan
    k = tc.build(args, target="sim", plan=choice.plan)
    container = {8: "uint4", 2: "unsigned int"}[choice.vector]
    assert f"reinterpret_cast<const {container}*>(&X[" in k.source
    npdt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16
    rng = np.random.default_rng(C)
    ins = [rng.standard_normal(tuple(int(s) for s in t.shape)).astype(npdt) for t in args if t.is_placeholder]
    y = np.zeros((R, C), npdt)
    k(*ins, y)
    want = norms.np_layer_norm(*ins)
    # one rounding to the 16-bit type: half an ulp (2^-8 bf16, 2^-11 fp16) of |y| ≤ ~5
    np.testing.assert_allclose(y.astype(np.float64), want, rtol=2 ** -7, atol=2e-2)


def test_half_vector_loads_stay_in_registers():
    from tecc.codegen import compile_cuda

    args = norms.softmax(4, 8192, "bfloat16")
    k = tc.build(args, target="sim", plan=propose(args).plan)
    ptx = compile_cuda(k.source, arch="sm_90").ptx
    assert "ld.global.nc.v4.u32" in ptx and "st.global.v4.u32" in ptx
    assert ".local" not in ptx, "the bf16 register arrays went to local memory"


def test_row_kernels_ask_for_full_occupancy_when_the_row_fits():
    # 33 registers would leave one 1024-thread block per SM (layer norm at 8192 ran at 61%)
    args = norms.layer_norm(4, 8192)
    plan = tc.Plan((tc.compiler.plan.Step("fuse_rows", {"threads": 1024, "cache": "registers", "vector": 4}),))
    k = tc.build(args, target="sim", plan=plan)
    assert "__launch_bounds__(1024, 2)" in k.source
    # the planner's point (512 x 16): 16 row words + 24 others fit three blocks of 512 per SM
    k = tc.build(args, target="sim", plan=propose(args).plan)
    assert "__launch_bounds__(512, 3)" in k.source


def test_a_row_kernel_without_the_occupancy_request_replays_and_matches_numpy():
    """fuse_rows(occupancy=False), the fallback of a group reading many tensors where ptxas spills
    under the request (row_fused.without_occupancy): `__launch_bounds__` without a block count,
    the step kept in the plan, the same results."""
    from tecc.compiler.strategies.row_fused import without_occupancy

    args = norms.layer_norm(5, 8192)
    asked = tc.build(args, target="sim", plan=propose(args).plan)
    free = tc.build(args, target="sim", plan=without_occupancy(propose(args).plan))
    assert "__launch_bounds__(512, 3)" in asked.source and "__launch_bounds__(512)" in free.source
    assert free.plan.steps[0].args["occupancy"] is False
    replayed = tc.build(args, target="sim", plan=free.plan.to_json())
    assert replayed.source == free.source
    rng = np.random.default_rng()
    x, g, b = rng.standard_normal((5, 8192)), rng.standard_normal(8192), rng.standard_normal(8192)
    x, g, b = (v.astype(np.float32) for v in (x, g, b))
    y = np.full((5, 8192), np.nan, np.float32)
    free(x, g, b, y)
    np.testing.assert_allclose(y, norms.np_layer_norm(x.astype(np.float64), g, b), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("shape,threads", [((3, 300), 64), ((2, 1000), 128), ((1, 1), 32), ((0, 40), 64), ((2, 33), 64)])
def test_online_softmax_reads_the_row_twice_and_matches_numpy(log, shape, threads):
    R, C = shape
    args = norms.softmax(R, C, log=log)
    plan = tc.Plan((tc.compiler.plan.Step("fuse_rows", {"threads": threads, "cache": "online"}),))
    k = tc.build(args, target="sim", plan=plan)
    (kernel,) = k.module.kernels
    assert dict(kernel.attrs)["online_pairs"] == 1
    x = np.random.default_rng(C).standard_normal((R, C)).astype(np.float32)
    y = np.zeros_like(x)
    k(x, y)
    np.testing.assert_allclose(y, norms.np_softmax(x, log=log), rtol=2e-5, atol=1e-6,
                               err_msg=f"online softmax {shape}, {threads} threads")


def test_softmax_keeps_exp_for_the_output_pass():
    args = norms.softmax(4, 4096, "bfloat16")
    k = tc.build(args, target="sim", plan=propose(args).plan)
    assert k.source.count("expf(") == 1, "exp(x - max) computed twice"
    # the exp array takes over the input row's registers: same occupancy request as layer norm
    assert "__launch_bounds__(256, 6)" in k.source


def test_short_16_bit_rows_take_two_16_byte_loads_per_thread():
    assert choose_point(1024, 1, itemsize=2) == (64, "registers")
    assert choose_point(1024, 1, itemsize=4) == (128, "registers")


def test_rows_from_8192_columns_take_four_16_byte_loads_per_thread():
    # measured on an H200: 256 x 32 beat 512 x 16 for bf16 softmax / layer norm at 8192 columns,
    # and 512 x 16 beat 1024 x 8 for float32 softmax; 4096 columns keep two loads per thread
    assert choose_point(4096, 1, itemsize=2) == (256, "registers")
    assert choose_point(8192, 1, itemsize=2) == (256, "registers")
    assert choose_point(16384, 1, itemsize=2) == (512, "registers")
    assert choose_point(4096, 1, itemsize=4) == (512, "registers")
    assert choose_point(8192, 1, itemsize=4) == (512, "registers")
    assert choose_point(16384, 1, itemsize=4) == (1024, "registers")


@pytest.mark.parametrize("op", ["softmax", "layer_norm"])
@pytest.mark.parametrize("shape,rows_per_block,cache,vector", [
    ((5, 64), 4, "registers", 4), ((8, 1000), 8, "registers", 1), ((3, 300), 2, "online", 1),
    ((0, 64), 4, "registers", 1), ((7, 33), 4, "none", 1)])
def test_several_rows_per_block_one_warp_each_match_numpy(op, shape, rows_per_block, cache, vector):
    build, ref = OPS[op]
    R, C = shape
    args = build(R, C, "float32")
    if cache == "online" and op != "softmax":
        cache = "none"
    step = {"threads": 32, "cache": cache, "vector": vector, "rows_per_block": rows_per_block}
    rng = np.random.default_rng(R * 7 + C)
    ins = [rng.standard_normal(tuple(int(s) for s in t.shape)).astype(np.float32) for t in args if t.is_placeholder]
    k, outs = _run(args, tc.Plan((tc.compiler.plan.Step("fuse_rows", step),)), ins)
    (kernel,) = k.module.kernels
    assert "barrier()" not in str(kernel), "a warp per row needs no barrier"
    if R:
        np.testing.assert_allclose(outs[0], ref(*ins), rtol=2e-5, atol=2e-6,
                                   err_msg=f"{op} {shape}, {rows_per_block} rows per block, cache {cache}")


def test_several_rows_per_block_need_one_warp_per_row():
    with pytest.raises(ScheduleError, match="one warp per row"):
        fuse_rows(norms.softmax(4, 256), 64, "registers", rows_per_block=2)


@pytest.mark.parametrize("dtype, strategy", [("float16", "gemm_wgmma"), ("float32", "gemm_pipelined")])
def test_a_contraction_read_along_the_last_axis_of_both_operands_is_left_to_the_planner(dtype, strategy):
    # C = A·Bᵀ reads A[i, k] and B[j, k]: both rows are contiguous along k, as in a row group, but
    # each operand is reused across the other's rows, which the tiled strategies exploit
    A = tc.placeholder((1000, 1000), dtype, name="A")
    B = tc.placeholder((1000, 1000), dtype, name="B")
    k = tc.reduce_axis(1000, name="k")
    C = tc.compute((1000, 1000), lambda i, j: tc.sum(tc.cast(A[i, k], "float32") * tc.cast(B[j, k], "float32"),
                                                      axis=k), name="C")
    assert propose([A, B, C]) is None
    assert tc.build([A, B, C], target="sim", arch="sm_90")  # sm_90: the wgmma path.plan.strategy == strategy


def test_a_row_vector_broadcast_into_a_row_reduction_still_fuses():
    X = tc.placeholder((64, 256), "float32", name="X")
    bias = tc.placeholder((256,), "float32", name="bias")
    k = tc.reduce_axis(256, name="k")
    m = tc.compute((64,), lambda r: tc.max(X[r, k] + bias[k], axis=k), name="m")
    assert propose([X, bias, m]) is not None


def test_the_row_kernel_of_an_empty_row_is_priced():
    """fused_workload over rows of no columns (reduce_axis(0)): a launch that loads nothing is
    priced, finite (the planner prices every graph-level point; it once divided by the row's zero
    loads in flight)."""
    from tecc.compiler.cost.analysis import analyze_kernel
    from tecc.compiler.cost.model import predict
    from tecc.compiler.strategies.row_fused import fused_workload
    from tecc.ir.target import target
    from tecc.passes.lower import lower

    A = tc.placeholder((4, 0), "float32", name="A")
    k = tc.reduce_axis(0, name="k")
    B = tc.compute((4,), lambda i: tc.sum(A[i, k], axis=k), name="B")
    info = analyze_kernel(lower([A, B]).kernels[0])
    for cache in ("registers", "none"):
        cost = predict(fused_workload(info, {"threads": 64, "cache": cache, "vector": 1, "unroll": 4}, target("sm_90")),
                       target("sm_90"))
        assert cost.ok and 0 < cost.total < 1e-4, (cache, cost.total)


@pytest.mark.parametrize("columns", [0, 5])
def test_a_row_group_with_column_reductions_over_no_rows_plans_and_runs(columns):
    """A row sum and a column product and sum over zero rows: the column plan's rows per block
    once divided by zero (found by tests/test_fuzz_programs.py). The column reductions over no
    rows are their identities (1 for the product, 0 for the sum), written for every column."""
    X = tc.placeholder((0, columns), "float32", name="X")
    c = tc.reduce_axis(columns, name="c")
    r = tc.reduce_axis(0, name="r")
    S0 = tc.compute((0,), lambda i: tc.sum(X[i, c], axis=c), name="S0")
    P = tc.compute((columns,), lambda j: tc.prod(X[r, j], axis=r), name="P")
    r2 = tc.reduce_axis(0, name="r2")
    S = tc.compute((columns,), lambda j: tc.sum(X[r2, j] * 2.0, axis=r2), name="S")
    f = tc.build([X, S0, P, S], target="sim", arch="sm_90")
    x = np.zeros((0, columns), np.float32)
    s0 = np.full((0,), np.nan, np.float32)
    p = np.full((columns,), np.nan, np.float32)
    s = np.full((columns,), np.nan, np.float32)
    f(x, s0, p, s)
    np.testing.assert_array_equal(p, np.ones(columns, np.float32))
    np.testing.assert_array_equal(s, np.zeros(columns, np.float32))
