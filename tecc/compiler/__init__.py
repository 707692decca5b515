"""tecc.compiler: the build driver, plans, checking, and (later) strategies, cost model, planner and tuner."""

from ..runtime.artifact import load
from ..runtime.cuda import cuda_available as gpu_available
from .build import build, default_plan
from .check import OpSpec
from .kernel import Kernel
from .plan import Plan, Step
from .profiling import profile
from .schedule import LoopRV, Schedule, StageRV

__all__ = ["build", "default_plan", "gpu_available", "load", "Kernel", "OpSpec", "Plan", "Step", "Schedule", "LoopRV", "StageRV", "profile"]
