"""What a compile did, for people: which ops fell back to ATen and why, which kernel computes
each FX node, and the dumps (`options={"dump_ir": DIR}`).

    DIR/<graph>/graph.txt          the ATen graph as AOTAutograd gave it (shapes, dtypes)
    DIR/<graph>/nodes.txt          every FX node: computed by which program and kernel, or run
                                   as ATen and why
    DIR/<graph>/<program>/         tc.build's dumps of each program (00_lower.txt, one file per
                                   schedule step, NN_cuda.cu, ...), plus program.txt (the tensor
                                   expressions and the signature) and explain.txt (the plan)

`reports()` keeps the reports of this process's recent compiles (newest last). A graph loaded
from the disk cache has its report stored with it: this module imports the graph planner (for
`GraphReport.of`, the placement and the dumps) only when a compile asks for them.
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from torch.fx import Node

from ..ir.tensor import ComputeOp, Tensor

if TYPE_CHECKING:
    from ..compiler.kernel import Kernel
    from .graph import GraphPlan

_RECENT: deque["GraphReport"] = deque(maxlen=64)


@dataclass
class GraphReport:
    """One compiled ATen graph: its programs, its fallbacks and where each node runs."""

    name: str
    programs: list[tuple[str, list[str]]]            # (program, its kernels)
    fallbacks: dict[str, list[tuple[str, str]]]      # ATen op -> [(FX node, reason)]
    placement: dict[str, str] = field(default_factory=dict)  # FX node -> where it runs
    seconds: float = 0.0
    # plan="auto" candidates that took a program and failed to build it: (program, candidate, why)
    plan_fallbacks: list[tuple[str, str, str]] = field(default_factory=list)

    @staticmethod
    def of(plan: GraphPlan, kernels: Sequence[Kernel], seconds: float) -> "GraphReport":
        from .graph import op_name

        programs = [(seg.name, [k.name for k in kernel.module.kernels]) for seg, kernel in zip(plan.segments, kernels)]
        fallbacks: dict[str, list[tuple[str, str]]] = {}
        for node in plan.fallbacks:
            fallbacks.setdefault(op_name(node.target), []).append((node.name, plan.reasons.get(node, "")))
        failed = [(seg.name, who, why) for seg, kernel in zip(plan.segments, kernels) for who, why in kernel.fallbacks]
        return GraphReport(plan.name, programs, fallbacks, placement(plan, kernels), seconds, failed)

    @property
    def fallback_ops(self) -> list[str]:
        return sorted(self.fallbacks)

    def fallback_message(self) -> str:
        lines = [f"tecc: graph {self.name}: {sum(len(v) for v in self.fallbacks.values())} node(s) run as ATen:"]
        for op, nodes in sorted(self.fallbacks.items()):
            names = ", ".join(n for n, _ in nodes[:8]) + (", ..." if len(nodes) > 8 else "")
            lines.append(f"  {op} ({len(nodes)}: {names}): {nodes[0][1]}")
        return "\n".join(lines)

    def plan_fallback_message(self) -> str:
        """The programs whose chosen strategy failed to build (a strategy bug the build survived)."""
        return "\n".join(f"tecc: graph {self.name}, program {program}: {who} failed ({why}); built with the "
                         "next candidate" for program, who, why in self.plan_fallbacks)

    def summary(self) -> str:
        kernels = sum(len(k) for _, k in self.programs)
        return (f"tecc: graph {self.name}: {len(self.programs)} program(s), {kernels} kernel(s), "
                f"{sum(len(v) for v in self.fallbacks.values())} ATen fallback(s), compiled in {self.seconds:.1f} s")


def record(report: GraphReport) -> None:
    _RECENT.append(report)


def reports() -> list[GraphReport]:
    """The reports of this process's recent compiles, oldest first."""
    return list(_RECENT)


def clear_reports() -> None:
    _RECENT.clear()


# ---- the node -> kernel map ---------------------------------------------------------------------
def _consumers(outputs: Sequence[Tensor]) -> dict[int, list[Tensor]]:
    """compute -> the computes that read it, over the program that computes `outputs`."""
    readers: dict[int, list[Tensor]] = {}
    seen: set[int] = set()
    stack = list(outputs)
    while stack:
        t = stack.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        for src in t.op.input_tensors:
            readers.setdefault(id(src), []).append(t)
            stack.append(src)
    return readers


