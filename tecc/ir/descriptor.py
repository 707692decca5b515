"""Shared-memory matrix descriptors: how wgmma finds its A and B tiles in shared memory.

A wgmma reads A (m x k) and B (k x n, or rather its n x k view) from shared memory through a
64-bit *matrix descriptor* (PTX ISA, "Matrix Descriptor Format" and "Shared Memory Matrix
Layout" of the warpgroup-level mma). The tile is made of 8-row "core matrices" of 16 bytes per
row; the descriptor gives the start address, two strides (LBO, the leading-dimension byte
offset, and SBO, the stride-dimension byte offset) and a swizzle mode. In the ISA's canonical
layouts (CuTe notation, T = 16 bytes / element size = 8 for 16-bit types, W = T * (swizzle
bytes / 16); offsets in elements, LBO and SBO divided by the element size):

    K-major,  none:    ((8, m), (T, 2k)) : ((T, SBO), (1, LBO))
    K-major,  swizzled ((8, m), (T, 2k)) : ((W, SBO), (1, T))         (LBO unused)
    MN-major, none:    ((T, 1, m), (8, k)) : ((1, T, SBO), (T, LBO))
    MN-major, swizzled ((T, W/T, m), (8, k)) : ((1, T, LBO), (W, SBO))

Rows of the tile are its m (or n) index, columns its k index; "K-major" means k is contiguous
(A as [m][k], B as [n][k]), "MN-major" that m or n is (A as [k][m], B as [k][n]; wgmma's
transpose bits). The swizzle XORs bits [4, 4 + b) of the shared *byte address* with bits
[7, 7 + b), b = 1, 2, 3 for 32, 64, 128 bytes: for 16-bit elements that is tecc's
`Swizzle(b, 3, 3)` on element offsets (32-bit ones, tf32: `Swizzle(b, 2, 3)`; 8-bit ones, fp8:
`Swizzle(b, 4, 3)`, T = 16, a 128B row holding 128 elements). tecc requires every descriptor's buffer to start at a
multiple of 1024 bytes (codegen aligns such buffers), so the swizzle of the absolute address is
the swizzle of the offset within the buffer, and the descriptor's base-offset field is 0.

`MatrixDescriptor.tile(rows, cols)` is the canonical layout as a tecc Layout (tecc.ir.layout), and
`MatrixDescriptor.offset(start, row, col)` the one definition of where element (row, col)
physically lives (an element offset into the buffer's storage, after the swizzle): the emulator
reads wgmma operands through it and the tests pin it against the canonical layouts; `encode`
builds the 64-bit descriptor codegen passes to the instruction. Both use only `+ * // % ^`, so
they work on ints, NumPy arrays and index Exprs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import TeccError
from .layout import Layout, Swizzle

# swizzle mode -> (bytes of one swizzled row, the 2-bit code in descriptor bits 62-63)
SWIZZLE_MODES: dict[str, tuple[int, int]] = {"none": (16, 0), "128B": (128, 1), "64B": (64, 2), "32B": (32, 3)}
MAJORS = ("K", "MN")
CORE_ROW_BYTES = 16          # one row of a core matrix
DESCRIPTOR_ALIGNMENT = 1024  # bytes; the swizzle pattern repeats every 8 rows of 128 bytes
# element bytes -> log2(T), T = elements in a 16-byte core-matrix row (the swizzle's base)
ELEMENT_BYTES = {1: 4, 2: 3, 4: 2}


class DescriptorError(TeccError):
    """A matrix descriptor's parameters are illegal or do not fit the buffer it describes."""


