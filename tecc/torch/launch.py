"""The launch list of a planned graph: programs, ATen calls and views in order, over slots.

Order: the program of level 0, the ATen ops of level 0 (in graph order), the program of level
1, ... (graph.py defines the levels). A view that leaves a program is made right before its first
reader, the seed of the random ops (graph.py) right before the first program that reads it.
Every slot is freed after the last step that reads it.
"""

from __future__ import annotations

import operator
from typing import Any, Sequence

import torch
from torch.fx import Node

from ..compiler.kernel import Kernel
from ..ir.expr import Var
from .graph import ATEN, FILLER, SCALAR, SEED, TECC, GraphPlan, is_view_node, view_base
from .lowering.context import static_int, torch_dtype_of
from .runtime import CompiledGraph, MakeView, RunAten, RunProgram, Size, Slot, Step


class _Assembler:
    def __init__(self, plan: GraphPlan, kernels: Sequence[Kernel], emulate: bool) -> None:
        self.plan = plan
        self.kernels = kernels
        self.emulate = emulate
        self.slot: dict[Node, int] = {}
        self.steps: list[Step] = []
        self.reads: list[set[int]] = []
        placeholders = [n for n in plan.gm.graph.nodes if n.op == "placeholder"]
        for position, node in enumerate(placeholders):
            self.slot[node] = position
        self.inputs = len(placeholders)
        self.count = self.inputs

    def new_slot(self, node: Node) -> int:
        self.slot[node] = self.count
        self.count += 1
        return self.slot[node]

    def add(self, step: Step, reads: set[int]) -> None:
        self.steps.append(step)
        self.reads.append(reads)

    # ---- argument templates -----------------------------------------------------------------
    def template(self, a: Any, reads: set[int]) -> Any:
        if isinstance(a, Node):
            return self.reference(a, reads)
        if isinstance(a, list):
            return [self.template(x, reads) for x in a]
        if isinstance(a, tuple):
            return tuple(self.template(x, reads) for x in a)
        if isinstance(a, dict):
            return {k: self.template(v, reads) for k, v in a.items()}
        if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return self.size(a)
        return a

    def size(self, value: Any) -> Any:
        expr = self.plan.sizes.expr(value)
        return expr if isinstance(expr, (int, bool)) else Size(expr)

    def reference(self, node: Node, reads: set[int]) -> Any:
        kind = self.plan.kinds.get(node)
        if kind == SCALAR:
            return self.size(node.meta["val"])
        if kind == FILLER and node not in self.slot:
            val = node.meta.get("val")
            if not isinstance(val, torch.Tensor):
                return None
            shape = tuple(self.size(s) for s in val.shape)
            self.add(RunAten(torch.zeros, (shape,), {"dtype": val.dtype, "device": val.device}, self.new_slot(node),
                             node.name), set())
        if kind == SEED and node not in self.slot:  # drawn right before the first program reading it
            self.aten(node)
        if node not in self.slot and kind == TECC and is_view_node(node, self.plan.kinds):
            self.make_view(node)
        if node not in self.slot:
            raise AssertionError(f"no runtime value for {node.name} ({kind})")
        reads.add(self.slot[node])
        return Slot(self.slot[node])

    def make_view(self, node: Node) -> None:
        base = view_base(node, self.plan.kinds)
        chain: list[Node] = []
        at = node
        while at is not base:
            chain.append(at)
            at = at.args[0]  # type: ignore[assignment]
        reads: set[int] = set()
        base_ref = self.reference(base, reads)
        links = []
        for link in reversed(chain):
            fn = _view_fn(link)
            links.append((fn, self.template(tuple(link.args[1:]), reads), self.template(dict(link.kwargs), reads)))
        out = self.new_slot(node)
        self.add(MakeView(base_ref.index, tuple(links), out, node.name), reads)

    # ---- steps ------------------------------------------------------------------------------
    def program(self, index: int) -> None:
        seg = self.plan.segments[index]
        reads: set[int] = set()
        inputs = tuple(self.reference(n, reads).index for n in seg.inputs)
        contiguous = tuple(t.op.strides is None for t in seg.args[: len(seg.inputs)])  # type: ignore[union-attr]
        outputs = []
        for node, t in zip(seg.outputs, seg.args[seg.outputs_start:]):
            outputs.append((self.new_slot(node), tuple(_size(s) for s in t.shape), torch_dtype_of(t.dtype)))
        val = seg.outputs[0].meta.get("val")
        device = val.device if isinstance(val, torch.Tensor) else "cpu"
        self.add(RunProgram(self.kernels[index], inputs, contiguous, tuple(outputs), self.emulate, seg.name,
                            tuple(seg.carriers), device, tuple(seg.input_orders), tuple(seg.output_orders)), reads)

    def aten(self, node: Node) -> None:
        reads: set[int] = set()
        args = self.template(tuple(node.args), reads)
        kwargs = self.template(dict(node.kwargs), reads)
        fn = node.target
        assert callable(fn)
        self.add(RunAten(fn, args, kwargs, self.new_slot(node), node.name), reads)

    def assemble(self) -> CompiledGraph:
        plan = self.plan
        by_level: dict[int, int] = {}
        for seg in plan.segments:
            by_level[plan.level[seg.nodes[0]]] = seg.index
        fallbacks: dict[int, list[Node]] = {}
        for node in plan.gm.graph.nodes:
            if plan.kinds.get(node) == ATEN:
                fallbacks.setdefault(plan.level[node], []).append(node)
        for lvl in sorted(set(by_level) | set(fallbacks)):
            if lvl in by_level:
                self.program(by_level[lvl])
            for node in fallbacks.get(lvl, []):
                self.aten(node)
        output_node = next(n for n in plan.gm.graph.nodes if n.op == "output")
        reads: set[int] = set()
        outputs = self.template(output_node.args[0], reads)
        frees = self._frees(reads)
        return CompiledGraph(plan.name, self.inputs, self.count, self.steps, frees, outputs, self._size_sources())

    def _frees(self, kept: set[int]) -> list[tuple[int, ...]]:
        """After each step, the slots no later step reads (outputs are kept)."""
        last: dict[int, int] = {}
        for position, reads in enumerate(self.reads):
            for s in reads:
                last[s] = position
        frees: list[list[int]] = [[] for _ in self.steps]
        for s, position in last.items():
            if s not in kept:
                frees[position].append(s)
        # values written but never read (a program's output only another output shares) stay
        return [tuple(sorted(f)) for f in frees]

    def _size_sources(self) -> list[tuple[Var, int, int | None]]:
        """Where each size variable's value comes from: an int input, or an input's dimension."""
        found: list[tuple[Var, int, int | None]] = []
        seen: set[Any] = set()
        placeholders = [n for n in self.plan.gm.graph.nodes if n.op == "placeholder"]
        for position, node in enumerate(placeholders):
            val = node.meta.get("val")
            candidates: list[tuple[Any, int | None]] = []
            if isinstance(val, torch.SymInt):
                candidates.append((val.node.expr, None))
            elif isinstance(val, torch.Tensor):
                candidates.extend((s.node.expr, d) for d, s in enumerate(val.shape) if isinstance(s, torch.SymInt))
            for expr, dim in candidates:
                if expr in self.plan.sizes.vars and expr not in seen:
                    seen.add(expr)
                    found.append((self.plan.sizes.vars[expr], position, dim))
        return found


def _size(s: Any) -> Any:
    n = static_int(s)
    return n if n is not None else s


def _view_fn(node: Node) -> Any:
    """What makes this view in torch, on a base that is ours (contiguous where eager's may not
    be): reshape where eager had view (a view of a contiguous tensor never fails, and reshape is
    one then), the op itself otherwise."""
    target = node.target
    if target is operator.getitem:
        return operator.getitem
    if target in (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default):
        return torch.ops.aten.reshape.default
    return target


def assemble(plan: GraphPlan, kernels: Sequence[Kernel], emulate: bool) -> CompiledGraph:
    return _Assembler(plan, kernels, emulate).assemble()
