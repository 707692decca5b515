"""The build driver: the one place that knows the whole pipeline.

Read `build` top to bottom to learn the compiler:

    tensor expressions ──lower──▶ loop IR ──schedule passes──▶ bound loop IR ──emit──▶ CUDA C
        ──NVRTC──▶ PTX + cubin ──▶ Kernel (runs on the GPU through cuda.core, or in the emulator)

With `dump_ir=DIR` (or TECC_DUMP_IR) the IR is written after every step: `00_lower.txt`,
`01_default_schedule.txt`, …, then `NN_cuda.cu` and `NN+1_<module>.ptx`.
"""

from __future__ import annotations

import os
import time
from typing import Any, Sequence

from ..codegen import default_arch, emit_source
from ..ir.errors import TeccError
from ..ir.stmt import Module
from ..ir.tensor import Tensor
from ..passes.default_schedule import DEFAULT_THREADS, default_schedule
from ..passes.lower import lower
from ..passes.manager import DumpIR, Pass, PassManager, PassTiming, VerifyIR
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


def _is_primitive_plan(plan: Plan) -> bool:
    return any(step.primitive != "default_schedule" for step in plan.steps)


def default_plan(threads: int = DEFAULT_THREADS) -> Plan:
    return Plan((Step("default_schedule", {"threads": threads}),), "naive",
                "one thread per output element; reductions serial per thread")


def build(args: Sequence[Tensor] | Schedule, target: str = "cuda", *, name: str | None = None,
          dump_ir: str | os.PathLike[str] | None = None, dump_filter: str | None = None,
          arch: str | None = None, plan: Plan | str | dict[str, Any] = "auto",
          options: Sequence[str] = ()) -> Kernel:
    """Compile the program whose kernel signature is `args` (inputs and outputs, in order), or
    the scheduled program of a `Schedule`.

    target: "cuda" (NVRTC → cubin, run through cuda.core) or "sim" (the CPU SIMT emulator).
    dump_ir: a directory that receives the IR after every pass (see the module docstring).
    arch: e.g. "sm_90"; default: TECC_ARCH, else the live device, else sm_90.
    plan: "auto", a Plan, or its JSON (ignored for a Schedule, which carries its own).
    options: extra NVRTC options (e.g. "-use_fast_math")."""
    if target not in TARGETS:
        raise TeccError(f"build(): unknown target {target!r}; use one of {TARGETS}")
    timing = PassTiming()

    # 1. lowering and the schedule primitives of the plan (the Schedule's own, when one is given)
    start = time.perf_counter()
    if isinstance(args, Schedule):
        module, chosen = args.mod, args.plan
    else:
        tensors = [args] if isinstance(args, Tensor) else list(args)
        chosen = _resolve_plan(plan)
        module = Schedule(tensors, chosen, name=name).mod if _is_primitive_plan(chosen) else lower(tensors, name)
    timing.seconds.append(("lower+schedule", time.perf_counter() - start))

    dump = knobs.dump_request(dump_ir, module.name, dump_filter)
    instruments: list[Any] = [timing]
    dumper = None
    if dump is not None:
        dumper = DumpIR(dump.directory, dump.kernel_filter)
        stage = "schedule" if isinstance(args, Schedule) or _is_primitive_plan(chosen) else "lower"
        dumper.write(f"{stage}.txt", f"# after {stage}\n{dumper.text(module)}")
        instruments.append(dumper)
    if knobs.verify_ir():
        verify_module(module)
        instruments.append(VerifyIR())

    # 2. the fixed tail of the pipeline
    pipeline = [
        _default_schedule_pass(chosen),
        Pass("simplify", simplify),
        Pass("unique_names", unique_names),
    ]
    module = PassManager(pipeline, instruments).run(module)

    # 3. CUDA C, then NVRTC
    start = time.perf_counter()
    source = emit_source(module.kernels)
    timing.seconds.append(("emit_cuda", time.perf_counter() - start))
    if dumper is not None:
        dumper.write("cuda.cu", source)

    host = HostProgram.from_module(module)
    kernel = Kernel(module=module, host=host, source=source, plan=chosen, target=target, timing=timing)
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
