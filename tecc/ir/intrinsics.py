"""The intrinsic table: every warp-collective matrix instruction tecc emits, declared once, as data.

A row says what the instruction computes and how its operands are spread over the 32 lanes of a
warp. Codegen prints the inline PTX from a row (operand counts, register packing, constraint
letters), the emulator executes the row by gathering and scattering through the very same
layout maps, and the tests pin the maps against the PTX ISA. A new instruction is a new row.

**Fragment layouts.** `FragmentOperand.layout` is a Layout (tecc.ir.layout) from (lane, element)
to (row, col): which element of the operand's tile a lane holds at position `element` of its
fragment (the PTX ISA, "Matrix fragments for mma.m16n8k16" / "... m16n8k8" and "ldmatrix").
`layout(lane, e)` evaluates it on Python ints, NumPy integer arrays (the emulator) and tecc
index `Expr`s (the passes that build the copies to and from fragments) alike.

**Registers.** A lane's fragment elements pack into 32-bit registers in element order:
`elements_per_register` consecutive elements share one register (two f16/bf16 values, low half
first, as `.f16x2` has them; four fp8 values, lowest byte first; one f32/tf32 value).
Codegen passes register r as the 32 bits at fragment elements [r * per_register, (r + 1) *
per_register).

**tf32.** A tf32 operand is stored as float32; the instruction reads only its top 19 bits.
tecc converts each such register with `cvt.rna.tf32.f32` (round to nearest, ties away from
zero, on the 13 dropped mantissa bits) before the mma, and the emulator rounds the same way
(`tecc.runtime.sim.matrix.round_to_tf32`), so both see the same inputs whatever the hardware does with low bits.

The m16n8k16 fragments (g = lane // 4, t = lane % 4; aN = element N of the lane's fragment):

    A (16 x 16, row-major)              B (16 x 8, k x n)        C / D (16 x 8)
          cols 0..7     cols 8..15            cols 0..7                cols 0..7
    row g   a0 a1 @2t     a4 a5 @2t+8     k 2t,2t+1   b0 b1 @ n=g   row g    c0 c1 @2t
    row g+8 a2 a3 @2t     a6 a7 @2t+8     k 2t+8,+9   b2 b3 @ n=g   row g+8  c2 c3 @2t
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from . import dtype as dt
from .dtype import DType
from .errors import TeccError
from .layout import Coord, Layout

WARP_SIZE = 32
# The PTX operand types of the table and the dtype a fragment buffer stores them in.
PTX_STORAGE: dict[str, DType] = {"f16": dt.float16, "bf16": dt.bfloat16, "tf32": dt.float32,
                                 "f32": dt.float32, "b16": dt.float16,
                                 "e4m3": dt.float8_e4m3, "e5m2": dt.float8_e5m2}
# PTX input types of wgmma that have no transpose immediates: their shared operands must be
# K-major (A [m][k], B [n][k]) (PTX ISA, wgmma.mma_async: imm-trans-a/b only for .f16 / .bf16)
K_MAJOR_ONLY = ("tf32", "e4m3", "e5m2")


class IntrinsicError(TeccError):
    """A matrix statement does not fit the intrinsic-table row it names (unknown row, wrong dtype,
    fragment too small, misaligned offset); the message names the row, the buffer and the fix."""


@lru_cache(maxsize=None)
def _pattern(layout: Layout) -> Layout:
    """A fragment layout with its outermost element extent set to 1 (evaluation never reduces the
    outermost mode, so this changes no value, only the domain)."""
    thread, value = layout[0], layout[1]
    shape = (1,) + value.shape[1:] if isinstance(value.shape, tuple) else 1
    return Layout((thread.shape, shape), (thread.stride, value.stride))


@dataclass(frozen=True)
class FragmentOperand:
    """One operand of a matrix instruction: the tile it covers and how the warp holds it.

    `role` is 'a', 'b', 'c' or 'd' for mma ('d' only for ldmatrix: what it loads); `ptx_type`
    the PTX element type; `rows x cols` the tile (A is m x k, B is k x n, C and D are m x n);
    `elements` how many elements each lane holds; `layout` the (lane, element) -> (row, col) map."""

    role: str
    ptx_type: str
    rows: int
    cols: int
    elements: int
    layout: Layout

    def __post_init__(self) -> None:
        if self.layout.rank != 2 or self.layout[1].size != self.elements or self.layout.is_offset:
            raise IntrinsicError(f"operand {self.role}: its layout {self.layout} must map (lane, element) with "
                                 f"{self.elements} elements to (row, col) Coords")

    def same_layout(self, other: FragmentOperand) -> bool:
        """Whether a fragment laid out as `other` holds what this operand needs where both have
        elements: the same layout up to the extent of the outermost element mode (the
        accumulators of wgmma rows of different n differ only there)."""
        return self.layout == other.layout or _pattern(self.layout) == _pattern(other.layout)

    @property
    def dtype(self) -> DType:
        """The dtype of a fragment buffer holding this operand."""
        return PTX_STORAGE[self.ptx_type]

    @property
    def elements_per_register(self) -> int:
        return 4 // self.dtype.bytes

    @property
    def registers(self) -> int:
        return self.elements // self.elements_per_register

    @property
    def convert(self) -> str | None:
        """The PTX conversion applied to each register before the instruction reads it."""
        return "cvt.rna.tf32.f32" if self.ptx_type == "tf32" else None


@dataclass(frozen=True)
class MatrixIntrinsic:
    """One row of the table.

    kind 'mma': D = A . B + C over an m x n x k tile, all four operands fragments.
    kind 'wgmma': D = A . B (+ D) over an m64 x n x k16 tile (k8 for tf32, k32 for fp8) by a warpgroup (`threads` = 128
    consecutive threads whose first is a multiple of 128): B (PTX type `input_type`) is read from
    shared memory through a matrix descriptor (tecc.ir.descriptor), A either the same way or from
    registers (operand 'a': 8 elements, 4 `.f16x2` registers per thread, the m16n8k16 A pattern
    repeated per warp over its 16 rows); 'c' and 'd' are the accumulator (the same registers).
    The layout maps take the thread index within the warpgroup (0..127) as their "lane". Needs
    `sm_90a`.
    kind 'ldmatrix': `matrices` 8 x 8 tiles of 16-bit elements, stacked as one (8 * matrices) x 8
    tile, loaded from shared memory; lane `address(lane)` < 8 * matrices supplies the address of
    that stacked row (8 contiguous elements, 16-byte aligned), and operand 'd' says which lane
    receives which element. `min_arch` is the first sm_XY that has the instruction."""

    name: str
    ptx: str
    kind: str
    shape: tuple[int, int, int]
    operands: tuple[FragmentOperand, ...]
    min_arch: int = 80
    matrices: int = 0
    transpose: bool = False
    address: Layout | None = None
    threads: int = WARP_SIZE
    input_type: str = ""
    b_type: str = ""  # wgmma: B's PTX type when it differs from A's (fp8 e4m3 x e5m2)

    def operand_type(self, role: str) -> str:
        """The PTX type of wgmma input `role` ('a' or 'b')."""
        return self.b_type if role == "b" and self.b_type else self.input_type

    @property
    def k_major_only(self) -> bool:
        """Whether the row's shared operands must be K-major (no transpose immediates)."""
        return self.input_type in K_MAJOR_ONLY

    def operand(self, role: str) -> FragmentOperand:
        for o in self.operands:
            if o.role == role:
                return o
        raise IntrinsicError(f"intrinsic {self.name} has no operand {role!r}; it has "
                             f"{', '.join(o.role for o in self.operands)}")

    @property
    def address_lanes(self) -> int:
        """Lanes whose row address an ldmatrix reads (the others' are ignored)."""
        return 8 * self.matrices


