"""The Hopper level in the emulator: one warpgroup computing D = A . B with wgmma, A staged by
bulk copies that complete on an mbarrier and B by plain stores, against NumPy in float64; and
the errors a broken kernel of this kind gets (race, deadlock, divergence, missing fences)."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hopper_kernels import wgmma_kernel

from tecc.ir import dtype as dt
from tecc.ir.errors import DeadlockError, DivergenceError, RaceError, TeccError
from tecc.ir.expr import Var
from tecc.ir.stmt import (
    Allocate,
    Barrier,
    BarrierArrive,
    BarrierInit,
    BarrierRef,
    BarrierWait,
    Buffer,
    BufferStore,
    For,
    IfThenElse,
    PrimFunc,
    SetMaxRegisters,
    WarpgroupFence,
    seq,
)
from tecc.runtime.sim import simulate_kernel

HALF = {"f16": np.float16, "bf16": ml_dtypes.bfloat16}


def _run(func: PrimFunc, n: int, ab: str, b_major: str, k: int = 16, seed: int = 0) -> tuple[np.ndarray, Any, Any]:
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((64, k)).astype(HALF[ab])
    b_kn = rng.standard_normal((k, n)).astype(HALF[ab])
    b = np.ascontiguousarray(b_kn.T) if b_major == "K" else b_kn
    d = np.full((64, n), np.nan, np.float32)
    simulate_kernel(func, {"A": a, "B": b, "D": d}, (1, 1, 1), (128, 1, 1))
    return d, a, b_kn


CASES = [
    (64, "f16", "128B", "128B", "K", 1),
    (64, "bf16", "128B", "128B", "K", 1),
    (128, "f16", "128B", "128B", "K", 1),
    (128, "bf16", "64B", "32B", "MN", 1),
    (64, "f16", "none", "none", "K", 1),
    (64, "bf16", "32B", "none", "MN", 1),
    (256, "f16", "128B", "128B", "MN", 1),
    (64, "f16", "128B", "128B", "K", 4),     # four chained wgmmas, k = 64, one commit and wait
    (128, "bf16", "128B", "64B", "MN", 4),
]


@pytest.mark.parametrize("n,ab,a_swizzle,b_swizzle,b_major,k_steps", CASES)
def test_one_warpgroup_wgmma_matches_numpy(n: int, ab: str, a_swizzle: str, b_swizzle: str, b_major: str,
                                           k_steps: int) -> None:
    func = wgmma_kernel(n, ab, a_swizzle, b_swizzle, b_major, k_steps=k_steps)
    d, a, b = _run(func, n, ab, b_major, 16 * k_steps)
    want = a.astype(np.float64) @ b.astype(np.float64)
    # exact products, f32 sums: (K + 1) units of 2^-24 of sum |a||b| (the GPU's order differs)
    bound = (16 * k_steps + 1) * 2.0**-24 * (np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64)))
    err = np.abs(d - want)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert (err <= bound).all(), f"{func.name}: D{worst} = {d[worst]}, want {want[worst]} (bound {bound[worst]})"


@pytest.mark.parametrize("warpgroups,blocks", [(2, 1), (2, 3), (1, 2)])
def test_each_warpgroup_of_each_block_multiplies_its_own_rows(warpgroups: int, blocks: int) -> None:
    # per-warpgroup descriptors (start 4096 halves apart), mbarrier state and shared memory per
    # block; every block computes the same D
    func = wgmma_kernel(64, "bf16", "128B", "128B", "K", k_steps=2, warpgroups=warpgroups)
    rng = np.random.default_rng(5)
    m = 64 * warpgroups
    a = rng.standard_normal((m, 32)).astype(HALF["bf16"])
    b_kn = rng.standard_normal((32, 64)).astype(HALF["bf16"])
    d = np.full((m, 64), np.nan, np.float32)
    simulate_kernel(func, {"A": a, "B": np.ascontiguousarray(b_kn.T), "D": d}, (blocks, 1, 1),
                    (128 * warpgroups, 1, 1))
    want = a.astype(np.float64) @ b_kn.astype(np.float64)
    bound = 33 * 2.0**-24 * (np.abs(a.astype(np.float64)) @ np.abs(b_kn.astype(np.float64)))
    assert (np.abs(d - want) <= bound).all(), func.name


def test_reading_the_accumulator_before_the_wgmma_wait_is_a_race() -> None:
    with pytest.raises(RaceError, match="wgmma race on acc.*wgmma.wait_group"):
        _run(wgmma_kernel(64, "f16", wait=False), 64, "f16", "K")


def test_refilling_an_operand_of_a_wgmma_in_flight_is_a_race() -> None:
    with pytest.raises(RaceError, match="wgmma operand race on Bs"):
        _run(wgmma_kernel(64, "f16", refill="before_wait"), 64, "f16", "K")
    d, a, b = _run(wgmma_kernel(64, "f16", refill="after_wait"), 64, "f16", "K")
    assert np.allclose(d, a.astype(np.float64) @ b.astype(np.float64), rtol=1e-5, atol=1e-5)


def test_a_phase_that_can_never_complete_is_a_deadlock_naming_the_barrier_and_phase() -> None:
    # thread 0 announces 4096 bytes but the copies bring 2048: the phase waits forever
    with pytest.raises(DeadlockError, match=r"bar\[0\].*phase 0 .*2048 transaction bytes are missing"):
        _run(wgmma_kernel(64, "f16", expect_bytes=4096), 64, "f16", "K")


def test_reading_bulk_copied_data_before_the_mbarrier_wait_is_a_race() -> None:
    with pytest.raises(RaceError, match="operand A .*asynchronous copy is still writing"):
        _run(wgmma_kernel(64, "f16", barrier_wait=False), 64, "f16", "K")


def test_wgmma_reading_plain_stores_needs_a_proxy_fence() -> None:
    with pytest.raises(RaceError, match="operand B .*fence.proxy.async"):
        _run(wgmma_kernel(64, "f16", proxy_fence=False), 64, "f16", "K")


def test_the_first_wgmma_needs_a_wgmma_fence() -> None:
    with pytest.raises(RaceError, match="no wgmma.fence"):
        _run(wgmma_kernel(64, "f16", wgmma_fence=False), 64, "f16", "K")


@pytest.mark.parametrize("stmt", [WarpgroupFence(), SetMaxRegisters(232, True)], ids=["fence", "setmaxnreg"])
def test_a_warpgroup_instruction_under_a_lane_condition_is_divergence(stmt: Any) -> None:
    tid = Var("tid")
    func = PrimFunc("half", (), For(tid, 0, 128, "threadIdx.x", IfThenElse(tid < 64, stmt)))
    with pytest.raises(DivergenceError, match="only some threads of a warpgroup"):
        simulate_kernel(func, {}, (1, 1, 1), (128, 1, 1))
    # by whole warpgroups (warp specialization: warpgroup 0 gives registers, 1 takes them) it runs
    whole = PrimFunc("whole", (), For(tid, 0, 256, "threadIdx.x",
                                      IfThenElse(tid < 128, SetMaxRegisters(40, False), SetMaxRegisters(232, True))))
    simulate_kernel(whole, {}, (1, 1, 1), (256, 1, 1))


def _arrivals_kernel(count: int, arrive_if: Any, parity: int = 0) -> PrimFunc:
    """Thread 0 initializes `bar` with `count`; threads where `arrive_if` holds arrive; all wait."""
    tid = Var("tid")
    bars = Buffer("bar", dt.int64, (1,), "shared")
    out = Buffer("out", dt.int32, (128,))
    bar = BarrierRef(bars, 0)
    body = seq(IfThenElse(tid == 0, BarrierInit(bar, count)), Barrier(),
               IfThenElse(arrive_if(tid), BarrierArrive(bar)),
               BarrierWait(bar, parity),
               BufferStore(out, (tid,), tid))
    return PrimFunc("arrivals", (out,), Allocate(bars, For(tid, 0, 128, "threadIdx.x", body)))


def test_mbarrier_phase_completes_after_count_arrivals() -> None:
    out = np.zeros(128, np.int32)
    simulate_kernel(_arrivals_kernel(32, lambda t: t < 32), {"out": out}, (1, 1, 1), (128, 1, 1))
    assert (out == np.arange(128)).all()


def test_mbarrier_too_few_arrivals_or_the_wrong_parity_deadlock() -> None:
    out = np.zeros(128, np.int32)
    with pytest.raises(DeadlockError, match=r"bar\[0\].*phase 0 \(parity 0\).*1 of 32 arrivals"):
        simulate_kernel(_arrivals_kernel(32, lambda t: t < 31), {"out": out}, (1, 1, 1), (128, 1, 1))
    # phase 0 completed, so the current phase is 1: waiting for parity 1 waits for phase 1
    with pytest.raises(DeadlockError, match=r"phase 1 \(parity 1\)"):
        simulate_kernel(_arrivals_kernel(32, lambda t: t < 32, parity=1), {"out": out}, (1, 1, 1), (128, 1, 1))


def test_a_wait_by_part_of_the_block_on_a_later_arrival_is_refused_not_misreported() -> None:
    tid = Var("tid")
    bars = Buffer("bar", dt.int64, (1,), "shared")
    bar = BarrierRef(bars, 0)
    body = seq(IfThenElse(tid == 0, BarrierInit(bar, 1)), Barrier(),
               IfThenElse(tid < 64, BarrierWait(bar, 0), BarrierArrive(bar)))
    func = PrimFunc("consumer_first", (), Allocate(bars, For(tid, 0, 128, "threadIdx.x", body)))
    with pytest.raises(TeccError, match="lockstep") as info:
        simulate_kernel(func, {}, (1, 1, 1), (128, 1, 1))
    assert not isinstance(info.value, DeadlockError)


def test_an_uninitialized_mbarrier_is_reported() -> None:
    tid = Var("tid")
    bars = Buffer("bar", dt.int64, (1,), "shared")
    func = PrimFunc("no_init", (), Allocate(bars, For(tid, 0, 128, "threadIdx.x", BarrierArrive(BarrierRef(bars, 0)))))
    with pytest.raises(TeccError, match="never initialized"):
        simulate_kernel(func, {}, (1, 1, 1), (128, 1, 1))
