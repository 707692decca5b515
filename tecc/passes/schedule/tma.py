"""TMA loads for the wgmma kernel, and the warp-specialized ring's protocol (the `pipeline(...,
producer="tma")` and `warp_specialize` primitives; the code is in ring.py and tensorize_wgmma.py).

1. loads       one TMA tile copy per operand and k tile (tecc/ir/tma_stmt.py): a K-major operand
               (A[b?, i, k], B[b?, j, k]) as one box of (rows, 64) into [S][rows][64]; an MN-major
               operand (A[b?, k, i], B[b?, k, j]) as rows/64 boxes of (64, 64), one per 64-column
               block of [S][rows/64][64][64]. tf32 (4-byte elements): boxes of 32 floats (128
               bytes) instead of 64 halves; a register-loaded X (tensorize_wgmma.py, "tf32") as
               rows/32 boxes of (32 k, 32) into [S][rows/32][32][32], which its fragment loads
               read through the same swizzle. The tensor map's 128B swizzle writes exactly the
               layout the descriptors read, and its zero fill is the M/N/K edge handling (no
               predicates). Only operands whose every index is a plain loop variable (a batch,
               the row/column, the k axis) qualify (`tma_refusal`): an implicit-GEMM gather keeps
               cp.async.
2. roles       (warp_specialize) BM/64 consumer warpgroups (warpgroup g computes rows 64g ..
               64g + 63, as before) and one more warpgroup, the producer, of which one thread
               issues every load. The block has 128 · (BM/64 + 1) threads. With two consumer
               warpgroups (384 threads, 168 registers each at launch) the producer gives
               registers back (setmaxnreg.dec 40) and the consumers take them (setmaxnreg.inc
               232): 128 · 40 + 256 · 232 = 384 · 168.
3. ring        S stages, barriers full[S] (count 1: the producer's expect-tx) and empty[S]
               (count 4 · BM/64: one arrival per consumer warp). Iteration kt, in two loops (one
               per role; a single loop whose body branches on the role made ptxas serialize the
               wgmmas and ignore setmaxnreg):

                 producer thread:  wait empty[kt % S] for parity (kt / S + 1) % 2
                                     (stage free: its previous tile's wgmmas completed; on a
                                      fresh barrier parity 1 counts as completed, so the first
                                      S waits return at once)
                                   expect_tx(full[kt % S], bytes of both tiles)
                                   TMA A and B tiles of k tile kt into stage kt % S
                 consumers:        wait full[kt % S] for parity (kt / S) % 2   (tile kt landed)
                                   wgmma.fence; BK/16 wgmmas; commit; wgmma.wait_group 1
                                   lane 0 of each warp: arrive empty[(kt - 1) % S]
                                     (tile kt - 1's wgmmas of this warp completed)

               TMA writes and wgmma reads are both async-proxy accesses ordered by the
               mbarriers, so no proxy fence sits in the loop; the barriers' initialization is
               made visible to the async proxy (fence.proxy.async) before the one __syncthreads.
               The producer runs up to S tiles ahead of the slowest consumer warpgroup.
4. epilogue    consumers: wgmma.wait_group 0, then the registers epilogue or, with
               `epilogue("tma")`, the staging tile and TMA stores (epilogue.py).
5. persistent  (`persistent(stage, P)`) P blocks instead of one per output tile: block b
               handles tiles b, b + P, b + 2P, ... in both roles, the ring's phases running on
               across tiles (k tile kt of the block's i-th tile is ring entry i · k_tiles + kt),
               so the producer loads the next tile's first stages while the consumers run this
               tile's epilogue. Tiles are numbered in a grouped order: group_m row tiles side by
               side sweep the column tiles together (then the next group), so the blocks running
               at one time share panels of A and B in L2 (tile_kernel.py, `for_each_tile`).

The emulator runs the roles as such (runtime/sim/roles.py): a forgotten release (no arrive on
`empty`) is reported as a deadlock.
"""

from __future__ import annotations

from ...ir.expr import Const, Var
from ...ir.tma_stmt import TMA_ALIGN
from .implicit_gemm import Contraction, Operand

MAX_PERSISTENT = 2**31 - 1


def tma_refusal(c: Contraction) -> str | None:
    """Why the contraction's operands cannot be loaded by TMA tile copies, or None when they can
    (module docstring, step 1): every index a plain loop variable, no where(), a contiguous
    innermost dimension, outer strides that are not known at compile time to miss TMA's
    16-byte alignment (run-time strides are checked when the tensor map is encoded), and two
    different buffers (one tensor map each)."""
    if c.a.buffer is c.b.buffer:
        return f"A and B are the same buffer {c.a.buffer.name} (one tensor map per buffer)"
    for op in (c.a, c.b):
        reason = _operand_refusal(c, op)
        if reason is not None:
            return f"operand {op.role} ({op.buffer.name}): {reason}"
    return None


def _operand_refusal(c: Contraction, op: Operand) -> str | None:
    if op.guard is not None:
        return "its read is under a where() (padding): TMA has no per-element predicate"
    outer = c.rows if op.role == "A" else c.cols
    if len(outer) != 1 or len(c.ks) != 1:
        return "its rows or its reduction are several axes (an implicit GEMM gathers them)"
    axes = {c.k: "k", outer[0][0]: "outer"}
    axes.update({v: "batch" for v, _ in c.batch})
    seen: set[Var] = set()
    for ix in op.load.indices:
        if not isinstance(ix, Var) or ix not in axes or ix in seen:
            return f"index {ix} is not a plain loop variable (TMA copies boxes of plain coordinates)"
        seen.add(ix)
    if c.k not in seen or outer[0][0] not in seen:
        return "it is not indexed by both its row/column axis and k"
    last = op.load.indices[-1]
    if last not in (c.k, outer[0][0]):
        return "its innermost dimension is a batch axis"
    strides = op.buffer.strides
    if strides is not None and len(strides) and str(strides[-1]) != "1":
        return f"its innermost stride is {strides[-1]}, TMA needs a contiguous innermost dimension"
    return _stride_refusal(op)


def _stride_refusal(op: Operand) -> str | None:
    """Why a stride of the operand known at compile time is not a multiple of TMA_ALIGN bytes
    (cuTensorMapEncodeTiled's rule), or None. A contiguous buffer's outer strides are multiples
    of its row, so its row decides."""
    buffer, size = op.buffer, op.buffer.dtype.bytes
    if buffer.strides is not None:
        for s in buffer.strides[:-1]:
            if isinstance(s, Const) and (int(s.value) * size) % TMA_ALIGN:
                return (f"its stride of {s} elements ({int(s.value) * size} bytes) is not a multiple of "
                        f"{TMA_ALIGN} bytes (TMA's stride alignment)")
        return None
    row = buffer.shape[-1] if len(buffer.shape) > 1 else None
    if isinstance(row, Const) and (int(row.value) * size) % TMA_ALIGN:
        return (f"its rows of {row} elements ({int(row.value) * size} bytes) are not a multiple of {TMA_ALIGN} "
                "bytes (TMA's stride alignment; pad the rows)")
    return None


__all__ = ["MAX_PERSISTENT", "tma_refusal"]
