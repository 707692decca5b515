"""The build driver: the one place that knows the whole pipeline.

Read `build` top to bottom to learn the compiler:

    tensor expressions ──lower──▶ loop IR ──schedule passes──▶ bound loop IR ──emit──▶ CUDA C
        ──NVRTC──▶ PTX + cubin ──▶ Kernel (runs on the GPU through cuda.core, or in the emulator)

The planner (plan="auto") picks each kernel's strategy and parameters by the cost model; its plan
is a list of schedule primitives, replayed on the lowered IR by `Schedule`. plan="auto" tries its
candidates in order (graph-level rewrites, the per-kernel planner, the generic schedule) and falls
back to the next when one that took the program fails to build (`_first_that_builds`).

With `dump_ir=DIR` (or TECC_DUMP_IR) the IR is written after every step: `00_lower.txt`, one
file per schedule primitive of the plan (`01_split.txt`, …), then the fixed tail
(`default_schedule`, `simplify`, `approx_math`, `unique_names`), `NN_cuda.cu` and `NN+1_<module>.ptx`.
"""

from __future__ import annotations

import operator
import os
import time
from dataclasses import replace
from typing import Any, Callable, Sequence

from ..codegen import default_arch, emit_source
from ..ir.errors import ShapeError, TeccError
from ..ir.expr import free_vars
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
    fallbacks: list[tuple[str, str]] = []

    # 1. lowering and the schedule primitives of the plan (the Schedule's own, when one is given),
    #    then the fixed tail of the pipeline
    start = time.perf_counter()
    dumper: DumpIR | None = None
    if isinstance(args, Schedule):
        module, chosen = args.mod, args.plan
        dumper = _dumper(dump_ir, module.name, dump_filter)
        if dumper is not None:
            dumper.write("schedule.txt", f"# the Schedule as given\n{dumper.text(module)}")
        timing.seconds.append(("lower+schedule", time.perf_counter() - start))
        module = _tail(module, chosen, _instruments(timing, dumper))
    else:
        tensors = [args] if isinstance(args, Tensor) else list(args)
        _check_arguments(tensors, sizes)
        dumper = _dumper(dump_ir, module_name(tensors, name), dump_filter)
        candidates: list[tuple[str, Callable[[], Any]]]
        if tune:
            from .tuner import tuned_plan

            start_tune = time.perf_counter()
            chosen = tuned_plan(tensors, arch=arch or knobs.default_arch_override(), sizes=sizes, name=name,
                                options=options)
            timing.seconds.append(("tune", time.perf_counter() - start_tune))
            tuned = chosen
            candidates = [("tuned", lambda: tuned)]
        elif plan == "auto" or plan is None:
            candidates = _auto_candidates(tensors, arch or knobs.default_arch_override(), sizes, name, timing)
        else:
            given = _resolve_plan(plan)
            candidates = [("given", lambda: given)]
        module, chosen, planning, fallbacks = _first_that_builds(candidates, tensors, name, dumper, timing)

    # 2. CUDA C, then NVRTC
    start = time.perf_counter()
    source = emit_source(module.kernels)
    timing.seconds.append(("emit_cuda", time.perf_counter() - start))
    if dumper is not None:
        dumper.write("cuda.cu", source)

    host = HostProgram.from_module(module)
    kernel = Kernel(module=module, host=host, source=source, plan=chosen, target=target, timing=timing)
    kernel.planning = planning
    kernel.fallbacks = fallbacks
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


# What a strategy that accepted a program may fail with while it is realized: tecc's own errors
# (a primitive refusing the request) and the internal failures of a strategy's arithmetic or
# bookkeeping. The build then falls back to the next candidate and records why; the generic
# schedule, last, is not caught, so a program that cannot be built at all says why.
STRATEGY_FAILURES: tuple[type[BaseException], ...] = (
    TeccError, ArithmeticError, LookupError, AssertionError, ValueError, TypeError, AttributeError,
    RecursionError,
)


def _auto_candidates(tensors: list[Tensor], plan_arch: str | None, sizes: dict[str, int] | None,
                     name: str | None, timing: PassTiming) -> list[tuple[str, Callable[[], Any]]]:
    """plan="auto": the candidates in the order they are tried. Each is a (label, thunk) whose thunk
    returns a Plan (or a PlanResult), or None when the candidate's guard declines the program."""
    from .planner import plan_program
    from .strategies.column_reduction import propose as propose_column_reduction
    from .strategies.row_fused import propose as propose_row_fused
    from .strategies.split_row_group import propose as propose_split_row_group
    from .strategies.split_rows import propose as propose_split_rows

    def proposal(propose: Callable[[], Any]) -> Callable[[], Plan | None]:
        def ask() -> Plan | None:
            found = propose()
            return None if found is None else found.plan
        return ask

    def planner() -> Any:
        result = plan_program(tensors, plan_arch, sizes=sizes, name=name)
        timing.seconds.append(("plan", result.search_seconds))
        return result

    # Graph-level rewrites the per-kernel planner cannot express, asked in this order; the first
    # that takes the program and builds wins: a reduction over rows too few to fill the GPU (or a
    # full reduction) as a grid reduction split over blocks; softmax / norms over such rows as
    # partial statistics, then the outputs; a graph of stages sharing a row as one kernel when
    # that moves fewer global bytes; a column / middle-axis reduction as a split reduction.
    # docs/memory-bound.md says when each applies. Then the per-kernel planner, then the
    # generic schedule (always valid).
    return [
        ("split_rows", proposal(lambda: propose_split_rows(tensors, plan_arch, sizes=sizes))),
        ("split_row_group", proposal(lambda: propose_split_row_group(tensors, plan_arch, sizes=sizes))),
        ("row_fused", proposal(lambda: propose_row_fused(tensors))),
        ("column_reduction", proposal(lambda: propose_column_reduction(tensors))),
        ("planner", planner),
        ("generic", default_plan),
    ]


