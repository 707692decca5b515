"""The Hopper level of the IR: wgmma rows, matrix descriptors, warpgroup and mbarrier statements.

The accumulator map and the descriptor address function are pinned against the PTX ISA typed
here independently: the accumulator figure of wgmma .m64nNk16 ("Register fragment layout for
accumulator matrix D") in the ISA's terms, and the canonical shared-memory layouts of the
"Shared Memory Matrix Layout" table in CuTe's (shape):(stride) notation, evaluated by a small
generic interpreter, with the swizzle applied to byte addresses as the ISA states it.
"""

from __future__ import annotations

import numpy as np
import pytest
from hopper_kernels import k_major, mn_major, wgmma_kernel

from tecc.ir import dtype as dt
from tecc.ir.descriptor import DescriptorError, MatrixDescriptor
from tecc.ir.errors import DTypeError, ScheduleError
from tecc.ir.evaluate import evaluate_int
from tecc.ir.expr import Var, index_expr
from tecc.ir.intrinsics import TABLE, WGMMA_N, IntrinsicError, lookup
from tecc.ir.layout import Swizzle
from tecc.ir.loop_json import module_from_json, module_to_json
from tecc.ir.stmt import (
    BarrierExpectTx,
    BarrierRef,
    BarrierWait,
    Buffer,
    BulkCopy,
    FragmentRef,
    KernelCall,
    Module,
    PrimFunc,
    SetMaxRegisters,
    SharedMatrix,
    WarpgroupMatrixMultiply,
    WarpgroupWait,
)
from tecc.ir.visitor import ExprMutator, StmtMutator, StmtVisitor, VarSubstituter
from tecc.passes.verify import verify_func

WGMMA_ROWS = [name for name, row in TABLE.items() if row.kind == "wgmma"]


# ---- the accumulator map ------------------------------------------------------------------------

def _isa_wgmma_d(thread: int, i: int) -> tuple[int, int]:
    """The ISA's figure: warp w of the warpgroup holds rows 16w..16w+15; in it, lane groupID g
    and threadID_in_group t hold d[i] at row g (i % 4 < 2) or g + 8, column 8 * (i / 4) + 2t + i % 2."""
    warp, lane = thread >> 5, thread & 31
    group, tig = lane >> 2, lane & 3
    row = 16 * warp + group + (8 if (i & 3) >= 2 else 0)
    col = 8 * (i >> 2) + 2 * tig + (i & 1)
    return row, col


def test_the_table_has_f16_and_bf16_rows_for_every_n() -> None:
    for n in (64, 128, 256):
        for ab in ("f16", "bf16"):
            row = lookup(f"wgmma.m64n{n}k16.f32.{ab}")
            assert row.ptx == f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ab}.{ab}"
            assert row.threads == 128 and row.min_arch == 90 and row.input_type == ab
            assert row.operand("d").elements == n // 2 and row.operand("d").registers == n // 2
    assert set(WGMMA_N) >= {64, 128, 256}


@pytest.mark.parametrize("name", WGMMA_ROWS)
def test_accumulator_map_matches_the_isa_and_is_a_bijection(name: str) -> None:
    op = lookup(name).operand("d")
    seen = set()
    for thread in range(128):
        for i in range(op.elements):
            got = op.layout(thread, i)
            assert got == _isa_wgmma_d(thread, i), f"{name}: thread {thread} element {i} -> {got}"
            seen.add(got)
    assert seen == {(r, c) for r in range(64) for c in range(op.cols)}


def test_accumulator_map_agrees_on_ints_arrays_and_exprs() -> None:
    op = lookup("wgmma.m64n128k16.f32.f16").operand("d")
    threads, elems = np.arange(128)[:, None], np.arange(op.elements)[None, :]
    rows, cols = (np.broadcast_to(x, (128, op.elements)) for x in op.layout(threads, elems))
    tv, ev = Var("t"), Var("e")
    erow, ecol = op.layout(tv, ev)
    for t in range(0, 128, 7):
        for i in range(0, op.elements, 5):
            want = op.layout(t, i)
            assert (rows[t, i], cols[t, i]) == want
            assert (evaluate_int(erow, {tv: t, ev: i}), evaluate_int(ecol, {tv: t, ev: i})) == want


# ---- descriptors against the canonical layouts ---------------------------------------------------

def _cute(shape: tuple, stride: tuple, coord: int) -> int:
    """A 1-D coordinate into a hierarchical (shape):(stride) mode, colexicographic as in CuTe."""
    if isinstance(shape, int):
        return coord * stride
    offset = 0
    for s, d in zip(shape, stride):
        size = int(np.prod(s)) if not isinstance(s, int) else s
        offset += _cute(s, d, coord % size)
        coord //= size
    return offset


