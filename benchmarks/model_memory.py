"""Where a training step's GPU memory goes under backend="tecc", on the CPU (no GPU).

    python benchmarks/model_memory.py                                  # GPT-2 small, 12 layers
    PYTHONPATH=$PWD:DIR python benchmarks/model_memory.py --model hf-gpt2   # transformers' GPT2LMHeadModel
    python benchmarks/model_memory.py --layers 2 --saved 0 --partitioner recompute   # every saved memory

The model's forward and backward ATen graphs are traced as the backend gets them
(benchmarks/model_kernels.py: AOTAutograd, tecc's decompositions, the --partitioner, bf16
autocast, batch 8 x 1024) and compiled as the backend compiles them for target "cuda" (NVRTC runs
here; the graphs go into TECC_CACHE_DIR, so a second run loads them). Then one training step is
replayed on a ledger of allocations instead of a GPU: each compiled graph's launch list runs
(runtime.py: RunProgram, RunAten, MakeView over slots, each slot freed after its last reader),
a program's outputs are allocated as `torch.empty` would (and the `.contiguous()` copy of an
input it takes row-major), views share their base's storage, and storages die when nothing
holds them (Python's reference counts do the freeing, as torch's tensors do). The kernel
temporaries are kept from one call to the next two ways, one tecc row each: per program (each
executor its own, in marshal.shared_storage's storages: the runtime before tecc/runtime/arena.py)
and in one stream arena shared by every program, placed by live range (arrays.stream_temporaries
now). The step: forward graph(s) in order (transformers' loss is a graph of its own, fed the
model's logits), the saved tensors held for the backward, backward graph(s) in reverse (each
consumes its saved tensors, boxed), the parameter gradients kept. The peak is printed with what
was live then, by category (parameters, gradients, saved, tangents, temporaries, ...; AdamW's
two float32 states added: the same for every backend, as is models_hf.py's untouched copy of the
model, not counted); then the saved tensors by the memory they hold (a view is not counted
twice), flagged: float32 values computed from bf16 ones, logits-sized, pointwise (recomputable
from their inputs); then each program's temporaries: summed, in storages, placed by live range,
and the most bytes live at one launch (the least any placement needs).

Two references for inductor on the same graphs: the floor (the same step holding only the
parameters, gradients, optimizer states, saved tensors and the graphs' inputs and outputs: no
intermediate at all) and the ATen liveness (each graph run node by node, every non-view value
allocated and freed after its last reader: eager-like, an upper bound for a fusing compiler).
A GPU measurement of the same step: benchmarks/models_hf.py (peak GiB column).
"""

from __future__ import annotations

import argparse
import operator
import os
import sys
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

GIB = float(2**30)


# ---- the ledger: storages and what is live --------------------------------------------------------
class Storage:
    """One allocation. It is freed (the ledger told) when nothing refers to it any more."""

    __slots__ = ("nbytes", "category", "name", "__weakref__")

    def __init__(self, ledger: "Ledger", nbytes: int, category: str, name: str) -> None:
        self.nbytes = int(nbytes)
        self.category = category
        self.name = name
        ledger.allocate(self)


@dataclass(frozen=True)
class View:
    """A tensor over (part of) another's storage: holds the base alive."""

    base: Any


class Ledger:
    """The bytes live per category, and the peak with what was live then."""

    def __init__(self) -> None:
        self.live: dict[int, tuple[int, str, str]] = {}
        self.total = 0
        self.peak = 0
        self.peak_at = ""
        self.peak_live: dict[int, tuple[int, str, str]] = {}
        self.where = ""

    def allocate(self, storage: Storage) -> None:
        key = id(storage)
        self.live[key] = (storage.nbytes, storage.category, storage.name)
        self.total += storage.nbytes
        weakref.finalize(storage, self._free, key)
        if self.total > self.peak:
            self.peak, self.peak_at, self.peak_live = self.total, self.where, dict(self.live)

    def relabel(self, value: Any, category: str) -> None:
        """The storage under `value` (through views) counted as `category` from now on, when it
        was counted as an intermediate (the base of a view the graph returns)."""
        while isinstance(value, View):
            value = value.base
        if isinstance(value, Storage) and value.category == "intermediates":
            value.category = category
            self.live[id(value)] = (value.nbytes, category, value.name)

    def _free(self, key: int) -> None:
        nbytes, _, _ = self.live.pop(key)
        self.total -= nbytes

    def categories(self, live: dict[int, tuple[int, str, str]] | None = None) -> dict[str, int]:
        out: dict[str, int] = {}
        for nbytes, category, _ in (self.peak_live if live is None else live).values():
            out[category] = out.get(category, 0) + nbytes
        return out


