"""Hand-built kernels of the matrix-fragment level, shared by the emulator, codegen and GPU tests.

Each builds the loop IR directly with the new statements (what a `tensorize` primitive will
generate later): one warp computes D = A . B + C for one mma tile, its fragments filled by plain
per-lane loads through the table's layout maps, or by ldmatrix from shared memory that was
staged with plain stores or with cp.async groups.
"""

from __future__ import annotations

from typing import Any

import numpy as np

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
    MatrixLoad,
    MatrixMultiply,
    PrimFunc,
    Stmt,
    seq,
)

F16_F32 = "mma.m16n8k16.f32.f16"
BF16_F32 = "mma.m16n8k16.f32.bf16"
F16_F16 = "mma.m16n8k16.f16.f16"
TF32_F32 = "mma.m16n8k8.f32.tf32"


def unrolled(name: str, extent: int, body_fn: Any) -> Stmt:
    v = Var(name)
    return For(v, 0, extent, "unroll", body_fn(v))


def fragment(name: str, intrinsic: str, role: str, count: int = 1) -> Buffer:
    op = lookup(intrinsic).operand(role)
    return Buffer(name, op.dtype, (op.elements * count,), "fragment", fragment=(intrinsic, role))


def fill_fragment(frag: Buffer, intrinsic: str, role: str, lane: Expr, src: Buffer) -> Stmt:
    """Each lane loads its fragment elements of the tile `src` through the table's map."""
    op = lookup(intrinsic).operand(role)

    def body(e: Var) -> Stmt:
        r, c = op.layout(lane, e)
        return BufferStore(frag, (e,), src[r, c])

    return unrolled(f"{role}e", op.elements, body)


def store_fragment(dst: Buffer, frag: Buffer, intrinsic: str, lane: Expr) -> Stmt:
    op = lookup(intrinsic).operand("d")

    def body(e: Var) -> Stmt:
        r, c = op.layout(lane, e)
        return BufferStore(dst, (r, c), frag[e])

    return unrolled("de", op.elements, body)


def mma_tile_buffers(intrinsic: str) -> tuple[Buffer, Buffer, Buffer, Buffer]:
    row = lookup(intrinsic)
    m, n, k = row.shape
    a, b, c = row.operand("a"), row.operand("b"), row.operand("c")
    return (Buffer("A", a.dtype, (m, k)), Buffer("B", b.dtype, (k, n)), Buffer("C", c.dtype, (m, n)),
            Buffer("D", c.dtype, (m, n)))


def mma_direct_kernel(intrinsic: str) -> PrimFunc:
    """One warp: fragments loaded lane by lane from global memory through the layout maps."""
    A, B, C, D = mma_tile_buffers(intrinsic)
    af, bf, cf = fragment("a_frag", intrinsic, "a"), fragment("b_frag", intrinsic, "b"), fragment("acc", intrinsic, "c")
    lane = Var("lane")
    body = seq(
        fill_fragment(af, intrinsic, "a", lane, A),
        fill_fragment(bf, intrinsic, "b", lane, B),
        fill_fragment(cf, intrinsic, "c", lane, C),
        MatrixMultiply(intrinsic, FragmentRef(cf, 0), FragmentRef(af, 0), FragmentRef(bf, 0), FragmentRef(cf, 0)),
        store_fragment(D, cf, intrinsic, lane),
    )
    name = "mma_direct_" + intrinsic.replace(".", "_")
    return PrimFunc(name, (A, B, C, D), For(lane, 0, 32, "threadIdx.x",
                                            Allocate(af, Allocate(bf, Allocate(cf, body)))))


