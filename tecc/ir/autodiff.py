"""Reverse-mode differentiation of tensor expressions: `grad(C, [A, B])`.

The result is more tensor expressions, built with the same language as the forward program, so
the backward pass is compiled by the same planner as any other program:

    C = compute(...)                      # from placeholders A, B
    g = grad(C, [A, B])                   # g.cotangent: placeholder dC (C's shape and dtype)
    back = build(g.args)                  # [*g.inputs, dC, dA, dB]: inputs, cotangent, gradients

How (docs/pytorch.md, "Gradients"):

1. **Normalize.** Every compute stage becomes either one reduction (`T[i] = sum/max/min_k h`)
   or reduction-free (elementwise with reads), by moving each reduction embedded in a larger
   body (`sum_k A*B + bias[j]`) into a stage of its own (`C.reduce0`). The backward program
   recomputes the forward stages it needs from the inputs.
2. **Adjoints, last stage first.** With the adjoint dT of a stage known, each read `X[idx(p)]`
   of its body gets the scalar adjoint `g(p) = dT[i] · ∂body/∂X[idx(p)]` over the stage's
   iteration space p = (axes i, reduction axes k), by reverse mode on the scalar expression
   (the rules in `autodiff_scalar.py`). For a max/min reduction the seed is the mask of the
   elements that reached the extremum, `where(h == T[i], dT[i] / count[i], 0)`: ties share the
   gradient equally (as torch.amax), `count[i]` being how many elements tie.
3. **Gather, not scatter.** `dX[x] = Σ_{p : idx(p) = x} g(p)` is written as a compute over X's
   shape: each coordinate of X's index that is an axis plus a constant (`i`, `k`, `j + 1`, a
   constant) fixes that axis from x (with a guard when the ranges differ), and the axes that no
   coordinate fixes are summed (`tc.sum`). Matmuls, broadcasts, transposes and shifts have this
   form; other indices (`X[i + k]`, `X[2 * i]`) raise TeccError naming the read. A read whose
   index is data-dependent (`W[idx[i], j]`: embedding, gather) is the one exception: its
   contribution *is* a scatter, `tc.scatter_add(X.shape, over=p, at=idx(p), value=g(p))`.
   Conversely the adjoint of a scatter (`T[at(x)] += v(x)`, tecc/ir/scatter.py) seeds its value
   with a gather, `dT[at(x)]`, over the scatter's domain, and its `init` with dT itself.
4. **Accumulate.** A tensor read by several stages (or several times) sums the contributions,
   each reduction in a stage of its own.

Only float tensors get gradients; reads of integer and bool tensors (the indices of a gather or
a scatter among them), comparisons, `floor`,
`ceil`, `round` and float→int casts pass no gradient. A max/min stage that the output does not
depend on -- a row maximum subtracted only to keep `exp` in range, as in softmax, log-softmax,
log-sum-exp and attention -- passes none either: `autodiff_algebra.shift_invariant` proves that
shifting it leaves the output unchanged, so the backward has no adjoint of it, no tie count and
no scatter onto the maximum.

**Saved values.** `grad(output, wrt, save=[mu, rstd])`: the backward program reads those forward
tensors (row statistics, a log-sum-exp) as inputs instead of recomputing them. They become
placeholders of the same shape and dtype (`Gradients.saved`), the forward to build is
`Gradients.forward = [*inputs, output, *save]`, and the backward's signature is
`[*inputs, *saved, cotangent, *grads]`. The gradient still flows through the saved tensors'
definitions; only their values are read. `Gradients.forward_backward`: both as ONE program.

**Attention.** An output that is the contraction of an online-softmax chain is differentiated in
the FlashAttention-2 form instead (tecc/ir/autodiff_online.py, unless `online=False` or `save=`
is given): its forward also saves the log-sum-exp, and `Gradients.saved` holds the output and
the log-sum-exp.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

from .errors import DTypeError, GradientError
from .expr import (
    Binary,
    Const,
    Expr,
    IterVar,
    Reduce,
    ReduceAxis,
    TensorRead,
    Var,
    binary,
    cast,
    compare,
    const_int,
    logical_and,
    select,
    substitute,
    walk,
)
from .ops import sum as reduce_sum
from .autodiff_algebra import replace_reads, shift_invariant
from .autodiff_online import online_chain, online_gradient
from .autodiff_scalar import scalar_adjoints
from .scatter import ScatterOp, data_dependent, scatter_add
from .tensor import ComputeOp, Tensor, compute, placeholder, reduce_axis
from .visitor import ExprMutator


@dataclass(frozen=True)
class Gradients:
    """What `grad` returns.

    `cotangent` is the new placeholder dC (the output's shape and dtype) that the backward
    program takes; `grads` the tensors dL/dX, one per requested input, each of that input's
    shape and dtype; `inputs` the placeholders of the forward program in the order they are
    first read; `args` the kernel signature to build: `[*inputs, *saved, cotangent, *grads]`.

    `forward` is the forward program's signature to build, `[*inputs, output, *save]`, and
    `saved` the backward's placeholders for the last len(saved) tensors of `forward` (named like
    them), whose values the backward reads instead of recomputing. With `save=` they are the
    placeholders of the `save` tensors; for an online-softmax chain (attention,
    tecc.ir.autodiff_online, docs/training.md) the forward also computes the log-sum-exp (its one
    `save` tensor) and `saved` holds the output and the log-sum-exp; otherwise `forward` is
    `[*inputs, output]` and `saved` is empty. `form` says how the gradient was derived (and, for
    a chain refused by the online form, why). `g[X]` is X's gradient, and iterating yields the
    gradients in `wrt` order (`dA, dB = g`).

    `forward_backward` = `[*inputs, cotangent, output, *grads]`: one program for a cotangent known
    before the forward runs (a loss's seed), reading the normalized forward's stages (training.md);
    in the online form the gradients read the forward's output and log-sum-exp stages instead of
    the saved placeholders."""

    output: Tensor
    wrt: tuple[Tensor, ...]
    inputs: tuple[Tensor, ...]
    cotangent: Tensor
    grads: tuple[Tensor, ...]
    saved: tuple[Tensor, ...] = ()
    forward: tuple[Tensor, ...] = ()
    forward_backward: tuple[Tensor, ...] = ()
    form: str = "reverse mode"

    @property
    def args(self) -> list[Tensor]:
        return [*self.inputs, *self.saved, self.cotangent, *self.grads]

    def __getitem__(self, tensor: Tensor) -> Tensor:
        """The gradient with respect to `tensor` (one of `wrt`)."""
        for x, g in zip(self.wrt, self.grads):
            if x is tensor:
                return g
        raise KeyError(tensor.name)

    def __iter__(self) -> Iterator[Tensor]:
        """The gradients in `wrt` order: `dA, dB = tc.grad(C, [A, B])`."""
        return iter(self.grads)

    def __len__(self) -> int:
        return len(self.grads)


def grad(output: Tensor, wrt: Sequence[Tensor], *, cotangent_name: str | None = None,
         save: Sequence[Tensor] = (), online: bool = True) -> Gradients:
    """The gradients of `output` with respect to the placeholders `wrt` (module docstring).

    save: computes of `output`'s program (not the output itself) whose values the backward
    program takes as inputs instead of recomputing them (module docstring, "Saved values").

    online: when `output` is the contraction of an online-softmax chain (attention) and `save`
    is empty, derive the FlashAttention-2 form, which reads the forward's saved output and
    log-sum-exp (`Gradients.saved`, `Gradients.forward`); False takes the generic reverse mode,
    which recomputes the forward inside the backward program. With `save` given the caller has
    chosen what the backward reads, so the generic reverse mode is taken (`Gradients.form` says so).

    Raises GradientError for what cannot be differentiated (a `prod` reduction, a reduction
    nested in another, a read whose index is not an axis plus a constant), DTypeError when a
    requested input or the output is not a float tensor."""
    if not isinstance(output, Tensor):
        raise GradientError(f"grad(): the output must be a tensor, got {type(output).__name__}")
    wrt = tuple(wrt)
    for x in wrt:
        if not isinstance(x, Tensor) or not x.is_placeholder:
            shown = x.name if isinstance(x, Tensor) else type(x).__name__
            raise GradientError(f"grad(): {shown} is not a placeholder; gradients are taken with respect to "
                                "the program's inputs")
        if not x.dtype.is_float:
            raise DTypeError(f"grad(): input {x.name} is {x.dtype}; only float tensors have gradients")
    if not output.dtype.is_float:
        raise DTypeError(f"grad(): output {output.name} is {output.dtype}; only a float output can be differentiated")
    if output.is_placeholder:
        raise GradientError(f"grad(): the output {output.name} is a placeholder; pass a compute of the inputs")

    inputs = _placeholders(output)
    builder = _Backward(output, wrt)
    form = "reverse mode"
    if online and save:
        if not isinstance(online_chain(output, _topological(output)), str):
            form = ("reverse mode (not the online form: save= given; the online form saves the output and its "
                    "log-sum-exp)")
    elif online:
        found = online_gradient(output, wrt, _topological(output), builder._name, cotangent_name, builder.reverse)
        if not isinstance(found, str):
            grads = tuple(found.grads[id(x)] if id(x) in found.grads else builder.zeros(x) for x in wrt)
            computed = replace_reads(grads, {id(p): t for p, t in zip(found.saved, found.forward_outputs)})
            return Gradients(output, wrt, inputs, found.cotangent, grads, saved=found.saved,
                             forward=(*inputs, *found.forward_outputs),
                             forward_backward=(*inputs, found.cotangent, output, *computed), form=found.form)
        if not found.startswith("no stage is a max"):
            form = f"reverse mode (not the online form: {found})"
    name = cotangent_name or builder._name(f"d{output.name}")
    builder.taken.add(name)
    dC = placeholder(output.shape, output.dtype, name=name)
    grads = builder.run(dC)
    joint = (*inputs, dC, builder.output, *grads)  # before `save` retargets the reads
    saved = builder.saved_placeholders(tuple(save))
    if saved:
        grads = tuple(replace_reads(grads, {id(builder.normalized(t)): p for t, p in zip(save, saved)}))
    return Gradients(output, wrt, inputs, dC, grads, saved=saved, forward=(*inputs, output, *save),
                     forward_backward=joint, form=form)


# ---- the forward DAG ------------------------------------------------------------------------------

def _reads(body: Expr) -> list[TensorRead]:
    return [n for n in walk(body) if isinstance(n, TensorRead)]


def _placeholders(output: Tensor) -> tuple[Tensor, ...]:
    """The placeholders of `output`'s program, in the order a depth-first walk first reads them."""
    seen: set[int] = set()
    found: list[Tensor] = []

    def visit(t: Tensor) -> None:
        if id(t) in seen:
            return
        seen.add(id(t))
        if t.is_placeholder:
            found.append(t)
            return
        assert isinstance(t.op, ComputeOp)
        for r in _reads(t.op.body):
            visit(r.tensor)

    visit(output)
    return tuple(found)


def _topological(output: Tensor, leaves: frozenset[int] = frozenset()) -> list[Tensor]:
    """Every tensor of `output`'s program, producers before consumers; the tensors with ids in
    `leaves` are taken as given (their producers are not visited)."""
    order: list[Tensor] = []
    seen: set[int] = set()

    def visit(t: Tensor) -> None:
        if id(t) in seen:
            return
        seen.add(id(t))
        if isinstance(t.op, ComputeOp) and id(t) not in leaves:
            for r in _reads(t.op.body):
                visit(r.tensor)
        order.append(t)

    visit(output)
    return order


class _Retarget(ExprMutator):
    """Rewrites reads of tensors to their normalized replacements and replaces whole reduction
    nodes by reads of the stages they moved to."""

    def __init__(self, tensors: dict[int, Tensor], reductions: dict[int, Expr]) -> None:
        super().__init__()
        self.tensors = tensors
        self.reductions = reductions

    def visit_Reduce(self, e: Reduce) -> Expr:
        hit = self.reductions.get(id(e))
        return hit if hit is not None else self.generic_visit(e)

    def visit_TensorRead(self, e: TensorRead) -> Expr:
        idx = tuple(self.visit(i) for i in e.indices)
        target = self.tensors.get(id(e.tensor), e.tensor)
        if target is e.tensor and all(a is b for a, b in zip(idx, e.indices)):
            return e
        return TensorRead(target, idx)


def _normalize(output: Tensor, replaced: dict[int, Tensor], leaves: frozenset[int] = frozenset()) -> Tensor:
    """`output`'s program with every stage either one reduction or reduction-free (step 1);
    `replaced` receives, by id of the forward tensor, the tensors that changed. The tensors with
    ids in `leaves` are kept as they are."""
    for t in _topological(output, leaves):
        if not isinstance(t.op, ComputeOp) or id(t) in leaves:
            continue
        if isinstance(t.op, ScatterOp):
            _retarget_scatter(t, replaced)
            continue
        body = t.op.body
        embedded = [n for n in walk(body) if isinstance(n, Reduce)] if not isinstance(body, Reduce) else []
        if isinstance(body, Reduce):
            for n in walk(body.source):
                if isinstance(n, Reduce):
                    raise GradientError(f"grad(): {t.name} nests the reduction {n} inside another; write the inner "
                                        "reduction as a stage of its own")
        moved: dict[int, Expr] = {}
        for pos, red in enumerate(embedded):
            if any(isinstance(n, Reduce) for n in walk(red.source)):
                raise GradientError(f"grad(): {t.name} nests a reduction inside {red}; write the inner reduction as "
                                    "a stage of its own")
            source = _Retarget(replaced, {}).visit(red)
            stage = compute(t.shape, _renamed_axes(t.op.axes, source), name=f"{t.name}_reduce{pos}")
            moved[id(red)] = TensorRead(stage, tuple(t.op.axes))
        new_body = _Retarget(replaced, moved).visit(body)
        if new_body is not body:
            replaced[id(t)] = Tensor(ComputeOp(t.name, t.op.axes, new_body), t.shape, t.dtype)
    return replaced.get(id(output), output)


def _retarget_scatter(t: Tensor, replaced: dict[int, Tensor]) -> None:
    """A scatter stage stays a scatter (its adjoint is a gather): rebuilt on the normalized
    tensors it reads, if any was replaced."""
    op = t.op
    assert isinstance(op, ScatterOp)
    if not any(id(r.tensor) in replaced for r in _reads(op.body)):
        return
    mutator = _Retarget(replaced, {})
    init = replaced.get(id(op.init), op.init) if op.init is not None else None
    new = ScatterOp(op.name, op.axes, mutator.visit(op.body), op.domain, tuple(mutator.visit(e) for e in op.at),
                    mutator.visit(op.value), init)
    replaced[id(t)] = Tensor(new, t.shape, t.dtype)


# ---- gathering adjoints onto an input's shape --------------------------------------------------

@dataclass(frozen=True)
class _Contribution:
    """`Σ_{p in space : read.indices(p) = x} value(p)`, a part of the adjoint of read.tensor."""

    stage: Tensor
    read: TensorRead
    value: Expr
    space: tuple[IterVar, ...]


def _affine_axis(ix: Expr, space: Sequence[IterVar]) -> tuple[IterVar | None, Expr] | None:
    """`ix` as (axis, offset) when it is an axis of `space` plus a constant (offset an integer
    expression free of the space's axes), (None, ix) when no axis of the space occurs in it,
    None otherwise."""
    axes = set(space)
    used = [n for n in walk(ix) if isinstance(n, Var) and n in axes]
    if not used:
        return None, ix
    if isinstance(ix, IterVar) and ix in axes:
        return ix, Const(0, ix.dtype)
    if isinstance(ix, Binary) and ix.op in ("+", "-"):
        left = ix.a if isinstance(ix.a, IterVar) and ix.a in axes else None
        right = ix.b if isinstance(ix.b, IterVar) and ix.b in axes else None
        if left is not None and not any(n in axes for n in walk(ix.b) if isinstance(n, Var)):
            return left, ix.b if ix.op == "+" else -ix.b
        if right is not None and ix.op == "+" and not any(n in axes for n in walk(ix.a) if isinstance(n, Var)):
            return right, ix.a
    return None


def _grouped_axis(ix: Expr, space: Sequence[IterVar]) -> tuple[IterVar, int] | None:
    """(axis, G) when `ix` is `axis // G` for an axis of `space` from 0 and a constant G > 0
    (grouped heads: K[b, h // G, j, d] is read by the G heads h = G·x .. G·x + G - 1)."""
    if not (isinstance(ix, Binary) and ix.op == "//" and isinstance(ix.a, IterVar) and ix.a in set(space)):
        return None
    group = const_int(ix.b)
    if group is None or group < 1 or const_int(ix.a.lo) != 0:
        return None
    return ix.a, group


def _gather_body(x: Tensor, c: _Contribution) -> Callable[..., Expr]:
    """The compute function of one contribution over x's axes (step 3). An index `axis // G`
    (grouped heads) fixes `axis` to G·x + g and sums over g in [0, G)."""
    forms: list[tuple[IterVar | None, Expr] | tuple[IterVar, int]] = []
    for pos, ix in enumerate(c.read.indices):
        form = _affine_axis(ix, c.space) or _grouped_axis(ix, c.space)
        if form is None:
            raise GradientError(
                f"grad(): cannot differentiate {c.stage.name}'s read {c.read} with respect to {x.name}: index {pos} "
                f"({ix}) is not one axis plus a constant or an axis divided by a constant; tc.grad handles reads like "
                "X[i, k], X[j], X[i + 1], X[h // 4] (matmuls, broadcasts, transposes, shifts, grouped heads), not "
                "convolution-like X[i + k] or strided X[2 * i]"
            )
        forms.append(form)

    def body(*xs: Var) -> Expr:
        mapping: dict[Var, Expr] = {}
        conds: list[Expr] = []
        summed = []
        for pos, form in enumerate(forms):
            coordinate = xs[pos]
            axis, offset = form
            if isinstance(offset, int):   # axis // G: axis = G·coordinate + g, g summed
                assert axis is not None
                if axis in mapping:
                    conds.append(compare("==", binary("//", mapping[axis], offset), coordinate))
                    continue
                group = reduce_axis(offset, name=f"{axis.name}_group")
                mapping[axis] = coordinate * offset + group
                summed.append(group)
                extent = const_int(axis.extent)
                if extent is None or extent % offset:
                    conds.append(compare("<", mapping[axis], axis.extent))
                continue
            if axis is None:
                conds.append(compare("==", coordinate, offset))
                continue
            value = binary("-", coordinate, offset)
            if axis in mapping:
                conds.append(compare("==", mapping[axis], value))
                continue
            mapping[axis] = value
            if not (isinstance(offset, Const) and offset.value == 0 and isinstance(axis.lo, Const)
                    and axis.lo.value == 0 and axis.extent is x.shape[pos]):
                conds.append(compare(">=", value, axis.lo))
                conds.append(compare("<", value, binary("+", axis.lo, axis.extent)))
        for axis in c.space:
            if axis not in mapping:
                fresh = reduce_axis((axis.lo, binary("+", axis.lo, axis.extent)), name=f"{axis.name}_")
                mapping[axis] = fresh
                summed.append(fresh)
        value = substitute(c.value, mapping)
        if conds:
            value = select(logical_and(*conds), value, 0)
        if summed:
            value = reduce_sum(value, axis=summed)
        return value

    return body


# ---- the backward program ---------------------------------------------------------------------

class _Backward:
    """Reverse mode over the program of `output`. `constants` holds the ids of the tensors
    through which no gradient flows: those given to the constructor (values the caller treats as
    given, e.g. the probabilities of the online form's dV: neither normalized nor looked into)
    and the max/min stages the output is shift-invariant to (found after `_active`)."""

    def __init__(self, output: Tensor, wrt: tuple[Tensor, ...], constants: Sequence[Tensor] = ()) -> None:
        given = frozenset(id(t) for t in constants)
        self.forward = _topological(output, given)
        self.replaced: dict[int, Tensor] = {}
        self.output = _normalize(output, self.replaced, given)
        self.wrt = wrt
        self.order = _topological(self.output, given)
        self.constants: set[int] = set(given)
        self.active = self._active()
        # a max/min stage the output is invariant to passes no gradient (autodiff_algebra.py)
        invariant = {id(t) for t in self.order if id(t) in self.active and _is_extremum(t)
                     and shift_invariant(t, self.order, self.output)}
        if invariant:
            self.constants |= invariant
            self.active = self._active()
        self.names = itertools.count()
        self.taken: set[str] = {t.name for t in self.order}

    def normalized(self, t: Tensor) -> Tensor:
        """The tensor of the normalized program that computes forward tensor `t`."""
        return self.replaced.get(id(t), t)

    def saved_placeholders(self, save: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        """A placeholder per saved forward tensor, named after it (module docstring)."""
        ids = {id(t) for t in self.forward}
        out = []
        for t in save:
            if not isinstance(t, Tensor) or t.is_placeholder or id(t) not in ids or t is self.forward[-1]:
                shown = t.name if isinstance(t, Tensor) else type(t).__name__
                raise GradientError(f"grad(): save= names {shown}, which is not a compute of the output's program "
                                    "(other than the output); save the statistics the forward computes, e.g. a "
                                    "row mean or a log-sum-exp")
            # the forward's tensor of that name is no longer read once the placeholder replaces it
            out.append(placeholder(t.shape, t.dtype, name=t.name))
        return tuple(out)

    def _active(self) -> set[int]:
        """Ids of the float tensors on a path from a requested input to the output (no path
        through `constants`)."""
        wanted = {id(x) for x in self.wrt}
        active: set[int] = set()
        for t in self.order:
            if not t.dtype.is_float or id(t) in self.constants:
                continue
            if id(t) in wanted:
                active.add(id(t))
            elif isinstance(t.op, ComputeOp) and any(id(r.tensor) in active for r in _reads(t.op.body)):
                active.add(id(t))
        return active

    def _name(self, want: str) -> str:
        name = want
        while name in self.taken:
            name = f"{want}_{next(self.names)}"
        self.taken.add(name)
        return name

    def run(self, cotangent: Tensor) -> tuple[Tensor, ...]:
        contributions: dict[int, list[_Contribution]] = {}
        adjoints: dict[int, Tensor] = {id(self.output): cotangent}
        for t in reversed(self.order):
            if id(t) not in self.active:
                continue
            if id(t) not in adjoints:
                adjoints[id(t)] = self._accumulate(t, contributions.get(id(t), []))
            if isinstance(t.op, ComputeOp):
                for c in self._stage_contributions(t, adjoints[id(t)]):
                    contributions.setdefault(id(c.read.tensor), []).append(c)
        grads = []
        for x in self.wrt:
            found = adjoints.get(id(x))
            if found is None:  # the output does not depend on x
                found = self.zeros(x)
            grads.append(found)
        return tuple(grads)

    def zeros(self, x: Tensor) -> Tensor:
        """dx = 0 (the output does not depend on x)."""
        return compute(x.shape, lambda *_: Const(0.0, x.dtype), name=self._name(f"d{x.name}"))

    def reverse(self, stage: Tensor, wrt: Sequence[Tensor], cotangent: Tensor,
                constants: Sequence[Tensor]) -> tuple[Tensor, ...]:
        """The gradients of `stage` (a compute built beside this program) with respect to `wrt`
        for the adjoint `cotangent` (a tensor of stage's shape), no gradient flowing through
        `constants`; its tensors take names not taken in this program."""
        sub = _Backward(stage, tuple(wrt), constants)
        sub.taken |= self.taken
        found = sub.run(cotangent)
        self.taken |= sub.taken
        return found

    def _stage_contributions(self, t: Tensor, dt_: Tensor) -> list[_Contribution]:
        assert isinstance(t.op, ComputeOp)
        if isinstance(t.op, ScatterOp):
            return self._scatter_contributions(t, t.op, dt_)
        axes = tuple(t.op.axes)
        body = t.op.body
        seed: Expr = TensorRead(dt_, axes)
        if not isinstance(body, Reduce):
            space = axes
            source = body
        else:
            space = axes + tuple(body.axes)
            source = body.source
            if body.combiner == "prod":
                raise GradientError(
                    f"grad(): {t.name} is a prod reduction, which tc.grad does not differentiate; write it as "
                    "exp(sum(log(x))) for positive x"
                )
            if body.combiner in ("max", "min"):
                reached = compare("==", source, TensorRead(t, axes))
                count = self._tie_count(t, body, reached)
                seed = select(reached, seed / TensorRead(count, axes), 0)
        return [_Contribution(t, read, value, space)
                for read, value in scalar_adjoints(source, seed, self.active).items()]

    def _scatter_contributions(self, t: Tensor, op: ScatterOp, dt_: Tensor) -> list[_Contribution]:
        """A scatter `T[at(x)] += v(x)` (+ init): v's reads get the gathered adjoint dT[at(x)]
        over the domain x, init's read dT itself."""
        seed = TensorRead(dt_, op.at)
        out = [_Contribution(t, read, value, op.domain)
               for read, value in scalar_adjoints(op.value, seed, self.active).items()]
        if op.init is not None and id(op.init) in self.active:
            read = TensorRead(op.init, op.axes)
            out.append(_Contribution(t, read, TensorRead(dt_, op.axes), op.axes))
        return out

    def _scattered(self, x: Tensor, c: _Contribution, name: str) -> Tensor:
        """The contribution of a read with a data-dependent index: a scatter of its adjoint
        onto x at the read's position, over the contribution's iteration space."""
        space = c.space

        def moved(e: Expr, xs: Sequence[Var]) -> Expr:
            return substitute(e, {a: binary("+", v, a.lo) if not (isinstance(a.lo, Const) and a.lo.value == 0) else v
                                  for a, v in zip(space, xs)})

        return scatter_add(x.shape, tuple(a.extent for a in space),
                           at=lambda *xs: tuple(moved(ix, xs) for ix in c.read.indices),
                           value=lambda *xs: cast(moved(c.value, xs), x.dtype), dtype=x.dtype,
                           name=self._name(name))

    def _tie_count(self, t: Tensor, body: Reduce, reached: Expr) -> Tensor:
        """`count[i]`: how many elements of t's reduction reach its max/min (at least 1)."""
        assert isinstance(t.op, ComputeOp)
        axes = t.op.axes

        def fcompute(*xs: Var) -> Expr:
            fresh = [reduce_axis((a.lo, binary("+", a.lo, a.extent)), name=f"{a.name}_") for a in body.axes]
            mapping: dict[Var, Expr] = dict(zip(axes, xs))
            mapping.update(zip(body.axes, fresh))
            return reduce_sum(select(substitute(reached, mapping), Const(1.0, t.dtype), Const(0.0, t.dtype)),
                              axis=fresh)

        return compute(t.shape, fcompute, name=self._name(f"{t.name}_ties"))

    def _accumulate(self, x: Tensor, parts: list[_Contribution]) -> Tensor:
        """dx: the sum of its contributions (step 4)."""
        name = f"d{x.name}"
        if not parts:
            return compute(x.shape, lambda *_: Const(0.0, x.dtype), name=self._name(name))
        if len(parts) == 1:
            if _gathers(parts[0]):
                return self._scattered(x, parts[0], name)
            return compute(x.shape, _cast_to(x, _gather_body(x, parts[0])), name=self._name(name))
        terms: list[Callable[..., Expr]] = []
        for c in parts:
            if _gathers(c):
                part = self._scattered(x, c, f"{name}_from_{c.stage.name}")
                terms.append(lambda *xs, part=part: TensorRead(part, tuple(xs)))
                continue
            body = _gather_body(x, c)
            if any(isinstance(n, ReduceAxis) for n in walk(c.value)) or self._sums(x, c):
                part = compute(x.shape, _cast_to(x, body), name=self._name(f"{name}_from_{c.stage.name}"))
                terms.append(lambda *xs, part=part: TensorRead(part, tuple(xs)))
            else:
                terms.append(body)

        def total(*xs: Var) -> Expr:
            out = terms[0](*xs)
            for term in terms[1:]:
                out = out + term(*xs)
            return cast(out, x.dtype)

        return compute(x.shape, total, name=self._name(name))

    @staticmethod
    def _sums(x: Tensor, c: _Contribution) -> bool:
        """Whether the contribution sums over axes its read does not fix."""
        fixed = {form[0] for form in (_affine_axis(ix, c.space) for ix in c.read.indices) if form is not None}
        return any(axis not in fixed for axis in c.space)


def _gathers(c: _Contribution) -> bool:
    """Whether the contribution's read has a data-dependent index (its adjoint is a scatter)."""
    return any(data_dependent(ix) for ix in c.read.indices)


def _is_extremum(t: Tensor) -> bool:
    return isinstance(t.op, ComputeOp) and isinstance(t.op.body, Reduce) and t.op.body.combiner in ("max", "min")


def _cast_to(x: Tensor, body: Callable[..., Expr]) -> Callable[..., Expr]:
    def cast_body(*xs: Var) -> Expr:
        return cast(body(*xs), x.dtype)

    return cast_body


def _renamed_axes(axes: Sequence[IterVar], body: Expr) -> Callable[..., Expr]:
    """A compute function giving `body` with `axes` replaced by the new compute's own axes."""

    def fcompute(*xs: Var) -> Expr:
        return substitute(body, dict(zip(axes, xs)))

    return fcompute


__all__ = ["GradientError", "Gradients", "grad"]
