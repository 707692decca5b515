"""The warp-collective matrix statements (MatrixMultiply, MatrixLoad) under the emulator.

Both run through the layout maps of their intrinsic-table row (tecc.ir.intrinsics), the same
maps codegen relies on, so a wrong map fails the emulator tests as it would fail on a GPU:

- mma: each warp's lanes' fragment elements are gathered into its A, B and C tiles
  (tile[row(lane, e), col(lane, e)] = fragment element e of lane), D = A . B + C is computed in
  float64 (products of f16 / bf16 / tf32 values are exact there, and so is a K <= 16 sum up to
  the final rounding) and rounded once to the accumulator dtype, then scattered back through D's
  map. tf32 inputs are first rounded as `cvt.rna.tf32.f32` does (codegen emits that conversion).
  The hardware accumulates in fp32 with its own order, so results may differ from this by a few
  fp32 ulps of the sum's magnitude; tests derive their tolerance from that.
- ldmatrix: lane L < 8 * matrices names (by its indices) the start of stacked row L; lane L'
  receives element e from stacked row r, column c, where (r, c) is the row's map at (L', e).

All 32 lanes of a warp must take part: a warp that is only partly active here is a
DivergenceError (as for shuffles; on a GPU `.sync.aligned` with missing lanes is undefined).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ...ir.errors import DivergenceError, OutOfBoundsError, TeccError
from ...ir.intrinsics import FragmentOperand, MatrixIntrinsic
from ...ir.stmt import FragmentRef, MatrixLoad, MatrixMultiply
from .banks import counting, record_access
from .expr_compiler import Scope, compile_expr
from .lanes import WARP_SIZE
from .memory import flat_index
from .state import LaneState

Runner = Callable[[LaneState], None]


def round_to_tf32(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to tf32 as `cvt.rna.tf32.f32` does: 10 mantissa bits kept, round to
    nearest with ties away from zero (add half the weight of the 13 dropped bits to the
    magnitude, then clear them); infinities and NaNs pass unchanged."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    special = (bits & 0x7F800000) == 0x7F800000
    rounded = ((bits.astype(np.uint64) + 0x1000) & 0xFFFFE000).astype(np.uint32)
    out: np.ndarray = np.where(special, bits, rounded).view(np.float32)
    return out


def truncate_to_tf32(x: np.ndarray) -> np.ndarray:
    """float32 values as a tf32 wgmma reads them from shared memory: the 13 low mantissa bits
    ignored (cleared: truncation toward zero); infinities and NaNs pass unchanged."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    special = (bits & 0x7F800000) == 0x7F800000
    out: np.ndarray = np.where(special, bits, bits & np.uint32(0xFFFFE000)).view(np.float32)
    return out


def _lane_map(op: FragmentOperand) -> tuple[np.ndarray, np.ndarray]:
    """The operand's layout map evaluated at every (lane, element): two (32, elements) arrays."""
    lanes = np.arange(WARP_SIZE)[:, None]
    elems = np.arange(op.elements)[None, :]
    rows, cols = op.layout(lanes, elems)
    shape = (WARP_SIZE, op.elements)
    return np.broadcast_to(rows, shape).copy(), np.broadcast_to(cols, shape).copy()


def check_whole_warps(st: LaneState, what: str) -> None:
    """DivergenceError unless every warp with an active lane has all 32 lanes active."""
    if not st.checks:
        return
    lay = st.layout
    if lay.threads % WARP_SIZE:
        raise DivergenceError(
            f"{what} in kernel {st.kernel}: the block has {lay.threads} threads, so its last warp is partial; "
            "warp-collective matrix instructions need whole warps (a multiple of 32 threads)")
    if st.mask is None:
        return
    warps = st.mask.reshape(-1, WARP_SIZE)
    partial = warps.any(axis=1) & ~warps.all(axis=1)
    if partial.any():
        w = int(np.argmax(partial))
        lane = w * WARP_SIZE + int(np.argmin(warps[w]))
        raise DivergenceError(
            f"{what} in kernel {st.kernel} is reached by only some lanes of a warp ({lay.where(lane)} is "
            "missing); warp-collective matrix instructions need all 32 lanes (no lane-dependent condition)")


def _uniform_offset(st: LaneState, value: Any, what: str) -> int:
    if isinstance(value, np.ndarray):
        active = value if st.mask is None else value[st.mask]
        if active.size and (active != active.flat[0]).any():
            raise TeccError(f"{what} in kernel {st.kernel}: the fragment offset differs between lanes; it must be "
                            "the same in the whole warp (a constant after unrolling)")
        return int(active.flat[0]) if active.size else 0
    return int(value)


