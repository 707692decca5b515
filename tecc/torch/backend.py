"""`torch.compile(model, backend="tecc")`: the dynamo backend, its options, and the compile of
one ATen graph.

tecc registers itself in the `torch_dynamo_backends` entry-point group (pyproject.toml), so
`backend="tecc"` works after `pip install tecc` with no `import tecc`. Dynamo hands the backend
an FX graph of torch ops; AOTAutograd (`aot_module_simplified`, its min-cut partitioner deciding
what the forward saves for the backward: the `partitioner` option) traces it into a forward and a backward ATen graph,
decomposed to core ATen with torch's own tables (decompositions.py). Each ATen graph is then
compiled by `compile_graph`: planned (graph.py), its programs built with `tc.build`, and its
launch list assembled (launch.py).

Options (`torch.compile(..., options={...})`):

| option | default | meaning |
| --- | --- | --- |
| `fallback` | `"aten"` | `"aten"`: an op tecc cannot lower runs as ATen inside the compiled graph (logged); `"error"`: raise a TeccError naming the op and its FX node |
| `cudagraphs` | `False` | capture each whole graph (fallbacks included) with torch.cuda.graph, inputs copied in and outputs copied out (CUDA tensors, static shapes); without it each program still replays as the runtime's own CUDA graph (docs/models.md, "Runtime") |
| `dump_ir` | `None` | a folder: each graph's FX code, the node -> kernel map and every program's IR dumps |
| `arch` | `None` | the GPU architecture to compile for (`"sm_90"`); default: the device's |
| `partitioner` | `"recompute"` | what the forward saves for the backward: `"recompute"`, AOTAutograd's min-cut rematerialization partitioner allowed to recompute cheap values that the backward reads through a GEMM (`ban_recompute_materialized_backward` off: an MLP's GELU output, a layer norm's bf16 output, bf16 copies of weights are recomputed in the backward from what is saved anyway, each right before its first reader, instead of saved for every layer: GPT-2 small at batch 8 × 1024 peaks at 5.50 GiB instead of 6.47 on an H200, its step ~2% slower); `"min_cut"`, the min-cut partitioner as inductor runs it (saves the fewest bytes and recomputes cheap elementwise values except those a GEMM reads; a loss head then saves its bf16 logits and two row statistics, and its backward recomputes the float32 cast, instead of 1.6 GB of float32 log-probabilities written and read back at GPT-2's size: both min-cut variants do this); `"default"`, AOTAutograd's default partitioner (saves what the backward reads) |
| `aot_cache` | `True` | keep AOTAutograd's result in torch's AOTAutogradCache (TORCHINDUCTOR_CACHE_DIR/aotautograd), its entry naming tecc's disk-cache entries: a second process skips AOTAutograd's joint trace and partitioner (aot_cache.py; H200, 12-layer GPT-2: the second process's first step 7.4 -> 4.6 s), and AOTAutograd altogether where its runtime would only call the graphs (direct.py). A torch without the API compiles as without it; off with TECC_NO_CACHE=1. The backward is then compiled with the forward, not at the first backward call |
| `parallel_compile` | `None` (auto) | with `aot_cache` (AOTAutograd then compiles the backward right after the forward), compile the forward graph in a worker process while this one compiles the backward; the forward's first call waits for the worker and loads the graph from tecc's disk cache (a failed worker is logged and the graph compiled in the caller's process then). Auto: on for a CUDA graph of at least 150 ATen ops on a machine of 4 or more CPUs (the worker's start, ~2-3 s of importing torch, is then hidden behind the backward's compile); never for the emulator's graphs, a graph with tensor constants, or with `dump_ir` (tecc/torch/background.py) |
| `memory_parts` | `True` | cut a backward graph's program into parts where that lowers the modelled peak, so that its gradients are allocated and its saved tensors freed as the backward runs instead of all at its first kernel (memory_parts.py; GPT-2: one cut, after the loss head's row kernel); `False`: one program per graph (where no ATen fallback splits it) |
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from torch.fx import GraphModule

from ..ir.errors import TeccError
from . import aot_cache, background, cache, direct
from .decompositions import decomposition_table
from .report import GraphReport, record
from .runtime import CompiledGraph, with_cuda_graph

if TYPE_CHECKING:
    from ..compiler.planner import Rankings
    from .graph import GraphPlan

log = logging.getLogger("tecc.torch")

FALLBACKS = ("aten", "error")
PARTITIONERS = ("min_cut", "default", "recompute")


@dataclass(frozen=True)
class Options:
    """The backend's options (module docstring)."""

    fallback: str = "aten"
    cudagraphs: bool = False
    dump_ir: str | None = None
    arch: str | None = None
    partitioner: str = "recompute"
    aot_cache: bool = True
    parallel_compile: bool | None = None
    memory_parts: bool = True
    backward: bool = False      # not an option: set per graph, for the backward's (memory_parts.py)

    @staticmethod
    def parse(options: dict[str, Any] | None) -> "Options":
        given = dict(options or {})
        known = {"fallback", "cudagraphs", "dump_ir", "arch", "partitioner", "aot_cache", "parallel_compile",
                 "memory_parts"}
        unknown = sorted(set(given) - known)
        if unknown:
            raise TeccError(f"torch.compile(backend='tecc'): unknown option(s) {', '.join(unknown)}; the options are "
                            f"{', '.join(sorted(known))} (docs/models.md)")
        fallback = given.get("fallback", "aten")
        if fallback not in FALLBACKS:
            raise TeccError(f"torch.compile(backend='tecc'): fallback={fallback!r}; use 'aten' (run ops tecc cannot "
                            "lower as ATen) or 'error' (raise instead)")
        partitioner = given.get("partitioner", "recompute")
        if partitioner not in PARTITIONERS:
            raise TeccError(f"torch.compile(backend='tecc'): partitioner={partitioner!r}; use 'recompute' "
                            "(the default: AOTAutograd's min-cut partitioner, recomputing cheap values the "
                            "backward's GEMMs read instead of saving them), 'min_cut' (AOTAutograd's min-cut "
                            "rematerialization partitioner as inductor runs it) or 'default' (AOTAutograd's default "
                            "partitioner)")
        dump = given.get("dump_ir")
        parallel = given.get("parallel_compile")
        if parallel not in (None, True, False):
            raise TeccError(f"torch.compile(backend='tecc'): parallel_compile={parallel!r}; use True (compile the "
                            "forward graph in a worker process beside the backward), False, or leave it out (auto)")
        return Options(fallback, bool(given.get("cudagraphs", False)), str(dump) if dump else None,
                       given.get("arch"), partitioner, bool(given.get("aot_cache", True)), parallel,
                       bool(given.get("memory_parts", True)))

    def for_graph(self, kind: str) -> "Options":
        """The options one of AOTAutograd's graphs ("forward", "backward", "inference") is
        compiled with."""
        return replace(self, backward=kind == "backward")

    @property
    def cut_for_memory(self) -> bool:
        """Whether the graph's programs are cut into parts for memory (memory_parts.py)."""
        return self.memory_parts and self.backward


