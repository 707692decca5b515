"""`build`: choose a program's Plan, then compile it (pipeline.py).

    build(args) ──plan="auto"──▶ graph-level rewrites (first that takes the program) or the planner
                ──tune=True───▶ the tuning database's winner, or the tuner measures now (tuning/)
                ──plan=Plan───▶ that plan, as given
            ──▶ pipeline.compile_plan(args, plan) ──▶ Kernel

The planner (plan="auto") picks each kernel's strategy and parameters by the cost model; its plan
is a list of schedule primitives, replayed on the lowered IR by `Schedule`. `f.explain()` says why.
"""

from __future__ import annotations

import os
import time
from typing import Any, Sequence

from ..ir.errors import TeccError
from ..ir.tensor import Tensor
from ..passes.manager import PassTiming
from . import options as knobs
from .kernel import Kernel
from .pipeline import TARGETS, compile_plan
from .plan import Plan
from .planner import PlanResult, plan_program
from .schedule import Schedule
from .strategies.column_reduction import propose as propose_column_reduction
from .strategies.row_fused import propose as propose_row_fused
from .strategies.split_row_group import propose as propose_split_row_group
from .strategies.split_rows import propose as propose_split_rows
from .tuning import tuned_plan


def build(args: Sequence[Tensor] | Schedule, target: str = "cuda", *, name: str | None = None,
          dump_ir: str | os.PathLike[str] | None = None, dump_filter: str | None = None,
          arch: str | None = None, plan: Plan | str | dict[str, Any] = "auto",
          options: Sequence[str] = (), sizes: dict[str, int] | None = None, tune: bool = False) -> Kernel:
    """Compile the program whose kernel signature is `args` (inputs and outputs, in order), or
    the scheduled program of a `Schedule`.

    target: "cuda" (NVRTC → cubin, run through cuda.core) or "sim" (the CPU SIMT emulator).
    dump_ir: a directory that receives the IR after every pass (see pipeline.py).
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
    compile_args = dict(name=name, dump_ir=dump_ir, dump_filter=dump_filter, arch=arch, options=options,
                        timing=timing)
    if isinstance(args, Schedule):
        return compile_plan(args, args.plan, target, **compile_args)  # type: ignore[arg-type]

    tensors = [args] if isinstance(args, Tensor) else list(args)
    planning: PlanResult | None = None
    program: Sequence[Tensor] | Schedule = tensors
    plan_arch = arch or knobs.default_arch_override()
    if tune:
        start = time.perf_counter()
        chosen = tuned_plan(tensors, arch=plan_arch, sizes=sizes, name=name, options=options)
        timing.seconds.append(("tune", time.perf_counter() - start))
    elif plan == "auto" or plan is None:
        proposal = _graph_level_proposal(tensors, plan_arch, sizes)
        if proposal is not None:
            chosen = proposal
        else:
            planning = plan_program(tensors, plan_arch, sizes=sizes, name=name)
            chosen = planning.plan
            timing.seconds.append(("plan", planning.search_seconds))
            if knobs.dump_request(dump_ir, "", dump_filter) is None:
                # the planner already scheduled the program (to check the primitives take the
                # plan): compile that IR; with dumps on, the replay writes one file per primitive
                program = planning.schedule
    else:
        chosen = _resolve_plan(plan)
    kernel = compile_plan(program, chosen, target, **compile_args)  # type: ignore[arg-type]
    kernel.planning = planning
    return kernel


def _graph_level_proposal(tensors: Sequence[Tensor], arch: str | None, sizes: dict[str, int] | None) -> Plan | None:
    """The plan of the first graph-level rewrite that takes the program, asked in this order:
    a reduction over rows too few to fill the GPU (or a full reduction) as a grid reduction
    split over blocks; softmax / norms over such rows as partial statistics, then the outputs; a
    graph of stages sharing a row as one kernel when that moves fewer global bytes; a column /
    middle-axis reduction as a split reduction. docs/memory-bound.md says when each applies;
    the per-kernel planner cannot express them."""
    graph_level = (
        lambda: propose_split_rows(tensors, arch, sizes=sizes),
        lambda: propose_split_row_group(tensors, arch, sizes=sizes),
        lambda: propose_row_fused(tensors),
        lambda: propose_column_reduction(tensors),
    )
    proposal = next((p for p in (ask() for ask in graph_level) if p is not None), None)
    return None if proposal is None else proposal.plan


def _resolve_plan(plan: Plan | str | dict[str, Any]) -> Plan:
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, (str, dict)):
        return Plan.from_json(plan)
    raise TeccError(f"build(): plan must be 'auto', a Plan or its JSON, got {type(plan).__name__}")
