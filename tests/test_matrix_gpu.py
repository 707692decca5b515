"""The matrix-fragment kernels on a real GPU (sm_80+), compared with NumPy float64 under the
same derived tolerance as the emulator tests (skipped without a GPU)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from matrix_kernels import (
    BF16_F32,
    F16_F16,
    F16_F32,
    TF32_F32,
    check_mma_result,
    ldmatrix_tile_kernel,
    mma_direct_kernel,
    mma_inputs,
    mma_ldmatrix_kernel,
    mma_reference,
)

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from test_codegen_gpu import run  # noqa: E402


def to_device(a: np.ndarray) -> Any:
    if a.dtype.name == "bfloat16":  # ml_dtypes' bfloat16: move the bits
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16).cuda()
    return torch.from_numpy(a.copy()).cuda()


def to_host(t: Any, like: np.ndarray) -> np.ndarray:
    if like.dtype.name == "bfloat16":
        return t.view(torch.int16).cpu().numpy().view(like.dtype)
    return t.cpu().numpy()


def run_mma(func: Any, arrays: dict[str, np.ndarray], **scalars: int) -> np.ndarray:
    dev = {k: to_device(v) for k, v in arrays.items()}
    args = [dev[p.name] if p.name in dev else scalars[p.name] for p in func.params]
    run(func, *args, sizes=scalars)
    torch.cuda.synchronize()
    return to_host(dev["D"], arrays["D"])


@pytest.mark.parametrize("intrinsic", [F16_F32, BF16_F32, F16_F16, TF32_F32])
def test_mma_direct_on_gpu(intrinsic: str) -> None:
    func = mma_direct_kernel(intrinsic)
    arrays = mma_inputs(intrinsic, 11)
    got = run_mma(func, arrays)
    want, bound = mma_reference(intrinsic, arrays)
    check_mma_result(got, want, bound, func.name)


@pytest.mark.parametrize("intrinsic", [F16_F32, BF16_F32])
@pytest.mark.parametrize("a_stored,b_stored", [("mk", "kn"), ("mk", "nk"), ("km", "kn"), ("km", "nk")])
@pytest.mark.parametrize("swizzle", [False, True])
def test_mma_ldmatrix_on_gpu(intrinsic: str, a_stored: str, b_stored: str, swizzle: bool) -> None:
    func = mma_ldmatrix_kernel(intrinsic, a_stored, b_stored, swizzle=swizzle)
    arrays = mma_inputs(intrinsic, 12, a_stored, b_stored)
    got = run_mma(func, arrays)
    want, bound = mma_reference(intrinsic, arrays, a_stored, b_stored)
    check_mma_result(got, want, bound, func.name)


@pytest.mark.parametrize("rows_valid", [16, 11])
def test_cp_async_staging_on_gpu(rows_valid: int) -> None:
    func = mma_ldmatrix_kernel(F16_F32, "mk", "nk", staging="cp.async", swizzle=True)
    arrays = mma_inputs(F16_F32, 13, "mk", "nk")
    got = run_mma(func, arrays, rows_valid=rows_valid)
    want, bound = mma_reference(F16_F32, arrays, "mk", "nk", rows_valid=rows_valid)
    check_mma_result(got, want, bound, f"{func.name} rows_valid={rows_valid}")


@pytest.mark.parametrize("swizzle", [False, True])
def test_ldmatrix_tile_round_trip_on_gpu(swizzle: bool) -> None:
    func = ldmatrix_tile_kernel(swizzle)
    g = np.random.default_rng(14)
    a = (g.uniform(0.5, 1.5, (16, 64)) * g.choice([-1, 1], (16, 64))).astype(np.float16)
    out = torch.full((16, 64), float("nan"), dtype=torch.float16, device="cuda")
    run(func, to_device(a), out)
    np.testing.assert_array_equal(out.cpu().numpy(), a)


def test_tf32_rounding_on_gpu_matches_the_emulator() -> None:
    func = mma_direct_kernel(TF32_F32)
    arrays = {"A": np.full((16, 8), 1 + 2.0**-11, dtype=np.float32), "B": np.eye(8, dtype=np.float32),
              "C": np.full((16, 8), 0.25, dtype=np.float32), "D": np.full((16, 8), np.nan, dtype=np.float32)}
    got = run_mma(func, arrays)
    np.testing.assert_array_equal(got, np.float32(1 + 2.0**-10 + 0.25))


@pytest.mark.parametrize("shape", [(128, 128, 128), (256, 192, 512)])
def test_tiled_tensor_core_gemm_on_gpu(shape: tuple[int, int, int]) -> None:
    from test_matrix_gemm import check_gemm, gemm_inputs, gemm_kernel

    M, N, K = shape
    func = gemm_kernel(M, N, K)
    arrays = gemm_inputs(M, N, K, 23)
    d = torch.full((M, N), float("nan"), dtype=torch.float32, device="cuda")
    run(func, to_device(arrays["A"]), to_device(arrays["B"]), d)
    torch.cuda.synchronize()
    check_gemm(d.cpu().numpy(), arrays, f"gemm {M}x{N}x{K} on GPU")


@pytest.mark.parametrize("row_name", [f"ldmatrix.x{x}{t}" for x in (1, 2, 4) for t in ("", ".trans")])
def test_every_ldmatrix_row_on_gpu_delivers_what_the_isa_says(row_name: str) -> None:
    from matrix_kernels import ldmatrix_probe_kernel
    from test_matrix_sim import ldmatrix_probe_expected

    s = np.arange(256, dtype=np.float16).reshape(32, 8)
    out = torch.full((32, 8), float("nan"), dtype=torch.float16, device="cuda")
    run(ldmatrix_probe_kernel(row_name), to_device(s), out)
    np.testing.assert_array_equal(out.cpu().numpy(), ldmatrix_probe_expected(row_name, s))
