"""tecc.compiler: the build driver, schedules and plans, strategies, cost model, planner, checking,
compile cache, tuning database and profiling.

The names below are imported on first use, so importing one small module of the package (its
options, the build cache's fingerprint) does not import the whole pipeline: a process that only
loads compiled graphs from the disk cache (tecc/torch/cache.py) never imports the planner,
the passes or NVRTC's code generator. Two names are also submodules (`build`, `explain`): the
package keeps the function under the name, as an eager `from .build import build` did, even
when the submodule is imported first (`_Package.__setattr__`).
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the names are, for type checkers (at run time: __getattr__)
    from ..runtime.artifact import load
    from ..runtime.cuda import cuda_available as gpu_available
    from .build import build
    from .check import OpSpec
    from .explain import explain
    from .kernel import Kernel
    from .pipeline import default_plan
    from .plan import Plan, Step
    from .planner import plan_program
    from .profiling import profile
    from .schedule import LoopRV, Schedule, StageRV

# public name -> the submodule that defines it
_LAZY = {
    "build": ".build", "default_plan": ".pipeline", "OpSpec": ".check", "explain": ".explain", "Kernel": ".kernel",
    "Plan": ".plan", "Step": ".plan", "plan_program": ".planner", "profile": ".profiling", "LoopRV": ".schedule",
    "Schedule": ".schedule", "StageRV": ".schedule",
}
# names taken from another layer: (module, its name for it)
_ELSEWHERE = {"load": ("tecc.runtime.artifact", "load"), "gpu_available": ("tecc.runtime.cuda", "cuda_available")}

__all__ = [
    "build", "default_plan", "explain", "gpu_available", "load", "plan_program", "profile",
    "Kernel", "LoopRV", "OpSpec", "Plan", "Schedule", "StageRV", "Step",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    elif name in _ELSEWHERE:
        module, attribute = _ELSEWHERE[name]
        value = getattr(importlib.import_module(module), attribute)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """The package's module type: importing the submodule `build` (or `explain`) sets the
    package's attribute of that name to the submodule, which would hide the function of the
    same name; that assignment is dropped, and the name resolves to the function (`__getattr__`)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _LAZY and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
