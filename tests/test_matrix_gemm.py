"""A hand-scheduled tiled fp16 GEMM on tensor cores, built directly as loop IR.

This is the kernel a `tensorize` primitive plus `pipeline(k, 2)` will generate; here every
statement is written by hand so the ingredients can be tested together first:

- block tile 64 x 64, 4 warps (2 x 2), each warp 32 x 32 = 2 x 4 mma.m16n8k16 tiles (32 f32
  accumulators per lane in one fragment buffer);
- K loop in steps of 32 with a two-stage cp.async ring: stage kt + 1 is in flight while stage
  kt is computed (commit every iteration, `cp.async.wait_group 1`, barrier);
- A staged as [64][32] halves with Swizzle(2, 3, 3) (64-byte rows), B as [32][64] with
  Swizzle(3, 3, 3) (128-byte rows): ldmatrix.x4 for A, ldmatrix.x4.trans for two B tiles;
- epilogue through the accumulator's layout map.
"""

from __future__ import annotations

import numpy as np
import pytest
from matrix_kernels import F16_F32, fragment, unrolled

from tecc.codegen import compile_cuda, emit_source
from tecc.ir import dtype as dt
from tecc.ir.expr import Expr, Var
from tecc.ir.intrinsics import lookup
from tecc.ir.layout import Swizzle
from tecc.ir.stmt import (
    Allocate,
    AsyncCommit,
    AsyncCopy,
    AsyncWait,
    Barrier,
    Buffer,
    BufferStore,
    For,
    FragmentRef,
    IfThenElse,
    MatrixLoad,
    MatrixMultiply,
    PrimFunc,
    Stmt,
    seq,
)
from tecc.passes.verify import verify_func
from tecc.runtime.sim import simulate_kernel
from tecc.runtime.sim.banks import count_bank_conflicts

BM, BN, BK = 64, 64, 32
WARPS_M, WARPS_N = 2, 2
WM, WN = BM // WARPS_M, BN // WARPS_N  # 32 x 32 per warp
TM, TN = WM // 16, WN // 8  # 2 x 4 mma tiles per warp
THREADS = 32 * WARPS_M * WARPS_N


