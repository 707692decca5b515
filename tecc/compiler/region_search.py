"""Where a graph-level strategy applies inside a larger program: the regions of the planner
(step 6 of tecc/compiler/planner.py).

The graph strategies (the online contraction and its backward, row fusion, split rows, ...) each
take a whole program. In a program of many stages (a model's graph) this module finds the parts
they take:

1. **Seeds**: every stage that reduces over one axis (a row statistic: a max, a sum), itself or
   in a compute inlined into it (a count summed as int64 and cast to float: the stage is the
   cast), and every compute P = exp(s - L) with s a reduction over the key and L a row statistic (an attention
   backward's probabilities, recomputed from the saved log-sum-exp). A scatter
   (tc.scatter_add) is neither a seed nor a member of a region: the per-kernel planner ranks
   its atomic form against its reduction form, which a graph strategy would not.
2. **A seed's region**, grown by structure, not by names: forward, every stage that reads a
   member and iterates the member's rows (shape = rows, or rows plus one axis: the row outputs,
   a normalized row, and a contraction that reads a row statistic itself); backward, every stage
   that only members read and that spans the rows and the reduced axis (the scores of
   attention). For recomputed probabilities: every stage that reads them (dQ, dK, dV, through
   dS = P·(dP - Δ)), then upstream the stages only members read that span the rows or the rows
   and one axis (Δ, dP); the views such a region reads as operands (a gradient arriving as a
   reshape of a GEMM's output) are stored as stages of their own (`_operand_views`), so that
   the region reads arrays. If the graph strategies refuse a row-statistic region, its row group
   alone (the reductions over the rows and the elementwise row outputs, no contraction) is asked
   instead. A seed that nothing joins is a region of its own unless it contracts (a lone
   matrix product no graph strategy takes): a lone row reduction (a layer
   norm backward's row sum, a row of 50,304 logits reduced) is offered to row fusion's one
   block per row and split_rows, which the per-kernel reduction strategy cannot express, and
   the planner keeps whichever its cost model ranks first.
   (A region matches statistics of the row's shape: the torch lowering computes a keepdim row
   statistic, amax(x, -1, keepdim=True), at the rows and reads it through a view that restores
   the size-1 axis, tecc/torch/lowering/reductions.py, so its readers read it at their row.)
3. The region is cut out of the program (regions.py) and offered to the planner's graph path
   (`graph_level`: its graph points weighed against its own per-kernel plans); it is kept when
   a graph point wins and realizes. Regions do not overlap, and one that would make the part
   order cyclic (a stage outside it between two of its members) is dropped.
4. The rest of the program is planned in parts between the regions (`per_kernel`, the planner
   again): a stage joins the part after the last region it depends on (as graph-level programs
   do in the torch backend), so the parts run in order and each reads only earlier parts'
   outputs. A stage that depends on no region (a value a backward recomputes from a saved
   one) joins the part of its earliest reader, or the part just before its earliest reading
   region: in the first part, every layer's recomputed values would be alive at once.

The plan is a list of `region` steps (regions.py) and the composed module is built here once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

import networkx as nx

from ..ir.expr import Binary, Call, Expr, Reduce, TensorRead, free_vars, substitute, walk
from ..ir.scatter import ScatterOp
from ..ir.stmt import Module
from ..ir.tensor import ComputeOp, Tensor
from ..passes.lower import Program, inlining, reached as _reached, same_shape
from ..passes.rewrite.split_reduce import merged_axes
from . import regions
from .plan import Plan, Step

# a part's signature -> the plan of a graph strategy that takes it (weighed and realized), or None
GraphLevel = Callable[[list[Tensor]], "tuple[Plan, Module] | None"]
# a part's signature and its number -> a function that returns the planner's plan of it and its
# scheduled module (called once the later parts were planned: the planner's compile checks of a
# part compile meanwhile, realize.deferring)
PerKernel = Callable[[list[Tensor], int], "Callable[[], tuple[Plan, Module]]"]


@dataclass
class Composed:
    """A program planned in parts: the composed plan and its module (scheduled, before the
    pipeline's fixed tail)."""

    plan: Plan
    module: Module
    parts: list[Module]          # the parts' scheduled modules, in launch order


class _Stages:
    """The program's stages (computes that lowering does not inline) and which stages each reads,
    through the computes inlined into it."""

    def __init__(self, args: Sequence[Tensor], stored: frozenset[Tensor] = frozenset(),
                 chosen: Program | None = None) -> None:
        # `chosen`: the program's inlining, when an earlier _Stages of the same args found it (a
        # model's whole graph: found once, not again for the stored views)
        self.chosen = chosen if chosen is not None else inlining(args)
        prog = self.chosen
        # `stored`: views that a region reads as its operands, made stages (_operand_views)
        self.prog: Program = Program(prog.args, prog.graph, prog.order, prog.inlined - stored)
        self.outputs = {id(a) for a in args}
        self.order = list(self.prog.stages)
        self.index = {id(t): n for n, t in enumerate(self.order)}
        self._through: dict[int, set[int]] = {}
        self._reducing: dict[int, tuple[Tensor, ...]] = {}
        self.reads: dict[int, set[int]] = {id(t): self._reads_of(t) for t in self.order}
        self.readers: dict[int, set[int]] = {id(t): set() for t in self.order}
        for t in self.order:
            for r in self.reads[id(t)]:
                self.readers[r].add(id(t))
        self.graph: nx.DiGraph = nx.DiGraph()
        self.graph.add_nodes_from(self.index)
        self.graph.add_edges_from((r, id(t)) for t in self.order for r in self.reads[id(t)])

    def _reads_of(self, t: Tensor) -> set[int]:
        op = t.op
        assert isinstance(op, ComputeOp)
        found: set[int] = set()
        for n in walk(op.body):
            if isinstance(n, TensorRead) and not n.tensor.is_placeholder:
                found |= self._stage_reads(n.tensor)
        return found

    def _stage_reads(self, t: Tensor) -> set[int]:
        """The stages a read of t reaches: t itself, or what t reads when it is inlined."""
        if t not in self.prog.inlined:
            return {id(t)}
        hit = self._through.get(id(t))
        if hit is None:
            self._through[id(t)] = set()
            hit = self._through[id(t)] = self._reads_of(t)
        return hit

    def reducing(self, t: Tensor) -> tuple[Tensor, ...]:
        """The computes of stage `t` that reduce: itself, and those inlined into it (a
        contraction or a sum inlined into its cast: `float(mm)[i, j]`); found once per stage
        (the region search asks for every stage of every candidate region)."""
        hit = self._reducing.get(id(t))
        if hit is not None:
            return hit
        op = t.op
        assert isinstance(op, ComputeOp)
        found = [t] if op.reductions else []
        for n in walk(op.body):
            if isinstance(n, TensorRead) and n.tensor in self.prog.inlined and isinstance(n.tensor.op, ComputeOp):
                found += [u for u in self.reducing(n.tensor) if u not in found]
        self._reducing[id(t)] = tuple(found)
        return self._reducing[id(t)]

    def reductions(self, t: Tensor) -> tuple[Reduce, ...]:
        """The reductions stage `t` computes, its own and those inlined into it (`reducing`)."""
        return tuple(r for u in self.reducing(t) for r in u.op.reductions)  # type: ignore[union-attr]

    def reduces(self, t: Tensor) -> bool:
        """Whether stage `t` reduces, itself or in a compute inlined into it."""
        return bool(self.reductions(t))

    def tensor(self, key: int) -> Tensor:
        return self.order[self.index[key]]


def _row_axes(st: _Stages, t: Tensor) -> tuple[Reduce, ...] | None:
    """The reductions of a stage, its own or those of the computes inlined into it (a sum read
    through its cast), when each is over one axis, else None."""
    reds = st.reductions(t)
    return reds if reds and all(len(r.axes) == 1 for r in reds) else None


def _spans(t: Tensor, rows: Sequence[object], extra: int) -> bool:
    return len(t.shape) == len(rows) + extra and same_shape(t.shape[: len(rows)], rows)  # type: ignore[arg-type]


def _grow(st: _Stages, seed: Tensor, row_group: bool, claimed: set[int]) -> set[int]:
    """The region of `seed` (module docstring, step 2)."""
    rows = seed.shape
    red = _row_axes(st, seed)
    assert red is not None
    keys = red[0].axes[0].extent
    members = {id(seed)}
    # every condition below needs a member that reads the stage or that it reads: the others are
    # passed over without asking them (a model's graph has ~1000 stages, a region a few)
    near = st.reads[id(seed)] | st.readers[id(seed)]
    changed = True
    while changed:
        changed = False
        for t in st.order:
            k = id(t)
            if k not in near or k in members or k in claimed:
                continue
            reds = st.reduces(t)
            reads_rows = any(_spans(st.tensor(r), rows, 0) for r in st.reads[k] & members)
            forward = bool(st.reads[k] & members) and (
                (_spans(t, rows, 0) and (not reds or _row_axes(st, t) is not None))
                or (_spans(t, rows, 1) and (not reds or (not row_group and reads_rows))))
            backward = (not row_group and k not in st.outputs and st.readers[k] and st.readers[k] <= members
                        and _spans(t, rows, 1) and t.shape[-1] is keys)
            if forward or backward or _sibling(st, t, rows, keys, members):
                members.add(k)
                near |= st.reads[k] | st.readers[k]
                changed = True
    return _without_cycles(st, seed, members)


def _sibling(st: _Stages, t: Tensor, rows: Sequence[object], keys: object, members: set[int]) -> bool:
    """Whether stage `t` is another statistic of the same rows that a member reads: a reduction
    over one axis of the seed's extent, of the rows' shape, that reads no member (a layer norm
    backward's sum of dy*g next to the sum of dy*g*xhat, both read by dx). It is upstream of the
    members, so adding it closes no cycle; one row kernel then computes both, where each was a
    kernel of its own."""
    k = id(t)
    if not (st.readers[k] & members) or st.reads[k] & members or not _spans(t, rows, 0):
        return False
    reds = _row_axes(st, t)
    return reds is not None and all(r.axes[0].extent is keys for r in reds)


def _without_cycles(st: _Stages, seed: Tensor, members: set[int]) -> set[int]:
    """`members` less those that depend on a stage outside them which itself depends on a member
    (a residual gradient dx1 + dx2 whose dx2 comes through a GEMM of dx1): with them the region
    could not run as one part, and the whole region used to be dropped. What remains keeps the
    seed; an empty set when the seed itself would go."""
    while True:
        between = (_beyond(st.graph.succ, members) & _beyond(st.graph.pred, members)) - members
        if not between:
            return members
        late = _beyond(st.graph.succ, between)
        if id(seed) in late:
            return set()
        members = members - late


def _acyclic(st: _Stages, members: set[int]) -> bool:
    """Whether no stage outside `members` lies on a path between two members."""
    return not ((_beyond(st.graph.succ, members) & _beyond(st.graph.pred, members)) - members)


def _beyond(edges: Mapping[int, Iterable[int]], sources: Iterable[int]) -> set[int]:
    """The stages a path of one edge or more reaches from any of `sources` along `edges` (the
    graph's successors: the union of their descendants; its predecessors: of their ancestors),
    found in one walk rather than one per source."""
    seen: set[int] = set()
    stack = [n for s in sources for n in edges[s]]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(edges[n])
    return seen


def _outputs(st: _Stages, members: set[int]) -> list[Tensor]:
    return [t for t in st.order if id(t) in members
            and (id(t) in st.outputs or st.readers[id(t)] - members)]


def _boundaries(st: _Stages, members: set[int]) -> list[Tensor]:
    return [st.tensor(r) for m in members for r in st.reads[m] if r not in members]


def _recomputed_probabilities(st: _Stages) -> list[Tensor]:
    """The computes P[r.., j] = exp(s - L[r..]) with s holding a reduction that reads the key j
    and L free of it (an attention backward's probabilities, recomputed from the saved
    log-sum-exp), inlined or not."""
    found = []
    for t in st.prog.order:
        op = t.op
        if not isinstance(op, ComputeOp) or len(t.shape) < 2:
            continue
        body = op.body
        if not (isinstance(body, Call) and body.name == "exp" and isinstance(body.args[0], Binary)
                and body.args[0].op == "-"):
            continue
        s, lse = body.args[0].a, body.args[0].b
        key = op.axes[-1]
        if (any(v is key for v in free_vars(s)) and not any(v is key for v in free_vars(lse))
                and any(isinstance(n, Reduce) for n in walk(s))):
            found.append(t)
    return found


def _sees(st: _Stages, t: Tensor, target: Tensor, memo: dict[int, bool]) -> bool:
    """Whether stage or inlined compute `t` reads `target`, directly or through inlined computes."""
    hit = memo.get(id(t))
    if hit is not None:
        return hit
    memo[id(t)] = False
    op = t.op
    assert isinstance(op, ComputeOp)
    for n in walk(op.body):
        if isinstance(n, TensorRead) and not n.tensor.is_placeholder and (
                n.tensor is target or (n.tensor in st.prog.inlined and _sees(st, n.tensor, target, memo))):
            memo[id(t)] = True
            break
    return memo[id(t)]


def _grow_backward(st: _Stages, probs: Tensor, claimed: set[int]) -> set[int]:
    """The region of an attention backward (module docstring, step 2): the stages that read the
    recomputed probabilities `probs` (dQ, dK, dV through dS = P·(dP - Δ)), then, upstream, the
    stages only members read that span the rows or the rows and one axis (Δ, dP)."""
    rows = probs.shape[:-1]
    memo: dict[int, bool] = {}
    # only the stages the program's graph reaches from `probs` through inlined computes can read
    # it: the others are not walked (a model's graph has ~1000 stages, an attention backward ~10)
    near = {id(probs)} | {id(s) for s in _reached(st.prog.graph.successors, probs, st.prog.inlined.__contains__)}
    members = {id(t) for t in st.order
               if id(t) in near and id(t) not in claimed and (t is probs or _sees(st, t, probs, memo))}
    changed = bool(members)
    while changed:
        changed = False
        for t in st.order:
            k = id(t)
            if k in members or k in claimed or k in st.outputs or not st.readers[k] or not st.readers[k] <= members:
                continue
            if isinstance(t.op, ComputeOp) and isinstance(t.op.body, TensorRead):
                continue  # a view stored as an operand (_operand_views): read, not computed, here
            if _spans(t, rows, 0) or _spans(t, rows, 1):
                members.add(k)
                changed = True
    return members


def _operand_views(st: _Stages) -> frozenset[Tensor]:
    """The views (inlined computes that only read another tensor at other indices) that the
    attention backward regions read: stored as stages of their own, so that the region reads its
    operands as arrays indexed [.., row or key, column] (the layout its tensor-core kernels stage),
    not through a reshape of another stage (a gradient dO arriving as a view of a GEMM's output)."""
    found: set[Tensor] = set()
    for probs in _recomputed_probabilities(st):
        for key in _grow_backward(st, probs, set()):
            stack = [st.tensor(key)]
            seen: set[int] = set()
            while stack:
                t = stack.pop()
                op = t.op
                assert isinstance(op, ComputeOp)
                for n in walk(op.body):
                    if not isinstance(n, TensorRead) or n.tensor not in st.prog.inlined or id(n.tensor) in seen:
                        continue
                    seen.add(id(n.tensor))
                    inner = n.tensor.op
                    if isinstance(inner, ComputeOp) and isinstance(inner.body, TensorRead):
                        found.add(n.tensor)
                    else:
                        stack.append(n.tensor)
    return frozenset(found)


def _find_regions(st: _Stages, graph_level: GraphLevel) -> list[tuple[set[int], Plan, Module]]:
    found: list[tuple[set[int], Plan, Module]] = []
    claimed: set[int] = {id(t) for t in st.order if isinstance(t.op, ScatterOp)}
    for probs in _recomputed_probabilities(st):
        members = _grow_backward(st, probs, claimed)
        if len(members) < 2 or members & claimed or not _acyclic(st, members):
            continue
        taken = graph_level(regions.cut(_outputs(st, members), _boundaries(st, members)))
        if taken is not None:
            found.append((members, taken[0], taken[1]))
            claimed |= members
    for seed in st.order:
        if id(seed) in claimed or _row_axes(st, seed) is None:
            continue
        tried: list[set[int]] = []
        for row_group in (False, True):
            members = _grow(st, seed, row_group, claimed)
            if not members or members in tried or (len(members) == 1 and _contraction(st, seed)):
                continue
            tried.append(members)
            part = regions.cut(_outputs(st, members), _boundaries(st, members))
            taken = graph_level(part)
            if taken is not None:
                found.append((members, taken[0], taken[1]))
                claimed |= members
                break
    for seed in st.order:
        if id(seed) in claimed or not _column_statistic(st, seed) or not _acyclic(st, {id(seed)}):
            continue
        taken = graph_level(regions.cut(_outputs(st, {id(seed)}), _boundaries(st, {id(seed)})))
        if taken is not None:
            found.append(({id(seed)}, taken[0], taken[1]))
            claimed.add(id(seed))
    return found


def _contraction(st: _Stages, t: Tensor) -> bool:
    """Whether a reduction of stage `t` reads two or more tensors along its reduced axis (a
    matrix product): alone, no graph strategy takes it, so a lone seed of it is not offered."""
    for r in st.reductions(t):
        axis = r.axes[0]
        reads = {id(n.tensor) for n in walk(r.source)
                 if isinstance(n, TensorRead) and any(axis in free_vars(i) for i in n.indices)}
        if len(reads) >= 2:
            return True
    return False


def _reads_through_views(st: _Stages, e: Expr, depth: int = 8) -> list[TensorRead]:
    """The tensor reads of `e`, a read of an inlined compute replaced by its body's reads at the
    read's indices (a channels_last tensor's logical NCHW view read as the NHWC stage under it)."""
    out: list[TensorRead] = []
    for n in walk(e):
        if not isinstance(n, TensorRead):
            continue
        inner = n.tensor.op
        if depth and n.tensor in st.prog.inlined and isinstance(inner, ComputeOp) and not inner.reductions:
            out += _reads_through_views(st, substitute(inner.body, dict(zip(inner.axes, n.indices))), depth - 1)
        else:
            out.append(n)
    return out


def _column_statistic(st: _Stages, t: Tensor) -> bool:
    """A stage reducing over one axis that its output does not iterate at its innermost (a
    bias's gradient, a column sum: sum_r x[r, c]), alone a region of its own (step 2b): the
    column reduction's split spreads the reduced axis over blocks, where one thread per output
    of a few hundred outputs leaves the GPU idle. The reduction may be inlined into the stage
    (a cast of the column sum). Also a reduction over several axes that split_reduce reads as
    one (merged_axes: a global average pool over (h, w) of an NHWC input, 32 x 64 outputs of
    3136 rows each), whose output may have several axes."""
    owners = st.reducing(t)
    if len(owners) != 1:
        return False
    t = owners[0]
    op = t.op
    assert isinstance(op, ComputeOp)
    if len(op.reductions) != 1 or len(merged_axes(op.reductions[0]).axes) != 1:
        return False
    wide = [ax for ax, d in zip(op.axes, t.shape) if str(d) != "1"]
    if not wide or (len(wide) > 1 and len(op.reductions[0].axes) == 1):
        return False
    reduced = set(op.reductions[0].axes)
    for read in _reads_through_views(st, op.body):
        if read.indices:
            last = free_vars(read.indices[-1])
            if wide[-1] in last and not reduced & last:
                return True
    return False


def _parts(st: _Stages, found: list[tuple[set[int], Plan, Module]],
           region_of: dict[int, int]) -> list[tuple[set[int], int | None]]:
    """The parts in launch order: per level, the remaining stages of that level, then its regions
    (module docstring, step 4). A remaining stage's level is the highest among the remaining
    stages it reads and one past the regions it reads; a region's is the highest among what
    it reads, regions included (regions of one level run in dependence order). A stage that
    depends on no region takes the lowest level among its readers instead: as late as it can."""
    contracted: nx.DiGraph = nx.DiGraph()

    def node(k: int) -> object:
        return ("region", region_of[k]) if k in region_of else k

    contracted.add_nodes_from(node(k) for k in st.index)
    contracted.add_edges_from((node(a), node(b)) for a, b in st.graph.edges if node(a) != node(b))
    level: dict[object, int] = {}
    order = list(nx.topological_sort(contracted))
    for n in order:
        region = isinstance(n, tuple)
        level[n] = max((level[p] + (1 if isinstance(p, tuple) and not region else 0)
                        for p in contracted.predecessors(n)), default=0)
    # A stage that depends on no region (it reads the program's inputs and other such stages:
    # a value the backward recomputes from a saved one) would run in the first part, and its
    # output stay alive from there to its reader, every layer's at once; it runs in the part of
    # its earliest reader instead (or just before that reader's region), as late as it can.
    after_region: set[object] = set()
    for n in order:
        if isinstance(n, tuple) or any(p in after_region for p in contracted.predecessors(n)):
            after_region.add(n)
    for n in reversed(order):
        readers = list(contracted.successors(n))
        if n not in after_region and readers:
            level[n] = min(level[r] for r in readers)
    parts: list[tuple[set[int], int | None]] = []
    for lvl in sorted(set(level.values())):
        rest = {k for k in st.index if not isinstance(node(k), tuple) and level[k] == lvl}
        if rest:
            parts.append((rest, None))
        for n in order:
            if isinstance(n, tuple) and level[n] == lvl:
                parts.append((found[n[1]][0], n[1]))
    return parts


def propose(args: Sequence[Tensor], graph_level: GraphLevel, per_kernel: PerKernel, name: str,
            threads: int, chosen: Program | None = None) -> Composed | None:
    """The program planned in parts (module docstring), or None when no graph strategy takes a
    part of it, or one takes all of it. `name`: the composed module's (the program's lowered
    module's name); `chosen`: the program's inlining as its lowering found it (lower.inlining)."""
    st = _Stages(args, chosen=chosen)
    views = _operand_views(st)
    if views:
        st = _Stages(args, views, st.chosen)
    if len(st.order) < 2:
        return None
    found = _find_regions(st, graph_level)
    if not found:
        return None
    region_of = {k: n for n, (members, _, _) in enumerate(found) for k in members}
    if len(found) == 1 and len(region_of) == len(st.order):
        return None
    parts = _parts(st, found, region_of)
    planned: list[tuple[int, list[Tensor], Callable[[], tuple[Plan, Module]]]] = []
    done: list[Tensor] = []
    for number, (members, region) in enumerate(parts):
        outputs = _outputs(st, members)
        if not outputs:
            continue
        part = regions.cut(outputs, done)
        if region is not None:
            planned.append((number, outputs, lambda taken=found[region]: (taken[1], taken[2])))
        else:
            planned.append((number, outputs, per_kernel(part, number)))
        done.extend(outputs)
    steps: list[Step] = []
    modules: list[Module] = []
    reasons: list[str] = []
    for number, outputs, settled in planned:
        plan, module = settled()
        steps.append(regions.region_step(outputs, plan))
        modules.append(module)
        reasons.append(f"part {number} ({', '.join(t.name for t in outputs[:3])}{', ...' if len(outputs) > 3 else ''}): "
                       f"{plan.strategy}")
    steps.append(Step("default_schedule", {"threads": threads}))
    strategies = sorted({s.args["plan"]["strategy"] for s in steps if s.primitive == regions.REGION})
    plan = Plan(tuple(steps), "regions", f"{len(found)} region(s) of graph-level rewrites ({', '.join(strategies)}); "
                + "; ".join(reasons))
    return Composed(plan, regions.compose(args, modules, name), modules)
