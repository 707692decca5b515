"""The tensor-core primitives applied in the order the GEMM strategies apply them, for tests whose
subject is the kernel rather than the primitives (tests/test_tensor_core_primitives.py tests the
primitives one by one): on a Schedule (`schedule_tensor_core`) or as passes on a lowered kernel
(`tensorized`, with the passes' test-only knobs)."""

from __future__ import annotations

from typing import Any, Sequence

from tecc.ir.stmt import PrimFunc
from tecc.passes.schedule import tensor_core


def schedule_tensor_core(sch: Any, stage: str = "C", intrinsic: str = "auto", block: Sequence[int] = (64, 64),
                         warps: Sequence[int] = (2, 2), k_tile: int = 32, stages: int = 2, *,
                         producer: str = "cp.async", persistent: int = 0, epilogue: str = "registers",
                         staged_output: bool = False, fragment_pipeline: bool = False, group_m: int = 0,
                         splits: int = 1) -> Any:
    """tensorize, both operands staged, a ring of `stages` by `producer` (warp-specialized for
    "tma"), then the optional steps (split_k when `splits` > 1); returns the Schedule."""
    k_tiles = sch.tensorize(stage, intrinsic, block=block, warps=warps, k_tile=k_tile)
    for operand in sch.gemm_operands(stage):
        sch.stage_operand(stage, operand)
    sch.pipeline(k_tiles, stages=stages, producer=producer)
    if fragment_pipeline:
        sch.pipeline_fragments(k_tiles)
    if producer == "tma":
        sch.warp_specialize(stage)
    if splits > 1:
        sch.split_k(stage, splits)
    if group_m:
        sch.tile_order(stage, group_m)
    if persistent:
        sch.persistent(stage, persistent)
    if staged_output:
        sch.epilogue(stage, "staged")
    if epilogue != "registers":
        sch.epilogue(stage, epilogue)
    return sch


def tensorized(func: PrimFunc, stage: str, intrinsic: str, block: Sequence[int], warps: Sequence[int], k_tile: int,
               stages: int, *, producer: str = "cp.async", persistent: int = 0, epilogue: str = "registers",
               lookahead: int | None = None, release: bool = True) -> PrimFunc:
    """The lowered kernel `func` through the tensor-core passes, as `schedule_tensor_core` orders
    them; `lookahead` and `release` are the passes' test-only knobs (a wgmma ring loading too far
    ahead; a warp-specialized ring without its releases)."""
    func = tensor_core.tensorize(func, stage, intrinsic, block, warps, k_tile)
    for operand in tensor_core.gemm_operands(func, stage):
        func = tensor_core.stage_operand(func, stage, operand)
    func = tensor_core.pipeline(func, tensor_core.K_TILE_LOOP, stages, producer, lookahead)
    if producer == "tma":
        func = tensor_core.warp_specialize(func, stage, release)
    if persistent:
        func = tensor_core.persistent(func, stage, persistent)
    if epilogue != "registers":
        func = tensor_core.epilogue(func, stage, epilogue)
    return func