def tensor_bytes(val: Any) -> int:
    """The bytes a (fake) tensor's storage takes: its elements' span for its strides."""
    if not isinstance(val, torch.Tensor):
        return 0
    if val.numel() == 0:
        return 0
    span = 1 + sum((int(n) - 1) * abs(int(s)) for n, s in zip(val.shape, val.stride()))
    return span * val.element_size()


# ---- compiling the graphs as the backend does (target cuda, NVRTC) ---------------------------------
def compile_cuda(gm: torch.fx.GraphModule, name: str, arch: str, kind: str = "forward",
                 memory_parts: bool = True) -> Any:
    """The CompiledGraph the backend would make of `gm` (AOTAutograd's graph of `kind`) for a GPU
    of `arch`, from TECC_CACHE_DIR when a run before stored it (tecc/torch/backend.py
    compile_graph's steps)."""
    from tecc.torch import backend, cache
    from tecc.torch.launch import assemble
    from tecc.torch.lowering import Sizes
    from tecc.torch.report import GraphReport

    opts = backend.Options.parse({"arch": arch, "memory_parts": memory_parts}).for_graph(kind)
    key = cache.graph_key(gm, backend.key_options(opts, False), "cuda")
    hit = cache.load_graph(key)
    backend.lift_constants(gm)
    if hit is not None:
        return hit[0]
    start = time.perf_counter()
    plan = backend.plan_graph(gm, name, Sizes(), backend._bound_symbols(gm), opts.cut_for_memory)
    kernels = backend.build_programs(plan, "cuda", opts, False)
    compiled = assemble(plan, kernels, False)
    report = GraphReport.of(plan, kernels, time.perf_counter() - start)
    compiled.report = report
    cache.store(key, compiled, kernels, report)
    return compiled


# ---- replaying a compiled graph on the ledger -------------------------------------------------------
@dataclass
class Arenas:
    """The kernel temporaries the CUDA executors keep between calls (one stream here).

    mode "program": each program's executor keeps its own, grouped into storages by
    marshal.shared_storage, each as large as its largest temporary (the runtime before the
    stream arena); mode "stream": one arena per stream shared by every program, each program's
    temporaries placed in it by their live ranges (arena.layout: what arrays.stream_temporaries
    does now). zero_init temporaries stay with their executor in both."""

    mode: str = "stream"
    kept: dict[Any, Storage] = field(default_factory=dict)
    layouts: dict[int, Any] = field(default_factory=dict)

    def take(self, ledger: Ledger, kernel: Any, category: str) -> list[Storage]:
        from tecc.runtime import arena
        from tecc.runtime.host import temp_bytes
        from tecc.runtime.marshal import live_ranges, plan_launches, shared_storage

        host = kernel.host
        if id(kernel) not in self.layouts:
            planned = plan_launches(host)
            temps = tuple((t.name, temp_bytes(t, {}), bool(t.zero_init)) for t in host.temps)
            storage = shared_storage(host, planned)
            self.layouts[id(kernel)] = (temps, storage, arena.layout(temps, None, live_ranges(planned)))
        temps, storage, plan = self.layouts[id(kernel)]
        sizes: dict[Any, int] = {}
        for name, nbytes, zero in temps:
            if zero or self.mode == "program":
                key = (id(kernel), storage[name])
                sizes[key] = max(sizes.get(key, 0), nbytes)
        if self.mode == "stream" and plan.nbytes:
            sizes["arena"] = plan.nbytes
        held = []
        for key, nbytes in sizes.items():
            found = self.kept.get(key)
            if found is None or found.nbytes < nbytes:
                label = "temporaries (stream arena)" if key == "arena" else category
                found = self.kept[key] = Storage(ledger, nbytes, label, f"{kernel.name}:{key}")
            held.append(found)
        return held


