"""An ATen FX graph as tensor-expression programs: which nodes tecc computes, which run as ATen,
and the programs (segments) the computed nodes form.

1. **Classify.** Every node is lowered once in graph order (lowering/): a node whose lowering
   raises `Unsupported`, or whose op has none, runs as ATen (a *fallback*, with the reason);
   nodes that compute symbolic sizes are evaluated on the host. A graph with random ops gets a
   *seed node* first (`aten.randint` of one int64, run as ATen at each call before the first
   program that reads it): the random ops read it as an input (lowering/random.py).
2. **Levels.** A computed node's level is the number of fallbacks it must wait for: the highest
   level among its computed inputs, and one past every fallback it reads. A fallback runs after
   the program of the highest level among its inputs. So the graph becomes programs and ATen
   calls in order, and an ATen op splits the graph only for what depends on it: with no
   fallback, the whole graph is ONE program.
3. **Segments.** The nodes of one level are lowered again as one program of their own: values
   that come from elsewhere (graph inputs, ATen results, other programs' outputs) become
   placeholders, and a view of such a value is re-lowered here as an index expression on it.
   A node is an output of its program when something outside reads it (the graph's outputs, an
   ATen op, another program), directly or through views.

`tc.build` then plans each program (runtime.py); its planner, not this module, decides where the
program's kernels begin and end.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch.fx import GraphModule, Node

from ..ir import dtype as dt
from ..ir.expr import Const, Var, free_vars
from ..ir.tensor import ComputeOp, Tensor, compute, placeholder
from .lowering import (LOWERINGS, RANDOM_OPS, LoweringContext, RandomDraws, Sizes, Unsupported, is_view, tecc_dtype,
                       why_not)
from .lowering.context import Namer, boundary_order, dense_order, in_order, memory_order, to_order

# node kinds: a graph input; computed by a tecc program; run as ATen; a size evaluated on the
# host; an output of a lowered op that tecc does not compute (attention's random-generator state
# with dropout off, ...), made by torch as zeros of its shape and dtype, or None; the seed of the
# graph's random ops, drawn by ATen at each call (an input of the programs: it splits none)
INPUT, TECC, ATEN, SCALAR, FILLER, SEED = "input", "tecc", "aten", "scalar", "filler", "seed"


@dataclass
class Segment:
    """One tensor-expression program: the computed nodes of one level."""

    index: int
    name: str
    nodes: list[Node]                                   # computed here, in graph order (views too)
    inputs: list[Node] = field(default_factory=list)    # placeholders, in signature order
    outputs: list[Node] = field(default_factory=list)   # what leaves the program, in signature order
    args: list[Tensor] = field(default_factory=list)    # the signature: placeholders, then outputs
    values: dict[Node, Any] = field(default_factory=dict)  # every node's value in this program
    # sizes no argument's dimension gives alone (only in products like 2·s0): each is passed
    # as a placeholder of that length and stride 0 after the inputs ("carriers"), so the
    # kernel binds it as it binds any dimension
    carriers: list[Var] = field(default_factory=list)
    # per input and per output: None, or the memory order of a channels_last tensor, which the
    # program takes and writes in that order (the runtime permutes: no copy)
    input_orders: list[tuple[int, ...] | None] = field(default_factory=list)
    output_orders: list[tuple[int, ...] | None] = field(default_factory=list)

    @property
    def outputs_start(self) -> int:
        return len(self.inputs) + len(self.carriers)


@dataclass
class GraphPlan:
    """What runs where: each node's kind, level and (for fallbacks) reason, and the segments."""

    gm: GraphModule
    name: str
    sizes: Sizes
    kinds: dict[Node, str]
    reasons: dict[Node, str]
    level: dict[Node, int]
    segments: list[Segment]
    seed: Node | None = None

    @property
    def fallbacks(self) -> list[Node]:
        return [n for n, k in self.kinds.items() if k == ATEN and n.target is not operator.getitem]

    def fallback_summary(self) -> dict[str, list[str]]:
        """ATen op -> the FX nodes of it that run as ATen."""
        out: dict[str, list[str]] = {}
        for n in self.fallbacks:
            out.setdefault(op_name(n.target), []).append(n.name)
        return out


