"""Deliberately broken kernels: the emulator reports what a GPU would silently get wrong."""

from __future__ import annotations

import numpy as np
import pytest
from test_sim_support import assert_close, elementwise_kernel, loop, matmul_kernel, poisoned, random_array, run_matmul

from tecc.ir import dtype as dt
from tecc.ir.errors import OutOfBoundsError, RaceError, TeccError, UninitializedReadError
from tecc.ir.expr import Var, warp_shuffle
from tecc.ir.stmt import Allocate, Barrier, Buffer, BufferStore, IfThenElse, PrimFunc, seq
from tecc.ir.tensor import placeholder
from tecc.runtime.sim import DivergenceError, simulate_kernel


def test_off_by_one_guard_names_buffer_index_block_and_thread() -> None:
    n = 1000
    func = elementwise_kernel(Var("n", kind="size"), 128, off_by_one=True)
    a, b, c = random_array((n,), np.float32, 1), random_array((n,), np.float32, 2), poisoned((n,), np.float32)
    with pytest.raises(OutOfBoundsError) as info:
        simulate_kernel(func, {"A": a, "B": b, "C": c, "n": n}, (8, 1, 1), (128, 1, 1))
    err = info.value
    # The value is computed before the store, so the first faulting access is the load of A.
    assert (err.buffer, err.index, err.block, err.thread) == ("A", (1000,), (7, 0, 0), (104, 0, 0))
    for text in ("A[1000]", "block (7, 0, 0)", "thread (104, 0, 0)", "[0, 1000)"):
        assert text in str(err), str(err)


def test_off_by_one_store_into_shared_memory_is_caught() -> None:
    S = Buffer("S", dt.float32, (32,), "shared")
    out = Buffer("out", dt.float32, (33,))
    func = PrimFunc("spill", (out,), Allocate(S, seq(
        loop("tx", 33, "threadIdx.x", lambda tx: BufferStore(S, (tx,), 1.0)),
        Barrier(),
        loop("tx", 33, "threadIdx.x", lambda tx: BufferStore(out, (tx,), S[tx])),
    )))
    with pytest.raises(OutOfBoundsError) as info:
        simulate_kernel(func, {"out": poisoned((33,), np.float32)}, (1, 1, 1), (33, 1, 1))
    assert (info.value.buffer, info.value.index, info.value.thread) == ("S", (32,), (32, 0, 0))
    assert "shared buffer S[32]" in str(info.value)


def test_missing_barrier_after_staging_is_a_read_after_write_race() -> None:
    with pytest.raises(RaceError) as info:
        run_matmul(64, 64, 32, barrier_before_compute=False)
    err = info.value
    assert err.buffer in ("As", "Bs") and "read-after-write" in str(err)
    assert err.block == (0, 0, 0) and err.other_thread != err.thread


def test_missing_barrier_before_restaging_is_a_write_after_read_race() -> None:
    with pytest.raises(RaceError) as info:
        run_matmul(64, 64, 32, barrier_after_compute=False)
    assert "write-after-read" in str(info.value) and info.value.buffer in ("As", "Bs")


