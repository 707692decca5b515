"""The intrinsic table pinned against the PTX ISA's fragment figures.

Each expected position below is typed independently from the ISA's figures ("Matrix fragments
for mma.m16n8k16 with floating point type", "... mma.m16n8k8 with .tf32", "ldmatrix"), in the
ISA's own words (groupID, threadID_in_group, per-element cases), not from the table's formulas.
"""

from __future__ import annotations

import numpy as np
import pytest

from tecc.ir import dtype as dt
from tecc.ir.expr import Var
from tecc.ir.evaluate import evaluate_int
from tecc.ir.intrinsics import TABLE, IntrinsicError, lookup


def _isa_m16n8k16_a(lane: int, i: int) -> tuple[int, int]:
    group, tig = lane >> 2, lane & 3
    row = group if i in (0, 1, 4, 5) else group + 8
    col = tig * 2 + (i & 1) if i < 4 else tig * 2 + (i & 1) + 8
    return row, col


def _isa_m16n8k16_b(lane: int, i: int) -> tuple[int, int]:
    group, tig = lane >> 2, lane & 3
    row = tig * 2 + (i & 1) if i < 2 else tig * 2 + (i & 1) + 8
    return row, group


def _isa_m16n8_c(lane: int, i: int) -> tuple[int, int]:
    group, tig = lane >> 2, lane & 3
    row = group if i < 2 else group + 8
    return row, tig * 2 + (i & 1)


def _isa_m16n8k8_tf32_a(lane: int, i: int) -> tuple[int, int]:
    group, tig = lane >> 2, lane & 3
    row = group if i in (0, 2) else group + 8
    col = tig if i in (0, 1) else tig + 4
    return row, col


def _isa_m16n8k8_tf32_b(lane: int, i: int) -> tuple[int, int]:
    group, tig = lane >> 2, lane & 3
    return (tig if i == 0 else tig + 4), group


def _isa_ldmatrix(transpose: bool):  # type: ignore[no-untyped-def]
    def position(lane: int, i: int) -> tuple[int, int]:
        # register i // 2 holds matrix i // 2; each thread gets two consecutive elements of row
        # lane / 4 (or, transposed, of column lane / 4).
        matrix, within = i >> 1, i & 1
        row, col = lane >> 2, (lane & 3) * 2 + within
        if transpose:
            row, col = col, row
        return matrix * 8 + row, col
    return position


ISA = {
    ("mma.m16n8k16.f32.f16", "a"): _isa_m16n8k16_a, ("mma.m16n8k16.f32.f16", "b"): _isa_m16n8k16_b,
    ("mma.m16n8k16.f32.f16", "c"): _isa_m16n8_c, ("mma.m16n8k16.f32.f16", "d"): _isa_m16n8_c,
    ("mma.m16n8k16.f32.bf16", "a"): _isa_m16n8k16_a, ("mma.m16n8k16.f32.bf16", "b"): _isa_m16n8k16_b,
    ("mma.m16n8k16.f32.bf16", "c"): _isa_m16n8_c, ("mma.m16n8k16.f32.bf16", "d"): _isa_m16n8_c,
    ("mma.m16n8k16.f16.f16", "a"): _isa_m16n8k16_a, ("mma.m16n8k16.f16.f16", "b"): _isa_m16n8k16_b,
    ("mma.m16n8k16.f16.f16", "c"): _isa_m16n8_c, ("mma.m16n8k16.f16.f16", "d"): _isa_m16n8_c,
    ("mma.m16n8k8.f32.tf32", "a"): _isa_m16n8k8_tf32_a, ("mma.m16n8k8.f32.tf32", "b"): _isa_m16n8k8_tf32_b,
    ("mma.m16n8k8.f32.tf32", "c"): _isa_m16n8_c, ("mma.m16n8k8.f32.tf32", "d"): _isa_m16n8_c,
}
for _x in (1, 2, 4):
    ISA[(f"ldmatrix.x{_x}", "d")] = _isa_ldmatrix(False)
    ISA[(f"ldmatrix.x{_x}.trans", "d")] = _isa_ldmatrix(True)

# Warp-level rows (32 lanes); the warpgroup (wgmma) rows are pinned in tests/test_hopper_ir.py.
CASES = [(row.name, op.role) for row in TABLE.values() if row.threads == 32 for op in row.operands]


def test_every_row_and_operand_has_an_isa_reference() -> None:
    assert sorted(CASES) == sorted(ISA), "a table row without an independent ISA check, or a stale check"


@pytest.mark.parametrize("name,role", CASES)
def test_layout_map_matches_the_isa_at_every_lane_and_element(name: str, role: str) -> None:
    op = lookup(name).operand(role)
    want = ISA[(name, role)]
    for lane in range(32):
        for i in range(op.elements):
            got = op.layout(lane, i)
            assert got == want(lane, i), f"{name} operand {role}: lane {lane} element {i} -> {got}, ISA {want(lane, i)}"