class _Fragment:
    """One fragment operand of a statement: its buffer slot, offset closure and map."""

    def __init__(self, ref: FragmentRef, op: FragmentOperand, scope: Scope) -> None:
        self.slot = scope.buffer_slot(ref.buffer)
        self.offset = compile_expr(ref.offset, scope)
        self.op = op
        self.rows, self.cols = _lane_map(op)

    def gather(self, st: LaneState, what: str) -> np.ndarray:
        """Each warp's tile (warps, rows, cols) in float64 from the lanes' fragment elements."""
        mem, off = st.mems[self.slot], _uniform_offset(st, self.offset(st), what)
        vals = np.stack([mem.load(st, (off + e,), (0,)) for e in range(self.op.elements)], axis=-1)
        if self.op.ptx_type == "tf32":
            vals = round_to_tf32(vals)
        vals = vals.astype(np.float64).reshape(-1, WARP_SIZE, self.op.elements)
        tile = np.zeros((vals.shape[0], self.op.rows, self.op.cols))
        tile[:, self.rows, self.cols] = vals
        return tile

    def scatter(self, st: LaneState, tile: np.ndarray, what: str) -> None:
        mem, off = st.mems[self.slot], _uniform_offset(st, self.offset(st), what)
        vals = tile[:, self.rows, self.cols].reshape(-1, self.op.elements)
        npd = self.op.dtype.numpy
        for e in range(self.op.elements):
            mem.store(st, (off + e,), vals[:, e].astype(npd), (0,))  # one rounding, as the hardware


def compile_matrix_multiply(s: MatrixMultiply, scope: Scope) -> Runner:
    row = s.row
    frags = {r: _Fragment(getattr(s, r), row.operand(r), scope) for r in ("a", "b", "c", "d")}
    what = f"{row.name} ({row.ptx})"

    def run(st: LaneState) -> None:
        check_whole_warps(st, what)
        a, b, c = (frags[r].gather(st, what) for r in ("a", "b", "c"))
        frags["d"].scatter(st, a @ b + c, what)

    return run


def compile_matrix_load(s: MatrixLoad, scope: Scope) -> Runner:
    row: MatrixIntrinsic = s.row
    op = row.operand("d")
    rows, cols = _lane_map(op)
    assert row.address is not None
    supplier = np.empty(row.address_lanes, dtype=np.int64)  # stacked row -> the lane that gives its address
    for lane in range(row.address_lanes):
        supplier[int(row.address(lane))] = lane
    src_slot, dst_slot = scope.buffer_slot(s.src), scope.buffer_slot(s.dst.buffer)
    fidx = [compile_expr(i, scope) for i in s.src_indices]
    foff = compile_expr(s.dst.offset, scope)
    what = f"{row.name} ({row.ptx}) from {s.src.name}"
    # 32-bit elements move as b16 pairs: a row is 4 elements, a register one element, the one
    # whose pair (2t, 2t+1) the 16-bit map gives (MatrixLoad's docstring)
    pairs = s.pairs
    row_elements = 4 if pairs else 8
    element_bytes = s.src.dtype.bytes

    def run(st: LaneState) -> None:
        check_whole_warps(st, what)
        src, dst = st.mems[src_slot], st.mems[dst_slot]
        lanes = st.layout.lanes
        start = np.broadcast_to(np.asarray(flat_index([f(st) for f in fidx], src.strides), dtype=np.int64), (lanes,))
        start = start.reshape(-1, WARP_SIZE)
        warp_active = np.ones(start.shape[0], dtype=bool) if st.mask is None else st.mask.reshape(-1, WARP_SIZE)[:, 0]
        if st.checks:
            _check_row_addresses(st, src, start, warp_active, row, what, row_elements)
        if counting():
            physical = start if src.layout is None else src.layout.apply(start)
            record_access(st, src.name, physical.reshape(-1) * element_bytes, 16, row.address_lanes)
        off = _uniform_offset(st, foff(st), what)
        if pairs:
            for r in range(op.registers):
                e = 2 * r  # the low half of the pair: its row and its column // 2
                logical = start[:, supplier[rows[:, e]]] + cols[:, e] // 2
                flat = logical.reshape(-1)
                dst.store(st, (off + r,), src.load_keys(st, src.keys_of(flat), (flat,)), (0,))
            return
        for e in range(op.elements):
            logical = start[:, supplier[rows[:, e]]] + cols[:, e]  # (warps, 32)
            flat = logical.reshape(-1)
            dst.store(st, (off + e,), src.load_keys(st, src.keys_of(flat), (flat,)), (0,))

    return run


def _check_row_addresses(st: LaneState, src: Any, start: np.ndarray, warp_active: np.ndarray,
                         row: MatrixIntrinsic, what: str, width: int = 8) -> None:
    """Each address lane's row must lie inside the buffer and be `width` contiguous (8 16-bit or
    4 32-bit), 16-byte-aligned elements after the layout (what ldmatrix reads as one 16-byte row)."""
    used = start[warp_active][:, :row.address_lanes]
    if used.size == 0:
        return
    bad = (used < 0) | (used + width > src.size)
    phys = used if src.layout is None else src.layout.apply(used)
    contiguous = np.ones(used.shape, dtype=bool)
    for c in range(width):
        p = used + c if src.layout is None else src.layout.apply(used + c)
        contiguous &= p == phys + c
    misaligned = (phys % width != 0) | ~contiguous
    for mask, problem in ((bad, "lies outside"),
                          (misaligned, f"is not {width} contiguous 16-byte-aligned elements of")):
        if mask.any():
            w, lane = np.argwhere(mask)[0]
            warp = int(np.flatnonzero(warp_active)[w])
            where = st.layout.where(warp * WARP_SIZE + int(lane))
            err_type = OutOfBoundsError if problem == "lies outside" else TeccError
            raise err_type(
                f"{what} in kernel {st.kernel}: the row that {where} addresses (element {int(used[w, lane])}) "
                f"{problem} shared buffer {src.name} ({src.size} elements{', ' + str(src.layout) if src.layout else ''}); "
                f"each address lane must point at a 16-byte-aligned row of {width} elements")