@dataclass(frozen=True)
class MatrixDescriptor:
    """The static part of a wgmma shared-memory matrix descriptor (the start address is given
    per use): `major` 'K' or 'MN', `swizzle` 'none', '32B', '64B' or '128B', `leading_bytes`
    (LBO) and `stride_bytes` (SBO) as the module docstring defines them, for elements of
    `element_bytes` bytes (2: f16 / bf16; 4: tf32 and 1: fp8, which the ISA takes K-major only)."""

    major: str
    swizzle: str
    leading_bytes: int
    stride_bytes: int
    element_bytes: int = 2

    def __post_init__(self) -> None:
        where = f"matrix descriptor ({self.major}-major, swizzle {self.swizzle})"
        if self.major not in MAJORS or self.swizzle not in SWIZZLE_MODES:
            raise DescriptorError(f"{where}: major must be one of {MAJORS} and swizzle one of {tuple(SWIZZLE_MODES)}")
        if self.element_bytes not in ELEMENT_BYTES:
            raise DescriptorError(f"{where}: elements must be 1 byte (fp8), 2 (f16, bf16) or 4 (tf32), "
                                  f"not {self.element_bytes}")
        for field in ("leading_bytes", "stride_bytes"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0 or value % 16 or value >= 1 << 18:
                raise DescriptorError(f"{where}: {field} must be a multiple of 16 below 2^18 (the field holds "
                                      f"bytes >> 4 in 14 bits), got {value!r}")

    @property
    def core_elements(self) -> int:
        """T: elements in one 16-byte core-matrix row."""
        return CORE_ROW_BYTES // self.element_bytes

    @property
    def row_elements(self) -> int:
        """W: elements of one swizzled row (T when unswizzled)."""
        return SWIZZLE_MODES[self.swizzle][0] // self.element_bytes

    @property
    def layout(self) -> Swizzle | None:
        """The element-offset swizzle this mode applies (None for 'none'): a buffer that plain
        loads and stores address logically must carry exactly this layout."""
        bits = {"none": 0, "32B": 1, "64B": 2, "128B": 3}[self.swizzle]
        # byte-address bits [4, 4 + b) XOR [7, 7 + b): in elements, base log2(T), shift 3
        return None if bits == 0 else Swizzle(bits, ELEMENT_BYTES[self.element_bytes], 3)

    def tile(self, rows: int, cols: int) -> Layout:
        """The canonical layout of a rows x cols tile (module docstring), (row, col) -> the
        unswizzled element offset from the start: rows split into 8-row core matrices (MN-major:
        into T- or W-element runs) and columns likewise, each part with its stride (LBO, SBO, T or
        W). The outermost part of each dimension is never reduced, so a coordinate past the tile
        continues along it."""
        t, w = self.core_elements, self.row_elements
        lbo, sbo = self.leading_bytes // self.element_bytes, self.stride_bytes // self.element_bytes

        def split(extent: int, inner: int) -> int:
            return max(1, -(-extent // inner))
        # terms: each dimension's inner part first, as the canonical formulas read
        if self.major == "K":
            if self.swizzle == "none":
                return Layout(((split(rows, 8), 8), (split(cols, t), t)), ((sbo, t), (lbo, 1)), terms=(1, 0, 3, 2))
            return Layout(((split(rows, 8), 8), cols), ((sbo, w), 1), terms=(1, 0, 2))
        if self.swizzle == "none":
            return Layout(((split(rows, t), t), (split(cols, 8), 8)), ((sbo, 1), (lbo, t)), terms=(1, 0, 3, 2))
        return Layout(((split(rows, w), w), (split(cols, 8), 8)), ((lbo, 1), (sbo, w)), terms=(1, 0, 3, 2))

    def canonical(self, row: Any, col: Any) -> Any:
        """The unswizzled element offset of tile element (row, col) from the start: `tile`
        evaluated (its extents do not bound the evaluation)."""
        return self.tile(8, self.core_elements)(row, col)

    def offset(self, start: Any, row: Any, col: Any) -> Any:
        """The physical element offset (within a 1024-byte-aligned buffer) of tile element
        (row, col) when the descriptor's start address is element `start` of the buffer."""
        logical = start + self.canonical(row, col)
        layout = self.layout
        return logical if layout is None else layout.apply(logical)

    def constant_bits(self) -> int:
        """The descriptor with a zero start address: LBO >> 4 in bits 16-29, SBO >> 4 in bits
        32-45, base offset 0 (bits 49-51), the swizzle code in bits 62-63."""
        code = SWIZZLE_MODES[self.swizzle][1]
        return ((self.leading_bytes >> 4) << 16) | ((self.stride_bytes >> 4) << 32) | (code << 62)

    def encode(self, address: Any) -> Any:
        """The 64-bit descriptor for a tile starting at shared-window byte `address`: the start
        field (bits 0-13) holds address bits 4-17 ((address % 2^18) // 16)."""
        return self.constant_bits() + (address % (1 << 18)) // 16

    def __str__(self) -> str:
        return f"desc({self.major}-major, {self.swizzle}, lbo={self.leading_bytes}, sbo={self.stride_bytes})"
