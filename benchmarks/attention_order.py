"""The launch order of the tensor-core attention, by tile counts (no GPU needed; issue 15).

    python benchmarks/attention_order.py [--sms 132] [--overhead 2] [--gqa] [--dims 64 128]

For each shape of benchmarks/attention.py (causal and not), builds the planned kernel for sm_90
(`plan_strategy(args, "online_contraction_wgmma")`), reads from its IR the key tiles of every block (the key loop's bound, evaluated
at the block's query block) and the order the blocks launch in (the lets of `_Kernel.grid`), and
schedules them greedily, in launch order, on `--sms` SMs with one block each (the planned
tilings hold one block per SM: 128-256 registers x 256 threads), each block costing its tiles
plus `--overhead` tiles (the Q load and the epilogue). It prints the predicted causal time as a
fraction of the non-causal one for the plain grid (query blocks in order, heads after) and for
the kernel's order, and the ratio of the work (tiles plus overheads). A model of the tail only: it ignores L2 and
the per-tile cost of the diagonal tiles' guard.
"""

from __future__ import annotations

import argparse
import heapq
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def makespan(costs: list[float], sms: int) -> float:
    free = [0.0] * sms
    for c in costs:
        heapq.heappush(free, heapq.heappop(free) + c)
    return max(free)


def block_costs(s: int, d: int, causal: bool, groups: int, overhead: float) -> tuple[list[float], list[float], str]:
    """(costs in the kernel's launch order, costs in the plain grid's order, tiling)."""
    from benchmarks.attention import attention_tensors
    from tecc.compiler.pipeline import refuse_spills
    from tecc.compiler.planner import plan_strategy
    from tecc.ir.evaluate import evaluate_int
    from tecc.ir.stmt import For, LetStmt, iter_stmts, launch_dims
    from tecc.passes.rewrite.online_contraction_mma import online_contraction_mma

    b, h = max(1, 16384 // s), (2048 // d if groups == 1 else 32)
    args = attention_tensors(b, h, s, d, "float16", causal, groups)
    choice = plan_strategy(args, "online_contraction_wgmma", "sm_90", compile_check=refuse_spills)
    assert choice is not None, "no wgmma plan"
    step = choice.plan.steps[0].args
    (kernel,) = online_contraction_mma(args, **step).kernels
    X, Y = (evaluate_int(g, {}) for g in launch_dims(kernel).grid[:2])
    loop = next(st for st in iter_stmts(kernel.body) if isinstance(st, For) and st.var.name.startswith("key_tile"))
    lets = {st.var.name.rstrip("0123456789_"): st for st in iter_stmts(kernel.body) if isinstance(st, LetStmt)}
    blocks = {st.kind: st.var for st in iter_stmts(kernel.body) if isinstance(st, For) and st.is_block}
    qvar = lets["query_block"].var if "query_block" in lets else blocks["blockIdx.x"]
    tiles = [evaluate_int(loop.extent, {qvar: q}) for q in range(X)]
    plain = [tiles[q] + overhead for _ in range(Y) for q in range(X)]
    if "query_block" not in lets:
        return plain, plain, f"{step['rows_per_block']}x{step['key_tile']}"
    order = []
    for y in range(Y):
        for x in range(X):
            at = {blocks["blockIdx.x"]: x, blocks["blockIdx.y"]: y}
            order.append(tiles[evaluate_int(lets["query_block"].value, at)] + overhead)
    return order, plain, f"{step['rows_per_block']}x{step['key_tile']}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--overhead", type=float, default=2.0, help="per-block cost beyond its key tiles, in tiles")
    ap.add_argument("--gqa", action="store_true", help="32 query heads over 8 K/V heads, d = 128, S in {1k, 4k, 8k}")
    ap.add_argument("--dims", type=int, nargs="+", default=(64, 128))
    opts = ap.parse_args()
    seqs, dims, groups = (1024, 2048, 4096, 8192, 16384), tuple(opts.dims), 1
    if opts.gqa:
        seqs, dims, groups = (1024, 4096, 8192), (128,), 4
    print(f"{'S':>6} {'d':>4} {'tiling':>7} {'blocks':>7}  causal / non-causal time: {'plain grid':>10} {'kernel':>7} "
          f"{'work':>6}")
    for d in dims:
        for s in seqs:
            full, _, _ = block_costs(s, d, False, groups, opts.overhead)
            order, plain, tiling = block_costs(s, d, True, groups, opts.overhead)
            base = makespan(full, opts.sms)
            print(f"{s:6d} {d:4d} {tiling:>7} {len(order):7d}  {'':26}{makespan(plain, opts.sms) / base:10.3f} "
                  f"{makespan(order, opts.sms) / base:7.3f} {sum(order) / sum(full):6.3f}", flush=True)


if __name__ == "__main__":
    main()