def _value_of(val: Any, ledger: Ledger, category: str, name: str) -> Any:
    if isinstance(val, (tuple, list)):
        return tuple(_value_of(v, ledger, category, f"{name}[{i}]") for i, v in enumerate(val))
    if isinstance(val, torch.Tensor):
        return Storage(ledger, tensor_bytes(val), category, name)
    return None


def _resolve(template: Any, slots: list[Any]) -> Any:
    from tecc.torch.runtime import Slot

    if isinstance(template, Slot):
        return slots[template.index]
    if isinstance(template, (list, tuple)):
        return [_resolve(t, slots) for t in template]
    if isinstance(template, dict):
        return [_resolve(t, slots) for t in template.values()]
    return None


def _first_tensor(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        for v in value:
            found = _first_tensor(v)
            if found is not None:
                return found
        return None
    return value


def run_compiled(ledger: Ledger, compiled: Any, gm: torch.fx.GraphModule, args: list[Any], arenas: Arenas,
                 kinds: Callable[[int], str], temp_category: str) -> list[Any]:
    """One call of a compiled graph on the ledger (runtime.CompiledGraph.__call__'s walk): `args`
    (emptied, as the boxed call does) -> the outputs. `kinds(slot)` names the category of what
    a step writes into a slot."""
    from tecc.torch.runtime import MakeView, RunAten, RunProgram

    nodes = {n.name: n for n in gm.graph.nodes}
    slots: list[Any] = [None] * compiled.slot_count
    slots[: compiled.inputs] = args
    args.clear()
    # the fake value of each slot a graph input or a view fills (a program's outputs are dense)
    vals = {i: _val(n) for i, n in enumerate(_placeholders(gm))}
    for step in compiled.steps:
        if isinstance(step, (MakeView, RunAten)) and step.name in nodes:
            vals[step.output] = _val(nodes[step.name])
    for number, (step, free) in enumerate(zip(compiled.steps, compiled.frees)):
        ledger.where = f"{compiled.name} step {number} ({type(step).__name__} {step.name})"
        if isinstance(step, RunProgram):
            # an input the program takes row-major that is not: RunProgram.run's .contiguous() copy
            copies = [Storage(ledger, val.numel() * val.element_size(), "input copies", f"{step.name}:in{slot}")
                      for slot, dense in zip(step.inputs, step.contiguous)
                      if dense and isinstance(val := vals.get(slot), torch.Tensor) and not val.is_contiguous()
                      and not step.input_orders]
            for slot, shape, dtype in step.outputs:
                numel = 1
                for n in shape:
                    numel *= int(n)
                slots[slot] = Storage(ledger, numel * torch.empty((), dtype=dtype).element_size(), kinds(slot),
                                      f"{compiled.name}:{step.name}:out{slot}")
            held = arenas.take(ledger, step.kernel, temp_category)
            del held, copies
        elif isinstance(step, RunAten):
            node = nodes.get(step.name)
            base = _first_tensor(_resolve(step.args, slots))
            if step.fn is operator.getitem:
                seq = slots[step.args[0].index]
                slots[step.output] = seq[step.args[1]] if isinstance(seq, tuple) else View(seq)
            elif isinstance(step.fn, torch._ops.OpOverload) and step.fn.is_view and base is not None:
                slots[step.output] = View(base)
            else:
                val = node.meta.get("val") if node is not None else None
                slots[step.output] = _value_of(val, ledger, kinds(step.output), f"{compiled.name}:{step.name}")
        elif isinstance(step, MakeView):
            base = slots[step.base]
            slots[step.output] = View(base)
        for s in free:
            slots[s] = None
    outputs = _resolve(compiled.outputs, slots)
    return outputs if isinstance(outputs, list) else [outputs]


def _held(value: Any) -> bool:
    """Whether `value` holds memory: a storage, a tuple holding one, or a view of one (a view
    of a value the floor does not materialize holds none)."""
    while isinstance(value, View):
        value = value.base
    if isinstance(value, tuple):
        return any(_held(v) for v in value)
    return isinstance(value, Storage)


def _is_view(node: Any) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and (
        node.target is operator.getitem or isinstance(node.target, torch._ops.OpOverload) and node.target.is_view)


def _bases(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, str]:
    """The nodes whose memory the graph's outputs hold: each output, or for a view the node it
    views (through views), with the name of (the first) output that holds it."""
    found: dict[torch.fx.Node, str] = {}
    for out in _outputs(gm):
        node = out
        while _is_view(node) and isinstance(node.args[0], torch.fx.Node):
            node = node.args[0]
        if isinstance(node, torch.fx.Node) and isinstance(out, torch.fx.Node):
            found.setdefault(node, out.name)
    return found


def run_aten(ledger: Ledger, gm: torch.fx.GraphModule, args: list[Any], name: str, kinds: Callable[[str], str],
             materialize: bool) -> list[Any]:
    """One call of the ATen graph itself node by node (an fx Interpreter's walk): each
    non-view value allocated (when `materialize`, else only what the graph returns or saves,
    or the base its returned views view) and dropped after its last reader."""
    kept = _bases(gm)
    env: dict[torch.fx.Node, Any] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, args):
        env[node] = value
    args.clear()
    last: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in gm.graph.nodes:
        for used in node.all_input_nodes:
            last[used] = node
    dying: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for used, user in last.items():
        dying.setdefault(user, []).append(used)
    outputs: Any = None
    for node in gm.graph.nodes:
        ledger.where = f"{name} node {node.name}"
        if node.op == "call_function":
            inputs = [env.get(n) for n in node.all_input_nodes]
            base = _first_tensor(inputs)
            val = node.meta.get("val")
            if node.target is operator.getitem and _held(env.get(node.args[0])):  # type: ignore[arg-type]
                seq = env.get(node.args[0])  # type: ignore[arg-type]
                env[node] = seq[node.args[1]] if isinstance(seq, tuple) else View(seq)
            elif isinstance(node.target, torch._ops.OpOverload) and node.target.is_view and _held(base):
                env[node] = View(base)
            elif materialize or node in kept:
                env[node] = _value_of(val, ledger, kinds(kept.get(node, node.name)), f"{name}:{node.name}")
            else:
                env[node] = None
        elif node.op == "output":
            outputs = [env.get(n) if isinstance(n, torch.fx.Node) else None for n in node.args[0]]
        for dead in dying.get(node, []):
            env.pop(dead, None)
    return outputs


