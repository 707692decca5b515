"""column_reduction: a reduction over a column or middle axis as a split reduction
(tecc.passes.split_reduce): consecutive threads on consecutive outputs (coalesced), the reduced
axis spread over the threads of a block and over blocks, combined in shared memory and, when
split over blocks, by a second small kernel.

Like row_fused this rewrites the whole program (it may make two kernels and a temporary), so it
is proposed over the program (`propose`) rather than through the per-kernel registry API; build
(plan="auto") asks it after row_fused and before the per-kernel planner.

Choice of the point (constants with the fact they rest on):
* THREADS_X = 32 outputs per block: one warp row reads one contiguous run of 32 elements (128 B
  for float32: one L2 line per warp load);
* THREADS_Y = 8 threads share an output (256-thread blocks: 8 per SM at full occupancy on
  sm_80/sm_90, 2048 threads per SM);
* splits S: enough blocks for WAVES full waves (blocks ≥ WAVES · SMs · 8), but each thread
  reduces at least MIN_ROWS rows, so the partials (S · outputs · 4 bytes) stay ≤ 1/MIN_ROWS ·
  1/THREADS_Y of the input's elements: under 1% extra traffic;
* UNROLL_BYTES = 32 bytes of rows in flight per thread (8 float32 or 16 bf16 loads: 64 KiB in
  flight per SM, ~2.5× what Little's law asks of an H200: 4.8 TB/s × ~650 ns / 132 SMs).
* outputs per thread V (16-bit sources only): one output per lane reads 32 × 2 = 64 bytes per
  warp instruction, which measured 63-67% of copy bandwidth for bf16 column sums of 4096/8192
  columns (H200, 2026-11-21), where float32 (128 bytes per warp) ran at 98-100% with the same
  blocks. V adjacent outputs per thread make each row read one V-wide load (32·V·2 bytes per
  warp). V is the widest of 16 bytes that divides the output's last extent and still fills
  WAVES waves with at most MAX_SPLITS blocks along the reduced axis (a longer combine is a
  serial chain of loads per output); none: V = 1, as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from ...ir.errors import ScheduleError
from ...ir.expr import const_int
from ...ir.tensor import Tensor
from ...passes.split_reduce import reduction_stage, uncoalesced_read
from ..plan import Plan, Step

THREADS_X = 32
THREADS_Y = 8
WAVES = 2
MIN_ROWS = 16
UNROLL_BYTES = 32
DEFAULT_SMS = 132            # an H100/H200 SXM when no Target is given
SM_THREADS = 2048
MAX_SPLITS = 64              # the combine kernel's serial chain of partials (64 measured at 83%)
VECTOR_BYTES = 16


@dataclass
class ColumnChoice:
    plan: Plan
    threads_x: int
    threads_y: int
    splits: int
    reason: str


def _wanted_blocks(sms: int) -> int:
    return WAVES * sms * (SM_THREADS // (THREADS_X * THREADS_Y))


def choose_outputs_per_thread(outputs: int | None, last: int | None, reduced: int | None, itemsize: int,
                              sms: int = DEFAULT_SMS) -> int:
    """Adjacent outputs per thread (see the module docstring): 1 for 32-bit sources."""
    if outputs is None or last is None or reduced is None or itemsize >= 4:
        return 1
    most = min(MAX_SPLITS, max(1, reduced // (THREADS_Y * MIN_ROWS)))
    v = min(8, VECTOR_BYTES // itemsize)
    while v > 1:
        if last % v == 0 and -(-outputs // (THREADS_X * v)) * most >= _wanted_blocks(sms):
            return v
        v //= 2
    return 1


def choose_splits(outputs: int | None, reduced: int | None, sms: int = DEFAULT_SMS, outputs_per_thread: int = 1) -> int:
    """Blocks along the reduced axis for `outputs` outputs reduced over `reduced` elements."""
    if outputs is None or reduced is None:
        return 1
    blocks_x = max(1, -(-outputs // (THREADS_X * outputs_per_thread)))
    wanted = _wanted_blocks(sms)
    most = max(1, reduced // (THREADS_Y * MIN_ROWS))
    if outputs_per_thread > 1:
        most = min(most, MAX_SPLITS)
    splits = max(1, min(-(-wanted // blocks_x), most))
    # a power of two divides power-of-two lengths, so the row guard goes (split_reduce)
    while reduced % (splits * THREADS_Y) and splits & (splits - 1):
        splits &= splits - 1
    return splits


def propose(tensors: Sequence[Tensor], target: Any = None) -> ColumnChoice | None:
    """The split-reduction plan for a one-reduction program whose reduced axis is not the
    unit-stride one (a column or middle-axis reduction), or None."""
    try:
        stage, red = reduction_stage(tensors)
        why = uncoalesced_read(tensors)
    except ScheduleError:
        return None
    if why is not None:
        return None
    outputs = 1
    for e in stage.shape:
        c = const_int(e)
        outputs = outputs * c if (c is not None and outputs is not None) else None  # type: ignore[operator]
    reduced = const_int(red.axes[0].extent)
    sms = getattr(target, "sm_count", None) or DEFAULT_SMS
    itemsize = max(1, min(t.dtype.bits // 8 for t in tensors if t.is_placeholder)) if any(
        t.is_placeholder for t in tensors) else 4
    vector = choose_outputs_per_thread(outputs, const_int(stage.shape[-1]), reduced, itemsize, sms)
    splits = choose_splits(outputs, reduced, sms, vector)
    unroll = max(1, UNROLL_BYTES // (itemsize * vector))
    args: dict[str, Any] = {"threads_x": THREADS_X, "threads_y": THREADS_Y, "splits": splits, "unroll": unroll}
    if vector > 1:
        args["outputs_per_thread"] = vector
    step = Step("split_reduce", args)
    reason = (f"reduction of {stage.name} over {red.axes[0].extent} elements along a non-contiguous axis: "
              f"{THREADS_X} x {vector} outputs x {THREADS_Y} threads per block, {splits} block(s) along the reduced "
              "axis" + (", combined by a second kernel" if splits > 1 else ""))
    plan = Plan((step,), "column_reduction", reason)
    return ColumnChoice(plan, THREADS_X, THREADS_Y, splits, reason)


__all__ = ["ColumnChoice", "choose_outputs_per_thread", "choose_splits", "propose"]
