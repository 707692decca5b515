"""The matrix-fragment level under the emulator: mma through the table's maps, ldmatrix,
cp.async groups, the races and divergence it reports, and shared-memory bank conflicts."""

from __future__ import annotations

import numpy as np
import pytest
from matrix_kernels import (
    BF16_F32,
    F16_F16,
    F16_F32,
    TF32_F32,
    check_mma_result,
    mma_direct_kernel,
    mma_inputs,
    mma_ldmatrix_kernel,
    mma_reference,
)

from tecc.runtime.sim import simulate_kernel

ALL_MMA = [F16_F32, BF16_F32, F16_F16, TF32_F32]
HALF_MMA = [F16_F32, BF16_F32, F16_F16]


@pytest.mark.parametrize("intrinsic", ALL_MMA)
def test_one_warp_mma_with_fragments_loaded_through_the_maps_matches_numpy(intrinsic: str) -> None:
    func = mma_direct_kernel(intrinsic)
    for seed in (1, 2):
        arrays = mma_inputs(intrinsic, seed)
        simulate_kernel(func, arrays, (1, 1, 1), (32, 1, 1))
        want, bound = mma_reference(intrinsic, arrays)
        check_mma_result(arrays["D"], want, bound, f"{intrinsic} seed {seed}")


@pytest.mark.parametrize("intrinsic", HALF_MMA)
@pytest.mark.parametrize("a_stored,b_stored", [("mk", "kn"), ("mk", "nk"), ("km", "kn"), ("km", "nk")])
@pytest.mark.parametrize("swizzle", [False, True])
def test_mma_with_ldmatrix_fragments_matches_numpy(intrinsic: str, a_stored: str, b_stored: str, swizzle: bool) -> None:
    func = mma_ldmatrix_kernel(intrinsic, a_stored, b_stored, swizzle=swizzle)
    arrays = mma_inputs(intrinsic, 3, a_stored, b_stored)
    simulate_kernel(func, arrays, (1, 1, 1), (32, 1, 1))
    want, bound = mma_reference(intrinsic, arrays, a_stored, b_stored)
    check_mma_result(arrays["D"], want, bound, func.name)


@pytest.mark.parametrize("swizzle", [False, True])
def test_cp_async_staging_with_commit_and_wait_feeds_ldmatrix(swizzle: bool) -> None:
    func = mma_ldmatrix_kernel(F16_F32, "mk", "nk", staging="cp.async", swizzle=swizzle)
    arrays = mma_inputs(F16_F32, 4, "mk", "nk")
    simulate_kernel(func, {**arrays, "rows_valid": 16}, (1, 1, 1), (32, 1, 1))
    want, bound = mma_reference(F16_F32, arrays, "mk", "nk")
    check_mma_result(arrays["D"], want, bound, func.name)


def test_cp_async_predicate_false_zero_fills_the_destination() -> None:
    func = mma_ldmatrix_kernel(F16_F32, "mk", "kn", staging="cp.async")
    arrays = mma_inputs(F16_F32, 5)
    simulate_kernel(func, {**arrays, "rows_valid": 11}, (1, 1, 1), (32, 1, 1))
    want, bound = mma_reference(F16_F32, arrays, rows_valid=11)
    check_mma_result(arrays["D"], want, bound, "rows 11.. of A zero-filled")
    np.testing.assert_array_equal(arrays["D"][11:], arrays["C"][11:])


# ---- races, divergence, bank conflicts --------------------------------------------------------

from matrix_kernels import fragment, ldmatrix_tile_kernel  # noqa: E402

from tecc.ir import dtype as dt  # noqa: E402
from tecc.ir.errors import DivergenceError, OutOfBoundsError, RaceError, TeccError, UninitializedReadError  # noqa: E402
from tecc.ir.expr import Var  # noqa: E402
from tecc.ir.stmt import (  # noqa: E402
    Allocate,
    AsyncCommit,
    AsyncCopy,
    Buffer,
    For,
    FragmentRef,
    IfThenElse,
    MatrixMultiply,
    PrimFunc,
    seq,
)
from tecc.runtime.sim.banks import count_bank_conflicts  # noqa: E402
from tecc.runtime.sim.matrix import round_to_tf32  # noqa: E402


def test_reading_a_cp_async_destination_without_the_wait_is_a_race() -> None:
    func = mma_ldmatrix_kernel(F16_F32, staging="cp.async", wait=False)
    with pytest.raises(RaceError) as info:
        simulate_kernel(func, {**mma_inputs(F16_F32, 6), "rows_valid": 16}, (1, 1, 1), (32, 1, 1))
    err = info.value
    assert err.buffer == "As" and err.block == (0, 0, 0), str(err)
    assert "cp.async" in str(err) and "in flight" in str(err) and "wait_group" in str(err)


def test_reading_another_threads_cp_async_data_after_the_wait_needs_a_barrier() -> None:
    func = mma_ldmatrix_kernel(F16_F32, staging="cp.async", barrier=False)
    with pytest.raises(RaceError, match="read-after-write") as info:
        simulate_kernel(func, {**mma_inputs(F16_F32, 7), "rows_valid": 16}, (1, 1, 1), (32, 1, 1))
    assert info.value.buffer == "As" and info.value.other_thread != info.value.thread