# ---- fragment layouts, typed from the PTX ISA's fragment figures --------------------------------
# Each is a Layout (tecc.ir.layout) from (lane, element) to the tile's (row, col): the lane as the
# ISA's (groupID, threadID_in_group) = (lane // 4, lane % 4), a warpgroup's thread as (warp, lane),
# the element as the digits its figure uses; strides say how far each moves the row (_r) or the
# column (_c).

def _r(k: int) -> Coord:
    return Coord(k, 0)


def _c(k: int) -> Coord:
    return Coord(0, k)


QUAD = (8, 4)            # a warp's lanes as (g, t)
WARPGROUP = (4, QUAD)    # a warpgroup's threads as (warp, (g, t)); warp w owns rows 16w .. 16w + 15

# m16n8k16 A: a0,a1: (g, 2t+i); a2,a3: (g+8, 2t+i); a4,a5: (g, 2t+8+i); a6,a7: (g+8, 2t+8+i)
M16N8K16_A = Layout((QUAD, (2, 2, 2)), ((_r(1), _c(2)), (_c(8), _r(8), _c(1))))
# m16n8k16 B: b0,b1: (k = 2t+i, n = g); b2,b3: (k = 2t+8+i, n = g)
M16N8K16_B = Layout((QUAD, (2, 2)), ((_c(1), _r(2)), (_r(8), _r(1))))
# m16n8 C / D: c0,c1: (g, 2t+i); c2,c3: (g+8, 2t+i) -- m16n8k16 and m16n8k8 alike
M16N8_C = Layout((QUAD, (2, 2)), ((_r(1), _c(2)), (_r(8), _c(1))))
# m16n8k8 tf32 A: a0: (g, t); a1: (g+8, t); a2: (g, t+4); a3: (g+8, t+4)
M16N8K8_TF32_A = Layout((QUAD, (2, 2)), ((_r(1), _c(1)), (_c(4), _r(8))))
# m16n8k8 tf32 B: b0: (k = t, n = g); b1: (k = t+4, n = g)
M16N8K8_TF32_B = Layout((QUAD, 2), ((_c(1), _r(1)), _r(4)))


