"""Hand-built loop-IR kernels and comparison helpers shared by the emulator tests.

The kernels are written the way the lowering emits them (tiling, thread binding, shared staging,
unrolled register tiles, guards), with the tecc.ir constructors, so the emulator is tested on
the same IR shapes the CUDA emitter prints. Each builder takes flags that break the kernel in one
deliberate way (a missing barrier, an off-by-one guard) for the error tests.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tecc.ir import dtype as dt
from tecc.ir.expr import Expr, Var
from tecc.ir.stmt import Allocate, Barrier, Buffer, BufferStore, For, IfThenElse, LetStmt, PrimFunc, Stmt, seq


def loop(name: str, extent: Any, kind: str, body_fn: Any, lo: Any = 0) -> Stmt:
    """`For` with a fresh variable; `body_fn(var)` builds the body."""
    v = Var(name)
    return For(v, lo, extent, kind, body_fn(v))


def let(name: str, value: Expr, body_fn: Any) -> Stmt:
    v = Var(name, value.dtype, "index" if value.dtype.is_int else "value")
    return LetStmt(v, value, body_fn(v))


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def random_array(shape: tuple[int, ...], dtype: Any, seed: int = 0) -> np.ndarray:
    """Fresh random data, never zeros (a kernel that does nothing must not pass)."""
    g = rng(seed)
    d = np.dtype(dtype)
    if d.kind == "f" or d.name == "bfloat16":
        return (g.uniform(0.5, 1.5, size=shape) * g.choice([-1, 1], size=shape)).astype(d)
    return g.integers(1, 100, size=shape).astype(d)


def poisoned(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An output buffer full of NaN (or a sentinel), so an element nobody wrote shows."""
    d = np.dtype(dtype)
    return np.full(shape, np.nan if d.kind == "f" or d.name == "bfloat16" else -7, dtype=d)


def assert_close(got: np.ndarray, want: np.ndarray, rtol: float, atol: float, what: str) -> None:
    """Compare with a message naming the worst element (index, got, want)."""
    g = np.asarray(got, dtype=np.float64)
    w = np.asarray(want, dtype=np.float64)
    assert g.shape == w.shape, f"{what}: shape {g.shape} != {w.shape}"
    err = np.abs(g - w) - (atol + rtol * np.abs(w))
    err = np.where(np.isnan(g) | np.isnan(w), np.inf, err)
    if (err > 0).any():
        worst = np.unravel_index(int(np.argmax(err)), err.shape)
        raise AssertionError(
            f"{what}: {(err > 0).sum()} of {err.size} elements differ; worst at {tuple(int(i) for i in worst)}: "
            f"got {g[worst]!r}, want {w[worst]!r} (rtol {rtol}, atol {atol})"
        )


# ---- kernels ------------------------------------------------------------------------------------

def elementwise_kernel(n_var: Var, block: int, off_by_one: bool = False,
                       dtype: dt.DType = dt.float32) -> PrimFunc:
    """C[i] = A[i] * 2 + B[i] over a symbolic n: i = bx*block + tx, guarded by i < n
    (`i <= n` when `off_by_one`, the classic broken guard)."""
    A = Buffer("A", dtype, (n_var,))
    B = Buffer("B", dtype, (n_var,))
    C = Buffer("C", dtype, (n_var,))
    grid = (n_var + (block - 1)) // block

    def body(bx: Var) -> Stmt:
        def thread(tx: Var) -> Stmt:
            i = bx * block + tx
            guard = (i <= n_var) if off_by_one else (i < n_var)
            return IfThenElse(guard, BufferStore(C, (i,), A[i] * 2.0 + B[i]))
        return loop("tx", block, "threadIdx.x", thread)

    return PrimFunc("elementwise", (A, B, C, n_var), loop("bx", grid, "blockIdx.x", body))


