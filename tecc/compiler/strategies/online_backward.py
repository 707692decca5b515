"""online_backward: the backward of an online contraction (attention's gradient as tc.grad writes
it, docs/training.md) as the tensor-core kernels of tecc.passes.rewrite.online_backward_mma.

Like online_contraction this rewrites the whole program, so it is a build candidate proposed over
the program (`propose`), asked after the forward rewrites. Its three parts:

* guard: `backward_chain` (the structure: P = exp(s - L) recomputed, every output a key-side,
  row-side or tile contraction of the tile's weights; never a name), 16-bit operands with head
  dims of 16..128, an sm_80 or newer target;
* space: `backward_tilings` (blocks of BN keys, query blocks of BM rows, dQ's units of 16 rows x
  NQ columns), the block's shared memory within the target's opt-in limit;
* workload: `backward_workload`, what a tiling makes the GPU do (tensor FLOPs of the contractions
  and the mma per visited tile, the tiles the mask leaves, the float32 atomics of dQ, the bytes
  staged, the exp2 per element, the registers its fragments take), priced by the cost model
  (`predict`); the points are taken in that order and the first that ptxas compiles for the
  target without spills is the plan (NVRTC, no GPU; the compile cache serves the build).

Unfused, the same program is 6 or 7 kernels that write three (rows x keys) float32 stages (P,
dP, dS) and read them back: O(S²) bytes that no tile choice for them recovers, so the candidate
is not ranked against them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from ...codegen import default_arch, dynamic_shared_bytes
from ...ir import dtype as dt
from ...ir.errors import ScheduleError, TeccError
from ...ir.evaluate import evaluate_int
from ...ir.expr import Var, const_int, walk
from ...ir.target import Target
from ...ir.target import target as target_info
from ...ir.tensor import Tensor
from ...passes.manager import PassTiming
from ...passes.rewrite.key_tiles import kept_conditions, query_block_start
from ...passes.rewrite.online_backward import BackwardChain, backward_chain
from ..cost.model import Cost, Workload, predict
from ..pipeline import compile_module, schedule_module, wgmma_serialized
from ..plan import Plan, Step

MMA_MIN_ARCH = 80          # mma.sync.m16n8k16, ldmatrix, cp.async
WGMMA_ARCH = 90            # wgmma: sm_90a only
NOMINAL_LENGTH = 8192      # a symbolic extent is costed at this length
ELEMENT_OPS = 24           # instructions per tile element: exp2, the weights, the guards, the casts


@dataclass
class BackwardChoice:
    plan: Plan
    reason: str
    cost: Cost


def _arch_number(arch: str) -> int:
    digits = "".join(ch for ch in arch[3:] if ch.isdigit()) if arch.startswith("sm_") else ""
    return int(digits) if digits else 0


def backward_tilings(widest: int, wgmma: bool = False) -> tuple[dict[str, Any], ...]:
    """The points for head dims up to `widest`: the key-block-major kernel's blocks of 64 or 128
    keys (4 or 8 warps of 16 keys) and query blocks of 16..64 rows (at d = 128 the key-side
    accumulators take d floats per lane, so the query blocks are small), each with dQ by float32
    atomics in units of 16 rows x 32 columns, or by the query-major kernel (64 rows over key
    blocks of 64). `wgmma` (sm_90) adds the Hopper forms (online_backward_wgmma: a warpgroup per
    64 keys, and per 64 query rows in the query-major kernel): 128 x 64 with either dQ form, and
    128 x 32 with the query-major dQ (128 rows over 64-key blocks; at d = 128 the atomics' m64 dQ
    tile does not fit beside the accumulators)."""
    if widest > 64:
        tiles = ((128, 32), (64, 32), (64, 16), (128, 16))
    else:
        tiles = ((128, 64), (128, 32), (64, 64), (64, 32))
    points: list[dict[str, Any]] = []
    kernel_dq = {"dq": "kernel", "dq_rows": 64, "dq_key_tile": 64}
    if wgmma:   # the query-major kernel on wgmma: two warpgroups of 64 rows over 64-key blocks
        wide = {"dq": "kernel", "dq_rows": 128, "dq_key_tile": 64}
        points.append({"key_tile": 128, "rows": 64, "dq_columns": 32, "wgmma": True})
        points.append({"key_tile": 128, "rows": 64, **wide, "wgmma": True})
        points.append({"key_tile": 128, "rows": 32, **wide, "wgmma": True})
    for bn, bm in tiles:
        points.append({"key_tile": bn, "rows": bm, "dq_columns": 32})
        points.append({"key_tile": bn, "rows": bm, **kernel_dq})
    return tuple(points)


def _sizes(chain: BackwardChain) -> dict[Var, int]:
    sizes = [*chain.rows, chain.keys, *chain.lead_extents]
    return {v: NOMINAL_LENGTH for e in sizes for v in walk(e) if isinstance(v, Var) and v.kind == "size"}


def visited_fraction(chain: BackwardChain, key_tile: int, rows: int) -> float:
    """The mean share of query blocks a key block visits (the isl-proven first query block of
    each key block, query_block_start; 1 without a bound)."""
    kb = Var("key_block", dt.int32)
    found = query_block_start(kept_conditions(chain.score), chain.query, chain.key, kb, key_tile, rows,
                              chain.rows[-1], chain.keys)
    if found is None:
        return 1.0
    env = _sizes(chain)
    try:
        queries = evaluate_int(chain.rows[-1], env)
        keys = evaluate_int(chain.keys, env)
        blocks = -(-queries // rows)
        starts = [min(evaluate_int(found[0], {**env, kb: b}), blocks) for b in range(-(-keys // key_tile))]
    except TeccError:
        return 1.0
    return sum(blocks - s for s in starts) / max(len(starts) * blocks, 1)


def _extents(chain: BackwardChain) -> tuple[int, int, int, int]:
    """(queries, keys, K/V heads, query heads per K/V head) at the program's sizes (NOMINAL_LENGTH
    for a symbolic one)."""
    env = _sizes(chain)
    heads = 1
    for e in chain.lead_extents:
        heads *= evaluate_int(e, env)
    groups = 1
    for g in chain.group_extents:
        groups *= g
    return evaluate_int(chain.rows[-1], env), evaluate_int(chain.keys, env), heads, groups


def backward_workload(chain: BackwardChain, point: dict[str, Any], target: Target,
                      registers: dict[str, int] | None = None) -> Workload:
    """What the point's kernels make the GPU do (module docstring): the key-block-major kernel,
    then (dq "kernel") the query-major one as the Workload's `then`; `registers` per thread of
    each ("main", "rows") from ptxas when known, else the fragments' count plus addressing."""
    BN, BM = point["key_tile"], point["rows"]
    atomic = point.get("dq", "atomic") == "atomic"
    queries, keys, heads, groups = _extents(chain)
    depth = sum(c.depth for c in chain.contractions)
    key_cols = sum(o.columns for o in chain.of_kind("key"))
    row_cols = sum(o.columns for o in chain.of_kind("row"))
    peak = target.tensor_flops.get(chain.contractions[0].row_operand.dtype.name, 0.0)
    # mma.sync reaches ~0.9 of the dense peak before sm_90 and ~0.6 on it; wgmma ~0.8 (the GEMM
    # strategies' MMA_SYNC_FRACTION and WGMMA_FRACTION)
    rate = peak * (0.8 if point.get("wgmma") else 0.9 if target.sm < 90 else 0.6)
    sync_rate = peak * (0.9 if target.sm < 90 else 0.6)
    blocks = heads * -(-keys // BN)
    tiles = blocks * groups * -(-queries // BM) * visited_fraction(chain, BN, BM)
    side = row_cols if atomic else 0
    flops = 2.0 * BN * BM * (depth + key_cols + side) * tiles
    row_bytes = sum(2 * BM * (const_int(b.shape[-1]) or 0) for b in _row_widths(chain))
    NQ = int(point.get("dq_columns", 32))
    regs = (registers or {}).get("main") or (BM // 2 * len(chain.contractions) + BM // 4 * len(chain.of_kind("key"))
                                             + key_cols // 2 + (NQ // 2 if side else 0) + 48)
    atomics = tiles * BM * side
    elements = tiles * BN * BM
    then = None if atomic or not row_cols else _rows_workload(chain, point, target, rate if point.get("wgmma") else sync_rate,
                                                              registers)
    return Workload(
        blocks=blocks, threads=2 * BN, registers={"ptxas" if registers else "fragments": regs},
        # the key tiles once, the row tiles in a 2-stage ring, dS's [BN][BM] tile, lse and Δ per stage
        smem_bytes=2 * BN * depth + 2 * row_bytes + (2 * BN * BM if side else 0) + 16 * BM, smem_opt_in=True,
        flops=flops, tensor_flops=flops, tensor_rate=rate, special_ops=elements, fma_ops=elements * 6,
        # an atomic (red.global.add.f32: no reply) moves its 4 bytes to the L2 slice that adds it
        l2_bytes=tiles * (row_bytes + 8 * BM) + blocks * 2 * BN * depth + 4 * atomics,
        dram_bytes=float(heads * groups * queries * 2 * (depth + key_cols) + heads * keys * 4 * depth
                         + 8 * atomics / max(-(-keys // BN), 1)),
        instructions=elements / 32 * ELEMENT_OPS + atomics / 32 * 4 + flops / 4096 / 32,
        bytes_in_flight=16.0, ilp=4.0, then=then,
        notes=[f"{tiles:.0f} tiles of {BN} keys x {BM} queries visited, "
               + (f"{atomics:.3g} float32 atomics for the row-side outputs" if side else
                  "the row-side outputs by the query-major kernel")])


def _rows_workload(chain: BackwardChain, point: dict[str, Any], target: Target, rate: float,
                   registers: dict[str, int] | None) -> Workload:
    """The query-major kernel of the row-side outputs: the row-key contractions again and the
    row-side contraction per visited tile, in registers, stored once."""
    BM, BN = int(point["dq_rows"]), int(point["dq_key_tile"])
    queries, keys, heads, groups = _extents(chain)
    depth = sum(c.depth for c in chain.contractions)
    row_cols = sum(o.columns for o in chain.of_kind("row"))
    blocks = heads * groups * -(-queries // BM)
    tiles = blocks * -(-keys // BN) * visited_fraction(chain, BN, BM)
    flops = 2.0 * BM * BN * (depth + row_cols) * tiles
    elements = tiles * BN * BM
    regs = (registers or {}).get("rows") or (BN // 2 * len(chain.contractions) + BN // 4 + row_cols // 2 + 48)
    return Workload(
        blocks=blocks, threads=2 * BM, registers={"ptxas" if registers else "fragments": regs},
        smem_bytes=2 * BM * depth + 2 * 2 * BN * depth + 8 * BM, smem_opt_in=True,
        flops=flops, tensor_flops=flops, tensor_rate=rate, special_ops=elements, fma_ops=elements * 6,
        l2_bytes=tiles * 2 * BN * depth + blocks * 2 * BM * (depth + row_cols),
        dram_bytes=float(heads * keys * 2 * depth + heads * groups * queries * 2 * (depth + row_cols)),
        instructions=elements / 32 * ELEMENT_OPS + flops / 4096 / 32, bytes_in_flight=16.0, ilp=4.0,
        notes=[f"the query-major kernel: {tiles:.0f} tiles of {BM} queries x {BN} keys"])


def _row_widths(chain: BackwardChain) -> list[Any]:
    """The distinct row operands' reads (one staged tile each per query block)."""
    seen: dict[int, Any] = {}
    for c in chain.contractions:
        seen.setdefault(id(c.row_operand.tensor), c.row_operand.tensor)
    for o in chain.of_kind("key"):
        if o.operand is not None:
            seen.setdefault(id(o.operand.tensor), o.operand.tensor)
    return list(seen.values())


def _compiled_registers(tensors: Sequence[Tensor], args: dict[str, Any], arch: str, name: str | None
                        ) -> tuple[dict[str, int], int] | str:
    """(registers of the main and query-major kernels, spilled bytes of any kernel) as the build
    compiles them, or why not."""
    plan = Plan((Step("online_backward_mma", args),), "online_backward_mma", "")
    timing = PassTiming()
    try:
        module = schedule_module(list(tensors), plan, name=name, dumper=None, timing=timing)
        kernel = compile_module(module, plan, "cuda", arch=arch, options=(), dumper=None, timing=timing)
    except TeccError as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    if len(kernel.resources) != len(kernel.module.kernels):
        return f"ptxas reported {len(kernel.resources)} kernels (log: {kernel.compile_log.strip()[:200]!r})"
    serialized = wgmma_serialized(kernel.compile_log)
    if serialized is not None:
        return f"ptxas serializes the wgmmas ({serialized[:120]})"
    limit = target_info(arch).smem_per_block_optin
    widest = max(dynamic_shared_bytes(k) + kernel.resources[k.name].shared_bytes for k in kernel.module.kernels)
    if widest > limit:
        return f"{widest // 1024} KiB of shared memory per block, {arch} allows {limit // 1024} KiB"
    regs = {("main" if n.endswith("_backward_mma_kernel") else "rows"): r.registers
            for n, r in kernel.resources.items() if n.endswith(("_backward_mma_kernel", "_backward_rows_kernel"))}
    return regs, sum(r.spill_stores + r.spill_loads for r in kernel.resources.values())


def _label(point: dict[str, Any]) -> str:
    dq = (f"dQ by a query-major kernel {point['dq_rows']}x{point['dq_key_tile']}" if point.get("dq") == "kernel"
          else f"dQ by atomics ({point['dq_columns']} columns per unit)")
    return f"{'wgmma ' if point.get('wgmma') else ''}{point['key_tile']}x{point['rows']}, {dq}"


NEAR = 1.05   # points predicted within 5% of the best are ordered by their tensor term


def _ranked(points: list[dict[str, Any]], workloads: list[Workload], target: Target) -> list[dict[str, Any]]:
    """The points by predicted time, except that those within NEAR of the best come first in the
    order of their tensor time (the tensor term plus the second kernel's): the time of every
    point here is bound by the same L2 stream of row tiles (re-read by every key block, the same
    bytes for every tile shape), which the model prices but no measurement has calibrated for
    this kernel yet, while the tensor term is where the instruction forms (mma.sync, wgmma) and
    the dQ forms really differ."""
    costs = [predict(w, target) for w in workloads]
    best = min((c.total for c in costs), default=math.inf)

    def tensor(i: int) -> float:
        then = workloads[i].then
        return costs[i].terms.get("tensor", 0.0) + (predict(then, target).terms.get("tensor", 0.0) if then else 0.0)
    near = sorted((i for i, c in enumerate(costs) if c.total <= NEAR * best), key=tensor)
    rest = sorted((i for i, c in enumerate(costs) if c.total > NEAR * best), key=lambda i: costs[i].total)
    return [points[i] for i in near + rest]


def propose(tensors: Sequence[Tensor], target: Any = None, name: str | None = None) -> BackwardChoice | None:
    """The tensor-core plan of the backward program `tensors`, or None when it is not one (or no
    point compiles without spills)."""
    try:
        chain = backward_chain(tensors)
    except ScheduleError:
        return None
    arch = target if isinstance(target, str) and target.startswith("sm_") else default_arch()
    if _arch_number(arch) < MMA_MIN_ARCH:
        return None
    info = target_info(arch)
    widest = max([c.depth for c in chain.contractions] + [o.columns for o in chain.outputs])
    points = list(backward_tilings(widest, wgmma=_arch_number(arch) == WGMMA_ARCH))
    if not chain.of_kind("row"):
        points = [p for p in points if p.get("dq", "atomic") == "atomic"]
    ranked = _ranked(points, [backward_workload(chain, p, info) for p in points], info)
    passed: list[str] = []
    for point in ranked:
        found = _compiled_registers(tensors, point, arch, name)
        if isinstance(found, str):
            passed.append(f"{_label(point)}: {found}")
            continue
        registers, spilled = found
        if spilled:
            passed.append(f"{_label(point)}: {registers} registers, spills")
            continue
        cost = predict(backward_workload(chain, point, info, registers), info)
        other = [predict(backward_workload(chain, p, info), info).total for p in points
                 if p.get("dq", "atomic") != point.get("dq", "atomic") and p["key_tile"] == point["key_tile"]
                 and p["rows"] == point["rows"] and p.get("wgmma") == point.get("wgmma")]
        return BackwardChoice(_plan(chain, point, arch, registers, cost, passed, other), "", cost)
    return None


def _plan(chain: BackwardChain, point: dict[str, Any], arch: str, registers: dict[str, int], cost: Cost,
          passed: list[str], other: list[float]) -> Plan:
    outs = ", ".join(f"{o.tensor.name} ({o.kind} side)" for o in chain.outputs)
    skipped = visited_fraction(chain, point["key_tile"], point["rows"])
    atomic = point.get("dq", "atomic") == "atomic"
    dq = ("the row-side ones by float32 atomics, then their conversion" if atomic else
          f"the row-side ones by a query-major kernel of {point['dq_rows']} rows over key blocks of {point['dq_key_tile']}")
    vs = (f"; the other dQ form predicted {min(other) * 1e6:.0f} us" if other else "")
    regs = ", ".join(f"{k} {v}" for k, v in sorted(registers.items()))
    form = "wgmma (a warpgroup per 64 keys)" if point.get("wgmma") else "mma.sync"
    reason = (f"the backward of an online contraction ({outs}) on tensor cores ({form}): a pre-pass for the row statistics "
              f"({', '.join(t.name for t in chain.statistics) or 'none'}), blocks of {point['key_tile']} keys walking "
              f"query blocks of {point['rows']} rows with the key-side outputs in registers, {dq}; no (rows x keys) "
              f"buffer; {skipped:.0%} of the query blocks visited ({arch}: registers {regs}, no spills; predicted "
              f"{cost.total * 1e6:.0f} us, {cost.bound}-bound{vs})")
    if passed:
        reason += f" (passed over: {'; '.join(passed)})"
    return Plan((Step("online_backward_mma", dict(point)),), "online_backward_mma", reason)


__all__ = ["BackwardChoice", "backward_tilings", "backward_workload", "propose", "visited_fraction"]
