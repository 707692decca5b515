"""CUDA C of the matrix-fragment level: the hand-built kernels emit inline PTX from the
intrinsic table, compile with NVRTC for sm_80 and sm_90 without spills, and one of them is
kept as a golden file (tests/golden/mma_ldmatrix_cp_async.cu; update on purpose with
TECC_UPDATE_GOLDEN=1 and review the diff)."""

from __future__ import annotations

import os
import pathlib
from typing import Callable

import pytest
from matrix_kernels import (
    BF16_F32,
    F16_F16,
    F16_F32,
    TF32_F32,
    ldmatrix_probe_kernel,
    ldmatrix_tile_kernel,
    mma_direct_kernel,
    mma_ldmatrix_kernel,
)

from tecc.codegen import compile_cuda, emit_source
from tecc.ir.stmt import PrimFunc

GOLDEN = pathlib.Path(__file__).parent / "golden"

KERNELS: dict[str, Callable[[], PrimFunc]] = {
    "direct_f16": lambda: mma_direct_kernel(F16_F32),
    "direct_bf16": lambda: mma_direct_kernel(BF16_F32),
    "direct_f16_acc": lambda: mma_direct_kernel(F16_F16),
    "direct_tf32": lambda: mma_direct_kernel(TF32_F32),
    "ldmatrix_mk_kn": lambda: mma_ldmatrix_kernel(F16_F32, "mk", "kn"),
    "ldmatrix_km_nk_swizzled": lambda: mma_ldmatrix_kernel(F16_F32, "km", "nk", swizzle=True),
    "ldmatrix_bf16": lambda: mma_ldmatrix_kernel(BF16_F32, "mk", "nk"),
    "cp_async_swizzled": lambda: mma_ldmatrix_kernel(F16_F32, "mk", "nk", staging="cp.async", swizzle=True),
    "tile_swizzled": lambda: ldmatrix_tile_kernel(True),
    "probe_x1": lambda: ldmatrix_probe_kernel("ldmatrix.x1"),
    "probe_x2_trans": lambda: ldmatrix_probe_kernel("ldmatrix.x2.trans"),
}

# PTX each kernel must contain: the table's mnemonics, reaching ptxas unchanged.
EXPECTED_PTX = {
    "direct_f16": ["mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"],
    "direct_bf16": ["mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"],
    "direct_f16_acc": ["mma.sync.aligned.m16n8k16.row.col.f16.f16.f16.f16"],
    "direct_tf32": ["cvt.rna.tf32.f32", "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32"],
    "ldmatrix_mk_kn": ["ldmatrix.sync.aligned.m8n8.x4.shared.b16", "ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16"],
    "ldmatrix_km_nk_swizzled": ["ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16", "ldmatrix.sync.aligned.m8n8.x2.shared.b16"],
    "ldmatrix_bf16": ["mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"],
    "cp_async_swizzled": ["cp.async.cg.shared.global", "cp.async.ca.shared.global", "cp.async.commit_group",
                          "cp.async.wait_group 0"],
    "tile_swizzled": ["ldmatrix.sync.aligned.m8n8.x4.shared.b16"],
    "probe_x1": ["ldmatrix.sync.aligned.m8n8.x1.shared.b16"],
    "probe_x2_trans": ["ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16"],
}


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_matrix_kernels_compile_with_nvrtc_without_spills(name: str, arch: str) -> None:
    func = KERNELS[name]()
    compiled = compile_cuda(emit_source([func]), arch=arch, name=name)
    assert compiled.cubin[:4] == b"\x7fELF"
    for mnemonic in EXPECTED_PTX[name]:
        assert mnemonic in compiled.ptx, f"{name}: {mnemonic} missing from the PTX"
    res = compiled.resources[func.name]
    assert (res.spill_stores, res.spill_loads, res.stack_bytes) == (0, 0, 0), f"{name} on {arch}: {res}"
    assert res.registers <= 64, f"{name} on {arch}: {res.registers} registers for one tile"


def test_register_packing_comes_from_the_table_row() -> None:
    text = emit_source([mma_direct_kernel(F16_F32)])
    # A: 4 registers of two halves, B: 2, C and D: 4 floats each (D outputs first, then A, B, C)
    assert '"=f"(acc[0]), "=f"(acc[1]), "=f"(acc[2]), "=f"(acc[3])' in text
    assert '"r"(*reinterpret_cast<unsigned*>(&a_frag[6])), "r"(*reinterpret_cast<unsigned*>(&b_frag[0]))' in text
    assert "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13}" in text
    assert "__align__(16) __half a_frag[8];" in text
    half_acc = emit_source([mma_direct_kernel(F16_F16)])
    assert "{%0, %1}, {%2, %3, %4, %5}, {%6, %7}, {%8, %9}" in half_acc


def test_swizzled_buffers_are_addressed_through_their_layout() -> None:
    text = emit_source([mma_ldmatrix_kernel(F16_F32, "mk", "kn", swizzle=True)])
    # logical offset o = row * 16 + col; physical o ^ ((o / 64) % 2) * 8 (Swizzle(1, 3, 3))
    logical = "(lane + 32 * i) / 16 * 16 + (lane + 32 * i) % 16"
    assert f"As[{logical} ^ ({logical}) / 64 % 2 * 8] = A[{logical}];" in text
    plain = emit_source([mma_ldmatrix_kernel(F16_F32, "mk", "kn", swizzle=False)])
    assert "^" not in plain


def test_golden_cuda_of_the_cp_async_ldmatrix_mma_kernel() -> None:
    path = GOLDEN / "mma_ldmatrix_cp_async.cu"
    text = emit_source([mma_ldmatrix_kernel(F16_F32, "mk", "nk", staging="cp.async", swizzle=True)])
    if os.environ.get("TECC_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert path.exists(), f"missing golden file {path}; run with TECC_UPDATE_GOLDEN=1 and review it"
    assert text == path.read_text(), f"generated CUDA changed; diff it against {path}"
