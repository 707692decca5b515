"""The shared-memory tile of transpose_tile: where each element of the staged box lives, and
what the two phases' warp accesses cost in banks.

The tile holds a BV x BU box of X: BV rows along the output's fastest axis v, each a run of BU
elements of X's contiguous dimension (along u). Two layouts:

* **padded** rows of BU + pad elements (`best_pad`): the copy writes one element per lane
  (scalar copies), the compute reads a column (lanes on consecutive rows). A padded row of
  16-bit elements is not 16-byte aligned, so the copy cannot be wide.
* **swizzled** rows of TU elements (BU and, where the box is narrower than the tile, a pad up
  to TU) through `Swizzle(bits, base, shift)`
  (tecc.ir.layout): the copy moves chunks of C = 16 / itemsize elements (16 bytes, LDG.128 /
  STS.128), which the layout keeps whole (base = log2 C), and the chunk index is XOR-ed with
  the row-group index g = row // V (shift puts g's bits there: base + shift = log2(TU · V)).
  The compute's lanes (tx, ty) read rows tx·V + q of one column: the TX row groups of a warp
  land on TX distinct chunk positions, i.e. distinct banks, while the 32 / TX lanes of one row
  group read consecutive columns inside one chunk (at most 16 bytes). Padding cannot do that:
  rows 16 bytes apart put every row group's word on one of 8 bank quads.

`tile_wavefronts` counts both phases with tecc.compiler.cost.warp (the emulator's counter
checks the same in tests/test_transpose_tile.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...ir.layout import Swizzle
from ..cost.warp import WARP, shared_wavefronts

MAX_PAD = 32          # pads tried by best_pad (elements)
WIDE_BYTES = 16       # a wide copy moves 16 bytes per lane


@dataclass(frozen=True)
class TileShape:
    """One point's tile: BU x BV staged, TX x TY threads, V outputs per thread and store, C
    elements per copy chunk (1: scalar copies), `pad` elements after each row or `bits` of
    swizzle (not both)."""

    bu: int
    bv: int
    tx: int
    ty: int
    vector: int
    copy: int
    pad: int
    bits: int
    itemsize: int

    @property
    def threads(self) -> int:
        return self.tx * self.ty

    @property
    def row(self) -> int:
        """Elements from one row of the tile to the next (the box's width and the pad)."""
        return self.bu + self.pad

    @property
    def swizzle(self) -> Swizzle | None:
        """The layout of a swizzled tile (None: padded rows, no swizzle)."""
        if self.copy == 1:
            return None
        return Swizzle(self.bits, _log2(self.copy), _log2(self.row * self.vector) - _log2(self.copy))

    def physical(self, row: int, col: int) -> int:
        """The element offset of (row, col) of the box in the buffer."""
        layout = self.swizzle
        offset = row * self.row + col
        return offset if layout is None else int(layout.apply(offset))

    def _words(self, elements: list[int]) -> list[int]:
        return [e * self.itemsize // 4 for e in elements]

    def copy_wavefronts(self) -> tuple[int, int]:
        """(wavefronts, worst degree) of one warp's copy store: lane l writes chunk l of the
        flattened box (C consecutive elements of one row)."""
        per_row = self.bu // self.copy
        starts = [self.physical(lane // per_row, (lane % per_row) * self.copy) for lane in range(WARP)]
        vector_words = max(1, self.copy * self.itemsize // 4)
        return shared_wavefronts(self._words(starts), vector_words if self.copy > 1 else 1)

    def read_wavefronts(self) -> tuple[int, int]:
        """(wavefronts of a warp's V column reads, worst degree): lane (tx, ty) reads element
        (tx·V + q, ty) for q < V (the first of its rows; the others move the column by TY,
        a whole number of the warp's row groups)."""
        total, worst = 0, 1
        for q in range(self.vector):
            rows = [(lane % self.tx) * self.vector + q for lane in range(WARP)]
            cols = [(lane // self.tx) % self.ty for lane in range(WARP)]
            wf, degree = shared_wavefronts(self._words([self.physical(r, c) for r, c in zip(rows, cols)]))
            total += wf
            worst = max(worst, degree)
        return total, worst

    def smem_elements(self) -> int:
        return self.bv * self.row


def _log2(n: int) -> int:
    if n < 1 or n & (n - 1):
        raise ValueError(f"{n} is not a power of two")
    return n.bit_length() - 1


def phase_wavefronts(bu: int, tx: int, vector: int, pad: int, itemsize: int) -> tuple[int, int, int]:
    """(wavefronts of one warp's copy store, of one warp's column reads (all V of them), worst
    conflict degree) for a padded tile of rows of BU + pad elements with scalar copies."""
    tile = TileShape(bu, WARP, tx, max(1, WARP // tx), vector, 1, pad, 0, itemsize)
    writes, worst = tile.copy_wavefronts()
    reads, degree = tile.read_wavefronts()
    return writes, reads, max(worst, degree)


def best_pad(bu: int, tx: int, vector: int, itemsize: int) -> int:
    """The smallest pad (elements) that gives both phases their fewest wavefronts."""
    costs = {pad: phase_wavefronts(bu, tx, vector, pad, itemsize) for pad in range(MAX_PAD + 1)}
    return min(costs, key=lambda p: (costs[p][0] + costs[p][1], p))


def wide_tile(bu: int, bv: int, tu: int, tx: int, ty: int, vector: int, itemsize: int) -> TileShape | None:
    """The swizzled tile with 16-byte copies, rows of TU elements (a box narrower than the tile,
    BU < TU, is padded to it: the row-group bits must sit at a power of two), whose both phases
    are conflict-free (the fewest swizzle bits that make them so); None when none is: rows not
    a whole number of chunks, more row groups per warp than distinct chunk positions, a row
    group's columns wider than a chunk."""
    copy = WIDE_BYTES // itemsize
    if bu % copy or tu % copy or bu > tu or tu & (tu - 1) or vector & (vector - 1):
        return None
    for bits in range(0, 4):
        tile = TileShape(bu, bv, tx, ty, vector, copy, tu - bu, bits, itemsize)
        layout = tile.swizzle
        assert layout is not None
        if layout.shift < bits or (bv * tile.row) % layout.period:
            break
        writes, w_degree = tile.copy_wavefronts()
        reads, r_degree = tile.read_wavefronts()
        if w_degree == 1 and r_degree == 1:
            return tile
    return None


__all__ = ["MAX_PAD", "WIDE_BYTES", "TileShape", "best_pad", "phase_wavefronts", "wide_tile"]
