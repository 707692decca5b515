"""Few long rows and full reductions in one kernel (tecc.passes.rewrite.split_rows, combine="last_block"):
the S blocks of a row each store their partial, the leader fences and counts the block on the
row's counter, and the last block to arrive combines the row's partials (read with load_cg),
writes Y and resets the counter. Checked against float64 NumPy in the emulator (fresh random
data every call, several calls on one kernel: the counter must come back to zero; the race and
fence checks on), against the two-kernel form, in the CUDA C / PTX NVRTC makes of it, in what
the strategy chooses, and (marked gpu) on the GPU."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

import tecc as tc
from tecc.compiler.plan import Plan, Step
from tecc.compiler.schedule import Schedule
from tecc.compiler.strategies.split_rows import (
    ONE_PASS_LAUNCH_SHARE,
    choose_combine,
    propose,
)
from tecc.ir import dtype as dt
from tecc.ir.errors import RaceError, ScheduleError
from tecc.ir.expr import Const
from tecc.ir.stmt import Barrier, BufferStore, IfThenElse
from tecc.ir.target import target
from tecc.passes.rewrite.split_rows import split_rows
from tecc.runtime.sim import SimExecutor

# tests/ is on sys.path (no package): the row and full reductions of the two-kernel tests
from test_split_rows import IDENTITY, NP_DTYPE, full_reduce, row_reduce
from test_split_rows import NP as NP_REDUCE
from protocol_edits import Edit, holds_atomic, is_fence

WIDEST = {"float32": 4, "float16": 8, "bfloat16": 8}   # elements of a 16-byte vector


def plan_of(threads=64, splits=4, vector=1, unroll=2, combine="last_block"):
    args = {"threads": threads, "splits": splits, "vector": vector, "unroll": unroll}
    if combine != "kernel":
        args["combine"] = combine
    return Plan((Step("split_rows", args),))


def fresh(rng, shape, dtype, combiner):
    x = rng.standard_normal(shape)
    if combiner == "prod":
        x = 1.0 + 0.01 * x   # a product of thousands of factors stays finite
    return x.astype(NP_DTYPE[dtype])


def check_close(y, x, combiner, dtype, what, axis=-1):
    """y against ⊕ of float64 x: float32 accumulation in another order than NumPy's (bounded by
    the sum of magnitudes), then one rounding to the output dtype (half an ulp)."""
    x64 = np.asarray(x, np.float64)
    if x64.ndim == 0 or axis is None:
        want, mag = NP_REDUCE[combiner](x64), np.abs(x64).sum()
    else:
        want, mag = NP_REDUCE[combiner](x64, axis=axis), np.abs(x64).sum(axis=axis)
    if combiner == "prod":
        mag = np.abs(want) * x64.shape[-1] if x64.ndim else np.abs(want)
    ulp = {"float32": 2.0 ** -23, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}[dtype]
    tol = ulp * np.abs(want) + 4e-7 * mag + 1e-6
    y64 = np.asarray(y, np.float64)
    bad = ~(np.abs(y64 - want) <= tol)   # NaN (an output nobody wrote) is bad
    if bad.any():
        k = np.unravel_index(int(np.argmax(np.where(bad, 1, 0))), np.shape(want)) if np.ndim(want) else ()
        raise AssertionError(f"{what}: {int(bad.sum())} element(s) off; worst at {k}: got {y64[k]}, "
                             f"want {np.asarray(want)[k]}")


def counters(k):
    """The zero_init counters the emulator keeps across calls (as the CUDA executor does)."""
    (arrivals,) = [t for t in k.host.temps if t.zero_init]
    return k._sim._zero_temps[arrivals.name]


def run_calls(k, shape, dtype, combiner="sum", calls=3, seed=0, out_shape=None):
    """`calls` calls of one kernel, each on fresh random data into an output pre-filled with NaN
    (an output the last block never wrote stays NaN); the counters must be zero after each."""
    rng = np.random.default_rng(seed)
    out_shape = shape[:-1] if out_shape is None else out_shape
    for n in range(calls):
        x = fresh(rng, shape, dtype, combiner)
        y = np.full(out_shape, np.nan, NP_DTYPE[dtype])
        k(x, y)
        axis = None if out_shape == () else -1
        check_close(y, x, combiner, dtype, f"{combiner} {shape} {dtype}, call {n + 1}, plan {k.plan}", axis)
        if any(t.zero_init for t in k.host.temps):
            assert not counters(k).any(), f"call {n + 1}: a counter was left non-zero"


# ---- the emulator ------------------------------------------------------------------------------

# (shape, threads, splits, unroll): the chunk forms of split_rows, and S against T
CHUNKS = {
    "guarded": ((3, 1000), 64, 4, 2),            # a guarded last round, S < T (select-guarded gather)
    "exact": ((4, 2048), 64, 4, 2),              # S·T·V·U divides the row: no guard (at V = 4)
    "unaligned": ((3, 3 * 512 + 7), 32, 5, 2),   # rows start anywhere: heads and tails by element
    "many_splits": ((2, 4001), 32, 70, 1),       # S > T: three gathered loads per thread, the last guarded
    "splits_divide": ((2, 4096), 32, 64, 1),     # S = 2T: two unguarded gathered loads per thread
}


@pytest.mark.parametrize("combine", ["last_block", "kernel"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("combiner", ["sum", "max", "min", "prod"])
@pytest.mark.parametrize("chunks", list(CHUNKS))
def test_rows_match_float64_numpy_call_after_call(chunks, combiner, dtype, combine):
    shape, threads, splits, unroll = CHUNKS[chunks]
    vector = WIDEST[dtype] if chunks != "exact" else 4
    k = tc.build(row_reduce(*shape, dtype, combiner), target="sim",
                 plan=plan_of(threads, splits, vector, unroll, combine))
    assert len(k.module.kernels) == (1 if combine == "last_block" else 2)
    run_calls(k, shape, dtype, combiner, calls=3, seed=len(chunks) + len(combiner) + len(dtype))


@pytest.mark.parametrize("combine", ["last_block", "kernel"])
@pytest.mark.parametrize("combiner", ["sum", "max", "prod"])
@pytest.mark.parametrize("shape,vector", [((40, 64), 4), ((33, 17), 1), ((33, 17), 4), ((3, 5, 24), 8)])
def test_full_reductions_to_a_scalar(shape, vector, combiner, combine):
    k = tc.build(full_reduce(shape, combiner=combiner), target="sim", plan=plan_of(32, 5, vector, 2, combine))
    assert k.module.params[1].shape == ()
    run_calls(k, shape, "float32", combiner, calls=3, seed=len(shape), out_shape=())


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_16_bit_mean_is_scaled_and_cast_by_the_last_block(dtype):
    args = row_reduce(3, 1200, dtype, mean=True)
    k = tc.build(args, target="sim", plan=plan_of(32, 3, 8, 2))
    (func,) = k.module.kernels
    assert "0.000833" in str(func) and "reinterpret_cast<const uint4*>(&X[" in k.source
    partial = next(t for t in k.module.temps if not t.zero_init)
    assert partial.dtype == dt.float32                          # float32 partials for 16-bit sources
    rng = np.random.default_rng(3)
    for n in range(3):
        x = rng.standard_normal((3, 1200)).astype(NP_DTYPE[dtype])
        y = np.full(3, np.nan, NP_DTYPE[dtype])
        k(x, y)
        want = x.astype(np.float64).mean(1)
        ulp = 2.0 ** -8 if dtype == "bfloat16" else 2.0 ** -11
        assert (np.abs(y.astype(np.float64) - want) <= ulp * np.abs(want) + 1e-6).all(), (n, y, want)


def test_symbolic_sizes_grow_and_shrink_the_counters_which_stay_zero():
    R, C = tc.var("R"), tc.var("C")
    k = tc.build(row_reduce(R, C), target="sim", plan=plan_of(32, 3, 4, 2))
    (arrivals,) = [t for t in k.host.temps if t.zero_init]
    assert arrivals.dtype == dt.int32 and str(arrivals.shape[0]) == "R"   # one counter per row
    rng = np.random.default_rng(7)
    # grow (3 -> 5 -> 9 rows: reallocated and zeroed), shrink (2: a zero prefix), grow again,
    # empty rows (the identity), no rows (nothing launches), and back
    for r, c in [(3, 701), (5, 2000), (2, 64), (9, 1001), (4, 0), (0, 5), (9, 333), (1, 3)]:
        x = rng.standard_normal((r, c)).astype(np.float32)
        y = np.full(r, np.nan, np.float32)
        k(x, y)
        check_close(y, x, "sum", "float32", f"symbolic {r} x {c}")
        assert not counters(k).any(), f"{r} x {c}: a counter was left non-zero"


def test_a_symbolic_single_row_reads_vectors_and_its_tail_by_element():
    N = tc.var("N")
    X = tc.placeholder((N,), "float32", name="X")
    n = tc.reduce_axis(N, name="n")
    k = tc.build([X, tc.compute((), lambda: tc.sum(X[n], axis=n), name="Y")], target="sim",
                 plan=plan_of(32, 3, 4, 2))
    assert "float4" in k.source
    for size in (1, 3, 1001, 255, 4000):
        x = np.random.default_rng(size).standard_normal(size).astype(np.float32)
        y = np.full((), np.nan, np.float32)
        k(x, y)
        check_close(y, x, "sum", "float32", f"N={size}", axis=None)


@pytest.mark.parametrize("combiner", ["sum", "prod", "max", "min"])
def test_empty_rows_give_the_identity_and_no_rows_launch_nothing(combiner):
    k = tc.build(row_reduce(3, 0, combiner=combiner), target="sim", plan=plan_of())
    for _ in range(2):
        y = np.full(3, np.nan, np.float32)
        k(np.zeros((3, 0), np.float32), y)
        assert (y == IDENTITY[combiner]).all(), y
    assert not counters(k).any()
    k = tc.build(row_reduce(0, 50, combiner=combiner), target="sim", plan=plan_of())
    y = np.zeros((0,), np.float32)
    k(np.zeros((0, 50), np.float32), y)
    assert y.shape == (0,)


def test_more_splits_than_chunks_with_data():
    # 40 elements over 8 blocks of 32 threads: most chunks are past the row's end (identity partials)
    k = tc.build(row_reduce(5, 40, combiner="max"), target="sim", plan=plan_of(32, 8, 2, 1))
    run_calls(k, (5, 40), "float32", "max", calls=3, seed=2)


def test_integer_sums():
    X = tc.placeholder((2, 999), "int32", name="X")
    c = tc.reduce_axis(999, name="c")
    k = tc.build([X, tc.compute((2,), lambda r: tc.sum(X[r, c], axis=c), name="Y")], target="sim",
                 plan=plan_of(splits=3))
    for seed in range(3):
        x = np.random.default_rng(seed).integers(-1000, 1000, (2, 999)).astype(np.int32)
        y = np.full(2, -7, np.int32)
        k(x, y)
        assert (y == x.sum(1)).all(), (y, x.sum(1))


def test_both_combine_forms_agree_and_the_one_pass_is_deterministic():
    x = np.random.default_rng(5).standard_normal((3, 5000)).astype(np.float32)
    ys = {}
    for combine in ("last_block", "kernel"):
        k = tc.build(row_reduce(3, 5000), target="sim", plan=plan_of(64, 9, 4, 2, combine))
        first, second = np.zeros(3, np.float32), np.zeros(3, np.float32)
        k(x, first)
        k(x, second)
        assert np.array_equal(first, second), f"{combine}: two calls on the same data differ"
        ys[combine] = first
    # the same partials, combined over T threads (one pass) or T2 = min(256, S rounded to a warp)
    np.testing.assert_allclose(ys["last_block"], ys["kernel"], rtol=1e-6, atol=1e-5)


def test_auto_plans_of_small_inputs_are_one_kernel_and_match_numpy():
    for args, shape, out_shape in [(row_reduce(1, 100003, "bfloat16"), (1, 100003), (1,)),
                                   (full_reduce((300, 301)), (300, 301), ())]:
        k = tc.build(args, target="sim", arch="sm_90")
        assert k.plan.strategy == "split_rows" and k.plan.steps[0].args.get("combine") == "last_block", k.plan
        assert [f.name for f in k.module.kernels] == ["Y_split_kernel"]
        assert "by the last of the row's blocks to finish (one kernel)" in k.explain()
        run_calls(k, shape, args[0].dtype.name, calls=3, seed=1, out_shape=out_shape)


# ---- the module ----------------------------------------------------------------------------------

def test_one_pass_module_has_one_kernel_a_partial_and_a_zeroed_counter_per_row():
    mod = split_rows(row_reduce(3, 1000), threads=64, splits=5, vector=4, unroll=2, combine="last_block")
    assert len(mod.kernels) == 1 and len(mod.calls) == 1
    partial, arrivals = mod.temps
    assert not partial.zero_init and arrivals.zero_init and arrivals.dtype == dt.int32
    assert isinstance(arrivals.shape[0], Const) and arrivals.shape[0].value == 3
    text = str(mod)
    for piece in ("for row in range(3):  # blockIdx.x", "for s in range(5):  # blockIdx.y", "zero_init",
                  "atomic_add(Y_arrivals[row], 1)", "load_cg(Y_partial[row, i * 64 + tx])", "thread_fence()",
                  "Y_arrivals[row] = 0", "combine = last_block", "min_blocks_per_sm = 32"):
        assert piece in text, (piece, text)
    # the kernel form is untouched by the option, and splits == 1 has nothing to combine
    assert "atomic" not in str(split_rows(row_reduce(3, 1000), threads=64, splits=5, vector=4, unroll=2))
    for combine in ("kernel", "last_block"):
        one = split_rows(row_reduce(3, 1000), threads=64, splits=1, vector=4, combine=combine)
        assert len(one.kernels) == 1 and not one.temps
    with pytest.raises(ScheduleError, match="combine"):
        split_rows(row_reduce(3, 1000), splits=2, combine="atomics")


def test_the_plan_replays_through_json_and_schedule_and_records_combine_only_when_not_the_default():
    args = row_reduce(3, 1000)
    one_pass = plan_of(64, 4, 4, 2)
    sch = Schedule(args, Plan.from_json(one_pass.to_json()))
    assert sch.plan.steps == one_pass.steps and sch.plan.steps[0].args["combine"] == "last_block"
    assert str(Schedule(args, one_pass).mod) == str(sch.mod) and len(sch.mod.kernels) == 1
    two = Schedule(args, plan_of(64, 4, 4, 2, combine="kernel"))
    assert "combine" not in two.plan.steps[0].args and len(two.mod.kernels) == 2
    explicit = Schedule(args, Plan((Step("split_rows", {"threads": 64, "splits": 4, "vector": 4, "unroll": 2,
                                                        "combine": "kernel"}),)))
    assert explicit.plan.steps == two.plan.steps and str(explicit.mod) == str(two.mod)


# ---- a broken protocol must fail -------------------------------------------------------------------

def _broken_run(calls=1, **edit):
    k = tc.build(row_reduce(3, 1000), target="sim", plan=plan_of(64, 5, 4, 2))
    (func,) = k.module.kernels
    broken = Edit(**edit).visit_func(func)
    assert str(broken) != str(func), "the mutation must change something"
    run = SimExecutor(k.host, {func.name: broken})
    x = np.random.default_rng(1).standard_normal((3, 1000)).astype(np.float32)
    ys = []
    for _ in range(calls):
        y = np.full(3, np.nan, np.float32)
        run(x, y)
        ys.append(y)
    return x, ys


def test_the_intact_kernel_passes_the_same_harness():
    # what the tests below break runs clean and right here, call after call
    k = tc.build(row_reduce(3, 1000), target="sim", plan=plan_of(64, 5, 4, 2))
    (func,) = k.module.kernels
    run = SimExecutor(k.host, {func.name: func})
    x = np.random.default_rng(1).standard_normal((3, 1000)).astype(np.float32)
    for _ in range(2):
        y = np.full(3, np.nan, np.float32)
        run(x, y)
        check_close(y, x, "sum", "float32", "intact")


def test_a_counter_that_is_not_reset_shows_on_the_next_call():
    x, (first, second) = _broken_run(calls=2, drop=lambda prev, s, nxt: isinstance(s, IfThenElse)
                                     and "Y_arrivals[row] = 0" in str(s))
    check_close(first, x, "sum", "float32", "first call")
    assert np.isnan(second).all(), "no block of the second call may believe it is the last"


def test_a_missing_release_fence_is_reported():
    with pytest.raises(RaceError, match="thread \\(0, 0, 0\\) stored to global memory, and neither its own "
                                        "__threadfence"):
        _broken_run(drop=lambda prev, s, nxt: is_fence(s) and isinstance(nxt, BufferStore))


def test_a_missing_barrier_after_the_atomic_is_a_shared_memory_race():
    with pytest.raises(RaceError, match="read-after-write.*Y_arrived"):
        _broken_run(drop=lambda prev, s, nxt: isinstance(s, Barrier) and holds_atomic(prev))


def test_the_barrier_free_publish_needs_the_leader_to_store_the_partial():
    # thread 1 storing the partial instead of the leader (thread 0): with no barrier between its
    # store and the leader's fence, nothing orders that store before the count
    def store_by_thread_1(s):
        if isinstance(s, IfThenElse) and isinstance(s.then_case, BufferStore) and \
                s.then_case.buffer.name == "Y_partial":
            return IfThenElse(s.cond.a == 1, s.then_case)  # tx == 0 -> tx == 1
        return None

    with pytest.raises(RaceError, match="thread \\(1, 0, 0\\) stored to global memory, and neither its own "
                                        "__threadfence"):
        _broken_run(swap=store_by_thread_1)


# ---- CUDA C, NVRTC and PTX --------------------------------------------------------------------------

def _entry(ptx, kernel):
    return ptx.split(f".entry {kernel}(")[1].split(".entry ")[0]


@pytest.mark.parametrize("args_of,vector", [(lambda: row_reduce(2, 3 * (1 << 20) + 7), 4),
                                            (lambda: row_reduce(2, 3 * (1 << 20) + 7, "bfloat16"), 8),
                                            (lambda: full_reduce((4096, 4099)), 4),
                                            (lambda: row_reduce(3, 100000, "float16"), 8)])
def test_ptx_has_the_atomic_the_fences_and_coherent_partial_loads(args_of, vector):
    pytest.importorskip("cuda.core")
    splits = 70  # not a multiple of the 256 threads: the gather's select guard is in too
    one = tc.build(args_of(), target="cuda", arch="sm_90", plan=plan_of(256, splits, vector, 4))
    two = tc.build(args_of(), target="cuda", arch="sm_90", plan=plan_of(256, splits, vector, 4, "kernel"))
    src = one.source
    assert "atomicAdd(&Y_arrivals[" in src and "__threadfence();" in src and "__ldcg(&Y_partial[" in src
    assert "int* __restrict__ Y_arrivals" in src and "const int* __restrict__ Y_arrivals" not in src
    ptx = one.ptx
    assert "atom.global.add" in ptx
    assert re.search(r"membar\.gl|fence\.sc\.gpu", ptx)
    assert len(re.findall(r"ld\.global\.cg", ptx)) >= 1
    # the only non-coherent loads are X's: as many as in the two-kernel form's first kernel
    nc = len(re.findall(r"ld\.global\.nc", ptx))
    assert nc >= 1 and nc == len(re.findall(r"ld\.global\.nc", _entry(two.ptx, "Y_partial_kernel")))
    for res in one.resources.values():
        assert res.spill_stores == 0 and res.spill_loads == 0
        assert res.registers <= 32, f"{res.registers} registers: under 8 blocks of 256 per SM"


def test_saved_manifest_records_the_zeroed_counter(tmp_path):
    pytest.importorskip("cuda.core")
    from tecc.runtime.artifact import load

    k = tc.build(row_reduce(tc.var("R"), 1 << 16), target="cuda", arch="sm_90", plan=plan_of(256, 16, 4, 4))
    stem = k.save(tmp_path / "rows")
    manifest = json.loads(stem.with_suffix(".json").read_text())
    assert manifest["version"] == 2
    temps = {t["buffer"]["name"]: t["buffer"] for t in manifest["host"]["temps"]}
    assert temps["Y_arrivals"]["zero_init"] is True and "zero_init" not in temps["Y_partial"]
    assert {t.name: t.zero_init for t in load(stem).host.temps} == {"Y_partial": False, "Y_arrivals": True}


# ---- the strategy ------------------------------------------------------------------------------------

H100 = target("sm_90")
H200 = H100.replace(dram_bandwidth=4.8e12, name="H200")
M = 1 << 20
# (name, args): the shapes of benchmarks/split_rows.py
SHAPES = {
    "8x16M": lambda d: row_reduce(8, 16 * M, d),
    "1x64M": lambda d: row_reduce(1, 64 * M, d),
    "2x(3M+7)": lambda d: row_reduce(2, 3 * M + 7, d),
    "16x1M": lambda d: row_reduce(16, M, d),
    "32x1M": lambda d: row_reduce(32, M, d),
    "8x(4M+3)": lambda d: row_reduce(8, 4 * M + 3, d),
    "full 8192^2": lambda d: full_reduce((8192, 8192), d),
    "full 4096x4099": lambda d: full_reduce((4096, 4099), d),
}
# the second launch is >= 10% of the DRAM time (<= 25 us: 108 MB at 4.32 TB/s on an H200, 75 MB
# at 3.02 TB/s on the H100 reference) and S >= 8: one pass; the large, measured ones keep two kernels
CHOICES = {
    ("8x16M", "float32"): "kernel", ("8x16M", "bfloat16"): "kernel",
    ("1x64M", "float32"): "kernel", ("1x64M", "bfloat16"): "kernel",
    ("2x(3M+7)", "float32"): "last_block", ("2x(3M+7)", "bfloat16"): "last_block",
    ("16x1M", "float32"): "last_block", ("16x1M", "bfloat16"): "last_block",
    ("32x1M", "float32"): "kernel", ("32x1M", "bfloat16"): "last_block",
    ("8x(4M+3)", "float32"): "kernel", ("8x(4M+3)", "bfloat16"): "last_block",
    ("full 8192^2", "float32"): "kernel", ("full 8192^2", "bfloat16"): "kernel",
    ("full 4096x4099", "float32"): "last_block", ("full 4096x4099", "bfloat16"): "last_block",
}


@pytest.mark.parametrize("tgt", [H200, H100], ids=["H200", "sm_90"])
@pytest.mark.parametrize("name,dtype", list(CHOICES), ids=[f"{n}-{d}" for n, d in CHOICES])
def test_small_inputs_combine_in_one_pass_and_large_ones_keep_the_measured_two_kernels(name, dtype, tgt):
    choice = propose(SHAPES[name](dtype), tgt)
    if tgt is H100 and name == "32x1M":
        assert choice is None   # DRAM-bound one block per row on the H100 (test_split_rows.py)
        return
    assert choice is not None
    step = choice.plan.steps[0].args
    assert (choice.combine, step.get("combine", "kernel")) == (CHOICES[name, dtype],) * 2, choice.reason
    assert choice.splits >= 8
    if choice.combine == "last_block":
        assert "by the last of the row's blocks to finish (one kernel)" in choice.reason
        assert "then" not in choice.split_cost.terms and choice.split_cost.total < choice.row_cost.total
    else:
        assert "combine" not in step and "by a second kernel" in choice.reason


def test_the_combine_rule():
    # 2.5 us >= 10% of the DRAM time: at most 25 us at 0.9 x the bandwidth
    edge = 25e-6 * 0.9 * H200.dram_bandwidth
    assert ONE_PASS_LAUNCH_SHARE == 0.1
    assert choose_combine(edge * 0.99, 64, H200) == "last_block"
    assert choose_combine(edge * 1.01, 64, H200) == "kernel"
    assert choose_combine(1e6, 4, H200) == "kernel"        # few splits: split_reduce measured it slower
    assert choose_combine(1e6, 8, H200) == "last_block"


# ---- on the GPU --------------------------------------------------------------------------------------

def _gpu_case(name, dtype):
    return SHAPES[name](dtype)


def _call_and_check(k, args, calls, seed, what):
    """`calls` calls of k on fresh random data against float64: torch tensors in place when torch
    has CUDA, else NumPy arrays."""
    shape = tuple(int(s) for s in args[0].shape)
    out_shape = tuple(int(s) for s in args[1].shape)
    dtype = args[0].dtype.name
    try:
        import torch

        use_torch = torch.cuda.is_available()
    except ImportError:
        use_torch = False
    rng = np.random.default_rng(seed)
    for n in range(calls):
        if use_torch:
            gen = torch.Generator(device="cuda").manual_seed(seed * 100 + n)
            x = torch.randn(shape, device="cuda", dtype=getattr(torch, dtype), generator=gen) + 0.25
            y = torch.full(out_shape, float("nan"), device="cuda", dtype=x.dtype)
            k(x, y)
            torch.cuda.synchronize()
            x_np, y_np = x.double().cpu().numpy(), y.double().cpu().numpy()
        else:
            x_np = (rng.standard_normal(shape) + 0.25).astype(NP_DTYPE[dtype])
            y = np.full(out_shape, np.nan, NP_DTYPE[dtype])
            k(x_np, y)
            y_np = y
        axis = None if out_shape == () else -1
        check_close(y_np, x_np, "sum", dtype, f"GPU {what}, call {n + 1}, plan {k.plan}", axis)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["2x(3M+7)", "full 4096x4099", "16x1M"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_auto_one_pass_matches_float64_call_after_call(name, dtype):
    from tecc.ir.target import from_device

    args = _gpu_case(name, dtype)
    k = tc.build(args)
    assert k.plan.strategy == "split_rows", k.plan
    combine = k.plan.steps[0].args.get("combine", "kernel")
    # one pass on an H100 SXM / H200 (>= 2.7 TB/s: the 67 MB inputs are <= 25 us of DRAM time);
    # 2 x (3M+7) (25 MB) on any part; whatever the device, the plan is what the strategy chose
    assert combine == propose(args, from_device()).combine, k.plan
    if name == "2x(3M+7)" or from_device().dram_bandwidth >= 2.7e12:
        assert combine == "last_block" and len(k.module.kernels) == 1, k.plan
    _call_and_check(k, args, calls=5, seed=len(name), what=f"{name} {dtype}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_auto_two_kernels_at_large_sizes_still_match(dtype):
    args = _gpu_case("8x16M", dtype)
    k = tc.build(args)
    assert k.plan.strategy == "split_rows" and "combine" not in k.plan.steps[0].args, k.plan
    _call_and_check(k, args, calls=3, seed=8, what=f"8x16M {dtype}")


@pytest.mark.gpu
def test_gpu_one_pass_forced_on_a_large_input_matches():
    # 8 x 16M with 256 blocks per row in one pass: 2048 counters' worth of blocks, 3 calls
    args = _gpu_case("8x16M", "float32")
    k = tc.build(args, plan=plan_of(256, 256, 4, 4))
    assert len(k.module.kernels) == 1
    _call_and_check(k, args, calls=3, seed=9, what="8x16M one pass")


@pytest.mark.gpu
def test_gpu_one_pass_with_symbolic_sizes_reallocates_its_counters():
    R, C = tc.var("R"), tc.var("C")
    k = tc.build(row_reduce(R, C), plan=plan_of(256, 64, 4, 4))
    rng = np.random.default_rng(4)
    for shape in [(2, 1 << 20), (8, 3 * (1 << 20) + 1), (1, 4099), (8, 1 << 20), (16, 1 << 20), (3, 0)]:
        x = rng.standard_normal(shape).astype(np.float32)
        y = np.full(shape[0], np.nan, np.float32)
        k(x, y)
        check_close(y, x, "sum", "float32", f"GPU symbolic {shape}")
