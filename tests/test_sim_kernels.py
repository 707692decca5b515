"""The SIMT emulator runs lowered loop-IR kernels with GPU semantics and matches NumPy."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from test_sim_support import (assert_close, elementwise_kernel, let, loop, poisoned, random_array,
                              run_matmul)

from tecc.ir import dtype as dt
from tecc.ir.expr import Var, binary, call, cast, select, warp_shuffle
from tecc.ir.stmt import Allocate, Barrier, Buffer, BufferStore, IfThenElse, PrimFunc, seq
from tecc.runtime.sim import simulate_kernel
from tecc.runtime.sim import kernel as sim_kernel


@pytest.mark.parametrize("n", [1, 127, 128, 1000, 4099])
def test_elementwise_with_guard_covers_non_divisible_sizes(n: int) -> None:
    func = elementwise_kernel(Var("n", kind="size"), 128)
    a, b = random_array((n,), np.float32, 1), random_array((n,), np.float32, 2)
    c = poisoned((n,), np.float32)
    simulate_kernel(func, {"A": a, "B": b, "C": c, "n": n}, ((n + 127) // 128, 1, 1), (128, 1, 1))
    assert_close(c, a * np.float32(2) + b, 0, 0, f"elementwise n={n}")


def test_many_blocks_run_in_several_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sim_kernel, "MAX_LANES", 512)  # 4 blocks of 128 per chunk, 79 chunks
    n = 40_000
    func = elementwise_kernel(Var("n", kind="size"), 128)
    a, b = random_array((n,), np.float32, 3), random_array((n,), np.float32, 4)
    c = poisoned((n,), np.float32)
    simulate_kernel(func, {"A": a, "B": b, "C": c, "n": n}, ((n + 127) // 128, 1, 1), (128, 1, 1))
    assert_close(c, a * np.float32(2) + b, 0, 0, "elementwise in chunks")


def test_zero_size_grid_launches_nothing() -> None:
    func = elementwise_kernel(Var("n", kind="size"), 128)
    empty = np.zeros((0,), np.float32)
    simulate_kernel(func, {"A": empty, "B": empty, "C": empty, "n": 0}, (0, 1, 1), (128, 1, 1))


def row_sum_kernel(rows: int, cols: int, dtype: dt.DType = dt.float32) -> PrimFunc:
    """out[r] = sum_j A[r, j], one thread per row, accumulating in a local register."""
    A = Buffer("A", dtype, (rows, cols))
    out = Buffer("out", dtype, (rows,))
    acc = Buffer("acc", dtype, (1,), "local")

    def thread(bx: Var, tx: Var) -> PrimFunc:
        r = bx * 64 + tx
        body = seq(
            BufferStore(acc, (0,), 0.0),
            loop("j", cols, "serial", lambda j: BufferStore(acc, (0,), acc[0] + A[r, j])),
            BufferStore(out, (r,), acc[0]),
        )
        return IfThenElse(r < rows, Allocate(acc, body))

    nest = loop("bx", (rows + 63) // 64, "blockIdx.x", lambda bx: loop("tx", 64, "threadIdx.x", lambda tx: thread(bx, tx)))
    return PrimFunc("row_sum", (A, out), nest)


def test_per_thread_reduction_accumulates_in_float32_like_the_gpu() -> None:
    a = random_array((100, 777), np.float32, 5)
    out = poisoned((100,), np.float32)
    simulate_kernel(row_sum_kernel(100, 777), {"A": a, "out": out}, (2, 1, 1), (64, 1, 1))
    # A sequential float32 sum, not float64 and not pairwise: bit-exact.
    want = np.cumsum(a, axis=1, dtype=np.float32)[:, -1]
    np.testing.assert_array_equal(out, want)


def test_shared_tiled_matmul_256_matches_numpy() -> None:
    a, b, c = run_matmul(256, 256, 256)
    assert_close(c, a.astype(np.float64) @ b.astype(np.float64), 1e-5, 2e-4, "shared-tiled matmul 256^3")


def test_shared_tiled_matmul_non_square() -> None:
    a, b, c = run_matmul(128, 192, 48, seed=7)
    assert_close(c, a.astype(np.float64) @ b.astype(np.float64), 1e-5, 1e-4, "shared-tiled matmul 128x192x48")


@pytest.mark.parametrize("dtype", [dt.float16, dt.bfloat16], ids=str)
def test_half_storage_rounds_after_every_operation(dtype: dt.DType) -> None:
    """C = A * B + A in a 16-bit type: each node computes in float32 and rounds back."""
    n = 3000
    A, B, C = (Buffer(x, dtype, (n,)) for x in "ABC")

    def thread(bx: Var, tx: Var) -> PrimFunc:
        i = bx * 256 + tx
        return IfThenElse(i < n, BufferStore(C, (i,), A[i] * B[i] + A[i]))

    func = PrimFunc("fma16", (A, B, C), loop("bx", (n + 255) // 256, "blockIdx.x", lambda bx: loop(
        "tx", 256, "threadIdx.x", lambda tx: thread(bx, tx))))
    npd = dtype.numpy
    g = np.random.default_rng(11)
    a = g.uniform(-3, 3, n).astype(npd)
    b = g.uniform(-3, 3, n).astype(npd)
    c = poisoned((n,), npd)
    simulate_kernel(func, {"A": a, "B": b, "C": c}, ((n + 255) // 256, 1, 1), (256, 1, 1))
    f32 = np.float32
    t = (a.astype(f32) * b.astype(f32)).astype(npd)
    want = (t.astype(f32) + a.astype(f32)).astype(npd)
    assert c.dtype == npd
    np.testing.assert_array_equal(c.astype(f32), want.astype(f32))
    # Rounding per node differs from a single rounding of the exact result somewhere.
    exact = (a.astype(np.float64) * b.astype(np.float64) + a.astype(np.float64)).astype(npd)
    assert (exact.astype(f32) != c.astype(f32)).any()


def test_half_inputs_accumulate_in_float32_and_cast_back() -> None:
    rows, cols = 40, 500
    A = Buffer("A", dt.bfloat16, (rows, cols))
    out = Buffer("out", dt.bfloat16, (rows,))
    acc = Buffer("acc", dt.float32, (1,), "local")
    body = lambda r: Allocate(acc, seq(  # noqa: E731
        BufferStore(acc, (0,), 0.0),
        loop("j", cols, "serial", lambda j: BufferStore(acc, (0,), acc[0] + cast(A[r, j], dt.float32))),
        BufferStore(out, (r,), cast(acc[0], dt.bfloat16)),
    ))
    func = PrimFunc("sum_bf16", (A, out), loop("tx", rows, "threadIdx.x", body))
    a = random_array((rows, cols), ml_dtypes.bfloat16, 12)
    o = poisoned((rows,), ml_dtypes.bfloat16)
    simulate_kernel(func, {"A": a, "out": o}, (1, 1, 1), (rows, 1, 1))
    want = np.cumsum(a.astype(np.float32), axis=1, dtype=np.float32)[:, -1].astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(o.astype(np.float32), want.astype(np.float32))


def warp_row_sum_kernel(rows: int, kind: str, dtype: dt.DType) -> PrimFunc:
    """out[r] = sum of a 64-wide row: one warp per row (threadIdx.x), 4 rows per block
    (threadIdx.y); each lane adds 2 elements, then a shuffle tree (xor or down) reduces the warp."""
    A = Buffer("A", dtype, (rows, 64))
    out = Buffer("out", dtype, (rows,))

    def lane(by: Var, ty: Var, tx: Var) -> PrimFunc:
        r = by * 4 + ty

        def tree(v: Var, offsets: list[int]) -> PrimFunc:
            if not offsets:
                return IfThenElse(tx == 0, BufferStore(out, (r,), v))
            return let(f"v{offsets[0]}", v + warp_shuffle(kind, v, offsets[0]), lambda w: tree(w, offsets[1:]))

        return let("v", A[r, tx] + A[r, tx + 32], lambda v: tree(v, [16, 8, 4, 2, 1]))

    return PrimFunc(f"warp_sum_{kind}", (A, out), loop("by", rows // 4, "blockIdx.x", lambda by: loop(
        "ty", 4, "threadIdx.y", lambda ty: loop("tx", 32, "threadIdx.x", lambda tx: lane(by, ty, tx)))))


@pytest.mark.parametrize("kind", ["shfl_xor", "shfl_down"])
def test_warp_shuffle_tree_gives_the_row_sum(kind: str) -> None:
    rows = 64
    a = random_array((rows, 64), np.int32, 13)
    out = poisoned((rows,), np.int32)
    simulate_kernel(warp_row_sum_kernel(rows, kind, dt.int32), {"A": a, "out": out}, (rows // 4, 1, 1), (32, 4, 1))
    np.testing.assert_array_equal(out, a.sum(axis=1))
    af = random_array((rows, 64), np.float32, 14)
    outf = poisoned((rows,), np.float32)
    simulate_kernel(warp_row_sum_kernel(rows, kind, dt.float32), {"A": af, "out": outf}, (rows // 4, 1, 1), (32, 4, 1))
    assert_close(outf, af.astype(np.float64).sum(axis=1), 1e-5, 1e-5, f"{kind} row sum")


def test_shfl_idx_broadcasts_one_lane_and_xor_stays_within_the_warp() -> None:
    A = Buffer("A", dt.int32, (64,))
    B = Buffer("B", dt.int32, (64,))
    C = Buffer("C", dt.int32, (64,))
    func = PrimFunc("shfl", (A, B, C), loop("tx", 64, "threadIdx.x", lambda tx: seq(
        BufferStore(B, (tx,), warp_shuffle("shfl_idx", A[tx], 3)),
        BufferStore(C, (tx,), warp_shuffle("shfl_xor", A[tx], 1)),
    )))
    a = random_array((64,), np.int32, 15)
    b, c = poisoned((64,), np.int32), poisoned((64,), np.int32)
    simulate_kernel(func, {"A": a, "B": b, "C": c}, (1, 1, 1), (64, 1, 1))
    np.testing.assert_array_equal(b, np.repeat(a[[3, 35]], 32))
    np.testing.assert_array_equal(c, a[np.arange(64) ^ 1])


def test_block_reduction_with_several_loops_binding_one_thread_axis() -> None:
    """Sum of 1000-wide rows by 256 threads: strided partial sums, then a shared-memory tree of
    loops bound to threadIdx.x with shrinking extents (guarded), barriers at block level."""
    rows, cols = 6, 1000
    A = Buffer("A", dt.float32, (rows, cols))
    out = Buffer("out", dt.float32, (rows,))
    red = Buffer("red", dt.float32, (256,), "shared")
    acc = Buffer("acc", dt.float32, (1,), "local")

    def block(bx: Var) -> PrimFunc:
        partial = loop("tx", 256, "threadIdx.x", lambda tx: Allocate(acc, seq(
            BufferStore(acc, (0,), 0.0),
            loop("j", (cols + 255) // 256, "serial", lambda j: IfThenElse(
                j * 256 + tx < cols, BufferStore(acc, (0,), acc[0] + A[bx, j * 256 + tx]))),
            BufferStore(red, (tx,), acc[0]),
        )))
        steps = []
        for s in (128, 64, 32, 16, 8, 4, 2, 1):
            steps += [loop("tx", s, "threadIdx.x", lambda tx, s=s: BufferStore(red, (tx,), red[tx] + red[tx + s])),
                      Barrier()]
        final = loop("tx", 1, "threadIdx.x", lambda tx: BufferStore(out, (bx,), red[0]))
        return Allocate(red, seq(partial, Barrier(), *steps, final))

    func = PrimFunc("block_sum", (A, out), loop("bx", rows, "blockIdx.x", block))
    a = random_array((rows, cols), np.float32, 16)
    o = poisoned((rows,), np.float32)
    simulate_kernel(func, {"A": a, "out": o}, (rows, 1, 1), (256, 1, 1))
    assert_close(o, a.astype(np.float64).sum(axis=1), 1e-5, 1e-4, "block reduction")


def test_thread_dependent_loop_bounds_and_divergent_ifs() -> None:
    """Thread t sums A[t, 0..t] (a triangular loop), then negates odd rows in an if/else and
    doubles rows past 40 in a nested if."""
    n = 70
    A = Buffer("A", dt.float32, (n, n))
    out = Buffer("out", dt.float32, (n,))
    acc = Buffer("acc", dt.float32, (1,), "local")

    def thread(tx: Var) -> PrimFunc:
        return Allocate(acc, seq(
            BufferStore(acc, (0,), 0.0),
            loop("j", tx + 1, "serial", lambda j: BufferStore(acc, (0,), acc[0] + A[tx, j])),
            IfThenElse(tx % 2 == 1, BufferStore(out, (tx,), 0.0 - acc[0]), seq(
                BufferStore(out, (tx,), acc[0]),
                IfThenElse(tx > 40, BufferStore(out, (tx,), out[tx] * 2.0)),
            )),
        ))

    func = PrimFunc("triangle", (A, out), loop("tx", n, "threadIdx.x", thread))
    a = random_array((n, n), np.float32, 17)
    o = poisoned((n,), np.float32)
    simulate_kernel(func, {"A": a, "out": o}, (1, 1, 1), (n, 1, 1))
    want = np.array([np.cumsum(a[t, : t + 1], dtype=np.float32)[-1] for t in range(n)])
    want = np.where(np.arange(n) % 2 == 1, -want, np.where(np.arange(n) > 40, want * 2, want))
    np.testing.assert_array_equal(o, want.astype(np.float32))


def test_select_and_logical_and_only_evaluate_the_lanes_that_take_them() -> None:
    """Padding reads past the end are guarded by `where` / `&&`: no OutOfBoundsError."""
    n = 100
    A = Buffer("A", dt.float32, (n,))
    out = Buffer("out", dt.float32, (128,))
    flags = Buffer("flags", dt.int32, (128,))
    func = PrimFunc("pad", (A, out, flags), loop("tx", 128, "threadIdx.x", lambda tx: seq(
        BufferStore(out, (tx,), select(tx < n, A[tx], -1.0)),
        BufferStore(flags, (tx,), select((tx < n) & (A[tx] > 0.0), 1, 0)),
    )))
    a = random_array((n,), np.float32, 18)
    o, f = poisoned((128,), np.float32), poisoned((128,), np.int32)
    simulate_kernel(func, {"A": a, "out": o, "flags": f}, (1, 1, 1), (128, 1, 1))
    np.testing.assert_array_equal(o, np.concatenate([a, np.full(28, -1, np.float32)]))
    np.testing.assert_array_equal(f, np.concatenate([(a > 0).astype(np.int32), np.zeros(28, np.int32)]))


def test_strided_buffers_read_views_in_place() -> None:
    """A has stride variables: a transposed, sliced view is read through its own strides, and a
    strided output is written in place into the caller's storage."""
    M, N = 37, 50
    s0, s1 = Var("sA0", kind="stride"), Var("sA1", kind="stride")
    t0, t1 = Var("sC0", kind="stride"), Var("sC1", kind="stride")
    A = Buffer("A", dt.float32, (M, N), strides=(s0, s1))
    C = Buffer("C", dt.float32, (M, N), strides=(t0, t1))

    def thread(by: Var, tx: Var) -> PrimFunc:
        return IfThenElse(tx < N, BufferStore(C, (by, tx), A[by, tx] + 1.0))

    func = PrimFunc("copy_strided", (A, C, s0, s1, t0, t1), loop("by", M, "blockIdx.x", lambda by: loop(
        "tx", 64, "threadIdx.x", lambda tx: thread(by, tx))))
    base = random_array((N * 2, M + 3), np.float32, 19)
    a = base[::2, 3:].T  # shape (M, N), strides (1, 2*(M+3)) elements
    storage = poisoned((M, N * 3), np.float32)
    c = storage[:, ::3]
    el = lambda x: tuple(s // x.itemsize for s in x.strides)  # noqa: E731
    simulate_kernel(func, {"A": a, "C": c, "sA0": el(a)[0], "sA1": el(a)[1], "sC0": el(c)[0], "sC1": el(c)[1]},
                    (M, 1, 1), (64, 1, 1))
    np.testing.assert_array_equal(c, a + np.float32(1))
    assert np.isnan(storage[:, 1::3]).all(), "the gaps between strided elements were written"


def test_three_dimensional_grid_and_block_coordinates() -> None:
    """Every thread writes its own coordinates: blockIdx/threadIdx along x, y, z as CUDA numbers them."""
    grid, block = (2, 3, 2), (4, 2, 3)
    shape = (grid[2], grid[1], grid[0], block[2], block[1], block[0])
    out = Buffer("out", dt.int32, shape)

    def store(bz: Var, by: Var, bx: Var, tz: Var, ty: Var, tx: Var) -> PrimFunc:
        code = ((((bz * 10 + by) * 10 + bx) * 10 + tz) * 10 + ty) * 10 + tx
        return BufferStore(out, (bz, by, bx, tz, ty, tx), code)

    nest = loop("bz", 2, "blockIdx.z", lambda bz: loop("by", 3, "blockIdx.y", lambda by: loop(
        "bx", 2, "blockIdx.x", lambda bx: loop("tz", 3, "threadIdx.z", lambda tz: loop(
            "ty", 2, "threadIdx.y", lambda ty: loop("tx", 4, "threadIdx.x", lambda tx: store(bz, by, bx, tz, ty, tx)))))))
    o = poisoned(shape, np.int32)
    simulate_kernel(PrimFunc("coords", (out,), nest), {"out": o}, grid, block)
    idx = np.indices(shape)
    want = sum(i * 10 ** (5 - d) for d, i in enumerate(idx))
    np.testing.assert_array_equal(o, want)


def test_barriers_under_a_block_uniform_branch_keep_other_blocks_epochs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Even blocks reverse their 64 values through shared memory, odd blocks rotate them by one;
    each path has its own barrier, reached by whole blocks only (a legal CUDA pattern)."""
    monkeypatch.setattr(sim_kernel, "MAX_LANES", 64 * 8)  # 8 blocks per chunk, both paths in one chunk
    nb = 12
    A = Buffer("A", dt.float32, (nb, 64))
    out = Buffer("out", dt.float32, (nb, 64))
    S = Buffer("S", dt.float32, (64,), "shared")

    def path(bx: Var, src) -> PrimFunc:  # type: ignore[no-untyped-def]
        return seq(
            loop("tx", 64, "threadIdx.x", lambda tx: BufferStore(S, (tx,), A[bx, tx])),
            Barrier(),
            loop("tx", 64, "threadIdx.x", lambda tx: BufferStore(out, (bx, tx), S[src(tx)])),
        )

    body = lambda bx: Allocate(S, IfThenElse(  # noqa: E731
        bx % 2 == 0, path(bx, lambda tx: 63 - tx), path(bx, lambda tx: (tx + 1) % 64)))
    func = PrimFunc("uniform_branch", (A, out), loop("bx", nb, "blockIdx.x", body))
    a = random_array((nb, 64), np.float32, 20)
    o = poisoned((nb, 64), np.float32)
    simulate_kernel(func, {"A": a, "out": o}, (nb, 1, 1), (64, 1, 1))
    want = np.where((np.arange(nb) % 2 == 0)[:, None], a[:, ::-1], np.roll(a, -1, axis=1))
    np.testing.assert_array_equal(o, want)


def test_local_array_indexed_by_a_thread_dependent_index() -> None:
    """A per-thread array read and written at lane-varying positions (local memory proper)."""
    A = Buffer("A", dt.int32, (48, 8))
    out = Buffer("out", dt.int32, (48,))
    buf = Buffer("buf", dt.int32, (8,), "local")
    func = PrimFunc("dyn_local", (A, out), loop("tx", 48, "threadIdx.x", lambda tx: Allocate(buf, seq(
        loop("j", 8, "serial", lambda j: BufferStore(buf, ((j + tx) % 8,), A[tx, j])),
        BufferStore(buf, (tx % 3,), buf[tx % 3] * 10),
        BufferStore(out, (tx,), buf[tx % 8] + buf[(tx + 1) % 8]),
    ))))
    a = random_array((48, 8), np.int32, 21)
    o = poisoned((48,), np.int32)
    simulate_kernel(func, {"A": a, "out": o}, (1, 1, 1), (48, 1, 1))
    want = np.empty(48, np.int64)
    for t in range(48):
        b = np.empty(8, np.int64)
        b[(np.arange(8) + t) % 8] = a[t]
        b[t % 3] *= 10
        want[t] = b[t % 8] + b[(t + 1) % 8]
    np.testing.assert_array_equal(o, want)


def test_intrinsics_and_integer_floor_semantics() -> None:
    """Math intrinsics in float32 (round: halves to even, like rintf), fmax dropping NaN,
    floor `//` and `%` on negative integers, float -> int casts truncating toward zero."""
    n = 64
    X = Buffer("X", dt.float32, (n,))
    I = Buffer("I", dt.int32, (n,))  # noqa: E741
    F = Buffer("F", dt.float32, (6, n))
    G = Buffer("G", dt.int32, (3, n))

    def thread(tx: Var) -> PrimFunc:
        x = X[tx]
        return seq(
            BufferStore(F, (0, tx), call("exp", x)),
            BufferStore(F, (1, tx), call("sqrt", call("abs", x))),
            BufferStore(F, (2, tx), call("round", x)),
            BufferStore(F, (3, tx), call("sigmoid", x)),
            BufferStore(F, (4, tx), call("erf", x)),
            BufferStore(F, (5, tx), binary("fmax", select(x > 0.0, x, float("nan")), -0.25)),
            BufferStore(G, (0, tx), I[tx] // 7),
            BufferStore(G, (1, tx), I[tx] % 7),
            BufferStore(G, (2, tx), cast(x * 3.0, dt.int32)),
        )

    func = PrimFunc("intrinsics", (X, I, F, G), loop("tx", n, "threadIdx.x", thread))
    x = np.linspace(-2.5, 2.5, n).astype(np.float32)
    x[:4] = [-2.5, -1.5, 0.5, 1.5]
    i = np.arange(-32, 32, dtype=np.int32)
    f, g = poisoned((6, n), np.float32), poisoned((3, n), np.int32)
    simulate_kernel(func, {"X": x, "I": i, "F": f, "G": g}, (1, 1, 1), (n, 1, 1))
    want = [np.exp(x), np.sqrt(np.abs(x)), np.rint(x), 1 / (1 + np.exp(-x)),
            np.array([math.erf(v) for v in x]), np.where(x > 0, x, -0.25)]
    for row, w in enumerate(want):
        assert_close(f[row], w, 1e-6, 1e-7, f"intrinsic row {row}")
    np.testing.assert_array_equal(f[2, :4], [-2, -2, 0, 2])
    np.testing.assert_array_equal(g[0], i // 7)
    np.testing.assert_array_equal(g[1], i % 7)
    np.testing.assert_array_equal(g[2], np.trunc(x * np.float32(3)).astype(np.int32))
