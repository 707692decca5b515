"""What a plan step may be when a Schedule replays it: a primitive of the schedule, addressing
kernels of this program, with arguments the primitive takes (each refusal a ScheduleError that
says what to do)."""

from __future__ import annotations

import inspect
from typing import Any

from ..ir.errors import ScheduleError
from .plan import Plan, Step
from .schedule_tensor_core import is_legacy_tensorize

# the step arguments that address a loop or a stage as "kernel/name" (LoopRV, StageRV)
_ADDRESS_ARGS = ("loop", "loops", "outer", "inner", "stage", "cache")
# public methods of a Schedule that are not primitives
_NOT_PRIMITIVES = ("replay", "get_loops", "gemm_operands")


def kernels_named(step: Step) -> list[str]:
    """The kernels a plan step addresses through its "kernel/name" arguments."""
    found = []
    for key in _ADDRESS_ARGS:
        value = step.args.get(key)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, str) and "/" in item:
                found.append(item.split("/", 1)[0])
    return found


def checked_step(schedule: Any, kernels: set[str], plan: Plan, number: int) -> Step:
    """Step `number` of `plan` as `schedule` applies it (a plan recorded before the tensor-core
    primitives were separate replays through replay_legacy_tensorize). A step naming a kernel
    this program does not have says the plan is for another program and what it names."""
    step = plan.steps[number]
    if any(k not in kernels for k in kernels_named(step)):
        named = sorted({k for s in plan.steps for k in kernels_named(s)} - kernels)
        raise ScheduleError(
            f"the plan is for another program: it names kernel(s) {', '.join(named)}, and this program's "
            f"kernels are {', '.join(sorted(kernels))} (plan step {number}, {step.primitive}); plan this "
            "program with plan='auto', or give it a plan made for it")
    if is_legacy_tensorize(step):
        step = Step("replay_legacy_tensorize", step.args)
    method = getattr(schedule, step.primitive, None)
    if method is None or step.primitive.startswith("_") or step.primitive in _NOT_PRIMITIVES:
        raise ScheduleError(f"plan step {step.primitive!r} is not a schedule primitive")
    try:
        if step.primitive == "reorder":
            inspect.signature(method).bind(*step.args["loops"])
        else:
            inspect.signature(method).bind(**step.args)
    except (KeyError, TypeError) as exc:
        params = ", ".join(inspect.signature(method).parameters)
        raise ScheduleError(f"plan step {step.primitive}({', '.join(map(str, step.args))}): {exc}; "
                            f"{step.primitive} takes ({params})") from exc
    return step
