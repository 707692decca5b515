"""The pipeline: a program and its Plan in, a Kernel out. Read `compile_plan` top to bottom:

    tensor expressions ──lower──▶ loop IR ──the plan's schedule primitives──▶ bound loop IR
        ──fixed tail (default_schedule, simplify, approx_math, unique_names)──▶ final loop IR
        ──emit──▶ CUDA C ──NVRTC──▶ PTX + cubin ──▶ Kernel (GPU through cuda.core, or the emulator)

Choosing the plan is build.py's part (the planner, the graph-level rewrites, the tuner); this
module only replays one, deterministically. The tuner's workers call it directly.

With `dump_ir=DIR` (or TECC_DUMP_IR) the IR is written after every step: `00_lower.txt`, one
file per schedule primitive of the plan (`01_split.txt`, …), then the fixed tail, `NN_cuda.cu`
and `NN+1_<module>.ptx`.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Sequence

from ..codegen import (KernelResources, default_arch, distinct_source, dynamic_shared_bytes, emit_parts, emit_source,
                       twin_entries)
from ..ir.errors import ScheduleError, TeccError
from ..ir.stmt import Module
from ..ir.tensor import Tensor
from ..passes.approx_math import approx_math
from ..passes.default_schedule import DEFAULT_THREADS, default_schedule
from ..passes.lower import lower
from ..passes.hoist_invariants import hoist_invariants
from ..passes.manager import DumpIR, Pass, PassManager, PassTiming, VerifyIR
from ..passes.names import identifier
from ..passes.schedule import drop_records
from ..passes.simplify import simplify
from ..passes.unique_names import unique_names
from ..passes.verify import verify_module
from ..runtime.host import HostProgram
from . import options as knobs
from . import regions
from .cache import compile_cached
from .kernel import Kernel
from .plan import Plan, Step
from .schedule import Schedule

TARGETS = ("cuda", "sim")


def default_plan(threads: int = DEFAULT_THREADS) -> Plan:
    return Plan((Step("default_schedule", {"threads": threads}),), "naive",
                "one thread per output element; reductions serial per thread")


def compile_plan(program: Sequence[Tensor] | Schedule, plan: Plan, target: str = "cuda", *,
                 name: str | None = None, dump_ir: str | os.PathLike[str] | None = None,
                 dump_filter: str | None = None, arch: str | None = None, options: Sequence[str] = (),
                 timing: PassTiming | None = None) -> Kernel:
    """Replay `plan` on `program` (the kernel signature) and compile it for `target`; a Schedule
    carries its own scheduled IR and plan (`plan` is then its plan too)."""
    timing = timing if timing is not None else PassTiming()
    dumper = open_dumps(program, name, dump_ir, dump_filter)
    module = schedule_module(program, plan, name=name, dumper=dumper, timing=timing)
    return compile_module(module, plan, target, arch=arch, options=options, dumper=dumper, timing=timing)


def open_dumps(program: Sequence[Tensor] | Schedule, name: str | None,
               dump_ir: str | os.PathLike[str] | None, dump_filter: str | None) -> DumpIR | None:
    """Where this build writes its IR dumps (None: nowhere)."""
    mod_name = program.mod.name if isinstance(program, Schedule) else module_name(list(program), name)
    request = knobs.dump_request(dump_ir, mod_name, dump_filter)
    if request is None:
        return None
    try:
        return DumpIR(request.directory, request.kernel_filter)
    except OSError as exc:
        raise TeccError(f"build(): cannot write the IR dumps to {request.directory} ({exc.strerror or exc}); "
                        "give dump_ir (or TECC_DUMP_IR) a directory that can be created and written") from exc


def schedule_module(program: Sequence[Tensor] | Schedule, plan: Plan, *, name: str | None,
                    dumper: DumpIR | None, timing: PassTiming, lowered: Module | None = None) -> Module:
    """Steps 1 and 2: lowering and the plan's schedule primitives (or the Schedule's IR as it is),
    then the fixed tail. Everything a plan can fail in happens here. `lowered`: the program's
    naive lowered module when the caller has it (a build lowers once: tecc.compiler.program)."""
    # 1. lowering and the schedule primitives of the plan (the Schedule's own, when one is given)
    start = time.perf_counter()
    if isinstance(program, Schedule):
        module = program.mod
        if dumper is not None:
            dumper.write("schedule.txt", f"# the Schedule as given\n{dumper.text(module)}")
    elif regions.is_composed(plan):  # parts scheduled with their own plans, one module (regions.py)
        module = regions.replay(list(program), plan, module_name(list(program), name))
        if dumper is not None:
            dumper.write("compose.txt", f"# the parts, composed\n{dumper.text(module)}")
    else:
        tensors = list(program)
        primitives = Plan(tuple(s for s in plan.steps if s.primitive != "default_schedule"))
        if primitives.steps:  # 00_lower.txt, then one file per primitive
            module = Schedule(tensors, primitives, name=name, dump_ir=dumper, lowered=lowered).mod
        else:
            module = lowered if lowered is not None else lower(tensors, name)
            if dumper is not None:
                dumper.write("lower.txt", f"# after pass lower\n{dumper.text(module)}")
    timing.seconds.append(("lower+schedule", time.perf_counter() - start))
    return finish_module(module, plan, dumper=dumper, timing=timing)


def finish_module(module: Module, plan: Plan, *, dumper: DumpIR | None, timing: PassTiming) -> Module:
    """Step 2 alone: the fixed tail of the pipeline on a scheduled module (also a module the
    planner composed from regions, which reaches here without step 1)."""
    # the tensor-core primitives' records (tecc/passes/schedule/tensor_core.py) end with the
    # schedule: they are no IR the code generator or the saved loop IR (kernel.save) knows
    module = drop_records(module)
    instruments: list[Any] = [timing]
    if dumper is not None:
        instruments.append(dumper)
    # 2. the fixed tail of the pipeline
    pipeline = [
        _default_schedule_pass(plan),
        Pass("simplify", simplify),
        Pass("hoist_invariants", hoist_invariants),
        Pass("approx_math", lambda m: approx_math(m, precise=knobs.precise_math()),
             (("precise", knobs.precise_math()),)),
        Pass("unique_names", unique_names),
    ]
    if not knobs.verify_ir():
        return PassManager(pipeline, instruments).run(module)
    verify_module(module)
    finished = PassManager(pipeline, instruments).run(module)
    try:
        verify_module(finished)   # the tail's result (a model's module: verified once, not after each pass)
    except TeccError:
        # which pass broke it: the tail again, verified after each pass (VerifyIR names the pass)
        PassManager(pipeline, [VerifyIR()]).run(module)
        raise
    return finished


def compile_module(module: Module, plan: Plan, target: str, *, arch: str | None, options: Sequence[str],
                   dumper: DumpIR | None, timing: PassTiming, threads: int = 1) -> Kernel:
    """Step 3: CUDA C from the final loop IR, then NVRTC (target "cuda"), as a Kernel. `threads`
    > 1: a module of several kernels compiles with NVRTC's split compile (cache.compile_cached;
    a build's final compile, never a compile check, whose ptxas warnings the split loses)."""
    start = time.perf_counter()
    prelude, texts = emit_parts(module.kernels)
    source = prelude + "".join("\n" + t for t in texts)
    # kernels that are an earlier kernel's code up to names (a model's layers) are compiled once
    # and launched under their own names (codegen/twins.py)
    twins = twin_entries(module.kernels, texts, prelude) if target == "cuda" else {}
    timing.seconds.append(("emit_cuda", time.perf_counter() - start))
    if dumper is not None:
        dumper.write("cuda.cu", source)

    # a kernel with over 48 KiB of shared buffers declares them dynamic: the launch passes the size
    dynamic = {k.name: dynamic_shared_bytes(k) for k in module.kernels}
    host = HostProgram.from_module(module, {k: v for k, v in dynamic.items() if v > 0}).with_entries(twins)
    kernel = Kernel(module=module, host=host, source=source, plan=plan, target=target, timing=timing)
    kernel.build_arch = arch
    if target == "cuda":
        the_arch = arch or knobs.default_arch_override() or default_arch()
        start = time.perf_counter()
        compiled, cached = compile_cached(distinct_source(prelude, module.kernels, texts, twins) if twins else source,
                                          arch=the_arch, name=module.name, options=tuple(options), threads=threads)
        timing.seconds.append(("nvrtc (cache hit)" if cached else "nvrtc", time.perf_counter() - start))
        if twins:  # a twin's ptxas report is its entry's
            resources = dict(compiled.resources)
            resources.update({k: resources[e] for k, e in twins.items() if e in resources})
            compiled = dataclasses.replace(compiled, resources=resources)
        kernel.attach_binary(compiled, tuple(options))
        if dumper is not None:
            dumper.write(f"{module.name}.ptx", compiled.ptx)
    if dumper is not None and dumper.matches:  # (a module the dump filter does not keep writes nothing)
        kernel.dump_dir = dumper.directory
    return kernel


