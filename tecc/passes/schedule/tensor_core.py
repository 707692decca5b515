"""The tensor-core primitive users call: `tensorize` sends a contraction stage to the kernel
builder of its instruction family. Each builder is one module; this one only chooses, so none of
them imports another's entry point (tensorize_wgmma builds on tensorize's emitter, the TMA ring on
tensorize_wgmma's):

  intrinsic "auto", an mma row (mma.sync m16n8k16, tf32 m16n8k8)   tensorize.py        tensorize_mma
  "wgmma" or a wgmma row, producer "threads" (cp.async ring)        tensorize_wgmma.py  tensorize_wgmma_threads
    ("wgmma.tf32" or a tf32 row for float32 operands)
  "wgmma" or a wgmma row, producer "tma" (mbarrier ring, optional   tensorize_wgmma_tma.py
    persistent grid)
"""

from __future__ import annotations

from ...ir.errors import ScheduleError
from ...ir.stmt import PrimFunc
from .tensorize import Tiling, tensorize_mma
from .tensorize_wgmma import PRODUCERS, checked_wgmma, tensorize_wgmma_threads
from .tensorize_wgmma_tma import tensorize_wgmma_tma


def tensorize(func: PrimFunc, stage: str, intrinsic: str, tiling: Tiling) -> PrimFunc:
    """`func` (the lowered kernel of `stage`) as a tensor-core kernel: mma.sync for "auto" and
    the mma rows, the Hopper warpgroup kernel (cp.async ring) for "wgmma" and its rows."""
    if intrinsic.startswith("wgmma"):
        return tensorize_wgmma(func, stage, intrinsic, tiling)
    return tensorize_mma(func, stage, intrinsic, tiling)


def tensorize_wgmma(func: PrimFunc, stage: str, intrinsic: str, tiling: Tiling,
                    lookahead: int | None = None, producer: str = "threads", release: bool = True,
                    persistent: int = 0, epilogue: str = "registers") -> PrimFunc:
    """`func` as a warpgroup (wgmma) kernel. `intrinsic`: "wgmma" (the row for the operands'
    dtype and BN) or that row's name. `producer`: "threads" (every thread issues cp.async into the
    ring: tensorize_wgmma.py) or "tma" (a producer warpgroup issues TMA tile copies into an
    mbarrier ring that consumer warpgroups drain: tensorize_wgmma_tma.py). `release` False drops
    the consumers' arrivals on that ring's empty barriers (only tests: the emulator must report
    the deadlock). `persistent` > 0 (producer "tma" only): that many blocks loop over the output
    tiles in a grouped order. `epilogue` (producer "tma" only): "registers" (fragments stored to
    global memory by every thread) or "tma" (through a swizzled shared staging tile and TMA
    stores, tensorize_wgmma_tma.py step 4). `lookahead` overrides the cp.async ring's tiles loaded ahead (tests)."""
    if producer not in PRODUCERS:
        raise ScheduleError(f"tensorize({stage}, wgmma): producer {producer!r} is not one of {PRODUCERS}")
    c, row = checked_wgmma(func, stage, intrinsic, tiling)
    if producer == "tma" and tiling.staged_output:
        raise ScheduleError(f"tensorize({stage}, wgmma): staged_output is built for the cp.async ring only (the TMA "
                            "ring's producer warpgroup takes no part in the epilogue's barrier)")
    if producer == "tma":
        return tensorize_wgmma_tma(func, stage, c, row, tiling, release, persistent, epilogue=epilogue)
    if persistent:
        raise ScheduleError(f"tensorize({stage}, wgmma): a persistent grid needs producer='tma'")
    if epilogue != "registers":
        raise ScheduleError(f"tensorize({stage}, wgmma): epilogue {epilogue!r} needs producer='tma'")
    return tensorize_wgmma_threads(func, c, row, tiling, lookahead)


__all__ = ["tensorize", "tensorize_wgmma"]
