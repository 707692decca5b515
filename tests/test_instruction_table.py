"""The instruction rows of the intrinsic table (tecc.ir.instructions): one statement class driven by
data. Each row prints, emits inline PTX and runs in the emulator from its entry; the constructors
under the IR's earlier class names build, recognise (isinstance) and dispatch (visit_<Name>) them;
saved loop IR written with the earlier class names still reads.

The expected IR text and CUDA below are what the per-class printer and emitters wrote before the
rows replaced them, so a change to either is a change of the generated code, on purpose or not.
"""

from __future__ import annotations

from typing import Any

import pytest

from tecc.codegen.cuda_expr import ExprEmitter
from tecc.codegen.instructions import instruction
from tecc.codegen.ranges import RangeEnv
from tecc.ir import dtype as dt
from tecc.ir.errors import DTypeError, ScheduleError
from tecc.ir.expr import Var
from tecc.ir.instructions import CONSTRUCTORS, ROWS, TABLE, IntrinsicError
from tecc.ir.loop_json import module_from_json, module_to_json
from tecc.ir.stmt import (
    AsyncCommit,
    AsyncProxyFence,
    AsyncWait,
    BarrierArrive,
    BarrierExpectTx,
    BarrierInit,
    BarrierRef,
    BarrierWait,
    Buffer,
    BulkCommit,
    BulkWait,
    Instruction,
    Module,
    NamedBarrier,
    PrimFunc,
    SetMaxRegisters,
    TensorMap,
    TensorMapPrefetch,
    WarpgroupCommit,
    WarpgroupFence,
    WarpgroupWait,
    seq,
)
from tecc.ir.visitor import StmtMutator, StmtVisitor
from tecc.ir.expr_visitor import ExprMutator
from tecc.runtime.sim.instructions import SEMANTICS

BARS = Buffer("bar", dt.int64, (2,), "shared")
ACC = Buffer("acc", dt.float32, (4,), "fragment", fragment=("wgmma.m64n8k16.f32.f16", "d"))
A_MAP = TensorMap(Buffer("A", dt.float16, (256, 256)), (64, 64), "128B")
P = Var("p")


def _emit(s: Instruction) -> list[str]:
    expr = ExprEmitter(lambda v: v.name, lambda b: b.name, set(), RangeEnv())
    return instruction(expr, s, {id(ACC): 2})


