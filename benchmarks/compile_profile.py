"""Where `torch.compile(model, backend="tecc")` spends its compile time, on the CPU (no GPU).

    python benchmarks/compile_profile.py                     # GPT-2 small, 2 layers, SDPA
    python benchmarks/compile_profile.py --layers 12 --top 40
    python benchmarks/compile_profile.py --layers 2 --profile /tmp/gpt2.prof --graphs forward
    python benchmarks/compile_profile.py --layers 12 --second-process   # then the disk-cache hit
    python benchmarks/compile_profile.py --layers 4 --twin-parts   # repeated parts: renamings of the first?
    python benchmarks/compile_profile.py --layers 12 --cache-dir DIR --load-only   # the hit again, from DIR
    python benchmarks/compile_profile.py --dump /tmp/after && diff -r /tmp/before /tmp/after

The model is docs/examples/train_gpt.py's GPT at GPT-2 small's sizes (width 768, 12 heads,
vocabulary 50304, batch 8 x 1024 tokens, bf16 autocast, SDPA or masked attention). Its forward
and backward ATen graphs are captured through AOTAutograd with torch's fake tensors, so nothing
is allocated or run at the real sizes, on CPU tensors (a CPU-only torch cannot trace CUDA
tensors through autograd): the graphs differ from the GPU's only in the attention op (the CPU's
`_scaled_dot_product_flash_attention_for_cpu`, which lowers to the same attention program) and
in autocast's CPU op lists. Each graph is then compiled as the backend compiles it
(tecc/torch/backend.py `compile_graph`), for target "cuda" (NVRTC runs here) and --arch (default:
as the backend, the live GPU's, else sm_90's reference part; on a GPU machine the planning is
then the real compile's):
`plan_graph` (lowering), `tc.build` of each program, `assemble`, and the store into the disk
cache. Printed per graph: seconds per phase, with `tc.build`'s split (lowering, planning,
scheduling, the fixed passes, emitting CUDA C, NVRTC), and the top cProfile entries over the
whole compile (--top). --second-process then loads the graphs back from the disk cache in a new
process, as a second `torch.compile` of the same model does (cache.graph_key, cache.load_graph,
the callable), and prints that time, after the new process's imports (torch with dynamo, then
tecc's backend) and its AOTAutograd trace of the graphs.

Each run starts from an empty TECC_CACHE_DIR (a temporary folder; --cache-dir to keep one), so
the figures are a first compile's.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "docs" / "examples"))
sys.path.insert(0, str(HERE.parent))

VOCAB, WIDTH, HEADS, CONTEXT, BATCH = 50304, 768, 12, 1024, 8


def capture(layers: int, attention: str, batch: int = BATCH, context: int = CONTEXT) -> dict[str, Any]:
    """The forward and backward ATen graphs of the GPT (fake CPU tensors, bf16 autocast), as
    AOTAutograd hands them to the backend: {"forward": (gm, inputs), "backward": (gm, inputs)}."""
    import torch
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._subclasses.fake_tensor import FakeTensorMode
    from train_gpt import GPT

    from tecc.torch.decompositions import decomposition_table

    with torch.device("meta"):
        model = GPT(VOCAB, WIDTH, HEADS, layers, context, attention)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        for module in model.modules():
            for name, p in list(module._parameters.items()):
                if p is not None:
                    module._parameters[name] = torch.nn.Parameter(torch.empty(p.shape))
        idx = torch.randint(0, VOCAB, (batch, context))
        targets = torch.randint(0, VOCAB, (batch, context))

    class Step(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor]:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return (self.inner(a, b),)

    graphs: dict[str, Any] = {}

    def keep(kind: str) -> Any:
        def compiler(gm: Any, inputs: Any) -> Any:
            graphs[kind] = (gm, inputs)
            return gm

        return compiler

    fn = aot_module_simplified(Step(model), (idx, targets), fw_compiler=keep("forward"),
                               bw_compiler=keep("backward"), decompositions=decomposition_table())
    import warnings

    with mode, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (loss,) = fn(idx, targets)
        loss.backward()
    return graphs


ORDER = ("graph_key", "lift_constants", "plan_graph (lowering)", "tc.build (all programs)", "  build: lower to loop IR",
         "  build: planner (search + realize)", "    of which compile checks (NVRTC)",
         "    of which waiting for checks in flight", "  build: schedule (replay the plan)",
         "  build: fixed passes", "  build: emit CUDA C", "  build: nvrtc (final module)", "assemble", "cache.store")


class Phases:
    """Wall seconds per named phase (printed in ORDER, then the others)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(ORDER, 0.0)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def timed(self, name: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.add(name, time.perf_counter() - start)


def compile_for_cuda(gm: Any, name: str, arch: str | None, phases: Phases, dump: str | None = None,
                     kind: str = "forward") -> Any:
    """compile_graph's steps (backend.py) with the programs built for target "cuda" (`gm` is
    AOTAutograd's graph of `kind`); `dump`: a folder to write each program's CUDA C and plan into
    (write_dump)."""
    from tecc.torch import backend, cache
    from tecc.torch.launch import assemble
    from tecc.torch.lowering import Sizes
    from tecc.torch.report import GraphReport

    start = time.perf_counter()
    opts = backend_options(arch, kind)
    key = phases.timed("graph_key", cache.graph_key, gm, _key_options(arch, kind), "cuda")
    phases.timed("lift_constants", backend.lift_constants, gm)
    sizes = Sizes()
    plan = phases.timed("plan_graph (lowering)", backend.plan_graph, gm, name, sizes, backend._bound_symbols(gm),
                        opts.cut_for_memory)
    kernels = phases.timed("tc.build (all programs)", backend.build_programs, plan, "cuda", opts, False)
    add_build_phases(phases, kernels)
    if dump is not None:
        write_dump(Path(dump) / name, kernels)
    compiled = phases.timed("assemble", assemble, plan, kernels, False)
    report = GraphReport.of(plan, kernels, time.perf_counter() - start)
    report.distinct = sum(1 for k in kernels for info in k.host.kernels if not info.entry)  # type: ignore[attr-defined]
    compiled.report = report
    phases.timed("cache.store", cache.store, key, compiled, kernels, report)
    return report


def write_dump(folder: Path, kernels: Any) -> None:
    """Each program's CUDA C (`<module>.cu`, every kernel under its own name, as Kernel.source
    holds it) and plan (`<module>.plan`: the JSON with its reason), so two versions of tecc can
    be compared on a model's graphs with `diff -r`: a change that means to keep the generated
    code must leave both byte-identical."""
    folder.mkdir(parents=True, exist_ok=True)
    for kernel in kernels:
        stem = kernel.module.name
        (folder / f"{stem}.cu").write_text(kernel.source)
        (folder / f"{stem}.plan").write_text(kernel.plan.to_json() + "\n")


def _key_options(arch: str | None, kind: str) -> dict[str, Any]:
    """backend.graph_key's options for AOTAutograd's graph of `kind` under the default options."""
    from tecc.torch import backend

    return backend.key_options(backend_options(arch, kind), False)


def backend_options(arch: str | None, kind: str) -> Any:
    from tecc.torch import backend

    return backend.Options.parse({"arch": arch}).for_graph(kind)


def add_build_phases(phases: Phases, kernels: Any) -> None:
    """The built kernels' timing steps added to `phases`, grouped (_phase_of); the planner's
    wall time is taken whole (_Wrapped), not from its step."""
    for kernel in kernels:
        for step, seconds in kernel.timing.seconds:
            if step != "plan":
                phases.add(f"  build: {_phase_of(step)}", seconds)


def _phase_of(step: str) -> str:
    """A timing step of tc.build (PassTiming) grouped into the phases this script prints."""
    if step.startswith("nvrtc"):
        return "nvrtc (final module)"
    if step in ("lower", "lower+schedule", "emit_cuda"):
        return {"lower": "lower to loop IR", "lower+schedule": "schedule (replay the plan)",
                "emit_cuda": "emit CUDA C"}[step]
    return "fixed passes"


class _Wrapped:
    """Wall seconds spent in a module-level function, counted while `phases` is set."""

    def __init__(self, module: Any, attribute: str, label: str) -> None:
        self.inner = getattr(module, attribute)
        self.label = label
        self.phases: Phases | None = None
        setattr(module, attribute, self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.phases is None:
            return self.inner(*args, **kwargs)
        return self.phases.timed(self.label, self.inner, *args, **kwargs)


def _instrument() -> list[_Wrapped]:
    """The planner (search and realization) and its compile checks, timed (see first_compile)."""
    import importlib

    build = importlib.import_module("tecc.compiler.build")
    planner = importlib.import_module("tecc.compiler.planner")
    realize = importlib.import_module("tecc.compiler.realize")
    # (the checks compile in threads, summed over them; the planner waits for those in flight in
    # realize._refusal, on its own thread)
    return [_Wrapped(planner, "plan_program", "  build: planner (search + realize)"),
            _Wrapped(build, "refuse_spills", "    of which compile checks (NVRTC)"),
            _Wrapped(realize, "_refusal", "    of which waiting for checks in flight")]


def _nvrtc_counter() -> list[float]:
    """Count the NVRTC compiles of this process and their seconds: [seconds, compiles]."""
    from tecc.codegen import nvrtc

    spent = [0.0, 0]
    inner = nvrtc._compile

    def timed(*a: Any, **kw: Any) -> Any:
        start = time.perf_counter()
        try:
            return inner(*a, **kw)
        finally:
            spent[0] += time.perf_counter() - start
            spent[1] += 1

    nvrtc._compile = timed
    return spent


def first_compile(args: argparse.Namespace) -> None:
    start = time.perf_counter()
    graphs = capture(args.layers, args.attention)
    print(f"captured {args.layers}-layer GPT ({args.attention}) forward/backward in {time.perf_counter() - start:.1f} s "
          f"(not counted below)")
    nvrtc_spent = _nvrtc_counter()
    planned = _Planned() if args.twin_parts else None
    wrapped = _instrument()
    total = 0.0
    profile = cProfile.Profile() if args.top or args.profile else None
    for kind in args.graphs:
        gm, _ = graphs[kind]
        phases = Phases()
        for w in wrapped:
            w.phases = phases
        before = list(nvrtc_spent)
        start, cpu = time.perf_counter(), time.process_time()
        if planned is not None:
            planned.results = []
        if profile is not None:
            profile.enable()
        report = compile_for_cuda(gm, f"g0_{kind}", args.arch, phases, args.dump, kind)
        if profile is not None:
            profile.disable()
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        total += seconds
        kernels = sum(len(k) for _, k in report.programs)
        print(f"\n{kind}: {len(gm.graph.nodes)} FX nodes, {len(report.programs)} program(s), {kernels} kernels "
              f"({report.distinct} compiled: the others are twins), "
              f"{seconds:.1f} s ({cpu:.1f} s of CPU, all threads); NVRTC {nvrtc_spent[1] - before[1]} compiles, "
              f"{nvrtc_spent[0] - before[0]:.1f} s (wall, summed over threads)")
        for name, s in phases.seconds.items():
            print(f"  {name:<44s} {s:8.2f} s")
        if planned is not None and planned.results is not None:
            print(f"  twin parts: {twin_parts(planned.results)}")
            planned.results = None
    print(f"\nfirst compile, all graphs: {total:.1f} s")
    if profile is not None:
        if args.profile:
            profile.dump_stats(args.profile)
        if args.top:
            out = io.StringIO()
            pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(args.top)
            print(out.getvalue())
            out = io.StringIO()
            pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(args.top)
            print(out.getvalue())


class _Planned:
    """The results of planner.plan_program while set (--twin-parts)."""

    def __init__(self) -> None:
        import importlib

        planner = importlib.import_module("tecc.compiler.planner")
        self.inner = planner.plan_program
        self.results: list[Any] | None = None
        planner.plan_program = self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        result = self.inner(*args, **kwargs)
        if self.results is not None:
            self.results.append(result)
        return result


def twin_parts(results: list[Any]) -> str:
    """Of the programs planned in regions, how many parts the planner gave an earlier part's
    planning renamed (part_twins.py), and, of those it planned (all with TECC_PART_TWINS=0), how
    many repeat an earlier part's structure (rankings.program_structure), and how many of those are the earlier part's scheduled module
    and plan steps with its names replaced by theirs (the names paired in the order they first
    appear in the two part programs; a derived name, `addmm_5_acc`, through its `_`-separated
    segments, as codegen/twins.py pairs kernels): what the planner's renaming relies on."""
    import re

    from tecc.codegen.twins import renamed
    from tecc.compiler import rankings

    identifier = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

    def names_in_order(program: Any) -> list[str]:
        own = rankings._names(program.module)
        return list(dict.fromkeys(w for w in identifier.findall(str(program.module)) if w in own))

    every = [part for r in results for part in r.parts]
    parts = [part for part in every if part.program is not None and part.schedule is not None]
    given = len(every) - len(parts)   # given an earlier part's planning renamed (tecc/compiler/part_twins.py)
    groups: dict[str, list[Any]] = {}
    for part in parts:
        groups.setdefault(rankings.program_structure(part.program), []).append(part)
    repeats = same = 0
    for first, *later in groups.values():
        for part in later:
            repeats += 1
            pairs = list(zip(names_in_order(first.program), names_in_order(part.program)))
            names = dict(pairs)
            steps = [repr(step) for step in first.schedule.plan.steps]
            if (len(names) == len(pairs) and renamed(str(first.schedule.mod), names) == str(part.schedule.mod)
                    and renamed("\n".join(steps), names) == "\n".join(repr(s) for s in part.schedule.plan.steps)):
                same += 1
    return (f"{len(every)} parts planned in regions, {given} given an earlier part's plan and module renamed "
            f"(TECC_PART_TWINS=0 plans each itself); of the {len(parts)} planned, {len(groups)} structures: "
            f"{repeats} repeat an earlier part, {same} of them its scheduled module and plan renamed")


def second_process(args: argparse.Namespace) -> None:
    """A new process: capture again, then key, load and finish each graph as backend.py does."""
    command = [sys.executable, __file__, "--child-load", "--layers", str(args.layers), "--attention", args.attention,
               *(["--arch", args.arch] if args.arch else []), "--graphs", *args.graphs]
    done = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ))
    print(done.stdout, end="")
    if done.returncode != 0:
        print(done.stderr[-3000:], file=sys.stderr)