BIG = 1 << 12  # the "m" / "k" repeat counts of the ISA's table: large enough for any test tile


def _isa_canonical(major: str, swizzle: str, lbo: int, sbo: int) -> tuple[tuple, tuple]:
    """The ISA's table, T = 8 (16-bit elements), LBO and SBO in elements."""
    t = 8
    w = {"none": 1, "32B": 2, "64B": 4, "128B": 8}[swizzle]
    if major == "K":
        if swizzle == "none":
            return ((8, BIG), (t, BIG)), ((t, sbo), (1, lbo))
        return ((8, BIG), (t, BIG)), ((w * t, sbo), (1, t))
    if swizzle == "none":
        return ((t, 1, BIG), (8, BIG)), ((1, t, sbo), (t, lbo))
    return ((t, w, BIG), (8, BIG)), ((1, t, lbo), (w * t, sbo))


def _isa_swizzle_bytes(address: int, swizzle: str) -> int:
    """Bits [4, 4 + b) of the byte address XOR bits [7, 7 + b), b = 1, 2, 3 for 32, 64, 128 B."""
    b = {"none": 0, "32B": 1, "64B": 2, "128B": 3}[swizzle]
    return address ^ (((address >> 7) & ((1 << b) - 1)) << 4)


DESCRIPTORS = [MatrixDescriptor(major, swizzle, lbo, sbo) for major in ("K", "MN")
               for swizzle in ("none", "32B", "64B", "128B") for lbo, sbo in ((128, 256), (2048, 1024), (4096, 512))]