# ---- the training step ----------------------------------------------------------------------------
def _placeholders(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _outputs(gm: torch.fx.GraphModule) -> list[Any]:
    (out,) = [n for n in gm.graph.nodes if n.op == "output"]
    return list(out.args[0])


@dataclass
class Pair:
    """One dynamo graph's forward and backward, and how their values connect."""

    forward: torch.fx.GraphModule
    backward: torch.fx.GraphModule
    saved: int  # the forward's last `saved` outputs are the backward's first inputs
    linked: frozenset[str] = frozenset()  # the forward's inputs that an earlier graph returns

    @property
    def params(self) -> set[str]:
        """The forward's inputs that get a gradient (the backward's output in their position)."""
        return {n.name for n, g in zip(_placeholders(self.forward), _outputs(self.backward))
                if isinstance(g, torch.fx.Node) and n.name not in self.linked}

    @property
    def user_outputs(self) -> int:
        return len(_outputs(self.forward)) - self.saved


def pairs_of(graphs: dict[str, torch.fx.GraphModule]) -> list[Pair]:
    found = []
    suffix = 0
    while f"forward{suffix or ''}" in graphs:
        fw, bw = graphs[f"forward{suffix or ''}"], graphs[f"backward{suffix or ''}"]
        saved = sum(1 for n in _placeholders(bw) if not n.name.startswith("tangents"))
        earlier = [_val(n) for p in found for n in _outputs(p.forward)[: len(_outputs(p.forward)) - p.saved]]
        linked = frozenset(n.name for n in _placeholders(fw) if any(_same(v, _val(n)) for v in earlier))
        found.append(Pair(fw, bw, saved, linked))
        suffix += 1
    return found


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _same(a: Any, b: Any) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and tuple(a.shape) == tuple(b.shape)
            and a.dtype == b.dtype)


