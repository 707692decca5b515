"""The CUDA C emitter and the NVRTC step, specified on hand-built loop-nest IR kernels.

Each kernel is checked twice: (a) the emitted text has the properties the emitter promises
(launch bounds, const/restrict, unroll pragmas, barriers, 64-bit offsets, floor formulas...),
(b) NVRTC compiles it to cubin for sm_90 and sm_80 and ptxas reports its resources. No GPU is
needed. Four kernels are also kept as golden files in tests/golden/ (update them on purpose with
TECC_UPDATE_GOLDEN=1, then review the diff).
"""

from __future__ import annotations

import os
import pathlib
from typing import Callable

import pytest

from tecc.codegen import compile_cuda, default_arch, emit_kernel, emit_source, needs_64bit_indexing, nvrtc_version
from tecc.codegen import nvrtc as nvrtc_module
from tecc.ir import (Allocate, Barrier, Buffer, BufferStore, CompileError, For, IfThenElse, LetStmt, PrimFunc,
                     bfloat16, cast, exp, float16, float32, int32, int64, maximum, sigmoid, sqrt, tanh, where)
from tecc.ir.expr import Var, logical_and, warp_shuffle
from tecc.ir.stmt import seq

GOLDEN = pathlib.Path(__file__).parent / "golden"


def grid_1d(n: Var | int, threads: int, body: Callable[[Var, Var], object]) -> For:
    """`for bx (blockIdx.x): for tx (threadIdx.x): body(bx, tx)` over ceil(n / threads) blocks."""
    bx, tx = Var("bx"), Var("tx")
    blocks = (n + threads - 1) // threads
    return For(bx, 0, blocks, "blockIdx.x", For(tx, 0, threads, "threadIdx.x", body(bx, tx)))


# ---- the kernels -------------------------------------------------------------------------------

def elementwise() -> PrimFunc:
    """B[i] = A[i] * 2 + exp(A[i]) over a symbolic N, one element per thread, bounds-guarded."""
    n = Var("N", int32, "size")
    a, b = Buffer("A", float32, (n,)), Buffer("B", float32, (n,))

    def body(bx: Var, tx: Var) -> IfThenElse:
        i = bx * 256 + tx
        return IfThenElse(i < n, BufferStore(b, (i,), a[i] * 2.0 + exp(a[i])))

    return PrimFunc("scale_exp", (a, b, n), grid_1d(n, 256, body))


def row_sum() -> PrimFunc:
    """Out[r] = sum(A[r, 1:K]) with a per-thread serial loop that starts at 1 and a local accumulator."""
    m, k = Var("M", int32, "size"), Var("K", int32, "size")
    a, out = Buffer("A", float32, (m, k)), Buffer("Out", float32, (m,))
    acc = Buffer("acc", float32, (1,), scope="local")
    j = Var("k")

    def body(bx: Var, tx: Var) -> IfThenElse:
        r = bx * 128 + tx
        loop = For(j, 1, k - 1, "serial", BufferStore(acc, (0,), acc[0] + a[r, j]))
        return IfThenElse(r < m, Allocate(acc, seq(BufferStore(acc, (0,), 0.0), loop,
                                                   BufferStore(out, (r,), acc[0]))))

    return PrimFunc("row_sum", (a, out, m, k), grid_1d(m, 128, body))


