"""gemm_wgmma_fp8: fp8 (float8_e4m3 / float8_e5m2) contractions on Hopper's wgmma, gemm_wgmma's
rungs and model with fp8's k tile and rate (the class docstring says what it serves)."""

from __future__ import annotations

from ...ir.target import Target
from ..cost.analysis import KernelInfo
from .gemm_tensor_core import mma_view
from .gemm_wgmma import K_TILE, WGMMA_ARCH, GemmWgmma
from .registry import Point, register

FP8_K_TILE = 128           # fp8 elements in a 128-byte swizzled row
FP8_DTYPES = ("float8_e4m3", "float8_e5m2")


class GemmWgmmaFP8(GemmWgmma):
    """fp8 (float8_e4m3 / float8_e5m2) contractions on Hopper's wgmma: wgmma.m64nNk32 .e4m3 /
    .e5m2 with f32 accumulators at the target's dense fp8 peak, k tiles of 128 elements (the
    same 128-byte rows, ring bytes and swizzle as gemm_wgmma's 64 halves), the output float32,
    float16 or bfloat16 (the epilogue rounds once, after any fused scale). The user writes
    `tc.sum(tc.cast(A[i, k], "float32") * tc.cast(B[j, k], "float32"), axis=k)`.

    Like tf32 the ISA takes fp8 shared operands K-major only (no transpose immediates), and this
    strategy serves the main form only: both operands k-contiguous (C = A·Bᵀ, A [m][k] and
    B [n][k], as torch._scaled_mm takes B column-major), both read through descriptors. The
    other orientations are refused by the guard (transpose an operand first). The two operands
    may be of different fp8 types (e4m3 x e5m2: the mixed rows). gemm_wgmma's rungs: the
    cp.async ring and the warp-specialized TMA ring (TMA copies fp8 as bytes), persistent or
    not, with the register or TMA-store epilogue.
    Priced with gemm_wgmma's model and constants (not fitted on fp8 points; timed on an H200 at
    1.00x / 0.98x torch._scaled_mm at 4096³ / 8192³: benchmarks/RESULTS.md)."""

    name = "gemm_wgmma_fp8"
    description = ("fp8 (e4m3 / e5m2) contraction on Hopper: wgmma.m64nNk32 with f32 accumulators, both operands "
                   "K-major (C = A·Bᵀ), cp.async or TMA ring, 128B swizzle")
    element_bytes = 1
    k_tile = FP8_K_TILE
    k_step = 32
    rate_key = "float8"
    intrinsic = "wgmma"

    def guard(self, info: KernelInfo, target: Target) -> str | None:
        if target.sm != WGMMA_ARCH:
            return f"{target.arch} has no wgmma (sm_90 only); fp8 contractions run on Hopper's wgmma only"
        view = mma_view(info, target, "wgmma.m64nNk32 fp8")
        if isinstance(view, str):
            return view
        pair = (view.a, view.b)
        if any(x.dtype not in FP8_DTYPES for x in pair):
            return "float8_e4m3 or float8_e5m2 operands only"
        # an operand with run-time strides stored with k outermost is taken in its K-major view
        # (B = w.t(): tensorize_wgmma.k_major_views), its copies tested at launch
        if not all(k_last or flipped for k_last, flipped in zip(view.k_last, view.transposed_copies)):
            return ("fp8 wgmma reads its shared operands K-major only (no transpose for .e4m3/.e5m2): store both "
                    "operands k-contiguous (A [i, k], B [j, k]: C = A·Bᵀ), or declare the other strides=\"any\" and "
                    "pass a K-major view (w.t())")
        return None

    def operand_note(self, info: KernelInfo) -> tuple[str]:
        return ("A and B (fp8, K-major) read by wgmma from 128B-swizzled shared tiles",)

    def describe(self, point: Point) -> str:
        return super().describe(point).replace("gemm_wgmma(", "gemm_wgmma_fp8(").replace(
            "k16 f32", "k32 fp8 f32").replace(f"k-tile {K_TILE}", f"k-tile {self.k_tile}")


register(GemmWgmmaFP8())