def _first_that_builds(candidates: list[tuple[str, Callable[[], Any]]], tensors: list[Tensor],
                       name: str | None, dumper: DumpIR | None, timing: PassTiming,
                       ) -> tuple[Module, Plan, Any, list[tuple[str, str]]]:
    """Lower and schedule with the first candidate that takes the program and builds.

    A candidate that fails (STRATEGY_FAILURES) is recorded as (label, why) and the next one is
    tried; its dumps are removed. The last candidate's failure is raised. Returns the final module,
    the plan (its reason says which candidates failed), the planner's result when it was chosen,
    and the failures."""
    fallbacks: list[tuple[str, str]] = []
    for position, (label, ask) in enumerate(candidates):
        last = position == len(candidates) - 1
        first_dump = dumper.count if dumper is not None else 0
        try:
            found = ask()
            if found is None:
                continue
            planning = None if isinstance(found, Plan) else found
            chosen: Plan = found if isinstance(found, Plan) else found.plan
            start = time.perf_counter()
            module = _lower_and_schedule(tensors, chosen, name, dumper)
            timing.seconds.append(("lower+schedule", time.perf_counter() - start))
            module = _tail(module, chosen, _instruments(timing, dumper))
        except STRATEGY_FAILURES as exc:
            if last or knobs.strict_plans():
                raise
            fallbacks.append((label, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"))
            _rewind(dumper, first_dump)
            continue
        if fallbacks:
            tried = "; ".join(f"{who} failed ({why})" for who, why in fallbacks)
            chosen = replace(chosen, reason=(chosen.reason + "; " if chosen.reason else "") + f"fell back: {tried}")
        return module, chosen, planning, fallbacks
    raise TeccError("build(): no candidate plan applies to this program")  # the list ends in one that always does


def _lower_and_schedule(tensors: list[Tensor], chosen: Plan, name: str | None, dumper: DumpIR | None) -> Module:
    primitives = Plan(tuple(s for s in chosen.steps if s.primitive != "default_schedule"))
    if primitives.steps:  # 00_lower.txt, then one file per primitive
        return Schedule(tensors, primitives, name=name, dump_ir=dumper).mod
    module = lower(tensors, name)
    if dumper is not None:
        dumper.write("lower.txt", f"# after pass lower\n{dumper.text(module)}")
    return module


def _instruments(timing: PassTiming, dumper: DumpIR | None) -> list[Any]:
    instruments: list[Any] = [timing]
    if dumper is not None:
        instruments.append(dumper)
    return instruments


def _tail(module: Module, chosen: Plan, instruments: list[Any]) -> Module:
    """The fixed tail of the pipeline, after the plan's primitives."""
    if knobs.verify_ir():
        verify_module(module)
        instruments = instruments + [VerifyIR()]
    pipeline = [
        _default_schedule_pass(chosen),
        Pass("simplify", simplify),
        Pass("approx_math", lambda m: approx_math(m, precise=knobs.precise_math()),
             (("precise", knobs.precise_math()),)),
        Pass("unique_names", unique_names),
    ]
    return PassManager(pipeline, instruments).run(module)


def _rewind(dumper: DumpIR | None, first: int) -> None:
    """Remove the dumps a failed candidate wrote (numbered from `first`) so the next starts there."""
    if dumper is None:
        return
    for path in dumper.directory.iterdir():
        number = path.name.split("_", 1)[0]
        if number.isdigit() and int(number) >= first and path.is_file():
            path.unlink()
    dumper.count = first


def module_name(tensors: Sequence[Tensor], name: str | None) -> str:
    """The module's name: `name`, else the last computed tensor's (as lowering names it)."""
    computed = [t for t in tensors if not t.is_placeholder]
    return identifier(name or (computed[-1].name if computed else "module"))


def _dumper(dump_ir: str | os.PathLike[str] | None, name: str, dump_filter: str | None) -> DumpIR | None:
    request = knobs.dump_request(dump_ir, name, dump_filter)
    if request is None:
        return None
    try:
        return DumpIR(request.directory, request.kernel_filter)
    except OSError as exc:
        raise TeccError(f"build(): cannot write the IR dumps to {request.directory} ({exc.strerror or exc}); "
                        "give dump_ir (or TECC_DUMP_IR) a directory that can be created and written") from exc


def _check_arguments(tensors: list[Tensor], sizes: dict[str, int] | None) -> None:
    """The argument list holds tensors, and `sizes` gives non-negative ints to size names the
    program has."""
    for pos, t in enumerate(tensors):
        if not isinstance(t, Tensor):
            raise TeccError(f"build(): argument {pos} is a {type(t).__name__}, not a tensor made by "
                            "tc.placeholder / tc.compute")
    if not sizes:
        return
    known = {v.name for t in tensors for dim in t.shape for v in free_vars(dim)}
    for key, value in sizes.items():
        if key not in known:
            raise ShapeError(f"build(): sizes names {key!r}, which is no size of this program; its sizes are "
                             f"{', '.join(sorted(known)) or 'none (every dimension is a constant)'}")
        try:
            ok = not isinstance(value, bool) and operator.index(value) >= 0
        except TypeError:
            ok = False
        if not ok:
            raise ShapeError(f"build(): sizes[{key!r}] is {value!r}; give a non-negative int")


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