def _ldmatrix_layout(matrices: int, transpose: bool) -> Layout:
    """Element e of a lane is in matrix e // 2; the lane gets row g, columns 2t and 2t+1 of it
    (.trans: column g, rows 2t and 2t+1 of the matrix as stored)."""
    if transpose:
        return Layout((QUAD, (matrices, 2)), ((_c(1), _r(2)), (_r(8), _r(1))))
    return Layout((QUAD, (matrices, 2)), ((_r(1), _c(2)), (_r(8), _c(1))))


# lanes 8j .. 8j+7 give the addresses of rows 0..7 of matrix j (stacked row = lane)
LDMATRIX_ADDRESS = Layout(WARP_SIZE, 1)


def _wgmma_accumulator(n: int) -> Layout:
    """D of wgmma .m64nNk*: warp w owns rows 16w .. 16w+15; inside the warp the m16n8 C pattern
    repeats over the n8 column blocks: d(4j), d(4j+1) at (g, 8j + 2t + i), d(4j+2), d(4j+3) at
    (g+8, ...) (PTX ISA, "Register fragment layout for accumulator matrix D")."""
    # the column adds the n8 block before the lane's column, as the kernels were written
    return Layout((WARPGROUP, (n // 8, 2, 2)), ((_r(16), (_r(1), _c(2))), (_c(8), _r(8), _c(1))),
                  terms=(0, 1, 3, 2, 4, 5))


# A from registers, 16-bit (m64nNk16): warp w holds rows 16w .. 16w+15 of the m64 x k16 tile in the
# m16n8k16 A pattern (PTX ISA, "Register fragment layout for matrix A" of wgmma .m64nNk16)
WGMMA_A = Layout((WARPGROUP, (2, 2, 2)), ((_r(16), (_r(1), _c(2))), (_c(8), _r(8), _c(1))))
# A from registers, tf32 (m64nNk8): the m16n8k8 tf32 A pattern per warp
WGMMA_TF32_A = Layout((WARPGROUP, (2, 2)), ((_r(16), (_r(1), _c(1))), (_c(4), _r(8))))
# A from registers, 8-bit (m64nNk32), four elements per .b32 register (lowest byte first):
# a0..a3: (g, 4t+i); a4..a7: (g+8, 4t+i); a8..a11: (g, 4t+16+i); a12..a15: (g+8, 4t+16+i)
WGMMA_FP8_A = Layout((WARPGROUP, (2, 2, 4)), ((_r(16), (_r(1), _c(4))), (_c(16), _r(8), _c(1))))


WARPGROUP_SIZE = 128
WGMMA_N = (8, 16, 32, 64, 96, 128, 192, 256)  # the n of the m64nNk16 / m64nNk8 rows in the table


def _wgmma(n: int, ab: str) -> MatrixIntrinsic:
    elements = 64 * n // WARPGROUP_SIZE
    return MatrixIntrinsic(
        name=f"wgmma.m64n{n}k16.f32.{ab}", ptx=f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ab}.{ab}",
        kind="wgmma", shape=(64, n, 16), min_arch=90, threads=WARPGROUP_SIZE, input_type=ab,
        operands=(FragmentOperand("a", ab, 64, 16, 8, WGMMA_A),
                  FragmentOperand("c", "f32", 64, n, elements, _wgmma_accumulator(n)),
                  FragmentOperand("d", "f32", 64, n, elements, _wgmma_accumulator(n))),
    )


def _wgmma_tf32(n: int) -> MatrixIntrinsic:
    """m64nNk8 with tf32 inputs: the ISA has no transpose immediates for them, so both shared
    operands must be K-major (A [m][k], B [n][k]); A may instead come from registers (4 per
    thread, converted with cvt.rna like mma.sync's). A shared operand is read as stored: the
    tensor core ignores the 13 low mantissa bits of each float32 (truncation)."""
    elements = 64 * n // WARPGROUP_SIZE
    return MatrixIntrinsic(
        name=f"wgmma.m64n{n}k8.f32.tf32", ptx=f"wgmma.mma_async.sync.aligned.m64n{n}k8.f32.tf32.tf32",
        kind="wgmma", shape=(64, n, 8), min_arch=90, threads=WARPGROUP_SIZE, input_type="tf32",
        operands=(FragmentOperand("a", "tf32", 64, 8, 4, WGMMA_TF32_A),
                  FragmentOperand("c", "f32", 64, n, elements, _wgmma_accumulator(n)),
                  FragmentOperand("d", "f32", 64, n, elements, _wgmma_accumulator(n))),
    )


FP8_TYPES = ("e4m3", "e5m2")


def _wgmma_fp8(n: int, a: str, b: str) -> MatrixIntrinsic:
    """m64nNk32 with fp8 inputs (`a`, `b`: e4m3 or e5m2, mixed allowed), f32 accumulator: like
    tf32, no transpose immediates, so both shared operands are K-major (32 bytes of k per
    instruction); A may come from registers (16 bytes per thread in 4 .b32). The products of
    fp8 values are exact, the sums f32."""
    elements = 64 * n // WARPGROUP_SIZE
    types = a if a == b else f"{a}.{b}"
    return MatrixIntrinsic(
        name=f"wgmma.m64n{n}k32.f32.{types}", ptx=f"wgmma.mma_async.sync.aligned.m64n{n}k32.f32.{a}.{b}",
        kind="wgmma", shape=(64, n, 32), min_arch=90, threads=WARPGROUP_SIZE, input_type=a,
        b_type="" if a == b else b,
        operands=(FragmentOperand("a", a, 64, 32, 16, WGMMA_FP8_A),
                  FragmentOperand("c", "f32", 64, n, elements, _wgmma_accumulator(n)),
                  FragmentOperand("d", "f32", 64, n, elements, _wgmma_accumulator(n))),
    )


def _mma(name: str, ptx: str, m: int, n: int, k: int, ab: str, cd: str,
         a: Layout, b: Layout, c: Layout) -> MatrixIntrinsic:
    per_lane = WARP_SIZE
    return MatrixIntrinsic(
        name=name, ptx=ptx, kind="mma", shape=(m, n, k),
        operands=(
            FragmentOperand("a", ab, m, k, m * k // per_lane, a),
            FragmentOperand("b", ab, k, n, k * n // per_lane, b),
            FragmentOperand("c", cd, m, n, m * n // per_lane, c),
            FragmentOperand("d", cd, m, n, m * n // per_lane, c),
        ),
    )


def _ldmatrix(matrices: int, transpose: bool) -> MatrixIntrinsic:
    suffix = f".x{matrices}" + (".trans" if transpose else "")
    rows = 8 * matrices
    layout = _ldmatrix_layout(matrices, transpose)
    return MatrixIntrinsic(
        name=f"ldmatrix{suffix}", ptx=f"ldmatrix.sync.aligned.m8n8{suffix}.shared.b16", kind="ldmatrix",
        shape=(rows, 8, 0), operands=(FragmentOperand("d", "b16", rows, 8, 2 * matrices, layout),),
        matrices=matrices, transpose=transpose, address=LDMATRIX_ADDRESS,
    )


_ROWS = (
    _mma("mma.m16n8k16.f32.f16", "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32", 16, 8, 16,
         "f16", "f32", M16N8K16_A, M16N8K16_B, M16N8_C),
    _mma("mma.m16n8k16.f32.bf16", "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32", 16, 8, 16,
         "bf16", "f32", M16N8K16_A, M16N8K16_B, M16N8_C),
    _mma("mma.m16n8k16.f16.f16", "mma.sync.aligned.m16n8k16.row.col.f16.f16.f16.f16", 16, 8, 16,
         "f16", "f16", M16N8K16_A, M16N8K16_B, M16N8_C),
    _mma("mma.m16n8k8.f32.tf32", "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32", 16, 8, 8,
         "tf32", "f32", M16N8K8_TF32_A, M16N8K8_TF32_B, M16N8_C),
) + tuple(_ldmatrix(x, t) for x in (1, 2, 4) for t in (False, True)) \
  + tuple(_wgmma(n, ab) for ab in ("f16", "bf16") for n in WGMMA_N) \
  + tuple(_wgmma_tf32(n) for n in WGMMA_N) \
  + tuple(_wgmma_fp8(n, a, b) for a in FP8_TYPES for b in FP8_TYPES for n in WGMMA_N)

TABLE: dict[str, MatrixIntrinsic] = {row.name: row for row in _ROWS}


def lookup(name: str) -> MatrixIntrinsic:
    """The table row called `name`, or IntrinsicError listing the rows."""
    row = TABLE.get(name)
    if row is None:
        raise IntrinsicError(f"no matrix intrinsic {name!r}; the table has {', '.join(TABLE)}")
    return row