_graphs = itertools.count()


def __getattr__(name: str) -> Any:
    """`RANKINGS`: the planner's rankings of every kernel this process compiled for a graph (a
    model's layers, and its forward and backward graphs, share kernels of one structure, ranked
    and realized once: planner.Rankings), made with the first compile. A process that only loads
    graphs from the disk cache never imports the planner."""
    if name == "RANKINGS":
        from ..compiler.planner import Rankings

        rankings = globals()["RANKINGS"] = Rankings()
        return rankings
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _rankings() -> Rankings:
    made = globals().get("RANKINGS")
    return made if made is not None else __getattr__("RANKINGS")  # type: ignore[no-any-return]


def tecc_backend(gm: GraphModule, example_inputs: Sequence[Any], options: dict[str, Any] | None = None,
                 mode: str | None = None) -> Callable[..., Any]:
    """The dynamo backend: forward and backward through AOTAutograd, each compiled by tecc."""
    from torch._functorch.aot_autograd import aot_module_simplified

    opts = Options.parse(options)
    number = next(_graphs)
    aot = (opts.aot_cache and not opts.dump_ir and cache.enabled() and aot_cache.available()
           and not _symbolic(example_inputs))
    identity = aot_cache.identity(_identity(opts)) if aot else ""
    # a later process's graph without AOTAutograd (direct.py): its entry, else one recorded now
    entry_key = direct.key(gm, example_inputs, identity) if aot else None
    if entry_key is not None:
        found = direct.load(entry_key, lambda key, name: from_disk_cache(key, opts, name, []), f"g{number}")
        if found is not None:
            return found
    recorder = direct.Recorder(len(example_inputs)) if entry_key is not None else None

    def compiler(kind: str) -> Callable[[GraphModule, Sequence[Any]], Any]:
        graph_opts = opts.for_graph(kind)

        def compile_fn(graph: GraphModule, inputs: Sequence[Any]) -> Any:
            if aot:
                if recorder is not None:  # before the compile changes the graph (lifted constants)
                    recorder.note(kind, graph)
                code = _for_aot_cache(graph, graph_opts, f"g{number}_{kind}", parallel=kind == "forward")
                if recorder is not None:
                    recorder.keyed(kind, code.key)
                return code
            return compile_graph(graph, inputs, graph_opts, f"g{number}_{kind}")

        return aot_cache.serializable(compile_fn) if aot else compile_fn

    with aot_cache.engaged(identity) if aot else contextlib.nullcontext():
        compiled = aot_module_simplified(gm, example_inputs, fw_compiler=compiler("forward"),
                                         bw_compiler=compiler("backward"), inference_compiler=compiler("inference"),
                                         decompositions=decomposition_table(), **partition(opts.partitioner))
    if recorder is not None and entry_key is not None and (recorder.graphs or recorder.refused):  # else: a hit
        recorder.save(entry_key)
    return compiled


