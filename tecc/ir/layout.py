"""Shared-memory layout functions: where a buffer's logical element offset physically lives.

A shared `Buffer` may carry a `layout`; every access to it (plain loads and stores, ldmatrix
row addresses, cp.async destinations) goes through `layout.apply(offset)`, where `offset` is
the logical flat element offset (indices times strides). Codegen prints `apply` on the offset
Expr, the emulator calls it on NumPy arrays: one definition, so they cannot disagree. A
buffer without a layout (None) is the identity.

Why swizzle: shared memory has 32 banks of 4 bytes. A warp reading one column of 16-byte
chunks from a tile whose rows are 128 bytes apart hits the same 4 banks eight times (an 8-way
conflict: ldmatrix reads 8 such rows per matrix). XOR-ing the chunk index with the row index
spreads the eight rows over all 32 banks while each 16-byte chunk stays contiguous.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import TeccError


class LayoutError(TeccError):
    """A layout's parameters are illegal, or it does not fit the buffer it is attached to."""


@dataclass(frozen=True)
class Swizzle:
    """XOR swizzle of element offsets: `o ^ (((o // 2^(base+shift)) % 2^bits) * 2^base)`.

    Bits [base, base+bits) of the offset (which `2^base`-element chunk within a row of chunks)
    are XOR-ed with bits [base+shift, base+shift+bits) (which row). Elements inside a chunk of
    2^base stay contiguous and in order, and every block of `period` = 2^(base+bits+shift)
    elements maps onto itself, so the layout is a bijection on any buffer whose size is a
    multiple of that period. For 16-bit tiles with 64-element rows, Swizzle(3, 3, 3) makes 16-byte
    chunks (8 elements) the unit and XORs the chunk index (0..7) with the row index mod 8.

    `apply` uses only `+`, `*`, `//`, `%` and `^`, so it works on ints, NumPy arrays and Exprs."""

    bits: int
    base: int
    shift: int

    def __post_init__(self) -> None:
        if self.bits < 0 or self.base < 0 or self.shift < self.bits:
            raise LayoutError(
                f"Swizzle(bits={self.bits}, base={self.base}, shift={self.shift}): need bits >= 0, base >= 0 "
                "and shift >= bits (otherwise the XOR source overlaps the bits it changes and the map is "
                "not a bijection)")

    @property
    def period(self) -> int:
        """Elements in one block that the swizzle permutes within itself."""
        return 1 << (self.base + self.bits + self.shift)

    @property
    def contiguous(self) -> int:
        """Elements that stay contiguous and in order (one chunk)."""
        return 1 << self.base

    def moves_whole_periods(self, stride: int) -> bool:
        """Whether a term `i * stride` of an offset moves it by whole periods, so that
        `apply(x + i * stride) == apply(x) + i * stride` for every x >= 0: the swizzle reads and
        changes only the offset's bits below the period, which adding a multiple of the period
        leaves as they are. Codegen keeps such terms (the stage of a ring, say) outside the XOR,
        where they do not make the swizzle of the rest depend on the loop that advances them."""
        return stride % self.period == 0

    def apply(self, offset: Any) -> Any:
        if self.bits == 0:
            return offset
        row = (offset // (1 << (self.base + self.shift))) % (1 << self.bits)
        return offset ^ (row * (1 << self.base))

    def check_fits(self, buffer_name: str, elements: int) -> None:
        """LayoutError unless a buffer of `elements` elements is a whole number of periods."""
        if elements % self.period:
            raise LayoutError(
                f"shared buffer {buffer_name}: {self} permutes blocks of {self.period} elements but the buffer "
                f"holds {elements}; pad it to a multiple of {self.period} or use fewer swizzle bits")

    def __str__(self) -> str:
        return f"swizzle({self.bits}, {self.base}, {self.shift})"


Layout = Swizzle  # the one layout family so far; identity is `None` on the buffer
