"""The tensor-core primitives: each a pass over one kernel with its own legality check and dump.

A tensor-core kernel is built by a short list of these, applied to the stage's kernel as
lowered (the GEMM strategies' `apply` is such a list):

  tensorize(stage, intrinsic, block, warps, k_tile)  the block tile mapped onto a row of the
        intrinsic table (mma.sync or wgmma): warps/warpgroups, accumulator fragments, the
        fragment loads and mma of each k step (tensorize.py, tensorize_wgmma.py). Alone it gives
        the simplest kernel that runs: each operand tile copied element by element into a plain
        shared buffer before each k tile, one block per output tile, the registers epilogue.
  stage_operand(stage, tensor, layout)   the operand's tile staged with cp.async copies in the
        layout its reads are conflict-free under ("swizzle"; "none": plain) (tile_staging.py)
  pipeline(k_tile, stages, producer)     the k-tile loop as a ring of `stages` buffers filled
        ahead of the compute: "cp.async" commit groups, or "tma" box copies completing on
        mbarriers (ring.py)
  pipeline_fragments(k_tile)             mma.sync: the next k step's fragments loaded during this
        step's mma, across the k-tile boundary (ring.py)
  warp_specialize(stage)                 the TMA ring split into a producer warpgroup and consumer
        warpgroups, with register reallocation (ring.py, tma.py)
  split_k(stage, splits)                 the k tiles of each output tile divided among `splits`
        blocks, their float32 partials summed in split order by the last to finish (split_k.py)
  tile_order(stage, group_m)             mma.sync: one blockIdx.x over the output tiles in the
        grouped (L2-friendly) order (tile_kernel.py)
  persistent(stage, blocks, group_m)     warp-specialized: `blocks` blocks loop over the output
        tiles in the grouped order, the ring running on across tiles (tile_kernel.py)
  epilogue(stage, kind)                  the fused tail: "registers", "staged" through shared
        memory, or "tma" stores from a swizzled staging tile (epilogue.py)

Each primitive checks its own request and the whole schedule it leaves (`check`), records it in
the kernel's TileSchedule (attr "tensor_core"; dumps print it) and emits the kernel from the
record again, so a primitive's dump is the kernel it leaves. The record holds the lowered
kernel, so the steps must follow tensorize before any other primitive of the kernel
(compiler/schedule.py drops the record when another primitive rewrites the kernel), and it is
dropped before codegen (`drop_records`).
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import replace
from typing import Iterable, Sequence

from ...ir.errors import ScheduleError
from ...ir.intrinsics import lookup
from ...ir.stmt import Module, PrimFunc
from .implicit_gemm import Operand
from .tensorize import MmaKernel, checked_mma
from .tensorize_wgmma import WgmmaKernel, checked_wgmma
from .split_k import check_splits, split_buffers
from .tile_kernel import EPILOGUES, GROUP_M, LAYOUTS, PRODUCERS, BlockTile, TileSchedule
from .tma import MAX_PERSISTENT, tma_refusal

RECORD = "tensor_core"
K_TILE_LOOP = "k_tile"
MAX_STAGES = 8   # cp.async.wait_group takes 0..7


def record_of(func: PrimFunc, where: str) -> TileSchedule:
    """The kernel's TileSchedule, or a ScheduleError saying to tensorize first."""
    record = func.attr(RECORD)
    if not isinstance(record, TileSchedule):
        raise ScheduleError(f"{where}: kernel {func.name} is not a tensorized kernel; apply tensorize to its stage "
                            "first (the tensor-core primitives follow tensorize before any other primitive of the "
                            "kernel)")
    return record


# Set while a Schedule defers the emission of its tensor-core kernels (Schedule.deferring: a
# twin's realized point, whose every step emitted for its twin): `emit` then gives the lowered
# kernel carrying the record, which is all the next primitive reads; the Schedule emits the
# last record once.
DEFER: ContextVar[bool] = ContextVar("tecc_defer_tensor_core_emission", default=False)


def emit(record: TileSchedule) -> PrimFunc:
    """The kernel of a TileSchedule, carrying the record (under DEFER: the lowered kernel
    carrying it, to be emitted later)."""
    if DEFER.get():
        src = record.source
        return PrimFunc(src.name, src.params, src.body, src.attrs + ((RECORD, record),))
    builder = WgmmaKernel if record.row.startswith("wgmma") else MmaKernel
    func = builder(record).kernel()
    return PrimFunc(func.name, func.params, func.body, func.attrs + ((RECORD, record),))