def _symbolic(example_inputs: Sequence[Any]) -> bool:
    """Whether dynamo traced with symbolic sizes (`dynamic=True`, or sizes it saw change): the
    option `aot_cache` is tested with static shapes only (docs/models.md), so it stays off."""
    for x in example_inputs:
        if isinstance(x, torch.SymInt) or (isinstance(x, torch.Tensor)
                                           and any(isinstance(d, torch.SymInt) for d in x.shape)):
            return True
    return False


def _identity(opts: Options) -> dict[str, Any]:
    """The options that AOTAutograd's cache key must hold for tecc (aot_cache.identity)."""
    return {"fallback": opts.fallback, "cudagraphs": opts.cudagraphs, "arch": opts.arch,
            "partitioner": opts.partitioner, "memory_parts": opts.memory_parts}


def _for_aot_cache(gm: GraphModule, opts: Options, name: str, parallel: bool = False) -> Any:
    """compile_graph's callable as AOTAutograd's cache stores it (aot_cache.TeccOutputCode): tecc's
    key when its disk cache holds the graph and the graph has no constants to lift, else the
    ATen graph, pickled before the compile changes it (lifted constants, a seed node). `parallel`
    (the forward graph, whose backward AOTAutograd compiles next): compiled by a worker process
    where the option `parallel_compile` says so (background.py)."""
    start = time.perf_counter_ns()
    constants = _has_constants(gm)
    found = _in_worker(gm, opts, name) if parallel and not constants else None
    if found is not None:   # no constants: the key is enough
        fn, key = found
        graph = None
    else:
        # pickled before the compile changes it, and only where the key will not be enough (the
        # emulator's graphs are not stored; ~0.4 s for GPT-2's backward): a CUDA graph whose
        # store then fails has neither, and a later process traces it again
        needed = constants or _target(_emulated(gm)) == "sim"
        graph = aot_cache.dump_graph(gm) if needed else None
        fn, key = compile_keyed(gm, opts, name)
        if key is not None and not constants:
            graph = None  # the key is enough
    code = aot_cache.TeccOutputCode(fn, opts, name, None if constants else key, graph)
    code._time_taken_ns = time.perf_counter_ns() - start
    return code