def test_a_copy_never_committed_or_never_waited_is_reported_at_kernel_end() -> None:
    A = Buffer("A", dt.float16, (32, 8))
    S = Buffer("S", dt.float16, (32, 8), "shared")
    for commit in (False, True):
        t = Var("t")
        body = seq(AsyncCopy(S, (t, 0), A, (t, 0), 16), AsyncCommit() if commit else None)
        func = PrimFunc("leaky", (A,), For(t, 0, 32, "threadIdx.x", Allocate(S, body)))
        status = "never waited" if commit else "never committed"
        with pytest.raises(RaceError, match=status):
            simulate_kernel(func, {"A": np.ones((32, 8), np.float16)}, (1, 1, 1), (32, 1, 1))


def test_mma_reached_by_half_a_warp_is_a_divergence_error() -> None:
    a, b, c = fragment("a", F16_F32, "a"), fragment("b", F16_F32, "b"), fragment("c", F16_F32, "c")
    lane = Var("lane")
    mma = MatrixMultiply(F16_F32, FragmentRef(c, 0), FragmentRef(a, 0), FragmentRef(b, 0), FragmentRef(c, 0))
    func = PrimFunc("half_warp", (), For(lane, 0, 32, "threadIdx.x",
                                         Allocate(a, Allocate(b, Allocate(c, IfThenElse(lane < 16, mma))))))
    with pytest.raises(DivergenceError, match="only some lanes of a warp"):
        simulate_kernel(func, {}, (1, 1, 1), (32, 1, 1))


@pytest.mark.parametrize("swizzle,conflicts", [(True, 0), (False, 4 * 4 * 7)])
def test_swizzle_makes_ldmatrix_reads_conflict_free(swizzle: bool, conflicts: int) -> None:
    """Unswizzled: each of the 4 x 4 ldmatrix phases (kk, matrix) puts 8 rows in 4 banks: 8
    wavefronts instead of 1. Swizzle(3, 3, 3): 0 extra. The values arrive right either way."""
    func = ldmatrix_tile_kernel(swizzle)
    a = (np.random.default_rng(8).uniform(0.5, 1.5, (16, 64)) * np.random.default_rng(9).choice([-1, 1], (16, 64)))
    a = a.astype(np.float16)
    out = np.full((16, 64), np.nan, dtype=np.float16)
    with count_bank_conflicts() as banks:
        simulate_kernel(func, {"A": a, "Out": out}, (1, 1, 1), (32, 1, 1))
    np.testing.assert_array_equal(out, a)
    assert banks.conflicts("S") == conflicts, (banks.requests["S"], banks.wavefronts["S"])
    assert banks.requests["S"] >= 16  # the 16 ldmatrix phases were counted


def test_tf32_inputs_are_rounded_to_nearest_with_ties_away_from_zero() -> None:
    x = np.array([1 + 2.0**-11, -(1 + 2.0**-11), 1 + 2.0**-12, 1 + 3 * 2.0**-11, np.inf, 3.0], dtype=np.float32)
    want = np.array([1 + 2.0**-10, -(1 + 2.0**-10), 1.0, 1 + 2 * 2.0**-10, np.inf, 3.0], dtype=np.float32)
    np.testing.assert_array_equal(round_to_tf32(x), want)
    assert np.isnan(round_to_tf32(np.array([np.nan], np.float32)))[0]


def test_tf32_mma_sees_rounded_inputs() -> None:
    """B = I: D = tf32(A) + C exactly, so truncation (which gives 1.0) would fail."""
    func = mma_direct_kernel(TF32_F32)
    a = np.full((16, 8), 1 + 2.0**-11, dtype=np.float32)
    c = np.full((16, 8), 0.25, dtype=np.float32)
    d = np.full((16, 8), np.nan, dtype=np.float32)
    simulate_kernel(func, {"A": a, "B": np.eye(8, dtype=np.float32), "C": c, "D": d}, (1, 1, 1), (32, 1, 1))
    np.testing.assert_array_equal(d, np.float32(1 + 2.0**-10 + 0.25))


