"""Hand-built kernels of the Hopper level, shared by the emulator, codegen and GPU tests.

One warpgroup (128 threads) computes D = A . B for one m64nNk16 wgmma tile:

- mbarrier `bar[0]` initialized by thread 0 with one arrival, then a barrier;
- A (64 x 16, K-major) staged by `cp.async.bulk`: every thread copies one 16-byte chunk
  (row r, columns 8j..8j+7) to where the A descriptor says the chunk lives (a swizzle keeps
  16-byte chunks whole, so raw copies of chunks build the swizzled tile), completing bytes on
  `bar[0]`; thread 0 announces the 2048 bytes with arrive.expect_tx before them;
- B staged by plain stores through the B descriptor's canonical map (the buffer carries the
  descriptor's swizzle as its layout), then fence.proxy.async and a barrier;
- every thread waits on phase 0 of `bar[0]`, then wgmma.fence, the wgmma (scale_d false: D =
  A . B), commit, wait 0 (pinning the accumulator), and the epilogue stores each accumulator
  element through the row's layout map.

Knobs drop pieces so that tests can show the errors: `wait=False` drops the wgmma.wait_group,
`expect_bytes` changes the bytes thread 0 announces (more than arrive: the phase never completes).
"""

from __future__ import annotations

from tecc.ir import dtype as dt
from tecc.ir.descriptor import MatrixDescriptor
from tecc.ir.expr import Var
from tecc.ir.intrinsics import lookup
from tecc.ir.stmt import (
    Allocate,
    AsyncProxyFence,
    Barrier,
    BarrierExpectTx,
    BarrierInit,
    BarrierRef,
    BarrierWait,
    Buffer,
    BufferStore,
    BulkCopy,
    For,
    FragmentRef,
    IfThenElse,
    PrimFunc,
    SharedMatrix,
    Stmt,
    WarpgroupCommit,
    WarpgroupFence,
    WarpgroupMatrixMultiply,
    WarpgroupWait,
    seq,
)

THREADS = 128
ROW_BYTES = {"none": 16, "32B": 32, "64B": 64, "128B": 128}


def k_major(swizzle: str) -> MatrixDescriptor:
    """A 64 x 16 (or N x 16) K-major tile: 8-row groups SBO apart; unswizzled, the two 8-column
    core matrices of a row group are LBO = 128 bytes apart and a row group is 256 bytes."""
    if swizzle == "none":
        return MatrixDescriptor("K", "none", leading_bytes=128, stride_bytes=256)
    return MatrixDescriptor("K", swizzle, leading_bytes=16, stride_bytes=8 * ROW_BYTES[swizzle])


def mn_major(swizzle: str, n: int) -> MatrixDescriptor:
    """B (16 x n) stored with n contiguous: swizzled, rows of W = swizzle bytes / 2 columns,
    8 k-rows per atom (SBO = 8 rows apart), column blocks of W LBO = 16 * W * 2 bytes apart;
    unswizzled, core matrices of 8 n x 8 k, SBO between n-blocks, LBO between k-blocks."""
    if swizzle == "none":
        return MatrixDescriptor("MN", "none", leading_bytes=128 * (n // 8), stride_bytes=128)
    w = ROW_BYTES[swizzle] // 2
    return MatrixDescriptor("MN", swizzle, leading_bytes=16 * w * 2, stride_bytes=8 * ROW_BYTES[swizzle])


def tile_elements(desc: MatrixDescriptor, rows: int, cols: int) -> int:
    """Elements of a shared buffer holding the tile: past its last canonical offset, rounded up
    to the swizzle's period (and to 512 elements, the 1024-byte unit descriptors assume)."""
    last = max(int(desc.canonical(r, c)) for r in range(rows) for c in range(cols)) + 1
    return -(-last // 512) * 512


def wgmma_kernel(n: int = 64, ab: str = "f16", a_swizzle: str = "128B", b_swizzle: str = "128B",
                 b_major: str = "K", wait: bool = True, expect_bytes: int | None = None) -> PrimFunc:
    intrinsic = f"wgmma.m64n{n}k16.f32.{ab}"
    row = lookup(intrinsic)
    half = dt.float16 if ab == "f16" else dt.bfloat16
    da = k_major(a_swizzle)
    db = k_major(b_swizzle) if b_major == "K" else mn_major(b_swizzle, n)
    A = Buffer("A", half, (64, 16))
    B = Buffer("B", half, (n, 16) if b_major == "K" else (16, n))
    D = Buffer("D", dt.float32, (64, n))
    As = Buffer("As", half, (tile_elements(da, 64, 16),), "shared", layout=da.layout)
    Bs = Buffer("Bs", half, (tile_elements(db, n, 16),), "shared", layout=db.layout)
    bars = Buffer("bar", dt.int64, (1,), "shared")
    op = row.operand("d")
    acc = Buffer("acc", op.dtype, (op.elements,), "fragment", fragment=(intrinsic, "d"))
    tid = Var("tid")
    bar = BarrierRef(bars, 0)

    # A: thread t copies chunk (r, j) = (t // 2, t % 2), 16 bytes, to its place in the tile
    r, j = tid // 2, tid % 2
    copy_a = BulkCopy(As, (da.canonical(r, 8 * j),), A, (r, 8 * j), 16, bar)
    a_bytes = 64 * 16 * 2

    # B: each thread stores n * 16 / 128 elements through the descriptor's canonical map
    stores = []
    i = Var("i")
    e = tid + THREADS * i
    if b_major == "K":
        bn, bk = e // 16, e % 16
        value = B[bn, bk]
    else:
        bk, bn = e // n, e % n
        value = B[bk, bn]
    stores.append(For(i, 0, n * 16 // THREADS, "unroll", BufferStore(Bs, (db.canonical(bn, bk),), value)))

    ee = Var("e")
    rr, cc = op.layout(tid, ee)
    epilogue = For(ee, 0, op.elements, "unroll", BufferStore(D, (rr, cc), acc[ee]))
    body = seq(
        IfThenElse(tid == 0, BarrierInit(bar, 1)),
        Barrier(),
        IfThenElse(tid == 0, BarrierExpectTx(bar, a_bytes if expect_bytes is None else expect_bytes)),
        copy_a,
        *stores,
        AsyncProxyFence(),
        Barrier(),
        BarrierWait(bar, 0),
        WarpgroupFence(),
        WarpgroupMatrixMultiply(intrinsic, FragmentRef(acc, 0), SharedMatrix(As, 0, da), SharedMatrix(Bs, 0, db),
                                False),
        WarpgroupCommit(),
        WarpgroupWait(0, (acc,)) if wait else None,
        epilogue,
    )
    kernel: Stmt = For(tid, 0, THREADS, "threadIdx.x", body)
    for buf in (acc, bars, Bs, As):
        kernel = Allocate(buf, kernel)
    name = f"wgmma_m64n{n}_{ab}_{a_swizzle}_{b_major}{b_swizzle}"
    return PrimFunc(name, (A, B, D), kernel)