# (statement, printed IR, CUDA lines) as the per-class printer and emitters wrote them
CASES: list[tuple[Instruction, str, list[str]]] = [
    (AsyncCommit(), "cp.async.commit_group()", ['asm volatile("cp.async.commit_group;\\n" ::: "memory");']),
    (AsyncWait(1), "cp.async.wait_group(1)", ['asm volatile("cp.async.wait_group 1;\\n" ::: "memory");']),
    (WarpgroupFence(), "wgmma.fence()", ['asm volatile("wgmma.fence.sync.aligned;\\n" ::: "memory");']),
    (WarpgroupCommit(), "wgmma.commit_group()", ['asm volatile("wgmma.commit_group.sync.aligned;\\n" ::: "memory");']),
    (WarpgroupWait(0, (ACC,)), "wgmma.wait_group(0, acc)",
     ['asm volatile("wgmma.wait_group.sync.aligned 0;\\n" ::: "memory");',
      'asm volatile("" : "+f"(acc[0]) :: "memory");', 'asm volatile("" : "+f"(acc[1]) :: "memory");']),
    (AsyncProxyFence(), "fence.proxy.async()", ['asm volatile("fence.proxy.async.shared::cta;\\n" ::: "memory");']),
    (SetMaxRegisters(240, True), "setmaxnreg.inc(240)",
     ['asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\\n" ::: "memory");']),
    (SetMaxRegisters(40, False), "setmaxnreg.dec(40)",
     ['asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\\n" ::: "memory");']),
    (BarrierInit(BarrierRef(BARS, 1), 128), "mbarrier.init(bar[1], count=128)",
     ['asm volatile(', '  "mbarrier.init.shared::cta.b64 [%0], %1;\\n"', '  :',
      '  : "r"(static_cast<unsigned>(__cvta_generic_to_shared(&bar[1]))), "r"(static_cast<unsigned>(128))',
      '  : "memory");']),
    (BarrierArrive(BarrierRef(BARS, 0)), "mbarrier.arrive(bar[0])",
     ['asm volatile(', '  "mbarrier.arrive.shared::cta.b64 _, [%0];\\n"', '  :',
      '  : "r"(static_cast<unsigned>(__cvta_generic_to_shared(&bar[0])))', '  : "memory");']),
    (BarrierExpectTx(BarrierRef(BARS, 0), 4096), "mbarrier.arrive_expect_tx(bar[0], bytes=4096)",
     ['asm volatile(', '  "mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\\n"', '  :',
      '  : "r"(static_cast<unsigned>(__cvta_generic_to_shared(&bar[0]))), "r"(static_cast<unsigned>(4096))',
      '  : "memory");']),
    (BarrierWait(BarrierRef(BARS, 0), P), "mbarrier.wait(bar[0], parity=p)",
     ['asm volatile(', '  "{\\n"', '  ".reg .pred done;\\n"', '  "TECC_WAIT:\\n"',
      '  "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\\n"', '  "@!done bra TECC_WAIT;\\n"', '  "}\\n"',
      '  :', '  : "r"(static_cast<unsigned>(__cvta_generic_to_shared(&bar[0]))), "r"(static_cast<unsigned>(p))',
      '  : "memory");']),
    (BulkCommit(), "cp.async.bulk.commit_group()",
     ['asm volatile(', '  "cp.async.bulk.commit_group;\\n"', '  :', '  :', '  : "memory");']),
    (BulkWait(2), "cp.async.bulk.wait_group.read(2)",
     ['asm volatile(', '  "cp.async.bulk.wait_group.read 2;\\n"', '  :', '  :', '  : "memory");']),
    (NamedBarrier(1, 256), "bar.sync(1, threads=256)",
     ['asm volatile(', '  "bar.sync %0, 256;\\n"', '  :', '  : "r"(static_cast<unsigned>(1))', '  : "memory");']),
    # a row added after the classes: the TMA descriptor prefetch, the map's parameter by address
    (TensorMapPrefetch(A_MAP), "prefetch.tensormap(A_tmap)",
     ['asm volatile(', '  "prefetch.tensormap [%0];\\n"', '  :',
      '  : "l"(reinterpret_cast<unsigned long long>(&A_tmap))', '  : "memory");']),
]


@pytest.mark.parametrize("s,text,cuda", CASES, ids=[c[1] for c in CASES])
def test_rows_print_and_emit_as_the_classes_they_replaced(s: Instruction, text: str, cuda: list[str]) -> None:
    assert str(s) == text
    assert _emit(s) == cuda


def test_every_row_has_a_case_emulator_semantics_and_a_constructor() -> None:
    assert {c[0].name for c in CASES} == set(TABLE)
    assert set(SEMANTICS) == set(TABLE), "a row without emulator semantics (tecc/runtime/sim/instructions.py)"
    assert {k.row.name for k in CONSTRUCTORS.values()} == set(TABLE)
    assert len(ROWS) == len(TABLE)


def test_constructors_build_recognise_and_default_like_the_classes() -> None:
    w = WarpgroupWait(1)
    assert isinstance(w, Instruction) and isinstance(w, WarpgroupWait) and not isinstance(w, AsyncWait)
    assert isinstance(w, (AsyncWait, WarpgroupWait))
    assert (w.pending, w.accumulators) == (1, ())
    assert AsyncWait().pending == 0 and AsyncWait(pending=3).pending == 3
    wait = BarrierWait(bar=BarrierRef(BARS, 0), parity=1)
    assert wait.bar.buffer is BARS and str(wait.parity) == "1" and wait.dispatch_name == "BarrierWait"
    assert not isinstance(BarrierArrive(BarrierRef(BARS, 0)), BarrierWait)
    with pytest.raises(AttributeError):
        w.parity  # noqa: B018 - an operand the row does not have
    with pytest.raises(IntrinsicError, match="needs its operand 'bar'"):
        BarrierArrive()
    with pytest.raises(IntrinsicError, match="unexpected or repeated operand"):
        AsyncWait(1, pending=2)


