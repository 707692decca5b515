"""online_backward: the backward of an online contraction (attention's gradient as tc.grad writes
it, docs/training.md) as the tensor-core kernels of tecc.passes.rewrite.online_backward_mma.

Like online_contraction it rewrites the whole program: a graph-level strategy
(registry.GraphStrategy, `OnlineBackwardMma`) that the planner prices against the per-kernel plans
of the kernels it replaces and realizes when cheaper. Its declarations:

* guard: `backward_chain` (the structure: P = exp(s - L) recomputed, every output a key-side,
  row-side or tile contraction of the tile's weights; never a name), 16-bit operands with head
  dims of 16..128, an sm_80 or newer target;
* space: `backward_tilings` (blocks of BN keys, query blocks of BM rows, dQ's units of 16 rows x
  NQ columns, or the query-major dQ kernel; the wgmma forms on sm_90);
* workload: `backward_workload`, what a tiling makes the GPU do (tensor FLOPs of the contractions
  and the mma per visited tile, the tiles the mask leaves, the float32 atomics of dQ, the bytes
  staged, the exp2 per element, the registers its fragments take), priced by the cost model at
  the program's sizes (a symbolic extent without one at the per-kernel analysis' DEFAULT_SIZE, so
  that the rewrite and the per-kernel plans it replaces are weighed at the same extents);
* order: the tilings are tried as they were ranked before they were weighed (priced at
  NOMINAL_LENGTH for every symbolic extent, those within NEAR of the best by their tensor time);
* apply: the online_backward_mma step, refused when a kernel's shared memory exceeds the
  target's opt-in limit; the planner's compile check (NVRTC, no GPU; the compile cache serves
  the build) passes over a point that spills or whose wgmmas ptxas serializes, and the plan's
  reason gives ptxas's registers.

Unfused, the same program is 6 or 7 kernels that write three (rows x keys) float32 stages (P,
dP, dS) and read them back: O(S²) bytes that no tile choice for them recovers.
"""

from __future__ import annotations

from typing import Any, Mapping

from ...codegen import KernelResources, dynamic_shared_bytes
from ...ir import dtype as dt
from ...ir.errors import ScheduleError, TeccError
from ...ir.evaluate import evaluate_int
from ...ir.expr import Var, const_int, walk
from ...ir.target import Target
from ...passes.rewrite.key_tiles import kept_conditions, query_block_start
from ...passes.rewrite.online_backward import BackwardChain, backward_chain
from ..cost.analysis import DEFAULT_SIZE
from ..cost.model import Cost, Workload, predict
from ..program import Program
from .registry import GraphStrategy, Point, register

MMA_MIN_ARCH = 80          # mma.sync.m16n8k16, ldmatrix, cp.async
WGMMA_ARCH = 90            # wgmma: sm_90a only
NOMINAL_LENGTH = 8192      # a symbolic extent is ranked at this length (`order`)
ELEMENT_OPS = 24           # instructions per tile element: exp2, the weights, the guards, the casts


def backward_tilings(widest: int, wgmma: bool = False) -> tuple[dict[str, Any], ...]:
    """The points for head dims up to `widest`: the key-block-major kernel's blocks of 64 or 128
    keys (4 or 8 warps of 16 keys) and query blocks of 16..64 rows (at d = 128 the key-side
    accumulators take d floats per lane, so the query blocks are small), each with dQ by float32
    atomics in units of 16 rows x 32 columns, or by the query-major kernel (64 rows over key
    blocks of 64). `wgmma` (sm_90) adds the Hopper forms (online_backward_wgmma: a warpgroup per
    64 keys, and per 64 query rows in the query-major kernel): 128 x 64 with either dQ form, and
    128 x 32 with the query-major dQ (128 rows over 64-key blocks; at d = 128 the atomics' m64 dQ
    tile does not fit beside the accumulators); at d <= 64 also one warpgroup per block in both
    kernels (64 x 64 with the query-major dQ of 64 rows over 64-key blocks, its query blocks in a
    ring of 3 stages or 2) and 128 x 64 with that dQ kernel."""
    if widest > 64:
        tiles = ((128, 32), (64, 32), (64, 16), (128, 16))
    else:
        tiles = ((128, 64), (128, 32), (64, 64), (64, 32))
    points: list[dict[str, Any]] = []
    kernel_dq = {"dq": "kernel", "dq_rows": 64, "dq_key_tile": 64}
    if wgmma:   # the query-major kernel on wgmma: two warpgroups of 64 rows over 64-key blocks
        wide = {"dq": "kernel", "dq_rows": 128, "dq_key_tile": 64}
        if widest <= 64:   # one warpgroup per block in both kernels
            points.extend(dict(p) for p in SM90_MEASURED_FIRST)
        else:   # one warpgroup per block of the key-major kernel, two of dQ's
            points.extend(dict(p) for p in SM90_WIDE_MEASURED_FIRST)
        points.append({"key_tile": 128, "rows": 64, "dq_columns": 32, "wgmma": True})
        points.append({"key_tile": 128, "rows": 64, **wide, "wgmma": True})
        points.append({"key_tile": 128, "rows": 32, **wide, "wgmma": True})
    for bn, bm in tiles:
        points.append({"key_tile": bn, "rows": bm, "dq_columns": 32})
        points.append({"key_tile": bn, "rows": bm, **kernel_dq})
    # each point, then the same with one guarded copy of the elementwise stage: predicted alike,
    # so the compile check tries the twin next when the unguarded copy for whole tiles spills
    return tuple(q for p in points for q in (p, {**p, "whole_tiles": False}))