def forget_record(func: PrimFunc) -> PrimFunc:
    """The kernel without its TileSchedule (another primitive rewrote it)."""
    if func.attr(RECORD) is None:
        return func
    return PrimFunc(func.name, func.params, func.body, tuple((k, v) for k, v in func.attrs if k != RECORD))


def drop_records(module: Module) -> Module:
    """The module with every kernel's TileSchedule dropped (before codegen and serialization)."""
    kernels = [forget_record(k) for k in module.kernels]
    if all(a is b for a, b in zip(kernels, module.kernels)):
        return module
    return module.with_kernels(kernels)


def gemm_operands(func: PrimFunc, stage: str) -> tuple[str, ...]:
    """The tensors the tensorized stage reads as A (rows) and B (columns): two, or one when
    it multiplies a tensor by itself (A·Aᵀ)."""
    record = record_of(func, f"gemm_operands({stage})")
    c = record.contraction
    names = [op.buffer.tensor or op.buffer.name for op in (c.a, c.b)]
    return tuple(dict.fromkeys(names))


# ---- the whole schedule's consistency ----------------------------------------------------------

def wgmma(record: TileSchedule) -> bool:
    return record.row.startswith("wgmma")


def check(record: TileSchedule, where: str) -> TileSchedule:
    """`record` when the primitives' choices fit together, else a ScheduleError from `where`."""
    c = record.contraction
    if record.stages > 1 and record.producer == "tma":
        if not wgmma(record):
            raise ScheduleError(f"{where}: TMA loads are built for the wgmma kernels (intrinsic='wgmma'); "
                                "the mma.sync kernel takes producer='cp.async'")
        missing = [op.buffer.name for op in (c.a, c.b) if record.layout(op.role) is None]
        if missing:
            raise ScheduleError(f"{where}: a TMA ring loads staged tiles; stage {' and '.join(missing)} first "
                                "(stage_operand)")
        reason = tma_refusal(c)
        if reason is not None:
            raise ScheduleError(f"{where}: TMA cannot load the operands: {reason}; use producer='cp.async'")
    if record.fragment_pipeline:
        if wgmma(record):
            raise ScheduleError(f"{where}: pipeline_fragments is a form of the mma.sync mainloop (wgmma reads its "
                                "operands from shared memory)")
        if record.stages < 2:
            raise ScheduleError(f"{where}: pipeline_fragments needs the cp.async ring: apply pipeline first")
        steps = record.bk // lookup(record.row).shape[2]
        if steps % 2:
            raise ScheduleError(f"{where}: pipeline_fragments alternates two fragment sets over the k steps of a "
                                f"tile, so it needs an even number of them; k_tile {record.bk} has {steps}: use a "
                                "k_tile of twice the mma's k")
    if record.warp_specialized and not (record.stages > 1 and record.producer == "tma"):
        raise ScheduleError(f"{where}: warp specialization splits a TMA ring into producer and consumer "
                            "warpgroups: apply pipeline(..., producer='tma') first")
    if record.persistent:
        if not record.warp_specialized:
            raise ScheduleError(f"{where}: a persistent grid is built for the warp-specialized TMA ring: apply "
                                "warp_specialize first")
        if record.persistent > MAX_PERSISTENT or record.group_m < 1:
            raise ScheduleError(f"{where}: persistent must be 1..{MAX_PERSISTENT} blocks and group_m positive, got "
                                f"{record.persistent} and {record.group_m}")
    elif record.group_m and wgmma(record):
        raise ScheduleError(f"{where}: tile_order orders the blocks of the mma.sync kernel; the wgmma kernels "
                            "order their tiles in the persistent grid (persistent)")
    if record.epilogue == "staged" and record.producer == "tma" and record.stages > 1:
        raise ScheduleError(f"{where}: the staged epilogue is built for the cp.async ring only (the TMA ring's "
                            "producer warpgroup takes no part in the epilogue's barrier); use epilogue 'tma'")
    if record.epilogue in ("tma", "threads") and not record.warp_specialized:
        what = "TMA-store" if record.epilogue == "tma" else "threads' staged"
        raise ScheduleError(f"{where}: the {what} epilogue is built for the warp-specialized TMA ring: apply "
                            "pipeline(..., producer='tma') and warp_specialize first")
    return record


