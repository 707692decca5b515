"""The matrix-fragment statements as IR: constructors refuse what the table forbids, the
printer reads like the program, the visitor/mutator and the verifier know every node."""

from __future__ import annotations

import pytest
from matrix_kernels import F16_F32, TF32_F32, fragment, mma_ldmatrix_kernel

from tecc.ir import dtype as dt
from tecc.ir.errors import DTypeError, ScheduleError, TeccError
from tecc.ir.expr import Var
from tecc.ir.intrinsics import IntrinsicError
from tecc.ir.layout import Swizzle
from tecc.ir.stmt import AsyncCopy, AsyncWait, Buffer, FragmentRef, MatrixLoad, MatrixMultiply, PrimFunc
from tecc.ir.visitor import ExprMutator, StmtMutator, StmtVisitor
from tecc.passes.verify import verify_func


def _mma(a: Buffer, b: Buffer, c: Buffer, intrinsic: str = F16_F32) -> MatrixMultiply:
    return MatrixMultiply(intrinsic, FragmentRef(c, 0), FragmentRef(a, 0), FragmentRef(b, 0), FragmentRef(c, 0))


def test_fragment_buffer_must_match_its_operand() -> None:
    with pytest.raises(IntrinsicError, match="stored as float16, but the buffer is float32"):
        Buffer("a", dt.float32, (8,), "fragment", fragment=(F16_F32, "a"))
    with pytest.raises(IntrinsicError, match="whole fragments of 8 elements"):
        Buffer("a", dt.float16, (12,), "fragment", fragment=(F16_F32, "a"))
    with pytest.raises(TeccError, match="needs fragment=\\(intrinsic, operand\\)"):
        Buffer("a", dt.float16, (8,), "fragment")
    with pytest.raises(TeccError, match="only a shared buffer can have a layout"):
        Buffer("r", dt.float16, (8,), "local", layout=Swizzle(1, 3, 3))
    with pytest.raises(TeccError, match="permutes blocks of 512 elements but the buffer holds 384"):
        Buffer("S", dt.float16, (16, 24), "shared", layout=Swizzle(3, 3, 3))


def test_mma_refuses_operands_of_another_layout_or_outside_the_buffer() -> None:
    a, b, c = fragment("a", F16_F32, "a"), fragment("b", F16_F32, "b"), fragment("c", F16_F32, "c")
    with pytest.raises(IntrinsicError, match="operand a b holds operand b"):
        _mma(b, b, c)
    tf_a = fragment("ta", TF32_F32, "a")
    with pytest.raises(IntrinsicError, match="layout or dtype differs"):
        _mma(tf_a, b, c)
    with pytest.raises(IntrinsicError, match="outside the buffer's 4 elements"):
        MatrixMultiply(F16_F32, FragmentRef(c, 4), FragmentRef(a, 0), FragmentRef(b, 0), FragmentRef(c, 0))
    with pytest.raises(IntrinsicError, match="MatrixMultiply needs an mma row"):
        MatrixMultiply("ldmatrix.x4", FragmentRef(c, 0), FragmentRef(a, 0), FragmentRef(b, 0), FragmentRef(c, 0))


def test_ldmatrix_and_cp_async_refuse_illegal_operands() -> None:
    a = fragment("a", F16_F32, "a")
    g = Buffer("G", dt.float16, (16, 16))
    s = Buffer("S", dt.float16, (16, 16), "shared")
    s32 = Buffer("S32", dt.float32, (16, 16), "shared")
    with pytest.raises(IntrinsicError, match="reads shared memory; G is global"):
        MatrixLoad("ldmatrix.x4", FragmentRef(a, 0), g, (0, 0))
    # float32 moves as b16 pairs (tf32 tiles, tests/test_tf32.py), but only into a float32 fragment
    with pytest.raises(DTypeError, match="is float16 but the source S32 is float32"):
        MatrixLoad("ldmatrix.x4", FragmentRef(a, 0), s32, (0, 0))
    with pytest.raises(DTypeError, match="moves 16-bit elements"):
        MatrixLoad("ldmatrix.x4", FragmentRef(a, 0), Buffer("S64", dt.float64, (16, 16), "shared"), (0, 0))
    with pytest.raises(IntrinsicError, match="must be a multiple of 2"):
        MatrixLoad("ldmatrix.x2", FragmentRef(a, 1), s, (0, 0))
    with pytest.raises(IntrinsicError, match="copies 4, 8 or 16 bytes"):
        AsyncCopy(s, (0, 0), g, (0, 0), 12)
    with pytest.raises(IntrinsicError, match="'cg' for 16-byte copies"):
        AsyncCopy(s, (0, 0), g, (0, 0), 8, cache="cg")
    with pytest.raises(IntrinsicError, match="copies global -> shared"):
        AsyncCopy(g, (0, 0), s, (0, 0), 16)
    with pytest.raises(DTypeError, match="predicate must be bool"):
        AsyncCopy(s, (0, 0), g, (0, 0), 16, predicate=Var("i"))
    with pytest.raises(IntrinsicError, match="constant 0..7"):
        AsyncWait(8)