def tiled_matmul(size: int = 1024, tile: int = 32, per_thread: int = 2) -> PrimFunc:
    """C = A @ B with 32x32 shared tiles, a 16x16 block, 2x2 outputs per thread in registers,
    barriers around the tile product, unrolled inner loops and a vectorized (float2) store."""
    a, b, c = (Buffer(n, float32, (size, size)) for n in "ABC")
    a_s = Buffer("A.shared", float32, (tile, tile), scope="shared")
    b_s = Buffer("B.shared", float32, (tile, tile), scope="shared")
    acc = Buffer("C.local", float32, (per_thread, per_thread), scope="local")
    by, bx, ty, tx = Var("by"), Var("bx"), Var("ty"), Var("tx")
    ko, kk, i, j = Var("ko"), Var("kk"), Var("i"), Var("j")
    threads = tile // per_thread
    row, col = ty * per_thread + i, tx * per_thread + j

    def per_output(stmt: object, inner: str = "unroll") -> For:
        return For(i, 0, per_thread, "unroll", For(j, 0, per_thread, inner, stmt))

    stage = per_output(seq(BufferStore(a_s, (row, col), a[by * tile + row, ko * tile + col]),
                           BufferStore(b_s, (row, col), b[ko * tile + row, bx * tile + col])))
    product = For(kk, 0, tile, "unroll", per_output(
        BufferStore(acc, (i, j), acc[i, j] + a_s[row, kk] * b_s[kk, col])))
    main = For(ko, 0, size // tile, "serial", seq(stage, Barrier(), product, Barrier()))
    body = seq(per_output(BufferStore(acc, (i, j), 0.0)), main,
               per_output(BufferStore(c, (by * tile + row, bx * tile + col), acc[i, j]), inner="vectorize"))
    nest = Allocate(acc, Allocate(a_s, Allocate(b_s, body)))
    for var, kind, extent in ((tx, "threadIdx.x", threads), (ty, "threadIdx.y", threads),
                              (bx, "blockIdx.x", size // tile), (by, "blockIdx.y", size // tile)):
        nest = For(var, 0, extent, kind, nest)
    return PrimFunc("matmul_tiled", (a, b, c), nest)


def half_math() -> PrimFunc:
    """float16 and bfloat16 math: sigmoid, products, max, a conversion between the two and from int."""
    n = Var("N", int32, "size")
    x, y = Buffer("X", float16, (n,)), Buffer("Y", float16, (n,))
    z, w = Buffer("Z", bfloat16, (n,)), Buffer("W", bfloat16, (n,))

    def body(bx: Var, tx: Var) -> IfThenElse:
        i = bx * 256 + tx
        h = x[i]
        y_value = maximum(sigmoid(h) * h + 1.5, cast(i % 7, float16))
        w_value = tanh(z[i]) * cast(h, bfloat16) + cast(sqrt(cast(z[i], float32)), bfloat16)
        return IfThenElse(i < n, seq(BufferStore(y, (i,), y_value), BufferStore(w, (i,), w_value)))

    return PrimFunc("half_math", (x, z, y, w, n), grid_1d(n, 256, body))


def wide_sizes() -> tuple[PrimFunc, PrimFunc]:
    """Two kernels whose buffers may exceed 2^31 elements: int64 size variables, and a static
    65536 x 65536 buffer indexed by int32 loop variables."""
    m, n = Var("M", int64, "size"), Var("N", int64, "size")
    a, b = Buffer("A", float32, (m, n)), Buffer("B", float32, (m, n))
    j, bx = Var("j", int64), Var("bx")
    row = For(j, 0, n, "serial", BufferStore(b, (cast(bx, int64), j), a[cast(bx, int64), j] + 1.0))
    dynamic = PrimFunc("add_one_int64", (a, b, m, n), For(bx, 0, cast(m, int32), "blockIdx.x", row))

    big = Buffer("Big", float32, (65536, 65536))
    by, tx = Var("by"), Var("tx")
    col = For(tx, 0, 256, "threadIdx.x", For(Var("c"), 0, 256, "serial", BufferStore(big, (by, tx), 0.0)))
    static = PrimFunc("zero_rows", (big,), For(by, 0, 65536, "blockIdx.x", col))
    return dynamic, static


def floor_div_mod() -> PrimFunc:
    """Floor // and % on a possibly negative dividend (constant and unknown-sign divisors) next
    to provably non-negative ones, which stay plain C / and %."""
    n, d = Var("N", int32, "size"), Var("d", int32, "stride")
    out = Buffer("Out", int32, (n, 4))

    def body(bx: Var, tx: Var) -> IfThenElse:
        i = bx * 256 + tx
        shifted = i - 8
        return IfThenElse(i < n, seq(
            BufferStore(out, (i, 0), shifted // 4 + shifted % 4),
            BufferStore(out, (i, 1), shifted // d + shifted % d),
            BufferStore(out, (i, 2), i // 4 + tx % 32),
            BufferStore(out, (i, 3), i // n)))

    return PrimFunc("floor_div_mod", (out, n, d), grid_1d(n, 256, body))


def warp_sum() -> PrimFunc:
    """Warp reduction with __shfl_xor_sync (float) and a half value broadcast with __shfl_sync."""
    a, s = Buffer("A", float32, (1024,)), Buffer("S", float32, (32,))
    h, hb = Buffer("H", float16, (1024,)), Buffer("HB", float16, (1024,))
    bx, tx = Var("bx"), Var("tx")
    values = [Var(f"v{k}", float32, "value") for k in range(6)]
    store = IfThenElse(tx == 0, BufferStore(s, (bx,), values[-1]))
    body = seq(store, BufferStore(hb, (bx * 32 + tx,), warp_shuffle("shfl_idx", h[bx * 32 + tx], 0)))
    for k in reversed(range(1, 6)):
        mask = 1 << (5 - k)
        body = LetStmt(values[k], values[k - 1] + warp_shuffle("shfl_xor", values[k - 1], mask), body)
    body = LetStmt(values[0], a[bx * 32 + tx], body)
    return PrimFunc("warp_sum", (a, h, s, hb), For(bx, 0, 32, "blockIdx.x", For(tx, 0, 32, "threadIdx.x", body)))


def padded_shift() -> PrimFunc:
    """B[i] = A[i - 1] where 1 <= i <= N else 0: a Select guards the out-of-bounds load; two loops
    bind threadIdx.x (256 and 128 wide), so the narrower one is guarded; a vectorized float4
    copy reads and writes 16 bytes at once."""
    n = Var("N", int32, "size")
    a, b = Buffer("A", float32, (n,)), Buffer("B", float32, (n + 1,))
    c, d = Buffer("C", float32, (512,)), Buffer("D", float32, (512,))
    bx, tx, tx2, v = Var("bx"), Var("tx"), Var("tx2"), Var("v")
    i = bx * 256 + tx
    load = where(logical_and(i >= 1, i <= n), a[i - 1], 0.0)
    shift = For(tx, 0, 256, "threadIdx.x", IfThenElse(i <= n, BufferStore(b, (i,), load)))
    copy = For(tx2, 0, 128, "threadIdx.x",
               For(v, 0, 4, "vectorize", BufferStore(d, (tx2 * 4 + v,), c[tx2 * 4 + v] * 0.5 + c[0])))
    return PrimFunc("padded_shift", (a, b, c, d, n), For(bx, 0, (n + 256) // 256, "blockIdx.x", seq(shift, copy)))


KERNELS: dict[str, Callable[[], PrimFunc]] = {
    "elementwise": elementwise, "row_sum": row_sum, "tiled_matmul": tiled_matmul, "half_math": half_math,
    "wide_dynamic": lambda: wide_sizes()[0], "wide_static": lambda: wide_sizes()[1],
    "floor_div_mod": floor_div_mod, "warp_sum": warp_sum, "padded_shift": padded_shift,
}


def source_of(name: str) -> str:
    return emit_source([KERNELS[name]()])


# ---- (a) what the emitted text promises ---------------------------------------------------------

def test_elementwise_kernel_signature_bindings_and_guard() -> None:
    text = source_of("elementwise")
    assert 'extern "C" __global__ void __launch_bounds__(256) scale_exp(' in text
    assert "const float* __restrict__ A, float* __restrict__ B, int N)" in text
    assert "  const int bx = blockIdx.x;\n  const int tx = threadIdx.x;\n" in text
    assert "    B[bx * 256 + tx] = A[bx * 256 + tx] * 2.0f + expf(A[bx * 256 + tx]);\n" in text
    assert "if (bx * 256 + tx < N) {" in text
    assert "#include" not in text  # no half type, no header
    assert "if (tx <" not in text  # the only thread loop spans the whole block


def test_serial_loop_respects_its_start_and_local_buffers_are_arrays() -> None:
    text = source_of("row_sum")
    assert "for (int k = 1; k < K; ++k) {" in text  # min 1, extent K - 1 -> bound 1 + (K - 1)
    assert "float acc[1];" in text
    assert "acc[0] = acc[0] + A[(bx * 128 + tx) * K + k];" in text
    assert "__launch_bounds__(128)" in text


def test_tiled_matmul_uses_shared_tiles_barriers_unrolling_and_a_vector_store() -> None:
    text = source_of("tiled_matmul")
    assert "__launch_bounds__(256)" in text  # 16 x 16 threads
    assert "__shared__ __align__(16) float A_shared[1024];" in text
    assert "__shared__ __align__(16) float B_shared[1024];" in text
    assert "float C_local[4];" in text
    assert text.count("__syncthreads();") == 2
    assert text.count("#pragma unroll\n") >= 6
    assert "const int by = blockIdx.y;" in text and "const int ty = threadIdx.y;" in text
    assert "for (int ko = 0; ko < 32; ++ko) {" in text
    assert "const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C" in text
    # The j loop of the final store is vectorized: contiguous in j and 2-aligned -> one float2 store.
    assert "float2 C_vec;" in text
    assert "*reinterpret_cast<float2*>(&C[" in text


def test_half_math_is_computed_in_float_and_rounded_at_each_node() -> None:
    text = source_of("half_math")
    assert text.index("#include <cuda_fp16.h>") < text.index("#include <cuda_bf16.h>") < text.index("extern")
    assert "const __half* __restrict__ X, const __nv_bfloat16* __restrict__ Z, __half* __restrict__ Y" in text
    # sigmoid(h) * h rounds the sigmoid to half, then the product, then the sum: three roundings.
    assert "__float2half_rn(1.0f / (1.0f + expf(-__half2float(X[bx * 256 + tx]))))" in text
    assert "__float2half_rn(__half2float(__float2half_rn(__half2float(__float2half_rn(1.0f / " in text
    assert "+ 1.5f)" in text
    assert "__int2half_rn(" in text  # int -> half in one correct rounding
    # float max propagates NaN through the helper printed once before the kernels, in float
    assert "tecc_max(__half2float(" in text and text.index("float tecc_max(float a") < text.index("extern")
    assert "__float2bfloat16_rn(tanhf(__bfloat162float(Z[bx * 256 + tx])))" in text
    assert "__float2bfloat16_rn(__half2float(X[bx * 256 + tx]))" in text  # half -> bf16 via exact float
    assert "__float2bfloat16_rn(sqrtf(__bfloat162float(Z[bx * 256 + tx])))" in text


def test_int64_sizes_and_huge_static_buffers_use_64bit_offsets() -> None:
    dynamic, static = wide_sizes()
    assert all(needs_64bit_indexing(p) for p in dynamic.params[:2])
    assert needs_64bit_indexing(static.params[0])
    assert not needs_64bit_indexing(elementwise().params[0])
    text = emit_kernel(dynamic)
    assert "long long M, long long N)" in text
    assert "for (long long j = 0; j < N; ++j) {" in text
    # bx is int and N long long: C widens bx before the multiply, so no cast is written.
    assert "B[bx * N + j] = A[bx * N + j] + 1.0f;" in text
    assert "const int bx = blockIdx.x;" in text
    text = emit_kernel(static)
    # The row index is int, the product must not wrap at 2^31: it is done in long long.
    assert "Big[by * 65536LL + tx] = 0.0f;" in text


def test_floor_division_and_modulo_formulas() -> None:
    text = source_of("floor_div_mod")
    shifted = "(bx * 256 + tx - 8)"
    # Constant positive divisor, dividend of unknown sign.
    assert f"{shifted} / 4 - ({shifted} % 4 < 0) + ({shifted} % 4 + 4) % 4" in text
    # Divisor of unknown sign (a stride variable): the general formula.
    assert f"{shifted} / d - ({shifted} % d != 0 && ({shifted} % d < 0) != (d < 0))" in text
    assert f"{shifted} % d + ({shifted} % d != 0 && ({shifted} % d < 0) != (d < 0) ? d : 0)" in text
    # A divisor that may be 0 is guarded: x // 0 and x % 0 are 0 (docs/semantics.md).
    assert f"(d == 0 ? 0 : {shifted} / d - (" in text and f"(d == 0 ? 0 : {shifted} % d + (" in text
    # Both operands provably non-negative: plain C operators (a size may be 0: guarded).
    assert "Out[(bx * 256 + tx) * 4 + 2] = (bx * 256 + tx) / 4 + tx % 32;" in text
    assert "Out[(bx * 256 + tx) * 4 + 3] = (N == 0 ? 0 : (bx * 256 + tx) / N);" in text


@pytest.mark.parametrize("a, b", [(-9, 4), (-8, 4), (7, 4), (0, 3), (7, -2), (-7, -2), (-7, 2), (6, -3)])
def test_floor_formulas_agree_with_python(a: int, b: int) -> None:
    """Evaluate the emitted C formulas with C's truncating / and % and compare with Python's floor."""
    def c_div(x: int, y: int) -> int:
        q = abs(x) // abs(y)
        return q if (x >= 0) == (y >= 0) else -q

    def c_mod(x: int, y: int) -> int:
        return x - c_div(x, y) * y

    general_div = c_div(a, b) - int(c_mod(a, b) != 0 and (c_mod(a, b) < 0) != (b < 0))
    general_mod = c_mod(a, b) + (b if c_mod(a, b) != 0 and (c_mod(a, b) < 0) != (b < 0) else 0)
    assert (general_div, general_mod) == (a // b, a % b)
    if b > 0:
        assert c_div(a, b) - int(c_mod(a, b) < 0) == a // b
        assert c_mod(c_mod(a, b) + b, b) == a % b


def test_warp_shuffles_use_the_full_mask() -> None:
    text = source_of("warp_sum")
    assert "const float v1 = v0 + __shfl_xor_sync(0xffffffffu, v0, 16);" in text
    assert "const float v5 = v4 + __shfl_xor_sync(0xffffffffu, v4, 1);" in text
    assert "HB[bx * 32 + tx] = __shfl_sync(0xffffffffu, H[bx * 32 + tx], 0);" in text
    assert "if (tx == 0) {" in text


def test_select_guards_the_load_and_narrow_thread_loops_are_guarded() -> None:
    text = source_of("padded_shift")
    assert "(bx * 256 + tx >= 1 && bx * 256 + tx <= N ? A[bx * 256 + tx - 1] : 0.0f)" in text
    assert "if (tx2 < 128) {" in text
    assert "if (tx < 256)" not in text
    assert "const float4 C_vec = *reinterpret_cast<const float4*>(&C[tx2 * 4]);" in text
    assert "D_vec.w = C_vec.w * 0.5f + C[0];" in text
    assert "*reinterpret_cast<float4*>(&D[tx2 * 4]) = D_vec;" in text


def test_unaligned_vector_loop_falls_back_to_unrolling() -> None:
    a = Buffer("A", float32, (64,))
    tx, v = Var("tx"), Var("v")
    body = For(tx, 0, 16, "threadIdx.x", For(v, 0, 4, "vectorize", BufferStore(a, (tx * 4 + v + 1,), 0.0)))
    text = emit_kernel(PrimFunc("offset_by_one", (a,), body))
    assert "reinterpret_cast" not in text
    assert "  #pragma unroll\n  for (int v = 0; v < 4; ++v) {\n    A[tx * 4 + v + 1] = 0.0f;" in text


def test_byte_vectors_move_as_16_byte_containers() -> None:
    """16 fp8 elements (or bools) per thread: one uint4 load and one uint4 store."""
    for dtype in ("float8_e4m3", "bool"):
        a, b = Buffer("A", dtype, (1024,)), Buffer("B", dtype, (1024,))
        tx, v = Var("tx"), Var("v")
        body = For(tx, 0, 64, "threadIdx.x", For(v, 0, 16, "vectorize", BufferStore(b, (tx * 16 + v,), a[tx * 16 + v])))
        text = emit_kernel(PrimFunc("copy_bytes", (a, b), body))
        assert "*reinterpret_cast<uint4*>(A_vec) = *reinterpret_cast<const uint4*>(&A[tx * 16]);" in text, text
        assert "*reinterpret_cast<uint4*>(&B[tx * 16]) = *reinterpret_cast<const uint4*>(B_vec);" in text, text


def test_a_split_guard_that_decides_whole_vectors_keeps_them_vectors() -> None:
    """`if (t * 8 + v < 40)`: 40 and the vector's start are multiples of 8, so the lanes of one
    vector are all in or all out: one test of its start, one uint4 store; `< 41` is not."""
    for n, vectorized in ((40, True), (41, False)):
        a = Buffer("A", "float16", (48,))
        tx, v = Var("tx"), Var("v")
        body = For(tx, 0, 6, "threadIdx.x", For(v, 0, 8, "vectorize",
                                                IfThenElse(tx * 8 + v < n, BufferStore(a, (tx * 8 + v,), 1.0))))
        text = emit_kernel(PrimFunc("edge", (a,), body))
        assert ("if (tx * 8 < 40) {" in text and "reinterpret_cast<uint4*>(&A[tx * 8])" in text) == vectorized, text


def test_a_swizzled_shared_tile_is_vectorized_by_its_logical_offsets() -> None:
    """Swizzle(3, 3, 6) keeps 8 halves together: a row chunk of the logical tile is one 16-byte
    store at the XOR-ed address of its first element."""
    from tecc.ir.layout import Swizzle

    out = Buffer("Out", "float16", (4096,))
    tile = Buffer("T", "float16", (64, 64), "shared", layout=Swizzle(3, 3, 6))
    tx, v = Var("tx"), Var("v")
    copy = For(tx, 0, 512, "threadIdx.x", For(v, 0, 8, "vectorize",
                                              BufferStore(tile, (tx // 8, tx % 8 * 8 + v), 0.5)))
    body = Allocate(tile, seq(copy, Barrier(), For(tx, 0, 512, "threadIdx.x", BufferStore(out, (tx,), tile[tx // 64, tx % 64]))))
    text = emit_kernel(PrimFunc("swizzled", (out,), body))
    assert "*reinterpret_cast<uint4*>(&T[tx / 8 * 64 + tx % 8 * 8 ^ (tx / 8 * 64 + tx % 8 * 8) / 512 % 8 * 8]) =" in text, text


def test_constants_round_trip_exactly() -> None:
    out = Buffer("Out", float32, (6,))
    dbl = Buffer("D", "float64", (2,))
    big = Buffer("L", int64, (1,))
    body = seq(BufferStore(out, (0,), 0.1), BufferStore(out, (1,), float("inf")),
               BufferStore(out, (2,), -float("inf")), BufferStore(out, (3,), float("nan")),
               BufferStore(out, (4,), 3.4028234663852886e38), BufferStore(out, (5,), 1e-45),
               BufferStore(dbl, (0,), 0.1), BufferStore(dbl, (1,), -2.5e-300),
               BufferStore(big, (0,), -(2**63)))
    text = emit_kernel(PrimFunc("constants", (out, dbl, big), body))
    for literal in ("Out[0] = 0.1f;", "Out[1] = __int_as_float(0x7f800000);",
                    "Out[2] = -__int_as_float(0x7f800000);", "Out[3] = __int_as_float(0x7fc00000);",
                    "Out[4] = 3.4028235e+38f;", "Out[5] = 1e-45f;", "D[0] = 0.1;", "D[1] = -2.5e-300;",
                    "L[0] = (-9223372036854775807LL - 1);"):
        assert literal in text, literal
    assert "__launch_bounds__(1)" in text


def test_names_are_sanitized_and_made_unique() -> None:
    a = Buffer("x.out", float32, (4,))
    i1, i2 = Var("i"), Var("i")
    body = For(i1, 0, 2, "serial", For(i2, 0, 2, "serial", BufferStore(a, (i1 * 2 + i2,), 1.0)))
    text = emit_kernel(PrimFunc("int", (a,), body))
    assert "void __launch_bounds__(1) int_(float* __restrict__ x_out)" in text
    assert "for (int i_1 = 0; i_1 < 2; ++i_1) {" in text
    assert "x_out[i * 2 + i_1] = 1.0f;" in text


def test_unbound_variable_is_a_compile_error() -> None:
    a = Buffer("A", float32, (4,))
    stray = Var("stray")
    with pytest.raises(CompileError, match="stray is used but is neither a parameter nor bound"):
        emit_kernel(PrimFunc("k", (a,), BufferStore(a, (stray,), 1.0)))


@pytest.mark.parametrize("name", ["elementwise", "tiled_matmul", "half_math", "floor_div_mod"])
def test_golden_cuda(name: str) -> None:
    """The generated CUDA of four kernels, compared exactly with tests/golden/<name>.cu."""
    path = GOLDEN / f"{name}.cu"
    text = source_of(name)
    if os.environ.get("TECC_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"missing golden file {path}; run with TECC_UPDATE_GOLDEN=1 and review it"
    assert text == path.read_text(), f"generated CUDA for {name} changed; diff it against {path}"


# ---- (b) NVRTC ----------------------------------------------------------------------------------

SIMPLE = ("elementwise", "row_sum", "floor_div_mod", "warp_sum", "padded_shift", "wide_dynamic", "wide_static")


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_every_kernel_compiles_to_cubin(name: str, arch: str) -> None:
    func = KERNELS[name]()
    compiled = compile_cuda(emit_source([func]), arch=arch, name=name)
    assert compiled.cubin[:4] == b"\x7fELF"
    assert f".target {arch}" in compiled.ptx and f".entry {func.name}(" in compiled.ptx
    resources = compiled.resources[func.name]
    assert resources.registers > 0
    if name in SIMPLE:
        assert (resources.spill_stores, resources.spill_loads) == (0, 0), compiled.log
    if name == "tiled_matmul":
        assert resources.shared_bytes == 2 * 32 * 32 * 4
        assert resources.barriers >= 1
    assert compiled.arch == arch and compiled.nvrtc_version == nvrtc_version()


def test_one_unit_holds_several_kernels() -> None:
    source = emit_source([elementwise(), half_math(), tiled_matmul()])
    assert source.count("#include <cuda_fp16.h>") == 1
    assert set(compile_cuda(source).resources) == {"scale_exp", "half_math", "matmul_tiled"}


def _elf_sections(cubin: bytes) -> dict[str, bytes]:
    """Name -> contents of every section of a 64-bit little-endian ELF (a cubin)."""
    import struct

    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    entry_size, count, names_at = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", cubin, shoff + n * entry_size) for n in range(count)]
    names = headers[names_at][4]
    out = {}
    for name, kind, _, _, offset, size in headers:
        label = cubin[names + name:cubin.index(b"\0", names + name)].decode()
        out[label] = b"" if kind == 8 else cubin[offset:offset + size]   # 8: SHT_NOBITS
    return out


def test_split_compile_keeps_every_kernels_machine_code() -> None:
    """compile_cuda(threads=N) compiles a unit of several kernels with NVRTC's --split-compile:
    the same PTX, resources and machine code (every .text section) as one thread; only the
    cubin's note of the tool options may differ (and the log: tests/test_cache.py)."""
    source = emit_source([elementwise(), half_math(), tiled_matmul()])
    one = compile_cuda(source, arch="sm_90")
    split = compile_cuda(source, arch="sm_90", threads=2)
    assert "--split-compile=2" in split.options and not any("split" in o for o in one.options)
    assert split.ptx == one.ptx and split.resources == one.resources
    a, b = _elf_sections(one.cubin), _elf_sections(split.cubin)
    assert set(a) == set(b)
    texts = [n for n in a if n.startswith(".text.")]
    assert len(texts) == 3, sorted(a)
    assert [n for n in a if a[n] != b[n]] in ([], [".note.nv.tkinfo"])
    # one kernel: nothing to split
    assert compile_cuda(source_of("half_math"), arch="sm_90", threads=4).options == \
        compile_cuda(source_of("half_math"), arch="sm_90").options


def test_split_compile_takes_ptxas_advisories_from_stderr_into_the_log(capfd: pytest.CaptureFixture[str],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The split's ptxas threads print their advisories (C75xx) to file descriptor 2; compile_cuda
    captures it while it compiles: the advisories go into the log (where a one-thread compile has
    them), and whatever else was written there meanwhile is written back to stderr."""
    from tecc.codegen import nvrtc

    inner = nvrtc._compile_reported

    def noisy(*args: object) -> object:
        os.write(2, b"ptxas info    : (C7519) warpgroup.arrive is injected in function 'k'\nanother thread's line\n")
        return inner(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(nvrtc, "_compile_reported", noisy)
    source = emit_source([elementwise(), half_math()])
    split = compile_cuda(source, arch="sm_90", threads=2)
    err = capfd.readouterr().err
    assert "(C7519)" in split.log and "C7519" not in err and "another thread's line" in err
    assert "another thread's line" not in split.log
    one = compile_cuda(source, arch="sm_90")   # no split: nothing captured, the line stays on stderr
    assert "C7519" in capfd.readouterr().err and "C7519" not in one.log


def test_cubin_matches_cuda_core_program() -> None:
    """The bindings path builds exactly the cubin cuda.core's Program builds from the same options."""
    from cuda.core import Program, ProgramOptions

    source = source_of("half_math")
    ours = compile_cuda(source, arch="sm_90", name="half_math")
    options = ProgramOptions(arch="sm_90", std="c++17", ptxas_options=["-v"],
                             include_path=list(nvrtc_module.cuda_include_dirs()) or None)
    theirs = Program(source, "c++", options).compile("cubin").code
    assert bytes(theirs) == ours.cubin


@pytest.mark.parametrize("arch", ["sm_80", "sm_90", "sm_90a", "sm_100a"])
@pytest.mark.parametrize("include", [(), ("/opt/cuda/include",), ("/a", "/b c")])
def test_option_list_is_what_program_options_spells(arch, include) -> None:
    """tecc spells NVRTC's common command line itself (no cuda.core import in a build): the same
    list cuda.core's ProgramOptions gives."""
    from cuda.core import ProgramOptions

    options = ProgramOptions(arch=arch, std="c++17", ptxas_options=["-v"], include_path=list(include) or None)
    assert nvrtc_module._spelled(arch, include) == [o.decode() for o in options.as_bytes("nvrtc")]


def test_nvrtc_error_is_a_compile_error_quoting_the_line() -> None:
    source = 'extern "C" __global__ void k(float* a) {\n  a[0] = undefined_name;\n}\n'
    with pytest.raises(CompileError) as info:
        compile_cuda(source, name="broken")
    error = info.value
    assert 'identifier "undefined_name" is undefined' in error.log
    assert error.source == source
    assert "broken(2): error" in str(error)
    assert ">    2 |   a[0] = undefined_name;" in str(error)


def test_unknown_arch_is_refused() -> None:
    with pytest.raises(CompileError, match="cannot compile for sm_10"):
        compile_cuda(source_of("elementwise"), arch="sm_10")


def test_missing_nvrtc_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_library() -> None:
        raise OSError("libnvrtc.so.13: cannot open shared object file")

    monkeypatch.setattr(nvrtc_module, "_import_nvrtc", no_library)
    nvrtc_module._nvrtc.cache_clear()
    try:
        with pytest.raises(CompileError, match="pip install \"nvidia-cuda-nvrtc"):
            compile_cuda(source_of("elementwise"))
    finally:
        nvrtc_module._nvrtc.cache_clear()


def test_ptxas_log_parsing() -> None:
    log = ("ptxas info    : Compiling entry function 'k' for 'sm_90'\n"
           "ptxas info    : Function properties for k\n"
           "ptxas         .     16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n"
           "ptxas info    : Used 40 registers, used 1 barriers, 8192 bytes smem, 368 bytes cmem[0]\n")
    r = nvrtc_module.parse_ptxas_log(log)["k"]
    assert (r.registers, r.shared_bytes, r.spill_stores, r.spill_loads, r.stack_bytes, r.barriers,
            r.constant_bytes) == (40, 8192, 8, 4, 16, 1, 368)


def test_default_arch_never_raises() -> None:
    arch = default_arch()
    assert arch.startswith("sm_") and arch[3:].isdigit()


@pytest.mark.parametrize("dtype", [float32, "float64", float16, bfloat16])
def test_every_intrinsic_and_operator_compiles(dtype: object) -> None:
    """Each math intrinsic, min/max/pow, compare, Select, Let and a shuffle, in one dtype: the
    spelling table must name functions NVRTC knows, with the right overload."""
    from tecc.ir.expr import INTRINSICS, binary, call

    x = Buffer("X", dtype, (64,))
    out = Buffer("Out", dtype, (len(INTRINSICS) + 8,))
    flags = Buffer("Flags", "bool", (2,))
    tx, let = Var("tx"), Var("x", x.dtype, "value")
    value = x[tx]
    stores = []
    for k, name in enumerate(INTRINSICS):
        result = call(name, let)
        if result.dtype.is_bool:
            stores.append(BufferStore(flags, (k % 2,), result))
        else:
            stores.append(BufferStore(out, (k,), result))
    base = len(INTRINSICS)
    stores += [BufferStore(out, (base,), binary("min", let, 1.0)), BufferStore(out, (base + 1,), binary("max", let, 1.0)),
               BufferStore(out, (base + 2,), binary("pow", let, 2.0)), BufferStore(out, (base + 3,), let / 3.0),
               BufferStore(out, (base + 4,), where(let < 0.5, let - 1.0, cast(tx, x.dtype))),
               BufferStore(out, (base + 5,), warp_shuffle("shfl_down", let, 1)),
               BufferStore(out, (base + 6,), cast(cast(let, int64), x.dtype)),
               BufferStore(flags, (0,), warp_shuffle("shfl_xor", let > 0.0, 1))]
    body = For(tx, 0, 64, "threadIdx.x", LetStmt(let, value, seq(*stores)))
    func = PrimFunc("intrinsics", (x, out, flags), body)
    compiled = compile_cuda(emit_source([func]), name="intrinsics")
    assert compiled.resources["intrinsics"].registers > 0
    text = emit_kernel(func)
    assert "const bool" not in text and f"const {x.dtype.c_name} x = X[tx];" in text


def test_int64_min_max_abs_keep_one_type() -> None:
    n = Var("N", int64, "size")
    out = Buffer("Out", int64, (3,))
    tx = Var("tx")
    from tecc.ir.expr import binary, call
    wide_tx = cast(tx, int64)
    body = For(tx, 0, 32, "threadIdx.x", seq(BufferStore(out, (0,), binary("min", wide_tx, n)),
                                             BufferStore(out, (1,), call("abs", wide_tx - n)),
                                             BufferStore(out, (2,), wide_tx * n + wide_tx)))
    func = PrimFunc("int64_ops", (out, n), body)
    text = emit_kernel(func)
    assert "min(static_cast<long long>(tx), N)" in text
    assert "llabs(tx - N)" in text
    assert "Out[2] = tx * N + tx;" in text
    compile_cuda(emit_source([func]), name="int64_ops")


def test_integer_products_keep_the_parentheses_around_a_division_on_their_right():
    """`s * ((C + 7) // 8 * 4)` must not print as `s * (C + 7) / 8 * 4`, which C groups as
    `((s * (C + 7)) / 8) * 4` (a split_rows chunk offset for symbolic C was wrong on the GPU)."""
    import itertools

    from tecc.codegen.cuda_expr import ExprEmitter
    from tecc.codegen.ranges import RangeEnv
    from tecc.ir import dtype as dt
    from tecc.ir.evaluate import evaluate_int
    from tecc.ir.expr import Var

    s, c = Var("s", dt.int32), Var("C", dt.int32)
    ranges = RangeEnv()
    for v in (s, c):
        ranges.bind(v, (0, 1 << 20))
    emitter = ExprEmitter(lambda v: v.name, lambda b: b.name, set(), ranges)
    exprs = [s * ((c + 7) // 8 * 4), s * ((c + 7) % 8 * 4), s * (c * ((c + 3) // 4 * 2)),
             s * (c * 2 * 3), (s + 1) * ((c + 262143) // 262144 * 4096)]
    for e in exprs:
        text = emitter.code(e)
        for sv, cv in itertools.product((0, 1, 3, 63), (1, 5, 1 << 20, 3 * (1 << 20) + 1)):
            # every operand is non-negative here, so C's `/` and `%` are Python's `//` and `%`
            got = eval(text.replace("/", "//"), {"s": sv, "C": cv})
            assert got == evaluate_int(e, {s: sv, c: cv}), (text, sv, cv)
    assert emitter.code(s * (c * 2 * 3)) == "s * C * 2 * 3"  # pure products still print bare


def test_fragment_stores_of_converted_floats_pair_into_one_register() -> None:
    """mma_tiles.paired_stores splits an element loop per store and writes each float32 -> bf16
    fragment store as 2-lane vector loops, which codegen emits as one __floats2bfloat162_rn into
    the 32-bit register holding both (not two conversions merged by byte permutes). A loop that
    stores one buffer twice, or reads a stored buffer at another element, stays as it was."""
    from tecc.passes.rewrite.mma_tiles import paired_stores

    names = iter(range(100))
    a, b = Buffer("A", float32, (256,)), Buffer("B", "bfloat16", (256,))
    s = Buffer("S", float32, (8,), "local")
    f = Buffer("F", "bfloat16", (8,), "fragment", fragment=("mma.m16n8k16.f32.bf16", "a"))
    tx, e, c = Var("tx"), Var("e"), Var("c")
    loop = For(e, 0, 8, "unroll", seq(BufferStore(s, (e,), a[tx * 8 + e] * 2.0),
                                       BufferStore(f, (e,), cast(s[e] + 1.0, "bfloat16"))))
    paired = paired_stores(loop, lambda label: f"{label}_{next(names)}")
    assert paired is not loop
    body = For(tx, 0, 32, "threadIdx.x", Allocate(s, Allocate(f, seq(
        paired, For(c, 0, 8, "unroll", BufferStore(b, (tx * 8 + c,), f[c]))))))
    text = emit_kernel(PrimFunc("pairs", (a, b), body))
    assert "*reinterpret_cast<__nv_bfloat162*>(&F[" in text and "__floats2bfloat162_rn(S[" in text, text
    assert "__float2bfloat16_rn(" not in text, text
    twice = For(e, 0, 8, "unroll", seq(BufferStore(f, (e,), cast(a[e], "bfloat16")),
                                        BufferStore(f, (e + 0,), cast(a[e] * 2.0, "bfloat16"))))
    assert paired_stores(twice, lambda label: label) is twice
    shifted = For(e, 0, 8, "unroll", seq(BufferStore(s, (e,), a[e]), BufferStore(f, (e,), cast(s[7 - e], "bfloat16"))))
    assert paired_stores(shifted, lambda label: label) is shifted
