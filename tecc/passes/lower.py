"""Lowering: a program of tensor expressions → the naive loop-nest module.

Steps, in order:
1. Collect the program DAG (networkx) from the tensors given to `build`, check that every input
   it reads is among them, and topologically order the compute stages.
2. Inline elementwise producers (computes without a reduction that are not outputs) into their
   consumers, so chains of elementwise ops never round-trip through memory (except a 16-bit copy
   of a wider float that a contraction reads: `narrowed_operands`); a reduction whose
   only consumer is an elementwise stage reading it at its own index (an epilogue such as
   `relu(C[i, j] + bias[j])`) is inlined too, so the store of the reduction applies it.
3. Give every remaining stage a buffer: outputs and inputs are the module's parameters, other
   stages become temporaries the host allocates.
4. Turn each stage into one kernel: a loop per axis, and for every reduction a local accumulator
   with an init, a loop over its axes and an update; then the store of the element.

The result is serial, unscheduled loop IR ("for i: for j: C[i, j] = ..."); schedule passes
bind it to threads and blocks afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Sequence

import networkx as nx

from ..ir import dtype as dt
from ..ir.errors import ShapeError, TeccError
from ..ir.expr import (
    Binary,
    BufferLoad,
    Cast,
    Const,
    Expr,
    IterVar,
    Reduce,
    Select,
    TensorRead,
    Var,
    binary,
    cast,
    const_int,
    const_product,
    free_vars,
    logical_and,
    reduce_identity,
    select,
    substitute,
    walk,
)
from ..ir.stmt import (
    Allocate,
    AsyncCopy,
    Buffer,
    BufferStore,
    Evaluate,
    For,
    IfThenElse,
    KernelCall,
    LetStmt,
    MatrixLoad,
    Module,
    PrimFunc,
    Stmt,
    iter_stmts,
    seq,
)
from ..ir.index_checks import IndexCheck
from ..ir.scatter import ScatterOp, data_dependent
from ..ir.tensor import ComputeOp, PlaceholderOp, Tensor
from ..ir.visitor import ExprMutator
from .simplify import linear_form, merged_dims
from .names import fresh_name, identifier


@dataclass
class Program:
    """The tensors of a build: the signature, the DAG and the stages that need kernels."""

    args: tuple[Tensor, ...]
    graph: nx.DiGraph
    order: tuple[Tensor, ...]  # every compute tensor, producers first
    inlined: frozenset[Tensor] = field(default_factory=frozenset)

    @property
    def stages(self) -> tuple[Tensor, ...]:
        return tuple(t for t in self.order if t not in self.inlined)


def collect_program(args: Sequence[Tensor]) -> Program:
    """The DAG of the tensors reachable from `args` (edges producer → consumer)."""
    if not args:
        raise TeccError("build() needs a list of tensors: the inputs and outputs, in kernel-signature order")
    for a in args:
        if not isinstance(a, Tensor):
            raise TeccError(f"build() takes tensors made by tc.placeholder / tc.compute, got {type(a).__name__}")
    if len({id(a) for a in args}) != len(args):
        raise TeccError("build(): a tensor appears twice in the argument list")
    g: nx.DiGraph = nx.DiGraph()
    stack = [a for a in args if not a.is_placeholder]
    if not stack:
        raise TeccError("build(): the argument list has no compute tensor, so there is nothing to compute")
    seen: set[int] = set()
    while stack:
        t = stack.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        g.add_node(t)
        for src in t.op.input_tensors:
            g.add_edge(src, t)
            stack.append(src)
    arg_ids = {id(a) for a in args}
    for t in g.nodes:
        if t.is_placeholder and id(t) not in arg_ids:
            consumers = ", ".join(c.name for c in g.successors(t))
            raise TeccError(
                f"build(): placeholder {t.name} is read by {consumers} but is not in the argument list; "
                "add it to the list passed to build()"
            )
    order = tuple(t for t in nx.topological_sort(g) if not t.is_placeholder)
    return Program(tuple(args), g, order)


def choose_inlined(prog: Program, epilogues: bool = False) -> Program:
    """Inline every compute that is not an output and has no reduction.

    With `epilogues` (what `lower` asks for; fuse_rows and split_reduce, which reuse this, do not)
    a reduction stage is also inlined into its consumer when that is an *epilogue*
    (`epilogue_consumer`): the consumer's kernel then computes the reduction and stores
    `D[i, j] = relu(acc + bias[j])` at the reduction's own store, and the temporary C is gone;
    and the computed and concatenated operands of contractions stay stages (`computed_operands`,
    `concatenated_operands`). Narrowing copies stay stages either way (`narrowed_operands`)."""
    outputs = {id(a) for a in prog.args}
    inlined = {
        t for t in prog.order
        if id(t) not in outputs and isinstance(t.op, ComputeOp) and not t.op.reductions
    }
    if epilogues:  # the kernels of the program as built (the row rewrites choose their own)
        inlined -= (concatenated_operands(prog, inlined) | computed_operands(prog, inlined)
                    | regathered_operands(prog, inlined))
    inlined -= narrowed_operands(prog, inlined)
    if epilogues:
        inlined -= shared_long_chains(prog, inlined)
    if epilogues:
        inlined |= epilogue_reductions(prog, frozenset(inlined))
    return Program(prog.args, prog.graph, prog.order, frozenset(inlined))


def narrowed_operands(prog: Program, elementwise: set[Tensor]) -> set[Tensor]:
    """The computes that narrow a float32/float64 tensor to 16 bits (`bfloat16(X[...])`: the
    casts of mixed precision, autocast's) and reach a contraction (a stage summing products)
    through elementwise computes only. They stay stages of their own, written once in 16 bits:
    the contraction then reads 16-bit operands, the form the tensor-core strategies take (an
    operand converted while it is staged is not one they have), instead of being planned as a
    generic reduction reading and converting the wide values at every use."""
    return {t for t in prog.order if t in elementwise and _narrowing_copy(t) and _reaches_contraction(prog, t, elementwise)}


def concatenated_operands(prog: Program, elementwise: set[Tensor]) -> set[Tensor]:
    """The computes that choose among two or more tensors by a where() on an index (a
    concatenation: the QKV projection's gradient cat([dq, dk, dv])) and reach a contraction
    through elementwise computes only. They stay stages of their own: inlined, the contraction's
    operand would be a select of several reads, which no tensor-core strategy takes, and the
    contraction (two of them for a linear layer's gradients) would be planned as a generic
    reduction; written once, it is a plain operand."""
    return {t for t in prog.order if t in elementwise and _selects_tensors(t)
            and _reaches_contraction(prog, t, elementwise)}


# An elementwise compute read by two or more stages stays a stage of its own when, inlined, it
# would read more than this many values: a model's backward carries the residual stream's
# gradient through every layer (dx_l = dx_(l+1) + the layer's terms), and inlined, each layer's
# kernels recompute every later layer's chain (GPT-2's 12 layers: bodies of 200+ reads, beyond
# any register budget, and work quadratic in the depth).
CHAIN_READS = 48
# ... or when it would read more than this many distinct tensors of its own size: each of its
# readers' kernels then reads them all again, where storing it costs one write and one read per
# reader (the residual stream's gradient, `dx_l = dx_(l+1) + dY_l·γ·rstd_l·(...)`, reads dx_(l+1),
# dY_l and x_l: stored at every layer, so the layers' kernels are the same code, and the
# depth's quadratic reads of a longer chain are gone).
CHAIN_TENSORS = 2


def shared_long_chains(prog: Program, inlined: set[Tensor]) -> set[Tensor]:
    """The inlined computes that CHAIN_READS or CHAIN_TENSORS says to store, producers first."""
    kept: set[Tensor] = set()
    reads: dict[int, int] = {}
    wide: dict[int, frozenset[int]] = {}   # the tensors of its own size an inlined compute reads
    for t in prog.order:
        op = t.op
        if not isinstance(op, ComputeOp):
            continue
        n = _tree_reads(op.body, lambda src: reads.get(id(src), 1) if src in inlined and src not in kept else 1, {})
        reads[id(t)] = n
        size = const_product(t.shape)
        found: set[int] = set()
        for r in walk(op.body) if size is not None else ():
            if not isinstance(r, TensorRead) or const_product(r.tensor.shape) != size:
                continue
            src = r.tensor
            found |= wide[id(src)] if src in inlined and src not in kept and id(src) in wide else {id(src)}
        wide[id(t)] = frozenset(found)
        if t in inlined and (n > CHAIN_READS or len(found) > CHAIN_TENSORS) and len(set(prog.graph.successors(t))) >= 2:
            kept.add(t)
    return kept


def _tree_reads(e: Expr, weight: Callable[[Tensor], int], memo: dict[int, int]) -> int:
    """The reads of `e` as a tree (a shared subexpression counts at each use, as inlining copies
    it), each read of an inlined compute weighing the reads of its own body."""
    if id(e) in memo:
        return memo[id(e)]
    if isinstance(e, TensorRead):
        n = weight(e.tensor) + sum(_tree_reads(i, weight, memo) for i in e.indices)
    else:
        n = sum(_tree_reads(c, weight, memo) for c in e.children)
    memo[id(e)] = n
    return n


def computed_operands(prog: Program, elementwise: set[Tensor]) -> set[Tensor]:
    """The elementwise computes that a contraction reads (directly or through views) and whose value
    is computed (not a read or a conversion of one: a relu between two convolutions), from stages of their own
    size. They stay stages of their own, the activation applied once where it is stored: inlined,
    the contraction's operand would be an expression of its reads, which no tensor-core strategy
    takes, and the contraction would be planned as a generic reduction. A compute that reads a
    smaller reduction (a row statistic: softmax's probabilities, a layer norm) stays inlined: the
    graph-level rewrites (the online contraction, row fusion) take those chains whole."""
    kept: set[Tensor] = set()
    for t in prog.order:
        if t not in elementwise or _plain(t) or not _reaches_contraction(prog, t, elementwise, views_only=True):
            continue
        if not _reads_statistics(prog, t, elementwise):
            kept.add(t)
    return kept


def regathered_operands(prog: Program, elementwise: set[Tensor]) -> set[Tensor]:
    """The copies (views, permuted clones: a read or a conversion of one) that a contraction
    reads at an affine index, but through which, inlined, it would read the stage beneath at an
    index that is neither affine nor split (`x // c`, `x % c` of an affine x) in each dimension:
    attention written by hand, whose per-head operands are copies of [B, S, H, D] views read as
    [B·H, S, D] (`(i // H)·S + s` as a row of the [B·S, H·D] GEMM output beneath). They stay
    stages of their own, written once in the contraction's order: inlined, no tensor-core
    strategy takes the read, and the batched GEMM would be planned as a generic reduction."""
    kept: set[Tensor] = set()
    for c in prog.order:
        op = c.op
        if c in elementwise or not isinstance(op, ComputeOp) or not (_sums_products(c) and _multiplies_two_tensors(c)):
            continue
        for r in op.reductions:
            for n in walk(r.source):
                if (isinstance(n, TensorRead) and n.tensor in elementwise and n.tensor not in kept and _plain(n.tensor)
                        and _tileable(n.indices, n.tensor.shape)
                        and not all(_tileable(ix, shape) for ix, shape in _reads_beneath(n, elementwise))):
                    kept.add(n.tensor)
    return kept


def _reads_beneath(read: TensorRead, elementwise: set[Tensor]) -> list[tuple[tuple[Expr, ...], tuple[Expr, ...]]]:
    """The (indices, shape) at which `read` reads the tensors beneath it once the copies it goes
    through (plain computes of `elementwise`) are inlined."""
    t = read.tensor
    op = t.op
    if t not in elementwise or not _plain(t) or not isinstance(op, ComputeOp):
        return [(read.indices, tuple(t.shape))]
    body = substitute(op.body, dict(zip(op.axes, read.indices)))
    return [found for n in walk(body) if isinstance(n, TensorRead) for found in _reads_beneath(n, elementwise)]


def _tileable(indices: Sequence[Expr], shape: Sequence[Expr]) -> bool:
    """Whether a read's indices are what the contraction strategies tile (the reads
    compiler/cost/analysis.py takes as affine or split): each affine in the loop variables, or an
    affine index // or % a constant (a split axis), once two neighbours `x // n`, `x % n` with n
    the next dimension's extent are merged (simplify.merged_dims)."""
    merged, _ = merged_dims(indices, [const_int(s) or -1 for s in shape])
    return all(_affine_index(i) or (isinstance(i, Binary) and i.op in ("//", "%") and _affine_index(i.a)
                                    and (const_int(i.b) or 0) > 0) for i in merged)


def _affine_index(e: Expr) -> bool:
    """Whether an integer index is a sum of constants times variables (a size variable may scale
    a loop variable: its value is known at the launch)."""
    terms, _ = linear_form(e)
    return all(isinstance(a, Var) or (isinstance(a, Binary) and a.op == "*" and _one_index_var(a)) for a in terms)


def _one_index_var(e: Expr) -> bool:
    return sum(1 for v in free_vars(e) if v.kind == "index") <= 1 and not any(
        isinstance(n, Binary) and n.op in ("//", "%") for n in walk(e))


def _plain(t: Tensor) -> bool:
    op = t.op
    if not isinstance(op, ComputeOp):
        return True
    body = op.body.a if isinstance(op.body, Cast) else op.body
    return isinstance(body, TensorRead)


def _reads_statistics(prog: Program, t: Tensor, elementwise: set[Tensor]) -> bool:
    """Whether t reads, directly or through elementwise computes, a reduction of fewer elements."""
    size = const_product(t.shape)
    return any(isinstance(s.op, ComputeOp) and s.op.reductions and (size is None or const_product(s.shape) != size)
               for s in reached(prog.graph.predecessors, t, elementwise.__contains__))


def reached(neighbours: Callable[[Tensor], Iterable[Tensor]], t: Tensor,
            through: Callable[[Tensor], bool]) -> Iterator[Tensor]:
    """The tensors reached from t along `neighbours` (the program graph's predecessors or
    successors), passing through the tensors `through` accepts to the first one it does not,
    each once."""
    seen: set[int] = set()
    frontier = list(neighbours(t))
    while frontier:
        s = frontier.pop()
        if id(s) in seen:
            continue
        seen.add(id(s))
        if through(s):
            frontier.extend(neighbours(s))
        else:
            yield s


def _selects_tensors(t: Tensor) -> bool:
    op = t.op
    if not isinstance(op, ComputeOp):
        return False
    return any(isinstance(n, Select) and _read_different_tensors(n.a, n.b) for n in walk(op.body))


def _reaches_contraction(prog: Program, t: Tensor, elementwise: set[Tensor], views_only: bool = False) -> bool:
    """Whether `t` reaches a stage summing products through elementwise computes only (with
    `views_only`: through views and widening conversions; a narrowing copy on the way is the
    stage narrowed_operands keeps, where the value is stored)."""
    def through(s: Tensor) -> bool:
        return s in elementwise and (not views_only or (_plain(s) and not _narrowing_copy(s)))

    return any(_sums_products(s) and (not views_only or _multiplies_two_tensors(s))
               for s in reached(prog.graph.successors, t, through))


def _multiplies_two_tensors(t: Tensor) -> bool:
    """Whether a sum of t multiplies reads of two different tensors (a matrix product, a
    convolution; not a sum of squares)."""
    op = t.op
    assert isinstance(op, ComputeOp)
    return any(isinstance(n, Binary) and n.op == "*" and _read_different_tensors(n.a, n.b)
               for r in op.reductions for n in walk(r.source))


def _read_different_tensors(a: Expr, b: Expr) -> bool:
    """Whether `a` and `b` both read tensors, and not the same ones."""
    sides = [{id(r.tensor) for r in walk(x) if isinstance(r, TensorRead)} for x in (a, b)]
    return bool(sides[0]) and bool(sides[1]) and sides[0] != sides[1]


def _narrowing_copy(t: Tensor) -> bool:
    op = t.op
    if not isinstance(op, ComputeOp) or t.dtype not in (dt.float16, dt.bfloat16):
        return False
    body = op.body
    return (isinstance(body, Cast) and isinstance(body.a, TensorRead)
            and body.a.dtype in (dt.float32, dt.float64))


def _sums_products(t: Tensor) -> bool:
    op = t.op
    return isinstance(op, ComputeOp) and any(
        r.combiner == "sum" and any(isinstance(n, Binary) and n.op == "*" for n in walk(r.source))
        for r in op.reductions)


def epilogue_reductions(prog: Program, inlined: frozenset[Tensor]) -> set[Tensor]:
    """The reduction stages inlined into their epilogue consumer (`epilogue_consumer`), at most
    one per consumer, producers first: a kernel holding two reductions (`D = mm_a + mm_b`, both
    inlined) is neither of them to the strategies (no GEMM takes two contractions, no scatter
    strategy a contraction), so it would fall to the thread-per-output reduction."""
    taken: dict[int, Tensor] = {}
    outputs = frozenset(id(a) for a in prog.args)
    for t in prog.order:
        d = epilogue_consumer(prog, t, inlined, outputs)
        if d is not None and id(d) not in taken:
            taken[id(d)] = t
    return set(taken.values())


def epilogue_consumer(prog: Program, t: Tensor, inlined: frozenset[Tensor], outputs: frozenset[int]) -> Tensor | None:
    """The consumer D of reduction stage `t` into which `t` is inlined, or None.

    Inlining saves bytes exactly when it moves no work: D is a stage (an output, or a compute kept
    stored because a contraction reads it: the batch norm and relu between two convolutions) of
    the same shape without a reduction of its own, the only stage `t` reaches (directly, or through elementwise
    computes inlined into D: a view, a batch norm and a relu after a convolution), and D reads
    `t` once, at its own index, once those computes are expanded (D[i, j] = f(C[i, j], ...)).
    The reduction is then computed once per output as before, and C's write and read back
    (2·|C|·itemsize bytes) and a kernel launch disappear. A consumer that reads C at another
    index or more than once would recompute the reduction; one that is itself inlined further
    would move it into a kernel of another shape: neither is done. A scatter stays a stage: its
    atomic realization (`scatter_atomic`) adds each position once, while inlined it is the
    gather-wise form, which searches every position for every output element (GPT-2's tied
    embedding gradient `mm + embedding_dense_backward`: 50257 x 768 outputs x 8192 positions).
    `outputs`: the ids of `prog.args` (made once by the caller, not per stage)."""
    op = t.op
    if id(t) in outputs or not isinstance(op, ComputeOp) or not op.reductions or t in inlined:
        return None
    if isinstance(op, ScatterOp):
        return None
    readers = _stages_reached(prog, t, inlined)
    if len(readers) != 1:
        return None
    d = readers[0]
    dop = d.op
    if d in inlined or not isinstance(dop, ComputeOp) or dop.reductions or not same_shape(d.shape, t.shape):
        return None
    reads = _reads_through(dop.body, t, inlined, [])
    if len(reads) != 1 or len(reads[0]) != len(dop.axes) or not all(a is b for a, b in zip(reads[0], dop.axes)):
        return None
    return d


def _stages_reached(prog: Program, t: Tensor, inlined: frozenset[Tensor]) -> list[Tensor]:
    """The stages that read `t`, directly or through inlined computes."""
    return list(reached(prog.graph.successors, t, inlined.__contains__))


def _reads_through(e: Expr, t: Tensor, inlined: frozenset[Tensor], found: list[tuple[Expr, ...]]
                   ) -> list[tuple[Expr, ...]]:
    """The indices at which `e` reads `t` once the inlined computes it reads are expanded (the
    search stops at a second read: `epilogue_consumer` wants exactly one)."""
    for n in walk(e):
        if len(found) > 1:
            break
        if not isinstance(n, TensorRead):
            continue
        if n.tensor is t:
            found.append(n.indices)
        elif n.tensor in inlined and isinstance(n.tensor.op, ComputeOp):
            src = n.tensor.op
            _reads_through(substitute(src.body, dict(zip(src.axes, n.indices))), t, inlined, found)
    return found


def same_shape(a: Sequence[Expr], b: Sequence[Expr]) -> bool:
    """Whether two shapes are the same, dimension by dimension. Expressions are hash-consed, so
    equal dimensions are the same node; `==` on two of them would build a symbolic comparison
    (whose truth value is refused), not answer the question."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


class Inliner(ExprMutator):
    """Replaces reads of inlined tensors by their bodies, and reads of stage tensors by buffer loads."""

    def __init__(self, inlined: frozenset[Tensor], buffers: dict[Tensor, Buffer]) -> None:
        super().__init__()
        self.inlined = inlined
        self.buffers = buffers

    def visit_TensorRead(self, e: TensorRead) -> Expr:
        idx = tuple(self.visit(i) for i in e.indices)
        t = e.tensor
        if t in self.inlined:
            op = t.op
            assert isinstance(op, ComputeOp)
            body = substitute(op.body, dict(zip(op.axes, idx)))
            value = self.visit(body)
        else:
            value = BufferLoad(self.buffers[t], idx)
        return guard_data_dependent(t, e.indices, idx, value)


def guard_data_dependent(t: Tensor, written: Sequence[Expr], indices: Sequence[Expr], value: Expr) -> Expr:
    """`value` (the read of `t` at `indices`) guarded by an IndexCheck of every index that was
    written data-dependent (`written`: the tensor expression's indices, `W[idx[i], j]`): the read
    gives 0 where a check fails, and the check reports the failure (index_checks.IndexCheck). Affine
    indices were proved in bounds when the compute was made and are not checked again."""
    checks = [IndexCheck(ix, extent, t.name, d)
              for d, (w, ix, extent) in enumerate(zip(written, indices, t.shape)) if data_dependent(w)]
    if not checks:
        return value
    return select(logical_and(*checks), value, Const(0, value.dtype))


# A Reduce's combiner as the binary operator that folds two partials (every rewrite that splits a
# reduction over threads or blocks combines its partials with it).
COMBINE = {"sum": "+", "prod": "*", "max": "max", "min": "min", "nanmax": "fmax", "nanmin": "fmin"}


class _StageLowering:
    """Builds the loop nest of one stage."""

    def __init__(self, stage: Tensor, out: Buffer, inliner: Inliner, taken: set[str]) -> None:
        self.stage = stage
        self.out = out
        self.inliner = inliner
        self.taken = taken
        self.n_acc = 0

    def fresh(self, base: str) -> str:
        return fresh_name(base, self.taken)

    def loop_var(self, iv: IterVar) -> Var:
        return Var(self.fresh(iv.name), iv.dtype, "index")

    def value(self, e: Expr, loops: dict[Var, Expr]) -> tuple[list[Stmt], list[Buffer], Expr]:
        """Statements computing the reductions of `e`, their accumulators, and `e`'s value."""
        stmts: list[Stmt] = []
        allocs: list[Buffer] = []
        pending: dict[int, Expr] = {}

        class _Reduces(ExprMutator):
            def visit_Reduce(inner, r: Reduce) -> Expr:  # noqa: N805 - closure over self
                load = self.reduction(r, loops, stmts, allocs)
                pending[id(r)] = load
                return load

        out = _Reduces().visit(substitute(e, loops) if loops else e)
        return stmts, allocs, out

    def reduction(self, r: Reduce, loops: dict[Var, Expr], stmts: list[Stmt], allocs: list[Buffer]) -> Expr:
        name = self.stage.name if self.n_acc == 0 else f"{self.stage.name}_{self.n_acc}"
        self.n_acc += 1
        acc = Buffer(self.fresh(f"{name}_acc"), r.acc_dtype, (1,), "local", tensor=f"{self.stage.name}.acc")
        allocs.append(acc)
        inner_loops = dict(loops)
        axis_vars = []
        for ax in r.axes:
            v = self.loop_var(ax)
            inner_loops[ax] = v
            axis_vars.append((v, ax))
        src_stmts, src_allocs, src = self.value(r.source, inner_loops)
        zero = Const(0, dt.int32)
        update: Stmt = BufferStore(acc, (zero,), binary(COMBINE[r.combiner], acc[zero], cast(src, r.acc_dtype)))
        body = seq(*src_stmts, update)
        for b in reversed(src_allocs):
            body = Allocate(b, body)
        for v, ax in reversed(axis_vars):
            body = For(v, substitute(ax.lo, loops), substitute(ax.extent, loops), "serial", body)
        stmts.append(BufferStore(acc, (zero,), reduce_identity(r.combiner, r.acc_dtype)))
        stmts.append(body)
        return cast(acc[zero], r.dtype)

    def lower(self) -> Stmt:
        op = self.stage.op
        assert isinstance(op, ComputeOp)
        loops = {ax: self.loop_var(ax) for ax in op.axes}
        body_expr = self.inliner.visit(op.body)
        stmts, allocs, value = self.value(body_expr, loops)  # type: ignore[arg-type]
        store = BufferStore(self.out, tuple(loops[ax] for ax in op.axes), value)
        body = seq(*stmts, store)
        for b in reversed(allocs):
            body = Allocate(b, body)
        for ax in reversed(op.axes):
            body = For(loops[ax], Const(0, ax.dtype), ax.extent, "serial", body)  # type: ignore[arg-type]
        return body


def buffer_for(t: Tensor, name: str) -> Buffer:
    strides = t.op.strides if isinstance(t.op, PlaceholderOp) else None
    return Buffer(name, t.dtype, t.shape, "global", strides, t.name)


def scalar_vars(exprs: Sequence[Expr]) -> list[Var]:
    out: list[Var] = []
    for e in exprs:
        for v in sorted(free_vars(e), key=lambda v: v.name):
            if v.kind in ("size", "stride") and v not in out:
                out.append(v)
    return out


@dataclass
class Signature:
    """The global buffers and the size/stride variables of a program's arguments, and the names
    they take (the kernel names and temporaries added later must avoid them)."""

    buffers: dict[Tensor, Buffer]
    scalars: list[Var]  # in order of first appearance in the arguments' shapes and strides
    names: set[str]

    def unique(self, base: str) -> str:
        return fresh_name(base, self.names, sep="_")


def signature(prog: Program) -> Signature:
    """Buffers for `prog.args` and their size/stride variables; every lowering starts here."""
    scalars: list[Var] = []
    for t in prog.args:
        b = buffer_for(t, t.name)
        for e in b.shape + (b.strides or ()):
            for v in sorted(free_vars(e), key=lambda v: v.name):
                if v not in scalars:
                    scalars.append(v)
    if len({v.name for v in scalars}) < len(scalars):
        twice = sorted({v.name for v in scalars if sum(w.name == v.name for w in scalars) > 1})
        raise TeccError(f"build(): two different size variables are named {', '.join(twice)}; rename one")
    # the size variables keep their names (the user's, in the kernels' parameters); a tensor of the
    # same name -- a buffer of a program's part, or a score tensor `S` over a length `S` -- takes
    # a fresh one (S_1)
    names: set[str] = {v.name for v in scalars}
    buffers = {t: buffer_for(t, fresh_name(t.name, names, sep="_")) for t in prog.args}
    return Signature(buffers, scalars, names)


def inlining(args: Sequence[Tensor]) -> Program:
    """The program `args` with the computes `lower` inlines chosen (its stages: the kernels)."""
    return choose_inlined(collect_program(args), epilogues=True)


def lower(args: Sequence[Tensor], name: str | None = None, chosen: Program | None = None) -> Module:
    """Lower the program whose signature is `args` to a module of naive (serial) kernels.
    `chosen`: its `inlining`, when the caller has it."""
    prog = chosen if chosen is not None else inlining(args)
    sig = signature(prog)
    buffers, scalars, names, unique = dict(sig.buffers), sig.scalars, sig.names, sig.unique
    temps: list[Buffer] = []
    for t in prog.stages:
        if t not in buffers:
            buffers[t] = buffer_for(t, unique(t.name))
            temps.append(buffers[t])

    inliner = Inliner(prog.inlined, buffers)
    kernels: list[PrimFunc] = []
    calls: list[KernelCall] = []
    for t in prog.stages:
        taken = set(names)
        body = _StageLowering(t, buffers[t], inliner, taken).lower()
        used = global_buffers(body)
        body_vars = scalar_vars(exprs_of(body) + [s for b in used for s in b.shape + (b.strides or ())])
        for v in body_vars:
            if v not in scalars:
                raise ShapeError(
                    f"compute {t.name} uses the size variable {v.name}, which no tensor in build()'s "
                    "argument list has in its shape; it could not be bound at call time"
                )
        ordered = [buffers[a] for a in prog.args if buffers[a] in used] + [b for b in temps if b in used]
        params = tuple(ordered) + tuple(v for v in scalars if v in body_vars)
        kname = unique(f"{t.name}_kernel")
        kernels.append(PrimFunc(kname, params, body))
        calls.append(KernelCall(kname, params))
    module_params = tuple(buffers[a] for a in prog.args) + tuple(scalars)
    mname = identifier(name or next(a.name for a in reversed(prog.args) if not a.is_placeholder))
    return Module(mname, module_params, tuple(kernels), tuple(calls), tuple(temps))


def global_buffers(body: Stmt) -> list[Buffer]:
    out: list[Buffer] = []

    def add(b: Buffer) -> None:
        if b.scope == "global" and b not in out:
            out.append(b)

    for s in iter_stmts(body):
        if isinstance(s, BufferStore):
            add(s.buffer)
        elif isinstance(s, AsyncCopy):
            add(s.src)
    for e in exprs_of(body):
        for n in walk(e):
            if isinstance(n, BufferLoad):
                add(n.buffer)
    return out


def unflatten(flat: Expr, shape: Sequence[Expr]) -> tuple[Expr, ...]:
    """The row-major index of element `flat` of `shape` (the first index is not reduced modulo
    its extent: `flat` is in range)."""
    idx: list[Expr] = []
    rest = flat
    for n, extent in enumerate(reversed(shape)):
        idx.append(rest if n == len(shape) - 1 else rest % extent)
        rest = rest // extent
    return tuple(reversed(idx))


def kernel_params(body: Stmt, arrays: Sequence[Buffer], temps: Sequence[Buffer],
                  scalars: Sequence[Var]) -> tuple[Buffer | Var, ...]:
    """The parameters of a kernel whose body is `body`, in the kernel ABI's order: the arrays it
    uses (in the order of `arrays`, the program's arguments), then the temporaries it uses, then
    the size/stride variables its statements and those buffers' shapes and strides need."""
    used = global_buffers(body)
    needed = scalar_vars(exprs_of(body) + [e for b in used for e in b.shape + (b.strides or ())])
    return (tuple(b for b in arrays if b in used) + tuple(t for t in temps if t in used)
            + tuple(v for v in scalars if v in needed))


def exprs_of(body: Stmt) -> list[Expr]:
    """Every expression held directly by a statement under `body`."""
    out: list[Expr] = []
    for s in iter_stmts(body):
        if isinstance(s, For):
            out += [s.min, s.extent]
        elif isinstance(s, BufferStore):
            out += list(s.indices) + [s.value]
        elif isinstance(s, IfThenElse):
            out.append(s.cond)
        elif isinstance(s, LetStmt):
            out.append(s.value)
        elif isinstance(s, Evaluate):
            out.append(s.value)
        elif isinstance(s, Allocate):
            out += list(s.buffer.shape)
        elif isinstance(s, AsyncCopy):
            out += list(s.dst_indices) + list(s.src_indices) + ([s.predicate] if s.predicate is not None else [])
        elif isinstance(s, MatrixLoad):
            out += list(s.src_indices)
    return out


__all__ = ["COMBINE", "Inliner", "Program", "buffer_for", "choose_inlined", "collect_program",
           "epilogue_consumer", "epilogue_reductions", "exprs_of", "global_buffers", "inlining", "kernel_params", "lower",
           "narrowed_operands", "reached", "scalar_vars", "unflatten"]