@pytest.mark.parametrize("name,role", CASES)
def test_layout_map_is_a_bijection_onto_the_tile(name: str, role: str) -> None:
    op = lookup(name).operand(role)
    assert 32 * op.elements == op.rows * op.cols, f"{name} {role}: {op.elements} per lane do not tile {op.rows}x{op.cols}"
    seen = {op.layout(lane, i) for lane in range(32) for i in range(op.elements)}
    assert seen == {(r, c) for r in range(op.rows) for c in range(op.cols)}


@pytest.mark.parametrize("name,role", CASES)
def test_layout_map_gives_the_same_answer_on_numpy_arrays_and_exprs(name: str, role: str) -> None:
    op = lookup(name).operand(role)
    lanes = np.arange(32)[:, None]
    elems = np.arange(op.elements)[None, :]
    rows, cols = (np.broadcast_to(x, (32, op.elements)) for x in op.layout(lanes, elems))
    lane_var, elem_var = Var("lane"), Var("e")
    erow, ecol = op.layout(lane_var, elem_var)
    for lane in range(0, 32, 5):
        for i in range(op.elements):
            env = {lane_var: lane, elem_var: i}
            want = op.layout(lane, i)
            assert (int(rows[lane, i]), int(cols[lane, i])) == want
            assert (evaluate_int(erow, env), evaluate_int(ecol, env)) == want


def test_rows_declare_register_packing_and_dtypes() -> None:
    f16 = lookup("mma.m16n8k16.f32.f16")
    assert [(o.role, o.dtype, o.elements, o.registers) for o in f16.operands] == [
        ("a", dt.float16, 8, 4), ("b", dt.float16, 4, 2), ("c", dt.float32, 4, 4), ("d", dt.float32, 4, 4)]
    half_acc = lookup("mma.m16n8k16.f16.f16")
    assert (half_acc.operand("d").dtype, half_acc.operand("d").registers) == (dt.float16, 2)
    tf32 = lookup("mma.m16n8k8.f32.tf32")
    assert (tf32.operand("a").dtype, tf32.operand("a").registers, tf32.operand("a").convert) == (
        dt.float32, 4, "cvt.rna.tf32.f32")
    assert lookup("ldmatrix.x4.trans").ptx == "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16"
    assert lookup("ldmatrix.x2").operand("d").registers == 2 and lookup("ldmatrix.x2").address_lanes == 16
    assert f16.ptx == "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"


def test_unknown_row_names_the_table() -> None:
    with pytest.raises(IntrinsicError, match="no matrix intrinsic 'mma.m16n8k32.s32.s8'; the table has"):
        lookup("mma.m16n8k32.s32.s8")


# ---- shared-memory layouts --------------------------------------------------------------------

from tecc.ir.layout import LayoutError, Swizzle  # noqa: E402


@pytest.mark.parametrize("bits,base,shift", [(3, 3, 3), (2, 3, 3), (3, 2, 4), (1, 0, 1)])
def test_swizzle_is_a_bijection_on_each_period_and_keeps_chunks_contiguous(bits: int, base: int, shift: int) -> None:
    sw = Swizzle(bits, base, shift)
    offsets = np.arange(4 * sw.period)
    physical = sw.apply(offsets)
    for p in range(4):
        block = physical[p * sw.period:(p + 1) * sw.period]
        assert sorted(block.tolist()) == list(range(p * sw.period, (p + 1) * sw.period))
    chunks = physical.reshape(-1, sw.contiguous)
    assert (np.diff(chunks, axis=1) == 1).all()
    v = Var("o")
    for o in (0, 7, sw.period + 3, 4 * sw.period - 1):
        assert evaluate_int(sw.apply(v), {v: o}) == sw.apply(o) == int(physical[o])


def test_swizzle_3_3_3_xors_the_16_byte_chunk_with_the_row() -> None:
    sw = Swizzle(3, 3, 3)
    # row r of a 64-element half tile, chunk c (8 halves) lands in chunk c ^ (r % 8)
    for r in range(16):
        for c in range(8):
            assert sw.apply(r * 64 + c * 8) == r * 64 + (c ^ (r % 8)) * 8


def test_swizzle_refuses_overlapping_bits_and_buffers_that_are_not_whole_periods() -> None:
    with pytest.raises(LayoutError, match="shift >= bits"):
        Swizzle(3, 3, 2)
    with pytest.raises(LayoutError, match="pad it to a multiple of 512"):
        Swizzle(3, 3, 3).check_fits("As", 16 * 24)
