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

import math
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..compiler import options
from ..ir.evaluate import evaluate
from ..ir.expr import Expr, Var
from ..runtime.launch_cache import LaunchEntry
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
    # positions of the inputs an ATen fallback made (CompiledGraph: their layouts are compared)
    watched: tuple[int, ...] = field(default=(), repr=False, compare=False)
    # per number of the graph inputs' layouts: the launch-cache entry the program's call ran as,
    # and the watched inputs' layouts then
    _entries: dict[int, tuple[LaunchEntry, tuple[Any, ...]]] = field(init=False, repr=False, compare=False)
    # the numbers of the graph inputs' layouts under which no input needed a copy (`_arguments`),
    # and the inputs passed permuted: (position, order)
    _uncopied: set[int] = field(init=False, repr=False, compare=False)
    _ordered: tuple[tuple[int, tuple[int, ...]], ...] = field(init=False, repr=False, compare=False)
    # per device: per output, a tensor its allocations are made like (`_prototypes`), or None
    _protos: dict[Any, tuple[Any, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._static_shapes = tuple(None if any(isinstance(n, Expr) for n in shape) else tuple(int(n) for n in shape)
                                    for _, shape, _ in self.outputs)
        self._entries = {}
        self._uncopied = set()
        self._ordered = tuple((p, o) for p, o in enumerate(self.input_orders) if o is not None)
        self._protos = {}

    def _carriers(self, env: Env, device: Any) -> list[Any]:
        if self.emulate:
            return [np.broadcast_to(np.zeros(1, np.int32), (env[v],)) for v in self.carriers]
        return [torch.zeros(1, dtype=torch.int32, device=device).expand(env[v]) for v in self.carriers]

    def run(self, slots: list[Any], env: Env, layouts: int | None = None) -> None:
        """Allocate the outputs into their slots and run the program. `layouts` numbers the
        graph inputs' layouts of this call (CompiledGraph.__call__; None: not known): every
        argument then has the layout it had on the earlier call of that number, so the launch
        that call ran as is launched again on the new pointers alone (RunnableKernel.relaunch),
        without reading each argument's key."""
        args = self._arguments(slots, layouts)
        device = args[0].device if args else self.device
        protos = () if self.emulate else self._protos.get(device)
        if protos is None:
            protos = self._protos[device] = self._prototypes(device)
        outs = []
        for position, ((slot, shape, dtype), static) in enumerate(zip(self.outputs, self._static_shapes)):
            proto = protos[position] if protos else None
            # (sizes as separate arguments: ~0.5 us less per call than a tuple, in torch's parser)
            out = torch.empty_like(proto) if proto is not None else \
                torch.empty(*(static if static is not None else shape_of(shape, env)), dtype=dtype, device=device) \
                if shape else torch.empty((), dtype=dtype, device=device)
            order = self.output_orders[position] if self.output_orders else None
            slots[slot] = out if order is None else out.permute([order.index(d) for d in range(len(order))])
            outs.append(out)
        carriers = self._carriers(env, device) if self.carriers else []
        if self.emulate:
            self.kernel.sim(*[_as_numpy(t) for t in args], *carriers, *[_as_numpy(t) for t in outs])
            return
        known = self._entries.get(layouts) if layouts is not None else None
        if known is not None and known[1] == self._watched_layouts(args):
            full = (*args, *carriers, *outs)
            if self.kernel.relaunch(known[0], [t.data_ptr() for t in full], full):
                return
        # a tensor that requires grad is passed detached (the runtime reads no autograd state)
        entry = self.kernel.call_entry(*[t.detach() if t.requires_grad else t for t in args], *carriers, *outs)
        if layouts is not None and entry is not None:
            self._entries[layouts] = (entry, self._watched_layouts(args))

    def _prototypes(self, device: Any) -> tuple[Any, ...]:
        """Per output of static shape and more than one element, a one-element tensor on `device`
        expanded to it: `torch.empty_like` of it (overlapping, so made contiguous) allocates the
        output in ~1.6 us of the host's time where `torch.empty` with the sizes takes ~3 (measured
        on an H200's host; a GPT-2 training step allocates ~340 outputs). None for the others."""
        protos = []
        for (_, _, dtype), static in zip(self.outputs, self._static_shapes):
            proto = None
            if static and math.prod(static) > 1:
                proto = torch.empty(1, dtype=dtype, device=device).expand(static)
                made = torch.empty_like(proto)
                if made.shape != static or not made.is_contiguous() or made.dtype != dtype:
                    proto = None   # (not what torch.empty makes: allocate with the sizes)
            protos.append(proto)
        return tuple(protos)

    def _arguments(self, slots: list[Any], layouts: int | None) -> list[Any]:
        """The program's inputs as it reads them: permuted to their memory order (`input_orders`),
        made contiguous where the placeholder wants it and they are not. Under a layouts number
        whose first call copied nothing, every input has the layout it had then, so only the
        permutes are redone and only the inputs an ATen fallback made (`watched`) are checked: a
        whole model's parameters (resnet50's 267 inputs) cost a list, not a check each."""
        if layouts is not None and layouts in self._uncopied:
            args = [slots[s] for s in self.inputs]
            for position, memory in self._ordered:
                args[position] = args[position].permute(memory)
            for position in self.watched:
                if self.contiguous[position] and not args[position].is_contiguous():
                    args[position] = args[position].contiguous()
            return args
        args, copied = [], False
        for position, (slot, contiguous) in enumerate(zip(self.inputs, self.contiguous)):
            t = slots[slot]
            order = self.input_orders[position] if self.input_orders else None
            if order is not None:
                t = t.permute(order)
            if contiguous and not t.is_contiguous():
                t, copied = t.contiguous(), True
            args.append(t)
        if layouts is not None and not copied:
            self._uncopied.add(layouts)
        return args

    def _watched_layouts(self, args: list[Any]) -> tuple[Any, ...]:
        return tuple((args[p].shape, args[p].stride(), args[p].dtype) for p in self.watched)


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

_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")

# Distinct input layouts a compiled graph numbers (a graph with static shapes sees one; dynamic
# sizes, a few); calls past them run their programs through the launch cache's keys.
LAYOUTS_KEPT = 16


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
        self._layout_numbers: dict[tuple[Any, ...], int] = {}   # the inputs' layouts seen -> their number
        self._last_layouts: tuple[tuple[Any, ...], int] | None = None
        # the last number's check in C++ (`tensor_guard`), with the non-tensor inputs by position
        self._last_guard: tuple[Any, tuple[Any, ...], int] | None = None
        self._watch_fallback_results()

    def _watch_fallback_results(self) -> None:
        """Tell each program which of its inputs an ATen fallback made (itself, or the base of
        the view it is): their layouts are not vouched for by the graph inputs' (an op whose
        output sizes depend on the values: nonzero, unique), so a relaunch compares them first."""
        from_fallback = [False] * self.slot_count
        for step in self.steps:
            if isinstance(step, RunAten):
                from_fallback[step.output] = True
            elif isinstance(step, MakeView):
                from_fallback[step.output] = from_fallback[step.base]
            else:
                for slot, _, _ in step.outputs:
                    from_fallback[slot] = False
                step.watched = tuple(p for p, slot in enumerate(step.inputs) if from_fallback[slot])

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
        # programs relaunched on pointers alone when the inputs' layouts repeat; TECC_RELAUNCH=0:
        # every program call reads its arguments' keys (docs/knobs.md)
        layouts = self._layouts_number(args) if options.relaunch() else None
        if isinstance(args, list):
            args.clear()
        for step, free in zip(self.steps, self.frees):
            if type(step) is RunProgram:
                step.run(slots, env, layouts)
            else:
                step.run(slots, env)
            for s in free:
                slots[s] = None
        return self._outputs(slots, env)

    def _layouts_number(self, args: Sequence[Any]) -> int | None:
        """A number for the layouts of this call's inputs: each tensor's sizes, strides, dtype and
        device, each other input's value (None when a tensor has a lazy negative or conjugate
        bit). Two calls with one number pass every program arguments of the same layouts: a
        program's outputs are allocated from the sizes, a view's layout and an ATen op's output
        layout follow from their inputs', and so on back to the graph's inputs. So a program's
        launch-cache entry found on the first call of a number serves every later call of it on
        the pointers alone (RunProgram.run). None past LAYOUTS_KEPT distinct layouts.

        A call whose tensors pass the last number's `tensor_guard` (the same fields, checked in
        C++ at ~0.1 us a tensor) and whose other inputs are the same gets that number without
        the fields being read in Python (~1 us a tensor: ~0.15-0.3 ms per call of a graph of
        transformers' GPT-2, before its forward's first kernel)."""
        tensor = torch.Tensor
        tensors = [a for a in args if isinstance(a, tensor)]
        marked = () if len(tensors) == len(args) else \
            tuple((i, a) for i, a in enumerate(args) if not isinstance(a, tensor))
        fast = self._last_guard
        if fast is not None and fast[1] == marked and fast[0].check(*tensors):
            return fast[2]
        if any(map(tensor.is_neg, tensors)) or any(map(tensor.is_conj, tensors)):
            return None
        # (each read by `map` over the tensors: ~0.5 us a tensor, where one tuple per tensor
        # built in Python costs twice that)
        others = tuple(a for _, a in marked)
        layouts = (others, tuple(map(_SHAPE, tensors)), tuple(map(tensor.stride, tensors)), tuple(map(_DTYPE, tensors)),
                   tuple(map(tensor.get_device, tensors)))
        last = self._last_layouts
        if last is not None and last[0] == layouts:
            number = last[1]
        else:
            try:
                known = self._layout_numbers.get(layouts)
            except TypeError:  # an input that cannot be a key (unhashable): no number
                return None
            if known is None:
                if len(self._layout_numbers) >= LAYOUTS_KEPT:
                    return None
                known = self._layout_numbers[layouts] = len(self._layout_numbers)
            number = known
            self._last_layouts = (layouts, number)
        guard = tensor_guard(tensors)
        self._last_guard = None if guard is None else (guard, marked, number)
        return number

    @property
    def programs(self) -> list[RunProgram]:
        return [s for s in self.steps if isinstance(s, RunProgram)]

    def __repr__(self) -> str:
        kinds = ", ".join(type(s).__name__ for s in self.steps)
        return f"<tecc compiled graph {self.name}: {kinds}>"


def tensor_guard(tensors: Sequence[Any]) -> Any:
    """A check that tensors have the layouts of `tensors`, one by one: `check(*tensors)` is true
    when each has the same dispatch keys (device type, the lazy negative and conjugate bits),
    dtype, device index, requires_grad, sizes and strides. torch's TensorGuards, the C++ check
    dynamo's guards run on a compiled frame's tensors, made with every size and stride static;
    None where this torch has none or refuses the tensors (they are then read in Python).
    (The class is looked up once: a graph's call that finds no check makes one again.)"""
    global _TENSOR_GUARDS
    if _TENSOR_GUARDS is None:
        try:
            from torch._C._dynamo import guards

            _TENSOR_GUARDS = guards.TensorGuards
        except Exception:  # noqa: BLE001 - an internal API: absent or broken means "no check"
            _TENSOR_GUARDS = False
    if _TENSOR_GUARDS is False:
        return None
    try:
        # (its stub types each list item as one size; the C++ reads one list per tensor)
        guard = _TENSOR_GUARDS(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                               dynamic_dims_strides=[list(t.stride()) for t in tensors])
        return guard if guard.check(*tensors) else None
    except Exception:  # noqa: BLE001 - an internal API: any refusal means "no check"
        return None


# torch's TensorGuards class once `tensor_guard` has looked it up; False: this torch has none
_TENSOR_GUARDS: Any = None


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