def step(ledger: Ledger, pairs: list[Pair], run_forward: Callable[..., list[Any]],
         run_backward: Callable[..., list[Any]]) -> None:
    """One training step: the forwards in order (a graph's input that is an earlier graph's user
    output of the same shape and dtype is that output: transformers' logits into its loss
    graph), the backwards in reverse (a tangent of the shape of a later backward's output is
    that output), the parameter gradients kept till the end."""
    params: dict[str, Storage] = {}
    grads: list[Any] = []
    saved_per_pair: list[list[Any]] = []
    produced: list[tuple[Any, Any]] = []  # (fake value, storage) of user outputs so far
    for number, pair in enumerate(pairs):
        args = []
        for node in _placeholders(pair.forward):
            val = _val(node)
            match = next((s for v, s in produced if _same(v, val)), None) if node.name in pair.linked else None
            if match is not None:
                args.append(match)
            elif node.name in pair.params:
                params.setdefault(node.name + str(number), Storage(ledger, tensor_bytes(val), "parameters",
                                                                   node.name))
                args.append(params[node.name + str(number)])
            else:
                args.append(Storage(ledger, tensor_bytes(val), "inputs", node.name))
        outs = run_forward(ledger, number, pair, args)
        user = pair.user_outputs
        for position, value in enumerate(outs):
            ledger.relabel(value, "graph outputs" if position < user else "saved for backward")
        produced += [(_val(n), s) for n, s in zip(_outputs(pair.forward)[:user], outs[:user])]
        saved_per_pair.append(list(outs[user:]))
        del outs, args
    produced = []
    upstream: list[tuple[Any, Any]] = []
    for number in reversed(range(len(pairs))):
        pair = pairs[number]
        args = saved_per_pair[number]
        saved_per_pair[number] = []
        for node in _placeholders(pair.backward)[pair.saved:]:
            val = _val(node)
            match = next((s for v, s in upstream if _same(v, val)), None)
            args.append(match if match is not None else Storage(ledger, tensor_bytes(val), "tangents", node.name))
        upstream = []
        outs = run_backward(ledger, number, pair, args)
        fw_inputs = _placeholders(pair.forward)
        for node, value in zip(fw_inputs, outs):
            if value is None:
                continue
            if node.name in pair.params:
                ledger.relabel(value, "gradients")
                grads.append(value)
            elif node.name in pair.linked:
                ledger.relabel(value, "tangents")
                upstream.append((_val(node), value))
        del outs, args
    ledger.where = "after the backward"
    del grads, params


def categorize(pair: Pair, kind: str) -> Callable[[Any], str]:
    """The category of what a graph writes, by output position."""
    if kind == "forward":
        outs = _outputs(pair.forward)
        saved = {n.name for n in outs[pair.user_outputs:] if isinstance(n, torch.fx.Node)}
        user = {n.name for n in outs[: pair.user_outputs] if isinstance(n, torch.fx.Node)}
    else:
        outs = _outputs(pair.backward)
        linked = {g.name for n, g in zip(_placeholders(pair.forward), outs)
                  if isinstance(g, torch.fx.Node) and n.name in pair.linked}
        saved, user = set(), {n.name for n in outs if isinstance(n, torch.fx.Node) and n.name not in linked}

    def of(name: str) -> str:
        if kind == "backward" and name in linked:
            return "tangents"
        if name in saved:
            return "saved for backward"
        if name in user:
            return "graph outputs" if kind == "forward" else "gradients"
        return "intermediates"

    return of