def op_name(target: Any) -> str:
    return str(target) if isinstance(target, torch._ops.OpOverload) else getattr(target, "__name__", str(target))


def is_view_node(node: Node, kinds: dict[Node, str]) -> bool:
    """A computed node whose value views its first argument (a getitem of a split too)."""
    if kinds.get(node) != TECC:
        return False
    if node.target is operator.getitem:
        parent = node.args[0]
        return isinstance(parent, Node) and is_view_node(parent, kinds)
    return is_view(node.target)


def view_base(node: Node, kinds: dict[Node, str]) -> Node:
    """The node a chain of views starts from (a materialized value, or a graph input / ATen result)."""
    while is_view_node(node, kinds):
        parent = node.args[0]
        assert isinstance(parent, Node)
        node = parent
    return node


def _scalar_value(node: Node) -> Any:
    val = node.meta.get("val")
    return val if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)) else None


class _Lowerer:
    """Lowers nodes into one program; values from outside become placeholders."""

    def __init__(self, sizes: Sizes, kinds: dict[Node, str], inside: Callable[[Node], bool],
                 random: RandomDraws | None = None, seed: Node | None = None) -> None:
        read_seed = None if seed is None else (lambda: self.placeholder(seed))
        self.ctx = LoweringContext(sizes, Namer(), random, read_seed)
        self.sizes = sizes
        self.kinds = kinds
        self.inside = inside
        self.values: dict[Node, Any] = {}
        self.placeholders: dict[Node, Tensor] = {}
        self.orders: dict[Node, tuple[int, ...] | None] = {}   # per placeholder (Segment.input_orders)
        self.logical: dict[Node, Tensor] = {}                   # a placeholder in memory order, as read

    def value(self, node: Node) -> Any:
        if node in self.values:
            return self.values[node]
        kind = self.kinds.get(node)
        value: Any
        if kind == SCALAR:
            value = self.sizes.expr(_scalar_value(node))
        elif kind == FILLER:
            value = None
        elif kind == TECC and (self.inside(node) or is_view_node(node, self.kinds)):
            value = self.lower(node)
        else:
            value = self.placeholder(node)
        self.values[node] = value
        return value

    def placeholder(self, node: Node) -> Tensor:
        """A value from outside as this program reads it: a placeholder, or the logical view of a
        placeholder in the value's memory order (channels_last, a transposed matrix:
        `boundary_order`)."""
        found = self.logical.get(node, self.placeholders.get(node))
        if found is not None:
            return found
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise Unsupported(f"{node.name} is not a tensor")
        shape = self.sizes.shape(val.shape)
        name = self.ctx.namer(node.name)
        order = self.orders[node] = boundary_order(val)
        if order is not None:
            stored = self.placeholders[node] = placeholder(tuple(shape[d] for d in order), tecc_dtype(val.dtype),
                                                           name=name)
            made = self.logical[node] = in_order(stored, order, self.ctx.namer(node.name + "_logical"))
            return made
        made = self.placeholders[node] = placeholder(shape, tecc_dtype(val.dtype), name=name,
                                                     strides=_strides(val, name, shape))
        return made

    def argument(self, a: Any) -> Any:
        if isinstance(a, Node):
            return self.value(a)
        if isinstance(a, (list, tuple)):
            return type(a)(self.argument(x) for x in a)
        if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return self.sizes.expr(a)
        return a

    def lower(self, node: Node) -> Any:
        if node.target is operator.getitem:
            parent = self.value(node.args[0])  # type: ignore[arg-type]
            return parent[node.args[1]]
        lowering = LOWERINGS.get(node.target)
        if lowering is None:
            raise Unsupported(why_not(node.target))
        self.ctx.node = node
        try:
            value = _empty_result(self.ctx)  # needs no argument (one may have a dtype tecc lacks)
            if value is None:
                args = [self.argument(a) for a in node.args]
                kwargs = {k: self.argument(v) for k, v in node.kwargs.items()}
                self.ctx.node = node  # lowering the arguments may have lowered other nodes
                value = lowering(self.ctx, *args, **kwargs)
        finally:
            self.ctx.node = None
        self.values[node] = value
        return value


