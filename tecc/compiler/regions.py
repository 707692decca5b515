"""A program built in parts: cut a program into sub-programs, schedule each with its own plan,
and compose their modules into ONE module (one host program launching every kernel).

This is how a graph-level rewrite (the online contraction, row fusion, ...) applies to a part of
a larger program: those rewrites take a whole program, so the part they recognise is cut out
(region_search.py finds it), planned by the rewrite, and composed with the rest, which the
per-kernel planner plans. The plan of such a build is a list of `region` steps, one per part in
launch order, each naming the part's outputs and holding the part's own plan; replaying it
(`replay`) cuts and schedules the same parts and composes them again, deterministically.

**Cutting.** The part that computes `outputs` reads the program's placeholders and the outputs
of earlier parts (its *boundaries*); a read of a boundary becomes a read of a placeholder of the
same name, shape and dtype, and every compute between is rebuilt around it (elementwise
computes that two parts read are computed in both, as lowering inlines them anyway).

**Composing.** The module's parameters are the program's; a boundary tensor becomes a
temporary of the composed module (the host allocates it once per call, as it allocates any
stage); each part's temporaries and kernels keep their names unless another part took them
first. A call of a part's kernel passes the composed module's buffer of the same name.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable, Sequence

from ..ir.expr import Expr, TensorRead
from ..ir.stmt import Buffer, KernelCall, KernelParam, Module, PrimFunc
from ..ir.tensor import ComputeOp, Tensor, placeholder, producers_first
from ..ir.visitor import ExprMutator
from ..passes.lower import collect_program, signature
from ..passes.names import fresh_name
from .plan import Plan, Step

REGION = "region"


def by_name(args: Sequence[Tensor]) -> dict[str, Tensor]:
    """Every tensor of the program `args`, by name (names are unique in a program)."""
    prog = collect_program(args)
    return {t.name: t for t in prog.graph.nodes}


class _Rebuild(ExprMutator):
    def __init__(self, cutter: "_Cutter") -> None:
        super().__init__()
        self.cutter = cutter

    def visit_TensorRead(self, e: TensorRead) -> Expr:
        idx = tuple(self.visit(i) for i in e.indices)
        t = self.cutter.tensor(e.tensor)
        if t is e.tensor and all(a is b for a, b in zip(idx, e.indices)):
            return e
        return TensorRead(t, idx)


class _Cutter:
    def __init__(self, boundaries: set[int]) -> None:
        self.boundaries = boundaries
        self.memo: dict[int, Tensor] = {}
        self.placeholders: list[Tensor] = []

    def tensor(self, t: Tensor) -> Tensor:
        found = self.memo.get(id(t))
        if found is not None:
            return found
        if t.is_placeholder:
            made = t
            self.placeholders.append(t)
        elif id(t) in self.boundaries:
            made = placeholder(t.shape, t.dtype, name=t.name)
            self.placeholders.append(made)
        else:
            op = t.op
            assert isinstance(op, ComputeOp)
            body = _Rebuild(self).visit(op.body)
            made = t if body is op.body else Tensor(ComputeOp(op.name, op.axes, body), t.shape, t.dtype)
        self.memo[id(t)] = made
        return made


def cut(outputs: Sequence[Tensor], boundaries: Iterable[Tensor]) -> list[Tensor]:
    """The signature of the part computing `outputs` (module docstring): its placeholders, in
    the order first read, then its outputs (rebuilt where they read a boundary)."""
    cutter = _Cutter({id(b) for b in boundaries} - {id(o) for o in outputs})
    # the rebuild recurses through a tensor's producers: a region at the end of resnet50's graph
    # (its average pool) reaches back through every layer, so the producers are rebuilt first and
    # each rebuild recurses through its own body only (ir/tensor.py producers_first)
    computed = [o for o in outputs if not o.is_placeholder]
    for t in producers_first(computed, stop=lambda t: id(t) in cutter.boundaries):
        cutter.tensor(t)
    made = [cutter.tensor(o) if not o.is_placeholder else o for o in outputs]
    return list(dict.fromkeys(cutter.placeholders)) + made


def compose(args: Sequence[Tensor], parts: Sequence[Module], name: str) -> Module:
    """One module running `parts` in order, with the signature of the program `args`."""
    sig = signature(collect_program(args))
    taken = set(sig.names)
    params = {b.name: b for b in (sig.buffers[a] for a in args)}
    temps: dict[str, Buffer] = {}
    kernels: list[PrimFunc] = []
    calls: list[KernelCall] = []
    kernel_names: set[str] = set()
    for part in parts:
        local: dict[int, KernelParam] = {}
        for p in part.params:
            if not isinstance(p, Buffer):
                local[id(p)] = p        # a size or stride variable: the program's own
            elif p.name in params:
                local[id(p)] = params[p.name]
            else:                       # a boundary: the composed module's temporary
                if p.name not in temps:
                    temps[p.name] = replace(p, name=p.name, strides=None, zero_init=False)
                    taken.add(p.name)
                local[id(p)] = temps[p.name]
        for t in part.temps:
            fresh = fresh_name(t.name, taken, sep="_")
            local[id(t)] = temps[fresh] = t if fresh == t.name else replace(t, name=fresh)
        renamed: dict[str, str] = {}
        for k in part.kernels:
            fresh = fresh_name(k.name, kernel_names, sep="_")
            renamed[k.name] = fresh
            kernels.append(k if fresh == k.name else replace(k, name=fresh))
        for c in part.calls:
            calls.append(KernelCall(renamed[c.kernel], tuple(local.get(id(a), a) for a in c.args)))
    module_params = tuple(sig.buffers[a] for a in args) + tuple(sig.scalars)
    return Module(name, module_params, tuple(kernels), tuple(calls), tuple(temps.values()))


def is_composed(plan: Plan) -> bool:
    return bool(plan.steps) and plan.steps[0].primitive == REGION


def region_step(outputs: Sequence[Tensor], plan: Plan) -> Step:
    return Step(REGION, {"outputs": [t.name for t in outputs], "plan": plan.to_dict()})


def parts_of(args: Sequence[Tensor], plan: Plan) -> list[tuple[list[Tensor], Plan]]:
    """The parts a composed plan names: each part's signature and its own plan."""
    tensors = by_name(args)
    done: list[Tensor] = []
    out = []
    for step in plan.steps:
        if step.primitive != REGION:
            continue
        outputs = [tensors[n] for n in step.args["outputs"]]
        out.append((cut(outputs, done), Plan.from_json(step.args["plan"])))
        done.extend(outputs)
    return out


def replay(args: Sequence[Tensor], plan: Plan, name: str) -> Module:
    """The composed module of a plan of `region` steps (module docstring)."""
    from .schedule import Schedule

    modules = []
    for number, (part, part_plan) in enumerate(parts_of(args, plan)):
        steps = Plan(tuple(s for s in part_plan.steps if s.primitive != "default_schedule"))
        modules.append(Schedule(part, steps, name=f"{name}_part{number}").mod)
    return compose(args, modules, name)


def default_threads(plan: Plan, fallback: int) -> int:
    """The threads of the naive kernels of a composed plan: its last part's default_schedule."""
    for step in reversed(plan.steps):
        if step.primitive == REGION:
            for inner in Plan.from_json(step.args["plan"]).steps:
                if inner.primitive == "default_schedule":
                    return int(inner.args.get("threads", fallback))
    return fallback


__all__ = ["REGION", "compose", "cut", "default_threads", "is_composed", "parts_of", "region_step", "replay"]