def test_printer_reads_like_the_program() -> None:
    text = str(mma_ldmatrix_kernel(F16_F32, "mk", "kn", staging="cp.async", swizzle=True))
    for line in ("allocate As: float16[16, 16] @shared swizzle(1, 3, 3)",
                 "allocate a_frag: float16[8] @fragment(mma.m16n8k16.f32.f16.a)",
                 "cp.async.cg 16B As[lane // 2, lane % 2 * 8] <- A[lane // 2, lane % 2 * 8] if lane // 2 < rows_valid else zero",
                 "cp.async.ca 8B Bs[lane // 2, lane % 2 * 4] <- B[lane // 2, lane % 2 * 4]",
                 "cp.async.commit_group()", "cp.async.wait_group(0)",
                 "ldmatrix.x4 a_frag[0:8] <- As[",
                 "ldmatrix.x2.trans b_frag[0:4] <- Bs[",
                 "mma.m16n8k16.f32.f16 acc[0:4] += a_frag[0:8] · b_frag[0:4]"):
        assert line in text, f"{line!r} missing from\n{text}"


def test_mutator_keeps_unchanged_nodes_and_rewrites_addresses() -> None:
    func = mma_ldmatrix_kernel(F16_F32, "mk", "kn", staging="cp.async")
    assert StmtMutator().visit_func(func) is func

    class Shift(ExprMutator):
        def visit_Var(self, v: Var) -> Var:
            return v

    class Renamer(StmtMutator):
        expr_mutator = Shift()

    assert Renamer().visit_func(func) is func
    seen: list[str] = []

    class Collect(StmtVisitor):
        def visit_MatrixLoad(self, s: MatrixLoad) -> None:
            seen.append(s.intrinsic)

        def visit_AsyncCopy(self, s: AsyncCopy) -> None:
            seen.append(f"cp.async {s.bytes}")

        def visit_MatrixMultiply(self, s: MatrixMultiply) -> None:
            seen.append(s.intrinsic)

    Collect().visit(func.body)
    assert seen == ["cp.async 16", "cp.async 8", "ldmatrix.x4", "ldmatrix.x2.trans", F16_F32]


def test_verifier_accepts_the_kernels_and_finds_a_fragment_outside_its_allocation() -> None:
    verify_func(mma_ldmatrix_kernel(F16_F32, "km", "nk", staging="cp.async", swizzle=True))
    a, b, c = fragment("a", F16_F32, "a"), fragment("b", F16_F32, "b"), fragment("c", F16_F32, "c")
    with pytest.raises(ScheduleError, match="mma.m16n8k16.f32.f16 uses buffer c outside its allocation"):
        verify_func(PrimFunc("stray", (), _mma(a, b, c)))


def test_a_term_of_whole_swizzle_periods_commutes_with_the_swizzle() -> None:
    # codegen keeps such terms (the ring's stage) outside the XOR: apply(x + i*s) == apply(x) + i*s
    import numpy as np

    from tecc.ir.layout import Swizzle

    rng = np.random.default_rng(3)
    for sw in (Swizzle(2, 3, 3), Swizzle(3, 3, 3), Swizzle(3, 3, 4), Swizzle(3, 3, 5)):
        x = rng.integers(0, 1 << 16, 4096)
        for stride in (sw.period, 4 * sw.period, 3 * sw.period):
            assert sw.moves_whole_periods(stride)
            i = rng.integers(0, 64, 4096)
            assert np.array_equal(sw.apply(x + i * stride), sw.apply(x) + i * stride)
        assert not sw.moves_whole_periods(sw.period // 2)
        # and a stride that is not a whole number of periods does not commute in general
        half = sw.period // 2
        assert not np.array_equal(sw.apply(x + half), sw.apply(x) + half)