def gemm_kernel(M: int, N: int, K: int, swizzle: bool = True, refill_barrier: bool = True) -> PrimFunc:
    """D[M, N] (float32) = A[M, K] . B[K, N] (float16), M, N multiples of 64, K of 32."""
    assert M % BM == 0 and N % BN == 0 and K % BK == 0
    A, B, D = Buffer("A", dt.float16, (M, K)), Buffer("B", dt.float16, (K, N)), Buffer("D", dt.float32, (M, N))
    As = Buffer("As", dt.float16, (2, BM, BK), "shared", layout=Swizzle(2, 3, 3) if swizzle else None)
    Bs = Buffer("Bs", dt.float16, (2, BK, BN), "shared", layout=Swizzle(3, 3, 3) if swizzle else None)
    af = fragment("a_frag", F16_F32, "a", count=TM)
    bf = fragment("b_frag", F16_F32, "b", count=TN)
    acc = fragment("acc", F16_F32, "c", count=TM * TN)
    c_map = lookup(F16_F32).operand("c").layout
    bx, by, tx, kt = Var("bx"), Var("by"), Var("tx"), Var("kt")
    lane, warp = tx % 32, tx // 32
    warp_m, warp_n = warp // WARPS_N, warp % WARPS_N

    def load_stage(stage: Expr, k0: Expr) -> Stmt:
        # 64 x 32 halves of A and 32 x 64 of B: 256 copies of 16 bytes each, 2 per thread.
        def copies(i: Var) -> Stmt:
            c = tx + THREADS * i
            ar, ac = c // (BK // 8), (c % (BK // 8)) * 8
            br, bc = c // (BN // 8), (c % (BN // 8)) * 8
            return seq(AsyncCopy(As, (stage, ar, ac), A, (by * BM + ar, k0 + ac), 16),
                       AsyncCopy(Bs, (stage, br, bc), B, (k0 + br, bx * BN + bc), 16))
        return unrolled("i", BM * BK // 8 // THREADS, copies)

    def compute(stage: Expr) -> Stmt:
        def k_step(kk: Var) -> Stmt:
            r, j = lane % 8, lane // 8

            def load_a(mi: Var) -> Stmt:
                row = warp_m * WM + mi * 16 + r + 8 * (j % 2)
                return MatrixLoad("ldmatrix.x4", FragmentRef(af, 8 * mi), As, (stage, row, kk * 16 + 8 * (j // 2)))

            def load_b(nj: Var) -> Stmt:
                # x4.trans: B[k 0:8, n 0:8], B[k 8:16, n 0:8], B[k 0:8, n 8:16], B[k 8:16, n 8:16]
                row = kk * 16 + r + 8 * (j % 2)
                col = warp_n * WN + nj * 16 + 8 * (j // 2)
                return MatrixLoad("ldmatrix.x4.trans", FragmentRef(bf, 8 * nj), Bs, (stage, row, col))

            def mma(mi: Var) -> Stmt:
                return unrolled("ni", TN, lambda ni: MatrixMultiply(
                    F16_F32, FragmentRef(acc, (mi * TN + ni) * 4), FragmentRef(af, 8 * mi),
                    FragmentRef(bf, 4 * ni), FragmentRef(acc, (mi * TN + ni) * 4)))

            return seq(unrolled("mi", TM, load_a), unrolled("nj", TN // 2, load_b), unrolled("mi2", TM, mma))
        return unrolled("kk", BK // 16, k_step)

    def epilogue(t: Var) -> Stmt:
        mi, ni = t // TN, t % TN

        def store(e: Var) -> Stmt:
            r, c = c_map(lane, e)
            return BufferStore(D, (by * BM + warp_m * WM + mi * 16 + r, bx * BN + warp_n * WN + ni * 8 + c),
                               acc[t * 4 + e])
        return unrolled("e", 4, store)

    k_tiles = K // BK
    body = seq(
        unrolled("z", TM * TN * 4, lambda z: BufferStore(acc, (z,), 0.0)),
        load_stage(0, 0),
        AsyncCommit(),
        For(kt, 0, k_tiles, "serial", seq(
            IfThenElse(kt + 1 < k_tiles, load_stage((kt + 1) % 2, (kt + 1) * BK)),
            AsyncCommit(),  # possibly empty: keeps "the most recent group" meaning stage kt + 1
            AsyncWait(1),
            Barrier(),
            compute(kt % 2),
            Barrier() if refill_barrier else None,  # every warp is done with stage kt % 2 before it is refilled
        )),
        AsyncWait(0),
        unrolled("t", TM * TN, epilogue),
    )
    allocs = Allocate(As, Allocate(Bs, Allocate(af, Allocate(bf, Allocate(acc, body)))))
    kernel = For(by, 0, M // BM, "blockIdx.y", For(bx, 0, N // BN, "blockIdx.x", For(tx, 0, THREADS, "threadIdx.x", allocs)))
    return PrimFunc("gemm_f16_tc" + ("" if swizzle else "_unswizzled"), (A, B, D), kernel)


def gemm_inputs(M: int, N: int, K: int, seed: int) -> dict[str, np.ndarray]:
    g = np.random.default_rng(seed)
    a = (g.uniform(0.5, 1.5, (M, K)) * g.choice([-1, 1], (M, K))).astype(np.float16)
    b = (g.uniform(0.5, 1.5, (K, N)) * g.choice([-1, 1], (K, N))).astype(np.float16)
    return {"A": a, "B": b, "D": np.full((M, N), np.nan, dtype=np.float32)}


def check_gemm(got: np.ndarray, arrays: dict[str, np.ndarray], what: str) -> None:
    """Against float64: exact products, K + 1 fp32 roundings relative to sum |a.b| at most."""
    a, b = arrays["A"].astype(np.float64), arrays["B"].astype(np.float64)
    want = a @ b
    bound = (a.shape[1] + 1) * 2.0**-24 * (np.abs(a) @ np.abs(b))
    err = np.where(np.isnan(got), np.inf, np.abs(got - want) - bound)
    if (err > 0).any():
        i = np.unravel_index(int(np.argmax(err)), err.shape)
        raise AssertionError(f"{what}: {(err > 0).sum()} of {err.size} elements off; worst at {tuple(map(int, i))}: "
                             f"got {got[i]!r}, want {want[i]!r} (bound {bound[i]:.3g})")


def test_tiled_tensor_core_gemm_matches_numpy_in_the_emulator() -> None:
    M, N, K = 128, 128, 128
    func = gemm_kernel(M, N, K)
    verify_func(func)
    arrays = gemm_inputs(M, N, K, 21)
    with count_bank_conflicts() as banks:
        simulate_kernel(func, arrays, (N // BN, M // BM, 1), (THREADS, 1, 1))
    check_gemm(arrays["D"], arrays, f"gemm {M}x{N}x{K}")
    assert banks.conflicts("As") == 0 and banks.conflicts("Bs") == 0, dict(banks.wavefronts)
    assert banks.requests["As"] > 0 and banks.requests["Bs"] > 0


def test_without_swizzle_the_same_gemm_has_bank_conflicts() -> None:
    M, N, K = 64, 64, 64
    arrays = gemm_inputs(M, N, K, 22)
    with count_bank_conflicts() as banks:
        simulate_kernel(gemm_kernel(M, N, K, swizzle=False), arrays, (1, 1, 1), (THREADS, 1, 1))
    check_gemm(arrays["D"], arrays, "unswizzled gemm")
    assert banks.conflicts("As") > 0 and banks.conflicts("Bs") > 0


def test_refilling_a_stage_other_warps_still_read_is_a_race() -> None:
    from tecc.ir.errors import RaceError

    M, N, K = 64, 64, 128  # 4 K tiles: iteration 1 refills stage 0, which iteration 0 read
    func = gemm_kernel(M, N, K, refill_barrier=False)
    with pytest.raises(RaceError, match="write-after-read") as info:
        simulate_kernel(func, gemm_inputs(M, N, K, 24), (1, 1, 1), (THREADS, 1, 1))
    assert info.value.buffer in ("As", "Bs") and info.value.other_thread != info.value.thread


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_tiled_tensor_core_gemm_compiles_without_spills(arch: str) -> None:
    func = gemm_kernel(256, 256, 256)
    compiled = compile_cuda(emit_source([func]), arch=arch, name=func.name)
    res = compiled.resources[func.name]
    assert (res.spill_stores, res.spill_loads, res.stack_bytes) == (0, 0, 0), f"{arch}: {res}"
    assert res.shared_bytes == 2 * (BM * BK + BK * BN) * 2
    assert res.registers <= 128, f"{arch}: {res.registers} registers"
    for mnemonic in ("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32", "ldmatrix.sync.aligned.m8n8.x4.shared.b16",
                     "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16", "cp.async.cg.shared.global",
                     "cp.async.wait_group 1"):
        assert mnemonic in compiled.ptx, mnemonic
