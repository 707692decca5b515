"""Schedule strategies: the registry (registry.py) and one file per strategy.

  naive        naive.py        the default schedule: one thread per output element (always valid)
  elementwise  elementwise.py  coalesced, vectorized, blocked or grid-stride
  reduction    reduction.py    row (shared-memory staged), column / generic (one thread per output)
  gemm         gemm.py         contraction: block tile, thread tile, k-tile, shared staging, unroll
  transpose_tile transpose_tile.py  permutations of axes (transposes): the input tile in padded or swizzled
                                    shared memory (its geometry: transpose_geometry.py)
"""

from .registry import Point, Strategy, get, load_all, register, strategies

__all__ = ["Point", "Strategy", "get", "load_all", "register", "strategies"]