def _in_worker(gm: GraphModule, opts: Options, name: str) -> tuple[Any, str] | None:
    """The graph's callable and key: loaded from the disk cache, or a worker's Pending callable
    (background.py); None where the graph does not go to a worker."""
    target = _target(_emulated(gm))
    if not background.wanted(gm, opts.parallel_compile, target):
        return None
    deterministic = torch.are_deterministic_algorithms_enabled()
    key = graph_key(gm, opts, deterministic)
    if key is None:
        return None
    loaded = from_disk_cache(key, opts, name, [])
    if loaded is not None:
        return loaded, key
    # the options as they are (arch None: the worker plans for the live GPU's properties, as
    # this process would; an arch string would plan with that arch's table instead)
    graph = _values_only(gm)
    if graph is None:
        return None

    def here() -> Any:
        return compile_stored(gm, opts, name, key, deterministic, [], time.perf_counter(), target)[0]

    pending = background.start(graph, opts, name, key, deterministic, target,
                               lambda k: from_disk_cache(k, opts, name, []), here)
    return None if pending is None else (pending, key)


def _values_only(gm: GraphModule) -> bytes | None:
    """The graph pickled with only its nodes' values in their metadata (what the lowering
    reads): the rest may name the caller's classes, which a worker process cannot import (the
    tests' tiny GPT's forward failed so in its worker), or hold what GraphPickler cannot write
    (transformers' GPT-2 forward on the GPU could not be pickled whole, "Cannot access data
    pointer of Tensor"; whether its values-only graph can is not measured yet). None where it
    cannot be pickled either: the caller compiles the graph itself."""
    kept = {node: node.meta for node in gm.graph.nodes}
    try:
        for node, meta in kept.items():
            node.meta = {"val": meta["val"]} if "val" in meta else {}
        return aot_cache.dump_graph(gm)
    finally:
        for node, meta in kept.items():
            node.meta = meta


def _has_constants(gm: GraphModule) -> bool:
    return any(n.op == "get_attr" and isinstance(_attribute(gm, n.target), torch.Tensor) for n in gm.graph.nodes)


def partition(partitioner: str) -> dict[str, Any]:
    """aot_module_simplified's partition_fn for the option (none: AOTAutograd's default)."""
    if partitioner == "min_cut":
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        return {"partition_fn": min_cut_rematerialization_partition}
    if partitioner == "recompute":
        return {"partition_fn": recomputing_min_cut}
    return {}


def recomputing_min_cut(joint: GraphModule, inputs: Any, **kwargs: Any) -> Any:
    """The min-cut partition with `ban_recompute_materialized_backward` off: a cheap value (a
    pointwise op of saved values) that a backward GEMM reads is recomputed in the backward, not
    saved. torch bans that by default because the recomputed value is written to memory in the
    backward anyway (no bandwidth saved); it is, as a temporary of the backward program (in the
    stream arena, tecc/runtime/arena.py), where the saved one was held from the forward on. The
    backward program computes each such value in the part of its first reader
    (tecc/compiler/region_search.py), so one layer's are alive at a time (docs/models.md, "Memory")."""
    from torch._functorch import config
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    with config.patch(ban_recompute_materialized_backward=False):
        return min_cut_rematerialization_partition(joint, inputs, **kwargs)


def _bound_symbols(gm: GraphModule) -> set[Any]:
    """The sympy symbols whose values the graph's inputs give (an int input, or a dimension)."""
    import sympy

    bound: set[Any] = set()
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("val")
        sizes = [val] if isinstance(val, torch.SymInt) else list(val.shape) if isinstance(val, torch.Tensor) else []
        for s in sizes:
            if isinstance(s, torch.SymInt) and isinstance(s.node.expr, sympy.Symbol):
                bound.add(s.node.expr)
    return bound


def _emulated(gm: GraphModule) -> bool:
    """Whether the graph runs on CPU tensors (then in the emulator) rather than CUDA ones."""
    for node in gm.graph.nodes:
        val = node.meta.get("val") if node.op == "placeholder" else None
        if isinstance(val, torch.Tensor) and val.device.type == "cuda":
            return False
    return True