# ---- the primitives ----------------------------------------------------------------------------------

def tensorize(func: PrimFunc, stage: str, intrinsic: str = "auto", block: Sequence[int] = (64, 64),
              warps: Sequence[int] = (2, 2), k_tile: int = 32) -> PrimFunc:
    """`func` (the lowered kernel of the contraction `stage`) with its block tile of `block` =
    (BM, BN) outputs mapped onto the intrinsic row: `warps` = (rows, columns) of warps, each a
    (BM/rows) × (BN/columns) tile of mma.sync tiles, or for "wgmma" BM/64 warpgroups,
    `warps` = (4·BM/64, 1); k tiles of `k_tile`. `intrinsic`: "auto" (the mma row of the
    operands' dtype), an mma row, "wgmma" or "wgmma.tf32" (the row for the operands and BN), or
    a wgmma row."""
    bm, bn = (int(x) for x in block)
    wm, wn = (int(x) for x in warps)
    tile = BlockTile(bm, bn, wm, wn, int(k_tile))
    if intrinsic.startswith("wgmma"):
        c, row = checked_wgmma(func, stage, intrinsic, tile)
    else:
        c, row = checked_mma(func, stage, intrinsic, tile)
    return emit(check(TileSchedule(func, stage, row, c, bm, bn, wm, wn, int(k_tile)), f"tensorize({stage})"))


def operands_of(record: TileSchedule, tensor: str, where: str) -> list[Operand]:
    """The operands of the tensorized contraction that read `tensor` (both for A·Aᵀ)."""
    c = record.contraction
    found = [op for op in (c.a, c.b) if tensor in (op.buffer.tensor, op.buffer.name)]
    if not found:
        raise ScheduleError(f"{where}: {tensor!r} is not an operand of the contraction; its operands are "
                            f"{c.a.buffer.name} (A) and {c.b.buffer.name} (B)")
    return found


def stage_operand(func: PrimFunc, stage: str, tensor: str, layout: str = "swizzle") -> PrimFunc:
    """The tile of operand `tensor` (both tiles of a tensor multiplied by itself) staged in
    shared memory by cp.async copies (where its addresses allow them) in `layout`: "swizzle" (the
    XOR swizzle its reads are conflict-free under) or "none" (a plain tile; mma.sync only:
    wgmma's descriptors read the 128-byte swizzle)."""
    where = f"stage_operand({stage}, {tensor})"
    record = record_of(func, where)
    ops = operands_of(record, tensor, where)
    if layout not in LAYOUTS:
        raise ScheduleError(f"{where}: layout {layout!r} is not one of {LAYOUTS}")
    if wgmma(record) and layout != "swizzle":
        raise ScheduleError(f"{where}: wgmma reads its shared operands through descriptors of the 128-byte swizzle; "
                            "use layout='swizzle'")
    if any(record.layout(op.role) is not None for op in ops):
        raise ScheduleError(f"{where}: {tensor} is staged already")
    return emit(check(replace(record, layouts=record.layouts + tuple((op.role, layout) for op in ops)), where))


def k_tile_record(func: PrimFunc, loop: str, where: str) -> TileSchedule:
    record = record_of(func, where)
    if loop != K_TILE_LOOP:
        raise ScheduleError(f"{where}: {loop!r} is not the k-tile loop of the tensorized stage ({K_TILE_LOOP!r})")
    return record


def pipeline(func: PrimFunc, loop: str, stages: int, producer: str = "cp.async",
             lookahead: int | None = None) -> PrimFunc:
    """The k-tile loop `loop` as a ring of `stages` shared buffers filled ahead of the compute by
    `producer`: "cp.async" (every thread's copies, one commit group per tile) or "tma" (box
    copies completing on an mbarrier per stage; wgmma, both operands staged). `lookahead`
    (tests only) overrides the wgmma cp.async ring's tiles loaded ahead."""
    where = f"pipeline({loop}, {stages}, {producer!r})"
    record = k_tile_record(func, loop, where)
    if record.stages > 1:
        raise ScheduleError(f"{where}: the k-tile loop is pipelined already ({record.stages} stages)")
    if not isinstance(stages, int) or not 2 <= stages <= MAX_STAGES:
        raise ScheduleError(f"{where}: stages must be 2..{MAX_STAGES} (cp.async.wait_group takes 0..7), got {stages}")
    if producer not in PRODUCERS:
        raise ScheduleError(f"{where}: producer {producer!r} is not one of {PRODUCERS}")
    if lookahead is not None and not wgmma(record):
        raise ScheduleError(f"{where}: lookahead is a knob of the wgmma ring")
    return emit(check(replace(record, stages=stages, producer=producer, lookahead=lookahead), where))


