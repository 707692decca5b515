"""Schedule primitives: passes over one kernel of the loop IR, each checking its preconditions.

Each primitive is a pure function PrimFunc → PrimFunc that raises ScheduleError naming the
precondition that failed. Loops are named by their variable (unique inside a kernel), stages by
their tensor name ("C", "A.shared", "C.local"). `tecc.compiler.schedule.Schedule` is the user
interface that records every application in a Plan.

  split        split.py        one loop into nested tiles (guards where not provably divisible)
  reorder      reorder.py      permute nested loops (distributing reduction statements)
  fuse         fuse.py         two adjacent loops into one
  bind / unroll / vectorize    loop_kind.py
  stage_read   cache_read.py   cache_read + compute_at: stage a tensor's tile in shared/local memory
  cache_write  cache_write.py  the per-thread output tile in local memory
  insert_barriers  barriers.py __syncthreads() where shared memory changes hands
  double_buffer  double_buffer.py  prefetch the next k-tile's copies into registers (software pipeline)
  guard_writeback_only  guard_writeback.py  a register tile's split guards only on its write-back
  unguard_reduction_tail  reduction_tail.py  the k-tail guard off the accumulation where both shared tiles are zero past K
  rfactor      rfactor.py      a reduction loop made a parallel axis, partials combined by a second kernel (split-K)
  flatten_contraction / gather_views  gemm_view.py  a float32 contraction (a convolution) over view buffers
               A_view[m, k], B_view[k, n] for the SIMT GEMM schedule, and the views replaced by gathered reads after it
  tensorize, stage_operand, pipeline, pipeline_fragments, warp_specialize, split_k, tile_order, persistent, epilogue
               tensor_core.py  the tensor-core primitives: a contraction's block tile mapped onto an intrinsic row
               (tensorize.py: mma.sync, tensorize_wgmma.py: wgmma), its operand tiles staged in shared memory
               (tile_staging.py), its k-tile loop a cp.async or TMA ring, warp-specialized (ring.py, tma.py), its
               k tiles split among blocks (split_k.py), its tile order (tile_kernel.py) and its fused tail (epilogue.py)
  legality     legality.py     dependence checks with islpy (tecc.ir.poly)
"""

from .barriers import insert_barriers
from .cache_read import stage_read
from .cache_write import cache_write
from .double_buffer import double_buffer
from .fuse import fuse
from .gemm_view import flatten_contraction, gather_views
from .guard_writeback import guard_writeback_only
from .loop_kind import bind, unroll, vectorize
from .loops import stage_leaves, stage_loops
from .reduction_tail import unguard_reduction_tail
from .reorder import distribute, reorder
from .rfactor import rfactor
from .split import split
from .tensor_core import (
    drop_records,
    epilogue,
    forget_record,
    gemm_operands,
    persistent,
    pipeline,
    pipeline_fragments,
    split_k,
    stage_operand,
    tensorize,
    tile_order,
    warp_specialize,
)

__all__ = ["bind", "cache_write", "distribute", "double_buffer", "drop_records", "epilogue", "flatten_contraction",
           "forget_record", "fuse", "gather_views", "gemm_operands", "guard_writeback_only", "insert_barriers",
           "persistent", "pipeline", "pipeline_fragments", "reorder", "rfactor", "split", "stage_leaves",
           "split_k", "stage_loops", "stage_operand", "stage_read", "tensorize", "tile_order", "unguard_reduction_tail", "unroll",
           "vectorize", "warp_specialize"]
