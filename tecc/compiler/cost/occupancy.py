"""Occupancy: how many blocks of a kernel one SM holds at once, and what limits it.

The formula of CUDA's occupancy calculator (`cuda_occupancy.h`, cudaOccupancyMaxActiveBlocksPerMultiprocessor):

  by threads    floor(max_warps_per_sm / warps_per_block)
  by blocks     max_blocks_per_sm
  by registers  registers are allocated per warp, rounded up to the allocation unit (256);
                an SM partition (1 of 4 schedulers) holds 65536/4 registers, warps are placed per
                partition, so the count is floor(regs_per_sm/4 / regs_per_warp) * 4 // warps_per_block
                (rounded to the warp allocation granularity)
  by shared     (smem_per_block + reserved per block) rounded up to 128 bytes, against the SM's
                shared memory (the carveout is assumed to be the maximum: the driver picks it for
                kernels that use shared memory)

The result is the minimum; `limiter` names which one it is.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...ir.target import Target


@dataclass(frozen=True)
class Occupancy:
    blocks_per_sm: int
    warps_per_sm: int
    limiter: str                 # threads | blocks | registers | shared memory | none (fits 0)
    by: tuple[tuple[str, int], ...]

    @property
    def fraction(self) -> float:
        return 0.0 if self.blocks_per_sm == 0 else self.warps_per_sm / 64.0

    def describe(self, target: Target) -> str:
        limits = ", ".join(f"{k} {v}" for k, v in self.by)
        return (f"{self.blocks_per_sm} block(s)/SM = {self.warps_per_sm}/{target.max_warps_per_sm} warps "
                f"({100.0 * self.warps_per_sm / target.max_warps_per_sm:.0f}%), limited by {self.limiter} [{limits}]")


def _round_up(x: int, unit: int) -> int:
    return -(-x // unit) * unit


def occupancy(target: Target, threads: int, registers: int, smem_bytes: int) -> Occupancy:
    """Blocks per SM for `threads` threads per block, `registers` per thread, `smem_bytes` of
    shared memory per block (static + dynamic)."""
    warps = -(-threads // target.warp_size)
    by: dict[str, int] = {}
    by["threads"] = target.max_warps_per_sm // warps if warps else 0
    by["blocks"] = target.max_blocks_per_sm
    regs_per_warp = _round_up(max(registers, 1) * target.warp_size, target.register_alloc_unit)
    # callers pass the count rounded to the allocation unit (8 per thread: 256 per warp), which
    # takes 249..255 registers, legal, to 256: the per-thread limit applies to the count before that
    per_thread_unit = max(1, target.register_alloc_unit // target.warp_size)
    if registers > _round_up(target.max_registers_per_thread, per_thread_unit):
        by["registers"] = 0
    else:
        per_partition = target.registers_per_sm // target.schedulers_per_sm
        warps_by_regs = (per_partition // regs_per_warp) * target.schedulers_per_sm
        warps_rounded = _round_up(warps, 1)
        by["registers"] = warps_by_regs // warps_rounded if warps_rounded else 0
    if smem_bytes > 0:
        per_block = _round_up(smem_bytes + target.smem_reserved_per_block, target.smem_alloc_unit)
        by["shared memory"] = target.smem_per_sm // per_block
    else:
        # the reserved 1 KiB per block still counts (it is what caps tiny blocks at 164-228/SM)
        by["shared memory"] = target.smem_per_sm // max(target.smem_reserved_per_block, 1)
    blocks = min(by.values())
    limiter = min(by, key=lambda k: (by[k], k != "threads"))
    return Occupancy(blocks, blocks * warps, limiter if blocks else f"{limiter} (does not fit)",
                     tuple(sorted(by.items())))


__all__ = ["Occupancy", "occupancy"]
