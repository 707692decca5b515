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


def k_major(swizzle: str, element_bytes: int = 2) -> MatrixDescriptor:
    """A 64 x 16 (or N x 16; fp8: x 32) K-major tile: 8-row groups SBO apart; unswizzled, the two
    16-byte core matrices of a row group are LBO = 128 bytes apart and a row group is 256 bytes."""
    if swizzle == "none":
        return MatrixDescriptor("K", "none", leading_bytes=128, stride_bytes=256, element_bytes=element_bytes)
    return MatrixDescriptor("K", swizzle, leading_bytes=16, stride_bytes=8 * ROW_BYTES[swizzle],
                            element_bytes=element_bytes)


def mn_major(swizzle: str, n: int, k: int = 16) -> MatrixDescriptor:
    """B (k x n) stored with n contiguous: swizzled, rows of W = swizzle bytes / 2 columns,
    8 k-rows per atom (SBO = 8 rows apart), column blocks of W LBO = k * W * 2 bytes apart;
    unswizzled, core matrices of 8 n x 8 k, SBO between n-blocks, LBO between k-blocks."""
    if swizzle == "none":
        return MatrixDescriptor("MN", "none", leading_bytes=128 * (n // 8), stride_bytes=128)
    w = ROW_BYTES[swizzle] // 2
    return MatrixDescriptor("MN", swizzle, leading_bytes=k * w * 2, stride_bytes=8 * ROW_BYTES[swizzle])


def tile_elements(desc: MatrixDescriptor, rows: int, cols: int) -> int:
    """Elements of a shared buffer holding the tile: past its last canonical offset, rounded up
    to the swizzle's period (and to 512 elements, the 1024-byte unit descriptors assume)."""
    last = max(int(desc.canonical(r, c)) for r in range(rows) for c in range(cols)) + 1
    unit = 1024 // desc.element_bytes
    return -(-last // unit) * unit


def _mn_step(desc: MatrixDescriptor, s: int) -> int:
    """Start of k16 slice s of an MN-major tile: two 8-row k blocks, SBO (swizzled) or LBO apart."""
    per_k8 = desc.stride_bytes if desc.swizzle != "none" else desc.leading_bytes
    return 2 * s * per_k8 // desc.element_bytes


def wgmma_kernel(n: int = 64, ab: str = "f16", a_swizzle: str = "128B", b_swizzle: str = "128B",
                 b_major: str = "K", k_steps: int = 1, wait: bool = True, expect_bytes: int | None = None,
                 barrier_wait: bool = True, proxy_fence: bool = True, wgmma_fence: bool = True,
                 warpgroups: int = 1, refill: str = "") -> PrimFunc:
    """D (64 x n, f32) = A (64 x 16·k_steps) · B, with B given as [n][k] (b_major 'K') or [k][n]
    ('MN'). k_steps > 1 chains wgmmas on one accumulator (the k16 slice s starts 32·s bytes into
    each swizzled row, scale_d false only for the first) and needs swizzled K-major tiles wide
    enough (16·k_steps elements per row). With `warpgroups` = w > 1 the block has 128·w threads and
    A 64·w rows: warpgroup g multiplies rows 64g.. of A, staged as its own 1024-byte-aligned tile.
    `refill` 'before_wait' / 'after_wait' stores B into its tile again (after a barrier) before or
    after the wgmma.wait_group, as a pipelined kernel refills a stage."""
    intrinsic = f"wgmma.m64n{n}k16.f32.{ab}"
    k = 16 * k_steps
    row = lookup(intrinsic)
    half = dt.float16 if ab == "f16" else dt.bfloat16
    da = k_major(a_swizzle)
    db = k_major(b_swizzle) if b_major == "K" else mn_major(b_swizzle, n, 16 * k_steps)
    if k_steps > 1 and (16 * k_steps > da.row_elements or (b_major == "K" and 16 * k_steps > db.row_elements)):
        raise ValueError(f"k_steps={k_steps} needs swizzled K-major rows of at least {k} elements")
    m, threads, a_tile = 64 * warpgroups, THREADS * warpgroups, tile_elements(da, 64, k)
    A = Buffer("A", half, (m, k))
    B = Buffer("B", half, (n, k) if b_major == "K" else (k, n))
    D = Buffer("D", dt.float32, (m, n))
    As = Buffer("As", half, (warpgroups * a_tile,), "shared", layout=da.layout)
    Bs = Buffer("Bs", half, (tile_elements(db, n, k),), "shared", layout=db.layout)
    bars = Buffer("bar", dt.int64, (1,), "shared")
    op = row.operand("d")
    acc = Buffer("acc", op.dtype, (op.elements,), "fragment", fragment=(intrinsic, "d"))
    tid = Var("tid")
    bar = BarrierRef(bars, 0)

    # A: m rows of 2·k_steps 16-byte chunks; thread t copies chunks t, t + threads, ... to their
    # place in the tile of the warpgroup that multiplies that row
    c = Var("c")
    chunk = tid + threads * c
    r, j = chunk // (2 * k_steps), chunk % (2 * k_steps)
    several = warpgroups > 1  # one warpgroup: the same kernel without the (zero) group terms
    place = (r // 64) * a_tile + da.canonical(r % 64, 8 * j) if several else da.canonical(r, 8 * j)
    copy_a = For(c, 0, k_steps, "unroll", BulkCopy(As, (place,), A, (r, 8 * j), 16, bar))
    a_bytes = m * k * 2
    group = tid // THREADS if several else 0

    # B: each thread stores n * k / 128 elements through the descriptor's canonical map
    i = Var("i")
    e = tid + threads * i
    if b_major == "K":
        bn, bk = e // k, e % k
        value = B[bn, bk]
    else:
        bk, bn = e // n, e % n
        value = B[bk, bn]
    stores = For(i, 0, n * k // threads, "unroll", BufferStore(Bs, (db.canonical(bn, bk),), value))
    steps = [WarpgroupMatrixMultiply(intrinsic, FragmentRef(acc, 0), SharedMatrix(As, group * a_tile + 16 * s, da),
                                     SharedMatrix(Bs, 16 * s if b_major == "K" else _mn_step(db, s), db),
                                     s > 0)
             for s in range(k_steps)]

    ee = Var("e")
    rr, cc = op.layout(tid % THREADS if several else tid, ee)
    epilogue = For(ee, 0, op.elements, "unroll", BufferStore(D, (64 * group + rr, cc), acc[ee]))
    body = seq(
        IfThenElse(tid == 0, BarrierInit(bar, 1)),
        Barrier(),
        IfThenElse(tid == 0, BarrierExpectTx(bar, a_bytes if expect_bytes is None else expect_bytes)),
        copy_a,
        stores,
        AsyncProxyFence() if proxy_fence else None,
        Barrier(),
        BarrierWait(bar, 0) if barrier_wait else None,
        WarpgroupFence() if wgmma_fence else None,
        *steps,
        WarpgroupCommit(),
        seq(Barrier(), stores) if refill == "before_wait" else None,
        WarpgroupWait(0, (acc,)) if wait else None,
        seq(Barrier(), stores) if refill == "after_wait" else None,
        epilogue,
    )
    kernel: Stmt = For(tid, 0, threads, "threadIdx.x", body)
    for buf in (acc, bars, Bs, As):
        kernel = Allocate(buf, kernel)
    name = f"wgmma_m64n{n}k{k}_{ab}_{a_swizzle}_{b_major}{b_swizzle}" + (f"_x{warpgroups}" if warpgroups > 1 else "")
    return PrimFunc(name, (A, B, D), kernel)


def register_a_kernel(n: int = 64, ab: str = "f16", b_swizzle: str = "128B", b_major: str = "K",
                      k_steps: int = 1) -> PrimFunc:
    """D (64 x n, f32) = A (64 x 16·k_steps) · B with A from registers (wgmma's register form):
    each thread loads its 8 elements of each k16 slice of A from global memory straight into a
    fragment through the row's operand-'a' map, B is stored as in wgmma_kernel (plain stores
    through the descriptor's canonical map, then fence.proxy.async and a barrier); the k_steps
    wgmmas chain on one accumulator (scale_d false for the first). `ab` "e4m3" / "e5m2": the fp8
    rows (k32 per step, 16 elements per thread, B K-major only)."""
    fp8 = ab in ("e4m3", "e5m2")
    ks = 32 if fp8 else 16
    intrinsic = f"wgmma.m64n{n}k{ks}.f32.{ab}"
    k = ks * k_steps
    row = lookup(intrinsic)
    half = {"f16": dt.float16, "bf16": dt.bfloat16, "e4m3": dt.float8_e4m3, "e5m2": dt.float8_e5m2}[ab]
    db = k_major(b_swizzle, half.bytes) if b_major == "K" else mn_major(b_swizzle, n, k)
    A = Buffer("A", half, (64, k))
    B = Buffer("B", half, (n, k) if b_major == "K" else (k, n))
    D = Buffer("D", dt.float32, (64, n))
    Bs = Buffer("Bs", half, (tile_elements(db, n, k),), "shared", layout=db.layout)
    a_op, d_op = row.operand("a"), row.operand("d")
    a_frag = Buffer("a_frag", a_op.dtype, (a_op.elements * k_steps,), "fragment", fragment=(intrinsic, "a"))
    acc = Buffer("acc", d_op.dtype, (d_op.elements,), "fragment", fragment=(intrinsic, "d"))
    tid, s, e, i = Var("tid"), Var("s"), Var("e"), Var("i")
    ar, ac = a_op.layout(tid, e)
    load_a = For(s, 0, k_steps, "unroll", For(e, 0, a_op.elements, "unroll",
                                               BufferStore(a_frag, (a_op.elements * s + e,), A[ar, ks * s + ac])))
    el = tid + THREADS * i
    if b_major == "K":
        bn, bk = el // k, el % k
        value = B[bn, bk]
    else:
        bk, bn = el // n, el % n
        value = B[bk, bn]
    stores = For(i, 0, n * k // THREADS, "unroll", BufferStore(Bs, (db.canonical(bn, bk),), value))
    steps = [WarpgroupMatrixMultiply(intrinsic, FragmentRef(acc, 0), FragmentRef(a_frag, a_op.elements * q),
                                     SharedMatrix(Bs, ks * q if b_major == "K" else _mn_step(db, q), db), q > 0)
             for q in range(k_steps)]
    f = Var("f")
    rr, cc = d_op.layout(tid, f)
    body = seq(load_a, stores, AsyncProxyFence(), Barrier(), WarpgroupFence(), *steps, WarpgroupCommit(),
               WarpgroupWait(0, (acc,)),
               For(f, 0, d_op.elements, "unroll", BufferStore(D, (rr, cc), acc[f])))
    kernel: Stmt = For(tid, 0, THREADS, "threadIdx.x", body)
    for buf in (acc, a_frag, Bs):
        kernel = Allocate(buf, kernel)
    return PrimFunc(f"wgmma_register_a_m64n{n}k{k}_{ab}_{b_major}{b_swizzle}", (A, B, D), kernel)