def child_load(args: argparse.Namespace) -> None:
    start = time.perf_counter()
    import torch._dynamo  # noqa: F401 - what torch.compile imports before it looks up the backend
    import torch._functorch.aot_autograd  # noqa: F401

    torch_imported = time.perf_counter()
    from tecc.torch import backend, cache  # the entry point's module, as dynamo loads it

    tecc_imported = time.perf_counter()
    graphs = capture(args.layers, args.attention)
    print(f"new process: torch (with dynamo, AOTAutograd) imported in {torch_imported - start:.2f} s, "
          f"tecc's backend in {tecc_imported - torch_imported:.2f} s; the forward and backward graphs traced "
          f"(AOTAutograd on fake tensors, what a torch.compile pays before the backend is asked) in "
          f"{time.perf_counter() - tecc_imported:.1f} s")

    profile = cProfile.Profile() if args.top else None
    total = 0.0
    for kind in args.graphs:
        gm, _ = graphs[kind]
        phases = Phases()
        start = time.perf_counter()
        if profile is not None:
            profile.enable()
        key = phases.timed("graph_key", cache.graph_key, gm, _key_options(args.arch, kind), "cuda")
        hit = phases.timed("cache.load_graph", cache.load_graph, key)
        if hit is None:
            raise SystemExit(f"{kind}: no entry in the disk cache (key {key[:16]})")
        compiled, _ = hit
        phases.timed("lift_constants", backend.lift_constants, gm)
        opts = backend.Options.parse({})
        phases.timed("finish", backend._finished, compiled, opts, False, bool(compiled.sizes))
        if profile is not None:
            profile.disable()
        seconds = time.perf_counter() - start
        total += seconds
        print(f"\n{kind} from the disk cache: {seconds:.2f} s ({len(compiled.programs)} program(s))")
        for name, s in phases.seconds.items():
            print(f"  {name:<44s} {s:8.3f} s")
    print(f"\nsecond process, all graphs: {total:.2f} s (the first launch's module loads are not included: no GPU)")
    if profile is not None:
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(args.top)
        print(out.getvalue())
    print(json.dumps({"second_process_s": total}))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--attention", choices=("sdpa", "masked"), default="sdpa")
    p.add_argument("--arch", default=None, help="e.g. sm_90 (default: the live GPU's, else sm_90)")
    p.add_argument("--graphs", nargs="+", choices=("forward", "backward"), default=["forward", "backward"])
    p.add_argument("--top", type=int, default=0, help="print the top N cProfile entries (cumulative and own time)")
    p.add_argument("--profile", default=None, help="write the cProfile of the compile to this file")
    p.add_argument("--dump", default=None, help="write each graph's programs' CUDA C and plans into this folder "
                   "(DIR/<graph>/<module>.cu, .plan), to diff two versions of tecc")
    p.add_argument("--cache-dir", default=None, help="the TECC_CACHE_DIR to use (default: a fresh temporary one)")
    p.add_argument("--second-process", action="store_true", help="then load the graphs in a new process")
    p.add_argument("--twin-parts", action="store_true", help="after each graph, how many of its parts planned in "
                   "regions are an earlier part's scheduled module renamed (twin_parts)")
    p.add_argument("--load-only", action="store_true", help="with --cache-dir: no first compile, only the new "
                   "process that loads the graphs a run before stored there")
    p.add_argument("--child-load", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child_load:
        child_load(args)
        return 0
    with tempfile.TemporaryDirectory(prefix="tecc-compile-profile-") as scratch:
        os.environ["TECC_CACHE_DIR"] = args.cache_dir or scratch
        if args.load_only and not args.cache_dir:
            p.error("--load-only needs the --cache-dir of an earlier run")
        if not args.load_only:
            first_compile(args)
        if args.second_process or args.load_only:
            second_process(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