def pipeline_fragments(func: PrimFunc, loop: str) -> PrimFunc:
    """mma.sync: two fragment sets, the next k step's ldmatrix issued before this step's mma and
    across the k-tile boundary, the ring's wait and barrier before the last k step of each tile
    (ring.py; an even number of k steps per tile)."""
    where = f"pipeline_fragments({loop})"
    record = k_tile_record(func, loop, where)
    return emit(check(replace(record, fragment_pipeline=True), where))


def warp_specialize(func: PrimFunc, stage: str, release: bool = True) -> PrimFunc:
    """The TMA ring's loads moved to a producer warpgroup, the wgmmas to consumer warpgroups that
    release each stage through an mbarrier (tma.py); registers reallocated with two consumer
    warpgroups. `release` False (tests only) drops the releases: the emulator must report the
    deadlock."""
    where = f"warp_specialize({stage})"
    record = record_of(func, where)
    if record.warp_specialized:
        raise ScheduleError(f"{where}: the kernel is warp-specialized already")
    return emit(check(replace(record, warp_specialized=True, release=release), where))


def split_k(func: PrimFunc, stage: str, splits: int, taken: Iterable[str] = ()) -> PrimFunc:
    """The k tiles of each output tile divided among `splits` blocks, whose float32 partial
    tiles the last of them to finish sums in split order before the epilogue (split_k.py). The
    kernel gains two global temporaries (the partial tiles, the arrival counters; named apart
    from the kernel's parameters and `taken`), which the module must list (Schedule.split_k)."""
    where = f"split_k({stage}, {splits})"
    record = record_of(func, where)
    check_splits(record, splits, where)
    names = {p.name for p in func.params} | set(taken)
    buffers = split_buffers(record, splits, lambda name: name in names)
    return emit(check(replace(record, splits=splits, split_buffers=buffers), where))


def tile_order(func: PrimFunc, stage: str, group_m: int) -> PrimFunc:
    """mma.sync: one blockIdx.x over the output tiles, `group_m` row tiles side by side sweeping
    the column tiles together (L2 reuse; tile_kernel.grouped_tile)."""
    where = f"tile_order({stage}, {group_m})"
    record = record_of(func, where)
    if not isinstance(group_m, int) or group_m < 1:
        raise ScheduleError(f"{where}: group_m must be the row tiles per group (a positive integer), got {group_m!r}")
    return emit(check(replace(record, group_m=group_m), where))


def persistent(func: PrimFunc, stage: str, blocks: int, group_m: int = GROUP_M) -> PrimFunc:
    """`blocks` blocks loop over the output tiles in the grouped order of `group_m` row tiles
    (tma.py, step 5), the ring's phases running on across tiles."""
    where = f"persistent({stage}, {blocks})"
    record = record_of(func, where)
    if not isinstance(blocks, int) or blocks < 1:
        raise ScheduleError(f"{where}: blocks must be a positive integer (one per SM: the device's SM count), "
                            f"got {blocks!r}")
    return emit(check(replace(record, persistent=blocks, group_m=int(group_m)), where))


def epilogue(func: PrimFunc, stage: str, kind: str) -> PrimFunc:
    """The fused tail: "registers" (each thread stores its accumulator elements), "staged" (the
    block's outputs through a padded shared tile, copied out in 16-byte chunks), "tma" (a
    swizzled staging tile written out by TMA stores; the warp-specialized kernel) or "threads"
    (that staging tile written out by the consumer threads' element stores, for an output TMA
    cannot store: rows not a multiple of 16 bytes)."""
    where = f"epilogue({stage}, {kind!r})"
    record = record_of(func, where)
    if kind not in EPILOGUES:
        raise ScheduleError(f"{where}: the epilogue is one of {EPILOGUES}")
    return emit(check(replace(record, epilogue=kind), where))


__all__ = ["DEFER", "K_TILE_LOOP", "RECORD", "drop_records", "epilogue", "forget_record", "gemm_operands", "persistent",
           "pipeline", "pipeline_fragments", "record_of", "split_k", "stage_operand", "tensorize", "tile_order",
           "warp_specialize"]