def matmul_kernel(M: int, N: int, K: int, barrier_before_compute: bool = True,
                  barrier_after_compute: bool = True) -> PrimFunc:
    """C = A @ B with the classic shared-memory tiling: a 64x64 block tile, 16x16 threads, a 4x4
    register tile per thread, k-tile 16; A and B tiles staged in shared memory (As, Bs) by all
    256 threads cooperatively, each k step cached in registers (a_reg, b_reg)."""
    assert M % 64 == 0 and N % 64 == 0 and K % 16 == 0
    A = Buffer("A", dt.float32, (M, K))
    B = Buffer("B", dt.float32, (K, N))
    C = Buffer("C", dt.float32, (M, N))
    As = Buffer("As", dt.float32, (16, 64), "shared")
    Bs = Buffer("Bs", dt.float32, (16, 64), "shared")
    acc = Buffer("acc", dt.float32, (4, 4), "local")
    a_reg = Buffer("a_reg", dt.float32, (4,), "local")
    b_reg = Buffer("b_reg", dt.float32, (4,), "local")

    def per_thread(by: Var, bx: Var, ty: Var, tx: Var) -> Stmt:
        init = loop("i", 4, "unroll", lambda i: loop("j", 4, "unroll", lambda j: BufferStore(acc, (i, j), 0.0)))

        def k_tile(ko: Var) -> Stmt:
            def stage(r: Var) -> Stmt:
                e = r * 256 + ty * 16 + tx  # this thread's element of the 1024-element tiles
                return seq(
                    BufferStore(As, (e % 16, e // 16), A[by * 64 + e // 16, ko * 16 + e % 16]),
                    BufferStore(Bs, (e // 64, e % 64), B[ko * 16 + e // 64, bx * 64 + e % 64]),
                )

            def k_step(k: Var) -> Stmt:
                return seq(
                    loop("i", 4, "unroll", lambda i: BufferStore(a_reg, (i,), As[k, ty * 4 + i])),
                    loop("j", 4, "unroll", lambda j: BufferStore(b_reg, (j,), Bs[k, tx * 4 + j])),
                    loop("i", 4, "unroll", lambda i: loop("j", 4, "unroll", lambda j: BufferStore(
                        acc, (i, j), acc[i, j] + a_reg[i] * b_reg[j]))),
                )

            return seq(
                loop("r", 4, "unroll", stage),
                Barrier() if barrier_before_compute else None,
                loop("k", 16, "serial", k_step),
                Barrier() if barrier_after_compute else None,
            )

        write = loop("i", 4, "unroll", lambda i: loop("j", 4, "unroll", lambda j: BufferStore(
            C, (by * 64 + ty * 4 + i, bx * 64 + tx * 4 + j), acc[i, j])))
        body = seq(init, loop("ko", K // 16, "serial", k_tile), write)
        return Allocate(acc, Allocate(a_reg, Allocate(b_reg, body)))

    nest = loop("by", M // 64, "blockIdx.y", lambda by: loop("bx", N // 64, "blockIdx.x", lambda bx: Allocate(
        As, Allocate(Bs, loop("ty", 16, "threadIdx.y", lambda ty: loop(
            "tx", 16, "threadIdx.x", lambda tx: per_thread(by, bx, ty, tx)))))))
    return PrimFunc("matmul_shared", (A, B, C), nest)


def run_matmul(M: int, N: int, K: int, seed: int = 0, **flags: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    from tecc.runtime.sim import simulate_kernel

    a = random_array((M, K), np.float32, seed)
    b = random_array((K, N), np.float32, seed + 1)
    c = poisoned((M, N), np.float32)
    simulate_kernel(matmul_kernel(M, N, K, **flags), {"A": a, "B": b, "C": c}, (N // 64, M // 64, 1), (16, 16, 1))
    return a, b, c


def _benchmark() -> None:
    """The figures recorded in docs/emulator.md: best of 3 after one warm-up run."""
    import time

    from tecc.runtime.sim import simulate_kernel

    func = matmul_kernel(256, 256, 256)
    a = random_array((256, 256), np.float32, 0)
    b = random_array((256, 256), np.float32, 1)
    for checks in (True, False):
        c = poisoned((256, 256), np.float32)
        args = {"A": a, "B": b, "C": c}
        simulate_kernel(func, args, (4, 4, 1), (16, 16, 1), checks=checks)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            simulate_kernel(func, args, (4, 4, 1), (16, 16, 1), checks=checks)
            times.append(time.perf_counter() - t0)
        assert_close(c, a.astype(np.float64) @ b.astype(np.float64), 1e-5, 1e-4, "matmul")
        print(f"256x256x256 shared-tiled fp32 matmul, checks={checks}: {min(times):.3f} s")


if __name__ == "__main__":  # python tests/test_sim_support.py
    _benchmark()