def _refuse_fallbacks(plan: GraphPlan) -> None:
    nodes = plan.fallbacks
    if not nodes:
        return
    first = nodes[0]
    others = f" (and {len(nodes) - 1} more: {', '.join(n.name for n in nodes[1:6])}{', ...' if len(nodes) > 6 else ''})"
    raise TeccError(f"tecc cannot lower {first.target} (FX node {first.name} of graph {plan.name}): "
                    f"{plan.reasons.get(first, 'no lowering')}{others if len(nodes) > 1 else ''}; "
                    "compile with options={'fallback': 'aten'} to run such ops as ATen inside the compiled graph")


def compile_graph(gm: GraphModule, example_inputs: Sequence[Any], opts: Options, name: str) -> Any:
    """One ATen graph compiled: its programs built with tc.build, its launch list assembled."""
    return compile_keyed(gm, opts, name)[0]


def compile_keyed(gm: GraphModule, opts: Options, name: str) -> tuple[Any, str | None]:
    """compile_graph's callable, and the graph's key in tecc's disk cache when the cache holds
    it (None: not cached, as the emulator's graphs)."""
    start = time.perf_counter()
    # torch.use_deterministic_algorithms(True): scatters sum in a fixed order, never by atomics
    deterministic = torch.are_deterministic_algorithms_enabled()
    key = graph_key(gm, opts, deterministic)
    constants = lift_constants(gm)
    if key is not None:
        loaded = from_disk_cache(key, opts, name, constants, start)
        if loaded is not None:
            return loaded, key
    return compile_stored(gm, opts, name, key, deterministic, constants, start)


def graph_key(gm: GraphModule, opts: Options, deterministic: bool) -> str | None:
    """The graph's key in tecc's disk cache (cache.graph_key), or None: the cache is off, or
    dumps are asked for (a hit writes none, so such a graph is compiled)."""
    if not cache.enabled() or opts.dump_ir:
        return None
    return cache.graph_key(gm, key_options(opts, deterministic), _target(_emulated(gm)))


def key_options(opts: Options, deterministic: bool) -> dict[str, Any]:
    """The options a graph's key in tecc's disk cache holds: those that change what is built."""
    return {"fallback": opts.fallback, "arch": opts.arch, "deterministic": deterministic,
            "memory_parts": opts.cut_for_memory}


def compile_stored(gm: GraphModule, opts: Options, name: str, key: str | None, deterministic: bool,
                   constants: list[torch.Tensor], start: float, target: str | None = None) -> tuple[Any, str | None]:
    """The graph compiled (its constants lifted as `constants`) for `target` (None: `_target`'s)
    and stored in tecc's disk cache under `key` (None: not stored): its callable, and the key
    when the entry was written."""
    from .lowering import Sizes
    from .report import write_dumps

    emulate = _emulated(gm)
    sizes = Sizes()
    plan = plan_graph(gm, name, sizes, _bound_symbols(gm), opts.cut_for_memory)
    if opts.fallback == "error":
        _refuse_fallbacks(plan)
    kernels = build_programs(plan, target or _target(emulate), opts, deterministic)
    compiled: CompiledGraph = assemble(plan, kernels, emulate)
    report = GraphReport.of(plan, kernels, time.perf_counter() - start)
    compiled.report = report
    record(report)
    if plan.fallbacks:
        log.warning("%s", report.fallback_message())
    if report.plan_fallbacks:
        log.warning("%s", report.plan_fallback_message())
    log.info("%s", report.summary())
    if opts.dump_ir:
        write_dumps(opts.dump_ir, plan, kernels, report)
    stored = key is not None and cache.store(key, compiled, kernels, report) is not None
    return _with_constants(_finished(compiled, opts, emulate, bool(sizes.vars)), constants), key if stored else None