def test_two_threads_writing_different_values_to_one_shared_element_race() -> None:
    S = Buffer("S", dt.int32, (16,), "shared")
    out = Buffer("out", dt.int32, (16,))
    func = PrimFunc("collide", (out,), Allocate(S, seq(
        loop("tx", 32, "threadIdx.x", lambda tx: BufferStore(S, (tx // 2,), tx)),
        Barrier(),
        loop("tx", 16, "threadIdx.x", lambda tx: BufferStore(out, (tx,), S[tx])),
    )))
    with pytest.raises(RaceError, match="write-after-write"):
        simulate_kernel(func, {"out": poisoned((16,), np.int32)}, (1, 1, 1), (32, 1, 1))


def test_every_thread_writing_the_same_value_is_benign() -> None:
    """Code outside thread loops runs in every thread; a shared store of one value there is the
    benign race racecheck does not report as an error."""
    S = Buffer("S", dt.int32, (1,), "shared")
    out = Buffer("out", dt.int32, (32,))
    func = PrimFunc("flag", (out,), Allocate(S, seq(
        BufferStore(S, (0,), 5),
        Barrier(),
        loop("tx", 32, "threadIdx.x", lambda tx: BufferStore(out, (tx,), S[0] + tx)),
    )))
    o = poisoned((32,), np.int32)
    simulate_kernel(func, {"out": o}, (1, 1, 1), (32, 1, 1))
    np.testing.assert_array_equal(o, 5 + np.arange(32))


def test_reading_shared_memory_nothing_wrote_is_reported() -> None:
    S = Buffer("S", dt.float32, (32,), "shared")
    out = Buffer("out", dt.float32, (32,))
    func = PrimFunc("half_staged", (out,), loop("bx", 3, "blockIdx.x", lambda bx: Allocate(S, seq(
        loop("tx", 31, "threadIdx.x", lambda tx: BufferStore(S, (tx,), 1.0)),
        Barrier(),
        loop("tx", 32, "threadIdx.x", lambda tx: BufferStore(out, (tx,), S[tx])),
    ))))
    with pytest.raises(UninitializedReadError) as info:
        simulate_kernel(func, {"out": poisoned((32,), np.float32)}, (3, 1, 1), (32, 1, 1))
    assert (info.value.buffer, info.value.index, info.value.thread) == ("S", (31,), (31, 0, 0))


def test_reading_a_local_accumulator_never_initialized_is_reported() -> None:
    A = Buffer("A", dt.float32, (8, 8))
    out = Buffer("out", dt.float32, (8,))
    acc = Buffer("acc", dt.float32, (1,), "local")
    func = PrimFunc("no_init", (A, out), loop("tx", 8, "threadIdx.x", lambda tx: Allocate(acc, seq(
        IfThenElse(tx != 5, BufferStore(acc, (0,), 0.0)),
        loop("j", 8, "serial", lambda j: BufferStore(acc, (0,), acc[0] + A[tx, j])),
        BufferStore(out, (tx,), acc[0]),
    ))))
    with pytest.raises(UninitializedReadError) as info:
        simulate_kernel(func, {"A": random_array((8, 8), np.float32), "out": poisoned((8,), np.float32)},
                        (1, 1, 1), (8, 1, 1))
    assert (info.value.buffer, info.value.thread) == ("acc", (5, 0, 0))


def test_barrier_under_a_thread_dependent_condition_is_divergent() -> None:
    out = Buffer("out", dt.float32, (64,))
    func = PrimFunc("bad_sync", (out,), loop("tx", 64, "threadIdx.x", lambda tx: IfThenElse(
        tx < 40, seq(Barrier(), BufferStore(out, (tx,), 1.0)))))
    with pytest.raises(DivergenceError, match="__syncthreads"):
        simulate_kernel(func, {"out": poisoned((64,), np.float32)}, (1, 1, 1), (64, 1, 1))


def test_warp_shuffle_from_an_inactive_lane_is_divergent() -> None:
    A = Buffer("A", dt.int32, (32,))
    out = Buffer("out", dt.int32, (32,))
    func = PrimFunc("bad_shfl", (A, out), loop("tx", 32, "threadIdx.x", lambda tx: IfThenElse(
        tx < 16, BufferStore(out, (tx,), warp_shuffle("shfl_xor", A[tx], 16)))))
    with pytest.raises(DivergenceError, match="shfl_xor"):
        simulate_kernel(func, {"A": random_array((32,), np.int32), "out": poisoned((32,), np.int32)},
                        (1, 1, 1), (32, 1, 1))


def test_checks_off_runs_a_broken_kernel_without_reports() -> None:
    func = matmul_kernel(64, 64, 32, barrier_before_compute=False)
    a, b = random_array((64, 32), np.float32), random_array((32, 64), np.float32, 1)
    c = poisoned((64, 64), np.float32)
    simulate_kernel(func, {"A": a, "B": b, "C": c}, (1, 1, 1), (16, 16, 1), checks=False)
    # Lane-parallel execution makes the missing barrier harmless here; a GPU might not be so kind.
    assert_close(c, a.astype(np.float64) @ b.astype(np.float64), 1e-5, 1e-4, "matmul, checks off")


def test_a_thread_loop_longer_than_the_launched_block_is_refused() -> None:
    func = elementwise_kernel(Var("n", kind="size"), 128)
    a = random_array((128,), np.float32)
    with pytest.raises(TeccError, match="threadIdx.x with extent 128"):
        simulate_kernel(func, {"A": a, "B": a, "C": a.copy(), "n": 128}, (1, 1, 1), (64, 1, 1))


def test_ir_that_is_not_lowered_is_refused_with_a_reason() -> None:
    X = placeholder((4,), "float32", name="X")
    out = Buffer("out", dt.float32, (4,))
    func = PrimFunc("unlowered", (out,), loop("tx", 4, "threadIdx.x", lambda tx: BufferStore(out, (tx,), X[tx])))
    with pytest.raises(TeccError, match="must be lowered"):
        simulate_kernel(func, {"out": poisoned((4,), np.float32)}, (1, 1, 1), (4, 1, 1))
    free = Var("m", kind="size")
    func = PrimFunc("free_var", (out,), loop("tx", 4, "threadIdx.x", lambda tx: BufferStore(out, (tx,), 1.0 + 0.0 * free)))
    with pytest.raises(TeccError):
        simulate_kernel(func, {"out": poisoned((4,), np.float32)}, (1, 1, 1), (4, 1, 1))