def _empty_result(ctx: LoweringContext) -> Tensor | None:
    """A result with no elements (a dimension of size 0): a compute of its shape and dtype,
    whatever the op, since there is nothing to compute."""
    val = ctx.meta
    if not isinstance(val, torch.Tensor) or not any(isinstance(s, int) and s == 0 for s in val.shape):
        return None
    d = tecc_dtype(val.dtype)
    return ctx.compute(ctx.out_shape(), lambda *idx: Const(False if d.is_bool else 0, d))


def _strides(val: torch.Tensor, name: str, shape: Sequence[Any]) -> Any:
    """A placeholder's strides: None (row-major) for a contiguous value, and for one whose last
    dimension is not of stride 1 (the runtime passes such a value made contiguous: every
    program's rows are then contiguous, as the staged copies of the tensor-core strategies need,
    an attention's log-sum-exp laid out (B, S, H) included); else a stride parameter per
    dimension and 1 for the last (a permuted or sliced tensor whose rows are contiguous: read in
    place)."""
    if _contiguous(val):
        return None
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    try:
        # a symbolic stride is asked without a guard: int() of it specializes its symbol (a
        # tensor the min-cut partitioner saves for the backward of tests/test_torch_backend.py's
        # GPT under dynamic=True pinned the sequence length: a recompile per length)
        unit = val.ndim > 0 and statically_known_true(val.stride()[-1] == 1)
    except Exception:  # noqa: BLE001 - a symbolic stride torch cannot decide: any strides
        return "any"
    if not unit:
        return None
    wide = any(getattr(s, "dtype", None) == dt.int64 for s in shape)
    made: list[Any] = [Var(f"{name}_stride{i}", dt.int64 if wide else dt.int32, "stride") for i in range(val.ndim)]
    made[-1] = 1
    return tuple(made)


def _contiguous(val: torch.Tensor) -> bool:
    try:
        return bool(val.is_contiguous())
    except Exception:  # noqa: BLE001 - a symbolic stride torch cannot decide: accept any
        return False


def seed_node(gm: GraphModule) -> Node | None:
    """The graph's seed node, added after its inputs when a node draws random numbers: one int64
    from torch's default generator of the device of the first such node (module docstring)."""
    drawing = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in RANDOM_OPS]
    if not drawing:
        return None
    val = drawing[0].meta.get("val")
    device = val.device if isinstance(val, torch.Tensor) else torch.device("cpu")
    first = next(n for n in gm.graph.nodes if n.op != "placeholder")
    with gm.graph.inserting_before(first):
        node = gm.graph.create_node("call_function", torch.ops.aten.randint.low, (0, 2**63 - 1, [1]),
                                    {"dtype": torch.int64, "device": device}, name="tecc_seed")
    node.meta["val"] = torch.empty((1,), dtype=torch.int64, device="meta")
    return node