def from_disk_cache(key: str, opts: Options, name: str, constants: list[torch.Tensor],
                    start: float | None = None) -> Any:
    """The callable of the graph tecc's disk cache holds under `key`, or None (a miss)."""
    start = time.perf_counter() if start is None else start
    hit = cache.load_graph(key)
    if hit is None:
        return None
    compiled, report = hit
    report.name = compiled.name = name
    report.seconds = time.perf_counter() - start  # the load's (the compile's are the first process's)
    record(report)
    if report.fallbacks:
        log.warning("%s", report.fallback_message())
    log.info("tecc: graph %s from the cache (%.2f s)", name, time.perf_counter() - start)
    emulate = any(getattr(step, "emulate", False) for step in compiled.steps)
    return _with_constants(_finished(compiled, opts, emulate, bool(compiled.sizes)), constants)


def plan_graph(gm: GraphModule, name: str, sizes: Any, bound: set[Any], backward: bool = False) -> GraphPlan:
    """graph.plan_graph (the lowering, imported with the first compile: a cache hit needs none);
    a `backward` graph's levels cut into parts for memory (memory_parts.split_levels)."""
    from .graph import plan_graph as plan

    if not backward:
        return plan(gm, name, sizes, bound)
    from .memory_parts import split_levels

    return plan(gm, name, sizes, bound, split_levels)


def assemble(plan: GraphPlan, kernels: Sequence[Any], emulate: bool) -> CompiledGraph:
    """launch.assemble (imported with the first compile, as plan_graph)."""
    from .launch import assemble as launch_list

    return launch_list(plan, kernels, emulate)


def build_programs(plan: GraphPlan, target: str, opts: Options, deterministic: bool) -> list[Any]:
    """`tc.build` of each program of the graph, the planner's rankings shared with every graph
    this process compiled (`RANKINGS`)."""
    from ..compiler import build
    from ..compiler.planner import shared_rankings

    kernels = []
    with shared_rankings(_rankings()):
        for seg in plan.segments:
            dump = f"{opts.dump_ir}/{plan.name}/{seg.name}" if opts.dump_ir else None
            kernels.append(build(seg.args, target=target, name=seg.name, arch=opts.arch, dump_ir=dump,
                                 deterministic=deterministic))
    return kernels


def lift_constants(gm: GraphModule) -> list[torch.Tensor]:
    """The graph's tensor constants (`get_attr` nodes: a `torch.tensor([])` in the traced code, as
    transformers' key/value cache starts with) made inputs after its own: each becomes a
    placeholder, so the programs read it like any input and no node runs in Python. Returns the
    tensors, in the order of the new placeholders (`_with_constants` passes them)."""
    nodes = [n for n in gm.graph.nodes if n.op == "get_attr" and isinstance(_attribute(gm, n.target), torch.Tensor)]
    if not nodes:
        return []
    last = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    constants = []
    for node in nodes:
        value = _attribute(gm, node.target)
        with gm.graph.inserting_after(last):
            last = gm.graph.placeholder(f"tecc_constant_{len(constants)}")
        last.meta.update(node.meta)
        last.meta.setdefault("val", value)
        node.replace_all_uses_with(last)
        gm.graph.erase_node(node)
        constants.append(value)
    gm.recompile()
    return constants


def _attribute(gm: GraphModule, target: Any) -> Any:
    value: Any = gm
    for part in str(target).split("."):
        value = getattr(value, part, None)
    return value


def _with_constants(fn: Callable[[list[Any]], Any], constants: list[torch.Tensor]) -> Callable[[list[Any]], Any]:
    """The compiled graph called with the lifted constants after the caller's inputs (boxed, as
    AOTAutograd calls it)."""
    if not constants:
        return fn

    def run(args: list[Any]) -> Any:
        args.extend(constants)
        return fn(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def _target(emulate: bool) -> str:
    """What the programs are built for: the emulator for CPU tensors, CUDA otherwise."""
    return "sim" if emulate else "cuda"


def _finished(compiled: CompiledGraph, opts: Options, emulate: bool, dynamic: bool) -> Any:
    if opts.cudagraphs and not emulate and not dynamic:
        return with_cuda_graph(compiled)
    return compiled


aot_cache.connect(compile_graph, from_disk_cache)  # what a hit of AOTAutograd's cache loads with
