"""What a fused epilogue costs a tensor-core GEMM's tile, on the consumers' serial path.

The consumer warps compute the epilogue of a tile (bias, activation, the conversion) between the
tile's last wgmma and the next tile's first: in the warp-specialized kernel the producer keeps
loading meanwhile, but the tensor pipe idles for as long as the consumers issue the epilogue. So
its arithmetic belongs in the per-tile chain, not only in the kernel's issue total (where a
throughput term of the whole kernel hides it behind the L2 or tensor time).

Per output tile of BM x BN elements on one SM (4 schedulers of 32 lanes, and the MUFU pipe's 16
lanes per clock: CUDA C++ Programming Guide, "Arithmetic Instructions"):

    cycles = BM * BN * max(E / 128, U / 16)

E: the epilogue's issued instructions per element beyond the accumulator's own conversion
(KernelInfo.epilogue_instructions; INSTRUCTION_COST, with a GELU rounded to 16 bits priced as the
cheap intrinsic approx_math will emit), U: its MUFU instructions (KernelInfo.epilogue_mufu). A
plain GEMM has E = U = 0 and pays nothing here. Latency between the instructions is assumed hidden
by the unrolled loop over the thread's BM * BN / threads elements (independent of each other).
An estimate, not fitted: the issue's H200 timings of gelu(x·Wᵀ + b) (0.73x and 0.83x of eager
PyTorch before the cheap GELU) are what it is meant to explain.
"""

from __future__ import annotations

from ..cost.analysis import KernelInfo

ISSUE_LANES_PER_CYCLE = 128.0   # 4 schedulers x 32 lanes per SM
MUFU_LANES_PER_CYCLE = 16.0     # sm_80 / sm_90


def epilogue_math_cycles(info: KernelInfo, bm: int, bn: int) -> float:
    """Cycles one output tile's fused epilogue keeps an SM's consumers from the next tile."""
    return bm * bn * max(info.epilogue_instructions / ISSUE_LANES_PER_CYCLE,
                         info.epilogue_mufu / MUFU_LANES_PER_CYCLE)


def epilogue_math_note(info: KernelInfo, bm: int, bn: int) -> str | None:
    """The explain() line of `epilogue_math_cycles` (None for a plain GEMM)."""
    cycles = epilogue_math_cycles(info, bm, bn)
    if cycles <= 0:
        return None
    return (f"fused epilogue: {info.epilogue_instructions:.0f} instructions + {info.epilogue_mufu:.0f} MUFU per "
            f"element, {cycles:.0f} cycles per {bm}x{bn} tile on the consumers between two tiles' k loops")


__all__ = ["epilogue_math_cycles", "epilogue_math_note"]
