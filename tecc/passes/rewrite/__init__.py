"""Graph-level rewrites: a tensor-expression DAG (after lowering's inlining) becomes kernels that
no sequence of loop-level schedule primitives (tecc/passes/schedule/) can reach from the one-
kernel-per-stage lowering, because they change which stages share a kernel or how a reduction's
partial results combine. Each applies where an algebraic precondition holds on the DAG, never
because of an op's name; each refuses with a ScheduleError that says which condition fails.
Whether one is worth applying is the planner's decision (tecc/compiler/strategies/).

  fuse_rows        fuse_rows.py        every stage of a *row group* (row_group.py) in one kernel, one block per
                                       row: reductions over one axis of one extent C, elementwise outputs
                                       of shape rows + (C,) or of the rows, which read the reductions only
                                       at their own row (the reduced axis is shared, nothing crosses rows);
                                       reductions over the rows of values of the row (dγ, dβ) summed per
                                       block of rows and folded by a second kernel (row_columns.py)
  split_rows       split_rows.py       one reduction whose combiner ⊕ is associative and commutative
                                       (+ * max min) over contiguous trailing axes, split into S chunks per
                                       row: the chunks' partials combine by ⊕ (a full reduction included)
  split_reduce     split_reduce.py     the same algebra over a non-contiguous axis (columns, a middle
                                       axis): partials per slice of the reduced axis, combined by ⊕
  split_row_group  split_row_group.py  a row group whose statistics have an associative combine of
                                       *partial statistics*: a single ⊕; (max, Σ exp(h - max)) rescaled
                                       to the larger max; (Σ h, Σ (h - μ)²) as moments merged by Chan's
                                       update. Partials per chunk, then a kernel that combines and writes
  online_contraction online_contraction.py  a contraction Σ_j exp(s - m)·v over the axis of a row statistic
                                       m = max_j s, l = Σ_j exp(s - m) (attention, masked / biased / grouped;
                                       softmax then a contraction): one kernel walking j in tiles with a
                                       running max; exp(s - m_new) = exp(s - m_old)·exp(m_old - m_new)
                                       rescales the sum and the partial output alike (docs/attention.md)
  online_contraction_mma online_contraction_mma.py  the same chain with float16/bfloat16 contractions as
                                       ONE tensor-core kernel (mma.sync, ldmatrix, a cp.async ring; P moved
                                       from C to A fragments in registers; key tiles a mask leaves -inf
                                       skipped by an isl-proved bound); wgmma=True: the Hopper form
                                       (wgmma for both contractions, P as the register A operand). Built in
                                       layers: online_mma_chain.py (when the chain fits), online_mma_operands.py
                                       (tiling, buffers, staging, the contractions), online_mma_scores.py (the
                                       masks and the guard), online_mma_softmax.py (running statistics,
                                       rescale, P's relayout), online_mma_epilogue.py, online_mma_split_kv.py,
                                       online_mma_loop.py (the K/V ring, peeled, overlapped, persistent loops)
  online_backward  online_backward.py  the backward of that chain (tc.grad's FlashAttention-2 form): a stage
                   online_backward_mma.py  P = exp(s - L) recomputed from a saved row statistic and outputs
                                       that contract the tile's weights over the queries (dK, dV), the keys
                                       (dQ) or neither (dBias), rows and keys found by unifying the score's
                                       contraction; three tensor-core kernels, no (rows x keys) buffer: a
                                       pre-pass, the key-block-major kernel (online_backward_key_major.py),
                                       dQ's conversion or its query-major kernel (online_backward_dq.py);
                                       their Hopper form on wgmma (online_backward_wgmma.py); shared parts
                                       in online_backward_kernels.py

Their shared parts:
  reduction_stage.py  the one reduction stage a split rewrite takes (one stage, one Reduce), lowered
                      (`LoweredReduction`: signature, inliner, `finish` around the combined total)
  key_tiles.py        which key tiles an attention mask keeps: loop bounds proved with isl (the tensor-
                      core online contraction skips fully masked tiles and unguards whole ones)
  online_stats.py     the two pairs of reductions that fold into one pass (running max and rescaled
                      sum; Welford / Chan moments): the algebra split_row_group and fuse_rows' long rows use
  row_chunks.py       the column walk of a row too long for registers (vector loads in flight, a tail)
  row_group.py        what a row group is (fuse_rows and split_row_group match with it)
  row_passes.py       a row group's passes over the row, its row values in registers and their
                      finish (fuse_rows and split_row_group build their kernels from them)
  row_columns.py      a row group's column reductions: sums over blocks of rows, the combine kernel
  last_block.py       the one-kernel combine of split partials (fence/atomic handshake), with the
                      combine forms both split rewrites offer
  mma_tiles.py        the tensor-core kernels' staging (cp.async tiles), fragments, the C-to-A identity
                      and exp2 with log2(e) folded in, shared by the forward and backward kernels
"""