@pytest.mark.parametrize("desc", DESCRIPTORS, ids=str)
def test_descriptor_offsets_are_the_isa_canonical_layouts(desc: MatrixDescriptor) -> None:
    shape, stride = _isa_canonical(desc.major, desc.swizzle, desc.leading_bytes // 2, desc.stride_bytes // 2)
    rows = 64
    cols = 16 if desc.major == "MN" or desc.swizzle == "none" else desc.row_elements
    for start in (0, 16, 512):
        for r in range(rows):
            for c in range(cols):
                element = start + _cute(shape[0], stride[0], r) + _cute(shape[1], stride[1], c)
                want = _isa_swizzle_bytes(2 * element, desc.swizzle) // 2
                assert desc.offset(start, r, c) == want, f"{desc} start {start}: ({r}, {c})"


def test_descriptor_offsets_agree_on_arrays_and_exprs() -> None:
    desc = MatrixDescriptor("K", "128B", 16, 1024)
    r, c = np.meshgrid(np.arange(64), np.arange(16), indexing="ij")
    got = desc.offset(32, r, c)
    rv, cv = Var("r"), Var("c")
    expr = desc.offset(32, rv, cv)
    for i in range(0, 64, 3):
        for j in range(16):
            assert got[i, j] == desc.offset(32, i, j) == evaluate_int(expr, {rv: i, cv: j})


def test_a_128B_k_major_tile_is_a_swizzled_row_major_tile_whose_k_slices_start_32_bytes_apart() -> None:
    # As [64][64] halves with Swizzle(3, 3, 3): element (r, 16 s + c) is where the k16 slice s of
    # the descriptor (start 16 s) puts (r, c); the layout is the descriptor's own.
    desc = MatrixDescriptor("K", "128B", 16, 1024)
    assert desc.layout == Swizzle(3, 3, 3)
    for s in range(4):
        for r in range(64):
            for c in range(16):
                assert desc.offset(16 * s, r, c) == Swizzle(3, 3, 3).apply(r * 64 + 16 * s + c)


def test_descriptor_encoding_puts_each_field_in_its_bits() -> None:
    desc = MatrixDescriptor("K", "128B", leading_bytes=16, stride_bytes=1024)
    value = desc.encode(0x1_2400)  # a shared-window address; only bits 4..17 are kept
    assert value & 0x3FFF == (0x1_2400 >> 4) & 0x3FFF
    assert (value >> 16) & 0x3FFF == 1 and (value >> 32) & 0x3FFF == 64
    assert (value >> 49) & 0x7 == 0 and value >> 62 == 1
    assert desc.encode(0x1_2400) == desc.constant_bits() + ((0x1_2400 & 0x3FFFF) >> 4)
    codes = {s: MatrixDescriptor("MN", s, 16, 16).constant_bits() >> 62 for s in ("none", "128B", "64B", "32B")}
    assert codes == {"none": 0, "128B": 1, "64B": 2, "32B": 3}


def test_descriptor_refuses_illegal_fields() -> None:
    with pytest.raises(DescriptorError, match="multiple of 16"):
        MatrixDescriptor("K", "128B", 8, 1024)
    with pytest.raises(DescriptorError, match="major must be"):
        MatrixDescriptor("row", "128B", 16, 1024)
    with pytest.raises(DescriptorError, match="below 2"):
        MatrixDescriptor("K", "none", 16, 1 << 18)


# ---- statements -----------------------------------------------------------------------------------

def _acc(n: int = 64, ab: str = "f16") -> Buffer:
    name = f"wgmma.m64n{n}k16.f32.{ab}"
    return Buffer("acc", dt.float32, (n // 2,), "fragment", fragment=(name, "d"))


def _tile(name: str, desc: MatrixDescriptor, elements: int = 1024, dtype: dt.DType = dt.float16) -> Buffer:
    return Buffer(name, dtype, (elements,), "shared", layout=desc.layout)


def test_wgmma_constructor_validates_its_operands() -> None:
    desc = k_major("128B")
    a, b = _tile("As", desc, 4096), _tile("Bs", desc, 4096)
    ok = WarpgroupMatrixMultiply("wgmma.m64n64k16.f32.f16", FragmentRef(_acc(), 0), SharedMatrix(a, 0, desc),
                                 SharedMatrix(b, 0, desc), True)
    assert ok.row.shape == (64, 64, 16)
    with pytest.raises(IntrinsicError, match="needs a wgmma row"):
        WarpgroupMatrixMultiply("mma.m16n8k16.f32.f16", FragmentRef(_acc(), 0), SharedMatrix(a, 0, desc),
                                SharedMatrix(b, 0, desc), True)
    warp_acc = Buffer("wacc", dt.float32, (32,), "fragment", fragment=("mma.m16n8k16.f32.f16", "c"))
    with pytest.raises(IntrinsicError, match="layout or dtype differs"):
        WarpgroupMatrixMultiply("wgmma.m64n64k16.f32.f16", FragmentRef(warp_acc, 0), SharedMatrix(a, 0, desc),
                                SharedMatrix(b, 0, desc), True)
    with pytest.raises(IntrinsicError, match="outside"):
        WarpgroupMatrixMultiply("wgmma.m64n128k16.f32.f16", FragmentRef(_acc(128), 32), SharedMatrix(a, 0, desc),
                                SharedMatrix(_tile("Bw", desc, 8192), 0, desc), True)
    with pytest.raises(DTypeError, match="must be bfloat16"):
        WarpgroupMatrixMultiply("wgmma.m64n64k16.f32.bf16", FragmentRef(_acc(64, "bf16"), 0),
                                SharedMatrix(a, 0, desc), SharedMatrix(b, 0, desc), True)
    with pytest.raises(DTypeError, match="scale_d must be bool"):
        WarpgroupMatrixMultiply("wgmma.m64n64k16.f32.f16", FragmentRef(_acc(), 0), SharedMatrix(a, 0, desc),
                                SharedMatrix(b, 0, desc), Var("x"))
    with pytest.raises(DescriptorError, match="reaches past"):
        WarpgroupMatrixMultiply("wgmma.m64n64k16.f32.f16", FragmentRef(_acc(), 0), SharedMatrix(a, 0, desc),
                                SharedMatrix(_tile("small", desc, 512), 0, desc), True)
    with pytest.raises(DescriptorError, match="has layout None"):
        SharedMatrix(_tile("plain", k_major("none")), 0, desc)
    with pytest.raises(DescriptorError, match="16-byte aligned"):
        SharedMatrix(a, 4, desc)
    with pytest.raises(IntrinsicError, match="0..7"):
        WarpgroupWait(8)
    with pytest.raises(IntrinsicError, match="multiple of 8 in"):
        SetMaxRegisters(100, True)
    assert str(SetMaxRegisters(240, True)) == "setmaxnreg.inc(240)"


def test_mbarrier_statements_validate() -> None:
    bars = Buffer("bar", dt.int64, (2,), "shared")
    with pytest.raises(IntrinsicError, match="1-D int64 shared buffer"):
        BarrierRef(Buffer("b32", dt.int32, (2,), "shared"), 0)
    with pytest.raises(IntrinsicError, match="outside the buffer"):
        BarrierRef(bars, 2)
    with pytest.raises(IntrinsicError, match="parity must be 0 or 1"):
        BarrierWait(BarrierRef(bars, 0), 2)
    with pytest.raises(IntrinsicError, match=r"\[1, "):
        BarrierExpectTx(BarrierRef(bars, 0), 0)
    src, dst = Buffer("A", dt.float16, (64,)), Buffer("S", dt.float16, (64,), "shared")
    with pytest.raises(IntrinsicError, match="multiple of 16 bytes"):
        BulkCopy(dst, (0,), src, (0,), 24, BarrierRef(bars, 0))
    with pytest.raises(IntrinsicError, match="global -> shared"):
        BulkCopy(src, (0,), dst, (0,), 16, BarrierRef(bars, 0))


def test_printer_reads_like_the_program() -> None:
    text = str(wgmma_kernel(64, "f16", "128B", "128B", "K", k_steps=2))
    for line in ("mbarrier.init(bar[0], count=1)",
                 "mbarrier.arrive_expect_tx(bar[0], bytes=4096)",
                 "cp.async.bulk 16B As[",
                 "completes bar[0]",
                 "fence.proxy.async()",
                 "mbarrier.wait(bar[0], parity=0)",
                 "wgmma.fence()",
                 "wgmma.m64n64k16.f32.f16 acc[0:32] = As[desc(K-major, 128B, lbo=16, sbo=1024) @ 0] · Bs[",
                 "wgmma.m64n64k16.f32.f16 acc[0:32] += As[desc(K-major, 128B, lbo=16, sbo=1024) @ 16] · Bs[",
                 "wgmma.commit_group()",
                 "wgmma.wait_group(0, acc)"):
        assert line in text, f"{line!r} missing from\n{text}"


def test_mutator_keeps_unchanged_nodes_and_visitor_sees_every_statement() -> None:
    func = wgmma_kernel(128, "bf16", "64B", "none", "MN")
    assert StmtMutator().visit_func(func) is func

    class Same(ExprMutator):
        pass

    class Rebuild(StmtMutator):
        expr_mutator = Same()

    assert Rebuild().visit_func(func) is func
    seen: list[str] = []

    class Collect(StmtVisitor):
        def generic_visit(self, s):  # type: ignore[no-untyped-def]
            name = getattr(s, "dispatch_name", type(s).__name__)  # an instruction: its row's constructor
            if name.startswith(("Warpgroup", "Barrier", "Bulk", "AsyncProxy")) and name != "Barrier":
                seen.append(name)
            return super().generic_visit(s)

    Collect().visit(func.body)
    assert seen == ["BarrierInit", "BarrierExpectTx", "BulkCopy", "AsyncProxyFence", "BarrierWait", "WarpgroupFence",
                    "WarpgroupMatrixMultiply", "WarpgroupCommit", "WarpgroupWait"]


def test_mutator_rewrites_descriptor_starts_barrier_indices_and_counts() -> None:
    desc = k_major("128B")
    a, b = _tile("As", desc, 4096), _tile("Bs", desc, 4096)
    bars = Buffer("bar", dt.int64, (2,), "shared")
    step = Var("s")
    mma = WarpgroupMatrixMultiply("wgmma.m64n64k16.f32.f16", FragmentRef(_acc(), 0), SharedMatrix(a, 16 * step, desc),
                                  SharedMatrix(b, 0, desc), step > 0)
    wait = BarrierWait(BarrierRef(bars, step % 2), step // 2 % 2)
    expect = BarrierExpectTx(BarrierRef(bars, step % 2), 1024 * (step + 1))

    class Substitute(StmtMutator):
        expr_mutator = VarSubstituter({step: index_expr(3)})

    new_mma = Substitute().visit(mma)
    assert isinstance(new_mma, WarpgroupMatrixMultiply) and new_mma is not mma
    assert evaluate_int(new_mma.a.start, {}) == 48 and new_mma.b is mma.b and new_mma.d is mma.d
    new_wait = Substitute().visit(wait)
    assert isinstance(new_wait, BarrierWait)
    assert evaluate_int(new_wait.bar.index, {}) == 1 and evaluate_int(new_wait.parity, {}) == 1
    new_expect = Substitute().visit(expect)
    assert isinstance(new_expect, BarrierExpectTx) and evaluate_int(new_expect.bytes, {}) == 4096
    assert StmtMutator().visit(mma) is mma and StmtMutator().visit(wait) is wait


def test_verifier_accepts_the_kernel_and_finds_a_barrier_outside_its_allocation() -> None:
    verify_func(wgmma_kernel(64, "f16", "32B", "64B", "MN"))
    bars = Buffer("bar", dt.int64, (1,), "shared")
    with pytest.raises(ScheduleError, match="mbarrier uses buffer bar outside its allocation"):
        verify_func(PrimFunc("stray", (), BarrierWait(BarrierRef(bars, 0), 0)))


def test_loop_json_round_trips_the_hopper_kernel() -> None:
    func = wgmma_kernel(64, "bf16", "128B", "128B", "MN", k_steps=2)
    module = Module("m", func.params, (func,), (KernelCall(func.name, func.params),))
    text = module_to_json(module)
    back = module_from_json(text)
    assert str(back) == str(module)
    assert module_to_json(back) == text
