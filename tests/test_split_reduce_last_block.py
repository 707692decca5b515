"""The one-pass split reduction (tecc.passes.rewrite.split_reduce, combine="last_block"): every block
stores its partials, fences, and counts itself on a per-column-block counter; the last block
of each column block combines the partials, writes Y and resets the counter. Checked against
float64 NumPy in the emulator (fresh random data, several calls on one kernel: the counter must
come back to zero), for the race and fence checks the protocol relies on, in the CUDA C / PTX
NVRTC makes of it, and in saved artifacts (the counter is a zero_init temporary)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import ml_dtypes
import numpy as np
import pytest

import tecc as tc
from tecc.compiler.plan import Step
from tecc.compiler.strategies.column_reduction import choose_point, propose
from tecc.ir import dtype as dt
from tecc.ir.errors import DTypeError, RaceError, TeccError
from tecc.ir.expr import BufferLoad, Call, Const, Var, atomic_add, load_cg, thread_fence
from tecc.ir.stmt import Barrier, Buffer, BufferStore, Evaluate, For, IfThenElse, PrimFunc, seq
from tecc.passes.rewrite.split_reduce import split_reduce
from tecc.runtime.artifact import ArtifactError, load
from tecc.runtime.sim import SimExecutor, simulate_kernel

from protocol_edits import Edit, holds_atomic, is_fence  # tests/ is on sys.path

NP_DTYPE = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
REDUCE = {"sum": tc.sum, "max": tc.max, "min": tc.min}
NP_REDUCE = {"sum": np.sum, "max": np.max, "min": np.min}


def column(R, C, dtype="float32", combiner="sum"):
    X = tc.placeholder((R, C), dtype, name="X")
    i = tc.reduce_axis(R, name="i")
    Y = tc.compute((C,), lambda j: tc.cast(REDUCE[combiner](tc.cast(X[i, j], "float32"), axis=i), dtype), name="Y")
    return [X, Y]


def middle_mean(A, B, C, dtype="float32"):
    X = tc.placeholder((A, B, C), dtype, name="X")
    b = tc.reduce_axis(B, name="b")
    scale = 1.0 / max(B, 1) if isinstance(B, int) else 1.0 / tc.cast(B, "float32")
    Y = tc.compute((A, C), lambda a, c: tc.cast(tc.sum(tc.cast(X[a, b, c], "float32"), axis=b) * scale, dtype),
                   name="Y")
    return [X, Y]


def plan_of(threads_y, splits, unroll=2, outputs_per_thread=1, combine="last_block", threads_x=32):
    args = {"threads_x": threads_x, "threads_y": threads_y, "splits": splits, "unroll": unroll, "combine": combine}
    if outputs_per_thread > 1:
        args["outputs_per_thread"] = outputs_per_thread
    return tc.Plan((Step("split_reduce", args),))


def expected(kind, x, combiner="sum"):
    x64 = x.astype(np.float64)
    return NP_REDUCE[combiner](x64, axis=0) if kind == "column" else x64.mean(axis=1)


def check_close(y, want, dtype, what):
    """Within the float32 accumulation (fp32) or one rounding to the 16-bit output (half an ulp),
    with the worst element named."""
    y64 = y.astype(np.float64)
    if dtype == "float32":
        tol = 1e-5 * np.abs(want) + 1e-4
    else:
        ulp = 2.0 ** -8 if dtype == "bfloat16" else 2.0 ** -11
        tol = ulp * np.abs(want) + ulp * 1e-2 + 1e-6
    bad = np.abs(y64 - want) > tol
    if bad.any():
        k = np.unravel_index(int(np.argmax(np.abs(y64 - want) - tol)), want.shape)
        raise AssertionError(f"{what}: {int(bad.sum())} elements off; worst at {k}: got {y64[k]}, want {want[k]}")


def run_calls(k, kind, shape, dtype, combiner="sum", calls=2, seed=0):
    """`calls` calls of one kernel, each on fresh random data into an output pre-filled with NaN
    (an output the last block never wrote stays NaN)."""
    rng = np.random.default_rng(seed)
    results = []
    for n in range(calls):
        x = (rng.standard_normal(shape) + 0.25).astype(NP_DTYPE[dtype])
        want = expected(kind, x, combiner)
        y = np.full(want.shape, np.nan, NP_DTYPE[dtype])
        k(x, y)
        check_close(y, want, dtype, f"{kind} {combiner} {shape} {dtype}, call {n + 1}, plan {k.plan}")
        results.append(y)
    return results


# ---- the emulator ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("combiner", ["sum", "max", "min"])
@pytest.mark.parametrize("combine", ["last_block", "kernel"])
def test_column_reductions_match_numpy_call_after_call(dtype, combiner, combine):
    # 300 rows over 4 threads x 5 splits (not divisible), 70 columns (a partial column block)
    k = tc.build(column(300, 70, dtype, combiner), target="sim", plan=plan_of(4, 5, combine=combine))
    assert len(k.module.kernels) == (1 if combine == "last_block" else 2)
    run_calls(k, "column", (300, 70), dtype, combiner, calls=3, seed=len(dtype) + len(combiner))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("threads_y,splits,outputs_per_thread", [(8, 3, 1), (4, 16, 2), (16, 4, 4), (2, 5, 8)])
def test_middle_axis_means_match_numpy_call_after_call(dtype, threads_y, splits, outputs_per_thread):
    shape = (3, 133, 48)  # 48 = 6 groups of 8 outputs, 144 outputs: the last column block is partial
    k = tc.build(middle_mean(*shape, dtype), target="sim",
                 plan=plan_of(threads_y, splits, outputs_per_thread=outputs_per_thread))
    run_calls(k, "middle", shape, dtype, calls=2, seed=threads_y * splits)


def test_both_combine_forms_give_the_same_bits():
    """The combine order is the same (partials over ty, then the shared-memory stage over ty vs
    a serial fold in the kernel form), so compare against each other loosely and each exactly
    against itself across calls: the one-pass form is deterministic."""
    x = np.random.default_rng(5).standard_normal((513, 96)).astype(np.float32)
    ys = {}
    for combine in ("last_block", "kernel"):
        k = tc.build(column(513, 96), target="sim", plan=plan_of(8, 6, combine=combine))
        first, second = np.zeros(96, np.float32), np.zeros(96, np.float32)
        k(x, first)
        k(x, second)
        assert np.array_equal(first, second), f"{combine}: two calls on the same data differ"
        ys[combine] = first
    np.testing.assert_allclose(ys["last_block"], ys["kernel"], rtol=1e-5, atol=1e-5)


def test_symbolic_sizes_and_a_temporary_that_grows_and_shrinks():
    R, C = tc.var("R"), tc.var("C")
    k = tc.build(column(R, C), target="sim", plan=plan_of(4, 4))
    arrivals = [t for t in k.host.temps if t.zero_init]
    assert len(arrivals) == 1 and arrivals[0].dtype == dt.int32
    rng = np.random.default_rng(11)
    for shape in [(100, 40), (257, 200), (33, 7), (300, 130)]:  # the counter is reused, regrown, reused
        x = rng.standard_normal(shape).astype(np.float32)
        y = np.full(shape[1], np.nan, np.float32)
        k(x, y)
        check_close(y, x.astype(np.float64).sum(0), "float32", f"column {shape}")
    assert not k._sim._zero_temps[arrivals[0].name].any(), "the counter must be back at zero after every call"


def test_zero_size_reductions_give_the_identity_or_nothing():
    k = tc.build(column(0, 40), target="sim", plan=plan_of(4, 3))
    for _ in range(2):  # every block stores identity partials; the last one writes them out
        y = np.full(40, np.nan, np.float32)
        k(np.zeros((0, 40), np.float32), y)
        assert (y == 0).all()
    k = tc.build(column(0, 40, combiner="max"), target="sim", plan=plan_of(4, 3))
    y = np.zeros(40, np.float32)
    k(np.zeros((0, 40), np.float32), y)
    assert (y == -np.inf).all()
    k = tc.build(column(50, 0), target="sim", plan=plan_of(4, 3))
    y = np.zeros(0, np.float32)
    k(np.zeros((50, 0), np.float32), y)  # an empty grid: nothing launches
    assert y.shape == (0,)


def test_more_splits_than_rows_and_fewer_splits_than_threads():
    for threads_y, splits in [(2, 16), (16, 3), (32, 1)]:
        k = tc.build(column(20, 33), target="sim", plan=plan_of(threads_y, splits))
        run_calls(k, "column", (20, 33), "float32", calls=2, seed=threads_y)


def test_one_pass_module_has_one_kernel_a_partial_and_a_zeroed_counter():
    mod = split_reduce(column(1000, 70), 32, 4, 5, combine="last_block")
    assert len(mod.kernels) == 1 and len(mod.calls) == 1
    partial, arrivals = mod.temps
    assert not partial.zero_init and arrivals.zero_init and arrivals.dtype == dt.int32
    assert const(arrivals.shape[0]) == 3  # one counter per block of 32 outputs
    text = str(mod)
    for piece in ("zero_init", "atomic_add(Y_arrivals[bo], 1)", "load_cg(Y_partial[", "thread_fence()",
                  "Y_arrivals[bo] = 0"):
        assert piece in text, text
    # splits == 1 has nothing to combine: the same single kernel either way, no temporaries
    for combine in ("kernel", "last_block"):
        one = split_reduce(column(1000, 70), 32, 4, 1, combine=combine)
        assert len(one.kernels) == 1 and not one.temps
    with pytest.raises(tc.ScheduleError, match="combine"):
        split_reduce(column(10, 10), combine="atomics")


def const(e):
    return e.value if isinstance(e, Const) else None


# ---- the strategy ------------------------------------------------------------------------------

def test_strategy_picks_one_wave_at_1024_columns_and_keeps_the_measured_two_wave_points():
    # (op, dtype, columns): (threads_y, splits, unroll, outputs_per_thread, combine)
    cases = {
        ("col", "bfloat16", 1024): (32, 32, 4, 4, "last_block"),   # one wave (74-75% measured)
        ("col", "float32", 1024): (32, 32, 4, 4, "last_block"),    # one wave (85-87%)
        ("mid", "bfloat16", 1024): (32, 2, 4, 4, "last_block"),    # one wave (76-77%)
        ("mid", "float32", 1024): (32, 2, 4, 4, "last_block"),     # one wave (86%)
        ("col", "bfloat16", 4096): (8, 32, 8, 2, "last_block"),    # the measured two-wave points,
        ("col", "bfloat16", 8192): (8, 32, 4, 4, "last_block"),    # one pass from 8 splits on
        ("col", "float32", 4096): (8, 16, 8, 1, "last_block"),
        ("col", "float32", 8192): (8, 8, 8, 1, "last_block"),
        ("mid", "bfloat16", 4096): (8, 4, 4, 4, "kernel"),         # few splits: two kernels, as measured
        ("mid", "bfloat16", 8192): (8, 4, 2, 8, "kernel"),
        ("mid", "float32", 4096): (8, 2, 8, 1, "kernel"),
        ("mid", "float32", 8192): (8, 1, 8, 1, "kernel"),          # nothing to combine: one kernel
    }
    for (op, dtype, columns), (threads_y, splits, unroll, vector, combine) in cases.items():
        args = column(16384, columns, dtype) if op == "col" else middle_mean(16, 1024, columns, dtype)
        choice = propose(args)
        step = choice.plan.steps[0].args
        got = (step["threads_y"], step["splits"], step["unroll"], step.get("outputs_per_thread", 1),
               step.get("combine", "kernel"))
        assert got == (threads_y, splits, unroll, vector, combine), (op, dtype, columns, step)
        assert choice.combine == combine
    # no V > 1 divides an odd last extent: the two-wave point stays
    assert choose_point(1023, 1023, 16384, 2).family == "two waves"
    assert choose_point(None, None, None, 2).splits == 1
    # few outputs of a big input: the two-wave point would read 64 bytes per warp (bf16, V = 1)
    assert choose_point(1024, 1024, 131072, 2).family == "one wave"


def test_a_grid_of_one_block_per_sm_keeps_every_row_of_a_thread_in_flight():
    """GPT-2's parameter gradients sum 8192 rows of 768 columns: the one-wave point has 6 x 16
    blocks (MIN_ROWS caps the splits), each alone on its SM, so a thread loads all its 16 bf16 rows
    (8 float32 ones: 128 bytes) at once instead of 4 per round; wider grids keep unroll 4."""
    cases = {
        ("bfloat16", 8192, 768): (32, 16, 16, 4),
        ("float32", 8192, 768): (32, 16, 8, 4),
        ("bfloat16", 8192, 2304): (32, 8, 4, 4),    # 144 blocks: two per SM, unroll 4
        ("bfloat16", 8192, 3072): (32, 8, 4, 4),
        ("bfloat16", 16384, 1024): (32, 32, 4, 4),  # the measured one-wave point
    }
    for (dtype, rows, columns), want in cases.items():
        step = propose(column(rows, columns, dtype)).plan.steps[0].args
        got = (step["threads_y"], step["splits"], step["unroll"], step.get("outputs_per_thread", 1))
        assert got == want, (dtype, rows, columns, step)


@pytest.mark.parametrize("shape", [(4099, 260), (1000, 300), (8192, 768)])
def test_the_planned_point_of_few_rows_matches_numpy(shape):
    """The planner's point for few rows (16 rows in flight per thread, a guarded last round when
    the rows do not divide: 4099 = 8 splits x 32 threads x 16 rows + 3) in the emulator."""
    k = tc.build(column(*shape, "bfloat16"), target="sim")
    assert k.plan.strategy == "column_reduction" and k.plan.steps[0].args["unroll"] == 16, k.plan
    run_calls(k, "column", shape, "bfloat16", calls=2, seed=sum(shape))


def test_auto_plan_builds_one_kernel_and_matches_numpy():
    k = tc.build(column(2048, 1024, "bfloat16"), target="sim")
    assert k.plan.strategy == "column_reduction" and len(k.module.kernels) == 1, k.plan
    run_calls(k, "column", (2048, 1024), "bfloat16", calls=2, seed=3)


# ---- the emulator's checks -----------------------------------------------------------------------

def _broken_run(drop, calls=1):
    k = tc.build(column(300, 70), target="sim", plan=plan_of(4, 5))
    (func,) = k.module.kernels
    broken = Edit(drop=drop).visit_func(func)
    assert str(broken) != str(func), "the mutation must remove something"
    run = SimExecutor(k.host, {func.name: broken})
    x = np.random.default_rng(1).standard_normal((300, 70)).astype(np.float32)
    ys = []
    for _ in range(calls):
        y = np.full(70, np.nan, np.float32)
        run(x, y)
        ys.append(y)
    return x, ys


def test_a_missing_barrier_after_the_atomic_is_a_shared_memory_race():
    with pytest.raises(RaceError, match="read-after-write.*Y_arrived"):
        _broken_run(lambda prev, s, nxt: isinstance(s, Barrier) and holds_atomic(prev))


def test_a_missing_release_fence_is_reported():
    with pytest.raises(RaceError, match="no __threadfence\\(\\) follows it"):
        _broken_run(lambda prev, s, nxt: is_fence(s) and isinstance(nxt, BufferStore))


def test_a_missing_barrier_between_the_stores_and_the_fence_is_reported():
    with pytest.raises(RaceError, match="a __syncthreads\\(\\) then a __threadfence"):
        _broken_run(lambda prev, s, nxt: isinstance(s, Barrier) and holds_atomic(nxt))


def _publish_kernel(fence_each: bool, barrier: bool, fence_leader: bool) -> PrimFunc:
    """Each of 64 threads of 4 blocks stores a word, then (optionally) fences, (optionally) a
    barrier, then thread 0 (optionally fences and) counts the block with an atomic."""
    data, count, ticket = Buffer("data", dt.int32, (256,)), Buffer("count", dt.int32, (1,)), Buffer(
        "ticket", dt.int32, (4,))
    bx, tx = Var("bx", dt.int32), Var("tx", dt.int32)
    zero = Const(0, dt.int32)
    leader = seq(Evaluate(thread_fence()) if fence_leader else None,
                 BufferStore(ticket, (bx,), atomic_add(count[zero], 1)))
    body = seq(BufferStore(data, (bx * 64 + tx,), tx), Evaluate(thread_fence()) if fence_each else None,
               Barrier() if barrier else None, IfThenElse(tx == 0, leader))
    return PrimFunc("publish", (data, count, ticket), For(bx, 0, 4, "blockIdx.x", For(tx, 0, 64, "threadIdx.x", body)))


@pytest.mark.parametrize("fence_each,barrier,fence_leader,error", [
    (True, True, False, None),               # every writer fences, a barrier, the atomic (threadFenceReduction)
    (False, True, True, None),               # a barrier, the leader fences, the atomic (grid sync)
    (True, False, False, "no __syncthreads\\(\\) orders that fence"),
    (False, True, False, "no __threadfence\\(\\) follows it"),
    (False, False, True, "neither its own __threadfence"),
])
def test_the_publish_check_accepts_both_handshakes_and_names_what_is_missing(fence_each, barrier, fence_leader,
                                                                           error):
    func = _publish_kernel(fence_each, barrier, fence_leader)
    args = {"data": np.zeros(256, np.int32), "count": np.zeros(1, np.int32), "ticket": np.full(4, -1, np.int32)}
    if error is None:
        simulate_kernel(func, args, (4, 1, 1), (64, 1, 1))
        assert sorted(args["ticket"]) == [0, 1, 2, 3] and args["count"][0] == 4
    else:
        with pytest.raises(RaceError, match=error):
            simulate_kernel(func, args, (4, 1, 1), (64, 1, 1))


def test_a_counter_that_is_not_reset_shows_on_the_next_call():
    x, (first, second) = _broken_run(lambda prev, s, nxt: isinstance(s, IfThenElse)
                                     and "Y_arrivals[bo] = 0" in str(s), calls=2)
    check_close(first, x.astype(np.float64).sum(0), "float32", "first call")
    assert np.isnan(second).all(), "no block of the second call may believe it is the last"


def test_atomic_add_takes_effect_in_lane_order():
    counts = Buffer("counts", dt.int32, (3,))
    out = Buffer("out", dt.int32, (2, 96))
    bx, tx = Var("bx", dt.int32), Var("tx", dt.int32)
    body = For(bx, 0, 2, "blockIdx.x", For(tx, 0, 96, "threadIdx.x",
               IfThenElse(tx % 5 != 4, BufferStore(out, (bx, tx), atomic_add(counts[tx % 3], 2)))))
    func = PrimFunc("atomics", (counts, out), body)
    c = np.array([7, 0, -3], np.int32)
    o = np.full((2, 96), -1, np.int32)
    simulate_kernel(func, {"counts": c, "out": o}, (2, 1, 1), (96, 1, 1))
    active = [(b, t) for b in range(2) for t in range(96) if t % 5 != 4]
    want = np.full((2, 96), -1, np.int32)
    running = [7, 0, -3]
    for b, t in active:  # lanes in order: block 0's threads, then block 1's
        want[b, t] = running[t % 3]
        running[t % 3] += 2
    np.testing.assert_array_equal(o, want)
    np.testing.assert_array_equal(c, running)


def test_float32_atomic_add_accumulates_in_lane_order_without_the_publication_check():
    """A float32 atomic_add (the attention backward's dQ) adds lane after lane, each sum rounded
    to float32, and announces nothing: a store before it needs no fence."""
    acc = Buffer("acc", dt.float32, (3,))
    old = Buffer("old", dt.float32, (64,))
    tx = Var("tx", dt.int32)
    body = For(tx, 0, 64, "threadIdx.x", seq(BufferStore(old, (tx,), Const(0.0, dt.float32)),
                                             BufferStore(old, (tx,), atomic_add(acc[tx % 3], Const(0.5, dt.float32)))))
    a = np.array([1.0, 2.0 ** 24, -3.0], np.float32)   # 2^24 + 0.5 rounds back to 2^24 in float32
    o = np.full(64, np.nan, np.float32)
    simulate_kernel(PrimFunc("accumulate", (acc, old), body), {"acc": a, "old": o}, (1, 1, 1), (64, 1, 1))
    counts = [len(range(r, 64, 3)) for r in range(3)]
    np.testing.assert_array_equal(a, np.array([1.0 + 0.5 * counts[0], 2.0 ** 24, -3.0 + 0.5 * counts[2]], np.float32))
    np.testing.assert_array_equal(o[0::3], 1.0 + 0.5 * np.arange(counts[0], dtype=np.float32))


def test_memory_intrinsics_are_checked_when_built():
    f32 = Buffer("f", dt.float32, (4,))
    shared = Buffer("s", dt.int32, (4,), "shared")
    counts = Buffer("c", dt.int32, (4,))
    with pytest.raises(DTypeError, match="int32, int64, float32, float64"):
        atomic_add(Buffer("h", dt.float16, (4,))[0], 1)  # no 16-bit atomics: scatters accumulate in float32
    with pytest.raises(DTypeError, match="float32 element"):
        Call("atomic_add", (f32[0], Const(1, dt.int32)), dt.int32)
    assert atomic_add(f32[0], 1.5).dtype == dt.float32
    with pytest.raises(TeccError, match="global buffer element"):
        atomic_add(shared[0], 1)
    with pytest.raises(TeccError, match="global buffer element"):
        load_cg(Const(1, dt.int32))
    assert isinstance(load_cg(f32[1]).args[0], BufferLoad) and load_cg(f32[1]).dtype == dt.float32
    assert str(atomic_add(counts[2], 1)) == "atomic_add(c[2], 1)" and str(thread_fence()) == "thread_fence()"
    with pytest.raises(TeccError, match="zero-initialised"):
        Buffer("z", dt.int32, (4,), "shared", zero_init=True)


# ---- CUDA C, NVRTC and PTX ----------------------------------------------------------------------

def _entry(ptx, kernel):
    """The PTX of one kernel: from its `.entry` to the next one."""
    return ptx.split(f".entry {kernel}(")[1].split(".entry ")[0]


@pytest.mark.parametrize("dtype,outputs_per_thread", [("float32", 4), ("bfloat16", 4), ("float16", 1)])
def test_ptx_has_the_atomic_the_fence_and_coherent_partial_loads(dtype, outputs_per_thread):
    one = tc.build(column(16384, 1024, dtype), target="cuda", arch="sm_90",
                   plan=plan_of(16, 64, 4, outputs_per_thread))
    two = tc.build(column(16384, 1024, dtype), target="cuda", arch="sm_90",
                   plan=plan_of(16, 64, 4, outputs_per_thread, combine="kernel"))
    src = one.source
    assert "atomicAdd(&Y_arrivals[bo], 1)" in src and "__threadfence();" in src and "__ldcg(&Y_partial[" in src
    assert "int* __restrict__ Y_arrivals" in src and "const int* __restrict__ Y_arrivals" not in src
    ptx = one.ptx
    assert re.search(r"atom\.global\.add\.u32|atom\.global\.add\.s32|red\.global\.add", ptx), ptx[-3000:]
    assert "atom.global.add" in ptx
    assert re.search(r"membar\.gl|fence\.(sc|acq_rel)\.gpu", ptx)
    assert len(re.findall(r"ld\.global\.cg", ptx)) >= 1
    # the only non-coherent loads are X's: as many as in the two-kernel form's first kernel
    nc = len(re.findall(r"ld\.global\.nc", ptx))
    assert nc >= 1 and nc == len(re.findall(r"ld\.global\.nc", _entry(two.ptx, "Y_split_kernel")))
    for res in one.resources.values():
        assert res.spill_stores == 0 and res.spill_loads == 0
        assert res.registers <= 32, f"{dtype}: {res.registers} registers: under full occupancy"


# ---- artifacts ---------------------------------------------------------------------------------------

def _built(args, plan):
    return tc.build(args, target="cuda", arch="sm_90", plan=plan)


def test_saved_manifest_records_the_zeroed_temporary_and_reads_back(tmp_path):
    k = _built(column(4096, 1024), plan_of(8, 8))
    stem = k.save(tmp_path / "col")
    manifest = json.loads(stem.with_suffix(".json").read_text())
    assert manifest["version"] == 2
    temps = {t["buffer"]["name"]: t["buffer"] for t in manifest["host"]["temps"]}
    assert temps["Y_arrivals"]["zero_init"] is True and "zero_init" not in temps["Y_partial"]
    loaded = load(stem)
    assert {t.name: t.zero_init for t in loaded.host.temps} == {"Y_partial": False, "Y_arrivals": True}
    # no zeroed temporary: the manifest stays version 1, readable by older runtimes
    plain = _built(column(4096, 1024), plan_of(8, 8, combine="kernel"))
    assert json.loads(plain.save(tmp_path / "two").with_suffix(".json").read_text())["version"] == 1
    # a version-1 manifest cannot carry one
    manifest["version"] = 1
    (tmp_path / "bad.json").write_text(json.dumps(manifest))
    (tmp_path / "bad.cubin").write_bytes(stem.with_suffix(".cubin").read_bytes())
    with pytest.raises(ArtifactError, match="zero_init"):
        load(tmp_path / "bad")


def test_header_says_zero_the_counter_once(tmp_path):
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "gen_header", Path(__file__).resolve().parents[1] / "examples" / "deploy" / "gen_header.py")
    gen_header = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen_header)
    stem = _built(column(tc.var("R"), 1024), plan_of(8, 8)).save(tmp_path / "col")
    header = tmp_path / "col.h"
    assert gen_header.main([str(stem.with_suffix(".json")), "-o", str(header)]) == 0
    text = header.read_text()
    assert "temporary Y_arrivals" in text and "zero this temporary once" in text
    assert text.count("zero this temporary once") == 2  # in the list of buffers and at its pointer
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is not None:
        main = tmp_path / "use.cpp"
        main.write_text(f'#include "{header}"\nint main() {{ Y_sizes s{{}}; s.R = 8; Y_buffers b{{}}; tecc_launch l;'
                        ' return Y_launch(0, &s, &b, &l) == 1 ? 0 : 1; }\n')
        subprocess.run([cxx, "-std=c++11", "-o", str(tmp_path / "use"), str(main)], check=True)
        assert subprocess.run([str(tmp_path / "use")]).returncode == 0


# ---- on the GPU --------------------------------------------------------------------------------------

GPU_CASES = [
    ("column", (16384, 1024), "bfloat16", None),             # the strategy's one-wave points
    ("column", (16384, 1024), "float32", None),
    ("column", (8192, 768), "bfloat16", None),               # GPT-2's gradients: a block per SM, unroll 16
    ("column", (8192, 768), "float32", None),
    ("middle", (16, 1024, 1024), "bfloat16", None),
    ("column", (16384, 4096), "bfloat16", None),             # a two-wave point, one pass (32 splits)
    ("column", (3001, 999), "float16", plan_of(16, 8, 4)),    # partial blocks, row guards
    ("column", (20000, 130), "float32", plan_of(32, 64, 4, 2)),
]


def _gpu_args(kind, shape, dtype):
    return column(*shape, dtype) if kind == "column" else middle_mean(*shape, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("kind,shape,dtype,plan", GPU_CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in GPU_CASES])
def test_gpu_one_pass_matches_numpy_call_after_call(kind, shape, dtype, plan):
    k = tc.build(_gpu_args(kind, shape, dtype), target="cuda", plan=plan or "auto")
    assert len(k.module.kernels) == 1, k.plan
    rng = np.random.default_rng(sum(shape))
    for n in range(4):  # the counter resets itself: every call must be right
        x = (rng.standard_normal(shape) + 0.25).astype(NP_DTYPE[dtype])
        want = expected(kind, x)
        y = np.full(want.shape, np.nan, NP_DTYPE[dtype])
        k(x, y)
        check_close(y, want, dtype, f"GPU {kind} {shape} {dtype}, call {n + 1}, plan {k.plan}")


@pytest.mark.gpu
def test_gpu_one_pass_with_symbolic_sizes_reallocates_its_counter():
    R, C = tc.var("R"), tc.var("C")
    k = tc.build(column(R, C), target="cuda", plan=plan_of(8, 16, 4))
    rng = np.random.default_rng(4)
    for shape in [(4096, 512), (4096, 4096), (1000, 77), (4096, 4096), (8192, 2048)]:  # grow, shrink, grow
        x = rng.standard_normal(shape).astype(np.float32)
        y = np.full(shape[1], np.nan, np.float32)
        k(x, y)
        check_close(y, x.astype(np.float64).sum(0), "float32", f"GPU column {shape}")


@pytest.mark.gpu
def test_gpu_one_pass_on_torch_tensors_in_place():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    k = tc.build(column(16384, 1024, "bfloat16"), target="cuda")
    assert len(k.module.kernels) == 1
    for n in range(5):  # launch-cache hits after the first call
        x = torch.randn(16384, 1024, device="cuda", dtype=torch.bfloat16) + 0.25
        y = torch.full((1024,), float("nan"), device="cuda", dtype=torch.bfloat16)
        k(x, y)
        torch.cuda.synchronize()
        want = x.double().sum(0).cpu().numpy()
        check_close(y.float().cpu().numpy(), want, "bfloat16", f"torch call {n + 1}")
    # another size through the same plan reallocates nothing but must still be right
    k2 = tc.build(middle_mean(16, 1024, 1024, "bfloat16"), target="cuda")
    x = torch.randn(16, 1024, 1024, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(16, 1024, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        k2(x, y)
    torch.cuda.synchronize()
    check_close(y.float().cpu().numpy(), x.double().mean(1).cpu().numpy(), "bfloat16", "torch middle mean")
