"""gemm_implicit: float32 contractions that are GEMMs only as a view (convolutions) on the SGEMM kernel.

`gemm` and `gemm_pipelined` want one row, one column and one reduction axis read as A[i, k],
B[k, j]. A float32 convolution is a GEMM over groups of axes (M = n·p·q, N = f, K = c·r·s,
tecc/passes/schedule/implicit_gemm.py) whose activation tile is a gather. Rather than a second
SIMT kernel with its own loaders, this strategy brackets gemm_pipelined's schedule:

  flatten_contraction   the stage over loops (b,) m, n, k reading view buffers A_view[m, k],
                        B_view[k, n] and storing C_view[m, n] (gemm_view.py: the views are index
                        maps onto the real tensors, built from implicit_gemm's match and unflatten)
  schedule_tiles        gemm_pipelined's schedule, step for step: 8 x 8 thread tiles in 4 x 4
                        quadrants, shared A and B tiles filled by the cooperative copy (the A_view
                        tile is an im2col tile that exists only in shared memory), zero fill past
                        M, N, K, register double buffer, unrolled k step
  gather_views          each view read becomes `select(pred, X[unflattened indices], 0)` in the
                        copy (pred: the `where` padding condition), the C_view store the store to Y

So the loads are gathered and predicated, and nothing is materialized. A tile is copied in
float4 chunks (vector_copy 4) where the view's contiguous group ends in an axis that
implicit_gemm.contiguous_copy proves a run of 4-aligned chunks of the operand (NHWC activations
with C % 4 == 0 along k: the channel; RSCF filters with F % 4 == 0 along n): gather_views then
reads each chunk as one 16-byte load at its first element's indices, under its first element's
predicate. Elsewhere (NCHW activations) the copies are element by element.
Split-K (point "split", where the output has fewer than 2 x SMs tiles: the 7x7 and 14x14 ResNet
layers) is gemm_pipelined's: `split` + `rfactor` of the flattened k loop onto blockIdx.z, a
combine kernel that sums the partials and stores C_view, which gather_views also turns into the
store to the output. Symbolic sizes stay with the plain strategies; plain GEMMs (one row, one
column and one reduction axis) are declined here, so their plans and code are unchanged.

Workload: gemm_pipelined's for the M × N × K GEMM (the operands' real sizes for DRAM), plus the
gather (a div/mod pair per grouped axis and copied element, element instead of float4 copies),
with the registers ptxas allocates per tile (IMPLICIT_PTXAS_REGISTERS).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Iterable

from ...ir.target import Target
from ..cost.analysis import Access, Affine, KernelInfo
from ..cost.model import Workload
from ...passes.schedule.implicit_gemm import Layout, contiguous_copy, gemm_order, layout_of
from .gemm_pipelined import GemmPipelined, schedule_tiles, split_chunk
from .gemm_tensor_core import GemmView, gemm_view
from .registry import Point, Strategy, register

GATHER_INSTRUCTIONS = 4.0  # per grouped axis of a gathered element: the div/mod pair by a constant
# per thread and k-tile, whatever the k-tile's size: the gathered copy's work that the per-element
# count above misses (the reduction index decomposed for the tile, the padding predicates of the
# thread's rows, the barrier pair and the loop around the copy). Without it the model put k-tile 8
# within 1% of k-tile 16 while the H200 timed k-tile 8 10-25% slower on the ResNet-50 float32
# layers, and split-K parts of few k-tiles (split 8-16 at k-tile 8) 20-50% slower. Fitted on the
# ten float32 layers of benchmarks/results/planner_regret_h200_s25.json by the ranking of their
# measured candidates: any value in 80..256 ranks them alike (leave-one-layer-out: the same picks),
# 0..72 leaves the 14x14 and 56x56 1x1 layers picking 20-50% slow points (docs/cost-model.md,
# "Planner regret").
KTILE_GATHER_INSTRUCTIONS = 96.0
# Registers per thread as ptxas (NVRTC 12, sm_90) allocates them per (BM, BN, BK): the median over
# the ten ResNet-50 float32 layers of benchmarks/conv.py (NHWC, batch 32; 1x1 and 3x3 within 1-11
# of each other on most points). The gathered addresses keep the row part of every copy live
# across the k loop, so k-tile 16 (twice the copies) costs 20-35 more than gemm_pipelined's
# PTXAS_REGISTERS, and k-tile 8 about the same.
IMPLICIT_PTXAS_REGISTERS = {
    (32, 64, 8): 136, (32, 64, 16): 166, (32, 128, 8): 127, (32, 128, 16): 161,
    (64, 32, 8): 157, (64, 32, 16): 168, (64, 64, 8): 128, (64, 64, 16): 161,
    (64, 128, 8): 127, (64, 128, 16): 141, (128, 32, 8): 141, (128, 32, 16): 167,
    (128, 64, 8): 127, (128, 64, 16): 151, (128, 128, 8): 123, (128, 128, 16): 129,
}


def _view(info: KernelInfo) -> GemmView | str:
    # a grouped convolution reads its activations at (f // Fg)·Cg + c, not affine: the analysis
    # calls it a reduction; gemm_view (and flatten_contraction) split f into groups
    if info.kind not in ("contraction", "reduction") or info.combiner != "sum":
        return f"not a sum of products (kind {info.kind})"
    if len(info.spatial) < 2:
        return "needs at least two output axes"
    if info.symbolic:
        return "symbolic sizes (the GEMM view needs constant extents)"
    return gemm_view(info)


def _layout(x: Access) -> Layout:
    if x.per_dim and all(d is not None for d in x.per_dim):
        return layout_of([(dict(d.coeff), d.const) for d in x.per_dim if d is not None], list(x.dims))
    return layout_of([], [])  # not affine (a grouped convolution's activations): no copy provable


def _groups(info: KernelInfo, view: GemmView) -> tuple[list[str], list[str]]:
    """The row and column axes as gemm_view groups them: an axis A reads only through a
    non-affine index (f // Fg of a grouped convolution) is a column axis of B."""
    a_vars, b_vars = set().union(*view.a.index_vars), set().union(*view.b.index_vars)
    plain_a = set().union(*(vs for vs, d in zip(view.a.index_vars, view.a.per_dim or (None,) * len(view.a.index_vars))
                            if d is not None))
    rows = [v for v, _ in info.spatial if v in a_vars and v not in b_vars]
    cols = [v for v, _ in info.spatial if v in b_vars and not (v in a_vars and v in plain_a)]
    return rows, cols


def _vector_widths(info: KernelInfo) -> tuple[int, int]:
    """float4 copies (4) or element copies (1) for A_view's tiles (along k) and B_view's (along n):
    4 where the group's innermost axis is a run of the operand that contiguous_copy proves in
    aligned chunks of 4 (gemm_view._chunk, which gathers such a chunk as one 16-byte load)."""
    view = _view(info)
    assert not isinstance(view, str)
    rows, cols = _groups(info, view)
    ks = [v for v, _ in info.reduction]
    extents = {v: int(e) for v, e in dict(info.spatial).items() | dict(info.reduction).items()}
    a_lay, b_lay = _layout(view.a), _layout(view.b)
    _, cols_o, ks_o, *_ = gemm_order(rows, cols, ks, a_lay, b_lay, extents)
    out = []
    for lay, group in ((a_lay, ks_o), (b_lay, cols_o)):
        run = contiguous_copy(lay, [(group[-1], extents[group[-1]])])
        out.append(4 if run and run % 4 == 0 else 1)
    return out[0], out[1]


def _plain_info(info: KernelInfo, view: GemmView) -> KernelInfo:
    """`info` as the plain GEMM C[(b,) m, n] = Σ_k A[(b,) m, k] · B[(b,) k, n] that the flattened
    stage computes; the operands keep their real extents (DRAM bytes are the tensors', not im2col's)."""
    lead = (("b", view.batch),) if view.batch > 1 else ()
    lead_vars = (frozenset({"b"}),) if lead else ()

    def access(x: Access, rows: tuple[str, int], cols: tuple[str, int]) -> Access:
        offset = Affine(((rows[0], cols[1]), (cols[0], 1)))
        dims = x.dims if x is not info.write else tuple(d for _, d in lead) + (rows[1], cols[1])
        return replace(x, offset=offset, index_vars=lead_vars + (frozenset({rows[0]}), frozenset({cols[0]})),
                       per_dim=(), dims=dims)

    m, n, k = ("m", view.m), ("n", view.n), ("k", view.k)
    return replace(info, spatial=lead + (m, n), reduction=(k,),
                   reads=(access(view.a, m, k), access(view.b, k, n)), write=access(info.write, m, n))


class GemmImplicit(Strategy):
    name = "gemm_implicit"
    description = "float32 implicit GEMM (convolution): the SGEMM kernel over gathered, predicated view tiles"
    priority = 2
    compile_checked = True  # the gathered addresses cost registers: a point ptxas spills is passed over

    def guard(self, info: KernelInfo, target: Target) -> str | None:
        view = _view(info)
        if isinstance(view, str):
            return view
        if any(x.itemsize != 4 or (x.dtype and x.dtype != "float32") for x in (view.a, view.b)):
            return "float32 operands only (16-bit operands: gemm_tensor_core)"
        rows, cols = _groups(info, view)
        if len(rows) == 1 and len(cols) == 1 and len(info.reduction) == 1:
            return "a plain (batched) GEMM: one row, one column and one reduction axis (gemm, gemm_pipelined)"
        if view.m < 32 or view.n < 32:
            return "needs M and N of at least 32 (one 32-wide block tile)"
        return None

    def space(self, info: KernelInfo, target: Target) -> Iterable[Point]:
        # gemm_pipelined's space over the view: tiles, and split-K where the output has fewer
        # than 2 x SMs tiles (not for a batch of groups, which fills blockIdx.z already)
        view = _view(info)
        assert not isinstance(view, str)
        yield from GemmPipelined().space(_plain_info(info, view), target)

    def workload(self, info: KernelInfo, point: Point, target: Target) -> Workload:
        view = _view(info)
        assert not isinstance(view, str)
        base = GemmPipelined().workload(_plain_info(info, view), point, target)
        bm, bn, bk = int(point["bm"]), int(point["bn"]), int(point["bk"])
        split = int(point.get("split", 1))
        # with split-K, base.blocks counts every part's blocks: a block runs one part's k-tiles
        ktiles = -(-(split_chunk(view.k, bk, split) if split > 1 else view.k) // bk)
        widths = _vector_widths(info)
        grouped = len(info.spatial) + len(info.reduction) - 3 - (1 if view.batch > 1 else 0)
        per_block = 0.0
        for elements, width in ((bm * bk, widths[0]), (bk * bn, widths[1])):
            # gemm_pipelined counts a float4 copy as 6 instructions for 4 elements; an element
            # copy costs 6 per element, and every grouped axis a div/mod pair
            per_block += elements * ((6.0 - 6.0 / 4) * (width == 1) + GATHER_INSTRUCTIONS * grouped / width)
        parts = {k: v for k, v in base.registers.items() if k in ("accumulators", "fragments", "copy")}
        regs = parts | {"addressing and gathers": IMPLICIT_PTXAS_REGISTERS[(bm, bn, bk)] - sum(parts.values())}
        extra = base.blocks * ktiles * (per_block / 32 + KTILE_GATHER_INSTRUCTIONS * base.threads / 32)
        notes = base.notes + [f"implicit GEMM {view.m}x{view.n}x{view.k}: copies {widths[0]}/{widths[1]} "
                              "elements wide, gathered through the view"]
        return replace(base, instructions=base.instructions + extra, registers=regs, notes=notes)

    def apply(self, sch: Any, info: KernelInfo, point: Point) -> None:
        bm, bn, bk = int(point["bm"]), int(point["bn"]), int(point["bk"])
        stage = info.stage
        a_width, b_width = _vector_widths(info)
        split = int(point.get("split", 1))
        sch.flatten_contraction(stage)
        loops = sch.get_loops(stage)
        batch = loops[0] if len(loops) == 4 else None
        i, j, k = loops[-3:]
        kernel = sch.mod.kernel(i.kernel)
        views = dict(kernel.attrs)["gemm_views"]
        a_view, b_view = views[0][0], views[1][0]
        tiled: Any = stage
        if split > 1:
            # split-K as in gemm_pipelined: the k loop's outer part made a parallel axis of
            # partials (rfactor) on blockIdx.z; the combine kernel stores C_view, which
            # gather_views turns into the store to the output too
            view = _view(info)
            assert not isinstance(view, str) and batch is None
            part, k = sch.split(k, factors=[None, split_chunk(view.k, bk, split)])
            tiled = sch.rfactor(part)
            batch = part
        schedule_tiles(sch, tiled, batch, i, j, k, [(a_view.tensor, a_width, True), (b_view.tensor, b_width, False)],
                       bm, bn, bk)
        sch.gather_views(f"{i.kernel}/{stage}")

    def describe(self, point: Point) -> str:
        split = int(point.get("split", 1))
        parts = f", split-K {split} + combine kernel" if split > 1 else ""
        return (f"gemm_implicit(block {point['bm']}x{point['bn']}, thread 8x8 in 4x4 quadrants, k-tile {point['bk']}{parts}, "
                "gathered view tiles, register double buffer)")


register(GemmImplicit())
