"""Schedule strategies: the registry (registry.py) and one file per strategy.

  naive        naive.py        the default schedule: one thread per output element (always valid)
  elementwise  elementwise.py  coalesced, vectorized, blocked or grid-stride
  reduction    reduction.py    row (shared-memory staged), column / generic (one thread per output)
  gemm         gemm.py         contraction: block tile, thread tile, k-tile, shared staging, unroll
  transpose_tile transpose_tile.py  permutations of axes (transposes): the input tile in padded or swizzled
                                    shared memory (its geometry: transpose_geometry.py)
  ...

Graph-level strategies (registry.GraphStrategy: a rewrite of the program's stages, priced by the
planner against the per-kernel plans of the stages it replaces):

  online_contraction_mma  online_contraction.py  attention / softmax then a contraction on tensor
                                                 cores (wgmma on sm_90, mma.sync from sm_80)
  online_contraction      online_contraction.py  the same chain on the SIMT lanes
  online_backward_mma     online_backward.py     its backward (tc.grad's FlashAttention-2 form) as
                                                 three tensor-core kernels
  split_rows              split_rows.py          few long rows / a full reduction over many blocks
  split_row_group         split_row_group.py     softmax / norms over few long rows in two kernels
  row_fused               row_fused.py           a row group (reduce -> elementwise, row values,
                                                 column reductions) as one kernel (+ a combine)
  column_reduction        column_reduction.py    a column / middle-axis reduction, split

A program with a scatter (tc.scatter_add) is planned per kernel unless the build is deterministic
(planner.graph_candidates_for says why).
"""

from .registry import GraphStrategy, Point, Strategy, get, graph_strategies, load_all, register, strategies

__all__ = ["GraphStrategy", "Point", "Strategy", "get", "graph_strategies", "load_all", "register", "strategies"]