def classify(gm: GraphModule, sizes: Sizes, bound: set[Any], random: RandomDraws | None = None,
             seed: Node | None = None) -> tuple[dict[Node, str], dict[Node, str]]:
    """Each node's kind (input / tecc / aten / scalar / seed), and why each fallback is one."""
    kinds: dict[Node, str] = {}
    reasons: dict[Node, str] = {}
    lowerer = _Lowerer(sizes, kinds, lambda n: True, random, seed)
    for node in gm.graph.nodes:
        if node is seed:
            kinds[node] = SEED
            continue
        if node.op == "placeholder":
            kinds[node] = SCALAR if _scalar_value(node) is not None else INPUT
            continue
        if node.op == "output":
            continue
        scalar = _scalar_value(node)
        if scalar is not None and _backed(scalar, bound):
            kinds[node] = SCALAR
            continue
        if node.op != "call_function":
            kinds[node], reasons[node] = ATEN, f"{node.op} nodes run in Python"
            continue
        if node.target is operator.getitem:
            parent = node.args[0]
            if isinstance(parent, Node) and kinds.get(parent) == TECC:
                element = lowerer.value(parent)[node.args[1]]
                kinds[node] = TECC if isinstance(element, Tensor) else FILLER
            else:
                kinds[node] = ATEN
            continue
        kinds[node] = TECC
        try:
            lowerer.lower(node)
        except Unsupported as exc:
            kinds[node], reasons[node] = ATEN, str(exc)
        except Exception as exc:  # noqa: BLE001 - a case the lowering did not foresee (a bug): run it
            # as ATen and say so; fallback="error" turns it into the compile's error
            kinds[node], reasons[node] = ATEN, f"lowering failed ({type(exc).__name__}: {exc})"
    return kinds, reasons


def _backed(value: Any, bound: set[Any]) -> bool:
    """Whether a scalar's value follows from the graph's inputs (no data-dependent symbol)."""
    if isinstance(value, (int, float, bool)):
        return True
    expr = value.node.expr
    return all(s in bound for s in expr.free_symbols)


def levels(gm: GraphModule, kinds: dict[Node, str]) -> dict[Node, int]:
    """The level of every computed and fallback node (module docstring, step 2)."""
    level: dict[Node, int] = {}
    for node in gm.graph.nodes:
        kind = kinds.get(node)
        if kind not in (TECC, ATEN):
            continue
        best = 0
        for a in node.all_input_nodes:
            k = kinds.get(a)
            if k == TECC:
                best = max(best, level[a])
            elif k == ATEN:
                best = max(best, level[a] + 1 if kind == TECC else level[a])
        level[node] = best
    return level


def users_outside(node: Node, kinds: dict[Node, str], level: dict[Node, int], home: int) -> bool:
    """Whether anything outside program `home` reads `node`, directly or through views."""
    for user in node.users:
        kind = kinds.get(user)
        if user.op == "output" or kind == ATEN:
            return True
        if kind == TECC and is_view_node(user, kinds):
            if users_outside(user, kinds, level, home):
                return True
        elif kind == TECC and level[user] != home:
            return True
    return False


def segments(gm: GraphModule, name: str, sizes: Sizes, kinds: dict[Node, str],
             level: dict[Node, int], random: RandomDraws | None = None, seed: Node | None = None) -> list[Segment]:
    """The programs, one per level, lowered with their placeholders and outputs."""
    by_level: dict[int, list[Node]] = {}
    for node in gm.graph.nodes:
        if kinds.get(node) == TECC:
            by_level.setdefault(level[node], []).append(node)
    out: list[Segment] = []
    for index, lvl in enumerate(sorted(by_level)):
        members = by_level[lvl]
        seg = Segment(index, f"{name}_p{index}", members)
        home = set(members)
        lowerer = _Lowerer(sizes, kinds, lambda n, home=home: n in home, random, seed)  # type: ignore[misc]
        for node in members:
            lowerer.value(node)
        outputs = [n for n in members if not is_view_node(n, kinds) and isinstance(lowerer.values.get(n), Tensor)
                   and users_outside(n, kinds, level, lvl)]
        seg.values = lowerer.values
        seg.inputs = list(lowerer.placeholders)
        seg.input_orders = [lowerer.orders.get(n) for n in seg.inputs]
        seg.outputs = outputs
        outs = _distinct_outputs(seg, lowerer)
        seg.carriers = _unbound_sizes(list(lowerer.placeholders.values()) + outs)
        carriers = [placeholder((v,), "int32", name=lowerer.ctx.namer(f"{v.name}_carrier"), strides="any")
                    for v in seg.carriers]
        seg.args = list(lowerer.placeholders.values()) + carriers + outs
        if outputs:
            out.append(seg)
    for index, seg in enumerate(out):
        seg.index = index
    return out


