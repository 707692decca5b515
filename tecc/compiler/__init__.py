"""tecc.compiler: the build driver, schedules and plans, strategies, cost model, planner, checking,
compile cache, tuning database and profiling."""

from ..runtime.artifact import load
from ..runtime.cuda import cuda_available as gpu_available
from .build import build
from .pipeline import default_plan
from .check import OpSpec
from .explain import explain
from .kernel import Kernel
from .plan import Plan, Step
from .planner import plan_program
from .profiling import profile
from .schedule import LoopRV, Schedule, StageRV

__all__ = [
    "build", "default_plan", "explain", "gpu_available", "load", "plan_program", "profile",
    "Kernel", "LoopRV", "OpSpec", "Plan", "Schedule", "StageRV", "Step",
]
