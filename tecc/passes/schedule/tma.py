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
               predicates). The map has one dimension per batch axis, one for the rows (A) or
               columns (B) and one for k (`tma_dims`): each index a plain batch axis or the flat
               index of consecutive axes of one group (the rows, the columns, k; a plain loop
               variable is the one-axis case), a group's axes read in order by consecutive
               dimensions whose strides chain (stride[d] == extent[d + 1] · stride[d + 1]),
               which the map merges into one (TensorMap.merge). So a view x.view(B·T, C) of a
               contiguous [B, T, C] intermediate, which the GEMM reads as X[i // T, i % T, k]
               (two row axes after match_contraction's split), is a [B·T, C] map, its 128-row
               boxes crossing the T boundary as one box; likewise y[b·T + t, j] (one dimension,
               two axes). Anything else (`tma_refusal`) keeps cp.async: an implicit-GEMM gather
               (x[n, p + r, ..]: an index mixing groups), a strided or transposed merge
               (O[i // T, k // D, i % T, k % D]: a group's dimensions not consecutive), strides
               that do not chain or are kernel parameters.
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

from dataclasses import dataclass
from typing import Mapping, Sequence

from ...ir.expr import Const, Expr, Var, const_int, const_product, size_product
from ...ir.stmt import Buffer
from ...ir.tma_stmt import MAX_RANK, TMA_ALIGN
from ..simplify import linear_form
from .implicit_gemm import Axis, Contraction, Operand

MAX_PERSISTENT = 2**31 - 1


@dataclass(frozen=True)
class MapDim:
    """One dimension of a tensor map (`tma_dims`): `span` consecutive dimensions of the buffer
    (merged when more than one), indexed by `axis`, a group's name (its flat index) or a batch
    axis."""

    span: int
    axis: str | Var


def tma_dims(buffer: Buffer, indices: Sequence[Expr], groups: Mapping[str, Sequence[Axis]],
             batch: Sequence[Var]) -> tuple[MapDim, ...] | str:
    """The tensor map of `buffer` read (or written) at `indices` (module docstring, step 1): one
    dimension per batch axis, in place, and one per group of `groups` (name -> axes, outermost
    first), spanning the consecutive dimensions whose indices are the flat index of the group
    (each index Σ of consecutive axes a_s..a_t with coefficients Π of the extents after them in
    the run, the runs in order); or why there is none."""
    where: dict[Var, tuple[str, int]] = {v: (name, n) for name, axes in groups.items()
                                         for n, (v, _) in enumerate(axes)}
    runs: list[tuple[str | Var, int, int]] = []   # per dimension: (axis, first, last position)
    for ix in indices:
        if isinstance(ix, Var) and ix in batch:
            runs.append((ix, 0, 0))
            continue
        terms, const = linear_form(ix)
        terms = {t: k for t, k in terms.items() if k}
        if const or not terms or not all(isinstance(t, Var) and t in where for t in terms):
            return f"index {ix} is not a plain loop variable (TMA copies boxes of plain coordinates)"
        names = {where[t][0] for t in terms if isinstance(t, Var)}
        if len(names) > 1:
            return (f"index {ix} mixes axes of the {' and '.join(sorted(names))} groups (an implicit GEMM gathers "
                    "them)")
        (name,) = names
        axes = groups[name]
        at = sorted(where[t][1] for t in terms if isinstance(t, Var))
        if at != list(range(at[0], at[-1] + 1)):
            return f"index {ix} is not the flat index of consecutive {name} axes"
        step = 1
        for n in reversed(at):
            v, ext = axes[n]
            if terms.get(v) != step:
                return f"index {ix} is not the flat index of its {name} axes (coefficient of {v.name})"
            e = const_int(ext)
            if e is None and n != at[0]:
                return f"index {ix} merges axes of symbolic extent"
            step *= e or 1
        runs.append((name, at[0], at[-1]))
    dims: list[MapDim] = []
    for d, (axis, first, last) in enumerate(runs):
        if isinstance(axis, Var):
            dims.append(MapDim(1, axis))
            continue
        if d and runs[d - 1][0] == axis:
            if first != runs[d - 1][2] + 1:
                return f"its {axis} axes are not read in order by consecutive dimensions"
            reason = _chain_refusal(buffer, d - 1, groups[axis][first:last + 1])
            if reason is not None:
                return reason
            dims[-1] = MapDim(dims[-1].span + 1, axis)
            continue
        if first != 0:
            return f"its {axis} axes are not read in order by consecutive dimensions"
        dims.append(MapDim(1, axis))
    for name, axes in groups.items():
        spans = [d for d, (axis, _, _) in enumerate(runs) if axis == name]
        if not spans:
            return f"it is not indexed by its {name} axis"
        if any(runs[b][0] != name for b in range(spans[0], spans[-1] + 1)) or runs[spans[-1]][2] != len(axes) - 1:
            return f"its {name} axes are not read in order by consecutive dimensions"
    if len({d.axis for d in dims}) != len(dims):
        return "it uses one loop variable in two dimensions"
    if len(dims) > MAX_RANK:
        return f"its tensor map would have {len(dims)} dimensions (TMA takes at most {MAX_RANK})"
    return tuple(dims)


def _chain_refusal(buffer: Buffer, d: int, inner: Sequence[Axis]) -> str | None:
    """Why dimension d of `buffer` and the next, whose index runs over the axes `inner`, cannot
    be one dimension of a tensor map (their strides do not chain), or None."""
    run = const_product([e for _, e in inner])
    if run is None:
        return f"its dimensions {d} and {d + 1} are merged over axes of symbolic extent"
    size = const_int(buffer.shape[d + 1])
    if size != run:
        return (f"its dimension {d + 1} has {buffer.shape[d + 1]} elements, not the {run} its axes take: the merged "
                "rows are not one flat axis in memory")
    if buffer.strides is None:
        return None
    outer, inner_stride = const_int(buffer.strides[d]), const_int(buffer.strides[d + 1])
    if outer is None or inner_stride is None:
        return (f"its strides are kernel parameters, so dimensions {d} and {d + 1} are not known to chain "
                "(stride[d] == extent[d + 1] * stride[d + 1]) as one flat axis")
    if outer != size * inner_stride:
        return (f"its dimensions {d} and {d + 1} do not chain in memory: stride {outer} is not {size} x "
                f"{inner_stride} (a strided view; TMA boxes one flat axis)")
    return None


def operand_dims(c: Contraction, op: Operand) -> tuple[MapDim, ...] | str:
    """The operand's tensor-map dimensions (`tma_dims`): its batch axes, "outer" (the rows of A,
    the columns of B) and "k"."""
    outer = c.rows if op.role == "A" else c.cols
    return tma_dims(op.buffer, op.load.indices, {"outer": outer, "k": c.ks}, [v for v, _ in c.batch])


def tma_refusal(c: Contraction) -> str | None:
    """Why the contraction's operands cannot be loaded by TMA tile copies, or None when they can
    (module docstring, step 1): every index a batch axis or the flat index of a group's axes
    (`tma_dims`), no where(), a contiguous innermost dimension, outer strides that are not known
    at compile time to miss TMA's 16-byte alignment (run-time strides are checked when the
    tensor map is encoded), and two different buffers (one tensor map each)."""
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
    dims = operand_dims(c, op)
    if isinstance(dims, str):
        return dims
    if isinstance(dims[-1].axis, Var):
        return "its innermost dimension is a batch axis"
    reason = _k_extent_refusal(c, op, dims)
    if reason is not None:
        return reason
    strides = op.buffer.strides
    if strides is not None and len(strides) and str(strides[-1]) != "1":
        return f"its innermost stride is {strides[-1]}, TMA needs a contiguous innermost dimension"
    return _stride_refusal(op)


def _k_extent_refusal(c: Contraction, op: Operand, dims: Sequence[MapDim]) -> str | None:
    """Why the operand's k dimension may run past the reduction (a buffer wider than the sum
    takes, x[:, :K]), or None: the boxes of the last k tile would read its elements past K,
    which TMA's zero fill, the k edge's only handling, does not cover."""
    d, sizes = 0, op.buffer.shape[:0]
    for dim in dims:
        if dim.axis == "k":
            sizes = op.buffer.shape[d:d + dim.span]
            break
        d += dim.span
    have, want = size_product(list(sizes)), c.kext
    known, k = const_int(have), const_int(want)
    if (known is not None and known == k) or str(have) == str(want):
        return None
    return (f"its k dimension has {have} elements, the reduction {want}: the last k tile's box would read past the "
            "reduction (TMA's zero fill is the k edge's only handling)")


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


__all__ = ["MAX_PERSISTENT", "MapDim", "operand_dims", "tma_dims", "tma_refusal"]