# Row addresses for ldmatrix (lane l gives row l % address_lanes of the stacked tile; l // 8 is the
# matrix it belongs to). Which 8 x 8 block of the stored tile each matrix is follows from the
# operand's register order: A registers are A[0:8,0:8], A[8:16,0:8], A[0:8,8:16], A[8:16,8:16];
# B registers are B[k 0:8], B[k 8:16].
def a_row_address(lane: Expr, stored: str) -> tuple[Expr, Expr]:
    r, j = lane % 8, (lane % 32) // 8
    if stored == "mk":  # A[m][k], ldmatrix.x4
        return r + 8 * (j % 2), 8 * (j // 2)
    return r + 8 * (j // 2), 8 * (j % 2)  # At[k][m], ldmatrix.x4.trans


def b_row_address(lane: Expr, stored: str) -> tuple[Expr, Expr]:
    r, j = lane % 8, (lane % 16) // 8
    if stored == "nk":  # Bt[n][k], ldmatrix.x2
        return r, 8 * j
    return r + 8 * j, 0 * r  # B[k][n], ldmatrix.x2.trans


A_LOAD = {"mk": "ldmatrix.x4", "km": "ldmatrix.x4.trans"}
B_LOAD = {"nk": "ldmatrix.x2", "kn": "ldmatrix.x2.trans"}
# 16 x 16 / 16 x 8 tiles of 16-bit elements: 32- / 16-byte rows. Swizzle(1, 3, 3) XORs the
# 16-byte chunk of a 32-byte row with bit 2 of the row, so 8 consecutive rows cover all banks.
TILE_SWIZZLE = Swizzle(1, 3, 3)


def mma_ldmatrix_kernel(intrinsic: str, a_stored: str = "mk", b_stored: str = "kn", staging: str = "plain",
                        swizzle: bool = False, wait: bool = True, barrier: bool = True) -> PrimFunc:
    """One warp: A and B staged in shared memory (plain stores, or cp.async with commit/wait),
    then loaded into fragments with ldmatrix; `a_stored` / `b_stored` say how the global arrays
    hold them ('mk' = A, 'km' = A transposed; 'kn' = B, 'nk' = B transposed). With
    staging='cp.async' the A copy is predicated on `row < rows_valid` (zero-filled beyond)."""
    row = lookup(intrinsic)
    m, n, k = row.shape
    a_op, c_op = row.operand("a"), row.operand("c")
    a_shape = (m, k) if a_stored == "mk" else (k, m)
    b_shape = (k, n) if b_stored == "kn" else (n, k)
    A, B = Buffer("A", a_op.dtype, a_shape), Buffer("B", a_op.dtype, b_shape)
    C, D = Buffer("C", c_op.dtype, (m, n)), Buffer("D", c_op.dtype, (m, n))
    layout_a = TILE_SWIZZLE if swizzle else None
    As = Buffer("As", a_op.dtype, a_shape, "shared", layout=layout_a)
    Bs = Buffer("Bs", a_op.dtype, b_shape, "shared", layout=Swizzle(1, 3, 3) if swizzle and b_shape[1] == 16 else None)
    af, bf, cf = fragment("a_frag", intrinsic, "a"), fragment("b_frag", intrinsic, "b"), fragment("acc", intrinsic, "c")
    lane = Var("lane")
    rows_valid = Var("rows_valid")
    params: tuple[Any, ...] = (A, B, C, D)
    if staging == "plain":
        stage = seq(
            unrolled("i", m * k // 32, lambda i: BufferStore(
                As, ((lane + 32 * i) // a_shape[1], (lane + 32 * i) % a_shape[1]),
                A[(lane + 32 * i) // a_shape[1], (lane + 32 * i) % a_shape[1]])),
            unrolled("i", k * n // 32, lambda i: BufferStore(
                Bs, ((lane + 32 * i) // b_shape[1], (lane + 32 * i) % b_shape[1]),
                B[(lane + 32 * i) // b_shape[1], (lane + 32 * i) % b_shape[1]])),
        )
    else:
        # A: 32 copies of 16 bytes (8 elements), one per lane; B: 32 copies of 8 bytes.
        ar, ac = lane // (a_shape[1] // 8), (lane % (a_shape[1] // 8)) * 8
        br, bc = lane // (b_shape[1] // 4), (lane % (b_shape[1] // 4)) * 4
        stage = seq(
            AsyncCopy(As, (ar, ac), A, (ar, ac), 16, predicate=ar < rows_valid, cache="cg"),
            AsyncCopy(Bs, (br, bc), B, (br, bc), 8, cache="ca"),
            AsyncCommit(),
            AsyncWait(0) if wait else None,
        )
        params = params + (rows_valid,)
    ar_, ac_ = a_row_address(lane, a_stored)
    br_, bc_ = b_row_address(lane, b_stored)
    body = seq(
        stage,
        Barrier() if barrier else None,
        MatrixLoad(A_LOAD[a_stored], FragmentRef(af, 0), As, (ar_, ac_)),
        MatrixLoad(B_LOAD[b_stored], FragmentRef(bf, 0), Bs, (br_, bc_)),
        fill_fragment(cf, intrinsic, "c", lane, C),
        MatrixMultiply(intrinsic, FragmentRef(cf, 0), FragmentRef(af, 0), FragmentRef(bf, 0), FragmentRef(cf, 0)),
        store_fragment(D, cf, intrinsic, lane),
    )
    name = f"mma_ldmatrix_{a_stored}_{b_stored}_{staging.replace('.', '_')}" + ("_swizzled" if swizzle else "")
    allocs = Allocate(As, Allocate(Bs, Allocate(af, Allocate(bf, Allocate(cf, body)))))
    return PrimFunc(name, params, For(lane, 0, 32, "threadIdx.x", allocs))


# ---- references ------------------------------------------------------------------------------

def mma_inputs(intrinsic: str, seed: int, a_stored: str = "mk", b_stored: str = "kn") -> dict[str, np.ndarray]:
    """Fresh random A, B, C (never zeros; signs mixed) and a poisoned D, in the kernel's dtypes."""
    row = lookup(intrinsic)
    m, n, k = row.shape
    a_np, c_np = row.operand("a").dtype.numpy, row.operand("c").dtype.numpy
    g = np.random.default_rng(seed)

    def rand(shape: tuple[int, ...], d: Any) -> np.ndarray:
        return (g.uniform(0.5, 1.5, size=shape) * g.choice([-1, 1], size=shape)).astype(d)

    a, b = rand((m, k), a_np), rand((k, n), a_np)
    return {"A": a if a_stored == "mk" else np.ascontiguousarray(a.T),
            "B": b if b_stored == "kn" else np.ascontiguousarray(b.T),
            "C": rand((m, n), c_np), "D": np.full((m, n), np.nan, dtype=c_np)}


def mma_reference(intrinsic: str, arrays: dict[str, np.ndarray], a_stored: str = "mk",
                  b_stored: str = "kn", rows_valid: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """D = A . B + C in float64 and the per-element error bound the instruction may show.

    The bound: each product of exact 16-bit inputs is exact; tf32 inputs are rounded (relative
    2^-11 each, so 2^-10 per product); the sum of K products and C then carries at most
    (K + 1) rounding errors of the accumulator type relative to sum |a.b| + |c|."""
    row = lookup(intrinsic)
    k = row.shape[2]
    a = arrays["A"].astype(np.float64)
    b = arrays["B"].astype(np.float64)
    a = a if a_stored == "mk" else a.T
    b = b if b_stored == "kn" else b.T
    if rows_valid is not None:
        a = a.copy()
        a[rows_valid:] = 0.0
    c = arrays["C"].astype(np.float64)
    acc = row.operand("c").dtype
    acc_eps = 2.0 ** -24 if acc == dt.float32 else 2.0 ** -11
    in_eps = 2.0 ** -10 if row.operand("a").ptx_type == "tf32" else 0.0
    magnitude = np.abs(a) @ np.abs(b)
    bound = in_eps * magnitude + (k + 1) * acc_eps * (magnitude + np.abs(c)) + 1e-30
    return a @ b + c, bound


def check_mma_result(got: np.ndarray, want: np.ndarray, bound: np.ndarray, what: str) -> None:
    g = got.astype(np.float64)
    err = np.where(np.isnan(g), np.inf, np.abs(g - want) - bound)
    if (err > 0).any():
        i = np.unravel_index(int(np.argmax(err)), err.shape)
        raise AssertionError(f"{what}: {(err > 0).sum()} of {err.size} elements off; worst at {tuple(map(int, i))}: "
                             f"got {g[i]!r}, want {want[i]!r} (bound {bound[i]:.3g})")
    # the bound must be tight enough to mean something: far below the values themselves
    assert np.median(bound) < 0.1 * np.median(np.abs(want)), f"{what}: the tolerance is too loose to test anything"



def ldmatrix_tile_kernel(swizzle: bool) -> PrimFunc:
    """One warp stages a 16 x 64 half tile (128-byte rows) in shared memory and loads it as four
    m16n8k16 A fragments with ldmatrix.x4, then writes each fragment element back to where the
    map says it belongs: `Out` must equal `A`. Unswizzled, the 8 rows of each 8 x 8 matrix sit in
    the same 4 banks (8-way conflict); Swizzle(3, 3, 3) spreads them over all 32."""
    A, Out = Buffer("A", dt.float16, (16, 64)), Buffer("Out", dt.float16, (16, 64))
    S = Buffer("S", dt.float16, (16, 64), "shared", layout=Swizzle(3, 3, 3) if swizzle else None)
    af = fragment("a_frag", F16_F32, "a", count=4)
    op = lookup(F16_F32).operand("a")
    lane = Var("lane")
    stage = unrolled("i", 32, lambda i: BufferStore(S, ((lane + 32 * i) // 64, (lane + 32 * i) % 64),
                                                     A[(lane + 32 * i) // 64, (lane + 32 * i) % 64]))

    def load(kk: Var) -> Stmt:
        r, c = a_row_address(lane, "mk")
        return MatrixLoad("ldmatrix.x4", FragmentRef(af, 8 * kk), S, (r, c + 16 * kk))

    def write_back(kk: Var) -> Stmt:
        def body(e: Var) -> Stmt:
            r, c = op.layout(lane, e)
            return BufferStore(Out, (r, c + 16 * kk), af[8 * kk + e])
        return unrolled("e", 8, body)

    body = seq(stage, Barrier(), unrolled("kk", 4, load), unrolled("kk2", 4, write_back))
    name = "ldmatrix_tile" + ("_swizzled" if swizzle else "")
    return PrimFunc(name, (A, Out), For(lane, 0, 32, "threadIdx.x", Allocate(S, Allocate(af, body))))


def ldmatrix_probe_kernel(row_name: str) -> PrimFunc:
    """One warp loads the stacked (8 * matrices) x 8 tile S (staged from global) with one
    ldmatrix row and writes what each lane received to Out[lane, e]; with distinct values in S,
    Out says exactly which element went where (the table's map, observed)."""
    row = lookup(row_name)
    S_in = Buffer("S_in", dt.float16, (32, 8))
    Out = Buffer("Out", dt.float16, (32, 8))
    S = Buffer("S", dt.float16, (32, 8), "shared")
    frag = fragment("frag", F16_F32, "a")  # 8 elements: room for x1, x2 and x4
    lane = Var("lane")
    n = row.operand("d").elements
    body = seq(
        unrolled("i", 8, lambda i: BufferStore(S, (lane, i), S_in[lane, i])),
        Barrier(),
        MatrixLoad(row_name, FragmentRef(frag, 0), S, (lane % row.address_lanes, 0 * lane)),
        unrolled("e", n, lambda e: BufferStore(Out, (lane, e), frag[e])),
    )
    name = "probe_" + row_name.replace(".", "_")
    return PrimFunc(name, (S_in, Out), For(lane, 0, 32, "threadIdx.x", Allocate(S, Allocate(frag, body))))