def _distinct_outputs(seg: Segment, lowerer: _Lowerer) -> list[Tensor]:
    """The output tensors, each a compute of its own: an output that is a placeholder or another
    output's tensor is written by an identity compute (build takes each tensor once). A value
    computed in its memory order (LoweringContext.compute) is written in that order, one whose
    eager strides are another dense order (`dense_order`) by a compute in that order."""
    seen: set[int] = {id(t) for t in lowerer.placeholders.values()}
    tensors = []
    seg.output_orders = []
    for node in seg.outputs:
        t = lowerer.values[node]
        stored, order = lowerer.ctx.stored.get(id(t), (t, None))
        if id(stored) not in seen:
            t = stored
            if order is None and (order := _write_order(node, t)) is not None:
                t = to_order(t, order, lowerer.ctx.namer(node.name + "_ordered"))
        else:
            order = None
            if id(t) in seen:
                source = t
                t = compute(source.shape, lambda *idx, s=source: s[idx], name=lowerer.ctx.namer(node.name + "_copy"))
                seg.values[node] = t
        seen.add(id(t))
        tensors.append(t)
        seg.output_orders.append(order)
    return tensors


def _write_order(node: Node, t: Tensor) -> tuple[int, ...] | None:
    """The memory order an output `t` computed in the logical one is written in: eager's
    (`dense_order`), so that what the next program, a view or the caller is handed has the
    strides its trace saw, where `t` is elementwise (its body is inlined into the write in that
    order: no kernel more). None for a row-major or channels_last value (the latter computed in
    its order already) and for a reduction's or a contraction's result, whose kernel stores it
    in the logical order: a copy in eager's order would be a kernel more. Not yet: the attention
    templates writing their output as eager lays it out, (B, S, H, D) (then transformers'
    `transpose(1, 2).reshape(...)` of it is a view, not the runtime's copy)."""
    if isinstance(t.op, ComputeOp) and t.op.reductions:
        return None
    val = node.meta.get("val")
    return None if memory_order(val) is not None else dense_order(val)


def _unbound_sizes(args: list[Tensor]) -> list[Var]:
    """The size variables a program uses that no argument has as a whole dimension."""
    used: dict[Var, None] = {}
    seen: set[int] = set()
    stack = list(args)
    while stack:
        t = stack.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        exprs = list(t.shape) + ([t.op.body] if isinstance(t.op, ComputeOp) else [])
        for e in exprs:
            for v in sorted(free_vars(e), key=lambda v: v.name):
                if v.kind == "size":
                    used[v] = None
        stack.extend(t.op.input_tensors)
    whole = {d for t in args for d in t.shape if isinstance(d, Var)}
    return [v for v in used if v not in whole]


Cut = Callable[[GraphModule, dict[Node, str], dict[Node, int]], dict[Node, int]]


def plan_graph(gm: GraphModule, name: str, sizes: Sizes, bound: set[Any], cut: Cut | None = None) -> GraphPlan:
    """The graph's plan; with `cut`, its levels renumbered by it (a backward graph's levels cut
    into parts for memory: memory_parts.split_levels, which backend.plan_graph passes)."""
    seed = seed_node(gm)
    random = RandomDraws()
    kinds, reasons = classify(gm, sizes, bound, random, seed)
    level = levels(gm, kinds)
    if cut is not None:
        level = cut(gm, kinds, level)
    return GraphPlan(gm, name, sizes, kinds, reasons, level, segments(gm, name, sizes, kinds, level, random, seed),
                     seed)