def refuse_spills(schedule: Schedule, kernel: str | None, arch: str) -> dict[str, KernelResources]:
    """ScheduleError when kernel `kernel` (None: any kernel) of the scheduled program spills once
    compiled for `arch`, or when ptxas serializes its wgmmas (ptxas's report through NVRTC; the
    compile cache keeps the binary for the build); else ptxas's report of every kernel. The
    planner's compile check for strategies whose register use ptxas decides."""
    timing = PassTiming()
    # the kernel alone: ptxas allocates each kernel on its own, so its report is the same as in
    # the whole module, and the check costs one kernel's compile however large the program is
    # (a graph rewrite's check, kernel None, compiles every kernel of the rewritten module)
    alone = only_kernel(schedule.mod, kernel) if kernel is not None else schedule.mod
    module = finish_module(alone, schedule.plan, dumper=None, timing=timing)
    compiled = compile_module(module, schedule.plan, "cuda", arch=arch, options=(), dumper=None, timing=timing)
    names = [kernel] if kernel is not None else [k.name for k in module.kernels]
    missing = [name for name in names if name not in compiled.resources]
    if kernel is None and missing:
        raise ScheduleError(f"ptxas reported no resources for {', '.join(missing)} on {arch} "
                            f"(log: {compiled.compile_log.strip()[:200]!r})")
    for name in names:
        res = compiled.resources.get(name)
        if res is not None and (res.spill_stores or res.spill_loads):
            raise ScheduleError(f"{name} spills on {arch}: ptxas keeps {res.registers} registers and spills "
                                f"{res.spill_stores} stores / {res.spill_loads} loads ({res.stack_bytes} bytes of stack)")
    serialized = wgmma_serialized(compiled.compile_log)
    if serialized is not None:
        raise ScheduleError(f"{kernel or module.name} on {compiled.arch}: ptxas serializes its wgmmas ({serialized})")
    return dict(compiled.resources)


