"""The analytic cost model (docs/cost-model.md).

  analysis.py   what a lowered kernel does: loops, extents, affine accesses, FLOPs, kind
  warp.py       one warp access: global sectors / lines, shared-memory wavefronts and bank conflicts
  traffic.py    memory traffic of the one-thread-per-output mappings
  occupancy.py  blocks per SM and what limits them (cuda_occupancy.h's formula)
  model.py      Workload -> Cost: every term, constraints with their reasons
"""

from .analysis import KernelInfo, analyze_kernel
from .model import Cost, CostParameters, Workload, predict
from .occupancy import Occupancy, occupancy

__all__ = ["Cost", "CostParameters", "KernelInfo", "Occupancy", "Workload", "analyze_kernel", "occupancy", "predict"]
