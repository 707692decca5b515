"""CUDA C of the Hopper level: the hand-built wgmma kernels compile with NVRTC for sm_90a (wgmma
needs the architecture-specific target) without spills, with every mnemonic in the PTX, and the
descriptors printed from the same MatrixDescriptor the emulator reads through; one kernel is kept
as a golden file (tests/golden/wgmma_mbarrier_bulk_copy.cu)."""

from __future__ import annotations

import os
import pathlib
import re

import pytest
from hopper_kernels import k_major, mn_major, wgmma_kernel

from tecc.codegen import compile_cuda, emit_source
from tecc.ir import dtype as dt
from tecc.ir.errors import CompileError
from tecc.ir.expr import Var
from tecc.ir.stmt import (
    Allocate,
    Barrier,
    BarrierArrive,
    BarrierInit,
    BarrierRef,
    BarrierWait,
    Buffer,
    BufferStore,
    For,
    IfThenElse,
    PrimFunc,
    SetMaxRegisters,
    seq,
)

KERNELS = {
    "m64n64_f16_128B_K": dict(n=64, ab="f16", a_swizzle="128B", b_swizzle="128B", b_major="K"),
    "m64n128_bf16_64B_MN32B": dict(n=128, ab="bf16", a_swizzle="64B", b_swizzle="32B", b_major="MN"),
    "m64n256_f16_128B_MN": dict(n=256, ab="f16", a_swizzle="128B", b_swizzle="128B", b_major="MN"),
    "m64n64_bf16_none": dict(n=64, ab="bf16", a_swizzle="none", b_swizzle="none", b_major="K"),
    "m64n64k64_f16_chained": dict(n=64, ab="f16", a_swizzle="128B", b_swizzle="128B", b_major="K", k_steps=4),
    "two_warpgroups": dict(n=64, ab="bf16", a_swizzle="128B", b_swizzle="128B", b_major="K", k_steps=2,
                           warpgroups=2),
}

MNEMONICS = ["mbarrier.init.shared::cta.b64", "mbarrier.arrive.expect_tx.shared::cta.b64",
             "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes", "fence.proxy.async.shared::cta",
             "mbarrier.try_wait.parity.shared::cta.b64", "wgmma.fence.sync.aligned",
             "wgmma.commit_group.sync.aligned", "wgmma.wait_group.sync.aligned 0"]


@pytest.mark.parametrize("name", list(KERNELS))
def test_wgmma_kernels_compile_for_sm_90a_without_spills(name: str) -> None:
    args = KERNELS[name]
    func = wgmma_kernel(**args)  # type: ignore[arg-type]
    code = compile_cuda(emit_source([func]), arch="sm_90a", name=name)
    n, ab = args["n"], args["ab"]
    for mnemonic in MNEMONICS + [f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ab}.{ab}"]:
        assert mnemonic in code.ptx, f"{name}: {mnemonic} missing from the PTX"
    res = code.resources[func.name]
    assert res.spill_stores == 0 and res.spill_loads == 0 and res.stack_bytes == 0, f"{name}: {res}"
    assert code.ptx.count("wgmma.mma_async") == args.get("k_steps", 1)


def test_descriptors_are_printed_from_the_matrix_descriptor() -> None:
    func = wgmma_kernel(128, "bf16", "64B", "32B", "MN")
    source = emit_source([func])
    for desc in (k_major("64B"), mn_major("32B", 128)):
        literal = f"0x{desc.constant_bits():016x}ULL + ((static_cast<unsigned long long>("
        assert literal in source, f"{desc}: {literal} missing"
    # A K-major (no transpose), B MN-major (transposed); scale-d from the statement
    assert re.search(r"scale_d, 1, 1, 0, 1;", source)
    assert "__shared__ __align__(1024) __nv_bfloat16 As[" in source
    assert "__shared__ __align__(1024) __nv_bfloat16 Bs[" in source
    # the accumulator is pinned after the wait, register by register
    assert source.count('asm volatile("" : "+f"(acc[') == 64


def test_a_wgmma_source_compiles_for_sm_90a_and_sm_80_refuses_it() -> None:
    # emit_source marks a source with wgmma; compile_cuda then targets the arch-specific sm_90a
    code = compile_cuda(emit_source([wgmma_kernel()]), arch="sm_90")
    assert code.arch == "sm_90a" and "wgmma.mma_async" in code.ptx
    with pytest.raises(CompileError):
        compile_cuda(emit_source([wgmma_kernel()]), arch="sm_80")


def test_setmaxnreg_compiles_for_sm_90a_in_a_warp_specialized_kernel() -> None:
    tid = Var("tid")
    out = Buffer("out", dt.int32, (256,))
    body = seq(IfThenElse(tid < 128, SetMaxRegisters(40, False), SetMaxRegisters(232, True)),
               BufferStore(out, (tid,), tid))
    func = PrimFunc("roles", (out,), For(tid, 0, 256, "threadIdx.x", body), attrs=(("min_blocks_per_sm", 1),))
    code = compile_cuda(emit_source([func]), arch="sm_90a")
    assert "setmaxnreg.dec.sync.aligned.u32 40" in code.ptx and "setmaxnreg.inc.sync.aligned.u32 232" in code.ptx


def test_several_mbarrier_waits_in_one_kernel_compile() -> None:
    # each wait's try_wait loop has its label inside its own { } scope
    tid = Var("tid")
    bars = Buffer("bar", dt.int64, (2,), "shared")
    out = Buffer("out", dt.int32, (128,))
    body = seq(IfThenElse(tid == 0, seq(BarrierInit(BarrierRef(bars, 0), 128), BarrierInit(BarrierRef(bars, 1), 128))),
               Barrier(),
               BarrierArrive(BarrierRef(bars, 0)), BarrierWait(BarrierRef(bars, 0), 0),
               BarrierArrive(BarrierRef(bars, 1)), BarrierWait(BarrierRef(bars, 1), 0),
               BufferStore(out, (tid,), tid))
    func = PrimFunc("two_waits", (out,), Allocate(bars, For(tid, 0, 128, "threadIdx.x", body)))
    code = compile_cuda(emit_source([func]), arch="sm_90")
    assert code.ptx.count("mbarrier.try_wait.parity.shared::cta.b64") == 2
    assert "mbarrier.arrive.shared::cta.b64" in code.ptx


GOLDEN = pathlib.Path(__file__).parent / "golden"


def test_golden_cuda_of_the_wgmma_mbarrier_bulk_copy_kernel() -> None:
    # update on purpose with TECC_UPDATE_GOLDEN=1 and review the diff
    path = GOLDEN / "wgmma_mbarrier_bulk_copy.cu"
    text = emit_source([wgmma_kernel(64, "f16", "128B", "128B", "MN", k_steps=2)])
    if os.environ.get("TECC_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert path.exists(), f"missing golden file {path}; run with TECC_UPDATE_GOLDEN=1 and review it"
    assert text == path.read_text(), f"generated CUDA changed; diff it against {path}"
