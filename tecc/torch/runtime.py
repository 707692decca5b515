"""The compiled graph's callable: one precomputed launch list over numbered slots.

A slot holds one runtime value (a graph input, a program's output, an ATen result, a view made by
torch). The list is computed once, at compile time; a call binds the symbolic sizes from the
inputs, runs the steps in order and frees every slot after its last reader (so intermediate
tensors go back to torch's caching allocator as soon as they are dead), then returns the
output slots. What a step resolves per call (its argument templates, its outputs' shapes) is
compiled once, when the step is made (`compile_template`), so a call runs little Python beyond
the steps themselves. Three kinds of step:

- `RunProgram`: one tecc program (one `tc.build` of a segment, which may launch many kernels):
  its outputs are allocated with torch (`torch.empty`, on the inputs' device, from the caching
  allocator) and the kernels run in place: on CUDA tensors on torch's current stream, on CPU
  tensors in the SIMT emulator;
- `RunAten`: an op tecc did not lower, called as ATen with its arguments from the slots;
- `MakeView`: a view that leaves a program, made by torch's view ops on its materialized base
  (never a copy); once made, one `as_strided` for a base of the same sizes, strides and dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..ir.evaluate import evaluate
from ..ir.expr import Expr, Var
from ..runtime.runnable import RunnableKernel

Env = dict[Var, int]


@dataclass(frozen=True)
class Slot:
    """A reference to slot `index` in an argument template."""

    index: int


@dataclass(frozen=True)
class Size:
    """A symbolic size in an argument template, evaluated per call."""

    expr: Expr


def resolve(template: Any, slots: list[Any], env: Env) -> Any:
    if isinstance(template, Slot):
        return slots[template.index]
    if isinstance(template, Size):
        value = evaluate(template.expr, env)
        return int(value) if isinstance(value, (int, np.integer)) and not isinstance(value, bool) else value
    if isinstance(template, list):
        return [resolve(t, slots, env) for t in template]
    if isinstance(template, tuple):
        return tuple(resolve(t, slots, env) for t in template)
    if isinstance(template, dict):
        return {k: resolve(v, slots, env) for k, v in template.items()}
    return template


Resolver = Callable[[list[Any], Env], Any]


def compile_template(template: Any) -> Resolver:
    """`resolve(template, ...)` decided once: a function of (slots, env) that gives what
    `resolve` gives, made of one closure per Slot, Size, list, tuple and dict in the template;
    a part that holds none of them (and no list or dict, which `resolve` makes afresh per call)
    is returned as it is."""
    if _constant(template):
        return lambda slots, env: template
    if isinstance(template, Slot):
        index = template.index
        return lambda slots, env: slots[index]
    if isinstance(template, Size):
        return lambda slots, env: resolve(template, slots, env)
    if isinstance(template, list):
        items = [compile_template(t) for t in template]
        return lambda slots, env: [item(slots, env) for item in items]
    if isinstance(template, tuple):
        items = [compile_template(t) for t in template]
        return lambda slots, env: tuple(item(slots, env) for item in items)
    assert isinstance(template, dict)
    entries = [(k, compile_template(v)) for k, v in template.items()]
    return lambda slots, env: {k: entry(slots, env) for k, entry in entries}


def _constant(template: Any) -> bool:
    """Whether `resolve` returns `template` itself: no Slot, Size, list or dict in it."""
    return _free_of(template, (Slot, Size, list, dict))


def _free_of(template: Any, kinds: tuple[type, ...]) -> bool:
    """Whether no part of an argument template (itself, or an item of a list, tuple or dict in
    it) is one of `kinds`."""
    if isinstance(template, kinds):
        return False
    if isinstance(template, (list, tuple)):
        return all(_free_of(t, kinds) for t in template)
    if isinstance(template, dict):
        return all(_free_of(t, kinds) for t in template.values())
    return True


def shape_of(shape: Sequence[Any], env: Env) -> tuple[int, ...]:
    return tuple(int(evaluate(s, env)) if isinstance(s, Expr) else int(s) for s in shape)


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's memory as a NumPy array (no copy; bfloat16 through ml_dtypes)."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


@dataclass
class RunProgram:
    """One tecc program: read `inputs`, allocate and write `outputs`."""

    kernel: RunnableKernel                            # a built Kernel, or a LoadedKernel from the disk cache
    inputs: tuple[int, ...]
    contiguous: tuple[bool, ...]                      # per input: the placeholder wants row-major
    outputs: tuple[tuple[int, tuple[Any, ...], torch.dtype], ...]   # (slot, shape, dtype)
    emulate: bool                                     # CPU tensors: the SIMT emulator
    name: str = ""
    carriers: tuple[Var, ...] = ()                    # sizes passed as stride-0 placeholders
    device: Any = "cpu"                               # where the outputs live (the graph's device)
    # per input / output: None, or the memory order (channels_last) the program takes it in:
    # an input is passed permuted to that order, an output allocated in it and permuted back
    input_orders: tuple[tuple[int, ...] | None, ...] = ()
    output_orders: tuple[tuple[int, ...] | None, ...] = ()
    # per output: its shape when no size in it is symbolic (made once), else None
    _static_shapes: tuple[tuple[int, ...] | None, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._static_shapes = tuple(None if any(isinstance(n, Expr) for n in shape) else tuple(int(n) for n in shape)
                                    for _, shape, _ in self.outputs)

    def _carriers(self, env: Env, device: Any) -> list[Any]:
        if self.emulate:
            return [np.broadcast_to(np.zeros(1, np.int32), (env[v],)) for v in self.carriers]
        return [torch.zeros(1, dtype=torch.int32, device=device).expand(env[v]) for v in self.carriers]

    def run(self, slots: list[Any], env: Env) -> None:
        args = []
        for position, (slot, contiguous) in enumerate(zip(self.inputs, self.contiguous)):
            t = slots[slot]
            order = self.input_orders[position] if self.input_orders else None
            if order is not None:
                t = t.permute(order)
            if contiguous and not t.is_contiguous():
                t = t.contiguous()
            args.append(t)
        device = args[0].device if args else self.device
        outs = []
        for position, ((slot, shape, dtype), static) in enumerate(zip(self.outputs, self._static_shapes)):
            out = torch.empty(static if static is not None else shape_of(shape, env), dtype=dtype, device=device)
            order = self.output_orders[position] if self.output_orders else None
            slots[slot] = out if order is None else out.permute([order.index(d) for d in range(len(order))])
            outs.append(out)
        carriers = self._carriers(env, device) if self.carriers else []
        if self.emulate:
            self.kernel.sim(*[_as_numpy(t) for t in args], *carriers, *[_as_numpy(t) for t in outs])
        else:
            # a tensor that requires grad is passed detached (the runtime reads no autograd state)
            self.kernel(*[t.detach() if t.requires_grad else t for t in args], *carriers, *outs)


@dataclass
class RunAten:
    """An op tecc did not lower, called as torch would."""

    fn: Callable[..., Any]
    args: Any
    kwargs: Any
    output: int
    name: str = ""
    _resolvers: tuple[Resolver, Resolver] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._resolvers = (compile_template(self.args), compile_template(self.kwargs))

    def run(self, slots: list[Any], env: Env) -> None:
        args, kwargs = self._resolvers
        slots[self.output] = self.fn(*args(slots, env), **kwargs(slots, env))


def _same_every_call(template: Any) -> bool:
    """Whether an argument template holds no slot and no symbolic size (unlike `_constant`, lists
    and dicts count: `resolve` makes them afresh, but with the same items every call)."""
    return _free_of(template, (Slot, Size))


@dataclass
class MakeView:
    """A view of slot `base` made by torch's view ops, each (fn, args after the first, kwargs).

    Where the chain's arguments are fixed, its result for a base of given sizes, strides and
    dtype is remembered (sizes, strides, offset from the base's) and later calls on such a base
    make it with one `as_strided`: one torch call where the chain's aten view ops take one each
    (~8 us for a view, select and permute on the host, ~2 us for as_strided). A chain whose
    result is not a view of the base's storage (a reshape that copied) is not remembered."""

    base: int
    chain: tuple[tuple[Callable[..., Any], Any, Any], ...]
    output: int
    name: str = ""
    _links: tuple[tuple[Callable[..., Any], Resolver, Resolver], ...] = field(init=False, repr=False, compare=False)
    _fixed: bool = field(init=False, repr=False, compare=False)
    _strided: dict[Any, tuple[Any, Any, int]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._links = tuple((fn, compile_template(args), compile_template(kwargs)) for fn, args, kwargs in self.chain)
        self._fixed = all(_same_every_call(args) and _same_every_call(kwargs) for _, args, kwargs in self.chain)
        self._strided = {}

    def run(self, slots: list[Any], env: Env) -> None:
        base = slots[self.base]
        key = (base.shape, base.stride(), base.dtype) if self._fixed and isinstance(base, torch.Tensor) else None
        known = self._strided.get(key) if key is not None else None
        if known is not None:
            size, stride, offset = known
            slots[self.output] = base.as_strided(size, stride, base.storage_offset() + offset)
            return
        value = base
        for fn, args, kwargs in self._links:
            value = fn(value, *args(slots, env), **kwargs(slots, env))
        if key is not None and isinstance(value, torch.Tensor) and value.dtype == base.dtype \
                and value.untyped_storage().data_ptr() == base.untyped_storage().data_ptr():
            self._strided[key] = (value.shape, value.stride(), value.storage_offset() - base.storage_offset())
        slots[self.output] = value


Step = RunProgram | RunAten | MakeView


class CompiledGraph:
    """What the backend returns for one ATen graph: call it with the graph's inputs (a list,
    boxed: the list is emptied so the inputs can be freed early) to get its outputs."""

    _boxed_call = True  # AOTAutograd passes the inputs as one list it lets us clear

    def __init__(self, name: str, inputs: int, slots: int, steps: Sequence[Step], frees: Sequence[tuple[int, ...]],
                 outputs: Any, sizes: Sequence[tuple[Var, int, int | None]], report: Any = None) -> None:
        self.name = name
        self.inputs = inputs
        self.slot_count = slots
        self.steps = tuple(steps)
        self.frees = tuple(frees)
        self.outputs = outputs
        self._outputs = compile_template(outputs)
        self.sizes = tuple(sizes)   # (size var, input position, dimension or None for an int input)
        self.report = report

    def bind_sizes(self, args: Sequence[Any]) -> Env:
        env: Env = {}
        for v, position, dim in self.sizes:
            if v in env:
                continue
            a = args[position]
            env[v] = int(a if dim is None else a.shape[dim])
        return env

    def __call__(self, args: list[Any]) -> Any:
        slots: list[Any] = [None] * self.slot_count
        slots[: self.inputs] = args
        env = self.bind_sizes(args) if self.sizes else {}
        if isinstance(args, list):
            args.clear()
        for step, free in zip(self.steps, self.frees):
            step.run(slots, env)
            for s in free:
                slots[s] = None
        return self._outputs(slots, env)

    @property
    def programs(self) -> list[RunProgram]:
        return [s for s in self.steps if isinstance(s, RunProgram)]

    def __repr__(self) -> str:
        kinds = ", ".join(type(s).__name__ for s in self.steps)
        return f"<tecc compiled graph {self.name}: {kinds}>"


def with_cuda_graph(compiled: CompiledGraph) -> Callable[[list[Any]], Any]:
    """Replay the whole graph as one CUDA graph (`cudagraphs=True`, the torch-level variant):
    the first call runs as is (warm-up: loads the cubins, fills the launch caches), the second
    captures into static inputs and outputs, every later call copies its inputs in, replays, and
    returns clones of the outputs (they outlive the next replay). It captures what the runtime's
    own graphs leave on the host (fallbacks, views, output allocation) at the price of those
    copies; without it each program's call is already one graph launch once its pointers repeat
    (tecc/runtime/graphs.py; docs/models.md, "Runtime"). Inside this capture the runtime sees
    the stream capturing and launches plainly into it."""
    state: dict[str, Any] = {}

    def run(args: list[Any]) -> Any:
        if "graph" not in state:
            if not state.get("warm"):
                state["warm"] = True
                return compiled(args)
            static = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
            args.clear()
            graph = torch.cuda.CUDAGraph()
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                out = compiled(list(static))
            state.update(graph=graph, static=static, out=out)
            graph.replay()
            return _cloned(out)
        for dst, src in zip(state["static"], args):
            if isinstance(dst, torch.Tensor):
                dst.copy_(src)
        args.clear()
        state["graph"].replay()
        return _cloned(state["out"])

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def _cloned(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, (list, tuple)):
        return type(out)(_cloned(o) for o in out)
    return out