def first_without_spills(tensors: Sequence[Tensor], plans: Sequence[Plan], arch: str | None,
                         name: str | None, lowered: Module | None = None) -> Plan:
    """The first of `plans` whose kernels ptxas compiles without spilling for `arch`, else the
    first: the compile check of a graph-level rewrite that offers fallbacks (row_fused's where
    the straight-line walk of a row filling the register cap spills). One plan: no compile. The
    check compiles without the build's options, as refuse_spills does; the compile cache keeps
    the binary for the build. `lowered`: the program's naive module (schedule_module)."""
    if len(plans) < 2:
        return plans[0]
    the_arch = arch or knobs.default_arch_override() or default_arch()
    for plan in plans:
        timing = PassTiming()
        module = schedule_module(tensors, plan, name=name, dumper=None, timing=timing, lowered=lowered)
        try:
            compiled, _ = compile_cached(emit_source(module.kernels), arch=the_arch, name=module.name, options=())
        except TeccError:  # no NVRTC here (an emulator build): no check
            return plans[0]
        if not any(r.spill_stores or r.spill_loads for r in compiled.resources.values()):
            return plan
    return plans[0]


def only_kernel(module: Module, kernel: str) -> Module:
    """`module` cut down to the kernel named `kernel` and its launches."""
    kept = tuple(k for k in module.kernels if k.name == kernel)
    if not kept:
        raise ScheduleError(f"no kernel {kernel!r} in module {module.name}")
    calls = tuple(c for c in module.calls if c.kernel == kernel)
    return Module(module.name, module.params, kept, calls, module.temps)


def wgmma_serialized(log: str) -> str | None:
    """ptxas's warning that it serialized the wgmmas of a kernel (C7515 "Potential Performance
    Loss: wgmma.mma_async instructions are serialized due to ..."), or None: such a kernel waits
    for every wgmma before the next, which is what the ring was built to avoid."""
    for line in log.splitlines():
        if "C7515" in line or ("wgmma" in line and "serialized" in line):
            return line.strip()
    return None


def _default_schedule_pass(plan: Plan) -> Pass:
    """The always-valid schedule for kernels the plan left unbound (all of them for the naive plan)."""
    threads = DEFAULT_THREADS
    for step in plan.steps:
        if step.primitive == "default_schedule":
            threads = int(step.args.get("threads", DEFAULT_THREADS))
    return Pass("default_schedule", lambda m: default_schedule(m, threads), (("threads", threads),))


def module_name(tensors: Sequence[Tensor], name: str | None) -> str:
    """The module's name: `name`, else the last computed tensor's (as lowering names it)."""
    computed = [t for t in tensors if not t.is_placeholder]
    return identifier(name or (computed[-1].name if computed else "module"))

