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

from ...ir.target import Target
from ..cost.analysis import KernelInfo
from ..cost.model import DEFAULT_PARAMETERS

ISSUE_LANES_PER_CYCLE = 128.0   # 4 schedulers x 32 lanes per SM
MUFU_LANES_PER_CYCLE = 16.0     # sm_80 / sm_90
# a second kernel's launch: the cost model's launch term
UNFUSED_LAUNCH_SECONDS = DEFAULT_PARAMETERS.launch_s


def epilogue_math_cycles(info: KernelInfo, bm: int, bn: int) -> float:
    """Cycles one output tile's fused epilogue keeps an SM's consumers from the next tile."""
    return bm * bn * max(info.epilogue_instructions / ISSUE_LANES_PER_CYCLE,
                         info.epilogue_mufu / MUFU_LANES_PER_CYCLE)


def epilogue_math_note(info: KernelInfo, bm: int, bn: int, target: Target, rounds: int) -> str | None:
    """The explain() line of `epilogue_math_cycles` (None for a plain GEMM): the cycles per tile,
    what they add over the busiest SM's `rounds` tiles, and what the same epilogue would cost as
    a kernel of its own instead -- the output written and read once more through DRAM and a
    launch (UNFUSED_LAUNCH_SECONDS) --, so the reader sees why fusion pays or does not."""
    cycles = epilogue_math_cycles(info, bm, bn)
    if cycles <= 0:
        return None
    fused = rounds * cycles / target.clock_hz
    out_bytes = float(info.outputs * info.write.itemsize)
    unfused = 2.0 * out_bytes / max(target.dram_bandwidth, 1.0) + UNFUSED_LAUNCH_SECONDS
    verdict = "fusion pays" if fused < unfused else "a separate elementwise kernel would be cheaper (not planned)"
    return (f"fused epilogue: {info.epilogue_instructions:.0f} instructions + {info.epilogue_mufu:.0f} MUFU per "
            f"element, {cycles:.0f} cycles per {bm}x{bn} tile on the consumers between two tiles' k loops: "
            f"{fused * 1e6:.1f} us over {rounds} tiles per SM, against {unfused * 1e6:.1f} us for the output's "
            f"DRAM round trip and launch of an unfused epilogue ({verdict})")


__all__ = ["epilogue_math_cycles", "epilogue_math_note"]