def compiled_runner(compiled: dict[str, Any], arenas: Arenas, kind: str) -> Callable[..., list[Any]]:
    def run(ledger: Ledger, number: int, pair: Pair, args: list[Any]) -> list[Any]:
        gm = pair.forward if kind == "forward" else pair.backward
        graph = compiled[f"{kind}{number or ''}"]
        by_name = categorize(pair, kind)
        slot_names = _slot_names(graph, gm)
        return run_compiled(ledger, graph, gm, args, arenas, lambda slot: by_name(slot_names.get(slot, "")),
                            f"temporaries ({kind})")
    return run


def _slot_names(compiled: Any, gm: torch.fx.GraphModule) -> dict[int, str]:
    """Slot -> the FX node whose value it holds (through the output template: what is saved)."""
    from tecc.torch.runtime import Slot

    names: dict[int, str] = {}
    for template, node in zip(compiled.outputs, _outputs(gm)):
        if isinstance(template, Slot) and isinstance(node, torch.fx.Node):
            names.setdefault(template.index, node.name)
    return names


def aten_runner(kind: str, materialize: bool) -> Callable[..., list[Any]]:
    def run(ledger: Ledger, number: int, pair: Pair, args: list[Any]) -> list[Any]:
        gm = pair.forward if kind == "forward" else pair.backward
        return run_aten(ledger, gm, args, f"{kind}{number or ''}", categorize(pair, kind), materialize)
    return run


# ---- what is saved ----------------------------------------------------------------------------------
CHEAP = {"convert_element_type", "mul", "add", "sub", "div", "neg", "rsqrt", "tanh", "gelu", "where", "exp",
         "relu", "pow", "clone", "_to_copy"}


def _op(node: torch.fx.Node) -> str:
    return "input" if node.op == "placeholder" else getattr(node.target, "__name__", str(node.target)).split(".")[0]


def saved_table(pair: Pair, number: int, top: int) -> tuple[list[str], dict[str, int]]:
    """The forward's saved tensors by the memory they hold: each saved value's base (the node
    it views, through views; itself when it is no view), counted once, grouped by (op, dtype,
    shape) of the base, with flags: a graph input (no new memory), a float32 value computed
    from a bf16 one, the size of the logits, a pointwise op (recomputable from its inputs)."""
    outs = _outputs(pair.forward)[pair.user_outputs:]
    groups: dict[tuple[str, str, str, str], list[int]] = {}
    flags: dict[str, int] = {}
    views: dict[torch.fx.Node, int] = {}
    for out in outs:
        node = out
        while _is_view(node) and isinstance(node.args[0], torch.fx.Node):
            node = node.args[0]
        if isinstance(node, torch.fx.Node) and isinstance(_val(node), torch.Tensor):
            views[node] = views.get(node, 0) + 1
    logits_like = max((tensor_bytes(_val(n)) for n in views), default=0)
    for node, count in views.items():
        val = _val(node)
        nbytes = tensor_bytes(val)
        op = _op(node)
        flag = []
        if node.op == "placeholder":
            flag.append("graph input (no new memory)")
            nbytes = 0
        if val.dtype == torch.float32 and any(getattr(_val(a), "dtype", None) == torch.bfloat16
                                              for a in node.all_input_nodes):
            flag.append("fp32 of bf16")
        if nbytes and nbytes == logits_like and nbytes > 2**28:
            flag.append("logits-sized")
        if op in CHEAP and node.op != "placeholder":
            flag.append(f"pointwise ({', '.join(_op(a) for a in node.all_input_nodes)})")
        for f in flag:
            f = f.split(" (")[0]
            flags[f] = flags.get(f, 0) + nbytes
        shape = "x".join(str(int(n)) for n in val.shape)
        key = (op, str(val.dtype).replace("torch.", ""), shape, ", ".join(flag) + (f"; {count} views" if count > 1 else ""))
        groups.setdefault(key, []).append(nbytes)
    rows = sorted(groups.items(), key=lambda kv: -sum(kv[1]))
    lines = [f"saved by forward{number or ''} for backward{number or ''}: {len(outs)} values over {len(views)} "
             f"memories, {sum(sum(v) for v in groups.values()) / GIB:.3f} GiB",
             "| op (of the memory) | dtype | shape | count | GiB | flags |", "| --- | --- | --- | --- | --- | --- |"]
    for (op, dtype, shape, flag), sizes in rows[: top or None]:
        lines.append(f"| {op} | {dtype} | {shape} | {len(sizes)} | {sum(sizes) / GIB:.3f} | {flag} |")
    return lines, flags


