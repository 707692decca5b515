"""The build driver: the one place that knows the whole pipeline.

Read `build` top to bottom to learn the compiler:

    tensor expressions ──lower──▶ loop IR ──schedule passes──▶ bound loop IR ──emit──▶ CUDA C
        ──NVRTC──▶ PTX + cubin ──▶ Kernel (runs on the GPU through cuda.core, or in the emulator)

The planner (plan="auto") picks each kernel's strategy and parameters by the cost model; its plan
is a list of schedule primitives, replayed on the lowered IR by `Schedule`.

With `dump_ir=DIR` (or TECC_DUMP_IR) the IR is written after every step: `00_lower.txt`, one
file per schedule primitive of the plan (`01_split.txt`, …), then the fixed tail
(`default_schedule`, `simplify`, `approx_math`, `unique_names`), `NN_cuda.cu` and `NN+1_<module>.ptx`.
"""

from __future__ import annotations

import os
import time
from typing import Any, Sequence

from ..codegen import default_arch, dynamic_shared_bytes, emit_source
from ..ir.errors import TeccError
from ..ir.stmt import Module
from ..ir.tensor import Tensor
from ..passes.approx_math import approx_math
from ..passes.default_schedule import DEFAULT_THREADS, default_schedule
from ..passes.lower import lower
from ..passes.manager import DumpIR, Pass, PassManager, PassTiming, VerifyIR
from ..passes.names import identifier
from ..passes.simplify import simplify
from ..passes.unique_names import unique_names
from ..passes.verify import verify_module
from ..runtime.host import HostProgram
from . import options as knobs
from .cache import compile_cached
from .kernel import Kernel
from .plan import Plan, Step
from .schedule import Schedule

TARGETS = ("cuda", "sim")


def _default_schedule_pass(plan: Plan) -> Pass:
    """The always-valid schedule for kernels the plan left unbound (all of them for the naive plan)."""
    threads = DEFAULT_THREADS
    for step in plan.steps:
        if step.primitive == "default_schedule":
            threads = int(step.args.get("threads", DEFAULT_THREADS))
    return Pass("default_schedule", lambda m: default_schedule(m, threads), (("threads", threads),))


def default_plan(threads: int = DEFAULT_THREADS) -> Plan:
    return Plan((Step("default_schedule", {"threads": threads}),), "naive",
                "one thread per output element; reductions serial per thread")


