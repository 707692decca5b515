"""online_contraction: a contraction over the axis of a (max, Σ exp) row statistic as ONE kernel
(tecc.passes.rewrite.online_contraction): attention, masked or biased, with grouped heads, or a
softmax followed by a contraction.

Like row_fused this rewrites the whole program, so it is proposed over the program (`propose`);
build(plan="auto") asks it before the row-group rewrites. It is guarded by the recognizer alone
(`online_chain`: the algebraic precondition, never an op's name), because unfused the chain is
four kernels that write the rows × keys score matrix and read it back three times: O(S²) bytes
of temporaries and traffic against none, which no choice of tiles for the unfused kernels
recovers. The point:

* THREADS = 32 lanes per row (one warp): the key tile is 32 keys, each lane computes one score
  of the tile; the lane's output columns are c = k·32 + lane, K = ceil(C / 32) registers
  (C = 64..256: 2..8 registers per lane for the partial output);
* ROWS_PER_BLOCK = 4: 128 threads per block, a 4 × 32 tile of scores in shared memory.

No cost-model prediction ranks it against the unfused kernels yet: the SIMT kernel re-reads K
and V per query row (from L2), which the tensor-core form with K/V tiles staged in shared memory
per head will remove (docs/attention.md, what is left).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from ...ir.errors import ScheduleError
from ...ir.expr import const_int
from ...ir.tensor import Tensor
from ...passes.rewrite.online_contraction import online_chain
from ..plan import Plan, Step

THREADS = 32
ROWS_PER_BLOCK = 4


@dataclass
class OnlineContractionChoice:
    plan: Plan
    threads: int
    rows_per_block: int
    reason: str


def propose(tensors: Sequence[Tensor], target: Any = None) -> OnlineContractionChoice | None:
    """The one-kernel plan for the chain `tensors`, or None when the program is not one (the
    recognizer's reason is then the next candidate's business)."""
    try:
        chain = online_chain(tensors)
    except ScheduleError:
        return None
    if const_int(chain.columns) is None:
        return None  # the partial output lives in registers: a constant column extent is needed
    reason = (f"{chain.output.name}: a contraction over the axis of the row statistics {chain.m.name} (max) and "
              f"{chain.l.name} (sum of exp) in one pass with a running max, no score temporary of "
              f"[{', '.join(map(str, chain.rows))}] x {chain.keys}; {ROWS_PER_BLOCK} rows per block, {THREADS} lanes per row, key tiles of {THREADS}")
    plan = Plan((Step("online_contraction", {"threads": THREADS, "rows_per_block": ROWS_PER_BLOCK}),),
                "online_contraction", reason)
    return OnlineContractionChoice(plan, THREADS, ROWS_PER_BLOCK, reason)


__all__ = ["OnlineContractionChoice", "propose"]