# ---- reporting ----------------------------------------------------------------------------------------
ORDER = ("parameters", "gradients", "saved for backward", "graph outputs", "inputs", "tangents", "intermediates",
         "temporaries (forward)", "temporaries (backward)", "temporaries (stream arena)", "input copies")


def breakdown(label: str, ledger: Ledger, extra: dict[str, int]) -> list[str]:
    cats = ledger.categories()
    for k, v in extra.items():
        cats[k] = cats.get(k, 0) + v
    total = sum(cats.values())
    line = [f"| {label} | {total / GIB:.2f} |"]
    for c in ORDER + tuple(sorted(set(cats) - set(ORDER))):
        line.append(f" {cats.get(c, 0) / GIB:.2f} |")
    return ["".join(line), f"  (peak at {ledger.peak_at})"]


def header(extra: dict[str, int]) -> list[str]:
    cols = list(ORDER) + sorted(set(extra) - set(ORDER))
    return ["| what | peak GiB | " + " | ".join(cols) + " |", "| --- " * (len(cols) + 2) + "|"]


def temporaries_table(compiled: dict[str, Any]) -> list[str]:
    """Per program: its temporaries' bytes summed, after sharing by liveness (what the executor
    keeps), and its largest one."""
    from tecc.runtime.host import temp_bytes
    from tecc.runtime.marshal import plan_launches, shared_storage
    from tecc.torch.runtime import RunProgram

    from tecc.runtime import arena
    from tecc.runtime.marshal import live_ranges

    lines = ["| graph | program | kernels | temporaries | GiB summed | GiB in storages (shared_storage) | storages | "
             "GiB placed by live range (arena.layout) | most live at once GiB | largest GiB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for kind, graph in compiled.items():
        for step in graph.steps:
            if not isinstance(step, RunProgram):
                continue
            host = step.kernel.host
            sizes = {t.name: temp_bytes(t, {}) for t in host.temps}
            planned = plan_launches(host)
            storage = shared_storage(host, planned)
            live = _most_live(host, planned, sizes)
            placed = arena.layout(tuple((t.name, sizes[t.name], bool(t.zero_init)) for t in host.temps), None,
                                  live_ranges(planned)).nbytes
            kept: dict[str, int] = {}
            for name, nbytes in sizes.items():
                kept[storage[name]] = max(kept.get(storage[name], 0), nbytes)
            lines.append(f"| {kind} | {step.name} | {len(host.calls)} | {len(sizes)} | {sum(sizes.values()) / GIB:.3f} | "
                         f"{sum(kept.values()) / GIB:.3f} | {len(kept)} | {placed / GIB:.3f} | {live / GIB:.3f} | "
                         f"{max(sizes.values(), default=0) / GIB:.3f} |")
    return lines


def _most_live(host: Any, planned: Sequence[Any], sizes: dict[str, int]) -> int:
    """The most temporary bytes live at one launch (each from the first launch that passes it
    to the last; zero_init ones always): the least any sharing can keep."""
    from tecc.runtime.marshal import live_ranges

    ranges = live_ranges(planned)
    zero = {t.name for t in host.temps if t.zero_init}
    change = [0] * (len(planned) + 1)
    always = 0
    for name, nbytes in sizes.items():
        if name in zero or name not in ranges:
            always += nbytes
            continue
        first, last = ranges[name]
        change[first] += nbytes
        change[last + 1] -= nbytes
    most = live = 0
    for delta in change:
        live += delta
        most = max(most, live)
    return most + always


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("gpt2", "hf-gpt2"), default="gpt2")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--partitioner", choices=("min_cut", "default", "recompute"), default="recompute")
    p.add_argument("--no-memory-parts", action="store_true",
                   help="the backward graph as one program (the backend's memory_parts=False)")
    p.add_argument("--saved", type=int, default=12, help="rows of the saved-tensor table (0: all)")
    p.add_argument("--cache-dir", default=None, help="TECC_CACHE_DIR (default: the environment's)")
    args = p.parse_args(argv)
    if args.cache_dir:
        os.environ["TECC_CACHE_DIR"] = args.cache_dir
    import model_kernels

    start = time.perf_counter()
    graphs = model_kernels.MODELS[args.model](args.layers, args.partitioner)
    print(f"# {args.model}, {args.layers} layer(s), batch 8 x 1024, bf16 autocast, partitioner {args.partitioner}: "
          f"traced in {time.perf_counter() - start:.1f} s ({', '.join(graphs)})")
    pairs = pairs_of(graphs)
    start = time.perf_counter()
    compiled = {kind: compile_cuda(gm, f"g_{kind}", args.arch, kind, not args.no_memory_parts)
                for kind, gm in graphs.items()}
    print(f"# compiled for cuda {args.arch} in {time.perf_counter() - start:.1f} s (TECC_CACHE_DIR "
          f"{os.environ.get('TECC_CACHE_DIR', '~/.cache/tecc')})\n")

    params = sum(tensor_bytes(_val(n)) for pair in pairs for n in _placeholders(pair.forward) if n.name in pair.params)
    extra = {"AdamW states": 2 * params}
    lines = ["## Peak of one training step (after warm-up: the executors' temporaries already kept)", ""]
    lines += header(extra)
    for mode, label in (("program", "tecc, temporaries kept per program (before)"),
                        ("stream", "tecc, one stream arena placed by live ranges (now)")):
        arenas = Arenas(mode)
        warm = Ledger()  # the first step fills the executors' kept temporaries
        step(warm, pairs, compiled_runner(compiled, arenas, "forward"), compiled_runner(compiled, arenas, "backward"))
        ledger = Ledger()
        again = Arenas(mode, {k: Storage(ledger, s.nbytes, s.category, s.name) for k, s in arenas.kept.items()},
                       arenas.layouts)
        del warm, arenas
        step(ledger, pairs, compiled_runner(compiled, again, "forward"), compiled_runner(compiled, again, "backward"))
        lines += breakdown(label, ledger, extra)
        del again
    floor = Ledger()
    step(floor, pairs, aten_runner("forward", False), aten_runner("backward", False))
    lines += breakdown("floor (saved, inputs, outputs only)", floor, extra)
    eager = Ledger()
    step(eager, pairs, aten_runner("forward", True), aten_runner("backward", True))
    lines += breakdown("ATen liveness (every value materialized)", eager, extra)
    lines += ["", f"parameters {params / GIB:.3f} GiB (models_hf.py keeps one more copy: the untouched base model)", ""]
    lines += ["## Saved tensors", ""]
    for number, pair in enumerate(pairs):
        table, flags = saved_table(pair, number, args.saved)
        lines += table
        lines += ["flags: " + "; ".join(f"{k} {v / GIB:.3f} GiB" for k, v in flags.items()), ""]
    lines += ["## Program temporaries", ""] + temporaries_table(compiled)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