@pytest.mark.parametrize("build,error,match", [
    (lambda: AsyncWait(8), IntrinsicError, "cp.async.wait_group takes a constant 0..7"),
    (lambda: WarpgroupWait(-1), IntrinsicError, "wgmma.wait_group takes a constant 0..7"),
    (lambda: WarpgroupWait(0, (BARS,)), IntrinsicError, "accumulator bar must be a fragment buffer"),
    (lambda: BulkWait(8), IntrinsicError, r"pending must be an integer in \[0, 8\)"),
    (lambda: SetMaxRegisters(100, True), IntrinsicError, "multiple of 8 in"),
    (lambda: BarrierInit(BarrierRef(BARS, 0), 0), IntrinsicError, r"count must lie in \[1, "),
    (lambda: BarrierExpectTx(BarrierRef(BARS, 0), 1 << 21), IntrinsicError, "bytes must lie in"),
    (lambda: BarrierWait(BarrierRef(BARS, 0), 2), IntrinsicError, "parity must be 0 or 1"),
    (lambda: BarrierWait(BarrierRef(BARS, 0), 0.5), DTypeError, "parity must be an integer"),
    (lambda: BarrierInit(BARS, 1), IntrinsicError, "must be a BarrierRef"),
    (lambda: NamedBarrier(0, 256), ScheduleError, "barrier id must be 1..15"),
    (lambda: NamedBarrier(1, 100), ScheduleError, "positive multiple of 32"),
    (lambda: TensorMapPrefetch(BARS), IntrinsicError, "prefetch.tensormap: the operand must be a TensorMap"),
])
def test_rows_check_their_operands(build: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        build()


def _kernel() -> PrimFunc:
    body = seq(*(c[0] for c in CASES))
    return PrimFunc("k", (), body)


def test_visitors_dispatch_on_the_constructor_name_then_on_instruction() -> None:
    seen: list[str] = []

    class Named(StmtVisitor):
        def visit_BarrierWait(self, s: Any) -> None:
            seen.append("wait")

        def visit_Instruction(self, s: Instruction) -> None:
            seen.append(s.name)

    Named().visit(_kernel().body)
    assert seen == ["wait" if c[0].name == "mbarrier.try_wait.parity" else c[0].name for c in CASES]


def test_the_mutator_rewrites_expr_and_barrier_operands_and_keeps_the_rest() -> None:
    func = _kernel()
    assert StmtMutator().visit_func(func) is func

    class Swap(ExprMutator):
        def visit_Var(self, v: Var) -> Any:
            return Var("q") if v is P else v

    class Rewrite(StmtMutator):
        expr_mutator = Swap()

    out = Rewrite().visit_func(func)
    assert "parity=q" in str(out) and str(out).replace("parity=q", "parity=p") == str(func)
    kept = [a is b for a, b in zip(out.body.stmts, func.body.stmts)]  # type: ignore[attr-defined]
    assert kept == [c[0].name != "mbarrier.try_wait.parity" for c in CASES]


def test_saved_loop_ir_reads_back_and_old_class_names_still_read() -> None:
    module = Module("m", (), (_kernel(),), ())
    text = module_to_json(module)
    assert '"class":"Instruction"' in text
    assert str(module_from_json(text)) == str(module)
    # a document written when these were classes: the class name and the operands by keyword
    new_form = '{"class":"Instruction","args":{"name":"cp.async.bulk.wait_group.read","operands":{"tuple":[2]}}}'
    old = text.replace(new_form, '{"class":"BulkWait","args":{"pending":2}}')
    assert old != text
    assert str(module_from_json(old)) == str(module)