def _size_vars(chain: BackwardChain) -> list[Var]:
    extents = [*chain.rows, chain.keys, *chain.lead_extents]
    return [v for e in extents for v in walk(e) if isinstance(v, Var) and v.kind == "size"]


def _sizes(chain: BackwardChain, sizes: Mapping[str, int] | None = None) -> dict[Var, int]:
    """The chain's symbolic sizes at `sizes` (by name), NOMINAL_LENGTH for those it lacks."""
    given = sizes or {}
    return {v: int(given.get(v.name, NOMINAL_LENGTH)) for v in _size_vars(chain)}


def visited_fraction(chain: BackwardChain, key_tile: int, rows: int, sizes: Mapping[str, int] | None = None) -> float:
    """The mean share of query blocks a key block visits (the isl-proven first query block of
    each key block, query_block_start; 1 without a bound), at `sizes` (`_sizes`)."""
    kb = Var("key_block", dt.int32)
    found = query_block_start(kept_conditions(chain.score), chain.query, chain.key, kb, key_tile, rows,
                              chain.rows[-1], chain.keys)
    if found is None:
        return 1.0
    env = _sizes(chain, sizes)
    try:
        queries = evaluate_int(chain.rows[-1], env)
        keys = evaluate_int(chain.keys, env)
        blocks = -(-queries // rows)
        starts = [min(evaluate_int(found[0], {**env, kb: b}), blocks) for b in range(-(-keys // key_tile))]
    except TeccError:
        return 1.0
    return sum(blocks - s for s in starts) / max(len(starts) * blocks, 1)


def _extents(chain: BackwardChain, sizes: Mapping[str, int] | None = None) -> tuple[int, int, int, int]:
    """(queries, keys, K/V heads, query heads per K/V head) at `sizes` (`_sizes`: NOMINAL_LENGTH
    for a symbolic one without a size)."""
    env = _sizes(chain, sizes)
    heads = 1
    for e in chain.lead_extents:
        heads *= evaluate_int(e, env)
    groups = 1
    for g in chain.group_extents:
        groups *= g
    return evaluate_int(chain.rows[-1], env), evaluate_int(chain.keys, env), heads, groups


def backward_workload(chain: BackwardChain, point: dict[str, Any], target: Target,
                      registers: dict[str, int] | None = None, sizes: Mapping[str, int] | None = None) -> Workload:
    """What the point's kernels make the GPU do (module docstring): the key-block-major kernel,
    then (dq "kernel") the query-major one as the Workload's `then`; `registers` per thread of
    each ("main", "rows") from ptxas when known, else the fragments' count plus addressing;
    symbolic extents at `sizes` (`_sizes`)."""
    BN, BM = point["key_tile"], point["rows"]
    atomic = point.get("dq", "atomic") == "atomic"
    queries, keys, heads, groups = _extents(chain, sizes)
    depth = sum(c.depth for c in chain.contractions)
    key_cols = sum(o.columns for o in chain.of_kind("key"))
    row_cols = sum(o.columns for o in chain.of_kind("row"))
    peak = target.tensor_flops.get(chain.contractions[0].row_operand.dtype.name, 0.0)
    # mma.sync reaches ~0.9 of the dense peak before sm_90 and ~0.6 on it; wgmma ~0.8 (the GEMM
    # strategies' MMA_SYNC_FRACTION and WGMMA_FRACTION)
    rate = peak * (0.8 if point.get("wgmma") else 0.9 if target.sm < 90 else 0.6)
    sync_rate = peak * (0.9 if target.sm < 90 else 0.6)
    blocks = heads * -(-keys // BN)
    tiles = blocks * groups * -(-queries // BM) * visited_fraction(chain, BN, BM, sizes)
    side = row_cols if atomic else 0
    flops = 2.0 * BN * BM * (depth + key_cols + side) * tiles
    row_bytes = sum(2 * BM * (const_int(b.shape[-1]) or 0) for b in _row_widths(chain))
    NQ = int(point.get("dq_columns", 32))
    stages = int(point.get("stages", 2))
    # the fragments, plus addressing: 48 on mma.sync, 24 on wgmma (whose descriptors are uniform
    # registers; 64 x 64 at d = 128: 224 fragment registers, 236 from ptxas)
    regs = (registers or {}).get("main") or (BM // 2 * len(chain.contractions) + BM // 4 * len(chain.of_kind("key"))
                                             + key_cols // 2 + (NQ // 2 if side else 0)
                                             + (24 if point.get("wgmma") else 48))
    atomics = tiles * BM * side
    elements = tiles * BN * BM
    then = None if atomic or not row_cols else _rows_workload(chain, point, target, rate if point.get("wgmma") else sync_rate,
                                                              registers, sizes)
    return Workload(
        blocks=blocks, threads=2 * BN, registers={"ptxas" if registers else "fragments": regs},
        # the key tiles once, the row tiles in a ring of `stages`, dS's [BN][BM] tile, lse and Δ per stage
        smem_bytes=2 * BN * depth + stages * row_bytes + (2 * BN * BM if side else 0) + 8 * stages * BM,
        smem_opt_in=True,
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
                   registers: dict[str, int] | None, sizes: Mapping[str, int] | None) -> Workload:
    """The query-major kernel of the row-side outputs: the row-key contractions again and the
    row-side contraction per visited tile, in registers, stored once."""
    BM, BN = int(point["dq_rows"]), int(point["dq_key_tile"])
    queries, keys, heads, groups = _extents(chain, sizes)
    depth = sum(c.depth for c in chain.contractions)
    row_cols = sum(o.columns for o in chain.of_kind("row"))
    blocks = heads * groups * -(-queries // BM)
    tiles = blocks * -(-keys // BN) * visited_fraction(chain, BN, BM, sizes)
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


def _label(point: dict[str, Any]) -> str:
    dq = (f"dQ by a query-major kernel {point['dq_rows']}x{point['dq_key_tile']}" if point.get("dq") == "kernel"
          else f"dQ by atomics ({point['dq_columns']} columns per unit)")
    guard = "" if point.get("whole_tiles", True) else ", every tile guarded"
    ring = f", {point['stages']}-stage ring of query blocks" if point.get("stages", 2) != 2 else ""
    return f"{'wgmma ' if point.get('wgmma') else ''}{point['key_tile']}x{point['rows']}, {dq}{ring}{guard}"


NEAR = 1.05   # points predicted within 5% of the best are ordered by their tensor term

# The sm_90 order (`order`): the wgmma forms first, the query-major dQ before atomics, then the
# model's tensor-time order. The model's own order (its bound, an L2 stream of row tiles no
# measurement has calibrated, then the tensor term) took dQ by atomics on wgmma at d = 64 and
# the mma.sync form at d = 128; per call on the H200 (fp16, B·S = 16384, H·d = 2048; GPT-2's
# shape in bf16), the pick against the wgmma form with the query-major dQ, in us:
MEASURED_ON_SM90 = {
    "S 1024 d 64": (2595.5, 2021.5), "S 1024 d 64 causal": (1952.7, 1572.5),
    "S 4096 d 64": (8192.0, 6808.0),
    "S 1024 d 128": (3732.9, 1936.5), "S 1024 d 128 causal": (2735.6, 1432.1),
    "GPT-2 causal (bf16)": (418.1, 346.8), "GPT-2 (bf16)": (522.8, 448.2),
}


# Then, at d <= 64, one warpgroup per block in both kernels (64 keys; dQ's 64 rows over 64-key
# blocks) with a 3-stage ring of query blocks, the same with 2 stages, then 128 keys with that dQ
# kernel, each before the two-warpgroup dQ kernel (128 rows) of the table above. GPT-2's shape in
# bf16 (B 8, H 12, S 1024, d 64), each kernel's time summed (CUPTI), us: causal 298.0 (128 x 64,
# dQ 128 x 64: its key-major kernel 199.2, dQ 83.3) -> 284.7 (128 x 64, dQ 64 x 64: 199.5, 69.4)
# -> 252.6 (64 x 64, dQ 64 x 64: 169.0, 67.9); not causal 385.4 -> 379.9 -> 380.8 (the key-major
# kernel 271-272 at either width, dQ 98.3 -> 93.0-93.4). A warpgroup's block of ~163 registers
# fits three to an SM where two warpgroups fit one; the causal key blocks of 64 also balance the
# triangle better. The key-major kernel's ring at 2 / 3 / 4 stages (another run): 172.7 / 161.0 /
# 194.2 causal, 273.1 / 267.4 / 322.0 not (the query-major kernel's, not a step argument, was
# slower at 3: 69.6 -> 72.5). Stop 35 (the kernels' instructions cut): 64 x 64 at 3 / 2 stages
# 99.1 + 62.7 / 97.8 + 61.9 us causal, 128 x 64 120.0 + 62.6, dQ over 128 rows 98.7 + 71.0.
SM90_MEASURED_FIRST = (
    {"key_tile": 64, "rows": 64, "dq": "kernel", "dq_rows": 64, "dq_key_tile": 64, "wgmma": True, "stages": 3},
    {"key_tile": 64, "rows": 64, "dq": "kernel", "dq_rows": 64, "dq_key_tile": 64, "wgmma": True},
    {"key_tile": 128, "rows": 64, "dq": "kernel", "dq_rows": 64, "dq_key_tile": 64, "wgmma": True},
)


# At d = 128 (stop 35, the kernels' index arithmetic, masked tiles and epilogue rewritten; fp16,
# `attention_backward.py --dims 128 --seqs 1024 4096 --variant ...`, us per call): 64 keys x 64
# rows in a 2-stage ring (two blocks per SM: a 3-stage ring of 128-wide rows leaves one) with dQ
# over 128 rows, against the earlier pick 128 x 32 (dQ 128 rows), 128 x 64 and 64 x 64 (3
# stages, dQ 64 rows): S 1k 1077.1 / 1208.9 / 1080.9 / 1178.6, causal 715.0 / 855.7 / 725.8 /
# 799.4; S 4k 3550.6 / 4093.4 / 3639.4 / 4050.5, causal 2048.9 / 2315.4 / 2021.2 / 2210.3;
# grouped (32 over 8 heads) S 8k 14071.5 / 17723.5 / 14905.6 / 17174.0. Then (another run, S 4k
# and 8k) dQ over 64 rows beat dQ over 128 at 7 of 8 shapes: S 8k 7063.9 -> 6774.4, causal
# 3806.7 -> 3554.2; grouped S 8k 14140.1 -> 14443.6 (the one slower), causal 7269.2 -> 6947.3.
SM90_WIDE_MEASURED_FIRST = (
    {"key_tile": 64, "rows": 64, "dq": "kernel", "dq_rows": 64, "dq_key_tile": 64, "wgmma": True, "stages": 2},
    {"key_tile": 64, "rows": 64, "dq": "kernel", "dq_rows": 128, "dq_key_tile": 64, "wgmma": True, "stages": 2},
    {"key_tile": 128, "rows": 64, "dq": "kernel", "dq_rows": 128, "dq_key_tile": 64, "wgmma": True},
)

# the measured orders in one (a point is in one of them: d <= 64 or d > 64)
SM90_PREFERRED = SM90_MEASURED_FIRST + SM90_WIDE_MEASURED_FIRST


def _sm90_preference(point: Point) -> tuple[int, int, int]:
    """(0 for wgmma, else 1; 0 for the query-major dQ, else 1; the point's place in
    SM90_PREFERRED (SM90_MEASURED_FIRST, or SM90_WIDE_MEASURED_FIRST at d > 64), after it those
    not in it): `order`'s
    first keys on sm_90."""
    bare = {k: v for k, v in point.items() if k != "whole_tiles"}
    measured = next((i for i, p in enumerate(SM90_PREFERRED) if p == bare), len(SM90_PREFERRED))
    return (0 if point.get("wgmma") else 1, 0 if point.get("dq") == "kernel" else 1, measured)


def _chain(program: Program) -> BackwardChain | str:
    """The program's backward chain, or why it is none (memoized per program)."""
    def recognize() -> BackwardChain | str:
        try:
            return backward_chain(program.args)
        except ScheduleError as exc:
            return str(exc).splitlines()[0]
    return program.memo("online_backward/chain", recognize)


def _priced_sizes(program: Program, chain: BackwardChain) -> dict[str, int]:
    """The sizes the points are priced at: the program's, and for a symbolic extent it does not
    size the per-kernel analysis' DEFAULT_SIZE, so that the rewrite and the per-kernel plans of
    the kernels it replaces are weighed at the same extents."""
    return {v.name: int(program.sizes.get(v.name, DEFAULT_SIZE)) for v in _size_vars(chain)}


def _registers(resources: Mapping[str, KernelResources] | None) -> dict[str, int]:
    """ptxas's registers of the key-block-major ("main") and query-major ("rows") kernels."""
    return {("main" if n.endswith("_backward_mma_kernel") else "rows"): r.registers
            for n, r in (resources or {}).items() if n.endswith(("_backward_mma_kernel", "_backward_rows_kernel"))}


def _strided_rows(program: Program) -> str | None:
    """Why not, when an input's rows are not contiguous: the kernels stage every operand and
    row statistic by cp.async row copies, which need a last stride of 1 known when compiling."""
    for t in program.args:
        op = t.op
        strides = getattr(op, "strides", None) if t.is_placeholder else None
        if strides and const_int(strides[-1]) != 1:
            return (f"online_backward_mma: the rows of input {t.name} are not contiguous (last stride {strides[-1]}); "
                    "its cp.async row copies need a last stride of 1")
    return None


class OnlineBackwardMma(GraphStrategy):
    """The registry's face of this module (see the module docstring)."""

    name = "online_backward_mma"
    description = ("the backward of an online contraction (attention's gradient) as three tensor-core kernels: the row "
                   "statistics, blocks of keys walking the query blocks with dK/dV in registers, dQ by float32 atomics "
                   "or a query-major kernel; no (rows x keys) buffer")
    compile_checked = True

    def guard(self, program: Program) -> str | None:
        chain = _chain(program)
        if isinstance(chain, str):
            return chain
        if program.target.sm < MMA_MIN_ARCH:
            return f"online_backward_mma: {program.target.arch} has no mma.m16n8k16 / cp.async (sm_80 or newer)"
        return _strided_rows(program)

    def space(self, program: Program) -> list[Point]:
        chain = _chain(program)
        assert not isinstance(chain, str)
        widest = max([c.depth for c in chain.contractions] + [o.columns for o in chain.outputs])
        points = list(backward_tilings(widest, wgmma=program.target.sm == WGMMA_ARCH))
        if not chain.of_kind("row"):
            points = [p for p in points if p.get("dq", "atomic") == "atomic"]
        return points

    def workload(self, program: Program, point: Point) -> Workload:
        chain = _chain(program)
        assert not isinstance(chain, str)
        return backward_workload(chain, point, program.target, sizes=_priced_sizes(program, chain))

    def order(self, program: Program, ranked: list[Any]) -> list[Any]:
        """The tilings in the order they are tried, priced at NOMINAL_LENGTH for every symbolic
        extent (the lengths they were compared at: a tiling's rank does not follow the program's
        sizes, which only weigh the rewrite against the per-kernel plans): those predicted within
        NEAR of the best first, by their tensor time (the tensor term plus the second kernel's),
        then the rest by predicted time; ties in the order of the space. Every point here is
        bound by the same L2 stream of row tiles (re-read by every key block, the same bytes for
        every tile shape), which the model prices but no measurement has calibrated for this
        kernel yet, while the tensor term is where the instruction forms (mma.sync, wgmma) and the
        dQ forms really differ."""
        if not ranked:
            return ranked
        chain = _chain(program)
        assert not isinstance(chain, str)
        target = program.target
        space = [dict(p) for p in self.space(program)]

        def nominal(c: Any) -> tuple[float, float, int]:
            w = backward_workload(chain, c.point, target)
            cost = predict(w, target)
            after = predict(w.then, target).terms.get("tensor", 0.0) if w.then is not None else 0.0
            position = space.index(c.point) if c.point in space else len(space)
            return cost.total, cost.terms.get("tensor", 0.0) + after, position
        keys = {id(c): nominal(c) for c in ranked}
        if target.sm == WGMMA_ARCH:
            # measured, not modelled: on the H200 the Hopper forms with the query-major dQ beat the
            # model's picks at every shape timed (MEASURED_ON_SM90), so they are tried first
            return sorted(ranked, key=lambda c: (_sm90_preference(c.point), keys[id(c)][1], keys[id(c)][2]))
        best = min(k[0] for k in keys.values())
        near = sorted((c for c in ranked if keys[id(c)][0] <= NEAR * best), key=lambda c: keys[id(c)][1:])
        rest = sorted((c for c in ranked if keys[id(c)][0] > NEAR * best), key=lambda c: (keys[id(c)][0], keys[id(c)][2]))
        return near + rest

    def apply(self, sch: Any, program: Program, point: Point) -> None:
        sch.online_backward_mma(**point)
        limit = program.target.smem_per_block_optin
        widest = max((dynamic_shared_bytes(k) for k in sch.mod.kernels), default=0)
        if widest > limit:
            raise ScheduleError(f"online_backward_mma: {widest // 1024} KiB of shared memory per block, "
                                f"{program.target.arch} allows {limit // 1024} KiB")

    def reason(self, program: Program, point: Point, resources: Mapping[str, KernelResources] | None = None) -> str:
        chain = _chain(program)
        assert not isinstance(chain, str)
        target = program.target
        registers = _registers(resources)
        sizes = _priced_sizes(program, chain)
        cost = predict(backward_workload(chain, point, target, registers or None, sizes), target)
        other = [predict(backward_workload(chain, p, target, sizes=sizes), target).total for p in self.space(program)
                 if p.get("dq", "atomic") != point.get("dq", "atomic") and p["key_tile"] == point["key_tile"]
                 and p["rows"] == point["rows"] and p.get("wgmma") == point.get("wgmma")]
        return _reason(chain, point, program.compile_arch, registers, cost, other, sizes)

    def describe(self, point: Point) -> str:
        return f"{self.name}({_label(point)})"


def _reason(chain: BackwardChain, point: dict[str, Any], arch: str, registers: dict[str, int], cost: Cost,
            other: list[float], sizes: Mapping[str, int]) -> str:
    outs = ", ".join(f"{o.tensor.name} ({o.kind} side)" for o in chain.outputs)
    skipped = visited_fraction(chain, point["key_tile"], point["rows"], sizes)
    atomic = point.get("dq", "atomic") == "atomic"
    dq = ("the row-side ones by float32 atomics, then their conversion" if atomic else
          f"the row-side ones by a query-major kernel of {point['dq_rows']} rows over key blocks of {point['dq_key_tile']}")
    vs = (f"; the other dQ form predicted {min(other) * 1e6:.0f} us" if other else "")
    regs = ", ".join(f"{k} {v}" for k, v in sorted(registers.items())) or "not compiled"
    form = "wgmma (a warpgroup per 64 keys)" if point.get("wgmma") else "mma.sync"
    return (f"the backward of an online contraction ({outs}) on tensor cores ({form}): a pre-pass for the row statistics "
            f"({', '.join(t.name for t in chain.statistics) or 'none'}), blocks of {point['key_tile']} keys walking "
            f"query blocks of {point['rows']} rows with the key-side outputs in registers, {dq}; no (rows x keys) "
            f"buffer; {skipped:.0%} of the query blocks visited ({arch}: registers {regs}"
            f"{', no spills' if registers else ''}; predicted {cost.total * 1e6:.0f} us, {cost.bound}-bound{vs})")


register(OnlineBackwardMma())


__all__ = ["NEAR", "OnlineBackwardMma", "backward_tilings", "backward_workload", "visited_fraction"]