def build(args: Sequence[Tensor] | Schedule, target: str = "cuda", *, name: str | None = None,
          dump_ir: str | os.PathLike[str] | None = None, dump_filter: str | None = None,
          arch: str | None = None, plan: Plan | str | dict[str, Any] = "auto",
          options: Sequence[str] = (), sizes: dict[str, int] | None = None, tune: bool = False) -> Kernel:
    """Compile the program whose kernel signature is `args` (inputs and outputs, in order), or
    the scheduled program of a `Schedule`.

    target: "cuda" (NVRTC → cubin, run through cuda.core) or "sim" (the CPU SIMT emulator).
    dump_ir: a directory that receives the IR after every pass (see the module docstring).
    arch: e.g. "sm_90"; default: TECC_ARCH, else the live device, else sm_90.
    plan: "auto" (the planner picks strategy and parameters by the cost model; `f.explain()`
      says why), a Plan, or its JSON (ignored for a Schedule, which carries its own).
    sizes: values of symbolic dimensions for the planner to plan for (others are assumed).
    options: extra NVRTC options (e.g. "-use_fast_math").
    tune: use the tuning database's winner for this problem (op, shapes from `sizes`, dtypes,
      arch) without measuring, else autotune now on the GPU (docs/tuning.md); `plan` is then
      ignored. `f.plan.reason` says which."""
    if target not in TARGETS:
        raise TeccError(f"build(): unknown target {target!r}; use one of {TARGETS}")
    timing = PassTiming()
    planning = None

    # 1. lowering and the schedule primitives of the plan (the Schedule's own, when one is given)
    start = time.perf_counter()
    dumper: DumpIR | None = None
    if isinstance(args, Schedule):
        module, chosen = args.mod, args.plan
        dumper = _dumper(dump_ir, module.name, dump_filter)
        if dumper is not None:
            dumper.write("schedule.txt", f"# the Schedule as given\n{dumper.text(module)}")
    else:
        tensors = [args] if isinstance(args, Tensor) else list(args)
        if tune:
            from .tuner import tuned_plan

            start_tune = time.perf_counter()
            chosen = tuned_plan(tensors, arch=arch or knobs.default_arch_override(), sizes=sizes, name=name,
                                options=options)
            timing.seconds.append(("tune", time.perf_counter() - start_tune))
        elif plan == "auto" or plan is None:
            from .planner import plan_program
            from .strategies.column_reduction import propose as propose_column_reduction
            from .strategies.row_fused import propose as propose_row_fused
            from .strategies.split_row_group import propose as propose_split_row_group
            from .strategies.split_rows import propose as propose_split_rows

            # Graph-level rewrites the per-kernel planner cannot express, asked in this order;
            # the first that takes the program wins: a reduction over rows too few to fill the
            # GPU (or a full reduction) as a grid reduction split over blocks; softmax / norms
            # over such rows as partial statistics, then the outputs; a graph of stages sharing a
            # row as one kernel when that moves fewer global bytes; a column / middle-axis
            # reduction as a split reduction. docs/memory-bound.md says when each applies.
            plan_arch = arch or knobs.default_arch_override()
            graph_level = (
                lambda: propose_split_rows(tensors, plan_arch, sizes=sizes),
                lambda: propose_split_row_group(tensors, plan_arch, sizes=sizes),
                lambda: propose_row_fused(tensors),
                lambda: propose_column_reduction(tensors),
            )
            proposal = next((p for p in (ask() for ask in graph_level) if p is not None), None)
            if proposal is not None:
                chosen = proposal.plan
            else:
                planning = plan_program(tensors, plan_arch, sizes=sizes, name=name)
                chosen = planning.plan
                timing.seconds.append(("plan", planning.search_seconds))
        else:
            chosen = _resolve_plan(plan)
        dumper = _dumper(dump_ir, module_name(tensors, name), dump_filter)
        primitives = Plan(tuple(s for s in chosen.steps if s.primitive != "default_schedule"))
        if primitives.steps:  # 00_lower.txt, then one file per primitive
            module = Schedule(tensors, primitives, name=name, dump_ir=dumper).mod
        else:
            module = lower(tensors, name)
            if dumper is not None:
                dumper.write("lower.txt", f"# after pass lower\n{dumper.text(module)}")
    timing.seconds.append(("lower+schedule", time.perf_counter() - start))

    instruments: list[Any] = [timing]
    if dumper is not None:
        instruments.append(dumper)
    if knobs.verify_ir():
        verify_module(module)
        instruments.append(VerifyIR())

    # 2. the fixed tail of the pipeline
    pipeline = [
        _default_schedule_pass(chosen),
        Pass("simplify", simplify),
        Pass("approx_math", lambda m: approx_math(m, precise=knobs.precise_math()),
             (("precise", knobs.precise_math()),)),
        Pass("unique_names", unique_names),
    ]
    module = PassManager(pipeline, instruments).run(module)

    # 3. CUDA C, then NVRTC
    start = time.perf_counter()
    source = emit_source(module.kernels)
    timing.seconds.append(("emit_cuda", time.perf_counter() - start))
    if dumper is not None:
        dumper.write("cuda.cu", source)

    # a kernel with over 48 KiB of shared buffers declares them dynamic: the launch passes the size
    dynamic = {k.name: dynamic_shared_bytes(k) for k in module.kernels}
    host = HostProgram.from_module(module, {k: v for k, v in dynamic.items() if v > 0})
    kernel = Kernel(module=module, host=host, source=source, plan=chosen, target=target, timing=timing)
    kernel.planning = planning
    if target == "cuda":
        the_arch = arch or knobs.default_arch_override() or default_arch()
        start = time.perf_counter()
        compiled, cached = compile_cached(source, arch=the_arch, name=module.name, options=tuple(options))
        timing.seconds.append(("nvrtc (cache hit)" if cached else "nvrtc", time.perf_counter() - start))
        kernel.attach_binary(compiled, tuple(options))
        if dumper is not None:
            dumper.write(f"{module.name}.ptx", compiled.ptx)
    if dumper is not None:
        kernel.dump_dir = dumper.directory
    return kernel


def module_name(tensors: Sequence[Tensor], name: str | None) -> str:
    """The module's name: `name`, else the last computed tensor's (as lowering names it)."""
    computed = [t for t in tensors if not t.is_placeholder]
    return identifier(name or (computed[-1].name if computed else "module"))


def _dumper(dump_ir: str | os.PathLike[str] | None, name: str, dump_filter: str | None) -> DumpIR | None:
    request = knobs.dump_request(dump_ir, name, dump_filter)
    return None if request is None else DumpIR(request.directory, request.kernel_filter)


def _resolve_plan(plan: Plan | str | dict[str, Any]) -> Plan:
    if isinstance(plan, Plan):
        return plan
    if plan == "auto" or plan is None:
        return default_plan()
    if isinstance(plan, (str, dict)):
        return Plan.from_json(plan)
    raise TeccError(f"build(): plan must be 'auto', a Plan or its JSON, got {type(plan).__name__}")


def lower_only(args: Sequence[Tensor], name: str | None = None) -> Module:
    """The naive loop IR of a program (what `00_lower.txt` shows)."""
    return lower(list(args), name)