def _kernels_of(t: Tensor, kernel_names: Sequence[str], readers: dict[int, list[Tensor]],
                memo: dict[int, set[str]]) -> set[str]:
    """The kernels that compute t: its own (named after it), else those of its readers, into
    which it was inlined."""
    if id(t) in memo:
        return memo[id(t)]
    memo[id(t)] = set()
    own = {k for k in kernel_names if k == f"{t.name}_kernel" or k.startswith(f"{t.name}_")}
    if own:
        memo[id(t)] = own
        return own
    found: set[str] = set()
    for r in readers.get(id(t), []):
        found |= _kernels_of(r, kernel_names, readers, memo)
    memo[id(t)] = found
    return found


def placement(plan: GraphPlan, kernels: Sequence[Kernel]) -> dict[str, str]:
    from .graph import ATEN, INPUT, SCALAR, SEED, TECC, is_view_node

    out: dict[str, str] = {}
    where: dict[Node, str] = {}
    for seg, kernel in zip(plan.segments, kernels):
        names = [k.name for k in kernel.module.kernels]
        outputs = seg.args[seg.outputs_start:]
        readers = _consumers(outputs)
        memo: dict[int, set[str]] = {}
        for node in seg.nodes:
            value = seg.values.get(node)
            tensors = value if isinstance(value, tuple) else (value,)
            found: set[str] = set()
            for t in tensors:
                if isinstance(t, Tensor) and isinstance(t.op, ComputeOp):
                    found |= _kernels_of(t, names, readers, memo)
            view = " (a view: an index expression)" if is_view_node(node, plan.kinds) else ""
            where[node] = (f"{seg.name}: {', '.join(sorted(found))}{view}" if found
                           else f"{seg.name}: not needed by its outputs{view}")
    for node in plan.gm.graph.nodes:
        kind = plan.kinds.get(node)
        if kind == INPUT:
            out[node.name] = "input"
        elif kind == SCALAR:
            out[node.name] = "size, evaluated on the host"
        elif kind == SEED:
            out[node.name] = "the random ops' seed, drawn by torch's generator at each call"
        elif kind == ATEN:
            reason = plan.reasons.get(node, "")
            out[node.name] = f"ATen{': ' + reason if reason else ''}"
        elif kind == TECC:
            out[node.name] = where.get(node, "computed in another program (re-lowered there)")
    return out


# ---- dumps -------------------------------------------------------------------------------------
def _node_line(node: Node, where: str) -> str:
    from .graph import op_name

    val = node.meta.get("val")
    shape = ""
    if hasattr(val, "shape") and hasattr(val, "dtype"):
        shape = f"{str(val.dtype).replace('torch.', '')}[{', '.join(str(s) for s in val.shape)}]"
    target = op_name(node.target) if node.op == "call_function" else node.op
    return f"{node.name:32s} {target:48s} {shape:28s} {where}"


def write_dumps(directory: str, plan: GraphPlan, kernels: Sequence[Kernel], report: GraphReport) -> None:
    root = os.path.join(directory, plan.name)
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, "graph.txt"), "w") as f:
        f.write(plan.gm.print_readable(print_output=False))
    with open(os.path.join(root, "nodes.txt"), "w") as f:
        f.write(f"# graph {plan.name}: FX node, op, result, where it runs\n")
        for node in plan.gm.graph.nodes:
            if node.op == "output":
                continue
            f.write(_node_line(node, report.placement.get(node.name, "")) + "\n")
    for seg, kernel in zip(plan.segments, kernels):
        folder = os.path.join(root, seg.name)
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "program.txt"), "w") as f:
            f.write(program_text(seg.args, seg.outputs_start))
        with open(os.path.join(folder, "explain.txt"), "w") as f:
            f.write(kernel.explain())


def program_text(args: Sequence[Tensor], inputs: int) -> str:
    """The tensor expressions of a program, producers first, then its signature."""
    order: list[Tensor] = []
    seen: set[int] = set()

    def visit(t: Tensor) -> None:
        if id(t) in seen:
            return
        seen.add(id(t))
        for src in t.op.input_tensors:
            visit(src)
        if isinstance(t.op, ComputeOp):
            order.append(t)

    for t in args[inputs:]:
        visit(t)
    lines = ["# inputs"] + [f"{t.name}: {t.dtype.name}[{', '.join(map(str, t.shape))}]" for t in args[:inputs]]
    lines.append("# computes (outputs marked *)")
    outputs = {id(t) for t in args[inputs:]}
    for t in order:
        mark = "*" if id(t) in outputs else " "
        lines.append(f"{mark} {t.dtype.name}[{', '.join(map(str, t.shape))}] {t}")
    return "\n".join(lines) + "\n"
