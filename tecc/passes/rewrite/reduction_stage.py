"""The reduction stage a split rewrite takes (split_rows, split_reduce): after elementwise
producers are inlined, the program is ONE compute stage holding ONE Reduce over axes that start
at 0, with no reduction inside it. Each rewrite adds its own conditions on top (split_reduce:
one axis and an output of rank >= 1; split_rows: extents free of the output's axes).

`LoweredReduction` is what both rewrites start their kernels from: the stage's program with its
buffers, size variables and fresh names, the inliner of its producers, and `finish`, the stage's
body around the combined accumulator (what the last kernel writes for each output)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ...ir.errors import ScheduleError
from ...ir.expr import Expr, Reduce, cast, const_int, substitute, walk
from ...ir.stmt import Buffer
from ...ir.tensor import ComputeOp, Tensor
from ...ir.visitor import ExprMutator
from ..lower import Inliner, Program, Signature, choose_inlined, collect_program, signature


def reduction_stage(args: Sequence[Tensor], rewrite: str) -> tuple[Tensor, Reduce]:
    """The one reduction stage of the program `args` and its Reduce, or a ScheduleError that
    names `rewrite` and the condition that fails."""
    prog = choose_inlined(collect_program(args))
    if len(prog.stages) != 1:
        raise ScheduleError(f"{rewrite}: the program has {len(prog.stages)} stages after inlining; one is needed")
    (t,) = prog.stages
    op = t.op
    assert isinstance(op, ComputeOp)
    reduces = {id(n): n for n in walk(op.body) if isinstance(n, Reduce)}
    if len(reduces) != 1:
        raise ScheduleError(f"{rewrite}: {t.name} has {len(reduces)} reductions; one is needed")
    (r,) = reduces.values()
    if any(const_int(ax.lo) != 0 for ax in r.axes):
        raise ScheduleError(f"{rewrite}: {t.name} reduces over an axis that does not start at 0")
    if any(isinstance(n, Reduce) for n in walk(r.source) if n is not r):
        raise ScheduleError(f"{rewrite}: {t.name} has a reduction inside a reduction")
    return t, r


@dataclass
class LoweredReduction:
    """The reduction stage `stage` (its Reduce `red`, its compute `op`) of the program `args`,
    ready for a split rewrite's kernels: `sig` holds the arguments' global buffers, the size
    variables and the names taken (`sig.unique` makes new ones), `inliner` inlines the
    producers into the stage's expressions."""

    stage: Tensor
    red: Reduce
    op: ComputeOp
    program: Program
    sig: Signature
    inliner: Inliner

    @classmethod
    def of(cls, args: Sequence[Tensor], stage: Tensor, red: Reduce) -> LoweredReduction:
        """`stage` and `red` (from reduction_stage) lowered: the signature of `args`' program."""
        prog = choose_inlined(collect_program(args))
        op = stage.op
        assert isinstance(op, ComputeOp)
        sig = signature(prog)
        return cls(stage, red, op, prog, sig, Inliner(prog.inlined, sig.buffers))

    @property
    def out(self) -> Buffer:
        """The stage's output buffer."""
        return self.sig.buffers[self.stage]

    def finish(self, acc: Expr, index: tuple[Expr, ...]) -> Expr:
        """The stage's body at output `index` with its Reduce replaced by the combined
        accumulator `acc` (a mean's 1/N, a cast to bf16, ...: applied once, to the total)."""

        class _Finish(ExprMutator):
            def visit_Reduce(self, r: Reduce) -> Expr:  # noqa: N805
                return cast(acc, r.dtype)

        op = self.op
        return self.inliner.visit(_Finish().visit(substitute(op.body, dict(zip(op.axes, index)))))


__all__ = ["LoweredReduction", "reduction_stage"]