def _ldmatrix_kernel(row_of_lane, col_of_lane, rows: int = 16) -> PrimFunc:  # type: ignore[no-untyped-def]
    from tecc.ir.stmt import Barrier, BufferStore, MatrixLoad

    S = Buffer("S", dt.float16, (rows, 16), "shared")
    a = fragment("a", F16_F32, "a")
    out = Buffer("out", dt.float16, (32, 8))
    lane = Var("lane")
    i = Var("i")
    body = seq(
        For(i, 0, rows * 16 // 32, "unroll", BufferStore(S, ((lane + 32 * i) // 16, (lane + 32 * i) % 16), 1.0)),
        Barrier(),
        MatrixLoad("ldmatrix.x4", FragmentRef(a, 0), S, (row_of_lane(lane), col_of_lane(lane))),
        For(i, 0, 8, "unroll", BufferStore(out, (lane, i), a[i])),
    )
    return PrimFunc("ldm", (out,), For(lane, 0, 32, "threadIdx.x", Allocate(S, Allocate(a, body))))


def test_ldmatrix_row_address_that_is_not_16_byte_aligned_is_reported() -> None:
    func = _ldmatrix_kernel(lambda lane: lane % 16, lambda lane: 4 + 0 * lane)
    with pytest.raises(TeccError, match="16-byte-aligned row of 8 elements") as info:
        simulate_kernel(func, {"out": np.full((32, 8), np.nan, np.float16)}, (1, 1, 1), (32, 1, 1))
    assert "shared buffer S" in str(info.value) and "thread (0, 0, 0)" in str(info.value)


def test_ldmatrix_row_address_outside_the_buffer_is_out_of_bounds() -> None:
    func = _ldmatrix_kernel(lambda lane: lane, lambda lane: 8 + 0 * lane)
    with pytest.raises(OutOfBoundsError, match="lies outside shared buffer S") as info:
        simulate_kernel(func, {"out": np.full((32, 8), np.nan, np.float16)}, (1, 1, 1), (32, 1, 1))
    assert "thread (16, 0, 0)" in str(info.value)


def test_ldmatrix_of_unwritten_shared_memory_is_an_uninitialized_read() -> None:
    from tecc.ir.stmt import Barrier, BufferStore, MatrixLoad

    # each lane writes one element of rows 0..15; ldmatrix.x4 reads all 32 rows

    S = Buffer("S", dt.float16, (32, 8), "shared")
    a = fragment("a", F16_F32, "a")
    lane = Var("lane")
    body = seq(BufferStore(S, (lane % 16, lane % 8), 1.0), Barrier(),
               MatrixLoad("ldmatrix.x4", FragmentRef(a, 0), S, (lane, 0)))
    half_written = PrimFunc("ldm_half", (), For(lane, 0, 32, "threadIdx.x", Allocate(S, Allocate(a, body))))
    with pytest.raises(UninitializedReadError, match="S\\["):
        simulate_kernel(half_written, {}, (1, 1, 1), (32, 1, 1))


def test_a_block_that_is_not_whole_warps_cannot_run_mma() -> None:
    func = mma_direct_kernel(F16_F32)
    arrays = mma_inputs(F16_F32, 9)
    with pytest.raises(DivergenceError, match="multiple of 32 threads"):
        simulate_kernel(func, arrays, (1, 1, 1), (48, 1, 1))


@pytest.mark.parametrize("case", ["misaligned", "split_by_swizzle"])
def test_cp_async_must_be_one_aligned_contiguous_run(case: str) -> None:
    """Codegen passes the physical address of a copy's first element; a copy that is not
    aligned to its size, or that a swizzle with smaller chunks tears apart, is refused."""
    from tecc.ir.layout import Swizzle
    from tecc.ir.stmt import AsyncWait

    A = Buffer("A", dt.float16, (32, 16))
    layout = Swizzle(2, 2, 3) if case == "split_by_swizzle" else None  # 4-element chunks, 8-element copies
    S = Buffer("S", dt.float16, (32, 16), "shared", layout=layout)
    t = Var("t")
    col = 4 if case == "misaligned" else 8
    body = seq(AsyncCopy(S, (t, col), A, (t, col), 16), AsyncCommit(), AsyncWait(0))
    func = PrimFunc("copy", (A,), For(t, 0, 32, "threadIdx.x", Allocate(S, body)))
    with pytest.raises(TeccError, match="not one 16-byte-aligned contiguous run in S"):
        simulate_kernel(func, {"A": np.ones((32, 16), np.float16)}, (1, 1, 1), (32, 1, 1))


LDMATRIX_ROWS = [f"ldmatrix.x{x}{t}" for x in (1, 2, 4) for t in ("", ".trans")]


def ldmatrix_probe_expected(row_name: str, s: np.ndarray) -> np.ndarray:
    """What each lane must receive, from the ISA's words (independent of the table): register j
    holds matrix j; lane l gets row l/4, columns 2(l%4) and 2(l%4)+1 (.trans: that column's rows)."""
    from tecc.ir.intrinsics import lookup

    out = np.full((32, 8), np.nan, dtype=np.float16)
    for lane in range(32):
        for i in range(lookup(row_name).operand("d").elements):
            j, r, c = i // 2, lane // 4, 2 * (lane % 4) + i % 2
            out[lane, i] = s[8 * j + c, r] if row_name.endswith(".trans") else s[8 * j + r, c]
    return out


@pytest.mark.parametrize("row_name", LDMATRIX_ROWS)
def test_every_ldmatrix_row_delivers_what_the_isa_says(row_name: str) -> None:
    from matrix_kernels import ldmatrix_probe_kernel

    s = np.arange(256, dtype=np.float16).reshape(32, 8)
    out = np.full((32, 8), np.nan, dtype=np.float16)
    simulate_kernel(ldmatrix_probe_kernel(row_name), {"S_in": s, "Out": out}, (1, 1, 1), (32, 1, 1))
    np.testing.assert_array_equal(out, ldmatrix_probe_expected(row_name, s))
